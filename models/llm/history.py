"""The readable text of a pre-target record H: demographics, then each earlier encounter.

Only `pretarget_events` rows are rendered, so whatever H excludes (the target encounter) cannot appear.
"""

from __future__ import annotations

from collections import defaultdict

import polars as pl

from models.llm.prompts import History
from warehouse.vocab import dotted, parse_meds_code


def _code_label(code: str, titles: dict[str, str | None]) -> str:
    """`I50.22 Chronic systolic heart failure` for an ICD code, else the code's last parts."""
    try:
        _, version, raw = parse_meds_code(code)
    except Exception:  # not an ICD code: show its readable tail
        return code.split("//", 1)[-1].replace("//", " ")
    title = titles.get(code)
    return f"{dotted(version, raw)} {title}" if title else dotted(version, raw)


def _day(value) -> str:
    return value.strftime("%Y-%m-%d") if value is not None else "undated"


def render_history(events: pl.DataFrame, titles: dict[str, str | None]) -> History:
    """Rendered H of one trajectory from its pre-target events (any order)."""
    events = events.sort("time", "code", nulls_last=False)
    header = []
    for code in events.filter(pl.col("code").str.starts_with("GENDER//"))["code"].to_list():
        header.append(f"Sex: {code.split('//', 1)[1]}")
    births = events.filter(pl.col("code") == "MEDS_BIRTH")["time"].to_list()
    if births:
        header.append(f"Born: {births[0].year}")
    encounters = (events.filter(pl.col("encounter_id").is_not_null())
                  .group_by("encounter_id").agg(pl.col("time").min().alias("start"))
                  .sort("start", "encounter_id", nulls_last=True))
    by_encounter = events.filter(pl.col("encounter_id").is_not_null()).partition_by("encounter_id", as_dict=True)
    blocks = []
    for number, (encounter_id, start) in enumerate(encounters.iter_rows(), 1):
        blocks.append(_encounter_block(number, start, by_encounter[(encounter_id,)], titles))
    loose = events.filter(pl.col("encounter_id").is_null() & pl.col("time").is_not_null()
                          & (pl.col("code") != "MEDS_BIRTH"))
    if not loose.is_empty():
        lines = [f"  {_day(t)} {_code_label(c, titles)}{'' if v is None else f' {v:g}'}"
                 for t, c, v in loose.select("time", "code", "numeric_value").iter_rows()]
        blocks.append("Events outside encounters:\n" + "\n".join(lines))
    return History("\n".join(header) or "Demographics: not recorded", blocks)


def _encounter_block(number: int, start, events: pl.DataFrame, titles: dict[str, str | None]) -> str:
    groups: dict[str, list[str]] = defaultdict(list)
    admission = discharge = None
    end = events["time"].max()
    for time, code, value, text in events.select("time", "code", "numeric_value", "text_value").iter_rows():
        kind = code.split("//", 1)[0]
        if kind == "HOSPITAL_ADMISSION":
            admission = code.split("//", 1)[-1]
        elif kind == "HOSPITAL_DISCHARGE":
            discharge = code.split("//", 1)[-1]
        elif kind == "DIAGNOSIS":
            groups["Diagnoses"].append(_code_label(code, titles))
        elif kind == "PROCEDURE":
            groups["Procedures"].append(_code_label(code, titles))
        elif kind == "MEDICATION":
            groups["Medications"].append(code.split("//")[-1])
        elif kind == "LAB":
            parts = code.split("//")
            unit = parts[2] if len(parts) > 2 else ""
            shown = f"{value:g}" if value is not None else (text or "")
            groups["Labs"].append(f"{parts[1] if len(parts) > 1 else code} {shown} {unit}".strip())
        elif kind == "NOTE":
            groups["Notes"].append(f"[{code.split('//', 1)[-1]}, {_day(time)}] {text or ''}".strip())
        else:
            groups["Other"].append(code)
    title = (f"Encounter {number}: {_day(start)} to {_day(end)}"
             + (f", admitted {admission}" if admission else "") + (f", discharged {discharge}" if discharge else ""))
    lines = [title]
    for label in ("Diagnoses", "Procedures", "Medications", "Labs", "Other"):
        if groups[label]:
            unique = list(dict.fromkeys(groups[label]))
            lines.append(f"  {label}: " + "; ".join(unique))
    for note in groups["Notes"]:
        lines.append(f"  Note {note}")
    return "\n".join(lines)
