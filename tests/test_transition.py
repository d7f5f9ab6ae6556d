"""The first-order transition baseline: learned on train only, exact probabilities, valid rankings."""

from __future__ import annotations

import datetime as dt

import polars as pl

from models.prior.planted import dx, write_planted_cohort
from models.transition import Transition, visit_diagnoses
from warehouse.store import Warehouse

D = dt.datetime


def write_tiny(wh: Warehouse) -> None:
    """Two train patients: A→B twice, A→C once; a held_out patient whose record must not be learned."""
    rows = [  # subject, encounter, day, code
        (1, 10, 1, dx("A")), (1, 11, 5, dx("B")), (1, 12, 9, dx("A")), (1, 13, 12, dx("B")),
        (2, 20, 1, dx("A")), (2, 21, 4, dx("C")), (2, 21, 4, "PROCEDURE//ICD//10//P1"),
    ]
    events = pl.DataFrame([{"cohort_id": "ct", "subject_id": s, "time": D(2020, 1, d), "code": c,
                            "numeric_value": None, "text_value": None, "encounter_id": e} for s, e, d, c in rows])
    wh.write("train_events", events, cohort_id="ct")
    wh.write("cohort_vocabulary", pl.DataFrame({"cohort_id": "ct", "code": [dx(c) for c in "ABCZ"],
                                                "icd_version": 10, "title": list("ABCZ")}), cohort_id="ct")


def test_transition_probabilities_are_exact(tmp_path):
    wh = Warehouse(tmp_path)
    write_tiny(wh)
    model = Transition()
    model.fit(wh.connect(), "ct")
    table = {(s, c): p for s, c, p in model.table.sort("source", "code").iter_rows()}
    # A has a successor visit 3 times: B twice, C once. B has a successor once (A).
    assert table == {(dx("A"), dx("B")): 2 / 3, (dx("A"), dx("C")): 1 / 3, (dx("B"), dx("A")): 1.0}

    pretarget = pl.DataFrame({"trajectory_id": ["t1"] * 2, "time": [D(2021, 1, 1), D(2021, 2, 1)],
                              "code": [dx("B"), dx("A")], "encounter_id": [1, 2]})
    ranked = model.predict(pl.DataFrame({"trajectory_id": ["t1", "t2"]}), pretarget, 3)
    assert ranked.filter(pl.col("trajectory_id") == "t1").select("code", "native").rows() == [
        (dx("B"), True), (dx("C"), True), (dx("A"), False)]
    # A trajectory without history still gets a padded list (train frequency: A 3, B 2, C 1).
    assert ranked.filter(pl.col("trajectory_id") == "t2")["code"].to_list() == [dx("A"), dx("B"), dx("C")]


def test_visit_numbering_skips_encounters_without_diagnoses():
    events = pl.DataFrame({"subject_id": [1, 1, 1], "time": [D(2020, 1, 1), D(2020, 1, 5), D(2020, 1, 9)],
                           "code": [dx("A"), "LAB//x//mg", dx("B")], "encounter_id": [1, 2, 3]})
    assert visit_diagnoses(events, "subject_id").sort("visit").rows() == [(1, 0, dx("A"), 1), (1, 1, dx("B"), 3)]


def test_transition_recovers_planted_successors(tmp_path):
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=100, seed=1)
    model = Transition()
    model.fit(wh.connect(), cohort)
    trajectories = wh.read("trajectories", cohort_id=cohort)
    pretarget = wh.read("pretarget_events", cohort_id=cohort)
    ranked = model.predict(trajectories, pretarget, 20)
    assert ranked.group_by("trajectory_id").len()["len"].to_list() == [20] * trajectories.height
    assert ranked.select(pl.struct("trajectory_id", "code").is_duplicated().any()).item() is False
    # The planted successor (P = 1 from the trigger) ranks in the top 3, next to the chronic codes.
    last_trigger = (visit_diagnoses(pretarget, "trajectory_id")
                    .filter(pl.col("visit") == pl.col("visit").max().over("trajectory_id"))
                    .filter(pl.col("code").str.contains("//T")))
    expected = last_trigger.select("trajectory_id", pl.col("code").str.replace("//T", "//S"))
    assert expected["trajectory_id"].n_unique() == trajectories.height  # every visit has a trigger: none goes unchecked
    top = ranked.filter(pl.col("rank") <= 3).select("trajectory_id", "code")
    assert expected.join(top, on=["trajectory_id", "code"], how="anti").is_empty()


def test_an_encounters_undated_diagnoses_belong_to_its_visit():
    events = pl.DataFrame({"subject_id": [1, 1, 1], "time": [D(2020, 1, 1), D(2020, 2, 1), None],
                           "code": [dx("A"), "LAB//x", dx("B")], "encounter_id": [10, 11, 11]})
    assert visit_diagnoses(events, "subject_id").sort("visit").rows() == [(1, 0, dx("A"), 10), (1, 1, dx("B"), 11)]


