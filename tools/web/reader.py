"""The page reader: robots.txt, per-domain politeness, timeouts, size and content-type caps,
main-text extraction (trafilatura, then readability) and link extraction (BeautifulSoup + lxml),
behind a page cache that is persisted in the warehouse (`page_cache`).

URLs come from search hits, links and redirects, i.e. from untrusted pages: before every request
(each redirect hop included) the reader refuses blocked domains, hosts that resolve to a
non-public address (unless in `allow_private_hosts`) and paths that robots.txt disallows. The
address check is made again on the addresses the connection uses (the reader's own resolver), so a
name cannot show a public address to the check and a private one to the connection (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import socket
import time
import urllib.robotparser
from dataclasses import dataclass, field
from urllib.parse import urldefrag, urljoin, urlsplit

import aiohttp
import polars as pl
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from tools.config import WebConfig
from tools.corpus.documents import clean_text
from warehouse.locks import held
from warehouse.schemas import utc_now

# Page errors that a later run may not meet again: such pages are not cached.
TRANSIENT_ERRORS = ("timeout", "connection")
# HTTP statuses that say "not now" rather than "not here": request timeout, too early, rate limit, server
# errors. Caching them would make a page unreadable for every later run after one overloaded moment.
TRANSIENT_STATUSES = frozenset({408, 425, 429, *range(500, 600)})
# The reader follows redirects itself, so that every hop passes the checks the first URL passes.
MAX_REDIRECTS = 5
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
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
    # False for a refusal that depends on this run's configuration (blocked domains, allow_private_hosts):
    # a run configured otherwise decides afresh, so it is not cached.
    cacheable: bool = True

    @property
    def transient(self) -> bool:
        """Whether a later run may well read this page differently (so it is not cached)."""
        return self.status in TRANSIENT_STATUSES or (self.error or "").startswith(TRANSIENT_ERRORS)


class Refused(Exception):
    """A URL (or redirect hop) the reader will not request; `detail` is the page error; `redirected` when the
    refused URL is a redirect target rather than the URL asked for."""

    def __init__(self, detail: str, cacheable: bool = True, redirected: bool = False):
        super().__init__(detail)
        self.detail, self.cacheable, self.redirected = detail, cacheable, redirected


class NonPublicAddress(OSError):
    """Raised by the reader's resolver, while connecting, for a host it must refuse; the message is the refusal."""


class CheckedResolver(AbstractResolver):
    """The resolver of the reader's connections: an answer holding a non-public address, for a host not in
    `allow_private_hosts`, is refused here, so the addresses checked are the ones connected to."""

    def __init__(self, reader: PageReader):
        self.reader, self.base = reader, ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        answers = await self.base.resolve(host, port, family)
        if refusal := self.reader.checked_addresses(host, [answer["host"] for answer in answers]):
            raise NonPublicAddress(refusal)
        return answers

    async def close(self) -> None:
        await self.base.close()


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


def non_public(address: str) -> bool:
    """Whether an IP address is loopback, private, link-local, multicast, reserved or unspecified."""
    ip = ipaddress.ip_address(address.split("%")[0])  # an IPv6 link-local address may carry a %zone
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped  # ::ffff:10.0.0.5 reaches 10.0.0.5
    # `not is_global` adds what the others miss, e.g. 100.64.0.0/10 (carrier-grade NAT, internal in clouds).
    return (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_reserved
            or ip.is_unspecified or not ip.is_global)


def is_blocked(url: str, blocked_domains) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return any(host == d or host.endswith("." + d) for d in blocked_domains)


