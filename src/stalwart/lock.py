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
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from stalwart.errors import RunLockedError

__all__ = ["LOCK_NAME", "RunLock"]

LOCK_NAME = ".lock"
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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}
