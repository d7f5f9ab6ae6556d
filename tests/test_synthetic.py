"""The synthetic generator: MEDS validity, determinism, re-simulation, vocabulary, labs, and the oracle."""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import shutil
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal
import simple_icd_10_cm as icd
from click.testing import CliRunner

from dxr.cli import main
from dxr.errors import ConfigError, InputError
from warehouse.meds import hash_split, validate_meds_dir
from warehouse.synthetic import GENERATOR_VERSION, generate, generation_parameters, oracle
from warehouse.synthetic.conditions import (
    CHRONIC, CHRONIC_BY_NAME, CODE_OWNER, COMPLICATIONS, REASONS, codes_of, validate_definitions,
)
from warehouse.synthetic.generate import code_dictionary, patient_frame
from warehouse.synthetic.model import Rule
from warehouse.synthetic.oracle import INFORMATION, encounter_probabilities, oracles, record_state
from warehouse.synthetic.realism import (
    REALISM_BANDS, band_statistics, diagnosis_encounters, final_encounter_cohort, mean_recall, realism_report,
    warehouse_realism,
)
from warehouse.synthetic.simulate import DIAGNOSIS, EncounterModel, draw_encounter, simulate_patient, stream

SEED = 7
PATIENTS = 300


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic") / "meds"
    generate(out, PATIENTS, SEED, shard_size=100)
    return out


@pytest.fixture(scope="module")
def events(dataset) -> pl.DataFrame:
    return pl.read_parquet(dataset / "data" / "*.parquet")


@pytest.fixture(scope="module")
def cohort(dataset) -> pl.DataFrame:
    """Every patient's final encounter (all splits, for a larger sample) with ≥ 1 prior encounter."""
    dx = diagnosis_encounters(dataset)
    parts = [final_encounter_cohort(dx, SEED, split) for split in ("train", "tuning", "held_out")]
    return pl.concat(parts).sort("subject_id")


def test_definitions_are_rich_and_billable():
    conditions = len(CHRONIC) + len(REASONS) + len(COMPLICATIONS)
    assert conditions >= 40, conditions
    assert len(CODE_OWNER) >= 300, len(CODE_OWNER)
    for code, owner in CODE_OWNER.items():
        assert icd.is_valid_item(code) and icd.is_leaf(code), f"{owner}: {code}"


def test_a_bad_code_is_named_with_its_condition():
    broken = replace(CHRONIC[0], codes=(Rule({"I50": 1.0}),))  # I50 is a category, not billable
    with pytest.raises(ConfigError, match=r"'hypertension': I50 is not billable"):
        validate_definitions(chronic=(broken, *CHRONIC[1:]))
    unknown = replace(CHRONIC[0], codes=(Rule({"Q99.99": 1.0}),))
    with pytest.raises(ConfigError, match=r"'hypertension': Q99.99 is not an ICD-10-CM code"):
        validate_definitions(chronic=(unknown, *CHRONIC[1:]))


def test_dataset_is_valid_meds(dataset, events):
    info = validate_meds_dir(dataset)
    assert info.n_subjects == PATIENTS
    assert info.icd_versions == (10,)
    metadata = json.loads((dataset / "metadata" / "dataset.json").read_text())
    assert metadata["generator_version"] == GENERATOR_VERSION
    assert (metadata["synthetic_seed"], metadata["synthetic_patients"]) == (SEED, PATIENTS)
    assert generation_parameters(dataset) == {"patients": PATIENTS, "seed": SEED,
                                              "generator_version": GENERATOR_VERSION}
    codes = pl.read_parquet(dataset / "metadata" / "codes.parquet")
    billable = sum(1 for c in set(icd.get_all_codes(with_dots=False)) if icd.is_leaf(c))
    assert codes.filter(pl.col("code").str.starts_with(DIAGNOSIS)).height == billable
    missing = set(events["code"].unique()) - set(codes["code"])
    assert not missing, f"codes emitted but absent from codes.parquet: {sorted(missing)[:5]}"
    splits = pl.read_parquet(dataset / "metadata" / "subject_splits.parquet")
    assert splits.height == PATIENTS
    assert all(hash_split(s, 7) == split for s, split in splits.iter_rows())


