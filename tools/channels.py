"""Offline retrieval channels: local corpora (relation / discovery evidence) and the ICD dictionary
(definition evidence). Both record every attempt through the one `Ledger`."""

from __future__ import annotations

from tools.dictionary import Dictionary
from tools.index import CorpusIndex
from tools.ledger import Ledger, LedgerRow, SearchJob


class LocalChannel:
    """The same query against fixed local corpora: focused passages, no network."""

    def __init__(self, index: CorpusIndex, ledger: Ledger, k: int = 5, mode: str = "hybrid"):
        self.index, self.ledger, self.k, self.mode = index, ledger, k, mode

    def run(self, job: SearchJob) -> list[LedgerRow]:
        mode = self.mode if self.index.has_dense else "bm25"
        hits = self.index.search(job.query, k=self.k, mode=mode)
        # The dense retriever always answers with its nearest passages, however far: in a hybrid search, hits none
        # of which shares a term with the query are no evidence of what it asks (`zzzz qqqq` got k unrelated rows).
        if mode == "hybrid" and all(hit.bm25_rank is None for hit in hits):
            hits = []
        if not hits:
            # One attempt per engine searched, each under the engine its hits record (pmc, arxiv, a corpus name;
            # not the index name `literature`, which no hit records).
            name = self.index.manifest["name"]
            return [self.ledger.record(job, engine=engine, state="no_result",
                                       detail=f"no passage of corpus index {name} matches the query")
                    for engine in self.index.engines]
        # The whole document is scanned for instruction-like text, as a web page is, not only the excerpt.
        return [self.ledger.record(job, engine=hit.engine, state="readable", doc_id=hit.doc_id, title=hit.title,
                                   url=hit.url, excerpt=hit.passage, source_text=self.index.document_text(hit.doc_id),
                                   chunk_id=hit.chunk_id)
                for hit in hits]


class DictionaryChannel:
    """Code-meaning lookups: one `definition` record per code (no_result when the code is unknown)."""

    ENGINE = "dictionary"

    def __init__(self, dictionary: Dictionary, ledger: Ledger):
        self.dictionary, self.ledger = dictionary, ledger

    def define(self, job: SearchJob) -> LedgerRow:
        definition = self.dictionary.define(job.code)
        if definition is None:
            return self.ledger.record(job, engine=self.ENGINE, state="no_result", channel="definition",
                                      detail=f"code {job.code} not in the ICD dictionary")
        return self.ledger.record(job, engine=self.ENGINE, state="readable", channel="definition",
                                  doc_id=definition.doc_id, title=definition.title, excerpt=definition.text)
