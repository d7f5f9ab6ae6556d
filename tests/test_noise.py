"""The third-party output dxr silences (`dxr/noise.py`) is exactly the named lines: the rest still reaches the user."""

from __future__ import annotations

import logging
import warnings

from dxr import noise  # importing dxr installs the filters, as in every dxr process


class Lines(logging.Handler):
    """The messages a logger hands to its handlers, i.e. those its filters let through."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def printed(logger_name: str, level: int, messages: list[str]) -> list[str]:
    logger = logging.getLogger(logger_name)
    lines, level_before = Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    try:
        for message in messages:
            logger.log(level, message)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level_before)
    return lines.lines


def test_only_lightnings_hardware_advert_and_max_epochs_lines_are_dropped():
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        assert printed(name, logging.INFO, [
            "GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
            "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
            "`Trainer.fit` stopped: `max_epochs=8` reached.", "`Trainer.fit` stopped: `max_steps=3` reached.",
            "Restoring states from the checkpoint path at /tmp/x.ckpt"]) == [
            "`Trainer.fit` stopped: `max_steps=3` reached.", "Restoring states from the checkpoint path at /tmp/x.ckpt"]
    # Another Lightning logger is untouched, even with the same words.
    assert printed("lightning.pytorch.trainer", logging.INFO, ["GPU available: False"]) == ["GPU available: False"]


def test_only_mlflows_pickle_and_schema_notices_are_dropped():
    pickle = ("Saving pytorch model by Pickle or CloudPickle format requires exercising caution because these formats "
              "rely on Python's object serialization mechanism")
    assert printed("mlflow.pytorch", logging.WARNING, [pickle, "Model logged without a signature"]) == [
        "Model logged without a signature"]
    assert printed("mlflow.store.db.utils", logging.INFO, [
        "Creating initial MLflow database tables...", "Updating database tables",
        "Database migration failed: check the store"]) == ["Database migration failed: check the store"]


def test_only_torchs_leafspec_deprecation_is_ignored():
    with warnings.catch_warnings(record=True) as caught:
        noise.silence_third_party_noise()  # pytest restores the warning filters of before the tests' imports
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
                      "treespec.is_leaf()` instead.", FutureWarning)
        warnings.warn("`tree_map_only` is deprecated", FutureWarning)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", UserWarning)
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "`tree_map_only` is deprecated"),
        (UserWarning, "`isinstance(treespec, LeafSpec)` is deprecated")]


def test_silencing_again_adds_nothing():
    filters = {name: list(logging.getLogger(name).filters) for name in ("mlflow.pytorch", *noise.LIGHTNING_LOGGERS)}
    noise.silence_third_party_noise()
    assert {name: list(logging.getLogger(name).filters) for name in filters} == filters
    assert all(len(kept) == 1 for kept in filters.values())


def test_mlflows_artifact_bar_is_off_unless_the_user_turns_it_on(monkeypatch):
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

    assert MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() is False
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")
    noise.silence_third_party_noise()
    assert MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() is True
