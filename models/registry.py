"""The systems `dxr forecast` runs: which class implements each forecaster, and the LLM systems. Imported lazily so
that the frequency baselines do not pay for importing torch, nor a command checking a system id for importing the
stages."""

from __future__ import annotations

from importlib import import_module

FORECASTERS: dict[str, str] = {
    "global_frequency": "models.baselines:GlobalFrequency",
    "repeat_history": "models.baselines:RepeatHistory",
    "transition": "models.transition:Transition",
    "gru": "models.prior.forecaster:GRUPrior",
    "dense_prior": "models.prior.forecaster:DensePrior",
    "ehr_prior": "models.prior.forecaster:RegisteredPrior",
}

# LLM stages write their own telemetry and read other systems' lists of the run, so they are stage
# functions (tasks/direct.py) rather than fit/predict Forecasters.
LLM_SYSTEMS = ("direct", "rrf_prior_direct")


def forecastable_systems() -> list[str]:
    """The systems `dxr forecast` runs, sorted."""
    return sorted([*FORECASTERS, *LLM_SYSTEMS])


def forecaster_class(system: str) -> type:
    module, name = FORECASTERS[system].split(":")
    return getattr(import_module(module), name)
