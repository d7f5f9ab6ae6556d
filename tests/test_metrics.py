"""Evaluation metrics on tiny hand-written warehouses: exact values, invariants, refusals, SQL cross-check."""

from __future__ import annotations

import importlib.util
import json
from datetime import datetime
from fractions import Fraction
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dxr.errors import InputError, NotFoundError
from tasks.evaluate import (NATURAL_K, SUBSETS, Counts, RunData, bootstrap_weights, estimate, evaluate,
                            evaluate_repeated, evaluate_run, label_targets, load_run, sign_test, system_counts)
from tasks.forecast import check_rerun, forecast_config
from warehouse.runs import record_run
from warehouse.schemas import METRICS
from warehouse.store import Warehouse

COHORT = "c1"


def dx(code: str, version: int = 10) -> str:
    return f"DIAGNOSIS//ICD//{version}//{code}"


A, B, C, D, E, X, Y = dx("A01"), dx("B02"), dx("250", 9), dx("D04"), dx("E05"), dx("X99"), dx("Y98")
T1, T2, T3 = f"{COHORT}:1:10", f"{COHORT}:2:20", f"{COHORT}:3:30"
TARGETS = {T1: [A, B, C], T2: [A, D], T3: [E]}
# A is in T1's pre-target record, so A is `repeated` for T1 and `new_onset` for T2.
PRETARGET = {T1: [A, "LAB//glucose//mg/dL"], T2: [dx("Z00")], T3: []}
TRAIN_COUNTS = {A: 12, B: 3, D: 150}          # train encounters coding each; C and E never occur in train_events
RANKINGS = {
    "s1": {T1: [A, X, B], T2: [D, A], T3: [X, Y]},
    "s2": {T1: [B, C], T2: [X], T3: [E, X]},     # T2 is short and says so below
}
STATUS = {("s2", T2): "short"}


def write_cohort(wh: Warehouse, targets=TARGETS, pretarget=PRETARGET, train_counts=TRAIN_COUNTS) -> None:
    ids = sorted(targets)
    # Registered, as a build leaves a cohort once complete (a test's: no dataset, no seed, so no note about its build).
    wh.write("cohorts", pl.DataFrame({
        "cohort_id": COHORT, "dataset_id": "hand", "name": "hand", "target_rule": "final", "harmonization": "native",
        "min_history": 1, "created_at": datetime(2020, 1, 1), "n_trajectories": len(ids), "vocabulary_size": 0,
        "vocabulary_source": "none", "options_json": "{}", "dataset_fingerprint": None, "cut_rule_version": None},
        schema_overrides={"min_history": pl.Int32, "dataset_fingerprint": pl.String, "cut_rule_version": pl.Int32}),
        cohort_id=COHORT)
    wh.write("trajectories", pl.DataFrame({
        "cohort_id": COHORT, "trajectory_id": ids, "subject_id": [int(t.split(":")[1]) for t in ids],
        "target_encounter_id": [int(t.split(":")[2]) for t in ids], "cutoff_time": datetime(2020, 1, 1),
        "split": "held_out", "shard": 0, "n_prior_encounters": 1, "birth_time_imputed": False}), cohort_id=COHORT)
    wh.write("targets", pl.DataFrame({"cohort_id": COHORT, "trajectory_id": [t for t in ids for _ in targets[t]],
                                      "code": [c for t in ids for c in targets[t]]}), cohort_id=COHORT)
    rows = [(t, c) for t in ids for c in pretarget.get(t, [])]
    wh.write("pretarget_events", pl.DataFrame({
        "cohort_id": COHORT, "trajectory_id": [r[0] for r in rows],
        "subject_id": [int(r[0].split(":")[1]) for r in rows],
        "time": datetime(2019, 1, 1), "code": [r[1] for r in rows], "numeric_value": None, "text_value": None,
        "encounter_id": 1}, schema_overrides={"numeric_value": pl.Float32, "text_value": pl.String,
                                              "time": pl.Datetime("us"), "code": pl.String, "trajectory_id": pl.String,
                                              "subject_id": pl.Int64}), cohort_id=COHORT, shard=0)
    # A code counted n is coded once in each of encounters 0 .. n-1.
    write_train_events(wh, [(code, encounter) for code, n in train_counts.items() for encounter in range(n)])


def write_train_events(wh: Warehouse, diagnoses: list[tuple[str, int | None]]) -> None:
    """The cohort's train_events: one row per (code, encounter_id) of `diagnoses`, beside 200 lab rows."""
    rows = diagnoses + [("LAB//glucose//mg/dL", 0)] * 200
    wh.write("train_events", pl.DataFrame({
        "cohort_id": COHORT, "subject_id": 100, "time": datetime(2018, 1, 1), "code": [r[0] for r in rows],
        "numeric_value": None, "text_value": None, "encounter_id": [r[1] for r in rows]},
        schema_overrides={"numeric_value": pl.Float32, "text_value": pl.String, "encounter_id": pl.Int64}),
        cohort_id=COHORT)


def write_rankings(wh: Warehouse, run_id: str, rankings=RANKINGS, status=STATUS, padding=()) -> None:
    for system, lists in rankings.items():
        rows = [(t, r + 1, c) for t, codes in lists.items() for r, c in enumerate(codes)]
        wh.write("rankings", pl.DataFrame({
            "run_id": run_id, "cohort_id": COHORT, "system": system, "trajectory_id": [r[0] for r in rows],
            "rank": [r[1] for r in rows], "code": [r[2] for r in rows], "score": [-float(r[1]) for r in rows],
            "native": [(system, r[0], r[2]) not in padding for r in rows]}), run_id=run_id, system=system, shard=0)
        wh.write("ranking_status", pl.DataFrame({
            "run_id": run_id, "system": system, "trajectory_id": sorted(lists),
            "status": [status.get((system, t), "ok") for t in sorted(lists)], "detail": None},
            schema_overrides={"detail": pl.String}), run_id=run_id, system=system, shard=0)


@pytest.fixture
def wh(tmp_path) -> Warehouse:
    warehouse = Warehouse(tmp_path / "wh")
    write_cohort(warehouse)
    write_rankings(warehouse, "r1")
    return warehouse


def value(metrics: pl.DataFrame, system: str, metric: str, k: int, subset: str = "all") -> float:
    row = metrics.filter((pl.col("system") == system) & (pl.col("metric") == metric) & (pl.col("k") == k)
                         & (pl.col("subset") == subset))
    assert row.height == 1, (system, metric, k, subset, row)
    return row["value"].item()


def test_hand_computed_metrics_at_k2(wh):
    metrics = evaluate(wh, "r1", ks=(2,), n_boot=0).metrics
    # s1 top-2 hits: T1 {A} of 3 targets, T2 {D, A} of 2, T3 none of 1.
    assert value(metrics, "s1", "precision_at_k", 2) == pytest.approx(float((Fraction(1, 2) + 1 + 0) / 3), abs=1e-15)
    assert value(metrics, "s1", "recall_at_k", 2) == pytest.approx(float((Fraction(1, 3) + 1 + 0) / 3), abs=1e-15)
    assert value(metrics, "s1", "micro_precision", 2) == 0.5      # T=3, nK=6
    assert value(metrics, "s1", "micro_recall", 2) == 0.5         # T=3, G=6
    assert value(metrics, "s1", "micro_f1", 2) == 0.5             # 2·3/(6+6)
    assert value(metrics, "s1", "macro_f1", 2) == pytest.approx(float((Fraction(2, 5) + 1 + 0) / 3), abs=1e-15)
    # s2 is short on T2 (explicitly): hits T1 {B, C}, T2 none, T3 {E}; denominators stay K = 2.
    assert value(metrics, "s2", "precision_at_k", 2) == pytest.approx(float((1 + 0 + Fraction(1, 2)) / 3), abs=1e-15)
    assert value(metrics, "s2", "micro_f1", 2) == pytest.approx(2 * 3 / (6 + 6), abs=1e-15)
    assert value(metrics, "s2", "recall_at_k", 2) == pytest.approx(float((Fraction(2, 3) + 0 + 1) / 3), abs=1e-15)


def test_variable_cardinality_uses_list_lengths(wh):
    metrics = evaluate(wh, "r1", ks=(2,), n_boot=0).metrics
    # s1 whole lists: T1 [A, X, B] 2 hits of 3, T2 2 of 2, T3 0 of 2; Σ|C| = 7, G = 6.
    assert value(metrics, "s1", "precision_at_k", NATURAL_K) == pytest.approx((2 / 3 + 1 + 0) / 3, abs=1e-15)
    assert value(metrics, "s1", "micro_precision", NATURAL_K) == pytest.approx(4 / 7, abs=1e-15)
    assert value(metrics, "s1", "micro_f1", NATURAL_K) == pytest.approx(8 / 13, abs=1e-15)
    assert value(metrics, "s1", "macro_f1", NATURAL_K) == pytest.approx((4 / 6 + 4 / 4 + 0) / 3, abs=1e-15)
    # s2's T2 list has one code: precision 0/1 there.
    assert value(metrics, "s2", "micro_precision", NATURAL_K) == pytest.approx(3 / 5, abs=1e-15)


