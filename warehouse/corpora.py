"""The stored corpora: `documents` and `chunks`, one (corpus, source) partition of each per ingested path (tools.corpus)
or per web search's pages (tools.web.channel, `documents` only)."""

from __future__ import annotations

import polars as pl

from dxr.errors import InputError
from warehouse.store import Warehouse


def stored_corpora(wh: Warehouse) -> list[str]:
    """The names of the corpora in `documents` (the web channel's pages, `web`, included), sorted.

    Read from the partition key alone: the documents' text (gigabytes for a full-text corpus) is not loaded.
    """
    if not wh.has_rows("documents"):
        return []
    con = wh.connect(tables=["documents"])
    try:
        return [name for (name,) in con.execute("SELECT DISTINCT corpus FROM documents ORDER BY 1").fetchall()]
    finally:
        con.close()


def corpus_documents(wh: Warehouse, corpora: list[str] | None = None) -> pl.DataFrame:
    """The `documents` rows of the named corpora (all when None) sorted by corpus, source and doc_id; only the named
    corpora's partitions are read."""
    if corpora:
        stored = stored_corpora(wh)
        unknown = sorted(set(corpora) - set(stored))
        if unknown:
            raise InputError(f"corpus {', '.join(unknown)} not ingested; ingested corpora: "
                             f"{', '.join(stored) or '(none)'}")
        frame = pl.concat([wh.read("documents", corpus=corpus) for corpus in sorted(set(corpora))])
    else:
        frame = wh.read("documents")
    return frame.sort(["corpus", "source", "doc_id"])


def replace_corpus_source(wh: Warehouse, corpus: str, source: str, documents: pl.DataFrame,
                          chunks: pl.DataFrame) -> None:
    """Replace the (corpus, source) partitions of `documents` and `chunks` in one commit: written apart, a kill
    between them could leave the chunks out of step with their documents."""
    keys = {"corpus": corpus, "source": source}
    wh.write_together([("documents", documents, keys), ("chunks", chunks, keys)])


def chunks_unlike_stored(wh: Warehouse, chunks: pl.DataFrame) -> list[tuple[str, int]]:
    """(corpus, count) of the `chunks` (corpus, chunk_id, text) that no stored `chunks` row matches in all three,
    by corpus; corpora without stored chunks (the web channel's pages are stored whole) are left out."""
    con = wh.connect(tables=["chunks"])
    try:
        con.register("built", chunks.select("corpus", "chunk_id", "text").to_arrow())
        return con.execute("""
            SELECT b.corpus, count(*) FROM built b
            ANTI JOIN chunks c ON c.corpus = b.corpus AND c.chunk_id = b.chunk_id AND c.text = b.text
            WHERE b.corpus IN (SELECT corpus FROM chunks)
            GROUP BY b.corpus ORDER BY b.corpus""").fetchall()
    finally:
        con.close()
