"""The page reader: robots.txt, per-domain politeness, timeouts, size and content-type caps,
main-text extraction (trafilatura, then readability) and link extraction (BeautifulSoup + lxml),
behind a page cache that is persisted in the warehouse (`page_cache`)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import urllib.robotparser
from dataclasses import dataclass, field
from datetime import datetime, timezone
from urllib.parse import urldefrag, urljoin, urlsplit

import aiohttp
import polars as pl

from tools.config import WebConfig
from tools.corpus.documents import clean_text

# Page errors that a later run may not meet again: such pages are not cached.
TRANSIENT_ERRORS = ("timeout", "connection")
# HTTP statuses that say "not now" rather than "not here": request timeout, too early, rate limit, server
# errors. Caching them would make a page unreadable for every later run after one overloaded moment.
TRANSIENT_STATUSES = frozenset({408, 425, 429, *range(500, 600)})
# readability logs a whole traceback for markup it cannot parse, then raises; extract() handles the failure.
logging.getLogger("readability.readability").setLevel(logging.CRITICAL)
_SKIP_SUFFIXES = (".pdf", ".jpg", ".jpeg", ".png", ".gif", ".svg", ".zip", ".gz", ".mp4", ".mp3", ".css", ".js")


@dataclass
class Page:
    url: str
    final_url: str | None = None
    status: int = 0
    content_type: str | None = None
    title: str | None = None
    text: str | None = None
    links: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def transient(self) -> bool:
        """Whether a later run may well read this page differently (so it is not cached)."""
        return self.status in TRANSIENT_STATUSES or (self.error or "").startswith(TRANSIENT_ERRORS)


def extract(html: str, base_url: str) -> tuple[str, str, list[str]]:
    """(title, main text, absolute http(s) links in document order)."""
    import trafilatura
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "lxml")
    title = clean_text(soup.title.get_text()) if soup.title else ""
    text = trafilatura.extract(html, favor_recall=True, include_comments=False, include_tables=False) or ""
    if len(text) < 200:
        from readability import Document as Readable

        try:
            summary = Readable(html).summary(html_partial=True)
            alternative = clean_text(BeautifulSoup(summary, "lxml").get_text(" "))
        except Exception:  # readability raises bare exceptions on degenerate markup; keep what we have
            alternative = ""
        if len(alternative) > len(text):
            text = alternative
    links, seen = [], set()
    for anchor in soup.find_all("a", href=True):
        try:
            absolute, _ = urldefrag(urljoin(base_url, anchor["href"].strip()))
            scheme = urlsplit(absolute).scheme
        except ValueError:  # e.g. 'http://[bad': pages carry broken hrefs; skip them, keep the page
            continue
        if scheme in ("http", "https") and absolute not in seen:
            seen.add(absolute)
            links.append(absolute)
    return title, clean_text(text), links


def decode(body: bytes, charset: str | None, content_type: str | None) -> str:
    """A page body as text, in the header's charset, else its byte-order mark's, else (markup only) the one
    it declares itself (`<meta charset>`, XML declaration), else UTF-8; invalid bytes are replaced."""
    from bs4.dammit import EncodingDetector

    if charset is None:
        body, charset = EncodingDetector.strip_byte_order_mark(body)
    if charset is None and content_type != "text/plain":
        declared = EncodingDetector.find_declared_encoding(body, is_html=True)
        # A declaration readable as ASCII cannot be right about UTF-16/32 (browsers read UTF-8 then).
        if declared and not declared.startswith(("utf-16", "utf-32")):
            charset = declared
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know (e.g. 'x-user-defined'): most pages are UTF-8 anyway
        return body.decode("utf-8", errors="replace")


def http_url(url) -> bool:
    """Whether `url` is a parsable http(s) URL with a host (what the reader can fetch)."""
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        return parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        return False


def eligible_link(url: str, blocked_domains) -> bool:
    return http_url(url) and not urlsplit(url).path.lower().endswith(_SKIP_SUFFIXES) \
        and not is_blocked(url, blocked_domains)


def is_blocked(url: str, blocked_domains) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return any(host == d or host.endswith("." + d) for d in blocked_domains)


class PageCache:
    """URL -> Page, loaded from and flushed to the `page_cache` table (bucketed by URL hash)."""

    def __init__(self, warehouse=None):
        self.warehouse = warehouse
        self.pages: dict[str, Page] = {}
        self._dirty: set[str] = set()
        if warehouse is not None:
            for row in warehouse.read("page_cache").iter_rows(named=True):
                page = Page(row["url"], row["final_url"], row["status"], row["content_type"], row["title"],
                            row["text"], json.loads(row["links_json"] or "[]"), row["error"])
                if not page.transient:  # earlier versions cached rate limits and server errors
                    self.pages[page.url] = page

    @staticmethod
    def bucket(url: str) -> str:
        return hashlib.sha1(url.encode()).hexdigest()[:2]

    def get(self, url: str) -> Page | None:
        return self.pages.get(url)

    def put(self, page: Page) -> None:
        # Transient failures are not cached: a later run may succeed.
        if page.transient:
            return
        self.pages[page.url] = page
        self._dirty.add(page.url)

    def flush(self) -> None:
        if self.warehouse is None or not self._dirty:
            return
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        for bucket in sorted({self.bucket(u) for u in self._dirty}):
            rows = [{"url": p.url, "final_url": p.final_url, "status": p.status, "content_type": p.content_type,
                     "title": p.title, "text": p.text, "links_json": json.dumps(p.links), "error": p.error,
                     "fetched_at": now} for u, p in sorted(self.pages.items()) if self.bucket(u) == bucket]
            self.warehouse.write("page_cache", pl.DataFrame(rows, schema_overrides={
                "status": pl.Int32, "fetched_at": pl.Datetime("us"), "final_url": pl.String,
                "content_type": pl.String, "title": pl.String, "text": pl.String, "error": pl.String}),
                bucket=bucket)
        self._dirty.clear()


class PageReader:
    """Fetch and extract pages politely. Never raises for a bad page: the error is on the Page."""

    def __init__(self, session: aiohttp.ClientSession, config: WebConfig, cache: PageCache | None = None):
        self.session, self.config = session, config
        self.cache = cache or PageCache()
        self.timeout = aiohttp.ClientTimeout(total=config.timeout_seconds)
        self._robots: dict[str, urllib.robotparser.RobotFileParser | None] = {}
        self._robots_locks: dict[str, asyncio.Lock] = {}
        self._host_locks: dict[str, asyncio.Lock] = {}
        self._host_last: dict[str, float] = {}
        self._slots = asyncio.Semaphore(config.concurrency)
        self.requests = 0

    async def read(self, url: str) -> Page:
        cached = self.cache.get(url)
        if cached is not None:
            return cached
        async with self._slots:
            page = await self._read(url)
        self.cache.put(page)
        return page

    async def _read(self, url: str) -> Page:
        if not http_url(url):
            return Page(url, error="not an http(s) URL")
        if not await self.allowed(url):
            return Page(url, error="disallowed by robots.txt")
        try:
            async with self._polite(url):
                self.requests += 1
                async with self.session.get(url, timeout=self.timeout, headers={"User-Agent": self.config.user_agent},
                                            max_redirects=5) as response:
                    page = Page(url, str(response.url), response.status,
                                response.headers.get("Content-Type", "").split(";")[0].strip().lower() or None)
                    if response.status != 200:
                        page.error = f"HTTP {response.status}"
                        return page
                    if page.content_type not in self.config.content_types:
                        page.error = f"content type {page.content_type or '(none declared)'} not accepted"
                        return page
                    declared = response.content_length
                    if declared is not None and declared > self.config.max_bytes:
                        page.error = f"oversized ({declared} bytes > {self.config.max_bytes})"
                        return page
                    body = bytearray()
                    async for block in response.content.iter_chunked(65536):
                        body.extend(block)
                        if len(body) > self.config.max_bytes:
                            page.error = f"oversized (> {self.config.max_bytes} bytes)"
                            return page
                    charset = response.charset
        except (asyncio.TimeoutError, TimeoutError):
            return Page(url, error=f"timeout after {self.config.timeout_seconds:g} s")
        except aiohttp.TooManyRedirects:
            return Page(url, error="more than 5 redirects (a redirect loop?)")
        except aiohttp.NonHttpUrlRedirectClientError as exc:
            return Page(url, error=f"redirect to a non-http(s) URL ({exc})")
        except aiohttp.ClientError as exc:
            return Page(url, error=f"connection error ({type(exc).__name__})")
        html = decode(bytes(body), charset, page.content_type)
        if page.content_type == "text/plain":
            page.title, page.text, page.links = "", clean_text(html), []
        else:
            page.title, page.text, page.links = extract(html, page.final_url or url)
        return page

    async def allowed(self, url: str) -> bool:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        lock = self._robots_locks.setdefault(origin, asyncio.Lock())
        async with lock:
            if origin not in self._robots:
                self._robots[origin] = await self._fetch_robots(origin)
        parser = self._robots[origin]
        return True if parser is None else parser.can_fetch(self.config.user_agent, url)

    async def _fetch_robots(self, origin: str):
        try:
            async with self._polite(origin):
                self.requests += 1
                async with self.session.get(origin + "/robots.txt", timeout=self.timeout,
                                            headers={"User-Agent": self.config.user_agent}) as response:
                    if response.status != 200:
                        return None  # no robots.txt: everything allowed
                    lines = (await response.text(errors="replace")).splitlines()
        except (asyncio.TimeoutError, TimeoutError, aiohttp.ClientError):
            return None
        parser = urllib.robotparser.RobotFileParser()
        parser.parse(lines)
        return parser

    @contextlib.asynccontextmanager
    async def _polite(self, url: str):
        """One request at a time per host, spaced by `per_domain_interval_seconds`."""
        host = urlsplit(url).netloc
        async with self._host_locks.setdefault(host, asyncio.Lock()):
            wait = self._host_last.get(host, 0.0) + self.config.per_domain_interval_seconds - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                yield
            finally:
                self._host_last[host] = time.monotonic()
