"""The run registry: every producing command records what it ran, with which code, and how it ended."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import polars as pl

from dxr import __version__
from dxr.errors import InputError
from warehouse.locks import held
from warehouse.store import SAFE_VALUE, Warehouse


def check_run_id(run_id: str) -> str:
    """A run id becomes a partition value and part of lock names: letters, digits and _.:- only."""
    if not SAFE_VALUE.match(run_id):
        raise InputError(f"run id {run_id!r} has unsafe characters: use letters, digits and _.:-")
    return run_id


def new_run_id(kind: str) -> str:
    """A readable, unique run id: kind, UTC timestamp, random suffix."""
    return f"{kind}-{datetime.utcnow():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


@lru_cache(maxsize=1)
def code_version() -> str:
    """Package version plus the git commit (and `+dirty`) when running from a checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return f"{__version__}+{sha}{'.dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return __version__


def record_run(wh: Warehouse, run_id: str, cohort_id: str | None, kind: str, config: dict, status: str,
               started_at: datetime, finished_at: datetime | None = None) -> None:
    """Write (or overwrite) the registry row of one run and kind, recorded by this process."""
    row = {"run_id": run_id, "cohort_id": cohort_id, "kind": kind,
           "config_json": json.dumps(config, sort_keys=True, default=str), "code_version": code_version(),
           "started_at": started_at, "finished_at": finished_at, "status": status,
           "host": socket.gethostname(), "pid": os.getpid()}
    wh.write("runs", pl.DataFrame([row], schema_overrides={"finished_at": pl.Datetime("us")}), run_id=run_id, kind=kind)


@dataclass
class Run:
    """A run being recorded; the body may set `cohort_id` once it is known (e.g. after a build)."""

    run_id: str
    kind: str
    config: dict
    cohort_id: str | None = None


def _record_lock(run_id: str, kind: str) -> str:
    return f"record:{run_id}|{kind}"


@contextmanager
def registered_run(wh: Warehouse, kind: str, config: dict, run_id: str | None = None,
                   cohort_id: str | None = None) -> Iterator[Run]:
    """Record a run as `running`, then `finished` or `failed` (re-raising) when the body ends.

    The run's record lock is held from before the `running` row until after the last one, so a
    `running` row whose lock is free was left by a killed process (`mark_killed`).
    """
    run = Run(run_id or new_run_id(kind.split(":")[0]), kind, config, cohort_id)
    mark_killed(wh)
    # `wait`: another process's `mark_killed` may hold the lock for a moment.
    with held(wh, _record_lock(run.run_id, kind), shared=False, wait=5.0,
              busy=f"run {run.run_id!r} ({kind}) is being recorded by another dxr process"):
        started = datetime.now()
        record_run(wh, run.run_id, run.cohort_id, kind, config, "running", started)
        try:
            yield run
        except BaseException:
            record_run(wh, run.run_id, run.cohort_id, kind, run.config, "failed", started, datetime.now())
            raise
        record_run(wh, run.run_id, run.cohort_id, kind, run.config, "finished", started, datetime.now())


def mark_killed(wh: Warehouse) -> list[tuple[str, str]]:
    """Rewrite as `killed` the `running` rows whose process ended without recording how (SIGKILL,
    the OOM killer, a lost node); returns their (run_id, kind).

    SIGTERM and Ctrl-C unwind and record `failed` themselves. A row is judged by its record lock,
    which the kernel releases when the process ends, so this holds across hosts and containers that
    share the warehouse on a file system with working `flock`.
    """
    killed = []
    if not wh.has_rows("runs"):
        return killed
    # A DuckDB scan: a warehouse of a few thousand runs is read in a fraction of a second.
    running = wh.connect().execute("SELECT run_id, kind FROM runs WHERE status = 'running' ORDER BY ALL").fetchall()
    for run_id, kind in running:
        try:
            with held(wh, _record_lock(run_id, kind), shared=False, busy="alive"):
                # Read again under the lock: the run may have ended normally since the first read.
                current = wh.read("runs", run_id=run_id, kind=kind)
                if current.is_empty() or current["status"][0] != "running":
                    continue
                wh.write("runs", current.with_columns(pl.lit("killed").alias("status")), run_id=run_id, kind=kind)
                killed.append((run_id, kind))
        except InputError:  # its process still holds the lock
            continue
    return killed


@contextmanager
def holding_run(wh: Warehouse, run_id: str, *, exclusive: bool) -> Iterator[None]:
    """A run and its cohorts held for the block.

    Exclusive to evaluate it (no forecast writes into it while it is read and its metrics are
    written); shared to read its evaluation (a report). Its cohorts are held shared either way, so
    no rebuild replaces their targets and oracles meanwhile.
    """
    check_run_id(run_id)
    busy = "being forecast or evaluated" if exclusive else "being evaluated"
    with held(wh, f"run:{run_id}", shared=not exclusive, busy=f"run {run_id!r} is {busy} by another dxr process"), \
            ExitStack() as cohorts:
        registered = wh.read("runs", run_id=run_id)["cohort_id"].drop_nulls().unique().sort().to_list()
        for cohort_id in registered:
            cohorts.enter_context(held(wh, f"cohort:{cohort_id}", shared=True,
                                       busy=f"cohort {cohort_id} of run {run_id!r} is being rebuilt by another dxr "
                                            "process"))
        yield
