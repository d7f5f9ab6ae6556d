"""Typed exceptions. The library raises these; the CLI turns each into one line and exit code 1.

Every message names the offending value and says how to fix it.
"""

import logging
import sys

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class DxrError(Exception):
    """Base class for every error a user can act on."""


class ConfigError(DxrError):
    """Invalid configuration file, environment variable or option."""


class InputError(DxrError):
    """Bad input data: a missing path, malformed file, missing column, unknown code system."""


class NotFoundError(DxrError):
    """A named dataset, cohort, run or table does not exist in the warehouse."""


class UserErrorTraceback(logging.Filter):
    """Drop the traceback Prefect logs with a failed flow or task run when the error is the user's
    to fix: its one-line message is the report, and the traceback only buries it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (DxrError, OSError)):
            record.exc_info = record.exc_text = None
        elif _is_parameter_error(error):
            # Prefect's check of a run's parameters (a value of a run form that a settings validator refuses)
            # reaches the run's log only as this record: the reason goes into its message, on one line.
            head, *items = str(error).splitlines()
            reasons = "; ".join(item.strip().removeprefix("- ") for item in items)
            record.msg, record.args = f"{record.getMessage()}: {head} {reasons}".rstrip(), None
            record.exc_info = record.exc_text = None
        return True


def _is_parameter_error(error: BaseException | None) -> bool:
    # Prefect is loaded wherever its run loggers log; importing it here would slow every CLI command.
    exceptions = sys.modules.get("prefect.exceptions")
    return exceptions is not None and isinstance(error, exceptions.ParameterTypeError)


def quiet_user_error_tracebacks() -> None:
    """Install `UserErrorTraceback` on Prefect's run loggers, once per process."""
    for name in RUN_LOGGERS:
        run_logger = logging.getLogger(name)
        if not any(isinstance(f, UserErrorTraceback) for f in run_logger.filters):
            run_logger.addFilter(UserErrorTraceback())
