"""Write a synthetic MEDS dataset: shards of independently simulated patients, then metadata.

Each shard holds `shard_size` consecutive subject ids and is built from per-patient streams
only, so shards can be written in any order, by any number of processes, and a rerun rewrites
byte-identical files. Memory is bounded by one shard per worker.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import meds
import polars as pl
import simple_icd_10_cm as icd
from tqdm import tqdm

from dxr.errors import InputError
from dxr.processes import worker_pool
from warehouse.meds import hash_split, write_data_shard, write_metadata
from warehouse.synthetic.conditions import CHRONIC_BY_NAME, PCS_TITLES, REASONS
from warehouse.synthetic.events import LAB_TITLES, LABS, patient_rows
from warehouse.synthetic.simulate import simulate_patient

GENERATOR_VERSION = "synthetic-1.2.0"
SPLIT_SEED = 7  # subject_splits.parquet follows the platform's default cohort split seed
SYNTHETIC_METADATA = "synthetic.json"  # sidecar under metadata/: what is needed to re-simulate

_SCHEMA = {"subject_id": pl.Int64, "time": pl.Int64, "code": pl.String, "numeric_value": pl.Float32,
           "text_value": pl.String, "encounter_id": pl.Int64}


def subject_ids(n_patients: int) -> range:
    return range(1, n_patients + 1)


def patient_frame(seed: int, subject_id_list) -> pl.DataFrame:
    """The MEDS rows of the given patients (the unit shared by shards and single re-simulation)."""
    rows: list[tuple] = []
    for sid in subject_id_list:
        rows.extend(patient_rows(seed, simulate_patient(seed, sid)))
    frame = pl.DataFrame(rows, schema=_SCHEMA, orient="row")
    return frame.with_columns(pl.col("time").cast(pl.Datetime("us")), pl.col("text_value").cast(pl.String))


def _write_shard(args: tuple[Path, str, int, int, int]) -> tuple[str, int]:
    out_dir, name, seed, first, last = args
    frame = patient_frame(seed, range(first, last + 1))
    write_data_shard(out_dir, name, frame)
    return name, frame.height


def shard_plan(n_patients: int, shard_size: int) -> list[tuple[str, int, int]]:
    ids = subject_ids(n_patients)
    return [(f"{i // shard_size:05d}", ids[i], ids[min(i + shard_size, len(ids)) - 1])
            for i in range(0, len(ids), shard_size)]


class _Patients:
    """Patients written so far: a bar on a terminal when `progress` is set, else a line to `log` each time another
    tenth of them is written (a shard ends; shards end in order).

    100,000 patients take about a minute; a bar shows nothing in a log file (cron) or a Prefect run's log, where a
    working generator would otherwise look like a hung one.
    """

    def __init__(self, total: int, progress: bool, log: Callable[[str], None] | None):
        # disable=None: tqdm draws only when stderr is a terminal, and then the bar says it all.
        self.bar = tqdm(total=total, unit="patient", desc="synthetic", disable=None if progress else True)
        self.log = log if self.bar.disable else None
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def add(self, patients: int) -> None:
        tenths_before = self.done * 10 // self.total
        self.done += patients
        self.bar.update(patients)
        if self.log is not None and self.done * 10 // self.total > tenths_before:
            self.log(f"synthetic: {self.done:,}/{self.total:,} patients written "
                     f"({self.done / self.total:.0%}) in {time.perf_counter() - self.started:.1f} s")

    def close(self) -> None:
        self.bar.close()


def generate(out_dir: Path, n_patients: int, seed: int, shard_size: int = 2000, progress: bool = False,
             workers: int | None = None, log: Callable[[str], None] | None = None) -> None:
    """Write a complete synthetic MEDS dataset of `n_patients` patients for `seed` into `out_dir`.

    With `progress` a bar shows the patients written on a terminal; otherwise (no terminal, or no `progress`) `log`
    receives a line each time another tenth of them is written (`synthetic: 40,000/100,000 patients written (40%)
    in 24.2 s`).
    """
    if n_patients < 1:
        raise InputError(f"n_patients={n_patients}: generate at least one patient")
    if shard_size < 1:
        raise InputError(f"shard_size={shard_size}: use a positive number of patients per shard")
    out_dir = Path(out_dir)
    plan = shard_plan(n_patients, shard_size)
    data_dir = out_dir / meds.data_subdirectory
    expected = {f"{name}.parquet" for name, _, _ in plan}
    if data_dir.is_dir():  # shards of an earlier, larger run would otherwise survive
        for stale in data_dir.glob("*.parquet"):
            if stale.name not in expected:
                stale.unlink()
    # worker processes pay a start-up cost (imports, the ICD tables); worth it only for large runs
    workers = workers or (min(2, os.cpu_count() or 1) if n_patients >= 4000 else 1)
    jobs = [(out_dir, name, seed, first, last) for name, first, last in plan]
    written = _Patients(n_patients, progress, log)
    if workers > 1 and len(jobs) > 1:
        with worker_pool(workers, "synthetic generator", "free memory or give it more (docs/benchmarks.md#memory lists "
                         "what each step needs), or lower synth.shard_size (patients per shard), then rerun") as pool:
            for (name, first, last), _ in zip(plan, pool.map(_write_shard, jobs)):
                written.add(last - first + 1)
    else:
        for job in jobs:
            _write_shard(job)
            written.add(job[4] - job[3] + 1)
    written.close()
    splits = pl.DataFrame({"subject_id": list(subject_ids(n_patients)),
                           "split": [hash_split(s, SPLIT_SEED) for s in subject_ids(n_patients)]},
                          schema={"subject_id": pl.Int64, "split": pl.String})
    extra = {"synthetic_seed": seed, "synthetic_patients": n_patients, "generator_version": GENERATOR_VERSION,
             "synthetic_shard_size": shard_size}
    write_metadata(out_dir, dataset_name="dxr-synthetic", dataset_version=f"{GENERATOR_VERSION}+seed{seed}",
                   etl_name="warehouse.synthetic", etl_version=GENERATOR_VERSION, codes=code_dictionary(),
                   splits=splits, extra=extra)
    sidecar = out_dir / "metadata" / SYNTHETIC_METADATA
    tmp = sidecar.with_name(f".{sidecar.name}.tmp")
    tmp.write_text(json.dumps(extra, indent=2, sort_keys=True))
    os.replace(tmp, sidecar)


@lru_cache(maxsize=1)
def code_dictionary() -> pl.DataFrame:
    """codes.parquet: the full billable ICD-10-CM dictionary plus every other code the generator emits."""
    rows: list[tuple[str, str]] = []
    # dict.fromkeys: a one-category block (B20, Z66...) is listed twice under the same name
    for code in dict.fromkeys(icd.get_all_codes(with_dots=False)):
        if icd.is_leaf(code):
            rows.append((f"DIAGNOSIS//ICD//10//{code}", icd.get_description(code)))
    for code, text in sorted(PCS_TITLES.items()):
        rows.append((f"PROCEDURE//ICD//10//{code}", text))
    meds_names = sorted({m for r in REASONS for m in r.meds}
                        | {m for c in CHRONIC_BY_NAME.values() for _, m in c.meds})
    rows += [(f"MEDICATION//NAME//{m}", m) for m in meds_names]
    rows += [(LABS[k], LAB_TITLES[k]) for k in LABS]
    rows += [(f"HOSPITAL_ADMISSION//{a}", f"{a.lower()} admission")
             for a in sorted({r.admission for r in REASONS})]
    rows += [(f"HOSPITAL_DISCHARGE//{d}", f"discharge: {d.lower().replace('_', ' ')}")
             for d in ("AGAINST_ADVICE", "DIED", "HOME", "HOME_HEALTH", "SNF")]
    rows += [("NOTE//DISCHARGE_SUMMARY", "discharge summary"), ("GENDER//F", "female"), ("GENDER//M", "male"),
             (meds.birth_code, "birth"), (meds.death_code, "death")]
    return pl.DataFrame(rows, schema={"code": pl.String, "description": pl.String}, orient="row").with_columns(
        pl.lit(None, dtype=pl.List(pl.String)).alias("parent_codes"))


def read_synthetic_metadata(meds_dir: Path) -> dict:
    """The seed and version a synthetic MEDS directory was generated with (InputError when not synthetic)."""
    path = Path(meds_dir) / "metadata" / SYNTHETIC_METADATA
    if not path.is_file():
        raise InputError(f"{path} not found: {meds_dir} was not written by the synthetic generator "
                         "(the oracle exists only for synthetic data)")
    return json.loads(path.read_text())


def generation_parameters(meds_dir: Path) -> dict:
    """{patients, seed, generator_version} of a synthetic MEDS directory (to decide whether to regenerate)."""
    meta = read_synthetic_metadata(meds_dir)
    return {"patients": meta["synthetic_patients"], "seed": meta["synthetic_seed"],
            "generator_version": meta["generator_version"]}
