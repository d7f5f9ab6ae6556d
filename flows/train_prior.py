"""Flow `train_prior`: train and register one or more learned priors for a cohort."""

from __future__ import annotations

from prefect import flow
from pydantic import ValidationError

from dxr.config import load_settings
from dxr.errors import InputError
from flows import flow_run_id
from models.prior.config import PriorConfig, check_prior_systems
from tasks.prior import train_prior_task


@flow(name="train_prior", log_prints=False)
def train_prior_flow(data_dir: str, cohort: str, systems: tuple[str, ...] = ("ehr_prior",),
                     cfg: PriorConfig | None = None, run_id: str | None = None) -> list[dict]:
    """One training task per system, in order, all under one run (kind `train:<system>`); returns each
    training's summary.

    `cfg` holds the prior settings the run changes; the others are the configured ones (see `run_prior_config`).
    A retry of the flow run keeps its run id (`flow_run_id`), so the systems that finished before the
    failure are not trained again (`tasks.prior.finished_training`), nor is one whose version was registered
    before the failure (`models.prior.train.registered_training`).
    """
    systems = tuple(systems)
    check_prior_systems(systems)  # a typo in the last system must not wait for the trainings before it
    cfg = run_prior_config(data_dir, cfg)
    run_id = run_id or flow_run_id("train")
    return [train_prior_task(data_dir, cohort, system, cfg, run_id) for system in systems]


def run_prior_config(data_dir: str, cfg: PriorConfig | None) -> PriorConfig:
    """The configured prior settings with the fields `cfg` sets (`model_fields_set`) over them.

    Prefect merges a run's parameters into its deployment's one level deep: a run of `train_prior/adhoc`
    given `cfg={"promote": false}` receives every other field at its default, not at the configured value
    the deployment's `cfg` holds (the experiment, the alias, a tracking server).
    """
    configured = load_settings(data_dir=data_dir).prior
    if cfg is None:
        return configured
    try:
        return PriorConfig.model_validate(configured.model_dump() | cfg.model_dump(include=cfg.model_fields_set))
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise InputError(f"cfg of this run: {reason} with the configured prior settings (the run sets "
                         f"{', '.join(sorted(cfg.model_fields_set))}): set the clashing settings in cfg together"
                         ) from None
