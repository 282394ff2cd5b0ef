"""Retention deletes old checkpoints in a thread of its own, after the commit, while training goes on.

The storage here is ``LocalStorage`` with a ``delete`` that can be held (a slow
disk freeing a large checkpoint's blocks); everything else is the real thing.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import stalwart
from stalwart.events import read_events
from stalwart.saving import Deletions
from stalwart.storage.local import LocalStorage
from stalwart.workers import Workers

from .conftest import make_parts, train_steps
from .support.interrupts import raised_into

HANG_S = 30.0
"""Longer than any step here takes: a test waiting this long has found a save that hangs."""


class HeldStorage(LocalStorage):
    """``LocalStorage`` whose ``delete`` waits for ``gate`` and records the thread it ran in."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.deleting = threading.Event()
        self.threads: list[str] = []
        self.fail_scan_in: str | None = None

    def delete(self, step: int) -> None:
        self.threads.append(threading.current_thread().name)
        self.deleting.set()
        assert self.gate.wait(HANG_S), "the test never released the deletion"
        super().delete(step)

    def committed_steps(self) -> list[int]:
        if self.fail_scan_in and threading.current_thread().name.startswith(self.fail_scan_in):
            raise PermissionError(13, "Permission denied (the run directory, for retention)")
        return super().committed_steps()


def _manager(run: Path, storage: LocalStorage, **kwargs: Any) -> stalwart.CheckpointManager:
    return stalwart.CheckpointManager(run, storage=storage, handle_signals=False, **kwargs)


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_returns_while_the_checkpoint_before_it_is_still_being_deleted(
    tmp_path: Path, async_save: bool
) -> None:
    run = tmp_path / "run"
    storage = HeldStorage(run)
    parts = make_parts()
    with _manager(run, storage, keep_last=1, async_save=async_save) as ckpt:
        assert ckpt.save(1, parts.state)
        ckpt.wait()
        storage.gate.clear()  # the disk takes its time freeing step 1
        train_steps(parts, 1)
        second, out = _in_thread(lambda: ckpt.save(2, parts.state))
        second.join(HANG_S)
        assert not second.is_alive(), "save(2) waited for the deletion of step 1"
        assert out == [True]
        assert storage.deleting.wait(HANG_S)
        assert storage.threads == ["stalwart-retention_0"]

        # The next save starts only once that deletion is done: its disk space is free.
        train_steps(parts, 1)
        third, out = _in_thread(lambda: ckpt.save(3, parts.state))
        third.join(0.5)
        assert third.is_alive(), "save(3) started writing while step 1 was being deleted"
        storage.gate.set()
        third.join(HANG_S)
        assert out == [True]
        ckpt.wait()  # async: step 3 committed, and step 2 deleted after it
        assert ckpt.all_steps() == [3]
    deleted = [e["step"] for e in read_events(run) if e["event"] == "delete"]
    assert deleted == [1, 2]


def test_wait_all_steps_and_close_see_the_deletions_done(tmp_path: Path) -> None:
    run = tmp_path / "run"
    storage = HeldStorage(run)
    parts = make_parts()
    with _manager(run, storage, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, parts.state)
        ckpt.wait()  # step 1 deleted before the gate closes
        storage.gate.clear()
        assert ckpt.save(4, parts.state)
        release = threading.Timer(0.3, storage.gate.set)
        release.start()
        started = time.monotonic()
        assert ckpt.all_steps() == [3, 4]  # after the held deletion of step 2
        assert time.monotonic() - started > 0.2
        storage.gate.clear()
        assert ckpt.save(5, parts.state)
        threading.Timer(0.3, storage.gate.set).start()
        ckpt.wait()
        assert sorted(p.name for p in run.glob("step_*")) == ["step_000000004", "step_000000005"]
        storage.gate.clear()
        assert ckpt.save(6, parts.state)
        threading.Timer(0.3, storage.gate.set).start()
    # close waited for the deletion of step 4
    assert sorted(p.name for p in run.glob("step_*")) == ["step_000000005", "step_000000006"]
    assert not list(run.glob(".step_*"))


def test_a_retention_pass_that_fails_is_an_event_and_training_goes_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    storage = HeldStorage(run)
    storage.fail_scan_in = "stalwart-retention"
    parts = make_parts()
    with _manager(run, storage, keep_last=1) as ckpt:
        for step in (1, 2, 3):
            train_steps(parts, 1)
            assert ckpt.save(step, parts.state)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2, 3]  # nothing deleted: the run keeps its disk space
        failed = [e for e in read_events(run) if e["event"] == "delete_failed"]
        assert failed and all(e["step"] is None for e in failed)
        assert all("retention failed: PermissionError" in e["error"] for e in failed)
        storage.fail_scan_in = None  # the directory is readable again: the next pass catches up
        assert ckpt.save(4, parts.state)
        assert ckpt.all_steps() == [4]


@pytest.mark.parametrize(
    ("code", "marker", "queued"),
    [
        (Workers.submit.__code__, "return self._executor().submit", 0),
        (concurrent.futures.ThreadPoolExecutor.submit.__code__, "self._adjust_thread_count()", 1),
    ],
    ids=["before-it-is-queued", "after-it-is-queued"],
)
def test_an_interrupt_while_a_pass_is_handed_over_leaves_retention_working(
    code: Any, marker: str, queued: int
) -> None:
    """Ctrl-C, or a signal handler's error, raised into the training thread while it
    hands a retention pass over (found by the sweep of tests/faults/test_interrupts.py):
    retention used to believe a pass was running and never ran one again. A pass
    queued before the interrupt is waited for like any other."""
    passes: list[str] = []
    gate = threading.Event()

    def run() -> None:
        assert gate.wait(HANG_S), "the test never opened the gate"
        passes.append(threading.current_thread().name)

    deletions = Deletions(run)
    raised_into(code, marker, KeyboardInterrupt(), deletions.request)
    threading.Timer(0.2, gate.set).start()
    deletions.wait()  # returns once a queued pass ran, through the gate
    assert len(passes) == queued, passes
    deletions.request()
    deletions.wait()
    assert len(passes) == queued + 1, passes
    assert all(name.startswith("stalwart-retention") for name in passes), passes
    deletions.request()
    deletions.wait()
    assert len(passes) == queued + 2
