"""The `dxr` command line. Each command group lives in its own module and registers on `main`.

Library code raises `DxrError` subclasses; `main` turns them into one line on stderr and exit 1.
"""

from __future__ import annotations

import sys

import click

from dxr import __version__
from dxr.config import Settings, load_settings
from dxr.errors import DxrError


class DxrGroup(click.Group):
    """A click group that reports library errors as one line instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DxrError as exc:
            raise click.ClickException(str(exc)) from exc


@click.group(cls=DxrGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dxr")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Warehouse root (default: setting data_dir, env DXR_DATA_DIR, else ./data).")
@click.pass_context
def main(ctx: click.Context, data_dir: str | None) -> None:
    """Evidence-grounded next-encounter ICD forecasting on MEDS data.

    \b
    Example:
      dxr demo
    """
    ctx.obj = {"data_dir": data_dir}


def settings(ctx: click.Context) -> Settings:
    """Settings for this invocation, with `--data-dir` applied."""
    data_dir = (ctx.find_root().obj or {}).get("data_dir")
    return load_settings(**({"data_dir": data_dir} if data_dir else {}))


def warehouse(ctx: click.Context):
    from warehouse.store import Warehouse

    return Warehouse(settings(ctx).data_dir)


def echo_err(message: str) -> None:
    click.echo(message, err=True)


# Command modules register themselves on `main` when imported.
from dxr.cli import data, demo, forecast  # noqa: E402,F401
from dxr.cli import ingest_mimic  # noqa: E402,F401
from dxr.cli import corpus  # noqa: E402,F401
from dxr.cli import evaluate  # noqa: E402,F401
from dxr.cli import prior  # noqa: E402,F401

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
