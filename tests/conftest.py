"""Shared fixtures: a tiny hand-written MEDS dataset, an empty warehouse, one Prefect harness."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pyarrow as pa
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_data(*parts: str) -> Path:
    """A path under ../shared/data, or a clean skip when that folder is not there."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data {path} is absent (expected ../shared/data next to the repository)")
    return path


def disk_full_errors() -> list:
    """The two errors DuckDB 2.0 raises when the disk fills (texts as seen): a write's IOException passing on
    ENOSPC, and the refusal to spill more once its temporary files reach `max_temp_directory_size`, which by
    default is 90% of the disk space that was free."""
    import duckdb

    return [
        duckdb.IOException(
            'IO Error: Async write failed for range [offset=0, size=262144]: {"exception_type":"IO",'
            '"exception_message":"Could not write file \\"import.duckdb.tmp/duckdb_temp_storage_S256K-0.tmp\\": '
            'No space left on device","errno":"28"}'),
        duckdb.OutOfMemoryException(
            "Out of Memory Error: failed to offload data block of size 256.0 KiB (960.0 KiB/976.5 KiB used).\n"
            "This limit was set by the 'max_temp_directory_size' setting.\nBy default, this setting utilizes the "
            "available disk space on the drive where the 'temp_directory' is located."),
    ]


# DuckDB's reason, as a one-line error quotes it, for running out of memory within a tiny limit: which allocation
# fails first (a query's data, a buffer block) depends on the timing of its threads.
OUT_OF_MEMORY = (r"\(Out of Memory Error: (failed to allocate data|could not allocate block) of size [0-9.]+ [KM]iB "
                 r"\([^()\n]+ used\)\)")


@contextmanager
def file_size_limit(n_bytes: int):
    """Writes past `n_bytes` of a file fail with EFBIG (RLIMIT_FSIZE), the way a full disk fails them with ENOSPC."""
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the signal's default action ends the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


class FailsAt:
    """A real DuckDB connection on which the first statement containing `marker` raises `error` instead."""

    def __init__(self, con, marker: str, error: Exception):
        self.con, self.marker, self.error, self.fired = con, marker, error, False

    def execute(self, query: str, *args, **kwargs):
        if self.marker in query and not self.fired:
            self.fired = True
            raise self.error
        return self.con.execute(query, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.con, name)


# What Lightning, torch and MLflow printed around a training and a forecast, none of it for a dxr user to act on.
THIRD_PARTY_NOISE = {
    "Lightning's hardware lines": r"(GPU|TPU) available: ",
    "Lightning's litlogger advert": r"litlogger",
    "Lightning's end of fit": r"`Trainer\.fit` stopped",
    "Lightning's notice of a batch limit set": r"`Trainer\(limit_\w+=[\d.]+\)` was configured",
    "Lightning's progress bar": r"Epoch \d+/\d+ |it/s\b",
    "Lightning's warning of a loader of length zero": r"Total length of `\w+` across ranks is zero",
    "torch's pytree deprecation inside Lightning": r"LeafSpec",
    "MLflow's pickle warning": r"Pickle or CloudPickle",
    "MLflow's artifact progress bar": r"Downloading artifacts|Uploading artifacts",
    "MLflow's schema creation": r"MLflow database tables|Updating database tables",
    "MLflow's registration notices": r"Successfully registered model|Registered model '.*' already exists|"
                                     r"Created version '",
}


class LoggedMessages(logging.Handler):
    """The messages of `level` and above that a logger hands to its handlers (those its filters let through)."""

    def __init__(self, level: int):
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def dx(code: str) -> str:
    return f"DIAGNOSIS//ICD//10//{code}"


def t(day: int, hour: int = 0) -> datetime:
    return datetime(2020, 1, 1 + day, hour)


