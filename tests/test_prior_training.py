"""EHR Prior training end to end: MLflow run contents, alias resolution, rankings, boundary sentinel."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import polars as pl
import sqlalchemy
import pytest
import torch
from click.testing import CliRunner
import mlflow
from mlflow.exceptions import MlflowException

from dxr.cli import main
from dxr.errors import ConfigError, InputError, NotFoundError
from models.prior import tracking
from models.prior.config import PriorConfig
from models.prior.lit import PriorDataModule
from models.prior.forecaster import RegisteredPrior
from models.prior.planted import SPLIT_CYCLE, write_planted_cohort
from tasks.forecast import cached_forecast_shard, clear_outputs, forecast_shard_task, shard_inputs
from tasks.prior import ensure_prior, train_prior, training_identity
from tests.conftest import THIRD_PARTY_NOISE, LoggedMessages, flow_run_names
from tests.sentinel import forecast_store_texts
from warehouse.runs import record_run, registered_run
from warehouse.store import Warehouse

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

TINY = dict(d_model=16, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16, dropout=0.0,
            batch_size=32, min_code_count=1, seed=5)
N_PATIENTS = 150
# Sentinel codes planted only in target encounters of held_out and tuning patients: they are in Ω but
# must never reach training (train_events hold train patients only; validation uses pre-target views).
SENTINELS = {s: f"DIAGNOSIS//ICD//10//ZZSENT{s}" for s in range(1, N_PATIENTS + 1)
             if SPLIT_CYCLE[(s - 1) % len(SPLIT_CYCLE)] in ("held_out", "tuning")}


@contextmanager
def prior_log_lines() -> Iterator[list[str]]:
    """The INFO lines `tasks.prior` logs meanwhile (outside a flow the stage logs to its module logger)."""
    progress = LoggedMessages(logging.INFO)
    logger = logging.getLogger("tasks.prior")
    logger.addHandler(progress)
    logger.setLevel(logging.INFO)
    try:
        yield progress.lines
    finally:
        logger.removeHandler(progress)
        logger.setLevel(logging.NOTSET)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("prior_wh")
    wh = Warehouse(root)
    cohort = write_planted_cohort(wh, n_patients=N_PATIENTS, seed=2, extra_target_codes=SENTINELS)
    with prior_log_lines() as lines:
        result = train_prior(str(root), cohort, "ehr_prior", PriorConfig(**TINY, epochs=2), run_id="train-test-1")
    return wh, cohort, result, lines


def test_mlflow_run_has_params_metrics_artifacts_and_registered_model(trained):
    wh, cohort, result, _ = trained
    assert result.registered_model == f"ehr_prior-{cohort}" and result.version == "1" and result.alias == "champion"
    assert tracking.mlflow.get_tracking_uri() == f"sqlite:///{wh.root / 'mlflow' / 'mlflow.db'}"
    client = tracking.MlflowClient()
    run = client.get_run(result.mlflow_run_id)
    assert run.data.params["prior.d_model"] == "16" and run.data.params["system"] == "ehr_prior"
    assert int(run.data.params["n_parameters"]) > 0
    for name in ("val_recall_at_20", "val_precision_at_20", "train_task_loss", "train_balance_loss",
                 "train_z_loss", "router_load_l0_e0"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [0, 1], name
    # The registered weights are those of the epoch with the best tuning R@20, and the result says which.
    history = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "val_recall_at_20"),
                                       key=lambda m: m.step)]
    selected = int(run.data.metrics["selected_epoch"])
    assert selected == max(range(len(history)), key=lambda e: (history[e], -e))
    assert result.metrics["val_recall_at_20"] == pytest.approx(history[selected])
    assert "prior_config.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert str(wh.root / "mlflow" / "artifacts") in run.info.artifact_uri
    runs = wh.read("runs").filter(pl.col("run_id") == "train-test-1")
    assert runs.select("kind", "status", "cohort_id").rows() == [("train:ehr_prior", "finished", cohort)]


def test_featurizing_and_each_epoch_log_one_progress_line_with_their_tracked_numbers(trained):
    # The featurizing line: at 100,000 patients the minute before the first epoch's line was silent in a log.
    # Each epoch's line: its tuning P@20 and R@20 and its time, validation included (a log without a bar said
    # neither the precision nor how long an epoch took).
    _, _, result, lines = trained
    client = tracking.MlflowClient()
    history = {name: [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, name),
                                              key=lambda m: m.step)]
               for name in ("train_loss", "val_precision_at_20", "val_recall_at_20")}
    n_val_pairs = int(client.get_run(result.mlflow_run_id).data.params["n_val_pairs"])
    assert [re.sub(r"(in|after) \d+\.\d s$", r"\1 S s", line) for line in lines] == [
        f"ehr_prior: {result.n_train_sequences:,} training sequences ({result.n_train_patients:,} train patients) "
        f"and {n_val_pairs:,} tuning pairs featurized in S s",
        *(f"ehr_prior epoch {e + 1}/2: train loss {history['train_loss'][e]:.4f}, tuning "
          f"P@20 {history['val_precision_at_20'][e]:.4f}, R@20 {history['val_recall_at_20'][e]:.4f} after S s"
          for e in range(2))]
    assert n_val_pairs > 0
    # The epochs are part of the training's time (each rounded to a tenth: at most 0.05 s up).
    epoch_seconds = [float(re.search(r"after (\d+\.\d) s$", line).group(1)) for line in lines[1:]]
    assert sum(epoch_seconds) <= result.train_seconds + 0.05 * len(epoch_seconds), (epoch_seconds, result)


def test_prediction_resolves_the_registered_alias(trained):
    wh, cohort, _, _ = trained
    second = train_prior(str(wh.root), cohort, "ehr_prior", PriorConfig(**TINY, epochs=1, promote=False))
    assert (second.version, second.alias) == ("2", None)
    forecaster = RegisteredPrior()
    forecaster.fit(wh.connect(), cohort)
    assert forecaster.version == "1"  # the alias still points to the first version
    tracking.MlflowClient().set_registered_model_alias(second.registered_model, "champion", "2")
    moved = RegisteredPrior()
    moved.fit(wh.connect(), cohort)
    assert (moved.version, moved.run_id) == ("2", second.mlflow_run_id)
    tracking.MlflowClient().set_registered_model_alias(second.registered_model, "champion", "1")
    with pytest.raises(NotFoundError, match="alias 'nobody'"):
        RegisteredPrior(PriorConfig(alias="nobody")).fit(wh.connect(), cohort)


def test_every_trajectory_gets_20_unique_vocabulary_codes_and_no_sentinel(trained):
    wh, cohort, _, _ = trained
    trajectories = wh.read("trajectories", cohort_id=cohort)
    total = sum(forecast_shard_task.fn(str(wh.root), cohort, "ehr_prior", shard, "all", 20, "fc-test")
                for shard in sorted(trajectories["shard"].unique()))
    assert total == trajectories.height
    rankings = wh.read("rankings", run_id="fc-test", system="ehr_prior")
    omega = wh.read("cohort_vocabulary", cohort_id=cohort)["code"]
    per = rankings.group_by("trajectory_id").agg(pl.col("code").n_unique().alias("unique"), pl.len().alias("n"),
                                                 pl.col("rank").sort().alias("ranks"))
    assert per.height == trajectories.height
    assert per["n"].to_list() == [20] * per.height and per["unique"].to_list() == [20] * per.height
    assert all(r == list(range(1, 21)) for r in per["ranks"].to_list())
    assert rankings["code"].is_in(omega.implode()).all()
    assert not rankings["code"].is_in(list(SENTINELS.values())).any()
    status = wh.read("ranking_status", run_id="fc-test", system="ehr_prior")
    assert status["status"].unique().to_list() == ["ok"]
    # The same lists are the Candidate Generation stage's candidates (pi_F), each code with the number
    # of pre-target encounters that record it, checked against SQL over the pre-target events.
    key = ["trajectory_id", "rank"]
    candidates = wh.read("candidates", run_id="fc-test", stage="candidate_generation").sort(key)
    assert candidates.select(*key, "code", "score").equals(rankings.sort(key).select(*key, "code", "score"))
    assert candidates["system"].unique().to_list() == ["ehr_prior"]
    expected = wh.connect().sql("""
        SELECT c.trajectory_id, c.rank, count(DISTINCT p.encounter_id)::INT AS history_count
        FROM candidates c LEFT JOIN pretarget_events p ON p.trajectory_id = c.trajectory_id AND p.code = c.code
        WHERE c.run_id = 'fc-test' GROUP BY ALL ORDER BY ALL""").pl()
    assert candidates.select(*key, "history_count").equals(expected)
    assert (candidates["history_count"] > 0).any() and (candidates["history_count"] == 0).any()
    # No planted target code anywhere in the forecasting store the forecast wrote to (Ω lists them
    # legitimately and is not scanned): rankings, candidates, the prediction cache, statuses.
    texts = forecast_store_texts(wh.forecast_dir)
    assert {"rankings", "candidates", "prediction_cache"} <= {name.split("/")[0] for name in texts}
    assert not [name for name, values in texts.items() if any("ZZSENT" in value for value in values)]
    # A rerun of the system first clears its own stage's candidates, not another stage's of the run.
    wh.write("candidates", candidates.with_columns(pl.lit("direct_forecast").alias("stage")), run_id="fc-test",
             stage="direct_forecast", shard=0)
    # ...and the lists of a system that fused its lists (made from the lists being replaced), not others'.
    for other in ("rrf_prior_direct", "repeat_history"):
        wh.write("rankings", rankings.with_columns(pl.lit(other).alias("system")), run_id="fc-test", system=other,
                 shard=0)
        wh.write("ranking_status", status.with_columns(pl.lit(other).alias("system")), run_id="fc-test",
                 system=other, shard=0)
    for kind in ("forecast:rrf_prior_direct", "forecast:repeat_history", "evaluate"):
        record_run(wh, "fc-test", cohort, kind, {}, "finished", datetime.now(), datetime.now())
    assert clear_outputs(wh, "fc-test", "ehr_prior", {}) == ["rrf_prior_direct"]
    assert wh.read("candidates", run_id="fc-test")["stage"].unique().to_list() == ["direct_forecast"]
    for table in ("rankings", "ranking_status"):
        assert wh.read(table, run_id="fc-test")["system"].unique().to_list() == ["repeat_history"]
    # The registry no longer calls finished what was removed: the fused forecast and the evaluation.
    statuses = dict(wh.read("runs", run_id="fc-test").select("kind", "status").iter_rows())
    assert statuses == {"forecast:rrf_prior_direct": "stale", "forecast:repeat_history": "finished",
                        "evaluate": "stale"}


@pytest.mark.parametrize("k", [5, 22])  # the planted cohort's model knows 24 output codes
def test_candidate_generation_holds_the_priors_20_codes_whatever_k_the_rankings_hold(trained, k):
    wh, cohort, _, _ = trained
    run_id = f"fc-k{k}"
    trajectories = wh.read("trajectories", cohort_id=cohort)
    for shard in sorted(trajectories["shard"].unique()):
        forecast_shard_task.fn(str(wh.root), cohort, "ehr_prior", shard, "all", k, run_id)
    rankings = wh.read("rankings", run_id=run_id, system="ehr_prior")
    candidates = wh.read("candidates", run_id=run_id, stage="candidate_generation")
    assert rankings.group_by("trajectory_id").len()["len"].unique().to_list() == [k]
    assert candidates.group_by("trajectory_id").len()["len"].unique().to_list() == [20]
    assert wh.read("ranking_status", run_id=run_id)["status"].unique().to_list() == ["ok"]
    # The ranks both hold are one list: the forecast's K cuts it, it does not reorder it.
    key = ["trajectory_id", "rank"]
    both = rankings.join(candidates, on=key, suffix="_candidate")
    assert both.height == trajectories.height * min(k, 20)
    assert both["code"].to_list() == both["code_candidate"].to_list()


def test_a_model_trained_on_codes_the_cohorts_vocabulary_no_longer_holds_is_refused(trained):
    # A cohort rebuilt under its id with another Ω (e.g. an ICD release update): the model would rank codes outside it.
    wh, cohort, result, _ = trained
    omega = wh.read("cohort_vocabulary", cohort_id=cohort)
    fitted = RegisteredPrior()
    fitted.fit(wh.connect(), cohort)
    dropped = fitted.vocab.output_codes[0]
    wh.write("cohort_vocabulary", omega.filter(pl.col("code") != dropped), cohort_id=cohort)
    try:
        with pytest.raises(ConfigError) as refused:
            RegisteredPrior().fit(wh.connect(), cohort)
    finally:
        wh.write("cohort_vocabulary", omega, cohort_id=cohort)
    assert str(refused.value) == (
        f"ehr_prior-{cohort} version {result.version} was trained when cohort {cohort}'s vocabulary held codes that it "
        f"no longer holds (1, e.g. {dropped}): the cohort was rebuilt with another vocabulary since; train the model "
        f"again (dxr prior train --cohort {cohort} --system ehr_prior)")


def test_a_later_forecast_with_the_same_model_version_reads_the_prediction_cache(trained, monkeypatch):
    wh, cohort, _, _ = trained
    trajectories, pretarget = shard_inputs(wh, cohort, 0, "all")
    forecaster = RegisteredPrior()
    forecaster.fit(wh.connect(), cohort)
    k = 15  # a K no other test forecasts with: the first call below cannot find its key
    first, first_status, cached = cached_forecast_shard(wh, forecaster, trajectories, pretarget, k, "cache-1",
                                                        cohort, 0)
    assert not cached and first.height == k * trajectories.height
    entry = wh.read("prediction_cache", system="ehr_prior")
    key_inputs = json.loads(entry.filter(pl.col("key_json").str.contains('"k": 15'))["key_json"][0])
    assert key_inputs["model"] == {"registered_model": f"ehr_prior-{cohort}", "version": "1",
                                   "mlflow_run_id": forecaster.run_id}
    assert (key_inputs["cohort_id"], key_inputs["shard"], key_inputs["n_trajectories"]) == (cohort, 0,
                                                                                           trajectories.height)

    def no_prediction(*args):
        raise AssertionError("the model was asked again for lists the cache holds")

    # Another run id, a fresh process's forecaster: the same lists, from the cache, without the model.
    again = RegisteredPrior()
    again.fit(wh.connect(), cohort)
    monkeypatch.setattr(again, "predict", no_prediction)
    second, second_status, cached = cached_forecast_shard(wh, again, trajectories, pretarget, k, "cache-2", cohort, 0)
    assert cached
    assert second.drop("run_id").equals(first.drop("run_id")) and second["run_id"].unique().to_list() == ["cache-2"]
    assert second_status.drop("run_id").equals(first_status.drop("run_id"))

    # Fewer trajectories, another pre-target file or another model version: other keys, so predicted anew.
    assert not cached_forecast_shard(wh, forecaster, trajectories.head(2), pretarget, k, "cache-3", cohort, 0)[2]
    pretarget_file = wh.partition_path("pretarget_events", cohort_id=cohort, shard=0)
    original = pretarget_file.read_bytes()
    try:
        wh.write("pretarget_events", wh.read("pretarget_events", cohort_id=cohort, shard=0).head(-1),
                 cohort_id=cohort, shard=0)
        assert not cached_forecast_shard(wh, forecaster, trajectories, pretarget, k, "cache-4", cohort, 0)[2]
    finally:
        pretarget_file.write_bytes(original)
    other = train_prior(str(wh.root), cohort, "ehr_prior", PriorConfig(**TINY, epochs=1, promote=False))
    tracking.MlflowClient().set_registered_model_alias(other.registered_model, "cache-test", other.version)
    challenger = RegisteredPrior(PriorConfig(alias="cache-test"))
    challenger.fit(wh.connect(), cohort)
    assert challenger.model_key["version"] == other.version != "1"
    assert not cached_forecast_shard(wh, challenger, trajectories, pretarget, k, "cache-5", cohort, 0)[2]


def test_a_forecast_at_another_torch_thread_count_predicts_anew_and_is_cached_under_that_count(trained):
    wh, cohort, _, _ = trained
    trajectories, pretarget = shard_inputs(wh, cohort, 0, "all")
    forecaster = RegisteredPrior()
    forecaster.fit(wh.connect(), cohort)
    k = 13  # a K no other test forecasts with: the first call below cannot find its key
    fitted_threads = torch.get_num_threads()
    assert not cached_forecast_shard(wh, forecaster, trajectories, pretarget, k, "threads-1", cohort, 0)[2]
    assert cached_forecast_shard(wh, forecaster, trajectories, pretarget, k, "threads-2", cohort, 0)[2]
    # Scores summed over another number of threads round otherwise: those lists are not the cached ones.
    torch.set_num_threads(fitted_threads + 1)
    try:
        assert not cached_forecast_shard(wh, forecaster, trajectories, pretarget, k, "threads-3", cohort, 0)[2]
        assert cached_forecast_shard(wh, forecaster, trajectories, pretarget, k, "threads-4", cohort, 0)[2]
    finally:
        torch.set_num_threads(fitted_threads)
    keys = wh.read("prediction_cache", system="ehr_prior").filter(pl.col("key_json").str.contains('"k": 13'))
    assert sorted(json.loads(key)["inference_threads"] for key in keys["key_json"].unique()) == [
        fitted_threads, fitted_threads + 1]


def test_a_trajectorys_list_is_the_same_in_any_batch_and_each_batch_size_is_cached_apart(trained):
    wh, cohort, _, _ = trained
    trajectories, pretarget = shard_inputs(wh, cohort, 0, "all")
    lists = {}
    for size in (1024, 3, 1):  # one batch for the shard; batches of records of like length; one record a batch
        forecaster = RegisteredPrior(PriorConfig(predict_batch_size=size))
        forecaster.fit(wh.connect(), cohort)
        lists[size] = forecaster.predict(trajectories, pretarget, 20).sort("trajectory_id", "rank")
    alone = pl.concat(forecaster.predict(trajectories.filter(pl.col("trajectory_id") == trajectory), pretarget, 20)
                      for trajectory in trajectories["trajectory_id"].head(5))
    for other in (lists[3], lists[1], alone):
        together = lists[1024].join(other, on=["trajectory_id", "rank"], suffix="_other")
        # Each rank's score within rounding (a trajectory given another's results would fail here); a code may differ
        # only where rounding swapped two near-tied codes, which another CPU's arithmetic could do.
        assert together.height == other.height
        assert (together["score"] - together["score_other"]).abs().max() < 1e-5
        assert (together["code"] == together["code_other"]).mean() > 0.99
    key = ["trajectory_id", "rank"]
    assert lists[3].select(key).equals(lists[1024].select(key)) and lists[3].height == trajectories.height * 20
    # Scores of another batching may round otherwise: its lists are cached under their own key.
    k = 17  # a K no other test forecasts with
    small, large = (RegisteredPrior(PriorConfig(predict_batch_size=size)) for size in (1, 1024))
    for forecaster in (small, large):
        forecaster.fit(wh.connect(), cohort)
    assert not cached_forecast_shard(wh, large, trajectories, pretarget, k, "batch-1", cohort, 0)[2]
    assert not cached_forecast_shard(wh, small, trajectories, pretarget, k, "batch-2", cohort, 0)[2]
    assert cached_forecast_shard(wh, small, trajectories, pretarget, k, "batch-3", cohort, 0)[2]
    keys = wh.read("prediction_cache", system="ehr_prior").filter(pl.col("key_json").str.contains('"k": 17'))
    assert sorted(json.loads(key)["predict_batch_size"] for key in keys["key_json"].unique()) == [1, 1024]


def test_no_held_out_or_tuning_target_reaches_training(trained):
    wh, cohort, _, _ = trained
    data = PriorDataModule(wh.connect(), cohort, PriorConfig(**TINY))
    data.setup()
    forbidden = set(SENTINELS.values())
    assert forbidden <= set(data.vocab.omega)  # they are valid codes, so only the boundary keeps them out
    assert not forbidden & (set(data.vocab.input_codes) | set(data.vocab.output_codes))
    train_subjects = set(data.train_set.t.keys)
    assert train_subjects and not train_subjects & set(SENTINELS)
    # Validation pairs come from tuning pre-target records, whose targets (with sentinels) are gold only.
    assert all(":" in key for key in data.val_set.t.keys) and len(data.val_set) > 0
    # The registered model's learned vocabularies (not Ω, which lists them legitimately) exclude them too.
    model_dir = next((wh.root / "mlflow" / "cache").glob("ehr_prior-*/v1-*"))
    logged = json.loads(next(model_dir.rglob("vocabulary.json")).read_text())
    assert not forbidden & (set(logged["input_codes"]) | set(logged["output_codes"]))


def test_cli_help_and_an_unknown_cohort_in_one_line_before_a_prefect_server_starts(prefect_harness, tmp_path,
                                                                                     monkeypatch):
    runner = CliRunner()
    assert "dxr prior train --cohort default" in runner.invoke(main, ["prior", "train", "--help"]).output
    # A typo must not cost a temporary server's start (seconds) and print the error again in the failed flow's log.
    started = []
    monkeypatch.setattr("flows.api_server.start_temporary_api", lambda: started.append("server"))
    wh = Warehouse(tmp_path)
    write_planted_cohort(wh, n_patients=3, seed=4)
    result = runner.invoke(main, ["--data-dir", str(tmp_path), "prior", "train", "--cohort", "nope"])
    assert (result.exit_code, result.stdout, started) == (1, "", [])
    assert result.stderr == (f"Error: cohort 'nope' not found in the warehouse at {tmp_path}; built cohorts: "
                             f"{wh.read('cohorts')['name'][0]} (list them with `dxr cohort list`, build one with "
                             "`dxr cohort build`, or check --data-dir)\n")


def test_cli_trains_every_system_under_the_given_run_id(prefect_harness, tmp_path):
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=60, seed=4)
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "prior", "train", "--cohort", cohort,
                                       "--system", "gru", "--system", "dense_prior", "--epochs", "1",
                                       "--run-id", "cli-train-1"])
    assert result.exit_code == 0, result.output
    assert re.findall(r"(\w+): registered ", result.output) == ["gru", "dense_prior"]
    runs = Warehouse(tmp_path).read("runs").sort("kind")
    assert runs.select("run_id", "kind", "status", "cohort_id").rows() == [
        ("cli-train-1", "train:dense_prior", "finished", cohort), ("cli-train-1", "train:gru", "finished", cohort)]


def test_a_cohort_without_tuning_pairs_says_so_instead_of_a_nan_recall(prefect_harness, tmp_path):
    # Three planted patients are all train (SPLIT_CYCLE), as the MIMIC-III demo's two tuning patients have one
    # visit each before their target: nothing to validate on, so the last epoch's weights are registered.
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=3, seed=4)
    with prior_log_lines() as lines, warnings.catch_warnings(record=True) as warned:
        train_prior(str(tmp_path), cohort, "gru", PriorConfig(**TINY, epochs=1), run_id="no-tuning-1")
    assert [re.sub(r"loss \d+\.\d{4}(.*) after \d+\.\d s$", r"loss L\1 after S s", line) for line in lines[1:]] == [
        "gru epoch 1/1: train loss L, tuning P@20, R@20 n/a (no tuning pair) after S s"]
    assert re.fullmatch(r"gru: \d+ training sequences \(3 train patients\) and 0 tuning pairs featurized in \d+\.\d s",
                        lines[0]), lines
    # Lightning warned that the empty tuning loader's "total length across ranks is zero", beside dxr's own line.
    empty_loader = THIRD_PARTY_NOISE["Lightning's warning of a loader of length zero"]
    assert [str(w.message) for w in warned if re.search(empty_loader, str(w.message))] == []
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "prior", "train", "--cohort", cohort,
                                       "--system", "gru", "--epochs", "2", "--run-id", "no-tuning-2"])
    assert result.exit_code == 0, result.output
    line = re.search(r"gru: registered .*", result.output).group(0)
    assert re.sub(r"in \d+ s \(mlflow run \w+\)$", "in S s", line) == (
        f"gru: registered gru-{cohort} v2 @champion; no tuning pair to validate on (kept the last epoch, 2), "
        "3 train patients in S s")


def test_training_logs_its_batches_within_an_epoch_beside_the_epoch_lines(tmp_path, monkeypatch):
    # A first epoch at 100,000 patients took minutes with nothing in a log between the featurizing line and its own.
    import models.prior.train

    monkeypatch.setattr(models.prior.train, "PROGRESS_SECONDS", 0.0)  # a line after each batch
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=60, seed=4)
    with prior_log_lines() as lines:
        result = train_prior(str(tmp_path), cohort, "gru", PriorConfig(**TINY, epochs=1), run_id="batches-1")
    batches = -(-result.n_train_sequences // TINY["batch_size"])
    assert batches > 1
    assert [re.sub(r"in \d+\.\d s$", "in S s", line) for line in lines[1:-1]] == [
        f"gru epoch 1/1: {done}/{batches} batches in S s" for done in range(1, batches + 1)]
    assert lines[-1].startswith("gru epoch 1/1: train loss "), lines


def test_training_and_forecasting_print_dxrs_lines_and_no_third_party_noise(prefect_harness, tmp_path):
    """Each command in a process of its own with piped output, as `make demo > log` runs: what a user sees."""
    from prefect.settings import PREFECT_API_URL

    # The demo's training runs in a data dir of its own, at the same time as the CLI's training and forecast.
    cohort = write_planted_cohort(Warehouse(tmp_path / "demo"), n_patients=60, seed=4)
    assert write_planted_cohort(Warehouse(tmp_path / "data"), n_patients=60, seed=4) == cohort
    config = tmp_path / "dxr.toml"
    config.write_text("[prior]\n" + "".join(f"{key} = {value!r}\n" for key, value in {**TINY, "epochs": 2}.items()))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "DXR_CONFIG": str(config)}
    # The demo's training (its task, which asks for progress, in a flow), the CLI's training and a forecast.
    demo_training = (f"from dxr.config import load_settings\nfrom flows.demo import ensure_prior_task\n"
                     f"from prefect import flow\nfrom warehouse.store import Warehouse\n"
                     f"data_dir = {str(tmp_path / 'demo')!r}\n"
                     f"flow(name='demo')(lambda: ensure_prior_task(Warehouse(data_dir), {cohort!r}, "
                     f"load_settings(data_dir=data_dir)))()")
    dxr = [sys.executable, "-m", "dxr", "--data-dir", str(tmp_path / "data")]
    demo = subprocess.Popen([sys.executable, "-c", demo_training], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=Path(__file__).parents[1])
    outputs = {}
    try:
        # Two systems: the second fit runs after MLflow registered the first (see `dxr.noise.LIGHTNING_LOGGERS`).
        for name, command in (("dxr prior train", [*dxr, "prior", "train", "--cohort", cohort, "--system", "ehr_prior",
                                                   "--system", "gru"]),
                              ("dxr forecast", [*dxr, "forecast", "--cohort", cohort, "--system", "ehr_prior"])):
            ended = subprocess.run(command, capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1],
                                   timeout=600)
            assert ended.returncode == 0, (name, ended.stdout, ended.stderr)
            outputs[name] = ended.stdout + ended.stderr
        stdout, stderr = demo.communicate(timeout=600)
        assert demo.returncode == 0, ("demo training", stdout, stderr)
        outputs["demo training"] = stdout + stderr
    finally:
        demo.kill()  # still running only when a check above failed
    for name, output in outputs.items():
        for noise, pattern in THIRD_PARTY_NOISE.items():
            assert not re.search(pattern, output), f"{noise} in the output of {name}:\n{output}"
    for name in ("demo training", "dxr prior train"):
        epochs = re.findall(r"ehr_prior epoch (\d)/2: train loss \d+\.\d{4}, tuning P@20 \d\.\d{4}, R@20 \d\.\d{4} "
                            r"after \d+\.\d s$",
                            outputs[name], re.MULTILINE)
        assert epochs == ["1", "2"], f"dxr's epoch lines missing from the output of {name}:\n{outputs[name]}"
        featurized = r"ehr_prior: \d+ training sequences \(\d+ train patients\) and \d+ tuning pairs featurized in "
        assert len(re.findall(featurized + r"\d+\.\d s$", outputs[name], re.MULTILINE)) == 1, outputs[name]
    assert re.search(f"^ehr_prior: registered ehr_prior-{cohort} v1 @champion; val R@20 ", outputs["dxr prior train"],
                     re.MULTILINE), outputs["dxr prior train"]


def test_a_rerun_of_a_finished_training_returns_it_and_registers_nothing(trained):
    wh, cohort, first, _ = trained
    tracking.use_tracking(wh.root, None, PriorConfig().experiment)  # other tests point MLflow at their own stores
    versions = tracking.registered_versions("ehr_prior", cohort)
    again = train_prior(str(wh.root), cohort, "ehr_prior", PriorConfig(**TINY, epochs=2), run_id="train-test-1")
    assert again == first
    assert tracking.registered_versions("ehr_prior", cohort) == versions
    # Other settings under the same run id are another training.
    other = train_prior(str(wh.root), cohort, "ehr_prior", PriorConfig(**TINY, epochs=1, promote=False),
                        run_id="train-test-1")
    assert other.mlflow_run_id != first.mlflow_run_id
    assert len(tracking.registered_versions("ehr_prior", cohort)) == len(versions) + 1


def test_a_rerun_of_a_finished_training_names_the_alias_only_where_it_points_now(tmp_path):
    # The rerun returned the alias recorded at the first training, so `dxr prior train` printed "v1 @champion"
    # while the champion was another version: a user took a model out of service for the one in service.
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=60, seed=4)
    cfg = PriorConfig(**TINY, epochs=1)
    first = train_prior(str(tmp_path), cohort, "ehr_prior", cfg, run_id="train-first")
    later = train_prior(str(tmp_path), cohort, "ehr_prior", cfg, run_id="train-later")
    assert (first.version, first.alias, later.version, later.alias) == ("1", "champion", "2", "champion")
    again = train_prior(str(tmp_path), cohort, "ehr_prior", cfg, run_id="train-first")
    assert (again.version, again.alias) == ("1", None)
    assert tracking.resolve_alias("ehr_prior", cohort, "champion")[0] == "2"  # the rerun moves nothing
    assert train_prior(str(tmp_path), cohort, "ehr_prior", cfg, run_id="train-later") == later


def test_a_retry_ends_the_mlflow_run_a_killed_attempt_left_running(tmp_path):
    # A training killed by SIGKILL (a served flow run, the OOM killer) never ends its MLflow run, which the MLflow UI
    # then showed RUNNING for good beside the retry's; the warehouse's `running` row of it becomes `killed`.
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=60, seed=4)
    cfg = PriorConfig(**TINY, epochs=1)
    identity = training_identity("train-killed", {"system": "gru", "cohort": cohort, "prior": cfg.model_dump()})
    tracking.use_tracking(tmp_path, None, cfg.experiment)
    client = tracking.MlflowClient()
    experiment = client.get_experiment_by_name(cfg.experiment).experiment_id
    tags = {**identity, "system": "gru"}  # as train_prior_model tags its MLflow run
    killed = client.create_run(experiment, tags=tags).info.run_id  # what the killed attempt left: RUNNING
    # An attempt killed under other settings (the retry changed --epochs, say) is as dead.
    killed_other_cfg = client.create_run(experiment, tags={**tags, "dxr.training": "0123456789abcdef"}).info.run_id
    # Another run's training, and another system's training in this run (its own lock), may be alive.
    other_run = client.create_run(experiment, tags={**tags, "dxr.run_id": "train-alive"}).info.run_id
    other_system = client.create_run(experiment, tags={**tags, "system": "dense_prior"}).info.run_id

    result = train_prior(str(tmp_path), cohort, "gru", cfg, run_id="train-killed")

    assert [client.get_run(r).info.status for r in (killed, killed_other_cfg, result.mlflow_run_id, other_run,
                                                     other_system)] == [
        "KILLED", "KILLED", "FINISHED", "RUNNING", "RUNNING"]


def test_a_training_ends_the_mlflow_run_of_a_training_killed_under_another_run_id(tmp_path):
    # Without --run-id each training gets a run id of its own, so no retry looked for the MLflow run of one that was
    # killed: it stayed RUNNING for good. The registry records that training as killed (`mark_killed`).
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    cfg = PriorConfig(**TINY, epochs=1)
    tracking.use_tracking(tmp_path, None, cfg.experiment)
    client = tracking.MlflowClient()
    experiment = client.get_experiment_by_name(cfg.experiment).experiment_id
    record_run(wh, "train-killed", cohort, "train:gru", {}, "killed", datetime(2026, 12, 5))
    # Killed; still training (its record lock held); and a run that another data dir sharing the store recorded.
    attempts = {run_id: client.create_run(experiment, tags={"dxr.run_id": run_id, "system": "gru"}).info.run_id
                for run_id in ("train-killed", "train-alive", "train-elsewhere")}
    client.log_text(attempts["train-killed"], "{}", "prior_config.json")  # what it logged before it was killed

    with registered_run(wh, "train:gru", {}, run_id="train-alive", cohort_id=cohort):
        result = train_prior(str(tmp_path), cohort, "gru", cfg)

    assert {run_id: client.get_run(mlflow_run).info.status for run_id, mlflow_run in attempts.items()} == {
        "train-killed": "KILLED", "train-alive": "RUNNING", "train-elsewhere": "RUNNING"}
    assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    # Its artifacts stay, as a failed run's do, until the user deletes the run and runs `mlflow gc`.
    assert [f.path for f in client.list_artifacts(attempts["train-killed"])] == ["prior_config.json"]


def test_a_retried_train_prior_flow_run_does_not_train_the_finished_systems_again(prefect_harness, tmp_path,
                                                                                  monkeypatch):
    import models.prior.train
    from flows.train_prior import train_prior_flow

    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=60, seed=4)
    real_train, calls = models.prior.train.train_prior_model, []

    def dense_fails_the_first_time(connection, cohort_id, system, *args, **kwargs):
        calls.append(system)
        if system == "dense_prior" and calls.count(system) == 1:
            raise OSError("no space left on device")
        return real_train(connection, cohort_id, system, *args, **kwargs)

    monkeypatch.setattr(models.prior.train, "train_prior_model", dense_fails_the_first_time)
    flow = train_prior_flow.with_options(retries=1, retry_delay_seconds=0)
    results = flow(str(tmp_path), cohort, ("gru", "dense_prior"), PriorConfig(**TINY, epochs=1))

    assert calls == ["gru", "dense_prior", "dense_prior"]
    assert [(r["system"], r["version"]) for r in results] == [("gru", "1"), ("dense_prior", "1")]
    assert [len(tracking.registered_versions(s, cohort)) for s in ("gru", "dense_prior")] == [1, 1]
    runs = Warehouse(tmp_path).read("runs").sort("kind")
    assert runs["run_id"].n_unique() == 1 and runs["run_id"][0].startswith("train-")
    assert runs.select("kind", "status").rows() == [("train:dense_prior", "finished"), ("train:gru", "finished")]


def test_a_retry_after_a_failure_past_registration_reuses_the_registered_version(prefect_harness, tmp_path,
                                                                                 monkeypatch):
    # The first attempt registers version 1, then fails putting it in service (a tracking-server hiccup; as
    # well a crash before the run is recorded finished). The retry trained again and registered version 2.
    import models.prior.train
    from flows.train_prior import train_prior_flow

    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=60, seed=4)
    real_train, calls = models.prior.train.train_prior_model, []

    def counted(connection, cohort_id, system, *args, **kwargs):
        calls.append(system)
        return real_train(connection, cohort_id, system, *args, **kwargs)

    real_alias, aliased = tracking.MlflowClient.set_registered_model_alias, []

    def alias_fails_the_first_time(client, name, alias, version):
        aliased.append(version)
        if len(aliased) == 1:
            raise MlflowException("database is locked")
        return real_alias(client, name, alias, version)

    monkeypatch.setattr(models.prior.train, "train_prior_model", counted)
    monkeypatch.setattr(tracking.MlflowClient, "set_registered_model_alias", alias_fails_the_first_time)
    flow = train_prior_flow.with_options(retries=1, retry_delay_seconds=0)
    [result] = flow(str(tmp_path), cohort, ("gru",), PriorConfig(**TINY, epochs=1))

    assert calls == ["gru"]
    assert aliased == ["1", "1"]
    assert (result["version"], result["alias"]) == ("1", "champion")
    assert [v["version"] for v in tracking.registered_versions("gru", cohort)] == ["1"]
    assert tracking.resolve_alias("gru", cohort, "champion") == ("1", result["mlflow_run_id"])
    first_attempt = tracking.MlflowClient().get_run(result["mlflow_run_id"])
    assert result["metrics"] == {**first_attempt.data.metrics, "selected_epoch": 0}
    runs = Warehouse(tmp_path).read("runs")
    assert runs.select("kind", "status").rows() == [("train:gru", "finished")]
    assert json.loads(runs["config_json"][0])["result"] == result


def test_a_train_prior_run_given_part_of_cfg_keeps_the_configured_prior_settings(prefect_harness, tmp_path,
                                                                              monkeypatch):
    # Prefect merges a run's parameters into the deployment's one level deep: `prefect deployment run
    # train_prior/adhoc --param cfg='{"promote": false}'` got every other prior setting at its default, and
    # trained into the default experiment under the default alias instead of the configured ones.
    from flows.train_prior import train_prior_flow

    (tmp_path / "dxr.toml").write_text(
        '[prior]\nexperiment = "nightly-priors"\nalias = "production"\nn_heads = 2\nn_experts = 2\n')
    monkeypatch.setenv("DXR_CONFIG", str(tmp_path / "dxr.toml"))
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=60, seed=4)
    run_form = {key: value for key, value in TINY.items() if key != "n_heads"} | {"epochs": 1, "promote": False}
    [result] = train_prior_flow(str(tmp_path), cohort, ("gru",), PriorConfig.model_validate(run_form))
    [run_id] = Warehouse(tmp_path).read("runs")["run_id"]
    assert flow_run_names("train_prior", (run_id,)) == [f"train-{cohort}"]  # the UI's list names the cohort

    recorded = json.loads(Warehouse(tmp_path).read("runs")["config_json"][0])["prior"]
    assert (recorded["experiment"], recorded["alias"], recorded["n_heads"]) == ("nightly-priors", "production", 2)
    assert (recorded["epochs"], recorded["promote"], recorded["d_model"]) == (1, False, 16)
    assert tracking.MlflowClient().get_run(result["mlflow_run_id"]).info.experiment_id == \
        tracking.MlflowClient().get_experiment_by_name("nightly-priors").experiment_id
    # A run's cfg valid alone that clashes with the configuration is one error, before any training.
    with pytest.raises(InputError, match=r"^cfg of this run: top_k 3 cannot exceed n_experts 2 with the configured "
                                         r"prior settings \(the run sets top_k\): set the clashing settings in cfg "
                                         r"together$"):
        train_prior_flow(str(tmp_path), cohort, ("gru",), PriorConfig.model_validate({"top_k": 3}))
    assert Warehouse(tmp_path).read("runs").height == 1


@pytest.mark.parametrize(("systems", "message"), [
    ((), "no system given: name at least one of ehr_prior, dense_prior, gru"),
    (("gru", "repeat_history"), "unknown prior system 'repeat_history': use one of ehr_prior, dense_prior, gru"),
    (("gru", "dense_prior", "gru"), "gru is listed twice in systems: list each system once"),
])
def test_the_systems_of_a_train_prior_flow_are_checked_before_any_training(prefect_harness, tmp_path, systems,
                                                                           message):
    # Typed into train_prior/adhoc's run form: an empty list finished without training anything, and a typo
    # in the second system failed only after the first one had been trained and registered.
    from flows.train_prior import train_prior_flow

    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=20, seed=4)
    with pytest.raises(InputError, match=f"^{re.escape(message)}$"):
        train_prior_flow(str(tmp_path), cohort, systems, PriorConfig(**TINY, epochs=1))
    assert Warehouse(tmp_path).read("runs").is_empty()


def test_a_training_of_a_cohort_cut_by_other_rules_warns_once_naming_it_and_the_rebuild(wh_vocab, tmp_path):
    # A forecast of such a cohort warned; its training, which selects its epoch on the tuning pre-target records the
    # cohort's rules cut, said nothing.
    from tests.conftest import write_tiny_meds
    from warehouse.cohorts import CUT_RULE_VERSION, CohortOptions, build_cohort
    from warehouse.datasets import ingest_meds

    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "meds"), "tiny")
    cohort_id = build_cohort(wh_vocab, "tiny", "every0", CohortOptions(target="every", min_history=0),
                             seed=7)["cohort_id"]
    cfg = PriorConfig(**TINY, epochs=1)
    warned = LoggedMessages(logging.WARNING)
    logger = logging.getLogger("tasks.prior")  # outside a flow, the stage logs to its module logger
    logger.addHandler(warned)
    try:
        train_prior(str(wh_vocab.root), "every0", "gru", cfg)
        assert warned.lines == []  # a fresh build records the current version
        # The cohorts row as a dxr before cut rules were versioned wrote it: its Parquet file has no such column.
        wh_vocab.read("cohorts", cohort_id=cohort_id).drop("cut_rule_version").write_parquet(
            wh_vocab.partition_path("cohorts", cohort_id=cohort_id))
        train_prior(str(wh_vocab.root), "every0", "gru", cfg)
    finally:
        logger.removeHandler(warned)
    assert warned.lines == [
        f"cohort every0 ({cohort_id}) was cut before cut rules were versioned, not by this dxr's version "
        f"{CUT_RULE_VERSION}: its trajectories, targets and pre-target records may differ from what a build makes "
        "now; this training validates on its tuning records as they are, and `dxr cohort build --dataset tiny "
        "--name every0 --target every --harmonize native --min-history 0` cuts it again"]


def test_an_unknown_system_is_refused_before_a_training_run_is_registered(tmp_path):
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=20, seed=4)
    with pytest.raises(InputError, match="unknown prior system 'repeat_history': use one of ehr_prior"):
        train_prior(str(tmp_path), cohort, "repeat_history", PriorConfig(), run_id="typo-1")
    assert Warehouse(tmp_path).read("runs").is_empty()


def test_prior_models_refuses_a_system_listed_twice(tmp_path):
    # `dxr prior train` refuses it; `dxr prior models` listed every version of the system twice.
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=20, seed=4)
    listed = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "prior", "models", "--cohort", cohort,
                                       "--system", "gru", "--system", "ehr_prior", "--system", "gru"])
    assert (listed.exit_code, listed.output) == (
        2, "Error: Invalid value for '--system': gru is listed twice in systems: list each system once "
           "(usage: main prior models -h)\n")


def test_another_tracking_store_does_not_reuse_the_cached_model_of_the_same_version(tmp_path):
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    cfg = PriorConfig(**{**TINY, "seed": 1}, epochs=1)
    first = train_prior(str(tmp_path), cohort, "ehr_prior", cfg)
    old = RegisteredPrior(cfg)
    old.fit(wh.connect(), cohort)
    # A new store (here: another sqlite file; likewise a reset one) numbers its versions from 1 again.
    other = cfg.model_copy(update={"seed": 2, "tracking_uri": f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}"})
    (tmp_path / "other").mkdir()
    second = train_prior(str(tmp_path), cohort, "ehr_prior", other)
    assert first.version == second.version == "1" and first.mlflow_run_id != second.mlflow_run_id
    run = tracking.MlflowClient().get_run(second.mlflow_run_id)
    assert run.info.artifact_uri.startswith((tmp_path / "other" / "artifacts").as_uri())  # beside its store
    new = RegisteredPrior(other)
    new.fit(wh.connect(), cohort)
    assert new.run_id == second.mlflow_run_id
    assert not all(torch.equal(a, b) for a, b in zip(old.net.state_dict().values(), new.net.state_dict().values()))


def file_digests(root) -> dict[str, str]:
    """Every file under `root` by relative path, with a digest of its bytes."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file()}


