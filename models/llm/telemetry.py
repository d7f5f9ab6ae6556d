"""Report-time views of `llm_calls`: cost from the configured price table (never stored)."""

from __future__ import annotations

import polars as pl

from models.llm.config import ModelPrice


def call_costs(calls: pl.DataFrame, prices: dict[str, ModelPrice]) -> pl.DataFrame:
    """`calls` with `cost_usd`: uncached input, cached input and output tokens at the model's price per 1M
    tokens; reasoning tokens are billed as output and already counted in `tokens_out`. Null for unpriced models."""
    table = pl.DataFrame({"model": list(prices), "p_in": [p.input for p in prices.values()],
                          "p_cached": [p.cached_input_price for p in prices.values()],
                          "p_out": [p.output for p in prices.values()]},
                         schema={"model": pl.String, "p_in": pl.Float64, "p_cached": pl.Float64, "p_out": pl.Float64})
    return calls.join(table, on="model", how="left", maintain_order="left").with_columns(
        (((pl.col("tokens_in") - pl.col("tokens_cached_in")) * pl.col("p_in")
          + pl.col("tokens_cached_in") * pl.col("p_cached") + pl.col("tokens_out") * pl.col("p_out")) / 1e6)
        .alias("cost_usd")).drop("p_in", "p_cached", "p_out")


TOKEN_KINDS = ("tokens_in", "tokens_cached_in", "tokens_out", "tokens_reasoning")


def backend_totals(calls: pl.DataFrame, prices: dict[str, ModelPrice], by: list[str]) -> pl.DataFrame:
    """Per group of `by`: LLM calls, backend calls, cache hits, tokens by kind, backend latency and cost.

    A cache hit sent no request: it is counted as a call but adds no tokens, no backend latency
    (its latency is a local file read) and no cost, whatever the price table says. Cost is null
    when a backend call's model has no price: an unknown cost is not zero.
    """
    backend = ~pl.col("cache_hit")
    costed = call_costs(calls, prices).with_columns(
        pl.when(pl.col("cache_hit")).then(0.0).otherwise(pl.col("cost_usd")).alias("cost_usd"))
    return (costed.group_by(by, maintain_order=True)
            .agg(pl.len().cast(pl.Int64).alias("llm_calls"), backend.sum().cast(pl.Int64).alias("backend_calls"),
                 pl.col("cache_hit").sum().cast(pl.Int64).alias("cache_hits"),
                 *(pl.col(kind).filter(backend).sum().cast(pl.Int64) for kind in TOKEN_KINDS),
                 pl.col("latency_ms").filter(backend).median().alias("latency_ms_p50"),
                 pl.col("latency_ms").filter(backend).sum().cast(pl.Float64).alias("latency_ms_total"),
                 pl.when(pl.col("cost_usd").is_null().any()).then(None).otherwise(pl.col("cost_usd").sum())
                 .cast(pl.Float64).alias("cost_usd")))