# Tiny MEDS dataset. Encounters: (subject, encounter_id, admit day, discharge day, diagnoses).
# Subject 1 (held_out): three encounters; the final one (103) also has a lab time-stamped before
#   its admission, which the pre-target view must still exclude.
# Subject 2 (train): two encounters. Subject 3 (tuning): one encounter only (no trajectory).
# Subject 4 (held_out): two encounters plus an encounter without diagnoses (not counted).
ENCOUNTERS = [
    (1, 101, 0, 2, ["I5022", "E119"]),
    (1, 102, 10, 12, ["I5022", "N179"]),
    (1, 103, 20, 22, ["I5023", "E119", "J189"]),
    (2, 201, 0, 3, ["E119", "I10"]),
    (2, 202, 5, 6, ["I10", "J189"]),
    (3, 301, 0, 1, ["I10"]),
    (4, 401, 0, 1, ["J449"]),
    (4, 402, 3, 4, []),
    (4, 403, 8, 9, ["J441", "J449"]),
]
SPLITS = {1: "held_out", 2: "train", 3: "tuning", 4: "held_out"}


def skip_unless_directories_swap(tmp_path: Path) -> None:
    """Skip a test of the one-step directory swap where the file system cannot do it (NFS, not Linux): the code
    then renames one after the other, which other tests cover."""
    from warehouse.scratch import exchange

    a, b = tmp_path / ".swap-probe-a", tmp_path / ".swap-probe-b"
    a.mkdir()
    b.mkdir()
    swapped = exchange(a, b)
    a.rmdir()
    b.rmdir()
    if not swapped:
        pytest.skip(f"the file system of {tmp_path} cannot swap two directories in one step (renameat2 "
                    "RENAME_EXCHANGE)")


def abandoned_scratch(target: Path, kind: str = "tmp") -> Path:
    """The scratch sibling of `target` (not yet created) and the free lock file that a process killed
    by SIGKILL leaves: a process takes it, then ends without unwinding."""
    code = ("import os; from pathlib import Path; from warehouse.scratch import scratch\n"
            f"with scratch(Path({str(target)!r}), {kind!r}) as path:\n"
            "    print(path, flush=True)\n"
            "    os._exit(0)  # no cleanup, as under SIGKILL")
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return Path(ended.stdout.strip())


def parquet_writes_failing_from(monkeypatch, number: int, error: BaseException) -> None:
    """The warehouse's Parquet writes raise `error` from the `number`th on, the earlier ones written: a kill or a
    full disk partway through a write of several files. `monkeypatch.undo()` ends it."""
    import warehouse.store as store

    real_write_table, written = store.pq.write_table, []

    def write_table(*args, **kwargs):
        if len(written) + 1 >= number:
            raise error
        written.append(args[1])
        return real_write_table(*args, **kwargs)

    monkeypatch.setattr(store.pq, "write_table", write_table)


def cut_cohort_builds_short(monkeypatch, error: BaseException) -> None:
    """Cohort builds raise `error` once their trajectories and records are written, before their targets (as they
    look up the code titles): a kill or a full disk partway through a build. `monkeypatch.undo()` ends it."""
    import warehouse.cohorts as cohorts

    def cut_short(*args, **kwargs):
        raise error

    monkeypatch.setattr(cohorts, "_code_titles", cut_short)


