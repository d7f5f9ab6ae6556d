"""Benchmark: building the ICD vocabulary tables and running the validator V(.).

Runs in a fresh process so package parsing (simple_icd_10_cm parses its XML on import) is
counted once, as in a first `load_vocabularies` of a new warehouse. Measures each builder, the
warehouse load (first write, then the skip on a rerun), building a `Vocabulary` over the 74,731
billable ICD-10-CM codes, and `validate()` throughput on a mix of valid and invalid items.
Prints a table; writes JSON to benchmarks/results/vocab.json.

    python benchmarks/vocab.py
"""

from __future__ import annotations

import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402
# LLM-style items: canonical, sloppy, titled, wrong-version, procedure, blank and free text.
ITEMS = ["I50.22", "i5022", "ICD10:I50.22", "E11.9 - Type 2 diabetes mellitus without complications", "I50.2",
         "428.0", "02703ZZ", "", "heart failure", "N18.6", "Z99.2", "J18.9 (Pneumonia)", "DIAGNOSIS//ICD//10//I10",
         "36.15", "S72.001A", "E83.00"]


def timed(label: str, rows: list, fn):
    started = time.perf_counter()
    value = fn()
    rows.append({"step": label, "seconds": round(time.perf_counter() - started, 3),
                 "rows": getattr(value, "height", None)})
    return value


def main() -> None:
    import polars as pl

    from warehouse import vocab
    from warehouse.store import Warehouse

    rows: list[dict] = []
    codes10 = timed("icd10_codes (incl. package parse)", rows, vocab.icd10_codes)
    timed("icd10_notes", rows, vocab.icd10_notes)
    timed("icd9_codes", rows, vocab.icd9_codes)
    timed("gem_table", rows, vocab.gem_table)
    with tempfile.TemporaryDirectory() as tmp:
        wh = Warehouse(tmp)
        timed("load_vocabularies (first, builders cached)", rows, lambda: vocab.load_vocabularies(wh))
        timed("load_vocabularies (rerun: skip)", rows, lambda: vocab.load_vocabularies(wh))
        notes_bytes = sum(p.stat().st_size for p in (wh.forecast_dir / "icd_notes").rglob("*.parquet"))
    billable = codes10.filter(pl.col("billable"))
    omega = dict(zip(billable["code"], billable["title"]))
    voc = timed("Vocabulary(74,731 ICD-10 codes), first", rows, lambda: vocab.Vocabulary(omega))
    timed("Vocabulary(74,731 ICD-10 codes), again", rows, lambda: vocab.Vocabulary(omega))
    repeats = 5_000
    started = time.perf_counter()
    for _ in range(repeats):
        voc.validate(ITEMS)
    per_item_us = (time.perf_counter() - started) / (repeats * len(ITEMS)) * 1e6

    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{'step':<45} {'seconds':>8} {'rows':>10}")
    for row in rows:
        print(f"{row['step']:<45} {row['seconds']:>8.3f} {row['rows'] if row['rows'] is not None else '':>10}")
    print(f"{'validate(): microseconds per item':<45} {per_item_us:>8.2f}")
    print(f"{'icd_notes partition on disk (MB)':<45} {notes_bytes / 2**20:>8.1f}")
    print(f"{'peak resident memory (MB)':<45} {peak_mb:>8.0f}")
    write_result(RESULTS / "vocab.json", {"steps": rows, "validate_us_per_item": round(per_item_us, 3),
                                          "icd_notes_mb": round(notes_bytes / 2**20, 2), "peak_rss_mb": round(peak_mb),
                                          "python": platform.python_version(), "machine": platform.machine()})


if __name__ == "__main__":
    main()
