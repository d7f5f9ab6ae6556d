"""MEDS events of a simulated patient: admissions, labs tracking the latent state, notes.

Labs and notes are rendered from a stream of their own (seed, subject, "events", k), so they
never perturb the latent simulation; their values follow the state at admission and the
encounter's own drawn facts (an AKI raises the creatinine, a GI bleed lowers the haemoglobin).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from functools import lru_cache
from random import Random

import simple_icd_10_cm as icd

from warehouse.synthetic.conditions import PCS_TITLES, REASON_BY_NAME
from warehouse.synthetic.simulate import DIAGNOSIS, Encounter, Patient, stream

_EPOCH = datetime(1970, 1, 1)
_US_PER_YEAR = 365.2425 * 86400 * 1_000_000

LABS = {  # name → MEDS code
    "hba1c": "LAB//HbA1c//%", "creatinine": "LAB//Creatinine//mg/dL", "egfr": "LAB//eGFR//mL/min/1.73m2",
    "bnp": "LAB//BNP//pg/mL", "hemoglobin": "LAB//Hemoglobin//g/dL", "wbc": "LAB//WBC//K/uL",
    "neutrophils": "LAB//Neutrophils//K/uL", "platelets": "LAB//Platelets//K/uL", "inr": "LAB//INR//ratio",
    "sodium": "LAB//Sodium//mmol/L", "potassium": "LAB//Potassium//mmol/L", "glucose": "LAB//Glucose//mg/dL",
    "troponin": "LAB//Troponin T//ng/L", "lactate": "LAB//Lactate//mmol/L",
}
LAB_TITLES = {
    "hba1c": "Haemoglobin A1c", "creatinine": "Serum creatinine", "egfr": "eGFR (CKD-EPI 2021)",
    "bnp": "B-type natriuretic peptide", "hemoglobin": "Haemoglobin", "wbc": "White blood cell count",
    "neutrophils": "Absolute neutrophil count", "platelets": "Platelet count", "inr": "International normalized ratio",
    "sodium": "Serum sodium", "potassium": "Serum potassium", "glucose": "Plasma glucose",
    "troponin": "High-sensitivity troponin T", "lactate": "Lactate",
}
# Baseline eGFR by CKD stage (mL/min/1.73m²), the middle of each KDIGO band.
_EGFR = {"stage2": 75.0, "stage3a": 52.0, "stage3b": 37.0, "stage4": 22.0, "stage5": 11.0, "esrd": 7.0}
_HB_DROP = {"stage3b": 0.8, "stage4": 1.6, "stage5": 2.3, "esrd": 2.5}


def to_us(t: float) -> int:
    """Calendar-year float → microseconds since 1970, rounded to the minute."""
    minutes = round((t - 1970.0) * _US_PER_YEAR / 60_000_000)
    return minutes * 60_000_000


def to_datetime(t: float) -> datetime:
    return _EPOCH + timedelta(microseconds=to_us(t))


def _creatinine_from_egfr(egfr: float, age: float, female: bool) -> float:
    """Invert CKD-EPI 2021 (race-free) for the creatinine that gives this eGFR."""
    kappa, alpha = (0.7, -0.241) if female else (0.9, -0.302)
    scale = 142.0 * 0.9938 ** age * (1.012 if female else 1.0)
    ratio = (egfr / scale) ** (1.0 / -1.2)
    if ratio < 1.0:
        ratio = (egfr / scale) ** (1.0 / alpha)
    return kappa * ratio


def egfr_ckd_epi_2021(creatinine: float, age: float, female: bool) -> float:
    """eGFR from serum creatinine (mg/dL) by the 2021 CKD-EPI equation."""
    kappa, alpha = (0.7, -0.241) if female else (0.9, -0.302)
    r = creatinine / kappa
    return 142.0 * min(r, 1.0) ** alpha * max(r, 1.0) ** -1.2 * 0.9938 ** age * (1.012 if female else 1.0)


def lab_values(e: Encounter, female: bool, rng: Random) -> dict[str, float]:
    """Admission labs from the latent state at admission plus the encounter's drawn facts."""
    stages = dict(e.stages)
    codes = set(e.draw.codes)
    tokens = e.draw.tokens
    age = e.age
    out: dict[str, float] = {}
    ckd = stages.get("ckd")
    egfr = _EGFR[ckd] if ckd else max(60.0, 105.0 - 0.7 * max(0.0, age - 30.0))
    egfr *= math.exp(rng.gauss(0.0, 0.1))
    if codes & {"N17.9", "N17.0"}:
        egfr *= rng.uniform(0.35, 0.6)
    creat = _creatinine_from_egfr(egfr, age, female)
    out["creatinine"] = round(creat, 2)
    out["egfr"] = round(egfr_ckd_epi_2021(creat, age, female), 1)
    hb = (12.9 if female else 14.2) - _HB_DROP.get(ckd or "", 0.0)
    hb -= 2.0 if "chemo" in tokens else 1.0 if "active_cancer" in tokens else 0.0
    hb -= 1.8 if "iron_deficiency" in stages else 0.0
    hb -= 2.8 if "D62" in codes else 0.0
    hb -= 1.2 if codes & {"D63.0", "D63.1", "D64.9", "D61.810"} else 0.0
    out["hemoglobin"] = round(max(5.5, hb + rng.gauss(0.0, 0.7)), 1)
    neutropenic = "D70.1" in codes or "D61.810" in codes
    wbc = 0.9 if neutropenic else 7.2 + (5.5 if "infection" in tokens else 0.0) - (1.5 if "chemo" in tokens else 0.0)
    out["wbc"] = round(max(0.3, wbc * math.exp(rng.gauss(0.0, 0.2))), 1)
    neutrophils = 0.25 * math.exp(rng.gauss(0.0, 0.4)) if neutropenic else out["wbc"] * rng.uniform(0.55, 0.8)
    out["neutrophils"] = round(neutrophils, 2)
    plt = 90.0 if ("D69.6" in codes or "cirrhosis" in stages) else 255.0
    out["platelets"] = round(max(8.0, plt * math.exp(rng.gauss(0.0, 0.2))))
    out["sodium"] = round(rng.gauss(127.0, 2.5) if "E87.1" in codes else rng.gauss(139.0, 2.0))
    k = 5.9 if "E87.5" in codes else 3.1 if "E87.6" in codes else 4.2
    out["potassium"] = round(rng.gauss(k, 0.3), 1)
    diabetic = "t1dm" in stages or "t2dm" in stages
    if e.draw.reason == "hypoglycemia":
        glucose = rng.uniform(32, 60)
    elif e.draw.reason in ("dka", "hyperglycemic_crisis"):
        glucose = rng.uniform(380, 800)
    elif diabetic:
        glucose = 28.7 * e.hba1c - 46.7 + rng.gauss(0.0, 35.0)  # ADAG estimated average glucose
    else:
        glucose = rng.gauss(98.0, 14.0)
    out["glucose"] = round(max(30.0, glucose))
    if diabetic or rng.random() < 0.15:
        out["hba1c"] = round(e.hba1c + rng.gauss(0.0, 0.25) if diabetic else rng.gauss(5.4, 0.3)
                             + (0.3 if "obesity" in stages else 0.0), 1)
    if "heart_failure" in stages or "cardiac" in tokens or "respiratory" in tokens:
        base = 60.0
        if "heart_failure" in stages:
            base = 700.0 if stages["heart_failure"] == "hfref" else 350.0
            base *= 3.0 if e.draw.reason == "hf_exacerbation" else 1.0
        out["bnp"] = round(base * math.exp(rng.gauss(0.0, 0.5)))
    if "cardiac" in tokens or e.draw.reason == "chest_pain":
        trop = 1800.0 if e.draw.reason == "ami" else 25.0 if "ckd" in stages else 8.0
        out["troponin"] = round(trop * math.exp(rng.gauss(0.0, 0.6)), 1)
    if stages.get("anticoagulation") == "warfarin":
        out["inr"] = round(max(1.0, rng.gauss(2.6, 0.6)), 2)
    elif "cirrhosis" in stages:
        out["inr"] = round(max(1.0, rng.gauss(1.8, 0.3)), 2)
    elif rng.random() < 0.3:
        out["inr"] = round(rng.gauss(1.05, 0.07), 2)
    if e.draw.reason == "sepsis" or "E87.21" in codes or "E87.20" in codes:
        out["lactate"] = round(rng.uniform(2.5, 6.0), 1)
    return out