def test_the_metrics_table_reference_names_every_metric_subset_and_the_natural_k():
    # docs/tables.md is generated from this text: what a query on `metrics` can filter on must be in it.
    from warehouse.schemas import TABLES

    doc = TABLES["metrics"].doc
    assert f"`metric` in {{{', '.join(METRICS)}}}" in doc
    assert f"`subset` in {{{', '.join(SUBSETS)}}}" in doc
    assert f"`k` = {NATURAL_K} is the variable-cardinality version" in doc

def test_subsets_restrict_targets_and_hits(wh):
    metrics = evaluate(wh, "r1", ks=(2,), n_boot=0).metrics
    n = dict(metrics.filter((pl.col("system") == "s1") & (pl.col("metric") == "micro_recall") & (pl.col("k") == 2))
             .select("subset", "n").iter_rows())
    # icd9: only T1 has C; repeated: only T1's A; freq_0: C (T1) and E (T3); freq_100plus: D (T2).
    assert n == {"all": 3, "icd9": 1, "icd10": 3, "new_onset": 3, "repeated": 1, "freq_0": 2, "freq_1_9": 1,
                 "freq_10_99": 2, "freq_100plus": 1}
    assert value(metrics, "s1", "recall_at_k", 2, "repeated") == 1.0            # A hit in T1
    assert value(metrics, "s1", "recall_at_k", 2, "icd9") == 0.0                # C not in T1's top 2
    assert value(metrics, "s1", "precision_at_k", 2, "freq_10_99") == 0.5       # A hit in T1 and T2, K = 2
    # new_onset targets: T1 {B, C}, T2 {A, D}, T3 {E}; s1 hits T2 {D, A} only: 2·2/(3·2 + 5).
    assert value(metrics, "s1", "micro_f1", 2, "new_onset") == pytest.approx(4 / 11, abs=1e-15)
    assert value(metrics, "s2", "recall_at_k", 2, "freq_0") == 1.0              # C in T1, E in T3


def test_frequency_buckets_count_train_encounters_not_diagnosis_rows(wh):
    # A is coded twice in each of 5 train stays (a repeat, or two source codes harmonized to one): 10 rows, 5 stays;
    # B twice in each of 50 stays. C is in 9 stays and in 3 rows without an encounter, D only in 2 such rows: those
    # add nothing, as in global_frequency. Counting rows put A and C in freq_10_99, B in freq_100plus, D in freq_1_9.
    coded_twice = [(code, stay) for code, stays in ((A, 5), (B, 50)) for stay in range(stays) for _ in range(2)]
    write_train_events(wh, coded_twice + [(C, stay) for stay in range(9)] + [(C, None)] * 3 + [(D, None)] * 2)
    labelled = load_run(wh, "r1", ks=(2,)).labelled.filter(pl.col("subset").str.starts_with("freq_"))
    assert labelled.height == 6  # A is a target of T1 and T2
    assert dict(labelled.select("code", "subset").unique().iter_rows()) == {
        A: "freq_1_9", B: "freq_10_99", C: "freq_1_9", D: "freq_0", E: "freq_0"}


def test_label_targets_rule():
    targets = pl.DataFrame({"trajectory_id": ["t", "t", "t"], "code": [dx("A1"), dx("250", 9), "OTHER//x"],
                            "repeated": [False, True, False], "train_count": [0, 9, 100]})
    labelled = label_targets(targets).group_by("code").agg(pl.col("subset").sort())
    assert dict(labelled.iter_rows()) == {
        dx("A1"): sorted(["all", "icd10", "new_onset", "freq_0"]),
        dx("250", 9): sorted(["all", "icd9", "repeated", "freq_1_9"]),
        "OTHER//x": sorted(["all", "new_onset", "freq_100plus"]),
    }


def test_silently_short_ranking_is_refused(wh):
    write_rankings(wh, "r2", rankings={"s3": {T1: [A, B], T2: [A], T3: [E, X]}}, status={})
    with pytest.raises(InputError, match=f"run 'r2', system 's3', trajectory '{T2}' ranks 1 code"):
        evaluate(wh, "r2", ks=(2,), n_boot=0)


def test_a_k_above_every_list_of_a_system_names_the_longest_list_not_an_output_to_fix(wh):
    # s1's lists hold 3, 2 and 2 codes: K = 5 is above the budget it was forecast with, so the way out is a smaller
    # K or a new forecast; s2's two silent lists (T2 is explicitly short) count too.
    refusal = (f"system 's1', trajectory '{T1}' ranks 3 code\\(s\\) < K=5 .*\\(5 such lists\\): s1's lists hold at "
               "most 3 codes: evaluate with --k up to 3, or forecast s1 with --k 5 under a new run id$")
    with pytest.raises(InputError, match=refusal):
        evaluate(wh, "r1", ks=(5,), n_boot=0)
    # One list below K among longer ones is the system's output to fix.
    write_rankings(wh, "r2", rankings={"s3": {T1: [A, B, C], T2: [A], T3: [E, X, Y]}}, status={})
    with pytest.raises(InputError, match="ranks 1 code.*: fix the system's output or record its status$"):
        evaluate(wh, "r2", ks=(3,), n_boot=0)


def test_missing_trajectory_without_status_is_refused(wh):
    write_rankings(wh, "r3", rankings={"s1": {T1: [A, B], T2: [A, B], T3: [E, X]}, "s4": {T1: [A, B], T2: [A, B]}},
                   status={})
    # Without a status either, s4 never addressed T3: it was forecast on fewer trajectories than s1.
    missing = f"run 'r3': system 's4' was not forecast for 1 of the run's 3 trajectories \\(e.g. '{T3}'\\)"
    with pytest.raises(InputError, match=missing):
        evaluate(wh, "r3", ks=(2,), n_boot=0)
    # Asking for K = 1 does not make it acceptable: a missing list is short at every K...
    with pytest.raises(InputError, match=missing):
        evaluate(wh, "r3", ks=(1,), n_boot=0)
    # ...and at the natural list size, the one "K" that any list length satisfies.
    with pytest.raises(InputError, match=missing):
        evaluate(wh, "r3", ks=(), natural=True, n_boot=0)
    # A list that exists but is short without saying so is the system's output to fix.
    write_rankings(wh, "r5", status={},
                   rankings={"s1": {T1: [A, B], T2: [A, B], T3: [E, X]}, "s4": {T1: [A, B], T2: [A, B], T3: []}})
    with pytest.raises(InputError, match=f"system 's4', trajectory '{T3}' ranks 0 code\\(s\\) < 1 \\(natural"):
        evaluate(wh, "r5", ks=(), natural=True, n_boot=0)


def test_explicit_short_and_failed_are_counted(wh):
    write_rankings(wh, "r4", rankings={"s5": {T1: [A, B], T2: [], T3: [E]}},
                   status={("s5", T2): "failed", ("s5", T3): "short"}, padding={("s5", T1, B)})
    result = evaluate(wh, "r4", ks=(2,), n_boot=0)
    cov = result.coverage.filter(pl.col("k") == 2).row(0, named=True)
    assert (cov["n_short"], cov["n_failed"], cov["n_below_k"], cov["n_trajectories"]) == (1, 1, 2, 3)
    assert cov["native_share"] == pytest.approx(2 / 3)
    # Hits counted as they are: T1 {A, B}, T2 none, T3 {E}; micro-P = 3 / (3·2).
    assert value(result.metrics, "s5", "micro_precision", 2) == 0.5


def test_duplicate_codes_are_refused(wh):
    write_rankings(wh, "r5", rankings={"s6": {T1: [A, A], T2: [A, B], T3: [E, X]}}, status={})
    with pytest.raises(InputError, match=f"trajectory '{T1}' repeats code"):
        evaluate(wh, "r5", ks=(2,), n_boot=0)


def test_unknown_system_and_run(wh):
    with pytest.raises(NotFoundError, match=r"in run .r1. \(it has: s1, s2\)"):
        evaluate(wh, "r1", systems=["nope"], n_boot=0)
    with pytest.raises(NotFoundError, match="run 'zzz' has no rankings"):
        evaluate(wh, "zzz", n_boot=0)


def test_oracle_from_gold_probabilities(wh):
    wh.write("oracle_probabilities", pl.DataFrame({
        "cohort_id": COHORT, "trajectory_id": [T1, T1, T1, T2, T2, T3, T3],
        "code": [X, B, A, D, Y, E, X], "probability": [0.2, 0.5, 0.5, 0.9, 0.1, 0.3, 0.3]}), cohort_id=COHORT)
    result = evaluate(wh, "r1", ks=(2,), n_boot=0)
    # Ties broken by code: T1 → [A, B] (both hits), T2 → [D, Y], T3 → [E, X].
    assert value(result.metrics, "oracle", "micro_precision", 2) == pytest.approx(4 / 6)
    assert not wh.read("rankings").filter(pl.col("system") == "oracle").height
    assert "record_oracle" not in set(result.metrics["system"])  # no record-oracle rows for this cohort
    with pytest.raises(NotFoundError, match="no record_oracle_probabilities"):
        evaluate(wh, "r1", systems=["s1", "record_oracle"], ks=(2,), n_boot=0)
    # A trajectory the generator gave no list is explicitly short, at natural list sizes too.
    wh.write("oracle_probabilities", pl.DataFrame({"cohort_id": COHORT, "trajectory_id": [T1, T2],
                                                   "code": [A, D], "probability": [0.5, 0.9]}), cohort_id=COHORT)
    natural = evaluate(wh, "r1", ks=(), natural=True, n_boot=0)
    assert natural.coverage.filter(pl.col("system") == "oracle")["n_short"].to_list() == [1]


