"""`dxr serve`: offer the deployments to a Prefect server and run what it schedules."""

from __future__ import annotations

import re
import signal

import click

from dxr.cli import echo_err, main, settings, warehouse
from dxr.config import DEPLOYMENT_NAME_PATTERN
from dxr.errors import ConfigError


def check_serve_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not re.match(DEPLOYMENT_NAME_PATTERN, value):
        raise click.BadParameter(f"{value!r} is no name of lower-case letters, digits, '-' and '_' that starts with a "
                                 "letter or digit, such as hosp2", ctx, param)
    return value


@main.command()
@click.option("--limit", type=click.IntRange(min=1), default=1, show_default=True,
              help="Flow runs executed at the same time.")
@click.option("--name", "serve_name", callback=check_serve_name,
              help="Append -NAME to every deployment's name (adhoc-NAME, <backfill>-NAME), so that serves of "
                   "several data dirs can share one Prefect server.")
@click.pass_context
def serve(ctx: click.Context, limit: int, serve_name: str | None) -> None:
    """Serve patient reruns, prior retraining and scheduled cohort backfills to a Prefect server until stopped.

    Registers `forecast-patient/adhoc` (start it from the Prefect UI with a cohort and a subject id),
    `train_prior/adhoc` (a cohort; the prior settings are editable per run) and one
    `cohort-backfill/<name>` per `[[backfills]]` table of the configuration, on its cron schedule;
    then executes their flow runs here. Needs a running Prefect server named by
    PREFECT_API_URL. Stopping (Ctrl-C, SIGTERM, a closed terminal) cancels the flow runs in progress
    and pauses the schedules. Refuses deployment names that another dxr serve is serving now: give each
    data dir served to one Prefect server its own --name.

    \b
    Example:
      export PREFECT_API_URL=http://127.0.0.1:4200/api
      dxr serve
      dxr --data-dir /srv/hosp2 serve --name hosp2   # forecast-patient/adhoc-hosp2, ...
    """
    from prefect.settings import PREFECT_API_URL

    from flows.api_server import check_configured_api
    from flows.deployments import build_deployments, check_refreshing_backfills, unbuilt_backfill_cohorts
    from flows.serving import check_not_served_elsewhere, serve_until_stopped

    cfg = settings(ctx)  # a configuration error first: it needs no server to be found
    if not PREFECT_API_URL.value():
        raise ConfigError("dxr serve needs a Prefect server: start one with `prefect server start --host 127.0.0.1` "
                          "and export PREFECT_API_URL=http://127.0.0.1:4200/api")
    check_configured_api()
    # Every served flow needs a cohort of this warehouse; a mistyped or relative data dir would re-point the
    # server's deployments at a folder where each run fails.
    wh = warehouse(ctx, existing=True)
    deployments = build_deployments(cfg, serve_name)
    check_refreshing_backfills(wh, cfg.backfills)
    for note in check_not_served_elsewhere(deployments, str(wh.root), say=echo_err):
        echo_err(note)
    for deployment in deployments:
        schedules = ", ".join(f"cron {s.schedule.cron} ({s.schedule.timezone})" for s in deployment.schedules or [])
        click.echo(f"deployment {deployment.flow_name}/{deployment.name}: {schedules or 'ad hoc'}")
    for warning in unbuilt_backfill_cohorts(wh, cfg.backfills):
        click.echo(warning, err=True)
    click.echo(f"serving to {PREFECT_API_URL.value()}; stop with Ctrl-C")
    stop_signal = serve_until_stopped(deployments, limit)
    if stop_signal in (signal.SIGINT, signal.SIGHUP):  # SIGTERM, a service manager's stop, is a clean exit
        click.echo(f"dxr: stopped by {signal.Signals(stop_signal).name}", err=True)
        raise SystemExit(128 + stop_signal)
