"""dxr: evidence-grounded clinical forecasting on MEDS data."""

import os

__version__ = "0.1.0"

# Offline hygiene wherever dxr runs: no telemetry, no model-hub lookups (a user may still override).
for _name, _value in {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                      "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}.items():
    os.environ.setdefault(_name, _value)
