"""Benchmark: the memory each step of `dxr demo` needs, and what a user sees with less.

Runs the demo's steps as the commands a team runs them, in a new `--data-dir`: synth, cohort build, the EHR prior's
training, forecasts of `held_out` by global_frequency, repeat_history and ehr_prior into one run, its evaluation and
report, then the LLM sample (`--llm-sample` held_out patients, 0 skips it): ehr_prior, direct with the embedded
llama.cpp server and rrf_prior_direct into run `<run>-llm`, evaluated and reported. For each step: wall time and the
peak RSS of its largest process (from `wait4`). Run as root where cgroup v1 memory control is mounted, each step runs
in a memory cgroup of its own, which adds the group's peak (every process of the step: the temporary Prefect API and
the llama.cpp server too, and the page cache it charged, which the kernel reclaims before it kills) and the peak of
its resident anonymous memory, sampled every 0.1 s.

With `--caps 512M,768M,1G` (root only) each step runs first under the smallest cap, then under the next one after a
failure, on what the failed attempt left behind, as a user who reruns with more memory would; a step that fails
under every cap runs once more without one. For each step: the smallest cap it passed under, and what every failed
attempt showed: its exit status and last line of stderr, whether the kernel's OOM killer ended a process, and the
processes the step left running in its group (killed by the benchmark before the next attempt). Prints a table;
writes JSON to benchmarks/results/memory-<patients>.json.

    python benchmarks/memory.py --data-dir /tmp/memory5k [--patients 5000] [--caps 512M,768M,1G,2G]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402

RUN = "bench-memory"
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
SAMPLE_SECONDS = 0.1
GRACE_SECONDS = 30  # between SIGTERM and SIGKILL when an attempt outlives --timeout


def steps(patients: int, seed: int, llm_sample: int) -> list[tuple[str, list[str]]]:
    """(label, dxr arguments) of the demo's steps, in the order it runs them."""
    forecast = ["forecast", "--cohort", "default", "--split", "held_out", "--run-id", RUN, "--system"]
    llm_run = f"{RUN}-llm"
    llm_forecast = ["forecast", "--cohort", "default", "--split", "held_out", "--limit", str(llm_sample),
                    "--run-id", llm_run, "--system"]
    demo = [
        ("synth", ["synth", "--patients", str(patients), "--seed", str(seed)]),
        ("cohort build", ["cohort", "build", "--dataset", "synthetic", "--name", "default"]),
        ("prior train", ["prior", "train", "--cohort", "default", "--system", "ehr_prior"]),
        ("forecast global_frequency", forecast + ["global_frequency"]),
        ("forecast repeat_history", forecast + ["repeat_history"]),
        ("forecast ehr_prior", forecast + ["ehr_prior"]),
        ("evaluate", ["evaluate", "--run", RUN]),
        ("report", ["report", "--run", RUN]),
    ]
    llm = [
        ("llm sample: forecast ehr_prior", llm_forecast + ["ehr_prior"]),
        ("llm sample: forecast direct", llm_forecast + ["direct"]),
        ("llm sample: forecast rrf_prior_direct", llm_forecast + ["rrf_prior_direct"]),
        ("llm sample: evaluate", ["evaluate", "--run", llm_run]),
        ("llm sample: report", ["report", "--run", llm_run]),
    ]
    return demo + (llm if llm_sample else [])


