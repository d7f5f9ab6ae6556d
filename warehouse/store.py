"""The warehouse: Parquet partitions as the source of truth, DuckDB views per connection.

A write replaces exactly one partition file atomically (temporary file + rename), so a rerun
replaces its own partition, a killed writer leaves either the old or the new file, and rows are
never duplicated; `write_together` commits several partitions that must change together, and
`delete_together` removes several (a cohort with its runs, or one run) as one commit. Readers
see complete files only: temporaries do not match the view globs, and a deleted partition is moved
out of its table (into the store's `.trash`) before its files go. A read (`connect`, `read`,
`has_rows`) first finishes the commits in its stores, so it sees all of a commit or none of it; a
connection's views list their files again at each query, so a query made while another process
renames a commit's files into place can see some of them new and the others old.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from dxr.errors import InputError, NotFoundError
from warehouse import duck
from warehouse.schemas import FORECAST, GOLD, RUN_TABLES, TABLES, Table
from warehouse.scratch import UNWRITABLE, make_dirs, naming, remove_abandoned, scratch

PART_FILE = "data.parquet"
TRASH_DIR = ".trash"  # per store; same file system as the tables, so moving a partition there is one rename
MOVE_TO_TRASH_ATTEMPTS = 10  # each failed one is owed to a concurrent delete removing the emptied trash
COMMIT_DIR = ".commits"  # per store: partitions staged by `write_together`, renamed into place once all are whole
COMMITTED = ".commit"  # a staging directory renamed to `<id>.commit` holds whole files that must reach their places
# A commit's id starts with its creation time, so the commits a killed writer left are finished in the order they
# were made: a later commit of a partition must land last. `t` sorts after the hex digits that began the random ids
# of earlier versions, whose commits are older than any of these.
COMMIT_ID = "t{ns:020d}-{token}"
COMMIT_TIME = re.compile(r"^t(\d{20})-")  # the time in a COMMIT_ID
# In a commit: [{"file": staged file name, "target": partition path in the store}] for a write, and
# [{"remove": directory path under the warehouse root}] for a removal (`delete_together`); a commit may hold both
# (`write_together` with removals moves rows from one table to another).
COMMIT_PLAN = "plan.json"
REMOVED = "removed"  # in a removal's commit: the directories it removes, moved in to go with it
SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.:\-]+$")
# A directory value DuckDB's hive partitioning reads back as NULL: the views' under a data dir path without `key=value`
# (`_view_sql`), and a reader's of the files without dxr (README).
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"


class Warehouse:
    """Both stores under one root: `<root>/forecast` and `<root>/gold`."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.forecast_dir = self.root / FORECAST
        self.gold_dir = self.root / GOLD

    # ---- locations ------------------------------------------------------------------------
    def store_dir(self, store: str) -> Path:
        return self.forecast_dir if store == FORECAST else self.gold_dir

    def table_dir(self, table: str) -> Path:
        spec = _spec(table)
        return self.store_dir(spec.store) / spec.name

    def partition_path(self, table: str, **keys) -> Path:
        spec = _spec(table)
        missing = [k for k in spec.partition_by if k not in keys]
        extra = [k for k in keys if k not in spec.partition_by]
        if missing or extra:
            raise ValueError(f"table {table} is partitioned by {spec.partition_by}; got {sorted(keys)}")
        path = self.table_dir(table)
        for key in spec.partition_by:
            value = str(keys[key])
            if problem := unsafe(value):
                raise InputError(f"partition value {key}={value!r} of table {table} {problem}")
            path = path / f"{key}={value}"
        return path / PART_FILE

    def meds_dir(self, dataset_id: str) -> Path:
        """Where a registered dataset's MEDS files live (gold store: raw data holds targets)."""
        return self.gold_dir / "meds" / dataset_id

    # ---- writes ---------------------------------------------------------------------------
    def write(self, table: str, data: pl.DataFrame | pa.Table, **keys) -> Path:
        """Replace one partition with `data` (validated against the declared schema)."""
        arrow = _checked(table, data, keys)
        return self._replace_partition(table, keys, lambda tmp: pq.write_table(arrow, tmp, compression="zstd"))

    def write_together(self, writes: list[tuple[str, pl.DataFrame | pa.Table, dict]],
                       removals: Iterable[tuple[str, dict]] = ()) -> list[Path]:
        """Replace several partitions of one store, given as (table, data, keys), and remove the partitions of that
        store given as (table, leading keys) in `removals`, as one commit.

        Each file is written into a staging directory under the store's `.commits`, which one rename
        turns into a commit; only then are the files renamed over their partitions, and the removed ones moved
        into the commit. A writer killed before that rename leaves every partition as it was; one killed after
        it leaves a commit that the next read, write or delete in the store finishes first, so a rerun gives a
        clean run's rows, and rows moved from one table to another are never in both or in neither. A partition may
        not be both written and under a removal (ValueError).
        """
        removals = list(removals)
        stores = {_spec(table).store for table, _, _ in writes} | {_spec(table).store for table, _ in removals}
        if len(stores) != 1:
            raise ValueError(f"write_together needs partitions of one store, got tables of stores {sorted(stores)}")
        store_dir = self.store_dir(stores.pop())
        checked = [(self.partition_path(table, **keys), _checked(table, data, keys)) for table, data, keys in writes]
        # The commit renames the new files into place before it moves the removed directories out: a partition both
        # written and removed would lose its new file.
        for removed_table, removed_keys in removals:
            removed = self.partitions_dir(removed_table, **removed_keys)
            for (table, _, keys), (path, _) in zip(writes, checked):
                if path.is_relative_to(removed):
                    raise ValueError(f"write_together would remove the partition it writes: table {table} {keys} "
                                     f"is under removal ({removed_table}, {removed_keys})")
        commits = store_dir / COMMIT_DIR
        finish_commits(commits)
        plan = []
        with scratch(commits / "batch", "staging") as staging:
            staging.mkdir()
            for number, (path, arrow) in enumerate(checked):
                with naming(path):
                    pq.write_table(arrow, staging / f"{number}.parquet", compression="zstd")
                plan.append({"file": f"{number}.parquet", "target": str(path.relative_to(store_dir))})
            if removals:
                (staging / REMOVED).mkdir()
                plan += [{"remove": str(self.partitions_dir(table, **keys).relative_to(self.root))}
                         for table, keys in removals]
            (staging / COMMIT_PLAN).write_text(json.dumps(plan))
            committed = commits / (new_commit_id(commits) + COMMITTED)
            os.replace(staging, committed)  # the commit point: from here on the files are the partitions' own
        # With the older commits first: one that a writer killed since our `finish_commits` above left would
        # otherwise be finished after ours, by the next read, and undo it.
        finish_commits(commits)
        return [store_dir / entry["target"] for entry in plan if "target" in entry]

    def write_query(self, table: str, con: duckdb.DuckDBPyConnection, query: str, **keys) -> Path:
        """Replace one partition with the rows of a DuckDB query, streamed to Parquet by DuckDB.

        For partitions too large to hold as one Arrow table (a cohort's train events): the query runs
        once, into the scratch file, and the checks of `write` run on that file before it replaces
        the partition.
        """
        spec = _spec(table)
        columns = con.sql(f"SELECT * FROM ({query}) LIMIT 0").columns
        missing = [c for c in spec.columns if c not in columns]
        if missing:
            raise InputError(f"table {spec.name}: missing column(s) {missing}; expected {list(spec.columns)}")
        cast = ", ".join(f'CAST("{n}" AS {_duck_type(t)}) AS "{n}"' for n, t in spec.columns.items())

        def write_checked(tmp: Path) -> None:
            con.execute(f"COPY (SELECT {cast} FROM ({query})) TO {duck.literal(tmp)} (FORMAT parquet, COMPRESSION zstd)"
                        ).fetchall()  # DuckDB 2: finish each result before the next statement
            required = [c for c in spec.columns if c not in spec.nullable]
            keyed = [k for k in spec.partition_by if k in spec.columns]
            checks = [f'count(*) FILTER (WHERE "{c}" IS NULL)' for c in required] + [
                f'count(*) FILTER (WHERE "{k}" IS DISTINCT FROM ?)' for k in keyed]
            # The file's own values, not the `key=value` of its directory.
            [counts] = con.execute(f"SELECT {', '.join(checks)} FROM {duck.read('read_parquet', tmp)}",
                                   [keys[k] for k in keyed]).fetchall()
            for name, nulls in zip(required, counts):
                if nulls:
                    raise InputError(f"table {spec.name}: column {name} has {nulls} null value(s); it is required")
            for key, others in zip(keyed, counts[len(required):]):
                if others:
                    raise ValueError(f"{table}: {others} row(s) with {key} other than {keys[key]} written to "
                                     f"partition {key}={keys[key]}")

        return self._replace_partition(table, keys, write_checked)

    def _replace_partition(self, table: str, keys: dict, write_file: Callable[[Path], object]) -> Path:
        """Write a partition's file beside it under a scratch name, then rename it over the old one."""
        path = self.partition_path(table, **keys)
        # A commit a killed `write_together` left is older than this write: finished later, it would undo it.
        finish_commits(self.store_dir(_spec(table).store) / COMMIT_DIR)
        remove_abandoned(path)
        with scratch(path, "tmp") as tmp, naming(path):
            write_file(tmp)
            os.replace(tmp, path)
        return path

    def delete(self, table: str, **keys) -> None:
        """Remove every partition matching the given leading keys (e.g. one cohort's shards)."""
        spec = _spec(table)
        finish_commits(self.store_dir(spec.store) / COMMIT_DIR)  # or it could bring a deleted partition back
        path = self.partitions_dir(table, **keys)
        trash = self.store_dir(spec.store) / TRASH_DIR
        # Move it out of the table first (one rename), so a kill during the removal never leaves
        # part of a partition where a view or read could see it.
        move_to_trash(path, trash)
        # Also when nothing was there: a delete killed between that rename and this left them.
        remove_emptied(path)
        # What is in the trash is already unreachable: remove it, including what a killed delete left.
        for doomed in trash.glob("*") if trash.is_dir() else ():
            shutil.rmtree(doomed, ignore_errors=True)
        # Then the trash itself, so none stays behind empty. `rmdir` removes it only while it is empty: one that a
        # concurrent delete (another run's forecast, in the same store) has just moved a partition into stays, for
        # that delete to empty and remove.
        try:
            trash.rmdir()
        except OSError:  # not empty, or removed by a concurrent delete
            pass

    def partitions_dir(self, table: str, **keys) -> Path:
        """The directory of every partition matching the given leading keys (the table's own without keys)."""
        spec = _spec(table)
        path = self.table_dir(table)
        for key in spec.partition_by:
            if key not in keys:
                break
            path = path / f"{key}={keys[key]}"
        return path

    def delete_together(self, partitions: list[tuple[str, dict]], directories: Iterable[Path] = ()) -> None:
        """Remove the partitions given as (table, leading keys), of either store, and other `directories` under the
        root (a run's report), as one commit of the forecasting store.

        The commit lists what goes, and one rename makes it (the commit point); only then is each directory moved
        into the commit, which is removed last. A process killed before that rename removed nothing; one killed
        after it left a commit that the next read, write or delete in the forecasting store finishes first, so a
        reader of that store sees all of the removal or none of it. Gold partitions go in the same step: remove
        only those that a reader reaches through the forecasting store (a cohort's targets through its row).
        """
        # Lexically under the root, not resolved: a store or `reports` may be a link to another disk, and what the
        # link's path names is the root's (`remove_into` moves it aside there).
        paths = [Path(os.path.abspath(path)) for path in
                 [self.partitions_dir(table, **keys) for table, keys in partitions] + list(directories)]
        outside = [str(path) for path in paths if not path.is_relative_to(self.root)]
        if outside:
            raise ValueError(f"delete_together removes only what is under the warehouse root {self.root}: {outside}")
        # A commit that a writer killed left in a store whose partitions go is finished first: finished later, by
        # the next read of that store, it would bring a removed partition back.
        for store in sorted({_spec(table).store for table, _ in partitions} - {FORECAST}):
            finish_commits(self.store_dir(store) / COMMIT_DIR)
        commits = self.forecast_dir / COMMIT_DIR
        finish_commits(commits)
        plan = [{"remove": str(path.relative_to(self.root))} for path in paths]
        with scratch(commits / "batch", "staging") as staging:
            staging.mkdir()
            (staging / REMOVED).mkdir()
            (staging / COMMIT_PLAN).write_text(json.dumps(plan))
            os.replace(staging, commits / (new_commit_id(commits) + COMMITTED))  # the commit point
        finish_commits(commits)

    def being_removed(self, table: str) -> pl.DataFrame:
        """The rows of `table` that removal commits left pending in the forecasting store remove, without finishing
        them: what a delete killed after its commit point was removing, gone at the next read.

        Each partition is read where the commit has got to with it: in its place, moved into the commit, or
        moved aside; one that the commit finished meanwhile is simply not among them.
        """
        spec = _spec(table)
        commits = self.forecast_dir / COMMIT_DIR
        frames = [pl.from_arrow(spec.schema.empty_table())]
        for committed in sorted(commits.glob(f"*{COMMITTED}")) if commits.is_dir() else ():
            try:
                plan = json.loads((committed / COMMIT_PLAN).read_text())
            except FileNotFoundError:  # finished meanwhile
                continue
            removed = [(number, self.root / entry["remove"]) for number, entry in enumerate(plan) if "remove" in entry]
            for number, path in removed:
                if not path.is_relative_to(self.table_dir(table)):
                    continue
                for place in (path, committed / REMOVED / str(number), aside(committed, path)):
                    try:
                        found = [_read_parquet(spec, file) for file in sorted(place.rglob(PART_FILE))]
                    except FileNotFoundError:  # moved on meanwhile by a process finishing the commit
                        continue
                    if found:
                        frames += found
                        break
        return pl.concat(frames, how="diagonal_relaxed")

    # ---- reads ----------------------------------------------------------------------------
    def connect(self, gold: bool = False, run_id: str | None = None,
                tables: Iterable[str] | None = None) -> duckdb.DuckDBPyConnection:
        """A fresh in-memory DuckDB connection with every table (or every one of `tables`) as a view.

        Without `gold`, the connection can read only the forecasting store: external access is
        restricted to that directory, and it cannot be re-enabled on this connection.
        With `run_id`, the tables partitioned by run (rankings, runs, metrics, llm_calls, ...) show
        only that run's rows: a query then opens that run's files instead of every run's, which
        matters once a warehouse holds thousands of runs.
        DuckDB reads the footer of every file a view covers when it creates the view (and when a query
        binds it), so a connection that reads a few tables names them in `tables`; the others are not
        views on it. A filter on a partition key skips the other partitions' files when the query scans.
        """
        self.forecast_dir.mkdir(parents=True, exist_ok=True)
        if run_id is not None:
            check_run_id(run_id)  # it goes into the views' file patterns
        for store in (FORECAST, GOLD) if gold else (FORECAST,):
            finish_commits(self.store_dir(store) / COMMIT_DIR)
        wanted = set(TABLES) if tables is None else {_spec(name).name for name in tables}
        con = duck.connect(":memory:")
        over_files = {}
        for spec in TABLES.values():
            if spec.name not in wanted or (spec.store == GOLD and not gold):
                continue
            scope = {"run_id": run_id} if run_id is not None and spec.name in RUN_TABLES else {}
            sql = self._view_sql(spec, scope)
            if sql is None:
                cols = ", ".join(f"CAST(NULL AS {_duck_type(t)}) AS \"{n}\"" for n, t in spec.columns.items())
                sql = f"SELECT {cols} WHERE false"
            else:
                over_files[spec.name] = sql
            try:
                con.execute(f"CREATE VIEW {spec.name} AS {sql}")
            except duckdb.InvalidInputException as exc:  # a file our atomic writes cannot have left: damaged since
                raise InputError(f"table {spec.name}: {exc.args[0].splitlines()[0]}; move that file out of the "
                                 "warehouse and rerun the command that wrote it") from exc
        _add_missing_columns(con, over_files)
        if not gold:
            duck.confine(con, self.forecast_dir)
        return con

    def has_rows(self, table: str, **keys) -> bool:
        spec = _spec(table)
        finish_commits(self.store_dir(spec.store) / COMMIT_DIR)
        return any(self._files(spec, keys))

    def read(self, table: str, **keys) -> pl.DataFrame:
        """All rows of the partitions matching the given leading keys (empty frame if none)."""
        spec = _spec(table)
        # A commit a killed `write_together` left: read without it, its partitions could be half new, half old.
        finish_commits(self.store_dir(spec.store) / COMMIT_DIR)
        # The empty frame first: every declared column in order and type, null in partitions written
        # before a (nullable) column was added.
        empty = pl.from_arrow(spec.schema.empty_table())
        return pl.concat([empty, *(_read_parquet(spec, f) for f in sorted(self._files(spec, keys)))],
                         how="diagonal_relaxed")

    def _files(self, spec: Table, keys: dict):
        # A value no write accepts names no partition; as a glob (`*`, `?`, `[`) it could match others.
        if any(unsafe(str(value)) for value in keys.values()):
            return iter(())
        return (self.store_dir(spec.store) / spec.name).glob(_partition_pattern(spec, keys))

    def _view_sql(self, spec: Table, keys: dict) -> str | None:
        """The view over the files of the partitions matching `keys`; None when there are none."""
        if not any(self._files(spec, keys)):
            return None
        table_dir = self.store_dir(spec.store) / spec.name
        pattern = _partition_pattern(spec, keys)
        if not any("=" in part for part in table_dir.parts):
            # Hive partitioning lets a filter on a partition key (`WHERE run_id = ...`) skip the other partitions'
            # files, and holds each key as one value per file (grouping by it costs nothing). Its values come from
            # the directory names, which `write` made equal to the file's own, typed as declared; a key that is no
            # column (`shard`) stays out of the view.
            types = ", ".join(f"'{key}': {_duck_type(spec.columns[key]) if key in spec.columns else 'VARCHAR'}"
                              for key in spec.partition_by)
            hidden = [key for key in spec.partition_by if key not in spec.columns]
            select = f"* EXCLUDE ({', '.join(hidden)})" if hidden else "*"
            return (f"SELECT {select} FROM read_parquet({duck.files(table_dir, pattern)}, union_by_name=true, "
                    f"hive_partitioning=true, hive_types={{{types}}})")
        # DuckDB's hive partitioning takes `key=value` from the whole path, the data dir's too: under `/lake/site=a/`
        # every view had a `site` column, under `/lake/run_id=zz/` every run's rows read run_id zz. There each key
        # that is a column is taken from its own directory, that many levels above the file: a filter on it still
        # skips the other partitions' files, but grouping by it parses each row's file name (a GROUP BY run_id over
        # 20M rows: 9 ms with hive partitioning, 240 ms so).
        depth = len(spec.partition_by) + 1
        from_directory = ", ".join(
            f"CAST(split_part(string_split(filename, '/')[{level - depth}], '=', 2) AS {_duck_type(spec.columns[key])})"
            f' AS "{key}"' for level, key in enumerate(spec.partition_by) if key in spec.columns)
        scan = duck.read("read_parquet", table_dir, pattern, "union_by_name = true, filename = true")
        replace = f" REPLACE ({from_directory})" if from_directory else ""
        return f"SELECT * EXCLUDE (filename){replace} FROM {scan}"


