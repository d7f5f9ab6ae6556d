"""Realism bands of the synthetic cohort: their definitions and the two ways they are measured.

`band_statistics` turns a cohort's targets, pre-target diagnosis codes, prior-encounter mean and
three R@20 values into the band statistics; both measurements feed it, so the statistics are
defined once. They differ in where those inputs come from:

- `realism_report(meds_dir)` tunes the generator: straight from a MEDS directory, with no
  warehouse, it re-derives the cohort (the `held_out` split by hash_split with `seed`, final-encounter
  targets: the deduplicated diagnosis set of a patient's last encounter that has a diagnosis,
  prior encounters the earlier ones with a diagnosis, at least one required), draws the oracle and
  ranks its own global frequency and repeat history.
- `warehouse_realism(wh, cohort_id, run_id)` checks what the platform built (the demo): the
  cohort's `trajectories`, `targets` and `pretarget_events`, and the R@20 `metrics` that a run's
  oracle and baselines scored.
"""

from __future__ import annotations

import math
from pathlib import Path

import meds
import polars as pl

from warehouse import duck
from warehouse.meds import hash_split
from warehouse.run_outputs import run_metric
from warehouse.store import Warehouse, fetch_frame
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
    shards = duck.read("read_parquet", Path(meds_dir) / meds.data_subdirectory, "**/*.parquet")
    con = duck.connect(":memory:")
    return con.sql(f"""
        WITH ev AS (SELECT subject_id, encounter_id, time, code FROM {shards}
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


def mean_recall(ranked: dict[str, list[str]], targets: dict[str, set[str]]) -> float:
    """R@K averaged over the trajectories of `targets`, summed in trajectory order: a float sum's last bit depends
    on its order, and the order of `targets` (from an unordered group_by) changes between runs."""
    return sum(len(set(ranked.get(t, [])[:K]) & targets[t]) / len(targets[t]) for t in sorted(targets)) / len(targets)


def band_statistics(targets: pl.DataFrame, history: pl.DataFrame, mean_prior_encounters: float,
                    recall_at_20: dict[str, float]) -> dict[str, float]:
    """The `REALISM_BANDS` statistics, in their order.

    `targets` holds one (trajectory_id, code) row per distinct target code, `history` the
    (trajectory_id, code) diagnosis codes before the cutoff, `recall_at_20` the R@20 of `oracle`,
    `repeat_history` and `global_frequency`; the condition share counts codes no condition owns as
    one group of their own.
    """
    owner = {f"{DIAGNOSIS}{code.replace('.', '')}": name for code, name in CODE_OWNER.items()}
    largest_condition = (targets.with_columns(pl.col("code").replace_strict(owner, default="(unowned)").alias("owner"))
                         .group_by("owner").len()["len"].max())
    new_onset = targets.join(history, on=["trajectory_id", "code"], how="anti").height
    oracle_r20 = recall_at_20["oracle"]
    return {
        "mean_target_size": targets.height / targets["trajectory_id"].n_unique(),
        "mean_prior_encounters": mean_prior_encounters,
        "new_onset_share": new_onset / targets.height,
        "oracle_r20": oracle_r20,
        "repeat_history_to_oracle": recall_at_20["repeat_history"] / oracle_r20,
        "global_frequency_to_oracle": recall_at_20["global_frequency"] / oracle_r20,
        "max_condition_share": largest_condition / targets.height,
    }


def realism_report(meds_dir: Path, seed: int = 7, draws: int = 200) -> dict[str, float]:
    """The band statistics of the held_out final-encounter cohort of a MEDS directory, with the
    trajectory count and the two baselines' R@20 beside them."""
    dx = diagnosis_encounters(meds_dir)
    cohort = final_encounter_cohort(dx, seed)
    target_rows = dx.join(cohort.select("trajectory_id", "subject_id",
                                        pl.col("target_encounter_id").alias("encounter_id")),
                          on=["subject_id", "encounter_id"]).select("trajectory_id", "code")
    targets = {t: set(c) for t, c in target_rows.group_by("trajectory_id").agg("code").iter_rows()}
    prior = dx.join(cohort.select("trajectory_id", "subject_id", "cutoff_time"), on="subject_id") \
        .filter(pl.col("admit") < pl.col("cutoff_time"))
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
    recall = {"oracle": mean_recall(oracle_ranked, targets), "repeat_history": mean_recall(repeat, targets),
              "global_frequency": mean_recall({t: global_rank for t in targets}, targets)}
    stats = band_statistics(target_rows, prior.select("trajectory_id", "code"),
                            float(cohort["n_prior_encounters"].mean()), recall)
    return {
        "n_trajectories": float(len(targets)),
        "mean_target_size": stats["mean_target_size"],
        "mean_prior_encounters": stats["mean_prior_encounters"],
        "new_onset_share": stats["new_onset_share"],
        "oracle_r20": stats["oracle_r20"],
        "repeat_history_r20": recall["repeat_history"],
        "global_frequency_r20": recall["global_frequency"],
        "repeat_history_to_oracle": stats["repeat_history_to_oracle"],
        "global_frequency_to_oracle": stats["global_frequency_to_oracle"],
        "max_condition_share": stats["max_condition_share"],
    }


def warehouse_realism(wh: Warehouse, cohort_id: str, run_id: str,
                      split: str = meds.held_out_split) -> dict[str, float]:
    """The band statistics of one split of a built cohort, as the platform's tables hold it; the recall values
    are the run's R@20 metrics on `all` codes. The caller holds the run (`warehouse.runs.holding_run`)."""
    con = wh.connect(gold=True, run_id=run_id)
    params = [cohort_id, split]
    targets = fetch_frame(con, """
        SELECT g.trajectory_id, g.code FROM targets g JOIN trajectories t USING (cohort_id, trajectory_id)
        WHERE g.cohort_id = ? AND t.split = ?""", params)
    history = fetch_frame(con, """
        SELECT DISTINCT p.trajectory_id, p.code
        FROM pretarget_events p JOIN trajectories t USING (cohort_id, trajectory_id)
        WHERE p.cohort_id = ? AND t.split = ? AND p.code LIKE 'DIAGNOSIS//%'""", params)
    [(mean_prior,)] = con.execute("SELECT avg(n_prior_encounters) FROM trajectories WHERE cohort_id = ? AND split = ?",
                                  params).fetchall()
    recall = dict(run_metric(con, run_id, "recall_at_k", K).iter_rows())
    return band_statistics(targets, history, mean_prior, recall)