def test_record_structure(events):
    static = events.filter(pl.col("time").is_null())
    assert sorted(static["code"].unique()) == ["GENDER//F", "GENDER//M"]
    assert static.height == PATIENTS
    assert events.filter(pl.col("code") == "MEDS_BIRTH").height == PATIENTS
    enc = events.filter(pl.col("encounter_id").is_not_null()).group_by("encounter_id").agg(
        pl.col("subject_id").n_unique().alias("subjects"),
        pl.col("time").filter(pl.col("code").str.starts_with("HOSPITAL_ADMISSION//")).alias("admit"),
        pl.col("time").filter(pl.col("code").str.starts_with("HOSPITAL_DISCHARGE//")).alias("discharge"),
        pl.col("time").filter(pl.col("code").str.starts_with(DIAGNOSIS)).max().alias("dx_time"),
        pl.col("time").min().alias("first"),
        pl.col("code").str.starts_with(DIAGNOSIS).sum().alias("n_dx"),
        (pl.col("code") == "NOTE//DISCHARGE_SUMMARY").sum().alias("notes"))
    assert enc["subjects"].max() == 1, "an encounter id is shared by two subjects"
    assert enc["n_dx"].min() >= 1, "an encounter without a diagnosis"
    assert (enc["admit"].list.len() == 1).all() and (enc["discharge"].list.len() == 1).all()
    assert (enc["notes"] == 1).all()
    enc = enc.with_columns(pl.col("admit").list.first(), pl.col("discharge").list.first())
    assert (enc["first"] == enc["admit"]).all(), "an event precedes its encounter's admission"
    assert (enc["dx_time"] == enc["discharge"]).all(), "diagnoses must be stamped at discharge"
    died = events.filter(pl.col("code") == "HOSPITAL_DISCHARGE//DIED")["subject_id"]
    deaths = events.filter(pl.col("code") == "MEDS_DEATH")["subject_id"]
    assert set(died) <= set(deaths)
    assert deaths.is_unique().all()


def test_notes_describe_their_own_encounter(events):
    notes = events.filter(pl.col("code") == "NOTE//DISCHARGE_SUMMARY").head(50)
    dx = events.filter(pl.col("code").str.starts_with(DIAGNOSIS))
    for eid, text in notes.select("encounter_id", "text_value").iter_rows():
        first = dx.filter(pl.col("encounter_id") == eid)["code"][0].removeprefix(DIAGNOSIS)
        assert icd.get_description(first) in text, (eid, first)


def test_same_seed_is_byte_identical_and_other_seed_differs(dataset, tmp_path):
    again = tmp_path / "again"
    generate(again, PATIENTS, SEED, shard_size=100, workers=1)
    for shard in sorted((dataset / "data").glob("*.parquet")):
        assert shard.read_bytes() == (again / "data" / shard.name).read_bytes(), shard.name
    for name in ("codes.parquet", "subject_splits.parquet"):
        assert (dataset / "metadata" / name).read_bytes() == (again / "metadata" / name).read_bytes()
    other = tmp_path / "other"
    generate(other, PATIENTS, SEED + 1, shard_size=100, workers=2)  # also exercises the process pool
    assert (dataset / "data" / "00000.parquet").read_bytes() != (other / "data" / "00000.parquet").read_bytes()


# SHA-256 of the rows of PATIENTS patients at SEED, per generator version. `dxr demo` and `synthetic_is_current` reuse
# a registered dataset whose version matches, so output that changes under the same version would go unnoticed.
EVENTS_DIGEST = {"synthetic-1.2.0": "59d469eb586de6eca67ac606a49373220a127c60f9966dd6ecf824bdf978563c"}


def test_changed_output_bumps_the_generator_version(events):
    digest = hashlib.sha256()
    # Lab values to 6 significant digits: a last-bit difference of another platform's libm is no change of generator.
    for row in events.with_columns(pl.col("numeric_value").map_elements(lambda v: f"{v:.6g}", pl.String)).iter_rows():
        digest.update(repr(row).encode())
    assert EVENTS_DIGEST.get(GENERATOR_VERSION) == digest.hexdigest(), (
        f"the generator's output changed under {GENERATOR_VERSION}: bump GENERATOR_VERSION in "
        f"warehouse/synthetic/generate.py and record {digest.hexdigest()} for it in EVENTS_DIGEST")


def test_rerun_over_a_larger_run_leaves_no_stale_shard(tmp_path):
    generate(tmp_path, 30, SEED, shard_size=10)
    generate(tmp_path, 15, SEED, shard_size=10)
    assert sorted(p.name for p in (tmp_path / "data").glob("*.parquet")) == ["00000.parquet", "00001.parquet"]
    assert validate_meds_dir(tmp_path).n_subjects == 15


def test_synth_without_a_terminal_says_each_tenth_of_the_patients_written(tmp_path, monkeypatch):
    # 100,000 patients take about a minute; the bar showed only on a terminal, so a cron job's log (or a captured run,
    # as here) said nothing until the dataset was registered. 20 shards of 5 patients: a line per tenth, not per shard.
    monkeypatch.setenv("DXR_SYNTH__SHARD_SIZE", "5")
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "synth", "--patients", "100", "--seed", "7"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert [re.sub(r"in \d+\.\d s$", "in S s", line) for line in result.stderr.splitlines()] == [
        f"synthetic: {n}/100 patients written ({n}%) in S s" for n in range(10, 101, 10)]
    assert result.stdout.startswith("dataset synthetic: 100 patients, ")


