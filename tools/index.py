"""The local literature index: tantivy BM25 + faiss dense vectors over chunks, fused by score.

An index is a directory:
  manifest.json       what was built (corpora, counts, embedder, build seconds)
  chunks.parquet      one row per chunk; the row number is the id in both indexes
  tantivy/            BM25 over title + body (stemmed English)
  dense.faiss         inner-product index over L2-normalized embeddings (absent for lexical-only, as are the
                      two files below)
  embeddings.npy      the vectors, one row per chunk
  embedding_keys.parquet  each vector's key (a hash of the embedder's name and the text it embedded), by which the
                      next build reuses the vectors of unchanged chunk texts

A build writes `.<name>.building/` beside it and swaps it in by rename (the old index stays whole
until then; embeddings are checkpointed there, so a killed build resumes).

Search works on chunks and answers with documents: each retriever's chunk ranking is collapsed
to a document ranking (best chunk per document, scored by that chunk), the two document lists are
fused (default: a convex combination of per-query z-scored BM25 and cosine scores; reciprocal rank
fusion and min-max normalization are the alternatives), and each hit carries a query-focused
passage from its best chunk and that chunk's neighbours in the same section (parent expansion).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from dxr.errors import InputError, NotFoundError
from tools.corpus.documents import (DEFAULT_CHUNK_CHARS, Document, chunk_document, normalize_arxiv_id,
                                    normalize_doi, normalize_pmcid, text_hash)
from tools.passages import DEFAULT_PASSAGE_CHARS, focused_passage
from warehouse.scratch import exchange

RRF_K = 60
# The identifiers a web hit can name, each in the one form both sides of `CorpusIndex.resolve` compare.
ID_NORMALIZERS = {"pmcid": normalize_pmcid, "arxiv_id": normalize_arxiv_id, "doi": normalize_doi,
                  "pmid": str.strip}
# Each retriever contributes this many chunks before collapsing to documents and fusing.
DEFAULT_DEPTH = 100
MODES = ("bm25", "dense", "hybrid")
FUSIONS = ("zscore", "minmax", "rrf")
# Chosen on the dev halves of the PubMedQA and MedQuAD questions jointly (one setting for both;
# the reported test halves never took part): benchmarks/retrieval.py, docs/tools.md.
DEFAULT_FUSION = "zscore"
DEFAULT_DENSE_SHARE = 0.7

# The id of an ICD dictionary document (tools.dictionary): `icd10:E11.9`, `icd9:250.00`. ICD-9's ranges
# (`icd9:001-139`) are chapters and blocks, not codes.
ICD_DOC_ID = re.compile(r"icd(9|10):([A-Z0-9]+(?:\.[A-Z0-9]+)?)")
# A query that is one code as written in a record: dotted or not, any case (`E11`, `i50.2`, `25000`).
CODE_QUERY = re.compile(r"[A-Z0-9]*[0-9][A-Z0-9]*(?:\.[A-Z0-9]+)?")

CHUNK_COLUMNS = {
    "chunk_id": pl.String, "doc_id": pl.String, "corpus": pl.String, "engine": pl.String, "ordinal": pl.Int32,
    "section": pl.String, "text": pl.String, "title": pl.String, "url": pl.String, "pmcid": pl.String,
    "pmid": pl.String, "arxiv_id": pl.String, "doi": pl.String,
}


def engine_of(doc: Document) -> str:
    """The ledger `engine` of a local document: pmc / arxiv for those sources, else the corpus name."""
    return {"jats": "pmc", "arxiv": "arxiv"}.get(doc.source_format, doc.corpus)


def chunk_frame(documents: list[Document], max_chars: int = DEFAULT_CHUNK_CHARS) -> pl.DataFrame:
    rows = []
    for doc in documents:
        for chunk in chunk_document(doc, max_chars):
            rows.append({"chunk_id": chunk.chunk_id, "doc_id": doc.doc_id, "corpus": doc.corpus,
                         "engine": engine_of(doc), "ordinal": chunk.ordinal, "section": chunk.section,
                         "text": chunk.text, "title": doc.title, "url": doc.url, "pmcid": doc.pmcid,
                         "pmid": doc.pmid, "arxiv_id": doc.arxiv_id, "doi": doc.doi})
    return pl.DataFrame(rows, schema=CHUNK_COLUMNS)


@dataclass
class Hit:
    """One document answering a query, with the chunk that ranked it and a focused passage."""

    rank: int
    doc_id: str
    chunk_id: str
    score: float
    title: str
    url: str | None
    corpus: str
    engine: str
    passage: str
    bm25_rank: int | None = None
    dense_rank: int | None = None


def reciprocal_rank_fusion(rankings: list[list[str]], k0: int = RRF_K,
                           weights: list[float] | None = None) -> list[tuple[str, float]]:
    """Fuse ranked id lists: score(d) = sum w/(k0 + rank), ranks one-based, weights default 1;
    ties by first appearance.

    >>> reciprocal_rank_fusion([["a", "b"], ["b", "c"]], k0=60)[0][0]
    'b'
    """
    scores: dict[str, float] = {}
    for ranking, weight in zip(rankings, weights or [1.0] * len(rankings)):
        for rank, item in enumerate(ranking, 1):
            scores[item] = scores.get(item, 0.0) + weight / (k0 + rank)
    order = {item: i for i, item in enumerate(dict.fromkeys(x for r in rankings for x in r))}
    return sorted(scores.items(), key=lambda kv: (-kv[1], order[kv[0]]))


def zscore_normalize(scores: dict[str, float]) -> dict[str, float]:
    """(score - mean) / standard deviation over one retriever's list; all-equal scores carry no
    order, so they all map to 0.

    >>> zscore_normalize({"a": 3.0, "b": 1.0})
    {'a': 1.0, 'b': -1.0}
    """
    if not scores:
        return {}
    values = np.fromiter(scores.values(), dtype="float64", count=len(scores))
    spread = float(values.std())
    if spread == 0.0:
        return dict.fromkeys(scores, 0.0)
    mean = float(values.mean())
    return {doc: (score - mean) / spread for doc, score in scores.items()}


def minmax_normalize(scores: dict[str, float]) -> dict[str, float]:
    """(score - min) / (max - min) over one retriever's list; all-equal scores map to 0.

    >>> minmax_normalize({"a": 3.0, "b": 2.0, "c": 1.0})
    {'a': 1.0, 'b': 0.5, 'c': 0.0}
    """
    if not scores:
        return {}
    low, high = min(scores.values()), max(scores.values())
    if high == low:
        return dict.fromkeys(scores, 0.0)
    return {doc: (score - low) / (high - low) for doc, score in scores.items()}


NORMALIZERS = {"zscore": zscore_normalize, "minmax": minmax_normalize}


def score_fusion(lexical: dict[str, float], dense: dict[str, float], dense_share: float,
                 normalize=zscore_normalize) -> list[tuple[str, float]]:
    """Fuse two retrievers' document scores: (1 - dense_share) * lexical + dense_share * dense,
    each normalized per query over the list that retriever returned. A document missing from one
    list takes that list's lowest normalized score (it ranked below everything the retriever
    returned), or one unit less when the list's scores are all equal; ties by first appearance,
    lexical list first.

    >>> fused = score_fusion({"a": 2.0, "b": 0.0}, {"b": 0.9, "c": 0.1}, dense_share=0.75)
    >>> [(doc, round(score, 2)) for doc, score in fused]
    [('b', 0.5), ('a', -0.5), ('c', -1.0)]
    """
    lexical_norm, dense_norm = normalize(lexical), normalize(dense)
    lexical_floor, dense_floor = _missing_score(lexical_norm), _missing_score(dense_norm)
    order = {doc: i for i, doc in enumerate(dict.fromkeys([*lexical, *dense]))}
    fused = {doc: (1.0 - dense_share) * lexical_norm.get(doc, lexical_floor)
             + dense_share * dense_norm.get(doc, dense_floor) for doc in order}
    return sorted(fused.items(), key=lambda kv: (-kv[1], order[kv[0]]))


def _missing_score(normalized: dict[str, float]) -> float:
    """The normalized score of a document a retriever did not return. An all-equal list (a single
    document, or ties) normalizes to one value, yet the retriever still returned those documents and
    not the others: a missing one ranks a unit below them, not level with them (which would make the
    only BM25 match of a query no better than documents BM25 never found). An empty list: 0, no effect."""
    low, high = min(normalized.values(), default=0.0), max(normalized.values(), default=0.0)
    return low - 1.0 if normalized and low == high else low


def fuse_documents(lexical: dict[str, float], dense: dict[str, float], fusion: str = DEFAULT_FUSION,
                   dense_share: float = DEFAULT_DENSE_SHARE) -> list[tuple[str, float]]:
    """One fused document ranking from each retriever's {doc: score} (dicts in rank order)."""
    if fusion not in FUSIONS:
        raise InputError(f"unknown fusion {fusion!r}; choose one of {', '.join(FUSIONS)}")
    if not 0.0 <= dense_share <= 1.0:
        raise InputError(f"dense_share {dense_share} is outside [0, 1]: it is the dense part of the fusion "
                         f"weight (0.5 = equal weight, default {DEFAULT_DENSE_SHARE})")
    if fusion == "rrf":
        return reciprocal_rank_fusion([list(lexical), list(dense)], weights=[1.0 - dense_share, dense_share])
    return score_fusion(lexical, dense, dense_share, NORMALIZERS[fusion])


