"""`prior.patience`: a training stops once that many epochs in a row bring no better tuning R@20, and registers what
the same training run to its last epoch would have, when the best epoch came before the stop."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.prior import tracking
from models.prior.config import PriorConfig
from models.prior.planted import write_planted_cohort
from tasks.prior import train_prior
from tests.conftest import cli
from tests.test_prior_resume import assert_same_model, assert_same_training, epoch_lines, fitted
from tests.test_prior_training import TINY, prior_log_lines
from warehouse.checkpoints import CHECKPOINTS_DIR, training_checkpoint
from warehouse.store import Warehouse

SETTINGS = {**TINY, "dropout": 0.1, "epochs": 3}
N_PATIENTS = 150  # the planted cohort then has tuning pairs, each epoch is validated


def patience_stop(recalls: list[float], patience: int) -> int:
    """How many epochs a training of per-epoch tuning recalls `recalls` trains with `patience`: it stops after the
    first epoch that is `patience` epochs past the best so far (the earliest on a tie)."""
    best = 0
    for epoch, value in enumerate(recalls):
        if value > recalls[best]:
            best = epoch
        if epoch - best >= patience:
            return epoch + 1
    return len(recalls)


def test_patience_stop_counts_epochs_after_the_best_so_far():
    assert patience_stop([0.5, 0.4, 0.45, 0.6], 2) == 3
    assert patience_stop([0.5, 0.6, 0.5, 0.6, 0.7], 2) == 4  # a tie is no better
    assert patience_stop([0.5, 0.6, 0.7], 1) == 3


@pytest.fixture(scope="module")
def every_epoch(tmp_path_factory) -> tuple[str, dict]:
    """The training without patience: its cohort and what it registered."""
    root = tmp_path_factory.mktemp("every-epoch")
    cohort = write_planted_cohort(Warehouse(root), n_patients=N_PATIENTS, seed=2)
    result = train_prior(str(root), cohort, "ehr_prior", PriorConfig(**SETTINGS), run_id="every-1")
    assert result.metrics["epochs_trained"] == SETTINGS["epochs"]
    return cohort, fitted(root, result)


def recalls(training: dict) -> list[float]:
    return [value for _, value in training["history"]["val_recall_at_20"]]


def assert_stopped_as_the_prefix(stopped: dict, whole: dict, epochs: int) -> None:
    """The training stopped after `epochs` epochs is the whole one's first epochs, and registered its weights."""
    assert stopped["history"] == {key: values[:epochs] for key, values in whole["history"].items()}
    assert_same_model(stopped, whole)


def test_a_training_stops_when_its_patience_runs_out_and_registers_the_best_epoch(every_epoch, tmp_path):
    cohort, whole = every_epoch
    stop = patience_stop(recalls(whole), patience=1)
    # The planted cohort peaks at the first epoch: with patience 1 the training stops before its last epoch, having
    # seen the epoch the whole training registers.
    assert stop < SETTINGS["epochs"] and whole["selected_epoch"] < stop
    write_planted_cohort(Warehouse(tmp_path), n_patients=N_PATIENTS, seed=2)

    with prior_log_lines() as lines:
        result = train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**SETTINGS, patience=1),
                             run_id="patient-1")

    assert epoch_lines(lines) == [f"ehr_prior epoch {e}/3" for e in range(1, stop + 1)]
    selected = int(whole["selected_epoch"]) + 1
    assert lines[-1] == (f"ehr_prior: stopped after epoch {stop}/3: no better tuning R@20 than epoch {selected}'s in "
                         "the 1 epoch after it (prior.patience)")
    assert result.metrics["epochs_trained"] == stop
    assert_stopped_as_the_prefix(fitted(tmp_path, result), whole, stop)
    assert not (tmp_path / CHECKPOINTS_DIR).exists()


