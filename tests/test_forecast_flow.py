"""The forecast flow runs a cohort's shards `forecast.shard_workers` at a time, with the same lists as one by one."""

from __future__ import annotations

import logging
import threading
import time

import polars as pl
import pytest

import tasks.forecast
from dxr.errors import InputError
from tasks.forecast import run_shards, shard_workers
from tests.conftest import LoggedMessages
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import ingest_meds


class ShardLog:
    """A stand-in for the shard task: records how many shards ran at once, the limits they got and which ended."""

    def __init__(self, sizes: dict[int, int], fail: int | None = None):
        self.sizes, self.fail = sizes, fail
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.started: list[tuple[int, int | None]] = []
        self.ended: list[int] = []
        self.failing = threading.Event()

    def __call__(self, shard: int, remaining: int | None) -> int:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.started.append((shard, remaining))
        try:
            if shard == self.fail:
                self.failing.set()
                raise RuntimeError(f"shard {shard} failed")
            if self.fail is not None:
                self.failing.wait(20)  # still under way when the failing shard fails
            time.sleep(0.2)  # long enough for the other workers to start meanwhile
            return self.sizes[shard] if remaining is None else min(self.sizes[shard], remaining)
        finally:
            with self.lock:
                self.running -= 1
                self.ended.append(shard)


def test_shards_run_at_most_workers_at_once_and_a_limit_runs_them_one_by_one():
    sizes = {0: 3, 1: 3, 2: 3, 3: 2, 4: 1}
    for workers in (1, 2, 3):
        log = ShardLog(sizes)
        assert run_shards(log, list(sizes), workers) == 12
        assert log.most == workers and sorted(log.started) == [(s, None) for s in sizes]

    log = ShardLog(sizes)
    assert run_shards(log, list(sizes), 1, limit=7) == 7
    assert log.started == [(0, 7), (1, 4), (2, 1)]  # each shard gets what is left; none after the limit
    with pytest.raises(ValueError, match="one shard at a time"):
        run_shards(log, [0], 2, limit=7)

    assert shard_workers("ehr_prior", None, 3) == 3
    assert shard_workers("ehr_prior", 10, 3) == 1  # a limit counts down shard by shard
    assert shard_workers("direct", None, 3) == 1  # the LLM client bounds its own concurrency


def test_after_a_failing_shard_none_starts_and_the_error_waits_for_the_shards_under_way():
    log = ShardLog({0: 1, 1: 1, 2: 1, 3: 1}, fail=1)
    with pytest.raises(RuntimeError, match="shard 1 failed"):
        run_shards(log, [0, 1, 2, 3], 2)
    assert sorted(log.ended) == [0, 1] and log.running == 0  # shard 0 ended before the error was raised


def test_every_failed_shard_that_says_something_else_is_logged_and_the_first_is_raised(caplog):
    # Two shards under way that failed with different errors used to leave only the raised one's message: the
    # other one's records are those dxr drops for a user's error, so nobody saw that it was a second problem.
    errors = {0: InputError("shard 0: code 'X' is not in Omega"), 1: OSError("disk full"), 2: OSError("disk full"),
              3: InputError("shard 0: code 'X' is not in Omega")}
    barrier = threading.Barrier(4)

    def every_shard_fails(shard: int, remaining: int | None) -> int:
        barrier.wait(20)  # all four are under way before any fails
        time.sleep(0.1 * shard)  # shard 0 fails first
        raise errors[shard]

    with caplog.at_level("ERROR", logger="tasks.forecast"), pytest.raises(InputError, match="shard 0: code"):
        run_shards(every_shard_fails, [0, 1, 2, 3], 4)
    assert [record.getMessage() for record in caplog.records] == ["shard 1 failed too: OSError: disk full"]


@pytest.fixture
def sharded(wh_vocab, tiny_meds):
    """The tiny dataset's every-encounter cohort in five shards of at most two trajectories."""
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cid = build_cohort(wh_vocab, "tiny", "every0", CohortOptions(target="every", min_history=0), seed=7,
                       shard_size=2)["cohort_id"]
    assert wh_vocab.read("trajectories", cohort_id=cid)["shard"].n_unique() == 5
    return wh_vocab, cid


def test_the_flow_runs_shards_concurrently_with_the_same_lists(sharded, monkeypatch):
    from flows.forecast import forecast_flow

    wh, cid = sharded

    def lists(run_id: str) -> pl.DataFrame:
        return wh.read("rankings", run_id=run_id).drop("run_id").sort("trajectory_id", "rank")

    monkeypatch.setenv("DXR_FORECAST__SHARD_WORKERS", "1")
    forecast_flow(str(wh.root), "every0", "repeat_history", split="all", run_id="one-by-one")

    # Two shard tasks must be inside shard_inputs together, or the barrier breaks and the forecast fails.
    together = threading.Barrier(2, timeout=20)
    real_inputs = tasks.forecast.shard_inputs

    def meet_then_read(wh, cohort_id, shard, *args):
        if shard in (0, 1):
            together.wait()
        return real_inputs(wh, cohort_id, shard, *args)

    monkeypatch.setattr(tasks.forecast, "shard_inputs", meet_then_read)
    monkeypatch.setenv("DXR_FORECAST__SHARD_WORKERS", "2")
    forecast_flow(str(wh.root), "every0", "repeat_history", split="all", run_id="two-at-once")
    assert lists("two-at-once").equals(lists("one-by-one"))
    status = wh.read("ranking_status", run_id="two-at-once")
    assert status["trajectory_id"].sort().to_list() == wh.read("trajectories", cohort_id=cid)[
        "trajectory_id"].sort().to_list()