def rank_documents(lexical: dict, dense: dict, mode: str = "hybrid", fusion: str = DEFAULT_FUSION,
                   dense_share: float = DEFAULT_DENSE_SHARE) -> list[tuple[str, float]]:
    """The document ranking of `CorpusIndex.retrieve`'s two lists: fused in hybrid mode (an empty
    list leaves the other's order intact), else the one retriever's order with its own scores."""
    lexical_scores = {doc: score for doc, (_, score) in lexical.items()}
    dense_scores = {doc: score for doc, (_, score) in dense.items()}
    if mode == "hybrid":
        return fuse_documents(lexical_scores, dense_scores, fusion, dense_share)
    return list((lexical_scores if mode == "bm25" else dense_scores).items())


def bm25_query_text(query: str) -> str:
    """Lower-cased runs of letters and digits (of any script, as the index tokenizes them) joined by
    spaces: tantivy's query syntax (quotes, colons, +/-, apostrophes, AND/OR) is never exposed.

    >>> bm25_query_text("children's 23-hour ward: AND effective? Sjögren")
    'children s 23 hour ward and effective sjögren'
    """
    return " ".join(re.findall(r"[^\W_]+", query.lower()))


def check_query(query: str) -> None:
    """Refuse a query without a word: the dense side would still answer, with the neighbours of an empty
    embedding, which is noise."""
    if not bm25_query_text(query):
        raise InputError(f"query {query!r} has no words to search for: phrase it with clinical terms")