def test_record_oracle_from_gold_probabilities(wh):
    wh.write("record_oracle_probabilities", pl.DataFrame({
        "cohort_id": COHORT, "trajectory_id": [T1, T1, T2, T2, T3, T3],
        "code": [X, A, Y, D, X, E], "probability": [0.6, 0.5, 0.9, 0.1, 0.3, 0.2]}), cohort_id=COHORT)
    result = evaluate(wh, "r1", ks=(2,), n_boot=0)
    # T1 → [X, A] (one hit), T2 → [Y, D] (one), T3 → [X, E] (one).
    assert value(result.metrics, "record_oracle", "micro_precision", 2) == pytest.approx(3 / 6)
    assert not result.headroom["pool"].str.contains("oracle").any()  # oracles are not pooled


def test_oracle_names_are_reserved(wh):
    write_rankings(wh, "r6", rankings={"record_oracle": {T1: [A, B], T2: [A, B], T3: [E, X]}}, status={})
    with pytest.raises(InputError, match="'record_oracle': that name is reserved"):
        evaluate(wh, "r6", ks=(2,), n_boot=0)


def test_pool_oracle_headroom(wh):
    headroom = evaluate(wh, "r1", ks=(2,), n_boot=0).headroom
    row = headroom.filter((pl.col("pool") == "s1+s2") & (pl.col("metric") == "micro_precision")
                          & (pl.col("k") == 2) & (pl.col("subset") == "all")).row(0, named=True)
    # Union pools: T1 {A,X,B,C} ∩ Y = 3 → min(2,3) = 2; T2 {D,A,X} → 2; T3 {X,Y,E} → 1.
    assert row["value"] == pytest.approx(5 / 6)
    assert row["mean_pool_size"] == pytest.approx(10 / 3)


def test_pool_oracle_at_natural_list_sizes_scores_the_whole_pool(wh):
    # At K = |C| the pool oracle's list is the whole pool (s1+s2): T1 {A,X,B,C} 3 of Y {A,B,C}; T2 {D,A,X} 2 of
    # {A,D}; T3 {X,Y,E} 1 of {E}. Σ|C| = 10, Σh = 6, G = 6.
    rows = evaluate(wh, "r1", ks=(2,), n_boot=0).headroom.filter(
        (pl.col("pool") == "s1+s2") & (pl.col("k") == NATURAL_K) & (pl.col("subset") == "all"))
    assert dict(rows.select("metric", "value").iter_rows()) == pytest.approx({
        "precision_at_k": (3 / 4 + 2 / 3 + 1 / 3) / 3, "recall_at_k": 1.0, "micro_precision": 6 / 10,
        "micro_recall": 1.0, "micro_f1": 2 * 6 / (10 + 6), "macro_f1": (6 / 7 + 4 / 5 + 2 / 4) / 3}, abs=1e-15)


def test_paired_comparison_and_sign_test(wh):
    paired = evaluate(wh, "r1", ks=(2,), n_boot=200, seed=3).paired
    row = paired.filter((pl.col("system_a") == "s1") & (pl.col("system_b") == "s2") & (pl.col("subset") == "all")
                        & (pl.col("metric") == "micro_f1") & (pl.col("k") == 2)).row(0, named=True)
    assert row["difference"] == pytest.approx(0.0)
    # Per patient hits s1 vs s2: T1 1 vs 2 (worse), T2 2 vs 0 (better), T3 0 vs 1 (worse).
    assert (row["n_improved"], row["n_worsened"], row["n_tied"]) == (1, 2, 0)
    assert row["sign_test_p"] == pytest.approx(1.0)
    assert row["ci_low"] <= row["difference"] <= row["ci_high"]


def test_the_sign_test_counts_patients_not_trajectories(tmp_path):
    # Patient 1 has six trajectories (`--target every`), each hit by s1 and missed by s2: one improved
    # patient, not six independent wins (p = 1, not 2 · 0.5^6). Patient 2's two trajectories cancel out.
    wh = Warehouse(tmp_path / "wh")
    first = [f"{COHORT}:1:{10 + i}" for i in range(6)]
    second = [f"{COHORT}:2:20", f"{COHORT}:2:21"]
    write_cohort(wh, targets={t: [A] for t in first + second}, pretarget={}, train_counts={A: 1})
    s1 = {**{t: [A] for t in first}, second[0]: [A], second[1]: [B]}
    s2 = {**{t: [B] for t in first}, second[0]: [B], second[1]: [A]}
    write_rankings(wh, "r1", rankings={"s1": s1, "s2": s2}, status={})
    paired = evaluate(wh, "r1", ks=(1,), n_boot=50, natural=False).paired
    row = paired.filter((pl.col("subset") == "all") & (pl.col("metric") == "macro_f1")).row(0, named=True)
    assert (row["n"], row["n_improved"], row["n_worsened"], row["n_tied"]) == (8, 1, 0, 1)
    assert row["sign_test_p"] == 1.0


def test_the_sign_test_of_each_metric_counts_the_patients_that_improved_on_that_metric(tmp_path):
    # At natural list sizes s1's longer list finds both targets (recall 1 against 1/2) at a lower precision (2/5
    # against 1/1) and F1 (4/7 against 2/3): each of the three patients improved on recall and worsened on the rest.
    wh = Warehouse(tmp_path / "wh")
    trajectories = [f"{COHORT}:{i}:{10 * i}" for i in (1, 2, 3)]
    write_cohort(wh, targets={t: [A, B] for t in trajectories}, pretarget={}, train_counts={A: 1})
    write_rankings(wh, "r1", rankings={"s1": {t: [A, B, X, Y, D] for t in trajectories},
                                       "s2": {t: [A] for t in trajectories}}, status={})
    paired = evaluate(wh, "r1", ks=(1,), n_boot=0).paired.filter((pl.col("subset") == "all") & (pl.col("k") == 0))
    counts = {r["metric"]: (r["n_improved"], r["n_worsened"], r["n_tied"], r["difference"] > 0)
              for r in paired.iter_rows(named=True)}
    assert counts == {"recall_at_k": (3, 0, 0, True), "micro_recall": (3, 0, 0, True),
                      "precision_at_k": (0, 3, 0, False), "micro_precision": (0, 3, 0, False),
                      "micro_f1": (0, 3, 0, False), "macro_f1": (0, 3, 0, False)}
    assert paired.filter(pl.col("metric") == "recall_at_k")["sign_test_p"].item() == 0.25   # 2 · 0.5^3


def test_paired_intervals_resample_both_systems_together_and_the_sign_test_leaves_ties_out(tmp_path):
    # Every trajectory (|Y| = 2, K = 2) has exactly one hit more under s1 than under s2, so every metric's
    # difference is 1/2 for every patient: 1/2 in the point and in every paired resample (interval [0.5, 0.5]),
    # although s1's own values vary between patients. Patient 1 has two trajectories (T1, T4).
    wh = Warehouse(tmp_path / "wh")
    t4 = f"{COHORT}:1:11"
    write_cohort(wh, targets={T1: [A, B], t4: [A, B], T2: [D, E], T3: [C, B]}, pretarget={}, train_counts={A: 1})
    s1 = {T1: [A, B], t4: [A, X], T2: [D, X], T3: [C, X]}
    s2 = {T1: [A, X], t4: [X, Y], T2: [X, Y], T3: [X, Y]}
    s3 = {**s2, T2: s1[T2]}  # patient 2 tied with s1
    write_rankings(wh, "r1", rankings={"s1": s1, "s2": s2, "s3": s3}, status={})
    result = evaluate(wh, "r1", ks=(2,), n_boot=200, seed=5, natural=False)
    paired = result.paired.filter((pl.col("subset") == "all") & (pl.col("system_a") == "s1"))
    versus_s2 = paired.filter(pl.col("system_b") == "s2")
    assert versus_s2.height == len(METRICS)
    for row in versus_s2.iter_rows(named=True):
        assert (row["difference"], row["ci_low"], row["ci_high"]) == pytest.approx((0.5, 0.5, 0.5), abs=1e-12)
        # Three patients improved, none worsened: 2 · 0.5^3.
        assert (row["n_improved"], row["n_worsened"], row["n_tied"], row["sign_test_p"]) == (3, 0, 0, 0.25)
    own = result.metrics.filter((pl.col("system") == "s1") & (pl.col("metric") == "recall_at_k")
                                & (pl.col("subset") == "all")).row(0, named=True)
    assert own["ci_low"] < own["ci_high"]  # the marginal varies: only pairing makes the difference's interval a point
    # Against s3 patient 2 is tied and left out of the test: 2 improved of 2 gives 2 · 0.5^2 (with the tie in the
    # trials, 2 of 3, p would be 1).
    tied = paired.filter((pl.col("system_b") == "s3") & (pl.col("metric") == "micro_f1")).row(0, named=True)
    assert (tied["n_improved"], tied["n_worsened"], tied["n_tied"], tied["sign_test_p"]) == (2, 0, 1, 0.5)


