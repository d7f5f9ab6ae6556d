"""Queries over the evidence tables a run's retrieval writes (`search_jobs`, `ledger`; see tools.ledger)."""

from __future__ import annotations

import duckdb
import polars as pl

from warehouse.store import fetch_frame


def retrieval_efficiency(connection: duckdb.DuckDBPyConnection, run_id: str,
                         units: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per unit: queries (distinct sanitized queries within the unit), retrieval operations (job x engine), source
    accesses (records that opened a source: every state but no_result), supported records.

    `units` maps trajectories to the unit they count in, as (unit, trajectory_id) rows (a patient's trajectories, say);
    by default each trajectory of the run's search jobs is a unit of its own. Trajectories it does not list are left
    out.
    """
    if units is None:
        members = "SELECT DISTINCT trajectory_id AS unit, trajectory_id FROM search_jobs WHERE run_id = $run"
    else:
        connection.register("retrieval_units", units.select("unit", "trajectory_id").to_arrow())
        members = "SELECT unit, trajectory_id FROM retrieval_units"
    return fetch_frame(connection, f"""
        SELECT u.unit,
               count(DISTINCT j.query) AS queries,
               count(DISTINCT l.job_id || '|' || l.engine) AS retrieval_operations,
               count(l.evidence_id) FILTER (WHERE l.state <> 'no_result') AS source_accesses,
               count(l.evidence_id) FILTER (WHERE l.state = 'readable_supported') AS supported_records
        FROM ({members}) u JOIN search_jobs j ON j.run_id = $run AND j.trajectory_id = u.trajectory_id
        LEFT JOIN ledger l ON l.run_id = j.run_id AND l.job_id = j.job_id
        GROUP BY u.unit ORDER BY u.unit
    """, {"run": run_id})


def search_job_count(connection: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """The number of `search_jobs` rows the run wrote."""
    return fetch_frame(connection, "SELECT count(*) AS n FROM search_jobs WHERE run_id = ?", [run_id])["n"].item()
