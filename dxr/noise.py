"""Third-party output that a dxr user can do nothing about, silenced by name in every process that imports dxr.

The CLI, the flows (also when `dxr serve`'s runner imports a served flow) and the benchmarks import `dxr`
before Lightning, MLflow, readability or huggingface_hub log anything or read their settings, and `dxr/__init__`
calls `silence_third_party_noise` once. Each entry names one logger's messages, one warning's text, a library's
documented switch or one print function's lines, and says why it is safe; everything else those libraries log, warn
or print, and every error that dxr does not handle itself, still reaches the user. Nothing is imported here: a
command that never trains, reads a page or embeds pays nothing; MLflow's registration notices are silenced by the
module that imports MLflow (`models.prior.tracking`, `silence_mlflow_registration_notices`), in every process that
trains or serves a prior (the CLI's, a flow's, a benchmark's child). Lightning's progress bar is a Trainer option,
set where every training builds its Trainer (`models.prior.train.fit_network`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable

# Lightning's INFO lines about the hardware and its own products, on each fit: dxr trains on the CPU by choice
# (Trainer(accelerator="cpu"); a GPU left unused is still a warning of Lightning's), logs one line per epoch
# itself (`tasks.prior.epoch_reporter`), so "stopped: max_epochs reached" repeats its last epoch line; a fit
# stopped for another reason still says so. `rank_zero_info` logs through the logger of whichever of Lightning's
# rank_zero modules was imported last: importing `mlflow.pytorch` (to log or load a model) imports the standalone
# `pytorch_lightning`, so every later fit in the process logs through its loggers. A training that continues from its
# resume checkpoint says so in its own line, naming the checkpoint and the epoch (`models.prior.train`), which
# Lightning's two lines on restoring it repeat.
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero")
LIGHTNING_INFO = ("GPU available: ", "TPU available: ", "💡 Tip: ", "`Trainer.fit` stopped: `max_epochs=",
                  "Restoring states from the checkpoint path at ", "Restored all states from the checkpoint at ")

# MLflow warns at every `log_model` that a pickled model runs code when loaded. dxr pickles on purpose
# (`models.prior.train`), and 'pt2' is no drop-in: the forecaster calls the network with `last_only=True` and
# calls its head's `unseen_code_scores`, which an export of the forward pass traced at an example's shapes does
# not keep; loads and the check that a cached copy is whole read `data/model.pth` (`tracking.WEIGHTS`), which
# 'pt2' does not write; every version registered so far is a pickle. The pickle loaded is one dxr registered in
# the configured store (`models.prior.forecaster.load_network`), not a file from elsewhere.
MLFLOW_MESSAGES = {
    "mlflow.pytorch": ("Saving pytorch model by Pickle or CloudPickle format requires exercising caution",),
    # The first two are logged only when MLflow creates a new, empty store's tables (made, then brought to the
    # installed schema), with nothing for the user to do; a store with an older schema is not migrated but refused
    # with MLflow's error naming `mlflow db upgrade`, and that and any failure still raise and are reported in one
    # line (`models.prior.tracking`). The third is logged, with its traceback, for each SQLite error of a store
    # operation (a full disk: two tracebacks of 40 lines before dxr's line), which MLflow then raises as its own
    # error, reported in that one line.
    "mlflow.store.db.utils": ("Creating initial MLflow database tables", "Updating database tables",
                              "SQLAlchemy database error"),
}

# MLflow prints a notice at each model registration with `eprint`, a print to its stream that no logger's filter
# reaches: "Successfully registered model 'gru-c1'." (or "Registered model 'gru-c1' already exists. Creating a new
# version of this model...") and "Created version '2' of model 'gru-c1'.". A training names the version it registered
# in its own line (`gru: registered gru-c1 v2 @champion; ...`). What else `eprint` prints and everything MLflow logs
# still reach stderr, and a registration that fails raises, reported in one line.
MLFLOW_REGISTRATION_NOTICES = ("Successfully registered model '", "Registered model '", "Created version '")

# readability logs a whole traceback for markup it cannot parse, then raises `Unparseable`, which the web reader
# catches to keep trafilatura's text (`tools.web.reader.extract`): the page is still read, nothing is wrong.
READABILITY_MESSAGES = {"readability.readability": ("error getting summary",)}


class DropMessages(logging.Filter):
    """Drop the records whose message starts with one of `prefixes`; let every other record through."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


class DropPrints:
    """A print function that drops the lines starting with one of `prefixes` and prints every other with `printer`."""

    def __init__(self, printer: Callable[..., None], prefixes: tuple[str, ...]):
        self.printer = printer
        self.prefixes = prefixes

    def __call__(self, *values, **options) -> None:
        if not (values and str(values[0]).startswith(self.prefixes)):
            self.printer(*values, **options)


def silence_mlflow_registration_notices() -> None:
    """Drop `MLFLOW_REGISTRATION_NOTICES` where MLflow's registry prints them, once however often it is called."""
    from mlflow.tracking._model_registry import fluent

    if not isinstance(fluent.eprint, DropPrints):
        fluent.eprint = DropPrints(fluent.eprint, MLFLOW_REGISTRATION_NOTICES)


def silence_third_party_noise() -> None:
    """Install the filters and defaults above, once however often it is called (a user's own
    MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR or HF_HUB_DISABLE_PROGRESS_BARS wins)."""
    # A logger's filter sees the records logged through it, whichever handlers (Lightning's own, Prefect's
    # console) then print them, so each line goes at its source.
    dropped = {**{name: LIGHTNING_INFO for name in LIGHTNING_LOGGERS}, **MLFLOW_MESSAGES, **READABILITY_MESSAGES}
    for name, prefixes in dropped.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(prefixes))
    # MLflow draws a bar for each artifact download or upload, even into a log file: a model's few small files
    # take milliseconds, and a load that fails still raises (its documented switch).
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # transformers draws a "Loading weights" bar on every model load, i.e. on every dense `dxr corpus search`
    # (`tools.embeddings`); a corpus build reports its own progress (`tools.index.chunk_progress`). huggingface_hub's
    # switch, read when it is imported, turns off its bars and transformers' (which follows it) alike; dxr downloads
    # nothing from the hub (HF_HUB_OFFLINE). Only the bars go: transformers' log level stays, so its report of weights
    # a model directory lacks (loaded random) still reaches stderr.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Lightning 2.6 still builds torch's LeafSpec, which torch 2.13 deprecates: Lightning's code to change, not
    # dxr's nor the user's. (A filter already there is moved, not repeated.)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
