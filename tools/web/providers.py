"""Search-engine-results providers: SearXNG, Brave, generic SERP-JSON, none.

All return ranked `SerpHit(title, url, snippet)`; the snippet is discovery only. Requests go out
one at a time with a minimum gap (`min_interval_seconds`), whatever the caller's concurrency.
Brave and generic SERP-JSON were exercised only against local emulation (see docs/tools.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass

import aiohttp

from dxr.errors import ConfigError, InputError
from tools.config import SerpMapping, WebConfig
from tools.web.reader import http_url

BRAVE_ENDPOINT = "https://api.search.brave.com/res/v1/web/search"
# Brave answers a query without web results with HTTP 200 and no `web` key: {"type": "search", "query": ...}.
BRAVE_MAPPING = SerpMapping(query_param="q", results_path="web.results", title_field="title", url_field="url",
                            snippet_field="description", key_header="X-Subscription-Token",
                            envelope={"type": "search"})
# SearXNG always sends `results`, an empty list when nothing matched: its absence is an error.
SEARXNG_MAPPING = SerpMapping(query_param="q", results_path="results", title_field="title", url_field="url",
                              snippet_field="content", extra_params={"format": "json"})


class ProviderUnavailable(Exception):
    """A transient provider failure (rate limit, server error): the job records no_result."""


@dataclass(frozen=True)
class SerpHit:
    rank: int
    title: str
    url: str
    snippet: str


class SearchProvider:
    """A provider maps one query to ranked hits; `name` is the ledger engine."""

    name = "none"

    async def search(self, session: aiohttp.ClientSession, query: str, limit: int) -> list[SerpHit]:
        return []


class SerpJsonProvider(SearchProvider):
    """GET `endpoint?<query_param>=<query>` and read hits at `results_path` with the field mapping."""

    def __init__(self, name: str, endpoint: str, mapping: SerpMapping, api_key: str | None = None,
                 min_interval_seconds: float = 1.0, timeout_seconds: float = 10.0):
        self.name, self.endpoint, self.mapping, self.api_key = name, endpoint, mapping, api_key
        self.min_interval = min_interval_seconds
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._lock = asyncio.Lock()
        self._last = 0.0

    async def search(self, session: aiohttp.ClientSession, query: str, limit: int) -> list[SerpHit]:
        params = {self.mapping.query_param: query, **self.mapping.extra_params}
        headers = {"Accept": "application/json"}
        if self.api_key and self.mapping.key_header:
            headers[self.mapping.key_header] = self.api_key
        if self.api_key and self.mapping.key_param:
            params[self.mapping.key_param] = self.api_key
        async with self._lock:  # serialized: one request in flight, spaced by min_interval
            wait = self._last + self.min_interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                async with session.get(self.endpoint, params=params, headers=headers, timeout=self.timeout) as response:
                    if response.status in (401, 403):
                        raise ConfigError(f"search provider {self.name} refused the request (HTTP "
                                          f"{response.status}) at {self.endpoint}: check the API key variable")
                    if response.status != 200:
                        raise ProviderUnavailable(f"HTTP {response.status}")
                    body = await response.read()
                    content_type = response.content_type
            finally:
                self._last = time.monotonic()
        try:
            payload = json.loads(body.decode("utf-8", errors="replace"))
        except json.JSONDecodeError:
            # Deterministic, not transient: e.g. SearXNG without `json` in search.formats, or a login page.
            raise ConfigError(f"search provider {self.name} answered {content_type or 'without a content type'} "
                              f"({len(body)} bytes), not JSON, at {self.endpoint}: check tools.web.endpoint "
                              "(SearXNG needs `json` in search.formats)") from None
        return self._hits(payload, limit)

    def _hits(self, payload, limit: int) -> list[SerpHit]:
        node = payload
        for part in self.mapping.results_path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None and self._is_envelope(payload):
            return []  # a well-formed answer that found nothing
        if not isinstance(node, list):
            keys = ", ".join(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
            raise InputError(f"search provider {self.name}: no result list at '{self.mapping.results_path}' in "
                             f"the response (top level: {keys or 'empty'}); for serp_json fix "
                             "tools.web.mapping.results_path, or set tools.web.mapping.envelope if the API leaves "
                             "the list out when nothing matched")
        hits = []
        for item in node:
            url = item.get(self.mapping.url_field) if isinstance(item, dict) else None
            if not http_url(url):
                continue  # nothing the reader could fetch (missing, not a string, javascript:, file:)
            hits.append(SerpHit(len(hits) + 1, str(item.get(self.mapping.title_field) or ""), str(url),
                                str(item.get(self.mapping.snippet_field) or "")))
            if len(hits) == limit:
                break
        return hits

    def _is_envelope(self, payload) -> bool:
        """Whether `payload` is the provider's own answer shape (so a missing result list means no hits)."""
        envelope = self.mapping.envelope
        return bool(envelope) and isinstance(payload, dict) and all(payload.get(k) == v for k, v in envelope.items())


def make_provider(config: WebConfig) -> SearchProvider:
    if config.provider == "none":
        return SearchProvider()
    key = os.environ.get(config.api_key_env, "") if config.api_key_env else None
    common = {"min_interval_seconds": config.min_interval_seconds, "timeout_seconds": config.timeout_seconds}
    if config.provider == "searxng":
        if not config.endpoint:
            raise ConfigError("tools.web.provider = 'searxng' needs tools.web.endpoint (e.g. http://localhost:8888)")
        return SerpJsonProvider("searxng", config.endpoint.rstrip("/") + "/search", SEARXNG_MAPPING, key, **common)
    if config.provider == "brave":
        if not key:
            raise ConfigError("tools.web.provider = 'brave' needs an API key: set tools.web.api_key_env to the name "
                              "of an environment variable that holds it")
        return SerpJsonProvider("brave", config.endpoint or BRAVE_ENDPOINT, BRAVE_MAPPING, key, **common)
    if not config.endpoint:
        raise ConfigError("tools.web.provider = 'serp_json' needs tools.web.endpoint and tools.web.mapping")
    return SerpJsonProvider("serp_json", config.endpoint, config.mapping, key, **common)