@contextlib.contextmanager
def building_index(out_dir: Path):
    """Hold the build lock of the index at `out_dir` and yield the function that builds it there,
    `build(chunks, embedder=None, *, index_titles, name, corpora, share_embeddings_with, progress) -> manifest`.

    A second build of one directory is refused here, at once: a caller takes the lock before the slow part of its
    preparation (reading corpora, loading an embedding model), so a refused build does none of it.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        yield functools.partial(_build_locked, out_dir)


def _build_locked(out_dir: Path, chunks: pl.DataFrame, embedder=None, *, index_titles: bool = True,
                  name: str | None = None, corpora: list[str] | None = None, share_embeddings_with: list[Path] = (),
                  progress: Callable[[str], None] | None = None) -> dict:
    """The build `building_index` yields; the caller holds the directory's build lock.

    The index is written to a staging directory beside `out_dir` and swapped in by rename, so a
    build killed at any point leaves the previous index intact (where the system can, the two trade places in one
    step, `warehouse.scratch.exchange`, so a search never finds no index there); embeddings are checkpointed in
    batches there, so the next build resumes instead of re-embedding. Embeddings of chunk texts
    already present in a previous build of this directory (or of the index directories in
    `share_embeddings_with`) are reused. `progress`, when given, receives a line when BM25 indexing starts, then at
    most one every PROGRESS_SECONDS and one when it ends (chunks indexed, rate, time left), and the same for
    embedding (chunks embedded of those to embed).
    """
    if chunks.is_empty():
        raise InputError(f"no chunks to index for {out_dir}: ingest a corpus first (dxr corpus ingest FORMAT PATH)")
    staging = out_dir.with_name(f".{out_dir.name}.building")
    retired = out_dir.with_name(f".{out_dir.name}.retired")
    if retired.exists() and not out_dir.exists():
        os.replace(retired, out_dir)  # killed between the two renames of a swap: the old index is whole
    shutil.rmtree(retired, ignore_errors=True)
    cached: dict[str, np.ndarray] = {}
    if embedder is not None:
        for directory in [*share_embeddings_with, out_dir]:
            cached.update(_load_cached_vectors(Path(directory)))
        cached.update(_load_checkpoints(staging / CHECKPOINT_DIR))
    _clear_staging(staging)
    manifest = _write_index(chunks, staging, embedder, cached, index_titles=index_titles,
                            name=name or out_dir.name, corpora=corpora, progress=progress)
    if out_dir.is_dir() and exchange(staging, out_dir):
        shutil.rmtree(staging, ignore_errors=True)  # the old index now; a kill here leaves it to be cleared
        return manifest
    if out_dir.exists():
        os.replace(out_dir, retired)
    os.replace(staging, out_dir)
    shutil.rmtree(retired, ignore_errors=True)
    return manifest


# Embeddings are saved every this many chunks during a build: a killed build loses at most one batch.
CHECKPOINT_ROWS = 512
CHECKPOINT_DIR = "checkpoints"
# A build reports its indexing and embedding progress at most this often: a checkpoint takes about a second at full
# speed, so a line per checkpoint would flood the terminal, yet a build can embed for half an hour.
PROGRESS_SECONDS = 30.0


def _write_index(chunks: pl.DataFrame, out_dir: Path, embedder, cached: dict[str, np.ndarray], *,
                 index_titles: bool, name: str, corpora: list[str] | None,
                 progress: Callable[[str], None] | None) -> dict:
    import tantivy

    started = time.perf_counter()
    chunks = chunks.select(list(CHUNK_COLUMNS)).with_row_index("row")
    texts = chunks["text"].to_list()
    titles = chunks["title"].fill_null("").to_list()

    lexical_dir = out_dir / "tantivy"
    lexical_dir.mkdir()
    builder = tantivy.SchemaBuilder()
    builder.add_integer_field("row", stored=True, indexed=False)
    builder.add_text_field("title", stored=False, tokenizer_name="en_stem")
    builder.add_text_field("body", stored=False, tokenizer_name="en_stem")
    index = tantivy.Index(builder.build(), path=str(lexical_dir))
    writer = index.writer(heap_size=128_000_000, num_threads=1)
    if progress:
        progress(f"{name}: indexing {len(texts):,} chunks for BM25")
    reported = time.perf_counter()
    for row, (title, text) in enumerate(zip(titles, texts)):
        writer.add_document(tantivy.Document(row=row, title=title if index_titles else "", body=text))
        # A clock read per chunk costs well under 1% of adding it; the last line waits for the commit below.
        if progress and row + 1 < len(texts) and (now := time.perf_counter()) - reported >= PROGRESS_SECONDS:
            progress(chunk_progress(name, "indexed", row + 1, len(texts), now - started))
            reported = now
    writer.commit()
    writer.wait_merging_threads()
    lexical_seconds = time.perf_counter() - started
    if progress:
        progress(chunk_progress(name, "indexed", len(texts), len(texts), lexical_seconds))

    embedded = reused = 0
    dense_seconds = 0.0
    if embedder is not None:
        import faiss

        dense_started = time.perf_counter()
        inputs = [f"{t}. {x}" if index_titles and t else x for t, x in zip(titles, texts)]
        keys = [text_hash(f"{embedder.name}\n{x}") for x in inputs]
        missing = list(dict.fromkeys(k for k in keys if k not in cached))
        input_of = dict(zip(keys, inputs))
        if progress and missing:
            reused_note = f" ({len(keys) - len(missing):,} reused)" if len(keys) > len(missing) else ""
            progress(f"{name}: embedding {len(missing):,} of {len(keys):,} chunks{reused_note}")
        embedding_started = reported = time.perf_counter()
        for start in range(0, len(missing), CHECKPOINT_ROWS):
            batch = missing[start:start + CHECKPOINT_ROWS]
            vectors = embedder.encode([input_of[k] for k in batch])
            _save_checkpoint(out_dir / CHECKPOINT_DIR / f"{text_hash(''.join(batch))}.npz", batch, vectors)
            cached.update(zip(batch, vectors))
            done, now = start + len(batch), time.perf_counter()
            if progress and (done == len(missing) or now - reported >= PROGRESS_SECONDS):
                progress(chunk_progress(name, "embedded", done, len(missing), now - embedding_started))
                reported = now
        vectors = np.stack([cached[k] for k in keys]).astype("float32")
        embedded, reused = len(missing), len(keys) - len(missing)
        dense = faiss.IndexFlatIP(vectors.shape[1])
        dense.add(vectors)
        faiss.write_index(dense, str(out_dir / "dense.faiss"))
        np.save(out_dir / "embeddings.npy", vectors)
        pl.DataFrame({"key": keys}).write_parquet(out_dir / "embedding_keys.parquet")
        dense_seconds = time.perf_counter() - dense_started

    shutil.rmtree(out_dir / CHECKPOINT_DIR)
    chunks.drop("row").write_parquet(out_dir / "chunks.parquet")
    manifest = {
        "name": name, "corpora": corpora or sorted(chunks["corpus"].unique().to_list()),
        "n_documents": chunks["doc_id"].n_unique(), "n_chunks": chunks.height, "index_titles": index_titles,
        "embedder": getattr(embedder, "name", None), "embedded": embedded, "embeddings_reused": reused,
        "lexical_seconds": round(lexical_seconds, 3), "dense_seconds": round(dense_seconds, 3),
        "build_seconds": round(time.perf_counter() - started, 3), "bytes": 0,
    }
    manifest["bytes"] = directory_bytes(out_dir)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def chunk_progress(name: str, verb: str, done: int, total: int, seconds: float) -> str:
    """One progress line of a build that has `verb` (indexed for BM25, embedded) `done` of `total` chunks in
    `seconds`.

    >>> chunk_progress("literature", "embedded", 5120, 30387, 125.0)
    'literature: embedded 5,120/30,387 chunks (17%) in 2.1 min, 41 chunks/s, about 10 min left'
    >>> chunk_progress("icd", "indexed", 447883, 447883, 21.0)
    'icd: indexed 447,883/447,883 chunks (100%) in 21 s, 21,328 chunks/s'
    """
    rate = done / max(seconds, 1e-9)
    left = f", about {_duration((total - done) / rate)} left" if done < total else ""
    return (f"{name}: {verb} {done:,}/{total:,} chunks ({done / total:.0%}) in {_duration(seconds)}, "
            f"{rate:,.0f} chunks/s{left}")


def _duration(seconds: float) -> str:
    """Seconds as people read a wait: '45 s', '2.1 min', '12 min', '1.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 600:
        return f"{seconds / 60:.1f} min"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def build_command(directory: Path, manifest: dict | None) -> str:
    """The `dxr corpus build` that makes the index at `directory` again: its name, and its corpora and kind from its
    manifest (a plain build makes only the default indexes, and a named one takes its corpora)."""
    if manifest is None:  # unreadable
        return f"dxr corpus build --name {directory.name} --corpus CORPUS"
    corpora = "".join(f" --corpus {corpus}" for corpus in manifest["corpora"])
    return f"dxr corpus build --name {directory.name}{corpora}" + (" --lexical-only" * (manifest["embedder"] is None))