class PageCache:
    """URL (without fragment, `PageReader.read`) -> Page, loaded from and flushed to the `page_cache` table
    (bucketed by URL hash)."""

    def __init__(self, warehouse=None):
        self.warehouse = warehouse
        self.pages: dict[str, Page] = {}
        self._dirty: set[str] = set()
        if warehouse is not None:
            for row in warehouse.read("page_cache").iter_rows(named=True):
                # Earlier versions fetched and stored `…/page#a` as such: the same page (a fragment is never sent),
                # found under the URL the reader now looks up. A row stored without the fragment is preferred.
                url = row["url"].partition("#")[0]
                page = Page(url, row["final_url"], row["status"], row["content_type"], row["title"],
                            row["text"], json.loads(row["links_json"] or "[]"), row["error"])
                if page.transient:  # earlier versions cached rate limits and server errors
                    continue
                if url not in self.pages or "#" not in row["url"]:
                    self.pages[url] = page

    @staticmethod
    def bucket(url: str) -> str:
        return hashlib.sha1(url.encode()).hexdigest()[:2]

    def get(self, url: str) -> Page | None:
        return self.pages.get(url)

    def put(self, page: Page) -> None:
        # Transient failures are not cached: a later run may succeed.
        if page.transient or not page.cacheable:
            return
        self.pages[page.url] = page
        self._dirty.add(page.url)

    def flush(self) -> None:
        if self.warehouse is None or not self._dirty:
            return
        now = utc_now()
        for bucket in sorted({self.bucket(u) for u in self._dirty}):
            # Other processes (parallel shards) may have written this bucket since this cache was loaded:
            # re-read it under its lock and add the pages read here, so that neither loses the other's.
            with held(self.warehouse, f"page_cache:{bucket}", shared=False, wait=60.0,
                      busy=f"page cache bucket {bucket} is being written by another dxr process"):
                stored = self.warehouse.read("page_cache", bucket=bucket)
                rows = {row["url"]: row for row in stored.iter_rows(named=True)
                        if row["status"] not in TRANSIENT_STATUSES}
                for url in self._dirty:
                    if self.bucket(url) == bucket:
                        page = self.pages[url]
                        rows[url] = {"url": url, "final_url": page.final_url, "status": page.status,
                                     "content_type": page.content_type, "title": page.title, "text": page.text,
                                     "links_json": json.dumps(page.links), "error": page.error, "fetched_at": now}
                frame = pl.DataFrame([rows[url] for url in sorted(rows)], schema_overrides={
                    "status": pl.Int32, "fetched_at": pl.Datetime("us"), "final_url": pl.String,
                    "content_type": pl.String, "title": pl.String, "text": pl.String, "error": pl.String})
                self.warehouse.write("page_cache", frame, bucket=bucket)
        self._dirty.clear()


