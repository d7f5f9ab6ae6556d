"""Cost of `llm_calls` rows: priced once, when a run writes them (`call_costs` on the run's price table), and
summed per group for the report (`backend_totals`).

Rows written before `cost_usd` was stored have no cost of their own: `with_report_time_costs` prices them from the
price table at report time, as every row was priced before.
"""

from __future__ import annotations

import polars as pl

from models.llm.config import ModelPrice


def call_costs(calls: pl.DataFrame, prices: dict[str, ModelPrice]) -> pl.DataFrame:
    """`calls` with `cost_usd`: uncached input, cached input and output tokens at the model's price per 1M
    tokens; reasoning tokens are billed as output and already counted in `tokens_out`. 0 for a cache hit (it sent
    no request, whatever the price table says); null for a backend call of an unpriced model (unknown is not 0)."""
    table = pl.DataFrame({"model": list(prices), "p_in": [p.input for p in prices.values()],
                          "p_cached": [p.cached_input_price for p in prices.values()],
                          "p_out": [p.output for p in prices.values()]},
                         schema={"model": pl.String, "p_in": pl.Float64, "p_cached": pl.Float64, "p_out": pl.Float64})
    priced = (((pl.col("tokens_in") - pl.col("tokens_cached_in")) * pl.col("p_in")
               + pl.col("tokens_cached_in") * pl.col("p_cached") + pl.col("tokens_out") * pl.col("p_out")) / 1e6)
    return calls.join(table, on="model", how="left", maintain_order="left").with_columns(
        pl.when(pl.col("cache_hit")).then(0.0).otherwise(priced).alias("cost_usd")).drop("p_in", "p_cached", "p_out")


def with_report_time_costs(calls: pl.DataFrame, prices: dict[str, ModelPrice],
                           written_before_cost: pl.Expr) -> pl.DataFrame:
    """`calls` with the rows selected by `written_before_cost` (written before `cost_usd` was stored, so null for
    want of the column, not for want of a price) priced from `prices` now; every other row keeps the cost stored
    when it was written, the price in force then, whatever `prices` says today."""
    now = call_costs(calls.drop("cost_usd"), prices)["cost_usd"]
    return calls.with_columns(pl.when(written_before_cost).then(now).otherwise(pl.col("cost_usd")).alias("cost_usd"))


TOKEN_KINDS = ("tokens_in", "tokens_cached_in", "tokens_out", "tokens_reasoning")


def backend_totals(calls: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """Per group of `by`: LLM calls, backend calls, cache hits, tokens by kind, backend latency and the sum of the
    calls' `cost_usd`.

    A cache hit sent no request: it is counted as a call but adds no tokens and no backend latency
    (its latency is a local file read); its cost is 0 (`call_costs`). The cost is null when a call's
    cost is: an unknown cost is not zero.
    """
    backend = ~pl.col("cache_hit")
    return (calls.group_by(by, maintain_order=True)
            .agg(pl.len().cast(pl.Int64).alias("llm_calls"), backend.sum().cast(pl.Int64).alias("backend_calls"),
                 pl.col("cache_hit").sum().cast(pl.Int64).alias("cache_hits"),
                 *(pl.col(kind).filter(backend).sum().cast(pl.Int64) for kind in TOKEN_KINDS),
                 pl.col("latency_ms").filter(backend).median().alias("latency_ms_p50"),
                 pl.col("latency_ms").filter(backend).sum().cast(pl.Float64).alias("latency_ms_total"),
                 pl.when(pl.col("cost_usd").is_null().any()).then(None).otherwise(pl.col("cost_usd").sum())
                 .cast(pl.Float64).alias("cost_usd")))
