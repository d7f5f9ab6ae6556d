"""Flow `train_prior`: train and register one or more learned priors for a cohort."""

from __future__ import annotations

from prefect import flow

from flows import flow_run_id
from models.prior.config import PriorConfig, check_prior_systems
from tasks.prior import run_prior_config, train_prior_task


@flow(name="train_prior", flow_run_name="train-{cohort}", log_prints=False)
def train_prior_flow(data_dir: str, cohort: str, systems: tuple[str, ...] = ("ehr_prior",),
                     cfg: PriorConfig | None = None, run_id: str | None = None) -> list[dict]:
    """One training task per system, in order, all under one run (kind `train:<system>`); returns each
    training's summary.

    `cfg` holds the prior settings the run changes; the others are the configured ones
    (`tasks.prior.run_prior_config`).
    A retry of the flow run keeps its run id (`flow_run_id`), so the systems that finished before the
    failure are not trained again (`tasks.prior.finished_training`), nor is one whose version was registered
    before the failure (`models.prior.train.registered_training`).

    Args:
        data_dir: the warehouse's data directory (set by `dxr serve`).
        cohort: the cohort's name or id (`dxr cohort list`); training reads its train patients only.
        systems: the learned systems to train, in order: ehr_prior, dense_prior, gru.
        cfg: prior settings for this run (the configured ones by default); promote false registers a
            challenger without moving the alias.
        run_id: resume this training run; empty for a new run.
    """
    systems = tuple(systems)
    check_prior_systems(systems)  # a typo in the last system must not wait for the trainings before it
    cfg = run_prior_config(data_dir, cfg)
    run_id = run_id or flow_run_id("train")
    return [train_prior_task(data_dir, cohort, system, cfg, run_id) for system in systems]

