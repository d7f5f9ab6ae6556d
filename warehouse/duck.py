"""DuckDB connections that a signal can stop.

Every DuckDB connection dxr opens comes from `connect`, so that `interrupt_queries` can reach the
queries in flight. The CLI's SIGTERM and Ctrl-C handler calls it: Python's exception alone stops
a multi-threaded DuckDB query late or not at all (measured: a query still ran 96 s after the
handler had raised, until a timeout killed it), while `interrupt()` stops it at once. Queries
running in worker threads, which never see the signal, are stopped too.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import tempfile
import uuid
import weakref
from pathlib import Path

import duckdb

from dxr.errors import ConfigError

_open: weakref.WeakSet[duckdb.DuckDBPyConnection] = weakref.WeakSet()


def connect(database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A new DuckDB connection, tracked until it is garbage-collected.

    An in-memory database spills to a directory of its own in the system's temporary directory. DuckDB's
    default, `.tmp` in the current directory, litters wherever a command runs (`dxr ingest meds` in the
    data's folder) and fails where that is read-only. DuckDB makes the directory at the first spill and
    removes it when the connection closes; one per connection, as instances sharing one delete each other's
    files when they close. A database file spills next to itself (`<file>.tmp`), as DuckDB does; a caller
    with a scratch directory of its own (a cohort build) sets `temp_directory` there.

    The session's time zone is UTC, the zone of every time dxr stores (without a zone): in the process's zone,
    DuckDB's default, a query casting one to TIMESTAMPTZ or comparing it with `now()` (runs of the last day) read
    it as a local time, 14 hours off under TZ=Pacific/Kiritimati.
    """
    con = duckdb.connect(database)
    _open.add(con)
    con.execute("SET TimeZone = 'UTC'")
    if database == ":memory:":
        con.execute(f"SET temp_directory = {literal(Path(tempfile.gettempdir()) / f'dxr-duckdb-{uuid.uuid4().hex}')}")
    return con


def literal(text) -> str:
    """`text` (e.g. a path) as a SQL string literal: a path may hold an apostrophe (`/data/o'brien`).

    >>> literal("/data/o'brien/*.parquet")
    "'/data/o''brien/*.parquet'"
    """
    return "'" + str(text).replace("'", "''") + "'"


def files(path, pattern: str | None = None) -> str:
    """The SQL string literal that names, to DuckDB's readers, the file `path` or the files that `pattern` (a glob,
    `**/*.parquet`) matches under directory `path`.

    DuckDB globs the whole string, the path too: a data dir `/srv/dxr [v2]` matched no file, and `/srv/dxr*` read the
    files of `/srv/dxr-old` as well. So each glob character of the path (`*`, `?`, `[`, `]`) goes into a class of
    its own, which matches that character alone.

    >>> files("/srv/o'brien [v2]", "**/*.parquet")
    "'/srv/o''brien [[]v2[]]/**/*.parquet'"
    """
    exact = glob_escaped(path)
    return literal(exact if pattern is None else f"{exact}/{pattern}")


def read(reader: str, path, pattern: str | None = None, options: str = "") -> str:
    """The SQL call of DuckDB's `reader` (`read_parquet`, `read_csv`) over `files(path, pattern)`, with `options`
    (SQL, `union_by_name = true`), that gives each file's own columns and values only.

    DuckDB's hive partitioning, on whenever the first file's path holds a `key=value` directory, takes a column from
    each such directory anywhere in the path: a data dir under `/lake/site=a/` gave every row a `site` column, one
    under `/lake/run_id=zz/` read the run id of every run as `zz`, and a MEDS dir under `/exports/subject_id=9/` made
    its 4 patients one.

    >>> read("read_parquet", "/lake/site=a/meds", "**/*.parquet", "union_by_name = true")
    "read_parquet('/lake/site=a/meds/**/*.parquet', hive_partitioning = false, union_by_name = true)"
    """
    return f"{reader}({', '.join(filter(None, (files(path, pattern), 'hive_partitioning = false', options)))})"


def glob_escaped(path) -> str:
    """`path` with each glob character in a class of its own, which matches that character alone."""
    return re.sub(r"[*?\[\]]", lambda glob_character: f"[{glob_character.group()}]", str(path))


def confine(con: duckdb.DuckDBPyConnection, *directories: Path) -> None:
    """Let `con` read files under `directories` only, for good (access cannot be re-enabled on it).

    DuckDB checks the name a reader is given, before it expands a glob, so each directory is allowed both as
    written and as `files` escapes it (`/srv/dxr [[]v2[]]/`). DuckDB reads a name that is an existing file as that
    file, without globbing, so the files of a directory literally named so would be readable too (and writable by
    `COPY … TO`): one that exists is refused. (Views over lists of files, which need no escaped name, would no longer
    see partitions written after the connection was made.)"""
    for directory in directories:
        escaped = glob_escaped(directory)
        if escaped != str(directory) and os.path.lexists(escaped):
            raise ConfigError(f"{escaped} exists: DuckDB takes it for the glob-escaped name of {directory}, so queries "
                              f"confined to {directory} could read it; rename or move one of them")
    names = dict.fromkeys(name for directory in directories for name in (str(directory), glob_escaped(directory)))
    con.execute(f"SET allowed_directories=[{', '.join(literal(f'{name}/') for name in names)}]")
    con.execute("SET enable_external_access=false")


