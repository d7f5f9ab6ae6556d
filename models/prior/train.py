"""Train one prior system (ehr_prior | dense_prior | gru) on a cohort, tracked and registered in MLflow."""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb
import lightning as L
import numpy as np
import torch

from models.prior import tracking
from models.prior.config import ARCHS, PriorConfig, check_prior_system
from models.prior.lit import PriorDataModule, PriorModule
from models.prior.nn import NetConfig, PriorNet, init_output_bias, init_weights, n_parameters
from warehouse.scratch import naming, remove_abandoned, scratch

mlflow = tracking.mlflow
SELECTION_METRIC = "val_recall_at_20"  # tuning R@20 picks the epoch whose weights are registered


@dataclass
class TrainResult:
    system: str
    cohort_id: str
    mlflow_run_id: str
    registered_model: str
    version: str
    alias: str | None
    metrics: dict[str, float]
    n_train_patients: int
    n_train_sequences: int
    train_seconds: float
    peak_rss_mb: float


def net_config(system: str, cfg: PriorConfig, n_input: int, n_output: int) -> NetConfig:
    arch = ARCHS[check_prior_system(system)]
    return NetConfig(n_input_codes=n_input, n_output_codes=n_output, arch=arch, d_model=cfg.d_model,
                     n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_experts=cfg.n_experts, top_k=cfg.top_k,
                     expert_hidden=cfg.expert_hidden, dropout=cfg.dropout, max_visits=cfg.max_visits,
                     recurrence=arch != "gru")


EpochReport = Callable[[int, dict[str, float], float], None]  # (0-based epoch, its metrics, its seconds)


class MlflowEpochLogger(L.Callback):
    """Logs every collected statistic once per epoch (after validation) to the active MLflow run,
    and hands them to `report` (progress for whoever runs the training) with the epoch's seconds, its
    validation included. It reads the clock only: no tensor, no random draw, so training is unchanged."""

    def __init__(self, report: EpochReport | None = None):
        self.history: list[dict[str, float]] = []
        self.report = report
        self.started = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, module: PriorModule) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, module: PriorModule) -> None:
        metrics = module.epoch_metrics()  # Lightning validates before this hook: the tuning metrics are in
        self.history.append(metrics)
        mlflow.log_metrics(metrics, step=trainer.current_epoch)
        if self.report is not None:
            self.report(trainer.current_epoch, metrics, time.perf_counter() - self.started)

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state: dict) -> None:
        """The epochs an earlier attempt finished (`EpochCheckpoint`): logged again with their steps, so the MLflow
        run of the training that continues them holds every epoch."""
        self.history = state["history"]
        for epoch, metrics in enumerate(self.history):
            mlflow.log_metrics(metrics, step=epoch)


# Within an epoch, training logs how many batches it has done at most this often when no bar shows them: an epoch at
# 100,000 patients takes minutes, a line per batch would flood the log.
PROGRESS_SECONDS = 60.0


class BatchProgress(L.Callback):
    """Logs `<system> epoch 1/8: 120/900 batches in 61.2 s` when `every` seconds have passed since the epoch began or
    since its last such line. It reads the clock only: no tensor, no random draw, so training is unchanged."""

    def __init__(self, system: str, log: Callable[[str], None], every: float):
        # Not `self.log`: Lightning sets a callback's `log` to its module's metric logger when fitting begins.
        self.system, self.log_line, self.every = system, log, every
        self.started = self.reported = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, module: PriorModule) -> None:
        self.started = self.reported = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: PriorModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if now - self.reported >= self.every:
            self.log_line(f"{self.system} epoch {trainer.current_epoch + 1}/{trainer.max_epochs}: "
                          f"{batch_idx + 1:,}/{trainer.num_training_batches:,} batches in {now - self.started:.1f} s")
            self.reported = now


