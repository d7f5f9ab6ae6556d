"""The one query sanitizer: every query (web, local corpora, dictionary) passes through here.

It removes identifiers (MRN / subject / encounter / account / case numbers, with or without an
alphabetic prefix, long digit runs, phone and SSN shapes, e-mail addresses, URLs), dates (numeric
with or without a year, month names with a day or a year in any order, times) and cuts any run of
more than `max_verbatim_words` consecutive words copied from the patient's record. The words that
served only what was removed go with it, so none dangles: a time word or label before a date ("seen
on 3/14" -> "seen", "DOB: 3/14/1950", "born in 1882"), any preposition before an identifier
("admitted on MRN 12345 with chest pain" -> "admitted with chest pain"), the open end of a range
("smoker from 2019 to present" -> "smoker"), a conjunction left with one side, brackets left empty,
and a preposition ending the words a verbatim cut keeps. An age over 89 becomes "90+" (an identifier too).
Clinical numbers stay: codes (N18.4), doses (500 mg), stages, ranges (15-29), "30-day", "COVID-19".
"""

from __future__ import annotations

import re
import reprlib
import unicodedata
from dataclasses import dataclass, field

from dxr.errors import InputError
from tools.text import words

_MONTH = (r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|jun(?:e)?|jul(?:y)?|aug(?:ust)?|"
          r"sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)(?![a-z])")
# Without a year a month name needs more care: the lower-case 'may' is the verb ("stage 3 may progress").
_MONTH_NO_YEAR = _MONTH.replace("|may|", "|(?-i:May|MAY)|")
_DAY = r"(?:0?[1-9]|[12]\d|3[01])(?:st|nd|rd|th)?\b"
# A day before its month may carry its article ("the 14th of March"): the article goes with the date.
_THE_DAY = rf"(?:the\s+)?{_DAY}"
# A number followed by a unit or a count noun is a dose or a size, not a year ("metformin 2000 mg"). The bare year is
# matched with case, so the units' usual capitals are spelled out ("2000 mL", "2000 IU"); not every upper-case form,
# as "MG" is also myasthenia gravis, "CC" a chief complaint and "L" left ("diagnosed 2019 MG" loses its year).
_NOT_A_QUANTITY = (r"(?!\s*(?:%|(?:mg|mcg|[µu]g|ng|g|kg|ml|mL|dl|dL|l|cc|iu|IU|u|units?|Units?|mmol|meq|mEq|kcal|"
                   r"patients|cells)\b))")
# Years 1800-2299: besides real dates, MIMIC shifts every date into 2100-2200 (and the birth years of the
# oldest patients into the 1800s), and the history a query is written from shows those years.
_CENTURY = r"(?:1[89]|2[0-2])"
_YEAR = rf"{_CENTURY}\d{{2}}\b{_NOT_A_QUANTITY}"
_SEP = r"[\s/.-]"
# Record-number words: any number after them is an identifier ("MRN 12", "subject 7", "hadm_id=29079034").
_ID_WORDS = r"mrn|hadm(?:_id)?|subject(?:_id)?|(?:patient|stay|note|encounter|transfer)_id|acct|ssn|accession"
# Words that also occur in clinical prose: a plain number after them is an identifier unless it is a dose
# ("patient 500 mg") or a hyphenated adjective ("encounter 30-day"); a number with letters must have three or
# more digits, so "patient type 2 diabetes", "patient COVID-19" and "patient HbA1c" stay.
_ID_NOUNS = r"patient|encounter|account|record|case|id"
_ID_LABEL = r"\s*(?:#|no\.?|number|id)?\s*[:=#]?\s*"
# An identifier may carry an alphabetic prefix: "AB1234", "AB-1234", or upper case and a space, "AB 1234".
_ID_PREFIX = r"(?:[A-Za-z]+-?|(?-i:[A-Z]{1,4})\s)?"
# Prepositions that take a noun: the words an identifier can be the object of ("admitted on MRN 12345").
_PREPOSITIONS = ("about", "after", "against", "among", "around", "as", "at", "before", "between", "by", "concerning",
                 "during", "for", "from", "in", "into", "of", "on", "onto", "over", "per", "regarding", "since",
                 "through", "till", "to", "toward", "towards", "under", "until", "via", "with", "within", "without")