def test_a_failing_shard_fails_the_run_and_nothing_is_written_into_it_afterwards(sharded, monkeypatch):
    from flows.forecast import forecast_flow

    wh, cid = sharded
    real_inputs = tasks.forecast.shard_inputs
    failing = threading.Event()

    def slow_first_failing_second(wh, cohort_id, shard, *args):
        if shard == 1:
            failing.set()
            raise InputError("shard 1: unreadable pre-target file")
        if shard == 0:  # still under way when shard 1 fails
            failing.wait(20)
            time.sleep(1.0)
        return real_inputs(wh, cohort_id, shard, *args)

    monkeypatch.setattr(tasks.forecast, "shard_inputs", slow_first_failing_second)
    monkeypatch.setenv("DXR_FORECAST__SHARD_WORKERS", "2")
    with pytest.raises(InputError, match="shard 1: unreadable"):
        forecast_flow(str(wh.root), "every0", "repeat_history", split="all", run_id="broken")

    def written() -> list[str]:
        return sorted(wh.read("ranking_status", run_id="broken")["trajectory_id"].to_list())

    assert wh.read("runs", run_id="broken")["status"].to_list() == ["failed"]
    shard0 = wh.read("trajectories", cohort_id=cid).filter(pl.col("shard") == 0)["trajectory_id"].sort().to_list()
    at_failure = written()
    assert at_failure == shard0  # shard 0 ended before the run was recorded failed; no later shard started
    time.sleep(1.5)
    assert written() == at_failure


def test_every_forecast_system_is_declared_and_the_refusal_tells_a_typo_from_a_declared_system():
    from models.registry import FORECASTERS
    from models.registry import LLM_SYSTEMS, check_system
    from warehouse.schemas import SYSTEMS

    assert set(FORECASTERS) | set(LLM_SYSTEMS) <= set(SYSTEMS)
    available = ("direct, ehr_prior, global_frequency, gru, dense_prior, repeat_history, rrf_prior_direct, "
                 "transition")
    available = ", ".join(sorted(available.split(", ")))
    with pytest.raises(InputError, match=rf"^unknown system 'ehr-prior'; available: {available}$"):
        check_system("ehr-prior")
    with pytest.raises(InputError, match=rf"^system 'full' is declared but not built yet; available: {available}$"):
        check_system("full")
    with pytest.raises(InputError, match=r"^system 'oracle' is not forecast: dxr evaluate adds it from the gold store"):
        check_system("oracle")
    check_system("ehr_prior")


def test_a_forecast_of_a_cohort_cut_by_other_rules_warns_once_naming_it_and_the_rebuild(sharded):
    # A cohort keeps the pre-target records of the rules it was built by: one built before 2026-12-06's change of
    # undated events was forecast as it was, and nothing said so.
    from flows.forecast import forecast_flow
    from warehouse.cohorts import CUT_RULE_VERSION, cohort_list, outdated_cut_note

    wh, cid = sharded
    warnings = LoggedMessages(logging.WARNING)
    logger = logging.getLogger("prefect.flow_runs")
    logger.addHandler(warnings)
    try:
        forecast_flow(str(wh.root), "every0", "repeat_history", split="all", run_id="current-cuts")
        assert warnings.lines == []  # a fresh build records the current version

        # The cohort as a dxr before the version was recorded wrote it: its Parquet file has no such column.
        row = wh.read("cohorts", cohort_id=cid)
        assert row["cut_rule_version"].to_list() == [CUT_RULE_VERSION]
        row.drop("cut_rule_version").write_parquet(wh.partition_path("cohorts", cohort_id=cid))
        assert wh.read("cohorts", cohort_id=cid)["cut_rule_version"].to_list() == [None]
        assert f"none (now {CUT_RULE_VERSION})" in cohort_list(wh).splitlines()[2]
        forecast_flow(str(wh.root), "every0", "repeat_history", split="all", run_id="older-cuts")
    finally:
        logger.removeHandler(warnings)
    assert warnings.lines == [
        f"cohort every0 ({cid}) was cut before cut rules were versioned, not by this dxr's version {CUT_RULE_VERSION}: "
        "its trajectories, targets and pre-target records may differ from what a build makes now; this run forecasts "
        "it as it is, and `dxr cohort build --dataset tiny --name every0 --target every --harmonize native "
        "--min-history 0` cuts it again"]
    assert wh.read("runs", run_id="older-cuts")["status"].to_list() == ["finished"]  # a warning, not a refusal
    other = {**row.row(0, named=True), "cut_rule_version": CUT_RULE_VERSION + 1}
    assert outdated_cut_note(wh, other).startswith(
        f"cohort every0 ({cid}) was cut by version {CUT_RULE_VERSION + 1} of the cut rules, not by this dxr's")
