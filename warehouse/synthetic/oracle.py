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
import os
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path

import numpy as np
import polars as pl

from dxr.errors import ConfigError, InputError
from dxr.processes import worker_pool
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
    harmonized: dict[tuple[str, ...], tuple[str, ...]] = {}
    for _ in range(draws):
        codes = [_meds_code(c) for c in model.draw(rng).codes]
        if harmonize is not None:
            key = tuple(sorted(codes))
            if key not in harmonized:
                harmonized[key] = tuple(set(harmonize(list(key))))
            codes = harmonized[key]
        counts.update(codes)
    return counts


@cache
def _meds_code(icd: str) -> str:
    """The MEDS code of a dotted ICD-10-CM code (the oracle rewrites some 2,000 per encounter, of a few hundred)."""
    return DIAGNOSIS + icd.replace(".", "")


def oracle(meds_dir: Path, trajectories: pl.DataFrame, harmonize: Callable[[list[str]], list[str]] | None,
           draws: int = 200, top: int = 100, information: str = "latent") -> pl.DataFrame:
    """Oracle probabilities (trajectory_id, code, probability): the `top` codes per trajectory.

    `information`: `latent` (the state at the cutoff) or `record` (the record oracle, see above).
    `harmonize` must be picklable (a module-level function or a `functools.partial` of one): large
    cohorts are split across worker processes.
    """
    if information not in INFORMATION:
        raise InputError(f"oracle: information={information!r}; choose one of {', '.join(INFORMATION)}")
    return dict(oracles(meds_dir, trajectories, harmonize, draws, top, (information,)))[information]


def oracles(meds_dir: Path, trajectories: pl.DataFrame, harmonize: Callable[[list[str]], list[str]] | None,
            draws: int = 200, top: int = 100, informations: tuple[str, ...] = INFORMATION
            ) -> Iterator[tuple[str, pl.DataFrame]]:
    """(information, `oracle` frame) for each of `informations`, from one re-simulation of each patient.

    The counts of every oracle are computed first, held compactly (integers); each frame is built only when the
    caller asks for the next, so a caller that writes and drops each one holds one frame at a time.
    """
    unknown = [i for i in informations if i not in INFORMATION]
    if unknown or not informations:
        raise InputError(f"oracle: information={unknown or list(informations)}; choose among {', '.join(INFORMATION)}")
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
    by_subject: dict[int, list[tuple[int, str, int, int]]] = {}
    for row, (tid, sid, eid, cutoff) in enumerate(traj.iter_rows()):
        index = eid - sid * 1000
        if not 0 <= index < MAX_ENCOUNTERS:
            raise InputError(f"oracle: trajectory {tid}: encounter {eid} does not belong to subject {sid} "
                             "in this synthetic dataset (encounter ids are subject_id*1000 + index)")
        by_subject.setdefault(sid, []).append((row, tid, index, cutoff))
    subjects = list(by_subject.items())
    # Worker processes pay a start-up cost (imports, definitions); worth it only for large cohorts.
    workers = min(2, os.cpu_count() or 1) if len(traj) >= PARALLEL_FROM else 1
    chunks = [subjects[i::workers] for i in range(workers)]
    jobs = [(meds_dir, seed, chunk, draws, top, harmonize, informations) for chunk in chunks]
    if workers > 1:
        with worker_pool(workers, "synthetic oracle", "free memory or give the build more (docs/benchmarks.md#memory "
                         "lists what each step needs), then rerun it") as pool:
            parts = list(pool.map(_oracle_chunk, jobs))
    else:
        parts = [_oracle_chunk(job) for job in jobs]
    trajectory_ids = traj["trajectory_id"].cast(pl.String)
    for information in informations:
        frames = []
        for codes, counted in parts:
            rows, positions, counts = (np.frombuffer(column, np.int32) for column in counted[information])
            frames.append(pl.DataFrame({"trajectory_id": trajectory_ids.gather(rows),
                                        "code": pl.Series(codes, dtype=pl.String).gather(positions),
                                        "probability": counts / draws}))
        yield information, pl.concat(frames).sort("trajectory_id", "probability", "code",
                                                  descending=[False, True, False])


def _oracle_chunk(job) -> tuple[list[str], dict[str, tuple[array, array, array]]]:
    """The counts of a list of (subject_id, [(row, trajectory_id, encounter index, cutoff)]): the codes seen, and
    per information the rows' (trajectory row, code's position among those codes, count) as int32 arrays."""
    meds_dir, seed, subjects, draws, top, harmonize, informations = job
    positions: dict[str, int] = {}
    counted = {information: (array("i"), array("i"), array("i")) for information in informations}
    for sid, items in subjects:
        wanted = frozenset(i for _, _, i, _ in items)
        patient = simulate_patient(seed, sid, capture=wanted, stop_after=max(wanted))  # never draws a target
        for row, tid, index, cutoff in items:
            if index not in patient.captured:
                raise InputError(f"oracle: trajectory {tid}: subject {sid} has no encounter {index} when "
                                 f"re-simulated with seed {seed}; is {meds_dir} the dataset these trajectories "
                                 "came from?")
            latent, t = patient.captured[index]
            if cutoff is not None and abs(to_us(t) - (cutoff - _EPOCH) // timedelta(microseconds=1)) > 60_000_000:
                raise InputError(f"oracle: trajectory {tid}: cutoff {cutoff} differs from the re-simulated "
                                 f"admission time of encounter {sid * 1000 + index}; the trajectories do not "
                                 f"match {meds_dir}")
            counted_here: dict[str, Counter] = {}
            for information in informations:
                state = latent if information == "latent" else record_state(latent, patient.encounters[:index])
                if information == "record" and "latent" in counted_here and _reveals_all(state, latent):
                    counts = counted_here["latent"]  # the same state, time and stream draw the same encounters
                else:
                    counts = encounter_probabilities(seed, sid, index, state, t, draws, harmonize)
                counted_here[information] = counts
                rows, codes, ns = counted[information]
                for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
                    rows.append(row)
                    codes.append(positions.setdefault(code, len(positions)))
                    ns.append(n)
    return list(positions), counted


def _reveals_all(revealed: State, latent: State) -> bool:
    """Whether `record_state` kept all of `latent`: it only drops conditions and a hidden pregnancy's delivery."""
    return (revealed.conds.keys() == latent.conds.keys() and revealed.pending == latent.pending
            and revealed.due == latent.due)