# Bytes per unit of a DuckDB size: those `cohort.memory_limit` takes (dxr.config's pattern) and those DuckDB prints.
SIZE_UNITS = {"bytes": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def size_bytes(size: str) -> float:
    """A DuckDB size (`2GB`, `512 MiB`, `819.1 MiB`) in bytes.

    >>> size_bytes("2GB"), size_bytes("1.5 GiB")
    (2000000000.0, 1610612736.0)
    """
    number, unit = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", size).groups()
    return float(number) * SIZE_UNITS[unit]


@functools.cache
def memory_within_reach() -> str:
    """DuckDB's default memory limit in this process: 80% of the memory it may use, which is the machine's, or the
    limit of its cgroup (a container's, a systemd unit's `MemoryMax`) where that is lower; DuckDB reads both cgroup
    versions. As DuckDB prints it (`819.1 MiB` under a 1 GiB cap)."""
    con = connect()
    try:
        return con.execute("SELECT current_setting('memory_limit')").fetchone()[0]
    finally:
        con.close()


def memory_limit_within_reach(memory_limit: str) -> str:
    """`memory_limit`, or `memory_within_reach()` where that is lower: the limit to set on a connection.

    A limit above what the process may use is no limit: DuckDB spills only once it reaches it, so it grows until the
    kernel's out-of-memory killer ends dxr without a word. Under a 1G cgroup, one of five 20,000-patient cohort builds
    with the default `cohort.memory_limit` of 2GB was killed in its pre-target step; the builds within 600MB and
    819 MiB, DuckDB's default there, passed (docs/benchmarks.md#memory)."""
    reach = memory_within_reach()
    return reach if size_bytes(reach) < size_bytes(memory_limit) else memory_limit


def limit_memory(con: duckdb.DuckDBPyConnection, memory_limit: str) -> None:
    """Let `con` use at most `memory_limit`, or what this process may use where that is less
    (`memory_limit_within_reach`); beyond it DuckDB spills to its temporary directory."""
    con.execute(f"SET memory_limit = {literal(memory_limit_within_reach(memory_limit))}")


# The system's answers to a write that has no room: a full disk, a full quota, a file past the size limit.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_disk(exc: BaseException) -> bool:
    """Whether `exc` says the disk is full: the system's ENOSPC, EDQUOT or EFBIG (`NO_ROOM`; DuckDB passes it on only
    in the text of an IOException, shutil.copytree inside the text of its Error), or DuckDB refusing to spill more
    because its temporary files reached `max_temp_directory_size`, which by default is 90% of the disk space that was
    free."""
    if isinstance(exc, OSError) and exc.errno in NO_ROOM:
        return True
    text = str(exc)
    return any(os.strerror(code) in text for code in NO_ROOM) or (
        isinstance(exc, duckdb.OutOfMemoryException) and "max_temp_directory_size" in text)


@contextlib.contextmanager
def resource_errors(what: str, directory: Path, memory_limit: str | None = None, setting: str | None = None,
                    elsewhere: str = "point --data-dir (DXR_DATA_DIR) to a disk with room"):
    """Inside the block, running out of disk (at `directory`, where `what` writes its output and DuckDB its spill
    files) or, with `memory_limit`, out of DuckDB memory is one ConfigError with its fix; other errors pass.

    DuckDB spills what it can to disk, so out of memory means memory it could not spill. `setting` names the
    setting that also holds the limit; `elsewhere` says how to move `directory` to another disk."""
    try:
        yield
    except (duckdb.Error, OSError) as exc:
        if out_of_disk(exc):
            if (exc.errno if isinstance(exc, OSError) else None) == errno.EFBIG or os.strerror(errno.EFBIG) in str(exc):
                raise ConfigError(f"{what}: a file in {directory} reached the file-size limit: raise it (ulimit -f), "
                                  f"or {elsewhere}") from exc
            raise ConfigError(f"{what}: out of disk space in {directory}: free disk space there, or {elsewhere}"
                              ) from exc
        if memory_limit is None or not isinstance(exc, duckdb.OutOfMemoryException):
            raise
        also = f", or the setting {setting}" if setting else ""
        limit = memory_limit_within_reach(memory_limit)
        if limit != memory_limit:  # raising the configured limit would not help: the machine or container is the cap
            raise ConfigError(f"{what}: DuckDB ran out of memory within its limit of {limit}, 80% of the memory this "
                              f"machine or container allows, which is below the {memory_limit} asked for "
                              f"({str(exc).strip().splitlines()[0]}): give it more memory (docs/benchmarks.md#memory "
                              "lists what each step needs)") from exc
        raise ConfigError(f"{what}: DuckDB ran out of memory within its limit of {memory_limit} "
                          f"({str(exc).strip().splitlines()[0]}): rerun with a larger memory limit "
                          f"(`--memory-limit`, e.g. 8GB{also}) that the machine has free") from exc


def interrupt_queries() -> int:
    """Interrupt the running query of every open connection of this process; returns how many were asked."""
    # No lock: this runs in a signal handler, possibly while the main thread is inside `connect`.
    # A worker thread adding a connection during the copy makes it fail; the next copy is taken.
    connections: list[duckdb.DuckDBPyConnection] = []
    for _ in range(10):
        try:
            connections = list(_open)
            break
        except RuntimeError:  # "Set changed size during iteration"
            continue
    asked = 0
    for con in connections:
        try:
            con.interrupt()
            asked += 1
        except duckdb.Error:  # closed already
            pass
    return asked
