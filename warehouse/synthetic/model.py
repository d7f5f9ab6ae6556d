"""The vocabulary of condition definitions: hazards, code rules, chronic states, encounter reasons.

Everything the simulator knows about a condition is one of these frozen records, so the clinical
content lives as readable data in `conditions.py` and the simulator stays generic.

Tokens are the small language that ties them together. A patient's state at a time is a set of
tokens: condition names (`ckd`), condition stages (`ckd:stage4`), facts (`female`, `age80`,
`hba1c_high`, `chemo`, `pregnancy:t3`) and, inside an encounter, `reason:<name>` plus the reason's
tags. A `when` string is a space-separated conjunction of tokens, `!token` negates one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def parse_when(when: str) -> tuple[frozenset[str], frozenset[str]]:
    """Split a `when` string into required and forbidden tokens.

    >>> parse_when("ckd !dialysis")
    (frozenset({'ckd'}), frozenset({'dialysis'}))
    """
    words = when.split()
    return frozenset(w for w in words if not w.startswith("!")), frozenset(w[1:] for w in words if w.startswith("!"))


def holds(cond: tuple[frozenset[str], frozenset[str]], tokens: set[str] | frozenset[str]) -> bool:
    return cond[0] <= tokens and cond[1].isdisjoint(tokens)


@dataclass(frozen=True)
class Hazard:
    """An annual rate at age 60, scaled per decade of age, for women, and by risk tokens.

    `requires` gates the hazard entirely (e.g. an exacerbation needs the chronic disease).
    Risk multipliers combine multiplicatively up to `cap`: risk factors overlap clinically (the
    diabetic smoker with hypertension is not 20 times as likely to infarct), and an uncapped
    product would make a few multimorbid patients absorb most admissions.
    """

    rate: float
    per_decade: float = 1.0
    female: float = 1.0
    risks: dict[str, float] = field(default_factory=dict)
    requires: str = ""
    ages: tuple[float, float] = (0.0, 130.0)
    cap: float = 5.0

    def __post_init__(self):
        object.__setattr__(self, "_req", parse_when(self.requires))
        object.__setattr__(self, "_risks", tuple(self.risks.items()))
        object.__setattr__(self, "_per_year", math.log(self.per_decade) / 10.0 if self.per_decade > 0 else -math.inf)

    def at(self, age: float, tokens: set[str]) -> float:
        if age < self.ages[0] or age > self.ages[1]:
            return 0.0
        required, forbidden = self._req
        if not (required <= tokens and forbidden.isdisjoint(tokens)):
            return 0.0
        h = self.rate * math.exp(self._per_year * (age - 60.0))
        if "female" in tokens:
            h *= self.female
        risk = 1.0
        for token, mult in self._risks:
            if token in tokens:
                risk *= mult
        return h * min(risk, self.cap)


@dataclass(frozen=True)
class Rule:
    """Which code a coder writes when `when` holds: a weighted choice among real siblings.

    `sticky` rules choose with the patient's own latent uniform for the condition, so the same
    patient keeps the same site/laterality/subtype from encounter to encounter; other rules model
    coder inconsistency (specified vs unspecified) afresh at every encounter.
    """

    codes: dict[str, float]
    when: str = ""
    sticky: bool = False

    def __post_init__(self):
        object.__setattr__(self, "_cond", parse_when(self.when))
        total = sum(self.codes.values())
        cumulative, acc = [], 0.0
        for weight in self.codes.values():
            acc += weight / total
            cumulative.append(acc)
        object.__setattr__(self, "_codes", tuple(self.codes))
        object.__setattr__(self, "_cum", tuple(cumulative))

    def pick(self, u: float) -> str:
        for code, c in zip(self._codes, self._cum):
            if u < c:
                return code
        return self._codes[-1]


def first_holding(rules: tuple[Rule, ...], tokens: set[str]) -> Rule | None:
    """The rule that codes under `tokens`: the first whose condition holds (None when none does)."""
    return next((rule for rule in rules if holds(rule._cond, tokens)), None)


@dataclass(frozen=True)
class Extra:
    """A further code written with probability `p` when `when` holds (status codes, manifestations)."""

    rules: tuple[Rule, ...]
    p: float
    when: str = ""

    def __post_init__(self):
        object.__setattr__(self, "_cond", parse_when(self.when))


def extra(code: str | dict[str, float], p: float, when: str = "", sticky: bool = False) -> Extra:
    codes = {code: 1.0} if isinstance(code, str) else code
    return Extra((Rule(codes, sticky=sticky),), p, when)


@dataclass(frozen=True)
class Chronic:
    """A latent state that persists between encounters (a disease, a stage, a status).

    `stages` are mutually exclusive sub-states; `initial` weights choose the stage at onset;
    `progression` maps a stage to (next stage, hazard) — next stage None means the state resolves.
    At every encounter a present state is coded with probability `coding` (omission otherwise).
    """

    name: str
    title: str
    onset: Hazard | None
    codes: tuple[Rule, ...]
    coding: float
    reasoning: str
    stages: tuple[str, ...] = ("present",)
    initial: tuple[float, ...] | None = None
    progression: dict[str, tuple[str | None, Hazard]] = field(default_factory=dict)
    also: tuple[Extra, ...] = ()
    meds: tuple[tuple[str, str], ...] = ()  # (when, normalized medication name)
    transient: bool = False  # cleared as soon as its onset requirement stops holding


@dataclass(frozen=True)
class Procedure:
    code: str  # ICD-10-PCS
    p: float
    when: str = ""

    def __post_init__(self):
        object.__setattr__(self, "_cond", parse_when(self.when))


@dataclass(frozen=True)
class Reason:
    """Why an encounter happens; reasons compete: given the state, reason k has probability λ_k/Σλ.

    `covers` names chronic states whose code the principal rule already gives (an acute-on-chronic
    heart failure code replaces the chronic one). `sets` changes the latent state after the
    encounter (a CABG creates CABG status); `clears` ends states (a delivery ends a pregnancy).
    Reasons with a `scheduled` group happen only at scheduled times (labour at term) and compete
    only within that group.
    """

    name: str
    title: str
    hazard: Hazard
    principal: tuple[Rule, ...]
    reasoning: str
    admission: str = "EMERGENCY"
    tags: tuple[str, ...] = ()
    secondary: tuple[Extra, ...] = ()
    covers: tuple[str, ...] = ()
    procedures: tuple[Procedure, ...] = ()
    meds: tuple[str, ...] = ()
    los_days: float = 4.0
    mortality: float = 0.0
    sets: dict[str, str] = field(default_factory=dict)
    clears: tuple[str, ...] = ()
    # how thoroughly comorbidities are coded on this kind of stay (a share of each state's `coding`)
    coding_depth: float = 0.9
    scheduled: str = ""
    plan: str = "follow up with primary care"


@dataclass(frozen=True)
class Complication:
    """A problem that arises or is noticed during a stay, coded with probability p(state, reason)."""

    name: str
    title: str
    p: float
    codes: tuple[Rule, ...]
    reasoning: str
    risks: dict[str, float] = field(default_factory=dict)
    requires: str = ""
    also: tuple[Extra, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "_req", parse_when(self.requires))
        object.__setattr__(self, "_risks", tuple(self.risks.items()))

    def probability(self, tokens: set[str]) -> float:
        if not holds(self._req, tokens):
            return 0.0
        p = self.p
        for token, mult in self._risks:
            if token in tokens:
                p *= mult
        return min(p, 0.95)