def test_generating_on_a_terminal_draws_its_bar_and_logs_no_line(tmp_path, monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, lines = Terminal(), []
    monkeypatch.setattr(sys, "stderr", terminal)
    generate(tmp_path, 20, SEED, shard_size=5, progress=True, log=lines.append)
    assert lines == []
    assert "synthetic: 100%" in terminal.getvalue() and "20/20" in terminal.getvalue()


def test_one_patient_resimulated_alone_equals_its_generated_record(events):
    for sid in (1, 57, 213):
        alone = patient_frame(SEED, [sid]).sort("time", "code", "numeric_value", nulls_last=False)
        stored = events.filter(pl.col("subject_id") == sid).sort("time", "code", "numeric_value", nulls_last=False)
        assert alone.equals(stored), f"subject {sid} differs when re-simulated alone"


def test_labs_track_the_latent_state(events):
    dx = events.filter(pl.col("code").str.starts_with(DIAGNOSIS))
    diabetic = set(dx.filter(pl.col("code").str.contains(r"//E1[01]\d*$"))["subject_id"])
    hba1c = events.filter(pl.col("code") == "LAB//HbA1c//%").with_columns(
        pl.col("subject_id").is_in(list(diabetic)).alias("diabetic")).group_by("diabetic") \
        .agg(pl.col("numeric_value").mean())
    means = dict(hba1c.iter_rows())
    assert means[True] > means[False] + 1.0, means
    advanced = set(dx.filter(pl.col("code").str.contains(r"//N18[456]$"))["encounter_id"])
    egfr = events.filter(pl.col("code") == "LAB//eGFR//mL/min/1.73m2").with_columns(
        pl.col("encounter_id").is_in(list(advanced)).alias("advanced")).group_by("advanced") \
        .agg(pl.col("numeric_value").mean())
    means = dict(egfr.iter_rows())
    assert means[True] < 30 < means[False], means
    failing = set(dx.filter(pl.col("code").str.contains(r"//I50"))["encounter_id"])
    bnp = events.filter(pl.col("code") == "LAB//BNP//pg/mL").with_columns(
        pl.col("encounter_id").is_in(list(failing)).alias("hf")).group_by("hf").agg(pl.col("numeric_value").median())
    means = dict(bnp.iter_rows())
    assert means[True] > 3 * means[False], means


def test_oracle_probabilities_are_valid_and_sorted(dataset, cohort):
    probs = oracle(dataset, cohort, harmonize=None, draws=200, top=100)
    assert set(probs["trajectory_id"]) == set(cohort["trajectory_id"])
    assert probs["probability"].min() > 0 and probs["probability"].max() <= 1
    for _, group in probs.group_by("trajectory_id"):
        p = group["probability"].to_list()
        assert p == sorted(p, reverse=True) and len(p) <= 100
    assert probs["code"].str.starts_with(DIAGNOSIS).all()


def test_oracle_in_worker_processes_equals_the_oracle_in_one(dataset, cohort, monkeypatch):
    oracle_module = importlib.import_module("warehouse.synthetic.oracle")  # the package exports the function

    sample = cohort.head(40)
    serial = oracle(dataset, sample, harmonize=None, draws=20)
    monkeypatch.setattr(oracle_module, "PARALLEL_FROM", 1)  # large cohorts are split across two processes
    monkeypatch.setattr(oracle_module.os, "cpu_count", lambda: 2)  # which a one-core machine would not start
    assert_frame_equal(oracle(dataset, sample, harmonize=None, draws=20), serial)


def test_oracle_mass_matches_the_realized_target_size(dataset, cohort):
    """Σ_code P(code ∈ Y) is the expected target size: it must match the realized sizes on average."""
    probs = oracle(dataset, cohort, harmonize=None, draws=200, top=1000)
    expected = probs.group_by("trajectory_id").agg(pl.col("probability").sum())["probability"].mean()
    dx = diagnosis_encounters(dataset)
    realized = dx.join(cohort.select("subject_id", pl.col("target_encounter_id").alias("encounter_id")),
                       on=["subject_id", "encounter_id"]).group_by("encounter_id").len()["len"].mean()
    assert abs(expected - realized) / realized < 0.1, (expected, realized)


def test_oracle_never_reads_the_target_encounter(dataset, cohort, tmp_path):
    """Deleting the target encounters' events from the data leaves the oracle's output unchanged."""
    sample = cohort.head(25)
    before = oracle(dataset, sample, harmonize=None, draws=50)
    stripped = tmp_path / "stripped"
    shutil.copytree(dataset, stripped)
    targets = sample["target_encounter_id"].to_list()
    for shard in (stripped / "data").glob("*.parquet"):
        frame = pl.read_parquet(shard)
        frame.filter(~pl.col("encounter_id").is_in(targets) | pl.col("encounter_id").is_null()).write_parquet(shard)
    after = oracle(stripped, sample, harmonize=None, draws=50)
    assert before.equals(after)


def test_oracle_is_unchanged_when_the_target_draw_is_redrawn(cohort):
    """Same latent history, a different realized target encounter: the oracle's estimate is the same."""
    changed = 0
    for sid, eid in cohort.head(40).select("subject_id", "target_encounter_id").iter_rows():
        k = eid - sid * 1000
        real = simulate_patient(SEED, sid, capture=frozenset({k}))
        other = simulate_patient(SEED, sid, capture=frozenset({k}), redraw={k: "alternative"})
        (state_a, t_a), (state_b, t_b) = real.captured[k], other.captured[k]
        assert t_a == t_b and state_a.conds == state_b.conds
        changed += real.encounters[k].draw.codes != other.encounters[k].draw.codes
        assert encounter_probabilities(SEED, sid, k, state_a, t_a, 50) == \
            encounter_probabilities(SEED, sid, k, state_b, t_b, 50)
    assert changed >= 20, "redrawing the target encounter should usually change its codes"


def test_the_oracle_prepares_a_target_encounter_once_and_draws_as_before(monkeypatch):
    """Each of the oracle's 200 draws of a target encounter recomputed its tokens, reason weights and coding rules,
    most of a synthetic cohort build's time; now one `EncounterModel` per encounter serves them all. The draws are
    unchanged: the values below are those of the unprepared draw (a delivery with its weeks-of-gestation code, a
    patient with 11 conditions), and a model reused for many draws draws as a fresh one on the same stream."""
    simulate = importlib.import_module("warehouse.synthetic.simulate")
    weights, prepared = simulate.reason_weights, []
    monkeypatch.setattr(simulate, "reason_weights", lambda *args: prepared.append(args) or weights(*args))
    assert simulate_patient(SEED, 36).encounters[2].draw.codes == (
        "O82", "Z37.0", "O99.02", "Z3A.34", "O99.334", "O99.333", "K59.09")
    expected = {
        36: (2, 1224, [("Z370", 194), ("Z3A34", 107), ("O99334", 91), ("O99333", 67), ("O1404", 59)]),
        57: (7, 2176, [("F319", 134), ("I129", 126), ("I350", 115), ("E1122", 112), ("I2510", 100)]),
    }
    for sid, (k, total, top) in expected.items():
        state, t = simulate_patient(SEED, sid, capture=frozenset({k}), stop_after=k).captured[k]
        prepared.clear()
        counts = encounter_probabilities(SEED, sid, k, state, t, 200)
        assert len(prepared) == 1
        assert sum(counts.values()) == total
        assert sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:5] == [(DIAGNOSIS + c, n) for c, n in top]
        model, reused, fresh = EncounterModel(state, t), stream(SEED, sid, "x"), stream(SEED, sid, "x")
        assert [model.draw(reused) for _ in range(100)] == [draw_encounter(state, t, fresh) for _ in range(100)]


