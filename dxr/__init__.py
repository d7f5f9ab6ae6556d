"""dxr: evidence-grounded clinical forecasting on MEDS data."""

import os

from dxr.noise import silence_third_party_noise

__version__ = "0.1.0"

# Offline hygiene wherever dxr runs: no telemetry, no model-hub lookups (a user may still override).
# Prefect's temporary API server gets 120 s to start instead of 20: on a machine busy with other
# work (a compile was enough here) it took longer, and the whole command failed.
for _name, _value in {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                      "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                      "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}.items():
    os.environ.setdefault(_name, _value)

# Here, so that every process running dxr's code (CLI, flows, served flows, benchmarks) prints dxr's output only.
silence_third_party_noise()
