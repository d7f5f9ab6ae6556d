"""Train one prior system (ehr_prior | dense_prior | gru) on a cohort, tracked and registered in MLflow."""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb
import lightning as L
import torch

from models.prior import tracking
from models.prior.config import ARCHS, PriorConfig, check_prior_system
from models.prior.lit import PriorDataModule, PriorModule
from models.prior.nn import NetConfig, PriorNet, init_output_bias, init_weights, n_parameters
from warehouse.scratch import naming

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
    """Remembers the weights of the epoch with the best tuning R@20 and restores them when fitting ends.

    The earliest epoch wins a tie. Without labelled validation pairs (no tuning record with two visits,
    or no label visit with an output code) there is nothing to select on and the last epoch's weights stay.
    """

    def __init__(self):
        self.epoch: int | None = None
        self.value = float("-inf")
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_epoch_end(self, trainer: L.Trainer, module: PriorModule) -> None:
        value = module.epoch_metrics().get(SELECTION_METRIC)
        if value is not None and value > self.value:
            self.epoch, self.value = trainer.current_epoch, value
            self.state = {k: v.detach().clone() for k, v in module.net.state_dict().items()}

    def on_fit_end(self, trainer: L.Trainer, module: PriorModule) -> None:
        if self.state is not None:
            module.net.load_state_dict(self.state)


def fit_network(data: PriorDataModule, system: str, cfg: PriorConfig, callbacks: list[L.Callback] = (),
                progress: bool = False,
                log: Callable[[str], None] | None = None) -> tuple[PriorNet, NetConfig, int | None]:
    """Seeded Lightning fit of a fresh network on a set-up data module.

    With `progress` Lightning's bar shows the batches on a terminal; otherwise `log` receives a line at most every
    PROGRESS_SECONDS within an epoch (`BatchProgress`).

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
    best = KeepBestEpoch() if cfg.keep_best_epoch else None
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
                        callbacks=[*callbacks, *batches, *([best] if best else [])])
    trainer.fit(PriorModule(net, cfg), datamodule=data)
    return net.eval(), net_cfg, best.epoch if best else None


# MLflow run tag holding what a `TrainResult` needs besides the registered version (`registered_training`).
RESULT_TAG = "dxr.result"


def train_prior_model(con: duckdb.DuckDBPyConnection, cohort_id: str, system: str, cfg: PriorConfig,
                      data_dir: str | Path, progress: bool = False, report_epoch: EpochReport | None = None,
                      identity: dict[str, str] | None = None, log: Callable[[str], None] | None = None) -> TrainResult:
    """Fit on train patients, validate on tuning pre-target records, log and register the model.

    `log` receives one line when the training data is featurized: at 100,000 patients a log was otherwise silent for
    about a minute before the first epoch's line (`report_epoch`); then, without a bar, a line at most every
    PROGRESS_SECONDS within an epoch (`fit_network`), whose first takes minutes at that scale.

    `identity` (tags naming the training, `tasks.prior.training_identity`) goes on the MLflow run, so a retry
    of a training that registered its version and then failed finds that version (`registered_training`).
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
    with (tracking.store_errors(f"recording the training of {name}"),
          mlflow.start_run(run_name=f"{system}-{cohort_id}") as run):
        mlflow.set_tags({"system": system, "cohort_id": cohort_id, "arch": ARCHS[system], **(identity or {})})
        mlflow.log_params({**{f"prior.{k}": v for k, v in cfg.model_dump().items()},
                           "system": system, "cohort_id": cohort_id, "n_input_codes": data.vocab.n_input,
                           "n_output_codes": data.vocab.n_output, "n_train_sequences": len(data.train_set),
                           "n_val_pairs": len(data.val_set)})
        mlflow.log_dict(cfg.model_dump(), "prior_config.json")
        net, net_cfg, best_epoch = fit_network(data, system, cfg, [epoch_logger], progress, log)
        mlflow.log_param("n_parameters", n_parameters(net))
        seconds = time.perf_counter() - started
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        selected = len(epoch_logger.history) - 1 if best_epoch is None else best_epoch
        summary = {"train_seconds": seconds, "train_patients_per_second": data.n_train_patients / seconds,
                   "peak_rss_mb": peak_mb, "selected_epoch": selected}
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