def test_record_state_keeps_exactly_the_conditions_the_record_reveals(cohort):
    dropped = kept = 0
    for sid, eid in cohort.head(60).select("subject_id", "target_encounter_id").iter_rows():
        k = eid - sid * 1000
        patient = simulate_patient(SEED, sid, capture=frozenset({k}), stop_after=k)
        state, _ = patient.captured[k]
        earlier = patient.encounters[:k]
        codes = {c for e in earlier for c in e.draw.codes}
        meds = {m for e in earlier for m in e.outcome.medications}
        revealed = record_state(state, earlier)
        for name, cond in state.conds.items():
            evidence = bool(set(codes_of(CHRONIC_BY_NAME[name])) & codes
                            or {m for _, m in CHRONIC_BY_NAME[name].meds} & meds)
            assert (name in revealed.conds) == evidence, name
            if evidence:
                assert revealed.conds[name] == cond
        if "pregnancy" not in revealed.conds:
            assert revealed.pending == "" and revealed.due == float("inf")
        dropped += len(state.conds) - len(revealed.conds)
        kept += len(revealed.conds)
    assert dropped > 0 and kept > dropped, (dropped, kept)


def test_record_oracle_differs_only_where_the_record_hides_a_condition(dataset, cohort):
    sample = cohort.head(30)
    latent = oracle(dataset, sample, harmonize=None, draws=50, top=1000)
    record = oracle(dataset, sample, harmonize=None, draws=50, top=1000, information="record")
    differs = 0
    for tid, sid, eid in sample.select("trajectory_id", "subject_id", "target_encounter_id").iter_rows():
        k = eid - sid * 1000
        patient = simulate_patient(SEED, sid, capture=frozenset({k}), stop_after=k)
        state, _ = patient.captured[k]
        hidden = len(record_state(state, patient.encounters[:k]).conds) < len(state.conds)
        same = latent.filter(pl.col("trajectory_id") == tid).equals(record.filter(pl.col("trajectory_id") == tid))
        assert same or hidden, tid
        differs += not same
    assert differs > 0
    with pytest.raises(InputError, match="information='posterior'"):
        oracle(dataset, sample, harmonize=None, information="posterior")


def test_both_oracles_in_one_pass_equal_each_drawn_on_its_own(dataset, cohort):
    # The build draws both oracles from one re-simulation of each patient, and where the record reveals every
    # condition it takes the record oracle's counts from the latent one's: neither may change a bit of either table.
    to_category = (lambda codes: sorted({c[:len(DIAGNOSIS) + 3] for c in codes}))
    sample = cohort.head(40)
    revealing = set()
    for harmonize in (None, to_category):
        together = dict(oracles(dataset, sample, harmonize, draws=40, top=12))
        for information in INFORMATION:
            rows = []
            for tid, sid, eid in sample.select("trajectory_id", "subject_id", "target_encounter_id").iter_rows():
                k = eid - sid * 1000
                patient = simulate_patient(SEED, sid, capture=frozenset({k}), stop_after=k)
                state, t = patient.captured[k]
                if information == "record":
                    revealed = record_state(state, patient.encounters[:k])
                    if len(revealed.conds) == len(state.conds):
                        revealing.add(tid)
                    state = revealed
                counts = encounter_probabilities(SEED, sid, k, state, t, 40, harmonize)
                rows += [(tid, code, n / 40) for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:12]]
            alone = pl.DataFrame(rows, schema={"trajectory_id": pl.String, "code": pl.String,
                                               "probability": pl.Float64}, orient="row")
            assert together[information].equals(alone.sort("trajectory_id", "probability", "code",
                                                           descending=[False, True, False])), (information, harmonize)
    assert 0 < len(revealing) < sample.height  # both kinds of trajectory: the shared counts and the record's own


