"""Child processes that end with the dxr process that started them, even when it is SIGKILLed, and worker pools
that fail instead of hanging when one of their workers is killed."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from dxr.errors import ConfigError

# Run by the guard process of Prefect's temporary server (see `guard_process`). It imports nothing
# heavy, so it starts in milliseconds and holds a few MB.
_GUARD = """
import os, select, signal, sys
target, parent = int(sys.argv[1]), int(sys.argv[2])
handle = os.pidfd_open(target)  # names the process itself, immune to the reuse of its PID

def stop(*_):
    try:
        signal.pidfd_send_signal(handle, signal.SIGTERM)
    except ProcessLookupError:
        pass
    os._exit(0)

signal.signal(signal.SIGTERM, stop)
if os.getppid() != parent:  # dxr died before the death signal was armed
    stop()
select.select([handle], [], [])  # readable once the target has ended on its own
"""


def die_with_parent() -> None:
    """Child-side hook (`preexec_fn`): ask Linux to send SIGTERM to this process when the thread
    that started it ends, which for dxr's main thread is when the dxr process ends."""
    _set_parent_death_signal(signal.SIGTERM)


def killed_with_parent() -> None:
    """`die_with_parent` for a child with nothing to flush: SIGKILL, which it cannot put off.

    The embedded llama.cpp server answers SIGTERM with uvicorn's graceful shutdown, which first finishes the
    generation in progress: with its client dead, that kept the model in memory and a core busy for minutes,
    beside the retry that had started its own server.
    """
    _set_parent_death_signal(signal.SIGKILL)


def _set_parent_death_signal(signum: int) -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signum)


def guard_process(target_pid: int, parent_pid: int) -> subprocess.Popen | None:
    """Start a guard that stops `target_pid` (SIGTERM) when this process dies, for a child whose
    start we do not control; None where Linux's parent-death signal or pidfds are missing.

    Call it from the main thread: the parent-death signal follows the thread that started the child.
    """
    if sys.platform != "linux" or not hasattr(signal, "pidfd_send_signal"):
        return None
    return subprocess.Popen([sys.executable, "-c", _GUARD, str(target_pid), str(parent_pid)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)


@contextlib.contextmanager
def worker_pool(workers: int, what: str, fix: str) -> Iterator[ProcessPoolExecutor]:
    """`workers` worker processes for `what` (e.g. `synthetic generator`), started with spawn: forking a process whose
    polars or DuckDB thread pools are running can deadlock.

    A worker that dies fails the block with one ConfigError naming `what`, the likely cause and `fix`. Under a memory
    cap (a container, a cgroup) the kernel's out-of-memory killer ends the largest process, often a worker:
    multiprocessing.Pool, used before, started a new worker in its place and waited forever for the lost result
    (`dxr synth --patients 20000` under a 1G cap hung). When the block raises (SIGTERM, Ctrl-C, an error) the workers
    are terminated at once instead of first finishing their jobs (minutes of an oracle's chunk). When dxr itself is
    killed (the out-of-memory killer's choice may be dxr), its workers end with it (`_end_with`).
    """
    others = set(multiprocessing.active_children())
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_end_with,
                                   initargs=(os.getpid(),))
    try:
        yield executor
    except BrokenProcessPool as exc:  # the executor has terminated the other workers
        raise ConfigError(f"{what}: a worker process was killed before it finished, most likely by the kernel's "
                          f"out-of-memory killer (the machine or its container ran short of memory): {fix}") from exc
    except BaseException:
        executor.shutdown(wait=False, cancel_futures=True)
        for worker in set(multiprocessing.active_children()) - others:
            worker.terminate()
        raise
    executor.shutdown()


def _end_with(parent_pid: int) -> None:
    """A pool worker's initializer: SIGKILL this worker when the dxr process `parent_pid` that started it dies.

    A worker of a SIGKILLed dxr waited for its next job for good, holding hundreds of MB in the container whose
    shortage of memory had killed dxr (`dxr demo` under a 1G cap). The worker ends at once if dxr died before the
    death signal was armed."""
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
