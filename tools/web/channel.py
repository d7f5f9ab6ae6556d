"""The online channel: provider hits -> page reader -> ledger rows, with bounded link following.

For each search job: the provider's top hits are read (concurrently); each page becomes exactly
one ledger row: `readable` (the ledger decides supported or not), or `unreadable` with the reason
(blocked, robots, timeout, oversized, content type, HTTP error, near-empty, non-medical,
duplicate). A hit that names a PMC / arXiv / DOI / PubMed document held locally is canonicalized: the local
text is used and the web hit is kept as provenance. Links of readable pages are followed level by
level up to `max_depth`, at most `max_sublinks` eligible links per page; reading stops after a
level that produced a support cue when `stop_on_support` is set.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from urllib.parse import unquote

import aiohttp
import polars as pl

from dxr.errors import InputError
from tools.config import WebConfig
from tools.corpus import WEB_CORPUS, WEB_WRITE_WAIT_SECONDS, writing_corpus
from tools.corpus.documents import normalize_url
from tools.ledger import Ledger, LedgerRow, SearchJob
from tools.passages import focused_passage
from tools.text import words
from tools.web.providers import ProviderUnavailable, SearchProvider
from tools.web.reader import PageReader, eligible_link, is_blocked
from warehouse.schemas import utc_now

_PMC = re.compile(r"/(?:pmc/)?articles/(PMC\d+)", re.I)
# A query string or fragment ("?context=cs", "#S2") still names the paper.
_ARXIV = re.compile(r"arxiv\.org/(?:abs|pdf)/([\w./-]+?)(?:v\d+)?(?:\.pdf)?/?(?:[?#]|$)", re.I)
# Publishers serve one DOI under several views: /doi/10.…, /doi/abs/, /doi/full/, /doi/pdf/, /doi/epdf/, /doi/reader/.
_DOI = re.compile(r"(?:doi\.org/|/doi/(?:(?:abs|full|pdf|epdf|pdfdirect|reader)/)?)(10\.\d{4,9}/[^\s?#]+)", re.I)
# PubMed abstract pages: MEDLINE and PubMedQA documents are keyed by PMID.
_PUBMED = re.compile(r"(?:pubmed\.ncbi\.nlm\.nih\.gov|ncbi\.nlm\.nih\.gov/pubmed)/(\d+)/?(?:[?#]|$)", re.I)


def identifiers_in_url(url: str) -> dict[str, str]:
    """PMC / arXiv / DOI / PubMed identifiers a URL names, e.g. {'pmcid': 'PMC1790863'}.

    >>> identifiers_in_url("https://pmc.ncbi.nlm.nih.gov/articles/PMC1790863/")
    {'pmcid': 'PMC1790863'}
    """
    found = {}
    if m := _PMC.search(url):
        found["pmcid"] = m.group(1).upper()
    if m := _ARXIV.search(url):
        found["arxiv_id"] = m.group(1)
    if m := _DOI.search(unquote(url)):
        found["doi"] = m.group(1).rstrip("/")
    if m := _PUBMED.search(url):
        found["pmid"] = m.group(1)
    return found


class WebChannel:
    """Runs search jobs through a provider and the reader, writing every attempt to the ledger."""

    def __init__(self, provider: SearchProvider, reader: PageReader, ledger: Ledger, config: WebConfig,
                 local_index=None):
        self.provider, self.reader, self.ledger, self.config = provider, reader, ledger, config
        self.local_index = local_index
        # Content fingerprints of pages already read, per job: a later copy in the same job is a duplicate. Not
        # per trajectory: another job is about another candidate or hypothesis, which needs evidence rows of its own.
        self._fingerprints: dict[str, dict[str, str]] = {}
        self.documents: dict[str, dict] = {}

    @classmethod
    def from_config(cls, config: WebConfig, session: aiohttp.ClientSession, ledger: Ledger, local_index=None):
        """The configured provider and a reader whose page cache lives in the ledger's warehouse."""
        from tools.web.providers import make_provider
        from tools.web.reader import PageCache

        return cls(make_provider(config), PageReader(session, config, PageCache(ledger.warehouse)), ledger, config,
                   local_index)

    async def run(self, job: SearchJob) -> list[LedgerRow]:
        rows: list[LedgerRow] = []
        try:
            hits = await self.provider.search(self.reader.session, job.query, self.config.results_per_query)
        except ProviderUnavailable as exc:
            return [self.ledger.record(job, engine=self.provider.name, state="no_result",
                                       detail=f"provider unavailable ({exc})")]
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError) as exc:
            return [self.ledger.record(job, engine=self.provider.name, state="no_result",
                                       detail=f"provider error ({type(exc).__name__})")]
        if not hits:
            return [self.ledger.record(job, engine=self.provider.name, state="no_result")]
        visited: set[str] = set()
        level = []
        for hit in hits:
            if normalize_url(hit.url) not in visited:
                visited.add(normalize_url(hit.url))
                level.append((hit.url, f"{self.provider.name} hit {hit.rank}"))
        depth, reads = 0, 0
        while level and reads < self.config.max_pages_per_job:
            level = level[: self.config.max_pages_per_job - reads]
            outcomes = await asyncio.gather(*(self._visit(job, url) for url, _ in level))
            reads += len(level)
            next_level = []
            for (url, provenance), (row_args, links) in zip(level, outcomes):
                rows.append(self.ledger.record(job, provenance=provenance, **row_args))
                if depth >= self.config.max_depth:
                    continue
                followed = 0
                for link in links:
                    key = normalize_url(link)
                    if followed >= self.config.max_sublinks or key in visited:
                        continue
                    if eligible_link(link, self.config.blocked_domains):
                        visited.add(key)
                        next_level.append((link, f"link from {url} (depth {depth + 1})"))
                        followed += 1
            if self.config.stop_on_support and self.ledger.supported(job):
                break
            level, depth = next_level, depth + 1
        return rows

    async def _visit(self, job: SearchJob, url: str) -> tuple[dict, list[str]]:
        """Ledger fields for one URL plus the links to consider following (readable pages only)."""
        engine = self.provider.name
        local = self._canonical(url)
        if local is not None:
            document = self.local_index.document(local)
            text = self.local_index.document_text(local)
            return ({"engine": document["engine"], "state": "readable", "doc_id": local, "title": document["title"],
                     "url": document["url"] or url,
                     "excerpt": focused_passage(job.query, text, self.config.passage_chars),
                     "source_text": text, "detail": f"canonicalized from {url}"}, [])
        if is_blocked(url, self.config.blocked_domains):
            return {"engine": engine, "state": "unreadable", "url": url, "detail": "blocked domain"}, []
        page = await self.reader.read(url)
        base = {"engine": engine, "url": url, "title": page.title or None}
        if page.error:
            return {**base, "state": "unreadable", "detail": page.error}, []
        text = page.text or ""
        if len(text) < self.config.min_chars:
            return {**base, "state": "unreadable", "detail": f"near-empty ({len(text)} characters)"}, []
        medical = set(words(text)) & set(self.config.medical_terms)
        if len(medical) < self.config.min_medical_terms:
            return {**base, "state": "unreadable",
                    "detail": f"non-medical ({len(medical)} medical terms < {self.config.min_medical_terms})"}, []
        seen = self._fingerprints.setdefault(job.job_id, {})
        fingerprint = hashlib.sha1(" ".join(words(text)).encode()).hexdigest()
        if fingerprint in seen and seen[fingerprint] != url:
            return {**base, "state": "unreadable", "detail": f"duplicate of {seen[fingerprint]}"}, []
        seen.setdefault(fingerprint, url)
        doc_id = "web:" + hashlib.sha1(normalize_url(page.final_url or url).encode()).hexdigest()[:16]
        self.documents[doc_id] = {"doc_id": doc_id, "title": page.title or "", "url": page.final_url or url,
                                  "text": text}
        return ({**base, "state": "readable", "doc_id": doc_id, "source_text": text,
                 "excerpt": focused_passage(job.query, text, self.config.passage_chars)}, page.links)

    def _canonical(self, url: str) -> str | None:
        if self.local_index is None:
            return None
        ids = identifiers_in_url(url)
        return self.local_index.resolve(**ids) if ids else None

    def documents_frame(self, source: str) -> pl.DataFrame:
        """Pages read in this channel as `documents` rows (corpus `web`)."""
        now = utc_now()
        rows = [{"corpus": WEB_CORPUS, "source": source, "doc_id": d["doc_id"], "source_format": "web",
                 "title": d["title"], "url": d["url"], "doi": None, "pmcid": None, "pmid": None, "arxiv_id": None,
                 "sections_json": json.dumps([["Page", d["text"]]], ensure_ascii=False), "n_chars": len(d["text"]),
                 "ingested_at": now, "authors": None, "categories": None}
                for d in sorted(self.documents.values(), key=lambda d: d["doc_id"])]
        return pl.DataFrame(rows, schema={
            **dict.fromkeys(("corpus", "source", "doc_id", "source_format", "title", "url", "doi", "pmcid", "pmid",
                             "arxiv_id", "sections_json"), pl.String), "n_chars": pl.Int64,
            "ingested_at": pl.Datetime("us"), "authors": pl.String, "categories": pl.String})

    def flush(self) -> None:
        """Write the pages read (documents, corpus `web`) and the ledger partition citing them as one commit, then
        the page cache: a flush cut short never leaves ledger rows citing pages that were not stored, neither this
        attempt's nor, beside this attempt's pages, an earlier one's. The pages' partition is replaced even when
        empty, so a rerun of the shard keeps no pages of an earlier attempt.

        The commit holds the corpus's exclusive lock, as an ingest does: `dxr corpus build --corpus web` reads the
        corpus under the shared one. Only the commit: the page cache's bucket locks are never taken inside it.
        """
        if self.ledger.warehouse is None:
            raise InputError("this WebChannel's ledger has no warehouse to write to: pass warehouse=Warehouse(root)")
        source = f"{self.ledger.run_id}-{self.ledger.shard}"
        with writing_corpus(self.ledger.warehouse, WEB_CORPUS, wait=WEB_WRITE_WAIT_SECONDS):
            self.ledger.warehouse.write_together([
                ("documents", self.documents_frame(source), {"corpus": WEB_CORPUS, "source": source}),
                *self.ledger.partitions()])
        self.reader.cache.flush()

    async def close(self) -> None:
        """Close the reader's connections (the caller's session, which the provider uses, stays open)."""
        await self.reader.close()
