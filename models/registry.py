"""The systems `dxr forecast` runs: which class implements each forecaster, the LLM systems, the lists a fused system
reads, and the checks of system ids that commands and settings run. Classes are imported lazily, so that the
frequency baselines do not pay for importing torch, and nothing here imports the stages, so that checking a system id
(a command's option, a backfill in the settings) costs no second of imports."""

from __future__ import annotations

from importlib import import_module

from dxr.errors import InputError
from warehouse.schemas import ORACLES, SYSTEMS

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
# The systems whose lists of the same run a fused system reads.
FUSED_INPUTS = {"rrf_prior_direct": ("ehr_prior", "direct")}


def forecastable_systems() -> list[str]:
    """The systems `dxr forecast` runs, sorted."""
    return sorted([*FORECASTERS, *LLM_SYSTEMS])


def check_system(system: str) -> None:
    """A system `dxr forecast` can run; the error tells a typo from a declared system that no forecast produces."""
    if system in FORECASTERS or system in LLM_SYSTEMS:
        return
    available = ", ".join(forecastable_systems())
    if system in ORACLES:
        raise InputError(f"system {system!r} is not forecast: dxr evaluate adds it from the gold store to every "
                         f"evaluation of a synthetic cohort; forecast one of: {available}")
    if system in SYSTEMS:
        raise InputError(f"system {system!r} is declared but not built yet; available: {available}")
    raise InputError(f"unknown system {system!r}; available: {available}")


def check_evaluable(system: str) -> None:
    """A system `dxr evaluate` can score: one `dxr forecast` runs, or a gold-side oracle; the error tells a typo from
    a declared system that nothing produces yet, whose lists no run can hold."""
    evaluable = sorted([*forecastable_systems(), *ORACLES])
    if system in evaluable:
        return
    if system in SYSTEMS:
        raise InputError(f"system {system!r} is declared but not built yet, so no run has its lists; evaluable: "
                         f"{', '.join(evaluable)}")
    raise InputError(f"unknown system {system!r}; evaluable: {', '.join(evaluable)}")


def check_system_order(systems: tuple[str, ...]) -> None:
    """Each system is known and listed once, and every fused system comes after the systems whose lists it fuses."""
    if not systems:
        raise InputError("no system given: name at least one, e.g. repeat_history")
    for position, system in enumerate(systems):
        check_system(system)
        # A second forecast of a system into the run redoes the first, and deletes the lists fused from it since.
        if system in systems[:position]:
            raise InputError(f"{system} is listed twice in systems: list each system once")
        missing = [source for source in FUSED_INPUTS.get(system, ()) if source not in systems[:position]]
        if missing:
            raise InputError(f"{system} fuses the lists of {', '.join(FUSED_INPUTS[system])}: put "
                             f"{', '.join(missing)} before it in systems")


def forecaster_class(system: str) -> type:
    module, name = FORECASTERS[system].split(":")
    return getattr(import_module(module), name)