class KeepBestEpoch(L.Callback):
    """Remembers the weights of the epoch with the best tuning R@20 and restores them when fitting ends; with
    `patience`, ends the fit once that many epochs in a row have brought no better value.

    The earliest epoch wins a tie. Without labelled validation pairs (no tuning record with two visits,
    or no label visit with an output code) there is nothing to select on and the last epoch's weights stay, and
    nothing stops the fit early.
    """

    def __init__(self, patience: int | None = None):
        self.patience = patience
        self.epoch: int | None = None
        self.value = float("-inf")
        self.state: dict[str, torch.Tensor] | None = None

    def out_of_patience(self, last_epoch: int) -> bool:
        """Whether the epochs after the best one, up to `last_epoch` (0-based), have used up the patience."""
        return self.patience is not None and self.epoch is not None and last_epoch - self.epoch >= self.patience

    def on_train_start(self, trainer: L.Trainer, module: PriorModule) -> None:
        # A fit continued from a checkpoint whose epochs had used up the patience (`EpochCheckpoint`: the attempt
        # that wrote it stopped there, then failed to register): it trains no epoch more. Lightning checks
        # `should_stop` before each epoch, and keeps it in no checkpoint.
        if self.out_of_patience(trainer.current_epoch - 1):
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer: L.Trainer, module: PriorModule) -> None:
        value = module.epoch_metrics().get(SELECTION_METRIC)
        if value is not None and value > self.value:
            self.epoch, self.value = trainer.current_epoch, value
            self.state = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
        if self.out_of_patience(trainer.current_epoch):
            trainer.should_stop = True

    def on_fit_end(self, trainer: L.Trainer, module: PriorModule) -> None:
        if self.state is not None:
            module.net.load_state_dict(self.state)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "value": self.value, "state": self.state}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.value, self.state = state["epoch"], state["value"], state["state"]


# The key of a resume checkpoint that holds what dxr adds to Lightning's own (`EpochCheckpoint`).
RESUME_KEY = "dxr"


@dataclass
class CheckpointPlace:
    """Where a training writes its resume checkpoint after each finished epoch, and the identity (its MLflow tags:
    dxr run, settings digest, and the build of its cohort) that makes a checkpoint found there its own."""

    path: Path
    identity: dict[str, str]


def rng_states() -> dict:
    """The global random generators' states: torch's (dropout draws from it), Python's and numpy's (numpy's key as a
    list, so the checkpoint loads with `weights_only`)."""
    numpy = np.random.get_state(legacy=False)
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {**numpy, "state": {**numpy["state"], "key": numpy["state"]["key"].tolist()}}}


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    numpy = states["numpy"]
    np.random.set_state({**numpy, "state": {**numpy["state"], "key": np.array(numpy["state"]["key"], np.uint32)}})