def cli(data_dir: Path, *args) -> tuple[int, str, str]:
    """`dxr --data-dir DATA_DIR ARGS` run in this process: its exit code, standard output and standard error."""
    from click.testing import CliRunner

    from dxr.cli import main

    result = CliRunner().invoke(main, ["--data-dir", str(data_dir), *map(str, args)], prog_name="dxr",
                                catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def build_index(chunks: pl.DataFrame, out_dir: Path, embedder=None, **options) -> dict:
    """Write an index directory for `chunks` in one step, as `dxr corpus build` does under `building_index`;
    `embedder=None` builds a lexical-only index. `options` are those of the build `building_index` yields."""
    from tools.index import building_index

    with building_index(out_dir) as build:
        return build(chunks, embedder, **options)


def legacy_scratch(target: Path, kind: str = "tmp") -> Path:
    """A scratch name of an ended process on this host, without a lock file (as earlier versions wrote)."""
    from warehouse.scratch import _HOST

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return target.with_name(f".{target.name}.{_HOST}-{int(ended.stdout)}-0123abcd.{kind}")


def tiny_events() -> pl.DataFrame:
    rows = []
    for subject in SPLITS:
        rows.append((subject, None, "GENDER//F", None, None, None))
        rows.append((subject, datetime(1950, 1, 1), "MEDS_BIRTH", None, None, None))
    for subject, enc, admit, discharge, codes in ENCOUNTERS:
        rows.append((subject, t(admit), "HOSPITAL_ADMISSION//EMERGENCY", None, None, enc))
        rows.append((subject, t(admit, 6), "LAB//HBA1C//%", 7.5, None, enc))
        rows += [(subject, t(discharge), dx(c), None, None, enc) for c in codes]
        rows.append((subject, t(discharge), "NOTE//DISCHARGE_SUMMARY", None, f"note of encounter {enc}", enc))
        rows.append((subject, t(discharge), "HOSPITAL_DISCHARGE//HOME", None, None, enc))
    # A lab of the final encounter of subject 1, recorded before that admission (pre-admission testing).
    rows.append((1, t(19, 12), "LAB//BNP//pg/mL", 900.0, None, 103))
    return pl.DataFrame(rows, schema={"subject_id": pl.Int64, "time": pl.Datetime("us"), "code": pl.String,
                                      "numeric_value": pl.Float32, "text_value": pl.String,
                                      "encounter_id": pl.Int64}, orient="row")


def nested_stay_meds(root: Path) -> Path:
    """The tiny dataset with train subject 2 given an admission (204, days 10 to 20, N179 coded at its discharge)
    that spans a shorter stay (205, days 12 to 14, J189), as MIMIC holds a few."""
    rows = []
    for encounter, admit, discharge, code in ((204, t(10), t(20), "N179"), (205, t(12), t(14), "J189")):
        rows += [(2, admit, "HOSPITAL_ADMISSION//EMERGENCY", None, None, encounter),
                 (2, admit.replace(hour=6), "LAB//HBA1C//%", 7.5, None, encounter),
                 (2, discharge, dx(code), None, None, encounter),
                 (2, discharge, "HOSPITAL_DISCHARGE//HOME", None, None, encounter)]
    nested = pl.DataFrame(rows, schema=tiny_events().schema, orient="row")
    return write_tiny_meds(root, pl.concat([tiny_events(), nested]))


FUROSEMIDE = "MEDICATION//NDC//00054829725"
# codes.parquet descriptions of `write_described_meds`: BNP and the procedure occur only in subject 1's target
# encounter, the unused procedure nowhere, the blank description says nothing.
DESCRIPTIONS = {FUROSEMIDE: "Furosemide", "LAB//HBA1C//%": "Haemoglobin A1c", "LAB//BNP//pg/mL": "B-type natriuretic",
                "PROCEDURE//ICD//9//3961": "Extracorporeal circulation auxiliary to open heart surgery",
                "PROCEDURE//ICD//9//9999": "Unused", dx("I5022"): "Chronic systolic heart failure",
                "NOTE//DISCHARGE_SUMMARY": "  ", "HOSPITAL_DISCHARGE//HOME": None}


def write_described_meds(root: Path) -> Path:
    """The tiny dataset with furosemide given to subjects 2 (train) and 4 (held out, first encounter), a procedure
    in subject 1's target encounter, and a codes.parquet describing codes (`DESCRIPTIONS`)."""
    from meds import code_metadata_filepath

    extra = pl.DataFrame([(2, t(0, 8), FUROSEMIDE, None, None, 201), (4, t(0, 8), FUROSEMIDE, None, None, 401),
                          (1, t(21), "PROCEDURE//ICD//9//3961", None, None, 103)],
                         schema=tiny_events().schema, orient="row")
    write_tiny_meds(root, pl.concat([tiny_events(), extra]).sort("subject_id", "time", nulls_last=False))
    pl.DataFrame({"code": list(DESCRIPTIONS), "description": list(DESCRIPTIONS.values())},
                 schema={"code": pl.String, "description": pl.String}).write_parquet(root / code_metadata_filepath)
    return root


def cohort_inputs(wh, cohort_id: str, split: str = "all") -> tuple[pl.DataFrame, pl.DataFrame]:
    """Every trajectory of a split and its pre-target events, gathered over the split's shards (each
    shard holds one split), for tests that hand them to a stage function as one batch."""
    from tasks.forecast import forecast_shards, shard_inputs

    parts = [shard_inputs(wh, cohort_id, shard, split) for shard in forecast_shards(wh, cohort_id, split)]
    return (pl.concat([trajectories for trajectories, _ in parts]).sort("trajectory_id"),
            pl.concat([pretarget for _, pretarget in parts]))


@asynccontextmanager
async def serving(handler):
    """`handler` as `/v1/chat/completions` of an aiohttp server on a free 127.0.0.1 port; yields the base URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


def nfs_flock(fd: int, operation: int) -> None:
    """`fcntl.flock` as Linux's NFS client does it: emulated with byte-range locks, so an exclusive lock on a
    descriptor open read-only fails with EBADF (flock(2), NOTES)."""
    if operation & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    fcntl.flock(fd, operation)


# What `warehouse.locks` sees as `fcntl` on NFS (`monkeypatch.setattr(locks, "fcntl", NFS_FCNTL)`).
NFS_FCNTL = SimpleNamespace(LOCK_SH=fcntl.LOCK_SH, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB, flock=nfs_flock)


def keep_lock_files(monkeypatch) -> None:
    """Make the locks released from now on leave their files behind, as holders killed while they held them do: the
    kernel drops the lock with the process, and nothing unlinks the file (`warehouse.locks.release` never runs)."""
    import warehouse.locks as locks

    monkeypatch.setattr(locks, "release", lambda path, fd: os.close(fd))


def lock_files(wh) -> list[str]:
    """The names of the lock files in the data dir."""
    from warehouse.locks import LOCK_DIR

    return sorted(path.name for path in (wh.root / LOCK_DIR).glob("*"))


def empty_partition_dirs(wh) -> list[Path]:
    """The partition directories (`key=value`) of either store that hold nothing."""
    return sorted(path for store in (wh.forecast_dir, wh.gold_dir) for path in store.rglob("*=*")
                  if path.is_dir() and not any(path.iterdir()))


def kill_a_delete(monkeypatch, stop_after: int | None) -> None:
    """Make the next removal commit (`Warehouse.delete_together`) die as a kill would: at its commit point (as it
    renames the staged commit into place) when `stop_after` is None, else after `stop_after` of its removals; the
    delete's lock files stay, as a kill leaves them."""
    import warehouse.store as store

    keep_lock_files(monkeypatch)
    real_replace, real_remove = store.os.replace, store.remove_into
    removed = []

    def replace(source, target):
        if stop_after is None and str(target).endswith(store.COMMITTED):
            raise KeyboardInterrupt("killed at the commit point")
        return real_replace(source, target)

    def remove_into(committed, path, number):
        if len(removed) == stop_after:
            raise KeyboardInterrupt("killed among the removals")
        removed.append(path)
        return real_remove(committed, path, number)

    monkeypatch.setattr(store.os, "replace", replace)
    monkeypatch.setattr(store, "remove_into", remove_into)


def fail_a_forecast(monkeypatch, wh, cohort: str, system: str, run_id: str) -> None:
    """Run a forecast whose shards all break, leaving it `failed` in the run."""
    import flows.forecast
    from flows.forecast import forecast_flow

    def broken_shard(*args, **kwargs):
        raise RuntimeError("the shard broke")

    with monkeypatch.context() as patched:
        patched.setattr(flows.forecast, "forecast_shard_task", broken_shard)
        with pytest.raises(RuntimeError, match="the shard broke"):
            forecast_flow(str(wh.root), cohort, system, split="all", run_id=run_id)


def placeholder(kind: pa.DataType):
    """A value of the column type, for a row planted in a table no command of the test writes."""
    if pa.types.is_timestamp(kind):
        return datetime(2026, 12, 5)
    if pa.types.is_boolean(kind):
        return False
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return 0
    if pa.types.is_list(kind):
        return []
    return "x"


def plant(wh, table: str, cohort_id: str, keys: dict) -> None:
    """One row of the cohort in `table` under `keys` (its partition keys, columns or not)."""
    from warehouse.schemas import TABLES

    spec = TABLES[table]
    row = {name: keys.get(name, placeholder(kind)) for name, kind in spec.columns.items()}
    if "cohort_id" in row:
        row["cohort_id"] = cohort_id
    wh.write(table, pa.Table.from_pylist([row], schema=spec.schema), **keys)


def every_table(wh) -> dict[str, pl.DataFrame]:
    """Every warehouse table's rows, by table name."""
    from warehouse.schemas import TABLES

    return {table: wh.read(table) for table in sorted(TABLES)}


def tables_unchanged(wh, before: dict[str, pl.DataFrame]) -> bool:
    """Whether every table of `wh` holds the rows it held in `before` (an `every_table` of it), read once: reading
    the warehouse again for each table read it 29 times over."""
    now = every_table(wh)
    return all(now[table].equals(rows) for table, rows in before.items())


def write_tiny_meds(root: Path, events: pl.DataFrame | None = None) -> Path:
    from warehouse.meds import write_data_shard, write_metadata

    events = tiny_events() if events is None else events
    write_data_shard(root, "0", events)
    codes = pl.DataFrame({"code": sorted(set(events["code"].to_list())), "description": None},
                         schema={"code": pl.String, "description": pl.String})
    write_metadata(root, dataset_name="tiny", dataset_version="1", etl_name="tests", etl_version="1",
                   codes=codes.filter(~pl.col("code").str.starts_with("DIAGNOSIS//")),
                   splits=pl.DataFrame({"subject_id": list(SPLITS), "split": list(SPLITS.values())}))
    return root


@pytest.fixture
def host_in_kolkata(monkeypatch):
    """The process's local zone is UTC+05:30 for the test (the zone a laptop or a hospital server may be in)."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def tiny_meds(tmp_path) -> Path:
    return write_tiny_meds(tmp_path / "tiny_meds")


@pytest.fixture
def wh(tmp_path):
    from warehouse.store import Warehouse

    return Warehouse(tmp_path / "warehouse")


@pytest.fixture(scope="session")
def vocab_cache(tmp_path_factory):
    """The vocabulary tables are built once per test session and linked into each warehouse."""
    from warehouse.store import Warehouse
    from warehouse.vocab import load_vocabularies

    shared = Warehouse(tmp_path_factory.mktemp("vocab"))
    load_vocabularies(shared)
    return shared


def with_vocabularies(wh, vocab_cache):
    """`wh`, an empty warehouse, given the vocabulary tables (copied from the session build)."""
    import shutil

    for table in ("icd_codes", "icd_notes", "gem_map"):
        src = vocab_cache.table_dir(table)
        if src.exists():
            shutil.copytree(src, wh.table_dir(table))
    return wh


@pytest.fixture
def wh_vocab(wh, vocab_cache):
    """An empty warehouse that already holds the vocabulary tables (copied from the session build)."""
    return with_vocabularies(wh, vocab_cache)


def warehouse_copy(template, destination: Path):
    """A test's own copy of a warehouse that its module built once: a copy takes milliseconds, a build seconds, and
    each test still changes only its own."""
    import shutil

    from warehouse.store import Warehouse

    return Warehouse(shutil.copytree(template.root, destination))


def flow_run_names(flow_name: str, run_ids: tuple[str, ...]) -> list[str]:
    """The names of the flow runs of `flow_name` whose ids end as the dxr `run_ids` do (`flows.flow_run_id`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
    names = {str(run.id)[-6:]: run.name for run in runs}
    return [names[run_id[-6:]] for run_id in run_ids]


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    """One ephemeral Prefect API for the whole session (each start costs seconds).

    Autouse: a test that reaches Prefect without it would start a temporary server of its own,
    whose shutdown then logs to pytest's closed output ("Logging error" after the summary).
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    # The harness waits 30 s for its server by default; a busy CI machine can need more. Heartbeats off: each flow
    # run's end joins its heartbeat thread, which sleeps in whole seconds, so every flow run (and subflow) took up to
    # a second longer, and no test reads the heartbeat events, which only matter to runs that outlive 180 s.
    with prefect_test_harness(server_startup_timeout=180), temporary_settings(
            updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture
def planted_cohort(wh_vocab, tmp_path):
    """The tiny cohort with sentinel markers planted in every target encounter: (warehouse, cohort_id, sentinels)."""
    from tests.sentinel import plant_sentinels
    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import ingest_meds

    meds_dir = write_tiny_meds(tmp_path / "meds")
    sentinels = plant_sentinels(meds_dir)
    ingest_meds(wh_vocab, meds_dir, "planted")
    cohort_id = build_cohort(wh_vocab, "planted", "default", CohortOptions(target="final"), seed=7)["cohort_id"]
    return wh_vocab, cohort_id, sentinels
