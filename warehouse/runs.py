"""The run registry: every producing command records what it ran, with which code, and how it ended."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import duckdb
import polars as pl

from dxr import __version__
from dxr.config import DEFAULT_CONFIG_FILE
from dxr.errors import InputError, NotFoundError
from dxr.notes import note
from warehouse.checkpoints import training_checkpoint
from warehouse.locks import held, lock_held
from warehouse.schemas import TABLES, utc_now
from warehouse.scratch import UNWRITABLE, naming, remove_abandoned, scratch
from warehouse.store import Warehouse, check_run_id, fetch_frame


# The `runs` kind of an evaluation, recorded under the run id it evaluated.
EVALUATE_KIND = "evaluate"
# Kinds of the runs whose rows are results on a cohort; the other runs (a dataset's ingest, a cohort's build, its
# priors' trainings and promotions, a corpus's ingest or build) are the record of what they made.
RESULT_KINDS = ("forecast:", EVALUATE_KIND)


def new_run_id(kind: str) -> str:
    """A readable, unique run id: kind, UTC timestamp, random suffix."""
    return f"{kind}-{utc_now():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


# The kinds of file the code is made of: Python modules and the TOML prompt files.
CODE_SUFFIXES = (".py", ".toml")


def is_settings_file(path: Path) -> bool:
    """Whether `path` is a settings file: `dxr.toml`, or the file `DXR_CONFIG` names."""
    named = os.environ.get("DXR_CONFIG")
    return path.name == DEFAULT_CONFIG_FILE or (bool(named) and path.resolve() == Path(named).resolve())


@lru_cache(maxsize=1)
def code_version() -> str:
    """The version of the running code (see `checkout_version`), computed once per process."""
    return checkout_version(Path(__file__).resolve().parents[1])


def checkout_version(root: Path) -> str:
    """Package version plus the git commit when `root` is a checkout, and for a checkout with
    uncommitted changes `.dirty.` and a digest of them.

    The digest covers the diff against the commit and the untracked code files (`CODE_SUFFIXES`) git
    does not ignore, so each uncommitted state of the code is a version of its own: the prediction cache, keyed by it,
    never serves lists that other code computed.
    """
    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=30, check=True).stdout

    try:
        # An installed copy (site-packages) may sit, untracked, inside some checkout whose commit is not its code's.
        if not git("ls-files", "--", "."):
            return __version__
        sha = git("rev-parse", "--short=12", "HEAD").decode().strip()
        # No external diff tool or text conversion: they could print nothing for a real change.
        diff = git("diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--", ".")
        names = git("ls-files", "--others", "--exclude-standard", "-z").decode().split("\0")
        # Untracked files count when they are code (modules, prompt files), not data someone keeps here, nor
        # settings: with them every settings edit was a code version of its own, and the prediction cache missed.
        untracked = sorted(root / name for name in names
                           if name and name.endswith(CODE_SUFFIXES) and (root / name).is_file()
                           and not is_settings_file(root / name))
        if not diff and not untracked:
            return f"{__version__}+{sha}"
        change = hashlib.sha256(diff)
        for path in untracked:
            try:
                content = path.read_bytes()
            except OSError:  # unreadable here, so not importable either: its name still marks the state
                content = b"<unreadable>"
            change.update(f"{path.relative_to(root)}\0".encode() + content)
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__}+{sha}.dirty.{change.hexdigest()[:12]}"


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
    started_at: datetime | None = None  # once its `running` row is written

    def record_cohort(self, wh: Warehouse, cohort_id: str) -> None:
        """Set the run's cohort and write it into its `running` row now, so that the row names it however the run
        ends: failed, or killed (`mark_killed` keeps the row but for its status)."""
        self.cohort_id = cohort_id
        record_run(wh, self.run_id, cohort_id, self.kind, self.config, "running", self.started_at)


def record_lock(run_id: str, kind: str) -> str:
    """The lock a registered run of this id and kind holds for its life (`registered_run`)."""
    return f"record:{run_id}|{kind}"


# One marker file per registered run in progress, so finding the runs a killed process left does not
# read the whole registry (one Parquet file per run and kind: seconds at ten thousand runs).
RUNNING_DIR = ".running"
# Written once the `running` rows of a warehouse from before the markers have been given theirs.
INDEXED_FLAG = "indexed"


def _marker(wh: Warehouse, run_id: str, kind: str) -> Path:
    name = f"{run_id}|{kind}"
    tame = re.sub(r"[^A-Za-z0-9_.:-]", "_", name)[:120]
    return wh.root / RUNNING_DIR / f"{tame}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.json"


def _write_marker(wh: Warehouse, run_id: str, kind: str) -> Path:
    marker = _marker(wh, run_id, kind)
    # A run of this id and kind killed while it wrote its marker left the scratch's lock file (or the scratch too).
    remove_abandoned(marker)
    # Named: Python's file write names no file, and on a full disk this is the first write of every command to fail.
    with scratch(marker, "tmp") as tmp, naming(marker):
        tmp.write_text(json.dumps({"run_id": run_id, "kind": kind}))
        os.replace(tmp, marker)
    return marker


# What `dxr run list` shows of each run, newest first; `$kind` takes the kind or, given as `forecast`, every
# `forecast:<system>`, and `$cohort` the runs of every cohort of that id or name.
RUN_LIST_QUERY = """SELECT r.run_id, r.kind, r.status, c.name AS cohort, r.cohort_id, r.started_at, r.finished_at
FROM runs r LEFT JOIN cohorts c ON c.cohort_id = r.cohort_id
WHERE ($cohort IS NULL OR r.cohort_id = $cohort OR c.name = $cohort)
  AND ($kind IS NULL OR r.kind = $kind OR starts_with(r.kind, $kind || ':'))
