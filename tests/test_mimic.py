"""MIMIC importers: the real MIMIC-III demo against counts taken straight from its CSVs, the
hand-written MIMIC-IV `hosp` fixture against its expected MEDS rows, and every bad-input case."""

from __future__ import annotations

import csv
import gzip
import json
import re
import shutil
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from dxr.cli import main
from dxr.errors import ConfigError, InputError
from models.llm.config import LLMConfig
from tests.conftest import FailsAt, abandoned_scratch, disk_full_errors, shared_data
from warehouse.choices import HARMONIZATIONS
from warehouse.importers import import_mimic3, import_mimic4
from warehouse.meds import hash_split, validate_meds_dir

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mimic4"
SEED = 7


def read_meds(root: Path) -> pl.DataFrame:
    return pl.read_parquet(root / "data" / "**" / "*.parquet").sort(
        "subject_id", "time", "code", "encounter_id", nulls_last=False)


# ---- MIMIC-III demo: counts from the raw CSVs ---------------------------------------------------

def raw_rows(folder: Path, table: str) -> list[dict[str, str]]:
    with open(folder / f"{table}.csv", newline="") as handle:
        return [{key.lower(): value for key, value in row.items()} for row in csv.DictReader(handle)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    src = shared_data("mimic-iii-demo")
    out = tmp_path_factory.mktemp("mimic3") / "meds"
    summary = import_mimic3(src, out, seed=SEED)
    return src, out, summary


def test_demo_counts_match_the_raw_csvs(demo):
    src, out, summary = demo
    patients, admissions = raw_rows(src, "PATIENTS"), raw_rows(src, "ADMISSIONS")
    diagnoses = raw_rows(src, "DIAGNOSES_ICD")
    hadm_ids = {row["hadm_id"] for row in admissions}
    unique_dx = {(int(row["hadm_id"]), row["icd9_code"].replace(".", "").upper())
                 for row in diagnoses if row["icd9_code"] and row["hadm_id"] in hadm_ids}
    events = read_meds(out)
    dx = events.filter(pl.col("code").str.starts_with("DIAGNOSIS//"))

    assert events["subject_id"].n_unique() == len({row["subject_id"] for row in patients}) == summary.n_subjects
    assert events.filter(pl.col("code").str.starts_with("HOSPITAL_ADMISSION//")).height == len(admissions)
    assert summary.n_admissions == len(admissions)
    assert set(zip(dx["encounter_id"], dx["code"].str.split("//").list.get(3))) == unique_dx
    assert dx.height == len(unique_dx) == summary.n_diagnoses
    assert dx["code"].str.starts_with("DIAGNOSIS//ICD//9//").all()
    admissions_with_dx = {hadm for hadm, _ in unique_dx}
    assert set(dx["encounter_id"].unique()) == admissions_with_dx
    assert summary.n_encounters == len(admissions_with_dx)


def test_demo_diagnoses_sit_at_discharge_with_seq_num(demo):
    src, out, _ = demo
    discharge = {int(row["hadm_id"]): datetime.fromisoformat(row["dischtime"]) for row in raw_rows(src, "ADMISSIONS")}
    first_seq = {}
    for row in raw_rows(src, "DIAGNOSES_ICD"):
        key = (int(row["hadm_id"]), row["icd9_code"])
        first_seq[key] = min(first_seq.get(key, 10**9), int(row["seq_num"]))
    dx = read_meds(out).filter(pl.col("code").str.starts_with("DIAGNOSIS//"))
    for hadm, time, code, seq in dx.select("encounter_id", "time", "code", "seq_num").iter_rows():
        assert time == discharge[hadm], (hadm, code)
        assert seq == first_seq[(hadm, code.split("//")[3])], (hadm, code)


def test_demo_ages_over_89_are_capped_at_90_and_flagged(demo):
    src, out, summary = demo
    first_admit = defaultdict(lambda: datetime.max)
    for row in raw_rows(src, "ADMISSIONS"):
        subject = int(row["subject_id"])
        first_admit[subject] = min(first_admit[subject], datetime.fromisoformat(row["admittime"]))

    def age(born: datetime, at: datetime) -> int:
        return at.year - born.year - ((at.month, at.day, at.time()) < (born.month, born.day, born.time()))

    over_89 = {int(row["subject_id"]) for row in raw_rows(src, "PATIENTS")
               if age(datetime.fromisoformat(row["dob"]), first_admit[int(row["subject_id"])]) > 89}
    births = read_meds(out).filter(pl.col("code") == "MEDS_BIRTH")
    capped = births.filter(pl.col("time_imputed"))
    assert set(capped["subject_id"]) == over_89 and summary.n_ages_capped == len(over_89) > 0
    for subject, born in capped.select("subject_id", "time").iter_rows():
        assert age(born, first_admit[subject]) == 90, subject
    for subject, born in births.filter(~pl.col("time_imputed")).select("subject_id", "time").iter_rows():
        assert age(born, first_admit[subject]) <= 89, subject


def test_demo_is_valid_meds_with_the_dictionary(demo):
    src, out, _ = demo
    info = validate_meds_dir(out)
    assert info.icd_versions == (9,)
    codes = pl.read_parquet(out / "metadata" / "codes.parquet")
    titles = dict(zip(codes["code"], codes["description"]))
    dictionary = raw_rows(src, "D_ICD_DIAGNOSES")
    assert all(titles[f"DIAGNOSIS//ICD//9//{row['icd9_code']}"] == row["long_title"] for row in dictionary)
    # Every emitted code is listed, but a diagnosis only from the dictionary: cohorts take Ω from the listed
    # diagnoses, and codes listed because the data holds them would put codes of held-out targets there.
    emitted = set(read_meds(out)["code"])
    assert {c for c in emitted if not c.startswith("DIAGNOSIS//")} <= set(titles)
    listed = {c for c in titles if c.startswith("DIAGNOSIS//")}
    assert listed == {f"DIAGNOSIS//ICD//9//{row['icd9_code']}" for row in dictionary}
    # Used, but not in the dictionary: the codes of the raw DIAGNOSES_ICD rows that D_ICD_DIAGNOSES lacks.
    used = {f"DIAGNOSIS//ICD//9//{row['icd9_code']}" for row in raw_rows(src, "DIAGNOSES_ICD") if row["icd9_code"]}
    assert {c for c in emitted if c.startswith("DIAGNOSIS//")} - listed == used - listed and len(used - listed) == 20
    splits = pl.read_parquet(out / "metadata" / "subject_splits.parquet")
    assert dict(zip(splits["subject_id"], splits["split"])) == {s: hash_split(s, SEED) for s in splits["subject_id"]}


def test_demo_ndc_codes_are_described_by_their_most_written_drug_name(demo):
    src, out, _ = demo
    names: dict[str, Counter] = defaultdict(Counter)
    for row in raw_rows(src, "PRESCRIPTIONS"):
        ndc = row["ndc"].strip().replace("-", "")
        if ndc.isdigit() and int(ndc) and row["drug"].strip():
            names[f"MEDICATION//NDC//{ndc}"][" ".join(row["drug"].split())] += 1
    codes = pl.read_parquet(out / "metadata" / "codes.parquet")
    ndc = codes.filter(pl.col("code").str.starts_with("MEDICATION//NDC//"))
    assert ndc.height == len(names) == 995 and ndc["description"].null_count() == 0
    assert dict(ndc.select("code", "description").iter_rows()) == {
        code: min(counts, key=lambda name: (-counts[name], name)) for code, counts in names.items()}
    titles = dict(zip(codes["code"], codes["description"]))
    assert titles["MEDICATION//NDC//00054829725"] == "Furosemide"
    # Written 'Heparin Flush CVL  (100 units/ml)' most often: spaces are made single.
    assert titles["MEDICATION//NDC//64253033335"] == "Heparin Flush CVL (100 units/ml)"
    assert titles["PROCEDURE//ICD//9//3961"] == "Extracorporeal circulation auxiliary to open heart surgery"


def test_demo_default_cohort_has_the_trajectories_the_csvs_imply(demo, wh_vocab):
    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import register_dataset
    from warehouse.meds import copy_meds_dir

    src, out, _ = demo
    copy_meds_dir(out, wh_vocab.meds_dir("mimic3demo"))
    register_dataset(wh_vocab, "mimic3demo", source="mimic3")
    row = build_cohort(wh_vocab, "mimic3demo", "default", CohortOptions(), seed=SEED)
    # Default cohort: each patient's final encounter with diagnoses, given ≥ 1 earlier one.
    hadm_with_dx = {row["hadm_id"] for row in raw_rows(src, "DIAGNOSES_ICD") if row["icd9_code"]}
    per_subject = defaultdict(int)
    for adm in raw_rows(src, "ADMISSIONS"):
        per_subject[adm["subject_id"]] += adm["hadm_id"] in hadm_with_dx
    expected = sum(1 for n in per_subject.values() if n >= 2)
    assert row["n_trajectories"] == expected == 14
    # The cohort carries the titles of the procedures and drugs its forecasting tables hold, and H shows them.
    from tasks.direct import direct_prompt
    from warehouse.cohorts import code_titles
    from warehouse.vocab import Vocabulary

    cid = row["cohort_id"]
    titles = code_titles(wh_vocab, cid)
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid)
    held = set(pretarget["code"]) | set(wh_vocab.read("train_events", cohort_id=cid)["code"])
    described = {c for c in held if c.startswith(("PROCEDURE//", "MEDICATION//NDC//"))}
    assert set(titles) <= held and described - set(titles) == {"PROCEDURE//ICD//9//3601"}  # not in the dictionary
    # Diagnoses: Ω's titles, and for the codes its dictionary lacks (789.5 ascites) the official ICD-9-CM title.
    omega = set(wh_vocab.read("cohort_vocabulary", cohort_id=cid)["code"])
    outside = {c for c in held if c.startswith("DIAGNOSIS//")} - omega
    assert "DIAGNOSIS//ICD//9//7895" in outside and titles["DIAGNOSIS//ICD//9//7895"] == "Ascites"
    assert {c for c in titles if c.startswith("DIAGNOSIS//")} <= outside
    furosemide = pretarget.filter(pl.col("code") == "MEDICATION//NDC//00054829725")["trajectory_id"][0]
    vocabulary = Vocabulary.from_warehouse(wh_vocab.connect(), cid)
    prompt = direct_prompt(pretarget.filter(pl.col("trajectory_id") == furosemide), vocabulary, LLMConfig(),
                           code_titles=titles).messages[1]["content"]
    assert "Furosemide (NDC 00054829725)" in prompt and "; 00054829725" not in prompt


