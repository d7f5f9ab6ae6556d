"""Pipeline stages: plain functions over warehouse tables, each with a thin Prefect task wrapper."""