def test_patience_that_never_runs_out_trains_every_epoch(every_epoch, tmp_path):
    cohort, whole = every_epoch
    patience = SETTINGS["epochs"]
    assert patience_stop(recalls(whole), patience) == SETTINGS["epochs"]
    write_planted_cohort(Warehouse(tmp_path), n_patients=N_PATIENTS, seed=2)
    with prior_log_lines() as lines:
        result = train_prior(str(tmp_path), cohort, "ehr_prior", PriorConfig(**SETTINGS, patience=patience))
    assert not [line for line in lines if "stopped after" in line]
    assert result.metrics["epochs_trained"] == SETTINGS["epochs"]
    assert_same_training(fitted(tmp_path, result), whole)


def test_a_training_stopped_early_whose_registration_failed_trains_no_epoch_more_on_its_rerun(
        every_epoch, tmp_path, monkeypatch):
    """Lightning keeps no stop in its checkpoint: the rerun must not take the epochs after the stop for epochs left
    to train."""
    cohort, whole = every_epoch
    stop = patience_stop(recalls(whole), patience=1)
    write_planted_cohort(Warehouse(tmp_path), n_patients=N_PATIENTS, seed=2)
    cfg = PriorConfig(**SETTINGS, patience=1)
    with monkeypatch.context() as patched:
        def full_disk(*args, **kwargs):
            raise OSError("no space left on device")

        patched.setattr(tracking.mlflow.pytorch, "log_model", full_disk)
        with pytest.raises(OSError, match="no space left"):
            train_prior(str(tmp_path), cohort, "ehr_prior", cfg, run_id="stopped-1")
    assert training_checkpoint(Warehouse(tmp_path).root, "stopped-1", "ehr_prior").is_file()

    with prior_log_lines() as lines:
        result = train_prior(str(tmp_path), cohort, "ehr_prior", cfg, run_id="stopped-1")

    assert epoch_lines(lines) == []
    assert any(line.startswith(f"ehr_prior: continuing after epoch {stop}/3 ") for line in lines), lines
    assert any(line.startswith(f"ehr_prior: stopped after epoch {stop}/3: ") for line in lines), lines
    assert result.metrics["epochs_trained"] == stop
    assert_stopped_as_the_prefix(fitted(tmp_path, result), whole, stop)


def test_patience_without_best_epoch_selection_is_refused():
    with pytest.raises(ValueError, match="patience 2 needs keep_best_epoch = true"):
        PriorConfig(patience=2, keep_best_epoch=False)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        PriorConfig(patience=0)


def test_prior_train_refuses_patience_against_a_setting_in_one_line(tmp_path: Path, monkeypatch):
    config = tmp_path / "dxr.toml"
    config.write_text("[prior]\nkeep_best_epoch = false\n")
    monkeypatch.setenv("DXR_CONFIG", str(config))
    code, out, err = cli(tmp_path, "prior", "train", "--cohort", "default", "--patience", "2")
    assert code != 0 and out == ""
    assert err.strip().splitlines() == [
        "Error: patience 2 needs keep_best_epoch = true: a training stopped early registers its best epoch's "
        "weights, not those of the epochs after it (the options of this command over the prior settings in force, "
        "which `dxr config show` prints)"]


def test_prior_train_says_where_the_patience_stopped_it(prefect_harness, every_epoch, tmp_path, monkeypatch):
    cohort, whole = every_epoch
    stop = patience_stop(recalls(whole), patience=1)
    write_planted_cohort(Warehouse(tmp_path), n_patients=N_PATIENTS, seed=2)
    config = tmp_path / "dxr.toml"
    config.write_text("[prior]\n" + "".join(f"{key} = {value!r}\n" for key, value in SETTINGS.items()))
    monkeypatch.setenv("DXR_CONFIG", str(config))
    code, out, err = cli(tmp_path, "prior", "train", "--cohort", cohort, "--patience", "1")
    assert code == 0, err
    best = whole["history"]["val_recall_at_20"][int(whole["selected_epoch"])][1]
    assert (f"; val R@20 {best:.3f} (epoch {int(whole['selected_epoch']) + 1}), stopped early after epoch {stop}/3, "
            f"{N_PATIENTS * 3 // 5} train patients in ") in out, out
