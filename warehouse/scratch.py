"""Scratch siblings for writes that are swapped into place, and cleanup of those a killed process left.

A file or directory is written under a hidden sibling name that records this host and process, then
renamed over its target. SIGTERM and Ctrl-C unwind and remove the scratch; SIGKILL (the OOM killer,
a node going away) cannot, so the next writer of the same target removes siblings whose process is
gone. Only this host's are judged: a live writer on another host sharing the directory is not
visible from here.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from pathlib import Path

_HOST = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"


def scratch_path(target: Path, kind: str) -> Path:
    """A hidden sibling of `target` owned by this process, e.g. `.data.parquet.host-123-9f2c1a0b.tmp`."""
    return target.with_name(f".{target.name}.{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}.{kind}")


def remove_abandoned(target: Path) -> list[Path]:
    """Remove the scratch siblings of `target` whose process on this host has ended; returns them."""
    owned = re.compile(rf"^\.{re.escape(target.name)}\.{_HOST}-(\d+)-[0-9a-f]{{8}}\.\w+$")
    removed = []
    if not target.parent.is_dir():
        return removed
    for sibling in target.parent.iterdir():
        match = owned.match(sibling.name)
        if match and not _alive(int(match.group(1))):
            if sibling.is_dir() and not sibling.is_symlink():
                shutil.rmtree(sibling, ignore_errors=True)
            else:
                sibling.unlink(missing_ok=True)
            removed.append(sibling)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
