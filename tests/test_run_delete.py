"""`dxr run delete` and `dxr run list`: a run goes with every row its id partitions and its report, in one commit that
a kill leaves whole or gone; its cohort, the cohort's other runs and the shared caches stay as they were."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import polars as pl
import pytest

from dxr.errors import InputError
from flows.forecast import forecast_flow
from tasks.evaluate import evaluate_repeated, evaluate_run
from tests.conftest import (cli, empty_partition_dirs, every_table, fail_a_forecast, keep_lock_files, kill_a_delete,
                            lock_files, plant, tables_unchanged, warehouse_copy, with_vocabularies, write_tiny_meds)
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import ingest_meds
from warehouse.locks import held, lock_file
from warehouse.run_deletion import NotAResult, delete_run
from warehouse.runs import record_run, registered_run
from warehouse.schemas import RUN_TABLES, TABLES, utc_now
from warehouse.store import COMMIT_DIR, COMMITTED, Warehouse

SYSTEMS = ("global_frequency", "repeat_history")


def without_run(tables: dict[str, pl.DataFrame], run_id: str) -> dict[str, pl.DataFrame]:
    """Every table as it is once `run_id` is deleted: the tables partitioned by run lose its rows, the others none."""
    return {table: rows.filter(pl.col("run_id") != run_id) if table in RUN_TABLES else rows
            for table, rows in tables.items()}


def files(wh) -> list[str]:
    return sorted(str(p.relative_to(wh.root)) for p in wh.root.rglob("*") if ".locks" not in p.parts)


@pytest.fixture(scope="module")
def two_runs_built(tmp_path_factory, vocab_cache, prefect_harness):
    """One cohort and two runs of it, each with two systems' forecasts, an evaluation, a report and a row in every
    table partitioned by run (an LLM system's calls, the ledger, ...); a prediction-cache entry of the cohort and an
    LLM response-cache file, which belong to no run. Built once for the module: tests get copies (`two_runs`)."""
    wh = with_vocabularies(Warehouse(tmp_path_factory.mktemp("two_runs") / "warehouse"), vocab_cache)
    ingest_meds(wh, write_tiny_meds(tmp_path_factory.mktemp("tiny_meds")), "tiny")
    cohort_id = build_cohort(wh, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    for run_id in ("r1", "r2"):
        for system in SYSTEMS:
            forecast_flow(str(wh.root), cohort_id, system, split="all", run_id=run_id)
        evaluate_run(wh, run_id, ks=(10,), n_boot=0, natural=False)
        for table in RUN_TABLES - {"runs"}:
            if wh.read(table, run_id=run_id).is_empty():
                plant(wh, table, cohort_id, {key: run_id if key == "run_id" else "0" if key == "shard" else "x"
                                             for key in TABLES[table].partition_by})
        (wh.root / "reports" / run_id).mkdir(parents=True)
        (wh.root / "reports" / run_id / "report.html").write_text("report")
    cache_entry = {"system": "ehr_prior", "cache_key": "k1"}
    plant(wh, "prediction_cache", cohort_id, cache_entry)
    # Its key names the cohort, as a forecast's does: `dxr cohort delete` finds the cohort's entries by it.
    wh.write("prediction_cache", wh.read("prediction_cache", **cache_entry).with_columns(
        key_json=pl.lit(json.dumps({"cohort_id": cohort_id}))), **cache_entry)
    (wh.forecast_dir / "llm_cache").mkdir()
    (wh.forecast_dir / "llm_cache" / "ab12.json").write_text("{}")
    return wh, cohort_id


@pytest.fixture
def two_runs(two_runs_built, tmp_path):
    """The module's two runs in a warehouse of the test's own."""
    template, cohort_id = two_runs_built
    return warehouse_copy(template, tmp_path / "warehouse"), cohort_id


def test_a_run_goes_with_its_evaluation_and_report_and_leaves_its_cohort_and_the_other_run(two_runs):
    wh, cohort_id = two_runs
    before = every_table(wh)
    for table in RUN_TABLES:  # every table partitioned by run holds rows of both runs
        assert {"r1", "r2"} <= set(before[table]["run_id"]), table

    code, out, err = cli(wh.root, "run", "delete", "r1")
    assert (code, err) == (0, "")
    removed = {table: rows.filter(pl.col("run_id") == "r1").height for table, rows in before.items()
               if table in RUN_TABLES}
    width = max(map(len, RUN_TABLES))  # superseded_llm_calls
    assert out == "\n".join([
        "run r1 (evaluate, forecast:global_frequency, forecast:repeat_history) of cohort default "
        f"({cohort_id}): removed these rows:",
        f"{'table':<{width}}  store     rows",
        f"{'-' * width}  --------  ----",
        *(f"{table:<{width}}  forecast  {removed[table]:>4}" for table in
          ["runs", *sorted(RUN_TABLES - {"runs"})]),
        f"({len(RUN_TABLES)} rows)",
        "removed reports/r1/", ""])

    after = every_table(wh)
    expected = without_run(before, "r1")
    for table in TABLES:
        assert after[table].equals(expected[table]), table
    assert not (wh.root / "reports" / "r1").exists() and (wh.root / "reports" / "r2" / "report.html").is_file()
    assert (wh.forecast_dir / "llm_cache" / "ab12.json").is_file()
    assert not list((wh.forecast_dir / COMMIT_DIR).glob(f"*{COMMITTED}"))
    # The other run works as before, and the deleted id is free for a new forecast.
    evaluate_run(wh, "r2", ks=(10,), n_boot=0, natural=False)
    forecast_flow(str(wh.root), cohort_id, "repeat_history", split="all", run_id="r1")
    assert wh.read("runs", run_id="r1")["kind"].to_list() == ["forecast:repeat_history"]


def test_the_dry_run_changes_nothing(two_runs):
    wh, cohort_id = two_runs
    before, on_disk = every_table(wh), files(wh)
    code, out, err = cli(wh.root, "run", "delete", "r2", "--dry-run")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == ("run r2 (evaluate, forecast:global_frequency, forecast:repeat_history) of cohort "
                                   f"default ({cohort_id}): would remove these rows:")
    counted = {line.split()[0]: int(line.split()[-1]) for line in out.splitlines()[3:] if line.split()[-1].isdigit()}
    assert counted == {table: before[table].filter(pl.col("run_id") == "r2").height for table in RUN_TABLES}
    assert out.endswith("would remove reports/r2/\n")
    assert files(wh) == on_disk
    assert tables_unchanged(wh, before)


def test_a_run_that_a_mean_averages_is_refused_until_the_mean_is_deleted(two_runs):
    wh, _ = two_runs
    evaluate_repeated(wh, ["r1", "r2"], ks=(10,), n_boot=0, natural=False, run_id="mean-12")
    before = every_table(wh)
    for table in ("metrics", "paired_comparisons"):  # the mean's rows, which its delete removes
        assert before[table].filter(pl.col("run_id") == "mean-12").height, table

    code, out, err = cli(wh.root, "run", "delete", "r1")
    assert (code, out) == (2, "")
    assert err == ("Error: run 'r1' is averaged by the mean(s) over repeated runs mean-12: delete each of them first "
                   "(`dxr run delete MEAN_ID`, which removes the mean's own rows only), then the run "
                   "(usage: dxr run delete -h)\n")
    assert tables_unchanged(wh, before)

    code, out, err = cli(wh.root, "run", "delete", "mean-12")
    assert (code, err) == (0, "")
    assert out.splitlines()[0].startswith("run mean-12 (evaluate) of cohort default (")
    after = every_table(wh)
    for table, rows in without_run(before, "mean-12").items():
        assert after[table].equals(rows), table
    assert after["metrics"].filter(pl.col("run_id") == "r1").height  # the averaged runs keep their own evaluations

    code, _, err = cli(wh.root, "run", "delete", "r1")
    assert (code, err) == (0, "")
    assert set(wh.read("runs")["run_id"]) >= {"r2"} and not wh.has_rows("runs", run_id="r1")


def test_a_cohorts_build_and_a_datasets_ingest_are_not_deleted_as_runs(two_runs):
    # They are the record of what they made: a cohort without its build row could no longer say how it was built.
    wh, _ = two_runs
    before = every_table(wh)
    records = wh.read("runs").filter(~pl.col("kind").str.starts_with("forecast:") & (pl.col("kind") != "evaluate"))
    assert sorted(records["kind"]) == ["cohort", "ingest:meds"]
    for run_id, kind in records.select("run_id", "kind").iter_rows():
        code, out, err = cli(wh.root, "run", "delete", run_id)
        assert (code, out) == (2, ""), err
        assert err.startswith(f"Error: run {run_id!r} is a {kind} run, not a forecast or an evaluation")
    assert tables_unchanged(wh, before)


def test_a_run_id_holding_results_and_a_record_is_refused_naming_both_and_its_cohorts_delete(two_runs):
    # A cohort's build given a forecast's run id, as a warehouse written before check_run_kind refused that holds it
    # (m3-all on the MIMIC-III demo): the refusal called the run "a cohort run, not a forecast".
    wh, cohort_id = two_runs
    record_run(wh, "r1", cohort_id, "cohort", {}, "finished", utc_now())
    before = every_table(wh)
    code, out, err = cli(wh.root, "run", "delete", "r1")
    assert (code, out) == (2, "")
    assert err == ("Error: run 'r1' holds both results (evaluate, forecast:global_frequency, forecast:repeat_history) "
                   "and the record of what a command made (cohort), as a run id could before dxr refused that: "
                   "`dxr run delete` deletes results only, and a record goes with what it made, so this run goes only "
                   f"with its cohort default, every run on it included: `dxr cohort delete {cohort_id} --with-runs` "
                   "(--dry-run first shows what goes) (usage: dxr run delete -h)\n")
    assert tables_unchanged(wh, before)
    code, out, err = cli(wh.root, "cohort", "delete", cohort_id, "--with-runs")  # the way out it names
    assert (code, err) == (0, ""), err
    assert not wh.has_rows("runs", run_id="r1") and not wh.has_rows("rankings", run_id="r1")


def test_an_unknown_run_is_not_found(two_runs):
    wh, _ = two_runs
    before = every_table(wh)
    code, out, err = cli(wh.root, "run", "delete", "r3")
    assert (code, out) == (1, "")
    assert err == f"Error: no run 'r3' in the warehouse at {wh.root}: list the runs with dxr run list\n"
    assert tables_unchanged(wh, before)


@pytest.mark.parametrize("stop_after", [None, 0, 1])
def test_a_delete_killed_midway_leaves_the_run_whole_or_gone_and_a_rerun_finishes_it(two_runs, monkeypatch,
                                                                                   stop_after):
    # stop_after None: killed before the commit point (as it renames the staged commit into place); 0 and 1: after
    # it, with nothing removed, or the run's `runs` rows (first) and none of the rest.
    wh, cohort_id = two_runs
    before = every_table(wh)
    kill_a_delete(monkeypatch, stop_after)
    with pytest.raises(KeyboardInterrupt):
        delete_run(wh, "r1")
    monkeypatch.undo()

    if stop_after is None:  # whole: every row as it was, and the delete simply runs again
        assert tables_unchanged(wh, before)
        code, out, err = cli(wh.root, "run", "delete", "r1")
        assert (code, err) == (0, "")
        assert out.startswith("run r1 (evaluate, forecast:global_frequency, forecast:repeat_history) of cohort ")
    else:
        assert wh.partitions_dir("runs", run_id="r1").exists() == (stop_after == 0)
        assert wh.partitions_dir("rankings", run_id="r1").exists()  # on disk until the commit is finished
        # The rerun finishes what was left and succeeds, as the delete did.
        code, out, err = cli(wh.root, "run", "delete", "r1")
        assert (code, err) == (0, "")
        assert out == ("run r1 (evaluate, forecast:global_frequency, forecast:repeat_history): the earlier delete, "
                       "interrupted, is now complete\n")
    after = every_table(wh)
    for table, rows in without_run(before, "r1").items():
        assert after[table].equals(rows), table
    assert not (wh.root / "reports" / "r1").exists() and (wh.root / "reports" / "r2").is_dir()
    assert not list((wh.forecast_dir / COMMIT_DIR).glob(f"*{COMMITTED}"))
    assert not [p for p in Path(wh.root).rglob("*r1*") if ".locks" not in p.parts]
    assert empty_partition_dirs(wh) == []
    # The killed delete's lock files went, but for its cohort's (held shared), which is still there: the cohort's
    # next holder removes that one.
    assert set(lock_files(wh)) <= {lock_file(wh, f"cohort:{cohort_id}").name}
    evaluate_run(wh, "r2", ks=(10,), n_boot=0, natural=False)
    assert lock_files(wh) == []
    code, _, err = cli(wh.root, "run", "delete", "r1")  # the delete completed: nothing left to finish
    assert code == 1 and err.startswith("Error: no run 'r1' in the warehouse at ")


def test_a_run_in_use_is_not_deleted(two_runs):
    wh, cohort_id = two_runs
    before = every_table(wh)
    with held(wh, "run:r1", shared=True, busy="a forecast"):  # as a forecast into it holds it
        with pytest.raises(InputError, match="^run 'r1' is being forecast or evaluated by another dxr process"):
            delete_run(wh, "r1")
    # A command of another kind recorded under the id (a training given --run-id r1 before dxr refused that, still
    # running) holds no lock of the run, and would write its last `runs` row after the delete: refused.
    record_run(wh, "r1", cohort_id, "train:ehr_prior", {}, "running", utc_now())
    with pytest.raises(NotAResult, match=r"^run 'r1' holds both results \(evaluate, forecast:global_frequency, "
                                         r"forecast:repeat_history\) and the record of what a command made "
                                         r"\(train:ehr_prior\)"):
        delete_run(wh, "r1", dry_run=True)
    assert wh.read("rankings").equals(before["rankings"])


def test_a_results_run_id_is_no_id_for_a_build_nor_a_builds_id_for_a_forecast(two_runs):
    # `dxr run delete` deletes results only: a build or a training recorded under a forecast's run id would keep that
    # forecast from being deleted without its cohort, so neither may join the other's run id.
    wh, cohort_id = two_runs
    build = wh.read("runs").filter(pl.col("kind") == "cohort")["run_id"][0]
    before = every_table(wh)
    code, out, err = cli(wh.root, "cohort", "build", "--dataset", "tiny", "--name", "default", "--run-id", "r1")
    assert (code, out) == (1, "")
    assert err == ("Error: run id 'r1' already holds results (evaluate, forecast:global_frequency, "
                   "forecast:repeat_history), and a cohort run is a record: give it a run id of its own (or none, to "
                   "have one generated); `dxr run delete` deletes results only, so it could not delete a run id that "
                   "holds both\n")
    code, out, err = cli(wh.root, "prior", "train", "--cohort", cohort_id, "--run-id", "r1")
    assert (code, out) == (1, "") and err.startswith("Error: run id 'r1' already holds results ("), err
    code, out, err = cli(wh.root, "forecast", "--cohort", cohort_id, "--system", "repeat_history", "--split", "all",
                         "--run-id", build)
    assert (code, out) == (1, "")
    assert err.startswith(f"Error: run id '{build}' already holds a record of what a command made (cohort), and a "
                          "forecast:repeat_history run is a result: give it a run id of its own"), err
    with pytest.raises(InputError, match="^run id 'r2' already holds results"):  # what the flows' runs go through
        with registered_run(wh, "train:ehr_prior", {}, run_id="r2", cohort_id=cohort_id):
            pass
    assert tables_unchanged(wh, before)
    code, _, err = cli(wh.root, "run", "delete", "r1")
    assert code == 0, err


def test_a_mean_is_not_written_while_one_of_its_runs_is_being_deleted(two_runs, monkeypatch):
    # The mean reads its runs under their locks, then computes and writes with them released: a run delete that
    # holds one of them meanwhile (here from when the first rows, the metrics, are put together) must not find no
    # mean, delete the run, and leave the mean averaging a run that is gone.
    import tasks.evaluate

    wh, _ = two_runs
    real_conform = tasks.evaluate._conform
    deleting = ExitStack()

    def conform_while_deleting(table, *args, **kwargs):
        if table == "metrics":
            deleting.enter_context(held(wh, "run:r2", shared=False, busy="a delete"))
        return real_conform(table, *args, **kwargs)

    monkeypatch.setattr(tasks.evaluate, "_conform", conform_while_deleting)
    with deleting, pytest.raises(InputError, match="^run 'r2' is being deleted or evaluated by another dxr process: "
                                                   "retry when it has finished$"):
        evaluate_repeated(wh, ["r1", "r2"], ks=(10,), n_boot=0, natural=False, run_id="mean-12")
    assert not wh.has_rows("runs", run_id="mean-12") and not wh.has_rows("metrics", run_id="mean-12")


def test_a_failed_run_of_another_cohort_deleted_frees_its_id(two_runs, monkeypatch):
    # `dxr forecast` refuses a run id whose only forecasts, of another cohort, failed; deleting that run is one fix.
    wh, cohort_id = two_runs
    other = build_cohort(wh, "tiny", "every", CohortOptions(target="every"), seed=7)["cohort_id"]
    fail_a_forecast(monkeypatch, wh, cohort_id, "repeat_history", "r9")
    with pytest.raises(InputError, match=r"or delete the run first \(`dxr run delete r9`\)$"):
        forecast_flow(str(wh.root), other, "repeat_history", split="all", run_id="r9")
    assert cli(wh.root, "run", "delete", "r9")[0] == 0
    forecast_flow(str(wh.root), other, "repeat_history", split="all", run_id="r9")
    assert wh.read("runs", run_id="r9").select("kind", "cohort_id", "status").rows() == [
        ("forecast:repeat_history", other, "finished")]


def test_a_deleted_run_leaves_no_lock_file_that_its_killed_forecast_left(two_runs, monkeypatch):
    # Nothing takes a deleted run's locks again, so the files its killed holders left would stay for good.
    wh, cohort_id = two_runs
    keep_lock_files(monkeypatch)  # as a forecast killed in the middle leaves them
    fail_a_forecast(monkeypatch, wh, cohort_id, "repeat_history", "r9")
    monkeypatch.undo()
    assert lock_files(wh) == sorted(lock_file(wh, resource).name for resource in (
        f"cohort:{cohort_id}", "run:r9", "run-register:r9", "run-system:r9|repeat_history",
        "record:r9|forecast:repeat_history"))

    code, _, err = cli(wh.root, "run", "delete", "r9")
    assert (code, err) == (0, "")
    assert lock_files(wh) == [] and empty_partition_dirs(wh) == []


def test_run_list_shows_the_runs_newest_first_by_cohort_kind_and_limit(two_runs):
    wh, cohort_id = two_runs
    registry = wh.read("runs").sort(["started_at", "run_id", "kind"], descending=[True, False, False])

    code, out, err = cli(wh.root, "run", "list", "--format", "json")
    assert (code, err) == (0, "")
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(r["run_id"], r["kind"], r["status"]) for r in listed] == registry.select("run_id", "kind", "status").rows()
    assert list(listed[0]) == ["run_id", "kind", "status", "cohort", "cohort_id", "started_at", "finished_at"]
    # The ingest belongs to no cohort; the build and the runs to the cohort, by name and id.
    assert {(r["kind"], r["cohort"], r["cohort_id"]) for r in listed if not r["kind"].startswith(("forecast", "ev"))} \
        == {("ingest:meds", None, None), ("cohort", "default", cohort_id)}

    code, out, err = cli(wh.root, "run", "list", "--cohort", "default", "--kind", "forecast", "--limit", "3",
                         "--format", "csv")
    assert (code, err) == (0, "")
    forecasts = registry.filter(pl.col("kind").str.starts_with("forecast:")).head(3)
    assert out.splitlines()[0] == "run_id,kind,status,cohort,cohort_id,started_at,finished_at"
    assert [line.split(",")[:5] for line in out.splitlines()[1:]] == [
        [run_id, kind, "finished", "default", cohort_id] for run_id, kind in forecasts.select("run_id", "kind").rows()]

    code, out, err = cli(wh.root, "run", "list", "--kind", "evaluate", "--cohort", cohort_id)
    assert (code, err) == (0, "")
    assert [line.split()[:5] for line in out.splitlines()[2:-1]] == [
        ["r2", "evaluate", "finished", "default", cohort_id], ["r1", "evaluate", "finished", "default", cohort_id]]
    assert out.splitlines()[-1] == "(2 rows)"

    code, out, err = cli(wh.root, "run", "list", "--cohort", "nightly")
    assert (code, out) == (1, "")
    assert err == (f"Error: cohort 'nightly' not found in the warehouse at {wh.root}; built cohorts: default (list "
                   "them with `dxr cohort list`, or check --data-dir)\n")