def test_a_copied_data_dir_trains_and_forecasts_with_its_own_mlflow_artifacts_only(tmp_path):
    original, copy = tmp_path / "prod", tmp_path / "trial"
    cohort = write_planted_cohort(Warehouse(original), n_patients=60, seed=4)
    cfg = PriorConfig(**TINY, epochs=1)
    first = train_prior(str(original), cohort, "ehr_prior", cfg)
    served = RegisteredPrior(cfg)
    served.fit(Warehouse(original).connect(), cohort)
    shutil.copytree(original, copy)  # a team trying something on a copy of the production warehouse
    before = file_digests(original)
    second = train_prior(str(copy), cohort, "ehr_prior", cfg.model_copy(update={"seed": 2}))
    assert file_digests(original) == before  # MLflow recorded the original's artifact directory
    artifacts = (copy / "mlflow" / "artifacts").as_uri() + "/"
    client = tracking.MlflowClient()
    assert client.get_run(second.mlflow_run_id).info.artifact_uri.startswith(artifacts)
    for version in ("1", "2"):
        assert client.get_model_version_download_uri(second.registered_model, version).startswith(artifacts)
    # The original gone (moved, or a restored backup elsewhere) and the copy's model cache cleared: the copy
    # loads the version trained before it was copied from its own files and forecasts with its champion.
    shutil.rmtree(original)
    shutil.rmtree(copy / "mlflow" / "cache")
    wh = Warehouse(copy)
    again = RegisteredPrior(cfg, version="1", run_id=first.mlflow_run_id)
    again.fit(wh.connect(), cohort)
    assert all(torch.equal(a, b) for a, b in zip(served.net.state_dict().values(), again.net.state_dict().values(),
                                                 strict=True))
    result = CliRunner().invoke(main, ["--data-dir", str(copy), "forecast", "--cohort", cohort, "--system",
                                       "ehr_prior", "--split", "all", "--run-id", "trial-1"])
    assert result.exit_code == 0, result.output
    recorded = json.loads(wh.read("runs", run_id="trial-1", kind="forecast:ehr_prior")["config_json"][0])
    assert (recorded["model"]["version"], recorded["model"]["mlflow_run_id"]) == ("2", second.mlflow_run_id)
    assert wh.read("rankings", run_id="trial-1").height == 20 * wh.read("trajectories").height


