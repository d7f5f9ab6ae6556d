"""`dxr cohort delete`: a cohort goes with every row that is its own (and with --with-runs, its runs' rows), in one
commit that a kill leaves whole or gone; another cohort of the same dataset and its runs stay as they were."""

from __future__ import annotations

import ast
import json
import re
import shlex
from datetime import datetime
from pathlib import Path

import polars as pl
import pytest

from dxr.errors import InputError, NotFoundError
from flows.forecast import forecast_flow
from tasks.evaluate import evaluate_repeated, evaluate_run
from tests.conftest import (cli, cut_cohort_builds_short, empty_partition_dirs, every_table, fail_a_forecast,
                            keep_lock_files, kill_a_delete, lock_files, plant, tables_unchanged, tiny_events,
                            warehouse_copy, with_vocabularies, write_tiny_meds)
from warehouse.cohort_deletion import COHORT_TABLES, delete_cohort
from warehouse.cohorts import CohortOptions, build_cohort, describe_cohort
from warehouse.datasets import ingest_meds
from warehouse.locks import held
from warehouse.runs import record_run
from warehouse.schemas import RUN_TABLES, TABLES
from warehouse.store import COMMIT_DIR, COMMITTED, Warehouse


def belongs(frame: pl.DataFrame, cohort_id: str, run_ids: list[str]) -> pl.Expr:
    """The rows of a table that name the cohort or one of its runs, by whichever of the columns it has."""
    named = pl.lit(False)
    if "cohort_id" in frame.columns:
        named |= pl.col("cohort_id") == cohort_id
    if "run_id" in frame.columns:
        named |= pl.col("run_id").is_in(run_ids)
    if "trajectory_id" in frame.columns:
        named |= pl.col("trajectory_id").fill_null("").str.starts_with(f"{cohort_id}:")
    if "key_json" in frame.columns:
        named |= pl.col("key_json").str.contains(cohort_id, literal=True)
    return named.fill_null(False)


def with_runs_and_results(wh, cohort_id: str, run_id: str) -> None:
    """A forecast and its evaluation on the cohort, a training record, a report and a prior's copy in the model
    cache, and a row in each run-keyed, cohort-keyed or cache table that the forecast leaves empty (an LLM
    system's calls, the ledger, a synthetic dataset's oracles)."""
    forecast_flow(str(wh.root), cohort_id, "repeat_history", split="all", run_id=run_id)
    evaluate_run(wh, run_id, ks=(10,), n_boot=0, natural=False)
    now = datetime(2026, 12, 5)
    record_run(wh, f"{run_id}-train", cohort_id, "train:ehr_prior", {}, "finished", now, now)
    for table in RUN_TABLES - {"runs"}:
        if wh.read(table, run_id=run_id).is_empty():
            plant(wh, table, cohort_id, {key: run_id if key == "run_id" else "0" if key == "shard" else "x"
                                           for key in TABLES[table].partition_by})
    for table in COHORT_TABLES:
        if wh.read(table, cohort_id=cohort_id).is_empty():
            plant(wh, table, cohort_id, {key: cohort_id if key == "cohort_id" else 0
                                           for key in TABLES[table].partition_by})
    wh.write("prediction_cache", pl.DataFrame({
        "system": "ehr_prior", "cache_key": f"k{cohort_id}", "key_json": json.dumps({"cohort_id": cohort_id}),
        "trajectory_id": f"{cohort_id}:1:103", "rank": 1, "code": "x", "score": 1.0, "native": True},
        schema_overrides={"rank": pl.Int32}), system="ehr_prior", cache_key=f"k{cohort_id}")
    (wh.root / "reports" / run_id).mkdir(parents=True)
    (wh.root / "reports" / run_id / "report.html").write_text("report")
    (wh.root / "mlflow" / "cache" / f"ehr_prior-{cohort_id}" / "v1-abc").mkdir(parents=True)