@lru_cache(maxsize=None)
def title(code: str) -> str:
    return icd.get_description(code)


def discharge_note(p: Patient, e: Encounter, labs: dict[str, float]) -> str:
    """A short discharge summary written only from this encounter's own facts."""
    reason = REASON_BY_NAME[e.draw.reason]
    who = "woman" if p.sex == "F" else "man"
    when = to_datetime(e.admit).date().isoformat()
    diagnoses = "; ".join(title(c) for c in e.draw.codes[:10]) or "none recorded"
    procedures = "; ".join(PCS_TITLES[c] for c in e.outcome.procedures) or "none"
    key = [f"{LAB_TITLES[k].lower()} {v:g} {LABS[k].rsplit('//', 1)[1]}" for k, v in labs.items()
           if k in ("hba1c", "creatinine", "egfr", "bnp", "hemoglobin", "inr", "sodium", "troponin")]
    meds = ", ".join(e.outcome.medications[:8]) or "none"
    if e.outcome.died:
        course = f"The patient died on hospital day {max(1, round(e.outcome.los_days))}."
    else:
        course = (f"Discharged to {e.outcome.disposition.replace('_', ' ').lower()} after "
                  f"{max(1, round(e.outcome.los_days))} day(s). Plan: {reason.plan}.")
    return (f"DISCHARGE SUMMARY. {round(e.age)}-year-old {who} admitted ({e.admission.lower()}) on {when} for "
            f"{reason.title.lower()}. Diagnoses: {diagnoses}. Procedures: {procedures}. "
            f"Key labs: {', '.join(key)}. Medications: {meds}. {course}")