# Words that start a new phrase: a date followed by one of them (or by punctuation, or the end) ends its phrase.
_PHRASE_STARTS = _PREPOSITIONS + ("and", "or", "but", "nor", "than", "vs", "versus", "when", "while", "because",
                                  "who", "which", "that", "whose", "where")
_PHRASE_END = rf"(?=\s*(?:[,;.:!?)\]]|$)|\s+(?:{'|'.join(_PHRASE_STARTS)})\b)"
# Words that cannot end what the verbatim cut keeps: they served the words after them.
_DANGLING_AT_A_CUT = frozenset(_PHRASE_STARTS + ("a", "an", "the"))
# An ordinal alone is a day of the month only in the idioms "on the 3rd", "by the 3rd", "since the 3rd" ending their
# phrase (with the days joined to it: "on the 3rd and the 4th"); before a noun it counts ("relapse after the 3rd
# cycle", "on the 3rd troponin").
_ORDINAL = r"(?:0?[1-9]|[12]\d|3[01])(?:st|nd|rd|th)\b"
_ORDINAL_DAY = (r"(?:(?<=\bon\s)|(?<=\bby\s)|(?<=\bsince\s)|(?<=\buntil\s)|(?<=\btill\s))the\s+"
                rf"{_ORDINAL}(?:\s*(?:,|and|or|to|-)\s*(?:the\s+)?{_ORDINAL})*(?:\s+of\s+the\s+month\b)?{_PHRASE_END}")
_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("url", re.compile(r"https?://\S+|www\.\S+", re.I)),
    # From the start of its run of name characters only: tried at each word boundary inside a long run with no '@'
    # ("1-1-1-..."), the name would be read to its end from every one of them.
    ("email", re.compile(r"(?<![\w.+-])(?=[.+-]*\w)[\w.+-]+@[\w-]+\.[\w.-]+\b")),
    ("identifier", re.compile(rf"\b(?:{_ID_WORDS}){_ID_LABEL}{_ID_PREFIX}\d[\w-]*", re.I)),
    ("identifier", re.compile(rf"\b(?:{_ID_NOUNS}){_ID_LABEL}(?:\d+(?![\w-]|\.\d)|{_ID_PREFIX}\d{{3,}}[\w-]*\b)"
                              rf"{_NOT_A_QUANTITY}", re.I)),
    # Numeric dates: year first (ISO, with an optional time), day or month first with a year, month/day.
    ("date", re.compile(r"\b\d{4}[/.-]\d{1,2}[/.-]\d{1,2}(?:[ T]\d{1,2}:\d{2}(?::\d{2})?)?\b")),
    # One separator throughout: "7.5/10" is a score, not a date.
    ("date", re.compile(r"\b\d{1,2}([/.-])\d{1,2}\1\d{2,4}\b")),
    # Only '/' without a year: "3/14"; "15-29" and "30-day" are ranges, "120/80" has no month.
    ("date", re.compile(r"(?<![\w./])(?:0?[1-9]|1[0-2])/(?:0?[1-9]|[12]\d|3[01])(?![\w/%]|[.,]\d)")),
    # Numeric month and year: "2019-03", "03/2180" (a bare year alone is removed below, the month would stay).
    ("date", re.compile(rf"\b{_CENTURY}\d{{2}}([/.-])(?:0?[1-9]|1[0-2])\b(?!\1\d)")),
    ("date", re.compile(rf"(?<![\w./-])(?:0?[1-9]|1[0-2])([/.-]){_CENTURY}\d{{2}}\b(?!\1\d)")),
    # Month names: with a year in every order, then day and month alone.
    ("date", re.compile(rf"\b{_CENTURY}\d{{2}}{_SEP}+{_MONTH}\.?{_SEP}+{_DAY}", re.I)),
    ("date", re.compile(rf"\b{_MONTH}\.?{_SEP}*{_DAY},?{_SEP}+\d{{2,4}}\b", re.I)),
    ("date", re.compile(rf"\b{_THE_DAY}(?:\s+of)?{_SEP}*{_MONTH}\.?,?{_SEP}+\d{{2,4}}\b", re.I)),
    ("date", re.compile(rf"\b{_MONTH}\.?,?{_SEP}+{_YEAR}", re.I)),
    ("date", re.compile(rf"\b{_MONTH_NO_YEAR}\.?{_SEP}*{_DAY}", re.I)),
    ("date", re.compile(rf"\b{_THE_DAY}(?:\s+of)?{_SEP}*{_MONTH_NO_YEAR}\.?", re.I)),
    ("date", re.compile(_ORDINAL_DAY, re.I)),
    ("date", re.compile(rf"\b{_YEAR}")),
    # Times, also glued to a preceding 'T' as in ISO timestamps ("T20:15"); "1:1000" is a dilution.
    ("date", re.compile(r"(?:\bT|(?<![\w:.]))\d{1,2}:\d{2}(?::\d{2})?(?![\d:])(?:\s*[ap]\.?m\b\.?)?", re.I)),
    ("identifier", re.compile(r"\b\d{3}-\d{2}-\d{4}\b|\(?\b\d{3}\)?[ .-]\d{3}[ .-]\d{4}\b")),
    # Five or more digits in a row are never clinical vocabulary: record, account or lab ids.
    ("identifier", re.compile(r"\b[A-Za-z]*\d{5,}[\w-]*\b")),
]
# An age over 89 is an identifier (HIPAA's safe harbour lists it with dates): a query keeps it as "90+" ("93-year-old"
# -> "90+-year-old", "aged 95" -> "aged 90+", "101 yo" -> "90+ yo"). Ages in days, weeks or months are not meant. The
# look-behinds read single spaces, which the text has when this runs. Before a unit the number needs no word boundary:
# notes write "94yo", "94y/o" and "94yr old" as often as "94 yo".
_OLD_AGE = r"(?:9\d|1[0-4]\d)"
# A "+" already written after the age goes with it ("age 95+" -> "age 90+").
_AGE_LABELS = "|".join(rf"(?<=\b{label})" for label in ("age ", "aged ", "age:", "age: ", "age :", "age : ", "age=",
                                                        "age= ", "age =", "age = "))