def test_demo_cohort_build_says_which_diagnosis_codes_no_forecast_can_reach(demo, wh_vocab):
    # DIAGNOSES_ICD uses 20 codes that D_ICD_DIAGNOSES (Ω) lacks, older ones such as 789.5 ascites and 276.6
    # fluid overload: V(.) drops them from every forecast. Under icd10, 37 codes map to NoDx only (pressure
    # ulcer stages, drug adverse effects) or are not in the GEM, and their events are dropped; icd10_closest
    # renders 17 of those through their children, leaving 20. Both used to pass in silence.
    from warehouse.datasets import register_dataset
    from warehouse.meds import copy_meds_dir

    _, out, _ = demo
    copy_meds_dir(out, wh_vocab.meds_dir("mimic3demo"))
    register_dataset(wh_vocab, "mimic3demo", source="mimic3")
    native = run("--data-dir", wh_vocab.root, "cohort", "build", "--dataset", "mimic3demo", "--name", "native")
    assert native.exit_code == 0, native.output
    # The demo's 14 trajectories are of train and tuning patients: said at the build, not first by `dxr forecast`.
    assert "14 trajectories (train 12, tuning 2, held_out 0)" in native.output
    assert "note: no trajectory is in held_out, the split dxr forecast takes by default: forecast --split all" \
        in native.output
    # The note named no code: which ones, and how often the data uses them, took a query of the gold store.
    assert native.output.splitlines()[-1] == (
        "note: 20 diagnosis codes of the data are not in Ω (dataset_dictionary): no forecast can name them, so "
        "where they are targets every system misses them; most frequent first: DIAGNOSIS//ICD//9//0414 (8 events), "
        "DIAGNOSIS//ICD//9//2765 (5 events), DIAGNOSIS//ICD//9//5185 (5 events), DIAGNOSIS//ICD//9//2554 "
        "(3 events), DIAGNOSIS//ICD//9//2766 (2 events), and 15 more")
    assert "in no ICD-9-CM or ICD-10-CM table" not in native.output  # they are older ICD-9-CM codes, no typos
    icd10 = run("--data-dir", wh_vocab.root, "cohort", "build", "--dataset", "mimic3demo", "--name", "icd10",
                "--harmonize", "icd10")
    assert "note: 37 diagnosis codes of the data have no icd10 rendering (not in the GEM, or NoDx only): their " \
           "events are dropped from histories and targets; most frequent first: " in icd10.output
    closest = run("--data-dir", wh_vocab.root, "cohort", "build", "--dataset", "mimic3demo", "--name", "closest",
                  "--harmonize", "icd10_closest")
    assert "note: 20 diagnosis codes of the data have no icd10_closest rendering (GEM NoDx only, no common ICD-10 " \
           "ancestor): their events are dropped from histories and targets; most frequent first: " \
           "DIAGNOSIS//ICD//9//70722 (5 events), " in closest.output
    recorded = {r["name"]: json.loads(r["options_json"]) for r in wh_vocab.read("cohorts").iter_rows(named=True)}
    assert recorded["native"]["diagnosis_codes_outside_vocabulary"] == 20
    assert recorded["native"]["unmapped_diagnosis_codes"] == 0
    assert recorded["icd10"]["unmapped_diagnosis_codes"] == 37
    assert recorded["closest"]["unmapped_diagnosis_codes"] == 20


def test_cohort_build_names_a_diagnosis_code_that_no_icd_table_has(tmp_path, wh_vocab):
    """A mistyped code (N1799 for N179) has a code's shape, so the import takes it; the build counted it among the
    codes Ω lacks without naming it or saying that it is no ICD code at all."""
    import gzip
    import shutil

    hosp = shutil.copytree(FIXTURE, tmp_path / "typo") / "hosp"
    with gzip.open(hosp / "diagnoses_icd.csv.gz", "rt") as f:
        rows = f.read()
    with gzip.open(hosp / "diagnoses_icd.csv.gz", "wt") as f:
        f.write(rows.replace(",N179,", ",N1799,"))
    assert run("--data-dir", wh_vocab.root, "ingest", "mimic4", hosp.parent, "--name", "typo").exit_code == 0
    built = run("--data-dir", wh_vocab.root, "cohort", "build", "--dataset", "typo", "--name", "typo")
    assert built.exit_code == 0, built.output
    assert built.output.splitlines()[-2:] == [
        "note: 1 diagnosis codes of the data are not in Ω (dataset_dictionary): no forecast can name them, so where "
        "they are targets every system misses them; most frequent first: DIAGNOSIS//ICD//10//N1799 (1 event)",
        "note: 1 diagnosis code(s) of the data are in no ICD-9-CM or ICD-10-CM table: DIAGNOSIS//ICD//10//N1799 "
        "(1 event); correct them in the export (a typo?), or list a local code with its title in the dataset's "
        "dictionary (d_icd_diagnoses, codes.parquet) to forecast it"]


# ---- MIMIC-IV fixture: every rule on a hand-written hosp directory -------------------------------

def ts(text: str) -> datetime:
    return datetime.fromisoformat(text)


