"""Notes for the user from library code that must not print itself (the warehouse): `note(...)`.

Inside a Prefect flow or task run a note is a warning of that run's logger (`tasks.stage_logger`'s rule), so it is in
the flow run's log, the served one's too, and on the console of the CLI's own flow runs; anywhere else it is a
`note: ...` line on stderr, as the CLI words its own notes, keeping stdout for the command's output.
"""

from __future__ import annotations

import logging
import sys

NOTES = logging.getLogger("dxr.notes")


class NoteHandler(logging.Handler):
    """Send each note to the Prefect run in progress, else to stderr as a `note:` line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            run_logger = _prefect_run_logger()
            if run_logger is not None:
                run_logger.warning(message)
            else:
                sys.stderr.write(f"note: {message}\n")  # the stream of now: Click's test runner and pytest swap it
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


def _prefect_run_logger() -> logging.LoggerAdapter | None:
    # Prefect is loaded wherever a flow or task runs; importing it here would slow every CLI command.
    if "prefect.logging" not in sys.modules:
        return None
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return None


NOTES.addHandler(NoteHandler())
NOTES.propagate = False  # said once, by the handler above, not again by whatever handlers the root logger has


def note(message: str) -> None:
    """Tell the user `message` (one line, without the `note:` prefix)."""
    NOTES.warning(message)
