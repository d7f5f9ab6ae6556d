"""Documents and chunks: stable ids, sentence-aware chunking with parent links, deduplication.

A document id is derived from the strongest public identifier the source carries, so the same
article ingested from two sources (a JATS file and a web hit) gets the same id:
`pmc:PMC123`, `arxiv:2101.00001`, `pmid:17942999`, `doi:10.1/x`, else `<corpus>:<native id>`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

# One chunk fits the default embedding model's 256-token window (~4 characters per token).
DEFAULT_CHUNK_CHARS = 1000

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[])")
_SPACE = re.compile(r"\s+")


@dataclass
class Document:
    """One ingested document; `sections` keeps the source's own structure as (heading, text)."""

    doc_id: str
    corpus: str
    source_format: str
    title: str
    sections: list[tuple[str, str]]
    url: str | None = None
    doi: str | None = None
    pmcid: str | None = None
    pmid: str | None = None
    arxiv_id: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "\n\n".join(body for _, body in self.sections if body)


@dataclass(frozen=True)
class Chunk:
    """A retrievable span; `doc_id` is its document (its parent), `ordinal` its position inside it."""

    chunk_id: str
    doc_id: str
    ordinal: int
    section: str
    text: str


def clean_text(text: str) -> str:
    return _SPACE.sub(" ", text or "").strip()


def stable_doc_id(corpus: str, native_id: str | None = None, *, pmcid=None, arxiv_id=None, pmid=None,
                  doi=None) -> str:
    """The document id: the strongest public identifier first, else the corpus-local id.

    >>> stable_doc_id("samples", pmcid="1790863", doi="10.1371/x")
    'pmc:PMC1790863'
    >>> stable_doc_id("medquad", "0000001_1")
    'medquad:0000001_1'
    """
    if pmcid:
        return f"pmc:{normalize_pmcid(pmcid)}"
    if arxiv_id:
        return f"arxiv:{normalize_arxiv_id(arxiv_id)}"
    if pmid:
        return f"pmid:{str(pmid).strip()}"
    if doi:
        return f"doi:{normalize_doi(doi)}"
    if not native_id:
        raise ValueError(f"document of corpus {corpus} has no identifier at all")
    return f"{corpus}:{native_id}"


def normalize_pmcid(value: str) -> str:
    digits = re.sub(r"(?i)^pmc", "", str(value).strip())
    return f"PMC{digits}"


def normalize_arxiv_id(value: str) -> str:
    """Strip URL prefixes and version suffixes: 'arXiv:2101.00001v2' -> '2101.00001'."""
    value = re.sub(r"(?i)^(arxiv:|https?://arxiv\.org/(abs|pdf)/)", "", str(value).strip())
    value = re.sub(r"\.pdf$", "", value)
    return re.sub(r"v\d+$", "", value)


def normalize_doi(value: str) -> str:
    value = re.sub(r"(?i)^(doi:|https?://(dx\.)?doi\.org/)", "", str(value).strip())
    return value.lower()


def normalize_url(url: str) -> str:
    """Scheme-less, lower-cased host, no `www.`, no fragment, no trailing slash (dedupe key).

    >>> normalize_url("HTTPS://www.Example.org/a/b/?x=1#top")
    'example.org/a/b?x=1'
    """
    parts = urlsplit(url.strip())
    host = parts.netloc.lower().removeprefix("www.")
    path = parts.path.rstrip("/")
    return urlunsplit(("", host, path, parts.query, "")).lstrip("/")


def normalize_title(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", (title or "").lower()).strip()


def dedupe(documents: list[Document]) -> tuple[list[Document], list[tuple[str, str]]]:
    """Keep one of each duplicate (by PMCID / arXiv id / DOI / PMID, then normalized URL + title): the one
    with the most text, the first of equals.

    The same article often comes from two corpora, e.g. its PMC full text and its MEDLINE citation (abstract
    only, or title only): the full text is the one to search, whichever corpus sorts first.
    Returns the kept documents in input order and (dropped doc_id, kept doc_id) pairs.
    """
    seen: dict[str, str] = {}
    kept, dropped = [], []
    for position in sorted(range(len(documents)), key=lambda i: (-len(documents[i].text), i)):
        doc = documents[position]
        keys = [f"doc:{doc.doc_id}"]
        if doc.pmcid:
            keys.append(f"pmc:{normalize_pmcid(doc.pmcid)}")
        if doc.arxiv_id:
            keys.append(f"arxiv:{normalize_arxiv_id(doc.arxiv_id)}")
        if doc.doi:
            keys.append(f"doi:{normalize_doi(doc.doi)}")
        if doc.pmid:
            keys.append(f"pmid:{str(doc.pmid).strip()}")
        if doc.url and doc.title:
            keys.append(f"url+title:{normalize_url(doc.url)}|{normalize_title(doc.title)}")
        first = next((seen[k] for k in keys if k in seen), None)
        if first is not None:
            dropped.append((position, doc.doc_id, first))
            continue
        for key in keys:
            seen[key] = doc.doc_id
        kept.append((position, doc))
    return [doc for _, doc in sorted(kept, key=lambda pair: pair[0])], [pair[1:] for pair in sorted(dropped)]


def split_sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(clean_text(text)) if s]


def chunk_document(doc: Document, max_chars: int = DEFAULT_CHUNK_CHARS) -> list[Chunk]:
    """Pack whole sentences of each section into chunks of at most `max_chars` (a longer
    sentence is cut at word boundaries); chunks never cross sections."""
    chunks: list[Chunk] = []
    for heading, body in doc.sections:
        buffer = ""
        for sentence in split_sentences(body):
            for piece in _cut_words(sentence, max_chars):
                if buffer and len(buffer) + 1 + len(piece) > max_chars:
                    chunks.append(_chunk(doc, len(chunks), heading, buffer))
                    buffer = piece
                else:
                    buffer = f"{buffer} {piece}" if buffer else piece
        if buffer:
            chunks.append(_chunk(doc, len(chunks), heading, buffer))
    return chunks


def _chunk(doc: Document, ordinal: int, heading: str, text: str) -> Chunk:
    return Chunk(f"{doc.doc_id}#{ordinal}", doc.doc_id, ordinal, heading, text)


def _cut_words(sentence: str, max_chars: int) -> list[str]:
    if len(sentence) <= max_chars:
        return [sentence]
    pieces, current = [], ""
    for word in sentence.split(" "):
        # A "word" longer than a chunk (a sequence, an inlined table) is split, never truncated.
        for part in [word[i:i + max_chars] for i in range(0, len(word), max_chars)]:
            if current and len(current) + 1 + len(part) > max_chars:
                pieces.append(current)
                current = part
            else:
                current = f"{current} {part}" if current else part
    if current:
        pieces.append(current)
    return pieces


def text_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()
