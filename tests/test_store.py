"""The warehouse store: atomic partition replacement and the boundary between the two stores."""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pytest

import warehouse.store as store
from dxr.cli import one_line
from dxr.errors import ConfigError, InputError, NotFoundError
from tests.conftest import NFS_FCNTL, abandoned_scratch, file_size_limit, legacy_scratch
from warehouse.scratch import _HOST, remove_abandoned, scratch


def targets(cohort: str, n: int) -> pl.DataFrame:
    return pl.DataFrame({"cohort_id": [cohort] * n, "trajectory_id": [f"{cohort}:{i}:1" for i in range(n)],
                         "code": ["DIAGNOSIS//ICD//10//I10"] * n})


def test_rewriting_a_partition_replaces_it(wh):
    wh.write("targets", targets("a", 3), cohort_id="a")
    wh.write("targets", targets("b", 2), cohort_id="b")
    wh.write("targets", targets("a", 1), cohort_id="a")
    counts = wh.connect(gold=True).execute("SELECT cohort_id, count(*) FROM targets GROUP BY 1 ORDER BY 1").fetchall()
    assert counts == [("a", 1), ("b", 2)]


def test_a_failed_partition_write_names_the_partition_and_keeps_the_old_one(wh):
    # pyarrow's writer raises OSError(27, 'Error writing bytes to file. Detail: ...') without a file name: the
    # CLI's line was "[Errno 27] Error writing bytes to file. Detail: [errno 27] File too large", no path.
    wh.write("targets", targets("a", 3), cohort_id="a")
    partition = wh.partition_path("targets", cohort_id="a")
    with file_size_limit(16 * 1024), pytest.raises(OSError) as raised:
        wh.write("targets", targets("a", 100_000), cohort_id="a")
    assert (raised.value.errno, raised.value.filename) == (errno.EFBIG, str(partition))
    assert one_line(raised.value) == (f"{partition}: File too large: raise the file-size limit (ulimit -f) or "
                                     "choose another location (--data-dir, DXR_DATA_DIR, TMPDIR)")
    assert wh.read("targets", cohort_id="a").equals(targets("a", 3))
    assert sorted(p.name for p in partition.parent.iterdir()) == ["data.parquet"]


def test_a_full_quota_names_the_path_and_the_fix_as_a_full_disk_does():
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/srv/dxr/forecast/runs/data.parquet")
    assert one_line(quota) == ("/srv/dxr/forecast/runs/data.parquet: Disk quota exceeded: free disk space (or raise "
                               "the quota) there or choose another location (--data-dir, DXR_DATA_DIR, TMPDIR)")


def test_a_query_written_past_the_file_size_limit_is_one_line_naming_the_directory_and_keeps_the_old_partition(wh):
    # DuckDB's COPY (a cohort build's train events) passes EFBIG on only as the text of an IOException, which the
    # build's `resource_errors` let through as a traceback: it knew ENOSPC's text alone.
    from warehouse.duck import connect, resource_errors

    wh.write("targets", targets("a", 3), cohort_id="a")
    con = connect()  # the build's: its queries read the gold store and MEDS files
    query = "SELECT 'a' AS cohort_id, 'a:' || range || ':1' AS trajectory_id, 'DIAGNOSIS//ICD//10//I10' AS code " \
            "FROM range(100000)"
    with file_size_limit(16 * 1024), pytest.raises(ConfigError) as raised, resource_errors("a build", wh.root):
        wh.write_query("targets", con, query, cohort_id="a")
    assert str(raised.value) == (f"a build: a file in {wh.root} reached the file-size limit: raise it (ulimit -f), "
                                 "or point --data-dir (DXR_DATA_DIR) to a disk with room")
    assert wh.read("targets", cohort_id="a").equals(targets("a", 3))


@pytest.mark.parametrize("text", ["Could not write file \"x.tmp\": Disk quota exceeded", "No space left on device"])
def test_a_full_quota_is_out_of_disk_space_as_a_full_disk_is(wh, text):
    from warehouse.duck import resource_errors

    with pytest.raises(ConfigError) as raised, resource_errors("a build", wh.root):
        raise duckdb.IOException(f"IO Error: {text}")
    assert str(raised.value) == (f"a build: out of disk space in {wh.root}: free disk space there, or point --data-dir "
                                 "(DXR_DATA_DIR) to a disk with room")


def test_temporary_files_of_a_killed_writer_are_invisible_and_removed_by_the_next_write(wh):
    wh.write("targets", targets("a", 3), cohort_id="a")
    partition = wh.partition_path("targets", cohort_id="a")
    killed = abandoned_scratch(partition)  # what SIGKILL mid-write leaves: a partial file, a free lock file
    killed.write_bytes(b"half a parquet file")
    older = legacy_scratch(partition)  # the same, from a version without lock files
    older.write_bytes(b"half a parquet file")
    with scratch(partition, "tmp") as live:  # a writer still running (this process)
        live.write_bytes(b"being written")
        assert wh.connect(gold=True).execute("SELECT count(*) FROM targets").fetchone() == (3,)
        wh.write("targets", targets("a", 2), cohort_id="a")
        lock = live.with_suffix(".lock")
        assert sorted(p.name for p in partition.parent.iterdir()) == sorted([partition.name, live.name, lock.name])
    assert [p.name for p in partition.parent.iterdir()] == [partition.name]


def test_scratch_is_judged_by_its_lock_not_by_host_and_process_id(wh):
    """Containers sharing a volume: another host's scratch is removed once its owner has ended, and kept
    while it runs, even where this host's process ids say otherwise."""
    target = wh.partition_path("targets", cohort_id="a")
    left = abandoned_scratch(target)
    foreign = left.with_name(left.name.replace(_HOST, "other_pod"))  # as if another host had written it
    left.with_suffix(".lock").rename(foreign.with_suffix(".lock"))
    foreign.write_bytes(b"left by a pod that was killed")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import os, time; from pathlib import Path; from warehouse.scratch import scratch\n"
        f"with scratch(Path({str(target)!r}), 'tmp') as path:\n"
        "    path.write_bytes(b'x'); print(path, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        running = Path(holder.stdout.readline().strip())
        assert remove_abandoned(target) == [foreign, foreign.with_suffix(".lock")]
        assert running.exists() and running.with_suffix(".lock").exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert remove_abandoned(target) == [running, running.with_suffix(".lock")]


def test_abandoned_scratch_is_removed_on_nfs_where_an_exclusive_lock_needs_a_writable_descriptor(wh, monkeypatch):
    # The lock file was opened read-only: NFS's emulated flock refused the exclusive try with EBADF, and every write
    # that swept its target's abandoned scratch failed with "[Errno 9] Bad file descriptor".
    import warehouse.scratch

    target = wh.partition_path("targets", cohort_id="a")
    left = abandoned_scratch(target)
    left.write_bytes(b"left by a writer that was killed")
    monkeypatch.setattr(warehouse.scratch, "fcntl", NFS_FCNTL)
    assert remove_abandoned(target) == [left, left.with_suffix(".lock")]


