"""Advisory locks between dxr processes that share a warehouse.

Writers of one thing exclude each other, and readers that need it stable while they work (a cohort
build reading its dataset, a forecast reading its cohort, an evaluation reading its run) exclude
its writers. The locks are `flock` locks on files under `<data_dir>/.locks`: the kernel releases
them when a process ends, even by SIGKILL, so a crash never leaves a stale lock. A lock that is
held elsewhere is refused at once with a one-line error instead of waited for: a scheduler retries,
and a person sees at once that something else is running.

Resources, and who holds them:
- `dataset:<id>`: exclusive while `synth` or an ingest writes it; shared during a cohort build;
- `cohort:<id>`: exclusive during its build and its deletion; shared during a forecast or a prior's training;
- `cohort:<id>` is also held shared by an evaluation of a run of that cohort;
- `run:<id>`: shared during each forecast into it; exclusive during its evaluation, its deletion and its cohort's
  deletion;
- `run:<id>` is also held shared while a report or the realism table reads the run's evaluation, and while a mean
  over repeated runs that averages the run is written;
- `run-system:<id>|<system>` (`|` cannot occur in a run id): exclusive during that system's forecast
  into the run; shared while a fused system (`rrf_prior_direct`) reads that system's lists of the run;
- `corpus:<name>`: exclusive during an ingest of that corpus (`tools.corpus.writing_corpus`), and `corpus:web`
  while the web channel commits its pages (`WebChannel.flush`); shared while `dxr corpus build` reads its
  documents and chunks (`tools.corpus.reading_corpora`);
- `mlflow-store`: exclusive while the data dir's own MLflow store is created (`models.prior.tracking`);
- a report's output directory: exclusive, by a hidden file beside it (`beside_held`), while the report is swapped
  in (`tasks.report.render_report`);
- `record:<id>|<kind>`: exclusive for the whole life of a registered run, so a run marked in progress
  (`<data_dir>/.running`) whose lock is free belongs to a process that was killed (`warehouse.runs.mark_killed`);
- `run-register:<id>`: exclusive (waited for) while a registered run given that id checks the kinds it holds and
  writes its `running` row (`warehouse.runs.registered_run`), so kinds that exclude each other never both start on it.

A lock file lives only while the lock is held: the last holder to release it (the one that can
take it exclusively) unlinks it, so `.locks` holds the locks in use rather than one file per run
ever made. Unlinking while another process has the file open but not yet locked is safe because a
lock counts only on the file the path names: after `flock` succeeds, the holder checks that the
path still names the inode it locked, and otherwise starts over on the new file.

A holder that is killed (SIGKILL, the OOM killer) never releases, so its lock file stays; the next holder of the
resource reuses the file and unlinks it. A resource that a delete removes (`dxr cohort delete`, `dxr run delete`)
has no next holder, so the delete removes its lock files once the removal is done (`remove_unheld`), by the same
exclusive try as a release: a file that a process holds stays, for that holder to unlink. The delete holds the
cohort and its runs exclusively meanwhile, and every other lock of a run (`run-system:`, `run-register:`, `record:`)
is taken under the run's lock or with a wait, so no process is about to take them. The rerun that finishes a killed
delete holds none: its exclusive try could at worst refuse, for that instant, a command taking one of those locks
without waiting, on a cohort or run that is gone. A lock file of a resource that still exists is left to its next
holder rather than swept, since such a refusal would then hit a command with work to do.

One host, on a local file system or one whose `flock` works across its clients; `fcntl` is POSIX.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dxr.errors import InputError
from warehouse.scratch import UNWRITABLE
from warehouse.store import Warehouse

LOCK_DIR = ".locks"
# What `flock` answers for an exclusive lock on a descriptor open read-only where NFS emulates it with byte-range
# locks (flock(2), NOTES): there an exclusive lock needs the file open for writing.
NFS_READ_ONLY = errno.EBADF


@contextmanager
def held(wh: Warehouse, resource: str, *, shared: bool, busy: str, wait: float = 0.0) -> Iterator[None]:
    """Hold the lock of `resource` for the block; `busy` says what holds it when it is taken.

    `wait` retries for that many seconds first, for locks that others hold only for a moment.

    A reader without write access to the lock directory (an analyst's account, a read-only mount or snapshot) takes
    the lock on the file when it exists and goes without it when it does not (see `open_lock`).
    """
    unwritable = (f"so it cannot take the lock {resource!r} that this command writes under: run it as an account "
                  f"that can write the warehouse at {wh.root}")
    with file_held(lock_file(wh, resource), shared=shared, busy=busy, wait=wait, unwritable=unwritable):
        yield


@contextmanager
def beside_held(target: Path, *, busy: str, wait: float = 0.0) -> Iterator[None]:
    """Hold an exclusive lock on `target` (a directory outside the warehouse, anywhere) for the block, by a hidden
    file beside it; `busy` and `wait` as for `held`.

    For work outside the warehouse's locks (a report swapped into its --out): it needs no write access to the data
    dir, so an account that may only read the warehouse can still render a report where it may write.
    """
    unwritable = f"so it cannot write {target}: give a directory of your own"
    with file_held(target.parent / f".{target.name}.lock", shared=False, busy=busy, wait=wait, unwritable=unwritable):
        yield


@contextmanager
def file_held(path: Path, *, shared: bool, busy: str, wait: float, unwritable: str) -> Iterator[None]:
    """Hold the `flock` of the file at `path` for the block (made if missing, unlinked by its last holder); `unwritable`
    ends the one-line refusal of an exclusive lock this process may not make."""
    deadline = time.monotonic() + wait
    while True:
        fd = open_lock(path, shared, unwritable)
        if fd is None:
            yield  # nobody holds it, and this process cannot make the file that would keep writers out
            return
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                raise InputError(f"{busy}: retry when it has finished") from None
            time.sleep(0.05)
            continue
        except OSError as exc:
            os.close(fd)
            if exc.errno != NFS_READ_ONLY:
                raise
            raise InputError(f"{path} is not writable by this user (uid {os.getuid()}), and this file system (NFS) "
                             f"locks a file exclusively only where it is open for writing, {unwritable}; a file that "
                             "another account left (killed while holding it) may be removed once no dxr process "
                             "runs") from exc
        if names_inode(path, fd):
            break
        os.close(fd)  # its last holder unlinked the file after we opened it: lock the one the path names now
    try:
        yield
    finally:
        release(path, fd)


def open_lock(path: Path, shared: bool, unwritable: str) -> int | None:
    """A descriptor of the lock file at `path`, made if missing; None for a shared lock whose file is missing where
    this process cannot make it.

    Opened for writing where this process may: NFS emulates `flock` with byte-range locks, and there an exclusive
    one needs a descriptor open for writing. A file this process may not write (another account made it: a reader
    in a group that may write `.locks`, or one killed holding it) is opened read-only, which a local `flock` needs
    no more than; on NFS an exclusive lock on it is refused in one line (`file_held`). Every holder makes the file,
    so where it is missing nobody holds the lock; a reader that cannot make it (no write access to the lock
    directory) then reads without it, and a writer that starts meanwhile is not kept out. A writer cannot do its
    work without write access anyway, and is refused in one line.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
            raise
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if shared:
                return None
            raise InputError(f"{path.parent} is not writable by this user (uid {os.getuid()}), {unwritable}") from exc


def lock_held(wh: Warehouse, resource: str) -> bool:
    """Whether a process holds the lock of `resource` exclusively now, asked without making a file or writing anything
    (a reader without write access to the warehouse may ask): every holder makes the file, so a missing one is not
    held. A shared holder is not seen (the shared try does not conflict with it): ask only of locks that are taken
    exclusively, as a run's record lock is (`warehouse.runs.record_lock`)."""
    path = lock_file(wh, resource)
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        else:
            if names_inode(path, fd):
                return False
            # its last holder unlinked the file after we opened it: ask the one the path names now
        finally:
            os.close(fd)


def lock_file(wh: Warehouse, resource: str) -> Path:
    """The file whose `flock` is the lock of `resource`."""
    # Run ids and names are user input: keep the file name tame, and the hash keeps it unique.
    tame = re.sub(r"[^A-Za-z0-9_-]", "_", resource)[:80]
    return wh.root / LOCK_DIR / f"{tame}-{hashlib.sha256(resource.encode()).hexdigest()[:8]}.lock"


def remove_unheld(wh: Warehouse, resources: Iterable[str]) -> None:
    """Remove the lock files of `resources` that no process holds: those their killed holders left.

    For the resources a delete removed only (see the module's docstring): the file is opened, not created, and
    released as its last holder would release it, so a held one stays, and a process that opened it and has not
    locked it yet takes the lock again on the file the path names once it has.
    """
    for resource in resources:
        path = lock_file(wh, resource)
        try:
            fd = open_existing(path)
        except FileNotFoundError:
            continue
        release(path, fd)


def open_existing(path: Path) -> int:
    """A descriptor of the lock file at `path`, which must exist, open for writing where this process may (see
    `open_lock`: an exclusive lock on NFS needs it), else read-only."""
    try:
        return os.open(path, os.O_RDWR)
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
            raise
        return os.open(path, os.O_RDONLY)


def names_inode(path, fd: int) -> bool:
    """Whether `path` still names the file that the descriptor `fd` has open."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def release(path, fd: int) -> None:
    """Release the lock; unlink its file first when no other process holds it.

    Taking the lock exclusively proves that nobody else holds it. For a shared holder that attempt
    may drop its own lock first (`flock` converts non-atomically), harmless at release. A holder that
    cannot unlink (a reader without write access to the lock directory), or cannot make that attempt (a descriptor
    open read-only on NFS), leaves the file to the next holder.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # another holder remains: the last one unlinks
    except OSError as exc:
        if exc.errno != NFS_READ_ONLY:  # whether it is the last holder is unknown: the file is left to the next one
            raise
    else:
        if names_inode(path, fd):
            try:
                os.unlink(path)
            except OSError as exc:
                if exc.errno not in UNWRITABLE:
                    raise
    finally:
        os.close(fd)