def test_oracle_harmonizes_codes(dataset, cohort):
    to_category = (lambda codes: sorted({c[:len(DIAGNOSIS) + 3] for c in codes}))
    sample = cohort.head(10)
    native = oracle(dataset, sample, harmonize=None, draws=100, top=1000)
    harmonized = oracle(dataset, sample, harmonize=to_category, draws=100, top=1000)
    assert (harmonized["code"].str.len_chars() == len(DIAGNOSIS) + 3).all()
    rolled = native.with_columns(pl.col("code").str.slice(0, len(DIAGNOSIS) + 3)).group_by("trajectory_id", "code") \
        .agg(pl.col("probability").max())
    joined = harmonized.join(rolled, on=["trajectory_id", "code"], suffix="_child")
    assert joined.height == harmonized.height
    assert (joined["probability"] >= joined["probability_child"] - 1e-12).all()


def test_oracle_rejects_foreign_trajectories(dataset, cohort, tmp_path):
    row = cohort.head(1)
    shifted = row.with_columns(pl.col("cutoff_time") + pl.duration(days=3))
    with pytest.raises(InputError, match="differs from the re-simulated admission time"):
        oracle(dataset, shifted, harmonize=None, draws=10)
    with pytest.raises(InputError, match="was not written by the synthetic generator"):
        oracle(tmp_path, row, harmonize=None, draws=10)
    with pytest.raises(InputError, match="lack column"):
        oracle(dataset, row.drop("cutoff_time"), harmonize=None)


def test_code_dictionary_has_titles():
    codes = code_dictionary()
    assert codes["code"].is_unique().all()
    assert codes.filter(pl.col("code") == f"{DIAGNOSIS}E1122")["description"].item() == \
        "Type 2 diabetes mellitus with diabetic chronic kidney disease"
    assert codes.filter(pl.col("code") == "PROCEDURE//ICD//10//5A1D70Z").height == 1


@pytest.mark.slow
def test_realism_bands_on_the_default_dataset(tmp_path):
    generate(tmp_path, 5000, 7)
    report = realism_report(tmp_path, seed=7)
    assert set(REALISM_BANDS) <= set(report)
    missed = {band: report[band] for band, (low, high) in REALISM_BANDS.items() if not low <= report[band] <= high}
    assert not missed, report


def test_mean_recall_is_the_same_whatever_order_the_trajectories_come_in():
    # realism_report's targets come out of an unordered group_by: summed in their own order, the recall of 0.1, 0.2
    # and 0.3 was (0.1 + 0.2 + 0.3) / 3 in one run and (0.3 + 0.2 + 0.1) / 3, a bit smaller, in another.
    codes = [f"{DIAGNOSIS}C{i:02d}" for i in range(10)]
    ranked = {"t1": codes[:1], "t2": codes[:2], "t3": codes[:3]}
    forward = {t: set(codes) for t in ("t1", "t2", "t3")}
    backward = {t: set(codes) for t in ("t3", "t2", "t1")}
    assert mean_recall(ranked, forward) == mean_recall(ranked, backward) == (0.1 + 0.2 + 0.3) / 3


def test_band_statistics_count_distinct_target_codes_and_unowned_codes_as_one_condition():
    # a: I10 repeats its history, R69 and R05.9 are new; b: R51.9 is new. No condition owns R69, R05.9 or R51.9.
    targets = pl.DataFrame({"trajectory_id": ["a", "a", "a", "b"],
                            "code": [f"{DIAGNOSIS}I10", f"{DIAGNOSIS}R69", f"{DIAGNOSIS}R059", f"{DIAGNOSIS}R519"]})
    history = pl.DataFrame({"trajectory_id": ["a", "a", "b"],
                            "code": [f"{DIAGNOSIS}I10", f"{DIAGNOSIS}I10", f"{DIAGNOSIS}I10"]})
    stats = band_statistics(targets, history, 2.5, {"oracle": 0.8, "repeat_history": 0.6, "global_frequency": 0.2})
    assert list(stats) == list(REALISM_BANDS)
    assert stats == {"mean_target_size": 2.0, "mean_prior_encounters": 2.5, "new_onset_share": 0.75,
                     "oracle_r20": 0.8, "repeat_history_to_oracle": 0.6 / 0.8, "global_frequency_to_oracle": 0.25,
                     "max_condition_share": 0.75}