def test_a_delete_killed_midway_leaves_nothing_visible_and_the_next_delete_cleans_up(wh, monkeypatch):
    for cohort in ("a", "b"):
        wh.write("targets", targets(cohort, 3), cohort_id=cohort)
    real_rmtree = store.shutil.rmtree

    def killed(path, **kwargs):
        raise KeyboardInterrupt("killed while removing files")

    monkeypatch.setattr(store.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        wh.delete("targets", cohort_id="a")
    assert any((wh.gold_dir / store.TRASH_DIR).iterdir())  # the files are still on disk …
    con = wh.connect(gold=True)  # … but neither the views nor reads see them
    assert con.execute("SELECT cohort_id, count(*) FROM targets GROUP BY 1").fetchall() == [("b", 3)]
    assert wh.read("targets")["cohort_id"].unique().to_list() == ["b"]
    monkeypatch.setattr(store.shutil, "rmtree", real_rmtree)
    wh.delete("targets", cohort_id="absent")
    assert not (wh.gold_dir / store.TRASH_DIR).exists()


def test_a_delete_leaves_no_empty_trash_behind(wh):
    # Each delete moved its partition into the store's `.trash`, emptied it, and left it there, empty, for good.
    wh.write("targets", targets("a", 3), cohort_id="a")
    wh.delete("targets", cohort_id="a")
    assert sorted(path.name for path in wh.gold_dir.iterdir()) == ["targets"]


def test_a_delete_moves_its_partition_into_a_trash_a_concurrent_delete_removed_meanwhile(wh, monkeypatch):
    # Another delete in the store (a forecast rerun of another run) may remove the trash it emptied between this
    # delete's `mkdir` of it and its rename of the partition into it.
    for cohort in ("a", "b"):
        wh.write("targets", targets(cohort, 3), cohort_id=cohort)
    trash = wh.gold_dir / store.TRASH_DIR
    real_replace = store.os.replace
    removed_trash = []

    def replace(source, target):
        if Path(target).parent == trash and not removed_trash:
            trash.rmdir()
            removed_trash.append(trash)
        return real_replace(source, target)

    monkeypatch.setattr(store.os, "replace", replace)
    wh.delete("targets", cohort_id="a")
    assert removed_trash == [trash]
    assert wh.read("targets")["cohort_id"].unique().to_list() == ["b"]
    assert not trash.exists()


def test_a_delete_removes_the_partition_directories_it_leaves_empty(wh):
    from tasks.forecast import clear_outputs
    from tests.conftest import empty_partition_dirs

    # A forecast rerun clears its system's evaluation of the run by run and system (`clear_outputs`): when that
    # system was the run's only one evaluated, `metrics/run_id=r1/` stayed behind, empty, for good.
    for run_id, system in (("r1", "repeat_history"), ("r2", "repeat_history"), ("r2", "global_frequency")):
        wh.write("metrics", pl.DataFrame({
            "run_id": run_id, "cohort_id": "c1", "system": system, "subset": "all", "k": 10, "metric": "recall_at_k",
            "value": 0.5, "ci_low": None, "ci_high": None, "n": 3, "n_runs": 1}), run_id=run_id, system=system)
    clear_outputs(wh, "r1", "repeat_history", {})
    clear_outputs(wh, "r2", "repeat_history", {})
    assert empty_partition_dirs(wh) == []
    assert [p.relative_to(wh.forecast_dir) for p in wh.forecast_dir.rglob(store.PART_FILE)] == [
        Path("metrics/run_id=r2/system=global_frequency/data.parquet")]
    # One that a delete killed after moving the partition out left goes with the next delete of those keys.
    (wh.table_dir("metrics") / "run_id=r3").mkdir()
    wh.delete("metrics", run_id="r3", system="repeat_history")
    assert empty_partition_dirs(wh) == [] and wh.table_dir("metrics").is_dir()


def chunk_rows(text: str, source: str = "s") -> pl.DataFrame:
    return pl.DataFrame({"corpus": ["c"], "source": [source], "chunk_id": ["c:1#0"], "doc_id": ["c:1"],
                         "ordinal": pl.Series([0], dtype=pl.Int32), "section": ["Text"], "text": [text]})


def kill_after_the_commit_point(monkeypatch) -> None:
    """Make a commit's renames of its files into place raise, as a kill right after its commit point would;
    `monkeypatch.undo()` ends it."""
    real_replace = os.replace

    def killed_before_the_renames(src, dst):
        if Path(src).parent.name.endswith(store.COMMITTED):
            raise KeyboardInterrupt("killed after the commit, before its files were renamed into place")
        return real_replace(src, dst)

    monkeypatch.setattr(store.os, "replace", killed_before_the_renames)


def test_a_commit_left_by_a_killed_writer_is_finished_before_any_later_write_or_delete(wh, monkeypatch):
    """Finished only by the next `write_together`, it would undo the writes and deletes made since."""
    def killed_commit(text: str) -> None:
        kill_after_the_commit_point(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            wh.write_together([("chunks", chunk_rows(text), {"corpus": "c", "source": "s"})])
        monkeypatch.undo()

    killed_commit("committed, then killed")
    wh.write("chunks", chunk_rows("written later"), corpus="c", source="s")
    wh.write_together([("chunks", chunk_rows("elsewhere", "t"), {"corpus": "c", "source": "t"})])
    assert wh.read("chunks", corpus="c", source="s")["text"].to_list() == ["written later"]
    killed_commit("committed, then killed")
    wh.delete("chunks", corpus="c", source="s")
    wh.write_together([("chunks", chunk_rows("elsewhere", "t"), {"corpus": "c", "source": "t"})])
    assert wh.read("chunks", corpus="c", source="s").height == 0
    assert list((wh.forecast_dir / store.COMMIT_DIR).iterdir()) == []


def test_a_gold_commit_left_by_a_killed_writer_cannot_bring_back_a_partition_removed_since(wh, monkeypatch):
    # The removal commit lives in the forecasting store: a gold commit left pending was finished only by the next
    # gold read, after the removal, and put the removed cohort's targets back.
    wh.write("targets", targets("c2", 1), cohort_id="c2")
    kill_after_the_commit_point(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        wh.write_together([("targets", targets("c1", 2), {"cohort_id": "c1"})])
    monkeypatch.undo()
    wh.delete_together([("targets", {"cohort_id": "c1"})])
    assert wh.read("targets")["cohort_id"].unique().to_list() == ["c2"]


def test_a_read_after_a_commit_killed_between_its_renames_sees_the_whole_commit(wh, monkeypatch):
    """A read finishes the commit first: it saw the new partition beside the old one until the next write."""
    import os

    for source in ("s", "t"):
        wh.write("chunks", chunk_rows("old", source), corpus="c", source=source)
    real_replace = os.replace

    def killed_between_the_renames(src, dst):
        if "source=t" in Path(dst).parts:
            raise KeyboardInterrupt("killed after the first file was renamed into place")
        return real_replace(src, dst)

    monkeypatch.setattr(store.os, "replace", killed_between_the_renames)
    with pytest.raises(KeyboardInterrupt):
        wh.write_together([("chunks", chunk_rows("new", source), {"corpus": "c", "source": source})
                           for source in ("s", "t")])
    monkeypatch.undo()
    assert wh.has_rows("chunks", corpus="c", source="t")
    assert wh.connect().execute("SELECT source, text FROM chunks ORDER BY source").fetchall() == [
        ("s", "new"), ("t", "new")]
    assert wh.read("chunks")["text"].to_list() == ["new", "new"]
    assert list((wh.forecast_dir / store.COMMIT_DIR).iterdir()) == []


def test_write_together_refuses_to_remove_a_partition_it_writes(wh):
    """The commit renames the new file into place, then moves the removed directory out with it: the write is lost."""
    wh.write("chunks", chunk_rows("old"), corpus="c", source="s")
    for removal in ({"corpus": "c", "source": "s"}, {"corpus": "c"}, {}):
        with pytest.raises(ValueError, match=r"table chunks \{'corpus': 'c', 'source': 's'\} is under removal "
                                             rf"\(chunks, {re.escape(str(removal))}\)"):
            wh.write_together([("chunks", chunk_rows("new"), {"corpus": "c", "source": "s"})],
                              removals=[("chunks", removal)])
    assert wh.read("chunks")["text"].to_list() == ["old"]
    # A sibling partition of the same table may go in the same commit.
    wh.write_together([("chunks", chunk_rows("new", "t"), {"corpus": "c", "source": "t"})],
                      removals=[("chunks", {"corpus": "c", "source": "s"})])
    assert wh.read("chunks")["text"].to_list() == ["new"]


def test_a_commit_whose_removal_was_killed_is_removed_by_the_next_write(wh, monkeypatch):
    real_unlink = os.unlink

    def killed_after_the_plan(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        if Path(path).name == store.COMMIT_PLAN:
            raise KeyboardInterrupt("killed while removing the finished commit")

    monkeypatch.setattr(os, "unlink", killed_after_the_plan)  # as shutil.rmtree removes the commit's plan
    with pytest.raises(KeyboardInterrupt):
        wh.write_together([("chunks", chunk_rows("whole"), {"corpus": "c", "source": "s"})])
    monkeypatch.undo()
    [left] = (wh.forecast_dir / store.COMMIT_DIR).glob(f"*{store.COMMITTED}")
    assert list(left.iterdir()) == []  # every file reached its partition, the plan is gone
    wh.write("chunks", chunk_rows("other", "t"), corpus="c", source="t")
    assert list((wh.forecast_dir / store.COMMIT_DIR).iterdir()) == []
    assert wh.read("chunks")["text"].to_list() == ["whole", "other"]


def test_commits_left_by_killed_writers_are_finished_in_the_order_they_were_made(wh, monkeypatch):
    """By random ids the later commit's sorted first and lost to the older one, which was finished after it."""
    import uuid

    # Every writer committed, then was killed before any commit could be finished (by a writer, or a reader):
    # without `finish_commits`, a writer leaves its commit as a kill right after the commit point would.
    monkeypatch.setattr(store, "finish_commits", lambda commits: None)
    commits = wh.forecast_dir / store.COMMIT_DIR
    for text, token in (("made first", "e" * 32), ("made second", "f" * 32), ("made third", "0" * 32)):
        monkeypatch.setattr(store.uuid, "uuid4", lambda token=token: uuid.UUID(token))
        wh.write_together([("chunks", chunk_rows(text), {"corpus": "c", "source": "s"})])
        if text == "made first":  # as an earlier version named it: its random id alone
            [first] = commits.glob(f"*{store.COMMITTED}")
            os.replace(first, commits / f"{token}{store.COMMITTED}")
    monkeypatch.undo()
    assert len(list(commits.glob(f"*{store.COMMITTED}"))) == 3
    assert wh.read("chunks", corpus="c", source="s")["text"].to_list() == ["made third"]
    assert list(commits.iterdir()) == []


def test_commits_left_pending_are_finished_in_the_order_they_were_made_when_the_clock_stepped_back(wh, monkeypatch):
    """By the wall clock alone the second commit, made after the clock went back, sorted first and was undone."""
    monkeypatch.setattr(store, "finish_commits", lambda commits: None)  # both writers killed after their commit
    commits = wh.forecast_dir / store.COMMIT_DIR
    for text, now in (("made first", 1_700_000_000_000_000_000), ("made second", 1_699_999_999_000_000_000)):
        monkeypatch.setattr(store.time, "time_ns", lambda now=now: now)
        wh.write_together([("chunks", chunk_rows(text), {"corpus": "c", "source": "s"})])
    monkeypatch.undo()
    assert sorted(path.name[:22] for path in commits.glob(f"*{store.COMMITTED}")) == [
        "t01700000000000000000-", "t01700000000000000001-"]
    assert wh.read("chunks", corpus="c", source="s")["text"].to_list() == ["made second"]
    assert list(commits.iterdir()) == []


def test_a_commit_killed_while_a_later_writer_staged_does_not_undo_that_writer(wh, monkeypatch):
    """A writer past its `finish_commits` that applied only its own commit left an older one behind, which
    the next read finished over its newer files."""
    real_replace, real_write_table = os.replace, store.pq.write_table
    killed = []

    def killed_before_the_renames(src, dst):
        if Path(src).parent.name.endswith(store.COMMITTED):
            raise KeyboardInterrupt("killed after the commit, before its files were renamed into place")
        return real_replace(src, dst)

    def older_writer_commits_meanwhile(*args, **kwargs):
        # While the later writer stages its files, an older one commits the same partition and is killed.
        if not killed:
            killed.append(True)
            monkeypatch.setattr(store.os, "replace", killed_before_the_renames)
            with pytest.raises(KeyboardInterrupt):
                wh.write_together([("chunks", chunk_rows("older"), {"corpus": "c", "source": "s"})])
            monkeypatch.setattr(store.os, "replace", real_replace)
        return real_write_table(*args, **kwargs)

    monkeypatch.setattr(store.pq, "write_table", older_writer_commits_meanwhile)
    wh.write_together([("chunks", chunk_rows("newer"), {"corpus": "c", "source": "s"})])
    monkeypatch.undo()
    assert killed == [True]
    assert wh.read("chunks", corpus="c", source="s")["text"].to_list() == ["newer"]
    assert list((wh.forecast_dir / store.COMMIT_DIR).iterdir()) == []


def test_forecasting_connection_cannot_read_the_gold_store(wh):
    wh.write("targets", targets("a", 3), cohort_id="a")
    gold_file = wh.partition_path("targets", cohort_id="a")
    # The same statements read the rows on a gold connection: the refusals below come from the boundary alone.
    assert wh.connect(gold=True).execute("SELECT count(*) FROM targets").fetchone() == (3,)
    assert duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{gold_file}')").fetchone() == (3,)
    con = wh.connect()
    with pytest.raises(duckdb.CatalogException, match="Table with name targets does not exist"):
        con.execute("SELECT * FROM targets")
    with pytest.raises(duckdb.PermissionException, match="disabled by configuration"):
        con.execute(f"SELECT * FROM read_parquet('{gold_file}')")
    with pytest.raises(duckdb.InvalidInputException, match="Cannot enable external access while database is running"):
        con.execute("SET enable_external_access=true")
    with pytest.raises(duckdb.PermissionException, match="disabled by configuration"):
        con.execute(f"SELECT * FROM read_parquet('{gold_file}')")


def test_writes_are_checked_against_the_schema(wh):
    with pytest.raises(InputError, match=r"table targets: missing column\(s\) \['code'\]"):
        wh.write("targets", targets("a", 1).drop("code"), cohort_id="a")
    with pytest.raises(InputError, match="column code has 1 null value"):
        wh.write("targets", targets("a", 1).with_columns(pl.lit(None, pl.String).alias("code")), cohort_id="a")
    with pytest.raises(ValueError, match="written to partition cohort_id=b"):
        wh.write("targets", targets("a", 1), cohort_id="b")


def test_empty_tables_are_typed_views(wh):
    con = wh.connect()
    assert con.execute("SELECT count(*) FROM rankings").fetchone() == (0,)
    types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE rankings)").fetchall())
    assert types["rank"] == "INTEGER" and types["native"] == "BOOLEAN"


def test_an_empty_view_has_the_types_of_a_view_over_files_list_columns_too(wh, tmp_path):
    """`entity_terms` of an empty `search_jobs` was VARCHAR, so `unnest(entity_terms)` was a binder error."""
    from warehouse.schemas import TABLES
    from warehouse.store import Warehouse

    def described(con) -> list[tuple[str, str]]:
        return con.execute("SELECT column_name, column_type FROM (DESCRIBE search_jobs)").fetchall()

    written = Warehouse(tmp_path / "written")
    job = {name: None for name in TABLES["search_jobs"].columns} | {
        "job_id": "j1", "run_id": "r", "trajectory_id": "t", "code": "c", "temporal_class": "onset", "iteration": 1,
        "purpose": "p", "query": "q", "entity_terms": ["a"], "endpoint_terms": [], "created_at": datetime(2026, 1, 1)}
    written.write("search_jobs", pa.Table.from_pylist([job], schema=TABLES["search_jobs"].schema), run_id="r", shard=0)
    empty = wh.connect()
    assert described(empty) == described(written.connect())
    assert dict(described(empty))["entity_terms"] == "VARCHAR[]"
    assert empty.execute("SELECT count(*) FROM search_jobs, unnest(entity_terms)").fetchall() == [(0,)]


def test_a_run_scoped_connection_shows_only_that_runs_rows_of_run_keyed_tables(wh):
    from warehouse.runs import record_run

    for run_id in ("a", "b", "a.b"):  # "a.b" would match a careless prefix or pattern for "a"
        record_run(wh, run_id, "c1", "synth", {}, "finished", datetime.now(), datetime.now())
    wh.write("targets", targets("c1", 2), cohort_id="c1")
    con = wh.connect(gold=True, run_id="a")
    assert con.execute("SELECT run_id FROM runs").fetchall() == [("a",)]
    assert con.execute("SELECT count(*) FROM rankings").fetchone() == (0,)  # none for run a: an empty typed view
    assert con.execute("SELECT count(*) FROM targets").fetchone() == (2,)  # not keyed by run: whole
    assert sorted(wh.connect().execute("SELECT run_id FROM runs").fetchall()) == [("a",), ("a.b",), ("b",)]
    with pytest.raises(InputError, match="run id 'a/\\*' has unsafe characters"):
        wh.connect(run_id="a/*")


def test_a_value_or_name_ending_in_a_newline_is_refused():
    # `$` matches before a final newline, so "r1\n" passed as a run id and would name a directory `run_id=r1\n`.
    from warehouse.datasets import check_cohort_key, check_name

    with pytest.raises(InputError, match="run id 'r1\\\\n' has unsafe characters"):
        store.check_run_id("r1\n")
    with pytest.raises(InputError, match="dataset name 'tiny\\\\n'"):
        check_name("dataset", "tiny\n")
    with pytest.raises(InputError, match="cohort 'default\\\\n' is no cohort name or id"):
        check_cohort_key("default\n")


def ranking_rows(run_id: str, n: int) -> pl.DataFrame:
    return pl.DataFrame({"run_id": [run_id] * n, "cohort_id": ["c"] * n, "system": ["repeat_history"] * n,
                         "trajectory_id": [f"c:{i}:1" for i in range(n)], "rank": [1] * n,
                         "code": ["DIAGNOSIS//ICD//10//I10"] * n, "score": [1.0] * n, "native": [True] * n})


def test_a_filter_on_a_partition_key_reads_only_the_matching_partitions(wh):
    from warehouse.schemas import TABLES

    for run_id, shards in (("r1", 2), ("r2", 3)):
        for shard in range(shards):
            wh.write("rankings", ranking_rows(run_id, 2), run_id=run_id, system="repeat_history", shard=shard)
    con = wh.connect()
    # The view has the declared columns (not the directory-only key `shard`) with the declared types.
    described = con.execute("DESCRIBE rankings").fetchall()
    assert [row[0] for row in described] == list(TABLES["rankings"].columns)
    assert [row[1] for row in described][:3] == ["VARCHAR"] * 3
    [(_, plan)] = con.execute("EXPLAIN ANALYZE SELECT count(*) FROM rankings WHERE run_id = 'r1'").fetchall()
    assert "Total Files Read: 2" in plan  # r1's two shards, not r2's three
    assert con.execute("SELECT count(*) FROM rankings WHERE run_id = 'r1'").fetchone() == (4,)
    assert con.execute("SELECT count(*) FROM rankings").fetchone() == (10,)


@pytest.mark.parametrize("lake", ["site=a", "run_id=zz", "cohort_id=zz", "icd_version=x"])
def test_a_data_dir_under_key_value_directories_has_the_views_of_one_under_a_plain_path(tmp_path, lake):
    # DuckDB's hive partitioning took `key=value` from the whole path: under `site=a/` every view had a `site` column,
    # under `run_id=zz/` every run's rows read run_id zz (`dxr evaluate` found no rankings), under `cohort_id=zz/` every
    # cohort's read cohort_id zz (a forecast found no history), and under `icd_version=x/` the vocabularies' TINYINT
    # icd_version was the text x.
    plain, under_keys = store.Warehouse(tmp_path / "plain" / "data"), store.Warehouse(tmp_path / lake / "data")
    for wh in (plain, under_keys):
        for run_id, shards in (("r1", 2), ("r2", 3)):
            for shard in range(shards):
                wh.write("rankings", ranking_rows(run_id, 2), run_id=run_id, system="repeat_history", shard=shard)
        for cohort, n in (("c1", 2), ("c2", 3)):
            wh.write("cohort_vocabulary", vocabulary(cohort, n), cohort_id=cohort)
            wh.write("targets", targets(cohort, n), cohort_id=cohort)

    def views(wh) -> dict:
        con = wh.connect(gold=True)
        return {table: (con.execute(f"DESCRIBE {table}").fetchall(),
                        con.execute(f"FROM {table} ORDER BY ALL").fetchall())
                for table in ("rankings", "cohort_vocabulary", "targets")}

    assert views(under_keys) == views(plain)
    con = under_keys.connect()
    [(_, plan)] = con.execute("EXPLAIN ANALYZE SELECT count(*) FROM rankings WHERE run_id = 'r1'").fetchall()
    assert "Total Files Read: 2" in plan  # r1's two shards, not r2's three
    assert con.execute("SELECT count(*) FROM cohort_vocabulary WHERE cohort_id = 'c2' AND icd_version = 10"
                       ).fetchall() == [(3,)]


def test_a_partition_value_that_duckdb_reads_as_null_is_refused(wh):
    # Read with DuckDB's hive partitioning (README), this directory value would come back as NULL, not as itself.
    null_marker = "__HIVE_DEFAULT_PARTITION__"
    with pytest.raises(InputError, match=f"partition value run_id='{null_marker}' of table rankings would read back"):
        wh.write("rankings", ranking_rows(null_marker, 1), run_id=null_marker, system="repeat_history", shard=0)
    with pytest.raises(InputError, match=f"run id '{null_marker}' would read back as NULL"):
        wh.connect(run_id=null_marker)
    with pytest.raises(InputError, match=f"partition value cohort_id='{null_marker}' of table targets would read back"):
        wh.write("targets", targets(null_marker, 1), cohort_id=null_marker)
    assert not any(wh.root.rglob("*.parquet"))


def damage(wh, table: str, **keys) -> Path:
    """A partition file that is not Parquet (what a disk fault or a careless copy leaves)."""
    path = wh.partition_path(table, **keys)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a parquet file")
    return path


def test_reading_a_damaged_file_names_it_and_the_fix(wh):
    damaged = damage(wh, "runs", run_id="r1", kind="cohort")
    with pytest.raises(InputError) as raised:
        wh.read("runs", run_id="r1")
    assert str(raised.value).startswith(f"table runs: {damaged} is not a readable Parquet file (")
    assert str(raised.value).endswith("); move that file out of the warehouse and rerun the command that wrote it")


def test_a_connection_limited_to_some_tables_opens_no_file_of_the_others(wh):
    from warehouse.schemas import NON_RUN_TABLES, RUN_TABLES

    assert {"rankings", "runs", "metrics", "llm_calls", "ledger"} <= RUN_TABLES
    assert {"cohorts", "train_events", "pretarget_events", "cohort_vocabulary"} <= NON_RUN_TABLES
    wh.write("targets", targets("a", 3), cohort_id="a")
    damaged = damage(wh, "rankings", run_id="r1", system="repeat_history", shard=0)
    # Creating a view opens every file of its table: the damaged one fails a connection with every view,
    # naming the file and the fix.
    with pytest.raises(InputError, match=f"table rankings: .*'{damaged}'.*move that file out of the warehouse"):
        wh.connect()
    con = wh.connect(gold=True, tables=NON_RUN_TABLES)
    assert con.execute("SELECT count(*) FROM targets").fetchone() == (3,)
    with pytest.raises(duckdb.CatalogException):
        con.execute("SELECT * FROM rankings")
    assert wh.connect(tables=["targets", "cohorts"]).execute("SHOW TABLES").fetchall() == [("cohorts",)]  # no gold
    with pytest.raises(NotFoundError, match="unknown table 'ranking'"):
        wh.connect(tables=["ranking"])


def test_sql_makes_views_of_the_tables_its_query_names_or_of_every_table(wh):
    from warehouse.sql import named_tables, run_query

    assert named_tables("SELECT r.code FROM Rankings r JOIN \"runs\" USING (run_id)") == {"rankings", "runs"}
    assert named_tables("SELECT * FROM information_schema.tables") is None
    wh.write("targets", targets("a", 3), cohort_id="a")
    damage(wh, "rankings", run_id="r1", system="repeat_history", shard=0)
    assert run_query(wh, "SELECT count(*) AS n FROM targets", fmt="csv", with_gold=True) == "n\n3\n"
    with pytest.raises(InputError, match="table rankings: .*magic bytes"):
        run_query(wh, "SELECT count(*) FROM rankings")
    with pytest.raises(InputError, match="table rankings"):
        run_query(wh, "SHOW TABLES")  # names no table: every view, the damaged one's too


def test_sql_streams_csv_and_json_lines_a_batch_at_a_time(wh, monkeypatch):
    import warehouse.sql
    from warehouse.sql import stream_query

    wh.write("targets", targets("a", 5), cohort_id="a")
    monkeypatch.setattr(warehouse.sql, "STREAM_ROWS", 2)
    query = "SELECT trajectory_id, code FROM targets ORDER BY trajectory_id"
    pieces = list(stream_query(wh, query, fmt="csv", with_gold=True))
    assert pieces[0] == "trajectory_id,code\n" and [p.count("\n") for p in pieces[1:]] == [2, 2, 1]
    rows = wh.read("targets").sort("trajectory_id").rows()
    assert "".join(pieces[1:]) == "".join(f"{t},{c}\n" for _, t, c in rows)
    lines = "".join(stream_query(wh, query, fmt="json", with_gold=True)).splitlines()
    assert [tuple(json.loads(line).values()) for line in lines] == [(t, c) for _, t, c in rows]
    # An error in the first rows comes before any output, as a one-line error.
    failing = stream_query(wh, "SELECT CAST(code AS INTEGER) FROM targets", fmt="csv", with_gold=True)
    with pytest.raises(InputError, match="SQL error: Conversion Error"):
        next(failing)


def test_sql_json_and_csv_spell_nested_blob_and_interval_values_as_json(wh):
    from warehouse.sql import stream_query

    query = ("SELECT {'a': 1, 'd': DATE '2020-01-02'} AS s, [{'x': 'p'}, {'x': NULL}] AS l, "
             "MAP {'k': 1.5::DOUBLE} AS m, MAP {2: 'two'} AS n, MAP {[1]: 'one'} AS lk, 'ab\\x00'::BLOB AS b, "
             "INTERVAL '1 day 2 hours' AS i, ['nan'::DOUBLE] AS f, [1, 2]::INTEGER[2] AS a, "
             "TIMESTAMP '2020-01-02 03:04:05' AS t, 'x' AS v, NULL::STRUCT(a INTEGER) AS z")
    line = json.loads("".join(stream_query(wh, query, fmt="json")))
    assert line == {"s": {"a": 1, "d": "2020-01-02"}, "l": [{"x": "p"}, {"x": None}], "m": {"k": 1.5},
                    "n": [{"key": 2, "value": "two"}], "lk": [{"key": [1], "value": "one"}], "b": "YWIA",
                    "i": 93600.0, "f": [None], "a": [1, 2], "t": "2020-01-02 03:04:05", "v": "x", "z": None}
    assert "".join(stream_query(wh, query, fmt="csv")).splitlines() == [
        "s,l,m,n,lk,b,i,f,a,t,v,z",
        '"{""a"": 1, ""d"": ""2020-01-02""}","[{""x"": ""p""}, {""x"": null}]","{""k"": 1.5}",'
        '"[{""key"": 2, ""value"": ""two""}]","[{""key"": [1], ""value"": ""one""}]",YWIA,93600,[null],"[1, 2]",'
        "2020-01-02 03:04:05,x,"]


def test_sql_json_writes_decimals_as_exact_numbers_and_csv_booleans_as_duckdb_does(wh, tmp_path):
    from warehouse.sql import stream_query

    query = ("SELECT 1.250::DECIMAL(18,3) AS d, 0.0000001::DECIMAL(18,7) AS tiny, "
             "-12345678901234567890.12::DECIMAL(38,2) AS big, NULL::DECIMAL(9,2) AS none, true AS t, false AS f, "
             "NULL::BOOLEAN AS nb, 2.5::DOUBLE AS x, [1.10::DECIMAL(4,2)] AS l, {'p': 0.50::DECIMAL(3,2)} AS s, "
             "union_value(k := 1.5::DECIMAL(4,1)) AS u, [true] AS lb, [2.00]::DECIMAL(3,2)[1] AS a")
    # Decimals were JSON strings ("1.250"), rounded by nothing but typed as text; now numbers with their digits.
    assert "".join(stream_query(wh, query, fmt="json")) == (
        '{"d": 1.250, "tiny": 0.0000001, "big": -12345678901234567890.12, "none": null, "t": true, "f": false, '
        '"nb": null, "x": 2.5, "l": [1.10], "s": {"p": 0.50}, "u": 1.5, "lb": [true], "a": [2.00]}\n')
    # Booleans were True / False and the tiny decimal 1E-7; nested values stay JSON text.
    csv_text = "".join(stream_query(wh, query, fmt="csv"))
    assert csv_text.splitlines() == ["d,tiny,big,none,t,f,nb,x,l,s,u,lb,a",
                                     '1.250,0.0000001,-12345678901234567890.12,,true,false,,2.5,[1.10],'
                                     '"{""p"": 0.50}",1.5,[true],[2.00]']
    # The scalar cells as DuckDB's own CSV writer spells them.
    scalars = "SELECT d, tiny, big, none, t, f, nb, x, u FROM (" + query + ")"
    duckdb.sql(f"COPY ({scalars}) TO '{tmp_path / 'duck.csv'}' (HEADER)")
    assert "".join(stream_query(wh, scalars, fmt="csv")) == (tmp_path / "duck.csv").read_text()


def test_sql_table_spells_decimals_booleans_and_nested_values_as_csv_does_and_aligns_decimals_as_numbers(wh):
    from warehouse.sql import stream_query

    query = ("SELECT * FROM (VALUES (1.250::DECIMAL(18,3), 0.0000001::DECIMAL(18,7), true, {'p': [1, 2]}, 'a'), "
             "(12.5, NULL, false, NULL, 'bb')) t(d, tiny, b, s, v)")
    # Decimals were left-aligned like text, the tiny one as 1E-7; booleans True / False; the struct Python text.
    assert "".join(stream_query(wh, query)) == (
        "     d       tiny  b      s              v\n"
        "------  ---------  -----  -------------  --\n"
        " 1.250  0.0000001  true   {\"p\": [1, 2]}  a\n"
        "12.500       NULL  false  NULL           bb\n"
        "(2 rows)\n")


def test_sql_table_spells_a_map_as_its_csv_cell_does_whatever_its_keys(wh):
    from warehouse.sql import stream_query

    query = "SELECT MAP {1: 'a', 22: 'b'} AS m, MAP {[1]: 2} AS ml, [MAP {DATE '2020-01-02': 1}] AS lm"
    # The table spelled maps from their Python form: keys as text ({"1": "a"}), a map with list keys as DuckDB's
    # client returns it ({"key": [[1]], "value": [2]}).
    rows = list(csv.reader(io.StringIO("".join(stream_query(wh, query, fmt="csv")))))[1]
    assert rows == ['[{"key": 1, "value": "a"}, {"key": 22, "value": "b"}]', '[{"key": [1], "value": 2}]',
                    '[[{"key": "2020-01-02", "value": 1}]]']
    assert "".join(stream_query(wh, query)).splitlines()[2].split("  ") == rows


def test_write_query_streams_a_partition_with_the_same_checks_as_write(wh):
    con = duckdb.connect()
    rows = ("SELECT 'a' AS cohort_id, 'a:' || i || ':1' AS trajectory_id, 'DIAGNOSIS//ICD//10//I10' AS code, "
            "0 AS extra FROM range(3) t(i)")
    wh.write_query("targets", con, rows, cohort_id="a")
    assert wh.read("targets").columns == ["cohort_id", "trajectory_id", "code"]  # declared columns only
    assert wh.read("targets", cohort_id="a")["trajectory_id"].to_list() == ["a:0:1", "a:1:1", "a:2:1"]
    with pytest.raises(InputError, match="column code has 1 null value"):
        wh.write_query("targets", con, "SELECT 'a' AS cohort_id, 'a:9:1' AS trajectory_id, NULL AS code", cohort_id="a")
    with pytest.raises(ValueError, match="1 row\\(s\\) with cohort_id other than b"):
        wh.write_query("targets", con, rows.replace("FROM range(3)", "FROM range(1)"), cohort_id="b")
    assert wh.read("targets")["cohort_id"].to_list() == ["a"] * 3  # refused writes changed nothing


def test_sql_sees_a_table_removed_after_its_views_were_made_as_empty(wh, monkeypatch):
    from warehouse.sql import run_query

    wh.write("targets", targets("a", 3), cohort_id="a")
    real_connect, calls = wh.connect, []

    def connect_then_rebuild(gold=False, run_id=None, tables=None):
        con = real_connect(gold=gold, run_id=run_id, tables=tables)
        if not calls:  # a cohort rebuild removes the partition between view creation and the read
            wh.delete("targets", cohort_id="a")
        calls.append(gold)
        return con

    monkeypatch.setattr(wh, "connect", connect_then_rebuild)
    assert run_query(wh, "SELECT count(*) AS n FROM targets", fmt="csv", with_gold=True) == "n\n0\n"
    assert len(calls) == 2


def test_interrupt_queries_stops_a_query_running_in_another_thread(wh):
    import threading

    from warehouse.duck import interrupt_queries

    con = wh.connect()
    outcome: list[BaseException] = []

    def long_query() -> None:
        try:
            con.execute("SELECT sum(hash(range)) FROM range(1000000000000)").fetchall()  # hours if not stopped
        except duckdb.Error as exc:
            outcome.append(exc)

    worker = threading.Thread(target=long_query, daemon=True)  # a query that went on must not hold up pytest
    worker.start()
    time.sleep(1.0)
    assert worker.is_alive()
    assert interrupt_queries() >= 1
    worker.join(timeout=30)
    assert not worker.is_alive(), "the query went on after interrupt_queries()"
    assert isinstance(outcome[0], duckdb.InterruptException)


def test_each_uncommitted_state_of_a_checkout_is_a_version_of_its_own(tmp_path, monkeypatch):
    from dxr import __version__
    from warehouse.runs import checkout_version

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    assert checkout_version(tmp_path) == __version__  # not a checkout
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("data/\n")
    (tmp_path / "model.py").write_text("WIDTH = 64\n")
    git("add", ".")
    git("commit", "-qm", "first")
    clean = f"{__version__}+{git('rev-parse', '--short=12', 'HEAD')}"
    assert checkout_version(tmp_path) == clean
    (tmp_path / "site-packages").mkdir()  # an installed copy inside the checkout is not the checkout's code
    assert checkout_version(tmp_path / "site-packages") == __version__
    (tmp_path / "site-packages").rmdir()
    (tmp_path / "model.py").write_text("WIDTH = 32\n")
    narrow = checkout_version(tmp_path)
    (tmp_path / "model.py").write_text("WIDTH = 16\n")
    narrower = checkout_version(tmp_path)
    assert narrow.startswith(f"{clean}.dirty.") and narrower.startswith(f"{clean}.dirty.") and narrow != narrower
    (tmp_path / "model.py").write_text("WIDTH = 32\n")
    assert checkout_version(tmp_path) == narrow  # the same change, the same version
    (tmp_path / "features.py").write_text("LAGS = 3\n")  # a new module counts before it is added
    with_module = checkout_version(tmp_path)
    assert with_module not in (clean, narrow, narrower)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.parquet").write_bytes(b"ignored")
    (tmp_path / "scratch.csv").write_text("a,b\n")
    assert checkout_version(tmp_path) == with_module  # ignored files and data are not code
    # A configured external diff tool that prints nothing does not hide a change.
    (tmp_path / "model.py").write_text("WIDTH = 8\n")
    monkeypatch.setenv("GIT_EXTERNAL_DIFF", "true")
    assert checkout_version(tmp_path).startswith(f"{clean}.dirty.")
    monkeypatch.delenv("GIT_EXTERNAL_DIFF")
    (tmp_path / "model.py").write_text("WIDTH = 64\n")
    for name in ("features.py", "scratch.csv"):
        (tmp_path / name).unlink()
    assert checkout_version(tmp_path) == clean


def test_a_settings_file_in_the_checkout_is_not_code(tmp_path, monkeypatch):
    from dxr import __version__
    from warehouse.runs import checkout_version

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "model.py").write_text("WIDTH = 64\n")
    git("add", ".")
    git("commit", "-qm", "first")
    clean = f"{__version__}+{git('rev-parse', '--short=12', 'HEAD')}"
    # `./dxr.toml` (or the file DXR_CONFIG names) holds settings: editing one must not make every cached
    # prediction of the same code miss, nor record the runs as made by uncommitted code.
    (tmp_path / "dxr.toml").write_text("[forecast]\nshard_workers = 1\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "prod.toml").write_text("[prior]\nalias = 'challenger'\n")
    monkeypatch.setenv("DXR_CONFIG", str(tmp_path / "conf" / "prod.toml"))
    assert checkout_version(tmp_path) == clean
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "direct_forecast.toml").write_text("version = 4\n")  # a new prompt file is code
    assert checkout_version(tmp_path).startswith(f"{clean}.dirty.")


def test_an_in_memory_connection_spills_to_a_directory_of_its_own_in_the_system_temp_dir(wh, tmp_path, monkeypatch):
    import tempfile

    from warehouse import duck

    system_tmp, cwd = tmp_path / "system-tmp", tmp_path / "cwd"
    system_tmp.mkdir()
    cwd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    monkeypatch.chdir(cwd)
    # DuckDB's own default for an in-memory database is `.tmp` in the current directory.
    first, second = duck.connect(), wh.connect()
    spills = [Path(con.execute("SELECT current_setting('temp_directory')").fetchone()[0]) for con in (first, second)]
    assert [p.parent for p in spills] == [system_tmp, system_tmp] and spills[0] != spills[1]
    assert list(system_tmp.iterdir()) == []  # made only when a query spills
    first.execute("SET memory_limit = '64MB'")
    first.execute("SET threads = 1")
    assert first.execute("SELECT count(*) FROM (SELECT random() AS r FROM range(10000000) ORDER BY r)").fetchone() == (
        10000000,)
    assert first.execute("SELECT count(*) FROM duckdb_temporary_files()").fetchone() == (0,)  # spilled, then freed
    assert list(system_tmp.iterdir()) == [spills[0]]
    first.close()
    assert list(system_tmp.iterdir()) == [] and list(cwd.iterdir()) == []
    # A database file spills next to itself, as DuckDB does.
    assert duck.connect(str(tmp_path / "x.duckdb")).execute("SELECT current_setting('temp_directory')").fetchone() == (
        f"{tmp_path / 'x.duckdb'}.tmp",)


@pytest.mark.parametrize("pattern", ["*", "?", "[ab]", "a*"])
def test_a_key_value_no_write_accepts_names_no_partition_rather_than_matching_others(wh, pattern):
    # `dxr evaluate --pair a,'*'` asked `has_rows(..., system='*')`, which globbed every system's files.
    wh.write("targets", targets("a", 3), cohort_id="a")
    wh.write("targets", targets("b", 2), cohort_id="b")
    assert not wh.has_rows("targets", cohort_id=pattern)
    assert wh.read("targets", cohort_id=pattern).height == 0
    assert wh.read("targets", cohort_id="a").height == 3


def test_a_directory_swap_trades_the_two_places_in_one_step_where_the_system_can(tmp_path, monkeypatch):
    import warehouse.meds as meds
    from conftest import skip_unless_directories_swap

    skip_unless_directories_swap(tmp_path)

    target, staging = tmp_path / "report", tmp_path / "staging"
    for directory, text in ((target, "old"), (staging, "new")):
        directory.mkdir()
        (directory / "report.md").write_text(text)
    # Not moved aside and then replaced, two renames between which a kill would leave no directory at `target`.
    monkeypatch.setattr(meds.os, "replace", lambda *paths: pytest.fail(f"renamed {paths} one after the other"))
    meds.replace_dir(staging, target)
    assert (target / "report.md").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_an_interrupt_between_the_renames_of_a_directory_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    import warehouse.meds as meds

    target, staging = tmp_path / "report", tmp_path / "staging"
    target.mkdir()
    (target / "report.md").write_text("old")
    staging.mkdir()
    (staging / "report.md").write_text("new")
    monkeypatch.setattr(meds, "exchange", lambda a, b: False)  # a file system that cannot swap two paths (NFS)
    rename = os.replace

    def interrupted(src, dst):  # Ctrl-C arriving once the old directory is moved aside
        if Path(src) == staging:
            raise KeyboardInterrupt
        rename(src, dst)

    monkeypatch.setattr(meds.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        meds.replace_dir(staging, target)
    assert (target / "report.md").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report", "staging"]


def test_sql_doctests():
    import doctest

    import warehouse.sql

    result = doctest.testmod(warehouse.sql)
    assert result.failed == 0 and result.attempted == 10, result


def test_recorded_times_are_utc_whatever_the_hosts_zone(wh, host_in_kolkata):
    from datetime import timezone

    from warehouse.runs import registered_run

    with registered_run(wh, "synth", {"name": "tiny"}) as run:
        pass
    row = wh.read("runs", run_id=run.run_id).row(0, named=True)
    # started_at was the host's local time (5.5 h ahead here), while the run id and the ledger's times are UTC:
    # a query comparing a run's times with its ledger's or with its id was off by the host's offset.
    utc = datetime.now(timezone.utc).replace(tzinfo=None)
    assert abs((utc - row["finished_at"]).total_seconds()) < 60
    assert run.run_id.split("-")[1] == f"{row['started_at']:%Y%m%dT%H%M%S}"


def test_sql_table_keeps_one_line_per_row_when_text_holds_line_breaks_or_tabs(wh):
    from warehouse.sql import stream_query

    # A ledger excerpt, a chunk or an LLM error holding a line break spilled over the next lines, out of its column.
    query = ("SELECT * FROM (VALUES ('first' || chr(10) || 'second', 1), ('a' || chr(9) || 'b' || chr(13), 22)) "
             "t(note, n)")
    assert "".join(stream_query(wh, query)) == (
        "note            n\n"
        "-------------  --\n"
        "first\\nsecond   1\n"
        "a\\tb\\r         22\n"
        "(2 rows)\n")
    # A plan is the one value of many lines that is shown as it is, as DuckDB draws it.
    plan = duckdb.sql("EXPLAIN SELECT 1 AS one").fetchall()[0][1]
    assert "".join(stream_query(wh, "EXPLAIN SELECT 1 AS one")) == plan.rstrip() + "\n" and plan.count("\n") > 3


def test_sql_table_spells_blobs_and_intervals_as_csv_and_json_lines_do_and_times_alike_in_every_format(wh):
    from warehouse.sql import stream_query

    query = ("SELECT 'ab'::BLOB AS b, TIMESTAMP '2026-12-05 09:25:19.5' - TIMESTAMP '2026-12-05 09:24:54' AS took, "
             "TIMESTAMP '2026-12-05 09:25:19.5' AS t, DATE '2026-12-05' AS d")
    # The table printed the blob as Python's b'ab' and the interval as Python's 0:00:25.500000.
    assert "".join(stream_query(wh, query)) == (
        "b     took  t                      d\n"
        "----  ----  ---------------------  ----------\n"
        "YWI=  25.5  2026-12-05 09:25:19.5  2026-12-05\n"
        "(1 row)\n")
    assert "".join(stream_query(wh, query, fmt="csv")) == (
        "b,took,t,d\nYWI=,25.5,2026-12-05 09:25:19.5,2026-12-05\n")
    assert json.loads("".join(stream_query(wh, query, fmt="json"))) == {
        "b": "YWI=", "took": 25.5, "t": "2026-12-05 09:25:19.5", "d": "2026-12-05"}
    # A time is spelled as SQL and DuckDB spell it (a space before the time), which a query takes back as a literal.
    assert duckdb.sql("SELECT TIMESTAMP '2026-12-05 09:25:19.5' = TIMESTAMP '2026-12-05T09:25:19.500000'").fetchall() \
        == [(True,)]


def test_delete_together_removes_a_partition_on_another_file_system_by_moving_it_aside(wh, monkeypatch):
    # A gold store mounted apart from the forecasting store: its partition cannot be renamed into the removal's
    # commit (EXDEV), so it is renamed beside itself, out of the view's pattern, and removed there.
    wh.write("targets", targets("c1", 2), cohort_id="c1")
    wh.write("targets", targets("c2", 2), cohort_id="c2")
    real_replace = os.replace

    def replace(source, target):
        if store.REMOVED in Path(target).parts and "gold" in Path(source).parts:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(source), str(target))
        return real_replace(source, target)

    monkeypatch.setattr(store.os, "replace", replace)
    wh.delete_together([("targets", {"cohort_id": "c1"})])
    monkeypatch.undo()
    assert wh.read("targets")["cohort_id"].unique().to_list() == ["c2"]
    assert sorted(p.name for p in wh.table_dir("targets").iterdir()) == ["cohort_id=c2"]
    assert not any((wh.forecast_dir / store.COMMIT_DIR).iterdir())


def test_being_removed_reads_the_rows_a_killed_removal_left_pending_wherever_they_are_and_finishes_nothing(wh,
                                                                                                         monkeypatch):
    # What a rerun of `dxr cohort delete` reads to know the cohort whose removal it finishes: one partition moved
    # into the commit, one moved aside (another file system) and killed before it went, one still in its place.
    for cohort, n in (("c1", 1), ("c2", 2), ("c3", 3), ("kept", 4)):
        wh.write("targets", targets(cohort, n), cohort_id=cohort)
    real_replace, real_rmtree = os.replace, store.shutil.rmtree

    def replace(source, target):
        if store.REMOVED in Path(target).parts and Path(source).name == "cohort_id=c2":
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(source), str(target))
        return real_replace(source, target)

    def rmtree(path, **options):
        if Path(path).name.startswith(".cohort_id=c2.") and Path(path).exists():
            raise KeyboardInterrupt("killed while removing what it moved aside")
        return real_rmtree(path, **options)

    monkeypatch.setattr(store.os, "replace", replace)
    monkeypatch.setattr(store.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        wh.delete_together([("targets", {"cohort_id": cohort}) for cohort in ("c1", "c2", "c3")])
    monkeypatch.undo()
    assert sorted(p.name for p in wh.table_dir("targets").iterdir()) == [
        ".cohort_id=c2." + next((wh.forecast_dir / store.COMMIT_DIR).iterdir()).name + ".removed", "cohort_id=c3",
        "cohort_id=kept"]
    assert wh.being_removed("targets").equals(pl.concat([targets("c1", 1), targets("c2", 2), targets("c3", 3)]))
    assert wh.being_removed("chunks").is_empty() and wh.being_removed("chunks").columns == list(
        store.TABLES["chunks"].columns)
    wh.read("cohorts")  # a read of the forecasting store, where the removal's commit is, finishes it
    assert wh.read("targets").equals(targets("kept", 4))
    assert wh.being_removed("targets").is_empty()


def test_sql_tells_null_from_an_empty_string_and_spells_times_and_intervals_without_trailing_zeros(wh, tmp_path):
    from warehouse.sql import stream_query

    query = ("SELECT * FROM (VALUES ('', 1, TIMESTAMP '2026-12-05 09:25:19.5', "
             "TIMESTAMPTZ '2026-12-05 09:25:19.25+00', TIME '09:25:19.125', INTERVAL '25.5 seconds', "
             "{'t': TIMESTAMP '2026-12-05 09:25:19.5'}), "
             "(NULL, NULL, NULL, NULL, NULL, NULL, NULL), "
             "('x', 2, TIMESTAMP '2026-12-05 09:25:19', TIMESTAMPTZ '2026-12-05 09:25:19+00', TIME '09:25:19', "
             "INTERVAL '1 day', {'t': TIMESTAMP '2026-12-05 09:25:19'})) v(s, n, t, tz, tm, i, nested)")
    # The table showed NULL and '' both as an empty cell, fractional seconds as .500000 and the interval with four
    # decimals (25.5000, 86400.0000); the CSV wrote NULL and '' both as an empty field, and 86400.0.
    assert "".join(stream_query(wh, query)) == (
        "s        n  t                      tz                            tm                i  nested\n"
        "----  ----  ---------------------  ----------------------------  ------------  -----  "
        "------------------------------\n"
        "         1  2026-12-05 09:25:19.5  2026-12-05 09:25:19.25+00:00  09:25:19.125   25.5  "
        "{\"t\": \"2026-12-05 09:25:19.5\"}\n"
        "NULL  NULL  NULL                   NULL                          NULL           NULL  NULL\n"
        "x        2  2026-12-05 09:25:19    2026-12-05 09:25:19+00:00     09:25:19      86400  "
        "{\"t\": \"2026-12-05 09:25:19\"}\n"
        "(3 rows)\n")
    csv_text = "".join(stream_query(wh, query, fmt="csv"))
    assert csv_text == (
        "s,n,t,tz,tm,i,nested\n"
        '"",1,2026-12-05 09:25:19.5,2026-12-05 09:25:19.25+00:00,09:25:19.125,25.5,'
        '"{""t"": ""2026-12-05 09:25:19.5""}"\n'
        ",,,,,,\n"
        'x,2,2026-12-05 09:25:19,2026-12-05 09:25:19+00:00,09:25:19,86400,"{""t"": ""2026-12-05 09:25:19""}"\n')
    # The CSV reads back as it was: NULL as NULL, '' as '' (a reader that tells a quoted empty field from an empty
    # one, as DuckDB's does without allow_quoted_nulls), the times as the same instants.
    (tmp_path / "out.csv").write_text(csv_text)
    read_back = duckdb.sql(f"SELECT s, n, t, tz, tm FROM read_csv('{tmp_path / 'out.csv'}', header = true, "
                           "allow_quoted_nulls = false, "
                           "columns = {'s': 'VARCHAR', 'n': 'INTEGER', 't': 'TIMESTAMP', 'tz': 'TIMESTAMPTZ', "
                           "'tm': 'TIME', 'i': 'DOUBLE', 'nested': 'VARCHAR'})").fetchall()
    assert read_back == duckdb.sql(f"SELECT s, n, t, tz, tm FROM ({query})").fetchall()
    # JSON already told them apart (null and ""); its times lose their trailing zeros too.
    assert [json.loads(line) for line in "".join(stream_query(wh, query, fmt="json")).splitlines()] == [
        {"s": "", "n": 1, "t": "2026-12-05 09:25:19.5", "tz": "2026-12-05 09:25:19.25+00:00", "tm": "09:25:19.125",
         "i": 25.5, "nested": {"t": "2026-12-05 09:25:19.5"}},
        {"s": None, "n": None, "t": None, "tz": None, "tm": None, "i": None, "nested": None},
        {"s": "x", "n": 2, "t": "2026-12-05 09:25:19", "tz": "2026-12-05 09:25:19+00:00", "tm": "09:25:19",
         "i": 86400.0, "nested": {"t": "2026-12-05 09:25:19"}}]


def test_delete_together_removes_a_partition_of_a_store_linked_to_another_directory(tmp_path):
    # A gold store kept elsewhere (another disk) and linked in as <root>/gold: its partitions are the root's.
    elsewhere = tmp_path / "gold-disk"
    elsewhere.mkdir()
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "gold").symlink_to(elsewhere)
    wh = store.Warehouse(tmp_path / "root")
    wh.write("targets", targets("c1", 2), cohort_id="c1")
    wh.write("targets", targets("c2", 2), cohort_id="c2")
    wh.delete_together([("targets", {"cohort_id": "c1"})])
    assert wh.read("targets")["cohort_id"].unique().to_list() == ["c2"]
    assert sorted(p.name for p in (elsewhere / "targets").iterdir()) == ["cohort_id=c2"]
    assert not any((wh.forecast_dir / store.COMMIT_DIR).iterdir())
    with pytest.raises(ValueError, match="removes only what is under the warehouse root"):
        wh.delete_together([], [wh.root / "reports" / ".." / ".." / "elsewhere"])


@pytest.mark.parametrize("together", [False, True], ids=["write", "write_together"])
def test_a_partition_written_while_a_removal_empties_its_parent_is_written(wh, monkeypatch, together):
    # A cohort's delete removes run r1's `runs` partitions kind by kind and then `runs/run_id=r1/`, left empty. A
    # writer of another kind of r1 makes that directory anew, and a second process finishing the same removal
    # commit can `rmdir` it again before the writer's `kind=` directory is in it: the write must still land.
    from tests.conftest import placeholder
    from warehouse.schemas import TABLES

    def row(kind: str) -> pa.Table:
        spec = TABLES["runs"]
        values = {name: placeholder(column) for name, column in spec.columns.items()} | {"run_id": "r1", "kind": kind}
        return pa.Table.from_pylist([values], schema=spec.schema)

    wh.write("runs", row("forecast"), run_id="r1", kind="forecast")
    wh.delete_together([("runs", {"run_id": "r1", "kind": "forecast"})])
    run_dir = wh.table_dir("runs") / "run_id=r1"
    assert not run_dir.exists()  # the removal took the directory it left empty
    real_mkdir, raced = os.mkdir, []

    def mkdir_then_emptied_again(path, mode=0o777):
        real_mkdir(path, mode)
        if Path(path) == run_dir and not raced:
            raced.append(path)
            store.remove_emptied(run_dir / "kind=forecast")  # the second process finishing the removal

    monkeypatch.setattr(os, "mkdir", mkdir_then_emptied_again)
    if together:
        wh.write_together([("runs", row("cohort_build"), {"run_id": "r1", "kind": "cohort_build"})])
    else:
        wh.write("runs", row("cohort_build"), run_id="r1", kind="cohort_build")
    monkeypatch.undo()
    assert raced
    assert wh.read("runs", run_id="r1")["kind"].to_list() == ["cohort_build"]
    assert not any((wh.forecast_dir / store.COMMIT_DIR).glob(f"*{store.COMMITTED}"))


STORED_TIME_AS_SEEN = """
import sys
from warehouse.store import Warehouse
con = Warehouse(sys.argv[1]).connect()
print(con.execute("SELECT (TIMESTAMP '2026-12-06 16:04:40')::TIMESTAMPTZ").fetchone()[0].isoformat())
"""


@pytest.mark.parametrize("zone", ["UTC", "Pacific/Kiritimati", "America/St_Johns"])
def test_a_stored_time_cast_to_timestamptz_is_the_utc_instant_it_was_stored_as_in_any_process_zone(tmp_path, zone):
    # Stored times are UTC without a zone; DuckDB's session took the process's zone and read them as local times.
    ran = subprocess.run([sys.executable, "-c", STORED_TIME_AS_SEEN, str(tmp_path)], env={**os.environ, "TZ": zone},
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "2026-12-06T16:04:40+00:00"


def vocabulary(cohort: str, n: int) -> pl.DataFrame:
    return pl.DataFrame({"cohort_id": [cohort] * n, "code": [f"DIAGNOSIS//ICD//10//I1{i}" for i in range(n)],
                         "icd_version": [10] * n, "title": [None] * n},
                        schema={"cohort_id": pl.String, "code": pl.String, "icd_version": pl.Int8, "title": pl.String})


def test_a_data_dir_whose_path_holds_glob_characters_reads_its_own_files_only(tmp_path):
    # DuckDB and polars glob the whole path: `[v2]` matched no file of this data dir, and the `*` matched the sibling.
    from warehouse.sql import run_query

    wh, sibling = store.Warehouse(tmp_path / "dxr [v2]*"), store.Warehouse(tmp_path / "dxr v-old")
    for warehouse, n in ((wh, 3), (sibling, 5)):
        warehouse.write("cohort_vocabulary", vocabulary("c", n), cohort_id="c")
        warehouse.write("targets", targets("c", n), cohort_id="c")
    assert wh.read("cohort_vocabulary").height == 3
    assert wh.connect().execute("SELECT count(*) FROM cohort_vocabulary").fetchall() == [(3,)]
    assert run_query(wh, "SELECT count(*) AS n FROM targets", fmt="csv", with_gold=True) == "n\n3\n"


def test_a_directory_named_as_the_glob_escaped_data_dir_is_refused_rather_than_readable(tmp_path):
    # The confined connection allows `dxr [[]v2[]]/forecast/` too, the name its views glob by; DuckDB reads an existing
    # file of that literal name as it is, so `dxr sql` read the files of a directory so named beside the data dir.
    from warehouse.sql import run_query

    wh = store.Warehouse(tmp_path / "dxr [v2]")
    wh.write("cohort_vocabulary", vocabulary("c", 3), cohort_id="c")
    assert wh.connect().execute("SELECT count(*) FROM cohort_vocabulary").fetchall() == [(3,)]
    beside = store.Warehouse(tmp_path / "dxr [[]v2[]]")
    beside.write("cohort_vocabulary", vocabulary("other", 5), cohort_id="other")
    with pytest.raises(ConfigError, match=re.escape(f"{beside.forecast_dir} exists: DuckDB takes it for the "
                                                    f"glob-escaped name of {wh.forecast_dir}")):
        run_query(wh, f"SELECT count(*) AS n FROM read_parquet('{beside.forecast_dir}/*/*/data.parquet')", fmt="csv")


def test_doctests_of_the_duck_module():
    import doctest

    from warehouse import duck

    result = doctest.testmod(duck)
    assert result.failed == 0 and result.attempted >= 3, result
