"""Small text helpers shared by retrieval, passage extraction, support cues and the sanitizer."""

from __future__ import annotations

import re

# Letters and digits of any script (`[^\W_]`): 'Sjögren' and 'β-thalassemia' are words, as in the index.
_WORD = re.compile(r"[^\W_]+(?:[-'][^\W_]+)*")

# Function words carry no retrieval signal; medical short forms (e.g. 'ca', 'mi') are kept.
STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have having
he her here hers him his how i if in into is it its itself just me more most my no nor not of off on once
only or other our out over own same she should so some such than that the their them then there these
they this those through to too under until up very was we were what when where which while who whom why
will with would you your yours
""".split())


def words(text: str) -> list[str]:
    """Lower-cased word tokens (hyphenated and apostrophe words kept whole).

    >>> words("Type-2 diabetes, HbA1c >= 7%; Sjögren")
    ['type-2', 'diabetes', 'hba1c', '7', 'sjögren']
    """
    return [w.lower() for w in _WORD.findall(text or "")]


def stem(word: str) -> str:
    """A crude suffix stripper so 'failures'/'failure', 'recurrent'/'recurrence' and 'infected'/'infectious'/
    'infection' meet.

    >>> [stem(w) for w in ["failures", "recurrence", "recurrent", "infections", "infected", "infectious"]]
    ['failur', 'recurr', 'recurr', 'infect', 'infect', 'infect']
    >>> [stem(w) for w in ["hospitalized", "hospitalization", "need", "bleed", "nervous"]]
    ['hospitaliz', 'hospitaliz', 'need', 'bleed', 'nerv']
    """
    for suffix in ("ations", "ation", "ences", "ence", "ents", "ent", "ions", "ion", "ious", "ous", "ing", "ies", "ed",
                   "es", "s", "e"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            return word[: -len(suffix)]
    return word


def content_terms(text: str) -> list[str]:
    """Stemmed words without stopwords, in order."""
    return [stem(w) for w in words(text) if w not in STOPWORDS]


def match_terms(text: str) -> list[str]:
    """Content terms with hyphens read as spaces, for matching a query's terms in a text: 'heart-failure' and
    '30-day' are single words elsewhere, yet a text writing 'heart failure' or '30 day' (or the reverse) states
    the same term.

    >>> match_terms("30-day heart-failure readmissions")
    ['30', 'day', 'heart', 'failur', 'readmiss']
    """
    return content_terms((text or "").replace("-", " "))