_AGES_OVER_89 = re.compile(
    rf"(?:{_AGE_LABELS}){_OLD_AGE}\b\+?"
    r"(?!\.\d|\s*(?:%|-?\s*(?:days?|d|weeks?|wks?|w|months?|mos?|m|hours?|hrs?|h)\b))"
    rf"|\b{_OLD_AGE}\+?(?=\s*-?\s*(?:years?|yrs?|y)\s*-?\s*old\b|\s*-?\s*(?:yo|y/o|y\.o\.?)(?![\w/])"
    r"|\s*-?\s*years?\s+of\s+age\b)", re.I)
# What a removal can leave behind between words: a lone colon, slash, hyphen or dash, "at" sign or ampersand.
_LEFTOVER = re.compile(r"[-/.,;:#=@&–—]+")
# Brackets that held only what was removed ("copd (MRN 12345) heart failure" would keep "( )").
_EMPTY_BRACKETS = re.compile(r"[(\[][-\s/.,;:#=@&–—]*[)\]]")
# Stand in for a removed date or identifier until the words that served only to introduce it are gone too
# (private-use characters, as is the mark of where a removal was: no query means them).
_DATE_GAP = "\ue000"
_IDENTIFIER_GAP = "\ue001"
# A preposition right before a removed date was there for the date ("seen on 3/14", "since May 2019", "at 8:30pm",
# "between 2018 and 2019", "prior to 2019", "on or after 3/14"): left alone it would dangle ("seen on"). Only these
# time words, and only right before the date, so "on warfarin since 2019" keeps its "on". A participle that only
# introduces the date goes too ("starting on 3/14"), and so does a label that names it ("DOB: 3/14/1950",
# "note dated 3/14", "admission date: 3/14" -> "admission").
_TIME_PREPOSITION_PHRASES = ("as of", "as at", "as from", "on", "at", "in", "since", "from", "between", "until", "till",
                             "through", "by", "before", "after", "during", "around", "circa", "prior to", "up to",
                             "no later than", "no earlier than", "no sooner than", "later than", "earlier than",
                             "sooner than")


