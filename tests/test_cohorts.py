"""Cohort building on a hand-written MEDS dataset: exact trajectories, targets and pre-target views."""

from __future__ import annotations

import datetime as dt
import re

import polars as pl
import pytest

from dxr.errors import InputError
from tests.conftest import (DESCRIPTIONS, FUROSEMIDE, OUT_OF_MEMORY, FailsAt, abandoned_scratch, cli,
                            cut_cohort_builds_short, disk_full_errors, dx, t, tiny_events, write_described_meds,
                            write_tiny_meds)
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import ingest_meds


@pytest.fixture
def tiny_cohort(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    row = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)
    return wh_vocab, row


def test_final_target_trajectories_and_targets(tiny_cohort):
    wh, row = tiny_cohort
    cid = row["cohort_id"]
    trajectories = wh.read("trajectories", cohort_id=cid).sort("subject_id")
    assert trajectories.select("trajectory_id", "subject_id", "target_encounter_id", "cutoff_time", "split",
                               "n_prior_encounters").rows() == [
        (f"{cid}:1:103", 1, 103, t(20), "held_out", 2),
        (f"{cid}:2:202", 2, 202, t(5), "train", 1),
        (f"{cid}:4:403", 4, 403, t(8), "held_out", 1),
    ]
    targets = wh.read("targets", cohort_id=cid).sort("trajectory_id", "code")
    assert targets.select("trajectory_id", "code").rows() == [
        (f"{cid}:1:103", dx("E119")), (f"{cid}:1:103", dx("I5023")), (f"{cid}:1:103", dx("J189")),
        (f"{cid}:2:202", dx("I10")), (f"{cid}:2:202", dx("J189")),
        (f"{cid}:4:403", dx("J441")), (f"{cid}:4:403", dx("J449")),
    ]
    assert row["n_trajectories"] == 3
    assert row["vocabulary_source"] == "official_billable_icd10"


def test_pretarget_view_excludes_the_target_encounter_even_when_timestamped_earlier(tiny_cohort):
    wh, row = tiny_cohort
    cid = row["cohort_id"]
    pretarget = wh.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")
    assert set(pretarget["encounter_id"].drop_nulls().to_list()) == {101, 102}
    assert "LAB//BNP//pg/mL" not in pretarget["code"].to_list()  # enc 103's lab at day 19, before the cutoff
    assert pretarget.filter(pl.col("time").is_null())["code"].to_list() == ["GENDER//F"]
    assert pretarget["time"].drop_nulls().max() < t(20)
    # An encounter without diagnoses is not counted but its events remain history.
    subject4 = wh.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:4:403")
    assert set(subject4["encounter_id"].drop_nulls().to_list()) == {401, 402}


def test_untagged_events_in_the_target_encounters_own_span_before_its_admission_are_not_history(wh_vocab, tmp_path):
    # Subject 1's final encounter (103, admitted on day 20) starts with an emergency-department registration at
    # day 19, 18:00; a troponin drawn there at 20:00 was exported without an encounter. An untagged lab before
    # that registration is outpatient history and stays.
    extra = pl.DataFrame({"subject_id": [1, 1, 1], "time": [t(19, 18), t(19, 20), t(18)],
                          "code": ["ED_REGISTRATION", "LAB//TROPONIN T//ng/mL", "LAB//CREATININE//mg/dL"],
                          "numeric_value": [None, 0.9, 1.1], "text_value": None, "encounter_id": [103, None, None]},
                         schema=tiny_events().schema)
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "ed", pl.concat([tiny_events(), extra])), "ed")
    cid = build_cohort(wh_vocab, "ed", "default", CohortOptions(), seed=7)["cohort_id"]
    codes = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")["code"]
    assert "LAB//TROPONIN T//ng/mL" not in codes and "ED_REGISTRATION" not in codes
    assert "LAB//CREATININE//mg/dL" in codes


def test_an_untagged_emergency_visit_that_led_into_the_target_admission_is_not_history(wh_vocab, tmp_path):
    # MEDS-Extract's MIMIC-IV ETL writes an admission's ED_REGISTRATION (edregtime) and ED_OUT (edouttime)
    # without its hadm_id, and the ED draws before the admission carry none either. Subject 1 registers at the
    # ED at day 19, 08:00, has a troponin drawn at 09:00 and leaves the ED at day 20, 01:00, after encounter
    # 103 began (its first own event, a BNP, is at day 19, 12:00): the ED visit led into 103 and is its own.
    # An ED visit at day 15 that ended the same morning is history, and so is the registration at day 9, 20:00
    # that led into encounter 102 (no ED_OUT recorded): it cannot stretch over 102 to claim the lab of day 16.
    creatinine = "LAB//CREATININE//mg/dL"
    rows = [(t(9, 20), "ED_REGISTRATION", None), (t(15), "ED_REGISTRATION", None), (t(15, 2), creatinine, 1.1),
            (t(15, 4), "ED_OUT", None), (t(16), creatinine, 1.3), (t(19, 8), "ED_REGISTRATION", None),
            (t(19, 9), "LAB//TROPONIN T//ng/mL", 0.9), (t(20, 1), "ED_OUT", None)]
    extra = pl.DataFrame({"subject_id": 1, "time": [r[0] for r in rows], "code": [r[1] for r in rows],
                          "numeric_value": [r[2] for r in rows], "text_value": None, "encounter_id": None},
                         schema=tiny_events().schema)
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "ed", pl.concat([tiny_events(), extra])), "ed")
    cid = build_cohort(wh_vocab, "ed", "default", CohortOptions(), seed=7)["cohort_id"]
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")
    untagged = pretarget.filter(pl.col("encounter_id").is_null() & pl.col("time").is_not_null())
    assert untagged.sort("time").select("time", "code").rows() == [
        (dt.datetime(1950, 1, 1), "MEDS_BIRTH"), (t(9, 20), "ED_REGISTRATION"), (t(15), "ED_REGISTRATION"),
        (t(15, 2), creatinine), (t(15, 4), "ED_OUT"), (t(16), creatinine)]


def test_a_date_only_death_on_the_target_admissions_day_is_not_history(wh_vocab, tmp_path):
    # Subject 1 is admitted (encounter 103) on day 20 at 14:00 and dies there that evening; the export knows only the
    # date of death, so MEDS_DEATH (no encounter, as MEDS-Extract writes it from patients.dod) sits at midnight,
    # before the cutoff and before the encounter's first own event. No later encounter can follow a death, so a
    # death before a cutoff is this one: it would tell every forecaster how the target encounter ends.
    events = tiny_events().filter((pl.col("encounter_id") != 103).fill_null(True))
    died = pl.DataFrame({"subject_id": 1, "time": [t(20, 14), t(20, 16), t(20, 22), t(20, 22), t(20)],
                         "code": ["HOSPITAL_ADMISSION//EMERGENCY", "LAB//HBA1C//%", dx("I5023"),
                                  "HOSPITAL_DISCHARGE//DIED", "MEDS_DEATH"],
                         "numeric_value": [None, 7.5, None, None, None], "text_value": None,
                         "encounter_id": [103, 103, 103, 103, None]}, schema=events.schema)
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "died", pl.concat([events, died])), "died")
    cid = build_cohort(wh_vocab, "died", "default", CohortOptions(), seed=7)["cohort_id"]
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")
    assert pretarget.height == 14 and "MEDS_DEATH" not in pretarget["code"].to_list()


