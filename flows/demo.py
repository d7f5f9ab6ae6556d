"""Flow `demo`: the main job on the embedded default data, end to end.

synthetic dataset -> default cohort -> baselines on held_out -> metrics (+ oracle) -> report.
Every step is idempotent: a rerun reuses an identical dataset and replaces its own partitions.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task

from dxr.config import Settings
from flows.forecast import forecast_flow
from tasks.evaluate import evaluate_run
from tasks.realism import realism_table
from tasks.report import render_report
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import create_synthetic, synthetic_is_current
from warehouse.runs import new_run_id
from warehouse.store import Warehouse

DEMO_DATASET = "synthetic"
DEMO_COHORT = "default"
DEMO_SYSTEMS = ("global_frequency", "repeat_history")


@task(name="synthetic-dataset")
def synthetic_dataset_task(wh: Warehouse, patients: int, seed: int, shard_size: int) -> str:
    if not synthetic_is_current(wh, DEMO_DATASET, patients, seed):
        create_synthetic(wh, DEMO_DATASET, patients, seed, shard_size, progress=True)
    return DEMO_DATASET


@task(name="build-cohort")
def build_cohort_task(wh: Warehouse, dataset_id: str, settings: Settings) -> dict:
    return build_cohort(wh, dataset_id, DEMO_COHORT, CohortOptions(min_history=settings.cohort.min_history),
                        seed=settings.seed, shard_size=settings.cohort.shard_size,
                        oracle_draws=settings.synth.oracle_draws, progress=True)


@task(name="evaluate")
def evaluate_task(wh: Warehouse, run_id: str):
    return evaluate_run(wh, run_id, ks=(10, 20))


@flow(name="demo")
def demo_flow(settings: Settings, run_id: str | None = None) -> dict:
    """Run the demo; returns the run id, the metrics frame, the realism table and the report path."""
    wh = Warehouse(settings.data_dir)
    dataset_id = synthetic_dataset_task(wh, settings.synth.patients, settings.seed, settings.synth.shard_size)
    cohort = build_cohort_task(wh, dataset_id, settings)
    run_id = run_id or new_run_id("demo")
    for system in DEMO_SYSTEMS:
        forecast_flow(str(wh.root), cohort["cohort_id"], system, split="held_out", run_id=run_id)
    metrics = evaluate_task(wh, run_id)
    report = render_report(wh, run_id, Path(wh.root) / "reports" / run_id)
    return {"run_id": run_id, "cohort": cohort, "metrics": metrics, "realism": realism_table(wh, cohort["cohort_id"], run_id),
            "report": report}
