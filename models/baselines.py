"""Simple baselines every user asks about, as peers of the learned models.

All forecasters share one interface: `fit(con, cohort_id)` learns from the forecasting store only
(a DuckDB connection that cannot open the gold store), and `predict(trajectories, pretarget, k)`
maps pre-target records to ranked codes. Scores are comparable within one trajectory only.
"""

from __future__ import annotations

from typing import Protocol

import duckdb
import polars as pl

from warehouse.store import fetch_frame

# What `predict` receives of each trajectory: its identity, not its target encounter nor its cutoff.
FORECASTER_COLUMNS = ("trajectory_id", "subject_id")
RANKING_COLUMNS = {"trajectory_id": pl.String, "rank": pl.Int32, "code": pl.String, "score": pl.Float64,
                   "native": pl.Boolean}


class Forecaster(Protocol):
    system: str
    # What identifies the fitted model (e.g. a registered model version), set by `fit` on forecasters
    # whose predictions the forecast stage may cache; None for those recomputed every time. Those with a key
    # also say `inference_settings()`: what else decides their scores in the calling thread (torch threads, …).
    model_key: dict | None = None

    def fit(self, con: duckdb.DuckDBPyConnection, cohort_id: str) -> None: ...

    def predict(self, trajectories: pl.DataFrame, pretarget: pl.DataFrame, k: int) -> pl.DataFrame:
        """One row per (trajectory_id, rank) with code, score and native (False for padding)."""


def train_code_frequency(con: duckdb.DuckDBPyConnection, cohort_id: str) -> pl.DataFrame:
    """Ω codes by the number of train-split encounters that carry them (code, count), most frequent first.

    Train patients only: statistics over evaluation patients may never reach a forecasting step.
    """
    return fetch_frame(con, """
        SELECT e.code, count(DISTINCT e.encounter_id)::DOUBLE AS count
        FROM train_events e
        JOIN cohort_vocabulary v ON v.cohort_id = e.cohort_id AND v.code = e.code
        WHERE e.cohort_id = ? AND e.code LIKE 'DIAGNOSIS//%'
        GROUP BY e.code ORDER BY count DESC, e.code""", [cohort_id])


class GlobalFrequency:
    """The same list for everyone: Ω codes by train-split encounter frequency."""

    system = "global_frequency"

    def fit(self, con: duckdb.DuckDBPyConnection, cohort_id: str) -> None:
        self.frequency = train_code_frequency(con, cohort_id)

    def predict(self, trajectories: pl.DataFrame, pretarget: pl.DataFrame, k: int) -> pl.DataFrame:
        top = self.frequency.head(k).with_columns(pl.int_range(1, pl.len() + 1, dtype=pl.Int32).alias("rank"))
        return (trajectories.select("trajectory_id").join(top, how="cross")
                .select("trajectory_id", "rank", "code", pl.col("count").alias("score"),
                        pl.lit(True).alias("native"))
                .sort("trajectory_id", "rank"))


class RepeatHistory:
    """The patient's own diagnoses by count then recency, padded with train-split global frequency.

    The count is that of pre-target encounters recording the code (diagnoses without an encounter
    count together as one), as `candidates.history_count` counts: a code listed twice in one stay, or
    two source codes harmonized to one, is still one encounter. Recency is the latest dated event;
    a code known only from undated rows is the least recent.
    """

    system = "repeat_history"

    def fit(self, con: duckdb.DuckDBPyConnection, cohort_id: str) -> None:
        self.frequency = train_code_frequency(con, cohort_id)
        self.vocabulary = fetch_frame(con, "SELECT code FROM cohort_vocabulary WHERE cohort_id = ?", [cohort_id])

    def predict(self, trajectories: pl.DataFrame, pretarget: pl.DataFrame, k: int) -> pl.DataFrame:
        history = (pretarget.filter(pl.col("code").str.starts_with("DIAGNOSIS//"))
                   .join(self.vocabulary, on="code", how="semi")
                   .group_by("trajectory_id", "code")
                   .agg(pl.col("encounter_id").n_unique().alias("count"), pl.col("time").max().alias("last_time"))
                   .sort(["trajectory_id", "count", "last_time", "code"], descending=[False, True, True, False],
                         nulls_last=True)
                   .with_columns(pl.lit(True).alias("native"),
                                 pl.col("count").cast(pl.Float64).alias("score")))
        # Padding scores sit below every history score (history counts are >= 1).
        padding = self.frequency.head(k).with_columns(
            (pl.col("count") / (pl.col("count").max() + 1)).alias("score"), pl.lit(False).alias("native"),
            pl.int_range(pl.len()).alias("pad_order"))
        candidates = pl.concat([
            history.select("trajectory_id", "code", "score", "native", pl.lit(-1).alias("pad_order"),
                           pl.int_range(pl.len()).over("trajectory_id").alias("order")),
            trajectories.select("trajectory_id").join(padding, how="cross")
            .select("trajectory_id", "code", "score", "native", "pad_order",
                    (pl.col("pad_order") + 10**9).alias("order")),
        ], how="vertical_relaxed")
        return (candidates.sort("trajectory_id", "order")
                .unique(["trajectory_id", "code"], keep="first", maintain_order=True)
                .with_columns(pl.int_range(1, pl.len() + 1, dtype=pl.Int32).over("trajectory_id").alias("rank"))
                .filter(pl.col("rank") <= k)
                .select("trajectory_id", "rank", "code", "score", "native"))