def test_a_diagnosis_with_neither_time_nor_encounter_is_not_history(wh_vocab, tmp_path):
    # Subject 1's problem list, exported undated and without an encounter, names J189, a diagnosis of its target
    # encounter 103: as static history it would hand the target to every forecaster. Sex stays static history.
    problem_list = pl.DataFrame({"subject_id": [1], "time": [None], "code": [dx("J189")], "numeric_value": [None],
                                 "text_value": [None], "encounter_id": [None]}, schema=tiny_events().schema)
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "pl", pl.concat([tiny_events(), problem_list])), "pl")
    cid = build_cohort(wh_vocab, "pl", "default", CohortOptions(), seed=7)["cohort_id"]
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")
    assert dx("J189") not in pretarget["code"].to_list()
    assert pretarget.filter(pl.col("time").is_null())["code"].to_list() == ["GENDER//F"]


def test_no_clinical_event_with_neither_time_nor_encounter_is_history(wh_vocab, tmp_path):
    # Rows an export took at extraction, undated and without an encounter: a summary of subject 1's target stay 103,
    # the furosemide and the ventilation begun there, a BNP. Nothing places them before the cutoff, so none is in
    # the record (the Direct prompt would list them as "Recorded without a date"). Race stays, as sex does.
    loose = pl.DataFrame({"subject_id": 1, "time": None,
                          "code": ["NOTE//DISCHARGE_SUMMARY", FUROSEMIDE, "PROCEDURE//ICD//10//5A1955Z",
                                   "LAB//BNP//pg/mL", "RACE//WHITE"],
                          "numeric_value": [None, None, None, 900.0, None],
                          "text_value": ["Admitted on day 20 with pneumonia", None, None, None, None],
                          "encounter_id": None}, schema=tiny_events().schema)
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "loose", pl.concat([tiny_events(), loose])), "loose")
    cid = build_cohort(wh_vocab, "loose", "default", CohortOptions(), seed=7)["cohort_id"]
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")
    assert sorted(pretarget.filter(pl.col("time").is_null())["code"].to_list()) == ["GENDER//F", "RACE//WHITE"]


def test_undated_events_of_an_encounter_open_at_the_cutoff_or_never_dated_are_not_history(wh_vocab, tmp_path):
    # An export that keeps diagnoses undated. Subject 1's 101 ended on day 2: its undated diagnoses are history.
    # 102 is admitted on day 10 and discharged on day 25, so it spans the target 103 (admitted on day 20): its
    # undated diagnoses are coded at that discharge, after the cutoff. 105 has no dated event at all; it names
    # J189, a diagnosis of 103. Nothing places either before the cutoff, so neither may be in 103's record.
    events = tiny_events().with_columns(
        pl.when(pl.col("encounter_id").is_in([101, 102]) & pl.col("code").str.starts_with("DIAGNOSIS//"))
        .then(None).when((pl.col("encounter_id") == 102) & (pl.col("code") == "HOSPITAL_DISCHARGE//HOME"))
        .then(pl.lit(t(25))).otherwise(pl.col("time")).alias("time"))
    undated = pl.DataFrame({"subject_id": 1, "time": None, "code": [dx("J189"), "NOTE//DISCHARGE_SUMMARY"],
                            "numeric_value": None, "text_value": [None, "pneumonia, lobar"], "encounter_id": 105},
                           schema=events.schema)
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "undated", pl.concat([events, undated])), "undated")
    cid = build_cohort(wh_vocab, "undated", "default", CohortOptions(), seed=7)["cohort_id"]
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")
    assert pretarget.filter(pl.col("time").is_null()).sort("code").select("code", "encounter_id").rows() == [
        (dx("E119"), 101), (dx("I5022"), 101), ("GENDER//F", None)]
    assert pretarget.filter(pl.col("encounter_id") == 102)["time"].max() < t(20)  # its dated events before the cutoff
    # The history count is what the record shows: 101 only.
    trajectory = wh_vocab.read("trajectories", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")
    assert trajectory["n_prior_encounters"].to_list() == [1]


def test_a_code_list_made_from_the_data_is_not_taken_for_a_dictionary(wh_vocab, tmp_path):
    # A codes.parquet listing exactly the data's diagnosis codes (as MEDS pipelines derive it) holds codes found
    # only in held-out targets, such as subject 1's J189 and I5023; with one code the data never uses it is a
    # dictionary.
    from meds import code_metadata_filepath

    for name, extra in (("derived", []), ("dictionary", [dx("A000")])):
        root = write_tiny_meds(tmp_path / name)
        used = sorted(set(tiny_events().filter(pl.col("code").str.starts_with("DIAGNOSIS//"))["code"]))
        pl.DataFrame({"code": used + extra, "description": "a title"}).write_parquet(root / code_metadata_filepath)
        ingest_meds(wh_vocab, root, name)
        row = build_cohort(wh_vocab, name, "default", CohortOptions(), seed=7)
        omega = set(wh_vocab.read("cohort_vocabulary", cohort_id=row["cohort_id"])["code"])
        if name == "derived":
            assert row["vocabulary_source"] == "official_billable_icd10" and len(omega) > 10_000
        else:
            assert row["vocabulary_source"] == "dataset_dictionary" and omega == set(used + extra)



def test_cohort_build_says_when_it_set_a_code_list_aside_as_no_dictionary(wh_vocab, tmp_path):
    # A MIMIC extract whose d_icd_diagnoses keeps only the codes its rows use built Ω from the official billable
    # codes, saying only "(official_billable_icd10)": nothing told that its dictionary was set aside, nor why.
    from click.testing import CliRunner
    from meds import code_metadata_filepath

    from dxr.cli import main

    def build(dataset: str) -> list[str]:
        result = CliRunner().invoke(main, ["--data-dir", str(wh_vocab.root), "cohort", "build", "--dataset", dataset,
                                           "--name", dataset], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.stdout.splitlines()

    root = write_tiny_meds(tmp_path / "derived")
    used = sorted(set(tiny_events().filter(pl.col("code").str.starts_with("DIAGNOSIS//"))["code"]))
    pl.DataFrame({"code": used, "description": "a title"}).write_parquet(root / code_metadata_filepath)
    ingest_meds(wh_vocab, root, "derived")
    assert build("derived")[1] == (
        f"note: the dataset's metadata/codes.parquet (d_icd_diagnoses, for a MIMIC import) lists {len(used)} "
        "diagnosis codes, each used by the data: taken for a list made from the data, which would put codes found "
        "only in held-out targets into Ω, not for a dictionary, so Ω is official_billable_icd10; to have Ω from "
        "your dictionary, ship it whole")
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "undescribed"), "undescribed")  # no diagnosis listed: no note
    assert not any("metadata/codes.parquet" in line for line in build("undescribed"))