S1, S2, S3, S4 = 10000001, 10000002, 10000003, 10000004
# (subject, time, code, encounter_id, seq_num, time_imputed), in MEDS order.
EXPECTED = [
    (S1, None, "GENDER//F", None, None, False),
    (S1, ts("2098-01-01"), "MEDS_BIRTH", None, None, False),
    (S1, ts("2150-03-01 08:00"), "HOSPITAL_ADMISSION//EW EMER.", 20000001, None, False),
    (S1, ts("2150-03-01 09:00"), "MEDICATION//NDC//00517570425", 20000001, None, False),
    (S1, ts("2150-03-01 10:00"), "MEDICATION//NAME//heparin sodium", 20000001, None, False),  # NDC 0 = none
    (S1, ts("2150-03-02"), "PROCEDURE//ICD//9//3722", 20000001, 1, False),
    (S1, ts("2150-03-05 14:00"), "DIAGNOSIS//ICD//9//25000", 20000001, 2, False),
    (S1, ts("2150-03-05 14:00"), "DIAGNOSIS//ICD//9//4280", 20000001, 1, False),
    (S1, ts("2150-03-05 14:00"), "HOSPITAL_DISCHARGE//HOME", 20000001, None, False),
    (S1, ts("2152-07-10 09:30"), "HOSPITAL_ADMISSION//URGENT", 20000002, None, False),
    (S1, ts("2152-07-11"), "PROCEDURE//ICD//10//02HV33Z", 20000002, 1, False),
    (S1, ts("2152-07-15 12:00"), "DIAGNOSIS//ICD//10//E119", 20000002, 2, False),
    (S1, ts("2152-07-15 12:00"), "DIAGNOSIS//ICD//10//I5023", 20000002, 1, False),
    (S1, ts("2152-07-15 12:00"), "HOSPITAL_DISCHARGE//SKILLED NURSING FACILITY", 20000002, None, False),
    # No dischtime: the diagnosis takes admittime and is flagged; no discharge event.
    (S1, ts("2153-01-01 10:00"), "DIAGNOSIS//ICD//10//I10", 20000003, 1, True),
    (S1, ts("2153-01-01 10:00"), "HOSPITAL_ADMISSION//EW EMER.", 20000003, None, False),
    (S2, None, "GENDER//M", None, None, False),
    (S2, ts("2070-01-01"), "MEDS_BIRTH", None, None, True),  # anchor_age 91 (top-coded) → 90 in 2160
    (S2, ts("2160-02-02 11:00"), "HOSPITAL_ADMISSION//ELECTIVE", 20000004, None, False),
    (S2, ts("2160-02-09 16:00"), "DIAGNOSIS//ICD//9//486", 20000004, 1, False),
    (S2, ts("2160-02-09 16:00"), "DIAGNOSIS//ICD//9//5849", 20000004, 2, False),
    (S2, ts("2160-02-09 16:00"), "HOSPITAL_DISCHARGE//HOME HEALTH CARE", 20000004, None, False),
    (S2, ts("2163-04-30 22:00"), "HOSPITAL_ADMISSION//EW EMER.", 20000005, None, False),
    (S2, ts("2163-05-01 06:00"), "MEDICATION//NAME//sodium chloride 0.9% flush, syringe", 20000005, None, False),
    (S2, ts("2163-05-02 10:00"), "DIAGNOSIS//ICD//10//J189", 20000005, 1, False),
    (S2, ts("2163-05-02 10:00"), "DIAGNOSIS//ICD//10//N179", 20000005, 2, False),
    (S2, ts("2163-05-02 10:00"), "HOSPITAL_DISCHARGE//DIED", 20000005, None, False),
    (S2, ts("2163-05-02 10:00"), "MEDS_DEATH", 20000005, None, False),  # deathtime beats the dod date
    (S2, ts("2163-05-02 10:00"), "PROCEDURE//ICD//10//0BH17EZ", 20000005, 1, True),  # no chartdate
    (S3, None, "GENDER//F", None, None, False),
    (S3, ts("2136-01-01"), "MEDS_BIRTH", None, None, False),
    (S3, ts("2170-06-01 07:00"), "HOSPITAL_ADMISSION//OBSERVATION ADMIT", 20000006, None, False),
    (S3, ts("2170-06-01 07:00"), "MEDICATION//NAME//omeprazole", 20000006, None, True),  # no starttime
    # Four raw rows, two codes: duplicates collapse to the smallest seq_num.
    (S3, ts("2170-06-03 18:00"), "DIAGNOSIS//ICD//10//E785", 20000006, 2, False),
    (S3, ts("2170-06-03 18:00"), "DIAGNOSIS//ICD//10//K219", 20000006, 1, False),
    (S3, ts("2170-06-03 18:00"), "HOSPITAL_DISCHARGE//HOME", 20000006, None, False),
    # An admission without diagnoses is kept as events but is not an encounter for cohorts.
    (S3, ts("2171-01-10 08:00"), "HOSPITAL_ADMISSION//SURGICAL SAME DAY ADMISSION", 20000007, None, False),
    (S3, ts("2171-01-11 09:00"), "HOSPITAL_DISCHARGE//HOME", 20000007, None, False),
    # Known by its date only (dod): the end of that day, never before an admission of the same day.
    (S3, ts("2171-01-11 23:59:59"), "MEDS_DEATH", None, None, True),
    (S4, None, "GENDER//M", None, None, False),  # a patient without admissions
    (S4, ts("2080-01-01"), "MEDS_BIRTH", None, None, False),
]


@pytest.fixture(scope="module")
def mimic4(tmp_path_factory):
    out = tmp_path_factory.mktemp("mimic4") / "meds"
    return out, import_mimic4(FIXTURE, out, seed=SEED)


def test_an_extract_under_a_key_value_directory_imports_as_under_a_plain_path(mimic4, tmp_path):
    # DuckDB took a column from each `key=value` directory of a CSV's path: the importer names the CSV columns c0,
    # c1, …, so under `c0=x/` every row's first column (the subject id) read x and the import failed.
    out, _ = mimic4
    source = shutil.copytree(FIXTURE, tmp_path / "c0=x" / "site=a" / "mimic4")
    import_mimic4(source, tmp_path / "meds", seed=SEED)
    assert read_meds(tmp_path / "meds").equals(read_meds(out))


def test_fixture_events_are_exactly_the_expected_rows(mimic4):
    out, _ = mimic4
    expected = pl.DataFrame(EXPECTED, orient="row", schema={
        "subject_id": pl.Int64, "time": pl.Datetime("us"), "code": pl.String, "encounter_id": pl.Int64,
        "seq_num": pl.Int32, "time_imputed": pl.Boolean})
    actual = read_meds(out)
    assert actual.select(expected.columns).to_dicts() == expected.to_dicts()
    assert actual["numeric_value"].is_null().all() and actual["text_value"].is_null().all()


def test_fixture_summary_and_metadata(mimic4):
    out, summary = mimic4
    assert (summary.n_subjects, summary.n_admissions, summary.n_encounters) == (4, 7, 6)
    assert summary.n_admissions_discharged_before_admitted == summary.n_diagnosis_rows_without_code == 0
    assert summary.n_procedure_rows_without_admission == summary.n_procedure_rows_without_code == 0
    assert (summary.n_prescription_rows_without_admission, summary.n_prescription_rows_without_time,
            summary.n_prescription_rows_without_drug) == (0, 0, 0)
    assert (summary.n_diagnosis_rows, summary.n_diagnoses, summary.n_diagnoses_time_imputed) == (13, 11, 1)
    assert summary.diagnoses_by_icd_version == {"9": 4, "10": 7}
    assert (summary.n_procedures, summary.n_medications, summary.n_ages_capped) == (3, 4, 1)
    assert summary.rows_read == {"patients": 4, "admissions": 7, "diagnoses_icd": 13, "procedures_icd": 3,
                                 "prescriptions": 4, "d_icd_diagnoses": 12, "d_icd_procedures": 3}
    metadata = json.loads((out / "metadata" / "dataset.json").read_text())
    assert metadata["dataset_name"] == "MIMIC-IV" and metadata["import_summary"]["n_encounters"] == 6
    assert metadata["other_extension_columns"] == ["encounter_id", "seq_num", "time_imputed"]
    info = validate_meds_dir(out)
    assert info.icd_versions == (9, 10) and info.n_subjects == 4 and info.n_events == len(EXPECTED)


def test_fixture_codes_hold_the_dictionaries_and_every_emitted_code(mimic4):
    out, _ = mimic4
    codes = pl.read_parquet(out / "metadata" / "codes.parquet")
    titles = dict(zip(codes["code"], codes["description"]))
    assert titles["DIAGNOSIS//ICD//10//R69"] == "Illness, unspecified"  # in the dictionary, not in the data
    assert titles["DIAGNOSIS//ICD//9//4280"] == "Congestive heart failure, unspecified"
    assert titles["PROCEDURE//ICD//9//3722"] == "Left heart cardiac catheterization"
    assert titles["HOSPITAL_DISCHARGE//DIED"] is None and titles["MEDICATION//NAME//omeprazole"] is None
    assert titles["MEDICATION//NDC//00517570425"] == "Furosemide"
    assert {code for _, _, code, *_ in EXPECTED} | {"DIAGNOSIS//ICD//10//R69"} <= set(titles)
    assert codes.height == codes["code"].n_unique() and codes["code"].to_list() == sorted(codes["code"])


def test_an_ndc_takes_its_most_written_drug_name_and_a_tie_the_first_in_sort_order(tmp_path):
    hosp = copy_fixture(tmp_path)
    furosemide = "10000001,20000001,1001,10000001-11,11,P00001,2150-03-01 09:00:00,2150-03-04 09:00:00,MAIN,Furosemide"
    tail = ",FURO40I,008209,{ndc},40mg/4mL Vial,,40,mg,1,VIAL,2,IV"
    extra = [furosemide.replace("Furosemide", "Lasix") + tail.format(ndc="00517570425")] * 2 + [
        furosemide.replace("Furosemide", name) + tail.format(ndc="0000-9999-999") for name in ("Zeta", "Alpha")]
    edit_table(hosp, "prescriptions", lambda lines: lines + extra)
    import_mimic4(hosp, tmp_path / "meds", seed=SEED)
    codes = pl.read_parquet(tmp_path / "meds" / "metadata" / "codes.parquet")
    titles = dict(zip(codes["code"], codes["description"]))
    assert titles["MEDICATION//NDC//00517570425"] == "Lasix"  # twice, against Furosemide once
    assert titles["MEDICATION//NDC//00009999999"] == "Alpha"  # once each


