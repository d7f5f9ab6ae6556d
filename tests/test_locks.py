"""Processes sharing a warehouse: what one holds, another is refused with one line, and a killed
holder leaves no stale lock."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime

import pytest

from dxr.errors import InputError, NotFoundError
from flows.forecast import forecast_flow
from tasks.evaluate import evaluate_run
from tasks.forecast import check_rerun, forecast_config
from tests.conftest import NFS_FCNTL, fail_a_forecast, keep_lock_files, lock_files
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import ingest_meds, writing_dataset
from warehouse.locks import LOCK_DIR, held, lock_file, remove_unheld


@pytest.fixture
def tiny_cohort(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    return wh_vocab, build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]


def test_a_build_refuses_a_dataset_being_written_and_an_ingest_one_being_read(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    with writing_dataset(wh_vocab, "tiny"):  # as `dxr synth` or an ingest holds it
        with pytest.raises(InputError, match="dataset 'tiny' is being written by another dxr process .*retry"):
            build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)
    with pytest.raises(InputError, match="is being written, or read by a cohort build"):
        with held(wh_vocab, "dataset:tiny", shared=True, busy="a cohort build"):  # the build's hold …
            ingest_meds(wh_vocab, tiny_meds, "tiny")  # … refuses a new ingest of the same name
    assert build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["n_trajectories"] == 3


def test_a_cohort_in_use_is_not_rebuilt_and_a_cohort_being_rebuilt_is_not_forecast(tiny_cohort, prefect_harness):
    wh, cohort_id = tiny_cohort
    with held(wh, f"cohort:{cohort_id}", shared=True, busy="a forecast"):  # a forecast reading it
        with pytest.raises(InputError, match=rf"cohort default \({cohort_id}\) is in use by another dxr process"):
            build_cohort(wh, "tiny", "default", CohortOptions(), seed=7)
    with held(wh, f"cohort:{cohort_id}", shared=False, busy="a build"):  # a rebuild in progress
        with pytest.raises(InputError, match="is being rebuilt by another dxr process"):
            forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="r1")
    assert not wh.has_rows("rankings", run_id="r1")


def test_one_system_forecasts_a_run_at_a_time_and_evaluation_waits_for_forecasts(tiny_cohort, prefect_harness):
    wh, cohort_id = tiny_cohort
    with held(wh, "run-system:r1|repeat_history", shared=False, busy="a forecast"):
        with pytest.raises(InputError, match="run 'r1' is already being forecast by repeat_history"):
            forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="r1")
        # another system may forecast into the same run meanwhile
        forecast_flow(str(wh.root), "default", "global_frequency", split="all", run_id="r1")
    with held(wh, "run-system:r1|ehr_prior", shared=False, busy="a forecast"):  # the fusion would read it half-written
        with pytest.raises(InputError, match="run 'r1' is being forecast by ehr_prior, whose lists rrf_prior_direct "
                                             "fuses"):
            forecast_flow(str(wh.root), "default", "rrf_prior_direct", split="all", run_id="r1")
    with held(wh, "run:r1", shared=True, busy="a forecast"):
        with pytest.raises(InputError, match="run 'r1' is being forecast or evaluated by another dxr process"):
            evaluate_run(wh, "r1", ks=(20,), n_boot=10)
    with held(wh, f"cohort:{cohort_id}", shared=False, busy="a build"):  # targets and oracles being replaced
        with pytest.raises(InputError, match=f"cohort {cohort_id} of run 'r1' is being rebuilt"):
            evaluate_run(wh, "r1", ks=(20,), n_boot=10)
    assert not wh.has_rows("metrics", run_id="r1")
    assert evaluate_run(wh, "r1", ks=(20,), n_boot=10).height
    with held(wh, "run-system:r1|ehr_prior", shared=False, busy="a forecast"):  # no clash with run 'r1:ehr_prior'
        forecast_flow(str(wh.root), "default", "global_frequency", split="all", run_id="r1:ehr_prior")


def test_an_evaluation_is_recorded_finished_while_it_still_holds_the_run(tiny_cohort, prefect_harness, monkeypatch):
    # Recorded after the lock was released, a `finished` could overwrite the `stale` of a forecast rerun that
    # started in between and removed this evaluation's metrics.
    import tasks.evaluate

    wh, _ = tiny_cohort
    forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="r1")
    real_record, recorded = tasks.evaluate.record_run, []

    def record_while_held(*args, **kwargs):
        with pytest.raises(InputError, match="a forecast is refused"):
            with held(wh, "run:r1", shared=True, busy="a forecast is refused"):
                pass
        recorded.append((args[3], args[5]))
        return real_record(*args, **kwargs)

    monkeypatch.setattr(tasks.evaluate, "record_run", record_while_held)
    evaluate_run(wh, "r1", ks=(20,), n_boot=0)
    # `stale` before its tables are written, `finished` after: both while the run is held.
    assert recorded == [("evaluate", "stale"), ("evaluate", "finished")]


def test_a_rerun_killed_while_clearing_leaves_the_evaluation_stale_not_finished(tiny_cohort, prefect_harness,
                                                                                 monkeypatch):
    wh, _ = tiny_cohort
    forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="r1")
    evaluate_run(wh, "r1", ks=(20,), n_boot=0)
    real_delete = type(wh).delete

    def killed_at_the_metrics(self, table, **keys):
        if table == "metrics":
            raise KeyboardInterrupt  # the rankings are gone, the metrics not yet
        return real_delete(self, table, **keys)

    monkeypatch.setattr(type(wh), "delete", killed_at_the_metrics)
    with pytest.raises(KeyboardInterrupt):
        forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="r1")
    assert wh.read("runs", run_id="r1", kind="evaluate")["status"].to_list() == ["stale"]


def test_a_run_holds_one_cohort(tiny_cohort, prefect_harness):
    wh, cohort_id = tiny_cohort
    forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="r1")
    other = build_cohort(wh, "tiny", "every", CohortOptions(target="every"), seed=7)["cohort_id"]
    with pytest.raises(InputError, match=rf"run r1 already holds forecasts of cohort {cohort_id} "
                                         rf"\(forecast:repeat_history\), this one is of cohort {other}"):
        check_rerun(wh, "r1", forecast_config(other, "global_frequency", "all", 20, None))


def test_a_run_whose_only_forecasts_failed_stays_on_their_cohort_and_the_refusal_names_both_fixes(
        tiny_cohort, prefect_harness, monkeypatch):
    wh, cohort_id = tiny_cohort
    other = build_cohort(wh, "tiny", "every", CohortOptions(target="every"), seed=7)["cohort_id"]
    fail_a_forecast(monkeypatch, wh, "default", "repeat_history", "r1")
    assert wh.read("runs", run_id="r1")["status"].to_list() == ["failed"]
    # The refusal said the run "already holds forecasts" and offered to add to it, though none had finished.
    with pytest.raises(InputError, match=rf"run r1 holds no finished forecast, only ones of cohort {cohort_id} "
                                         rf"\(repeat_history failed\), and this one is of cohort {other}: .*; pass a "
                                         rf"new --run-id, redo them on their cohort with --cohort {cohort_id} "
                                         r"--run-id r1, or delete the run first \(`dxr run delete r1`\)$"):
        forecast_flow(str(wh.root), "every", "global_frequency", split="all", run_id="r1")
    assert set(wh.read("runs", run_id="r1")["cohort_id"]) == {cohort_id}
    # Both fixes work: the failed forecast redone on its cohort, the other cohort under a new run id.
    forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="r1")
    forecast_flow(str(wh.root), "every", "global_frequency", split="all", run_id="r2")
    assert wh.read("runs", run_id="r1")["status"].to_list() == ["finished"]
    assert set(wh.read("rankings", run_id="r2")["cohort_id"]) == {other}


def test_two_systems_started_together_into_a_new_run_on_two_cohorts_are_not_both_recorded(tiny_cohort, monkeypatch):
    import threading

    import flows.forecast
    from tasks.forecast import forecast_shard_task

    wh, cohort_id = tiny_cohort
    other = build_cohort(wh, "tiny", "every", CohortOptions(target="every"), seed=7)["cohort_id"]
    real_check = flows.forecast.check_rerun

    def slow_check(*args):  # the window between a run's check and its `running` row, widened
        real_check(*args)
        time.sleep(1.0)

    monkeypatch.setattr(flows.forecast, "check_rerun", slow_check)
    monkeypatch.setattr(flows.forecast, "forecast_shard_task", forecast_shard_task.fn)  # no task engine in threads
    errors = {}

    def forecast(cohort: str, system: str) -> None:
        try:
            forecast_flow.fn(str(wh.root), cohort, system, split="all", run_id="r2")
        except InputError as exc:
            errors[system] = str(exc)

    threads = [threading.Thread(target=forecast, args=args)
               for args in (("default", "repeat_history"), ("every", "global_frequency"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 1, errors  # the later one was refused, after waiting for the earlier's registration
    assert "run r2 already holds forecasts of cohort" in next(iter(errors.values()))
    assert wh.read("rankings", run_id="r2")["cohort_id"].unique().len() == 1
    assert set(wh.read("runs", run_id="r2")["cohort_id"]) in ({cohort_id}, {other})


def test_a_forecast_that_did_not_finish_is_not_evaluated(tiny_cohort, prefect_harness):
    import polars as pl

    from warehouse.runs import record_run

    wh, cohort_id = tiny_cohort
    for system in ("repeat_history", "global_frequency"):
        forecast_flow(str(wh.root), "default", system, split="all", run_id="r3")
    row = wh.read("runs", run_id="r3", kind="forecast:repeat_history").row(0, named=True)
    for status, how in (("running", "was killed"), ("killed", "was killed"), ("failed", "failed")):
        # `running` under the evaluation's exclusive lock: a process that ended without recording how.
        record_run(wh, "r3", cohort_id, row["kind"], json.loads(row["config_json"]), status, row["started_at"])
        with pytest.raises(InputError, match=f"run 'r3': its repeat_history forecast {how}, so its lists may stop "
                                             f"part way: rerun dxr forecast --cohort {cohort_id} --system "
                                             "repeat_history --run-id r3 with the same options"):
            evaluate_run(wh, "r3", n_boot=10)
    metrics = evaluate_run(wh, "r3", systems=["global_frequency"], n_boot=10)  # the finished one still can be
    assert set(metrics["system"]) == {"global_frequency"} and metrics.filter(pl.col("n") > 0).height


def test_a_holder_killed_by_sigkill_leaves_no_stale_lock(wh):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from warehouse.store import Warehouse; from warehouse.locks import held\n"
        f"with held(Warehouse({str(wh.root)!r}), 'cohort:c1', shared=False, busy='x'):\n"
        "    print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(InputError, match="busy elsewhere"):
        with held(wh, "cohort:c1", shared=True, busy="busy elsewhere"):
            pass
    holder.kill()
    holder.wait(timeout=30)
    deadline = time.monotonic() + 10
    while True:  # the kernel drops the lock with the process
        try:
            with held(wh, "cohort:c1", shared=False, busy="still held"):
                break
        except InputError:
            assert time.monotonic() < deadline, "the lock outlived its holder"
            time.sleep(0.1)


def test_a_lock_file_lives_only_while_the_lock_is_held(wh):
    locks = wh.root / LOCK_DIR
    with held(wh, "run:r1", shared=False, busy="x"):
        assert len(list(locks.iterdir())) == 1
    assert list(locks.iterdir()) == []
    other = held(wh, "run:r2", shared=True, busy="x")
    with held(wh, "run:r2", shared=True, busy="x"):
        other.__enter__()  # a second shared holder
    # One shared holder released: the file stays, and the lock with the other holder …
    assert len(list(locks.iterdir())) == 1
    with pytest.raises(InputError, match="still held"):
        with held(wh, "run:r2", shared=False, busy="still held"):
            pass
    other.__exit__(None, None, None)  # … which unlinks it when it releases
    assert list(locks.iterdir()) == []


@pytest.mark.parametrize("nfs", [False, True], ids=["local", "nfs"])
def test_removing_unheld_lock_files_removes_those_killed_holders_left_and_keeps_a_held_one(wh, monkeypatch, nfs):
    # On NFS the exclusive try needs the file open for writing: opened read-only, it failed with EBADF.
    import warehouse.locks as locks

    keep_lock_files(monkeypatch)
    for resource in ("run:r1", "run:r2"):
        with held(wh, resource, shared=False, busy="x"):  # its holder killed: the file stays
            pass
    monkeypatch.undo()
    if nfs:
        monkeypatch.setattr(locks, "fcntl", NFS_FCNTL)
    with held(wh, "run:r2", shared=True, busy="x"):
        remove_unheld(wh, ["run:r1", "run:r2", "run:r3"])
        assert lock_files(wh) == [lock_file(wh, "run:r2").name]
        with pytest.raises(InputError, match="still held"):  # and still the lock the holder holds
            with held(wh, "run:r2", shared=False, busy="still held"):
                pass
    assert lock_files(wh) == []  # its holder unlinked it


def test_a_lock_taken_on_a_file_that_was_unlinked_meanwhile_is_taken_again_on_the_new_file(wh, monkeypatch):
    import warehouse.locks as locks

    opened = []  # (descriptor, inode) of each file opened
    open_lock = locks.open_lock

    def open_then_lose_the_race(*args):
        fd = open_lock(*args)
        opened.append((fd, os.fstat(fd).st_ino))
        if len(opened) == 1:  # the previous holder releases and unlinks the file between our open and our flock
            opened.append(os.open(lock_file(wh, "run:r1"), os.O_RDONLY))  # so that the new file is another inode
            os.unlink(lock_file(wh, "run:r1"))
        return fd

    monkeypatch.setattr(locks, "open_lock", open_then_lose_the_race)
    with held(wh, "run:r1", shared=False, busy="x"):
        (_, orphan), keeper, (fd, inode) = opened
        assert orphan != inode and os.fstat(fd).st_ino == inode == lock_file(wh, "run:r1").stat().st_ino
        orphaned = f"{lock_file(wh, 'run:r1')} (deleted)"
        # The orphan was closed: only the test's own descriptor still has it open.
        assert [name for name in os.listdir("/proc/self/fd") if _target(name) == orphaned] == [str(keeper)]
        os.close(keeper)
        monkeypatch.undo()
        # Held on the file the path names: another holder is refused (on the orphan it would not be).
        with pytest.raises(InputError, match="held here"):
            with held(wh, "run:r1", shared=True, busy="held here"):
                pass


def _target(fd_name: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd_name}")
    except OSError:  # the descriptor that listed the directory, closed since
        return ""


def test_a_prior_is_not_trained_on_a_cohort_being_rebuilt(tiny_cohort):
    from models.prior.config import PriorConfig
    from tasks.prior import train_prior

    wh, cohort_id = tiny_cohort
    with held(wh, f"cohort:{cohort_id}", shared=False, busy="a build"):
        with pytest.raises(InputError, match="is being rebuilt by another dxr process"):
            train_prior(str(wh.root), "default", "ehr_prior", PriorConfig(epochs=1))
    assert sorted(wh.read("runs")["kind"].to_list()) == ["cohort", "ingest:meds"]  # no training run


def test_a_forecast_of_a_cohort_being_built_says_so(wh_vocab, tiny_meds):
    from warehouse.cohorts import get_cohort
    from warehouse.runs import registered_run

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    with registered_run(wh_vocab, "cohort", {"dataset": "tiny", "name": "nightly"}, "coh-1"):  # `dxr cohort build`
        with pytest.raises(NotFoundError, match=r"cohort 'nightly' is being built \(run coh-1, started .*\): retry"):
            get_cohort(wh_vocab, "nightly")


def _registered_run_in_another_process(wh, run_id: str, kind: str = "cohort", config: dict | None = None,
                                       cohort_id: str | None = None) -> subprocess.Popen:
    """A `dxr`-like process inside a registered run (a cohort build unless told), waiting to be killed."""
    config = {"name": "nightly"} if config is None else config
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from warehouse.store import Warehouse; from warehouse.runs import registered_run\n"
        f"with registered_run(Warehouse({str(wh.root)!r}), {kind!r}, {config!r}, {run_id!r}, {cohort_id!r}):\n"
        "    print('running', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "running"
    return holder


def test_a_run_killed_by_sigkill_is_marked_killed_by_the_next_run_and_a_live_one_is_left(wh):
    import os
    import socket

    from warehouse.runs import mark_killed, registered_run

    live, doomed = (_registered_run_in_another_process(wh, run_id) for run_id in ("live-1", "doomed-1"))
    try:
        doomed.kill()
        doomed.wait(timeout=30)
        with registered_run(wh, "synth", {}, "next-1"):
            pass
        runs = {row["run_id"]: row for row in wh.read("runs").iter_rows(named=True)}
        assert runs["doomed-1"]["status"] == "killed"
        assert runs["doomed-1"]["pid"] == doomed.pid and runs["doomed-1"]["host"] == socket.gethostname()
        assert runs["doomed-1"]["finished_at"] is None
        assert runs["live-1"]["status"] == "running" and runs["live-1"]["pid"] == live.pid
        assert runs["next-1"]["status"] == "finished" and runs["next-1"]["pid"] == os.getpid()
        assert mark_killed(wh) == []  # nothing new: the live run still holds its record lock
    finally:
        live.kill()
        live.wait(timeout=30)
    assert mark_killed(wh) == [("live-1", "cohort")]


def test_looking_for_killed_runs_in_a_data_dir_that_does_not_exist_creates_nothing(tmp_path):
    from warehouse.runs import mark_killed, runs_in_progress
    from warehouse.store import Warehouse

    wh = Warehouse(tmp_path / "typo")
    assert mark_killed(wh) == [] and runs_in_progress(wh).is_empty()
    assert not (tmp_path / "typo").exists()


def test_only_runs_in_progress_keep_a_marker_and_finding_killed_runs_does_not_read_the_registry(wh, monkeypatch):
    from warehouse.runs import RUNNING_DIR, mark_killed, registered_run
    from warehouse.store import Warehouse

    with registered_run(wh, "synth", {}, "ok-1"):
        assert len(list((wh.root / RUNNING_DIR).glob("*.json"))) == 1
    with pytest.raises(RuntimeError), registered_run(wh, "synth", {}, "bad-1"):
        raise RuntimeError("the body failed")
    assert list((wh.root / RUNNING_DIR).glob("*.json")) == []
    doomed = _registered_run_in_another_process(wh, "doomed-1")
    doomed.kill()
    doomed.wait(timeout=30)

    def no_scan(self):
        raise AssertionError("mark_killed scanned the whole run registry")

    monkeypatch.setattr(Warehouse, "connect", no_scan)
    assert mark_killed(wh) == [("doomed-1", "cohort")]
    assert list((wh.root / RUNNING_DIR).glob("*.json")) == []
    assert wh.read("runs", run_id="doomed-1")["status"].to_list() == ["killed"]


def test_the_marker_scratch_a_killed_run_left_goes_when_the_run_is_redone(wh):
    from tests.conftest import abandoned_scratch
    from warehouse.runs import INDEXED_FLAG, RUNNING_DIR, _marker, registered_run

    # A run killed between renaming its marker into place and removing the scratch's lock file (seen by killing
    # `dxr prior train` there): nothing removed that file, so `.running` kept one per such kill for good.
    killed = abandoned_scratch(_marker(wh, "again-1", "synth"))
    assert sorted(path.name for path in (wh.root / RUNNING_DIR).iterdir()) == [killed.name[:-len("tmp")] + "lock"]
    with registered_run(wh, "synth", {}, "again-1"):
        pass
    assert [path.name for path in (wh.root / RUNNING_DIR).iterdir()] == [INDEXED_FLAG]


def test_a_run_id_that_cannot_be_a_partition_is_refused_before_its_marker_is_written(wh):
    from warehouse.runs import RUNNING_DIR, registered_run

    # `dxr prior train --run-id 'a b'`, or a run_id typed into a deployment's run form: the marker written
    # before the registry row refused the id stayed behind, for every later run to look at again.
    with pytest.raises(InputError, match=r"^run id 'a b' has unsafe characters: use letters, digits and _\.:-$"):
        with registered_run(wh, "train:ehr_prior", {}, "a b"):
            raise AssertionError("the body ran under an unsafe run id")
    assert list((wh.root / RUNNING_DIR).glob("*.json")) == []
    assert not (wh.root / "forecast" / "runs").exists()


def test_a_run_id_is_checked_and_its_first_row_written_under_its_registration_lock(wh):
    from concurrent.futures import ThreadPoolExecutor

    from warehouse.runs import record_run, registered_run, registration_lock
    from warehouse.schemas import utc_now

    # A forecast and a build started at the same instant on one new run id both passed `check_run_kind`, neither
    # having written its `runs` row yet, and left a run id holding results and a record, which `dxr run delete`
    # refuses. Here the forecast holds the lock (as it does from its check to its `running` row); the build waits.
    def build() -> None:
        with registered_run(wh, "cohort", {}, "r1"):
            raise AssertionError("the build ran under a run id that a forecast registered")

    with ThreadPoolExecutor(1) as pool:
        with held(wh, registration_lock("r1"), shared=False, busy="a forecast registering r1"):
            building = pool.submit(build)
            time.sleep(0.5)
            assert not building.done() and wh.read("runs").is_empty()
            record_run(wh, "r1", "c1", "forecast:repeat_history", {}, "running", utc_now())
        with pytest.raises(InputError, match=r"^run id 'r1' already holds results \(forecast:repeat_history\), and a "
                                             r"cohort run is a record"):
            building.result(timeout=30)
    assert wh.read("runs").select("run_id", "kind").rows() == [("r1", "forecast:repeat_history")]


def test_running_rows_written_before_the_markers_are_still_found_once(wh):
    from datetime import datetime

    from warehouse.runs import RUNNING_DIR, mark_killed, record_run

    # A registry row left `running` by a version without markers, whose process is gone.
    record_run(wh, "old-1", None, "synth", {}, "running", datetime.now())
    assert not (wh.root / RUNNING_DIR).exists()
    assert mark_killed(wh) == [("old-1", "synth")]
    assert mark_killed(wh) == []
    assert wh.read("runs", run_id="old-1")["status"].to_list() == ["killed"]


def test_a_killed_build_is_not_reported_as_being_built(wh_vocab):
    from warehouse.cohorts import get_cohort

    build = _registered_run_in_another_process(wh_vocab, "coh-1")
    with pytest.raises(NotFoundError, match="'nightly' is being built"):
        get_cohort(wh_vocab, "nightly")
    build.kill()
    build.wait(timeout=30)
    with pytest.raises(NotFoundError, match="cohort 'nightly' not found in the warehouse"):
        get_cohort(wh_vocab, "nightly")
    assert wh_vocab.read("runs", run_id="coh-1")["status"].to_list() == ["killed"]


def test_runs_rows_written_before_host_and_pid_read_as_null(wh):
    import polars as pl

    from warehouse.runs import record_run

    old = pl.DataFrame({"run_id": ["old-1"], "cohort_id": [None], "kind": ["synth"], "config_json": ["{}"],
                        "code_version": ["0.1.0"], "started_at": [datetime(2026, 11, 1)],
                        "finished_at": [datetime(2026, 11, 1, 1)], "status": ["finished"]})
    path = wh.partition_path("runs", run_id="old-1", kind="synth")
    path.parent.mkdir(parents=True)
    old.write_parquet(path)
    assert wh.read("runs")[["host", "pid"]].row(0) == (None, None)
    record_run(wh, "new-1", None, "synth", {}, "finished", datetime(2026, 12, 1))
    assert wh.connect().sql("SELECT run_id, pid IS NULL FROM runs ORDER BY run_id").fetchall() == [
        ("new-1", False), ("old-1", True)]


def test_a_forecast_refuses_a_cohort_unregistered_while_it_waited_for_the_lock(tiny_cohort, monkeypatch):
    import warehouse.cohorts as cohorts

    wh, cohort_id = tiny_cohort
    real_held = cohorts.held

    @contextmanager
    def held_after_a_failed_build(*args, **kwargs):
        wh.delete("cohorts", cohort_id=cohort_id)  # a rebuild unregistered it, then was killed
        with real_held(*args, **kwargs):
            yield

    monkeypatch.setattr(cohorts, "held", held_after_a_failed_build)
    # The message a reader gets before the lock too (`unbuilt_cohort`), not an older one without the command.
    refusal = (f"cohort default ({cohort_id}) is not built: a build of it did not finish, and a build unregisters its "
               "cohort until it is complete; build it again with `dxr cohort build --dataset tiny --name default "
               "--target final --harmonize native --min-history 1`")
    with pytest.raises(NotFoundError, match=f"^{re.escape(refusal)}$"):
        with cohorts.reading_cohort(wh, "default"):
            pass


def test_a_report_waits_for_the_evaluation_of_its_run(tiny_cohort, prefect_harness):
    from tasks.report import render_report

    wh, _ = tiny_cohort
    forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="r1")
    evaluate_run(wh, "r1", ks=(20,), n_boot=10)
    with held(wh, "run:r1", shared=False, busy="an evaluation"):
        with pytest.raises(InputError, match="run 'r1' is being evaluated by another dxr process"):
            render_report(wh, "r1", wh.root / "report")
    assert not (wh.root / "report").exists()


def test_a_run_whose_failure_cannot_be_recorded_raises_its_own_error_and_is_recorded_killed_next(wh, monkeypatch):
    # On a full disk the body fails and then so may its `failed` row: the row's OSError replaced the body's error (a
    # training that filled the disk under MLflow was reported as an unwritable `runs` file).
    import errno

    import warehouse.runs as runs

    def full_at_failed(wh, run_id, cohort_id, kind, config, status, *times):
        if status == "failed":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "runs/data.parquet")
        recorded(wh, run_id, cohort_id, kind, config, status, *times)

    recorded = runs.record_run
    monkeypatch.setattr(runs, "record_run", full_at_failed)
    with pytest.raises(InputError, match="the body's error"), runs.registered_run(wh, "synth", {}, "full-2"):
        raise InputError("the body's error")
    assert wh.read("runs", run_id="full-2")["status"].to_list() == ["running"]
    assert runs.mark_killed(wh) == [("full-2", "synth")]  # its marker stayed
    assert wh.read("runs", run_id="full-2")["status"].to_list() == ["killed"]


def test_a_run_that_cannot_write_its_marker_names_it_and_leaves_nothing_behind(wh):
    # A full disk fails the first write of every command, its marker's; Python's own file write names no file, so
    # the CLI's line was "[Errno 28] No space left on device" for synth, forecast, a prior's training alike.
    import errno

    from dxr.cli import one_line
    from tests.conftest import file_size_limit
    from warehouse.runs import RUNNING_DIR, _marker, registered_run

    with file_size_limit(8), pytest.raises(OSError) as raised, registered_run(wh, "synth", {}, "full-1"):
        raise AssertionError("the body ran without a marker")
    marker = _marker(wh, "full-1", "synth")
    assert (raised.value.errno, raised.value.filename) == (errno.EFBIG, str(marker))
    assert one_line(raised.value) == (f"{marker}: File too large: raise the file-size limit (ulimit -f) or "
                                     "choose another location (--data-dir, DXR_DATA_DIR, TMPDIR)")
    assert list((wh.root / RUNNING_DIR).iterdir()) == []
    assert not wh.has_rows("runs")


def _forecast_killed_by_sigkill(wh, run_id: str) -> subprocess.Popen:
    """A `dxr forecast`-like process inside its registered run, SIGKILLed as the out-of-memory killer ends one."""
    import signal

    doomed = _registered_run_in_another_process(wh, run_id, "forecast:repeat_history", {}, "c0123")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(timeout=30)
    return doomed


def _killed_note(wh, run_id: str, doomed: subprocess.Popen) -> str:
    import socket

    started = wh.read("runs", run_id=run_id)["started_at"][0]
    return (f"note: run {run_id} (forecast:repeat_history, cohort c0123; pid {doomed.pid} on {socket.gethostname()}, "
            f"started {started:%Y-%m-%d %H:%M:%S} UTC) ended without recording how: it was killed (SIGKILL, most "
            "often by the out-of-memory killer when the machine or its container ran short of memory; see "
            "docs/benchmarks.md#memory) or failed unable to record it (a full disk; its own output said why), and is "
            "now `killed` in `runs`; to finish it, rerun the command that started "
            f"it, or Retry its flow run (under its run id, `--run-id {run_id}`, it resumes where it stopped)")


def test_the_command_after_a_sigkill_says_once_which_run_was_killed_and_how_to_resume_it(wh):
    # The killed process says nothing (exit 137, a shell's `Killed`): the next command to register a run says it.
    from tests.conftest import cli

    doomed = _forecast_killed_by_sigkill(wh, "doomed-1")
    code, _, err = cli(wh.root, "synth", "--patients", "5", "--run-id", "next-1")
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("note:")] == [_killed_note(wh, "doomed-1", doomed)]
    assert wh.read("runs", run_id="doomed-1")["status"].to_list() == ["killed"]
    code, out, err = cli(wh.root, "run", "list")  # marks too, but finds nothing new to say
    assert (code, err) == (0, "")
    assert re.search(r"doomed-1 +forecast:repeat_history +killed", out)


def test_run_list_says_which_run_was_killed_and_lists_it_killed(wh):
    from tests.conftest import cli

    with_registry = cli(wh.root, "synth", "--patients", "5")
    assert with_registry[0] == 0, with_registry[2]
    doomed = _forecast_killed_by_sigkill(wh, "doomed-2")
    code, out, err = cli(wh.root, "run", "list", "--kind", "forecast")
    assert (code, err.splitlines()) == (0, [_killed_note(wh, "doomed-2", doomed)])
    assert re.search(r"doomed-2 +forecast:repeat_history +killed", out)  # stdout: the table alone
    assert cli(wh.root, "run", "list", "--kind", "forecast")[1:] == (out, "")


def test_a_flow_run_after_a_sigkill_says_in_its_log_which_run_was_killed(tiny_cohort, capsys):
    # A served flow run (a backfill, a patient's rerun, a retraining) has no terminal: its log is where it is read.
    import logging

    from tests.conftest import LoggedMessages

    wh, _ = tiny_cohort
    doomed = _forecast_killed_by_sigkill(wh, "doomed-3")
    warnings = LoggedMessages(logging.WARNING)
    logger = logging.getLogger("prefect.flow_runs")
    logger.addHandler(warnings)
    try:
        forecast_flow(str(wh.root), "default", "repeat_history", split="all", run_id="next-3")
    finally:
        logger.removeHandler(warnings)
    assert warnings.lines == [_killed_note(wh, "doomed-3", doomed).removeprefix("note: ")]
    assert "note:" not in capsys.readouterr().err  # said once, in the run's log


def test_a_killed_run_recorded_before_host_and_pid_were_is_told_without_them(wh, capsys):
    from datetime import datetime

    import polars as pl

    from warehouse.runs import mark_killed, record_run

    record_run(wh, "old-2", None, "synth", {}, "running", datetime(2026, 12, 1, 3, 4, 5))
    partition = wh.partition_path("runs", run_id="old-2", kind="synth")
    pl.read_parquet(partition).drop("host", "pid").write_parquet(partition)  # as a dxr before 5a85cca wrote it
    assert mark_killed(wh) == [("old-2", "synth")]
    assert capsys.readouterr().err == (
        "note: run old-2 (synth; started 2026-12-01 03:04:05 UTC) ended without recording how: it was killed "
        "(SIGKILL, most often by the out-of-memory killer when the machine or its container ran short of memory; see "
        "docs/benchmarks.md#memory) or failed unable to record it (a full disk; its own output said why), and is now "
        "`killed` in `runs`; to finish it, rerun the command that started it, or Retry its flow run\n")


@pytest.mark.parametrize("run_id", ["demo-20261207T051229-a1b2c3", "demo-20261207T051229-a1b2c3-llm"])
def test_a_killed_forecast_of_the_demo_is_resumed_by_the_demo_under_its_run_id(run_id):
    # `dxr demo --run-id X` forecasts under X and X-llm: `--run-id X-llm` would have made X-llm-llm.
    from warehouse.runs import killed_note

    row = {"run_id": run_id, "kind": "forecast:direct", "cohort_id": "c1", "pid": 7, "host": "h",
           "started_at": datetime(2026, 12, 7, 5, 12, 29)}
    assert killed_note(row).endswith("; to finish it, rerun the command that started it, or Retry its flow run "
                                     "(`dxr demo --run-id demo-20261207T051229-a1b2c3` resumes its forecasts)")