def cap_bytes(cap: str) -> int:
    """`512M`, `1G`, `1.5G` in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG])", cap.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"cap {cap!r}: give a size such as 512M, 1G or 1.5G")
    return int(float(match.group(1)) * UNITS[match.group(2)])


class MemoryGroup:
    """A cgroup v1 memory group of this benchmark's own, which one step's processes run in at a time."""

    def __init__(self):
        self.path = CGROUP_V1 / f"dxr-memory-benchmark-{os.getpid()}"
        self.path.mkdir()

    def write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def prepare(self, cap: int | None) -> None:
        """Empty of the page cache a previous step charged, capped at `cap` bytes (None: no cap), peaks reset."""
        self.write("memory.force_empty", "0")
        self.write("memory.limit_in_bytes", str(cap) if cap else "-1")
        self.write("memory.max_usage_in_bytes", "0")

    def enter(self) -> None:
        """Move the calling process into the group (run in the child between fork and exec)."""
        self.write("cgroup.procs", str(os.getpid()))

    def oom_kills(self) -> int:
        return int(re.search(r"^oom_kill (\d+)$", (self.path / "memory.oom_control").read_text(), re.M).group(1))

    def peak_mb(self) -> int:
        return round(int((self.path / "memory.max_usage_in_bytes").read_text()) / 2**20)

    def anonymous_mb(self) -> int:
        return round(int(re.search(r"^total_rss (\d+)$", (self.path / "memory.stat").read_text(), re.M).group(1))
                     / 2**20)

    def processes(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def kill_left_behind(self) -> list[str]:
        """The command lines of the processes still in the group, which are then killed (the benchmark started them)."""
        left = []
        for pid in self.processes():
            try:
                left.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()[:120])
                os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        while self.processes():
            time.sleep(SAMPLE_SECONDS)
        return left

    def remove(self) -> None:
        self.kill_left_behind()
        self.path.rmdir()


def attempt(data_dir: Path, args: list[str], group: MemoryGroup | None, cap: int | None, timeout: float) -> dict:
    """Run one dxr command to its end, under `cap` bytes when given; what it took and how it ended."""
    if group is not None:
        group.prepare(cap)
        kills_before = group.oom_kills()
    anonymous_mb = 0
    with tempfile.TemporaryFile("w+") as stderr:
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "dxr", "--data-dir", str(data_dir), *args], cwd=REPO,
                                   stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                   preexec_fn=group.enter if group is not None else None)
        stopping_since = None
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if group is not None:
                anonymous_mb = max(anonymous_mb, group.anonymous_mb())
            if stopping_since is None and time.perf_counter() - started > timeout:
                stopping_since = time.perf_counter()
                process.send_signal(signal.SIGTERM)
            elif stopping_since is not None and time.perf_counter() - stopping_since > GRACE_SECONDS:
                process.kill()
            time.sleep(SAMPLE_SECONDS)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: Popen must not wait for it again
        stderr.seek(0)
        last_line = next((line.strip() for line in reversed(stderr.read().splitlines()) if line.strip()), "")
    row = {"cap": cap, "exit_code": process.returncode, "seconds": round(seconds, 2),
           "peak_rss_mb": round(usage.ru_maxrss / 1024), "timed_out": stopping_since is not None}
    if process.returncode != 0:
        row["last_stderr_line"] = last_line[:300]
    if group is not None:
        row |= {"cgroup_peak_mb": group.peak_mb(), "anonymous_peak_mb": anonymous_mb,
                "oom_kills": group.oom_kills() - kills_before, "left_running": group.kill_left_behind()}
    return row


def outcome(row: dict) -> str:
    """How a failed attempt ended, briefly."""
    if row["timed_out"]:
        return "timeout"
    if row["exit_code"] == -signal.SIGKILL and row.get("oom_kills"):
        return "OOM kill, no message"
    return f"exit {row['exit_code']}" + (f" ({row['oom_kills']} OOM kill)" if row.get("oom_kills") else "")


def size_label(size: int | None) -> str:
    if size is None:
        return "none"
    return f"{size / UNITS['G']:g}G" if size >= UNITS["G"] else f"{size / UNITS['M']:g}M"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True, help="a new directory: the warehouse it makes")
    parser.add_argument("--patients", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--llm-sample", type=int, default=4, help="held_out patients of the LLM sample (0 skips it)")
    parser.add_argument("--caps", type=lambda text: sorted(cap_bytes(cap) for cap in text.split(",")), default=[],
                        help="memory caps to try from the smallest up, e.g. 512M,768M,1G,2G (root, cgroup v1)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before an attempt is stopped")
    args = parser.parse_args()
    if args.data_dir.exists() and any(args.data_dir.iterdir()):
        raise SystemExit(f"--data-dir {args.data_dir} is not empty: give a new directory, the benchmark builds its "
                         "warehouse from nothing")
    cgroups = os.geteuid() == 0 and (CGROUP_V1 / "memory.limit_in_bytes").exists()
    if args.caps and not cgroups:
        raise SystemExit("--caps needs root and cgroup v1 memory control at /sys/fs/cgroup/memory; run without it to "
                         "measure peak RSS only")
    if not cgroups:
        print("not root or no cgroup v1 memory control: peak RSS of each step's largest process only", flush=True)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    group = MemoryGroup() if cgroups else None
    rows = []
    print(f"{'step':<38}  {'seconds':>7}  {'RSS MB':>6}  {'group MB':>8}  {'anon MB':>7}  {'passed':>6}  failed under")
    try:
        for label, dxr_args in steps(args.patients, args.seed, args.llm_sample):
            attempts = []
            for cap in [*args.caps, None] if args.caps else [None]:
                attempts.append(attempt(args.data_dir, dxr_args, group, cap, args.timeout))
                if attempts[-1]["exit_code"] == 0:
                    break
            passed = attempts[-1]
            if passed["exit_code"] != 0:
                raise SystemExit(f"dxr {' '.join(dxr_args)} failed without a cap: {passed.get('last_stderr_line')}")
            rows.append({"step": label, "args": dxr_args, "smallest_cap": passed["cap"], "attempts": attempts})
            failed = "; ".join(f"{size_label(a['cap'])}: {outcome(a)}" for a in attempts[:-1])
            print(f"{label:<38}  {passed['seconds']:>7.1f}  {passed['peak_rss_mb']:>6,}  "
                  f"{passed.get('cgroup_peak_mb', 0):>8,}  {passed.get('anonymous_peak_mb', 0):>7,}  "
                  f"{size_label(passed['cap']) if args.caps else '':>6}  {failed}", flush=True)
    finally:
        if group is not None:
            group.remove()
    write_result(RESULTS / f"memory-{args.patients}.json",
                 {"patients": args.patients, "seed": args.seed, "llm_sample": args.llm_sample,
                  "caps": args.caps, "cgroup": cgroups, "steps": rows})


if __name__ == "__main__":
    main()
