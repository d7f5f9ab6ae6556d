"""JSON adapters: arXiv metadata snapshot, MedQuAD, PubMedQA and generic JSON lines."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from dxr.errors import InputError
from tools.corpus.documents import Document, clean_text, normalize_arxiv_id, stable_doc_id


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _load_json(path: Path):
    try:
        with _open_text(path) as handle:
            return json.load(handle)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); "
                         "for one object per line use FORMAT jsonl") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({exc}); check the file is complete UTF-8 JSON") from None


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        with _open_text(path) as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{number}: invalid JSON ({exc.msg}); each line must be one object") \
                        from None
                if not isinstance(record, dict):
                    raise InputError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
                yield number, record
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({exc}); check the file is complete UTF-8 JSON lines") from None


def _require(record: dict, key: str, where: str):
    value = record.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise InputError(f"{where}: missing field '{key}'")
    return value


def read_arxiv(path: Path, corpus: str, fulltext_dir: Path | None = None) -> Iterator[Document]:
    """arXiv metadata snapshot (one JSON object per line: id, title, abstract, authors, categories).

    Full text is optional: a `full_text` field on the line, or `<fulltext_dir>/<id>.txt`
    (slashes of old-style ids replaced by underscores).
    """
    for number, record in _json_lines(path):
        where = f"{path}:{number}"
        arxiv_id = normalize_arxiv_id(_require(record, "id", where))
        title = clean_text(_require(record, "title", where))
        sections = [("Abstract", clean_text(record.get("abstract", "")))]
        full = record.get("full_text")
        if not full and fulltext_dir is not None:
            candidate = fulltext_dir / f"{arxiv_id.replace('/', '_')}.txt"
            if candidate.is_file():
                full = candidate.read_text(encoding="utf-8", errors="replace")
        if full:
            sections.append(("Full text", clean_text(full)))
        yield Document(doc_id=stable_doc_id(corpus, arxiv_id=arxiv_id), corpus=corpus, source_format="arxiv",
                       title=title, sections=[s for s in sections if s[1]],
                       url=f"https://arxiv.org/abs/{arxiv_id}", doi=record.get("doi") or None, arxiv_id=arxiv_id,
                       meta={"authors": record.get("authors"), "categories": record.get("categories")})


def read_medquad(path: Path, corpus: str) -> Iterator[Document]:
    """MedQuAD documents: one document per source page; its answers are the sections.

    Question strings are never part of the document (retrieval must not see them); the section
    heading is the question type (e.g. 'treatment').
    """
    data = _load_json(path)
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of MedQuAD documents, got {type(data).__name__}")
    natives = [_medquad_native_id(record, f"{path}: document #{index}") for index, record in enumerate(data)]
    counts = Counter(natives)
    for index, (record, native) in enumerate(zip(data, natives)):
        where = f"{path}: document #{index}"
        if counts[native] > 1:
            # MedQuAD reuses some doc_ids (even URLs) for different topics; URL + focus tell them apart.
            page = f"{record.get('url')}|{record.get('focus')}"
            native = f"{native}~{hashlib.sha1(page.encode()).hexdigest()[:8]}"
        qa = record.get("qa")
        if not isinstance(qa, list):
            raise InputError(f"{where} ({native}): field 'qa' must be a list of question/answer objects")
        sections = [(clean_text(item.get("qtype", "answer")), clean_text(item.get("answer") or "")) for item in qa]
        yield Document(doc_id=stable_doc_id(corpus, native), corpus=corpus, source_format="medquad",
                       title=clean_text(record.get("focus") or ""), sections=[s for s in sections if s[1]],
                       url=record.get("url") or None, meta={"source": record.get("source")})


def _medquad_native_id(record: dict, where: str) -> str:
    """`<source>/<doc_id>`; a record without doc_id falls back to the prefix of its first qid."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    doc_id = record.get("doc_id")
    if not doc_id:
        qa = record.get("qa") or [{}]
        qid = str(_require(qa[0], "qid", f"{where}: no 'doc_id' and first qa item"))
        doc_id = qid.rsplit("-", 1)[0]
    return f"{record.get('source') or 'unknown'}/{doc_id}"


def read_pubmedqa(path: Path, corpus: str) -> Iterator[Document]:
    """PubMedQA (`ori_pqal.json`): one abstract per PMID (labelled contexts + the conclusion).

    The question is not part of the document.
    """
    data = _load_json(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object keyed by PMID, got {type(data).__name__}")
    for pmid, record in data.items():
        where = f"{path}: PMID {pmid}"
        contexts = _require(record, "CONTEXTS", where)
        labels = record.get("LABELS") or ["Abstract"] * len(contexts)
        if len(labels) != len(contexts):
            raise InputError(f"{where}: {len(labels)} LABELS for {len(contexts)} CONTEXTS")
        sections = [(clean_text(label).title(), clean_text(text)) for label, text in zip(labels, contexts)]
        if record.get("LONG_ANSWER"):
            sections.append(("Conclusions", clean_text(record["LONG_ANSWER"])))
        yield Document(doc_id=stable_doc_id(corpus, pmid=pmid), corpus=corpus, source_format="pubmedqa",
                       title="", sections=sections, url=f"https://pubmed.ncbi.nlm.nih.gov/{pmid}/", pmid=str(pmid),
                       meta={"year": record.get("YEAR")})


def read_jsonl(path: Path, corpus: str) -> Iterator[Document]:
    """Generic JSON lines: `id` and `text` required; optional title, url, doi, pmcid, pmid, arxiv_id."""
    for number, record in _json_lines(path):
        where = f"{path}:{number}"
        native = str(_require(record, "id", where))
        text = clean_text(_require(record, "text", where))
        ids = {k: (str(record[k]) if record.get(k) else None) for k in ("pmcid", "pmid", "arxiv_id", "doi")}
        yield Document(doc_id=stable_doc_id(corpus, native, **ids), corpus=corpus, source_format="jsonl",
                       title=clean_text(record.get("title") or ""), sections=[("Text", text)],
                       url=record.get("url") or None, **ids)