def test_re_pointing_a_copied_store_is_said_in_one_line_once(tmp_path, caplog):
    # Without the line, a store opened under two paths (a container's mount and the host's) would flip silently.
    tracking.use_tracking(tmp_path / "prod", None, "dxr-ehr-prior")
    shutil.copytree(tmp_path / "prod", tmp_path / "trial")
    db = (tmp_path / "trial" / "mlflow" / "mlflow.db").resolve()
    caplog.set_level(logging.INFO, logger="models.prior.tracking")
    tracking.use_tracking(tmp_path / "trial", None, "dxr-ehr-prior")
    tracking.use_tracking(tmp_path / "trial", None, "dxr-ehr-prior")  # nothing left to re-point
    old, new = ((tmp_path / d / "mlflow" / "artifacts").resolve().as_uri() for d in ("prod", "trial"))
    assert [r.getMessage() for r in caplog.records if r.name == "models.prior.tracking"] == [
        f"MLflow store {db}: artifact locations recorded under {old} re-pointed to {new} (the data dir was moved, "
        "copied or restored)"]
    assert tracking.mlflow.get_experiment_by_name("dxr-ehr-prior").artifact_location == new


def test_a_data_dir_copied_without_its_mlflow_artifacts_says_so_when_loading(trained, tmp_path):
    # MLflow downloads nothing, without an error, from a local artifact location that does not exist.
    wh, cohort, result, _ = trained
    copy = Path(shutil.copytree(wh.root, tmp_path / "copy", ignore=shutil.ignore_patterns("artifacts", "cache")))
    try:
        with pytest.raises(NotFoundError) as raised:
            RegisteredPrior(PriorConfig(**TINY)).fit(Warehouse(copy).connect(), cohort)
        client = tracking.MlflowClient()
        location = client.get_model_version_download_uri(result.registered_model, "1")
    finally:
        tracking.use_tracking(wh.root, None, "dxr-ehr-prior")  # process-wide: later tests use the original
    assert location.startswith((copy / "mlflow" / "artifacts").as_uri() + "/models/m-")
    assert str(raised.value) == (
        f"{result.registered_model} version 1 has no model files at {location}: the MLflow store's artifacts are "
        "missing (a data dir moved, copied or restored without mlflow/artifacts?): copy them in with mlflow.db, or "
        f"train again with `dxr prior train --cohort {cohort} --system ehr_prior`")
    assert not (copy / "mlflow" / "cache" / result.registered_model / f"v1-{result.mlflow_run_id}").exists()


