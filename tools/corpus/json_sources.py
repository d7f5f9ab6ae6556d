"""JSON adapters: arXiv metadata snapshot, MedQuAD, PubMedQA and generic JSON lines."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from dxr.errors import InputError
from tools.corpus.documents import Document, clean_text, normalize_arxiv_id, stable_doc_id
from tools.corpus.files import open_text

REENCODE = "re-encode it as UTF-8 (e.g. iconv -f <its encoding> -t utf-8)"


def _load_json(path: Path):
    try:
        with open_text(path) as handle:
            return json.load(handle)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); "
                         "for one object per line use FORMAT jsonl") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 ({exc.reason}, byte 0x{exc.object[exc.start]:02x}); {REENCODE}") \
            from None
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read ({exc}); check the file is complete UTF-8 JSON") from None


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    number = 0
    try:
        with open_text(path) as handle:
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
    except UnicodeDecodeError as exc:
        # Lines are decoded in blocks: the bad byte is on the line after the last one read, or soon after.
        raise InputError(f"{path}: not UTF-8 at or after line {number + 1} ({exc.reason}, byte "
                         f"0x{exc.object[exc.start]:02x}); {REENCODE}") from None
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read ({exc}); check the file is complete UTF-8 JSON lines") from None


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "true/false"
    return {dict: "an object", list: "a list", int: "a number", float: "a number"}.get(type(value), "a string")


def _field(record: dict, key: str, where: str, *, required: bool = False, number_ok: bool = False) -> str | None:
    """A text field of a JSON record (identifiers may be numbers); absent or blank is None unless required."""
    value = record.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise InputError(f"{where}: missing field '{key}'")
        return None
    if isinstance(value, str):
        return value
    if number_ok and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    expected = "a string or a number" if number_ok else "a string"
    raise InputError(f"{where}: field '{key}' must be {expected}, got {_json_type(value)}")


def _names(record: dict, key: str, where: str, separator: str) -> str | None:
    """A field of names kept as one string: the arXiv snapshot's own string, or a list of strings joined by
    `separator`, as other exports write authors and categories."""
    value = record.get(key)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return separator.join(item.strip() for item in value if item.strip()) or None
    return _field(record, key, where)


def _strings(record: dict, key: str, where: str, *, required: bool = False) -> list[str] | None:
    """A list-of-strings field (PubMedQA CONTEXTS, LABELS)."""
    value = record.get(key)
    if value is None and not required:
        return None
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    if value is None:
        got = "nothing"
    elif not isinstance(value, list):
        got = _json_type(value)
    else:
        got = "a list with non-string items" if value else "an empty list"
    raise InputError(f"{where}: field '{key}' must be a non-empty list of strings, got {got}")


def read_arxiv(path: Path, corpus: str, fulltext_dir: Path | None = None) -> Iterator[Document]:
    """arXiv metadata snapshot (one JSON object per line: id, title, abstract, authors, categories).

    Full text is optional: a `full_text` field on the line, or `<fulltext_dir>/<id>.txt`
    (slashes of old-style ids replaced by underscores).
    """
    for number, record in _json_lines(path):
        where = f"{path}:{number}"
        arxiv_id = normalize_arxiv_id(_field(record, "id", where, required=True, number_ok=True))
        title = clean_text(_field(record, "title", where, required=True))
        sections = [("Abstract", clean_text(_field(record, "abstract", where)))]
        full = _field(record, "full_text", where)
        if not full and fulltext_dir is not None:
            candidate = fulltext_dir / f"{arxiv_id.replace('/', '_')}.txt"
            if candidate.is_file():
                full = candidate.read_text(encoding="utf-8", errors="replace")
        if full:
            sections.append(("Full text", clean_text(full)))
        yield Document(doc_id=stable_doc_id(corpus, arxiv_id=arxiv_id), corpus=corpus, source_format="arxiv",
                       title=title, sections=[s for s in sections if s[1]],
                       url=f"https://arxiv.org/abs/{arxiv_id}", doi=_field(record, "doi", where), arxiv_id=arxiv_id,
                       meta={"authors": _names(record, "authors", where, ", "),
                             "categories": _names(record, "categories", where, " ")})


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
        if not isinstance(qa, list) or not all(isinstance(item, dict) for item in qa):
            raise InputError(f"{where} ({native}): field 'qa' must be a list of question/answer objects")
        sections = [(clean_text(_field(item, "qtype", f"{where} qa #{number}") or "answer"),
                     clean_text(_field(item, "answer", f"{where} qa #{number}")))
                    for number, item in enumerate(qa)]
        yield Document(doc_id=stable_doc_id(corpus, native), corpus=corpus, source_format="medquad",
                       title=clean_text(_field(record, "focus", where)), sections=[s for s in sections if s[1]],
                       url=_field(record, "url", where), meta={"source": record.get("source")})


def _medquad_native_id(record: dict, where: str) -> str:
    """`<source>/<doc_id>`; a record without doc_id falls back to the prefix of its first qid."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    doc_id = _field(record, "doc_id", where, number_ok=True)
    if not doc_id:
        qa = record.get("qa") or [{}]
        first = qa[0] if isinstance(qa, list) and isinstance(qa[0], dict) else {}
        qid = _field(first, "qid", f"{where}: no 'doc_id' and first qa item", required=True, number_ok=True)
        doc_id = qid.rsplit("-", 1)[0]
    return f"{_field(record, 'source', where) or 'unknown'}/{doc_id}"