def _add_missing_columns(con: duckdb.DuckDBPyConnection, views: dict[str, str]) -> None:
    """Give each view over files (`views`: name -> its query) the nullable columns none of them has, as NULL.

    Such a view reads each column that one of its files has (null in the others); a column added to a
    table after all its partitions were written would be missing, and every query naming it would fail.
    """
    if not views:
        return
    present: dict[str, set[str]] = {}
    for view, column in con.execute("SELECT table_name, column_name FROM duckdb_columns() WHERE table_name IN "
                                    f"({', '.join('?' for _ in views)})", list(views)).fetchall():
        present.setdefault(view, set()).add(column)
    for view, sql in views.items():
        spec = TABLES[view]
        missing = [name for name in spec.columns if name in spec.nullable and name not in present.get(view, ())]
        if missing:
            nulls = ", ".join(f'CAST(NULL AS {_duck_type(spec.columns[name])}) AS "{name}"' for name in missing)
            con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT *, {nulls} FROM ({sql})")


def new_commit_id(commits: Path) -> str:
    """The id of a commit about to be made in `commits`: its creation time, but past every pending commit's.

    A clock stepped back (NTP, a VM resumed) would give it an earlier time than a commit made before it
    and left pending by a killed writer, which would then be finished after it and undo it.
    """
    pending = (COMMIT_TIME.match(path.name) for path in commits.glob(f"t*{COMMITTED}"))
    newest = max((int(found.group(1)) for found in pending if found), default=-1)
    return COMMIT_ID.format(ns=max(time.time_ns(), newest + 1), token=uuid.uuid4().hex[:8])