def test_a_damaged_default_store_is_one_line_naming_it(tmp_path):
    # What a truncated copy or backup of the database looks like to SQLite (MLflow raised a SQLAlchemy traceback).
    db = tmp_path / "mlflow" / "mlflow.db"
    db.parent.mkdir()
    db.write_bytes(b"SQLite format 3\x00" + b"\x01" * 200)
    with pytest.raises(ConfigError) as raised:
        tracking.use_tracking(tmp_path, None, "dxr-ehr-prior")
    assert str(raised.value) == (f"MLflow store {db} failed while checking where its artifacts are: file is not a "
                                 "database: it must be a readable and writable SQLite file (restore it from a backup "
                                 "if it is damaged)")


def test_models_the_store_in_force_does_not_hold_are_noted_with_the_store_they_were_registered_in(tmp_path):
    # `dxr prior models` printed "(0 rows)" and nothing else when prior.tracking_uri named another store than the
    # trainings had registered in, or when the store had been deleted: as if the cohort had never been trained.
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=60, seed=4)
    train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**TINY, epochs=1), run_id="train-kept")
    runner, other, store = CliRunner(), tmp_path / "other.db", tracking.mlflow.get_tracking_uri()
    listing = ["--data-dir", str(tmp_path), "prior", "models", "--cohort", cohort]
    try:
        elsewhere = runner.invoke(main, listing, env={"DXR_PRIOR__TRACKING_URI": f"sqlite:///{other}"})
        listed = runner.invoke(main, listing)
        shutil.rmtree(tmp_path / "mlflow")
        lost = runner.invoke(main, listing)
    finally:
        tracking.mlflow.set_tracking_uri(store)
    said = (f"note: the MLflow store {{}} holds no version of the ehr_prior model(s) of cohort {cohort}, though run(s) "
            "train-kept registered them")
    default = tracking.sqlite_uri(tracking.default_store(tmp_path))
    assert (elsewhere.exit_code, elsewhere.stdout.splitlines()[-1]) == (0, "(0 rows)")
    assert elsewhere.stderr == (said.format(f"sqlite:///{other}") + f" in {default}: set prior.tracking_uri (env "
                                "DXR_PRIOR__TRACKING_URI) to that store to list and use them\n")
    assert not other.exists()  # reading made no store
    assert (listed.stderr, listed.stdout.splitlines()[2].split()[:2]) == ("", ["ehr_prior", "1"])
    assert (lost.exit_code, lost.stdout.splitlines()[-1]) == (0, "(0 rows)")
    assert lost.stderr == (said.format(default) + " there: the store was replaced, reset or deleted since; restore "
                           f"it, or train again with `dxr prior train --cohort {cohort} --system ehr_prior`\n")