def _chain(phrases: tuple[str, ...]) -> str:
    """Prepositions joined by 'or'/'and' ("on or after"), matched only from the first one of a chain.

    Started at each word of a long chain that no removal follows ("on or at or in or ..."), the regex would read the
    rest of the chain from every one of them: quadratic. A later word adds nothing, since the chain from the first
    word ends at the same places, so a word after a preposition and 'or'/'and' does not start one, nor does a word
    inside a phrase of several ("at" of "as at", "to" of "up to", "later than" of "no later than": the phrase from its
    first word ends where they do). Look-behinds have a fixed width, so there is one per width; they read single
    spaces, which the text has when this runs.
    """
    by_width: dict[int, list[str]] = {}
    for phrase in phrases:
        for conjunction in ("or", "and"):
            before = f"{phrase} {conjunction} "
            by_width.setdefault(len(before), []).append(re.escape(before))
    not_inside = "".join(rf"(?<!\b(?:{'|'.join(befores)}))" for befores in by_width.values())
    # No phrase extends a later part of another ("at" of "as at" is no "at ..." phrase's start), or the chain from the
    # later word could end elsewhere than the chain from the first.
    extending = [(phrase, other) for phrase in phrases for other in phrases
                 if any(other.startswith(f"{part} ") for part in _later_parts(phrase))]
    assert not extending, f"phrases extending a later part of another: {extending}"
    not_within = "".join(rf"(?!(?<=\b{re.escape(phrase[:-len(part)])}){re.escape(part)}\b)"
                         for phrase in phrases for part in _later_parts(phrase))
    element = "|".join(re.escape(phrase).replace(r"\ ", r"\s+") for phrase in phrases)
    return rf"\b{not_inside}{not_within}(?:{element})(?:\s+(?:or|and)\s+(?:{element}))*"


def _later_parts(phrase: str) -> list[str]:
    """The ends of a phrase of several words that start at its second word or later: "no later than" -> "later than",
    "than"."""
    words = phrase.split(" ")
    return [" ".join(words[i:]) for i in range(1, len(words))]


_TIME_PREPOSITIONS = _chain(_TIME_PREPOSITION_PHRASES)
_TIME_PARTICIPLE = r"effective|starting|beginning|commencing|ending"
# "born" is a label too ("born in 1882"), but not the end of a word such as "first-born".
_DATE_LABEL = r"dob|d\.o\.b\.?|date\s+of\s+birth|birth\s*date|year\s+of\s+birth|birth\s*year|(?<!-)born|dated|date"
# "date of admission: 3/14" keeps the event it dates: "admission".
_DATE_OF_EVENT = re.compile(rf"\bdate\s+of\s+(?!birth\b)([^\W\d_]+)\s*[:=]?\s*(?={_DATE_GAP})", re.I)
# A word placing the time within the date goes with it: "in early 2019", "on the 2019-03-14", "mid-2019", "in the
# year 2019", "by the end of 2019", "in the spring of 2019", "on Monday, 3/14". The guard keeps "5-year 2019".
_WEEKDAY = r"(?:mon|tues|wednes|thurs|fri|satur|sun)day|(?-i:Mon|Tue|Tues|Wed|Thu|Thur|Thurs|Fri|Sat|Sun)\.?"
_PART_OF_A_PERIOD = (r"start|beginning|middle|end|first\s+half|second\s+half|spring|summer|autumn|fall|winter|"
                     r"year|month")
_WITHIN_THE_DATE = (r"(?<![\w-])(?:the\s+(?:year\s+)?)?"
                    rf"(?:(?:(?:early|mid|late)[\s-]+)?(?:{_PART_OF_A_PERIOD})\s+of\s+(?:the\s+)?)?"
                    rf"(?:(?:early|mid|late|spring|summer|autumn|winter)[\s-]+)?(?:(?:{_WEEKDAY}),?\s+)?")