@pytest.fixture(scope="module")
def two_cohorts_built(tmp_path_factory, vocab_cache, prefect_harness):
    """Two cohorts of one dataset (native codes and ICD categories), each with a run and everything above. Built once
    for the module: tests get copies (`two_cohorts`)."""
    wh = with_vocabularies(Warehouse(tmp_path_factory.mktemp("two_cohorts") / "warehouse"), vocab_cache)
    ingest_meds(wh, write_tiny_meds(tmp_path_factory.mktemp("tiny_meds")), "tiny")
    old = build_cohort(wh, "tiny", "old", CohortOptions(), seed=7)["cohort_id"]
    kept = build_cohort(wh, "tiny", "kept", CohortOptions(harmonize="category"), seed=7)["cohort_id"]
    with_runs_and_results(wh, old, "r-old")
    with_runs_and_results(wh, kept, "r-kept")
    return wh, old, kept


@pytest.fixture
def two_cohorts(two_cohorts_built, tmp_path):
    """The module's two cohorts in a warehouse of the test's own."""
    template, old, kept = two_cohorts_built
    return warehouse_copy(template, tmp_path / "warehouse"), old, kept


def removal_arguments(out: str) -> dict[str, str]:
    """The argument of each Python call in the MLflow removal command that a delete's note prints, by the called name,
    read as the shell and then Python read it."""
    [command] = re.findall(r"remove it with `(.*)`$", out, flags=re.MULTILINE)
    program, flag, code = shlex.split(command)
    assert (program, flag) == (".venv/bin/python", "-c"), command
    calls = [node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Call)]
    return {getattr(call.func, "attr", getattr(call.func, "id", None)): ast.literal_eval(arg)
            for call in calls for arg in call.args}


def test_the_mlflow_removal_command_of_a_data_dir_with_a_quote_in_its_path_runs_as_printed(two_cohorts_built,
                                                                                         tmp_path):
    # The note put the store's URI between single quotes inside a double-quoted shell argument: `/srv/o'brien` broke it.
    template, old, _ = two_cohorts_built
    wh = warehouse_copy(template, tmp_path / "o'brien \"wh\" $HOME é")
    code, out, err = cli(wh.root, "cohort", "delete", old, "--with-runs")
    assert code == 0, err
    assert removal_arguments(out) == {"MlflowClient": f"sqlite:///{wh.root / 'mlflow' / 'mlflow.db'}",
                                      "delete_registered_model": f"ehr_prior-{old}"}


def test_with_runs_removes_every_row_of_the_cohort_and_its_runs_and_leaves_the_other_cohort(two_cohorts):
    wh, old, kept = two_cohorts
    before = every_table(wh)
    deleted_runs = ["r-old"]
    for table in sorted(RUN_TABLES | set(COHORT_TABLES) | {"prediction_cache"}):
        # Every table that holds a cohort's or a run's rows has some of the deleted cohort's, and of the other.
        assert before[table].filter(belongs(before[table], old, deleted_runs)).height, table
        assert before[table].filter(belongs(before[table], kept, ["r-kept"])).height, table

    code, out, err = cli(wh.root, "cohort", "delete", old, "--with-runs")
    assert code == 0, err
    assert out.startswith(f"cohort old ({old}), built ")
    assert ": removed 1 run(s) (r-old) and these rows:" in out.splitlines()[0]
    assert "removed reports/r-old/" in out and f"removed mlflow/cache/ehr_prior-{old}/" in out
    assert f"note: registered MLflow model ehr_prior-{old} (if still registered) stays in sqlite:///" in out
    assert removal_arguments(out) == {"MlflowClient": f"sqlite:///{wh.root / 'mlflow' / 'mlflow.db'}",
                                      "delete_registered_model": f"ehr_prior-{old}"}

    after = every_table(wh)
    for table, rows in before.items():
        assert after[table].equals(rows.filter(~belongs(rows, old, deleted_runs))), table
    assert not (wh.root / "reports" / "r-old").exists() and (wh.root / "reports" / "r-kept").is_dir()
    assert not (wh.root / "mlflow" / "cache" / f"ehr_prior-{old}").exists()
    assert (wh.root / "mlflow" / "cache" / f"ehr_prior-{kept}").is_dir()
    assert not list((wh.forecast_dir / COMMIT_DIR).glob(f"*{COMMITTED}"))
    assert empty_partition_dirs(wh) == []  # runs/run_id=r-old/ went with the last of its kinds
    # The other cohort and its run work as before.
    evaluate_run(wh, "r-kept", ks=(10,), n_boot=0, natural=False)


