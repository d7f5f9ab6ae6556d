"""Prefect flows: orchestration only (which stages, in which order, on which shards)."""

from __future__ import annotations

from datetime import timezone

from prefect.runtime import flow_run

from dxr.errors import quiet_user_errors
from warehouse.runs import new_run_id

# A served flow run executes in Prefect's engine process, which imports its flow from here without
# passing through the CLI: a user's error (an unknown cohort or patient) stays one line in its log too.
quiet_user_errors()


def flow_run_id(kind: str) -> str:
    """A run id for the Prefect flow run under way, the same in each of its attempts (a new one outside a flow run).

    A failed flow run is retried as the same flow run (the UI's Retry button, a flow's `retries`): the
    retry must finish the run the first attempt started, not leave it half done beside a second one.
    So the id comes from the flow run's id and expected start (UTC; the server sets it once), not from
    the clock.
    """
    if flow_run.id is None:
        return new_run_id(kind)
    return f"{kind}-{flow_run.scheduled_start_time.astimezone(timezone.utc):%Y%m%dT%H%M%S}-{flow_run.id[-6:]}"
