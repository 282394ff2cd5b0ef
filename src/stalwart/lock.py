"""A single-writer lock on a run directory.

``flock(2)`` on ``<run>/.lock``: the kernel drops the lock when the holding
process dies, however it dies, so a stale lock of a SIGKILLed trainer is taken
over by the next one without any guessing about pids. The file's content (pid,
host, start time) is only there to make the error message useful.

A flock belongs to the open file description, which ``fork`` shares with the
child: DataLoader workers forked from the trainer would keep the lock alive after
the trainer is killed, and the restarted trainer would find its own run locked.
So every forked child closes its copy of the descriptor at once (the parent's
copy keeps the lock); children started by ``exec`` never inherit it.

flock works on local filesystems and on NFSv4 (as a byte-range lock); on
filesystems where it does not, two writers are not detected.

The run directory is input from outside (copied from elsewhere, writable by
others), and the lock file is truncated and rewritten: it is opened with
``O_NOFOLLOW`` and must be a regular file with one link. A symbolic link, FIFO,
device or hard link at ``<run>/.lock`` is refused with ``RunLockedError`` naming
it, so a link planted there never makes stalwart truncate a file outside the run.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

from stalwart.errors import RunLockedError
from stalwart.files import not_regular
from stalwart.layout import LOCK_NAME

__all__ = ["LOCK_NAME", "RunLock", "lock_file_problem", "read_lock_holder"]

logger = logging.getLogger("stalwart")

_held: dict[int, RunLock] = {}


def _close_in_child() -> None:
    for fd, lock in list(_held.items()):
        lock._fd = None
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunLock:
    """Exclusive, non-blocking lock held by the one process that writes a run directory."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise ``RunLockedError`` (held by another process, or
        ``.lock`` is not a plain file this process may write)."""
        fd = _open_lock(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = (
                f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
                if holder
                else "another process"
            )
            raise RunLockedError(
                f"{self.path.parent} is already being written by {who}; two managers must not "
                "write one run directory. Stop the other process, or give this run its own directory."
            ) from None
        previous = _read_holder(fd)
        if previous and previous.get("pid") != os.getpid():
            logger.info(
                "took over the lock of %s from pid %s on %s, which no longer holds it",
                self.path.parent,
                previous.get("pid"),
                previous.get("host"),
            )
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        _held[fd] = self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _held.pop(fd, None)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# O_NONBLOCK: opening a FIFO must not wait for a writer; the fstat below refuses it.
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_lock(path: Path) -> int:
    """``path`` opened for writing, or ``RunLockedError`` unless it is a regular file
    with a single link (never opened through a symbolic link)."""
    # lstat first: opening a device node can have effects of its own. The fstat
    # below still decides, for an entry swapped in between.
    problem = lock_file_problem(path.parent)
    if problem is not None:
        raise _unsafe(path, problem)
    try:
        fd = os.open(path, _OPEN_FLAGS, 0o644)
    except OSError as exc:
        problem = lock_file_problem(path.parent)
        if problem is None:
            raise
        raise _unsafe(path, problem) from exc
    info = os.fstat(fd)
    problem = not_regular(info, writing=True)
    if problem is not None:
        os.close(fd)
        raise _unsafe(path, problem)
    os.set_blocking(fd, True)
    return fd


def _unsafe(path: Path, problem: str) -> RunLockedError:
    return RunLockedError(
        f"{path} is {problem}, not a regular file; stalwart never writes through it, so "
        f"the run cannot be locked. Remove {path} (rm, which removes only the entry "
        "itself) and retry"
    )


def lock_file_problem(directory: Path) -> str | None:
    """Why ``<directory>/.lock`` may not be used as a lock file (``"a symbolic link"``,
    ``"a FIFO"``, ...), or None when it is a plain file or absent. Only ``lstat``."""
    try:
        info = os.lstat(directory / LOCK_NAME)
    except OSError:
        return None
    return not_regular(info, writing=True)


def read_lock_holder(directory: Path) -> dict[str, Any]:
    """What the lock file of ``directory`` says about its holder (pid, host, since), or {}.

    Reads only a regular file, never through a link, and never waits on a FIFO.
    """
    try:
        fd = os.open(
            directory / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        )
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        return _read_holder(fd)
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}
