"""The third-party output dxr silences (`dxr/noise.py`) is exactly the named lines: the rest still reaches the user."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

from dxr import noise  # importing dxr installs the filters, as in every dxr process
from tests.conftest import LoggedMessages


def printed(logger_name: str, level: int, messages: list[str]) -> list[str]:
    logger = logging.getLogger(logger_name)
    lines, level_before = LoggedMessages(logging.DEBUG), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    try:
        for message in messages:
            logger.log(level, message)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level_before)
    return lines.lines


def test_only_lightnings_hardware_advert_max_epochs_and_checkpoint_restoring_lines_are_dropped():
    # The standalone packages' loggers too: once `mlflow.pytorch` is imported, a fit logs through them.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        assert printed(name, logging.INFO, [
            "GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
            "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
            "`Trainer.fit` stopped: `max_epochs=8` reached.", "`Trainer.fit` stopped: `max_steps=3` reached.",
            "Restoring states from the checkpoint path at /tmp/x.ckpt",
            "Restored all states from the checkpoint at /tmp/x.ckpt", "Loading `train_dataloader` to estimate"]) == [
            "`Trainer.fit` stopped: `max_steps=3` reached.", "Loading `train_dataloader` to estimate"]
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
    # Logged with its traceback before MLflow raises the same error as its own, which dxr reports in one line.
    assert printed("mlflow.store.db.utils", logging.ERROR, [
        "SQLAlchemy database error. The following exception is caught.\n(sqlite3.OperationalError) database or disk "
        "is full", "Database migration failed: check the store"]) == ["Database migration failed: check the store"]


def test_only_mlflows_registration_notices_are_printed_no_more_once_dxr_imports_mlflow():
    # MLflow prints them with `eprint`, past every logger filter: each training printed two lines of MLflow's beside
    # dxr's own, which names the version it registered; so did the benchmark's training child (benchmarks/prior.py).
    notices = ["Successfully registered model 'gru-c1'.", "Registered model 'gru-c1' already exists. Creating a new "
               "version of this model...", "Created version '2' of model 'gru-c1'."]
    other = "Packing environment for Databricks Model Serving with install_dependencies True..."
    result = in_a_fresh_process(
        "import models.prior.tracking\n"  # as every training and forecast of a prior does
        "from mlflow.tracking._model_registry import fluent\n"
        "from dxr.noise import DropPrints, silence_mlflow_registration_notices\n"
        "silence_mlflow_registration_notices()\n"
        "assert not isinstance(fluent.eprint.printer, DropPrints), 'installed twice'\n"
        f"for line in {[*notices, other]!r}:\n"
        "    fluent.eprint(line)\n")
    assert (result.returncode, result.stderr) == (0, f"{other}\n")


def test_only_readabilitys_traceback_for_markup_it_cannot_parse_is_dropped():
    assert printed("readability.readability", logging.ERROR, [
        "error getting summary: ", "ruthless removal did not work. "]) == ["ruthless removal did not work. "]


def in_a_fresh_process(code: str, **environment: str) -> subprocess.CompletedProcess:
    """`code` run as a dxr command runs: a process of its own, in which nothing was imported or switched before."""
    inherited = {name: value for name, value in os.environ.items() if name != "HF_HUB_DISABLE_PROGRESS_BARS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=inherited | environment, cwd=Path(__file__).resolve().parents[1])


def test_a_page_readability_cannot_parse_is_read_without_its_traceback():
    # The empty page: trafilatura finds no text, and readability's fallback logs a traceback as it raises.
    result = in_a_fresh_process("from tools.web.reader import extract; print(extract('', 'https://example.org/'))")
    assert (result.returncode, result.stdout, result.stderr) == (0, "('', '', [])\n", "")


def test_transformers_progress_bars_are_off_unless_the_user_turns_them_on():
    # The switch is read when huggingface_hub is imported, so only a process that imports dxr first shows it.
    enabled = "import dxr; from transformers.utils import logging; print(logging.is_progress_bar_enabled())"
    assert in_a_fresh_process(enabled).stdout == "False\n"
    assert in_a_fresh_process(enabled, HF_HUB_DISABLE_PROGRESS_BARS="0").stdout == "True\n"


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
    names = ("mlflow.pytorch", "readability.readability", *noise.LIGHTNING_LOGGERS)
    filters = {name: list(logging.getLogger(name).filters) for name in names}
    noise.silence_third_party_noise()
    assert {name: list(logging.getLogger(name).filters) for name in filters} == filters
    assert all(len(kept) == 1 for kept in filters.values())


def test_mlflows_artifact_bar_is_off_unless_the_user_turns_it_on(monkeypatch):
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

    assert MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() is False
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")
    noise.silence_third_party_noise()
    assert MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() is True


class RunRecords(logging.Handler):
    """(logger, level, message's first line, traceback kept) of each record a run logger hands to its handlers."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str, str, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelname, record.getMessage().splitlines()[0],
                             record.exc_info is not None))


