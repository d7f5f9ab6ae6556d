"""dxr: evidence-grounded clinical forecasting on MEDS data."""

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from dxr.noise import silence_third_party_noise

__version__ = "0.1.0"

# Offline hygiene wherever dxr runs: no telemetry, no model-hub lookups (a user may still override).
# Prefect's temporary API server gets 120 s to start instead of 20: on a machine busy with other
# work (a compile was enough here) it took longer, and the whole command failed.
for _name, _value in {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                      "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                      "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}.items():
    os.environ.setdefault(_name, _value)


def writable_or_creatable(path: Path) -> bool:
    """Whether `path` is a directory this process may write in, or one it could create."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def own_temporary_directory(name: str) -> Path:
    """`<temporary directory>/<name>`, this user's alone (mode 0700), made if missing.

    In a shared /tmp anyone may make that name first, the uid in it being no secret: a symlink to their directory or
    a directory they can write in would have Prefect keep its database and pickled task results where they can read
    and replace them, and one they alone can write in would leave every flow command waiting for a server that cannot
    start. Whatever else holds the name, a new directory of this user's own is made beside it instead."""
    path = Path(tempfile.gettempdir()) / name
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    status = path.lstat()
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
        return Path(tempfile.mkdtemp(prefix=f"{name}-"))
    if stat.S_IMODE(status.st_mode) != 0o700:
        path.chmod(0o700)  # made by the tool itself (before dxr made it) under the user's umask
    return path


# Prefect keeps its temporary API server's database and task results under its home (`~/.prefect`), matplotlib its
# font cache under `~/.config/matplotlib`. A service account's HOME is often unwritable (`/nonexistent`, a read-only
# image): every flow command then waited 120 s for a Prefect server that could not open its database and failed with
# a traceback, and every report warned that matplotlib made a temporary cache. There, a directory of this user's own
# in the temporary directory is used instead; a variable that is set is left alone.
for _variable, _default, _tool in [("PREFECT_HOME", "~/.prefect", "prefect"),
                                   ("MPLCONFIGDIR", os.path.join(os.environ.get("XDG_CONFIG_HOME") or "~/.config",
                                                                 "matplotlib"), "matplotlib")]:
    if _variable not in os.environ and not writable_or_creatable(Path(os.path.expanduser(_default))):
        os.environ[_variable] = str(own_temporary_directory(f"dxr-{_tool}-{os.getuid()}"))

# Here, so that every process running dxr's code (CLI, flows, served flows, benchmarks) prints dxr's output only.
silence_third_party_noise()
