"""Data commands: synthetic generation, ingestion, cohorts, SQL and configuration."""

from __future__ import annotations

import json

import click

from dxr.cli import main, settings, warehouse


@main.group()
def config() -> None:
    """Show the configuration in force.

    \b
    Example:
      dxr config show
    """


@config.command("show")
@click.pass_context
def config_show(ctx: click.Context) -> None:
    """Print every setting with its value (TOML file + DXR_* environment + defaults).

    \b
    Example:
      DXR_DATA_DIR=/tmp/wh dxr config show
    """
    from dxr.config import config_path

    values = settings(ctx).model_dump(mode="json")
    path = config_path()
    click.echo(f"# config file: {path if path else '(none; ./dxr.toml or DXR_CONFIG)'}")
    click.echo(json.dumps(values, indent=2))


@main.command()
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--with-gold", is_flag=True, help="Also open the gold store (targets, raw MEDS, oracle).")
@click.pass_context
def sql(ctx: click.Context, query: str, fmt: str, with_gold: bool) -> None:
    """Run read-only SQL over the warehouse views.

    \b
    Example:
      dxr sql "SELECT system, count(*) FROM rankings GROUP BY ALL" --format csv
    """
    from warehouse.sql import run_query

    click.echo(run_query(warehouse(ctx), query, fmt=fmt, with_gold=with_gold), nl=False)
