"""Benchmark: evaluating a large run (5,000 trajectories × 15 systems × 20 codes, B = 1000).

Writes a synthetic warehouse with random targets (1–8 codes from a 2,000-code vocabulary skewed
towards frequent codes) and random exact-K rankings, then times each evaluation step: loading and
checking the run, per-trajectory counts, the bootstrap over every (system, subset, K, metric),
paired comparisons of every pair, pool-oracle headroom, and writing the tables.
Prints a table; writes JSON to benchmarks/results/evaluate.json.

    python benchmarks/evaluate.py [--trajectories 5000] [--systems 15] [--bootstrap 1000]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from datetime import datetime
from itertools import combinations
from pathlib import Path

import numpy as np
import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402
from tasks.evaluate import (ORACLES, bootstrap_weights, coverage_rows, estimate, load_run,  # noqa: E402
                            metric_rows, paired_rows, pool_oracle_counts, system_counts)
from warehouse.store import Warehouse  # noqa: E402

COHORT = "bench"


def build(wh: Warehouse, n: int, n_systems: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = np.array([f"DIAGNOSIS//ICD//{10 if c % 3 else 9}//C{c:04d}" for c in range(2000)])
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    ids = [f"{COHORT}:{i}:{i}" for i in range(n)]
    wh.write("trajectories", pl.DataFrame({
        "cohort_id": COHORT, "trajectory_id": ids, "subject_id": np.arange(n) // 2, "target_encounter_id": np.arange(n),
        "cutoff_time": datetime(2020, 1, 1), "split": "held_out", "shard": 0, "n_prior_encounters": 1,
        "birth_time_imputed": False}),
        cohort_id=COHORT)
    sizes = rng.integers(1, 9, size=n)
    target_codes = [rng.choice(len(vocab), size=s, replace=False, p=weights) for s in sizes]
    wh.write("targets", pl.DataFrame({"cohort_id": COHORT, "trajectory_id": np.repeat(ids, sizes),
                                      "code": vocab[np.concatenate(target_codes)]}), cohort_id=COHORT)
    prior = [c[: len(c) // 2] for c in target_codes]
    wh.write("pretarget_events", pl.DataFrame({
        "cohort_id": COHORT, "trajectory_id": np.repeat(ids, [len(p) for p in prior]),
        "subject_id": np.repeat(np.arange(n) // 2, [len(p) for p in prior]), "time": datetime(2019, 1, 1),
        "code": vocab[np.concatenate(prior)], "numeric_value": None, "text_value": None, "encounter_id": 1},
        schema_overrides={"numeric_value": pl.Float32, "text_value": pl.String}), cohort_id=COHORT, shard=0)
    train = rng.choice(len(vocab), size=200_000, p=weights)
    wh.write("train_events", pl.DataFrame({
        "cohort_id": COHORT, "subject_id": 0, "time": datetime(2018, 1, 1), "code": vocab[train],
        "numeric_value": None, "text_value": None, "encounter_id": 1},
        schema_overrides={"numeric_value": pl.Float32, "text_value": pl.String}), cohort_id=COHORT)
    for m in range(n_systems):
        # Each system draws its list from the same skewed distribution, half of them seeing some targets.
        picks = np.stack([rng.choice(len(vocab), size=k, replace=False, p=weights) for _ in range(n)])
        if m % 2:
            for i, codes in enumerate(target_codes):
                take = codes[: max(1, len(codes) // 2)]
                rest = [c for c in picks[i] if c not in set(take)][: k - len(take)]
                picks[i] = np.concatenate([take, rest])
        wh.write("rankings", pl.DataFrame({
            "run_id": "bench", "cohort_id": COHORT, "system": f"sys{m:02d}", "trajectory_id": np.repeat(ids, k),
            "rank": np.tile(np.arange(1, k + 1, dtype=np.int32), n), "code": vocab[picks.ravel()],
            "score": 0.0, "native": True}), run_id="bench", system=f"sys{m:02d}", shard=0)
    wh.write("oracle_probabilities", pl.DataFrame({
        "cohort_id": COHORT, "trajectory_id": np.repeat(ids, k),
        "code": vocab[np.stack([rng.choice(len(vocab), size=k, replace=False, p=weights) for _ in range(n)]).ravel()],
        "probability": rng.random(n * k)}), cohort_id=COHORT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=5000)
    parser.add_argument("--systems", type=int, default=15)
    parser.add_argument("--bootstrap", type=int, default=1000)
    args = parser.parse_args()
    ks = (10, 20, 0)
    steps = []

    def timed(label, fn):
        started = time.perf_counter()
        value = fn()
        steps.append({"step": label, "seconds": round(time.perf_counter() - started, 3),
                      "rows": getattr(value, "height", None)})
        return value

    with tempfile.TemporaryDirectory() as tmp:
        wh = Warehouse(tmp)
        timed("write synthetic warehouse", lambda: build(wh, args.trajectories, args.systems, 20, 0))
        run = timed("load + check run (incl. oracle)", lambda: load_run(wh, "bench", ks=(10, 20)))
        counts = timed("per-trajectory counts", lambda: system_counts(run, ks))
        weights = timed("bootstrap weights", lambda: bootstrap_weights(run.subject_index, args.bootstrap, 0))
        est = timed("metrics + bootstrap", lambda: estimate(counts, weights))
        rows = timed("metric rows + intervals", lambda: metric_rows(est))
        pairs = list(combinations(run.systems, 2))
        timed(f"paired comparisons ({len(pairs)} pairs)", lambda: paired_rows(est, pairs, run.subject_index))
        forecasting = [s for s in run.systems if s not in ORACLES]
        pools = [(s,) for s in forecasting] + [tuple(forecasting)]
        timed(f"pool oracle ({len(pools)} pools)", lambda: estimate(pool_oracle_counts(run, pools, ks)[0], weights))
        timed("coverage", lambda: coverage_rows(run, ks))
    total = sum(s["seconds"] for s in steps[1:])
    width = max(len(s["step"]) for s in steps)
    print(f"{'step':<{width}}  {'seconds':>8}  {'rows':>8}")
    for s in steps:
        print(f"{s['step']:<{width}}  {s['seconds']:>8.3f}  {s['rows'] if s['rows'] is not None else '':>8}")
    print(f"{'evaluation total (without the warehouse build)':<{width}}  {total:>8.3f}")
    result = {"trajectories": args.trajectories, "systems": len(run.systems), "bootstrap": args.bootstrap,
              "ks": list(ks), "metric_rows": rows.height, "steps": steps, "evaluation_seconds": round(total, 3),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "python": platform.python_version(), "machine": platform.machine()}
    print(f"peak RSS {result['peak_rss_mb']} MB")
    write_result(RESULTS / "evaluate.json", result)


if __name__ == "__main__":
    main()
