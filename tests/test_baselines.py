"""Frequency baselines on the tiny cohort: exact rankings, padding marked, statuses."""

from __future__ import annotations

import datetime as dt

import polars as pl

from models.baselines import GlobalFrequency, RepeatHistory
from tasks.evaluate import load_run
from tasks.forecast import forecast_shard, shard_inputs, write_shard_outputs
from tests.conftest import dx, tiny_events, write_tiny_meds
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import ingest_meds


def test_repeat_history_then_padding(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cid = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    trajectories, pretarget = shard_inputs(wh_vocab, cid, 0, "held_out")
    model = RepeatHistory()
    model.fit(wh_vocab.connect(), cid)
    ranked, status = forecast_shard(model, trajectories, pretarget, 5, "r1", cid)
    subject1 = ranked.filter(pl.col("trajectory_id") == f"{cid}:1:103")
    # History: I50.22 twice; N17.9 and E11.9 once each, N17.9 more recent. Padding: train frequency
    # (I10 in 2 encounters, then E11.9 and J18.9 in 1) without the codes already listed.
    assert subject1.select("code", "native").rows() == [
        (dx("I5022"), True), (dx("N179"), True), (dx("E119"), True), (dx("I10"), False), (dx("J189"), False)]
    assert subject1["score"].is_sorted(descending=True)
    # Subject 4 has one history code and three padding codes: 4 < 5, explicitly short.
    assert status.select("trajectory_id", "status", "detail").rows() == [
        (f"{cid}:1:103", "ok", None), (f"{cid}:4:403", "short", "4 of 5 codes")]
    ranked, status = forecast_shard(model, trajectories, pretarget, 20, "r1", cid)
    assert status.filter(pl.col("trajectory_id") == f"{cid}:1:103").row(0, named=True)["detail"] == "5 of 20 codes"


def test_repeat_history_counts_encounters_and_ranks_undated_codes_least_recent():
    t = dt.datetime
    # A: one encounter, listed twice in it; B: two encounters; C: two encounters, the later one more
    # recent than B's; D: twice undated outside any encounter (one occurrence); E: one encounter in
    # 2019, the oldest dated code, yet more recent than the undated D.
    pretarget = pl.DataFrame({
        "trajectory_id": "t1",
        "time": [t(2020, 1, 1), t(2020, 1, 1), t(2020, 1, 1), t(2020, 3, 1), t(2020, 2, 1), t(2020, 4, 1),
                 None, None, t(2019, 1, 1)],
        "code": [dx("A"), dx("A"), dx("B"), dx("B"), dx("C"), dx("C"), dx("D"), dx("D"), dx("E")],
        "encounter_id": [1, 1, 1, 3, 2, 4, None, None, 5]})
    model = RepeatHistory()
    model.vocabulary = pl.DataFrame({"code": [dx(c) for c in "ABCDE"]})
    model.frequency = pl.DataFrame({"code": [dx("Z")], "count": [5.0]})
    ranked = model.predict(pl.DataFrame({"trajectory_id": ["t1"]}), pretarget, 6)
    assert ranked.select("code", "score").rows() == [
        (dx("C"), 2.0), (dx("B"), 2.0), (dx("A"), 1.0), (dx("E"), 1.0), (dx("D"), 1.0), (dx("Z"), 5 / 6)]


def test_forecasters_see_each_trajectorys_identity_but_not_its_target_or_cutoff(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cid = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    trajectories, pretarget = shard_inputs(wh_vocab, cid, 0, "held_out")
    assert {"target_encounter_id", "cutoff_time"} <= set(trajectories.columns)
    seen = []

    class Recording(GlobalFrequency):
        def predict(self, trajectories, pretarget, k):
            seen.append(trajectories.columns)
            return super().predict(trajectories, pretarget, k)

    model = Recording()
    model.fit(wh_vocab.connect(), cid)
    forecast_shard(model, trajectories, pretarget, 3, "r1", cid)
    assert seen == [["trajectory_id", "subject_id"]]


def test_global_frequency_uses_train_patients_only(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cid = build_cohort(wh_vocab, "tiny", "default", CohortOptions(), seed=7)["cohort_id"]
    model = GlobalFrequency()
    model.fit(wh_vocab.connect(), cid)
    assert model.frequency.rows() == [(dx("I10"), 2.0), (dx("E119"), 1.0), (dx("J189"), 1.0)]


def test_stage_candidates_keep_native_codes_and_count_history_encounters():
    from tasks.forecast import stage_candidates

    ranked = pl.DataFrame({
        "run_id": "r1", "cohort_id": "c", "system": "ehr_prior", "trajectory_id": ["t1", "t1", "t1", "t2"],
        "rank": [1, 2, 3, 1], "code": [dx("I5022"), dx("N179"), dx("I10"), dx("I5022")],
        "score": [3.0, 2.0, 1.0, 5.0], "native": [True, True, False, True]})
    pretarget = pl.DataFrame({
        "trajectory_id": ["t1"] * 5 + ["t2"],
        # I50.22 in encounters 10 and 11 (twice in 11), N17.9 twice without an encounter, a procedure
        # with I50.22's digits; t2's history is its own.
        "code": [dx("I5022"), dx("I5022"), dx("I5022"), dx("N179"), dx("N179"), "PROCEDURE//ICD//10//I5022"],
        "encounter_id": [10, 11, 11, None, None, 20]})
    candidates = stage_candidates(ranked, pretarget, "candidate_generation")
    assert candidates.columns == ["run_id", "cohort_id", "stage", "system", "trajectory_id", "rank", "code", "score",
                                  "history_count"]
    assert candidates.select("trajectory_id", "rank", "code", "history_count").rows() == [
        ("t1", 1, dx("I5022"), 2), ("t1", 2, dx("N179"), 1), ("t2", 1, dx("I5022"), 0)]
    assert candidates["stage"].unique().to_list() == ["candidate_generation"]


def test_global_frequency_and_the_evaluations_frequency_buckets_count_a_category_cohorts_stays_alike(wh_vocab,
                                                                                                  tmp_path):
    # Train patient 2 gets five more stays, each coding E11.9 and E11.65: harmonized to category E11 they are two
    # rows of one stay, so E11 has 11 train_events rows in 6 stays (201 codes E11.9 alone). The evaluation's
    # frequency buckets counted the rows and put E11 in freq_10_99 while global_frequency ranks it by its 6 stays.
    stays = []
    for n, stay in enumerate(range(211, 216)):
        admit, discharge = dt.datetime(2020, 2, 1 + 3 * n), dt.datetime(2020, 2, 2 + 3 * n)
        stays += [(2, admit, "HOSPITAL_ADMISSION//EMERGENCY", None, None, stay),
                  *[(2, discharge, dx(code), None, None, stay) for code in ("E119", "E1165")],
                  (2, discharge, "HOSPITAL_DISCHARGE//HOME", None, None, stay)]
    base = tiny_events()
    events = pl.concat([base, pl.DataFrame(stays, schema=base.schema, orient="row")])
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "meds", events), "tiny")
    cid = build_cohort(wh_vocab, "tiny", "category", CohortOptions(harmonize="category"), seed=7)["cohort_id"]
    e11 = dx("E11")
    train = wh_vocab.read("train_events", cohort_id=cid).filter(pl.col("code") == e11)
    assert (train.height, train["encounter_id"].n_unique()) == (11, 6)
    model = GlobalFrequency()
    model.fit(wh_vocab.connect(), cid)
    assert dict(model.frequency.rows())[e11] == 6.0
    trajectories, pretarget = shard_inputs(wh_vocab, cid, 0, "held_out")
    ranked, status = forecast_shard(model, trajectories, pretarget, 3, "r1", cid)
    write_shard_outputs(wh_vocab, model.system, 0, "r1", ranked, status, pretarget)
    labelled = load_run(wh_vocab, "r1", ks=(3,)).labelled
    # Stay 103's targets: I50 (no train stay), E11 (6) and J18 (J18.9 in stay 202).
    assert labelled.filter((pl.col("trajectory_id") == f"{cid}:1:103") & pl.col("subset").str.starts_with("freq_")
                           ).select("code", "subset").sort("code").rows() == [
        (e11, "freq_1_9"), (dx("I50"), "freq_0"), (dx("J18"), "freq_1_9")]
