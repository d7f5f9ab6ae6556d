"""Query-focused passage extraction: the best window of consecutive sentences for a query."""

from __future__ import annotations

from tools.corpus.documents import split_sentences
from tools.text import match_terms

DEFAULT_PASSAGE_CHARS = 700


def focused_passage(query: str, text: str, max_chars: int = DEFAULT_PASSAGE_CHARS) -> str:
    """The window of whole sentences (at most `max_chars`) covering the most distinct query terms,
    then the most mentions; ties go to the earliest window, whose leading sentences without any
    query term are dropped. A text without sentences is cut at `max_chars`.

    >>> focused_passage("dialysis", "Intro here. Kidney failure often needs dialysis. Unrelated end.", 60)
    'Kidney failure often needs dialysis.'
    """
    sentences = split_sentences(text)
    if not sentences:
        return text[:max_chars]
    # Hyphens read as spaces, as the support cue reads this passage: '30-day' in the text states '30 day'.
    wanted = set(match_terms(query))
    sentence_terms = [set(match_terms(s)) & wanted for s in sentences]
    best_score, best = (-1, 0), (0, 1)
    for start in range(len(sentences)):
        covered: set[str] = set()
        hits = 0
        length = 0
        for end in range(start, len(sentences)):
            length += len(sentences[end]) + (1 if end > start else 0)
            if length > max_chars and end > start:
                break
            covered |= sentence_terms[end]
            hits += len(sentence_terms[end])
            # Prefer covering more distinct terms, then more mentions; a window only grows when it gains.
            score = (len(covered), hits)
            if score > best_score:
                best_score, best = score, (start, end + 1)
    start, end = best
    while start < end - 1 and not sentence_terms[start]:
        start += 1  # leading sentences without a query term add no focus
    passage = " ".join(sentences[start:end])
    return passage[:max_chars]