def finish_commits(commits: Path) -> None:
    """Finish the commits that killed writers left in `commits`, oldest first, and remove their unfinished staging.

    A process that may not write the store (an analyst's account, a read-only mount or copy) cannot finish one, and
    reading without it could show its partitions half new, half old: it is refused in one line naming the fix.
    """
    remove_abandoned(commits / "batch")
    for committed in sorted(commits.glob(f"*{COMMITTED}")) if commits.is_dir() else ():
        try:
            apply_commit(committed)
        except OSError as exc:
            if exc.errno not in UNWRITABLE:
                raise
            raise InputError(f"{committed} is a commit that a killed writer left unfinished, and this user (uid "
                             f"{os.getuid()}) may not finish it: run any dxr command that reads the warehouse (dxr "
                             f"--data-dir {commits.parent.parent} sql 'SELECT 1') as an account that can write it, "
                             "then retry") from exc


def apply_commit(committed: Path) -> None:
    """Rename a commit's files over their partitions, then remove it.

    Safe to run twice at once (a writer finishing its own commit while another finishes what it takes
    for a killed writer's): each staged file is renamed once, by whichever gets to it first.
    """
    try:
        plan = json.loads((committed / COMMIT_PLAN).read_text())
    except FileNotFoundError:
        # Finished: the plan is in the commit from its rename on and goes only once every file has been renamed.
        # Removed meanwhile, or a removal was killed after the plan went and left the rest behind for good.
        shutil.rmtree(committed, ignore_errors=True)
        return
    store_dir = committed.parent.parent
    for number, entry in enumerate(plan):
        if "remove" in entry:
            remove_into(committed, store_dir.parent / entry["remove"], number)
            remove_emptied(store_dir.parent / entry["remove"])
            continue
        target = store_dir / entry["target"]
        make_dirs(target.parent)
        try:
            os.replace(committed / entry["file"], target)
        except FileNotFoundError:  # renamed already
            pass
    shutil.rmtree(committed, ignore_errors=True)


