"""The `dxr` command line. Each command group lives in its own module and registers on `main`.

Library code raises `DxrError` subclasses; `main` turns them into one line on stderr and exit 1. An option's value
that is malformed whatever the warehouse holds is refused by its callback (`dxr.cli.valid`) as a usage error, exit 2.
"""

from __future__ import annotations

import errno
import io
import signal
import sys
import threading

import click

from dxr import __version__
from dxr.config import Settings, load_settings
from dxr.errors import DxrError, NotFoundError, quiet_user_errors


def one_line(exc: OSError) -> str:
    """An operating-system error as one line naming the path and the fix."""
    if exc.filename is None:
        return str(exc)
    where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else exc.filename
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "make it writable or choose another location (--data-dir, --out, DXR_DATA_DIR)"
    elif exc.errno == errno.ENOTDIR:
        fix = "a part of this path is a file; point to a directory"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free disk space (or raise the quota) there or choose another location (--data-dir, DXR_DATA_DIR, TMPDIR)"
    elif exc.errno == errno.EFBIG:  # a file past the process's size limit (`ulimit -f`) or the file system's largest
        fix = "raise the file-size limit (ulimit -f) or choose another location (--data-dir, DXR_DATA_DIR, TMPDIR)"
    else:
        fix = "check the path"
    return f"{where}: {exc.strerror}: {fix}"


_received: list[int] = []  # the terminating signal, once it has arrived


def terminated(signum: int, frame) -> None:
    """SIGTERM and Ctrl-C (SIGINT): stop DuckDB's queries in flight and unwind with exit code 128 + signal."""
    from warehouse.duck import interrupt_queries

    _received.append(signum)
    click.echo(f"dxr: stopped by {signal.Signals(signum).name}", err=True)
    interrupt_queries()  # the exception below alone does not stop a multi-threaded DuckDB query
    raise SystemExit(128 + signum)


class OneLineUsageError(click.UsageError):
    """A usage error (unknown option, bad choice, missing option) as one line, still with exit code 2."""

    def show(self, file=None) -> None:
        command = self.ctx.command_path if self.ctx is not None else "dxr"
        click.echo(f"Error: {self.format_message()} (usage: {command} -h)", err=True, file=file)


def _in_one_line(exc: click.UsageError) -> click.UsageError:
    """The usage error as one line; a bare `dxr` or `dxr cohort` keeps showing its help."""
    if isinstance(exc, (OneLineUsageError, click.exceptions.NoArgsIsHelpError)):
        return exc
    message = exc.format_message()
    if isinstance(exc, click.NoSuchOption) and exc.option_name == "--data-dir" and exc.ctx is not None:
        # The benchmark scripts take --data-dir after their name, so it is easily typed after a dxr command too.
        command = exc.ctx.command_path.removeprefix(exc.ctx.find_root().command_path).strip()
        message = (f"No such option '--data-dir' here: it is an option of dxr itself, given before the command "
                   f"(dxr --data-dir DIR {command} …), or set DXR_DATA_DIR")
    one = OneLineUsageError(message, exc.ctx)
    one.__cause__ = exc
    return one


def tolerant_output() -> None:
    """Make stdout and stderr write a character their encoding lacks as an escape (`\\u2192`) instead of raising.

    dxr prints `→`, `≥`, `…`, `Ω` and the data's own text (titles, names). Click writes UTF-8 where the terminal
    says ASCII, but trusts any other encoding: under `PYTHONIOENCODING=latin-1` (or a Latin-1 locale without
    Python's UTF-8 coercion) `dxr evaluate --help` and any query showing such a character died with
    UnicodeEncodeError, part way through the output."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")


class DxrGroup(click.Group):
    """A click group that reports library, file-system and usage errors as one line instead of a
    traceback or Click's usage block."""

    def main(self, *args, **kwargs):
        tolerant_output()  # before anything is printed: help, usage errors and the command's output alike
        return super().main(*args, **kwargs)

    def make_context(self, info_name, args, parent=None, **extra):
        try:  # the group's own options
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _in_one_line(exc)

    def invoke(self, ctx: click.Context):
        if threading.current_thread() is threading.main_thread():
            # `kill` (SIGTERM, e.g. from a scheduler) and Ctrl-C unwind, so runs are recorded `failed`
            # and temporary files are removed instead of the process vanishing mid-write.
            signal.signal(signal.SIGTERM, terminated)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when Ctrl-C is ignored
                signal.signal(signal.SIGINT, terminated)
        _received.clear()  # a signal handled in an earlier invocation of this process is not this one's
        quiet_user_errors()
        try:
            return super().invoke(ctx)
        except Exception as exc:
            if _received:  # the signal surfaced as another error, e.g. DuckDB's "Query interrupted"
                raise SystemExit(128 + _received[0]) from exc
            if isinstance(exc, click.UsageError):
                raise _in_one_line(exc)
            if isinstance(exc, DxrError):
                raise click.ClickException(str(exc)) from exc
            if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
                raise click.ClickException(one_line(exc)) from exc
            raise  # a broken pipe (`dxr … | head`) ends quietly in click's main; anything else is a bug


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


def warehouse(ctx: click.Context, existing: bool = False):
    """The warehouse at the configured data dir; with `existing`, refuse one that was never created
    (reading commands would otherwise show a mistyped --data-dir as an empty warehouse)."""
    from warehouse.store import Warehouse

    wh = Warehouse(settings(ctx).data_dir)
    if existing and not (wh.forecast_dir.is_dir() or wh.gold_dir.is_dir()):
        raise NotFoundError(f"no warehouse at {wh.root}: pass the right --data-dir (or DXR_DATA_DIR), or create "
                            "one with `dxr synth` or `dxr ingest`")
    return wh


def echo_err(message: str) -> None:
    click.echo(message, err=True)


# Command modules register themselves on `main` when imported.
from dxr.cli import data, demo, forecast  # noqa: E402,F401
from dxr.cli import ingest_mimic  # noqa: E402,F401
from dxr.cli import corpus  # noqa: E402,F401
from dxr.cli import evaluate  # noqa: E402,F401
from dxr.cli import prior  # noqa: E402,F401
from dxr.cli import runs  # noqa: E402,F401
from dxr.cli import serve  # noqa: E402,F401

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