@pytest.mark.parametrize("configured", [False, True], ids=["default store", "configured store"])
def test_listing_the_models_of_a_damaged_store_is_one_line_naming_it(tmp_path, configured):
    # `dxr prior models` reads the store without re-pointing it, so the check `use_tracking` makes never ran: SQLite's
    # error left MLflow as SQLAlchemy's traceback, as it did for every command on a damaged configured store.
    cohort = write_planted_cohort(Warehouse(tmp_path / "wh"), n_patients=20, seed=4)
    db = tmp_path / "shared.db" if configured else tmp_path / "wh" / "mlflow" / "mlflow.db"
    db.parent.mkdir(exist_ok=True)
    db.write_bytes(b"\x01" * 4096)  # what a file overwritten or cut off at its start looks like to SQLite
    env = {"DXR_PRIOR__TRACKING_URI": f"sqlite:///{db}"} if configured else {}
    store = tracking.mlflow.get_tracking_uri()
    try:
        listed = CliRunner(env=env).invoke(main, ["--data-dir", str(tmp_path / "wh"), "prior", "models",
                                                  "--cohort", cohort, "--system", "ehr_prior"])
    finally:
        tracking.mlflow.set_tracking_uri(store)  # process-wide: later tests must not meet the damaged file
    assert (listed.exit_code, listed.output) == (
        1, f"Error: MLflow store sqlite:///{db} failed while listing the versions of ehr_prior-{cohort}: file is not a "
           "database: it must be a readable and writable database (restore it from a backup if it is damaged), or set "
           "prior.tracking_uri (env DXR_PRIOR__TRACKING_URI)\n")