def remove_into(committed: Path, path: Path, number: int) -> None:
    """Move the directory `path` into a removal's commit, to be removed with it.

    Nothing when it is gone: removed already, or the commit finished meanwhile (its directory gone too, so a
    partition written since cannot be moved into it). A directory on another file system than the forecasting
    store (a gold store mounted apart) is moved aside instead, out of every view's pattern, and removed there.
    """
    try:
        os.replace(path, committed / REMOVED / str(number))
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        os.replace(path, aside(committed, path))
    shutil.rmtree(aside(committed, path), ignore_errors=True)  # also what a process killed during a removal left there


def move_to_trash(path: Path, trash: Path) -> None:
    """Move the directory `path` into the store's `trash` by one rename; nothing when it is gone.

    Deletes share a store's trash and each removes it once it has emptied it (`Warehouse.delete`), which another
    delete may do between this one's `mkdir` and its rename: the rename then finds no trash, and is made again on a
    new one. A trash that holds a partition is never removed, so each retry is owed to one such `rmdir`.
    """
    for attempt in range(MOVE_TO_TRASH_ATTEMPTS):
        if not path.exists():
            return
        trash.mkdir(exist_ok=True)
        try:
            os.replace(path, trash / uuid.uuid4().hex)
            return
        except FileNotFoundError:
            if attempt == MOVE_TO_TRASH_ATTEMPTS - 1:
                raise


