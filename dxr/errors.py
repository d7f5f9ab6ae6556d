"""Typed exceptions. The library raises these; the CLI turns each into one line and exit code 1.

Every message names the offending value and says how to fix it.
"""

import logging
import sys

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
# What Prefect's engines log, with the exception, when a task run or flow run raises; its final state line
# ("Finished in state Failed('… NotFoundError: <message>')") follows and says the same.
RAISED = ("Task run failed with exception", "Encountered exception during execution")
FINISHED = "Finished in state "


class DxrError(Exception):
    """Base class for every error a user can act on."""


class ConfigError(DxrError):
    """Invalid configuration file, environment variable or option."""


class InputError(DxrError):
    """Bad input data: a missing path, malformed file, missing column, unknown code system."""


class NotFoundError(DxrError):
    """A named dataset, cohort, run or table does not exist in the warehouse."""


class QuietUserErrors(logging.Filter):
    """Keep a failed run's error that is the user's to fix to its one-line message: drop the traceback Prefect
    logs with it, and the records that only repeat it.

    Prefect logged such an error three times at ERROR before the CLI's `Error:` line: the task run's exception
    and its final state, then the flow run's exception. Each of those goes (the task run's state line once its
    exception went); the flow run's state line stays, with the message, in the terminal and in the Prefect UI,
    where both runs still end Failed with it. An error that is no user's keeps every record and its traceback.
    """

    def __init__(self):
        super().__init__()
        self.quiet_task_runs: set[str] = set()  # task runs whose user's error was dropped, until their state line

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        task_run_id = getattr(record, "task_run_id", None)
        if isinstance(error, (DxrError, OSError)):
            if record.getMessage().startswith(RAISED):
                if task_run_id is not None:
                    self.quiet_task_runs.add(task_run_id)
                return False
            record.exc_info = record.exc_text = None
        elif task_run_id in self.quiet_task_runs and record.getMessage().startswith(FINISHED):
            self.quiet_task_runs.discard(task_run_id)
            return False
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


def quiet_user_errors() -> None:
    """Install `QuietUserErrors` on Prefect's run loggers, once per process."""
    for name in RUN_LOGGERS:
        run_logger = logging.getLogger(name)
        if not any(isinstance(f, QuietUserErrors) for f in run_logger.filters):
            run_logger.addFilter(QuietUserErrors())