def test_fit_reads_diagnoses_and_encounter_starts_not_every_lab_row(tmp_path, monkeypatch):
    import models.transition

    wh = Warehouse(tmp_path)
    write_tiny(wh)
    # 500 lab results in an undated-diagnosis encounter that starts with them: they date the visit, nothing more.
    labs = pl.DataFrame([{"cohort_id": "ct", "subject_id": 2, "time": D(2020, 1, 7, 0, i % 60), "code": "LAB//x//mg",
                          "numeric_value": float(i), "text_value": None, "encounter_id": 22} for i in range(500)]
                        + [{"cohort_id": "ct", "subject_id": 2, "time": None, "code": dx("B"), "numeric_value": None,
                            "text_value": None, "encounter_id": 22}])
    wh.write("train_events", pl.concat([wh.read("train_events", cohort_id="ct"), labs], how="vertical_relaxed"),
             cohort_id="ct")
    read, query = [], models.transition.sql_frame

    def counted(*args):
        frame = query(*args)
        read.append(frame.height)
        return frame

    monkeypatch.setattr(models.transition, "sql_frame", counted)
    model = Transition()
    model.fit(wh.connect(), "ct")
    table = {(s, c): p for s, c, p in model.table.sort("source", "code").iter_rows()}
    # Subject 2 now goes A → C → B: C gains a successor.
    assert table == {(dx("A"), dx("B")): 2 / 3, (dx("A"), dx("C")): 1 / 3, (dx("B"), dx("A")): 1.0,
                     (dx("C"), dx("B")): 1.0}
    # At most one row per diagnosis (7) and per encounter (7) in memory, not the 508 events: at MIMIC-IV scale
    # the lab and medication rows are most of the hundred million.
    assert max(read) <= 14, read


def test_a_stay_nested_in_a_longer_one_is_learned_from_the_record_its_forecast_sees(wh_vocab, tmp_path):
    from tests.conftest import dx as icd10, nested_stay_meds
    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import ingest_meds

    ingest_meds(wh_vocab, nested_stay_meds(tmp_path / "meds"), "nested")
    cid = build_cohort(wh_vocab, "nested", "every", CohortOptions(target="every"), seed=7)["cohort_id"]
    model = Transition()
    model.fit(wh_vocab.connect(), cid)
    table = {(s, c): p for s, c, p in model.table.sort("source", "code").iter_rows()}
    # Train subject 2: 201 {E119, I10} → 202 {I10, J189} → the outer 204 (days 10-20, N179 coded at discharge),
    # which spans 205 (days 12-14, J189). 205's pre-target record ends with 202: 204 has no diagnosis before
    # 205's admission. So 205 is learned from 202, not from N179, which its forecast cannot know.
    e119, i10, j189, n179 = (icd10(c) for c in ("E119", "I10", "J189", "N179"))
    assert table == {(e119, i10): 1.0, (e119, j189): 1.0, (i10, i10): 1 / 3, (i10, j189): 2 / 3, (i10, n179): 1 / 3,
                     (j189, j189): 1 / 2, (j189, n179): 1 / 2}
    # The forecast of train trajectory 2:205 indeed sees 202 as its last visit.
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:2:205")
    last = visit_diagnoses(pretarget, "trajectory_id").filter(pl.col("visit") == pl.col("visit").max())
    assert sorted(last["code"].to_list()) == [i10, j189]


def test_visits_within_a_stay_that_spans_them_are_cut_a_batch_at_a_time(tmp_path, monkeypatch):
    """Each visit within a stay still open at its admission is learned from its record cut there, so one record is
    cut once per such visit: one patient with 5,000 daily visits within a stay spanning them all took the fit to a
    4.2 GB peak. The records are cut in batches of about `CUT_BATCH_EVENTS` events, with the same table."""
    import models.pretarget as pretarget

    rows = [(1, 100, 1, "HOSPITAL_ADMISSION//EMERGENCY"), (1, 100, 29, dx("O"))]  # the stay spanning days 1-29
    for i in range(20):
        rows += [(1, 101 + i, 2 + i, "HOSPITAL_ADMISSION//EMERGENCY"), (1, 101 + i, 2 + i, dx("AB"[i % 2]))]
    events = pl.DataFrame([{"cohort_id": "ct", "subject_id": s, "time": D(2020, 1, d), "code": c,
                            "numeric_value": None, "text_value": None, "encounter_id": e} for s, e, d, c in rows])
    wh = Warehouse(tmp_path)
    wh.write("train_events", events, cohort_id="ct")
    wh.write("cohort_vocabulary", pl.DataFrame({"cohort_id": "ct", "code": [dx(c) for c in "ABO"],
                                                "icd_version": 10, "title": list("ABO")}), cohort_id="ct")
    whole = Transition()
    whole.fit(wh.connect(), "ct")
    cut_sizes = []

    def counted(*args):
        cut, label_codes, names = cut_records(*args)
        cut_sizes.append(cut.height)
        return cut, label_codes, names

    cut_records = pretarget.cut_records
    monkeypatch.setattr(pretarget, "cut_records", counted)
    monkeypatch.setattr(pretarget, "CUT_BATCH_EVENTS", 60)  # the record's 63 events: one visit a batch
    batched = Transition()
    batched.fit(wh.connect(), "ct")
    assert len(cut_sizes) == 20 and max(cut_sizes) < 63  # each a record cut once, not the 20 cut at once
    assert batched.table.sort("source", "code").equals(whole.table.sort("source", "code"))
    assert whole.table.filter(pl.col("source") == dx("A"))["code"].to_list() == [dx("B")]  # O is after the cutoff


def test_refits_rank_the_same(tmp_path):
    """A code's score sums its sources' probabilities, whose order a parallel join varies from one fit (or
    call) to the next: summed as they came, 0.1 + 0.2 + 0.3 was 0.6 in one run and 0.6000000000000001 in
    another, and codes of equal scores swapped places when the same forecast was rerun."""
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=100, seed=1)
    trajectories = wh.read("trajectories", cohort_id=cohort)
    pretarget = wh.read("pretarget_events", cohort_id=cohort)
    rankings = set()
    for _ in range(5):
        model = Transition()
        model.fit(wh.connect(), cohort)
        rankings.add(tuple(model.predict(trajectories, pretarget, 20).sort("trajectory_id", "rank").rows()))
    assert len(rankings) == 1
