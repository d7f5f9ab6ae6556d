"""Pipeline stages: plain functions over warehouse tables, each with a thin Prefect task wrapper."""

from __future__ import annotations

import logging

from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger


def stage_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run's logger inside a flow or task run; the named module logger when a stage function
    is called directly (a notebook, a benchmark)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(name)