def test_a_dictionary_with_codes_written_unlike_the_data_is_refused(wh_vocab, tmp_path):
    # A hand-made dictionary writing its codes with dots became Ω as it was: no event, target or model output
    # matched it, so every forecast came out empty without an error. Its codes are held to the data's rules.
    from meds import code_metadata_filepath

    for name, written, problem in (
            ("lower", "DIAGNOSIS//ICD//10//i5022",
             r"diagnosis code 'DIAGNOSIS//ICD//10//i5022' is not upper case: write it 'DIAGNOSIS//ICD//10//I5022'"),
            ("system", "DIAGNOSIS//SNOMED//84114007",
             r"unknown code system in diagnosis code 'DIAGNOSIS//SNOMED//84114007': diagnosis codes must be")):
        root = write_tiny_meds(tmp_path / name)
        # A block listed by its range (row 2) is a dictionary entry like any other.
        pl.DataFrame({"code": ["GENDER//F", dx("C00-C96"), written, written + "9"], "description": "a title"}
                     ).write_parquet(root / code_metadata_filepath)
        with pytest.raises(InputError, match=rf"codes\.parquet, row 3: {problem}.*"
                                             r"\(2 codes like it\)"):
            ingest_meds(wh_vocab, root, name)
    # Written with the dot, as the data may be, ingest copies it without (`DIAGNOSIS_SPELLINGS`).
    root = write_tiny_meds(tmp_path / "dotted")
    pl.DataFrame({"code": [dx("C00-C96"), "DIAGNOSIS//ICD//10//I50.22"]}).write_parquet(root / code_metadata_filepath)
    ingest_meds(wh_vocab, root, "dotted")
    assert pl.read_parquet(wh_vocab.meds_dir("dotted") / code_metadata_filepath)["code"].to_list() == [
        dx("C00-C96"), dx("I5022")]
    # Rewritten after the dataset was registered: the build refuses it (its fingerprint leaves it out).
    root = write_tiny_meds(tmp_path / "later")
    ingest_meds(wh_vocab, root, "later")
    copied = wh_vocab.read("datasets", dataset_id="later")["meds_dir"][0]
    pl.DataFrame({"code": ["DIAGNOSIS//ICD//10//E11.9"]}).write_parquet(f"{copied}/{code_metadata_filepath}")
    with pytest.raises(InputError, match=r"row 1: diagnosis code 'DIAGNOSIS//ICD//10//E11\.9' has a dot"):
        build_cohort(wh_vocab, "later", "default", CohortOptions(), seed=7)


def test_code_titles_hold_the_descriptions_of_non_diagnosis_codes_the_forecasting_store_holds(wh_vocab, tmp_path):
    from warehouse.cohorts import code_titles

    ingest_meds(wh_vocab, write_described_meds(tmp_path / "meds"), "described")
    cid = build_cohort(wh_vocab, "described", "default", CohortOptions(), seed=7)["cohort_id"]
    titles = wh_vocab.read("code_titles", cohort_id=cid)
    assert titles.rows() == [(cid, "LAB//HBA1C//%", "Haemoglobin A1c"), (cid, FUROSEMIDE, "Furosemide")]
    assert code_titles(wh_vocab, cid) == {"LAB//HBA1C//%": "Haemoglobin A1c", FUROSEMIDE: "Furosemide"}
    # The boundary: code metadata only, and only of codes already in the forecasting store. The procedure and
    # the BNP lab of subject 1's held-out target encounter stay out, with them any hint of that encounter.
    assert titles.columns == ["cohort_id", "code", "title"]
    held = set(wh_vocab.read("pretarget_events", cohort_id=cid)["code"]) | set(
        wh_vocab.read("train_events", cohort_id=cid)["code"])
    assert set(titles["code"]) <= held
    assert {"PROCEDURE//ICD//9//3961", "LAB//BNP//pg/mL"} <= set(DESCRIPTIONS) - held
    # A dataset without descriptions gives none.
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "plain"), "plain")
    plain = build_cohort(wh_vocab, "plain", "default", CohortOptions(), seed=7)["cohort_id"]
    assert wh_vocab.read("code_titles", cohort_id=plain).is_empty() and code_titles(wh_vocab, plain) == {}


def test_paths_with_an_apostrophe_work_end_to_end(vocab_cache, tmp_path):
    import shutil

    from warehouse.store import Warehouse

    wh = Warehouse(tmp_path / "o'brien" / "warehouse")
    for table in ("icd_codes", "icd_notes", "gem_map"):
        shutil.copytree(vocab_cache.table_dir(table), wh.table_dir(table))
    ingest_meds(wh, write_tiny_meds(tmp_path / "d'arcy" / "meds"), "tiny")
    cid = build_cohort(wh, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    assert wh.connect().execute("SELECT count(*) FROM trajectories WHERE cohort_id = ?", [cid]).fetchone() == (3,)


def test_train_events_hold_only_train_patients(tiny_cohort):
    wh, row = tiny_cohort
    train = wh.read("train_events", cohort_id=row["cohort_id"])
    assert set(train["subject_id"].to_list()) == {2}
    assert train.height == 2 + 2 * 6  # static + birth, two encounters of 6 events each


def test_every_target_rule_and_min_history(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    every = build_cohort(wh_vocab, "tiny", "every", CohortOptions(target="every"), seed=7)
    ids = wh_vocab.read("trajectories", cohort_id=every["cohort_id"])["target_encounter_id"].sort().to_list()
    assert ids == [102, 103, 202, 403]
    zero = build_cohort(wh_vocab, "tiny", "every0", CohortOptions(target="every", min_history=0), seed=7)
    ids = wh_vocab.read("trajectories", cohort_id=zero["cohort_id"])["target_encounter_id"].sort().to_list()
    assert ids == [101, 102, 103, 201, 202, 301, 401, 403]
    assert every["cohort_id"] != zero["cohort_id"]


def test_history_counts_only_encounters_whose_diagnoses_precede_the_cutoff(wh_vocab, tmp_path):
    # Subject 2's first stay (201) now lasts to day 10, so 202 (day 5) is admitted while it is still open:
    # 201's diagnoses, coded at its discharge, are not in 202's record. Subject 1 gets an encounter (104)
    # admitted at the same moment as 103, whose diagnoses are therefore not in 103's record either.
    events = tiny_events()
    events = events.with_columns(
        pl.when((pl.col("encounter_id") == 201) & (pl.col("time") == t(3))).then(pl.lit(t(10)))
        .otherwise(pl.col("time")).alias("time"))
    extra = events.filter(pl.col("encounter_id") == 101).with_columns(
        pl.lit(104, dtype=pl.Int64).alias("encounter_id"), (pl.col("time") + pl.duration(days=20)).alias("time"))
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "nested", pl.concat([events, extra])), "nested")
    every = build_cohort(wh_vocab, "nested", "every", CohortOptions(target="every", min_history=0), seed=7)
    trajectories = wh_vocab.read("trajectories", cohort_id=every["cohort_id"])
    priors = dict(trajectories.select("target_encounter_id", "n_prior_encounters").iter_rows())
    assert priors == {101: 0, 102: 1, 103: 2, 104: 2, 201: 0, 202: 0, 301: 0, 401: 0, 403: 1}
    pretarget = wh_vocab.read("pretarget_events", cohort_id=every["cohort_id"])
    for trajectory_id, encounter, n_prior in trajectories.select(
            "trajectory_id", "target_encounter_id", "n_prior_encounters").iter_rows():
        seen = pretarget.filter(pl.col("trajectory_id") == trajectory_id, pl.col("code").str.starts_with("DIAGNOSIS//"))
        assert seen["encounter_id"].n_unique() == n_prior, encounter  # the count is what H shows
    final = build_cohort(wh_vocab, "nested", "final", CohortOptions(), seed=7)
    # Subject 2's 202 has no diagnosed history before it began, so min-history 1 leaves it out.
    assert sorted(wh_vocab.read("trajectories", cohort_id=final["cohort_id"])["target_encounter_id"]) == [104, 403]


