"""The information boundary: sentinels planted in target encounters never reach forecasting artifacts,
and the harness demonstrably catches a planted leak."""

from __future__ import annotations

import polars as pl
import pytest

import warehouse.cohorts as cohorts
from tasks.forecast import forecast_shard, fitted_forecaster
from tests.conftest import cohort_inputs, write_tiny_meds
from tests.sentinel import PHRASE_PREFIX, LeakError, assert_no_leak, forecast_store_texts, plant_sentinels
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import ingest_meds


def build_and_forecast(wh, meds_dir, target="final"):
    ingest_meds(wh, meds_dir, "planted")
    cid = build_cohort(wh, "planted", "default", CohortOptions(target=target), seed=7)["cohort_id"]
    fitted_forecaster.cache_clear()
    for system in ("global_frequency", "repeat_history"):
        model = fitted_forecaster(str(wh.root), cid, system)
        trajectories, pretarget = cohort_inputs(wh, cid)
        ranked, status = forecast_shard(model, trajectories, pretarget, 20, "sentinel-run", cid)
        wh.write("rankings", ranked, run_id="sentinel-run", system=system, shard=0)
        wh.write("ranking_status", status, run_id="sentinel-run", system=system, shard=0)
    return cid


@pytest.mark.parametrize("target", ["final", "every"])
def test_no_sentinel_reaches_the_forecasting_store(wh_vocab, tmp_path, target):
    meds_dir = write_tiny_meds(tmp_path / "meds")
    sentinels = plant_sentinels(meds_dir)
    assert len(sentinels.encounters) == 3  # final encounters of the non-train patients 1, 3, 4
    cid = build_and_forecast(wh_vocab, meds_dir, target)
    # The targets (gold) do hold the sentinels: the harness planted where evaluation will look.
    gold_codes = wh_vocab.read("targets", cohort_id=cid)["code"].to_list()
    assert set(sentinels.codes) & set(gold_codes)
    assert_no_leak(sentinels, forecast_store_texts(wh_vocab.forecast_dir))


def test_the_title_of_a_code_only_target_encounters_hold_never_reaches_the_forecasting_store(wh_vocab, tmp_path):
    from meds import code_metadata_filepath

    meds_dir = write_tiny_meds(tmp_path / "meds")
    sentinels = plant_sentinels(meds_dir)
    # The planted lab sits in held-out target encounters only: its title would say that they had it.
    sentinels.phrases.append(f"{PHRASE_PREFIX}title")
    pl.DataFrame({"code": ["LAB//SENTINEL//x", "LAB//HBA1C//%"],
                  "description": [f"{PHRASE_PREFIX}title lab", "Haemoglobin A1c"]}).write_parquet(
        meds_dir / code_metadata_filepath)
    cid = build_and_forecast(wh_vocab, meds_dir)
    titles = wh_vocab.read("code_titles", cohort_id=cid)
    assert titles["title"].to_list() == ["Haemoglobin A1c"]  # the table is written, with the history's lab
    assert_no_leak(sentinels, forecast_store_texts(wh_vocab.forecast_dir))


@pytest.mark.parametrize("forgotten, leaked", [
    # That the target encounter's events can be time-stamped before its admission.
    (("AND (e.encounter_id IS NULL OR e.encounter_id <> t.target_encounter_id)",
      "AND (s.start_time IS NULL OR s.start_time < t.cutoff_time)"), "prelab"),
    # That a note with neither a time nor an encounter is placed before no cutoff.
    ((f"AND NOT (e.time IS NULL AND e.encounter_id IS NULL AND {cohorts.clinical_sql('e.code')})",), "loose"),
])
def test_harness_catches_a_leaky_pretarget_view(wh_vocab, tmp_path, monkeypatch, forgotten, leaked):
    meds_dir = write_tiny_meds(tmp_path / "meds")
    sentinels = plant_sentinels(meds_dir)
    honest = cohorts.pretarget_sql

    def leaky(events, trajectories, encounter_starts):
        sql = honest(events, trajectories, encounter_starts)
        for condition in forgotten:
            assert condition in sql
            sql = sql.replace(condition, "")
        return sql

    monkeypatch.setattr(cohorts, "pretarget_sql", leaky)
    build_and_forecast(wh_vocab, meds_dir)
    with pytest.raises(LeakError, match=f"pretarget_events.*QUILLWORT-ZEPHYR-0-{leaked}"):
        assert_no_leak(sentinels, forecast_store_texts(wh_vocab.forecast_dir))


def test_harness_catches_a_leaked_code_in_any_artifact(tmp_path):
    sentinels = plant_sentinels(write_tiny_meds(tmp_path / "meds"))
    raw = sentinels.codes[0].rsplit("//", 1)[-1]
    with pytest.raises(LeakError, match="prompt"):
        assert_no_leak(sentinels, {"prompt": [f"History: ... consider {raw[:3]}.{raw[3:]} next"]})