@pytest.mark.parametrize("configured", [False, True], ids=["default store", "configured store"])
def test_listing_the_models_of_an_empty_store_file_leaves_it_as_it_is(tmp_path, configured):
    # MLflow created its whole schema in the file, in place: a read command wrote to the user's file, and a kill
    # among its migrations would have left the half-made store that dxr otherwise never makes in place.
    cohort = write_planted_cohort(Warehouse(tmp_path / "wh"), n_patients=20, seed=4)
    db = tmp_path / "shared.db" if configured else tmp_path / "wh" / "mlflow" / "mlflow.db"
    db.parent.mkdir(exist_ok=True)
    db.touch()
    env = {"DXR_PRIOR__TRACKING_URI": f"sqlite:///{db}"} if configured else {}
    listed = CliRunner(env=env).invoke(main, ["--data-dir", str(tmp_path / "wh"), "prior", "models",
                                              "--cohort", cohort])
    assert (listed.exit_code, listed.output.splitlines()[-1]) == (0, "(0 rows)"), listed.output
    assert db.stat().st_size == 0


def test_a_damaged_configured_store_is_one_line_naming_it(tmp_path):
    db = tmp_path / "shared.db"
    db.write_bytes(b"SQLite format 3\x00" + b"\x01" * 200)
    store = tracking.mlflow.get_tracking_uri()
    try:
        with pytest.raises(ConfigError) as raised:
            tracking.use_tracking(tmp_path / "wh", f"sqlite:///{db}", "dxr-ehr-prior")
    finally:
        tracking.mlflow.set_tracking_uri(store)
    assert str(raised.value) == (
        f"MLflow store sqlite:///{db} failed while opening experiment 'dxr-ehr-prior': file is not a database: it must "
        "be a readable and writable database (restore it from a backup if it is damaged), or set prior.tracking_uri "
        "(env DXR_PRIOR__TRACKING_URI)")