def test_encounters_begun_at_one_instant_or_coded_as_the_next_begins_are_not_each_others_history(wh_vocab, tmp_path):
    # The prior encounters are counted in one pass over a patient's encounters in time order (a pairwise count took
    # 24 s for one patient's 20,000 encounters): 502 and 503 begin at one instant, and both are coded on day 6 as
    # 504 begins, so only 501 is history of each of the three; 505 has all four before it.
    rows = [(1, t(day), code, None, None, encounter) for encounter, day, code in [
        (501, 1, "HOSPITAL_ADMISSION//EMERGENCY"), (501, 1, dx("I10")), (502, 5, "HOSPITAL_ADMISSION//EMERGENCY"),
        (502, 6, dx("E119")), (503, 5, "HOSPITAL_ADMISSION//EMERGENCY"), (503, 6, dx("J189")),
        (504, 6, "HOSPITAL_ADMISSION//EMERGENCY"), (504, 7, dx("I10")), (505, 9, "HOSPITAL_ADMISSION//EMERGENCY"),
        (505, 9, dx("J189"))]]
    events = tiny_events()
    events = pl.concat([events.filter(pl.col("subject_id") != 1),
                        pl.DataFrame(rows, schema=events.schema, orient="row")])
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "ties", events), "ties")
    cid = build_cohort(wh_vocab, "ties", "every", CohortOptions(target="every", min_history=0), seed=7)["cohort_id"]
    trajectories = wh_vocab.read("trajectories", cohort_id=cid).filter(pl.col("subject_id") == 1)
    assert dict(trajectories.select("target_encounter_id", "n_prior_encounters").iter_rows()) == {
        501: 0, 502: 1, 503: 1, 504: 1, 505: 4}


def test_shards_hold_one_split_each_and_a_split_forecast_visits_only_its_own(wh_vocab, tiny_meds):
    from tasks.forecast import forecast_shards

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cid = build_cohort(wh_vocab, "tiny", "every0", CohortOptions(target="every", min_history=0), seed=7,
                       shard_size=2)["cohort_id"]
    trajectories = wh_vocab.read("trajectories", cohort_id=cid).sort("shard", "subject_id", "cutoff_time")
    assert trajectories.select("shard", "split", "target_encounter_id").rows() == [
        (0, "held_out", 101), (0, "held_out", 102), (1, "held_out", 103), (1, "held_out", 401),
        (2, "held_out", 403), (3, "train", 201), (3, "train", 202), (4, "tuning", 301)]
    assert forecast_shards(wh_vocab, cid, "held_out") == [0, 1, 2]
    assert forecast_shards(wh_vocab, cid, "tuning") == [4]
    assert forecast_shards(wh_vocab, cid, "all") == [0, 1, 2, 3, 4]
    assert forecast_shards(wh_vocab, cid, "held_out", subject_id=4) == [1, 2]
    for shard in range(5):  # each shard's pre-target file holds its own trajectories' records only
        records = wh_vocab.read("pretarget_events", cohort_id=cid, shard=shard)
        assert set(records["trajectory_id"]) == set(trajectories.filter(pl.col("shard") == shard)["trajectory_id"])


def test_cohort_id_is_stable_and_rebuild_never_duplicates(tiny_cohort):
    wh, row = tiny_cohort
    before = {table: wh.read(table, cohort_id=row["cohort_id"]).sort(pl.all()) for table in
              ("trajectories", "pretarget_events", "train_events", "targets", "cohort_vocabulary")}
    again = build_cohort(wh, "tiny", "default", CohortOptions(), seed=7)
    assert again["cohort_id"] == row["cohort_id"]
    for table, frame in before.items():
        assert wh.read(table, cohort_id=row["cohort_id"]).sort(pl.all()).equals(frame), table
    assert wh.read("cohorts").height == 1


def test_a_build_without_a_terminal_says_each_step_as_it_ends(wh_vocab):
    # At 100,000 patients a build takes 5 minutes, 90 % of it in the oracles; its bar showed only on a terminal, so
    # a cron job's log (or a captured run, as here) said nothing until the build ended.
    from click.testing import CliRunner

    from dxr.cli import main
    from warehouse.datasets import create_synthetic

    create_synthetic(wh_vocab, "synthetic", patients=60, seed=5, shard_size=60)
    result = CliRunner().invoke(main, ["--data-dir", str(wh_vocab.root), "cohort", "build", "--dataset", "synthetic",
                                       "--name", "nightly"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert [re.sub(r"done in \d+\.\d s$", "done in S s", line) for line in result.stderr.splitlines()] == [
        f"cohort nightly: {step} done in S s" for step in (
            "events", "harmonized diagnosis codes", "trajectories", "vocabulary",
            "pre-target records, train events and targets",
            "oracle probabilities (latent and record)")]
    assert result.stdout.startswith("cohort nightly (c")


def test_a_build_on_a_terminal_draws_its_bar_and_logs_no_line(wh_vocab, tiny_meds, monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    terminal, lines = Terminal(), []
    monkeypatch.setattr(sys, "stderr", terminal)
    build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7, progress=True, log=lines.append)
    assert lines == []
    assert "cohort default: 100%" in terminal.getvalue() and "5/5" in terminal.getvalue()


def test_killed_build_is_not_registered_and_rerun_is_identical(wh_vocab, tiny_meds, monkeypatch):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    clean = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)
    expected = wh_vocab.read("pretarget_events", cohort_id=clean["cohort_id"]).sort(pl.all())

    cut_cohort_builds_short(monkeypatch, KeyboardInterrupt("killed mid-build"))
    with pytest.raises(KeyboardInterrupt):
        build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)
    assert wh_vocab.read("cohorts").is_empty()  # a half-built cohort is never registered
    monkeypatch.undo()
    build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)
    assert wh_vocab.read("pretarget_events", cohort_id=clean["cohort_id"]).sort(pl.all()).equals(expected)
    assert wh_vocab.read("cohorts").height == 1


def test_a_name_being_rebuilt_is_not_answered_by_an_older_cohort_of_that_name(wh_vocab, tiny_meds, monkeypatch):
    # "default" was built natively, then by categories (the newest, so the one the name means). While the
    # category cohort is rebuilt it is unregistered, and the name used to return the native cohort: a
    # forecast or a prior's training started then ran on the wrong cohort without a word.
    import warehouse.cohorts as cohorts
    from dxr.errors import NotFoundError

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    native = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    category = build_cohort(wh_vocab, "tiny", "default", CohortOptions(harmonize="category"), seed=7)["cohort_id"]
    assert cohorts.get_cohort(wh_vocab, "default")["cohort_id"] == category
    original, seen = cohorts._code_titles, []

    def looking_up_meanwhile(*args, **kwargs):
        for key in ("default", native):
            try:
                seen.append(cohorts.get_cohort(wh_vocab, key)["cohort_id"])
            except NotFoundError as exc:
                seen.append(str(exc))
        return original(*args, **kwargs)

    monkeypatch.setattr(cohorts, "_code_titles", looking_up_meanwhile)  # once the rebuild unregistered it
    build_cohort(wh_vocab, "tiny", "default", CohortOptions(harmonize="category"), seed=7, run_id="rebuild")
    by_name, by_id = seen
    assert by_name.startswith("cohort 'default' is being built (run rebuild, started ")
    assert by_name.endswith(f"retry when it has finished; 1 finished cohort(s) of the name remain: name one by its "
                            f"id to use it ({native})")
    assert by_id == native  # an id names one cohort, whatever is being built
    assert cohorts.get_cohort(wh_vocab, "default")["cohort_id"] == category


