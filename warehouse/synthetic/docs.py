"""Render docs/synthetic.md from the condition definitions (`python -m warehouse.synthetic.docs`).

The page is committed; a test checks it matches the definitions, so it never drifts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import simple_icd_10_cm as icd

from warehouse.synthetic.conditions import (
    CHRONIC, COMPLICATIONS, FACTS, PCS_TITLES, REASONS, WEEK_CODES, codes_of,
)
from warehouse.synthetic.generate import GENERATOR_VERSION
from warehouse.synthetic.model import Extra, Hazard, Rule
from warehouse.synthetic.realism import REALISM_BANDS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "synthetic.md"

INTRO = """\
# The synthetic cohort (embedded default data)

Generator version `{version}`. Every number below is rendered from `warehouse/synthetic/conditions.py`
by `python -m warehouse.synthetic.docs`; a test fails when this page and the definitions disagree.

## How a patient is simulated

* **Population.** Adults enter the hospital's record at a first admission between 2016 and 2024
  (age at entry: 10% 18–34, 15% 35–49, 30% 50–64, 30% 65–79, 15% 80–95; 53% women) and are
  followed to the end of 2025 or death. A patient-level admission propensity (gamma, shape 5, mean
  1.3) scales every admission hazard.
* **Latent state.** From age 4 to the first admission the chronic states below accumulate in
  5-year steps (their onset hazards, progressions, and the durable marks left by events such as an
  infarction or a stroke); during follow-up they evolve in 1-year steps. The state holds each
  condition's stage, its onset time and one latent uniform per condition (used by *sticky* code
  rules, so a patient keeps the same laterality, subtype or BMI code), the latent HbA1c of a
  diabetic (random walk, σ = 0.7 %/year), and a pending scheduled event (labour at term).
* **Hazards.** An annual rate at age 60, multiplied by `per_decade^((age − 60)/10)`, by the female
  factor for women, and by every risk factor present — the product of risk factors is capped (5×
  unless stated) because risk factors overlap clinically. `requires` gates a hazard entirely.
* **Encounters.** Admissions arrive as a Poisson process whose rate is the sum of the reason
  hazards below (times the propensity). At an encounter the reasons compete: reason *k* is chosen with
  probability λ_k/Σλ given the state at that time; labour at term is scheduled at conception and
  chooses between vaginal and caesarean delivery the same way. Background mortality is Gompertz in
  age (0.035% per year at 30, doubling every ~8 years) times the burden of heart failure, metastatic
  cancer, dementia, severe COPD, ESRD and cirrhosis; reasons carry an in-hospital mortality.
* **Coding.** At every encounter the reason's principal rule gives the first code, its secondary
  codes follow with their probabilities, then each present chronic state is coded with probability
  `coding × coding depth` of the stay (0.9 by default; lower for obstetric, elective and
  chemotherapy stays) — omissions are the norm, as in real discharge abstracts — choosing its code
  with the first rule whose `when` holds (weights express coder choice between specified and
  unspecified siblings). States a reason `covers` are coded by the reason (acute-on-chronic heart
  failure replaces the chronic code). Finally each in-stay problem (complications table) is coded
  with its probability given the state and the reason.
* **Events.** `HOSPITAL_ADMISSION//<type>` at admission; labs 90 minutes later whose values follow
  the latent state and the encounter's coded facts (eGFR from the CKD stage through the CKD-EPI
  2021 equation, HbA1c from the latent value, BNP by heart-failure subtype and decompensation,
  haemoglobin lowered by CKD, chemotherapy, iron deficiency and bleeding, neutrophils in
  chemotherapy-induced neutropenia, INR on warfarin or in cirrhosis…); medications three hours after
  admission; diagnoses, ICD-10-PCS procedures, `HOSPITAL_DISCHARGE//<disposition>` and a short
  `NOTE//DISCHARGE_SUMMARY` written from that encounter's own facts at discharge; `MEDS_DEATH` at death.
* **Determinism.** Each patient uses private random streams keyed by (seed, subject id): one for
  the life course and one per encounter (plus one for lab values and notes), so any patient can be
  re-simulated alone and shards are independent. `encounter_id = subject_id × 1000 + index`.

## The oracle