def test_bootstrap_resamples_patients_with_all_their_trajectories(tmp_path):
    # Patient 1's two trajectories are both hit, patient 2's one is missed (|Y| = 1, K = 1). A resample of two
    # patients is (1, 1) → R@1 = 2/3, (2, 0) → 4/4 = 1 or (0, 2) → 0; resampling trajectories instead would
    # also give 1/3. The 95% percentile interval over 400 resamples is [0, 1].
    from tasks.evaluate import load_run, system_counts

    wh = Warehouse(tmp_path / "wh")
    first, second, other = f"{COHORT}:1:10", f"{COHORT}:1:11", f"{COHORT}:2:20"
    write_cohort(wh, targets={first: [A], second: [B], other: [C]}, pretarget={}, train_counts={A: 1})
    write_rankings(wh, "r1", rankings={"s1": {first: [A], second: [B], other: [D]}}, status={})
    run = load_run(wh, "r1", ks=(1,))
    est = estimate(system_counts(run, (1,)), bootstrap_weights(run.subject_index, 400, 0))
    recall = est.boot[:, 0, SUBSETS.index("all"), 0, METRICS.index("recall_at_k")]
    assert set(np.round(recall, 12)) == {0.0, round(2 / 3, 12), 1.0}
    row = (evaluate(wh, "r1", ks=(1,), n_boot=400, seed=0, natural=False).metrics
           .filter((pl.col("metric") == "recall_at_k") & (pl.col("subset") == "all")).row(0, named=True))
    assert (row["value"], row["ci_low"], row["ci_high"]) == pytest.approx((2 / 3, 0.0, 1.0), abs=1e-12)


def test_sign_test_matches_binomial_tail():
    # 10 improved, 0 worsened: 2 · 0.5^10.
    assert sign_test(np.array([10, 0, 3]), np.array([0, 0, 3])).tolist() == [2 * 0.5 ** 10, 1.0, 1.0]


def test_rerun_replaces_partitions(wh):
    evaluate_run(wh, "r1", ks=(2,), n_boot=50)
    first = wh.read("metrics", run_id="r1")
    evaluate_run(wh, "r1", ks=(2,), n_boot=50)
    again = wh.read("metrics", run_id="r1")
    assert again.height == first.height > 0
    assert again.sort(["system", "subset", "k", "metric"]).equals(first.sort(["system", "subset", "k", "metric"]))
    assert set(again["metric"]) == set(METRICS) and set(again["subset"]) <= set(SUBSETS)


def test_independent_sql_reproduces_stored_precision_and_recall(wh):
    evaluate_run(wh, "r1", ks=(1, 2), n_boot=0)
    con = wh.connect(gold=True)
    expected = con.sql("""
        WITH tg AS (
            SELECT t.trajectory_id, t.code,
                   CASE WHEN t.code LIKE 'DIAGNOSIS//ICD//9//%' THEN 'icd9'
                        WHEN t.code LIKE 'DIAGNOSIS//ICD//10//%' THEN 'icd10' END AS version,
                   CASE WHEN EXISTS (SELECT 1 FROM pretarget_events p WHERE p.trajectory_id = t.trajectory_id
                                     AND p.code = t.code AND p.code LIKE 'DIAGNOSIS//%')
                        THEN 'repeated' ELSE 'new_onset' END AS onset,
                   (SELECT count(DISTINCT e.encounter_id) FROM train_events e WHERE e.code = t.code) AS freq
            FROM targets t),
        labelled AS (
            SELECT trajectory_id, code, 'all' AS subset FROM tg
            UNION ALL SELECT trajectory_id, code, version FROM tg WHERE version IS NOT NULL
            UNION ALL SELECT trajectory_id, code, onset FROM tg
            UNION ALL SELECT trajectory_id, code, CASE WHEN freq = 0 THEN 'freq_0' WHEN freq < 10 THEN 'freq_1_9'
                      WHEN freq < 100 THEN 'freq_10_99' ELSE 'freq_100plus' END FROM tg),
        ks AS (SELECT unnest([0, 1, 2]) AS k),
        lists AS (SELECT system, trajectory_id, count(*) AS len FROM rankings WHERE run_id = 'r1' GROUP BY ALL),
        per_patient AS (
            SELECT l.system, y.subset, ks.k, y.trajectory_id, count(DISTINCT y.code) AS n_y,
                   count(DISTINCT r.code) AS h,
                   CASE WHEN ks.k = 0 THEN any_value(l.len) ELSE ks.k END AS c
            FROM labelled y CROSS JOIN ks
            JOIN lists l ON l.trajectory_id = y.trajectory_id
            LEFT JOIN rankings r ON r.run_id = 'r1' AND r.system = l.system AND r.trajectory_id = y.trajectory_id
                 AND r.code = y.code AND (ks.k = 0 OR r.rank <= ks.k)
            GROUP BY l.system, y.subset, ks.k, y.trajectory_id)
        SELECT system, subset, k, avg(h / c) AS precision_at_k, avg(h / n_y) AS recall_at_k
        FROM per_patient GROUP BY ALL""").pl()
    stored = wh.read("metrics", run_id="r1").filter(pl.col("metric").is_in(["precision_at_k", "recall_at_k"])
                                                    & (pl.col("system") != "oracle"))
    stored = stored.pivot("metric", index=["system", "subset", "k"], values="value")
    joined = stored.join(expected, on=["system", "subset", "k"], how="full", suffix="_sql")
    assert joined.height == stored.height == expected.height == 2 * len(SUBSETS) * 3
    for metric in ("precision_at_k", "recall_at_k"):
        diff = (joined[metric] - joined[f"{metric}_sql"]).abs().max()
        assert diff < 1e-12, (metric, diff)


def test_repeated_runs_average_run_level_metrics(wh):
    write_rankings(wh, "r6", rankings={"s1": {T1: [B, C], T2: [D, A], T3: [E, X]}}, status={})
    started = datetime(2026, 1, 1)
    for run_id in ("r1", "r6"):
        record_run(wh, run_id, COHORT, "forecast:s1", {"system": "s1", "k": 2, "seed": int(run_id[1:]),
                                                       "run_id": run_id}, "finished", started, started)
    metrics = evaluate_repeated(wh, ["r1", "r6", "r1"], systems=["s1"], ks=(2,), n_boot=100)  # r1 counts once
    r1 = evaluate(wh, "r1", systems=["s1"], ks=(2,), n_boot=0).metrics
    r6 = evaluate(wh, "r6", systems=["s1"], ks=(2,), n_boot=0).metrics
    assert set(metrics["n_runs"]) == {2} and metrics["run_id"].unique().to_list()[0].startswith("config-")
    for metric in METRICS:
        mean = (value(r1, "s1", metric, 2) + value(r6, "s1", metric, 2)) / 2
        assert value(metrics, "s1", metric, 2) == pytest.approx(mean, abs=1e-12)
    # r6's T1 hits are {B, C}; r1's are {A}: micro-P 0.5 and 5/6 average to 2/3.
    assert value(metrics, "s1", "micro_precision", 2) == pytest.approx(2 / 3)
    stored = wh.read("metrics", run_id=metrics["run_id"][0])
    assert stored.height == metrics.height


