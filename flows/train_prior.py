"""Flow `train_prior`: train and register one or more learned priors for a cohort."""

from __future__ import annotations

from prefect import flow

from models.prior.config import PriorConfig
from tasks.prior import train_prior_task


@flow(name="train_prior", log_prints=False)
def train_prior_flow(data_dir: str, cohort: str, systems: tuple[str, ...] = ("ehr_prior",),
                     cfg: PriorConfig | None = None, run_id: str | None = None) -> list[dict]:
    """One training task per system, in order, all under `run_id` when given (kind `train:<system>`);
    returns each training's summary."""
    cfg = cfg or PriorConfig()
    return [train_prior_task(data_dir, cohort, system, cfg, run_id) for system in systems]
