"""Realism bands of a synthetic cohort, computed from the warehouse exactly as users see it.

The statistics come from the cohort tables and the run's metrics (held_out trajectories), so they
describe the cohort the platform built, not a re-implementation of the cohort rules; the query and
the band definitions live with the generator (`warehouse.synthetic.realism.warehouse_realism`,
`REALISM_BANDS`).
"""

from __future__ import annotations

import polars as pl

from warehouse.cohorts import registered_cohort
from warehouse.runs import holding_run
from warehouse.store import Warehouse
from warehouse.synthetic.realism import REALISM_BANDS, warehouse_realism


def realism_table(wh: Warehouse, cohort_id: str, run_id: str) -> pl.DataFrame:
    """(band, value, low, high, within_band) for printing and for the demo's pass/fail, of the run's cohort."""
    with holding_run(wh, run_id, exclusive=False):
        registered_cohort(wh, cohort_id)  # a build cut short leaves its tables half rewritten
        stats = warehouse_realism(wh, cohort_id, run_id)
    rows = [(name, stats[name], low, high, low <= stats[name] <= high) for name, (low, high) in REALISM_BANDS.items()]
    return pl.DataFrame(rows, schema={"band": pl.String, "value": pl.Float64, "low": pl.Float64, "high": pl.Float64,
                                      "within_band": pl.Boolean}, orient="row")