def test_a_named_mean_over_repeated_runs_is_replaced_whole_by_a_rerun_and_takes_no_other_runs_id(wh):
    write_rankings(wh, "r6", rankings={"s1": {T1: [B, C], T2: [D, A], T3: [E, X]},
                                       "s2": {T1: [B, C], T2: [X, E], T3: [E, X]}}, status={})
    started = datetime(2026, 1, 1)
    for run_id in ("r1", "r6"):
        for system in ("s1", "s2"):
            record_run(wh, run_id, COHORT, f"forecast:{system}", {"system": system, "k": 2}, "finished", started,
                       started)
    both = evaluate_repeated(wh, ["r1", "r6"], systems=["s1", "s2"], ks=(2,), n_boot=0, run_id="mean-a")
    assert set(both["run_id"]) == {"mean-a"}  # both systems under the one id, not a config-… id each
    stored = wh.read("metrics", run_id="mean-a")
    assert sorted(set(stored["system"])) == ["s1", "s2"] and stored.height == both.height
    # micro-P@2 of s1: r1 1/2 (test_hand_computed_metrics_at_k2), r6 5/6; of s2: r1 1/2 and r6 1/2.
    assert value(stored, "s1", "micro_precision", 2) == pytest.approx(2 / 3)
    assert value(stored, "s2", "micro_precision", 2) == pytest.approx(1 / 2)
    [registered] = wh.read("runs", run_id="mean-a").rows(named=True)
    assert (registered["kind"], registered["status"]) == ("evaluate", "finished")
    assert json.loads(registered["config_json"])["systems"] == ["s1", "s2"]

    # The same id again with fewer systems replaces the mean: s2's earlier rows do not stay beside it.
    evaluate_repeated(wh, ["r1", "r6"], systems=["s1"], ks=(2,), n_boot=0, run_id="mean-a")
    assert set(wh.read("metrics", run_id="mean-a")["system"]) == {"s1"}
    assert json.loads(wh.read("runs", run_id="mean-a")["config_json"][0])["systems"] == ["s1"]

    # An id holding a forecast (one of the averaged runs, say) or a single run's evaluation is refused before any
    # work: the mean would replace that run's own rows.
    evaluate_run(wh, "r6", ks=(2,), n_boot=0)
    for taken, what in (("r1", "a forecast:s1 run"), ("r6", "a forecast:s1 run")):
        with pytest.raises(InputError, match=f"^--run-id {taken} is {what} \\(see `runs`\\), not a mean over repeated "
                                             "runs: pass a new --run-id for the mean$"):
            evaluate_repeated(wh, ["r1", "r6"], systems=["s1"], ks=(2,), n_boot=0, run_id=taken)
    write_rankings(wh, "unregistered", rankings={"s1": {T1: [A, B], T2: [A, D], T3: [E, X]}}, status={})
    with pytest.raises(InputError, match="^--run-id unregistered holds rankings \\(a forecast run\\)"):
        evaluate_repeated(wh, ["r1", "r6"], systems=["s1"], ks=(2,), n_boot=0, run_id="unregistered")
    with pytest.raises(InputError, match="^run id 'config-1' starts with config-, as the ids a mean over repeated"):
        evaluate_repeated(wh, ["r1", "r6"], systems=["s1"], ks=(2,), n_boot=0, run_id="config-1")
    assert set(wh.read("metrics", run_id="r1")["system"]) == set()  # r1 was never evaluated, and still is not
    assert wh.read("metrics", run_id="r6")["n_runs"].unique().to_list() == [1]
    # Nor does a forecast go into the mean's id, where it would be evaluated over the mean.
    with pytest.raises(InputError, match="^run mean-a holds the mean over repeated runs r1, r6 \\(dxr evaluate\\): "
                                         "pass a new --run-id for the forecast, or delete the mean first "
                                         r"\(`dxr run delete mean-a`\)$"):
        check_rerun(wh, "mean-a", forecast_config(COHORT, "s1", "all", 2, None))


# Paired comparisons of means: three patients (patient 1 has T1 and T4), K = 2, two runs of s1, s2 and s3.
T4 = f"{COHORT}:1:11"
MEAN_TARGETS = {T1: [A, B], T4: [A, B, C], T2: [D, E], T3: [C, B, E]}
MEAN_ORDER = [T1, T4, T2, T3]  # the evaluated (sorted) trajectories
# Hits of each run's system on MEAN_ORDER. s1 − s2 is one hit on alternate runs, half a hit per trajectory on
# average, so the precision difference of the means is 1/4 in every resample that both runs share. s1 − s3, summed
# over the runs, is worse for patient 1 (better in r1 alone), tied for patient 2 and better for patient 3.
MEAN_HITS = {("r1", "s1"): [2, 1, 1, 1], ("r1", "s2"): [1, 1, 0, 1], ("r1", "s3"): [1, 1, 0, 0],
             ("r2", "s1"): [1, 1, 1, 1], ("r2", "s2"): [1, 0, 1, 0], ("r2", "s3"): [2, 2, 2, 1]}


@pytest.fixture
def two_runs_of_three_systems(tmp_path) -> Warehouse:
    """MEAN_HITS as rankings: each list is the trajectory's first h target codes, padded with codes of no target."""
    wh = Warehouse(tmp_path / "wh")
    write_cohort(wh, targets=MEAN_TARGETS, pretarget={}, train_counts={A: 1})
    started = datetime(2026, 1, 1)
    for run_id in ("r1", "r2"):
        rankings = {system: {t: MEAN_TARGETS[t][:h] + [X, Y][:2 - h] for t, h in zip(MEAN_ORDER, hits)}
                    for (run, system), hits in MEAN_HITS.items() if run == run_id}
        write_rankings(wh, run_id, rankings=rankings, status={})
        for system in rankings:
            record_run(wh, run_id, COHORT, f"forecast:{system}", {"k": 2}, "finished", started, started)
    return wh


def independent_mean_metrics(system: str, weights: np.ndarray) -> dict[str, float]:
    """Spec §1's six metrics (subset all, K = 2) of `system`, with trajectory multiplicities `weights`, averaged over
    r1 and r2."""
    k, sizes = 2, np.array([len(MEAN_TARGETS[t]) for t in MEAN_ORDER], float)
    per_run = []
    for run_id in ("r1", "r2"):
        h, n = np.array(MEAN_HITS[(run_id, system)], float) * weights, weights.sum()
        y = sizes * weights
        per_run.append({"precision_at_k": (h / k).sum() / n, "recall_at_k": (h / sizes).sum() / n,
                        "micro_precision": h.sum() / (n * k), "micro_recall": h.sum() / y.sum(),
                        "micro_f1": 2 * h.sum() / (n * k + y.sum()),
                        "macro_f1": (2 * h / (k + sizes)).sum() / n})
    return {metric: float(np.mean([run[metric] for run in per_run])) for metric in METRICS}


def test_paired_comparisons_of_means_equal_an_independent_computation_with_one_resample_for_every_run(
        two_runs_of_three_systems):
    from scipy.stats import binomtest

    wh = two_runs_of_three_systems
    metrics = evaluate_repeated(wh, ["r1", "r2"], ks=(2,), n_boot=200, seed=4, natural=False, run_id="mean")
    stored = wh.read("paired_comparisons", run_id="mean")
    assert set(stored["cohort_id"]) == {COHORT}
    assert sorted(set(stored.select("system_a", "system_b").rows())) == [("s1", "s2"), ("s1", "s3"), ("s2", "s3")]
    assert json.loads(wh.read("runs", run_id="mean")["config_json"][0])["pairs"] == [["s1", "s2"], ["s1", "s3"],
                                                                                     ["s2", "s3"]]
    # The resample the evaluation draws, one for every run and system (patients 1, 1, 2, 3).
    resamples = bootstrap_weights(np.array([0, 0, 1, 2]), 200, 4)
    k, sizes = 2, np.array([len(MEAN_TARGETS[t]) for t in MEAN_ORDER], float)
    for a, b in (("s1", "s2"), ("s1", "s3"), ("s2", "s3")):
        point_a, point_b = independent_mean_metrics(a, np.ones(4)), independent_mean_metrics(b, np.ones(4))
        replicates = [(independent_mean_metrics(a, w), independent_mean_metrics(b, w)) for w in resamples]
        # A patient's change: its F1 summands 2h/(K + |Y|), a minus b, summed over its trajectories and both runs.
        change = sum((np.array(MEAN_HITS[(run_id, a)]) - np.array(MEAN_HITS[(run_id, b)])) * 2 / (k + sizes)
                     for run_id in ("r1", "r2"))
        by_patient = np.round([change[0] + change[1], change[2], change[3]], 12)
        improved, worsened = int((by_patient > 0).sum()), int((by_patient < 0).sum())
        p = binomtest(improved, improved + worsened).pvalue if improved + worsened else 1.0
        for metric in METRICS:
            row = stored.filter((pl.col("system_a") == a) & (pl.col("system_b") == b) & (pl.col("subset") == "all")
                                & (pl.col("metric") == metric) & (pl.col("k") == 2)).row(0, named=True)
            low, high = np.percentile([ra[metric] - rb[metric] for ra, rb in replicates], [2.5, 97.5])
            assert (row["value_a"], row["value_b"], row["difference"], row["ci_low"], row["ci_high"]) == pytest.approx(
                (point_a[metric], point_b[metric], point_a[metric] - point_b[metric], low, high), abs=1e-12), metric
            assert (row["value_a"], row["value_b"]) == pytest.approx(
                (value(metrics, a, metric, 2), value(metrics, b, metric, 2)), abs=1e-15)
            assert (row["n"], row["n_improved"], row["n_worsened"], row["n_tied"]) == (
                4, improved, worsened, 3 - improved - worsened)
            assert row["sign_test_p"] == pytest.approx(p, abs=1e-12)
    versus_s2 = stored.filter((pl.col("system_a") == "s1") & (pl.col("system_b") == "s2") & (pl.col("subset") == "all"))
    for metric in ("precision_at_k", "micro_precision"):
        row = versus_s2.filter(pl.col("metric") == metric).row(0, named=True)
        assert (row["difference"], row["ci_low"], row["ci_high"]) == pytest.approx((0.25, 0.25, 0.25), abs=1e-12)
    # In one run the difference varies between patients: only the resample shared by both runs makes it a point.
    own = evaluate(wh, "r1", ks=(2,), n_boot=200, seed=4, natural=False).paired.filter(
        (pl.col("system_a") == "s1") & (pl.col("system_b") == "s2") & (pl.col("subset") == "all")
        & (pl.col("metric") == "precision_at_k")).row(0, named=True)
    assert own["ci_low"] < own["ci_high"]
    # Summed over both runs patient 1 is worse under s1 than s3, patient 2 tied, patient 3 better (r1 alone: 3 better).
    versus_s3 = stored.filter((pl.col("system_a") == "s1") & (pl.col("system_b") == "s3")).row(0, named=True)
    assert (versus_s3["n_improved"], versus_s3["n_worsened"], versus_s3["n_tied"]) == (1, 1, 1)


