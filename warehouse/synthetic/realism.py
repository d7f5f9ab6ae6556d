"""Realism bands of the synthetic cohort, computed straight from a MEDS directory and the oracle.

The cohort is the `held_out` split (hash_split with `seed`) with final-encounter targets: the
target is the deduplicated diagnosis set of a patient's last encounter that has a diagnosis,
prior encounters are the earlier ones with a diagnosis, and at least one is required.
"""

from __future__ import annotations

import math
from pathlib import Path

import meds
import polars as pl

from warehouse import duck
from warehouse.meds import hash_split
from warehouse.synthetic.conditions import CODE_OWNER
from warehouse.synthetic.oracle import oracle
from warehouse.synthetic.simulate import DIAGNOSIS

K = 20
REALISM_BANDS: dict[str, tuple[float, float]] = {
    "mean_target_size": (8.0, 20.0),
    "mean_prior_encounters": (2.5, math.inf),
    "new_onset_share": (0.40, 0.65),
    "oracle_r20": (0.55, 0.85),
    "repeat_history_to_oracle": (0.0, 0.75),
    "global_frequency_to_oracle": (0.0, 0.5),
    "max_condition_share": (0.0, 0.10),
}


def diagnosis_encounters(meds_dir: Path) -> pl.DataFrame:
    """(subject_id, encounter_id, admit, code) for every diagnosis of every encounter."""
    glob = str(Path(meds_dir) / meds.data_subdirectory / "**" / "*.parquet")
    con = duck.connect(":memory:")
    return con.sql(f"""
        WITH ev AS (SELECT subject_id, encounter_id, time, code FROM read_parquet({duck.literal(glob)})
                    WHERE encounter_id IS NOT NULL),
             adm AS (SELECT encounter_id, min(time) AS admit FROM ev GROUP BY encounter_id)
        SELECT DISTINCT ev.subject_id, ev.encounter_id, adm.admit, ev.code
        FROM ev JOIN adm USING (encounter_id) WHERE ev.code LIKE 'DIAGNOSIS//%'
        ORDER BY ev.subject_id, adm.admit, ev.encounter_id, ev.code""").pl()


def final_encounter_cohort(dx: pl.DataFrame, seed: int, split: str = meds.held_out_split) -> pl.DataFrame:
    """One row per trajectory: subject, target encounter, cutoff, n_prior_encounters."""
    enc = dx.select("subject_id", "encounter_id", "admit").unique().sort("subject_id", "admit", "encounter_id")
    enc = enc.with_columns(pl.col("encounter_id").cum_count().over("subject_id").alias("n"),
                           pl.len().over("subject_id").alias("total"))
    final = enc.filter(pl.col("n") == pl.col("total"), pl.col("total") >= 2)
    final = final.filter(pl.col("subject_id").map_elements(lambda s: hash_split(s, seed) == split,
                                                            return_dtype=pl.Boolean))
    return final.select(
        pl.format("synthetic:{}:{}", "subject_id", "encounter_id").alias("trajectory_id"), "subject_id",
        pl.col("encounter_id").alias("target_encounter_id"), pl.col("admit").alias("cutoff_time"),
        (pl.col("total") - 1).alias("n_prior_encounters"))


def _recall(ranked: dict[str, list[str]], targets: dict[str, set[str]]) -> float:
    return sum(len(set(ranked.get(t, [])[:K]) & y) / len(y) for t, y in targets.items()) / len(targets)


def realism_report(meds_dir: Path, seed: int = 7, draws: int = 200) -> dict[str, float]:
    """The band statistics of the held_out final-encounter cohort (see REALISM_BANDS)."""
    dx = diagnosis_encounters(meds_dir)
    cohort = final_encounter_cohort(dx, seed)
    target_rows = dx.join(cohort.select("trajectory_id", "subject_id",
                                        pl.col("target_encounter_id").alias("encounter_id")),
                          on=["subject_id", "encounter_id"])
    targets = {t: set(c) for t, c in target_rows.group_by("trajectory_id").agg("code").iter_rows()}
    prior = dx.join(cohort.select("trajectory_id", "subject_id", "cutoff_time"), on="subject_id") \
        .filter(pl.col("admit") < pl.col("cutoff_time"))
    history_codes = {t: set(c) for t, c in prior.group_by("trajectory_id").agg("code").iter_rows()}
    n_codes = sum(len(y) for y in targets.values())
    new_onset = sum(len(y - history_codes.get(t, set())) for t, y in targets.items())
    # global frequency: number of train-split patients' encounters containing the code
    train = dx.filter(pl.col("subject_id").map_elements(lambda s: hash_split(s, seed) == meds.train_split,
                                                         return_dtype=pl.Boolean))
    global_rank = train.group_by("code").agg(pl.col("encounter_id").n_unique().alias("n")) \
        .sort(["n", "code"], descending=[True, False])["code"].to_list()
    # repeat history: pre-target codes by count then recency, padded with global frequency
    repeat_rows = prior.group_by("trajectory_id", "code") \
        .agg(pl.len().alias("n"), pl.col("admit").max().alias("last")) \
        .sort(["trajectory_id", "n", "last", "code"], descending=[False, True, True, False])
    repeat: dict[str, list[str]] = {t: list(c) for t, c in repeat_rows.group_by("trajectory_id", maintain_order=True)
                                    .agg("code").iter_rows()}
    for t, codes in repeat.items():
        seen = set(codes)
        codes.extend(c for c in global_rank[: K + len(codes)] if c not in seen)
    orc = oracle(meds_dir, cohort, harmonize=None, draws=draws, top=K)
    oracle_ranked = {t: list(c) for t, c in orc.group_by("trajectory_id", maintain_order=True).agg("code").iter_rows()}
    owners = pl.DataFrame({"code": [c for y in targets.values() for c in y]}).with_columns(
        pl.col("code").str.strip_prefix(DIAGNOSIS).replace_strict(
            {k.replace(".", ""): v for k, v in CODE_OWNER.items()}, default="(other)").alias("owner"))
    shares = owners.group_by("owner").len().with_columns(pl.col("len") / owners.height)
    oracle_r = _recall(oracle_ranked, targets)
    repeat_r = _recall(repeat, targets)
    global_r = _recall({t: global_rank for t in targets}, targets)
    return {
        "n_trajectories": float(len(targets)),
        "mean_target_size": n_codes / len(targets),
        "mean_prior_encounters": float(cohort["n_prior_encounters"].mean()),
        "new_onset_share": new_onset / n_codes,
        "oracle_r20": oracle_r,
        "repeat_history_r20": repeat_r,
        "global_frequency_r20": global_r,
        "repeat_history_to_oracle": repeat_r / oracle_r,
        "global_frequency_to_oracle": global_r / oracle_r,
        "max_condition_share": float(shares["len"].max()),
    }


def violations(report: dict[str, float]) -> list[str]:
    """Human-readable list of the bands a report misses (empty when all hold)."""
    return [f"{k}={report[k]:.3f} outside [{lo}, {hi}]" for k, (lo, hi) in REALISM_BANDS.items()
            if not lo <= report[k] <= hi]
