"""Benchmark: generating the synthetic MEDS dataset (and, with --realism, its oracle and bands).

Generates `--patients` patients into a temporary directory (or `--out`), then reports patients,
events, seconds, rows/s and peak memory (the main process and the largest worker). With
`--realism` it also times the oracle on the held_out final-encounter cohort and prints the
realism bands. Prints a table; writes JSON to benchmarks/results/synth.json.

    python benchmarks/synth.py [--patients 60000] [--seed 7] [--workers 2] [--realism]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402
from warehouse.synthetic import GENERATOR_VERSION, generate, oracle  # noqa: E402
from warehouse.synthetic.realism import (  # noqa: E402
    REALISM_BANDS, diagnosis_encounters, final_encounter_cohort, realism_report,
)


def run(out: Path, args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    generate(out, args.patients, args.seed, shard_size=args.shard_size, progress=args.progress, workers=args.workers)
    seconds = time.perf_counter() - started
    shards = sorted((out / "data").glob("*.parquet"))
    events = sum(pq.ParquetFile(s).metadata.num_rows for s in shards)
    result = {
        "generator_version": GENERATOR_VERSION, "patients": args.patients, "seed": args.seed,
        "shard_size": args.shard_size, "workers": args.workers, "shards": len(shards), "events": events,
        "seconds": round(seconds, 2), "rows_per_second": round(events / seconds),
        "patients_per_second": round(args.patients / seconds, 1),
        "data_mb": round(sum(s.stat().st_size for s in shards) / 2**20, 1),
    }
    if args.realism:
        cohort = final_encounter_cohort(diagnosis_encounters(out), args.split_seed)
        started = time.perf_counter()
        oracle(out, cohort, harmonize=None, draws=200, top=100)
        result["oracle_trajectories"] = cohort.height
        result["oracle_seconds"] = round(time.perf_counter() - started, 2)
        result["realism"] = realism_report(out, seed=args.split_seed)
    result["peak_rss_mb_main"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["peak_rss_mb_worker"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, default=60000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--split-seed", type=int, default=7, help="hash_split seed of the realism cohort")
    parser.add_argument("--shard-size", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--realism", action="store_true", help="also time the oracle and print the realism bands")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="keep the dataset here (default: a temp dir)")
    args = parser.parse_args()
    if args.out:
        result = run(args.out, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(Path(tmp) / "meds", args)
    rows = [("patients", f"{result['patients']:,}"), ("events", f"{result['events']:,}"),
            ("shards", result["shards"]), ("workers", result["workers"]), ("seconds", result["seconds"]),
            ("rows/s", f"{result['rows_per_second']:,}"), ("patients/s", result["patients_per_second"]),
            ("data (MB, zstd Parquet)", result["data_mb"]),
            ("peak RSS main (MB)", result["peak_rss_mb_main"]), ("peak RSS worker (MB)", result["peak_rss_mb_worker"])]
    if args.realism:
        rows += [("oracle trajectories", result["oracle_trajectories"]), ("oracle seconds", result["oracle_seconds"])]
        rows += [(f"{k} (band {REALISM_BANDS[k][0]:g}–{REALISM_BANDS[k][1]:g})" if k in REALISM_BANDS else k,
                  f"{v:.3f}") for k, v in result["realism"].items()]
    width = max(len(str(k)) for k, _ in rows)
    print(f"{'measure':<{width}}  value")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    result.update(python=platform.python_version(), machine=platform.machine())
    write_result(RESULTS / ("synth.json" if not args.realism else f"synth_realism_seed{args.seed}.json"), result)


if __name__ == "__main__":
    main()