def test_unknown_options_fail_with_the_fix():
    with pytest.raises(InputError, match="unknown harmonization 'icd11': use one of native, icd10, category"):
        CohortOptions(harmonize="icd11")


def write_meds_extract_like(root):
    """A MEDS directory as MEDS-Extract's MIMIC-IV ETL writes one: shards under data/<split>/, the admission id as
    `hadm_id`, its code shapes, codes.parquet with parent_codes, and the layouts real exports hold.

    Subject 10 (train): two stays, the second with an undated DRG row and a lab row exported twice.
    Subject 20 (held_out, no MEDS_BIRTH): a stay; then stay 2002 (days 10-20) with stay 2003 (days 12-14) inside it.
    Subject 30 (held_out): a stay; then stays 3002 and 3003 admitted at the same time.
    Subject 40 (tuning): one stay. Subject 50 (held_out): a stay, a stay without diagnoses, a stay.
    """
    import json

    def stay(subject, hadm, admit, discharge, codes, extra=()):
        return [(subject, t(admit, 7), "HOSPITAL_ADMISSION//EW EMER.//EMERGENCY ROOM", None, None, hadm),
                (subject, t(admit, 9), "LAB//50912//mg/dL", 1.1, None, hadm), *extra,
                *[(subject, t(discharge, 15), f"DIAGNOSIS//ICD//{code}", None, None, hadm) for code in codes],
                (subject, t(discharge, 15), "HOSPITAL_DISCHARGE//HOME", None, None, hadm)]

    def demographics(subject, birth=True):
        return [(subject, None, "GENDER//F", None, None, None)] + (
            [(subject, dt.datetime(1950, 1, 1), "MEDS_BIRTH", None, None, None)] if birth else [])

    shards = {
        "train": demographics(10) + stay(10, 1001, 0, 2, ["10//I10"]) + stay(
            10, 1002, 10, 12, ["10//E119"], [(10, None, "DRG//HCFA//291", None, None, 1002)]
            + [(10, t(10, 9), "LAB//50912//mg/dL", 1.1, None, 1002)]),
        "tuning": demographics(40) + stay(40, 4001, 0, 2, ["10//I10"]),
        "held_out": (demographics(20, birth=False) + stay(20, 2001, 0, 2, ["9//4019"])
                     + stay(20, 2002, 10, 20, ["10//I10"]) + stay(20, 2003, 12, 14, ["10//N179"])
                     + demographics(30) + stay(30, 3001, 0, 2, ["10//J189"])
                     + stay(30, 3002, 10, 11, ["10//E119"]) + stay(30, 3003, 10, 11, ["10//I10"])
                     + demographics(50) + stay(50, 5001, 0, 2, ["10//J449"]) + stay(50, 5002, 5, 6, [])
                     + stay(50, 5003, 10, 12, ["10//J441"])),
    }
    schema = {"subject_id": pl.Int64, "time": pl.Datetime("us"), "code": pl.String, "numeric_value": pl.Float32,
              "text_value": pl.String, "hadm_id": pl.Int64}
    for split, rows in shards.items():
        (root / "data" / split).mkdir(parents=True)
        (pl.DataFrame(rows, schema=schema, orient="row").sort("subject_id", "time", nulls_last=False)
         .write_parquet(root / "data" / split / "0.parquet"))
    (root / "metadata").mkdir()
    codes = sorted({row[2] for rows in shards.values() for row in rows})
    pl.DataFrame({"code": codes, "description": None, "parent_codes": [[c.split("//")[0]] for c in codes]},
                 schema_overrides={"description": pl.String}).write_parquet(root / "metadata" / "codes.parquet")
    pl.DataFrame({"subject_id": [10, 20, 30, 40, 50], "split": ["train", "held_out", "held_out", "tuning", "held_out"]}
                 ).write_parquet(root / "metadata" / "subject_splits.parquet")
    (root / "metadata" / "dataset.json").write_text(json.dumps({
        "dataset_name": "MIMIC-IV", "dataset_version": "2.2", "etl_name": "MEDS_transforms", "etl_version": "0.0.7",
        "meds_version": "0.3.3", "created_at": "2024-09-01T00:00:00"}))
    return root


def test_a_meds_extract_layout_with_nested_and_simultaneous_stays_keeps_the_boundary(wh_vocab, tmp_path):
    row = ingest_meds(wh_vocab, write_meds_extract_like(tmp_path / "mimic_iv_meds"), "extract")
    assert (row["n_subjects"], row["icd_versions"]) == (5, "9,10")
    cid = build_cohort(wh_vocab, "extract", "main", CohortOptions(), seed=7)["cohort_id"]
    trajectories = wh_vocab.read("trajectories", cohort_id=cid).sort("subject_id")
    # 20: the stay inside 2002 is the last to begin; 2002's diagnoses come after it began, so one prior stay.
    # 30: of two stays begun together the one with the larger id is the target, and the other is not its history.
    assert trajectories.select("subject_id", "target_encounter_id", "n_prior_encounters", "split").rows() == [
        (10, 1002, 1, "train"), (20, 2003, 1, "held_out"), (30, 3003, 1, "held_out"), (50, 5003, 1, "held_out")]
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid)
    encounters = {key: sorted(set(part["encounter_id"].drop_nulls().to_list()))
                  for (key,), part in pretarget.partition_by("trajectory_id", as_dict=True).items()}
    assert encounters == {f"{cid}:10:1002": [1001], f"{cid}:20:2003": [2001, 2002], f"{cid}:30:3003": [3001],
                          f"{cid}:50:5003": [5001, 5002]}
    held = pretarget.filter(pl.col("trajectory_id") == f"{cid}:20:2003")
    # The open stay 2002 shows what happened before the cutoff (its admission and lab), not its diagnosis.
    assert held.filter(pl.col("encounter_id") == 2002)["code"].to_list() == [
        "HOSPITAL_ADMISSION//EW EMER.//EMERGENCY ROOM", "LAB//50912//mg/dL"]
    assert held["time"].drop_nulls().max() < t(12, 7)
    targets = wh_vocab.read("targets", cohort_id=cid).sort("trajectory_id", "code")
    assert targets.select("trajectory_id", "code").rows() == [
        (f"{cid}:10:1002", "DIAGNOSIS//ICD//10//E119"), (f"{cid}:20:2003", "DIAGNOSIS//ICD//10//N179"),
        (f"{cid}:30:3003", "DIAGNOSIS//ICD//10//I10"), (f"{cid}:50:5003", "DIAGNOSIS//ICD//10//J441")]


