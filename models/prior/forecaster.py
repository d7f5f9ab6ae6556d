"""Forecasters backed by a registered MLflow model: `ehr_prior` (MoE), `dense_prior`, `gru`.

`fit` does not train: it loads a version of the registered model `{system}-{cohort_id}`, the pinned
one or the one the alias (setting `prior.alias`, default `champion`) points to; `predict` is a batched
tensor computation over the pre-target records of a shard.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import torch

from dxr.config import load_settings
from dxr.errors import ConfigError
from models.prior import tracking
from models.prior.config import PriorConfig
from models.prior.data import Vocabulary, input_config, length_batches, trim, visit_tensors
from models.prior.nn import PriorNet
from models.transition import sql_frame
from warehouse import duck


def warehouse_root(con: duckdb.DuckDBPyConnection) -> Path:
    """The warehouse root behind a forecasting connection (its one allowed store directory, which may be allowed
    under its glob-escaped name too: `duck.confine`)."""
    allowed = con.sql("SELECT current_setting('allowed_directories')").fetchall()[0][0]
    stores = [Path(d) for d in allowed if d.rstrip("/").endswith("/forecast") and duck.glob_escaped(d) in allowed]
    if not stores:
        raise ConfigError(f"cannot locate the forecasting store from the connection (allowed: {allowed}); "
                          "open it with Warehouse.connect()")
    return stores[0].parent


def load_network(model_dir: Path) -> PriorNet:
    """The pickled network of an `mlflow.pytorch` model directory, loaded with torch directly.

    `mlflow.pytorch.load_model` would import its Lightning autologging (seconds per process) for
    a file that `torch.load` reads as is; the directory is our own registered artifact.
    """
    weights = model_dir / tracking.WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{model_dir} holds no {tracking.WEIGHTS}: it is not an mlflow.pytorch model "
                          "logged by `dxr prior train`; retrain or point the alias at such a version")
    net = torch.load(weights, map_location="cpu", weights_only=False)
    if not isinstance(net, PriorNet):
        raise ConfigError(f"{weights} holds a {type(net).__name__}, not a PriorNet: retrain with `dxr prior train`")
    return net.eval()


def check_vocabulary(con: duckdb.DuckDBPyConnection, cohort_id: str, vocab: Vocabulary, system: str,
                     version: str) -> None:
    """Refuse a model trained when the cohort's Ω held codes it no longer holds (a rebuild under the same cohort
    id, e.g. after an ICD release update): it would rank them, and a forecast names Ω codes only."""
    omega = sql_frame(con, "SELECT code FROM cohort_vocabulary WHERE cohort_id = ?", [cohort_id])["code"]
    trained = pl.Series(vocab.omega, dtype=pl.String)
    gone = trained.filter(~trained.is_in(omega.implode())).to_list()
    if gone:
        raise ConfigError(f"{tracking.registered_name(system, cohort_id)} version {version} was trained when cohort "
                          f"{cohort_id}'s vocabulary held codes that it no longer holds ({len(gone)}, e.g. {gone[0]}): "
                          "the cohort was rebuilt with another vocabulary since; train the model again "
                          f"(dxr prior train --cohort {cohort_id} --system {system})")


class RegisteredPrior:
    """Ranks Ω codes with a registered model of one system: the version `version` when pinned (a forecast
    run resolves its alias once, so that every shard uses one version), else the one the alias points to.

    `run_id`, given with a pinned version, is the MLflow run that version was when pinned; `fit` refuses
    a store where it is another run (the store was reset or replaced since).
    """

    system = "ehr_prior"

    def __init__(self, config: PriorConfig | None = None, version: str | None = None, run_id: str | None = None):
        self.config = config
        self.version = version
        self.pinned_run_id = run_id
        self.model_key = None  # set by fit

    @classmethod
    def resolve(cls, root: Path, cohort_id: str, config: PriorConfig | None = None) -> dict:
        """The registered version the configured alias points to now, as a forecast run records it."""
        cfg = config or load_settings(data_dir=root).prior
        tracking.use_tracking(root, cfg.tracking_uri, cfg.experiment)
        version, run_id = tracking.resolve_alias(cls.system, cohort_id, cfg.alias)
        return {"registered_model": tracking.registered_name(cls.system, cohort_id), "alias": cfg.alias,
                "version": version, "mlflow_run_id": run_id}

    def fit(self, con: duckdb.DuckDBPyConnection, cohort_id: str) -> None:
        root = warehouse_root(con)
        cfg = self.config or load_settings(data_dir=root).prior
        tracking.use_tracking(root, cfg.tracking_uri, cfg.experiment)
        if self.version is None:
            self.version, self.run_id = tracking.resolve_alias(self.system, cohort_id, cfg.alias)
        else:
            self.run_id = tracking.version_run(self.system, cohort_id, self.version)
            if self.pinned_run_id is not None and self.run_id != self.pinned_run_id:
                raise ConfigError(f"{tracking.registered_name(self.system, cohort_id)} version {self.version} is "
                                  f"MLflow run {self.run_id} in {tracking.mlflow.get_tracking_uri()}, not the "
                                  f"pinned run {self.pinned_run_id}: the tracking store changed since the forecast "
                                  "started; start it again")
        model_dir = tracking.download_model(self.system, cohort_id, self.version, self.run_id,
                                            root / "mlflow" / "cache")
        # The run id too: another (or a reset) tracking store numbers its versions from 1 again.
        self.model_key = {"registered_model": tracking.registered_name(self.system, cohort_id),
                          "version": self.version, "mlflow_run_id": self.run_id}
        bundle = tracking.read_bundle(model_dir)
        self.vocab = Vocabulary(**bundle["vocabulary.json"])
        check_vocabulary(con, cohort_id, self.vocab, self.system, self.version)
        self.train_cfg = PriorConfig(**bundle["prior_config.json"])
        self.batch_size = cfg.predict_batch_size
        torch.set_num_threads(cfg.threads)
        self.net = load_network(model_dir)
        self.output_codes = np.array(self.vocab.output_codes, dtype=object)

    def inference_settings(self) -> dict:
        """What besides the model and the inputs decides `predict`'s scores in this thread, to the last bit.

        `inference_threads`: the torch threads `predict` would use if called in this thread, the count that `fit` set
        or whatever set it since in this thread (torch keeps one per thread, which a new thread takes from the latest
        `torch.set_num_threads` anywhere), not necessarily the `prior.threads` setting of now. `predict_batch_size`:
        the most trajectories a batch holds (`length_batches`). A reduction split over other threads, or a matrix
        product over another batch, rounds otherwise (scores moved by up to 2e-6), which may order near-ties otherwise.
        """
        return {"inference_threads": torch.get_num_threads(), "predict_batch_size": self.batch_size}

    @torch.inference_mode()
    def predict(self, trajectories: pl.DataFrame, pretarget: pl.DataFrame, k: int) -> pl.DataFrame:
        keys = trajectories["trajectory_id"].to_list()
        t = visit_tensors(pretarget, "trajectory_id", self.vocab, input_config(self.train_cfg), keys=keys)
        top_k = min(k, self.vocab.n_output)
        scores, codes = torch.empty(len(keys), top_k), torch.empty(len(keys), top_k, dtype=torch.long)
        states = torch.empty(len(keys), self.net.cfg.d_model)
        for part in length_batches(t.lengths, self.batch_size):
            batch = trim({"codes": t.codes[part], "numeric": t.numeric[part], "static": t.static[part],
                          "lengths": t.lengths[part], "dx": t.dx.dense(part)})
            logits, states[part], _ = self.net(batch["codes"], batch["numeric"], batch["static"], batch["lengths"],
                                               batch["dx"], last_only=True)
            scores[part], codes[part] = logits.topk(top_k, dim=1)
        ranked = pl.DataFrame({
            "row": np.repeat(np.arange(len(keys)), top_k),
            "code": self.output_codes[codes.reshape(-1).numpy()],
            "score": scores.reshape(-1).double().numpy()}, schema_overrides={"code": pl.String})
        unseen = self._unseen_history_scores(t, states)
        return (pl.concat([ranked, unseen])
                .sort(["row", "score", "code"], descending=[False, True, False])
                .unique(["row", "code"], keep="first", maintain_order=True)
                .with_columns(pl.int_range(1, pl.len() + 1, dtype=pl.Int32).over("row").alias("rank"))
                .filter(pl.col("rank") <= k)
                .join(pl.DataFrame({"row": np.arange(len(keys)), "trajectory_id": keys}), on="row")
                .select("trajectory_id", "rank", "code", "score", pl.lit(True).alias("native")))

    def _unseen_history_scores(self, t, states: torch.Tensor) -> pl.DataFrame:
        """Scores of Ω history codes the model never saw in training (copied from the history)."""
        if t.history.is_empty():
            return pl.DataFrame(schema={"row": pl.Int64, "code": pl.String, "score": pl.Float64})
        last = t.lengths.numpy() - 1
        features = (t.history.group_by("row", "code")
                    .agg(pl.col("pos").n_unique().alias("count"), pl.col("pos").max().alias("last_pos"))
                    .join(pl.DataFrame({"row": np.arange(len(last)), "now": last}), on="row"))
        history = torch.tensor(np.stack([
            np.log1p(features["count"].to_numpy()),
            1.0 / (1.0 + features["now"].to_numpy() - features["last_pos"].to_numpy()),
            (features["last_pos"] == features["now"]).to_numpy()], axis=1), dtype=torch.float32)
        rows = torch.tensor(features["row"].to_numpy())
        scores = self.net.head.unseen_code_scores(states[rows], history)
        return features.select("row", "code", pl.Series("score", scores.double().numpy()))


class DensePrior(RegisteredPrior):
    """The same transformer without experts (ablation)."""

    system = "dense_prior"


class GRUPrior(RegisteredPrior):
    """GRU over visits with a generative head only (Doctor-AI style)."""

    system = "gru"
