"""Flow `cohort-backfill`: forecast a cohort split with several systems into one new run, then evaluate it.

This is what a scheduled deployment runs (`dxr serve`, `[[backfills]]` in the configuration): each
firing makes a fresh run id, so successive backfills stay side by side in `rankings` and `metrics`
and can be compared with SQL. Systems run in the order given, so a fused system finds its inputs.
"""

from __future__ import annotations

from prefect import flow

from flows.forecast import forecast_flow
from tasks.evaluate import evaluate_run_task
from tasks.forecast import check_system_order
from warehouse.runs import new_run_id

BACKFILL_SYSTEMS = ("global_frequency", "repeat_history", "ehr_prior")


@flow(name="cohort-backfill")
def cohort_backfill_flow(data_dir: str, cohort: str, systems: tuple[str, ...] = BACKFILL_SYSTEMS,
                         split: str = "held_out", k: int = 20, limit: int | None = None,
                         run_id: str | None = None) -> str:
    """Forecast `split` of `cohort` with each system into one run and write its metrics; returns the run id."""
    systems = tuple(systems)
    check_system_order(systems)
    run_id = run_id or new_run_id("backfill")
    for system in systems:
        forecast_flow(data_dir, cohort, system, split=split, k=k, limit=limit, run_id=run_id)
    evaluate_run_task(data_dir, run_id)
    return run_id
