"""Prefect's temporary API server, bound to the life of the dxr process that starts it.

Without `PREFECT_API_URL`, Prefect starts a temporary API server (uvicorn, about 200 MB) in a
subprocess on first use and stops it at interpreter exit. A dxr process killed by SIGKILL (a
scheduler's hard timeout, the OOM killer) never reaches that exit, and the server lived on. The
CLI therefore starts the server itself before running a flow (the same instance Prefect's client
uses afterwards), and a guard process, started the moment the server process exists, stops the
server when the kernel tells it that dxr has died.
"""

from __future__ import annotations

import os
import subprocess

from dxr.errors import ConfigError
from dxr.processes import guard_process

_guards: dict[int, subprocess.Popen | None] = {}  # server PID → its guard


def start_temporary_api() -> None:
    """Start Prefect's temporary API server with its guard, unless a Prefect server is configured.

    Call from the main thread (the guard's parent-death signal follows the starting thread).
    """
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # a real server (deployments, the test harness): nothing of ours to stop
        check_configured_api()
        return
    server = SubprocessASGIServer()  # Prefect keeps one instance per process; its client reuses it
    if server.running:
        return
    launch = server._run_uvicorn_command  # Prefect's own launch, wrapped to guard each server at birth

    def launch_guarded() -> subprocess.Popen:
        process = launch()
        _guards[process.pid] = guard_process(process.pid, os.getpid())
        return process

    server._run_uvicorn_command = launch_guarded
    server.start()


def check_configured_api() -> None:
    """Refuse a PREFECT_API_URL where no server answers (a server not started, a mistyped port): Prefect's
    client would fail at its first call, deep in a flow or in `serve`, with a traceback."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is not None:
        raise ConfigError(f"no Prefect server answers at PREFECT_API_URL={PREFECT_API_URL.value()} ({error}): start "
                          "it with `prefect server start --host 127.0.0.1`, or correct PREFECT_API_URL (commands "
                          "other than `dxr serve` run without it)")