def patient_rows(seed: int, p: Patient) -> list[tuple]:
    """(subject_id, time_us | None, code, numeric_value | None, text_value | None, encounter_id | None) rows."""
    sid = p.subject_id
    female = p.sex == "F"
    rows: list[tuple] = [(sid, None, f"GENDER//{p.sex}", None, None, None),
                         (sid, to_us(p.birth), "MEDS_BIRTH", None, None, None)]
    for e in p.encounters:
        rng = stream(seed, sid, "events", e.index)
        eid = sid * 1000 + e.index
        admit, discharge = to_us(e.admit), to_us(e.discharge)
        if discharge <= admit:
            discharge = admit + 60_000_000
        rows.append((sid, admit, f"HOSPITAL_ADMISSION//{e.admission}", None, None, eid))
        lab_time = admit + 90 * 60_000_000
        labs = lab_values(e, female, rng)
        for name, value in labs.items():
            rows.append((sid, min(lab_time, discharge), LABS[name], float(value), None, eid))
        med_time = min(admit + 3 * 3_600_000_000, discharge)
        for med in e.outcome.medications:
            rows.append((sid, med_time, f"MEDICATION//NAME//{med}", None, None, eid))
        for code in e.draw.codes:
            rows.append((sid, discharge, DIAGNOSIS + code.replace(".", ""), None, None, eid))
        for pcs in e.outcome.procedures:
            rows.append((sid, discharge, f"PROCEDURE//ICD//10//{pcs}", None, None, eid))
        rows.append((sid, discharge, f"HOSPITAL_DISCHARGE//{e.outcome.disposition}", None, None, eid))
        rows.append((sid, discharge, "NOTE//DISCHARGE_SUMMARY", None, discharge_note(p, e, labs), eid))
    if p.death is not None:
        rows.append((sid, to_us(p.death), "MEDS_DEATH", None, None,
                     sid * 1000 + p.encounters[-1].index if p.encounters and p.encounters[-1].outcome.died else None))
    return rows