def test_labs_are_imported_only_when_asked_for_with_labels_values_and_counted_drops(tmp_path, mimic4):
    out, summary = mimic4
    assert "labevents" not in summary.rows_read and "lab results" not in summary.table()  # the file is there
    with_labs = import_mimic4(FIXTURE, tmp_path / "labs", seed=SEED, labs=True)
    events = read_meds(tmp_path / "labs")
    labs = events.filter(pl.col("code").str.starts_with("LAB//")).sort("subject_id", "time").with_columns(
        pl.col("numeric_value").cast(pl.Float64).round(3))  # stored as float32
    assert labs.select("subject_id", "code", "numeric_value", "text_value", "encounter_id").rows() == [
        # No hadm_id, drawn in the emergency department (from edregtime) before admission 20000001: part of it.
        (S1, "LAB//Creatinine (Blood)//mg/dL", 1.3, None, 20000001),
        (S1, "LAB//Creatinine (Blood)//mg/dL", 1.4, None, 20000001),
        (S1, "LAB//Sodium (Blood)//mEq/L", 134.0, None, 20000001),
        (S1, "LAB//Creatinine (Blood)//mg/dL", 1.1, None, None),  # outpatient: no admission
        (S2, "LAB//Leukocytes (Urine)//no unit", None, "NEG", 20000004),
        (S3, "LAB//99999//U/L", 42.0, None, 20000006),  # not in d_labitems: the itemid stays
    ]
    # The code spells the d_labitems label already; an item missing from it has none to give.
    codes = pl.read_parquet(tmp_path / "labs" / "metadata" / "codes.parquet")
    assert codes.filter(pl.col("code").str.starts_with("LAB//"))["description"].is_null().all()
    assert events.filter(~pl.col("code").str.starts_with("LAB//")).equals(read_meds(out))  # nothing else changes
    assert (with_labs.n_labs, with_labs.n_labs_outside_admissions, with_labs.n_labs_within_stays,
            with_labs.n_lab_rows_without_admission, with_labs.n_lab_rows_without_time) == (6, 1, 1, 1, 1)
    assert with_labs.rows_read["labevents"] == 8 and "  dropped (rows without a chart time)" in with_labs.table()
    hosp = copy_fixture(tmp_path)
    (hosp / "labevents.csv").unlink()
    with pytest.raises(InputError, match="missing MIMIC-IV table labevents"):
        import_mimic4(hosp, tmp_path / "no_labs", seed=SEED, labs=True)


def test_fixture_hosp_folder_and_release_root_give_the_same_events(tmp_path, mimic4):
    out, _ = mimic4
    import_mimic4(FIXTURE / "hosp", tmp_path / "direct", seed=SEED)
    assert read_meds(tmp_path / "direct").equals(read_meds(out))


def test_shards_are_bounded_by_events_and_never_split_a_subject(tmp_path, mimic4):
    # Shards were 25,000 subjects whatever their events: with lab results, MIMIC-IV puts ~470 events on a patient,
    # so one shard held ~12M events in memory. Split train holds S1 (16 events), S3 (10) and S4 (2); S2 is tuning.
    out, _ = mimic4

    def layout(root: Path) -> list[tuple[str, list[int], int]]:
        return sorted((str(path.relative_to(root / "data")), sorted(set(pl.read_parquet(path)["subject_id"])),
                       pl.read_parquet(path).height) for path in (root / "data").rglob("*.parquet"))

    assert layout(out) == [("train/0.parquet", [S1, S3, S4], 28), ("tuning/0.parquet", [S2], 13)]
    # S3 begins at event 16 and S4 at event 26 of train: windows of 14 put them together after S1.
    summary = import_mimic4(FIXTURE, tmp_path / "fourteen", seed=SEED, events_per_shard=14)
    assert layout(tmp_path / "fourteen") == [("train/0.parquet", [S1], 16), ("train/1.parquet", [S3, S4], 12),
                                             ("tuning/0.parquet", [S2], 13)]
    # Windows of 8: S1 alone fills windows 0 and 1 (S3 begins in window 2), yet the shards are numbered without a gap.
    import_mimic4(FIXTURE, tmp_path / "eight", seed=SEED, events_per_shard=8)
    assert layout(tmp_path / "eight") == [("train/0.parquet", [S1], 16), ("train/1.parquet", [S3], 10),
                                           ("train/2.parquet", [S4], 2), ("tuning/0.parquet", [S2], 13)]
    assert summary.n_shards == 3
    for name in ("fourteen", "eight"):
        assert read_meds(tmp_path / name).equals(read_meds(out)), name


def test_mimic4_v1_core_module_beside_hosp_is_read(tmp_path, mimic4):
    # MIMIC-IV before v2.0 keeps patients and admissions in a `core` module next to `hosp`.
    out, _ = mimic4
    hosp = Path(shutil.copytree(FIXTURE, tmp_path / "mimic-iv-1.0")) / "hosp"
    (hosp.parent / "core").mkdir()
    for table in ("patients.csv.gz", "admissions.csv.gz"):
        (hosp / table).rename(hosp.parent / "core" / table)
    for given in (hosp.parent, hosp):
        import_mimic4(given, tmp_path / f"from_{given.name}", seed=SEED)
        assert read_meds(tmp_path / f"from_{given.name}").equals(read_meds(out)), given
    shutil.copy(hosp.parent / "core" / "patients.csv.gz", hosp)
    with pytest.raises(InputError, match=r"table patients exists twice \(core/patients.csv.gz, "
                                         r"patients.csv.gz\): keep one of them"):
        import_mimic4(hosp.parent, tmp_path / "twice", seed=SEED)


@pytest.mark.parametrize("mode", HARMONIZATIONS)
def test_fixture_runs_end_to_end_with_every_harmonization(mode, wh_vocab, prefect_harness):
    from flows.forecast import forecast_flow
    from tasks.evaluate import evaluate_run
    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import register_dataset

    import_mimic4(FIXTURE, wh_vocab.meds_dir("mimic4fix"), seed=SEED)
    register_dataset(wh_vocab, "mimic4fix", source="mimic4")
    cohort = build_cohort(wh_vocab, "mimic4fix", mode, CohortOptions(harmonize=mode), seed=SEED)
    # S1 (three encounters with diagnoses) and S2 (two) have a history; S3 has one encounter.
    assert cohort["n_trajectories"] == 2
    for system in ("global_frequency", "repeat_history"):
        forecast_flow(str(wh_vocab.root), mode, system, split="all", k=5, run_id=f"run-{mode}")
    status = wh_vocab.read("ranking_status")
    assert status.height == 4 and set(status["status"]) == {"ok"}, status
    metrics = evaluate_run(wh_vocab, f"run-{mode}", ks=(5,), n_boot=0, natural=False)
    overall = metrics.filter((pl.col("subset") == "all") & (pl.col("metric") == "recall_at_k"))
    assert sorted(overall["system"]) == ["global_frequency", "repeat_history"] and set(overall["n"]) == {2}


def test_results_split_per_icd_version_for_a_patient_moving_from_icd9_to_icd10(tmp_path, wh_vocab, prefect_harness):
    """The docs' example of the `icd9` and `icd10` subsets: the fixture with S1's second admission coded in ICD-9,
    so S1 has two ICD-9 admissions before an ICD-10 one and `--target every` gives one ICD-9 target of three."""
    from flows.forecast import forecast_flow
    from tasks.evaluate import evaluate_run
    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import register_dataset

    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "diagnoses_icd", lambda lines: [
        line.replace("20000002,1,I5023,10", "20000002,1,4280,9").replace("20000002,2,E119,10", "20000002,2,25000,9")
        for line in lines])
    import_mimic4(hosp, wh_vocab.meds_dir("moving"), seed=SEED)
    register_dataset(wh_vocab, "moving", source="mimic4")
    n_per_subset = {}
    for mode in ("native", "icd10"):
        build_cohort(wh_vocab, "moving", mode, CohortOptions(target="every", harmonize=mode), seed=SEED)
        forecast_flow(str(wh_vocab.root), mode, "repeat_history", split="all", k=5, run_id=f"run-{mode}")
        metrics = evaluate_run(wh_vocab, f"run-{mode}", ks=(5,), n_boot=0, natural=False).filter(
            pl.col("metric") == "recall_at_k")
        by_version = metrics.filter(pl.col("subset").is_in(["all", "icd9", "icd10"]))
        n_per_subset[mode] = dict(by_version.select("subset", "n").iter_rows())
        if mode == "native":  # S1's ICD-9 target repeats its first admission's two codes
            assert metrics.filter(pl.col("subset") == "icd9")["value"].to_list() == [1.0]
    # Harmonized to ICD-10, the ICD-9 target is an ICD-10 one: no icd9 row.
    assert n_per_subset == {"native": {"all": 3, "icd9": 1, "icd10": 2}, "icd10": {"all": 3, "icd10": 3}}


def test_a_cohort_flags_the_patients_whose_age_was_capped_and_an_older_cohort_reads_null(wh_vocab):
    import pyarrow.parquet as pq

    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import register_dataset
    from warehouse.sql import run_query

    import_mimic4(FIXTURE, wh_vocab.meds_dir("mimic4fix"), seed=SEED)
    register_dataset(wh_vocab, "mimic4fix", source="mimic4")
    cohort_id = build_cohort(wh_vocab, "mimic4fix", "native", CohortOptions(), seed=SEED)["cohort_id"]
    # S2's anchor_age 91 was capped (its MEDS_BIRTH row time_imputed); S1's 42 was not. The forecasting store
    # had no flag: only the gold MEDS files told a capped 90 from a real one.
    query = "SELECT subject_id, birth_time_imputed FROM trajectories ORDER BY subject_id"
    assert run_query(wh_vocab, query, fmt="csv").splitlines() == ["subject_id,birth_time_imputed",
                                                                  f"{S1},false", f"{S2},true"]
    written = wh_vocab.partition_path("trajectories", cohort_id=cohort_id)
    pq.write_table(pq.read_table(written).drop_columns(["birth_time_imputed"]), written)  # as built before it
    assert wh_vocab.read("trajectories")["birth_time_imputed"].to_list() == [None, None]
    assert run_query(wh_vocab, query, fmt="csv").splitlines()[1:] == [f"{S1},", f"{S2},"]


