"""Queries over the evidence tables a run's retrieval writes (`search_jobs`, `ledger`; see tools.ledger)."""

from __future__ import annotations

import duckdb
import polars as pl

from warehouse.store import fetch_frame


def retrieval_efficiency(connection: duckdb.DuckDBPyConnection, run_id: str) -> pl.DataFrame:
    """Per trajectory: queries (distinct sanitized queries), retrieval operations (job x engine),
    source accesses (records that opened a source: every state but no_result), supported records."""
    return fetch_frame(connection, """
        SELECT j.trajectory_id,
               count(DISTINCT j.query) AS queries,
               count(DISTINCT l.job_id || '|' || l.engine) AS retrieval_operations,
               count(l.evidence_id) FILTER (WHERE l.state <> 'no_result') AS source_accesses,
               count(l.evidence_id) FILTER (WHERE l.state = 'readable_supported') AS supported_records
        FROM search_jobs j LEFT JOIN ledger l ON l.run_id = j.run_id AND l.job_id = j.job_id
        WHERE j.run_id = ?
        GROUP BY j.trajectory_id ORDER BY j.trajectory_id
    """, [run_id])


def search_job_count(connection: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """The number of `search_jobs` rows the run wrote."""
    return fetch_frame(connection, "SELECT count(*) AS n FROM search_jobs WHERE run_id = ?", [run_id])["n"].item()
