"""The oracle: P(code ∈ Y | latent state at the cutoff), by Monte Carlo over the target encounter.

For each trajectory the patient is re-simulated (deterministically, from its own streams) up to
the latent state just before its target encounter; that encounter is then drawn `draws` times
with `draw_encounter` (prepared once for them all, `EncounterModel`) — the very code the generator
used — from an oracle stream that is distinct from the realized encounter's stream. The oracle
thus marginalizes everything decided at the target encounter (its reason, which conditions get
coded, which sibling, complications) and never reads the target encounter's events: it is the
ceiling a forecaster can approach, not a copy of the target.

That ceiling knows the whole latent state, including conditions that began after the last
visit or were never coded, which no record shows. The **record oracle** (`information="record"`)
draws the same encounter from the state restricted to what the pre-target encounters reveal:
conditions with at least one of their codes or medications there (a hidden pregnancy also drops
its scheduled delivery). It is not a bound either way: a forecaster may still infer hidden
conditions from risk factors or from graded lab evidence (HbA1c, eGFR, BNP), which the record
oracle ignores, while the record oracle keeps the exact latent stage of the conditions it keeps.
The difference between the two measures how much of the oracle rests on conditions no code or
medication of the record shows.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import polars as pl

from dxr.errors import ConfigError, InputError
from warehouse.synthetic.conditions import CHRONIC_BY_NAME, codes_of
from warehouse.synthetic.events import to_us
from warehouse.synthetic.generate import GENERATOR_VERSION, read_synthetic_metadata
from warehouse.synthetic.simulate import (DIAGNOSIS, MAX_ENCOUNTERS, Encounter, EncounterModel, State,
                                          simulate_patient, stream)

_EPOCH = datetime(1970, 1, 1)
_REQUIRED = ("trajectory_id", "subject_id", "target_encounter_id", "cutoff_time")
PARALLEL_FROM = 2000  # trajectories; below this one process is faster than starting two
INFORMATION = ("latent", "record")
_CONDITION_CODES = {name: frozenset(codes_of(c)) for name, c in CHRONIC_BY_NAME.items()}
_CONDITION_MEDS = {name: frozenset(med for _, med in c.meds) for name, c in CHRONIC_BY_NAME.items()}


def record_state(state: State, earlier: list[Encounter]) -> State:
    """The state restricted to conditions that the earlier encounters reveal by a code or a medication."""
    codes = {c for e in earlier for c in e.draw.codes}
    meds = {m for e in earlier for m in e.outcome.medications}
    revealed = state.copy()
    for name in list(revealed.conds):
        if not (_CONDITION_CODES[name] & codes or _CONDITION_MEDS[name] & meds):
            del revealed.conds[name]
    if "pregnancy" not in revealed.conds:
        revealed.pending, revealed.due = "", math.inf
    revealed.changed()
    return revealed


def encounter_probabilities(seed: int, subject_id: int, index: int, state: State, t: float, draws: int,
                            harmonize: Callable[[list[str]], list[str]] | None = None) -> Counter:
    """Monte Carlo estimate of P(code ∈ Y) for encounter `index` given the state before it."""
    rng = stream(seed, subject_id, "oracle", index)
    model = EncounterModel(state, t)
    counts: Counter = Counter()
    cache: dict[tuple[str, ...], tuple[str, ...]] = {}
    for _ in range(draws):
        codes = tuple(sorted(DIAGNOSIS + c.replace(".", "") for c in model.draw(rng).codes))
        if harmonize is not None:
            if codes not in cache:
                cache[codes] = tuple(set(harmonize(list(codes))))
            codes = cache[codes]
        counts.update(codes)
    return counts


def oracle(meds_dir: Path, trajectories: pl.DataFrame, harmonize: Callable[[list[str]], list[str]] | None,
           draws: int = 200, top: int = 100, information: str = "latent") -> pl.DataFrame:
    """Oracle probabilities (trajectory_id, code, probability): the `top` codes per trajectory.

    `information`: `latent` (the state at the cutoff) or `record` (the record oracle, see above).
    `harmonize` must be picklable (a module-level function or a `functools.partial` of one): large
    cohorts are split across worker processes.
    """
    if information not in INFORMATION:
        raise InputError(f"oracle: information={information!r}; choose one of {', '.join(INFORMATION)}")
    missing = [c for c in _REQUIRED if c not in trajectories.columns]
    if missing:
        raise InputError(f"oracle: trajectories lack column(s) {missing}; expected {list(_REQUIRED)}")
    if draws < 1 or top < 1:
        raise InputError(f"oracle: draws={draws}, top={top}: both must be positive")
    meta = read_synthetic_metadata(meds_dir)
    if meta.get("generator_version") != GENERATOR_VERSION:
        raise ConfigError(f"{meds_dir} was generated by {meta.get('generator_version')}, this code is "
                          f"{GENERATOR_VERSION}: regenerate the dataset (the oracle re-simulates its patients)")
    seed = int(meta["synthetic_seed"])
    traj = trajectories.select(_REQUIRED).with_columns(pl.col("cutoff_time").cast(pl.Datetime("us")))
    by_subject: dict[int, list[tuple[str, int, int]]] = {}
    for tid, sid, eid, cutoff in traj.iter_rows():
        index = eid - sid * 1000
        if not 0 <= index < MAX_ENCOUNTERS:
            raise InputError(f"oracle: trajectory {tid}: encounter {eid} does not belong to subject {sid} "
                             "in this synthetic dataset (encounter ids are subject_id*1000 + index)")
        by_subject.setdefault(sid, []).append((tid, index, cutoff))
    subjects = list(by_subject.items())
    # Worker processes pay a start-up cost (imports, definitions); worth it only for large cohorts.
    workers = min(2, os.cpu_count() or 1) if len(traj) >= PARALLEL_FROM else 1
    chunks = [subjects[i::workers] for i in range(workers)]
    jobs = [(meds_dir, seed, chunk, draws, top, harmonize, information) for chunk in chunks]
    if workers > 1:
        # spawn, not fork: forking a process whose polars/duckdb thread pools are running can deadlock.
        # A Pool's exit terminates its workers at once, so SIGTERM or Ctrl-C stops the build without
        # waiting minutes for the chunks in flight.
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            parts = pool.map(_oracle_chunk, jobs)
    else:
        parts = [_oracle_chunk(job) for job in jobs]
    return pl.concat(parts).sort("trajectory_id", "probability", "code", descending=[False, True, False])


def _oracle_chunk(job) -> pl.DataFrame:
    """Oracle rows for a list of (subject_id, [(trajectory_id, encounter index, cutoff)])."""
    meds_dir, seed, subjects, draws, top, harmonize, information = job
    tids, codes, probs = [], [], []
    for sid, items in subjects:
        wanted = frozenset(i for _, i, _ in items)
        patient = simulate_patient(seed, sid, capture=wanted, stop_after=max(wanted))  # never draws a target
        for tid, index, cutoff in items:
            if index not in patient.captured:
                raise InputError(f"oracle: trajectory {tid}: subject {sid} has no encounter {index} when "
                                 f"re-simulated with seed {seed}; is {meds_dir} the dataset these trajectories "
                                 "came from?")
            state, t = patient.captured[index]
            if cutoff is not None and abs(to_us(t) - (cutoff - _EPOCH) // timedelta(microseconds=1)) > 60_000_000:
                raise InputError(f"oracle: trajectory {tid}: cutoff {cutoff} differs from the re-simulated "
                                 f"admission time of encounter {sid * 1000 + index}; the trajectories do not "
                                 f"match {meds_dir}")
            if information == "record":
                state = record_state(state, patient.encounters[:index])
            counts = encounter_probabilities(seed, sid, index, state, t, draws, harmonize)
            ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
            for code, n in ranked:
                tids.append(tid)
                codes.append(code)
                probs.append(n / draws)
    return pl.DataFrame({"trajectory_id": tids, "code": codes, "probability": probs},
                        schema={"trajectory_id": pl.String, "code": pl.String, "probability": pl.Float64})
