"""`dxr prior`: train the learned EHR priors (MoE transformer, dense ablation, GRU)."""

from __future__ import annotations

import click

from dxr.cli import main, settings

PRIOR_SYSTEMS = ("ehr_prior", "dense_prior", "gru")


@main.group()
def prior() -> None:
    """Train and inspect the learned EHR priors.

    \b
    Example:
      dxr prior train --cohort default
    """


@prior.command("train")
@click.option("--cohort", required=True, help="Cohort name or id.")
@click.option("--system", "systems", type=click.Choice(PRIOR_SYSTEMS), multiple=True, default=("ehr_prior",),
              show_default=True, help="System(s) to train; repeat the option for several.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Override setting prior.epochs.")
@click.option("--max-train-patients", type=click.IntRange(min=1), default=None,
              help="Train on at most N train patients (quick runs).")
@click.option("--seed", type=int, default=None, help="Override setting prior.seed.")
@click.option("--run-id", default=None, help="Run id to register (generated when absent); each system's training "
              "is recorded under it with kind train:<system>.")
@click.pass_context
def prior_train(ctx: click.Context, cohort: str, systems: tuple[str, ...], epochs: int | None,
                max_train_patients: int | None, seed: int | None, run_id: str | None) -> None:
    """Train on train patients, validate on tuning pre-target records, register in MLflow and set the alias.

    \b
    Example:
      dxr prior train --cohort default --system ehr_prior --system gru --epochs 4
    """
    from flows.api_server import start_temporary_api
    from flows.train_prior import train_prior_flow

    s = settings(ctx)
    overrides = {k: v for k, v in {"epochs": epochs, "max_train_patients": max_train_patients, "seed": seed}.items()
                 if v is not None}
    cfg = s.prior.model_copy(update=overrides)
    start_temporary_api()
    for result in train_prior_flow(str(s.data_dir), cohort, tuple(systems), cfg, run_id):
        click.echo(f"{result['system']}: registered {result['registered_model']} v{result['version']}"
                   f"{' @' + result['alias'] if result['alias'] else ''}; "
                   f"val R@20 {result['metrics'].get('val_recall_at_20', float('nan')):.3f} "
                   f"(epoch {int(result['metrics']['selected_epoch']) + 1}), "
                   f"{result['n_train_patients']} train patients in {result['train_seconds']:.0f} s "
                   f"(mlflow run {result['mlflow_run_id']})")
