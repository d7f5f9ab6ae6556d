"""Where, when and from which code a benchmark result was measured.

Every benchmark writes its JSON through `write_result`, which adds a `provenance` object, so that a number quoted in
the docs can be traced to the commit and the machine that produced it, and a rerun at another commit compared with it:

- `commit`: the checked-out commit (null outside a git checkout);
- `uncommitted_changes`: whether tracked files differed from that commit, in which case the commit alone does not
  reproduce the result (null outside a git checkout);
- `measured_at`: when the result was written, ISO 8601 in UTC as every time dxr records;
- `load_average`: the 1-, 5- and 15-minute load averages then, since timings on a shared machine depend on them;
- `python`, `platform`, `machine`, `cpus`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance() -> dict:
    commit = _git("rev-parse", "HEAD")
    changed = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit, "uncommitted_changes": None if changed is None else bool(changed),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def write_result(path: Path, result: dict, **dumps_options) -> None:
    """Write `result` with its provenance as JSON to `path` (its directory made if missing) and say so.

    `dumps_options` go to `json.dumps` (indent 2 unless given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "provenance": provenance()}, **{"indent": 2, **dumps_options}))
    print(f"wrote {path}")
