"""The sentinel harness: plant unique markers in target encounters, then prove none leaks.

Later stages reuse it: plant into a MEDS directory before ingesting, run the stage, then hand every
artifact that could carry a leak (prompts, queries, ledger rows, rankings, cache-key inputs, the whole
forecasting store) to `find_leaks` / `assert_no_leak`.

Markers are vocabulary-valid ICD-10-CM codes no realistic dataset here would contain, and note
phrases that cannot occur by chance. They are planted only in the target encounters of
non-train patients: train patients' full records are legitimately in the forecasting store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Iterable

import meds
import polars as pl
import pyarrow.parquet as pq

# Billable ICD-10-CM external-cause codes (checked against the vocabulary by `plant_sentinels`).
SENTINEL_RAW_CODES = ("W6162XA", "W5922XA", "V9107XA", "W5501XA")
PHRASE_PREFIX = "QUILLWORT-ZEPHYR-"
# Tables fixed independently of targets: a sentinel code is a valid vocabulary entry, so it is there.
VOCABULARY_TABLES = frozenset({"icd_codes", "icd_notes", "gem_map", "cohort_vocabulary", "datasets"})


class LeakError(AssertionError):
    """A sentinel planted in a target encounter reached a forecasting artifact."""


@dataclass
class Sentinels:
    codes: list[str] = field(default_factory=list)  # MEDS code strings
    phrases: list[str] = field(default_factory=list)
    encounters: list[int] = field(default_factory=list)

    @property
    def needles(self) -> list[str]:
        """Every textual form a leaked sentinel could take (MEDS code, bare code, dotted code, phrase)."""
        forms = []
        for code in self.codes:
            raw = code.rsplit("//", 1)[-1]
            forms += [code, raw, f"{raw[:3]}.{raw[3:]}"]
        return forms + self.phrases


def plant_sentinels(meds_dir: Path, exclude_splits: Iterable[str] = ("train",)) -> Sentinels:
    """Add sentinel events to each planted patient's final encounter with diagnoses (in place).

    Per planted encounter: a sentinel diagnosis at discharge, a discharge-note phrase, a lab with a
    phrase time-stamped one hour *before* the admission, and a copy of the note with neither a time nor an
    encounter, as an export taken at extraction may hold it (the pre-target view must drop both anyway).
    """
    import simple_icd_10_cm as cm

    assert all(cm.is_valid_item(c) and cm.is_leaf(c) for c in SENTINEL_RAW_CODES), "sentinel codes must be billable"
    splits = pl.read_parquet(meds_dir / "metadata" / "subject_splits.parquet")
    planted_subjects = set(splits.filter(~pl.col("split").is_in(list(exclude_splits)))["subject_id"].to_list())
    sentinels = Sentinels()
    for shard in sorted((meds_dir / "data").rglob("*.parquet")):
        events = pl.read_parquet(shard)
        encounters = (events.filter(pl.col("encounter_id").is_not_null() & pl.col("subject_id").is_in(planted_subjects))
                      .group_by("subject_id", "encounter_id")
                      .agg(pl.col("time").min().alias("start"), pl.col("time").max().alias("end"),
                           pl.col("code").str.starts_with("DIAGNOSIS//").any().alias("has_dx"))
                      .filter("has_dx").sort("subject_id", "start", "encounter_id")
                      .group_by("subject_id", maintain_order=True).last())
        extra = []
        for i, (subject, encounter, start, end, _) in enumerate(encounters.iter_rows()):
            n = len(sentinels.encounters)
            code = f"DIAGNOSIS//ICD//10//{SENTINEL_RAW_CODES[n % len(SENTINEL_RAW_CODES)]}"
            phrase = f"{PHRASE_PREFIX}{n}"
            extra += [(subject, end, code, None, None, encounter),
                      (subject, end, "NOTE//DISCHARGE_SUMMARY", None, f"Discharged. {phrase} noted.", encounter),
                      (subject, start - timedelta(hours=1), "LAB//SENTINEL//x", 1.0, f"{phrase}-prelab", encounter),
                      (subject, None, "NOTE//DISCHARGE_SUMMARY", None, f"Copy. {phrase}-loose", None)]
            sentinels.encounters.append(encounter)
            sentinels.phrases.append(phrase)
            if code not in sentinels.codes:
                sentinels.codes.append(code)
        if extra:
            added = pl.DataFrame(extra, schema={c: events.schema[c] for c in
                                                ("subject_id", "time", "code", "numeric_value", "text_value",
                                                 "encounter_id")}, orient="row")
            merged = pl.concat([events, added], how="diagonal_relaxed").sort("subject_id", "time", nulls_last=False)
            pq.write_table(meds.DataSchema.align(merged.to_arrow()), shard)
    assert sentinels.encounters, f"no encounter to plant in {meds_dir}"
    return sentinels


def find_leaks(sentinels: Sentinels, artifacts: dict[str, Iterable[str | None]]) -> list[str]:
    """Where each sentinel occurs: `artifact: needle in 'text…'` lines (empty when clean)."""
    needles = sentinels.needles
    found = []
    for name, texts in artifacts.items():
        for text in texts:
            if not text:
                continue
            for needle in needles:
                if needle in text:
                    found.append(f"{name}: {needle!r} in {text[:80]!r}")
    return found


def assert_no_leak(sentinels: Sentinels, artifacts: dict[str, Iterable[str | None]]) -> None:
    leaks = find_leaks(sentinels, artifacts)
    if leaks:
        raise LeakError(f"{len(leaks)} sentinel leak(s):\n" + "\n".join(leaks[:20]))


def forecast_store_texts(forecast_dir: Path) -> dict[str, list[str]]:
    """Every string cell of every forecasting-store Parquet file except the vocabulary tables."""
    artifacts: dict[str, list[str]] = {}
    for path in sorted(Path(forecast_dir).rglob("*.parquet")):
        table = path.relative_to(forecast_dir).parts[0]
        if table in VOCABULARY_TABLES:
            continue
        frame = pl.read_parquet(path)
        texts = []
        for name, dtype in frame.schema.items():
            if dtype in (pl.String, pl.Utf8):
                texts += frame[name].drop_nulls().to_list()
        artifacts[str(path.relative_to(forecast_dir))] = texts
    return artifacts
