"""Prefect's runner as `dxr serve` runs it: stopped the one graceful way by Ctrl-C, SIGTERM or a closed terminal.

A graceful stop cancels the flow runs in progress (each records its dxr run `failed`; *Retry* in the UI finishes it
later) and pauses the schedules. Prefect's runner stops so on SIGTERM alone, and only once it has started: a signal
while it registered the deployments, or a second one while it stopped, called `sys.exit(0)` inside its event loop,
which exited 0 without pausing the schedules and could hang at interpreter exit.

A terminal's Ctrl-C goes to its whole foreground process group, so it also reached each flow run's process (and the
embedded LLM server that process starts) directly: a flow run interrupted by it crashed, with a traceback when it was
still starting, instead of being cancelled. Each flow run therefore runs in a session of its own (Prefect's
`isolate_process_group`, which also makes a cancellation stop the processes the flow run started), and only the
runner decides when it ends.

A deployment is the Prefect server's, one per flow and name, not a serve's: a second serve of the same names would
take the first one's over (its own data dir in their parameters, so the first serve's runs would go to the second
warehouse), both runners would execute their runs, and stopping either would pause the schedules the other still
serves. `check_not_served_elsewhere` therefore refuses names that another serve is serving now.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable

from prefect.deployments.runner import RunnerDeployment
from prefect.runner import runner as prefect_runner
from prefect.runner._starter_engine import EngineCommandStarter

from dxr.errors import ConfigError

# A runner polls its deployments every PREFECT_RUNNER_POLL_FREQUENCY seconds, and the server records each poll a
# moment later (a background task): a serve that is alive has polled again after this much more.
POLL_RECORD_DELAY_SECONDS = 5

# SIGHUP: a closed terminal; the flow runs, in sessions of their own, would not receive it and outlive dxr serve.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class IsolatedEngineCommandStarter(EngineCommandStarter):
    """Prefect's starter of a flow run's process, in a session of its own that no terminal signal reaches."""

    def __init__(self, **kwargs) -> None:
        super().__init__(isolate_process_group=True, **kwargs)


class ServeRunner(prefect_runner.Runner):
    """A runner that any of `STOP_SIGNALS` stops gracefully, whenever it arrives; `stop_signal` records the first."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit=limit, pause_on_shutdown=True)
        self.stop_signal: int | None = None

    def handle_sigterm(self, signum: int = signal.SIGTERM, frame=None) -> None:
        """The handler of every stop signal (Prefect's runner installs this method for SIGTERM when it starts)."""
        if self.stop_signal is not None:  # a second Ctrl-C while the flow runs are cancelled: the stop goes on
            return
        self.stop_signal = signum
        if self.started and self._loop is not None:
            # Stopped (and logged) from the loop: a handler's log line could interrupt a write to the same stream.
            self._loop.call_soon_threadsafe(self._stop)
        # Otherwise the runner is still starting: `__aenter__` stops it once it has started.

    async def __aenter__(self) -> ServeRunner:
        await super().__aenter__()
        if self.stop_signal is not None:
            self._stop()
        return self

    def _stop(self) -> None:
        if self.stopping:
            return
        self._logger.info(f"{signal.Signals(self.stop_signal).name} received: cancelling the flow runs in progress "
                          "and pausing the schedules...")
        self.stopping = True
        self.execute_in_background(self.astop)


def serve_until_stopped(deployments: list[RunnerDeployment], limit: int) -> int | None:
    """Register `deployments` and run their flow runs, `limit` at a time, until a stop signal; returns that signal
    (None when the runner stopped on its own, or when the signals are not this thread's to handle)."""
    runner = ServeRunner(limit=limit)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS
                    if signal.getsignal(signum) is not signal.SIG_IGN}  # `nohup` and background jobs ignore some
        for signum in handlers:
            signal.signal(signum, runner.handle_sigterm)
    # The runner takes its starter from this module global at each flow run (the deployments are module paths);
    # Prefect offers no setting for its `isolate_process_group`, which only its workspace runs use.
    original_starter = prefect_runner.EngineCommandStarter
    prefect_runner.EngineCommandStarter = IsolatedEngineCommandStarter
    try:
        for deployment in deployments:
            runner.add_deployment(deployment)
        asyncio.run(runner.start())
    finally:
        prefect_runner.EngineCommandStarter = original_starter
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return runner.stop_signal


def check_not_served_elsewhere(deployments: list[RunnerDeployment], data_dir: str,
                               say: Callable[[str], None]) -> list[str]:
    """Refuse `deployments` when a runner elsewhere (another `dxr serve`) is serving any of them now; returns a note
    per deployment this serve takes over from a stopped serve of another data dir. `say` tells why it waits.

    A runner records itself only by polling its deployments. One that was stopped paused them after its last poll;
    one that was killed outright stops polling, which the server notes after 60 s (status Not Ready). Within those
    60 s, and for a deployment polled after it was paused, the only sign of a live runner is its next poll.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import DeploymentStatus
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import get_current_settings

    def registered(client) -> dict:
        found = {}
        for deployment in deployments:
            name = f"{deployment.flow_name}/{deployment.name}"
            try:
                found[name] = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
        return found

    with get_client(sync_client=True) as client:
        before = registered(client)
        maybe_served = [name for name, d in before.items() if d.status == DeploymentStatus.READY
                        and d.last_polled is not None and not (d.paused and d.last_polled <= d.updated)]
        if maybe_served:
            wait = get_current_settings().runner.poll_frequency + POLL_RECORD_DELAY_SECONDS
            say(f"waiting {wait} s to see whether another dxr serve still polls {maybe_served[0]} (polled lately and "
                "not paused since)")
            time.sleep(wait)
            after = registered(client)
            for name in maybe_served:
                now = after.get(name)
                if now is not None and now.last_polled is not None and now.last_polled > before[name].last_polled:
                    raise ConfigError(
                        f"{name} is being served by another dxr serve, of data dir {now.parameters.get('data_dir')}: "
                        "stop that one first, or give this one deployment names of its own with "
                        "`dxr serve --name NAME`")
    taken_over: dict[str, list[str]] = {}
    for name, deployment in before.items():
        if deployment.parameters.get("data_dir") not in (None, data_dir):
            taken_over.setdefault(deployment.parameters["data_dir"], []).append(name)
    return [f"note: {', '.join(names)} served data dir {earlier} until now, and {data_dir} from now on (serve each "
            "data dir under a name of its own, `dxr serve --name NAME`, to keep both)"
            for earlier, names in taken_over.items()]