@contextlib.contextmanager
def _build_lock(out_dir: Path):
    """An exclusive lock per index directory, released by the kernel even when the process is killed."""
    import fcntl

    with open(out_dir.with_name(f".{out_dir.name}.lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"index {out_dir} is being built by another process: wait for it to finish, "
                             "then rerun") from None
        yield


def _clear_staging(staging: Path) -> None:
    """An empty staging directory except for the embedding checkpoints of interrupted builds
    (keyed by embedder and text, so they stay valid whatever changed since)."""
    (staging / CHECKPOINT_DIR).mkdir(parents=True, exist_ok=True)
    for child in staging.iterdir():
        if child.name != CHECKPOINT_DIR:
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()


def _save_checkpoint(path: Path, keys: list[str], vectors: np.ndarray) -> None:
    partial = path.with_name(f"{path.stem}.partial.npz")
    np.savez(partial, keys=np.array(keys), vectors=np.asarray(vectors, dtype="float32"))
    os.replace(partial, path)  # a checkpoint is either whole or absent


def _load_checkpoints(directory: Path) -> dict[str, np.ndarray]:
    """Embeddings saved by an interrupted build (only whole checkpoints: they were renamed into place)."""
    cached: dict[str, np.ndarray] = {}
    for path in sorted(directory.glob("*[0-9a-f].npz")):
        with np.load(path, allow_pickle=False) as saved:
            cached.update(zip(saved["keys"].tolist(), saved["vectors"]))
    return cached


def _load_cached_vectors(out_dir: Path) -> dict[str, np.ndarray]:
    keys_path, vectors_path = out_dir / "embedding_keys.parquet", out_dir / "embeddings.npy"
    if not (keys_path.exists() and vectors_path.exists()):
        return {}
    keys = pl.read_parquet(keys_path, glob=False)["key"].to_list()
    vectors = np.load(vectors_path)
    if len(keys) != len(vectors):
        return {}
    return dict(zip(keys, vectors))


# Opening an index is retried this often when a build swaps the directory meanwhile.
OPEN_ATTEMPTS = 5


def _directory_identity(path: Path) -> tuple[int, int] | None:
    """Which directory `path` names now (a swap renames another one into place); None while it is absent."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class CorpusIndex:
    """A built index opened for search. `embedder` is needed only for dense / hybrid search."""

    def __init__(self, directory: Path, embedder=None):
        import tantivy

        self.directory = Path(directory)
        if not (self.directory / "manifest.json").exists():
            raise NotFoundError(f"no corpus index at {self.directory}: build it with `dxr corpus build`")
        # A build swaps in a whole new directory by rename. Parts read on both sides of a swap would mix two
        # builds (with equal row counts, unnoticed below): read them again until the directory stayed the same.
        for _ in range(OPEN_ATTEMPTS):
            before = _directory_identity(self.directory)
            try:
                parts = self._read_parts(tantivy)
            except InputError:
                if before is not None and before == _directory_identity(self.directory):
                    raise  # unreadable as it stands, not swapped meanwhile
                parts = None
            if parts is not None and before is not None and before == _directory_identity(self.directory):
                break
            time.sleep(0.05)  # between the two renames of a swap the directory is briefly absent
        else:
            raise InputError(f"corpus index at {self.directory} kept being replaced while it was opened: retry when "
                             "the running `dxr corpus build` has finished")
        self.manifest, self.chunks, self._lexical, self._dense = parts
        self._searcher = self._lexical.searcher()
        # Both indexes address chunks by row number; an index whose parts disagree (left by a build
        # interrupted before builds were staged) would answer with the wrong chunks.
        counts = {"chunks.parquet": self.chunks.height, "tantivy": self._searcher.num_docs}
        if self._dense is not None:
            counts["dense.faiss"] = self._dense.ntotal
        if len(set(counts.values())) > 1:
            found = ", ".join(f"{part} {count}" for part, count in counts.items())
            raise InputError(f"corpus index at {self.directory} is inconsistent ({found} rows): "
                             f"rebuild it with `{build_command(self.directory, self.manifest)}`")
        self.embedder = embedder
        # Columns as Python lists: per-hit access stays O(1) without frame indexing overhead.
        self._col = {name: self.chunks[name].to_list() for name in self.chunks.columns}
        self._row_of_chunk = {chunk_id: row for row, chunk_id in enumerate(self._col["chunk_id"])}
        self._rows_of_doc: dict[str, list[int]] = {}
        for row, doc_id in enumerate(self._col["doc_id"]):
            self._rows_of_doc.setdefault(doc_id, []).append(row)
        # ICD dictionary documents as (undotted, version, dotted, doc_id), for queries that name a code.
        self._icd_codes = sorted((m[2].replace(".", ""), int(m[1]), m[2], doc_id) for doc_id in self._rows_of_doc
                                 if (m := ICD_DOC_ID.fullmatch(doc_id)))
        self._icd_keys = [undotted for undotted, *_ in self._icd_codes]
        # Stored as the source gave them (a JSONL record may say 'arXiv:2101.00001v2' or 'https://doi.org/10.1/X'):
        # keyed in the normalized form `resolve` looks up, so a web hit on any spelling finds the document.
        self._ids = {}
        for key, normalize in ID_NORMALIZERS.items():
            for row, value in enumerate(self._col[key]):
                if value:
                    self._ids.setdefault((key, normalize(str(value)).lower()), self._col["doc_id"][row])

    def _read_parts(self, tantivy) -> tuple:
        """(manifest, chunks, tantivy index, faiss index or None) as they are in the directory now."""
        manifest = None
        try:
            manifest = json.loads((self.directory / "manifest.json").read_text())
            chunks = pl.read_parquet(self.directory / "chunks.parquet", glob=False)
            lexical = tantivy.Index.open(str(self.directory / "tantivy"))
            dense = None
            if (self.directory / "dense.faiss").exists():
                import faiss

                dense = faiss.read_index(str(self.directory / "dense.faiss"))
        except (OSError, ValueError, RuntimeError) as exc:
            raise InputError(f"corpus index at {self.directory} is unreadable ({str(exc).splitlines()[0]}): "
                             f"rebuild it with `{build_command(self.directory, manifest)}`") from None
        return manifest, chunks, lexical, dense

    @property
    def has_dense(self) -> bool:
        return self._dense is not None

    @property
    def engines(self) -> list[str]:
        """The ledger engines of the documents indexed (`engine_of`: pmc, arxiv, corpus names), sorted."""
        return sorted(set(self._col["engine"]))

    # ---- retrieval --------------------------------------------------------------------------
    def bm25_chunks(self, query: str, depth: int = DEFAULT_DEPTH) -> list[tuple[int, float]]:
        """(chunk row, BM25 score) of the top `depth` chunks, best first."""
        text = bm25_query_text(query)
        if not text:
            return []
        parsed = self._lexical.parse_query(text, ["title", "body"])
        result = self._searcher.search(parsed, depth)
        return [(self._searcher.doc(address)["row"][0], float(score)) for score, address in result.hits]

    def dense_chunks(self, query: str, depth: int = DEFAULT_DEPTH) -> list[tuple[int, float]]:
        """(chunk row, cosine similarity) of the top `depth` chunks, best first."""
        if self._dense is None:
            raise InputError(f"index {self.directory} has no dense vectors (built lexical-only): use mode bm25")
        if self.embedder is None:
            raise InputError("dense search needs an embedder: open the index with CorpusIndex(dir, embedder)")
        built_with = self.manifest.get("embedder")
        if built_with != self.embedder.name:
            # Another model's query vectors still search (often in the same dimension), but against vectors
            # they are not comparable with: the ranking would be silently meaningless.
            raise InputError(f"index {self.directory} was built with embedder {built_with}, not {self.embedder.name} "
                             f"(tools.embedding): rebuild it with `{build_command(self.directory, self.manifest)}`, "
                             "or set tools.embedding back")
        import faiss

        vector = self.embedder.encode([query])
        threads = faiss.omp_get_max_threads()
        # One query is too small to split: two OpenMP threads on a busy 2-core machine were 5x slower.
        faiss.omp_set_num_threads(1)
        try:
            similarities, rows = self._dense.search(vector, min(depth, self._dense.ntotal))
        finally:
            faiss.omp_set_num_threads(threads)
        return [(int(r), float(s)) for r, s in zip(rows[0], similarities[0]) if r >= 0]

    def retrieve(self, query: str, mode: str = "hybrid", depth: int = DEFAULT_DEPTH) -> tuple[dict, dict]:
        """Each retriever's documents in rank order as {doc_id: (best chunk row, its score)}; the
        retriever a mode does not use answers {}. A hybrid search on a lexical-only index is BM25."""
        if mode not in MODES:
            raise InputError(f"unknown search mode {mode!r}; choose one of {', '.join(MODES)}")
        check_query(query)
        if mode == "hybrid" and self._dense is None:
            mode = "bm25"
        lexical = self._best_chunk_per_doc(self.bm25_chunks(query, depth)) if mode in ("bm25", "hybrid") else {}
        dense = self._best_chunk_per_doc(self.dense_chunks(query, depth)) if mode in ("dense", "hybrid") else {}
        return lexical, dense

    def search(self, query: str, k: int = 10, mode: str = "hybrid", depth: int = DEFAULT_DEPTH,
               passage_chars: int = DEFAULT_PASSAGE_CHARS, with_passages: bool = True,
               fusion: str = DEFAULT_FUSION, dense_share: float = DEFAULT_DENSE_SHARE) -> list[Hit]:
        """Top-k documents for `query` (one hit per document). In hybrid mode the two retrievers'
        lists are fused by `fusion` with `dense_share` of the weight on the dense side; a single
        retriever's hits carry its own score (BM25 or cosine). A query that is one ICD code answers
        that code, then its subcodes (`code_matches`), ahead of their scores (0 where not retrieved)."""
        if k < 1:
            raise InputError(f"k = {k}: a search returns at least 1 hit; pass k >= 1")
        if mode == "hybrid" and self._dense is None:
            mode = "bm25"  # a lexical-only index: plain BM25 order and scores
        lexical, dense = self.retrieve(query, mode, depth)
        ranked = rank_documents(lexical, dense, mode, fusion, dense_share)
        if codes := self.code_matches(query):
            # BM25 ranks a category below its subcodes (they repeat its code in their notes) or not at all
            # (past `depth`): the code named comes first, whatever the retrievers' scores.
            scores, placed = dict(ranked), set(codes)
            ranked = [(doc_id, scores.get(doc_id, 0.0)) for doc_id in codes] + [
                (doc_id, score) for doc_id, score in ranked if doc_id not in placed]
        lexical_rank = {d: i for i, d in enumerate(lexical, 1)}
        dense_rank = {d: i for i, d in enumerate(dense, 1)}
        hits = []
        for rank, (doc_id, score) in enumerate(ranked[:k], 1):
            row = lexical[doc_id][0] if doc_id in lexical else dense[doc_id][0] if doc_id in dense else (
                self._rows_of_doc[doc_id][0])  # a code match neither retriever returned: its title chunk
            if doc_id in lexical and doc_id in dense and dense_rank[doc_id] < lexical_rank[doc_id]:
                # Take the chunk of the retriever that ranked this document higher.
                row = dense[doc_id][0]
            passage = focused_passage(query, self.expanded_text(row), passage_chars) if with_passages else ""
            hits.append(Hit(rank, doc_id, self._col["chunk_id"][row], score, self._col["title"][row] or "",
                            self._col["url"][row], self._col["corpus"][row], self._col["engine"][row], passage,
                            lexical_rank.get(doc_id), dense_rank.get(doc_id)))
        return hits

    def code_matches(self, query: str) -> list[str]:
        """The ICD dictionary documents of the code a query names, dotted or not: the code (ICD-10 before ICD-9
        when the undotted form names both, e.g. E880), then its subcodes in code order; [] when the query is
        not one code of the index."""
        written = query.strip().upper()
        if not CODE_QUERY.fullmatch(written):
            return []
        undotted = written.replace(".", "")
        # The code and its subcodes, which extend it (I50.2 -> I50.21, 250 -> 250.01); a dotted query names them
        # dotted, so it cannot mean the other version's code of the same characters (E880.1 is not E88.01).
        family = [(key, version, doc_id) for key, version, dotted, doc_id in self._icd_codes[
                  bisect_left(self._icd_keys, undotted):bisect_right(self._icd_keys, undotted + "~")]
                  if "." not in written or dotted.startswith(written)]
        versions = {version for key, version, _ in family if key == undotted}
        # The code first (ICD-10 before ICD-9), then the subcodes of each version in code order.
        return [doc_id for _, doc_id in sorted(((key != undotted, -version, key), doc_id)
                                               for key, version, doc_id in family if version in versions)]

    def _best_chunk_per_doc(self, chunks: list[tuple[int, float]]) -> dict[str, tuple[int, float]]:
        best: dict[str, tuple[int, float]] = {}
        for row, score in chunks:
            best.setdefault(self._col["doc_id"][row], (row, score))
        return best

    def passage(self, query: str, hit: Hit, passage_chars: int = DEFAULT_PASSAGE_CHARS) -> str:
        """The query-focused passage of a hit returned without one (`with_passages=False`)."""
        return focused_passage(query, self.expanded_text(self._row_of_chunk[hit.chunk_id]), passage_chars)

    # ---- documents --------------------------------------------------------------------------
    def expanded_text(self, row: int, window: int = 1) -> str:
        """The chunk plus up to `window` neighbours on each side within the same section."""
        doc_rows = self._rows_of_doc[self._col["doc_id"][row]]
        position = doc_rows.index(row)
        section = self._col["section"][row]
        picked = [r for r in doc_rows[max(0, position - window): position + window + 1]
                  if self._col["section"][r] == section]
        return " ".join(self._col["text"][r] for r in picked)

    def document_text(self, doc_id: str) -> str:
        return "\n\n".join(self._col["text"][r] for r in self._rows_of_doc.get(doc_id, []))

    def document(self, doc_id: str) -> dict | None:
        rows = self._rows_of_doc.get(doc_id)
        if not rows:
            return None
        first = rows[0]
        return {key: self._col[key][first] for key in ("doc_id", "corpus", "engine", "title", "url", "pmcid",
                                                        "pmid", "arxiv_id", "doi")}

    def resolve(self, *, pmcid=None, arxiv_id=None, doi=None, pmid=None) -> str | None:
        """The local doc_id carrying one of these identifiers (canonicalization of web hits)."""
        for key, value in (("pmcid", pmcid), ("arxiv_id", arxiv_id), ("doi", doi), ("pmid", pmid)):
            if value:
                found = self._ids.get((key, ID_NORMALIZERS[key](str(value)).lower()))
                if found:
                    return found
        return None
