"""Realism bands of a synthetic cohort, computed from the warehouse exactly as users see it.

The statistics come from the cohort tables and the run's metrics (held_out trajectories), so they
describe the cohort the platform built, not a re-implementation of the cohort rules. The bands
themselves are defined with the generator (`warehouse.synthetic.realism.REALISM_BANDS`).
"""

from __future__ import annotations

import polars as pl

from warehouse.runs import holding_run
from warehouse.store import Warehouse, fetch_frame
from warehouse.synthetic.conditions import CODE_OWNER
from warehouse.synthetic.realism import REALISM_BANDS


def realism_statistics(wh: Warehouse, cohort_id: str, run_id: str, split: str = "held_out") -> dict[str, float]:
    """Band statistics of one cohort split; recall values are the run's R@20 metrics on `all` codes."""
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
    recall = dict(con.execute("""SELECT system, value FROM metrics WHERE run_id = ? AND subset = 'all'
                                 AND metric = 'recall_at_k' AND k = 20""", [run_id]).fetchall())
    owner = {f"DIAGNOSIS//ICD//10//{code.replace('.', '')}": name for code, name in CODE_OWNER.items()}
    condition_share = (targets.with_columns(pl.col("code").replace_strict(owner, default="(unowned)").alias("owner"))
                       .group_by("owner").len()["len"].max() / targets.height)
    new_onset = targets.join(history, on=["trajectory_id", "code"], how="anti").height / targets.height
    oracle = recall["oracle"]
    return {
        "mean_target_size": targets.height / targets["trajectory_id"].n_unique(),
        "mean_prior_encounters": mean_prior,
        "new_onset_share": new_onset,
        "oracle_r20": oracle,
        "repeat_history_to_oracle": recall["repeat_history"] / oracle,
        "global_frequency_to_oracle": recall["global_frequency"] / oracle,
        "max_condition_share": condition_share,
    }


def realism_table(wh: Warehouse, cohort_id: str, run_id: str) -> pl.DataFrame:
    """(band, value, low, high, within_band) for printing and for the demo's pass/fail."""
    with holding_run(wh, run_id, exclusive=False):
        stats = realism_statistics(wh, cohort_id, run_id)
    rows = [(name, stats[name], low, high, low <= stats[name] <= high) for name, (low, high) in REALISM_BANDS.items()]
    return pl.DataFrame(rows, schema={"band": pl.String, "value": pl.Float64, "low": pl.Float64, "high": pl.Float64,
                                      "within_band": pl.Boolean}, orient="row")