def remove_emptied(removed: Path) -> None:
    """Remove the partition directories (`key=value`) above a removed one that it left empty, nearest first: a
    cohort's delete removes a run's `runs` partitions one kind at a time, which left `runs/run_id=<id>/` behind, and a
    forecast rerun clears one system's metrics of a run (`Warehouse.delete`), which left `metrics/run_id=<id>/`.

    `rmdir` removes a directory only while it is empty, so one a writer has put a partition in since stays. A writer
    that finds one gone makes it again; a second process finishing the same commit may then `rmdir` it again in the
    instant before the writer's partition directory is in it, and the writer makes both again (`make_dirs`); so may
    a `Warehouse.delete` of a sibling partition (another system's forecast into the same run). The table's own
    directory, with no `=` in its name, stays.
    """
    for directory in removed.parents:
        if "=" not in directory.name:
            return
        try:
            directory.rmdir()
        except OSError:  # not empty, or removed by another process finishing the commit
            return


def aside(committed: Path, path: Path) -> Path:
    """Where a removal's commit moves `path` when it is on another file system: beside it, hidden from the views."""
    return path.with_name(f".{path.name}.{committed.name}.{REMOVED}")


def _checked(table: str, data: pl.DataFrame | pa.Table, keys: dict) -> pa.Table:
    """`data` conformed to the declared schema, its partition columns holding the partition's values only."""
    spec = _spec(table)
    arrow = conform(spec, data)
    for key in spec.partition_by:
        if key in spec.columns:
            values = set(arrow.column(key).unique().to_pylist())
            if values - {keys[key]} and len(arrow):
                raise ValueError(f"{table}: rows with {key} in {sorted(map(str, values))} written to "
                                 f"partition {key}={keys[key]}")
    return arrow


