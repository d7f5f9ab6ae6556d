"""Queries over what a run's stages wrote (`rankings`, `ranking_status`, `llm_calls`, `superseded_llm_calls`,
`metrics`), for the stages that read a run back: its efficiency (tasks.efficiency), its report and the demo's realism
check."""

from __future__ import annotations

import duckdb
import polars as pl
import pyarrow.parquet as pq

from warehouse.store import PART_FILE, Warehouse, fetch_frame


def matched_patients(connection: duckdb.DuckDBPyConnection, run_id: str) -> pl.DataFrame:
    """(system, trajectory_id, subject_id), sorted: every trajectory each system of the run ranked or gave a status,
    with its patient (several trajectories of one patient in a cohort that targets every encounter)."""
    return fetch_frame(connection, """
        SELECT m.system, m.trajectory_id, t.subject_id FROM (
            SELECT system, trajectory_id FROM rankings WHERE run_id = $run
            UNION SELECT system, trajectory_id FROM ranking_status WHERE run_id = $run) m
        JOIN trajectories t USING (trajectory_id)
        ORDER BY m.system, m.trajectory_id""", {"run": run_id})


def run_llm_calls(connection: duckdb.DuckDBPyConnection, run_id: str) -> pl.DataFrame:
    """Every `llm_calls` row of the run, in every column."""
    return fetch_frame(connection, "SELECT * FROM llm_calls WHERE run_id = ?", [run_id])


def run_superseded_calls(connection: duckdb.DuckDBPyConnection, run_id: str) -> pl.DataFrame:
    """Every `superseded_llm_calls` row of the run: the calls of attempts that a rerun of their system replaced."""
    return fetch_frame(connection, "SELECT * FROM superseded_llm_calls WHERE run_id = ?", [run_id])


def calls_written_before_cost(wh: Warehouse, run_id: str) -> list[str]:
    """`call_id` of the run's `llm_calls` rows in files written before `cost_usd` was recorded: their cost reads null
    because the file has no such column, not because their model had no price (which a newer file's null says)."""
    files = sorted(wh.partitions_dir("llm_calls", run_id=run_id).rglob(PART_FILE))
    return [call_id for path in files if "cost_usd" not in pq.read_schema(path).names
            for call_id in pl.read_parquet(path, columns=["call_id"], glob=False)["call_id"]]


def run_metric(connection: duckdb.DuckDBPyConnection, run_id: str, metric: str, k: int,
               subset: str = "all") -> pl.DataFrame:
    """(system, value): one `metrics` value per system of the run's evaluation, on the codes of `subset`."""
    return fetch_frame(connection, "SELECT system, value FROM metrics WHERE run_id = ? AND subset = ? AND metric = ? "
                                   "AND k = ?", [run_id, subset, metric, k])