# ---- bad input: one line naming the file, row or column and the fix; nothing half-written -------

def copy_fixture(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "src")) / "hosp"


def edit_table(folder: Path, name: str, edit) -> None:
    """Rewrite a fixture table (plain or gzipped) through `edit(lines) -> lines`."""
    path = next(p for p in folder.iterdir() if p.name.lower().split(".")[0] == name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as handle:
        lines = handle.read().splitlines()
    with opener(path, "wt", newline="") as handle:
        handle.write("\n".join(edit(lines)) + "\n")


def replace_on_line(index: int, old: str, new: str):
    def edit(lines):
        assert old in lines[index], (old, lines[index])
        lines[index] = lines[index].replace(old, new, 1)
        return lines
    return edit


def at_offset(offset: str, *exceptions: tuple[str, int, str]):
    """Write every time of day of every table at `offset`, except the (table, line, offset) `exceptions`."""
    def damage(hosp: Path) -> None:
        for table in ("admissions", "prescriptions", "labevents"):
            def edit(lines, table=table):
                others = {index: other for name, index, other in exceptions if name == table}
                return [re.sub(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", rf"\g<1>{others.get(index, offset)}", line)
                        for index, line in enumerate(lines)]
            edit_table(hosp, table, edit)
    return damage


BAD_INPUTS = {
    "missing table": (lambda hosp: (hosp / "admissions.csv.gz").unlink(),
                      "hosp: missing MIMIC-IV table admissions (admissions.csv or admissions.csv.gz): "
                      "add it from the official release"),
    "missing column": (lambda hosp: edit_table(hosp, "admissions", lambda lines: [
                           ",".join(c for i, c in enumerate(line.split(",")) if i != 3) for line in lines]),
                       "admissions.csv.gz: missing column 'dischtime' (columns found: subject_id, hadm_id, "
                       "admittime, deathtime,"),
    "column twice": (lambda hosp: edit_table(hosp, "diagnoses_icd", lambda lines: [
                         lines[0] + ",ICD_CODE", *(line + ",X" for line in lines[1:])]),
                     "diagnoses_icd.csv.gz: column 'icd_code' appears 2 times in the header (columns found: "
                     "subject_id, hadm_id, seq_num, icd_code, icd_version, ICD_CODE): keep one of them"),
    "renamed column": (lambda hosp: edit_table(hosp, "admissions", replace_on_line(0, "dischtime", "discharge_time")),
                       "rename 'discharge_time' back to the official name 'dischtime'"),
    "unparsable timestamp": (lambda hosp: edit_table(hosp, "admissions",
                                                     replace_on_line(3, "2153-01-01 10:00:00", "01/01/2153 10am")),
                             "admissions.csv.gz, data row 3, column 'admittime': '01/01/2153 10am' is not a "
                             "timestamp (YYYY-MM-DD HH:MM:SS): correct the value or restore the official file"),
    "unparsable timestamp (plain csv)": (lambda hosp: edit_table(hosp, "procedures_icd",
                                                                 replace_on_line(2, "2152-07-11", "2152-07-32")),
                                         "procedures_icd.csv, data row 2, column 'chartdate': '2152-07-32' is not a "
                                         "timestamp"),
    "times at mixed offsets": (at_offset("-05:00", ("admissions", 2, "-04:00")),
                               "admissions.csv.gz, data row 2, column 'admittime': '2152-07-10 09:30:00-04:00' is at "
                               "UTC offset -04:00 but admissions.csv.gz, data row 1, column 'admittime' has "
                               "'2150-03-01 08:00:00-05:00': times at mixed offsets (daylight saving, sites in several "
                               "zones) can misorder events; convert every time to one UTC offset (such as UTC itself) "
                               "or to local time without an offset"),
    "times with and without an offset": (at_offset("", ("prescriptions", 3, "+01:00")),
                                         "prescriptions.csv, data row 3, column 'starttime': "
                                         "'2163-05-01 06:00:00+01:00' is at UTC offset +01:00 but admissions.csv.gz, "
                                         "data row 1, column 'admittime' has '2150-03-01 08:00:00': times at mixed "
                                         "offsets"),
    "time zone with daylight saving": (at_offset(" America/New_York"),
                                       "admissions.csv.gz, data row 1, column 'admittime': '2150-03-01 08:00:00 "
                                       "America/New_York' names the time zone 'America/New_York', whose UTC offset "
                                       "changes from -05:00 to -04:00 on 2150-03-08, within the data's times "
                                       "(2150-03-01 to 2171-01-11): times at mixed offsets (daylight saving) can "
                                       "misorder events; convert every time to one UTC offset"),
    "unknown time zone": (at_offset(" Mars/Olympus_Mons"),
                          "admissions.csv.gz, data row 1, column 'admittime': '2150-03-01 08:00:00 Mars/Olympus_Mons' "
                          "names the time zone 'Mars/Olympus_Mons', which the time zone database does not know: write "
                          "a zone name it has (such as Asia/Tokyo) or convert every time to one UTC offset"),
    "time zone at another offset": (at_offset("+05:30", ("prescriptions", 2, " Asia/Tokyo")),
                                    "prescriptions.csv, data row 2, column 'starttime': '2150-03-01 10:00:00 "
                                    "Asia/Tokyo' is at UTC offset +09:00 but admissions.csv.gz, data row 1, column "
                                    "'admittime' has '2150-03-01 08:00:00+05:30': times at mixed offsets"),
    "non-integer id": (lambda hosp: edit_table(hosp, "diagnoses_icd", replace_on_line(5, "20000003", "2000000x")),
                       "diagnoses_icd.csv.gz, data row 5, column 'hadm_id': '2000000x' is not an integer"),
    "empty admittime": (lambda hosp: edit_table(hosp, "admissions", replace_on_line(2, "2152-07-10 09:30:00", "")),
                        "admissions.csv.gz, data row 2: column 'admittime' is empty: every admissions row "
                        "needs a value there"),
    "unknown ICD version": (lambda hosp: edit_table(hosp, "diagnoses_icd", replace_on_line(8, "J189,10", "J189,11")),
                            "diagnoses_icd.csv.gz, data row 8, column 'icd_version': 11 is not 9 or 10"),
    "duplicate admission": (lambda hosp: edit_table(hosp, "admissions", lambda lines: lines + [lines[1]]),
                            "admissions.csv.gz: hadm_id 20000001 appears on several data rows (1, 8): "
                            "each admission must appear once"),
    "no diagnoses": (lambda hosp: edit_table(hosp, "diagnoses_icd", lambda lines: lines[:1]),
                     "diagnoses_icd.csv.gz: a header but no data rows: MIMIC-IV needs the diagnoses_icd rows; "
                     "restore the file from the official release"),
    "no diagnosis of a known admission": (lambda hosp: edit_table(hosp, "diagnoses_icd", lambda lines: [
                                              lines[0], *(line.replace(",2000000", ",3000000") for line in lines[1:])]),
                                          "diagnoses_icd.csv.gz: no diagnosis row belongs to an admission in "
                                          "admissions.csv.gz: forecasting needs diagnoses"),
    "header only": (lambda hosp: edit_table(hosp, "patients", lambda lines: lines[:1]),
                    "patients.csv.gz: a header but no data rows: MIMIC-IV needs the patients rows"),
    "empty file": (lambda hosp: (hosp / "admissions.csv.gz").write_bytes(b""),
                   "admissions.csv.gz: the file is empty: restore admissions from the official MIMIC-IV release"),
    "row with an extra field": (lambda hosp: edit_table(hosp, "diagnoses_icd", replace_on_line(5, ",I10,", ",I10,X,")),
                                "diagnoses_icd.csv.gz, data row 5: malformed CSV (6 fields where the header has 5): "
                                "fix the row or re-download the file"),
    "row with a missing field": (lambda hosp: edit_table(hosp, "procedures_icd", replace_on_line(2, ",02HV33Z", "")),
                                 "procedures_icd.csv, data row 2: malformed CSV (5 fields where the header has 6)"),
    "unterminated quote": (lambda hosp: edit_table(hosp, "procedures_icd",
                                                   replace_on_line(2, "10000001,2", '10000001,"2')),
                           'procedures_icd.csv, data row 2: malformed CSV (a quote (") opens a value that never '
                           'closes): fix the row or re-download the file'),
    "not UTF-8": (lambda hosp: (hosp / "prescriptions.csv").write_bytes(
                      (hosp / "prescriptions.csv").read_bytes().replace(b"Omeprazole", "Omépr".encode("latin-1"))),
                  "prescriptions.csv, data row 4: malformed CSV (text that is not UTF-8, as when the file was saved "
                  "in another encoding such as Latin-1): fix the row or re-download the file"),
    # DuckDB refused these with "The CSV Parser state machine reached an invalid state", naming no line.
    "line endings converted twice": (lambda hosp: edit_table(hosp, "diagnoses_icd", lambda lines: [
                                         line + "\r\r" if index >= 6 else line for index, line in enumerate(lines)]),
                                     "diagnoses_icd.csv.gz, data row 6: malformed CSV (the line ends in \\r\\r\\n, a "
                                     "carriage return too many, as when Windows line endings are converted twice): end "
                                     "every line with \\n or \\r\\n, e.g. gunzip it, then sed -i 's/\\r*$//' "),
    "every line ending converted twice": (lambda hosp: edit_table(hosp, "procedures_icd", lambda lines: [
                                              line + "\r\r" for line in lines]),
                                          "procedures_icd.csv, the header: malformed CSV (the line ends in \\r\\r\\n"),
    "semicolon separated": (lambda hosp: edit_table(hosp, "patients", lambda lines: [
                                line.replace(",", ";") for line in lines]),
                            "patients.csv.gz: the columns are separated by ';', not by commas: use the official "
                            "comma-separated file"),
    "truncated gzip": (lambda hosp: (hosp / "diagnoses_icd.csv.gz").write_bytes(
                           gzip.compress(b"subject_id,hadm_id,seq_num,icd_code,icd_version\n" * 2000)[:200]),
                       "diagnoses_icd.csv.gz: malformed CSV (the gzip data ends early, as after an incomplete "
                       "download or copy): re-download the file"),
    "duplicate patient": (lambda hosp: edit_table(hosp, "patients", lambda lines: lines + [lines[1]]),
                          "patients.csv.gz: subject_id 10000001 appears on several data rows (1, 5): "
                          "each patient must appear once"),
    "diagnosis of another patient's admission": (
        lambda hosp: edit_table(hosp, "diagnoses_icd", replace_on_line(5, "10000001,20000003", "10000002,20000003")),
        "diagnoses_icd.csv.gz, data row 5: subject_id 10000002 but hadm_id 20000003 is an admission of subject_id "
        "10000001 in admissions.csv.gz: use files of one release, unedited"),
    "prescription of another patient's admission": (
        lambda hosp: edit_table(hosp, "prescriptions", replace_on_line(3, "10000002,20000005", "10000003,20000005")),
        "prescriptions.csv, data row 3: subject_id 10000003 but hadm_id 20000005 is an admission of subject_id "
        "10000002"),
    "both csv and csv.gz": (lambda hosp: shutil.copy(hosp / "procedures_icd.csv", hosp / "PROCEDURES_ICD.csv.gz"),
                            "table procedures_icd exists twice (PROCEDURES_ICD.csv.gz, procedures_icd.csv): "
                            "keep one of them"),
}


@pytest.fixture
def previous_import(tmp_path):
    """A complete earlier import at the output path: a failed import must leave it untouched."""
    out = tmp_path / "out" / "meds"
    import_mimic4(FIXTURE, out, seed=SEED)
    return out, read_meds(out)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_naming_the_problem_and_nothing_changes(case, tmp_path, previous_import):
    out, before = previous_import
    hosp = copy_fixture(tmp_path)
    damage, message = BAD_INPUTS[case]
    damage(hosp)
    with pytest.raises(InputError) as raised:
        import_mimic4(hosp.parent, out, seed=SEED)
    text = str(raised.value)
    assert message in text and "\n" not in text, text
    assert read_meds(out).equals(before)
    assert sorted(p.name for p in out.parent.iterdir()) == ["meds"]  # no staging or work directory left


def test_wrong_directories(tmp_path):
    with pytest.raises(InputError, match="MIMIC-IV directory .*nope does not exist: check the path"):
        import_mimic4(tmp_path / "nope", tmp_path / "out", seed=SEED)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="notes.txt is a file: pass the MIMIC-IV directory"):
        import_mimic4(tmp_path / "notes.txt", tmp_path / "out", seed=SEED)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"empty is not a MIMIC-III directory: none of patients, admissions, "
                                         r"diagnoses_icd \(.csv or .csv.gz\) is there"):
        import_mimic3(tmp_path / "empty", tmp_path / "out", seed=SEED)
    assert not (tmp_path / "out").exists()


