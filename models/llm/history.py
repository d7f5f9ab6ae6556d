"""The readable text of a pre-target record H, and how it shrinks to fit a prompt.

H reads as demographics (sex, birth year, the other static rows: no time, no encounter), then a timeline from
oldest to newest: each earlier encounter, with the events recorded outside any encounter (outpatient labs, notes)
in a block of their own between the encounters they fall between, one line per day and kind. An event without an
encounter within an encounter's stay (a pharmacy order, an ED draw, from the ED registration that led into it on)
is that encounter's, placed as the EHR prior places it (`models.stays.within_stays`). Only `pretarget_events` rows
are rendered, so whatever H excludes (the target encounter) cannot appear.

`fit_history` shortens H to a character budget by giving up the least informative text first
(`DROP_STEPS`); the diagnoses of an encounter go only with the whole encounter, after everything else.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from itertools import groupby

import polars as pl

from models.stays import has_loose_events, stay_spans, within_stays
from warehouse.vocab import dotted, dotted_procedure, parse_meds_code

# Line labels of the event kinds, in the order an encounter lists them (notes follow, one line each).
LABELS = {"diagnosis": "Diagnoses", "procedure": "Procedures", "medication": "Medications", "lab": "Labs",
          "other": "Other"}
MEDS_KINDS = {"DIAGNOSIS": "diagnosis", "PROCEDURE": "procedure", "MEDICATION": "medication", "LAB": "lab",
              "NOTE": "note"}
# Continuation lines of a note sit deeper than any line of the record's own structure (titles at column 0,
# event lines at column 2), so note text cannot pass for an encounter or an event line.
NOTE_INDENT = " " * 4

# What gives way when H is over budget, step by step, oldest first within a step: (recent?, kinds).
# "Recent" is the newest encounter and whatever follows it; everything before it is older. Diagnoses are
# not here: they go last, with their whole block, oldest block first.
DROP_STEPS = ((False, {"note"}), (False, {"lab"}), (True, {"lab"}), (True, {"note"}),
              (False, {"medication", "procedure", "other"}), (True, {"medication", "procedure", "other"}))
# A note that would keep fewer characters than this is dropped whole rather than shortened.
MIN_NOTE_CHARS = 200
# The longest text value of a lab or other code that is shown whole (a DRG's description, an OMR reading fit); a
# longer free text keeps its beginning, so that one event cannot take the room of many.
MAX_VALUE_CHARS = 80
# A text value of underscores only: MIMIC-IV's de-identification mask, no value at all.
MASK = re.compile("_+")
# The unit part of a lab code that names no unit: MEDS-Extract's `UNK`, the MIMIC importers' `no unit`.
NO_UNIT = ("UNK", "no unit")
# The longest header line of undated facts (demographics beyond sex and birth, as race or language): the header is
# never shortened to fit, so a record with many undated rows must not crowd out its encounters.
MAX_UNDATED_CHARS = 240
# How the marker counts what it omitted, in this order: kind -> (singular, plural).
NOUNS = {"encounter": ("earlier encounter", "earlier encounters"), "diagnosis": ("diagnosis", "diagnoses"),
         "procedure": ("procedure", "procedures"), "medication": ("medication", "medications"),
         "other": ("other event", "other events"), "lab": ("lab result", "lab results"), "note": ("note", "notes")}


@dataclass(frozen=True)
class Line:
    """One line under a block's title: `head`, then the items of one kind ("; "-separated), or one note's text.

    `mark` is set only on a line shortened to fit: a note keeps its beginning and its end with the mark
    between them (the end of a discharge summary holds its diagnoses and plans); a list keeps its newest
    items after the mark.
    """

    kind: str
    head: str
    items: tuple[str, ...]
    mark: str = ""

    @property
    def text(self) -> str:
        if self.kind == "note":
            return self.head + self.mark.join(self.items)
        return self.head + self.mark + "; ".join(self.items)

    @property
    def count(self) -> int:
        return 1 if self.kind == "note" else len(self.items)

    def cut(self, limit: int) -> Line | None:
        """This line in at most `limit` characters, or None when too little of it would be left.

        >>> Line("lab", "  Labs: ", ("K 3.1", "K 3.9", "K 4.4")).cut(40).text
        '  Labs: [1 earlier omitted] K 3.9; K 4.4'
        """
        if self.mark:  # already shortened once: no second cut
            return None
        if self.kind == "note":
            body = self.items[0]
            mark = f" … [{len(body)} characters omitted] … "  # the longest it can be
            room = limit - len(self.head) - len(mark)
            if room < MIN_NOTE_CHARS:
                return None
            start, end = body[:room - room // 2], body[len(body) - room // 2:]
            return replace(self, items=(start, end), mark=f" … [{len(body) - room} characters omitted] … ")
        size = len(self.head) - 2
        for kept in range(len(self.items)):  # how many of the newest items fit after the mark
            size += len(self.items[-kept - 1]) + 2
            mark = f"[{len(self.items) - kept - 1} earlier omitted] "
            if size + len(mark) > limit:
                break
        else:
            return self
        if kept == 0:
            return None
        return replace(self, items=self.items[-kept:], mark=f"[{len(self.items) - kept} earlier omitted] ")


@dataclass(frozen=True)
class Block:
    """A title line (one encounter, or the events between two encounters) and its event lines."""

    title: str
    lines: tuple[Line, ...]
    encounter: bool = True

    @property
    def text(self) -> str:
        return "\n".join([self.title, *(line.text for line in self.lines)])


@dataclass(frozen=True)
class History:
    """A rendered pre-target record: a fixed header plus blocks from oldest to newest."""

    header: str
    blocks: list[Block]

    @property
    def text(self) -> str:
        return "\n\n".join([self.header, *(block.text for block in self.blocks)])


def _code_label(code: str, titles: dict[str, str | None]) -> str:
    """`I50.22 Chronic systolic heart failure` for an ICD code (a procedure code in its own form: `39.61`,
    `5A1D70Z`), else the code's last parts (a procedure's with its title: `CPT4 99213 Office visit`)."""
    try:
        kind, version, raw = parse_meds_code(code)
    except Exception:  # not an ICD code: show its readable tail
        tail = code.split("//", 1)[-1].replace("//", " ")
        title = None if code.startswith("DIAGNOSIS//") else _new_words(titles.get(code), tail)
        return f"{tail} {title}" if title else tail
    shown = dotted_procedure(version, raw) if kind == "PROCEDURE" else dotted(version, raw)
    title = titles.get(code)
    if title and kind != "DIAGNOSIS":  # a dataset's description of a procedure may span lines
        title = _one_line(title)
    return f"{shown} {title}" if title else shown


def _new_words(title: str | None, code_text: str) -> str | None:
    """The title on one line, or None when it tells nothing that `code_text` does not already say (the
    title `metformin` of `MEDICATION//NAME//metformin`)."""
    if not title or not title.strip():
        return None
    plain = " ".join(title.lower().split())
    return None if plain in " ".join(code_text.lower().split()) else _one_line(title)


def _medication_words(code: str) -> str:
    """An untitled medication code as words: the drug of a `NAME` or `NDC` code (the MIMIC importers'), else every
    part but `UNK`, so that MEDS-Extract's `MEDICATION//Furosemide//Administered` keeps its drug and
    `MEDICATION//STOP//Furosemide` says that the order stopped.

    >>> _medication_words("MEDICATION//NDC//00054829725"), _medication_words("MEDICATION//START//Heparin//UNK")
    ('00054829725', 'START Heparin')
    """
    parts = code.split("//")[1:]
    if len(parts) == 2 and parts[0] in ("NAME", "NDC"):
        return parts[1]
    return " ".join(part for part in parts if part != "UNK") or code


def _lab_parts(code: str) -> tuple[bool, str, str]:
    """(a specimen collection?, item, unit) of a lab code: `LAB//<item>//<unit>`, or in MEDS-Extract's newer MIMIC-IV
    ETL a result `LAB//RESULT//<item>//<unit>` (the values, at the store time) and a collection
    `LAB//SPECIMEN_COLLECTED//<item>` (no value, at the chart time); a unit the source left empty (`UNK`, the MIMIC
    importers' `no unit`) is none, so that a text-only result reads `Leukocytes (Urine) NEG`.

    >>> [_lab_parts(c) for c in ("LAB//50912//mg/dL", "LAB//RESULT//51508//UNK", "LAB//SPECIMEN_COLLECTED//51003")]
    [(False, '50912', 'mg/dL'), (False, '51508', ''), (True, '51003', '')]
    >>> _lab_parts("LAB//Leukocytes (Urine)//no unit")
    (False, 'Leukocytes (Urine)', '')
    """
    parts = code.split("//")[1:]
    if parts[:1] == ["SPECIMEN_COLLECTED"]:
        return True, " ".join(parts[1:]), ""
    parts = parts[1:] if parts[:1] == ["RESULT"] else parts
    if len(parts) < 2:
        return False, parts[0] if parts else code, ""
    return False, " ".join(parts[:-1]), "" if parts[-1] in NO_UNIT else parts[-1]


def _day(value) -> str:
    return value.strftime("%Y-%m-%d") if value is not None else "undated"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _bounded(text: str) -> str:
    """`text` on one line in at most `MAX_VALUE_CHARS` characters, its beginning when longer; nothing for MIMIC-IV's
    de-identification mask (`___`: the result's words are in `comments`, which is not imported).

    >>> _bounded("HEART FAILURE & SHOCK WITH MCC"), len(_bounded("word " * 40)), _bounded(" ___ ")
    ('HEART FAILURE & SHOCK WITH MCC', 80, '')
    """
    text = _one_line(text)
    if MASK.fullmatch(text):
        return ""
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 1] + "…"


def _note(time, code: str, text: str | None) -> Line:
    first, *rest = (text or "").replace("\r\n", "\n").replace("\r", "\n").strip().split("\n")
    body = "\n".join([first, *(NOTE_INDENT + line.rstrip() if line.strip() else "" for line in rest)])
    return Line("note", f"  Note [{code.split('//', 1)[-1]}, {_day(time)}] ", (body,))


def _other_item(code: str, value, text: str | None, titles: dict[str, str | None]) -> str:
    """A code of no kind of its own with its value, as a lab shows its own: `Blood Pressure 128/82`."""
    title = _new_words(titles.get(code), code)
    shown = f"{value:g}" if value is not None else _bounded(text or "")
    return _one_line(f"{title} ({code}) {shown}" if title else f"{code} {shown}")


def _undated_line(items: list[str]) -> str:
    """The header line of the undated facts `items`, its first items whole within `MAX_UNDATED_CHARS` when longer.

    >>> _undated_line(["RACE//WHITE", "LANGUAGE//ENGLISH"])
    'Recorded without a date: RACE//WHITE; LANGUAGE//ENGLISH'
    >>> line = _undated_line([f"FLAG//{i:03}" for i in range(40)])
    >>> len(line), line[-39:]
    (240, 'FLAG//016; FLAG//017; [22 more omitted]')
    """
    line = "Recorded without a date: " + "; ".join(items)
    for kept in range(len(items) - 1, 0, -1):
        if len(line) <= MAX_UNDATED_CHARS:
            break
        line = f"Recorded without a date: {'; '.join(items[:kept])}; [{len(items) - kept} more omitted]"
    return line


def _event_lines(events: list[tuple], titles: dict[str, str | None], prefix: str = "") -> list[Line]:
    """One line per kind of event (items in time order, repeats shown once), then one line per note, from `events`
    (time, code, numeric_value, text_value) in time order. A specimen's collection is left out where its result is
    among `events`."""
    groups: dict[str, list[str]] = defaultdict(list)
    notes = []
    resulted = {item for collected, item, _ in (_lab_parts(code) for _, code, _, _ in events
                                                if code.startswith("LAB//")) if not collected}
    for time, code, value, text in events:
        kind = MEDS_KINDS.get(code.split("//", 1)[0], "other")
        if kind == "note":
            notes.append(_note(time, code, text))
        elif kind in ("diagnosis", "procedure"):
            groups[kind].append(_code_label(code, titles))
        elif kind == "medication":  # `furosemide (NDC 00054829725)` with a title, else the code's words
            title = _new_words(titles.get(code), code)
            tail = code.split("//", 1)[-1].replace("//", " ")
            groups[kind].append(_one_line(f"{title} ({tail})" if title else _medication_words(code)))
        elif kind == "lab":  # a title stands for the code's label: the label may be an item number
            collected, item, unit = _lab_parts(code)
            if collected and item in resulted:
                continue  # its result says more, in the same place
            shown = "collected" if collected else f"{value:g}" if value is not None else _bounded(text or "")
            label = _new_words(titles.get(code), code) or item
            groups[kind].append(_one_line(f"{label} {shown} {unit}"))
        else:
            groups[kind].append(_other_item(code, value, text, titles))
    lines = [Line(kind, f"  {prefix}{label}: ", tuple(dict.fromkeys(groups[kind])))
             for kind, label in LABELS.items() if groups[kind]]
    return lines + notes


def _encounter_block(number: int, start, events: list[tuple], titles: dict[str, str | None]) -> Block:
    """The block of one encounter from its `events` (time, code, numeric_value, text_value) in time order."""
    stays: dict[str, list[str]] = {"HOSPITAL_ADMISSION": [], "HOSPITAL_DISCHARGE": []}
    rest = []
    for event in events:
        kind = event[1].split("//", 1)[0]
        if kind in stays:
            stays[kind].append(event[1])
        else:
            rest.append(event)
    # MEDS-Extract writes a part the source left empty as UNK (`HOSPITAL_DISCHARGE//UNK`): nothing to say.
    admitted, discharged = ("//".join(part for part in codes[-1].split("//")[1:] if part != "UNK") if codes else ""
                            for codes in stays.values())
    end = max((time for time, *_ in events if time is not None), default=None)
    title = (f"Encounter {number}: {_day(start)} to {_day(end)}"
             + (f", admitted {admitted}" if admitted else "") + (f", discharged {discharged}" if discharged else ""))
    return Block(title, tuple(_event_lines(rest, titles)))


def _outside_block(events: list[tuple], titles: dict[str, str | None]) -> Block:
    """Events outside any encounter (time, code, numeric_value, text_value; dated, in time order), one line per day
    and kind (they can span years: each keeps its date)."""
    lines = []
    for day, rows in groupby(events, key=lambda event: event[0].date()):
        lines += _event_lines(list(rows), titles, prefix=f"{_day(day)} ")
    title = f"Outside encounters: {_day(events[0][0])} to {_day(events[-1][0])}"
    return Block(title, tuple(lines), encounter=False)


def _place_within_stays(events: pl.DataFrame) -> pl.DataFrame:
    """`events` with each event without an encounter that falls within an encounter's stay (`stay_spans`: from its
    first dated event, or the ED registration that led into it, to its last) given that encounter, as `within_stays`
    places it for the EHR prior (here every encounter is a stay, not only those with a diagnosis: each has its
    block). The birth stays in the header."""
    rows = events.with_row_index("_row").with_columns(pl.lit(0).alias("_record"))
    placeable = rows.filter(pl.col("code") != "MEDS_BIRTH")
    if not has_loose_events(placeable):
        return events
    placed = within_stays(placeable, "_record", stay_spans(rows, "_record"))
    return rows.update(placed.select("_row", "encounter_id"), on="_row").drop("_row", "_record")


def render_history(events: pl.DataFrame, titles: dict[str, str | None]) -> History:
    """Rendered H of one trajectory from its pre-target events (any order).

    `titles` names codes: a diagnosis by Ω's title, any other code by its dataset's (`code_titles`).
    """
    events = _place_within_stays(events).sort("time", "code", "numeric_value", "text_value", nulls_last=False)
    header = []
    for code in events.filter(pl.col("code").str.starts_with("GENDER//"))["code"].to_list():
        header.append(f"Sex: {code.split('//', 1)[1]}")
    # An undated birth (a MEDS export may write one) tells no year; a dated one beside it still does.
    births = events.filter((pl.col("code") == "MEDS_BIRTH") & pl.col("time").is_not_null())["time"].to_list()
    if births:
        header.append(f"Born: {births[0].year}")
    # The rest of the pre-target view's static rows (no time, no encounter), as the EHR prior takes them as the
    # patient's own tokens: nothing places them at an encounter, so none can be the target encounter's.
    undated = events.filter(pl.col("time").is_null() & pl.col("encounter_id").is_null()
                            & ~pl.col("code").str.starts_with("GENDER//") & (pl.col("code") != "MEDS_BIRTH"))
    if undated.height:
        items = (_other_item(code, value, text, titles)
                 for code, value, text in undated.select("code", "numeric_value", "text_value").iter_rows())
        header.append(_undated_line(list(dict.fromkeys(items))))
    inside = events.filter(pl.col("encounter_id").is_not_null())
    encounters = (inside.group_by("encounter_id").agg(pl.col("time").min().alias("start"))
                  .sort("start", "encounter_id", nulls_last=True))
    # Blocks are built from Python rows: a frame operation per block cost more than the rendering itself.
    shown = ("time", "code", "numeric_value", "text_value")
    by_encounter = defaultdict(list)
    for encounter_id, *event in inside.select("encounter_id", *shown).iter_rows():
        by_encounter[encounter_id].append(tuple(event))
    outside = events.filter(pl.col("encounter_id").is_null() & pl.col("time").is_not_null()
                            & (pl.col("code") != "MEDS_BIRTH"))
    # An event outside encounters follows the last encounter that began on or before it.
    starts = [start for start in encounters["start"].to_list() if start is not None]
    between = defaultdict(list)
    for event in outside.select(shown).iter_rows():
        between[bisect_right(starts, event[0])].append(event)
    blocks = [_outside_block(between[0], titles)] if 0 in between else []
    for number, (encounter_id, start) in enumerate(encounters.iter_rows(), 1):
        blocks.append(_encounter_block(number, start, by_encounter[encounter_id], titles))
        if number in between:
            blocks.append(_outside_block(between[number], titles))
    return History("\n".join(header) or "Demographics: not recorded", blocks)


def _marker(chars: int, gone: Counter) -> str:
    """The line that stands where H was shortened.

    >>> _marker(5230, Counter(lab=590, note=1))
    '[history shortened to fit: 5230 characters omitted (590 lab results, 1 note)]'
    """
    parts = [f"{gone[kind]} {one if gone[kind] == 1 else many}" for kind, (one, many) in NOUNS.items() if gone[kind]]
    return f"[history shortened to fit: {chars} characters omitted" + (f" ({', '.join(parts)})" if parts else "") + "]"


def fit_history(history: History, budget_chars: int) -> tuple[str, int]:
    """The history within `budget_chars`, least informative text first; returns (text, characters of H omitted).

    Older notes go first, then older labs, then the labs and notes of the newest encounter (the newest
    values last), then medications, procedures and other codes; only then whole blocks with their
    diagnoses, oldest first, and last the newest block's lines, oldest first. One line may be shortened
    instead of dropped (a list keeps its newest items whole), marked where it was cut;
    a marker after the header says how much was omitted.
    """
    full = history.text
    if len(full) <= budget_chars:
        return full, 0
    totals = Counter(encounter=sum(block.encounter for block in history.blocks))
    for line in (line for block in history.blocks for line in block.lines):
        totals[line.kind] += line.count
    longest = len(_marker(len(full), totals))  # every count at its largest
    # The marker is written last, and what it says depends on what went: start from its shortest form and
    # reserve more room while it does not fit.
    reserve = len(_marker(len(full), Counter()))
    while True:
        body, dropped, gone = _shrink(history, budget_chars - reserve - 2)
        marker = _marker(dropped, gone)
        if len(marker) <= reserve or reserve >= longest:
            text = "\n\n".join([history.header, marker, body])
            assert len(text) <= budget_chars or len(history.header) + longest + 5 > budget_chars, (
                f"fitted history has {len(text)} characters, budget {budget_chars}")
            return text, dropped
        reserve = min(max(reserve + 1, len(marker)), longest)


def _give_way(block: list[Line | None], kinds: set[str] | None, over: int, gone: Counter) -> int:
    """Shorten or drop the lines of `block` of `kinds` (None: every kind), first to last, until `over` characters
    went; returns what is still over."""
    for i, line in enumerate(block):
        if over <= 0:
            break
        if line is None or (kinds is not None and line.kind not in kinds):
            continue
        shorter = line.cut(len(line.text) - over)
        if shorter is None:
            over -= len(line.text) + 1  # with its newline
            gone[line.kind] += line.count
        else:
            over -= len(line.text) - len(shorter.text)
            gone[line.kind] += line.count - shorter.count  # a shortened note is still there
        block[i] = shorter
    return over


def _shrink(history: History, room: int) -> tuple[str, int, Counter]:
    """The blocks of H, shortened (`DROP_STEPS`) so that header, blank line and blocks fit in `room` characters;
    returns (blocks text, characters of H omitted, what went by kind)."""
    full = len(history.text)
    lines = [list(block.lines) for block in history.blocks]
    alive = [True] * len(lines)
    recent_from = max((b for b, block in enumerate(history.blocks) if block.encounter), default=0)
    over = full - room
    gone: Counter = Counter()
    for recent, kinds in DROP_STEPS:
        for b, block in enumerate(lines):
            if not alive[b] or (b >= recent_from) != recent:
                continue
            over = _give_way(block, kinds, over, gone)
            if not history.blocks[b].encounter and all(line is None for line in block):
                alive[b] = False  # a title over nothing left says nothing
                over -= len(history.blocks[b].title) + 2
    newest = max((b for b in range(len(lines)) if alive[b]), default=None)
    for b in [b for b in range(len(lines)) if alive[b]][:-1]:  # whole blocks, oldest first; never the newest
        if over <= 0:
            break
        kept = [line for line in lines[b] if line is not None]
        alive[b] = False
        over -= len(Block(history.blocks[b].title, tuple(kept)).text) + 2
        gone["encounter"] += history.blocks[b].encounter
        for line in kept:
            gone[line.kind] += line.count
    if newest is not None:
        # The newest block alone overflows (an encounter's diagnoses, or years of outpatient diagnoses after the
        # last encounter, one line per day): its lines go oldest first and a list keeps its newest items whole,
        # so that what stays is the most recent and no code is cut in two.
        over = _give_way(lines[newest], None, over, gone)
    body = "\n\n".join(Block(history.blocks[b].title, tuple(line for line in lines[b] if line is not None)).text
                       for b in range(len(lines)) if alive[b])
    marks = sum(len(line.mark) for block in lines for line in block if line is not None)
    left = room - len(history.header) - 2
    if body and len(body) > left:  # the newest block's title alone overflows: keep its beginning
        body = body[:max(left - 1, 0)] + "…"
        marks += 1
    return body, full - len(history.header) - 2 - (len(body) - marks), gone