def test_warehouse_realism_reads_one_split_of_the_cohort_and_the_runs_r20(wh):
    """Held_out t1 and t2 count; train t3, other runs' metrics, other k and subsets, and non-diagnosis codes do not."""
    cohort = "c1"
    wh.write("trajectories", pl.DataFrame({
        "cohort_id": cohort, "trajectory_id": ["t1", "t2", "t3"], "subject_id": [1, 2, 3],
        "target_encounter_id": [11, 21, 31], "cutoff_time": [datetime(2020, 1, 1)] * 3,
        "split": ["held_out", "held_out", "train"], "shard": [0, 0, 1], "n_prior_encounters": [2, 5, 9],
        "birth_time_imputed": False}),
        cohort_id=cohort)
    # hypertension owns I10 and I13.0, hyperlipidemia E78.5; no condition owns R69.
    wh.write("targets", pl.DataFrame({
        "cohort_id": cohort, "trajectory_id": ["t1", "t1", "t1", "t2", "t2", "t3"],
        "code": [f"{DIAGNOSIS}{c}" for c in ("I10", "E785", "R69", "I10", "I130", "E785")]}), cohort_id=cohort)
    wh.write("pretarget_events", pl.DataFrame({
        "cohort_id": cohort, "trajectory_id": ["t1", "t1", "t2", "t2", "t3"], "subject_id": [1, 1, 2, 2, 3],
        "time": [datetime(2019, 1, 1)] * 5,
        "code": [f"{DIAGNOSIS}I10", "LAB//E785//mg/dL", f"{DIAGNOSIS}I10", f"{DIAGNOSIS}I10", f"{DIAGNOSIS}E785"],
        "numeric_value": None, "text_value": None, "encounter_id": [10, 10, 20, 19, 30]},
        schema_overrides={"numeric_value": pl.Float32, "text_value": pl.String}), cohort_id=cohort, shard=0)
    metrics = pl.DataFrame([("r1", "oracle", "all", 20, 0.8), ("r1", "repeat_history", "all", 20, 0.4),
                            ("r1", "global_frequency", "all", 20, 0.2), ("r1", "oracle", "all", 10, 0.5),
                            ("r1", "oracle", "new_onset", 20, 0.3), ("r2", "oracle", "all", 20, 0.1)],
                           schema={"run_id": pl.String, "system": pl.String, "subset": pl.String, "k": pl.Int32,
                                   "value": pl.Float64}, orient="row")
    metrics = metrics.with_columns(cohort_id=pl.lit(cohort), metric=pl.lit("recall_at_k"),
                                   ci_low=pl.lit(None, pl.Float64), ci_high=pl.lit(None, pl.Float64),
                                   n=pl.lit(2, pl.Int64), n_runs=pl.lit(1, pl.Int32))
    for (run_id, system), partition in metrics.partition_by("run_id", "system", as_dict=True).items():
        wh.write("metrics", partition, run_id=run_id, system=system)
    assert warehouse_realism(wh, cohort, "r1") == {
        "mean_target_size": 2.5, "mean_prior_encounters": 3.5, "new_onset_share": 0.6, "oracle_r20": 0.8,
        "repeat_history_to_oracle": 0.5, "global_frequency_to_oracle": 0.25, "max_condition_share": 0.6}


def test_docs_page_matches_the_definitions():
    from warehouse.synthetic.docs import PAGE, render

    assert PAGE.read_text() == render(), "docs/synthetic.md is stale: run python -m warehouse.synthetic.docs"


def test_coding_is_clinically_coherent(events):
    """Sex-specific codes match the sex; one hypertension code per stay; acute-on-chronic replaces chronic HF."""
    sex = events.filter(pl.col("code").str.starts_with("GENDER//")).select(
        "subject_id", pl.col("code").str.strip_prefix("GENDER//").alias("sex"))
    dx = events.filter(pl.col("code").str.starts_with(DIAGNOSIS)).select(
        "subject_id", "encounter_id",
        pl.col("code").str.strip_prefix(DIAGNOSIS).alias("icd")).join(sex, on="subject_id")
    female_only = dx.filter(pl.col("icd").str.contains(r"^(O|Z3A|Z37|Z33)"))
    male_only = dx.filter(pl.col("icd").str.contains(r"^(C61|N40|Z85\.?46)"))
    assert female_only.height > 0 and (female_only["sex"] == "F").all()
    assert male_only.height > 0 and (male_only["sex"] == "M").all()
    per_stay = dx.group_by("encounter_id").agg(
        pl.col("icd").str.contains(r"^I1[0-3]").sum().alias("hypertension"),
        (pl.col("icd").str.contains(r"^I50[234]3$").any() & pl.col("icd").str.contains(r"^I50[234]2$").any())
        .alias("acute_and_chronic_hf"))
    assert per_stay["hypertension"].max() == 1
    assert not per_stay["acute_and_chronic_hf"].any()