def test_running_out_of_duckdb_memory_is_one_error_saying_how_to_raise_the_limit(wh_vocab, tiny_meds):
    # It was DuckDB's OutOfMemoryException and its traceback, with DuckDB's own `SET memory_limit` advice.
    from dxr.errors import ConfigError

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    with pytest.raises(ConfigError) as raised:
        build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7, memory_limit="1MB", run_id="coh-oom")
    # DuckDB's own sentence says how much it holds, which depends on its threads.
    assert re.fullmatch(re.escape("cohort build of default from dataset tiny: DuckDB ran out of memory within its "
                                  "limit of 1MB ") + OUT_OF_MEMORY + re.escape(
                            ": rerun with a larger memory limit (`--memory-limit`, e.g. 8GB, or the setting "
                            "cohort.memory_limit) that the machine has free"), str(raised.value)), str(raised.value)
    assert wh_vocab.read("cohorts").is_empty()
    assert wh_vocab.read("runs", run_id="coh-oom")["status"].to_list() == ["failed"]
    assert not [p.name for p in wh_vocab.gold_dir.iterdir() if p.name.startswith(".cohort-build-")]


@pytest.mark.parametrize("error", disk_full_errors(), ids=["enospc", "spill_cap"])
def test_a_full_disk_during_a_build_says_so_and_where(wh_vocab, tiny_meds, monkeypatch, error):
    from dxr.errors import ConfigError
    from warehouse import duck

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    connect = duck.connect
    monkeypatch.setattr(duck, "connect", lambda database: FailsAt(connect(database), "CREATE TEMP TABLE events", error))
    with pytest.raises(ConfigError) as raised:
        build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)
    assert str(raised.value) == (f"cohort build of default from dataset tiny: out of disk space in {wh_vocab.root}: "
                                 "free disk space there, or point --data-dir (DXR_DATA_DIR) to a disk with room")
    assert wh_vocab.read("cohorts").is_empty()


def test_a_build_removes_the_spill_directory_a_killed_build_of_another_cohort_left(wh_vocab, tiny_meds):
    # A build killed by SIGKILL (the OOM killer, at MIMIC scale) leaves its DuckDB spill files, gigabytes under a
    # hidden name in the gold store; only a build of that same cohort removed them, and a cohort built again with
    # other options (a new id) is never built under the old id again.
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    killed = abandoned_scratch(wh_vocab.gold_dir / "cohort-build-c0123456789a", "work")
    killed.mkdir()
    (killed / "duckdb_temp_storage-0.tmp").write_bytes(b"spilled rows")
    build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)
    assert not [p.name for p in wh_vocab.gold_dir.iterdir() if p.name.startswith(".cohort-build-")]


@pytest.mark.parametrize("change, min_history, why", [
    ("none", 3, "dataset 'tiny' yields no trajectory with --min-history 3: no patient has that many earlier encounters "
                "with diagnoses coded before the target encounter began (at most 2); lower --min-history to 2"),
    # Both were told to lower --min-history, also at 0.
    ("no splits", 0, "dataset 'tiny' yields no trajectory: none of the patients with encounters is listed in its "
                     "metadata/subject_splits.parquet, and a patient it does not list is in no cohort: give them a "
                     "split (train, tuning or held_out) there, or leave the file out for the seeded hash split, and "
                     "ingest the dataset again"),
    ("diagnoses outside encounters", 0,
     "dataset 'tiny' yields no trajectory: no encounter has a diagnosis (a target is the diagnoses coded in one "
     "encounter, so a diagnosis needs the encounter_id of its admission, and the encounter a dated event): give "
     "diagnoses their encounter_id and ingest the dataset again")])
def test_a_build_without_trajectories_names_the_cause(wh_vocab, tmp_path, change, min_history, why):
    events = tiny_events()
    if change == "diagnoses outside encounters":
        events = events.with_columns(pl.when(pl.col("code").str.starts_with("DIAGNOSIS//")).then(None)
                                     .otherwise(pl.col("encounter_id")).alias("encounter_id"))
    root = write_tiny_meds(tmp_path / "meds", events)
    if change == "no splits":
        splits = root / "metadata" / "subject_splits.parquet"
        pl.read_parquet(splits).head(0).write_parquet(splits)
    ingest_meds(wh_vocab, root, "tiny")
    with pytest.raises(InputError, match=f"^{re.escape(why)}$"):
        build_cohort(wh_vocab, "tiny", "none", CohortOptions(min_history=min_history), seed=7)
    assert wh_vocab.read("cohorts").is_empty()


def test_a_name_whose_newest_build_was_cut_short_is_refused_though_an_older_cohort_of_it_is_built(
        wh_vocab, tiny_meds, monkeypatch):
    # "default" built natively (A), then built by categories (B, another id) and cut short: `--cohort default`
    # answered A without a word, though the user's last word on the name was B.
    import warehouse.cohorts as cohorts
    from dxr.errors import NotFoundError
    from warehouse.cohort_deletion import delete_cohort

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    native = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]

    cut_cohort_builds_short(monkeypatch, OSError("no space left on device"))
    with pytest.raises(OSError):
        build_cohort(wh_vocab, "tiny", "default", CohortOptions(harmonize="category"), seed=7, run_id="b1")
    monkeypatch.undo()
    category = wh_vocab.read("runs", run_id="b1")["cohort_id"][0]  # recorded once it began to write
    assert category not in (None, native)
    refusal = (f"cohort default ({category}) is not built: its build in run b1 failed, and a build unregisters its "
               "cohort until it is complete; build it again with `dxr cohort build --dataset tiny --name default "
               "--target final --harmonize category --min-history 1`; 1 finished cohort(s) of the name remain: name "
               f"one by its id to use it ({native}), or `dxr cohort delete {category}` for the name to mean the "
               "newest of them again")
    with pytest.raises(NotFoundError, match=f"^{re.escape(refusal)}$"):
        cohorts.get_cohort(wh_vocab, "default")
    assert cohorts.get_cohort(wh_vocab, native)["cohort_id"] == native  # the older one, by its id
    code, out, err = cli(wh_vocab.root, "cohort", "list")
    assert (code, err) == (0, f"note: {refusal}\n") and native in out and category not in out

    # Builds refused for their input before they wrote anything leave the name as it was.
    with pytest.raises(NotFoundError, match="dataset 'nosuch' is not registered"):
        build_cohort(wh_vocab, "nosuch", "default", CohortOptions(), seed=7)
    with pytest.raises(InputError, match="yields no trajectory with --min-history 50"):
        build_cohort(wh_vocab, "tiny", "default", CohortOptions(min_history=50), seed=7)
    with pytest.raises(NotFoundError, match=f"^{re.escape(refusal)}$"):
        cohorts.get_cohort(wh_vocab, "default")

    # Deleting the half-built cohort gives the name back to the older one, as the refusal says.
    delete_cohort(wh_vocab, category, with_runs=False)
    assert cohorts.get_cohort(wh_vocab, "default")["cohort_id"] == native
    assert cli(wh_vocab.root, "cohort", "list")[2] == ""


