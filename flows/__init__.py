"""Prefect flows: orchestration only (which stages, in which order, on which shards)."""
