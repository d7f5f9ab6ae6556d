"""dxr: evidence-grounded clinical forecasting on MEDS data."""

__version__ = "0.1.0"