class PageReader:
    """Fetch and extract pages politely. Never raises for a bad page: the error is on the Page.

    `session` is the caller's (the web channel's provider uses it); pages are requested through the reader's
    own session, whose resolver is a CheckedResolver: close the reader (`close()` or `async with`) when done."""

    def __init__(self, session: aiohttp.ClientSession, config: WebConfig, cache: PageCache | None = None):
        self.session, self.config = session, config
        self._http: aiohttp.ClientSession | None = None  # created in the running loop, on the first request
        self.cache = cache or PageCache()
        # Per origin: its rules, None (no robots.txt: everything allowed) or why it is unreachable.
        self._robots: dict[str, urllib.robotparser.RobotFileParser | str | None] = {}
        self._robots_locks: dict[str, asyncio.Lock] = {}
        self._host_locks: dict[str, asyncio.Lock] = {}
        self._host_last: dict[str, float] = {}
        self._slots = asyncio.Semaphore(config.concurrency)
        # urlsplit gives IPv6 hosts without brackets and host names in lower case: compare them so.
        self._private_hosts_allowed = {host.strip("[]").lower() for host in config.allow_private_hosts}
        self._host_refusals: dict[str, str | None] = {}  # what checked_addresses found for each host resolved
        self.requests = 0

    async def __aenter__(self) -> PageReader:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _pages_session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=CheckedResolver(self)))
        return self._http

    async def read(self, url: str) -> Page:
        """The page at `url`, without its fragment: a fragment names a place in a page and is never sent, so a
        page that search hits and links reach with several is fetched and cached once."""
        if isinstance(url, str):
            url = url.partition("#")[0]  # the fragment starts at the first "#" (urldefrag raises on a bad host)
        cached = self.cache.get(url)
        if cached is not None:
            # Checked on every read: the shared cache may hold a page that a run allowing its host has read.
            for where in dict.fromkeys((url, cached.final_url or url)):
                if refusal := await self.address_refusal(where):
                    return Page(url, error=refusal if where == url else f"redirect to {where}: {refusal}",
                                cacheable=False)
            return cached
        async with self._slots:
            page = await self._read(url)
        self.cache.put(page)
        return page

    async def _read(self, url: str) -> Page:
        if not http_url(url):
            return Page(url, error="not an http(s) URL")
        try:
            async with self._get(url) as response:
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
        except Refused as exc:
            return Page(url, error=exc.detail, cacheable=exc.cacheable)
        except (asyncio.TimeoutError, TimeoutError):
            return Page(url, error=f"timeout after {self.config.timeout_seconds:g} s")
        except aiohttp.ClientError as exc:
            return Page(url, error=f"connection error ({type(exc).__name__})")
        html = decode(bytes(body), charset, page.content_type)
        if page.content_type == "text/plain":
            page.title, page.text, page.links = "", clean_text(html), []
        else:
            page.title, page.text, page.links = extract(html, page.final_url or url)
        return page

    @contextlib.asynccontextmanager
    async def _get(self, url: str, robots: bool = True):
        """The response to GET `url` after at most MAX_REDIRECTS redirects, each hop checked (`_refusal`) and
        spaced (`_polite`) like the first; raises Refused for a hop it will not request.

        `timeout_seconds` bounds the whole chain's requests, from the first request to the last byte: six hops
        each just under it would otherwise hold a read slot six times as long. Only the time a hop holds its host's
        turn counts: a hop waiting behind another page of the same host (a slow one, say) has sent nothing yet, and
        that wait is bounded by the other page's own timeout."""
        hop, budget = url, self.config.timeout_seconds
        for redirects in range(MAX_REDIRECTS + 1):
            if refused := await self._refusal(hop, robots):
                raise refused if redirects == 0 else Refused(f"redirect to {hop}: {refused.detail}", refused.cacheable,
                                                             redirected=True)
            async with self._polite(hop):
                if budget <= 0:
                    raise asyncio.TimeoutError
                self.requests += 1
                requested = time.monotonic()
                timeout = aiohttp.ClientTimeout(total=budget)
                try:
                    async with self._pages_session().get(hop, timeout=timeout, allow_redirects=False,
                                                         headers={"User-Agent": self.config.user_agent}) as response:
                        redirect = response.status in _REDIRECT_STATUSES
                        location = response.headers.get("Location") if redirect else None
                        if not location:
                            yield response
                            return
                except aiohttp.ClientConnectorError as exc:
                    if not isinstance(exc.os_error, NonPublicAddress):
                        raise
                    detail = str(exc.os_error)
                    raise Refused(detail if redirects == 0 else f"redirect to {hop}: {detail}", cacheable=False,
                                  redirected=redirects > 0) from None
                budget -= time.monotonic() - requested
            try:
                hop = urljoin(hop, location)
            except ValueError:  # e.g. 'http://[bad'
                hop = location
            if not http_url(hop):
                raise Refused(f"redirect to a non-http(s) URL ({hop})")
        raise Refused(f"more than {MAX_REDIRECTS} redirects (a redirect loop?)")

    async def _refusal(self, url: str, robots: bool) -> Refused | None:
        """Why `url` must not be requested, or None; robots.txt is consulted when `robots`."""
        if is_blocked(url, self.config.blocked_domains):
            return Refused("blocked domain", cacheable=False)
        if refusal := await self.address_refusal(url):
            return Refused(refusal, cacheable=False)
        if robots:
            return await self.robots_refusal(url)
        return None

    async def address_refusal(self, url: str) -> str | None:
        """Why the host of `url` is refused: it resolves to a non-public address and is not allowed by
        `allow_private_hosts`; None when it is public, allowed, or does not resolve (then the request fails)."""
        if not http_url(url):
            return None
        host = urlsplit(url).hostname.lower()
        if host in self._private_hosts_allowed:
            return None
        if host not in self._host_refusals:
            try:
                # The loop's getaddrinfo runs in a thread: resolution never blocks the other reads.
                infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None,
                                                                                      type=socket.SOCK_STREAM),
                                               self.config.timeout_seconds)
            except (OSError, UnicodeError, asyncio.TimeoutError, TimeoutError):
                return None  # not remembered: a later lookup may succeed, and must then be checked
            return self.checked_addresses(host, [info[4][0] for info in infos])
        return self._host_refusals[host]

    def checked_addresses(self, host: str, addresses: list[str]) -> str | None:
        """Why `host` is refused given the addresses it resolved to, or None; remembered for later reads. Called
        before a request (address_refusal) and again by the resolver of the connection, which may get another
        answer (DNS rebinding): a refusal found then holds for the rest of this reader's life."""
        host = host.lower()
        if host in self._private_hosts_allowed:
            return None
        found = sorted({address for address in addresses if non_public(address)})
        if not self._host_refusals.get(host):  # a host once refused stays refused, whatever it answers next
            self._host_refusals[host] = None if not found else (
                f"non-public address refused: {host}{f' is {found[0]}' if found[0] != host else ''} "
                "(allow the host in tools.web.allow_private_hosts)")
        return self._host_refusals[host]

    async def robots_refusal(self, url: str) -> Refused | None:
        """Why robots.txt forbids `url`, or None. An origin whose robots.txt is unreachable is refused whole for
        this reader's lifetime (RFC 9309 2.3.1.4); that refusal is not cached, a later run asks again."""
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        lock = self._robots_locks.setdefault(origin, asyncio.Lock())
        async with lock:
            if origin not in self._robots:
                self._robots[origin] = await self._fetch_robots(origin)
        rules = self._robots[origin]
        if isinstance(rules, str):
            return Refused(f"robots.txt unreachable ({rules}): every path disallowed (RFC 9309)", cacheable=False)
        if rules is not None and not rules.can_fetch(self.config.user_agent, url):
            return Refused("disallowed by robots.txt")
        return None

    async def _fetch_robots(self, origin: str) -> urllib.robotparser.RobotFileParser | str | None:
        """The rules of `origin`'s robots.txt; None when there is none (a 4xx answer: everything allowed); why it
        is unreachable otherwise (RFC 9309: server error, timeout, connection error, or a redirect not followed).
        408, 425 and 429 say "not now" like a server error, so they disallow too rather than allow everything."""
        try:
            async with self._get(origin + "/robots.txt", robots=False) as response:
                if 400 <= response.status < 500 and response.status not in TRANSIENT_STATUSES:
                    return None
                if not 200 <= response.status < 300:
                    return f"HTTP {response.status}"
                # Like a page, a robots.txt is read up to max_bytes (RFC 9309 lets a crawler parse only its head):
                # an endless or huge one would otherwise fill memory until the timeout, then allow everything.
                body = bytearray()
                async for block in response.content.iter_chunked(65536):
                    body.extend(block)
                    if len(body) > self.config.max_bytes:
                        break
                head = bytes(body[:self.config.max_bytes])
                if len(body) > self.config.max_bytes:
                    head = head[:head.rfind(b"\n") + 1]  # a cut last line could be a wrong rule: drop it
                lines = decode(head, response.charset, "text/plain").splitlines()
        except Refused as exc:
            if not exc.cacheable and not exc.redirected:
                # Refused when connecting (its address changed since the check): every page of the host is refused.
                raise
            return exc.detail  # e.g. redirected to a blocked domain, or a redirect loop: none we may read
        except (asyncio.TimeoutError, TimeoutError):
            return f"timeout after {self.config.timeout_seconds:g} s"
        except aiohttp.ClientError as exc:
            return f"connection error ({type(exc).__name__})"
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
