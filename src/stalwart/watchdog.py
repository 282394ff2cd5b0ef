"""The hang watchdog: a rank that stops making progress dumps its stacks and exits.

A hung rank (a deadlock in user code, a stuck filesystem, a collective waiting
for a peer that will never come) holds the whole job: torch.distributed's own
timeouts only cover collectives, often at 30 minutes or more, and nothing says
where the time went. :class:`Watchdog` is a daemon thread per rank that
watches a heartbeat: ``CheckpointManager.save`` beats it on every call (so once
a step), and the loop may call :meth:`Watchdog.heartbeat` itself. When no beat
came for ``timeout`` seconds it

1. writes the stacks of every thread of this process to
   ``<run>/watchdog/rank<r>-<ns>.txt`` (``faulthandler``, which reads the frames
   without running Python code in the hung thread),
2. appends a ``watchdog`` event to ``<run>/events.jsonl`` (each rank its own;
   lines are single appends, so ranks never interleave),
3. ``grace`` seconds after it fired, ends the process with ``os._exit(exit_code)``:
   a thread blocked in C code (a collective, a read) cannot be interrupted any
   other way, and a non-zero exit is what makes torchrun restart the job.

Every rank dumps itself: the hung rank stops beating first, and a peer that
waits for it in a collective stops one step later. The grace period lets that
peer's watchdog fire before the first exit breaks its collective.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import threading
import time
from pathlib import Path
from types import TracebackType

from stalwart.events import EVENTS_NAME, EventLog
from stalwart.layout import WATCHDOG_DIR
from stalwart.manager import CheckpointManager

__all__ = ["WATCHDOG_DIR", "Watchdog"]

logger = logging.getLogger("stalwart")

EXIT_CODE = 124
"""The default exit status of a process the watchdog ends (the one ``timeout(1)`` uses)."""


class Watchdog:
    """Ends this rank with its stacks on disk when no heartbeat came for ``timeout`` seconds.

    ``Watchdog(ckpt, timeout=...)`` on every rank, after ``ckpt.restore`` (the
    clock starts at construction). It registers :meth:`heartbeat` with the
    manager, so every ``ckpt.save`` call beats it; choose ``timeout`` above the
    longest step plus the longest save. ``grace`` (default ``min(timeout, 10)``
    seconds) is how long a firing rank lives on after it fired, so peers
    blocked waiting for it dump theirs too. ``exit_code=None`` only dumps
    and records (once per silence) and never exits. ``close`` (or the context
    manager) stops the thread; do that before work without heartbeats (a long
    evaluation, the final teardown). Not itself collective; thread-safe.
    """

    def __init__(
        self,
        ckpt: CheckpointManager,
        *,
        timeout: float,
        grace: float | None = None,
        exit_code: int | None = EXIT_CODE,
        poll: float | None = None,
    ) -> None:
        if not isinstance(ckpt, CheckpointManager):
            raise TypeError(f"ckpt must be a stalwart.CheckpointManager, got {type(ckpt).__name__}")
        self.timeout = _positive("timeout", timeout)
        self.grace = (
            min(self.timeout, 10.0) if grace is None else _positive("grace", grace, zero=True)
        )
        self.poll = min(self.timeout / 10, 1.0) if poll is None else _positive("poll", poll)
        if exit_code is not None and (
            isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 < exit_code < 256
        ):
            raise ValueError(
                f"exit_code must be an int in 1..255 (non-zero, so torchrun restarts the job) or "
                f"None to only record, got {exit_code!r}"
            )
        self.exit_code = exit_code
        self.ckpt = ckpt
        self.directory: Path = ckpt.directory
        self.rank = ckpt.rank
        # Every rank records its own firing: the hung rank may be any rank, not the leader.
        self._events = EventLog(self.directory / EVENTS_NAME, rank=self.rank)
        self._last = time.monotonic()
        self._step: int | None = None
        self._beats = 0
        self._fired_at = -1
        self.fired: list[Path] = []
        """Stack files this watchdog wrote, oldest first."""
        self._stop = threading.Event()
        ckpt.heartbeats.append(self.heartbeat)
        self._thread = threading.Thread(
            target=self._watch, name=f"stalwart-watchdog-rank{self.rank}", daemon=True
        )
        self._thread.start()

    def heartbeat(self, step: int | None = None) -> None:
        """Record progress (at ``step``, when known). Any thread; cheap (two stores)."""
        self._step = step if step is not None else self._step
        self._last = time.monotonic()
        self._beats += 1

    @property
    def silent_for(self) -> float:
        """Seconds since the last heartbeat (or construction)."""
        return time.monotonic() - self._last

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            if self.silent_for > self.timeout and self._fired_at != self._beats:
                self._fired_at = self._beats
                self._fire()

    def _fire(self) -> None:
        silent, step = self.silent_for, self._step
        if self.exit_code is not None:
            # Armed first: the exit must not depend on the dump or the event, since the hung
            # thread may hold a lock they need (a logging handler's, stderr's). The grace lets
            # peers that wait for this rank in a collective, and stopped beating a step later,
            # dump their own stacks before this exit breaks their collective.
            timer = threading.Timer(self.grace, os._exit, (self.exit_code,))
            timer.daemon = True
            timer.start()
        path = self._dump(silent, step)
        self._events.emit(
            "watchdog",
            logging.ERROR,
            step=step,
            silent_s=round(silent, 3),
            timeout=self.timeout,
            stacks=None if path is None else str(path.relative_to(self.directory)),
            exit_code=self.exit_code,
        )

    def _dump(self, silent: float, step: int | None) -> Path | None:
        """Write every thread's stack to ``watchdog/rank<r>-<ns>.txt``; None when that fails."""
        folder = self.directory / WATCHDOG_DIR
        path = folder / f"rank{self.rank:05d}-{time.time_ns()}.txt"
        try:
            folder.mkdir(exist_ok=True)
            # The run directory is input from outside: ``watchdog`` as a link would send the
            # dump anywhere, so the folder is opened without following one and the file is
            # created inside that very folder.
            where = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(path.name, flags, 0o644, dir_fd=where)
            finally:
                os.close(where)
            with os.fdopen(fd, "w") as f:
                f.write(
                    f"stalwart watchdog: rank {self.rank} (pid {os.getpid()}) made no progress "
                    f"for {silent:.1f} s (timeout {self.timeout:g} s); last heartbeat at step "
                    f"{step}. Stacks of every thread, most recent call first:\n\n"
                )
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as exc:
            # The exit matters more than the dump: a full disk must not keep a hung job alive.
            logger.error("watchdog could not write %s: %s", path, exc)
            return None
        self.fired.append(path)
        return path

    def close(self) -> None:
        """Stop watching and unregister from the manager. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self.heartbeat in self.ckpt.heartbeats:
            self.ckpt.heartbeats.remove(self.heartbeat)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _positive(name: str, value: object, *, zero: bool = False) -> float:
    # Finite too: an infinite timeout never fires, and an infinite grace overflows the
    # timer that must end the process.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value >= 0 if zero else value > 0):  # type: ignore[operator]
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a number of seconds {bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]