# One removal, or several joined by commas, "and", "or", "to" or a dash ("3/14, 3/15 and 3/16", "2018-2019",
# "555-123-4567 or bob@example.org").
_ONE_GAP = rf"(?:{_WITHIN_THE_DATE}{_DATE_GAP}|{_IDENTIFIER_GAP})"
_GAP = rf"{_ONE_GAP}(?:\s*(?:,|&|and|or|to|until|till|through|[-–—])?\s*{_ONE_GAP})*"
# A range from a removed date to now loses its open end too: "from 2019 to present", "since 2019 until now",
# "2019-present", "2019 onwards", "2019 or later", "between 2018 and today". After a word that opens the range
# "to present" is its end whatever follows; otherwise "seen 3/14 to present with fever" means the verb.
_OPEN_END = r"(?:the\s+)?(?:present(?:\s+(?:day|time))?|now|today|date|current)\b"
_TO_OPEN_END = rf"\s*(?:(?:to|until|till|through|thru|up\s+to)\s+|[-–—]\s*){_OPEN_END}"
_AFTER_THE_DATE = r"\s+(?:onwards?|forwards?|(?:and|or)\s+(?:after|later|beyond)|or\s+(?:before|earlier|sooner))\b"
_RANGE_OPENER = rf"(?:(?:{_TIME_PARTICIPLE})\s+)?(?:from|since|between)|starting|beginning|commencing|effective"
_RANGE_END = rf"(?:{_TO_OPEN_END}|\s+and\s+{_OPEN_END}|{_AFTER_THE_DATE})?"
_GUARDED_RANGE_END = rf"(?:{_TO_OPEN_END}(?!\s+(?:with|as)\b)|{_AFTER_THE_DATE})?"
# "for", "to" and "of" introduce a date only when the date ends the phrase ("scheduled for 3/14", "admission of
# March 2019 for sepsis"); before another word the date is an adjective and the preposition serves that word
# ("history of 2019 stroke" -> "history of stroke").
_PHRASE_END_PREPOSITION = r"for|to|of"
# An identifier is never an adjective: any preposition right before it was there for it ("admitted on MRN 12345
# with chest pain", "sepsis for patient 12345", "contact at bob@example.org"), and so was a record word linked to
# it ("MRN is 12345").
# Each word once: one matched by two alternatives doubles, at every word of a chain ("on or at or in or ..."), the ways
# the regex retries when no identifier follows, which took minutes on a query of 30 words.
_IDENTIFIER_PREPOSITIONS = _chain(_TIME_PREPOSITION_PHRASES
                                  + tuple(word for word in _PREPOSITIONS if word not in _TIME_PREPOSITION_PHRASES))
# Each removal with its words, tried in this order at each place: a range opened before a date (its open end goes
# whatever follows), an identifier with any preposition or record word before it, "for"/"to"/"of" before a date
# ending its phrase, a date with its participle and time words, a date with its label and time words ("born in").
_REMOVAL_WITH_ITS_WORDS = re.compile(
    rf"\b(?:{_RANGE_OPENER})\s+{_GAP}{_RANGE_END}"
    rf"|(?:{_IDENTIFIER_PREPOSITIONS}\s+)?(?:\b(?:{_ID_WORDS})\s*(?:(?:is|was|of)\s+|[:=#]\s*)?)?"
    rf"(?={_IDENTIFIER_GAP}){_GAP}{_GUARDED_RANGE_END}"
    rf"|\b(?:{_PHRASE_END_PREPOSITION})\s+{_GAP}{_GUARDED_RANGE_END}{_PHRASE_END}"
    rf"|(?:\b(?:{_TIME_PARTICIPLE})\s+)?(?:{_TIME_PREPOSITIONS}\s+)?{_GAP}{_GUARDED_RANGE_END}"
    rf"|\b(?:{_DATE_LABEL})\s*[:=]?\s*(?:{_TIME_PREPOSITIONS}\s+)?{_GAP}{_GUARDED_RANGE_END}", re.I)
# Where a removal with its words was, until a conjunction it leaves without one of its sides is gone too:
# "heart failure and MRN 12345 with fever", "CKD and 2019", "MRN 12345 and sepsis", "sepsis, 2019 and CKD". A comma
# between the two goes with the conjunction: "sepsis, MRN 12345, and culture" -> "sepsis, culture".
_REMOVED = "\ue002"
_CONJUNCTION = r"and|or|but|nor"
_DANGLING_CONJUNCTION = re.compile(
    rf"\b(?:{_CONJUNCTION})\s*,?\s+{_REMOVED}(?:\s*{_REMOVED})*{_PHRASE_END}"
    rf"|(?:^|(?<=[,;:(\[]))\s*{_REMOVED}(?:\s*{_REMOVED})*\s*,?\s+(?:{_CONJUNCTION})\b", re.I)
# A removal set off by commas after a conjunction was an aside, and its commas go with it, while the conjunction keeps
# its sides: "sepsis and, MRN 12345, culture" -> "sepsis and culture". Where the phrase ends after it, the conjunction
# lost a side and goes too ("sepsis and, MRN 12345." -> "sepsis").
_ASIDE_AFTER_A_CONJUNCTION = re.compile(
    rf"\b({_CONJUNCTION})\s*,\s*{_REMOVED}(?:\s*{_REMOVED})*(?:\s*,)?(?!{_PHRASE_END})", re.I)

