"""The one query sanitizer: every query (web, local corpora, dictionary) passes through here.

It removes identifiers (MRN / subject / encounter / account numbers, long digit runs, phone and
SSN shapes, e-mail addresses, URLs), dates (ISO, numeric, month-name forms, times) and cuts any
run of more than `max_verbatim_words` consecutive words copied from the patient's record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dxr.errors import InputError
from tools.text import words

_MONTH = (r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|jun(?:e)?|jul(?:y)?|aug(?:ust)?|"
          r"sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)")
_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("url", re.compile(r"https?://\S+|www\.\S+", re.I)),
    ("email", re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b")),
    ("identifier", re.compile(r"\b(?:mrn|subject(?:_id)?|patient(?:_id)?|hadm(?:_id)?|encounter(?:_id)?|"
                              r"account|acct|record|id|ssn|dob)\s*(?:#|no\.?|number|id)?\s*[:=#]?\s*[A-Za-z]*\d[\w-]*",
                              re.I)),
    ("date", re.compile(r"\b\d{4}-\d{1,2}-\d{1,2}(?:[ T]\d{1,2}:\d{2}(?::\d{2})?)?\b")),
    ("date", re.compile(r"\b\d{1,2}[/.-]\d{1,2}[/.-]\d{2,4}\b")),
    ("date", re.compile(rf"\b{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{2,4}}\b", re.I)),
    ("date", re.compile(rf"\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}\.?,?\s+\d{{2,4}}\b", re.I)),
    ("date", re.compile(rf"\b{_MONTH}\.?\s+(?:19|20)\d{{2}}\b", re.I)),
    ("date", re.compile(r"\b(?:19|20)\d{2}\b")),
    ("date", re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\s*(?:am|pm)?\b", re.I)),
    ("identifier", re.compile(r"\b\d{3}-\d{2}-\d{4}\b|\(?\b\d{3}\)?[ .-]\d{3}[ .-]\d{4}\b")),
    # Five or more digits in a row are never clinical vocabulary: record, account or lab ids.
    ("identifier", re.compile(r"\b[A-Za-z]*\d{5,}[\w-]*\b")),
]


@dataclass
class SanitizedQuery:
    text: str
    removed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.removed)


def sanitize_query(query: str, patient_text: str | None = None, max_verbatim_words: int = 6,
                   forbidden: tuple[str, ...] = ()) -> SanitizedQuery:
    """Clean one query; `patient_text` (the pre-target record) enables verbatim-span detection and
    `forbidden` names literal strings (e.g. the subject id) that must never leave the process.

    >>> sanitize_query("MRN 12345678 heart failure readmission 2019-03-04").text
    'heart failure readmission'
    """
    removed: list[tuple[str, str]] = []
    text = query
    for literal in forbidden:
        if literal and literal.lower() in text.lower():
            removed.append(("identifier", literal))
            text = re.sub(re.escape(literal), " ", text, flags=re.I)
    for kind, pattern in _PATTERNS:
        for match in pattern.findall(text):
            removed.append((kind, match if isinstance(match, str) else match[0]))
        text = pattern.sub(" ", text)
    tokens = text.split()
    if patient_text:
        tokens, spans = _cut_verbatim(tokens, patient_text, max_verbatim_words)
        removed.extend(("verbatim", span) for span in spans)
    cleaned = " ".join(tokens).strip(" ,;:-")
    if not words(cleaned):
        raise InputError(f"query {query!r} has nothing left after removing identifiers, dates and verbatim "
                         "record spans: phrase it with clinical terms only")
    return SanitizedQuery(cleaned, removed)


def _cut_verbatim(tokens: list[str], patient_text: str, limit: int) -> tuple[list[str], list[str]]:
    """Drop the words past `limit` of every query run that appears word-for-word in the record."""
    record = words(patient_text)
    grams = {tuple(record[i:i + limit + 1]) for i in range(len(record) - limit)}
    norm = [tuple(words(t)) for t in tokens]
    keep = [True] * len(tokens)
    spans = []
    flat: list[tuple[str, int]] = [(w, i) for i, ws in enumerate(norm) for w in ws]
    i = 0
    while i + limit < len(flat):
        if tuple(w for w, _ in flat[i:i + limit + 1]) in grams:
            # Extend the copied run as far as it goes, then keep only its first `limit` words.
            end = i + limit + 1
            while end < len(flat) and tuple(w for w, _ in flat[end - limit:end + 1]) in grams:
                end += 1
            cut = {token for _, token in flat[i + limit:end]}
            spans.append(" ".join(w for w, _ in flat[i:end]))
            for token in cut:
                keep[token] = False
            i = end
        else:
            i += 1
    return [t for t, k in zip(tokens, keep) if k], spans
