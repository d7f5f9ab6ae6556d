"""An account that may only read the warehouse (an analyst's, a read-only mount or snapshot copy): the reading commands
work and write nothing; those that must write refuse in one line naming the path and the fix.

File modes bind only a process without root's capabilities, so the commands run in a subprocess: as this user when
it is not root, and as root without its capabilities (`setpriv`) when it is.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flows.forecast import forecast_flow
from models.prior.config import PriorConfig
from models.prior.planted import write_planted_cohort
from tasks.evaluate import evaluate_run
from tasks.prior import train_prior
from warehouse.locks import held, lock_file
from warehouse.runs import record_lock
from warehouse.store import Warehouse

TINY_PRIOR = PriorConfig(d_model=16, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16, dropout=0.0,
                         batch_size=32, min_code_count=1, seed=5, epochs=1)


def reader_prefix() -> list[str]:
    """What runs a command bound by file modes: nothing for a user other than root; root without its capabilities."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
    if shutil.which("setpriv") is None or not modes_bind(tuple(prefix)):
        pytest.skip("running as root, and setpriv cannot drop root's capabilities here: no process is bound by file "
                    "modes")
    return prefix


@functools.cache
def modes_bind(prefix: tuple[str, ...]) -> bool:
    """Whether a process run under `prefix` is refused a directory that file modes close to it (a container may
    forbid setpriv, or keep capabilities it cannot drop)."""
    with tempfile.TemporaryDirectory() as scratch:
        closed = Path(scratch) / "closed"
        closed.mkdir(mode=0o555)
        done = subprocess.run([*prefix, sys.executable, "-c", "import os, sys; os.mkdir(sys.argv[1])",
                               str(closed / "made")], capture_output=True, text=True, timeout=60)
        return done.returncode != 0 and "PermissionError" in done.stderr