def test_with_runs_removes_a_mean_over_its_runs_with_the_means_paired_comparisons(two_cohorts):
    wh, old, _ = two_cohorts
    forecast_flow(str(wh.root), old, "global_frequency", split="all", run_id="r-old")
    for system in ("repeat_history", "global_frequency"):
        forecast_flow(str(wh.root), old, system, split="all", run_id="r-old2")
    evaluate_repeated(wh, ["r-old", "r-old2"], ks=(10,), n_boot=0, natural=False, run_id="mean-old")
    before = every_table(wh)
    for table in ("metrics", "paired_comparisons"):
        assert before[table].filter(pl.col("run_id") == "mean-old").height, table

    code, out, err = cli(wh.root, "cohort", "delete", old, "--with-runs")
    assert code == 0, err
    assert ": removed 3 run(s) (mean-old, r-old, r-old2) and these rows:" in out.splitlines()[0]
    after = every_table(wh)
    for table, rows in before.items():
        assert after[table].equals(rows.filter(~belongs(rows, old, ["mean-old", "r-old", "r-old2"]))), table


def test_a_cohort_with_runs_is_refused_without_with_runs_and_the_dry_run_changes_nothing(two_cohorts):
    wh, old, _ = two_cohorts
    files = sorted(str(p.relative_to(wh.root)) for p in wh.root.rglob("*") if ".locks" not in p.parts)
    before = every_table(wh)

    code, out, err = cli(wh.root, "cohort", "delete", "old")
    assert code == 2 and not out
    assert err == (f"Error: cohort old ({old}) has 1 run(s) recorded on it (r-old): pass --with-runs to delete them, "
                   "and everything they wrote, with it (usage: dxr cohort delete -h)\n")

    code, out, err = cli(wh.root, "cohort", "delete", "old", "--with-runs", "--dry-run")
    assert code == 0, err
    assert ": would remove 1 run(s) (r-old) and these rows:" in out.splitlines()[0]
    counted = {line.split()[0]: int(line.split()[-1]) for line in out.splitlines()[3:] if line.split()[-1].isdigit()}
    assert counted == {table: rows.filter(belongs(rows, old, ["r-old"])).height
                       for table, rows in before.items() if rows.filter(belongs(rows, old, ["r-old"])).height}
    assert "would remove reports/r-old/" in out

    assert sorted(str(p.relative_to(wh.root)) for p in wh.root.rglob("*") if ".locks" not in p.parts) == files
    assert tables_unchanged(wh, before)


def test_a_cohort_without_runs_goes_with_its_own_rows_only(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cohort_id = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7, run_id="build-1")["cohort_id"]
    vocabulary = wh_vocab.read("icd_codes")
    code, out, err = cli(wh_vocab.root, "cohort", "delete", "default")
    assert code == 0, err
    assert ": removed no run and these rows:" in out.splitlines()[0]
    assert "note:" not in out  # no prior was trained on it
    for table in COHORT_TABLES:
        assert wh_vocab.read(table).is_empty(), table
    assert wh_vocab.read("runs")["kind"].to_list() == ["ingest:meds"]  # its build's record went with it
    assert wh_vocab.read("datasets").height == 1 and wh_vocab.read("icd_codes").equals(vocabulary)
    code, _, err = cli(wh_vocab.root, "cohort", "delete", cohort_id)
    assert code == 1
    assert err == (f"Error: cohort {cohort_id!r} not found in the warehouse at {wh_vocab.root}; built cohorts: none "
                   "(list them with `dxr cohort list`, or check --data-dir)\n")


