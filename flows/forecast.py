"""Flow: one forecasting system over a cohort, one task per trajectory shard (`forecast.shard_workers` at once)."""

from __future__ import annotations

from contextlib import ExitStack

from prefect import flow

from dxr.config import load_settings
from dxr.errors import InputError
from flows import flow_run_id
from models.registry import FORECASTERS, FUSED_INPUTS, check_system
from tasks import stage_logger
from tasks.forecast import (check_rerun, clear_outputs, fitted_forecaster, forecast_config, forecast_shard_task,
                            forecast_shards, llm_run_config, pinned_model, run_shards, shard_workers)
from warehouse.choices import FORECAST_SPLITS
from warehouse.cohorts import outdated_cut_note, reading_cohort, rebuild_command, superseded_note
from warehouse.locks import held
from warehouse.runs import check_run_id, registered_run
from warehouse.store import Warehouse


@flow(name="forecast", flow_run_name="forecast-{system}", log_prints=False)
def forecast_flow(data_dir: str, cohort: str, system: str, split: str = "held_out", k: int = 20,
                  limit: int | None = None, run_id: str | None = None, subject_id: int | None = None) -> str:
    """Rank codes for every trajectory of a cohort split with `system`; returns the run id.

    `subject_id` restricts the run to one patient's trajectories (an ad-hoc rerun of one patient).
    """
    if split not in FORECAST_SPLITS:
        raise InputError(f"unknown split {split!r}: use one of {', '.join(FORECAST_SPLITS)}")
    check_system(system)  # fail fast on an unknown system, before registering a run
    # Checked here too, not only by the CLI: deployments take their parameters from the Prefect UI.
    if k < 1:
        raise InputError(f"k must be at least 1, got {k}")
    if limit is not None and limit < 1:
        raise InputError(f"limit must be at least 1 (or none for every trajectory), got {limit}")
    settings = load_settings(data_dir=data_dir)
    workers = shard_workers(system, limit, settings.forecast.shard_workers)
    wh = Warehouse(data_dir)
    run_id = check_run_id(run_id) if run_id else flow_run_id("forecast")
    # Other systems may forecast into the same run at the same time; the same system, a rebuild of
    # the cohort or an evaluation of the run may not.
    with (reading_cohort(wh, cohort) as cohort_row,
          held(wh, f"run:{run_id}", shared=True, busy=f"run {run_id!r} is being evaluated by another dxr process"),
          held(wh, f"run-system:{run_id}|{system}", shared=False,
               busy=f"run {run_id!r} is already being forecast by {system} in another dxr process"),
          ExitStack() as stack):
        for source in FUSED_INPUTS.get(system, ()):  # a fused system reads other systems' lists of the run
            stack.enter_context(held(wh, f"run-system:{run_id}|{source}", shared=True,
                                     busy=f"run {run_id!r} is being forecast by {source}, whose lists {system} "
                                          "fuses, in another dxr process"))
        cohort_id = cohort_row["cohort_id"]
        if superseded := superseded_note(wh, cohort_row):
            # A backfill that fires between a refresh's ingest and its cohort build forecasts yesterday's cohort.
            stage_logger(__name__).warning("%s: this run forecasts that cohort as it was built; `%s` builds the "
                                           "current files", superseded, rebuild_command(cohort_row, settings.seed))
        if outdated := outdated_cut_note(wh, cohort_row):
            # A warning, not a refusal: a dataset the changed rules never meet (for version 1, one whose events all
            # have a time) is cut the same by either version, and a backfill of it that stopped at every upgrade
            # until its cohort is rebuilt would lose nights of lists for nothing.
            stage_logger(__name__).warning("%s; this run forecasts it as it is, and `%s` cuts it again", outdated,
                                           rebuild_command(cohort_row, settings.seed))
        # The cut rules of the build forecast (not an option, see `check_rerun`): the cohort may be built again under
        # its id by other ones, and an evaluation of this run against that build says so (`cohort_rebuilt_note`).
        config = (forecast_config(cohort_id, system, split, k, limit, subject_id) | llm_run_config(system, data_dir)
                  | {"cut_rule_version": cohort_row["cut_rule_version"]})
        shards = forecast_shards(wh, cohort_id, split, subject_id)
        model = pinned_model(wh, cohort_id, system)
        if model is not None:
            config["model"] = model
        # Checked with the `running` row under the run's registration lock: two systems started together into one
        # new run on different cohorts would otherwise both pass the check before either is recorded.
        run = stack.enter_context(registered_run(wh, f"forecast:{system}", config, run_id, cohort_id,
                                                 check=lambda: check_rerun(wh, run_id, config)))
        for fused in clear_outputs(wh, run.run_id, system, settings.llm.prices):
            stage_logger(__name__).warning(
                "removed %s's lists of run %s: they fused the %s lists this run replaces; forecast %s "
                "again with --run-id %s", fused, run.run_id, system, fused, run.run_id)
        version, model_run_id = (model["version"], model["mlflow_run_id"]) if model else (None, None)
        if system in FORECASTERS:  # load the model here, once: a failing load is one error, not one per shard
            fitted_forecaster(str(wh.root), cohort_id, system, version, model_run_id)
        run_shards(lambda shard, remaining: forecast_shard_task(
                       str(wh.root), cohort_id, system, shard, split, k, run.run_id, remaining, subject_id, version,
                       model_run_id),
                   shards, workers, limit)
    return run.run_id
