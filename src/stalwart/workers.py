"""Threads kept for the short tasks of saves and restores: hashing, reads, writes, fsyncs.

Starting and joining a thread costs about a millisecond on a busy 2-core
host, and a save or restore used to start several of them (a writer thread
and an fsync per file, a hashing thread per streamed file, two readers):
a tenth of a 64 MiB restore's time. A ``Workers`` pool keeps its threads
between tasks instead (``concurrent.futures.ThreadPoolExecutor``, which
starts a thread only when none is idle).

Each pool serves one role whose tasks never wait for another task of the
same pool, so a full pool only queues work, never deadlocks. After a fork
the child gets fresh pools (the parent's threads do not exist there), and
once the interpreter is shutting down, when executors accept no more work,
a task runs in a thread of its own, or inline where even that is refused.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["Workers", "refused_new_work"]

# How an executor or ``Thread.start`` says it takes no more work: at the
# interpreter's exit, or when no thread can be started.
_REFUSALS = (
    "cannot schedule new futures",
    "can't start new thread",
    "can't create new thread",
)


def refused_new_work(exc: RuntimeError) -> bool:
    """True when ``exc`` is an executor or thread start refusing work, so the work
    was not queued and may run elsewhere. Any other ``RuntimeError`` is not: a
    signal handler can raise one into the submitting thread at any bytecode, after
    the work was queued (DataLoader's SIGCHLD handler does, when a worker dies), and
    running the work a second time would close a file under its queued fsync and
    swallow the handler's error."""
    return str(exc).startswith(_REFUSALS)


class Workers:
    """A lazily started, per-process pool of at most ``size`` threads named ``name``."""

    _all: ClassVar[list[Workers]] = []

    def __init__(self, name: str, size: int) -> None:
        if size < 1:
            raise ValueError(f"size={size}: a pool needs at least one thread")
        self.name = name
        self.size = size
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = 0
        Workers._all.append(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` in one of the pool's threads; its future."""
        try:
            return self._executor().submit(fn, *args)
        except RuntimeError as exc:
            if not refused_new_work(exc):
                raise
            return _in_own_thread(fn, args, self.name)  # interpreter shutdown

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = concurrent.futures.ThreadPoolExecutor(self.size, self.name)
                self._pid = os.getpid()
            return self._pool

    def _forget(self) -> None:
        """In a forked child: the parent's threads are not there, start anew."""
        self._lock = threading.Lock()
        self._pool = None
        self._pid = 0


def _in_own_thread(
    fn: Callable[..., Any], args: tuple[Any, ...], name: str
) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever waits, in their thread
            future.set_exception(exc)

    try:
        threading.Thread(target=run, name=name).start()
    except RuntimeError as exc:
        if not refused_new_work(exc):
            raise
        run()  # no new thread at this point of the interpreter's exit
    return future


def _after_fork_in_child() -> None:
    for workers in Workers._all:
        workers._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