def test_a_name_of_several_cohorts_is_refused_and_each_goes_by_its_id(wh_vocab, tmp_path):
    # A nightly refresh: the dataset registered again with a new patient, the cohort built again under its name.
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v1"), "hosp")
    first = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v2", tiny_events().filter(pl.col("subject_id") != 4)), "hosp")
    second = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    assert first != second

    with pytest.raises(InputError, match=rf"^cohort name 'nightly' names 2 cohorts, oldest first: {first} \(built "
                                         rf".*\), {second} \(built .*\); delete one by its id"):
        delete_cohort(wh_vocab, "nightly", with_runs=False)
    delete_cohort(wh_vocab, first, with_runs=False)
    assert wh_vocab.read("cohorts")["cohort_id"].to_list() == [second]
    assert wh_vocab.read("trajectories")["cohort_id"].unique().to_list() == [second]


def test_a_half_built_cohort_goes_by_its_name_or_id_with_its_builds_and_on_request_its_runs(wh_vocab, tiny_meds,
                                                                                           monkeypatch):
    # A rebuild of the only cohort of its name, cut short: the delete refused it ("is not built: ... build it again")
    # until the rebuild the user wanted gone had been run in full.
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cohort_id = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7, run_id="build-1")["cohort_id"]
    forecast_flow(str(wh_vocab.root), "default", "repeat_history", split="all", run_id="r1")

    cut_cohort_builds_short(monkeypatch, KeyboardInterrupt("killed between the records and the targets"))
    with pytest.raises(KeyboardInterrupt):
        build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7, run_id="build-2")
    monkeypatch.undo()
    before = every_table(wh_vocab)
    assert before["trajectories"].height and before["cohorts"].is_empty()

    code, out, err = cli(wh_vocab.root, "cohort", "delete", "default")
    assert (code, out) == (2, "")
    assert err.startswith(f"Error: cohort default ({cohort_id}) has 1 run(s) recorded on it (r1): pass --with-runs")
    code, out, err = cli(wh_vocab.root, "cohort", "delete", "default", "--with-runs", "--dry-run")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == (f"cohort default ({cohort_id}), not built (its build in run build-2 failed): "
                                   "would remove 1 run(s) (r1) and these rows:")
    counted = {line.split()[0]: int(line.split()[-1]) for line in out.splitlines()[3:] if line.split()[-1].isdigit()}
    assert counted == {table: rows.filter(belongs(rows, cohort_id, ["r1"])).height
                       for table, rows in before.items() if rows.filter(belongs(rows, cohort_id, ["r1"])).height}
    assert counted["runs"] == 3  # both builds and the forecast
    assert tables_unchanged(wh_vocab, before)

    # Killed after its commit point: the rerun, by the name, finishes it as for a built cohort.
    kill_a_delete(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        delete_cohort(wh_vocab, cohort_id, with_runs=True)
    monkeypatch.undo()
    code, out, err = cli(wh_vocab.root, "cohort", "delete", "default", "--with-runs")
    assert (code, err) == (0, "")
    assert out == (f"cohort default ({cohort_id}), not built (a build of it did not finish): the earlier delete, "
                   "interrupted, is now complete\n")
    after = every_table(wh_vocab)
    for table, rows in before.items():
        assert after[table].equals(rows.filter(~belongs(rows, cohort_id, ["r1"]))), table
    assert wh_vocab.read("runs")["kind"].to_list() == ["ingest:meds"]
    assert lock_files(wh_vocab) == [] and empty_partition_dirs(wh_vocab) == []
    code, _, err = cli(wh_vocab.root, "forecast", "--cohort", "default", "--system", "repeat_history")
    assert code == 1 and err.splitlines()[-1].startswith("Error: cohort 'default' not found in the warehouse at ")


def test_a_cohort_in_use_is_not_deleted(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cohort_id = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    with held(wh_vocab, f"cohort:{cohort_id}", shared=True, busy="a forecast"):  # as a forecast or training holds it
        with pytest.raises(InputError, match=rf"^cohort default \({cohort_id}\) is in use by another dxr process"):
            delete_cohort(wh_vocab, "default", with_runs=True)
    assert wh_vocab.has_rows("trajectories", cohort_id=cohort_id)


@pytest.mark.parametrize("stop_after", [None, 0, 3])
def test_a_delete_killed_midway_leaves_the_cohort_whole_or_gone_and_a_rerun_finishes_it(two_cohorts, monkeypatch,
                                                                                      stop_after):
    # stop_after None: killed before the commit point (as it renames the staged commit into place); 0 and 3: after
    # it, with none or three of the removals done (the cohort's row, first, still in its place or in the commit).
    wh, old, kept = two_cohorts
    before = every_table(wh)
    described = describe_cohort(wh.read("cohorts", cohort_id=old).row(0, named=True))
    kill_a_delete(monkeypatch, stop_after)
    with pytest.raises(KeyboardInterrupt):
        delete_cohort(wh, old, with_runs=True)
    monkeypatch.undo()

    if stop_after is None:  # whole: every row as it was, and the delete simply runs again
        assert tables_unchanged(wh, before)
        code, out, err = cli(wh.root, "cohort", "delete", old, "--with-runs")
        assert (code, err) == (0, "")
        assert out.startswith(f"cohort {described}: removed 1 run(s) (r-old) and these rows:\n")
    else:
        assert wh.partitions_dir("cohorts", cohort_id=old).exists() == (stop_after == 0)
        assert wh.partitions_dir("trajectories", cohort_id=old).exists()  # on disk until the commit is finished
        # The rerun (by the name only this cohort had, or by its id) finishes what was left and succeeds, as the
        # delete did; it names the model the killed delete could not print.
        code, out, err = cli(wh.root, "cohort", "delete", "old" if stop_after == 0 else old, "--with-runs")
        assert (code, err) == (0, "")
        assert out.splitlines()[0] == f"cohort {described}: the earlier delete, interrupted, is now complete"
        assert [line.split(" stays in ")[0] for line in out.splitlines()[1:]] == [
            f"note: registered MLflow model ehr_prior-{old} (if still registered)"]
    after = every_table(wh)
    for table, rows in before.items():
        assert after[table].equals(rows.filter(~belongs(rows, old, ["r-old"]))), table
    assert not (wh.root / "reports" / "r-old").exists()
    assert not list((wh.forecast_dir / COMMIT_DIR).glob(f"*{COMMITTED}"))
    assert not [p for p in Path(wh.root).rglob(f"*{old}*") if ".locks" not in p.parts]
    assert lock_files(wh) == [] and empty_partition_dirs(wh) == []  # the killed delete's lock files went too
    code, _, err = cli(wh.root, "cohort", "delete", old, "--with-runs")  # the delete completed: nothing left to finish
    assert code == 1 and err.startswith(f"Error: cohort {old!r} not found in the warehouse at {wh.root}; ")


def test_a_deleted_cohort_leaves_no_lock_file_that_a_killed_forecast_of_it_left(two_cohorts, monkeypatch):
    # Nothing takes the locks of a deleted cohort and its runs again, so the files killed holders left would stay.
    wh, old, _ = two_cohorts
    keep_lock_files(monkeypatch)  # as a forecast killed in the middle leaves them
    fail_a_forecast(monkeypatch, wh, old, "repeat_history", "r-killed")
    monkeypatch.undo()
    assert len(lock_files(wh)) == 5  # the cohort's, the run's, its registration's, the system's and the record's

    code, _, err = cli(wh.root, "cohort", "delete", old, "--with-runs")
    assert (code, err) == (0, "")
    assert lock_files(wh) == [] and empty_partition_dirs(wh) == []


def test_the_mlflow_runs_that_killed_trainings_of_the_cohort_left_running_end_as_killed(two_cohorts):
    from models.prior import tracking
    from warehouse.runs import _write_marker

    # A killed training leaves its MLflow run RUNNING, which the next training ends as KILLED only while the registry
    # records that training as killed (`tasks.prior.killed_attempt`): the delete removed that record, so the run
    # stayed RUNNING for good.
    wh, old, kept = two_cohorts
    prior = {"prior": {"tracking_uri": None, "experiment": "dxr-ehr-prior"}}  # what a training records of its store
    record_run(wh, "t-killed", old, "train:gru", prior, "killed", datetime(2026, 12, 5))
    # Killed too, though no run has started since to record it: `running`, its marker left, its record lock free.
    record_run(wh, "t-dead", old, "train:dense_prior", prior, "running", datetime(2026, 12, 5))
    _write_marker(wh, "t-dead", "train:dense_prior")
    record_run(wh, "t-other", kept, "train:gru", prior, "killed", datetime(2026, 12, 5))  # another cohort's
    tracking.use_tracking(wh.root, None, "dxr-ehr-prior")
    client = tracking.MlflowClient()
    experiment = client.get_experiment_by_name("dxr-ehr-prior").experiment_id
    mlflow_runs = {run_id: client.create_run(experiment, tags={"dxr.run_id": run_id, "system": system}).info.run_id
                   for run_id, system in (("t-killed", "gru"), ("t-dead", "dense_prior"), ("t-other", "gru"),
                                          ("r-old-train", "ehr_prior"))}  # the last: a training recorded finished

    assert cli(wh.root, "cohort", "delete", old, "--with-runs", "--dry-run")[0] == 0
    assert {client.get_run(run).info.status for run in mlflow_runs.values()} == {"RUNNING"}
    code, out, err = cli(wh.root, "cohort", "delete", old, "--with-runs")

    assert code == 0, err
    ended = sorted(mlflow_runs[run_id] for run_id in ("t-killed", "t-dead"))
    assert out.splitlines()[-1] == (f"note: MLflow run(s) {', '.join(ended)} of the cohort's killed trainings, left "
                                    "RUNNING, ended as KILLED (the runs and their artifacts stay)")
    assert {run_id: client.get_run(run).info.status for run_id, run in mlflow_runs.items()} == {
        "t-killed": "KILLED", "t-dead": "KILLED", "t-other": "RUNNING", "r-old-train": "RUNNING"}
    assert wh.read("runs", run_id="t-killed").is_empty() and wh.read("runs", run_id="t-dead").is_empty()


def test_a_mean_over_runs_taken_while_its_cohort_is_deleted_is_not_written(wh_vocab, tiny_meds, prefect_harness,
                                                                            monkeypatch):
    # The mean reads its runs under their locks, then computes and writes with them released: a delete of the cohort
    # with its runs that finishes meanwhile (here once the configurations were read, as the metrics rows are put
    # together) must not leave the mean behind, on a cohort no longer registered.
    import tasks.evaluate

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cohort_id = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    for run_id in ("r1", "r2"):
        forecast_flow(str(wh_vocab.root), cohort_id, "repeat_history", split="all", run_id=run_id)
    real_conform = tasks.evaluate._conform

    def conform_after_the_delete(table, *args, **kwargs):
        if table == "metrics":
            delete_cohort(wh_vocab, cohort_id, with_runs=True)
        return real_conform(table, *args, **kwargs)

    monkeypatch.setattr(tasks.evaluate, "_conform", conform_after_the_delete)
    with pytest.raises(NotFoundError, match=rf"^run\(s\) r1, r2 of cohort {cohort_id} were deleted while the mean "
                                            "over r1, r2 was taken: nothing was written"):
        tasks.evaluate.evaluate_repeated(wh_vocab, ["r1", "r2"], ks=(10,), n_boot=0, natural=False)
    assert wh_vocab.read("metrics").is_empty()
    assert wh_vocab.read("runs").filter(pl.col("cohort_id") == cohort_id).is_empty()
