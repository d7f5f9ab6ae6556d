"""A MIMIC-IV dataset as MEDS-Extract's MIMIC-IV ETL writes it, in two releases, through the whole CLI.

The generator follows that ETL's event_configs.yaml: the admission id as `hadm_id` (null where the config carries
none: ED_REGISTRATION/ED_OUT, the pharmacy's MEDICATION//START and //STOP, MEDS_BIRTH, MEDS_DEATH, OMR, the
patient weight at an infusion, and the labs drawn outside any admission), diagnoses and DRG codes at discharge,
procedures and HCPCS at their chart date (midnight), ICU stays with `icustay_id`, and a death the pre-MEDS step
dates by `dod` (midnight) or `deathtime`. Shards under data/{train,tuning,held_out}/.

Layout "0.0.7" is MEDS_transforms' MIMIC-IV example (MEDS 0.3.3): a lab is `LAB//<itemid>//<unit>` at its chart
time with its values, procedures are dated at their chart date. Layout "0.6.7" is the MIMIC_IV_MEDS package on
MEDS-Extract (MEDS 0.4.1; its event_configs.yaml and demo regression statistics): a lab is its specimen collection,
`LAB//SPECIMEN_COLLECTED//<itemid>` at the chart time without a value, and its result,
`LAB//RESULT//<itemid>//<unit>` at the store time with the values; a missing code part is `UNK` (a lab without a
unit, a discharge without a location); ICD procedures are dated at discharge; ICU procedure events are
`PROCEDURE//START//<itemid>` and `PROCEDURE//END//<itemid>`; every shard carries `code_components` (a struct of the
parts each code was made of) and `source_block`; codes.parquet also has `code_template` and `possibly_cpt_code`.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from pathlib import Path

import polars as pl
import pytest

SEED = 11
N_SUBJECTS = 40
# The ICD-9 to ICD-10 switch of the source hospital, in MIMIC-IV's shifted years: patients admitted on both sides
# of it have both systems in their records.
ICD10_FROM = dt.datetime(2151, 10, 1)
CHRONIC = {9: ["4280", "4019", "25000", "42731", "41401", "2724"], 10: ["I5022", "I10", "E119", "I4891", "I2510",
                                                                         "E785"]}
ACUTE = {9: ["5849", "5990", "486", "V4581", "E8497"], 10: ["N179", "N390", "J189", "Z955", "Y92239"]}
PROCEDURES = {9: "3893", 10: "02HV33Z"}
SCHEMA = {"subject_id": pl.Int64, "time": pl.Datetime("us"), "code": pl.String, "numeric_value": pl.Float32,
          "text_value": pl.String, "hadm_id": pl.Int64, "icustay_id": pl.Int64, "insurance": pl.String,
          "priority": pl.String, "route": pl.String}
COMPONENTS = pl.Struct({"itemid": pl.Int64, "valueuom": pl.String, "icd_code": pl.String, "icd_version": pl.Int64})
PHARMACY = "MEDICATION//START//Furosemide"  # ordered by the pharmacy, written without its hadm_id
VENTILATION = 225792  # an ICU procedure event's item (invasive ventilation)


def lab_code(layout: str, itemid: int, unit: str | None) -> str:
    """The code of a lab's value: its result's in layout 0.6.7."""
    return f"LAB//{itemid}//{unit}" if layout == "0.0.7" else f"LAB//RESULT//{itemid}//{unit or 'UNK'}"


def ed_lab(layout: str) -> str:  # troponin T, drawn in the ED before the admission
    return lab_code(layout, 51003, "ng/mL")


def creatinine(layout: str) -> str:
    return lab_code(layout, 50912, "mg/dL")


def split_of(index: int) -> str:
    return "held_out" if index % 10 == 0 else "tuning" if index % 10 == 1 else "train"


def write_mimic_iv_meds(root: Path, seed: int = SEED, layout: str = "0.0.7") -> dict:
    """Write the dataset; returns what it holds per subject: {subject_id: {"admissions": [...], "died": ...}}."""
    rng = random.Random(seed)
    rows: list[dict] = []
    truth: dict[int, dict] = {}
    next_hadm, next_stay = 20_000_000, 30_000_000
    newer = layout == "0.6.7"

    def event(subject, time, code, value=None, text=None, hadm=None, **extra):
        rows.append({"subject_id": subject, "time": time, "code": code, "numeric_value": value, "text_value": text,
                     "hadm_id": hadm, **extra})

    def lab(subject, time, itemid, unit, value, text, hadm=None, **extra):
        """A labevents row: drawn and resulted at once (0.0.7), or collected, then resulted an hour later (0.6.7)."""
        if newer:
            event(subject, time, f"LAB//SPECIMEN_COLLECTED//{itemid}", hadm=hadm, **extra)
            time += dt.timedelta(hours=1)
        event(subject, time, lab_code(layout, itemid, unit), value, text, hadm=hadm, **extra)

    for index in range(N_SUBJECTS):
        subject = 10_000_000 + 37 * index
        born = rng.randint(2070, 2110)
        event(subject, None, f"GENDER//{rng.choice('FM')}")
        event(subject, dt.datetime(born, 1, 1), "MEDS_BIRTH")
        n_admissions = 0 if index % 6 == 5 else 1 if index % 6 == 4 else rng.randint(2, 4)
        dies = index % 9 in (2, 3) and n_admissions >= 2
        chronic = {v: rng.sample(CHRONIC[v], 2) for v in (9, 10)}
        admit = dt.datetime(2150, 1, 1, rng.randint(8, 20)) + dt.timedelta(days=rng.randint(0, 400))
        admissions = []
        for number in range(n_admissions):
            hadm, next_hadm = next_hadm, next_hadm + rng.randint(1, 50)
            version = 9 if admit < ICD10_FROM else 10
            discharge = admit + dt.timedelta(days=rng.randint(2, 8), hours=rng.randint(0, 6))
            last = number == n_admissions - 1
            emergency = rng.random() < 0.7
            if emergency:
                registered = admit - dt.timedelta(hours=5)
                event(subject, registered, "ED_REGISTRATION")
                event(subject, registered, "TRANSFER_TO//ED//Emergency Department", hadm=hadm)
                lab(subject, registered + dt.timedelta(hours=1), 51003, "ng/mL", 0.01, "0.01", priority="STAT")
                lab(subject, registered + dt.timedelta(hours=1), 50912, "mg/dL", 1.4, "1.4", priority="STAT")
                event(subject, admit + dt.timedelta(hours=1), "ED_OUT")
                event(subject, admit, "HOSPITAL_ADMISSION//EW EMER.//EMERGENCY ROOM", hadm=hadm, insurance="Medicare")
            else:
                event(subject, admit, "HOSPITAL_ADMISSION//ELECTIVE//PHYSICIAN REFERRAL", hadm=hadm,
                      insurance="Other")
            event(subject, admit, "TRANSFER_TO//admit//Medicine", hadm=hadm)
            day = admit.replace(hour=0)
            event(subject, discharge if newer else day, f"PROCEDURE//ICD//{version}//{PROCEDURES[version]}", hadm=hadm)
            event(subject, day, "HCPCS//Hospital observation service, per hour", hadm=hadm)
            value = round(rng.uniform(0.5, 3.0), 1)
            lab(subject, admit + dt.timedelta(hours=3), 50912, "mg/dL", value, str(value), hadm=hadm,
                priority="ROUTINE")
            lab(subject, admit + dt.timedelta(hours=3), 51484, "mg/dL", None, "NEG", hadm=hadm)
            if newer:  # a urine appearance, reported as text without a unit
                lab(subject, admit + dt.timedelta(hours=3), 51508, None, None, "Clear", hadm=hadm)
            event(subject, admit + dt.timedelta(hours=2), PHARMACY, route="IV")
            event(subject, admit + dt.timedelta(hours=4), "MEDICATION//Furosemide//Administered", hadm=hadm)
            event(subject, discharge - dt.timedelta(hours=2), "MEDICATION//STOP//Furosemide")
            if rng.random() < 0.3:
                stay, next_stay = next_stay, next_stay + 1
                icu_in = admit + dt.timedelta(hours=6)
                event(subject, icu_in, "ICU_ADMISSION//Medical Intensive Care Unit (MICU)", hadm=hadm, icustay_id=stay)
                event(subject, icu_in + dt.timedelta(hours=1), "LAB//220045//bpm", float(rng.randint(60, 120)),
                      None, hadm=hadm, icustay_id=stay)
                event(subject, icu_in + dt.timedelta(hours=2), "INFUSION_START//225158", 100.0, hadm=hadm,
                      icustay_id=stay)
                event(subject, icu_in + dt.timedelta(hours=2), "SUBJECT_WEIGHT_AT_INFUSION//KG", 80.0)
                if newer:
                    for part, hours in (("START", 1), ("END", 20)):
                        event(subject, icu_in + dt.timedelta(hours=hours), f"PROCEDURE//{part}//{VENTILATION}",
                              hadm=hadm, icustay_id=stay)
                event(subject, icu_in + dt.timedelta(hours=30), "ICU_DISCHARGE//Medical Intensive Care Unit (MICU)",
                      hadm=hadm, icustay_id=stay)
            coded = index % 13 != 7 or not last  # one admission of the set is never coded
            diagnoses = sorted(set(chronic[version] + rng.sample(ACUTE[version], rng.randint(1, 2)))) if coded else []
            for code in diagnoses:
                event(subject, discharge, f"DIAGNOSIS//ICD//{version}//{code}", hadm=hadm)
            if coded:
                event(subject, discharge, "DRG//HCFA//291//HEART FAILURE & SHOCK WITH MCC", hadm=hadm)
            died = dies and last
            # MIMIC leaves the discharge location of some admissions empty: the newer ETL writes it UNK.
            home = "UNK" if newer and number == 1 else "HOME"
            event(subject, discharge, f"HOSPITAL_DISCHARGE//{'DIED' if died else home}", hadm=hadm)
            if died:  # the pre-MEDS step takes `dod` (a date) for some exports and `deathtime` for others
                event(subject, discharge.replace(hour=0) if index % 9 == 2 else discharge, "MEDS_DEATH")
            admissions.append({"hadm_id": hadm, "admit": admit, "discharge": discharge, "version": version,
                               "diagnoses": diagnoses, "emergency": emergency})
            # Outpatient draws and an OMR reading between admissions: no hadm_id.
            after = discharge + dt.timedelta(days=rng.randint(10, 20))
            outpatient = round(rng.uniform(0.5, 2.0), 1)
            lab(subject, after, 50912, "mg/dL", outpatient, str(outpatient), priority="ROUTINE")
            event(subject, after.replace(hour=0), "Blood Pressure", None, "128/82")
            admit = after + dt.timedelta(days=rng.randint(20, 300))
        if not n_admissions:
            lab(subject, dt.datetime(2151, 3, 4, 9), 50912, "mg/dL", 0.9, "0.9")
        truth[subject] = {"index": index, "split": split_of(index), "admissions": admissions, "died": dies}

    frame = pl.DataFrame(rows, schema=SCHEMA).sort("subject_id", "time", nulls_last=False, maintain_order=True)
    if newer:
        itemid = pl.col("code").str.extract(r"^LAB//(?:RESULT//|SPECIMEN_COLLECTED//)?(\d+)").cast(pl.Int64)
        frame = frame.with_columns(
            pl.struct(itemid.alias("itemid"), pl.lit(None, pl.String).alias("valueuom"),
                      pl.lit(None, pl.String).alias("icd_code"), pl.lit(None, pl.Int64).alias("icd_version"))
            .cast(COMPONENTS).alias("code_components"),
            pl.col("code").str.split("//").list.first().alias("source_block"))
    for split in ("train", "tuning", "held_out"):
        part = frame.filter(pl.col("subject_id").is_in([s for s, v in truth.items() if v["split"] == split]))
        (root / "data" / split).mkdir(parents=True)
        part.write_parquet(root / "data" / split / "0.parquet")
    (root / "metadata").mkdir()
    codes = frame["code"].unique().sort()
    described = {creatinine(layout): "Creatinine", ed_lab(layout): "Troponin T", "LAB//SPECIMEN_COLLECTED//51003":
                 "Troponin T", "DIAGNOSIS//ICD//10//I5022": "Chronic systolic (congestive) heart failure",
                 "DIAGNOSIS//ICD//9//4280": "Congestive heart failure, unspecified",
                 f"PROCEDURE//ICD//9//{PROCEDURES[9]}": "Venous catheterization, not elsewhere classified"}
    metadata = pl.DataFrame({"code": codes, "description": [described.get(c) for c in codes],
                             "parent_codes": [[c.split("//")[0]] for c in codes]},
                            schema={"code": pl.String, "description": pl.String, "parent_codes": pl.List(pl.String)})
    if newer:
        metadata = metadata.with_columns(code_template=pl.lit(None, pl.String),
                                         possibly_cpt_code=pl.lit(None, pl.List(pl.String)))
    metadata.write_parquet(root / "metadata" / "codes.parquet")
    pl.DataFrame({"subject_id": list(truth), "split": [v["split"] for v in truth.values()]},
                 schema={"subject_id": pl.Int64, "split": pl.String}).write_parquet(
        root / "metadata" / "subject_splits.parquet")
    versions = {"dataset_version": "3.1:0.1.1", "meds_version": "0.4.1"} if newer else {
        "dataset_version": "2.2", "meds_version": "0.3.3"}
    (root / "metadata" / "dataset.json").write_text(json.dumps({
        "dataset_name": "MIMIC-IV", "etl_name": "MEDS_transforms", "etl_version": layout, **versions,
        "created_at": "2024-09-01T00:00:00"}))
    return truth


def expected_trajectories(truth: dict) -> list[tuple]:
    """(subject, target hadm_id, cutoff, split, prior admissions) of each patient with two coded admissions: the
    last coded admission is the target, its admission time the cutoff."""
    rows = []
    for subject, record in sorted(truth.items()):
        coded = [a for a in record["admissions"] if a["diagnoses"]]
        if len(coded) >= 2:
            rows.append((subject, coded[-1]["hadm_id"], coded[-1]["admit"], record["split"], len(coded) - 1))
    return rows


@pytest.mark.parametrize("layout, n_events", [("0.0.7", "1,946"), ("0.6.7", "2,561")])
def test_a_mimic_iv_meds_extract_export_runs_end_to_end_and_keeps_the_boundary(layout, n_events, wh_vocab, tmp_path,
                                                                               monkeypatch):
    from click.testing import CliRunner

    from dxr.cli import main
    from models.llm.config import LLMConfig
    from tasks.direct import direct_prompt
    from tasks.forecast import fitted_forecaster
    from warehouse.cohorts import code_titles
    from warehouse.vocab import Vocabulary

    for setting, value in (("D_MODEL", 16), ("N_LAYERS", 1), ("N_HEADS", 2), ("EXPERT_HIDDEN", 16), ("SEED", 5)):
        monkeypatch.setenv(f"DXR_PRIOR__{setting}", str(value))
    truth = write_mimic_iv_meds(tmp_path / "MIMIC-IV_MEDS", layout=layout)
    wh, root = wh_vocab, wh_vocab.root  # the vocabulary tables already there: building them takes seconds

    def run(*args: str) -> str:
        result = CliRunner().invoke(main, ["--data-dir", str(root), *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    assert f"dataset mimiciv: 40 patients, {n_events} events, ICD versions 9,10" in run(
        "ingest", "meds", str(tmp_path / "MIMIC-IV_MEDS"), "--name", "mimiciv")
    run("cohort", "build", "--dataset", "mimiciv", "--name", "native")
    run("cohort", "build", "--dataset", "mimiciv", "--name", "icd10", "--harmonize", "icd10")
    con = wh.connect()
    cohorts = dict(con.execute("SELECT name, cohort_id FROM cohorts").fetchall())
    expected = expected_trajectories(truth)
    assert len(expected) == 27
    # Patients coded in both ICD versions (admitted on both sides of the switch), each with a trajectory.
    mixed = {s for s, r in truth.items() if len({a["version"] for a in r["admissions"] if a["diagnoses"]}) == 2}
    assert len(mixed) == 9 and mixed <= {row[0] for row in expected}
    for name, cohort in cohorts.items():
        # The targets are the hospital admissions (hadm_id), cut at their admission, not at the ED registration.
        assert con.execute("""SELECT subject_id, target_encounter_id, cutoff_time, split, n_prior_encounters
                              FROM trajectories WHERE cohort_id = ? ORDER BY subject_id""", [cohort]).fetchall() \
            == expected, name
        # Nothing of a target admission before its cutoff: not its ED registration, ED draws and ED transfer (from
        # 5 h before the admission), its procedures dated at midnight, its discharge, DRG, diagnoses or death.
        leaks = con.execute("""
            SELECT p.trajectory_id, p.time, p.code FROM pretarget_events p JOIN trajectories t USING (trajectory_id)
            WHERE t.cohort_id = ? AND (p.encounter_id = t.target_encounter_id OR p.code = 'MEDS_DEATH'
                                       OR p.time >= t.cutoff_time - INTERVAL 5 HOUR)""", [cohort]).fetchall()
        assert leaks == [], name
        # What the earlier admissions hold is history: each one's DRG, ED draws and pharmacy orders.
        counts = dict(con.execute("""
            SELECT code, count(*) FROM pretarget_events p JOIN trajectories t USING (trajectory_id)
            WHERE t.cohort_id = ? AND code IN ('DRG//HCFA//291//HEART FAILURE & SHOCK WITH MCC', ?, ?)
            GROUP BY code""", [cohort, ed_lab(layout), PHARMACY]).fetchall())
        prior_admissions = [a for s, hadm, *_ in expected for a in truth[s]["admissions"]
                            if a["diagnoses"] and a["hadm_id"] != hadm]
        assert counts == {
            "DRG//HCFA//291//HEART FAILURE & SHOCK WITH MCC": len(prior_admissions),
            ed_lab(layout): sum(a["emergency"] for a in prior_admissions), PHARMACY: len(prior_admissions)}, name
    # ICD-9 targets harmonized to ICD-10 by every target of their GEM entries (272.4 "Other and unspecified
    # hyperlipidemia" has two alternatives); ICD-10 targets kept.
    gem = {"4280": ["I509"], "2724": ["E784", "E785"], "25000": ["E119"], "486": ["J189"], "5990": ["N390"],
           "42731": ["I4891"], "41401": ["I2510"], "4019": ["I10"], "V4581": ["Z951"], "E8497": ["Y92199"],
           "5849": ["N179"]}
    for name, harmonized in (("native", lambda v, c: [f"DIAGNOSIS//ICD//{v}//{c}"]),
                             ("icd10", lambda v, c: [f"DIAGNOSIS//ICD//10//{t}" for t in (gem[c] if v == 9 else [c])])):
        targets = wh.read("targets", cohort_id=cohorts[name]).group_by("trajectory_id").agg(pl.col("code").sort())
        assert dict(targets.iter_rows()) == {
            f"{cohorts[name]}:{s}:{hadm}": sorted({code for a in truth[s]["admissions"] if a["hadm_id"] == hadm
                                                   for c in a["diagnoses"] for code in harmonized(a["version"], c)})
            for s, hadm, *_ in expected}, name

    # The readable record of the first trajectory: its second admission began in the ED. A lab reads as its result
    # (a collection would only repeat it), a unit or a discharge location the source left empty (UNK) as none.
    first = f"{cohorts['native']}:{expected[0][0]}:{expected[0][1]}"
    prompt = direct_prompt(wh.read("pretarget_events", cohort_id=cohorts["native"]).filter(
        pl.col("trajectory_id") == first), Vocabulary.from_warehouse(wh.connect(), cohorts["native"]), LLMConfig(),
        code_titles=code_titles(wh, cohorts["native"])).messages[1]["content"].splitlines()
    second = prompt.index("Encounter 2: 2151-05-27 to 2151-06-04, admitted EW EMER.//EMERGENCY ROOM"
                          + (", discharged HOME" if layout == "0.0.7" else ""))
    urine = "51508 Clear; " if layout == "0.6.7" else ""
    assert prompt[second + 4] == ("  Labs: Creatinine 1.4 mg/dL; Troponin T 0.01 ng/mL; Creatinine 0.9 mg/dL; "
                                  f"51484 NEG mg/dL; {urine}220045 93 bpm")
    assert prompt[second + 8] == "  2151-06-14 Labs: Creatinine 0.8 mg/dL"

    trained = run("prior", "train", "--cohort", "native", "--epochs", "1")
    assert f"ehr_prior: registered ehr_prior-{cohorts['native']} v1 @champion" in trained
    systems = ("repeat_history", "transition", "global_frequency", "ehr_prior")
    for system in systems:
        run("forecast", "--cohort", "native", "--system", system, "--split", "all", "--run-id", "mext")
    # The prior's inputs: diagnoses, procedures of both ICD versions, medications (the emar's administrations and
    # the pharmacy's orders, which carry no hadm_id), lab value quintiles (the ED troponin too) and the texts of results
    # without a number (urine protein NEG; in 0.6.7 urine appearance Clear), the ICU's procedure events and sex.
    vocab = fitted_forecaster(str(root), cohorts["native"], "ehr_prior").vocab
    texts = [f"{lab_code(layout, 51484, 'mg/dL')}//NEG"] + ([f"{lab_code(layout, 51508, None)}//CLEAR"]
                                                           if layout == "0.6.7" else [])
    labs = sorted([f"{lab}//q{q}" for lab in ("LAB//220045//bpm", creatinine(layout), ed_lab(layout)) for q in range(5)]
                  + texts)
    icu = [f"PROCEDURE//{part}//{VENTILATION}" for part in ("START", "END")] if layout == "0.6.7" else []
    assert [c for c in vocab.input_codes if not c.startswith("DIAGNOSIS//")] == [
        "GENDER//F", "GENDER//M", *labs, "MEDICATION//Furosemide//Administered", PHARMACY,
        "MEDICATION//STOP//Furosemide", *sorted([f"PROCEDURE//ICD//10//{PROCEDURES[10]}",
                                                 f"PROCEDURE//ICD//9//{PROCEDURES[9]}", *icu])]
    # Every trajectory gets 20 distinct codes of Ω from every system.
    con = wh.connect()
    assert con.execute("""
        SELECT r.system, count(*), count(DISTINCT (r.trajectory_id, r.code)), count(v.code),
               count(DISTINCT r.trajectory_id), max(r.rank)
        FROM rankings r JOIN trajectories t USING (trajectory_id)
        LEFT JOIN cohort_vocabulary v ON v.cohort_id = t.cohort_id AND v.code = r.code
        WHERE r.run_id = 'mext' GROUP BY r.system ORDER BY r.system""").fetchall() == [
        (system, 540, 540, 540, 27, 20) for system in sorted(systems)]
    run("evaluate", "--run", "mext", "--k", "10,20", "--bootstrap", "0")
    con = wh.connect()
    assert con.execute("""SELECT system, n_trajectories, n_short, n_failed, n_below_k FROM evaluation_coverage
                          WHERE run_id = 'mext' AND k = 20 ORDER BY system""").fetchall() == [
        (system, 27, 0, 0, 0) for system in sorted(systems)]
    # Results per ICD version of the target admission: 18 coded in ICD-9, 9 in ICD-10.
    per_version = con.execute("""SELECT system, subset, n FROM metrics WHERE run_id = 'mext' AND k = 20
                                 AND metric = 'recall_at_k' AND subset IN ('all', 'icd9', 'icd10') ORDER BY ALL""")
    assert per_version.fetchall() == [(system, subset, n) for system in sorted(systems)
                                      for subset, n in (("all", 27), ("icd10", 9), ("icd9", 18))]
    run("report", "--run", "mext")
    assert (root / "reports" / "mext" / "report.md").is_file()