def test_paired_comparisons_of_a_mean_are_replaced_whole_and_compared_only_under_one_run_id(
        two_runs_of_three_systems):
    from tasks.evaluate import paired_means

    wh = two_runs_of_three_systems
    evaluate_repeated(wh, ["r1", "r2"], ks=(2,), n_boot=0, natural=False, run_id="mean")
    assert wh.read("paired_comparisons", run_id="mean").height
    # The pairs asked for, as a single run's are; a pair with an oracle is each run's own (the mean has none).
    metrics = evaluate_repeated(wh, ["r1", "r2"], ks=(2,), n_boot=0, natural=False, run_id="mean",
                                pairs=[("s3", "s1"), ("s1", "oracle")])
    assert set(wh.read("paired_comparisons", run_id="mean").select("system_a", "system_b").rows()) == {("s3", "s1")}
    assert paired_means(metrics, [("s3", "s1"), ("s1", "oracle")]) == (
        [("s3", "s1")], "no paired comparison of means for s1,oracle: an oracle is the same in every run and has no "
                        "mean; each run's own evaluation compares it")
    with pytest.raises(NotFoundError, match="^pair s1,s9 names 's9', not evaluated in run 'r1, r2'; evaluated: s1, "
                                            "s2, s3$"):
        evaluate_repeated(wh, ["r1", "r2"], ks=(2,), n_boot=0, natural=False, run_id="mean", pairs=[("s1", "s9")])
    # A rerun with one system leaves none of the earlier pairs.
    evaluate_repeated(wh, ["r1", "r2"], systems=["s1"], ks=(2,), n_boot=0, natural=False, run_id="mean")
    assert not wh.has_rows("paired_comparisons", run_id="mean")
    assert set(wh.read("metrics", run_id="mean")["system"]) == {"s1"}
    assert json.loads(wh.read("runs", run_id="mean")["config_json"][0])["pairs"] == []
    # Without --run-id each system's mean is under its own config-… id: no pair is compared, and the note says why.
    metrics = evaluate_repeated(wh, ["r1", "r2"], systems=["s1", "s2"], ks=(2,), n_boot=0, natural=False)
    assert metrics["run_id"].n_unique() == 2
    assert wh.read("paired_comparisons").is_empty()
    assert paired_means(metrics, None) == ([], "no paired comparison of the means of s1,s2: each system's mean is "
                                               "stored under its own configuration's config-… id, and only means "
                                               "under one id are compared; pass --run-id to store them under one id "
                                               "with their paired comparisons")


def test_repeated_runs_refuse_different_configurations(wh):
    write_rankings(wh, "r7", rankings={"s1": {T1: [B, C], T2: [D, A], T3: [E, X]}}, status={})
    started = datetime(2026, 1, 1)
    record_run(wh, "r1", COHORT, "forecast:s1", {"k": 2}, "finished", started, started)
    record_run(wh, "r7", COHORT, "forecast:s1", {"k": 3}, "finished", started, started)
    with pytest.raises(InputError, match="different configurations"):
        evaluate_repeated(wh, ["r1", "r7"], systems=["s1"], ks=(2,), n_boot=0)


def test_repeated_runs_recorded_before_and_after_forecasts_recorded_the_cut_rule_version_are_one_configuration(wh):
    # Upgrade audit: a run forecast by a dxr of 2026-12-05 and one forecast by today's dxr of the same cohort, as it
    # stood, with the same options: the mean was refused as "different configurations", since a forecast's config
    # now records the cohort's cut_rule_version (null: cut before it was recorded), which the earlier run lacks.
    write_rankings(wh, "r7", rankings={"s1": RANKINGS["s1"]}, status={})
    started = datetime(2026, 1, 1)
    earlier = forecast_config(COHORT, "s1", "held_out", 2, None, None)
    record_run(wh, "r1", COHORT, "forecast:s1", earlier, "finished", started, started)
    record_run(wh, "r7", COHORT, "forecast:s1", earlier | {"cut_rule_version": None}, "finished", started, started)
    metrics = evaluate_repeated(wh, ["r1", "r7"], systems=["s1"], ks=(2,), n_boot=0, natural=False)
    assert metrics["n_runs"].unique().to_list() == [2]
    assert value(metrics, "s1", "precision_at_k", 2) == value(evaluate(wh, "r1", ks=(2,), n_boot=0,
                                                                       natural=False).metrics, "s1",
                                                              "precision_at_k", 2)


def test_repeated_llm_runs_are_compared_on_the_settings_every_run_recorded(wh):
    # Upgrade audit: Direct runs of 2026-12-02 recorded none of the LLM settings, those before 9d90165 (2026-12-04)
    # no llm_max_tokens_field. A mean of such a run with one of today's was refused as "different configurations",
    # where a rerun into the run id (check_rerun) leaves a setting the recorded run cannot say out of the comparison.
    for run_id in ("r2", "r7", "r8"):
        write_rankings(wh, run_id, rankings={"s1": RANKINGS["s1"]}, status={})
    started = datetime(2026, 1, 1)
    options = forecast_config(COHORT, "s1", "held_out", 2, None, None)
    today = {"llm_backend": "openai", "llm_model": "m", "llm_temperature": 0.0, "llm_max_tokens_field": "max_tokens"}
    record_run(wh, "r1", COHORT, "forecast:s1", options, "finished", started, started)
    record_run(wh, "r7", COHORT, "forecast:s1", options | today, "finished", started, started)
    record_run(wh, "r8", COHORT, "forecast:s1", options | today | {"llm_temperature": 0.7}, "finished", started,
               started)
    before_9d90165 = {key: value for key, value in today.items() if key != "llm_max_tokens_field"}
    record_run(wh, "r2", COHORT, "forecast:s1", options | before_9d90165, "finished", started, started)

    assert evaluate_repeated(wh, ["r1", "r7"], systems=["s1"], ks=(2,), n_boot=0)["n_runs"].unique().to_list() == [2]
    assert evaluate_repeated(wh, ["r2", "r7"], systems=["s1"], ks=(2,), n_boot=0)["n_runs"].unique().to_list() == [2]
    # A setting both runs recorded is compared as before.
    with pytest.raises(InputError, match="different configurations"):
        evaluate_repeated(wh, ["r2", "r8"], systems=["s1"], ks=(2,), n_boot=0)


def test_repeats_of_an_llm_system_under_other_seeds_are_one_configuration(wh):
    # Repeats of a sampled Direct Forecast vary llm.seed, as repeats of the others vary `seed`: their mean was refused
    # as "different configurations".
    for run_id in ("r2", "r7"):
        write_rankings(wh, run_id, rankings={"s1": RANKINGS["s1"]}, status={})
    started = datetime(2026, 1, 1)
    options = forecast_config(COHORT, "s1", "held_out", 2, None, None) | {"llm_model": "m", "llm_temperature": 0.7}
    for run_id, llm_seed in (("r1", 1), ("r2", 2), ("r7", None)):
        record_run(wh, run_id, COHORT, "forecast:s1", options | {"llm_seed": llm_seed}, "finished", started, started)
    metrics = evaluate_repeated(wh, ["r1", "r2", "r7"], systems=["s1"], ks=(2,), n_boot=0)
    assert metrics["n_runs"].unique().to_list() == [3]


# ---- invariants on random rankings and targets -----------------------------------------------------------

@st.composite
def exact_k_problems(draw):
    """Random targets (non-empty) and exact-K rankings over a small vocabulary, several systems."""
    k = draw(st.integers(1, 6))
    vocab = 12
    n = draw(st.integers(1, 12))
    n_sys = draw(st.integers(1, 3))
    targets = [draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=6)) for _ in range(n)]
    rankings = [[draw(st.permutations(range(vocab)))[:k] for _ in range(n)] for _ in range(n_sys)]
    return k, targets, rankings


def counts_of(k, targets, rankings) -> Counts:
    n, n_sub = len(targets), len(SUBSETS)
    hits = np.zeros((len(rankings), n_sub, 1, n))
    target_counts = np.zeros((n_sub, n))
    target_counts[0] = [len(t) for t in targets]   # subset `all` only; the others are empty
    for m, system in enumerate(rankings):
        hits[m, 0, 0] = [len(set(r[:k]) & t) for r, t in zip(system, targets)]
    return Counts([f"s{m}" for m in range(len(rankings))], (k,), hits, np.full((len(rankings), 1, n), float(k)),
                  target_counts)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exact_k_problems())
