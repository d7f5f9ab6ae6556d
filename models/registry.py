"""Which class implements each forecasting system. Imported lazily so that the frequency
baselines do not pay for importing torch."""

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


def forecaster_class(system: str) -> type:
    module, name = FORECASTERS[system].split(":")
    return getattr(import_module(module), name)
