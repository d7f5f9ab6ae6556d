"""Short of memory: what a process that the kernel's out-of-memory killer ends, or a limit that is too small, leaves
the user with (benchmarks/memory.py measures how much each step needs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import cli, warehouse_copy

REPO = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def is_worker(pid: int) -> bool:
    try:
        return b"multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


def kill_a_worker(process: subprocess.Popen, busy_for: float = 2.0) -> None:
    """SIGKILL a worker process of `process` once it has been running `busy_for` seconds: what the out-of-memory killer
    does to the largest process of a capped container, often a worker."""
    seen: dict[int, float] = {}
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        for worker in filter(is_worker, children(process.pid)):
            if time.monotonic() - seen.setdefault(worker, time.monotonic()) >= busy_for:
                os.kill(worker, signal.SIGKILL)
                return
        time.sleep(0.05)
    pytest.fail(f"no worker process of {process.args} to kill:\n{process.communicate()[1][-2000:]}")


def dxr(data_dir: Path, *args: str, kill_worker: bool = False) -> tuple[int, str]:
    """`python -m dxr --data-dir DATA_DIR ARGS` to its end (its exit code and standard error), with one of its worker
    processes killed on the way when `kill_worker` is set; a run that outlives 240 s fails the test."""
    process = subprocess.Popen([sys.executable, "-m", "dxr", "--data-dir", str(data_dir), *args], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill_worker:
        kill_a_worker(process)
    try:
        _, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"dxr {' '.join(args)} hung after its worker was killed:\n{process.communicate()[1][-2000:]}")
    return process.returncode, stderr


@pytest.mark.skipif(sys.platform != "linux", reason="finds the worker processes under /proc")
def test_a_killed_worker_fails_synth_and_the_build_with_one_line_and_a_rerun_finishes(vocab_cache, tmp_path):
    # multiprocessing.Pool started a new worker in place of a killed one and waited forever for the lost result: under
    # a 1G cap, `dxr synth --patients 20000` hung after the kernel killed a worker. 4,000 patients take two workers,
    # and their cohort's 2,700 trajectories two oracle workers.
    from warehouse.store import Warehouse

    data_dir = warehouse_copy(vocab_cache, tmp_path / "data").root
    synth = ("synth", "--patients", "4000")
    code, stderr = dxr(data_dir, *synth, kill_worker=True)
    assert code == 1, stderr[-2000:]
    assert stderr.strip().splitlines()[-1].startswith(
        "Error: synthetic generator: a worker process was killed before it finished, most likely by the kernel's "
        "out-of-memory killer (the machine or its container ran short of memory): free memory or give it more"), stderr
    assert Warehouse(data_dir).read("datasets").is_empty()  # nothing half-written is registered
    assert dxr(data_dir, *synth)[0] == 0

    code, stderr = dxr(data_dir, "cohort", "build", "--dataset", "synthetic", "--name", "default", kill_worker=True)
    assert code == 1, stderr[-2000:]
    assert stderr.strip().splitlines()[-1].startswith(
        "Error: synthetic oracle: a worker process was killed before it finished, most likely by the kernel's "
        "out-of-memory killer"), stderr
    wh = Warehouse(data_dir)
    assert wh.read("runs").filter(kind="cohort")["status"].to_list() == ["failed"]
    assert wh.read("cohorts").is_empty()  # the build registers its cohort last


@pytest.mark.skipif(sys.platform != "linux", reason="finds the worker processes under /proc")
def test_the_workers_of_a_killed_dxr_end_with_it(tmp_path):
    # When the out-of-memory killer chose dxr itself, its pool's workers waited for their next job for good, holding
    # memory in the container that was short of it (`dxr demo` under a 1G cap left two synthetic generator workers).
    process = subprocess.Popen([sys.executable, "-m", "dxr", "--data-dir", str(tmp_path / "data"), "synth",
                                "--patients", "4000"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers := list(filter(is_worker, children(process.pid)))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(workers) == 2, "dxr synth --patients 4000 started no two workers"
        time.sleep(1)  # into their shards
        process.kill()
        process.wait()
        deadline = time.monotonic() + 20
        while any(Path(f"/proc/{worker}").exists() for worker in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [worker for worker in workers if Path(f"/proc/{worker}").exists()]
        assert not left, "the workers outlived their SIGKILLed dxr"
    finally:
        process.kill()
        for worker in filter(is_worker, workers):  # those the test failed on
            os.kill(worker, signal.SIGKILL)


CGROUP_V1 = Path("/sys/fs/cgroup/memory")


@contextmanager
def memory_cgroup(limit: str):
    """A new cgroup v1 memory group capped at `limit` (e.g. `1G`), removed afterwards; a clean skip where this process
    cannot make one (not root, or no cgroup v1 memory control)."""
    if os.geteuid() != 0 or not os.access(CGROUP_V1 / "memory.limit_in_bytes", os.W_OK):
        pytest.skip(f"needs root and cgroup v1 memory control at {CGROUP_V1} to cap a process's memory")
    group = CGROUP_V1 / f"dxr-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(limit)
        yield group
    finally:
        group.rmdir()


def mebibytes(setting: str) -> float:
    """A size as DuckDB shows a setting (`819.1 MiB`, `1.8 GiB`) in MiB."""
    number, unit = setting.split()
    return float(number) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[unit]


def test_duckdb_stays_within_a_memory_cap_below_its_configured_limit(tmp_path):
    # DuckDB was given cohort.memory_limit (2GB) whatever the machine allowed, so under a 1G cap it would not spill
    # before the kernel's out-of-memory killer ended dxr. Within 80% of the cap, DuckDB's own default there, it spills.
    script = ("import sys\n"
              "from warehouse import cohorts, meds\n"
              "from warehouse.store import Warehouse\n"
              "show = \"SELECT current_setting('memory_limit')\"\n"
              f"with cohorts._spilling_connection(Warehouse({str(tmp_path)!r}), 'c0ffee', '2GB') as con:\n"
              "    print(con.execute(show).fetchone()[0])\n"
              "with meds._spilling_connection('validation', '2GB') as con:\n"
              "    print(con.execute(show).fetchone()[0])\n"
              "with meds._spilling_connection('validation', '100MB') as con:\n"
              "    print(con.execute(show).fetchone()[0])\n")
    with memory_cgroup("1G") as group:
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                              preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    assert done.returncode == 0, done.stderr[-2000:]
    build, validation, lower = (mebibytes(limit) for limit in done.stdout.splitlines())
    assert build <= 0.81 * 1024 and validation <= 0.81 * 1024, done.stdout
    assert lower == pytest.approx(100e6 / 2**20, abs=0.1), done.stdout  # a configured limit below the cap stays


def test_duckdb_out_of_memory_below_the_configured_limit_says_the_machine_is_the_cap(tiny_meds, wh_vocab,
                                                                                       monkeypatch):
    # As if the process may use 1.25 MiB: DuckDB's default, 80% of it, is the limit, and raising
    # cohort.memory_limit, the advice for running out within it, would change nothing.
    from warehouse import duck

    assert cli(wh_vocab.root, "ingest", "meds", tiny_meds, "--name", "tiny")[0] == 0
    monkeypatch.setattr(duck, "memory_within_reach", lambda: "1.0 MiB")
    code, _, stderr = cli(wh_vocab.root, "cohort", "build", "--dataset", "tiny", "--name", "default")
    assert code == 1
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("Error: cohort build of default from dataset tiny: DuckDB ran out of memory within its "
                           "limit of 1.0 MiB, 80% of the memory this machine or container allows, which is below the "
                           "2GB asked for (Out of Memory Error: "), line
    assert line.endswith("): give it more memory (docs/benchmarks.md#memory lists what each step needs)"), line