def test_invalid_dataset_json_is_a_one_line_error_naming_the_file(tmp_path):
    generate(tmp_path, 12, SEED, shard_size=10)
    (tmp_path / "metadata" / "dataset.json").write_text('{"dataset_name": "x",}')
    with pytest.raises(InputError,
                       match=r"dataset\.json: not valid JSON \(.* at line 1 column \d+\): fix it or remove"):
        validate_meds_dir(tmp_path)
    (tmp_path / "metadata" / "dataset.json").write_text('{"dataset_name": "x')  # json's message ends with "at"
    with pytest.raises(InputError) as raised:
        validate_meds_dir(tmp_path)
    assert str(raised.value) == (f"{tmp_path / 'metadata' / 'dataset.json'}: not valid JSON (Unterminated string "
                                 "starting at line 1 column 18): fix it or remove it (the file is optional)")


# ---- validate_meds_dir: each bad event, a copied shard or a bad split name is one line naming it ----------

def small_dataset(root: Path) -> Path:
    """Twelve patients in two shards; returns the first shard."""
    generate(root, 12, SEED, shard_size=10)
    return root / "data" / "00000.parquet"


def set_value(shard: Path, column: str, row: int, value) -> None:
    """Overwrite one value (0-based row) of a shard, keeping the column's type."""
    table = pq.read_table(shard)
    values = table[column].to_pylist()
    values[row] = value
    field = table.schema.field(column)
    pq.write_table(table.set_column(table.schema.get_field_index(column), field, pa.array(values, field.type)), shard)


def first_diagnosis(shard: Path) -> tuple[int, str]:
    codes = pq.read_table(shard)["code"].to_pylist()
    row = next(i for i, code in enumerate(codes) if code.startswith(DIAGNOSIS))
    return row, codes[row]


def one_line_error(root: Path) -> str:
    with pytest.raises(InputError) as raised:
        validate_meds_dir(root)
    text = str(raised.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("column, message", [
    ("subject_id", "00000.parquet, row 4: subject_id is empty: every MEDS event needs its subject"),
    ("code", "00000.parquet, row 4: code is empty: every MEDS event needs a code"),
])
def test_an_event_without_subject_or_code_is_named_by_file_and_row(column, message, tmp_path):
    set_value(small_dataset(tmp_path), column, 3, None)
    assert one_line_error(tmp_path).endswith(message)


def test_a_diagnosis_without_encounter_is_history_only_and_counted(tmp_path):
    shard = small_dataset(tmp_path / "meds")
    row, code = first_diagnosis(shard)
    set_value(shard, "encounter_id", row, None)
    assert validate_meds_dir(tmp_path / "meds").n_diagnoses_without_encounter == 1
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path / "wh"), "ingest", "meds", str(tmp_path / "meds"),
                                       "--name", "loose"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "note: 1 diagnosis events have no encounter_id; they stay in patients' histories" in result.output


def test_a_lower_case_diagnosis_code_gets_the_exact_code_to_write(tmp_path):
    shard = small_dataset(tmp_path)
    row, code = first_diagnosis(shard)
    set_value(shard, "code", row, code.lower())
    assert one_line_error(tmp_path).endswith(
        f"00000.parquet, row {row + 1}: diagnosis code {code.lower()!r} is not upper case: write it {code!r} "
        "(prefix DIAGNOSIS//ICD//10//)")


def test_an_encounter_id_of_two_patients_is_refused(tmp_path):
    shard = small_dataset(tmp_path)
    table = pq.read_table(shard)
    subjects, encounters = table["subject_id"].to_pylist(), table["encounter_id"].to_pylist()
    row = next(i for i, e in enumerate(encounters) if e is not None and subjects[i] != subjects[0])
    first_encounter = next(e for e in encounters if e is not None)
    set_value(shard, "encounter_id", row, first_encounter)
    assert one_line_error(tmp_path).endswith(
        f"00000.parquet, row {row + 1}: encounter_id {first_encounter} belongs to subjects {subjects[0]} and "
        f"{subjects[row]}: encounter ids must be unique across the dataset (e.g. the admission id); number them "
        "per dataset, not per patient")


@pytest.mark.parametrize("rewrite", ["byte copy", "same rows, other compression"])
def test_a_copied_shard_is_refused(rewrite, tmp_path):
    shard = small_dataset(tmp_path)
    copy = shard.with_name("00000_copy.parquet")
    if rewrite == "byte copy":
        shutil.copy(shard, copy)
    else:
        pq.write_table(pq.read_table(shard), copy, compression="snappy")
    rows = pq.ParquetFile(shard).metadata.num_rows
    assert one_line_error(tmp_path) == (f"{copy}: the same {rows:,} events as {shard} (a copied shard): remove one "
                                        "of the two; every event must be stored once")


def test_a_shard_with_as_many_rows_but_other_events_is_not_a_copy(tmp_path):
    shard = small_dataset(tmp_path)
    other = shard.with_name("00002.parquet")
    shutil.copy(shard, other)
    set_value(other, "subject_id", 0, 999)
    assert validate_meds_dir(tmp_path).n_subjects == 13


@pytest.mark.parametrize("name", ["test", None])
def test_an_unknown_split_name_is_refused_when_the_dataset_is_validated(name, tmp_path):
    small_dataset(tmp_path)
    path = tmp_path / "metadata" / "subject_splits.parquet"
    set_value(path, "split", 1, name)
    assert one_line_error(tmp_path) == (f"{path}, row 2: split {name!r} is not one of train, tuning, held_out: "
                                        "rename it to one of these")


