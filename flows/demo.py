"""Flow `demo`: the main job on the embedded default data, end to end.

synthetic dataset -> default cohort -> EHR prior (trained once per cohort build) -> baselines and
the prior on held_out, evaluated and reported (the `cohort-backfill` flow); then, on a small held_out
sample, Direct Forecast with the configured LLM (the embedded model by default) and Union + RRF of
the prior and Direct lists, evaluated as their own run `<run_id>-llm` on exactly those patients.
Every step is idempotent: a rerun reuses an identical dataset, the registered prior and the LLM
response cache, and replaces its own partitions.
"""

from __future__ import annotations

from prefect import flow, task

from dxr.config import Settings
from flows import flow_run_id
from flows.backfill import cohort_backfill_flow
from tasks import stage_logger
from tasks.forecast import status_counts
from tasks.prior import ensure_prior
from tasks.realism import realism_table
from tasks.report import report_path
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import create_synthetic, synthetic_is_current
from warehouse.store import Warehouse

DEMO_DATASET = "synthetic"
DEMO_COHORT = "default"
DEMO_SYSTEMS = ("global_frequency", "repeat_history", "ehr_prior")
LLM_SAMPLE_SYSTEMS = ("ehr_prior", "direct", "rrf_prior_direct")


@task(name="synthetic-dataset")
def synthetic_dataset_task(wh: Warehouse, patients: int, seed: int, shard_size: int) -> str:
    if not synthetic_is_current(wh, DEMO_DATASET, patients, seed):
        create_synthetic(wh, DEMO_DATASET, patients, seed, shard_size, progress=True,
                         log=stage_logger(__name__).info)
    return DEMO_DATASET


@task(name="build-cohort")
def build_cohort_task(wh: Warehouse, dataset_id: str, settings: Settings) -> dict:
    return build_cohort(wh, dataset_id, DEMO_COHORT, CohortOptions(min_history=settings.cohort.min_history),
                        seed=settings.seed, shard_size=settings.cohort.shard_size,
                        oracle_draws=settings.synth.oracle_draws, memory_limit=settings.cohort.memory_limit,
                        progress=True, log=stage_logger(__name__).info)


@task(name="ensure-ehr-prior")
def ensure_prior_task(wh: Warehouse, cohort_id: str, settings: Settings) -> str:
    return ensure_prior(str(wh.root), cohort_id, "ehr_prior", settings.prior)


@flow(name="demo")
def demo_flow(settings: Settings, run_id: str | None = None, llm_sample: int = 4) -> dict:
    """Run the demo; returns the run ids, metrics frames, the realism table and the report paths.

    `llm_sample` held_out patients get Direct Forecast and Union + RRF (0 skips the LLM part).
    """
    wh = Warehouse(settings.data_dir)
    dataset_id = synthetic_dataset_task(wh, settings.synth.patients, settings.seed, settings.synth.shard_size)
    cohort = build_cohort_task(wh, dataset_id, settings)
    cohort_id = cohort["cohort_id"]
    ensure_prior_task(wh, cohort_id, settings)
    run_id = run_id or flow_run_id("demo")
    cohort_backfill_flow(str(wh.root), cohort_id, DEMO_SYSTEMS, split="held_out", run_id=run_id)
    result = {"run_id": run_id, "cohort": cohort, "metrics": wh.read("metrics", run_id=run_id),
              "realism": realism_table(wh, cohort_id, run_id), "report": report_path(wh, run_id), "llm": None}
    if llm_sample:
        llm_run = f"{run_id}-llm"
        cohort_backfill_flow(str(wh.root), cohort_id, LLM_SAMPLE_SYSTEMS, split="held_out", limit=llm_sample,
                             run_id=llm_run)
        result["llm"] = {"run_id": llm_run, "metrics": wh.read("metrics", run_id=llm_run),
                         "status": status_counts(wh, llm_run), "report": report_path(wh, llm_run)}
    return result