class EpochCheckpoint(L.Callback):
    """After each finished epoch (its validation and `KeepBestEpoch`'s choice included: this callback comes last),
    writes Lightning's full checkpoint (weights, optimizer, loop state, the callbacks' state: the best epoch's
    weights and value, the metric history) with the global random generators' states, the training seconds so far
    (`carried` from earlier attempts plus this one's since `started`) and the identity it belongs to.

    Written beside its place under a scratch name and renamed over it: a kill while writing leaves the previous
    checkpoint, or none, never part of one. It reads the clock and the generators' states only: no tensor changes, no
    random draw, so the training is the one it would be without it.

    A fit resumed from such a checkpoint gets the generators back as it restores the checkpoint, before anything
    draws from them (nothing draws between the end of one epoch and the next epoch's data loader iterator), and
    starts the batch sampler at its first epoch: a sampler made anew counts its epochs from 0.
    """

    def __init__(self, place: CheckpointPlace, carried: float, started: float, mlflow_run_id: str):
        self.place, self.carried, self.started, self.mlflow_run_id = place, carried, started, mlflow_run_id
        self.resumed = False

    def on_train_epoch_start(self, trainer: L.Trainer, module: PriorModule) -> None:
        if self.resumed:
            trainer.train_dataloader.batch_sampler.set_epoch(trainer.current_epoch)
            self.resumed = False

    def on_train_epoch_end(self, trainer: L.Trainer, module: PriorModule) -> None:
        remove_abandoned(self.place.path)  # what a write killed midway left
        with scratch(self.place.path, "tmp") as tmp, naming(self.place.path):
            trainer.save_checkpoint(tmp, weights_only=False)  # the full checkpoint: optimizer and loops too
            os.replace(tmp, self.place.path)

    def on_save_checkpoint(self, trainer: L.Trainer, module: PriorModule, checkpoint: dict) -> None:
        checkpoint[RESUME_KEY] = {"identity": self.place.identity, "epochs": trainer.current_epoch + 1,
                                  "seconds": self.carried + time.perf_counter() - self.started,
                                  "mlflow_run_id": self.mlflow_run_id, "rng": rng_states()}

    def on_load_checkpoint(self, trainer: L.Trainer, module: PriorModule, checkpoint: dict) -> None:
        # Here, before the fit makes its first epoch's data loader iterator, which draws its base seed from the torch
        # generator: a fit's first iterator is made before its first epoch starts, the later ones after.
        set_rng_states(checkpoint[RESUME_KEY]["rng"])
        self.resumed = True


def read_checkpoint(place: CheckpointPlace) -> dict | None:
    """What dxr added to the resume checkpoint at `place` (`EpochCheckpoint`) when it is this training's; None when
    there is none there, or one of another training (other settings, another build of the cohort) or unreadable."""
    if not place.path.is_file():
        return None
    try:
        resume = torch.load(place.path, map_location="cpu", weights_only=True)[RESUME_KEY]
    except Exception:  # whatever keeps it from loading (damaged, another format): no checkpoint to continue
        return None
    return resume if resume["identity"] == place.identity else None


