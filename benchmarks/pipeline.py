"""Benchmark: every user-facing command once, in the order a team runs them, on one synthetic warehouse.

Runs `python -m dxr` of this checkout in a new `--data-dir`: synth, cohort build and list, the EHR prior's
training (`--epochs`, 2 by default, to bound the time), forecasts of `held_out` by repeat_history, transition and
ehr_prior into one run, its evaluation and report, the README's `dxr sql` queries (metrics, runs, ranking status,
the rankings joined to their titles as a table and as CSV, the ledger, LLM calls), `dxr run list`, the README's
patient rerun, a forecast rerun of the run (the prediction cache) and `dxr run delete`. Each command's wall time,
peak RSS (the largest of its process and the processes it waited for, from `wait4`) and the load average before
and after it; for the training, the seconds of each epoch after the first (from its log lines; the first also
holds the featurization). Prints a table; writes JSON to benchmarks/results/pipeline-<patients>.json.

    python benchmarks/pipeline.py --data-dir /tmp/pipeline100k [--patients 100000] [--seed 7] [--epochs 2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402

RUN = "bench"
RANKINGS_WITH_TITLES = ("SELECT r.system, r.trajectory_id, r.rank, c.dotted, c.title FROM rankings r "
                        "LEFT JOIN icd_codes c USING (code) ORDER BY r.system, r.trajectory_id, r.rank")
EPOCH_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) .* epoch \d+/\d+: ")


def commands(patients: int, seed: int, epochs: int) -> list[tuple[str, list[str]]]:
    """(label, dxr arguments) in the order they run."""
    forecast = ["forecast", "--cohort", "default", "--run-id", RUN, "--system"]
    return [
        ("synth", ["synth", "--patients", str(patients), "--seed", str(seed)]),
        ("cohort build", ["cohort", "build", "--dataset", "synthetic", "--name", "default"]),
        ("cohort list", ["cohort", "list"]),
        ("prior train", ["prior", "train", "--cohort", "default", "--system", "ehr_prior", "--epochs", str(epochs)]),
        ("forecast repeat_history", forecast + ["repeat_history"]),
        ("forecast transition", forecast + ["transition"]),
        ("forecast ehr_prior", forecast + ["ehr_prior"]),
        ("evaluate", ["evaluate", "--run", RUN]),
        ("report", ["report", "--run", RUN]),
        ("sql metrics", ["sql", "SELECT run_id, system, metric, k, value, ci_low, ci_high FROM metrics "
                                "WHERE subset = 'all' ORDER BY ALL"]),
        ("sql runs", ["sql", "SELECT run_id, kind, status, started_at, finished_at FROM runs ORDER BY started_at"]),
        ("sql --run ranking_status", ["sql", "--run", RUN, "SELECT system, status, count(*) AS n FROM ranking_status "
                                                          "GROUP BY ALL ORDER BY ALL"]),
        ("sql --run rankings with titles", ["sql", "--run", RUN, RANKINGS_WITH_TITLES]),
        ("sql --run rankings with titles, csv", ["sql", "--run", RUN, "--format", "csv", RANKINGS_WITH_TITLES]),
        ("sql --run ledger", ["sql", "--run", RUN, "SELECT trajectory_id, evidence_id, code, channel, state, engine, "
                                                  "coalesce(url, doc_id) AS source, detail FROM ledger "
                                                  "ORDER BY trajectory_id, evidence_id[2:]::INT"]),
        ("sql --run llm_calls", ["sql", "--run", RUN, "SELECT stage, status, count(*) AS calls, sum(tokens_in), "
                                                     "sum(tokens_out) FROM llm_calls GROUP BY ALL"]),
        ("run list", ["run", "list"]),
        ("patient rerun", ["forecast", "--cohort", "default", "--system", "ehr_prior", "--split", "all",
                           "--subject-id", "6"]),
        ("forecast ehr_prior again (cache)", forecast + ["ehr_prior"]),
        ("run delete", ["run", "delete", RUN]),
    ]


def measure(data_dir: Path, label: str, args: list[str]) -> dict:
    """Run one dxr command to completion; its wall time, peak RSS and the load average around it."""
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "dxr", "--data-dir", str(data_dir), *args], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        last = stderr.strip().splitlines()[-1:] or [f"exit status {os.waitstatus_to_exitcode(status)}, no output"]
        raise SystemExit(f"dxr {' '.join(args)} failed: {last[0]}")
    row = {"command": label, "args": args, "seconds": round(seconds, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024),
           "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    epochs = [datetime.strptime(m.group(1), "%H:%M:%S.%f") for m in map(EPOCH_LINE.match, stderr.splitlines()) if m]
    if len(epochs) > 1:
        # Log lines carry clock times only: a training that runs past midnight starts the next day's clock.
        row["later_epoch_seconds"] = [round((b - a).total_seconds() % 86400, 1) for a, b in zip(epochs, epochs[1:])]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True, help="a new directory: the warehouse it makes")
    parser.add_argument("--patients", type=int, default=100000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if args.data_dir.exists() and any(args.data_dir.iterdir()):
        raise SystemExit(f"--data-dir {args.data_dir} is not empty: give a new directory, the benchmark builds its "
                         "warehouse from nothing")
    args.data_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'command':<36}  {'seconds':>8}  {'peak RSS MB':>11}  load")
    for label, dxr_args in commands(args.patients, args.seed, args.epochs):
        rows.append(measure(args.data_dir, label, dxr_args))
        row = rows[-1]
        print(f"{label:<36}  {row['seconds']:>8.2f}  {row['peak_rss_mb']:>11,}  "
              f"{row['load_before']:.2f}->{row['load_after']:.2f}", flush=True)
    write_result(RESULTS / f"pipeline-{args.patients}.json",
                 {"patients": args.patients, "seed": args.seed, "epochs": args.epochs, "commands": rows})


if __name__ == "__main__":
    main()