# A child process that is SIGKILLed while MLflow creates a store, right before the fifth of its schema migrations is
# stamped: MLflow commits each migration's tables apart from its stamp, so the file is left half made.
KILLED_AMONG_MIGRATIONS = """
import os, signal
from sqlalchemy import event
from sqlalchemy.engine import Engine

stamps = 0

@event.listens_for(Engine, "before_cursor_execute")
def kill_before_the_fifth_stamp(conn, cursor, statement, parameters, context, executemany):
    global stamps
    if statement.lstrip().upper().startswith("UPDATE ALEMBIC_VERSION"):
        stamps += 1
        if stamps == 5:
            os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_among_migrations(create_store: str) -> None:
    ended = subprocess.run([sys.executable, "-c", KILLED_AMONG_MIGRATIONS + create_store], capture_output=True,
                           text=True)
    assert ended.returncode == -signal.SIGKILL, ended.stderr[-2000:]


def test_a_default_store_killed_while_it_is_created_is_absent_and_the_next_use_creates_it(tmp_path):
    killed_among_migrations(f"from models.prior import tracking\ntracking.use_tracking({str(tmp_path)!r}, None, 'x')")
    store = tmp_path / "mlflow"
    assert not (store / "mlflow.db").exists()  # only the scratch of the creation, whose owner has ended
    uri = tracking.use_tracking(tmp_path, None, "dxr-ehr-prior")
    assert mlflow.get_experiment_by_name("dxr-ehr-prior").artifact_location == tracking.artifact_root(uri)
    assert sorted(path.name for path in store.iterdir()) == ["mlflow.db"]


def test_a_default_store_half_made_by_a_killed_creation_is_made_again(tmp_path):
    # What dxr left before creating the store under a scratch name: MLflow creating it in place, killed. Every later
    # open failed with "table ... already exists", so no training or learned forecast could run there again.
    db = tmp_path / "mlflow" / "mlflow.db"
    db.parent.mkdir()
    killed_among_migrations(f"import mlflow\nmlflow.MlflowClient(tracking_uri='sqlite:///{db}').search_experiments()")
    assert db.is_file()
    uri = tracking.use_tracking(tmp_path, None, "dxr-ehr-prior")
    assert mlflow.get_experiment_by_name("dxr-ehr-prior").artifact_location == tracking.artifact_root(uri)


def test_a_configured_sqlite_store_killed_while_it_is_created_is_absent_and_the_next_use_creates_it(tmp_path):
    # MLflow created a configured store in place: killed among its migrations, it left a file no later open could use.
    db = tmp_path / "shared" / "store.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    killed_among_migrations(f"from models.prior import tracking\n"
                            f"tracking.use_tracking({str(tmp_path / 'wh')!r}, {uri!r}, 'x')")
    assert not db.exists()  # only the scratch of the creation, whose owner has ended
    tracking.use_tracking(tmp_path / "wh", uri, "dxr-ehr-prior")
    assert mlflow.get_experiment_by_name("dxr-ehr-prior").artifact_location == tracking.artifact_root(uri)
    assert sorted(path.name for path in db.parent.iterdir()) == ["store.db"]


def test_a_configured_sqlite_store_half_made_in_place_is_one_line_naming_it_and_left_as_it_is(tmp_path):
    # Half made by MLflow itself (or by dxr before configured stores were created whole): the file is the user's, so
    # it is named with the fix rather than replaced. The open failed with SQLAlchemy's traceback.
    db = tmp_path / "shared" / "store.db"
    db.parent.mkdir()
    killed_among_migrations(f"import mlflow\nmlflow.MlflowClient(tracking_uri='sqlite:///{db}').search_experiments()")
    left = db.read_bytes()
    with pytest.raises(ConfigError) as raised:
        tracking.use_tracking(tmp_path / "wh", f"sqlite:///{db}", "dxr-ehr-prior")
    assert str(raised.value) == (
        f"MLflow store {db} (prior.tracking_uri) is half made: it has no experiment and MLflow cannot open it "
        "((sqlite3.OperationalError) table latest_metrics already exists), as a creation cut short leaves it: remove "
        "the file (it holds no run) and rerun to have it created whole, or restore it from a backup")
    assert db.read_bytes() == left
    assert sorted(path.name for path in db.parent.iterdir()) == ["store.db"]  # the checked copy is gone
    db.unlink()  # the fix the error names
    tracking.use_tracking(tmp_path / "wh", f"sqlite:///{db}", "dxr-ehr-prior")
    assert mlflow.get_experiment_by_name("dxr-ehr-prior") is not None


def test_a_configured_store_is_not_re_pointed_at_the_data_dir_that_uses_it(tmp_path):
    # Two data dirs sharing one configured store (here: the first one's own database): only the default store,
    # which belongs to its data dir, follows that data dir.
    shared = tracking.use_tracking(tmp_path / "first", None, "shared")
    tracking.use_tracking(tmp_path / "second", shared, "shared")
    location = (tmp_path / "first" / "mlflow" / "artifacts").as_uri()
    assert tracking.mlflow.get_experiment_by_name("shared").artifact_location == location
    assert not (tmp_path / "second" / "mlflow").exists()


@pytest.mark.parametrize("folder", ["why?", "100%20 o'b é中文", "100% sure"])
def test_a_data_dir_whose_path_holds_a_question_mark_or_percent_sign_keeps_its_store_inside_it(tmp_path, folder):
    # SQLAlchemy ends a URI's path at `?` and decodes `%20`: the store was opened at `<tmp>/why`, or not at all.
    root = tmp_path / folder
    uri = tracking.use_tracking(root, None, "dxr-ehr-prior")
    with mlflow.start_run():
        mlflow.log_dict({"epochs": 2}, "config.json")
    assert sqlalchemy.make_url(uri).database == str(root / "mlflow" / "mlflow.db")
    assert tracking.sqlite_file(uri) == root / "mlflow" / "mlflow.db"
    assert mlflow.get_experiment_by_name("dxr-ehr-prior").artifact_location == (root / "mlflow" / "artifacts").as_uri()
    assert [path.name for path in (root / "mlflow" / "artifacts").rglob("*.json")] == ["config.json"]


def test_a_long_lived_process_forecasts_with_the_pinned_run_not_an_earlier_stores_same_version(tmp_path,
                                                                                             monkeypatch):
    from flows.forecast import forecast_flow

    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    first = train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**{**TINY, "seed": 1}, epochs=1))
    forecast_flow(str(tmp_path), cohort, "ehr_prior", split="all", run_id="store-1")
    # The same process (`dxr serve`) after the tracking store was reset (here: another sqlite file):
    # its version 1 is another model.
    (tmp_path / "other").mkdir()
    other = f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}"
    monkeypatch.setenv("DXR_PRIOR__TRACKING_URI", other)
    second = train_prior(str(tmp_path), cohort, "ehr_prior",
                         PriorConfig(**{**TINY, "seed": 2}, epochs=1, tracking_uri=other))
    assert first.version == second.version == "1" and first.mlflow_run_id != second.mlflow_run_id
    forecast_flow(str(tmp_path), cohort, "ehr_prior", split="all", run_id="store-2")
    model = json.loads(wh.read("runs", run_id="store-2", kind="forecast:ehr_prior")["config_json"][0])["model"]
    assert model["mlflow_run_id"] == second.mlflow_run_id
    fresh = RegisteredPrior()
    fresh.fit(wh.connect(), cohort)
    assert fresh.run_id == second.mlflow_run_id
    key = ["trajectory_id", "rank"]
    expected = pl.concat(fresh.predict(*shard_inputs(wh, cohort, shard, "all"), 20)
                         for shard in sorted(wh.read("trajectories", cohort_id=cohort)["shard"].unique()))
    written = wh.read("rankings", run_id="store-2", system="ehr_prior").select(expected.columns)
    assert written.sort(key).equals(expected.sort(key))
    # A store that changed between pinning and loading is refused rather than served another model.
    with pytest.raises(ConfigError, match=f"not the pinned run {first.mlflow_run_id}"):
        RegisteredPrior(version="1", run_id=first.mlflow_run_id).fit(wh.connect(), cohort)


def test_ensure_prior_puts_its_model_in_service_once_even_when_training_does_not_promote(tmp_path):
    from tasks.forecast import pinned_model

    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    cfg = PriorConfig(**TINY, epochs=1, promote=False)  # a deployment that registers challengers only
    assert ensure_prior(str(tmp_path), cohort, "ehr_prior", cfg) == "1"
    assert ensure_prior(str(tmp_path), cohort, "ehr_prior", cfg) == "1"  # reused, not trained again
    assert [v["version"] for v in tracking.registered_versions("ehr_prior", cohort)] == ["1"]
    assert pinned_model(wh, cohort, "ehr_prior")["version"] == "1"  # the forecast that follows finds it


def test_models_are_listed_promoted_and_pinned_by_each_forecast_run(tmp_path, monkeypatch):
    import flows.forecast
    from flows.forecast import forecast_flow
    from tasks.forecast import fitted_forecaster

    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    first = train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**TINY, epochs=2))
    runner = CliRunner()
    trained = runner.invoke(main, ["--data-dir", str(tmp_path), "prior", "train", "--cohort", cohort, "--epochs", "1",
                                   "--no-promote", "--run-id", "challenger-1"])
    assert trained.exit_code == 0, trained.output
    assert "ehr_prior: registered ehr_prior-" in trained.output and " v2;" in trained.output
    assert "@champion" not in trained.output  # --no-promote left the alias on version 1

    listed = runner.invoke(main, ["--data-dir", str(tmp_path), "prior", "models", "--cohort", cohort])
    assert listed.exit_code == 0, listed.output
    rows = [line.split() for line in listed.output.splitlines()[2:-1]]
    assert [(r[0], r[1]) for r in rows] == [("ehr_prior", "2"), ("ehr_prior", "1")]  # newest first; no gru trained
    assert rows[1][2] == "champion" and rows[1][-3] == first.mlflow_run_id
    # Epochs trained and the dxr run that trained each version: the challenger's one epoch under its own run id.
    assert rows[0][-2:] == ["1", "challenger-1"]
    [first_run] = wh.read("runs").filter((pl.col("kind") == "train:ehr_prior")
                                         & (pl.col("run_id") != "challenger-1"))["run_id"]
    assert rows[1][-2:] == [str(int(first.metrics["epochs_trained"])), first_run]
    # The listed tuning R@20 is the selected epoch's, which training reported.
    assert float(rows[1][6]) == pytest.approx(first.metrics["val_recall_at_20"], abs=5e-5)
    # The same rows as JSON lines (full precision) and CSV, for analysts.
    as_json = runner.invoke(main, ["--data-dir", str(tmp_path), "prior", "models", "--cohort", cohort,
                                   "--format", "json"])
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [(r["version"], r["aliases"], r["epochs_trained"], r["dxr_run_id"]) for r in records] == [
        ("2", "", 1, "challenger-1"), ("1", "champion", int(first.metrics["epochs_trained"]), first_run)]
    assert records[1]["val_recall_at_20"] == first.metrics["val_recall_at_20"]
    as_csv = runner.invoke(main, ["--data-dir", str(tmp_path), "prior", "models", "--cohort", cohort,
                                  "--format", "csv"]).stdout.splitlines()
    assert as_csv[0].split(",") == ["system", "version", "aliases", "created_at", "selected_epoch", "val_recall_at_20",
                                    "val_precision_at_20", "mlflow_run_id", "epochs_trained", "dxr_run_id"]
    assert as_csv[1].startswith("ehr_prior,2,\"\",") and as_csv[1].endswith(",1,challenger-1")

    with pytest.raises(NotFoundError, match=r"has no version '9' .*\(versions: 2, 1\)"):
        fitted_forecaster(str(tmp_path), cohort, "ehr_prior", "9")
    missing = runner.invoke(main, ["--data-dir", str(tmp_path), "prior", "promote", "--cohort", cohort,
                                   "--version", "9"])
    assert missing.exit_code != 0 and "has no version '9'" in missing.output
    untrained = runner.invoke(main, ["--data-dir", str(tmp_path), "prior", "promote", "--cohort", cohort,
                                     "--system", "gru", "--version", "1"])
    assert untrained.exit_code != 0 and untrained.output.rstrip().endswith(
        f"(versions: none): train one with `dxr prior train --cohort {cohort} --system gru`"), untrained.output
    assert Warehouse(tmp_path).read("runs").filter(pl.col("kind") == "promote:ehr_prior").is_empty()

    def recorded_model(run_id: str) -> dict:
        return json.loads(wh.read("runs", run_id=run_id, kind="forecast:ehr_prior")["config_json"][0])["model"]

    def lists(run_id: str) -> pl.DataFrame:
        return wh.read("rankings", run_id=run_id, system="ehr_prior").sort("trajectory_id", "rank")

    forecast_flow(str(tmp_path), cohort, "ehr_prior", split="all", run_id="pinned-1")
    assert recorded_model("pinned-1") == {"registered_model": f"ehr_prior-{cohort}", "alias": "champion",
                                          "version": "1", "mlflow_run_id": first.mlflow_run_id}
    by_first = lists("pinned-1")
    promoted = runner.invoke(main, ["--data-dir", str(tmp_path), "prior", "promote", "--cohort", cohort,
                                    "--version", "2", "--run-id", "rollout-2"])
    assert promoted.exit_code == 0, promoted.output
    assert promoted.stdout == f"ehr_prior-{cohort}: @champion -> v2 (was v1; recorded as run rollout-2)\n"
    promotion = json.loads(wh.read("runs", run_id="rollout-2", kind="promote:ehr_prior")["config_json"][0])
    assert (promotion["version"], promotion["previous_version"], promotion["alias"]) == ("2", "1", "champion")
    # A rerun of the same run id is allowed; it uses, and records, the version the alias points to now.
    forecast_flow(str(tmp_path), cohort, "ehr_prior", split="all", run_id="pinned-1")
    assert recorded_model("pinned-1")["version"] == "2"
    by_second = lists("pinned-1")
    assert by_first.height == by_second.height and not by_first["score"].equals(by_second["score"])
    # The alias moving while a run is under way (here: as its shard starts) does not change the version it uses.
    real_task = flows.forecast.forecast_shard_task

    def alias_moves_meanwhile(*args):
        tracking.set_alias("ehr_prior", cohort, "1", "champion")
        return real_task.fn(*args)

    monkeypatch.setattr(flows.forecast, "forecast_shard_task", alias_moves_meanwhile)
    forecast_flow(str(tmp_path), cohort, "ehr_prior", split="all", run_id="pinned-2")
    assert tracking.resolve_alias("ehr_prior", cohort, "champion")[0] == "1"
    assert recorded_model("pinned-2")["version"] == "2"
    assert lists("pinned-2").drop("run_id").equals(by_second.drop("run_id"))
    assert fitted_forecaster(str(tmp_path), cohort, "ehr_prior", "1").run_id == first.mlflow_run_id
    # A learned system with nothing registered: one line naming the fix, before any run is recorded.
    runs_before = wh.read("runs").height
    untrained = runner.invoke(main, ["--data-dir", str(tmp_path), "forecast", "--cohort", cohort, "--system", "gru"])
    assert untrained.exit_code != 0
    assert f"no registered model 'gru-{cohort}' with alias 'champion'" in untrained.output
    assert f"dxr prior train --cohort {cohort} --system gru" in untrained.output
    assert wh.read("runs").height == runs_before
    # Versions registered, none under the alias asked for (another prior.alias): the fix is a promote, not training.
    with pytest.raises(NotFoundError, match=re.escape(
            f"alias 'challenger' in {tracking.mlflow.get_tracking_uri()}: point it at one of versions 1, 2 with "
            f"`dxr prior promote --cohort {cohort} --system ehr_prior --version 2` (setting prior.alias = "
            "'challenger'), or train one with")):
        tracking.resolve_alias("ehr_prior", cohort, "challenger")


def test_an_interrupted_model_download_leaves_nothing_a_later_load_takes_for_a_model(trained, monkeypatch):
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    wh, cohort, _, _ = trained
    cache = wh.root / "mlflow" / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    download_file = LocalArtifactRepository._download_file

    def connection_lost_at_the_weights(self, remote_file_path, local_path):
        if remote_file_path.endswith("model.pth"):
            raise OSError("connection reset by peer")
        return download_file(self, remote_file_path, local_path)

    monkeypatch.setattr(LocalArtifactRepository, "_download_file", connection_lost_at_the_weights)
    with pytest.raises(ConfigError, match=r"failed while downloading ehr_prior-\w+ version 1"):
        RegisteredPrior(PriorConfig(**TINY)).fit(wh.connect(), cohort)
    assert list(cache.rglob("MLmodel")) == []  # neither a partial copy nor scratch is left behind

    # What an interrupted download of an earlier dxr left in place: the model's files but no weights.
    version, run_id = tracking.resolve_alias("ehr_prior", cohort, "champion")
    partial = cache / f"ehr_prior-{cohort}" / f"v{version}-{run_id}"
    partial.mkdir(parents=True)
    (partial / "MLmodel").write_text("flavors: {}\n")
    monkeypatch.setattr(LocalArtifactRepository, "_download_file", download_file)  # the connection is back
    again = RegisteredPrior(PriorConfig(**TINY))
    again.fit(wh.connect(), cohort)
    assert again.version == "1" and (partial / tracking.WEIGHTS).is_file()


def test_a_failing_tracking_store_is_reported_not_taken_for_a_missing_model(tmp_path, monkeypatch):
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    cfg = PriorConfig(**TINY, epochs=1)
    assert ensure_prior(str(tmp_path), cohort, "ehr_prior", cfg) == "1"

    def locked(self, name, alias):
        raise MlflowException("(sqlite3.OperationalError) database is locked")

    monkeypatch.setattr(tracking.MlflowClient, "get_model_version_by_alias", locked)
    # Taken for "nothing registered", this would train version 2 and move the champion to it.
    with pytest.raises(ConfigError, match="failed while resolving ehr_prior-.*database is locked"):
        ensure_prior(str(tmp_path), cohort, "ehr_prior", cfg)
    monkeypatch.undo()
    assert [v["version"] for v in tracking.registered_versions("ehr_prior", cohort)] == ["1"]


def test_an_unreachable_tracking_server_is_one_line_naming_the_store(trained, monkeypatch):
    wh, cohort, _, _ = trained
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's retries would take minutes
    store = tracking.mlflow.get_tracking_uri()
    try:
        result = CliRunner(env={"DXR_PRIOR__TRACKING_URI": "http://127.0.0.1:9"}).invoke(
            main, ["--data-dir", str(wh.root), "forecast", "--cohort", cohort, "--system", "ehr_prior"])
    finally:
        tracking.mlflow.set_tracking_uri(store)  # process-wide: later tests must not meet the dead server
    assert result.exit_code == 1 and not isinstance(result.exception, MlflowException), result.output
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("Error: MLflow store http://127.0.0.1:9 failed while opening experiment"), error
    assert "DXR_PRIOR__TRACKING_URI" in error


def test_a_model_download_that_fills_the_disk_names_the_local_copy_not_the_store(tmp_path, monkeypatch):
    # MLflow's text as seen on a full disk: the path it names is the store's, and the store was blamed ("check that
    # it is reachable and writable"), while the disk that was full holds the warehouse's copy of the model.
    seen = ("The following failures occurred while downloading one or more artifacts from file:///srv/store/"
            "artifacts/models/m-1/artifacts: ##### File requirements.txt ##### [Errno 28] No space left on device: "
            "'/srv/store/artifacts/models'")

    def disk_full(**kwargs):
        raise MlflowException(seen)

    monkeypatch.setattr(tracking.mlflow.artifacts, "download_artifacts", disk_full)
    cache = tmp_path / "mlflow" / "cache"
    with pytest.raises(ConfigError) as raised:
        tracking.download_model("ehr_prior", "c1", "1", "r1", cache)
    assert str(raised.value) == (f"downloading ehr_prior-c1 version 1: out of disk space in {cache}: free disk "
                                 "space there, or point --data-dir (DXR_DATA_DIR) to a disk with room")
    assert list((cache / "ehr_prior-c1").iterdir()) == []


def test_a_full_disk_while_the_store_is_created_is_one_line_and_leaves_no_store(tmp_path, monkeypatch):
    # MLflow lets SQLite's error out of its schema creation as SQLAlchemy's, not its own: the CLI printed six
    # tracebacks and no line of its own.
    import sqlite3

    def disk_full(tracking_uri):
        raise sqlalchemy.exc.OperationalError("CREATE TABLE experiments (...)", {},
                                              sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(tracking, "MlflowClient", disk_full)
    with pytest.raises(ConfigError) as raised:
        tracking.create_default_store(tmp_path)
    assert str(raised.value) == (
        f"creating the MLflow store in {tmp_path / 'mlflow'}: out of disk space: free disk space there, or point "
        "--data-dir (DXR_DATA_DIR) or prior.tracking_uri (env DXR_PRIOR__TRACKING_URI) to a disk with room")
    assert list((tmp_path / "mlflow").iterdir()) == []


def test_a_full_temporary_directory_while_a_model_is_logged_names_the_file(tmp_path, monkeypatch):
    # Python's write names no file: the CLI's line was "[Errno 27] File too large", no path.
    import errno

    def full_at_vocabulary(path, text, *args, **kwargs):
        if path.name == "vocabulary.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return written(path, text, *args, **kwargs)

    written = Path.write_text
    cohort = write_planted_cohort(Warehouse(tmp_path), n_patients=20, seed=4)
    monkeypatch.setattr(Path, "write_text", full_at_vocabulary)
    with pytest.raises(OSError) as raised:
        train_prior(str(tmp_path), cohort, "gru", PriorConfig(**TINY, epochs=1), run_id="full-1")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename.endswith("/vocabulary.json")


def test_a_full_disk_under_the_tracking_store_is_said_to_be_one():
    # SQLite's text as seen when a training could not be recorded; the line quoted it, cut off in the SQL.
    seen = MlflowException("(raised as a result of Query-invoked autoflush) (sqlite3.OperationalError) database or "
                           "disk is full [SQL: INSERT INTO runs (run_uuid, name) VALUES (?, ?)]")
    previous = tracking.mlflow.get_tracking_uri()
    tracking.mlflow.set_tracking_uri("sqlite:////srv/dxr/mlflow/mlflow.db")
    try:
        error = tracking.store_error(seen, "recording the training of ehr_prior-c1")
    finally:
        tracking.mlflow.set_tracking_uri(previous)
    assert str(error) == (
        "MLflow store sqlite:////srv/dxr/mlflow/mlflow.db failed while recording the training of ehr_prior-c1: out "
        "of disk space: free disk space there, or set prior.tracking_uri (env DXR_PRIOR__TRACKING_URI) to a store "
        "on a disk with room")
