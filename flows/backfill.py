"""Flow `cohort-backfill`: forecast a cohort split with several systems into one new run, evaluate it
and render its report.

This is what a scheduled deployment runs (`dxr serve`, `[[backfills]]` in the configuration): each
firing makes a fresh run id, so successive backfills stay side by side in `rankings` and `metrics`
and can be compared with SQL. Systems run in the order given, so a fused system finds its inputs.
The headline table also goes to a Prefect artifact (`backfill-<cohort>`), so the Prefect UI shows
how each firing did without opening the warehouse.
"""

from __future__ import annotations

import re

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.forecast import forecast_flow
from tasks.evaluate import evaluate_run_task
from tasks.forecast import check_system_order
from tasks.report import Paragraph, render_report_task, system_table, to_markdown
from warehouse.runs import new_run_id
from warehouse.store import Warehouse

BACKFILL_SYSTEMS = ("global_frequency", "repeat_history", "ehr_prior")
ARTIFACT_K = 20


@flow(name="cohort-backfill")
def cohort_backfill_flow(data_dir: str, cohort: str, systems: tuple[str, ...] = BACKFILL_SYSTEMS,
                         split: str = "held_out", k: int = 20, limit: int | None = None,
                         run_id: str | None = None) -> str:
    """Forecast `split` of `cohort` with each system into one run, write its metrics and report; returns
    the run id."""
    systems = tuple(systems)
    check_system_order(systems)
    run_id = run_id or new_run_id("backfill")
    for system in systems:
        forecast_flow(data_dir, cohort, system, split=split, k=k, limit=limit, run_id=run_id)
    evaluate_run_task(data_dir, run_id)
    report = render_report_task(data_dir, run_id)
    create_markdown_artifact(markdown=headline_markdown(Warehouse(data_dir), run_id, report),
                             key=artifact_key("backfill", cohort),
                             description=f"cohort {cohort}, {split}: run {run_id}")
    return run_id


def headline_markdown(wh: Warehouse, run_id: str, report: str) -> str:
    """The report's system table at K = 20 (all codes), under the run id and the report's path."""
    table = system_table(wh.read("metrics", run_id=run_id), wh.read("evaluation_coverage", run_id=run_id),
                         ARTIFACT_K)
    return to_markdown([Paragraph(f"Run `{run_id}`, K = {ARTIFACT_K}, all codes; report: `{report}`"), table])


def artifact_key(prefix: str, name: str) -> str:
    """A Prefect artifact key (lower-case letters, digits and dashes) for a cohort or patient name."""
    return f"{prefix}-{re.sub(r'[^a-z0-9-]+', '-', name.lower()).strip('-')}"