def run_records(flow_fn) -> tuple[object, list[tuple[str, str, str, bool]]]:
    """The final state of `flow_fn` run with dxr's filter installed, and the records its run loggers handed on."""
    from dxr.errors import RUN_LOGGERS, quiet_user_errors

    quiet_user_errors()  # as the CLI and the flows package do
    handler, loggers = RunRecords(), [logging.getLogger(name) for name in RUN_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        return flow_fn(return_state=True), handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_a_users_error_in_a_task_is_logged_once_by_the_flow_runs_state_line_and_a_bug_in_full():
    # `dxr forecast` failing in a shard task printed its error three times at ERROR (the task run's exception and
    # state, the flow run's exception) before the flow run's state line and the CLI's `Error:` line.
    from prefect import flow, task

    from dxr.errors import InputError

    @task(name="stage")
    def stage(error: Exception) -> None:
        raise error

    @flow(name="pipeline")
    def pipeline(error: Exception) -> None:
        stage(error)

    user, user_records = run_records(lambda **kw: pipeline(InputError("cohort 'x' not found"), **kw))
    bug, bug_records = run_records(lambda **kw: pipeline(KeyError("k"), **kw))
    # The Prefect UI still records the failure and its message.
    assert user.is_failed() and user.message == "Flow run encountered an exception: InputError: cohort 'x' not found"
    assert [r for r in user_records if "not found" in r[2]] == [
        ("prefect.flow_runs", "INFO", "Finished in state Failed(\"Flow run encountered an exception: InputError: "
                                      "cohort 'x' not found\")", False)]
    assert bug.is_failed()
    assert [r for r in bug_records if "KeyError" in r[2]] == [
        ("prefect.task_runs", "ERROR", "Task run failed with exception: KeyError('k')", True),
        ("prefect.task_runs", "ERROR", "Finished in state Failed(\"Task run encountered an exception KeyError: "
                                       "'k'\")", False),
        ("prefect.flow_runs", "ERROR", "Encountered exception during execution: KeyError('k')", True),
        ("prefect.flow_runs", "INFO", "Finished in state Failed(\"Flow run encountered an exception: KeyError: "
                                      "'k'\")", False)]


def test_a_users_error_of_the_flow_body_keeps_its_state_line_and_a_retried_task_keeps_its_own():
    # The flow run's exception record goes without a task run's: its state line still carries the message. A task
    # whose user's error (an OSError) is retried is logged at INFO without the exception, so nothing of it is
    # dropped, and its final state line, Completed, must stay.
    from prefect import flow, task

    from dxr.errors import InputError

    @flow(name="checks")
    def checks() -> None:
        raise InputError("k must be at least 1, got 0")

    attempts = []

    @task(name="flaky", retries=1)
    def flaky() -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("disk busy")
        return 1

    @flow(name="retried")
    def retried() -> int:
        return flaky()

    state, records = run_records(checks)
    assert state.is_failed()
    assert [r for r in records if r[1] == "ERROR" or "Finished" in r[2]] == [
        ("prefect.flow_runs", "INFO", "Finished in state Failed('Flow run encountered an exception: InputError: k "
                                      "must be at least 1, got 0')", False)]
    state, records = run_records(retried)
    assert state.is_completed()
    assert [r for r in records if r[0] == "prefect.task_runs"] == [
        ("prefect.task_runs", "INFO", "Task run failed with exception: OSError('disk busy') - Retry 1/1 will start "
                                      "immediately", False),
        ("prefect.task_runs", "INFO", "Finished in state Completed()", False)]