def test_a_subject_listed_in_two_splits_is_refused(tmp_path):
    # Its full record (target included) would be training data while its target is evaluated.
    small_dataset(tmp_path)
    path = tmp_path / "metadata" / "subject_splits.parquet"
    splits = pq.read_table(path)
    first_id, first_split = splits["subject_id"][0].as_py(), splits["split"][0].as_py()
    other = "held_out" if first_split == "train" else "train"
    pq.write_table(pa.concat_tables([splits, pa.table({"subject_id": [first_id], "split": [other]},
                                                      schema=splits.schema)]), path)
    assert one_line_error(tmp_path) == (f"{path}, row {splits.num_rows + 1}: subject {first_id} is listed again (first "
                                        f"at row 1, split {first_split!r}): list every subject once")


def test_an_encounter_id_that_is_not_an_integer_is_refused_at_ingest(tmp_path):
    shard = small_dataset(tmp_path)
    table = pq.read_table(shard)
    as_text = pa.array([None if e is None else f"V{e}" for e in table["encounter_id"].to_pylist()], pa.string())
    pq.write_table(table.set_column(table.schema.get_field_index("encounter_id"), "encounter_id", as_text), shard)
    assert one_line_error(tmp_path) == (f"{shard}: column 'encounter_id' is string, not an integer: number the "
                                        "encounters (e.g. map each visit id to an integer) and write them as int64")


def test_empty_shards_are_not_copies_of_each_other(tmp_path):
    shard = small_dataset(tmp_path)
    empty = pq.read_table(shard).slice(0, 0)
    for split in ("tuning", "held_out"):  # splits without patients, as an ETL may write them
        (tmp_path / "data" / split).mkdir()
        pq.write_table(empty, tmp_path / "data" / split / "0.parquet")
    assert validate_meds_dir(tmp_path).n_subjects == 12



def test_split_subject_ids_that_are_not_integers_are_refused_when_the_dataset_is_validated(tmp_path):
    # They could never match the data's int64 subject_id: the cohort build failed on the cast.
    small_dataset(tmp_path)
    path = tmp_path / "metadata" / "subject_splits.parquet"
    splits = pq.read_table(path)
    as_text = pa.array([f"S{s}" for s in splits["subject_id"].to_pylist()], pa.string())
    pq.write_table(splits.set_column(0, "subject_id", as_text), path)
    assert one_line_error(tmp_path) == (f"{path}: column 'subject_id' is String, not an integer: write the "
                                        "subject ids of data/ (int64)")


def test_a_dataset_json_that_is_not_an_object_is_a_one_line_error(tmp_path):
    small_dataset(tmp_path)
    path = tmp_path / "metadata" / "dataset.json"
    path.write_text("[1, 2]")
    assert one_line_error(tmp_path) == (f"{path}: a JSON list, not an object of dataset fields (dataset_name, …): "
                                        "fix it or remove it (the file is optional)")


def test_shards_written_by_polars_or_pandas_pass_whatever_arrow_string_type_they_record(tmp_path):
    # Parquet stores all strings alike; polars records `code` as large_string, pandas `text_value` as string.
    shard = small_dataset(tmp_path)
    expected = validate_meds_dir(tmp_path)
    pl.read_parquet(shard).write_parquet(shard)
    other = shard.with_name("00001.parquet")
    table = pq.read_table(other)
    pq.write_table(table.cast(pa.schema([f.with_type(pa.string()) if f.name == "text_value" else f
                                         for f in table.schema])), other)
    assert (pq.read_schema(shard).field("code").type, pq.read_schema(other).field("text_value").type) == (
        pa.large_string(), pa.string())
    info = validate_meds_dir(tmp_path)
    assert (info.n_subjects, info.n_events, info.icd_versions) == (
        expected.n_subjects, expected.n_events, expected.icd_versions)


def test_a_dotted_diagnosis_code_gets_the_exact_code_to_write(tmp_path):
    shard = small_dataset(tmp_path)
    row, code = first_diagnosis(shard)
    prefix, raw = code.rsplit("//", 1)
    set_value(shard, "code", row, f"{prefix}//{raw[:3]}.{raw[3:]}")
    assert one_line_error(tmp_path).endswith(
        f"00000.parquet, row {row + 1}: diagnosis code '{prefix}//{raw[:3]}.{raw[3:]}' has a dot: write it {code!r} "
        "(MEDS ICD codes are written without it)")


def test_a_shard_in_the_pre_0_3_meds_layout_is_told_which_columns_to_rename(tmp_path):
    # MEDS 0.3 renamed patient_id to subject_id and timestamp to time.
    shard = small_dataset(tmp_path)
    table = pq.read_table(shard)
    pq.write_table(table.rename_columns(["patient_id" if n == "subject_id" else n for n in table.column_names]), shard)
    assert one_line_error(tmp_path) == (f"{shard}: missing column 'subject_id' (int64): this is the MEDS layout "
                                        "before 0.3; rename patient_id to subject_id (and timestamp to time)")