def as_reader(data_dir: Path, commands: list[list[str]]) -> list[tuple[int, str]]:
    """(exit code, output) of each `dxr --data-dir DATA_DIR …` command, run in one process bound by file modes."""
    script = ("import json, sys\nfrom click.testing import CliRunner\nfrom dxr.cli import main\n"
              "results = [CliRunner().invoke(main, args) for args in json.loads(sys.argv[1])]\n"
              "print(json.dumps([(r.exit_code, r.output) for r in results]))")
    arguments = [["--data-dir", str(data_dir), *command] for command in commands]
    done = subprocess.run([*reader_prefix(), sys.executable, "-c", script, json.dumps(arguments)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    return [tuple(result) for result in json.loads(done.stdout.splitlines()[-1])]


def run_bound(script: str, data_dir: Path, *, read_only_dir: bool = False) -> subprocess.CompletedProcess:
    """Run a Python `script` (given the data dir as its argument) in a process bound by file modes, with the data dir
    made read-only meanwhile when `read_only_dir`."""
    if read_only_dir:
        read_only(data_dir)
    try:
        return subprocess.run([*reader_prefix(), sys.executable, "-c", script, str(data_dir)], capture_output=True,
                              text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    finally:
        if read_only_dir:
            writable(data_dir)


def digests(root: Path) -> dict[str, str]:
    """Every file under `root` with its content's digest, and every directory."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
            for path in sorted(root.rglob("*"))}


def read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222)


def writable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IWUSR)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A read-only copy, at another path, of a warehouse with an evaluated run, a registered prior and a run that was
    killed (its marker and record lock file left behind), and the copy's files before any command ran.

    Built once for the module: its tests only read it, each checks that it changed no file of it."""
    root = tmp_path_factory.mktemp("read_only")
    prod, copy = root / "prod", root / "snapshot"
    wh = Warehouse(prod)
    cohort = write_planted_cohort(wh, n_patients=60, seed=4)
    train_prior(str(prod), cohort, "ehr_prior", TINY_PRIOR)
    forecast_flow(str(prod), cohort, "repeat_history", split="held_out", run_id="r1")
    evaluate_run(wh, "r1", ks=(10,), n_boot=0)
    killed = subprocess.Popen([sys.executable, "-c", (
        "import os, signal\nfrom warehouse.store import Warehouse\nfrom warehouse.runs import registered_run\n"
        f"with registered_run(Warehouse({str(prod)!r}), 'forecast:global_frequency', {{}}, 'r2'):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)")], cwd=Path(__file__).resolve().parents[1])
    assert killed.wait(timeout=120) == -signal.SIGKILL
    assert lock_file(wh, record_lock("r2", "forecast:global_frequency")).exists()
    shutil.copytree(prod, copy)  # its MLflow store records the artifacts of `prod`: a writer would re-point it
    read_only(copy)
    yield copy, cohort, digests(copy)
    writable(copy)  # for pytest's own cleanup


def test_a_reader_of_a_read_only_snapshot_runs_the_reading_commands_and_changes_nothing(snapshot, tmp_path):
    copy, cohort, before = snapshot
    out = tmp_path / "analyst" / "r1"
    results = as_reader(copy, [
        ["sql", "SELECT count(*) AS n FROM metrics WHERE run_id = 'r1'", "--format", "csv"],
        ["run", "list", "--kind", "evaluate", "--format", "csv"],
        ["cohort", "list"],
        ["prior", "models", "--cohort", cohort],  # by name: asks which builds are in progress, with r2's marker there
        ["report", "--run", "r1", "--out", str(out)],
    ])
    for (code, output), command in zip(results, ("sql", "run list", "cohort list", "prior models", "report")):
        assert code == 0, f"{command}: {output}"
    assert results[0][1] == f"n\n{Warehouse(copy).read('metrics', run_id='r1').height}\n"
    assert results[1][1].splitlines()[1].startswith("r1,evaluate,finished,")
    assert cohort in results[2][1]
    assert results[3][1].splitlines()[2].split()[:3] == ["ehr_prior", "1", "champion"]
    assert results[4][1] == f"report: {out / 'report.html'}\nmarkdown: {out / 'report.md'}\n"
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert digests(copy) == before


def test_a_reader_is_refused_in_one_line_what_must_write_the_warehouse(snapshot):
    copy, cohort, before = snapshot
    evaluated, reported = as_reader(copy, [["evaluate", "--run", "r1", "--k", "10", "--bootstrap", "0"],
                                           ["report", "--run", "r1"]])
    assert evaluated == (1, "evaluating run r1 (K=10, bootstrap 0) …\n"
                            f"Error: {copy / '.locks'} is not writable by this user (uid {os.getuid()}), so it cannot "
                            f"take the lock 'run:r1' that this command writes under: run it as an account that can "
                            f"write the warehouse at {copy}\n")
    assert reported == (1, f"Error: {copy} is not writable by this user (uid {os.getuid()}), and the "
                           "report of run r1 is written there: give --out a directory of your own (a report only reads "
                           "the warehouse)\n")
    assert digests(copy) == before


def test_a_reader_still_waits_for_a_writer_holding_the_lock_it_cannot_make(tmp_path):
    # The lock file of a run being evaluated exists: a reader without write access takes its lock on it (read-only),
    # and so is refused while the evaluation holds it, as any reader is.
    wh = Warehouse(tmp_path / "wh")
    script = ("import sys\nfrom warehouse.store import Warehouse\nfrom warehouse.locks import held\n"
              "with held(Warehouse(sys.argv[1]), 'run:r1', shared=True, busy='run r1 is being evaluated'):\n"
              "    print('read')")
    with held(wh, "run:r1", shared=False, busy="an evaluation"):
        done = run_bound(script, wh.root, read_only_dir=True)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].endswith(
        "InputError: run r1 is being evaluated: retry when it has finished")


def test_a_reader_that_cannot_finish_a_commit_a_killed_writer_left_says_who_can(tmp_path):
    # Read without it, the commit's partitions could be half new, half old; the reader got a rename's error, whose
    # fix ("choose another location") was no fix.
    from warehouse.store import COMMIT_DIR, COMMIT_PLAN, COMMITTED, REMOVED, new_commit_id

    wh = Warehouse(tmp_path / "wh")
    wh.write("datasets", wh.read("datasets"), dataset_id="d1")  # an empty partition: the store exists
    commits = wh.forecast_dir / COMMIT_DIR
    committed = commits / (new_commit_id(commits) + COMMITTED)  # what a writer killed after its commit point left
    (committed / REMOVED).mkdir(parents=True)
    (committed / COMMIT_PLAN).write_text(json.dumps([{"remove": "forecast/datasets/dataset_id=d1"}]))
    read_only(wh.root)
    try:
        [result] = as_reader(wh.root, [["sql", "SELECT 1 AS one"]])
    finally:
        writable(wh.root)
    assert result == (1, f"Error: {committed} is a commit that a killed writer left unfinished, and this user (uid "
                         f"{os.getuid()}) may not finish it: run any dxr command that reads the warehouse (dxr "
                         f"--data-dir {wh.root} sql 'SELECT 1') as an account that can write it, then retry\n")
    assert committed.is_dir()


def test_a_writer_takes_a_lock_whose_file_another_account_left(tmp_path):
    # An analyst killed while holding a shared lock leaves its file, owned by the analyst and not writable by others:
    # the service account must still take the lock (opening the file for writing, as NFS wants, was refused).
    if os.geteuid() != 0:
        pytest.skip("giving the lock file to another account needs root")
    wh = Warehouse(tmp_path / "wh")
    with held(wh, "run:r1", shared=True, busy="x"):
        left = lock_file(wh, "run:r1")
        os.link(left, tmp_path / "kept")  # the file outlives its holder's release, as a killed holder's does
    os.link(tmp_path / "kept", left)
    os.chown(left, 65534, 65534)
    left.chmod(0o644)
    script = ("import sys\nfrom warehouse.store import Warehouse\nfrom warehouse.locks import held\n"
              "with held(Warehouse(sys.argv[1]), 'run:r1', shared=False, busy='busy'):\n"
              "    print('held')")
    done = run_bound(script, wh.root)
    assert (done.returncode, done.stdout) == (0, "held\n"), done.stderr


# Run first in a reader's script: `warehouse.locks` locks as on NFS (`tests.conftest.nfs_flock`).
ON_NFS = "import warehouse.locks\nfrom tests.conftest import NFS_FCNTL\nwarehouse.locks.fcntl = NFS_FCNTL\n"


def test_a_reader_on_nfs_takes_and_releases_the_lock_files_it_may_not_write(tmp_path):
    # On NFS an exclusive lock needs a descriptor open for writing, and a reader opens a file that it may not write
    # read-only: its release (whose exclusive try tells the last holder) and `mark_killed` on a killed run's record
    # lock failed with "[Errno 9] Bad file descriptor", so no reading command ran once such a file was there.
    wh = Warehouse(tmp_path / "wh")
    killed = subprocess.Popen([sys.executable, "-c", (
        "import os, signal\nfrom warehouse.store import Warehouse\nfrom warehouse.runs import registered_run\n"
        f"with registered_run(Warehouse({str(wh.root)!r}), 'forecast:global_frequency', {{}}, 'r2'):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)")], cwd=Path(__file__).resolve().parents[1])
    assert killed.wait(timeout=120) == -signal.SIGKILL
    left = lock_file(wh, "run:r1")
    left.touch()  # as a holder killed while it held the lock leaves it
    script = ON_NFS + ("import sys\nfrom warehouse.store import Warehouse\nfrom warehouse.locks import held\n"
                       "from warehouse.runs import runs_in_progress\nwh = Warehouse(sys.argv[1])\n"
                       "with held(wh, 'run:r1', shared=True, busy='run r1 is being evaluated'):\n"
                       "    print('read')\nprint(runs_in_progress(wh).height)")
    done = run_bound(script, wh.root, read_only_dir=True)
    assert (done.returncode, done.stdout) == (0, "read\n0\n"), done.stderr
    assert left.exists()  # left to a holder that may write it


def test_a_writer_on_nfs_is_refused_in_one_line_a_lock_whose_file_another_account_left(tmp_path):
    # Opened read-only, the file cannot be locked exclusively on NFS: the writer failed with "[Errno 9] Bad file
    # descriptor", naming neither the file nor the fix.
    if os.geteuid() != 0:
        pytest.skip("giving the lock file to another account needs root")
    wh = Warehouse(tmp_path / "wh")
    left = lock_file(wh, "run:r1")
    left.parent.mkdir(parents=True)
    left.touch(mode=0o644)
    os.chown(left, 65534, 65534)
    script = ON_NFS + ("import sys\nfrom warehouse.store import Warehouse\nfrom warehouse.locks import held\n"
                       "with held(Warehouse(sys.argv[1]), 'run:r1', shared=False, busy='busy'):\n"
                       "    print('held')")
    done = run_bound(script, wh.root)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"dxr.errors.InputError: {left} is not writable by this user (uid {os.getuid()}), and this file system (NFS) "
        "locks a file exclusively only where it is open for writing, so it cannot take the lock 'run:r1' that this "
        f"command writes under: run it as an account that can write the warehouse at {wh.root}; a file that another "
        "account left (killed while holding it) may be removed once no dxr process runs")
