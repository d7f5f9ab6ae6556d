"""Latent-state simulation of one patient, and the encounter draw shared with the oracle.

A patient is simulated from private random streams keyed by (seed, subject_id): one latent
stream for the life course (onsets, progression, encounter arrival times, deaths) and one stream
per encounter for what is decided at that encounter (`draw_encounter`: its reason, which
conditions get coded and with which sibling, complications; then `draw_outcome`: length of stay,
procedures, disposition). The state just before encounter k therefore depends only on the
latent stream and the draws of encounters 0..k-1, which is what lets the oracle condition on it
and re-draw encounter k from a stream of its own.

Time is a float in calendar years (2019.5 = early July 2019).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from random import Random

from warehouse.synthetic.conditions import (
    CANCER_NAMES, CHRONIC, CHRONIC_BY_NAME, COMPLICATIONS, REASON_BY_NAME, REASONS,
)
from warehouse.synthetic.model import Chronic, first_holding, holds

DATA_START = 2016.0  # first admissions of the synthetic hospital
ENTRY_END = 2024.0  # patients enter (first admission) between DATA_START and ENTRY_END
DATA_END = 2026.0  # end of follow-up
COVID_START = 2020.2
WEEKS_PER_YEAR = 52.1775
DIAGNOSIS = "DIAGNOSIS//ICD//10//"
STEP = 1.0  # latent update step during follow-up (years)
BURN_IN_STEP = 5.0  # coarser steps from childhood to the first admission (no encounters)
MAX_ENCOUNTERS = 999  # encounter_id = subject_id * 1000 + index

_ONSET_ORDER = tuple(c for c in CHRONIC if c.onset is not None)
_NONSCHEDULED = tuple(r for r in REASONS if not r.scheduled)
_SCHEDULED = {group: tuple(r for r in REASONS if r.scheduled == group)
              for group in {r.scheduled for r in REASONS} - {""}}
_BURN_IN_REASONS = tuple(r for r in _NONSCHEDULED if r.sets and "pregnancy" not in r.hazard.requires)


def stream(seed: int, subject_id: int, *parts: object) -> Random:
    """An independent, platform-stable random stream for (seed, subject, purpose...)."""
    key = ":".join(str(p) for p in (seed, subject_id, *parts)).encode()
    return Random(int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "big"))


@dataclass
class Cond:
    stage: str
    u: float  # the patient's latent uniform for sticky code choices of this condition
    since: float


@dataclass
class State:
    """Everything latent about a patient at a time."""

    sex: str
    birth: float
    frailty: float
    conds: dict[str, Cond] = field(default_factory=dict)
    hba1c: float = 5.4
    pending: str = ""  # a scheduled encounter group that starts now (labour)
    due: float = math.inf  # time of the scheduled delivery, when pregnant
    _base: frozenset[str] | None = None

    def copy(self) -> "State":
        return State(self.sex, self.birth, self.frailty,
                     {k: Cond(v.stage, v.u, v.since) for k, v in self.conds.items()},
                     self.hba1c, self.pending, self.due, self._base)

    def changed(self) -> None:
        self._base = None

    def base_tokens(self) -> frozenset[str]:
        if self._base is None:
            tokens = {"female" if self.sex == "F" else "male"}
            for name, cond in self.conds.items():
                tokens.add(name)
                tokens.add(f"{name}:{cond.stage}")
            if "t1dm" in tokens or "t2dm" in tokens:
                tokens.add("diabetes")
                if self.hba1c > 9.0:
                    tokens.add("hba1c_high")
            if tokens & {"ckd:stage3b", "ckd:stage4", "ckd:stage5", "ckd:esrd"}:
                tokens.add("ckd_advanced")
            if "atrial_fibrillation" in tokens or "vte_history" in tokens:
                tokens.add("anticoag_indication")
            for cancer in CANCER_NAMES:
                stage = self.conds.get(cancer)
                if stage is not None and stage.stage != "remission":
                    tokens.add("active_cancer")
                    if stage.stage == "treatment":
                        tokens.add("chemo")
                    elif stage.stage == "metastatic":
                        tokens.add("metastatic")
            if "dementia" in tokens and self.conds["dementia"].u >= 0.5 and self.conds["dementia"].u < 0.8:
                tokens.add("dementia_alzheimer")  # the G30.9 band of the dementia sticky choice
            if "dementia" in tokens or "parkinson" in tokens:
                tokens.add("aspiration_risk")
            self._base = frozenset(tokens)
        return self._base

    def gestational_week(self, t: float) -> int:
        return int((t - self.conds["pregnancy"].since) * WEEKS_PER_YEAR) + 2

    def tokens(self, t: float) -> set[str]:
        tokens = set(self.base_tokens())
        age = t - self.birth
        if age >= 40:
            tokens.add("age40")
        if age >= 65:
            tokens.add("age65")
        if age >= 80:
            tokens.add("age80")
        if t >= COVID_START:
            tokens.add("covid_era")
        if "pregnancy" in self.conds:
            week = self.gestational_week(t)
            tokens.add("pregnancy:t1" if week < 14 else "pregnancy:t2" if week < 28 else "pregnancy:t3")
        return tokens


# ------------------------------------------------------------------------------------------
# Latent dynamics
# ------------------------------------------------------------------------------------------
def _onset(state: State, c: Chronic, t: float, rng: Random, stage: str | None = None) -> None:
    if stage is None:
        if c.initial is None:
            stage = c.stages[0]
        else:
            u, acc = rng.random(), 0.0
            stage = c.stages[-1]
            for s, w in zip(c.stages, c.initial):
                acc += w
                if u < acc:
                    stage = s
                    break
    state.conds[c.name] = Cond(stage, rng.random(), t)
    if c.name in ("t1dm", "t2dm"):
        state.hba1c = min(13.0, max(6.2, rng.gauss(7.7, 1.3)))
    if c.name == "insulin_use":
        state.hba1c = max(6.2, state.hba1c - 0.8)
    if c.name == "pregnancy":
        preterm = rng.random() < 0.09
        weeks = rng.uniform(32.0, 36.9) if preterm else min(41.9, max(37.0, rng.gauss(39.3, 1.1)))
        state.due = t + (weeks - 2.0) / WEEKS_PER_YEAR
    state.changed()


def _resolve(state: State, name: str) -> None:
    state.conds.pop(name, None)
    if name == "pregnancy":
        state.due = math.inf
    if name == "smoker":
        state.conds.setdefault("former_smoker", Cond("present", 0.0, 0.0))
    state.changed()
    # transient states end with what they depend on (gestational diabetes with the pregnancy)
    for c in CHRONIC:
        if c.transient and c.name in state.conds and not holds(c.onset._req, state.base_tokens()):
            state.conds.pop(c.name)
            state.changed()


def latent_step(state: State, t: float, dt: float, rng: Random, burn_in: bool = False) -> None:
    """Onsets, stage progressions and glycaemic drift over [t, t+dt)."""
    age = t - state.birth
    tokens = state.tokens(t)
    for c in _ONSET_ORDER:
        if c.name in state.conds or (burn_in and (c.name == "pregnancy" or c.transient)):
            continue
        h = c.onset.at(age, tokens)
        if h > 0.0 and rng.random() < 1.0 - math.exp(-h * dt):
            _onset(state, c, t, rng)
            tokens = state.tokens(t)
    for name in list(state.conds):
        cond = state.conds.get(name)
        c = CHRONIC_BY_NAME[name]
        step = c.progression.get(cond.stage) if cond else None
        if step is None:
            continue
        nxt, hazard = step
        h = hazard.at(age, tokens)
        if h > 0.0 and rng.random() < 1.0 - math.exp(-h * dt):
            if nxt is None:
                _resolve(state, name)
            else:
                cond.stage = nxt
                state.changed()
            tokens = state.tokens(t)
    if "diabetes" in tokens:
        state.hba1c = min(13.5, max(5.8, state.hba1c + rng.gauss(0.0, 0.7) * math.sqrt(dt)))
        state.changed()
    if burn_in:
        for r in _BURN_IN_REASONS:
            h = r.hazard.at(age, tokens) * state.frailty
            if h > 0.0 and rng.random() < 1.0 - math.exp(-h * dt):
                _apply_sets(state, r, t, rng)
                tokens = state.tokens(t)


def mortality_rate(state: State, t: float) -> float:
    """Background (out-of-hospital) annual death rate: Gompertz in age times disease burden."""
    tokens = state.base_tokens()
    rate = 0.00035 * math.exp(0.085 * (t - state.birth - 30.0))
    for token, mult in (("heart_failure", 1.8), ("metastatic", 8.0), ("dementia", 2.0), ("copd:severe", 2.0),
                        ("ckd:esrd", 2.5), ("cirrhosis", 2.5), ("active_cancer", 1.5)):
        if token in tokens:
            rate *= mult
    return rate


def _apply_sets(state: State, reason, t: float, rng: Random) -> None:
    for name, stage in reason.sets.items():
        if stage.startswith("="):
            source = state.conds.get(stage[1:])
            if source is None:
                continue
            stage = source.stage
        current = state.conds.get(name)
        if current is None:
            _onset(state, CHRONIC_BY_NAME[name], t, rng, stage)
        else:
            current.stage = stage
    for name in reason.clears:
        _resolve(state, name)
    state.changed()


# ------------------------------------------------------------------------------------------
# The encounter draw (shared by the generator and the oracle)
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Draw:
    reason: str
    codes: tuple[str, ...]  # dotted ICD-10-CM codes, deduplicated, in coding order
    tokens: frozenset[str]


def reason_weights(state: State, t: float, tokens: set[str]) -> list[tuple[object, float]]:
    age = t - state.birth
    pool = _SCHEDULED[state.pending] if state.pending else _NONSCHEDULED
    out = []
    for r in pool:
        h = r.hazard.at(age, tokens)
        if h > 0.0:
            out.append((r, h))
    return out


def draw_encounter(state: State, t: float, rng: Random) -> Draw:
    """What is decided at an encounter starting at t, given the latent state: reason and codes."""
    return EncounterModel(state, t).draw(rng)


_WEEK = "Z3A.{week}"
_UNRESOLVED = object()


class EncounterModel:
    """`draw_encounter` for one state and time, prepared for many draws (the oracle draws each target 200 times).

    Everything but the random numbers depends on the state and the time alone: the tokens, the reason weights and,
    per reason, which extras and complications can be coded with what probability and which rule would code them.
    `draw` consumes the stream exactly as the unprepared draw did, one number per roll and two per coded choice
    (the draw's and a sticky one, a condition's own `u` standing in for the latter), so a generated dataset and
    its oracle are the same with or without the preparation. The state must not change between draws.
    """

    def __init__(self, state: State, t: float):
        self.state, self.t = state, t
        self.tokens = state.tokens(t)
        self.weights = reason_weights(state, t, self.tokens)
        self.total = sum(w for _, w in self.weights)
        self._plans: dict[str, tuple] = {}

    def _plan(self, reason) -> tuple:
        """(name, tokens, steps, coders) of an encounter for `reason`. A step is (roll threshold or None for no roll,
        the rules of its code, the sticky uniform or None for a drawn one, whether a weeks-of-gestation code is
        filled in); `coders` keeps, by step, the rule that codes under these tokens once a draw has needed it (many
        steps, such as rare complications, are never coded)."""
        state, depth = self.state, reason.coding_depth
        tokens = frozenset(self.tokens | {f"reason:{reason.name}", *reason.tags})
        cover = state.conds.get(reason.covers[0]) if reason.covers else None
        steps = [(None, reason.principal, cover.u if cover else None, False)]
        steps += [(e.p, e.rules, None, False) for e in reason.secondary if holds(e._cond, tokens)]
        for name, cond in state.conds.items():
            c = CHRONIC_BY_NAME[name]
            if name not in reason.covers:
                steps.append((c.coding * depth, c.codes, cond.u, True))
            steps += [(e.p * depth, e.rules, cond.u, False) for e in c.also if holds(e._cond, tokens)]
        for comp in COMPLICATIONS:
            p = comp.probability(tokens)
            if p > 0.0:
                steps.append((p, comp.codes, None, False))
        return reason.name, tokens, tuple(steps), {}

    def draw(self, rng: Random) -> Draw:
        random = rng.random  # bound once: the oracle calls it some 50 times per draw, 200 draws per encounter
        u, acc = random() * self.total, 0.0
        reason = self.weights[-1][0]
        for r, w in self.weights:
            acc += w
            if u < acc:
                reason = r
                break
        plan = self._plans.get(reason.name)
        if plan is None:
            plan = self._plans[reason.name] = self._plan(reason)
        name, tokens, steps, coders = plan
        codes: list[str] = []
        for i, (threshold, rules, sticky, week) in enumerate(steps):
            if threshold is not None and not random() < threshold:
                continue
            u_draw = random()
            u_sticky = random() if sticky is None else sticky
            rule = coders.get(i, _UNRESOLVED)
            if rule is _UNRESOLVED:
                rule = coders[i] = first_holding(rules, tokens)
            if rule is not None:
                code = rule.pick(u_sticky if rule.sticky else u_draw)
                codes.append(_week_code(self.state, self.t) if week and code == _WEEK else code)
        return Draw(name, tuple(dict.fromkeys(codes)), tokens)


def _week_code(state: State, t: float) -> str:
    return f"Z3A.{min(42, max(8, state.gestational_week(t))):02d}"


@dataclass(frozen=True)
class Outcome:
    los_days: float
    disposition: str
    died: bool
    procedures: tuple[str, ...]
    medications: tuple[str, ...]


def draw_outcome(state: State, t: float, draw: Draw, rng: Random) -> Outcome:
    """Length of stay, procedures, medications and disposition of a drawn encounter."""
    reason = REASON_BY_NAME[draw.reason]
    tokens = draw.tokens
    age = t - state.birth
    los = reason.los_days * math.exp(rng.gauss(0.0, 0.45)) * (1.0 + max(0.0, age - 60.0) * 0.01)
    los *= 1.0 + 0.08 * max(0, len(draw.codes) - 8)
    death_p = reason.mortality * math.exp(0.03 * (age - 65.0)) * (2.0 if "metastatic" in tokens else 1.0)
    died = rng.random() < min(0.5, death_p)
    if died:
        disposition = "DIED"
    else:
        u = rng.random()
        snf = 0.02 + (0.12 if age >= 80 else 0.0) + (0.25 if "injury" in tokens and age >= 65 else 0.0) \
            + (0.2 if draw.reason == "stroke" else 0.0) + (0.1 if "dementia" in tokens else 0.0)
        home_health = 0.08 + (0.1 if age >= 75 else 0.0)
        ama = 0.08 if "alcohol_use" in tokens else 0.005
        disposition = ("SNF" if u < snf else "HOME_HEALTH" if u < snf + home_health
                       else "AGAINST_ADVICE" if u < snf + home_health + ama else "HOME")
    procedures = [p.code for p in reason.procedures if holds(p._cond, tokens) and rng.random() < p.p]
    if "dialysis" in tokens and rng.random() < 0.9:
        procedures.append("5A1D70Z")
    meds = list(reason.meds)
    for name in state.conds:
        for when, med in CHRONIC_BY_NAME[name].meds:
            if (not when or when in tokens) and rng.random() < 0.85:
                meds.append(med)
    return Outcome(round(max(0.2, los), 2), disposition, died, tuple(dict.fromkeys(procedures)),
                   tuple(dict.fromkeys(meds)))


# ------------------------------------------------------------------------------------------
# One patient's life course
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Encounter:
    index: int
    admit: float
    discharge: float
    admission: str
    draw: Draw
    outcome: Outcome
    age: float
    hba1c: float
    stages: tuple[tuple[str, str], ...]  # the latent states at admission (for labs and notes)


@dataclass
class Patient:
    subject_id: int
    sex: str
    birth: float
    encounters: list[Encounter]
    death: float | None
    captured: dict[int, tuple[State, float]]  # encounter index → (state just before its draw, admit time)


def _entry_age(rng: Random) -> float:
    """Age at first admission: an adult hospital population, older-skewed."""
    u = rng.random()
    bands = ((0.10, 18, 35), (0.25, 35, 50), (0.55, 50, 65), (0.85, 65, 80), (1.0, 80, 95))
    for cum, lo, hi in bands:
        if u < cum:
            return rng.uniform(lo, hi)
    return 60.0


def simulate_patient(seed: int, subject_id: int, capture: frozenset[int] = frozenset(),
                     stop_after: int | None = None, redraw: dict[int, str] | None = None) -> Patient:
    """Simulate one patient deterministically from its own streams.

    `capture` asks for copies of the latent state just before the draw of those encounters (the
    oracle's conditioning); `stop_after` ends the simulation once that encounter index is
    reached (before drawing it); `redraw` replaces the stream of chosen encounters by another
    salt (used to prove the oracle never depends on a target encounter's realized draw).
    """
    rng = stream(seed, subject_id, "life")
    sex = "F" if rng.random() < 0.53 else "M"
    entry = rng.uniform(DATA_START, ENTRY_END)
    birth = entry - _entry_age(rng)
    state = State(sex=sex, birth=birth, frailty=rng.gammavariate(5.0, 0.26))
    t = birth + 4.0
    while t < entry:
        dt = min(BURN_IN_STEP, entry - t)
        latent_step(state, t, dt, rng, burn_in=True)
        t += dt
    t = entry
    encounters: list[Encounter] = []
    captured: dict[int, tuple[State, float]] = {}
    death: float | None = None

    def encounter_at(when: float) -> bool:
        """Run encounter number len(encounters) at `when`; False when the simulation must stop."""
        nonlocal death
        k = len(encounters)
        if k in capture:
            captured[k] = (state.copy(), when)
        if stop_after is not None and k >= stop_after:
            return False
        salt = (redraw or {}).get(k, "")
        erng = stream(seed, subject_id, "encounter", k, salt)
        draw = draw_encounter(state, when, erng)
        outcome = draw_outcome(state, when, draw, erng)
        discharge = when + outcome.los_days / 365.25
        reason = REASON_BY_NAME[draw.reason]
        encounters.append(Encounter(k, when, discharge, reason.admission, draw, outcome, when - state.birth,
                                    state.hba1c, tuple((n, c.stage) for n, c in state.conds.items())))
        state.pending = ""
        _apply_sets(state, reason, discharge, erng)
        if outcome.died:
            death = discharge
            return False
        return k + 1 < MAX_ENCOUNTERS

    if not encounter_at(entry):
        return Patient(subject_id, sex, birth, encounters, death, captured)
    t = encounters[-1].discharge
    step_start = entry
    alive = True
    while alive and t < DATA_END:
        step_end = min(step_start + STEP, DATA_END)
        latent_step(state, step_start, step_end - step_start, rng)
        t = max(t, step_start)
        death_at = t + rng.expovariate(max(mortality_rate(state, t), 1e-9))
        while True:
            tokens = state.tokens(t)
            boundary = step_end
            if "pregnancy" in state.conds:  # hazards change at trimester boundaries
                since = state.conds["pregnancy"].since
                for week in (14, 28):
                    edge = since + (week - 2) / WEEKS_PER_YEAR
                    if t < edge < boundary:
                        boundary = edge
            total = sum(w for _, w in reason_weights(state, t, tokens)) * state.frailty
            arrival = t + rng.expovariate(total) if total > 0 else math.inf
            # labour that fell during another stay starts right after it
            scheduled = max(state.due, t + 0.5 / 365.25) if state.due < math.inf else math.inf
            nxt = min(arrival, scheduled, death_at)
            if nxt >= boundary:
                t = boundary
                if boundary >= step_end:
                    break
                continue  # a trimester boundary: hazards change, the year goes on
            if nxt == death_at:
                death, alive = death_at, False
                break
            if nxt == scheduled:
                state.pending = "delivery"
            if not encounter_at(nxt):
                alive = False
                break
            t = encounters[-1].discharge
        step_start = step_end
    if death is not None and encounters and death < encounters[-1].discharge:
        death = encounters[-1].discharge
    return Patient(subject_id, sex, birth, encounters, death, captured)