def read_pubmedqa(path: Path, corpus: str) -> Iterator[Document]:
    """PubMedQA (`ori_pqal.json`): one abstract per PMID (labelled contexts + the conclusion) titled by its QUESTION.

    PubMedQA's questions are the articles' own titles (PQA-L and PQA-U take articles titled by a question; PQA-A
    turns a statement title into one), so the question is the document's title; it is not part of its text.
    """
    data = _load_json(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object keyed by PMID, got {type(data).__name__}")
    for pmid, record in data.items():
        where = f"{path}: PMID {pmid}"
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object with CONTEXTS, got {_json_type(record)}")
        contexts = _strings(record, "CONTEXTS", where, required=True)
        labels = _strings(record, "LABELS", where) or ["Abstract"] * len(contexts)
        if len(labels) != len(contexts):
            raise InputError(f"{where}: {len(labels)} LABELS for {len(contexts)} CONTEXTS")
        sections = [(clean_text(label).title(), clean_text(text)) for label, text in zip(labels, contexts)]
        if conclusion := _field(record, "LONG_ANSWER", where):
            sections.append(("Conclusions", clean_text(conclusion)))
        yield Document(doc_id=stable_doc_id(corpus, pmid=pmid), corpus=corpus, source_format="pubmedqa",
                       title=clean_text(_field(record, "QUESTION", where)), sections=sections,
                       url=f"https://pubmed.ncbi.nlm.nih.gov/{pmid}/", pmid=str(pmid),
                       meta={"year": record.get("YEAR")})


def read_jsonl(path: Path, corpus: str) -> Iterator[Document]:
    """Generic JSON lines: `id` and `text` required; optional title, url, doi, pmcid, pmid, arxiv_id."""
    for number, record in _json_lines(path):
        where = f"{path}:{number}"
        native = _field(record, "id", where, required=True, number_ok=True)
        text = clean_text(_field(record, "text", where, required=True))
        ids = {k: _field(record, k, where, number_ok=True) for k in ("pmcid", "pmid", "arxiv_id", "doi")}
        yield Document(doc_id=stable_doc_id(corpus, native, **ids), corpus=corpus, source_format="jsonl",
                       title=clean_text(_field(record, "title", where)), sections=[("Text", text)],
                       url=_field(record, "url", where), **ids)