def test_algebraic_identities_of_exact_k_outputs(problem):
    k, targets, rankings = problem
    est = estimate(counts_of(k, targets, rankings), None)
    n, total_gold = len(targets), sum(len(t) for t in targets)
    for m, system in enumerate(rankings):
        total_hits = sum(len(set(r) & t) for r, t in zip(system, targets))
        p_at_k, r_at_k, micro_p, micro_r, micro_f1, macro_f1 = est.point[m, 0, 0]
        assert p_at_k == pytest.approx(total_hits / (n * k), abs=1e-12)
        assert micro_p == pytest.approx(p_at_k, abs=1e-12)
        assert micro_r == pytest.approx(total_hits / total_gold, abs=1e-12)
        assert micro_f1 == pytest.approx(2 * total_hits / (n * k + total_gold), abs=1e-12)
        assert all(0.0 <= v <= 1.0 for v in est.point[m, 0, 0])
        # Harmonic mean of pooled P and R is the pooled F1 when both are positive.
        if total_hits:
            assert micro_f1 == pytest.approx(2 * micro_p * micro_r / (micro_p + micro_r), abs=1e-12)
        hits = [len(set(r) & t) for r, t in zip(system, targets)]
        assert macro_f1 == pytest.approx(np.mean([2 * h / (k + len(t)) for h, t in zip(hits, targets)]), abs=1e-12)
        assert r_at_k == pytest.approx(np.mean([h / len(t) for h, t in zip(hits, targets)]), abs=1e-12)
    # Metrics describe a set of patients: their order does not matter.
    reversed_est = estimate(counts_of(k, targets[::-1], [s[::-1] for s in rankings]), None)
    assert np.allclose(reversed_est.point, est.point, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(exact_k_problems(), st.integers(0, 2 ** 16))
def test_bootstrap_interval_brackets_resample_values_and_is_seeded(problem, seed):
    k, targets, rankings = problem
    counts = counts_of(k, targets, rankings)
    subjects = np.arange(len(targets))
    weights = bootstrap_weights(subjects, 50, seed)
    assert weights.sum(axis=1).tolist() == [len(targets)] * 50
    first, second = estimate(counts, weights), estimate(counts, bootstrap_weights(subjects, 50, seed))
    assert np.array_equal(first.boot, second.boot, equal_nan=True)
    finite = first.boot[:, :, 0, 0]
    assert np.nanmin(finite) >= -1e-6 and np.nanmax(finite) <= 1 + 1e-6


@settings(max_examples=80, deadline=None)
@given(exact_k_problems())
def test_more_budget_never_loses_hits(problem):
    k, targets, rankings = problem
    small = estimate(counts_of(k, targets, [[r[: max(1, k - 1)] for r in s] for s in rankings]), None)
    large = estimate(counts_of(k, targets, rankings), None)
    # Recall-type metrics are monotone in the prefix; precision denominators are fixed at K.
    assert np.all(large.point[:, 0, 0, [1, 3]] >= small.point[:, 0, 0, [1, 3]] - 1e-12)


@st.composite
def ranked_problems(draw):
    """Random targets with random classes, and ranked lists of any length (empty too), several systems and budgets."""
    codes = [dx(f"A{c:02d}") for c in range(6)] + [dx(f"{c:03d}", 9) for c in range(6)]
    n = draw(st.integers(1, 8))
    targets = [draw(st.lists(st.sampled_from(codes), min_size=1, max_size=6, unique=True)) for _ in range(n)]
    repeated = {code: draw(st.booleans()) for code in codes}
    train_count = {code: draw(st.sampled_from([0, 3, 40, 500])) for code in codes}
    lists = [[draw(st.permutations(codes))[:draw(st.integers(0, 8))] for _ in range(n)]
             for _ in range(draw(st.integers(1, 3)))]
    ks = tuple(sorted(draw(st.sets(st.integers(1, 8), min_size=1, max_size=3)))) + (NATURAL_K,)
    return targets, repeated, train_count, lists, ks


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ranked_problems())
def test_metrics_from_random_rankings_equal_their_definitions_in_every_subset(problem):
    # The path from ranked rows to hits (positions, subsets by version, onset and train frequency) against §1 written
    # out per trajectory: patient-averaged over the subset's trajectories, pooled over them, K = |C| at k = 0.
    targets, repeated, train_count, lists, ks = problem
    ids = [f"t{i}" for i in range(len(targets))]
    systems = [f"s{m}" for m in range(len(lists))]
    target_rows = [(t, c) for t, codes in zip(ids, targets) for c in codes]
    labelled = label_targets(pl.DataFrame({"trajectory_id": [r[0] for r in target_rows],
                                           "code": [r[1] for r in target_rows],
                                           "repeated": [repeated[r[1]] for r in target_rows],
                                           "train_count": [train_count[r[1]] for r in target_rows]}))
    ranked = [(s, t, position, c) for s, per_system in zip(systems, lists) for t, codes in zip(ids, per_system)
              for position, c in enumerate(codes, 1)]
    rankings = pl.DataFrame({"system": [r[0] for r in ranked], "trajectory_id": [r[1] for r in ranked],
                             "position": [r[2] for r in ranked], "code": [r[3] for r in ranked], "native": True},
                            schema={"system": pl.String, "trajectory_id": pl.String, "position": pl.Int32,
                                    "code": pl.String, "native": pl.Boolean})
    run = RunData("r", COHORT, ids, np.arange(len(ids)), systems, rankings, pl.DataFrame(), labelled)
    est = estimate(system_counts(run, ks), None)
    for s, subset in enumerate(SUBSETS):
        gold = {t: set(labelled.filter((pl.col("trajectory_id") == t) & (pl.col("subset") == subset))["code"])
                for t in ids}
        members = [i for i, t in enumerate(ids) if gold[t]]
        assert est.n[s] == len(members)
        for m, per_system in enumerate(lists):
            for kk, k in enumerate(ks):
                if not members:
                    continue
                size = [len(per_system[i]) if k == NATURAL_K else k for i in members]
                hits = [len(set(per_system[i] if k == NATURAL_K else per_system[i][:k]) & gold[ids[i]])
                        for i in members]
                wanted = [len(gold[ids[i]]) for i in members]
                expected = [np.mean([h / c if c else 0.0 for h, c in zip(hits, size)]),
                            np.mean([h / y for h, y in zip(hits, wanted)]),
                            sum(hits) / sum(size) if sum(size) else 0.0, sum(hits) / sum(wanted),
                            2 * sum(hits) / (sum(size) + sum(wanted)),
                            np.mean([2 * h / (c + y) for h, c, y in zip(hits, size, wanted)])]
                assert est.point[m, s, kk] == pytest.approx(expected, abs=1e-12), (subset, k, systems[m])


def test_cluster_bootstrap_keeps_a_patients_trajectories_together():
    weights = bootstrap_weights(np.array([0, 0, 1, 2, 2, 2]), 200, seed=1)
    assert np.array_equal(weights[:, 0], weights[:, 1])
    assert np.array_equal(weights[:, 3], weights[:, 5])
    assert (weights[:, [0, 2, 3]].sum(axis=1) == 3).all()


