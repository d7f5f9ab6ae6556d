"""Corpus ingestion: format adapters -> documents + chunks in the warehouse.

`ingest(warehouse, fmt, path, corpus)` parses one file or a directory of files, deduplicates,
chunks, and replaces the partition `(corpus, source)` of `documents` and `chunks`, where `source`
is derived from the resolved path, so re-ingesting the same path replaces its own rows.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import polars as pl

from dxr.errors import InputError
from tools.corpus.documents import DEFAULT_CHUNK_CHARS, Document, chunk_document, dedupe
from tools.corpus.json_sources import read_arxiv, read_jsonl, read_medquad, read_pubmedqa
from tools.corpus.xml_sources import read_jats, read_medline
from warehouse.corpora import chunks_unlike_stored, corpus_documents, replace_corpus_source
from warehouse.schemas import utc_now


@dataclass(frozen=True)
class Format:
    reader: Callable[[Path, str], Iterator[Document]]
    # File name endings read when PATH is a directory.
    suffixes: tuple[str, ...]
    default_corpus: str
    # The files are a baseline and its updates (read in name order): a later record of a document replaces the
    # earlier one, and a record marked `meta["withdrawn"]` removes it.
    revised: bool = False


FORMATS: dict[str, Format] = {
    "jats": Format(read_jats, (".nxml", ".xml", ".nxml.gz"), "pmc"),
    "medline": Format(read_medline, (".xml", ".xml.gz"), "medline", revised=True),
    "arxiv": Format(read_arxiv, (".json", ".jsonl", ".json.gz", ".jsonl.gz"), "arxiv"),
    "medquad": Format(read_medquad, (".json", ".json.gz"), "medquad"),
    "pubmedqa": Format(read_pubmedqa, (".json", ".json.gz"), "pubmedqa"),
    "jsonl": Format(read_jsonl, (".jsonl", ".jsonl.gz"), "jsonl"),
}


# Pages read by the web channel (tools.web.channel) are stored as this corpus; no ingest may write into it.
WEB_CORPUS = "web"
# How long a web search's commit of its pages waits for a build reading the corpus (or another search's commit),
# and a build for a search's commit, before refusing: both hold the lock only for their read or write.
WEB_WRITE_WAIT_SECONDS = 60.0


@dataclass
class IngestSummary:
    corpus: str
    source: str
    files: int
    documents: int
    duplicates: int
    chunks: int
    # Kept (they carry identifiers and titles) but not searchable: e.g. MEDLINE citations without abstract.
    without_text: int = 0
    # Citations left out as withdrawn (MEDLINE: deleted, or revised into a retraction).
    withdrawn: int = 0
    # MEDLINE <DeleteCitation>s naming a PMID that no earlier record of the files holds: nothing was removed (the
    # deleted citation is in another ingested path, a baseline ingested apart from this update, or nowhere here).
    unmatched_deletions: int = 0


def source_key(path: Path) -> str:
    """A partition-safe key for an ingested path: readable stem + hash of the resolved path."""
    resolved = str(path.resolve())
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.name)[:40] or "root"
    return f"{stem}-{hashlib.sha1(resolved.encode()).hexdigest()[:8]}"


def check_input_path(fmt: str, path: Path) -> Path:
    if not path.exists():
        raise InputError(f"{path} does not exist: give a {fmt} file or a directory of them")
    return path


def input_files(fmt: str, path: Path) -> list[Path]:
    if fmt not in FORMATS:
        raise InputError(f"unknown corpus format {fmt!r}; choose one of {', '.join(FORMATS)} (or icd)")
    check_input_path(fmt, path)
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(FORMATS[fmt].suffixes))
    if not files:
        raise InputError(f"{path}: no files ending in {', '.join(FORMATS[fmt].suffixes)} for format {fmt}")
    # An empty file is an interrupted download or copy; reading it would fail with a parser's
    # less helpful message, or (JSON lines) silently contribute nothing.
    empty = [f for f in files if f.stat().st_size == 0]
    if empty:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise InputError(f"{empty[0]}: empty file (0 bytes){more}; complete the download or remove it")
    return files


def read_documents(fmt: str, path: Path, corpus: str | None = None, progress=None,
                   fulltext_dir: Path | None = None) -> tuple[list[Document], int, int]:
    """The documents of the files at `path`, the number left out as withdrawn and the number of deletions that
    named no citation read before them (see `revise`).

    `fulltext_dir` (format arxiv only) holds `<id>.txt` full texts for records without a `full_text` field."""
    if fulltext_dir is not None and fmt != "arxiv":
        raise InputError(f"full texts from a directory apply to format arxiv only, not {fmt}")
    files = input_files(fmt, path)
    corpus = corpus or FORMATS[fmt].default_corpus
    reader = FORMATS[fmt].reader if fulltext_dir is None else partial(read_arxiv, fulltext_dir=fulltext_dir)
    documents: list[Document] = []
    for file in files:
        documents.extend(reader(file, corpus))
        if progress:
            progress(file)
    return revise(documents) if FORMATS[fmt].revised else (documents, 0, 0)


def revise(records: list[Document]) -> tuple[list[Document], int, int]:
    """Apply records in order: each replaces the earlier document of its id, a withdrawn one removes it.

    Returns the documents left (in order of their latest record), the number of citations left out as withdrawn (a
    deletion that removed a document, a retraction, itself a citation) and the number of deletions that removed
    nothing: counted as withdrawn, those would claim that citations of the files were left out.
    """
    latest: dict[str, Document] = {}
    withdrawn = unmatched_deletions = 0
    for record in records:
        removed = latest.pop(record.doc_id, None)
        if record.meta.get("withdrawn") == "deleted" and removed is None:
            unmatched_deletions += 1
        elif "withdrawn" in record.meta:
            withdrawn += 1
        else:
            latest[record.doc_id] = record
    return list(latest.values()), withdrawn, unmatched_deletions


def documents_frame(documents: list[Document], corpus: str, source: str) -> pl.DataFrame:
    now = utc_now()
    return pl.DataFrame([{
        "corpus": corpus, "source": source, "doc_id": d.doc_id, "source_format": d.source_format, "title": d.title,
        "url": d.url, "doi": d.doi, "pmcid": d.pmcid, "pmid": d.pmid, "arxiv_id": d.arxiv_id,
        "sections_json": json.dumps(d.sections, ensure_ascii=False), "n_chars": len(d.text), "ingested_at": now,
        "authors": d.meta.get("authors"), "categories": d.meta.get("categories"),
    } for d in documents], schema_overrides={"ingested_at": pl.Datetime("us"), "authors": pl.String,
                                             "categories": pl.String})


def chunks_frame(documents: list[Document], corpus: str, source: str, max_chars: int) -> pl.DataFrame:
    rows = [{"corpus": corpus, "source": source, "chunk_id": c.chunk_id, "doc_id": c.doc_id, "ordinal": c.ordinal,
             "section": c.section, "text": c.text}
            for d in documents for c in chunk_document(d, max_chars)]
    return pl.DataFrame(rows, schema={"corpus": pl.String, "source": pl.String, "chunk_id": pl.String,
                                      "doc_id": pl.String, "ordinal": pl.Int32, "section": pl.String,
                                      "text": pl.String})


def writing_corpus(warehouse, corpus: str, wait: float = 0.0):
    """The exclusive lock of a corpus, held by an ingest from before it reads until it has written, and by the web
    channel while it commits the pages it read (corpus `web`).

    Two ingests of one path make concurrent commits of the same partitions, and their renames can interleave:
    one's documents beside the other's chunks.
    """
    from warehouse.locks import held

    busy = (f"corpus {WEB_CORPUS!r} is being written by a web search or read for an index by another dxr process "
            "(dxr corpus build)" if corpus == WEB_CORPUS else
            f"corpus {corpus!r} is being ingested or read for an index by another dxr process (dxr corpus ingest "
            "or build)")
    return held(warehouse, f"corpus:{corpus}", shared=False, busy=busy, wait=wait)


@contextmanager
def reading_corpora(warehouse, corpora: Iterable[str]) -> Iterator[None]:
    """The shared locks of corpora, held by an index build while it reads their documents and chunks.

    An ingest committing meanwhile could leave the build the documents from before its commit and the chunks
    from after it. Builds share the locks, so they run alongside each other.
    """
    from warehouse.locks import held

    with ExitStack() as stack:
        for corpus in sorted(set(corpora)):
            if corpus == WEB_CORPUS:  # a web search holds it for one commit: wait that out rather than fail
                lock = held(warehouse, f"corpus:{corpus}", shared=True, wait=WEB_WRITE_WAIT_SECONDS,
                            busy=f"corpus {corpus!r} is being written by a web search of another dxr process")
            else:
                lock = held(warehouse, f"corpus:{corpus}", shared=True,
                            busy=f"corpus {corpus!r} is being ingested by another dxr process (dxr corpus ingest)")
            stack.enter_context(lock)
        yield


def store_documents(warehouse, documents: list[Document], corpus: str, source: str,
                    max_chars: int = DEFAULT_CHUNK_CHARS, files: int = 1, withdrawn: int = 0,
                    unmatched_deletions: int = 0) -> IngestSummary:
    """Dedupe and write one (corpus, source) partition of `documents` and `chunks`; the caller holds
    `writing_corpus`."""
    kept, dropped = dedupe(documents)
    if not kept:
        raise InputError(f"corpus {corpus}: source {source} produced no documents; check the FORMAT and PATH")
    chunks = chunks_frame(kept, corpus, source, max_chars)
    replace_corpus_source(warehouse, corpus, source, documents_frame(kept, corpus, source), chunks)
    without_text = sum(1 for d in kept if not d.text)
    return IngestSummary(corpus, source, files, len(kept), len(dropped), chunks.height, without_text, withdrawn,
                         unmatched_deletions)


def ingest(warehouse, fmt: str, path: Path, corpus: str | None = None, max_chars: int = DEFAULT_CHUNK_CHARS,
           progress=None, fulltext_dir: Path | None = None) -> IngestSummary:
    files = input_files(fmt, Path(path))
    corpus = corpus or FORMATS[fmt].default_corpus
    with writing_corpus(warehouse, corpus):
        documents, withdrawn, unmatched_deletions = read_documents(fmt, Path(path), corpus, progress, fulltext_dir)
        return store_documents(warehouse, documents, corpus, source_key(Path(path)), max_chars, len(files),
                               withdrawn, unmatched_deletions)


def load_documents(warehouse, corpora: list[str] | None = None) -> list[Document]:
    """Documents of the named corpora (all when None) back from the warehouse, in stable order (`corpus_documents`)."""
    return [Document(doc_id=r["doc_id"], corpus=r["corpus"], source_format=r["source_format"], title=r["title"],
                     sections=[tuple(s) for s in json.loads(r["sections_json"])], url=r["url"], doi=r["doi"],
                     pmcid=r["pmcid"], pmid=r["pmid"], arxiv_id=r["arxiv_id"])
            for r in corpus_documents(warehouse, corpora).iter_rows(named=True)]


def check_stored_chunks(warehouse, chunks: pl.DataFrame, max_chars: int) -> None:
    """Refuse to index chunks that are not the `chunks` rows of their corpus, id and text alike: ledger rows
    name the chunk of their evidence by id, to be found in that table. They differ when `max_chars`
    (tools.chunk_chars) is not the size the corpus was chunked with when it was ingested."""
    differing = chunks_unlike_stored(warehouse, chunks)
    if differing:
        found = ", ".join(f"{corpus} ({count} chunk{'s' if count > 1 else ''})" for corpus, count in differing)
        raise InputError(f"corpus {found}: not the chunks ingested, which another tools.chunk_chars than {max_chars} "
                         "made; re-ingest it (dxr corpus ingest) or set tools.chunk_chars back, so the chunk_id of "
                         "ledger rows names rows of the chunks table")
