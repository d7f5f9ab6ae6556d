"""Configuration of EHR Prior training and inference (the `prior` section of the settings)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from dxr.errors import InputError
from dxr.settings_model import SettingsModel

ARCHS = {"ehr_prior": "moe", "dense_prior": "dense", "gru": "gru"}
# Lightning's seed_everything refuses a seed numpy's legacy generator does not take.
MAX_SEED = 2**32 - 1


def check_prior_system(system: str) -> str:
    if system not in ARCHS:
        raise InputError(f"unknown prior system {system!r}: use one of {', '.join(ARCHS)}")
    return system


def check_prior_systems(systems: tuple[str, ...]) -> None:
    """At least one system, each known and listed once: checked before the first of them is trained."""
    if not systems:
        raise InputError(f"no system given: name at least one of {', '.join(ARCHS)}")
    for position, system in enumerate(systems):
        check_prior_system(system)
        if system in systems[:position]:
            raise InputError(f"{system} is listed twice in systems: list each system once")


def check_model_version(version: str) -> str:
    """A registered version as MLflow numbers a model's versions: 1, 2, …"""
    if not re.fullmatch(r"[1-9][0-9]*", version):
        raise InputError(f"version {version!r} is no registered version: MLflow numbers them 1, 2, … "
                         "(`dxr prior models` lists them)")
    return version


class PriorConfig(SettingsModel):
    """Model, training and MLflow settings; CPU-friendly defaults (2 cores, minutes not hours)."""

    # ---- model ----
    d_model: int = Field(64, ge=8)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    n_experts: int = Field(4, ge=2, description="routed experts per MoE block (plus one shared expert)")
    top_k: int = Field(2, ge=1)
    expert_hidden: int = Field(64, ge=4)
    dropout: float = Field(0.1, ge=0, lt=1)
    # Visits of a training sequence (positions the network embeds); longer records keep their most recent visits,
    # and a forecast reads the most recent max_visits - 1 (`input_config`). The synthetic patients rarely exceed this.
    max_visits: int = Field(24, ge=2)
    max_codes_per_visit: int = Field(
        48, ge=1, description="kept in this order: diagnoses, procedures, medications, lab values")
    min_code_count: int = Field(3, ge=1, description="rarer input codes share the unknown token")
    # ---- training ----
    epochs: int = Field(8, ge=1)
    keep_best_epoch: bool = Field(True, description="register the weights of the epoch with the best tuning "
                                  "R@20 (the earliest on a tie) instead of the last epoch's")
    patience: int | None = Field(None, ge=1, description="stop once this many epochs in a row bring no better "
                                 "tuning R@20 than the best so far (needs keep_best_epoch); None = train every epoch")
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    # Codes of the next few visits after t+1 as a second, weaker target of position t: a condition coded two
    # visits on was usually present, uncoded, at t+1. +0.009 to +0.011 tuning R@20 at 5k (3 seeds), +0.006 at 50k.
    later_visits: int = Field(3, ge=0, description="visits after t+1 whose codes are a second target of visit t; "
                              "0 = the next visit only")
    later_weight: float = Field(0.5, ge=0, description="weight of the later-visits target in the loss")
    balance_loss_weight: float = Field(0.01, ge=0)
    z_loss_weight: float = Field(0.001, ge=0)
    seed: int = Field(7, ge=0, le=MAX_SEED, description="seeds torch, numpy and Lightning (0 to 2^32 - 1)")
    # One thread: on a shared 2-core machine, two intra-op threads were measured 10-80x slower (spin-waits).
    threads: int = Field(1, ge=1, description="torch CPU threads")
    max_train_patients: int | None = Field(None, ge=1, description="cap for quick runs; None = every train patient")
    featurize_chunk_patients: int = Field(20_000, ge=1, description="train patients featurized at a time "
                                          "(bounds the memory of reading and joining their events)")
    # ---- tracking / inference ----
    tracking_uri: str | None = Field(None, description="MLflow tracking URI; None = sqlite under <data_dir>/mlflow")
    experiment: str = "dxr-ehr-prior"
    alias: str = Field("champion", description="registered-model alias that inference resolves")
    promote: bool = Field(True, description="point the alias at the newly registered version after training")
    predict_batch_size: int = Field(1024, ge=1)

    @field_validator("alias")
    @classmethod
    def _settable_alias(cls, alias: str) -> str:
        # MLflow refuses these only when training points the alias at its new version, after the whole
        # training (and `ensure_prior` then trains another version at every call). Its rules, mirrored:
        if not re.fullmatch(r"[\w-]+", alias):
            raise ValueError(f"alias {alias!r} may hold only letters, digits, _ and - (an MLflow model alias)")
        if re.fullmatch(r"latest|v\d+", alias, flags=re.IGNORECASE):
            raise ValueError(f"MLflow reserves alias {alias!r} ('latest' and v<number> name versions): "
                             "choose another, e.g. champion or challenger")
        return alias

    @model_validator(mode="after")
    def _network_shape(self) -> PriorConfig:
        # Checked here so that a bad setting fails before minutes of featurization, not in the first step.
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be a multiple of n_heads {self.n_heads}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k {self.top_k} cannot exceed n_experts {self.n_experts}")
        return self

    @model_validator(mode="after")
    def _patience_keeps_best(self) -> PriorConfig:
        if self.patience is not None and not self.keep_best_epoch:
            raise ValueError(f"patience {self.patience} needs keep_best_epoch = true: a training stopped early "
                             "registers its best epoch's weights, not those of the epochs after it")
        return self
