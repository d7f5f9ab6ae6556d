"""A prior's training killed or failed after an epoch continues from it when rerun under its run id, and ends exactly
as the same training run uninterrupted: weights to the bit, selected epoch, per-epoch metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch

from models.prior import tracking
from models.prior.config import PriorConfig
from models.prior.planted import write_planted_cohort
from models.prior.train import MlflowEpochLogger, TrainResult
from tasks.prior import train_prior
from tests.conftest import cli
from tests.test_prior_training import TINY, prior_log_lines
from warehouse.checkpoints import CHECKPOINTS_DIR, training_checkpoint
from warehouse.store import Warehouse

# Dropout on: a continuation must get the global torch generator back where the uninterrupted fit had it.
SETTINGS = {**TINY, "dropout": 0.1, "epochs": 3}
N_PATIENTS = 150  # the planted cohort then has tuning pairs: each epoch is validated and the best one kept


def fitted(root: Path, result) -> dict:
    """What must not depend on an interruption: the registered weights, the selected epoch and every epoch's
    metrics as the MLflow run holds them, (step, value) per metric."""
    tracking.use_tracking(root, None, PriorConfig().experiment)
    copy = tracking.download_model(result.system, result.cohort_id, result.version, result.mlflow_run_id,
                                   root / "mlflow" / "cache")
    client = tracking.MlflowClient()
    run = client.get_run(result.mlflow_run_id)
    epochs = [key for key in run.data.metrics if key.startswith(("train_", "val_", "router_"))
              and key not in ("train_seconds", "train_patients_per_second")]
    return {"weights": torch.load(copy / tracking.WEIGHTS, weights_only=False).state_dict(),
            "selected_epoch": run.data.metrics["selected_epoch"],
            "history": {key: sorted((m.step, m.value) for m in client.get_metric_history(result.mlflow_run_id, key))
                        for key in epochs}}


def assert_same_model(trained: dict, other: dict) -> None:
    """The same registered weights, to the bit, and the same selected epoch."""
    assert trained["weights"].keys() == other["weights"].keys()
    assert all(torch.equal(trained["weights"][k], other["weights"][k]) for k in other["weights"])
    assert trained["selected_epoch"] == other["selected_epoch"]


def assert_same_training(resumed: dict, uninterrupted: dict) -> None:
    assert_same_model(resumed, uninterrupted)
    assert resumed["history"] == uninterrupted["history"]
    assert all([step for step, _ in values] == [0, 1, 2] for values in resumed["history"].values())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[str, dict]:
    root = tmp_path_factory.mktemp("uninterrupted")
    cohort = write_planted_cohort(Warehouse(root), n_patients=N_PATIENTS, seed=2)
    result = train_prior(str(root), cohort, "ehr_prior", PriorConfig(**SETTINGS), run_id="whole-1")
    assert not (root / CHECKPOINTS_DIR).exists()  # a finished training leaves nothing behind
    return cohort, fitted(root, result)


def fail_after_epoch(monkeypatch, epochs: int) -> None:
    """Make the training raise as epoch `epochs` + 1 starts, `epochs` epochs finished (a full disk, a lost store)."""
    start = MlflowEpochLogger.on_train_epoch_start

    def failing(self, trainer, module):
        if trainer.current_epoch == epochs:
            raise OSError("no space left on device")
        start(self, trainer, module)

    monkeypatch.setattr(MlflowEpochLogger, "on_train_epoch_start", failing)


def failed_training(monkeypatch, root: Path, cohort: str, run_id: str, epochs: int, **settings) -> Path:
    """A training of `run_id` failed after `epochs` epochs; returns where its checkpoint is."""
    with monkeypatch.context() as patched:
        fail_after_epoch(patched, epochs)
        with pytest.raises(OSError, match="no space left"):
            train_prior(str(root), cohort, "ehr_prior", PriorConfig(**{**SETTINGS, **settings}), run_id=run_id)
    return training_checkpoint(Warehouse(root).root, run_id, "ehr_prior")


def epoch_lines(lines: list[str]) -> list[str]:
    return [line.split(":")[0] for line in lines if line.startswith("ehr_prior epoch ") and "train loss" in line]


def test_a_training_failed_after_an_epoch_continues_from_it_and_ends_as_the_uninterrupted_one(
        uninterrupted, tmp_path, monkeypatch):
    cohort, whole = uninterrupted
    wh = Warehouse(tmp_path)
    write_planted_cohort(wh, n_patients=N_PATIENTS, seed=2)
    checkpoint = failed_training(monkeypatch, tmp_path, cohort, "resumed-1", epochs=2)
    [failed_run] = [run.info.run_id for run in tracking.mlflow.search_runs(
        filter_string="tags.`dxr.run_id` = 'resumed-1'", output_format="list")]

    with prior_log_lines() as lines:
        result = train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**SETTINGS), run_id="resumed-1")

    assert epoch_lines(lines) == ["ehr_prior epoch 3/3"]  # epochs 1 and 2 were not trained again
    assert [line for line in lines if "continuing" in line] == [
        f"ehr_prior: continuing after epoch 2/3 from the checkpoint an earlier attempt wrote ({checkpoint}; MLflow "
        f"run {failed_run})"]
    assert_same_training(fitted(tmp_path, result), whole)
    tags = tracking.MlflowClient().get_run(result.mlflow_run_id).data.tags
    assert (tags["dxr.resumed_after_epoch"], tags["dxr.resumed_from_mlflow_run"]) == ("2", failed_run)
    assert wh.read("runs", run_id="resumed-1")["status"].to_list() == ["finished"]
    assert not (tmp_path / CHECKPOINTS_DIR).exists()  # gone with the finished training


def test_a_training_killed_by_sigkill_after_an_epoch_continues_from_it_and_ends_as_the_uninterrupted_one(
        uninterrupted, tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL

    cohort, whole = uninterrupted
    write_planted_cohort(Warehouse(tmp_path), n_patients=N_PATIENTS, seed=2)
    config = tmp_path / "dxr.toml"
    config.write_text("[prior]\n" + "".join(f"{key} = {value!r}\n" for key, value in SETTINGS.items()))
    monkeypatch.setenv("DXR_CONFIG", str(config))
    command = ["--data-dir", str(tmp_path), "prior", "train", "--cohort", cohort, "--system", "ehr_prior",
               "--run-id", "killed-1"]
    # `dxr prior train` killed by SIGKILL (as the OOM killer kills) as its second epoch starts.
    killed_after_epoch_1 = (
        "import os, signal\nfrom models.prior.train import MlflowEpochLogger\n"
        "start = MlflowEpochLogger.on_train_epoch_start\n"
        "def killed(self, trainer, module):\n"
        "    if trainer.current_epoch == 1:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    start(self, trainer, module)\n"
        f"MlflowEpochLogger.on_train_epoch_start = killed\nfrom dxr.cli import main\nmain({command!r})\n")
    doomed = subprocess.run([sys.executable, "-c", killed_after_epoch_1], capture_output=True, text=True,
                            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                            cwd=Path(__file__).parents[1], timeout=600)
    assert doomed.returncode == -signal.SIGKILL, doomed.stderr

    code, _, err = cli(tmp_path, "run", "list")
    assert code == 0
    assert err.rstrip().endswith("to finish it, rerun the command that started it, or Retry its flow run (under its "
                                 "run id, `--run-id killed-1`, it continues from its last finished epoch)"), err
    code, _, err = cli(tmp_path, *command[2:])
    assert code == 0, err
    recorded = Warehouse(tmp_path).read("runs", run_id="killed-1")["config_json"][0]
    trained = TrainResult(**json.loads(recorded)["result"])
    assert tracking.MlflowClient().get_run(trained.mlflow_run_id).data.tags["dxr.resumed_after_epoch"] == "1"
    assert_same_training(fitted(tmp_path, trained), whole)
    assert not (tmp_path / CHECKPOINTS_DIR).exists()


@pytest.mark.parametrize("other", ["settings", "cohort build"])
def test_a_checkpoint_of_another_training_is_not_continued_from_and_is_replaced(tmp_path, monkeypatch, other):
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    checkpoint = failed_training(monkeypatch, tmp_path, cohort, "other-1", epochs=1)
    settings = dict(SETTINGS)
    if other == "settings":
        settings["lr"] = PriorConfig().lr / 2
    else:  # built again under its id: other records, whatever its id says
        wh.write("cohorts", wh.read("cohorts", cohort_id=cohort).with_columns(pl.col("created_at").dt.offset_by("1d")),
                 cohort_id=cohort)
    with monkeypatch.context() as patched, prior_log_lines() as lines:
        fail_after_epoch(patched, 1)
        with pytest.raises(OSError):
            train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**settings), run_id="other-1")
    assert epoch_lines(lines) == ["ehr_prior epoch 1/3"]
    assert [line for line in lines if "checkpoint" in line] == [
        f"ehr_prior: the checkpoint {checkpoint} is another training's (other settings, or another build of the "
        "cohort) or does not load: not continued from, and replaced after the first epoch"]
    with prior_log_lines() as lines:
        train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**settings), run_id="other-1")
    assert epoch_lines(lines) == ["ehr_prior epoch 2/3", "ehr_prior epoch 3/3"]  # the replacement is its own


def test_a_checkpoint_cut_short_is_not_read(tmp_path, monkeypatch):
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    checkpoint = failed_training(monkeypatch, tmp_path, cohort, "cut-1", epochs=1)
    whole = checkpoint.read_bytes()
    # A process killed while writing the next one left its scratch sibling half written (and the scratch's lock
    # file, which no process holds): never read, and removed with the next checkpoint's write.
    cut = checkpoint.with_name(f".{checkpoint.name}.host-999999-0123abcd.tmp")
    cut.write_bytes(whole[:len(whole) // 2])
    cut.with_suffix(".lock").touch()
    with prior_log_lines() as lines:
        train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**SETTINGS), run_id="cut-1")
    assert epoch_lines(lines) == ["ehr_prior epoch 2/3", "ehr_prior epoch 3/3"]
    assert not (tmp_path / CHECKPOINTS_DIR).exists()
    # A checkpoint damaged in place (a disk's fault; dxr renames only whole ones there) is not read either.
    checkpoint = failed_training(monkeypatch, tmp_path, cohort, "cut-2", epochs=1)
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    with prior_log_lines() as lines:
        train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**SETTINGS), run_id="cut-2")
    assert epoch_lines(lines) == ["ehr_prior epoch 1/3", "ehr_prior epoch 2/3", "ehr_prior epoch 3/3"]


def test_deleting_the_cohort_removes_the_checkpoints_of_its_trainings(tmp_path, monkeypatch):
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    checkpoint = failed_training(monkeypatch, tmp_path, cohort, "deleted-1", epochs=1)
    # `dxr run delete` deletes results only: a training is the cohort's record, and goes with it.
    code, _, err = cli(tmp_path, "run", "delete", "deleted-1")
    assert code != 0 and "go with it (`dxr cohort delete`)" in err
    assert checkpoint.is_file()
    code, out, err = cli(tmp_path, "cohort", "delete", cohort)
    assert code == 0, err
    assert f"removed {checkpoint.parent.relative_to(wh.root)}/" in out.splitlines()
    assert not (tmp_path / CHECKPOINTS_DIR).exists()


def test_a_training_that_failed_after_its_last_epoch_registers_the_same_model_without_training_again(
        uninterrupted, tmp_path, monkeypatch):
    """Every epoch finished, then registering the model failed (a full disk): the rerun trains no epoch and
    registers what the uninterrupted training did."""
    cohort, whole = uninterrupted
    write_planted_cohort(Warehouse(tmp_path), n_patients=N_PATIENTS, seed=2)
    with monkeypatch.context() as patched:
        def full_disk(*args, **kwargs):
            raise OSError("no space left on device")

        patched.setattr(tracking.mlflow.pytorch, "log_model", full_disk)
        with pytest.raises(OSError, match="no space left"):
            train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**SETTINGS), run_id="last-1")
    assert training_checkpoint(Warehouse(tmp_path).root, "last-1", "ehr_prior").is_file()

    with prior_log_lines() as lines:
        result = train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**SETTINGS), run_id="last-1")

    assert epoch_lines(lines) == []
    assert any(line.startswith("ehr_prior: continuing after epoch 3/3 ") for line in lines), lines
    assert_same_training(fitted(tmp_path, result), whole)
    assert not (tmp_path / CHECKPOINTS_DIR).exists()
