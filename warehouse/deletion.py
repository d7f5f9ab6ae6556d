"""What the deletes (`dxr cohort delete`, `dxr run delete`) share: the partitions and directories one delete removes,
counted by table, with a run's own share of them read off the schemas; the one removal commit that removes them; and
the rerun that finds a delete killed after its commit point pending.

A delete goes in one removal commit of the forecasting store (`Warehouse.delete_together`): a process killed before
the commit point leaves everything whole, one killed after it leaves a commit that the next read of the warehouse
finishes. A rerun of the delete that finds that commit pending finishes it and succeeds (`finish_interrupted`), so
a scheduler's retry of a delete that in fact went through is no failure; what no pending removal names is not found,
gone or not, since nothing records a finished delete and a mistyped id must not pass for a deleted one.

Once the removal is done, the delete (or the rerun that finished it) removes the lock files of what went that no
process holds: those that holders killed while they held them left (`warehouse.locks.remove_unheld`). No later
holder would remove them, since nothing takes the lock of a cohort or a run that is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from warehouse.locks import remove_unheld
from warehouse.runs import RESULT_KINDS, record_lock, registration_lock
from warehouse.schemas import RUN_TABLES, SYSTEMS, TABLES
from warehouse.store import COMMIT_DIR, PART_FILE, Warehouse, finish_commits

# The default place of a run's report (`dxr report` without --out): `<data_dir>/reports/<run_id>`.
REPORTS_DIR = "reports"
# What a rerun that finished a delete's pending removal says after naming what it removed.
INTERRUPTED_DONE = "the earlier delete, interrupted, is now complete"


@dataclass(kw_only=True)
class Removal:
    """What one delete removes (or removed): partitions by table, their rows, and directories."""

    partitions: list[tuple[str, dict]] = field(default_factory=list)  # (table, leading keys), in removal order
    rows: dict[str, int] = field(default_factory=dict)  # table -> rows of its partitions that go
    directories: list[Path] = field(default_factory=list)  # reports and model copies
    locks: list[str] = field(default_factory=list)  # resources whose lock files go with it (`run_locks`, a cohort's)
    interrupted: bool = False  # an earlier delete, killed after its commit point, removed it: this one finished that

    def add(self, wh: Warehouse, table: str, **keys) -> None:
        """One partition (or all under the given leading keys), when it holds files."""
        files = list(wh.partitions_dir(table, **keys).rglob(PART_FILE))
        if files:
            self.partitions.append((table, keys))
            self.rows[table] = self.rows.get(table, 0) + sum(pq.read_metadata(f).num_rows for f in files)

    def add_run_outputs(self, wh: Warehouse, run_id: str) -> None:
        """What a run wrote besides its `runs` rows: every other table partitioned by `run_id` first, so a table
        added later is not forgotten, and its report in the default place (one written with --out stays)."""
        for table in sorted(RUN_TABLES - {"runs"}):
            self.add(wh, table, run_id=run_id)
        if (report := wh.root / REPORTS_DIR / run_id).is_dir():
            self.directories.append(report)

    def remove(self, wh: Warehouse) -> None:
        """Remove it all in one removal commit, then the lock files of what went that no process holds."""
        wh.delete_together(self.partitions, self.directories)
        remove_unheld(wh, self.locks)

    def listing(self, wh: Warehouse, done: str) -> list[str]:
        """The lines a delete prints under its first: rows by table and store, then each directory."""
        from warehouse.sql import format_table

        by_table = [(name, TABLES[name].store, n) for name, n in self.rows.items()]
        return ([format_table(["table", "store", "rows"], by_table).rstrip("\n")]
                + [f"{done} {path.relative_to(wh.root)}/" for path in self.directories])


def run_locks(runs: pl.DataFrame) -> list[str]:
    """The locks taken under the ids of the `runs` rows (run_id, kind) that a delete removes: each row's record lock
    and each id's registration lock (`warehouse.runs.registered_run`), and for a result run also those its forecasts
    and evaluation take (`run:` and `run-system:` in `flows.forecast` and `warehouse.runs.holding_run`), the last for
    every system, since a fused forecast takes those of the systems it reads too."""
    rows = sorted(set(runs.select("run_id", "kind").rows()))
    locks = [record_lock(run_id, kind) for run_id, kind in rows]
    locks += [registration_lock(run_id) for run_id in sorted({run_id for run_id, _ in rows})]
    for run_id in sorted({run_id for run_id, kind in rows if kind.startswith(RESULT_KINDS)}):
        locks += [f"run:{run_id}", *(f"run-system:{run_id}|{system}" for system in SYSTEMS)]
    return locks


def finish_interrupted(wh: Warehouse, table: str, which: pl.Expr) -> tuple[pl.DataFrame, pl.DataFrame] | None:
    """The rows of `table` matching `which`, and every `runs` row, that removals left pending by deletes killed after
    their commit point remove, once those removals are finished; None, finishing nothing, when no pending removal
    removes such a row of `table`.

    Looked for before any read, since the first read finishes every pending commit and the rows are then gone.
    """
    found = wh.being_removed(table).filter(which)
    if found.is_empty():
        return None
    runs = wh.being_removed("runs")
    finish_commits(wh.forecast_dir / COMMIT_DIR)
    return found, runs