def test_a_half_built_cohort_whose_name_a_later_build_took_is_noted_by_id_until_deleted(wh_vocab, tiny_meds,
                                                                                          monkeypatch):
    # "default" built natively (A) and cut short, then built by categories (B): the name means B, and `dxr cohort list`
    # went by name only, so A's half-written tables stayed on disk without a word, deletable by an id nothing showed.
    import warehouse.cohorts as cohorts
    from warehouse.cohort_deletion import delete_cohort

    ingest_meds(wh_vocab, tiny_meds, "tiny")

    def cut_short(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(cohorts, "_code_titles", cut_short)  # after the records are written, before the targets
    with pytest.raises(OSError):
        build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7, run_id="a1")
    monkeypatch.undo()
    orphan = wh_vocab.read("runs", run_id="a1")["cohort_id"][0]
    category = build_cohort(wh_vocab, "tiny", "default", CohortOptions(harmonize="category"), seed=7)["cohort_id"]
    assert cohorts.get_cohort(wh_vocab, "default")["cohort_id"] == category  # the name is not refused for A
    assert wh_vocab.has_rows("trajectories", cohort_id=orphan)  # what A's build left

    note = (f"cohort default ({orphan}) is not built: its build in run a1 failed, and a build unregisters its cohort "
            "until it is complete; build it again with `dxr cohort build --dataset tiny --name default --target final "
            f"--harmonize native --min-history 1`; a later build of the name default (cohort {category}) took the name "
            f"from it: `dxr cohort delete {orphan}` removes the tables it left half written (building it again takes "
            "the name back)")
    code, out, err = cli(wh_vocab.root, "cohort", "list")
    assert (code, err) == (0, f"note: {note}\n") and category in out and orphan not in out

    delete_cohort(wh_vocab, orphan, with_runs=False)  # as the note says
    assert not wh_vocab.has_rows("trajectories", cohort_id=orphan)
    assert cli(wh_vocab.root, "cohort", "list")[2] == ""
    assert cohorts.get_cohort(wh_vocab, "default")["cohort_id"] == category


def test_an_orphans_note_says_that_the_cohort_which_took_its_name_was_renamed_since(wh_vocab, tiny_meds,
                                                                                     monkeypatch):
    # "default" cut short (A), then built by categories (B), which was then built again under the name "other": A's
    # note still said that B "took the name", though the name led to no cohort any more.
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cut_cohort_builds_short(monkeypatch, OSError("no space left on device"))
    with pytest.raises(OSError):
        build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7, run_id="a1")
    monkeypatch.undo()
    orphan = wh_vocab.read("runs", run_id="a1")["cohort_id"][0]
    category = build_cohort(wh_vocab, "tiny", "default", CohortOptions(harmonize="category"), seed=7)["cohort_id"]
    build_cohort(wh_vocab, "tiny", "other", CohortOptions(harmonize="category"), seed=7)
    code, out, err = cli(wh_vocab.root, "cohort", "list")
    assert (code, err) == (0, f"note: cohort default ({orphan}) is not built: its build in run a1 failed, and a build "
                              "unregisters its cohort until it is complete; build it again with `dxr cohort build "
                              "--dataset tiny --name default --target final --harmonize native --min-history 1`; a "
                              f"later build of the name default (cohort {category}, renamed other since) took the name "
                              f"from it: `dxr cohort delete {orphan}` removes the tables it left half written "
                              "(building it again takes the name back)\n")


def test_the_deletes_that_give_a_name_back_include_an_older_build_of_it_cut_short(wh_vocab, tiny_meds, monkeypatch):
    # "default" built (A), then built under other options twice, both cut short (O, then B): the refusal named only
    # `dxr cohort delete B` "for the name to mean the newest of them again", after which the name led to O, refused.
    import warehouse.cohorts as cohorts
    from dxr.errors import NotFoundError
    from warehouse.cohort_deletion import delete_cohort

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    finished = build_cohort(wh_vocab, "tiny", "default", CohortOptions(min_history=0), seed=7)["cohort_id"]
    cut_cohort_builds_short(monkeypatch, OSError("no space left on device"))
    for run_id, options in (("o1", CohortOptions(harmonize="category")), ("b1", CohortOptions())):
        with pytest.raises(OSError):
            build_cohort(wh_vocab, "tiny", "default", options, seed=7, run_id=run_id)
    monkeypatch.undo()
    older, newer = (wh_vocab.read("runs", run_id=run_id)["cohort_id"][0] for run_id in ("o1", "b1"))
    remain = f"1 finished cohort(s) of the name remain: name one by its id to use it ({finished}), or "
    with pytest.raises(NotFoundError, match=re.escape(f"{remain}`dxr cohort delete {newer}`, then `dxr cohort delete "
                                                      f"{older}` for the name to mean the newest of them again")):
        cohorts.get_cohort(wh_vocab, "default")
    delete_cohort(wh_vocab, newer, with_runs=False)
    with pytest.raises(NotFoundError, match=re.escape(f"({older}) is not built: its build in run o1 failed")
                       + ".*" + re.escape(f"{remain}`dxr cohort delete {older}` for the name to mean the newest")):
        cohorts.get_cohort(wh_vocab, "default")
    delete_cohort(wh_vocab, older, with_runs=False)
    assert cohorts.get_cohort(wh_vocab, "default")["cohort_id"] == finished


def test_the_notes_of_two_cut_short_builds_of_one_name_read_oldest_first(wh_vocab, tiny_meds, monkeypatch):
    # The name's note (the newer build, B) came before the orphan's (A), whose note tells of B taking its name.
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cut_cohort_builds_short(monkeypatch, OSError("no space left on device"))
    for run_id, harmonize in (("a1", "native"), ("b1", "category")):
        with pytest.raises(OSError):
            build_cohort(wh_vocab, "tiny", "default", CohortOptions(harmonize=harmonize), seed=7, run_id=run_id)
    monkeypatch.undo()
    older, newer = (wh_vocab.read("runs", run_id=run_id)["cohort_id"][0] for run_id in ("a1", "b1"))
    code, out, err = cli(wh_vocab.root, "cohort", "list")
    assert (code, err.splitlines()) == (0, [
        f"note: cohort default ({older}) is not built: its build in run a1 failed, and a build unregisters its cohort "
        "until it is complete; build it again with `dxr cohort build --dataset tiny --name default --target final "
        f"--harmonize native --min-history 1`; a later build of the name default (cohort {newer}) took the name from "
        f"it: `dxr cohort delete {older}` removes the tables it left half written (building it again takes the name "
        "back)",
        f"note: cohort default ({newer}) is not built: its build in run b1 failed, and a build unregisters its cohort "
        "until it is complete; build it again with `dxr cohort build --dataset tiny --name default --target final "
        "--harmonize category --min-history 1`"])


