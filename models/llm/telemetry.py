"""Report-time views of `llm_calls`: cost from the configured price table (never stored)."""

from __future__ import annotations

import polars as pl

from models.llm.config import ModelPrice


def call_costs(calls: pl.DataFrame, prices: dict[str, ModelPrice]) -> pl.DataFrame:
    """`calls` with `cost_usd`: uncached input, cached input and output tokens at the model's price per 1M
    tokens; reasoning tokens are billed as output and already counted in `tokens_out`. Null for unpriced models."""
    table = pl.DataFrame({"model": list(prices), "p_in": [p.input for p in prices.values()],
                          "p_cached": [p.cached_input for p in prices.values()],
                          "p_out": [p.output for p in prices.values()]},
                         schema={"model": pl.String, "p_in": pl.Float64, "p_cached": pl.Float64, "p_out": pl.Float64})
    return calls.join(table, on="model", how="left", maintain_order="left").with_columns(
        (((pl.col("tokens_in") - pl.col("tokens_cached_in")) * pl.col("p_in")
          + pl.col("tokens_cached_in") * pl.col("p_cached") + pl.col("tokens_out") * pl.col("p_out")) / 1e6)
        .alias("cost_usd")).drop("p_in", "p_cached", "p_out")