def test_a_mimic4_release_root_given_to_the_mimic3_importer_says_which_command_to_use(tmp_path):
    with pytest.raises(InputError) as raised:
        import_mimic3(FIXTURE, tmp_path / "out", seed=SEED)
    assert str(raised.value) == (f"{FIXTURE} looks like a MIMIC-IV directory (hosp/ holds the tables): "
                                 "use `dxr ingest mimic4`")


def test_a_deleted_column_is_not_offered_an_unused_official_column_as_its_rename(tmp_path):
    hosp = copy_fixture(tmp_path)
    # Without dischtime the closest remaining names are official columns the importer ignores (edouttime, …).
    edit_table(hosp, "admissions", lambda lines: [
        ",".join(c for i, c in enumerate(line.split(",")) if i != 3) for line in lines])
    with pytest.raises(InputError) as raised:
        import_mimic4(hosp, tmp_path / "out", seed=SEED)
    text = str(raised.value)
    assert "rename" not in text, text
    assert text.endswith("MIMIC-IV admissions needs subject_id, hadm_id, admittime, dischtime, deathtime, "
                         "admission_type, discharge_location; restore the official file"), text


def test_admissions_without_edregtime_are_read_and_then_only_the_hospital_stay_claims_labs(tmp_path):
    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "admissions", lambda lines: [  # a trimmed export: no ED registration time
        ",".join(c for i, c in enumerate(line.split(",")) if i != 13) for line in lines])
    summary = import_mimic4(hosp, tmp_path / "out", seed=SEED, labs=True)
    ed_draw = read_meds(tmp_path / "out").filter(pl.col("time") == ts("2150-03-01 07:00"))
    assert ed_draw.select("code", "encounter_id").rows() == [("LAB//Creatinine (Blood)//mg/dL", None)]
    assert (summary.n_labs_outside_admissions, summary.n_labs_within_stays) == (2, 0)


def test_a_prescription_without_hadm_id_belongs_to_the_admission_whose_stay_holds_it(tmp_path):
    # Left outside any encounter, an order given in the ED before admission 20000001 (edregtime 06:10, admittime
    # 08:00) sat before that admission's cutoff, in the pre-target record of the very admission it belongs to.
    hosp = copy_fixture(tmp_path)
    order = "10000001,,1009,10000001-19,19,P00001,{start},,MAIN,{drug},,,,,,1,g,1,VIAL,1,IV"
    edit_table(hosp, "prescriptions", lambda lines: lines + [
        order.format(start="2150-03-01 07:30:00", drug="Ceftriaxone"),  # in the ED, before admittime
        order.format(start="2150-03-04 12:00:00", drug="Ondansetron"),  # during the hospital stay
        order.format(start="2151-06-01 09:00:00", drug="Aspirin")])  # outside any stay: no encounter
    summary = import_mimic4(hosp, tmp_path / "meds", seed=SEED)
    orders = read_meds(tmp_path / "meds").filter(
        pl.col("code").is_in(["MEDICATION//NAME//ceftriaxone", "MEDICATION//NAME//ondansetron",
                              "MEDICATION//NAME//aspirin"]))
    assert orders.select("time", "code", "encounter_id", "time_imputed").rows() == [
        (ts("2150-03-01 07:30"), "MEDICATION//NAME//ceftriaxone", 20000001, False),
        (ts("2150-03-04 12:00"), "MEDICATION//NAME//ondansetron", 20000001, False),
        (ts("2151-06-01 09:00"), "MEDICATION//NAME//aspirin", None, False)]
    assert (summary.n_medications, summary.n_medications_within_stays) == (7, 2)
    [line] = [line for line in summary.table().splitlines() if "within an admission's ED" in line]
    assert line.split()[-1] == "2", line


def test_an_order_in_two_stays_admitted_at_one_time_goes_to_the_larger_hadm_id(tmp_path):
    # The latest admitted stay claims an untagged order; between two admitted at the same second the pick was
    # whichever DuckDB's aggregate met last.
    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "admissions", lambda lines: lines + [
        "10000001,20000009,2150-03-01 08:00:00,2150-03-04 14:00:00,,EW EMER.,P00001,EMERGENCY ROOM,HOME,Medicare,"
        "ENGLISH,MARRIED,WHITE,,,0"])
    order = "10000001,,1009,10000001-19,19,P00001,2150-03-02 10:00:00,,MAIN,Ceftriaxone,,,,,,1,g,1,VIAL,1,IV"
    edit_table(hosp, "prescriptions", lambda lines: lines + [order])
    import_mimic4(hosp, tmp_path / "meds", seed=SEED)
    ceftriaxone = read_meds(tmp_path / "meds").filter(pl.col("code") == "MEDICATION//NAME//ceftriaxone")
    assert ceftriaxone["encounter_id"].to_list() == [20000009]


def test_mimic3_files_given_to_the_mimic4_importer_say_which_command_to_use(tmp_path):
    src = shared_data("mimic-iii-demo")
    with pytest.raises(InputError, match=r"PATIENTS.csv: missing column 'anchor_age' .*: this file has the "
                                         r"MIMIC-III layout; use `dxr ingest mimic3`"):
        import_mimic4(src, tmp_path / "out", seed=SEED)