def test_a_build_renaming_a_cohort_cut_short_names_the_build_under_the_new_name(wh_vocab, tiny_meds, monkeypatch):
    # The cohort "default" built again under the name "renamed" and killed: the command named to build it again was
    # `--name default`, which would undo the rename the user asked for.
    import warehouse.cohorts as cohorts
    from dxr.errors import NotFoundError
    from warehouse.cohort_deletion import resolve_cohort

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    older = build_cohort(wh_vocab, "tiny", "default", CohortOptions(min_history=0), seed=7)["cohort_id"]
    renamed = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    cut_cohort_builds_short(monkeypatch, KeyboardInterrupt("killed between the records and the targets"))
    with pytest.raises(KeyboardInterrupt):
        build_cohort(wh_vocab, "tiny", "renamed", CohortOptions(), seed=7, run_id="rename")
    monkeypatch.undo()
    command = "dxr cohort build --dataset tiny --name renamed --target final --harmonize native --min-history 1"
    head = ("is not built: its build in run rename failed, and a build unregisters its cohort until it is complete; "
            f"build it again with `{command}`")
    by_old_name = (f"cohort renamed ({renamed}, formerly default) {head}; 1 finished cohort(s) of the name remain: "
                   f"name one by its id to use it ({older}), or `dxr cohort delete {renamed}` for the name to mean the "
                   "newest of them again")
    for name_or_id, refusal in (("default", by_old_name), ("renamed", f"cohort renamed ({renamed}) {head}"),
                                (renamed, f"cohort renamed ({renamed}) {head}")):
        with pytest.raises(NotFoundError, match=f"^{re.escape(refusal)}$"):
            cohorts.get_cohort(wh_vocab, name_or_id)
    assert cli(wh_vocab.root, "cohort", "list")[2] == f"note: {by_old_name}\n"
    with pytest.raises(InputError, match=f"^cohort name 'default' names 2 cohorts, oldest first: {older} .*, "
                                         f"{renamed} \\(not built: its build in run rename failed\\); "):
        resolve_cohort(wh_vocab, "default")

    # The command named finishes the rename; a later rename cut short leaves the old name to its older cohort.
    assert build_cohort(wh_vocab, "tiny", "renamed", CohortOptions(), seed=7)["cohort_id"] == renamed
    cut_cohort_builds_short(monkeypatch, KeyboardInterrupt("killed between the records and the targets"))
    with pytest.raises(KeyboardInterrupt):
        build_cohort(wh_vocab, "tiny", "again", CohortOptions(), seed=7, run_id="again")
    monkeypatch.undo()
    assert cohorts.get_cohort(wh_vocab, "default")["cohort_id"] == older
    with pytest.raises(NotFoundError, match=f"^cohort again \\({renamed}, formerly renamed\\) is not built: its build "
                                            "in run again failed"):
        cohorts.get_cohort(wh_vocab, "renamed")


def test_a_build_refused_for_its_input_leaves_its_cohort_registered(tiny_cohort, monkeypatch):
    # A build unregistered its cohort before it read anything: refused on the way (here a dictionary it cannot take),
    # it left a cohort of that id unregistered, which only a build that passes could bring back.
    import warehouse.cohorts as cohorts

    wh, row = tiny_cohort

    def refused(*args, **kwargs):
        raise InputError("the dictionary is refused")

    monkeypatch.setattr(cohorts, "_vocabulary", refused)
    with pytest.raises(InputError, match="the dictionary is refused"):
        build_cohort(wh, "tiny", "default", CohortOptions(), seed=7, run_id="refused")
    assert wh.read("cohorts")["cohort_id"].to_list() == [row["cohort_id"]]
    assert wh.read("runs", run_id="refused").select("status", "cohort_id").rows() == [("failed", None)]
    assert cohorts.get_cohort(wh, "default")["cohort_id"] == row["cohort_id"]


def test_the_realism_bands_of_a_cohort_whose_rebuild_was_cut_short_are_refused_with_its_build_command(
        wh_vocab, monkeypatch):
    # `realism_table` read a half-rewritten cohort's tables as no other reader does: bands of records without targets.
    from dxr.errors import NotFoundError
    from flows.forecast import forecast_flow
    from tasks.evaluate import evaluate_run
    from tasks.realism import realism_table
    from warehouse.datasets import create_synthetic
    from warehouse.synthetic.realism import REALISM_BANDS

    wh = wh_vocab
    create_synthetic(wh, "synthetic", 200, seed=7)
    row = build_cohort(wh, "synthetic", "default", CohortOptions(), seed=7)
    for system in ("repeat_history", "global_frequency"):
        forecast_flow(str(wh.root), "default", system, run_id="r1")
    evaluate_run(wh, "r1", ks=(20,), n_boot=0)
    assert realism_table(wh, row["cohort_id"], "r1")["band"].to_list() == list(REALISM_BANDS)

    cut_cohort_builds_short(monkeypatch, KeyboardInterrupt("killed between the records and the targets"))
    with pytest.raises(KeyboardInterrupt):
        build_cohort(wh, "synthetic", "default", CohortOptions(), seed=7, run_id="rebuild")
    monkeypatch.undo()
    refusal = (f"cohort default ({row['cohort_id']}) is not built: its build in run rebuild failed, and a build "
               "unregisters its cohort until it is complete; build it again with `dxr cohort build --dataset "
               "synthetic --name default --target final --harmonize native --min-history 1`")
    with pytest.raises(NotFoundError, match=f"^{re.escape(refusal)}$"):
        realism_table(wh, row["cohort_id"], "r1")


def test_a_build_killed_by_sigkill_is_said_killed_and_the_command_named_builds_it_again(wh_vocab):
    # The kills above raise inside the build, which records itself `failed`. A SIGKILL records nothing: its `running`
    # row is marked `killed` by the next command (`mark_killed`), whose refusal says "was killed".
    import os
    import shlex
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from warehouse.datasets import create_synthetic

    # 100 patients: the claim is about the kill, not the size, and each in-process build of 300 took seconds more.
    create_synthetic(wh_vocab, "synthetic", 100, seed=7)
    built = build_cohort(wh_vocab, "synthetic", "default", CohortOptions(), seed=7)
    trajectories = wh_vocab.read("trajectories", cohort_id=built["cohort_id"])
    # The clone's own code (`-m` from its root), with an oracle slow enough (about 10 s) to be killed in.
    build = subprocess.Popen([sys.executable, "-m", "dxr", "--data-dir", str(wh_vocab.root), "cohort", "build",
                              "--dataset", "synthetic", "--name", "default", "--run-id", "killed"],
                             cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "DXR_SEED": "7", "DXR_SYNTH__ORACLE_DRAWS": "6000"})
    try:
        # Its last step before the oracles: the cohort is unregistered and its records rewritten.
        for line in build.stderr:
            if line.startswith("cohort default: pre-target records, train events and targets done"):
                break
        assert build.poll() is None, "the build ended before it could be killed"
        build.send_signal(signal.SIGKILL)
    finally:
        build.kill()
        build.wait(timeout=60)
    assert build.returncode == -signal.SIGKILL
    assert wh_vocab.read("cohorts").is_empty()

    code, out, err = cli(wh_vocab.root, "forecast", "--cohort", "default", "--system", "repeat_history")
    command = ("dxr cohort build --dataset synthetic --name default --target final --harmonize native "
               "--min-history 1")
    assert (code, out, err.splitlines()[-1]) == (1, "", (
        f"Error: cohort default ({built['cohort_id']}) is not built: its build in run killed was killed, and a build "
        f"unregisters its cohort until it is complete; build it again with `{command}`"))
    assert wh_vocab.read("runs", run_id="killed").select("status", "cohort_id").rows() == [
        ("killed", built["cohort_id"])]

    code, _, err = cli(wh_vocab.root, *shlex.split(command)[1:])  # the command the refusal names
    assert code == 0, err
    assert wh_vocab.read("cohorts")["cohort_id"].to_list() == [built["cohort_id"]]
    assert wh_vocab.read("trajectories", cohort_id=built["cohort_id"]).equals(trajectories)
    assert cli(wh_vocab.root, "forecast", "--cohort", "default", "--system", "repeat_history")[0] == 0