For a trajectory the patient is re-simulated to the latent state just before the target
encounter; the encounter is then drawn `draws` times (default 200) with the same
`draw_encounter` function the generator used, from a stream distinct from the realized one.
`P(code ∈ Y | state)` is the share of draws containing the code (after the cohort's harmonization).
A cohort build stores the 100 most probable codes of each trajectory (`oracle(..., top=100)`) among
those drawn at least once, so every stored probability is at least 1/`draws`, and a trajectory whose draws
name fewer codes stores fewer: 472 of the default cohort's 3,343 trajectories, down to 47 codes.
The oracle knows the latent state — including conditions not yet coded and current stages — but
not what is decided at the encounter (its reason, omissions, siblings, complications).

The **record oracle** (`oracle(..., information="record")`, gold table
`record_oracle_probabilities`, system `record_oracle` in evaluations) makes the same draws from
the latent state after dropping every condition that no diagnosis code and no medication of the
pre-target encounters reveals. A hidden pregnancy also loses its scheduled delivery. It shows how
much of the oracle rests on what the record hides. On the default cohort's held_out split:

- 59 % of patients have at least one hidden condition (1.1 on average);
- R@20 is 0.589 for the record oracle against 0.648 for the oracle;
- new-onset recall is 0.366 against 0.461.

It bounds nothing. A forecaster can still infer hidden conditions from graded labs or risk
factors, and the record oracle keeps the exact stage of the conditions it keeps.

## Realism bands

Checked on the `held_out` cohort of the default 5,000-patient dataset, final-encounter targets.
Both measurements below compute the statistics with one function (`band_statistics` in
`warehouse/synthetic/realism.py`); they differ in where its inputs come from:

* `realism_report(meds_dir)` tunes the generator. It reads the MEDS directory alone (no
  warehouse, no cohort build, no run): it re-derives the cohort, draws the oracle and ranks its own
  global frequency and repeat history. Its numbers are the measured table below.
* `warehouse_realism(wh, cohort_id, run_id)` is what `dxr demo` prints and fails on. It reads
  what the platform built: the cohort's `trajectories`, `targets` and `pretarget_events`, and the
  R@20 that the run's `oracle`, `repeat_history` and `global_frequency` scored in `metrics`, so it
  holds the platform itself to the bands. On the default dataset the two agree (the README's demo
  table and the seed 7 column); they part where the platform's cohort rules, baselines or oracle draws
  (`synth.oracle_draws`) differ from the re-derivation.

| statistic | band |
|---|---|
{bands}

Measured with `realism_report` on 5,000 patients (generator `{version}`):

| statistic | seed 7 | seed 11 |
|---|---|---|
{measured}

What shapes these numbers, and why the values are where they are:

* *Target size* (~10 codes) comes from the principal and secondary codes of the reason (~1.5),
  coded chronic states (~6; omissions at `coding × 0.9`) and in-stay problems (~2).
* *New-onset share* (~50%, as in the MIMIC demos) comes from the acute content of each stay
  (reason codes, complications), from coders switching between specified and unspecified
  siblings, and from states that changed since the last stay (new onsets, stage progression,
  statuses left by events); it falls with the number of prior stays, so the tail of frequent
  admissions is limited by capping the product of risk factors.
* *Oracle vs repeat history*: the oracle knows the current latent state (new onsets, current CKD
  stage or obesity class, a chemotherapy phase, gestational age, durable marks of last stay's
  infarction or stroke, which past acute codes will not recur); repeat history only replays the
  past. *Global frequency* is weak because no single condition dominates (≤ 5% of target codes).
* *Prevalence* is kept clinically plausible (table below) — the bands are met by the coding
  process (omissions, siblings, acute content), not by an implausibly sick or healthy population.

Latent prevalence at the first admission (4,000 patients, seed 7; share of patients in each age
band at entry):

| state | 18–44 | 45–64 | 65–79 | 80+ |
|---|---|---|---|---|
{prevalence}

## Other files

`metadata/subject_splits.parquet` follows `hash_split(subject_id, seed=7)`, the platform's default
cohort split seed; `metadata/synthetic.json` (and extra keys of `dataset.json`) records the seed,
patient count and generator version needed to re-simulate; `codes.parquet` holds the full billable
ICD-10-CM FY2026 dictionary plus every procedure, medication, lab, admission and discharge code.

## Performance

`python benchmarks/synth.py --patients 60000` (2 worker processes, zstd Parquet, 2,000 patients per
shard): 60,000 patients, 6.13 M events in 112 s on a shared 2-core machine (55 k rows/s, load average
6.5; kept in `benchmarks/reference/synth.json`; 118 s on 2026-12-04), peak RSS 358 MB in the main
process and 417 MB in a worker. The oracle for the default cohort (~340 trajectories × 200 draws) takes
about 5 s (`--realism`).

## Tokens

A `when`/`requires` string is a conjunction of tokens (`!` negates). Condition names and
`name:stage` are tokens; so are these derived facts:

| token | meaning |
|---|---|
{facts}
"""

# Measured with `python benchmarks/synth.py --patients 5000 --seed S --realism` (S = 7, 11); update
# these when the generator version changes (the slow test re-checks the bands on seed 7).
MEASURED = {
    "n_trajectories": (332, 359), "mean_target_size": (9.533, 9.850), "mean_prior_encounters": (3.515, 3.735),
    "new_onset_share": (0.500, 0.476), "oracle_r20": (0.648, 0.659), "repeat_history_r20": (0.428, 0.455),
    "global_frequency_r20": (0.276, 0.286), "repeat_history_to_oracle": (0.660, 0.691),
    "global_frequency_to_oracle": (0.426, 0.434), "max_condition_share": (0.042, 0.044),
}
# Latent prevalence at the first admission by age band (simulate_patient, seed 7, 4,000 patients).
PREVALENCE = {
    "hypertension": (0.04, 0.29, 0.56, 0.81), "hyperlipidemia": (0.05, 0.29, 0.55, 0.77),
    "t2dm": (0.02, 0.13, 0.27, 0.46), "t1dm": (0.01, 0.01, 0.00, 0.01), "ckd": (0.00, 0.05, 0.19, 0.51),
    "heart_failure": (0.00, 0.02, 0.11, 0.34), "atrial_fibrillation": (0.00, 0.03, 0.10, 0.33),
    "cad": (0.02, 0.12, 0.27, 0.54), "copd": (0.00, 0.05, 0.16, 0.30), "asthma": (0.05, 0.09, 0.12, 0.15),
    "obesity": (0.14, 0.32, 0.39, 0.43), "smoker": (0.29, 0.26, 0.12, 0.05),
    "former_smoker": (0.08, 0.26, 0.42, 0.51), "depression": (0.05, 0.13, 0.20, 0.23),
    "dementia": (0.00, 0.00, 0.03, 0.26), "alcohol_use": (0.03, 0.08, 0.08, 0.10),
    "cirrhosis": (0.01, 0.02, 0.05, 0.07), "lung_cancer": (0.00, 0.01, 0.03, 0.09),
    "insulin_use": (0.01, 0.06, 0.15, 0.29), "old_mi": (0.02, 0.05, 0.12, 0.27),
    "stroke_history": (0.01, 0.04, 0.12, 0.33), "anticoagulation": (0.02, 0.06, 0.16, 0.42),
    "dialysis": (0.00, 0.00, 0.01, 0.05),
}


def _hazard(h: Hazard | None) -> str:
    if h is None:
        return "set by an encounter (no spontaneous onset)"
    parts = [f"{h.rate:g}/yr"]
    if h.per_decade != 1.0:
        parts.append(f"×{h.per_decade:g} per decade")
    if h.female != 1.0:
        parts.append(f"women ×{h.female:g}")
    if h.risks:
        parts.append("risks " + ", ".join(f"{k} ×{v:g}" for k, v in h.risks.items()))
        if h.cap != 5.0:
            parts.append(f"risk product capped at ×{h.cap:g}")
    if h.requires:
        parts.append(f"requires `{h.requires}`")
    if h.ages != (0.0, 130.0):
        parts.append(f"ages {h.ages[0]:g}–{h.ages[1]:g}")
    return "; ".join(parts)


def _rule(r: Rule) -> str:
    total = sum(r.codes.values())
    codes = ", ".join(f"{c} {w / total:.0%}" if len(r.codes) > 1 else c for c, w in r.codes.items())
    when = f"when `{r.when}`: " if r.when else ""
    return f"{when}{codes}{' (sticky)' if r.sticky else ''}"


def _extras(extras: tuple[Extra, ...]) -> str:
    return "; ".join(f"{e.p:.0%} {'when `' + e.when + '` ' if e.when else ''}→ "
                     + " / ".join(_rule(r) for r in e.rules) for e in extras)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    bands = "\n".join(f"| {k} | {lo:g} – {hi:g} |".replace("inf", "∞") for k, (lo, hi) in REALISM_BANDS.items())
    measured = "\n".join(f"| {k} | {a:g} | {b:g} |" for k, (a, b) in MEASURED.items())
    facts = "\n".join(f"| `{k}` | {v} |" for k, v in FACTS.items())
    prevalence = "\n".join(f"| {k} | " + " | ".join(f"{x:.0%}" for x in v) + " |" for k, v in PREVALENCE.items())
    out = [INTRO.format(version=GENERATOR_VERSION, bands=bands, measured=measured, facts=facts,
                        prevalence=prevalence)]
    n_codes = len({c for d in (*CHRONIC, *REASONS, *COMPLICATIONS) for c in codes_of(d)})
    out.append(f"## Conditions\n\n{len(CHRONIC)} chronic states, {len(REASONS)} encounter reasons and "
               f"{len(COMPLICATIONS)} in-stay problems emit {n_codes} distinct billable ICD-10-CM codes "
               f"(the weeks-of-gestation code `Z3A.{{week}}` stands for {WEEK_CODES[0]}–{WEEK_CODES[-1]}).\n")
    out.append("### Chronic states\n")
    for c in CHRONIC:
        out.append(f"#### `{c.name}` — {c.title}\n\n{c.reasoning}\n")
        rows = [("onset", _hazard(c.onset)), ("coded per encounter", f"{c.coding:.0%} × coding depth")]
        if c.stages != ("present",):
            init = "" if c.initial is None else " (at onset " + ", ".join(
                f"{s} {w:.0%}" for s, w in zip(c.stages, c.initial)) + ")"
            rows.append(("stages", ", ".join(c.stages) + init))
        for stage, (nxt, h) in c.progression.items():
            rows.append((f"{stage} →", f"{nxt or 'resolves'}: {_hazard(h)}"))
        rows.append(("codes", "<br>".join(_rule(r) for r in c.codes)))
        if c.also:
            rows.append(("also coded", _extras(c.also)))
        if c.meds:
            rows.append(("medications", ", ".join(f"{m}{' (' + w + ')' if w else ''}" for w, m in c.meds)))
        if c.transient:
            rows.append(("ends", "with the state it requires"))
        out.append("| | |\n|---|---|\n" + "\n".join(f"| {k} | {_cell(v)} |" for k, v in rows) + "\n")
    out.append("### Encounter reasons\n")
    for r in REASONS:
        out.append(f"#### `{r.name}` — {r.title}\n\n{r.reasoning}\n")
        hazard = _hazard(r.hazard) if not r.scheduled else f"scheduled ({r.scheduled}); weight {_hazard(r.hazard)}"
        rows = [("hazard", hazard), ("admission", f"{r.admission}; length of stay ~{r.los_days:g} days; "
                                                  f"in-hospital mortality {r.mortality:.0%} at 65"),
                ("principal code", "<br>".join(_rule(x) for x in r.principal))]
        if r.secondary:
            rows.append(("secondary codes", _extras(r.secondary)))
        if r.covers:
            rows.append(("replaces the chronic code of", ", ".join(r.covers)))
        if r.procedures:
            rows.append(("procedures (ICD-10-PCS)", "; ".join(
                f"{p.code} {PCS_TITLES[p.code]} ({p.p:.0%}{', when `' + p.when + '`' if p.when else ''})"
                for p in r.procedures)))
        if r.meds:
            rows.append(("medications", ", ".join(r.meds)))
        if r.sets or r.clears:
            rows.append(("changes the state", ", ".join([f"sets {k}={v}" for k, v in r.sets.items()]
                                                       + [f"ends {k}" for k in r.clears])))
        if r.coding_depth != 0.9:
            rows.append(("coding depth", f"{r.coding_depth:g}"))
        out.append("| | |\n|---|---|\n" + "\n".join(f"| {k} | {_cell(v)} |" for k, v in rows) + "\n")
    out.append("### In-stay problems\n\n| problem | base probability | risks | codes | reasoning |\n"
               "|---|---|---|---|---|")
    for c in COMPLICATIONS:
        risks = ", ".join(f"{k} ×{v:g}" for k, v in c.risks.items())
        if c.requires:
            risks += f"; requires `{c.requires}`"
        out.append(f"| `{c.name}` {c.title} | {c.p:.1%} | {_cell(risks)} | "
                   f"{_cell('<br>'.join(_rule(r) for r in c.codes))} | {_cell(c.reasoning)} |")
    out.append("\n## Code index\n\n| code | title | emitted by |\n|---|---|---|")
    owners: dict[str, list[str]] = {}
    for d in (*CHRONIC, *REASONS, *COMPLICATIONS):
        for code in codes_of(d):
            owners.setdefault(code, []).append(d.name)
    for code in sorted(owners):
        out.append(f"| {code} | {_cell(icd.get_description(code))} | {', '.join(owners[code])} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(render())
    print(f"wrote {PAGE}", file=sys.stderr)