def _partition_pattern(spec: Table, keys: dict) -> str:
    """The files of the partitions matching the given leading keys, relative to the table's directory.

    `key=*`, not `*`: DuckDB's `*` also matches hidden names, which are never partitions.
    """
    return "/".join([f"{key}={keys[key]}" if key in keys else f"{key}=*" for key in spec.partition_by]
                    + [PART_FILE])


def _read_parquet(spec: Table, path: Path) -> pl.DataFrame:
    try:
        return pl.read_parquet(path, glob=False)
    except pl.exceptions.ComputeError as exc:  # a file our atomic writes cannot have left: damaged since
        raise InputError(f"table {spec.name}: {path} is not a readable Parquet file ({str(exc).splitlines()[0]}); "
                         "move that file out of the warehouse and rerun the command that wrote it") from exc


def check_run_id(run_id: str) -> str:
    """A run id becomes a partition value, part of file patterns and of lock names: letters, digits and _.:- only."""
    if problem := unsafe(run_id):
        raise InputError(f"run id {run_id!r} {problem}")
    return run_id


def unsafe(value: str) -> str | None:
    """Why a value cannot be a partition directory's value (None when it can)."""
    if not SAFE_VALUE.fullmatch(value):  # `$` alone would let a trailing newline through
        return "has unsafe characters: use letters, digits and _.:-"
    if value == HIVE_NULL:
        return "would read back as NULL through DuckDB's hive partitioning: use another value"
    return None


