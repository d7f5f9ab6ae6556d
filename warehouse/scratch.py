"""Scratch siblings for writes that are swapped into place, and cleanup of those a killed process left.

A file or directory is written under a hidden sibling name that records its owner (host, process,
a random token), then renamed over its target. SIGTERM and Ctrl-C unwind and remove the scratch;
SIGKILL (the OOM killer, a node going away) cannot, so the next writer of the same target removes
the siblings whose owner has ended.

The owner is judged by a lock file beside the scratch (`.<target>.<owner>.lock`) on which the owner
holds an `flock` while the scratch exists. The kernel releases it when the process ends, so this
holds for processes on other hosts or in other containers sharing the directory, wherever `flock`
works. Scratch without a lock file (left by earlier versions) is judged by host and process id.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HOST = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"
LOCK_KIND = "lock"
_AT_FDCWD = -100  # <fcntl.h>: paths relative to the working directory
_RENAME_EXCHANGE = 2  # <linux/fs.h>: renameat2 swaps the two paths
# renameat2's answers for a kernel or file system that cannot swap (Linux before 3.15, NFS, ...).
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_MAKE_DIRS_ATTEMPTS = 10
# What the system answers a process that may not create or remove a file (no write access, a read-only mount).
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


@contextmanager
def scratch(target: Path, kind: str) -> Iterator[Path]:
    """A hidden sibling of `target` owned by this process for the block, e.g.
    `.data.parquet.host-123-9f2c1a0b.tmp`; whatever is left at it at the end is removed.

    The body creates the file or directory itself (or renames it into place).
    """
    make_dirs(target.parent)
    owner = f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lock_path = target.with_name(f".{target.name}.{owner}.{LOCK_KIND}")
    path = target.with_name(f".{target.name}.{owner}.{kind}")
    with open(lock_path, "x") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            yield path
        finally:
            _remove(path)
            lock_path.unlink(missing_ok=True)


def make_dirs(directory: Path) -> None:
    """`directory.mkdir(parents=True, exist_ok=True)`, made again when a parent it made is removed before its child.

    A removal commit removes the partition directories it left empty (`warehouse.store.remove_emptied`), and a second
    process finishing the same commit may `rmdir` one again just after a writer has made it anew for its partition;
    `Path.mkdir` then fails making the child, with nothing wrong to report. A directory that holds a child is never
    removed, so each retry is owed to one such `rmdir` and a few suffice.
    """
    for attempt in range(_MAKE_DIRS_ATTEMPTS):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == _MAKE_DIRS_ATTEMPTS - 1:
                raise


@contextmanager
def naming(target: Path) -> Iterator[None]:
    """Inside the block, an OSError that names no file is raised again naming `target`, the file being written.

    pyarrow's Parquet writer reports a full disk as `OSError(28, 'Error writing bytes to file. Detail: [errno 28]
    No space left on device')`, and Python's own file writes name no file either, so the CLI's one line
    (`dxr.cli.one_line`) could not say where; the scratch sibling's hidden name would not help the user.
    """
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, os.strerror(exc.errno) if exc.errno else str(exc), str(target)) from exc


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux `renameat2` with RENAME_EXCHANGE): there is no moment at which
    either name is missing, not even for a process killed midway. False where the system cannot (not Linux, glibc
    before 2.28, a file system without the flag); the caller then renames one after the other."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def remove_abandoned(target: Path) -> list[Path]:
    """Remove the scratch siblings of `target` whose owner has ended; returns them."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(([A-Za-z0-9_]+)-(\d+)-[0-9a-f]{{8}})\.(\w+)$")
    if not target.parent.is_dir():
        return []
    by_owner: dict[str, list[Path]] = {}
    legacy: dict[str, tuple[str, int]] = {}
    for sibling in target.parent.iterdir():
        match = pattern.match(sibling.name)
        if match:
            owner, host, pid, _ = match.groups()
            by_owner.setdefault(owner, []).append(sibling)
            legacy[owner] = (host, int(pid))
    removed = []
    for owner, siblings in by_owner.items():
        lock_path = target.with_name(f".{target.name}.{owner}.{LOCK_KIND}")
        if lock_path in siblings:
            ended = _lock_is_free(lock_path)
        else:  # left by a version without lock files
            host, pid = legacy[owner]
            ended = host == _HOST and not _alive(pid)
        if ended:
            for sibling in sorted(siblings, key=lambda p: p == lock_path):  # the lock file last
                _remove(sibling)
                removed.append(sibling)
    return removed


def _lock_is_free(lock_path: Path) -> bool:
    """Whether nobody holds the scratch's lock file. Opened for writing where this process may, since NFS emulates
    `flock` with byte-range locks and there an exclusive one needs that (EBADF otherwise: then the scratch is
    taken as held, and left to a process that may write it)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:  # its owner has just finished and removed it
        return False
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
            raise
        return False  # nor could this process remove the scratch
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        if exc.errno not in UNWRITABLE:  # scratch is hidden from every reader: left to a process that may remove it
            raise


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