# Each pass takes what the one before brought together, and the last finds nothing: a query needs at most three ("Mar
# 12345 14"), unless it nests dates in dates ("14 14 12345 Mar Mar" needs four), one more pass for each level. Each
# pass reads the whole query, so nesting a level every few words would take time quadratic in its length: such a query
# is refused instead.
_MOST_PASSES = 5


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
    >>> sanitize_query("heart failure admitted on or after 2019-03-04, prior to dialysis").text
    'heart failure admitted prior to dialysis'
    >>> sanitize_query("admitted on MRN 12345 with chest pain, smoker from 2019 to present").text
    'admitted with chest pain, smoker'
    """
    removed: list[tuple[str, str]] = []
    text = _visible(query)
    for literal in forbidden:
        if literal and literal.lower() in text.lower():
            removed.append(("identifier", literal))
            text = re.sub(re.escape(literal), f" {_IDENTIFIER_GAP} ", text, flags=re.I)
    # Again until nothing matches: a removal brings together what stood on either side of it, and that may be a
    # date ("Mar 12345 14" is "Mar 14" once the identifier is gone).
    for _ in range(_MOST_PASSES):
        text, found = _remove_once(text, removed)
        if not found:
            break
    else:
        raise InputError(f"query {reprlib.repr(query)} ({len(query):,} characters) still shows a new date or "
                         f"identifier after {_MOST_PASSES} passes, each joining the words around what the one before "
                         "removed: phrase it with clinical terms only")
    text = " ".join(text.split())
    removed.extend(("age", match.group(0)) for match in _AGES_OVER_89.finditer(text))
    text = _AGES_OVER_89.sub("90+", text)
    text = _EMPTY_BRACKETS.sub(" ", text)
    tokens = [token for token in text.split() if not _LEFTOVER.fullmatch(token)]
    if patient_text:
        tokens, spans = _cut_verbatim(tokens, patient_text, max_verbatim_words)
        removed.extend(("verbatim", span) for span in spans)
    cleaned = " ".join(tokens).strip(" ,;:-")
    if not words(cleaned):
        raise InputError(f"query {query!r} has nothing left after removing identifiers, dates and verbatim "
                         "record spans: phrase it with clinical terms only")
    return SanitizedQuery(cleaned, removed)


def _visible(query: str) -> str:
    """The query without invisible characters: a zero-width space or a private-use character inside a date or an
    identifier ("3/\u200b14/2019") would hide it from every pattern, and a private-use one could pose as the gaps
    this module marks removals with."""
    return "".join(char for char in query if unicodedata.category(char) not in ("Cf", "Co"))


def _remove_once(text: str, removed: list[tuple[str, str]]) -> tuple[str, bool]:
    """One pass of every pattern, then the words that served what they removed; says whether a pattern matched."""
    found = False
    # One space between words, as the fixed-width look-behinds of the ordinal day expect ("on the 3rd").
    text = " ".join(text.split())
    for kind, pattern in _PATTERNS:
        matches = [" ".join(match.group(0).split()) for match in pattern.finditer(text)]
        if matches:
            found = True
            removed.extend((kind, match) for match in matches)
            text = pattern.sub(f" {_DATE_GAP if kind == 'date' else _IDENTIFIER_GAP} ", text)
    # Single spaces again, as the look-behinds of a preposition chain expect.
    text = " ".join(_DATE_OF_EVENT.sub(r"\1 ", text).split())
    text = _ASIDE_AFTER_A_CONJUNCTION.sub(r"\1 ", _REMOVAL_WITH_ITS_WORDS.sub(f" {_REMOVED} ", text))
    return _DANGLING_CONJUNCTION.sub(" ", text).replace(_REMOVED, " "), found


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
            # What is kept must not end on a word that served the words cut ("stable on" of "stable on warfarin").
            kept_end = i + limit
            while kept_end > i and flat[kept_end - 1][0] in _DANGLING_AT_A_CUT:
                kept_end -= 1
            cut = {token for _, token in flat[kept_end:end]}
            spans.append(" ".join(w for w, _ in flat[i:end]))
            for token in cut:
                keep[token] = False
            i = end
        else:
            i += 1
    return [t for t, k in zip(tokens, keep) if k], spans
