"""Preemption signals: SIGTERM and SIGUSR1 set a flag that the next ``save`` acts on.

The handler only sets a flag (and notes when it arrived: the grace window runs
from there): it runs between bytecodes of the training loop, and saving from
there could interleave with a half-done optimizer step. The manager reads the
flag in ``save``, agrees on it across ranks and writes an emergency checkpoint
when it fits in the grace window (``stalwart.preemption``).

A scheduler signals the whole job, not one process: torchrun sends SIGTERM to
each rank's process group, SLURM to every process of the step, ``kill -TERM
-PGID`` to a group. DataLoader workers are in those groups and die of the
default action before the rank could save, and the rank's next batch then
raises. ``shield_worker`` (the ``worker_init_fn`` that ``ResumableDataLoader``
installs, and that a plain ``DataLoader`` can take) keeps them alive.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = [
    "PREEMPTION_SIGNALS",
    "PreemptionSignals",
    "ShieldedWorkerInit",
    "preemption_requested",
    "shield_worker",
    "shielded_worker_init",
]

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")

_INSTALLED: list[PreemptionSignals] = []
"""The flags installed in this process now; a signal sets each of them (a process has one
set of signal handlers, shared by every open manager)."""
_PREVIOUS: dict[int, Any] = {}
"""The handlers in place before the first ``install``, put back when the last one leaves."""
_SHIELDED_PID: int | None = None
"""The process ``shield_worker`` ran in (a forked worker inherits the value of its parent)."""


def _signums() -> list[int]:
    return [s for s in (getattr(signal, n, None) for n in PREEMPTION_SIGNALS) if s is not None]


def preemption_requested() -> bool:
    """Whether a preemption signal reached *this process* since a manager installed its handlers.

    Cheap (no collective, no lock), safe to poll anywhere in the training
    thread, e.g. to cut short a long evaluation or data-preparation loop. It is
    this rank's own view: with several ranks, leave a loop that runs collectives
    (DDP forward/backward, gradient accumulation, all-reduced metrics) only
    through ``save`` and ``CheckpointManager.preempted``, where the ranks
    agree; a rank that broke out alone would leave the others waiting in the
    next collective.
    """
    return any(s.is_set() for s in _INSTALLED)


class PreemptionSignals:
    """A flag set by SIGTERM or SIGUSR1 once ``install`` ran; ``uninstall`` puts the old handlers back.

    Handlers are installed only from the main thread (Python allows no other);
    elsewhere ``install`` does nothing and the flag stays clear. Several may be
    installed at once (two managers in one process): a signal sets every
    installed flag, in any order of ``uninstall``, and the handlers in place
    before the first ``install`` come back when the last one is uninstalled.
    """

    def __init__(self) -> None:
        self._flag = threading.Event()
        self.arrived: float | None = None
        """``time.monotonic()`` when the first signal arrived (None: none yet)."""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self in _INSTALLED:
            return
        for signum in _signums():
            previous = signal.signal(signum, _on_signal)
            if previous is not _on_signal:
                _PREVIOUS[signum] = previous
        _INSTALLED.append(self)

    def _mark(self) -> None:
        if self.arrived is None:
            self.arrived = time.monotonic()
        self._flag.set()

    def is_set(self) -> bool:
        """Whether a preemption signal arrived (in this process)."""
        return self._flag.is_set()

    def seconds_since(self) -> float | None:
        """Seconds since the first signal arrived (None: no signal yet)."""
        return None if self.arrived is None else time.monotonic() - self.arrived

    def uninstall(self) -> None:
        """Stop setting this flag; the last one out restores the earlier handlers. Idempotent."""
        if self not in _INSTALLED:
            return
        _INSTALLED.remove(self)
        if not _INSTALLED:
            for signum, handler in _PREVIOUS.items():
                signal.signal(signum, handler)
            _PREVIOUS.clear()


def _on_signal(_signum: int, _frame: FrameType | None) -> None:
    for flag in list(_INSTALLED):
        flag._mark()


# ------------------------------------------------------------- DataLoader workers


def shield_worker(worker_id: int = 0) -> None:
    """Keep this DataLoader worker alive through a preemption signal sent to its whole job.

    Usable as a ``worker_init_fn`` (``ResumableDataLoader`` installs it itself;
    ``shielded_worker_init`` wraps a user's own). In the worker, SIGTERM and
    SIGUSR1 are blocked and read by a thread: one sent by the worker's parent
    (the DataLoader shutting its workers down, multiprocessing terminating them
    at exit) ends the worker as before, by that signal; one from anywhere else
    (torchrun, SLURM, ``kill -- -PGID``) is ignored, so the rank keeps its
    batches until it has written its emergency checkpoint. The worker still
    ends with its DataLoader, when its parent dies, and on SIGKILL. A second
    call in the same worker does nothing.
    """
    del worker_id  # the same for every worker
    global _SHIELDED_PID
    if os.getpid() == _SHIELDED_PID:
        return  # shielded already (a ShieldedWorkerInit given to ResumableDataLoader)
    _SHIELDED_PID = os.getpid()
    signums = _signums()
    parent = multiprocessing.parent_process()
    # spawn/forkserver: the process that started the worker, not the fork server.
    parent_pid = parent.pid if parent is not None and parent.pid else os.getppid()
    for signum in signums:
        signal.signal(signum, signal.SIG_DFL)  # not the rank's inherited flag handler
    # Blocked before the reader thread exists, so that it inherits the mask and
    # every thread the worker starts later does too: sigwaitinfo then gets each one.
    signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    threading.Thread(
        target=_read_signals, args=(signums, parent_pid), name="stalwart-shield", daemon=True
    ).start()


def _read_signals(signums: list[int], parent_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo(signums)
        if info.si_pid == parent_pid:
            # The loader stops its worker: die of the signal, as without the shield.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [info.si_signo])
            signal.raise_signal(info.si_signo)
            os._exit(128 + info.si_signo)  # not reached: the default action ends the process


class ShieldedWorkerInit:
    """A ``worker_init_fn`` that runs ``shield_worker`` and then the user's own (picklable)."""

    def __init__(self, user: Callable[[int], None] | None) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        shield_worker(worker_id)
        if self.user is not None:
            self.user(worker_id)


def shielded_worker_init(user: Callable[[int], None] | None = None) -> ShieldedWorkerInit:
    """``worker_init_fn`` for a plain ``DataLoader``: ``shield_worker``, then ``user`` if given."""
    return ShieldedWorkerInit(user)
