"""Benchmark: the run registry's cost per registered run as the registry grows.

Every producing command (and each system of a patient rerun or backfill) enters `registered_run`,
which first looks for runs that a killed process left `running`. This measures that entry plus the
`running` and `finished` rows with an empty body, on registries of growing size (one Parquet file
per run and kind, as the warehouse keeps them); reading one run's rows (by partition, and through
DuckDB on a plain and on a run-scoped connection, `Warehouse.connect(run_id=…)`) and the whole registry;
opening a connection with every table as a view, and the one that model fitting and training use
(`Warehouse.connect(tables=NON_RUN_TABLES)`); `dxr sql` over a table that is not partitioned by run.
Prints a table; writes JSON to benchmarks/results/registry.json.

    python benchmarks/registry.py [--sizes 0,1000,10000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402
from warehouse.runs import mark_killed, record_run, registered_run  # noqa: E402
from warehouse.schemas import NON_RUN_TABLES, utc_now  # noqa: E402
from warehouse.sql import run_query  # noqa: E402
from warehouse.store import Warehouse  # noqa: E402


def grow(wh: Warehouse, start: int, stop: int) -> None:
    """Finished runs `r{start}`..`r{stop - 1}`, written as the registry writes them (times in UTC)."""
    now = utc_now()
    for i in range(start, stop):
        record_run(wh, f"r{i}", "c1", "forecast:repeat_history", {"split": "held_out", "k": 20}, "finished", now, now)


def seconds(fn, repeats: int) -> float:
    """Median wall time of `fn` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def one_run(wh: Warehouse, counter: list[int]) -> None:
    counter[0] += 1
    with registered_run(wh, "forecast:bench", {}, f"bench-{counter[0]}"):
        pass


def sql_one_run(wh: Warehouse, run_id: str, scoped: bool) -> None:
    """One run's registry rows through DuckDB, as evaluation and the report query them."""
    con = wh.connect(run_id=run_id if scoped else None)
    con.execute("SELECT kind, status, started_at, finished_at FROM runs WHERE run_id = ?", [run_id]).fetchall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,1000,10000", help="registry sizes (runs), ascending")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    rows = []
    # On the repository's disk, as a warehouse would be, but under the ignored results directory: a killed run
    # leaves nothing git would list.
    scratch_parent = REPO / "benchmarks" / "results"
    scratch_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch_parent) as root:
        wh = Warehouse(root)
        mark_killed(wh)  # a new warehouse: nothing to index
        grown, counter = 0, [0]
        for size in sizes:
            grow(wh, grown, size)
            grown = size
            rows.append({
                "registry_runs": size,
                "registered_run_ms": round(1000 * seconds(lambda: one_run(wh, counter), args.repeats), 2),
                "mark_killed_ms": round(1000 * seconds(lambda: mark_killed(wh), args.repeats), 2),
                "read_one_run_ms": round(1000 * seconds(lambda: wh.read("runs", run_id="r0"), args.repeats), 2),
                "sql_one_run_ms": round(1000 * seconds(lambda: sql_one_run(wh, "r0", scoped=False), 3), 2),
                "sql_one_run_scoped_ms": round(1000 * seconds(lambda: sql_one_run(wh, "r0", scoped=True),
                                                              args.repeats), 2),
                "connect_ms": round(1000 * seconds(wh.connect, 3), 2),
                "connect_non_run_ms": round(1000 * seconds(lambda: wh.connect(tables=NON_RUN_TABLES), args.repeats),
                                            2),
                "sql_cohorts_ms": round(1000 * seconds(lambda: run_query(wh, "SELECT count(*) FROM cohorts"),
                                                       args.repeats), 2),
                "read_registry_s": round(seconds(lambda: wh.read("runs"), 1), 2),
            })
            rows[-1]["registry_runs"] += counter[0]  # the benchmark's own runs are in the registry too
            print(rows[-1], file=sys.stderr, flush=True)  # progress; stdout holds the table alone
    header = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in header]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(str(row[h]).rjust(w) for h, w in zip(header, widths)))
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")  # ISO 8601 with +00:00, as dxr's times
    write_result(RESULTS / "registry.json", {"rows": rows, "repeats": args.repeats, "machine": platform.machine(),
                                             "python": platform.python_version(), "measured_at": measured_at})


if __name__ == "__main__":
    main()
