"""Typed exceptions. The library raises these; the CLI turns each into one line and exit code 1.

Every message names the offending value and says how to fix it.
"""


class DxrError(Exception):
    """Base class for every error a user can act on."""


class ConfigError(DxrError):
    """Invalid configuration file, environment variable or option."""


class InputError(DxrError):
    """Bad input data: a missing path, malformed file, missing column, unknown code system."""


class NotFoundError(DxrError):
    """A named dataset, cohort, run or table does not exist in the warehouse."""


class BoundaryError(DxrError):
    """An operation would let target-encounter information reach a forecasting step."""