ORDER BY r.started_at DESC, r.run_id, r.kind
LIMIT $limit"""


def run_list(wh: Warehouse, cohort: str | None = None, kind: str | None = None, limit: int | None = None,
             fmt: str = "table") -> Iterator[str]:
    """The registered runs, newest first, as `dxr run list` prints them (`dxr sql`'s formats), each kind of a run
    id a row of its own: only those on a cohort (its id or name) or of a kind when asked, the first `limit`. Those a
    killed process left `running` are marked `killed` first (`mark_killed`)."""
    from warehouse.cohorts import unknown_cohort
    from warehouse.sql import stream_query

    mark_killed(wh)  # a run whose process was killed is listed `killed`, not `running`, and the user told of it
    if cohort is not None:
        cohorts = wh.read("cohorts")
        if cohort not in cohorts["cohort_id"] and cohort not in cohorts["name"]:
            raise unknown_cohort(wh, cohort, cohorts)
    return stream_query(wh, RUN_LIST_QUERY, fmt=fmt, params={"cohort": cohort, "kind": kind, "limit": limit})


def unknown_run(wh: Warehouse, run_id: str) -> NotFoundError:
    """The error for a run id that the registry does not hold (a typo, another data dir), with how to list the runs."""
    return NotFoundError(f"no run {run_id!r} in the warehouse at {wh.root}: list the runs with dxr run list")


def check_run_kind(wh: Warehouse, run_id: str, kind: str) -> None:
    """Refuse to record a result (a forecast) under a run id that records what a command made (a build, an ingest, a
    training, ...), or such a record under a run id that holds results: `dxr run delete` deletes results only and
    refuses a run id holding a record, so a run id holding both could not be deleted without its cohort."""
    recorded = wh.read("runs", run_id=run_id)["kind"].to_list()
    result = kind.startswith(RESULT_KINDS)
    if others := sorted({other for other in recorded if other.startswith(RESULT_KINDS) != result}):
        held, adding = ("a record of what a command made", "a result") if result else ("results", "a record")
        raise InputError(f"run id {run_id!r} already holds {held} ({', '.join(others)}), and a {kind} run is "
                         f"{adding}: give it a run id of its own (or none, to have one generated); `dxr run delete` "
                         "deletes results only, so it could not delete a run id that holds both")


def registration_lock(run_id: str) -> str:
    """The lock under which a run id's recorded kinds are checked and a new kind's first `runs` row is written."""
    return f"run-register:{run_id}"


@contextmanager
def registered_run(wh: Warehouse, kind: str, config: dict, run_id: str | None = None,
                   cohort_id: str | None = None, check: Callable[[], None] | None = None) -> Iterator[Run]:
    """Record a run as `running`, then `finished` or `failed` (re-raising) when the body ends.

    A given run id is checked (`check_run_kind`, then the caller's own `check`, such as a forecast's refusal of
    other options) and its `running` row written under its registration lock, so that two processes starting
    kinds that exclude each other on one new run id at the same instant cannot both pass: the second waits for
    the first's row and is refused. A generated run id is new, so nothing can race it there.
    The run's record lock is held from before its marker and `running` row until after the last
    row and the marker's removal, so a marker whose lock is free was left by a killed process
    (`mark_killed`).
    """
    # Checked before the marker: the registry write refusing it would leave the marker behind for good.
    run = Run(check_run_id(run_id) if run_id else new_run_id(kind.split(":")[0]), kind, config, cohort_id)
    mark_killed(wh)
    with ExitStack() as recording:
        with ExitStack() as registering:
            if run_id:
                registering.enter_context(held(wh, registration_lock(run_id), shared=False, wait=10.0,
                                               busy=f"run {run_id!r} is being registered by another dxr process"))
                check_run_kind(wh, run_id, kind)
                if check is not None:
                    check()
            # `wait`: another process's `mark_killed` may hold the lock for a moment.
            recording.enter_context(held(wh, record_lock(run.run_id, kind), shared=False, wait=5.0,
                                         busy=f"run {run.run_id!r} ({kind}) is being recorded by another dxr process"))
            run.started_at = utc_now()
            marker = _write_marker(wh, run.run_id, kind)
            record_run(wh, run.run_id, run.cohort_id, kind, config, "running", run.started_at)
        try:
            yield run
        except BaseException:
            try:
                record_run(wh, run.run_id, run.cohort_id, kind, run.config, "failed", run.started_at, utc_now())
            except OSError:
                # A full disk fails the body and then often this row too: the body's error, raised below, says what
                # went wrong, and the marker stays, so the next command's `mark_killed` records the run `killed`.
                pass
            else:
                marker.unlink(missing_ok=True)
            raise
        record_run(wh, run.run_id, run.cohort_id, kind, run.config, "finished", run.started_at, utc_now())
        marker.unlink(missing_ok=True)


def mark_killed(wh: Warehouse) -> list[tuple[str, str]]:
    """Rewrite as `killed` the `running` rows whose process ended without recording how (SIGKILL,
    the OOM killer, a lost node), telling the user of each (`killed_note`, once: only the process that rewrites a row
    tells); returns their (run_id, kind).

    SIGTERM and Ctrl-C unwind and record `failed` themselves. A run is judged by its record lock,
    which the kernel releases when the process ends, so this holds across hosts and containers that
    share the warehouse on a file system with working `flock`. Only the runs with a marker are
    looked at, so the cost follows the runs in progress, not the size of the registry. A process that may not write
    the warehouse (an analyst's account, a read-only mount) leaves them to the next one that may.
    """
    _index_legacy_running(wh)
    killed = []
    for marker, run_id, kind in _markers(wh):
        if lock_held(wh, record_lock(run_id, kind)):  # its process is alive
            continue
        try:
            with held(wh, record_lock(run_id, kind), shared=False, busy="alive"):
                # Read under the lock: the run may have ended normally since the marker was listed.
                current = wh.read("runs", run_id=run_id, kind=kind)
                if not current.is_empty() and current["status"][0] == "running":
                    wh.write("runs", current.with_columns(pl.lit("killed").alias("status")), run_id=run_id, kind=kind)
                    killed.append((run_id, kind))
                    # Said here, by the one process that rewrote the row: the killed process could say nothing.
                    row = current.row(0, named=True)
                    note(killed_note(row, checkpointed=kind.startswith("train:") and training_checkpoint(
                        wh.root, run_id, kind.removeprefix("train:")).is_file()))
                marker.unlink(missing_ok=True)
        except InputError:  # taken since by a run of that id and kind, or not to be taken by this process
            continue
        except OSError as exc:
            if exc.errno not in UNWRITABLE:
                raise
            break  # this process may not write the warehouse
    return killed


# The run ids `dxr demo` generates: `<id>` for its forecasts, `<id>-llm` for its LLM sample's (`flows.demo`), both
# resumed by `dxr demo --run-id <id>`.
DEMO_RUN_ID = re.compile(r"(demo-\d{8}T\d{6}-[0-9a-f]{6})(-llm)?")


def killed_note(row: dict, checkpointed: bool = False) -> str:
    """What the user is told of a run found killed (`mark_killed`), from its `runs` row: which run, what ended it and
    how to finish it; `checkpointed` for a prior's training that left a resume checkpoint (`warehouse.checkpoints`)."""
    cohort = f", cohort {row['cohort_id']}" if row["cohort_id"] else ""
    # A row recorded before the registry had `host` and `pid` (a `running` row indexed since) has neither.
    process = f"pid {row['pid']} on {row['host']}, " if row["pid"] is not None and row["host"] else ""
    finish = "to finish it, rerun the command that started it, or Retry its flow run"
    # A forecast keeps the lists it wrote and goes on from there under its run id; a training that left a resume
    # checkpoint continues after its last finished epoch under its run id (`tasks.prior.train_prior` writes one only
    # for a run id it was given: `--run-id`, a `train_prior` flow run's, which its Retry keeps, or a backfill's
    # `<id>-refresh`); the other kinds do their work again (a training keeps the systems it finished only under its
    # own run id, which the demo, say, does not pass, so its training leaves no checkpoint: naming its run id would
    # send the user to a command that trains from the first epoch all the same).
    if row["kind"].startswith("forecast:"):
        demo = DEMO_RUN_ID.fullmatch(row["run_id"])
        finish += (f" (`dxr demo --run-id {demo[1]}` resumes its forecasts)" if demo
                   else f" (under its run id, `--run-id {row['run_id']}`, it resumes where it stopped)")
    elif checkpointed:
        finish += f" (under its run id, `--run-id {row['run_id']}`, it continues from its last finished epoch)"
    return (f"run {row['run_id']} ({row['kind']}{cohort}; {process}started {row['started_at']:%Y-%m-%d %H:%M:%S} UTC) "
            "ended without recording how: it was killed (SIGKILL, most often by the out-of-memory killer when the "
            "machine or its container ran short of memory; see docs/benchmarks.md#memory) or failed unable to record "
            "it (a full disk; its own output said why), and is now `killed` in "
            f"`runs`; {finish}")


def mark_stale(wh: Warehouse, run_id: str, kind: str) -> None:
    """Rewrite as `stale` the `finished` row of a run whose outputs were removed because an input it
    read is being redone (a fused system's lists, an evaluation's metrics).

    The caller holds the locks that keep that run from writing meanwhile. A `failed` or `killed` row
    keeps its status: it says more about what happened.
    """
    current = wh.read("runs", run_id=run_id, kind=kind)
    if not current.is_empty() and current["status"][0] == "finished":
        wh.write("runs", current.with_columns(pl.lit("stale").alias("status")), run_id=run_id, kind=kind)


def runs_in_progress(wh: Warehouse) -> pl.DataFrame:
    """The `runs` rows of the runs in progress now: those marked whose process holds its record lock (those a killed
    process left are marked first, where this process may write the warehouse)."""
    mark_killed(wh)
    rows = [wh.read("runs", run_id=run_id, kind=kind) for _, run_id, kind in _markers(wh)
            if lock_held(wh, record_lock(run_id, kind))]
    empty = pl.from_arrow(TABLES["runs"].schema.empty_table())  # typed, for when nothing is in progress
    return pl.concat([empty, *rows], how="diagonal_relaxed").filter(pl.col("status") == "running")


def finished_wall_clocks(connection: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, float]:
    """Seconds from start to finish of each kind the run registered that finished (not running, failed, killed or
    stale), by kind."""
    runs = fetch_frame(connection, "SELECT kind, status, started_at, finished_at FROM runs WHERE run_id = ?", [run_id])
    return {r["kind"]: (r["finished_at"] - r["started_at"]).total_seconds()
            for r in runs.iter_rows(named=True) if r["status"] == "finished" and r["finished_at"] is not None}


def _markers(wh: Warehouse) -> list[tuple[Path, str, str]]:
    """(marker, run_id, kind) of every marked run, in name order."""
    found = []
    for marker in sorted((wh.root / RUNNING_DIR).glob("*.json")):
        try:
            entry = json.loads(marker.read_text())
        except FileNotFoundError:  # its run ended meanwhile
            continue
        found.append((marker, entry["run_id"], entry["kind"]))
    return found


def _index_legacy_running(wh: Warehouse) -> None:
    """Give a marker to every `running` row of a registry written before the markers existed (once)."""
    flag = wh.root / RUNNING_DIR / INDEXED_FLAG
    # A data dir that does not exist has no registry to index, and a mistyped --data-dir must not appear on disk.
    if flag.exists() or not wh.root.is_dir():
        return
    try:
        if wh.has_rows("runs"):
            registry = wh.connect(tables=["runs"])
            running = registry.execute("SELECT run_id, kind FROM runs WHERE status = 'running'").fetchall()
            for run_id, kind in running:
                _write_marker(wh, run_id, kind)
        flag.parent.mkdir(parents=True, exist_ok=True)
        flag.touch()
    except OSError as exc:
        if exc.errno not in UNWRITABLE:  # a process that may not write the warehouse leaves this to one that may
            raise


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