def fit_network(data: PriorDataModule, system: str, cfg: PriorConfig, callbacks: list[L.Callback] = (),
                progress: bool = False, log: Callable[[str], None] | None = None,
                checkpoint: EpochCheckpoint | None = None,
                resume: bool = False) -> tuple[PriorNet, NetConfig, int | None]:
    """Seeded Lightning fit of a fresh network on a set-up data module: `cfg.epochs` epochs, fewer when
    `cfg.patience` runs out (`KeepBestEpoch`).

    With `progress` Lightning's bar shows the batches on a terminal; otherwise `log` receives a line at most every
    PROGRESS_SECONDS within an epoch (`BatchProgress`). `checkpoint` writes a resume checkpoint after each finished
    epoch; with `resume` the fit continues from the one at its place, as the fit that wrote it would have gone on.

    Returns the network in eval mode, its config and the epoch whose weights it holds (0-based;
    None when `keep_best_epoch` is off or there was nothing to validate on: the last epoch).
    """
    torch.set_num_threads(cfg.threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    net_cfg = net_config(system, cfg, data.vocab.n_input, data.vocab.n_output)
    net = PriorNet(net_cfg)
    init_weights(net)
    train = data.train_set.t
    row, pos, _, ids = train.dx.entries()
    init_output_bias(net, ids[pos < train.lengths[row]], int(train.lengths.sum()))
    best = KeepBestEpoch(cfg.patience) if cfg.keep_best_epoch else None
    # Lightning's bar is drawn on stdout, and drawn whole even into a file or a pipe (a log, `dxr demo | tee`), where
    # it repeats the epoch lines dxr logs itself: shown only on a terminal, as dxr's own bars (tqdm, disable=None).
    show_bar = progress and sys.stdout.isatty()
    batches = [] if show_bar or log is None else [BatchProgress(system, log, PROGRESS_SECONDS)]
    # No tuning pair (the MIMIC-III demo's tuning patients have one visit before their target): validation is
    # switched off, or Lightning warns that a loader of length zero may not be what was meant; dxr says it itself.
    # Otherwise the limit stays unset (None, every batch): set to 1.0 it made Lightning say so on every fit.
    trainer = L.Trainer(max_epochs=cfg.epochs, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=show_bar, enable_model_summary=False,
                        num_sanity_val_steps=0, deterministic=True, limit_val_batches=None if len(data.val_set) else 0,
                        callbacks=[*callbacks, *batches, *([best] if best else []),
                                   *([checkpoint] if checkpoint else [])])
    trainer.fit(PriorModule(net, cfg), datamodule=data, ckpt_path=checkpoint.place.path if resume else None,
                weights_only=True)
    return net.eval(), net_cfg, best.epoch if best else None


# MLflow run tag holding what a `TrainResult` needs besides the registered version (`registered_training`).
RESULT_TAG = "dxr.result"


def train_prior_model(con: duckdb.DuckDBPyConnection, cohort_id: str, system: str, cfg: PriorConfig,
                      data_dir: str | Path, progress: bool = False, report_epoch: EpochReport | None = None,
                      identity: dict[str, str] | None = None, log: Callable[[str], None] | None = None,
                      checkpoint: CheckpointPlace | None = None) -> TrainResult:
    """Fit on train patients, validate on tuning pre-target records, log and register the model.

    `log` receives one line when the training data is featurized: at 100,000 patients a log was otherwise silent for
    about a minute before the first epoch's line (`report_epoch`); then, without a bar, a line at most every
    PROGRESS_SECONDS within an epoch (`fit_network`), whose first takes minutes at that scale.

    `identity` (tags naming the training, `tasks.prior.training_identity`) goes on the MLflow run, so a retry
    of a training that registered its version and then failed finds that version (`registered_training`).

    With `checkpoint` a resume checkpoint is written there after each finished epoch (`EpochCheckpoint`), and a
    checkpoint of the same training found there (an earlier attempt killed or failed) is continued from: the
    MLflow run logs the earlier epochs' metrics again and is tagged `dxr.resumed_after_epoch` (how many epochs
    the checkpoint held) and `dxr.resumed_from_mlflow_run`. `train_seconds` is then the sum over the attempts of
    the time each spent up to its last checkpoint (featurizing included), this one's whole: work a kill cut short
    after a checkpoint is not counted.
    """
    net_config(system, cfg, 0, 0)  # unknown system: fail before touching MLflow
    tracking.use_tracking(data_dir, cfg.tracking_uri, cfg.experiment)
    started = time.perf_counter()
    data = PriorDataModule(con, cohort_id, cfg)
    data.setup()
    if log is not None:
        log(f"{system}: {len(data.train_set):,} training sequences ({data.n_train_patients:,} train patients) and "
            f"{len(data.val_set):,} tuning pairs featurized in {time.perf_counter() - started:.1f} s")
    epoch_logger = MlflowEpochLogger(report_epoch)
    name = tracking.registered_name(system, cohort_id)
    resume = None if checkpoint is None else read_checkpoint(checkpoint)
    if checkpoint is not None and resume is None and checkpoint.path.exists() and log is not None:
        log(f"{system}: the checkpoint {checkpoint.path} is another training's (other settings, or another build of "
            "the cohort) or does not load: not continued from, and replaced after the first epoch")
    carried = 0.0 if resume is None else resume["seconds"]
    with (tracking.store_errors(f"recording the training of {name}"),
          mlflow.start_run(run_name=f"{system}-{cohort_id}") as run):
        mlflow.set_tags({"system": system, "cohort_id": cohort_id, "arch": ARCHS[system], **(identity or {})})
        if resume is not None:
            mlflow.set_tags({"dxr.resumed_after_epoch": resume["epochs"],
                             "dxr.resumed_from_mlflow_run": resume["mlflow_run_id"]})
            if log is not None:
                log(f"{system}: continuing after epoch {resume['epochs']}/{cfg.epochs} from the checkpoint an "
                    f"earlier attempt wrote ({checkpoint.path}; MLflow run {resume['mlflow_run_id']})")
        mlflow.log_params({**{f"prior.{k}": v for k, v in cfg.model_dump().items()},
                           "system": system, "cohort_id": cohort_id, "n_input_codes": data.vocab.n_input,
                           "n_output_codes": data.vocab.n_output, "n_train_sequences": len(data.train_set),
                           "n_val_pairs": len(data.val_set)})
        mlflow.log_dict(cfg.model_dump(), "prior_config.json")
        writer = None if checkpoint is None else EpochCheckpoint(checkpoint, carried, started, run.info.run_id)
        net, net_cfg, best_epoch = fit_network(data, system, cfg, [epoch_logger], progress, log, writer,
                                               resume=resume is not None)
        mlflow.log_param("n_parameters", n_parameters(net))
        seconds = carried + time.perf_counter() - started
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        trained = len(epoch_logger.history)
        selected = trained - 1 if best_epoch is None else best_epoch
        if trained < cfg.epochs and log is not None:  # only the patience ends a fit early
            log(f"{system}: stopped after epoch {trained}/{cfg.epochs}: no better tuning R@20 than epoch "
                f"{selected + 1}'s in the {cfg.patience} epoch{'s' * (cfg.patience > 1)} after it (prior.patience)")
        summary = {"train_seconds": seconds, "train_patients_per_second": data.n_train_patients / seconds,
                   "peak_rss_mb": peak_mb, "selected_epoch": selected, "epochs_trained": trained}
        mlflow.log_metrics(summary)
        chosen = epoch_logger.history[selected] if epoch_logger.history else {}
        outcome = {"metrics": {**chosen, **summary}, "n_train_patients": data.n_train_patients,
                   "n_train_sequences": len(data.train_set), "train_seconds": seconds, "peak_rss_mb": peak_mb}
        mlflow.set_tag(RESULT_TAG, json.dumps(outcome))  # before registering: a registered version has it
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for file, payload in (("vocabulary.json", data.vocab.to_json()),
                                  ("prior_config.json", cfg.model_dump()), ("net_config.json", asdict(net_cfg))):
                path = Path(tmp) / file
                with naming(path):  # the temporary directory may be full: Python's write names no file
                    path.write_text(json.dumps(payload))
                files.append(str(path))
            torch_pin = f"torch=={torch.__version__.split('+')[0]}"
            info = mlflow.pytorch.log_model(net, name="model", registered_model_name=name, extra_files=files,
                                            serialization_format="pickle", pip_requirements=[torch_pin])
        version = str(info.registered_model_version)
        alias = None
        if cfg.promote:
            tracking.MlflowClient().set_registered_model_alias(name, cfg.alias, version)
            alias = cfg.alias
    return TrainResult(system, cohort_id, run.info.run_id, name, version, alias, **outcome)


def registered_training(system: str, cohort_id: str, cfg: PriorConfig, identity: dict[str, str]) -> TrainResult | None:
    """The training tagged `identity` whose model version is registered, put in service as `cfg.promote` says;
    None when no attempt of it got as far as registering.

    An attempt can register its version and still fail (putting it in service, ending the MLflow run, recording
    the dxr run) or be killed: its retry takes that version instead of registering another of the same training.
    """
    found = tracking.version_tagged(system, cohort_id, identity)
    if found is None:
        return None
    version, run = found  # its run was tagged with the result before the version was registered
    alias = None
    if cfg.promote:
        tracking.set_alias(system, cohort_id, version, cfg.alias)
        alias = cfg.alias
    return TrainResult(system, cohort_id, run.info.run_id, tracking.registered_name(system, cohort_id), version,
                       alias, **json.loads(run.data.tags[RESULT_TAG]))