def conform(spec: Table, data: pl.DataFrame | pa.Table) -> pa.Table:
    """Select and cast the declared columns; name the first missing column or null in a required one."""
    arrow = data.to_arrow() if isinstance(data, pl.DataFrame) else data
    missing = [c for c in spec.columns if c not in arrow.column_names]
    if missing:
        raise InputError(f"table {spec.name}: missing column(s) {missing}; expected {list(spec.columns)}")
    arrow = arrow.select(list(spec.columns))
    for name in spec.columns:
        if name not in spec.nullable and arrow.column(name).null_count:
            raise InputError(f"table {spec.name}: column {name} has {arrow.column(name).null_count} null value(s); "
                             "it is required")
    try:
        return arrow.cast(spec.schema, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise InputError(f"table {spec.name}: cannot cast to the declared schema ({exc})") from exc


def _spec(table: str) -> Table:
    try:
        return TABLES[table]
    except KeyError:
        raise NotFoundError(f"unknown table {table!r}; known tables: {', '.join(sorted(TABLES))}") from None


def _duck_type(t: pa.DataType) -> str:
    if pa.types.is_timestamp(t):
        return "TIMESTAMP"
    if pa.types.is_boolean(t):
        return "BOOLEAN"
    if pa.types.is_floating(t):
        return "DOUBLE" if t.bit_width == 64 else "FLOAT"
    if pa.types.is_integer(t):
        return {8: "TINYINT", 16: "SMALLINT", 32: "INTEGER", 64: "BIGINT"}[t.bit_width]
    if pa.types.is_list(t) or pa.types.is_large_list(t):  # search_jobs' terms: an empty view's type as a file's
        return f"{_duck_type(t.value_type)}[]"
    return "VARCHAR"


def fetch_frame(con: duckdb.DuckDBPyConnection, query: str, params: list | None = None) -> pl.DataFrame:
    """Run a query and fetch the whole result as a polars frame.

    Uses the relation API (no extra copy). DuckDB 2 refuses it while an `execute` result is still
    unfinished, so callers finish theirs with `fetchall()` (never `fetchone()`).
    """
    return pl.from_arrow(con.sql(query, params=params or None).to_arrow_table())
