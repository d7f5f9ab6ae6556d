"""The ICD dictionary channel: what a code means (title, inclusion terms, excludes, instructional notes).

Built from the vocabulary tables (`icd_codes`, `icd_notes`) and indexed lexically as its own corpus
(`icd`). A definition establishes what a code means, never that it will occur: its ledger rows use
channel `definition` and contribute no forecast confidence.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from dxr.errors import InputError
from tools.corpus.documents import DEFAULT_CHUNK_CHARS, Document

CORPUS = "icd"
NOTE_HEADINGS = {
    "inclusion_term": "Inclusion terms", "includes": "Includes", "excludes1": "Excludes1",
    "excludes2": "Excludes2", "code_first": "Code first", "use_additional": "Use additional code",
    "code_also": "Code also", "notes": "Notes",
}


def load_vocabulary(warehouse=None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(codes, notes) from the warehouse tables when loaded there, else from the packaged vocabularies."""
    if warehouse is not None and warehouse.has_rows("icd_codes"):
        return warehouse.read("icd_codes"), warehouse.read("icd_notes")
    try:
        from warehouse import vocab
    except ImportError as exc:  # the vocabulary module ships with the warehouse package
        raise InputError(f"no ICD vocabulary in the warehouse and warehouse.vocab is unavailable ({exc}); "
                         "load the vocabularies first") from None
    codes = pl.concat([vocab.icd10_codes(), vocab.icd9_codes()], how="vertical_relaxed")
    return codes, vocab.icd10_notes()


def ingest_dictionary(warehouse, corpus: str = CORPUS, max_chars: int = DEFAULT_CHUNK_CHARS):
    """Store the ICD dictionary (one document per code) as the `(corpus, "vocabulary")` partition of `documents` and
    `chunks`; returns its IngestSummary."""
    from tools.corpus import store_documents, writing_corpus

    with writing_corpus(warehouse, corpus):
        documents = icd_documents(*load_vocabulary(warehouse), corpus=corpus)
        return store_documents(warehouse, documents, corpus, "vocabulary", max_chars)


def icd_documents(codes: pl.DataFrame, notes: pl.DataFrame, corpus: str = CORPUS) -> list[Document]:
    """One document per code: '<dotted> <title>' plus one section per note kind (inherited notes
    say which ancestor they come from)."""
    for column in ("code", "icd_version", "dotted", "title", "billable"):
        if column not in codes.columns:
            raise InputError(f"ICD codes frame lacks column '{column}'; expected the icd_codes table schema")
    # An ancestor is named as codes are written in notes and titles, dotted: 'from I50.2', not 'from I502' (and
    # 'from E88.0', not 'from E880', which reads as ICD-9's E880). Blocks ('E70-E88') are no codes: as they are.
    dotted = dict(zip(codes["code"].to_list(), codes["dotted"].to_list()))
    grouped: dict[str, list[tuple[str, str]]] = {}
    for row in notes.iter_rows(named=True):
        text = row["text"]
        if ancestor := row.get("inherited_from"):
            text = f"{text} (from {dotted.get(ancestor, ancestor.rsplit('//', 1)[-1])})"
        grouped.setdefault(row["code"], []).append((row["kind"], text))
    documents = []
    for row in codes.sort(["icd_version", "code"]).iter_rows(named=True):
        version = int(row["icd_version"])
        title = f"{row['dotted']} {row['title']}"
        # The undotted form too: it is how MEDS codes and EHR exports write the code, and the lexical index
        # splits 'E11.9' into 'e11' and '9', so a search for 'E119' would find nothing.
        raw = row["code"].rsplit("//", 1)[-1]
        written = f"{row['dotted']} ({raw})" if raw != row["dotted"] else row["dotted"]
        sections = [("Title", f"ICD-{version}-CM {written} {row['title']}")]
        by_kind: dict[str, list[str]] = {}
        for kind, text in grouped.get(row["code"], []):
            by_kind.setdefault(kind, []).append(text)
        for kind, texts in by_kind.items():
            sections.append((NOTE_HEADINGS.get(kind, kind), "; ".join(texts) + "."))
        documents.append(Document(doc_id=f"icd{version}:{row['dotted']}", corpus=corpus, source_format="icd",
                                  title=title, sections=sections, meta={"code": row["code"],
                                                                        "billable": row["billable"]}))
    return documents


@dataclass(frozen=True)
class Definition:
    code: str
    doc_id: str
    title: str
    text: str


class Dictionary:
    """Exact code lookups (no index needed) over the vocabulary frames."""

    def __init__(self, codes: pl.DataFrame, notes: pl.DataFrame):
        self._by_key: dict[str, Document] = {}
        for doc in icd_documents(codes, notes):
            code = doc.meta["code"]
            version = code.split("//")[2]
            raw = code.rsplit("//", 1)[-1]
            dotted = doc.doc_id.split(":", 1)[1]
            for key in (code, f"{version}:{raw}", f"{version}:{dotted}"):
                self._by_key[key.upper()] = doc

    def define(self, code: str, icd_version: int | None = None) -> Definition | None:
        """The definition of a MEDS code string, or of a raw/dotted code with its ICD version; None when the
        dictionary does not hold the code. Case, surrounding space and a dot in a MEDS code do not matter."""
        written = code.strip().upper()
        if written.startswith(("DIAGNOSIS//", "PROCEDURE//")):
            head, _, raw = written.rpartition("//")
            key = f"{head}//{raw.replace('.', '')}"
        elif icd_version is None:
            # Without the version a raw code is ambiguous (ICD-9 E880.9 and ICD-10 E88.09 are both 'E8809'),
            # and a lookup under 'None:' would report a known code as missing from the dictionary.
            raise InputError(f"ICD code {code!r} without its version: pass icd_version=9 or 10, or the MEDS code "
                             "(e.g. DIAGNOSIS//ICD//10//E119)")
        elif icd_version not in (9, 10):
            raise InputError(f"icd_version {icd_version} of code {code!r}: ICD versions are 9 and 10")
        else:
            key = f"{icd_version}:{written}"
        doc = self._by_key.get(key)
        if doc is None:
            return None
        return Definition(doc.meta["code"], doc.doc_id, doc.title, doc.text)
