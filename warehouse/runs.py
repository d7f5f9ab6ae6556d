"""The run registry: every producing command records what it ran, with which code, and how it ended."""

from __future__ import annotations

import json
import subprocess
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import polars as pl

from dxr import __version__
from dxr.errors import InputError
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
    """Write (or overwrite) the registry row of one run and kind."""
    row = {"run_id": run_id, "cohort_id": cohort_id, "kind": kind,
           "config_json": json.dumps(config, sort_keys=True, default=str), "code_version": code_version(),
           "started_at": started_at, "finished_at": finished_at, "status": status}
    wh.write("runs", pl.DataFrame([row], schema_overrides={"finished_at": pl.Datetime("us")}), run_id=run_id, kind=kind)


@dataclass
class Run:
    """A run being recorded; the body may set `cohort_id` once it is known (e.g. after a build)."""

    run_id: str
    kind: str
    config: dict
    cohort_id: str | None = None


@contextmanager
def registered_run(wh: Warehouse, kind: str, config: dict, run_id: str | None = None,
                   cohort_id: str | None = None) -> Iterator[Run]:
    """Record a run as `running`, then `finished` or `failed` (re-raising) when the body ends."""
    run = Run(run_id or new_run_id(kind.split(":")[0]), kind, config, cohort_id)
    started = datetime.now()
    record_run(wh, run.run_id, run.cohort_id, kind, config, "running", started)
    try:
        yield run
    except BaseException:
        record_run(wh, run.run_id, run.cohort_id, kind, run.config, "failed", started, datetime.now())
        raise
    record_run(wh, run.run_id, run.cohort_id, kind, run.config, "finished", started, datetime.now())