def test_a_discharge_before_the_admission_is_kept_as_recorded_and_counted(tmp_path):
    # Real MIMIC-III has a few such admissions (deaths, organ donors): rejecting them would refuse the release.
    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "admissions", replace_on_line(1, "2150-03-05 14:00:00", "2150-02-25 14:00:00"))
    summary = import_mimic4(hosp, tmp_path / "meds", seed=SEED)
    assert summary.n_admissions_discharged_before_admitted == 1
    [line] = [line for line in summary.table().splitlines() if "dischtime before admittime" in line]
    assert line.split()[-1] == "1", line
    dx = read_meds(tmp_path / "meds").filter(pl.col("code").str.starts_with("DIAGNOSIS//")
                                             & (pl.col("encounter_id") == 20000001))
    assert dx["time"].to_list() == [ts("2150-02-25 14:00")] * 2


def test_rows_that_cannot_become_events_are_dropped_and_counted_by_reason(tmp_path):
    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "diagnoses_icd", replace_on_line(2, ",25000,", ",,"))
    edit_table(hosp, "procedures_icd", replace_on_line(1, "10000001,20000001", "10000001,29999999"))
    edit_table(hosp, "procedures_icd", replace_on_line(2, ",02HV33Z,", ",,"))
    edit_table(hosp, "prescriptions", replace_on_line(1, "10000001,20000001", "10000001,29999999"))
    edit_table(hosp, "prescriptions", replace_on_line(2, ",20000001,1002,", ",,1002,"))  # no admission …
    edit_table(hosp, "prescriptions", replace_on_line(2, ",2150-03-01 10:00:00,", ",,"))  # … and no start time
    edit_table(hosp, "prescriptions", replace_on_line(4, ",Omeprazole,", ",,"))
    summary = import_mimic4(hosp, tmp_path / "meds", seed=SEED)
    drops = {"n_diagnosis_rows_without_code": 1, "n_procedure_rows_without_admission": 1,
             "n_procedure_rows_without_code": 1, "n_prescription_rows_without_admission": 1,
             "n_prescription_rows_without_time": 1, "n_prescription_rows_without_drug": 1}
    assert {name: getattr(summary, name) for name in drops} == drops
    assert (summary.n_procedures, summary.n_medications) == (1, 1)
    recorded = json.loads((tmp_path / "meds" / "metadata" / "dataset.json").read_text())["import_summary"]
    assert {name: recorded[name] for name in drops} == drops
    table = summary.table()
    for label in ("dropped (rows without a code)", "dropped (rows whose admission is not in admissions)",
                  "dropped (rows without a start time or admission)", "dropped (rows without an NDC or drug name)"):
        counts = [line.split()[-1] for line in table.splitlines() if label in line]
        assert counts and set(counts) == {"1"}, (label, table)
    # The emptied code is not among the rows counted above it: "diagnosis rows read 12" beside "dropped (rows
    # without a code) 1" read as 12 rows read, 11 of them kept.
    [line] = [line for line in table.splitlines() if line.startswith("diagnosis rows")]
    assert line.split() == ["diagnosis", "rows", "with", "a", "code", "12"], table
    events = read_meds(tmp_path / "meds")
    assert 29999999 not in events["encounter_id"].to_list()


def test_a_trailing_comma_and_a_quoted_header_name_are_read(tmp_path, mimic4):
    # Both broke the column list given to DuckDB: "malformed CSV (Binder Error: …): re-download the file".
    out, _ = mimic4
    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "diagnoses_icd", lambda lines: [line + "," for line in lines])
    edit_table(hosp, "admissions", lambda lines: [lines[0] + ',"note ""a"""', *(line + ",x" for line in lines[1:])])
    import_mimic4(hosp.parent, tmp_path / "meds", seed=SEED)
    assert read_meds(tmp_path / "meds").equals(read_meds(out))


def test_header_case_and_padding_are_ignored(tmp_path, mimic4):
    # A header exported as "subject_id, hadm_id, …" was refused as missing 'hadm_id' (columns found: … hadm_id …).
    out, _ = mimic4
    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "diagnoses_icd", lambda lines: [lines[0].upper(), *lines[1:]])
    edit_table(hosp, "admissions", lambda lines: [lines[0].title(), *lines[1:]])
    edit_table(hosp, "patients", lambda lines: [lines[0].replace(",", " , "), *lines[1:]])
    import_mimic4(hosp, tmp_path / "meds", seed=SEED)
    assert read_meds(tmp_path / "meds").equals(read_meds(out))


# ---- CLI ---------------------------------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)


def test_cli_ingest_mimic4_registers_the_dataset_and_its_run(tmp_path):
    from warehouse.store import Warehouse

    result = run("--data-dir", tmp_path / "wh", "ingest", "mimic4", FIXTURE, "--name", "fixture", "--run-id", "ing-4")
    assert result.exit_code == 0, result.output
    assert "encounters (admissions with ≥ 1 diagnosis)" in result.output
    assert result.output.strip().endswith("dataset fixture: 4 patients, 41 events, ICD versions 9,10")
    wh = Warehouse(tmp_path / "wh")
    row = wh.read("datasets").row(0, named=True)
    assert (row["dataset_id"], row["source"], row["n_events"]) == ("fixture", "mimic4", 41)
    assert (row["time_zone"], row["utc_offset"]) == ("", "")
    assert wh.read("runs").select("run_id", "kind", "status").rows() == [("ing-4", "ingest:mimic4", "finished")]
    hosp = copy_fixture(tmp_path)
    at_offset(" Asia/Kolkata", ("labevents", 1, "+05:30"))(hosp)
    assert run("--data-dir", tmp_path / "wh", "ingest", "mimic4", hosp.parent, "--name", "kolkata").exit_code == 0
    row = wh.read("datasets", dataset_id="kolkata").row(0, named=True)
    assert (row["time_zone"], row["utc_offset"]) == ("Asia/Kolkata", "+05:30")  # without --labs: no labevents' +05:30


def test_cli_mimic_imports_print_the_ingest_notes_of_what_the_release_holds_and_the_demo_none(tmp_path):
    # `dxr ingest meds` printed a note for an event at a placeholder date; the MIMIC importers computed the same
    # count and printed nothing.
    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "prescriptions", replace_on_line(1, ",2150-03-01 09:00:00,", ",2999-12-31 00:00:00,"))
    result = run("--data-dir", tmp_path / "wh", "ingest", "mimic4", hosp, "--name", "placeholder")
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines() if line.startswith("note:")] == [
        "note: 1 event is dated before 1800 or in 2300 or later (e.g. data/train/0.parquet, row 16: subject 10000001, "
        "MEDICATION//NDC//00517570425 at 2999-12-31 00:00:00): taken as dated, such an event precedes every cutoff "
        "of its patient or follows them all (an admission so dated makes the patient's last encounter, the target of "
        "--target final); a placeholder date? correct it in the export"]
    # The official files give none: the demo's births of patients over 89, moved before 1800 by MIMIC-III and
    # capped by the import, and its shifted years stay quiet.
    result = run("--data-dir", tmp_path / "wh", "ingest", "mimic3", shared_data("mimic-iii-demo"), "--name", "demo")
    assert result.exit_code == 0, result.output
    assert "note:" not in result.stdout


def test_cli_bad_input_is_one_line_and_registers_nothing(tmp_path):
    from warehouse.store import Warehouse

    hosp = copy_fixture(tmp_path)
    (hosp / "diagnoses_icd.csv.gz").unlink()
    result = run("--data-dir", tmp_path / "wh", "ingest", "mimic4", hosp, "--name", "broken", "--run-id", "ing-5")
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"Error: {hosp}: missing MIMIC-IV table diagnoses_icd (diagnoses_icd.csv or "
                     "diagnoses_icd.csv.gz): add it from the official release"]
    assert not (tmp_path / "wh" / "gold" / "meds" / "broken").exists()
    assert not (tmp_path / "wh" / "forecast" / "datasets").exists()
    assert Warehouse(tmp_path / "wh").read("runs").select("run_id", "status").rows() == [("ing-5", "failed")]