def test_a_metric_equal_for_every_trajectory_has_exactly_that_value_and_interval():
    # Every trajectory has 1 hit among 3 targets in its top 10: P@10 = 0.1, R@10 = 1/3, F1 = 2/13 for each, so
    # every resample has the same values. Summed in float32 the resamples gave P@10 in [0.1000001, 0.1000002],
    # an interval that excluded its own point value, and the point sum of 300 × 0.1 gave 0.09999999999999999.
    from tasks.evaluate import metric_rows

    n = 300
    targets = np.zeros((len(SUBSETS), n))
    targets[0] = 3
    hits = np.zeros((1, len(SUBSETS), 1, n))
    hits[0, 0, 0] = 1
    counts = Counts(["s"], (10,), hits, np.full((1, 1, n), 10.0), targets)
    rows = metric_rows(estimate(counts, bootstrap_weights(np.arange(n) // 2, 200, 0))).filter(pl.col("subset") == "all")
    expected = {"precision_at_k": 0.1, "recall_at_k": 1 / 3, "micro_precision": 0.1, "micro_recall": 1 / 3,
                "micro_f1": 2 / 13, "macro_f1": 2 / 13}
    assert {r["metric"]: (r["value"], r["ci_low"], r["ci_high"]) for r in rows.iter_rows(named=True)} == {
        metric: (v, v, v) for metric, v in expected.items()}


def test_an_interval_of_a_patient_average_never_leaves_zero_to_one():
    # One hit in 15 trajectories: the resamples without its trajectory averaged 0.1 - 0.1 to -3e-17, and the
    # interval of P@10 was printed as [-0.000, 0.020].
    from tasks.evaluate import metric_rows

    n = 15
    targets = np.zeros((len(SUBSETS), n))
    targets[0] = 3
    hits = np.zeros((1, len(SUBSETS), 1, n))
    hits[0, 0, 0, 0] = 1
    counts = Counts(["s"], (10,), hits, np.full((1, 1, n), 10.0), targets)
    est = estimate(counts, bootstrap_weights(np.arange(n), 1000, 0))
    assert est.boot[:, 0, 0, 0].min() == 0.0
    rows = metric_rows(est).filter(pl.col("subset") == "all")
    assert rows["ci_low"].to_list() == [0.0] * len(METRICS)
    assert rows.filter(pl.col("metric") == "precision_at_k")["ci_high"].to_list() == [pytest.approx(0.02)]


def test_vectorised_bootstrap_is_fast():
    """5,000 patients × 15 systems × 9 subsets × 3 K values × 6 metrics, B = 1000, within seconds."""
    import time

    rng = np.random.default_rng(0)
    n, n_sys, n_sub, ks = 5000, 15, len(SUBSETS), (10, 20, 0)
    targets = rng.integers(0, 4, size=(n_sub, n)).astype(float)
    targets[0] = rng.integers(1, 8, size=n)
    hits = np.minimum(rng.integers(0, 4, size=(n_sys, n_sub, len(ks), n)), targets[None, :, None, :])
    counts = Counts([f"s{m}" for m in range(n_sys)], ks, hits.astype(float),
                    np.full((n_sys, len(ks), n), 20.0), targets)
    start = time.perf_counter()
    est = estimate(counts, bootstrap_weights(np.arange(n), 1000, 0))
    from tasks.evaluate import metric_rows
    rows = metric_rows(est)
    elapsed = time.perf_counter() - start
    assert rows.height == n_sys * n_sub * len(ks) * len(METRICS)
    assert elapsed < 30, f"bootstrap took {elapsed:.1f}s"


def test_run_where_every_trajectory_failed_counts_zero_hits(wh):
    wh.write("ranking_status", pl.DataFrame({"run_id": "r8", "system": "s9", "trajectory_id": [T1, T2, T3],
                                             "status": "failed", "detail": "backend timeout"}),
             run_id="r8", system="s9", shard=0)
    started = datetime(2026, 1, 1)
    record_run(wh, "r8", COHORT, "forecast:s9", {"k": 2}, "finished", started, started)
    result = evaluate(wh, "r8", ks=(2,), n_boot=10)
    assert value(result.metrics, "s9", "micro_f1", 2) == 0.0
    assert result.coverage.filter(pl.col("k") == 2)["n_failed"].item() == 3


def test_trajectory_outside_the_cohort_is_refused(wh):
    write_rankings(wh, "r10", rankings={"s1": {T1: [A, B], T2: [A, B], T3: [E, X], f"{COHORT}:9:90": [A, B]}},
                   status={})
    with pytest.raises(InputError, match=(
            f"^run 'r10' ranks trajectory '{COHORT}:9:90' \\(1 such\\), which is not in cohort c1's trajectories: "
            "forecast the run's systems again on the current build, under a new --run-id or this one with the same "
            "options$")):
        evaluate(wh, "r10", ks=(2,), n_boot=0)


def test_codes_outside_the_cohort_vocabulary_are_refused(wh):
    vocabulary = [A, B, C, D, E, X, Y]
    wh.write("cohort_vocabulary", pl.DataFrame({"cohort_id": COHORT, "code": vocabulary, "icd_version": 10,
                                                "title": None}, schema_overrides={"title": pl.String}),
             cohort_id=COHORT)
    assert evaluate(wh, "r1", ks=(2,), n_boot=0).metrics.height > 0
    write_rankings(wh, "r11", rankings={"s1": {T1: [A, "E11.9"], T2: [A, B], T3: [E, X]}}, status={})
    with pytest.raises(InputError, match=f"trajectory '{T1}' ranks 'E11.9' \\(rank 2\\), which is not in cohort c1's"):
        evaluate(wh, "r11", ks=(2,), n_boot=0)


def test_a_narrower_re_evaluation_leaves_no_rows_of_the_earlier_one(wh):
    # Evaluated with every system at K = 2 and intervals, then again for s1 alone at K = 1 without them: the
    # run's stored evaluation is the second one, not s2's old K = 2 rows beside s1's new K = 1 rows.
    evaluate_run(wh, "r1", ks=(2,), n_boot=20)
    evaluate_run(wh, "r1", systems=["s1"], ks=(1,), n_boot=0)
    for table in ("metrics", "evaluation_coverage"):
        stored = wh.read(table, run_id="r1")
        assert set(stored["system"]) == {"s1"} and set(stored["k"]) == {1, NATURAL_K}, table
    assert wh.read("metrics", run_id="r1")["ci_low"].null_count() == wh.read("metrics", run_id="r1").height


def test_a_pair_or_pool_naming_a_system_not_evaluated_is_refused_before_the_bootstrap(wh):
    # 10**12 resamples cannot even be allocated: only names checked before the bootstrap give these errors.
    with pytest.raises(NotFoundError) as raised:
        evaluate(wh, "r1", ks=(2,), n_boot=10**12, pairs=[("s1", "s3")])
    assert str(raised.value) == "pair s1,s3 names 's3', not evaluated in run 'r1'; evaluated: s1, s2"
    with pytest.raises(NotFoundError) as raised:
        evaluate(wh, "r1", systems=["s1"], ks=(2,), n_boot=10**12, pools=[("s1", "s2")])
    assert str(raised.value) == "pool s1+s2 names 's2', not evaluated in run 'r1'; evaluated: s1"


def test_a_system_pair_or_pool_named_twice_is_written_once(wh):
    evaluate_run(wh, "r1", systems=["s1", "s2", "s1"], ks=(2,), n_boot=0, pairs=[("s1", "s2"), ("s1", "s2")],
                 pools=[("s1", "s2"), ("s1", "s2")])
    keys = {"metrics": ["system", "subset", "k", "metric"], "evaluation_coverage": ["system", "k"],
            "paired_comparisons": ["system_a", "system_b", "subset", "k", "metric"],
            "headroom": ["pool", "subset", "k", "metric"]}
    for table, key in keys.items():
        stored = wh.read(table, run_id="r1")
        assert stored.height == stored.select(key).unique().height > 0, table



def load_prior_gap():
    path = Path(__file__).parents[1] / "benchmarks" / "prior_gap.py"
    spec = importlib.util.spec_from_file_location("prior_gap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prior_gap_splits_new_onset_codes_by_icd_category(tmp_path):
    """benchmarks/prior_gap.py: a new code of a category the record holds is a sibling, the rest new categories."""
    prior_gap = load_prior_gap()
    wh = Warehouse(tmp_path / "wh")
    sibling = dx("A019")  # category A01, as A
    write_cohort(wh, targets={T1: [A, sibling, B], T2: [A, D]}, pretarget={T1: [A], T2: [dx("Z00")]})
    rankings = {"ehr_prior": {T1: [A, sibling, X], T2: [D, X, Y]}, "gru": {T1: [], T2: []}}
    failed = {("gru", T1): "failed", ("gru", T2): "failed"}
    for run_id in ("bench-prior-20250101T000000", "bench-prior-20260101T000000", "bench-prior-20260101T000000-all"):
        write_rankings(wh, run_id, rankings=rankings, status=failed)
    run_id = prior_gap.newest_benchmark_run(wh)
    assert run_id == "bench-prior-20260101T000000"

    gap = prior_gap.gap_summary(wh, run_id, k=2)
    # T1: A repeated, A019 sibling, B new; T2: A and D new (Z00 shares no category with them).
    assert gap["targets"] == {"repeated": 1, "sibling": 1, "new_category": 3}
    # Top 2: T1 {A, A019} both hit, A in the record; T2 {D, X}, D hits, neither in the record.
    # gru failed everywhere: it hits nothing and spends no place.
    assert gap["systems"] == [{"system": "ehr_prior", "repeated": 1.0, "sibling": 1.0, "new_category": 1 / 3,
                               "record_places": 0.5, "record_place_hits": 1.0, "other_place_hits": 2 / 3},
                              {"system": "gru", "repeated": 0.0, "sibling": 0.0, "new_category": 0.0,
                               "record_places": None, "record_place_hits": None, "other_place_hits": None}]
    assert gap["categories"] == [{"category": "10:A01", "targets": 2, "ehr_prior": 1, "gru": 0},
                                 {"category": "10:B02", "targets": 1, "ehr_prior": 0, "gru": 0},
                                 {"category": "10:D04", "targets": 1, "ehr_prior": 1, "gru": 0}]


def test_pooled_precision_of_no_predictions_is_zero_in_every_resample_too(wh):
    # s9 failed everywhere: at natural list sizes it predicts nothing, so no prediction is correct. The point
    # value says 0; the resamples (every one with trajectories) must say the same, not NaN dropped as if the
    # subset were empty, which left the interval null.
    wh.write("ranking_status", pl.DataFrame({"run_id": "r8", "system": "s9", "trajectory_id": [T1, T2, T3],
                                             "status": "failed", "detail": "backend timeout"}),
             run_id="r8", system="s9", shard=0)
    record_run(wh, "r8", COHORT, "forecast:s9", {"k": 2}, "finished", datetime(2026, 1, 1), datetime(2026, 1, 1))
    metrics = evaluate(wh, "r8", ks=(2,), n_boot=25).metrics
    rows = metrics.filter((pl.col("k") == NATURAL_K) & (pl.col("metric") == "micro_precision"))
    assert rows.height == len(SUBSETS)
    assert set(rows["value"]) == set(rows["ci_low"]) == set(rows["ci_high"]) == {0.0}
