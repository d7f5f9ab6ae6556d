"""`dxr forecast`: the one command that writes rankings."""

from __future__ import annotations

import json

import click

from dxr.cli import main, settings, valid, warehouse
from dxr.errors import DxrError
from warehouse.choices import FORECAST_SPLITS


def forecastable_system(ctx: click.Context, param: click.Parameter, system: str) -> str:
    """A system id outside those dxr forecast runs is a value outside the option's choices: a usage error (exit
    code 2), as `dxr prior train --system` gives, with check_system's message naming the ids that are."""
    from models.registry import check_system

    return valid.checked(ctx, param, system, check_system)


@main.command()
@click.option("--cohort", required=True, callback=valid.cohort_key, help="Cohort name or id.")
@click.option("--system", required=True, callback=forecastable_system,
              help="Forecasting system id, e.g. repeat_history, ehr_prior, direct.")
@click.option("--split", type=click.Choice(FORECAST_SPLITS), default="held_out",
              show_default=True, help="Which trajectories to forecast.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Forecast at most N trajectories.")
@click.option("--k", type=click.IntRange(min=1), default=20, show_default=True,
              help="Codes per trajectory; a list with fewer is `short`. direct and rrf_prior_direct keep their whole "
              "lists (Direct's up to 30 codes; their union with the prior's 20), of which evaluation scores the first K.")
@click.option("--subject-id", type=int, default=None, help="Forecast only this patient's trajectories (an ad-hoc "
              "rerun of one patient).")
@click.option("--run-id", default=None, callback=valid.run_id,
              help="Run id to write under (generated when absent); reuse it to put several systems in one run.")
@click.pass_context
def forecast(ctx: click.Context, cohort: str, system: str, split: str, limit: int | None, k: int,
             run_id: str | None, subject_id: int | None) -> None:
    """Rank the next encounter's diagnosis codes for a cohort's trajectories.

    \b
    Example:
      dxr forecast --cohort default --system repeat_history --split held_out --run-id demo-1
    """
    import polars as pl

    from flows.api_server import start_temporary_api
    from flows.forecast import forecast_flow
    from tasks.forecast import check_rerun, forecast_config, forecast_shards, llm_run_config, pinned_model
    from warehouse.cohorts import get_cohort
    from warehouse.runs import new_run_id

    # Check the inputs here, so a typo is one line and not a failed flow run with a traceback.
    data_dir, wh = str(settings(ctx).data_dir), warehouse(ctx, existing=True)
    cohort_id = get_cohort(wh, cohort, suggest_build=True)["cohort_id"]
    check_rerun(wh, run_id, forecast_config(cohort_id, system, split, k, limit, subject_id)
                | llm_run_config(system, data_dir))
    forecast_shards(wh, cohort_id, split, subject_id)  # an empty split or a patient outside it
    pinned_model(wh, cohort_id, system)  # a learned system without a registered model
    start_temporary_api()
    # A generated id is made here rather than in the flow, so that a failure's line can name the run to resume.
    run = run_id or new_run_id("forecast")
    try:
        forecast_flow(data_dir, cohort, system, split=split, k=k, limit=limit, run_id=run, subject_id=subject_id)
    except (DxrError, SystemExit) as exc:  # SystemExit: stopped by a signal (dxr.cli.terminated)
        if run_id is None and not wh.read("runs", run_id=run).is_empty():
            resume = f"recorded failed; resume it with --run-id {run}"
            if isinstance(exc, SystemExit):
                click.echo(f"dxr: run {run} {resume}", err=True)
                raise
            raise DxrError(f"run {run} ({resume}): {exc}") from exc
        raise
    status = wh.read("ranking_status", run_id=run, system=system)
    failed = status.filter(pl.col("status") == "failed")
    if failed.height and failed.height == status.height:  # e.g. an LLM whose every reply stays invalid: no list
        raise DxrError(f"run {run}: every {system} forecast failed ({failed.height} of {status.height} "
                       f"trajectories), e.g. {failed['detail'][0]}: fix the cause, then rerun with --run-id {run} "
                       "(details in ranking_status and llm_calls)")
    whom = "" if subject_id is None else f", patient {subject_id}"
    recorded = json.loads(wh.read("runs", run_id=run, kind=f"forecast:{system}")["config_json"][0])
    model = recorded.get("model")
    using = "" if model is None else f" with {model['registered_model']} v{model['version']} (@{model['alias']})"
    # A short or failed list is no error of the run, but the user should not have to look for it.
    counts = dict(status.group_by("status").len().iter_rows())
    outcome = ", ".join(f"{counts[s]:,} {s}" for s in ("ok", "short", "failed") if s in counts)
    why = " (ranking_status says why)" if set(counts) - {"ok"} else ""
    click.echo(f"run {run}: system {system}{using} wrote rankings for cohort {cohort} ({split}{whom}): "
               f"{status.height:,} trajector{'y' if status.height == 1 else 'ies'}, {outcome}{why}")
