"""`dxr prior`: train the learned EHR priors (MoE transformer, dense ablation, GRU)."""

from __future__ import annotations

import click

from dxr.cli import echo_err, main, settings, valid, warehouse
from dxr.errors import InputError
from models.prior.config import ARCHS, MAX_SEED, PriorConfig
from warehouse.choices import OUTPUT_FORMATS

PRIOR_SYSTEMS = tuple(ARCHS)


@main.group()
def prior() -> None:
    """Train the learned EHR priors, list their registered versions and choose the one forecasts use.

    \b
    Example:
      dxr prior train --cohort default
      dxr prior models --cohort default
    """


@prior.command("train")
@click.option("--cohort", required=True, callback=valid.cohort_key, help="Cohort name or id.")
@click.option("--system", "systems", type=click.Choice(PRIOR_SYSTEMS), multiple=True, default=("ehr_prior",),
              callback=valid.prior_systems, show_default=True,
              help="System(s) to train; repeat the option for several.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Override setting prior.epochs.")
@click.option("--patience", type=click.IntRange(min=1), default=None,
              help="Override setting prior.patience: stop once N epochs in a row bring no better tuning R@20.")
@click.option("--max-train-patients", type=click.IntRange(min=1), default=None,
              help="Train on at most N train patients (quick runs).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None, help="Override setting prior.seed.")
@click.option("--promote/--no-promote", default=None, help="Override setting prior.promote: point the alias at the "
              "new version (or leave it where it is, to compare first).")
@click.option("--run-id", default=None, callback=valid.run_id,
              help="Run id to register (generated when absent); each system's training is recorded under it with "
                   "kind train:<system>.")
@click.pass_context
def prior_train(ctx: click.Context, cohort: str, systems: tuple[str, ...], epochs: int | None, patience: int | None,
                max_train_patients: int | None, seed: int | None, promote: bool | None, run_id: str | None) -> None:
    """Train on train patients, validate on tuning pre-target records, register in MLflow and set the alias.

    \b
    Example:
      dxr prior train --cohort default --system ehr_prior --system gru --epochs 4
    """
    from pydantic import ValidationError

    from flows.api_server import start_temporary_api
    from flows.train_prior import train_prior_flow
    from warehouse.cohorts import get_cohort
    from warehouse.runs import check_run_kind

    s = settings(ctx)
    overrides = {k: v for k, v in {"epochs": epochs, "patience": patience, "max_train_patients": max_train_patients,
                                   "seed": seed, "promote": promote}.items() if v is not None}
    cfg = s.prior.model_copy(update=overrides)
    # Check the inputs here, so a typo is one line and not a failed flow run with its log, after a server's start.
    try:
        PriorConfig.model_validate(cfg.model_dump())  # an option may clash with a setting (--patience)
    except ValidationError as exc:
        raise InputError(f"{exc.errors()[0]['msg'].removeprefix('Value error, ')} (the options of this command "
                         "over the prior settings in force, which `dxr config show` prints)") from None
    wh = warehouse(ctx, existing=True)
    get_cohort(wh, cohort, suggest_build=True)
    if run_id:
        check_run_kind(wh, run_id, f"train:{systems[0]}")
    start_temporary_api()
    for result in train_prior_flow(str(s.data_dir), cohort, tuple(systems), cfg, run_id):
        epoch = int(result['metrics']['selected_epoch']) + 1
        recall = result['metrics'].get('val_recall_at_20')
        # No tuning record with two visits (the MIMIC-III demo's 2 tuning patients): no R@20, not "nan".
        validated = (f"no tuning pair to validate on (kept the last epoch, {epoch})" if recall is None
                     else f"val R@20 {recall:.3f} (epoch {epoch})")
        if (trained := int(result['metrics']['epochs_trained'])) < cfg.epochs:
            validated += f", stopped early after epoch {trained}/{cfg.epochs}"
        click.echo(f"{result['system']}: registered {result['registered_model']} v{result['version']}"
                   f"{' @' + result['alias'] if result['alias'] else ''}; {validated}, "
                   f"{result['n_train_patients']} train patients in {result['train_seconds']:.0f} s "
                   f"(mlflow run {result['mlflow_run_id']})")


@prior.command("models")
@click.option("--cohort", required=True, callback=valid.cohort_key, help="Cohort name or id.")
@click.option("--system", "systems", type=click.Choice(PRIOR_SYSTEMS), multiple=True, default=PRIOR_SYSTEMS,
              callback=valid.prior_systems,
              help="System(s) to list; repeat the option for several.  [default: all]")
@click.option("--format", "fmt", type=click.Choice(OUTPUT_FORMATS), default="table", show_default=True,
              help="An aligned table, CSV, or JSON lines, spelt as `dxr sql` spells them.")
@click.pass_context
def prior_models(ctx: click.Context, cohort: str, systems: tuple[str, ...], fmt: str) -> None:
    """List the registered versions of the learned priors of a cohort, with their aliases and tuning metrics.

    The metrics are those of the epoch whose weights the version holds (selected_epoch, counted from 1) among the
    epochs_trained (fewer than prior.epochs when the patience stopped the training). dxr_run_id is the run that
    trained the version, as `dxr run list` shows it.

    \b
    Example:
      dxr prior models --cohort default --system ehr_prior
    """
    import pyarrow as pa

    from tasks.prior import lost_versions_note, prior_versions
    from warehouse.sql import table_text

    warehouse(ctx, existing=True)  # a mistyped --data-dir is said so, not taken for one without the cohort
    data_dir, cfg = str(settings(ctx).data_dir), settings(ctx).prior
    rows = prior_versions(data_dir, cohort, tuple(systems), cfg)
    if note := lost_versions_note(data_dir, cohort, tuple(systems), rows, cfg):
        echo_err(note)
    listed = [{**r, "aliases": ",".join(r["aliases"]), "created_at": f"{r['created_at']:%Y-%m-%d %H:%M:%S}"}
              for r in rows]
    columns = pa.schema({"system": pa.string(), "version": pa.string(), "aliases": pa.string(),
                         "created_at": pa.string(), "selected_epoch": pa.int64(), "val_recall_at_20": pa.float64(),
                         "val_precision_at_20": pa.float64(), "mlflow_run_id": pa.string(),
                         "epochs_trained": pa.int64(), "dxr_run_id": pa.string()})
    click.echo(table_text(pa.Table.from_pylist(listed, schema=columns), fmt), nl=False)


@prior.command("promote")
@click.option("--cohort", required=True, callback=valid.cohort_key, help="Cohort name or id.")
@click.option("--system", type=click.Choice(PRIOR_SYSTEMS), default="ehr_prior", show_default=True,
              help="System whose alias moves.")
@click.option("--version", "version", required=True, callback=valid.model_version,
              help="Registered version the alias should point to.")
@click.option("--run-id", default=None, callback=valid.run_id, help="Run id to register (generated when absent).")
@click.pass_context
def prior_promote(ctx: click.Context, cohort: str, system: str, version: str, run_id: str | None) -> None:
    """Point the alias (setting prior.alias, default champion) at a registered version: a rollback, or a
    model trained with --no-promote put into service. Forecasts started afterwards use it.

    \b
    Example:
      dxr prior promote --cohort default --system ehr_prior --version 2
    """
    from tasks.prior import promote_prior

    s = settings(ctx)
    warehouse(ctx, existing=True)
    done = promote_prior(str(s.data_dir), cohort, system, version, s.prior, run_id)
    before = "was unset" if done["previous_version"] is None else f"was v{done['previous_version']}"
    click.echo(f"{system}-{done['cohort']}: @{done['alias']} -> v{version} ({before}; "
               f"recorded as run {done['run_id']})")