def test_one_release_imported_from_two_paths_into_two_warehouses_gets_one_fingerprint_and_cohort_id(
        tmp_path, wh_vocab):
    # Two teams with the same release and options: one imports it where it was unpacked, the other a copy elsewhere,
    # each into a warehouse of its own. dataset.json records both paths; the fingerprint, and so the cohort id that
    # hashes it, must not depend on them.
    from warehouse.store import Warehouse

    other = Warehouse(tmp_path / "other")
    for table in ("icd_codes", "icd_notes", "gem_map"):
        if wh_vocab.table_dir(table).exists():
            shutil.copytree(wh_vocab.table_dir(table), other.table_dir(table))
    copy = shutil.copytree(FIXTURE, tmp_path / "elsewhere" / "mimic-iv")
    fingerprints, cohort_ids, paths = [], [], []
    for wh, release in ((wh_vocab, FIXTURE), (other, copy)):
        assert run("--data-dir", wh.root, "ingest", "mimic4", release, "--name", "mimic4").exit_code == 0
        assert run("--data-dir", wh.root, "cohort", "build", "--dataset", "mimic4", "--name", "m4").exit_code == 0
        fingerprints.append(wh.read("datasets")["fingerprint"].to_list())
        cohort_ids.append(wh.read("cohorts")["cohort_id"].to_list())
        metadata = json.loads((wh.meds_dir("mimic4") / "metadata" / "dataset.json").read_text())
        paths.append((metadata["source_dir"], metadata["import_summary"]["out_dir"]))
    assert paths[0][0] != paths[1][0] and paths[0][1] != paths[1][1]  # recorded, as provenance
    assert fingerprints[0] == fingerprints[1] and len(fingerprints[0]) == 1
    assert cohort_ids[0] == cohort_ids[1] and len(cohort_ids[0]) == 1


def test_rerun_removes_the_scratch_of_a_killed_import(tmp_path, previous_import):
    out, before = previous_import
    for kind in ("staging", "work"):  # what SIGKILL (e.g. the OOM killer) mid-import leaves behind
        (abandoned_scratch(out, kind) / "spill").mkdir(parents=True)
    import_mimic4(FIXTURE, out, seed=SEED)
    assert sorted(p.name for p in out.parent.iterdir()) == ["meds"]
    assert read_meds(out).equals(before)


def test_running_out_of_duckdb_memory_says_so_and_how_to_raise_the_limit(tmp_path, previous_import):
    # The gzip reader alone needs a 30.5 MiB block, so 1MB fails on the first table. It was reported as a
    # malformed patients.csv.gz to re-download, and past the read as a DuckDB traceback.
    out, before = previous_import
    with pytest.raises(ConfigError) as raised:
        import_mimic4(FIXTURE, out, seed=SEED, memory_limit="1MB")
    # DuckDB's own sentence says how much it holds, which depends on its threads.
    assert re.fullmatch(re.escape(f"MIMIC-IV import of {FIXTURE}: DuckDB ran out of memory within its limit of 1MB ")
                        + r"\(Out of Memory Error: could not allocate block of size 30\.5 MiB \([^()\n]+ used\)\)"
                        + re.escape(": rerun with a larger memory limit (`--memory-limit`, e.g. 8GB) that the machine "
                                    "has free"), str(raised.value)), str(raised.value)
    assert read_meds(out).equals(before)
    assert sorted(p.name for p in out.parent.iterdir()) == ["meds"]


def test_cli_memory_limit_reaches_the_import_and_a_bad_one_is_one_line(tmp_path):
    from warehouse.store import Warehouse

    result = run("--data-dir", tmp_path / "wh", "ingest", "mimic4", FIXTURE, "--name", "small", "--memory-limit", "1MB",
                 "--run-id", "ing-6")
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: MIMIC-IV import of {FIXTURE}: DuckDB ran out of memory "
                                                   "within its limit of 1MB"), lines
    assert not (tmp_path / "wh" / "forecast" / "datasets").exists()
    assert Warehouse(tmp_path / "wh").read("runs").select("run_id", "status").rows() == [("ing-6", "failed")]
    result = run("--data-dir", tmp_path / "wh", "ingest", "mimic3", FIXTURE, "--memory-limit", "lots")
    assert result.exit_code == 2
    assert [line for line in result.output.splitlines() if line.strip()] == [
        "Error: Invalid value for '--memory-limit': 'lots' is not a size such as 2GB or 512MB "
        "(usage: main ingest mimic3 -h)"], result.output
    result = run("--data-dir", tmp_path / "wh", "ingest", "mimic4", FIXTURE, "--name", "roomy",
                 "--memory-limit", "512MB")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("error", disk_full_errors(), ids=["enospc", "spill_cap"])
@pytest.mark.parametrize("marker", ["read_csv(", "CREATE TABLE subject_shards"])
def test_a_full_disk_during_import_says_so_and_where(tmp_path, previous_import, monkeypatch, marker, error):
    # A full disk during the CSV read was reported as a malformed patients.csv.gz to re-download, past the read as a
    # DuckDB traceback (ENOSPC) or as too little memory (DuckDB's spill cap, which follows the free disk space).
    from warehouse import duck

    out, before = previous_import
    connect = duck.connect
    monkeypatch.setattr(duck, "connect", lambda database: FailsAt(connect(database), marker, error))
    with pytest.raises(ConfigError) as raised:
        import_mimic4(FIXTURE, out, seed=SEED)
    assert str(raised.value) == (
        f"MIMIC-IV import of {FIXTURE}: out of disk space in {out.parent}: free disk space there, or point --data-dir "
        "(DXR_DATA_DIR) to a disk with room")
    assert read_meds(out).equals(before)
    assert sorted(p.name for p in out.parent.iterdir()) == ["meds"]


def test_cli_full_disk_during_import_is_one_line(tmp_path, monkeypatch):
    from warehouse import duck
    from warehouse.store import Warehouse

    connect = duck.connect
    monkeypatch.setattr(duck, "connect", lambda database: FailsAt(connect(database), "read_csv(",
                                                                      disk_full_errors()[0]))
    result = run("--data-dir", tmp_path / "wh", "ingest", "mimic4", FIXTURE, "--name", "full", "--run-id", "ing-9")
    assert result.exit_code == 1
    assert [line for line in result.output.splitlines() if line.strip()] == [
        f"Error: MIMIC-IV import of {FIXTURE}: out of disk space in {tmp_path / 'wh' / 'gold' / 'meds'}: free disk "
        "space there, or point --data-dir (DXR_DATA_DIR) to a disk with room"]
    assert Warehouse(tmp_path / "wh").read("runs").select("run_id", "status").rows() == [("ing-9", "failed")]


def test_a_lab_unit_holding_the_code_separator_is_escaped_like_a_label(tmp_path):
    # A unit written 'mg//dL' would otherwise make the code LAB//Creatinine (Blood)//mg//dL: four parts, read as
    # the item 'Creatinine (Blood) mg' with the unit 'dL'.
    hosp = copy_fixture(tmp_path)
    edit_table(hosp, "labevents", replace_on_line(8, ",mg/dL,", ",mg//dL,"))
    import_mimic4(hosp.parent, tmp_path / "meds", seed=SEED, labs=True)
    codes = read_meds(tmp_path / "meds").filter(pl.col("subject_id") == 10000001, pl.col("numeric_value") == 1.3)
    assert codes["code"].to_list() == ["LAB//Creatinine (Blood)//mg/dL"]


def test_a_named_time_zone_at_one_utc_offset_over_the_data_is_imported_at_the_wall_clock_time_it_shows(tmp_path):
    # Asia/Kolkata has been at +05:30 since 1945; a time written at that offset is at the same one.
    hosp = copy_fixture(tmp_path)
    at_offset(" Asia/Kolkata", ("labevents", 1, "+05:30"))(hosp)
    summary = import_mimic4(hosp.parent, tmp_path / "kolkata", seed=SEED, labs=True)
    assert (summary.time_zone, summary.utc_offset) == ("Asia/Kolkata, +05:30", "+05:30")
    [line] = [line for line in summary.table().splitlines() if line.startswith("time zone")]
    assert line.split("  ")[-1].strip() == "Asia/Kolkata, +05:30 (UTC+05:30)"
    recorded = json.loads((tmp_path / "kolkata" / "metadata" / "dataset.json").read_text())["import_summary"]
    assert (recorded["time_zone"], recorded["utc_offset"]) == ("Asia/Kolkata, +05:30", "+05:30")
    plain = import_mimic4(FIXTURE, tmp_path / "plain", seed=SEED, labs=True)
    assert read_meds(tmp_path / "kolkata").equals(read_meds(tmp_path / "plain"))
    assert (plain.time_zone, plain.utc_offset) == ("", "")
    assert "none written" in [line for line in plain.table().splitlines() if line.startswith("time zone")][0]


def test_times_at_one_utc_offset_are_imported_at_the_wall_clock_time_they_show(tmp_path):
    # A single-zone export writing its offset: the times order the events as they are, so the offset is dropped.
    hosp = copy_fixture(tmp_path)
    at_offset("-05:00")(hosp)
    edit_table(hosp, "labevents", replace_on_line(1, "09:30:00-05:00", "14:30:00Z"))  # 09:30 at -05:00 is 14:30 UTC
    with pytest.raises(InputError, match=r"'2150-03-01 14:30:00Z' is at UTC offset \+00:00 but admissions.csv.gz"):
        import_mimic4(hosp.parent, tmp_path / "mixed", seed=SEED, labs=True)
    edit_table(hosp, "labevents", replace_on_line(1, "14:30:00Z", "09:30:00-0500"))  # the same offset, spelled apart
    import_mimic4(hosp.parent, tmp_path / "offset", seed=SEED, labs=True)
    import_mimic4(FIXTURE, tmp_path / "plain", seed=SEED, labs=True)
    assert read_meds(tmp_path / "offset").equals(read_meds(tmp_path / "plain"))
