"""The cyclic collector pauses while a save or restore blocks the caller, and comes back as it was."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from stalwart.gc_pause import gc_paused


class _Recorder:
    """A stateful component that notes whether the collector runs when it is called."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []
        self.value = 1

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(("save", gc.isenabled()))
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen.append(("restore", gc.isenabled()))
        self.value = state["value"]


@pytest.fixture
def collector_enabled() -> Any:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


@pytest.mark.parametrize("async_save", [False, True])
def test_save_and_restore_run_with_the_collector_paused_and_give_it_back(
    tmp_path: Path, async_save: bool, collector_enabled: None
) -> None:
    recorder = _Recorder()
    model = torch.nn.Linear(4, 2)
    state = stalwart.TrainState(model=model, recorder=recorder)
    with stalwart.CheckpointManager(
        tmp_path / "run", async_save=async_save, handle_signals=False
    ) as mgr:
        mgr.save(1, state, force=True)
        assert gc.isenabled()
        mgr.wait()
        recorder.value = 5
        assert mgr.restore(state) == 1
        assert gc.isenabled()
    assert recorder.value == 1
    assert ("save", False) in recorder.seen and ("restore", False) in recorder.seen
    assert all(not enabled for _, enabled in recorder.seen)


def test_a_process_that_disabled_the_collector_keeps_it_disabled(tmp_path: Path) -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        state = stalwart.TrainState(model=torch.nn.Linear(4, 2))
        with stalwart.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
            mgr.save(1, state, force=True)
            mgr.restore(state)
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


def test_a_failing_restore_gives_the_collector_back(
    tmp_path: Path, collector_enabled: None
) -> None:
    state = stalwart.TrainState(model=torch.nn.Linear(4, 2))
    with stalwart.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        mgr.save(1, state, force=True)
        with pytest.raises(stalwart.StateMismatchError):
            mgr.restore(stalwart.TrainState(model=torch.nn.Linear(5, 2)), step=1)
    assert gc.isenabled()


def test_overlapping_pauses_in_two_threads_end_with_the_last(collector_enabled: None) -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=other)
    with gc_paused():
        thread.start()
        assert inside.wait(timeout=30)
    assert not gc.isenabled()  # the other thread's pause still holds
    release.set()
    thread.join(timeout=30)
    assert gc.isenabled()
