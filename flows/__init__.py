"""Prefect flows: orchestration only (which stages, in which order, on which shards)."""

from dxr.errors import quiet_user_error_tracebacks

# A served flow run executes in Prefect's engine process, which imports its flow from here without
# passing through the CLI: a user's error (an unknown cohort or patient) stays one line in its log too.
quiet_user_error_tracebacks()
