"""`dxr serve`: offer the deployments to a Prefect server and run what it schedules."""

from __future__ import annotations

import signal

import click

from dxr.cli import main, settings, warehouse
from dxr.errors import ConfigError


@main.command()
@click.option("--limit", type=click.IntRange(min=1), default=1, show_default=True,
              help="Flow runs executed at the same time.")
@click.pass_context
def serve(ctx: click.Context, limit: int) -> None:
    """Serve patient reruns, prior retraining and scheduled cohort backfills to a Prefect server until stopped.

    Registers `forecast-patient/adhoc` (start it from the Prefect UI with a cohort and a subject id),
    `train_prior/adhoc` (a cohort; the prior settings are editable per run) and one
    `cohort-backfill/<name>` per `[[backfills]]` table of the configuration, on its cron schedule;
    then executes their flow runs here. Needs a running Prefect server named by
    PREFECT_API_URL. Stopping (Ctrl-C, SIGTERM, a closed terminal) cancels the flow runs in progress
    and pauses the schedules.

    \b
    Example:
      export PREFECT_API_URL=http://127.0.0.1:4200/api
      dxr serve
    """
    from prefect.settings import PREFECT_API_URL

    from flows.api_server import check_configured_api
    from flows.deployments import build_deployments, check_refreshing_backfills, unbuilt_backfill_cohorts
    from flows.serving import serve_until_stopped

    if not PREFECT_API_URL.value():
        raise ConfigError("dxr serve needs a Prefect server: start one with `prefect server start --host 127.0.0.1` "
                          "and export PREFECT_API_URL=http://127.0.0.1:4200/api")
    check_configured_api()
    # Every served flow needs a cohort of this warehouse; a mistyped or relative data dir would re-point the
    # server's deployments at a folder where each run fails.
    wh = warehouse(ctx, existing=True)
    deployments = build_deployments(settings(ctx))
    check_refreshing_backfills(wh, settings(ctx).backfills)
    for deployment in deployments:
        schedules = ", ".join(f"cron {s.schedule.cron} ({s.schedule.timezone})" for s in deployment.schedules or [])
        click.echo(f"deployment {deployment.flow_name}/{deployment.name}: {schedules or 'ad hoc'}")
    for warning in unbuilt_backfill_cohorts(wh, settings(ctx).backfills):
        click.echo(warning, err=True)
    click.echo(f"serving to {PREFECT_API_URL.value()}; stop with Ctrl-C")
    stop_signal = serve_until_stopped(deployments, limit)
    if stop_signal in (signal.SIGINT, signal.SIGHUP):  # SIGTERM, a service manager's stop, is a clean exit
        click.echo(f"dxr: stopped by {signal.Signals(stop_signal).name}", err=True)
        raise SystemExit(128 + stop_signal)
