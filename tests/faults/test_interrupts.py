"""An exception raised into the training thread in the middle of a save, at every call.

A Python signal handler runs in the main thread where the interpreter checks for
pending signals, at the entry of a function among others, and its exception
comes out of whatever the thread was doing. DataLoader's SIGCHLD handler raises
a RuntimeError that way when one of its workers dies (a group SIGTERM kills
them first), and Ctrl-C raises KeyboardInterrupt. Here a trace function raises
such an error at the N-th function entry of a sync save, for N across the whole
save (every entry with ``STRIDE`` 1; this test takes every ``STRIDE``-th).

After each: the error comes out (as it is, or as the cause named by a
``CheckpointSaveError``), no descriptor is left open, no staging directory is
left behind, and the next save works. At the end every committed checkpoint
restores exactly. Found this way, and fixed: the fsync task run twice (see
``stalwart.workers.refused_new_work``); descriptors left open by an interrupted
file check (``events.open_regular``) and by an interrupt between a file's
write and its fsync's start; a staging directory left by an interrupt between
its creation and the write; and the interrupt itself swallowed by cleanup code
that waited for the fsyncs or the direct writes under ``suppress``.

The same for a restore: the error comes out (or, raised where a library's own
``except Exception`` takes it, the restore completes exactly), the checkpoint
is never moved aside or skipped for an older one, every descriptor is closed
once the error is dropped, and the next restore is exact. Found this way, and
fixed: Ctrl-C or a handler's error inside DCP's load planning was taken as a
damaged checkpoint, which was moved aside and the run started over (an error
after every check passed is now transient, a KeyboardInterrupt comes out as
itself, and a restore whose candidates all failed that way raises instead of
returning None); the ``extra`` dict emptied by an interrupt between its clear
and its update; a descriptor left by an interrupt at a generator context
manager's exit (``open_checkpoint_file`` now returns a file whose exit runs no
Python code) or between a file's check and its close (a checked file's
descriptor now closes when it is dropped); the files whose checks had begun,
left open by an interrupt at the ranks' agreement on that step until the error
was dropped (now closed before it comes out).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import stalwart

from ..conftest import assert_same
from ..hostile.harness import resign
from ..support.interrupts import (
    KILLED,
    RaiseAfterReturn,
    RaiseAtCall,
    RaiseBetween,
    fds_settle,
    interrupted_restore,
    names_the_error,
    open_fds,
    small_state,
    traced,
)

STRIDE = 5
"""Every 5th function entry: about 200 of a save's 1,000 (each of the 1,000 passes too)."""


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("error", "width"),
    [(KILLED, 64), (KeyboardInterrupt(), 64), (KILLED, 640)],
    ids=["handler", "ctrl-c", "handler-direct-writes"],
)
def test_an_error_raised_into_a_save_at_any_call_loses_nothing(
    tmp_path: Path, error: BaseException, async_save: bool, width: int
) -> None:
    """Async: the training thread's part (the state dict, the staging copy, the
    hand-off to the background writer), with ``wait`` after each save. Width 640:
    tensors whose pages go to the disk with O_DIRECT, gathered with the framing
    between them (a sync save's from the live tensors' own memory)."""
    model, _opt, state = small_state(extra={"k": 1}, width=width)
    run = tmp_path / "run"
    wanted: dict[int, dict[str, torch.Tensor]] = {}
    with stalwart.CheckpointManager(
        run, keep_last=3, handle_signals=False, async_save=async_save
    ) as ckpt:

        def save(step: int) -> bool:
            started = ckpt.save(step, state, force=True)
            ckpt.wait()
            return started

        save(1)
        counting = RaiseAtCall(0, error)
        assert traced(counting, lambda: save(2)) is None
        assert counting.calls > 300, counting.calls  # the whole save was counted
        step, raised = 3, 0
        for at in range(1, counting.calls, STRIDE):
            fds = open_fds()
            trace = RaiseAtCall(at, error)
            values = {k: v.clone() for k, v in model.state_dict().items()}
            outcome = traced(trace, lambda s=step: save(s))
            # Nothing the save turned off stays off: autograd is on in this thread.
            assert torch.is_grad_enabled(), trace.where
            with contextlib.suppress(stalwart.CheckpointSaveError):
                ckpt.wait()  # a background save that went on settles first
            if trace.where is None or ckpt.storage.step_path(step).exists():
                # Committed: fewer calls than the counted save, or the error came after
                # the commit. A checkpoint that exists is whole either way.
                wanted[step] = values
            step += 1
            if trace.where is None:
                assert outcome is None
                continue
            raised += 1
            assert names_the_error(outcome, trace.error), (trace.where, outcome)
            if not isinstance(trace.error, Exception):
                # Ctrl-C comes out as itself, never as a failed save a loop may catch.
                assert outcome is trace.error, (trace.where, outcome)
            where = trace.where
            outcome = trace.error.__traceback__ = None
            assert not fds_settle(fds), (where, fds_settle(fds))
            assert not list(run.glob(".step_*.tmp-*")), where
            with torch.no_grad():
                model[0].weight.add_(1.0)  # each committed step has values of its own
            assert save(step), where
            wanted[step] = {k: v.clone() for k, v in model.state_dict().items()}
            step += 1
        assert raised > counting.calls // STRIDE // 2, raised
    committed = sorted(int(p.name.split("_")[1]) for p in run.glob("step_*"))
    assert committed == sorted(wanted)[-3:]
    with stalwart.CheckpointManager(run, handle_signals=False) as ckpt:
        for s in committed:
            assert ckpt.restore(state, step=s) == s
            assert_same(model.state_dict(), wanted[s])


RESTORE_STRIDE = 13
"""Every 13th function entry: about 145 of a restore's 1,900 (every 3rd passes too)."""


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("error", [KILLED, KeyboardInterrupt()], ids=["handler", "ctrl-c"])
def test_an_error_raised_into_a_restore_at_any_call_keeps_the_checkpoint(
    tmp_path: Path, error: BaseException
) -> None:
    extra = {"k": 1}
    model, _opt, state = small_state(extra)
    run = tmp_path / "run"
    with stalwart.CheckpointManager(run, keep_last=3, handle_signals=False) as ckpt:
        ckpt.save(1, state, force=True)
        wanted = {k: v.clone() for k, v in model.state_dict().items()}
        counting = RaiseAtCall(0, error)
        assert traced(counting, lambda: ckpt.restore(state)) is None
        assert counting.calls > 1000, counting.calls  # the whole restore was counted
        raised = 0
        for at in range(1, counting.calls, RESTORE_STRIDE):
            with torch.no_grad():
                model[0].weight.add_(1.0)  # the next restore must put the values back
            fds = open_fds()
            trace = RaiseAtCall(at, error)
            raised += interrupted_restore(trace, ckpt, state, model, wanted)
            where = trace.where
            assert (run / "step_000000001").is_dir(), where
            assert not list(run.glob(".step_*")), where  # nothing moved aside
            trace.error.__traceback__ = None
            assert not fds_settle(fds), (where, fds_settle(fds))
            assert ckpt.restore(state) == 1, where
            assert_same(model.state_dict(), wanted)
            assert extra == {"k": 1}, where
        assert raised > counting.calls // RESTORE_STRIDE // 2, raised


@pytest.mark.parametrize("error", [KILLED, KeyboardInterrupt()], ids=["handler", "ctrl-c"])
def test_an_error_raised_once_a_restore_opened_its_files_closes_them_before_it_comes_out(
    tmp_path: Path, error: BaseException
) -> None:
    """Raised at the first call after the files' checks began (the ranks' agreement on
    the outcome): the checks run on in their threads, each holding its file, and the
    error's traceback holds the files. They are closed before the error comes out,
    not once the last reference to the error is dropped."""
    model, _opt, state = small_state()
    with stalwart.CheckpointManager(tmp_path / "run", handle_signals=False) as ckpt:
        ckpt.save(1, state, force=True)
        wanted = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.wait()
        before = open_fds()
        trace = RaiseAfterReturn(error, "verified_checkpoint")
        outcome = traced(trace, lambda: ckpt.restore(state))
        assert trace.where is not None
        assert names_the_error(outcome, trace.error), (trace.where, outcome)
        assert trace.error.__traceback__ is not None  # every frame of the restore alive
        assert open_fds() == before, trace.where
        assert not list((tmp_path / "run").glob(".step_*"))  # nothing moved aside
        with torch.no_grad():
            model[0].weight.add_(1.0)
        assert ckpt.restore(state) == 1
        assert_same(model.state_dict(), wanted)


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize("error", [KILLED, KeyboardInterrupt()], ids=["handler", "ctrl-c"])
def test_an_error_raised_into_the_metadata_pickles_read_keeps_the_checkpoint(
    tmp_path: Path, error: BaseException
) -> None:
    """A checkpoint without the JSON twin (an older stalwart's): its metadata comes from
    DCP's pickle, through the restricted pure-Python unpickler (a call per opcode). An
    error raised into any of about 80 points spread over that read comes out, and the
    checkpoint is neither moved aside nor skipped (DataLoader's handler's error was
    taken for a malformed pickle, and the only checkpoint moved aside)."""
    model, _opt, state = small_state()
    run = tmp_path / "run"
    with stalwart.CheckpointManager(run, handle_signals=False) as ckpt:
        ckpt.save(1, state, force=True)
    wanted = {k: v.clone() for k, v in model.state_dict().items()}
    step = run / "step_000000001"
    (step / ".metadata.json").unlink()
    resign(
        step,
        lambda body: body.update(files=[e for e in body["files"] if e["path"] != ".metadata.json"]),
    )

    def unpickling(at: int) -> RaiseBetween:
        return RaiseBetween(at, error, "_unpickle_metadata", "_check_structure")

    with stalwart.CheckpointManager(run, handle_signals=False) as ckpt:
        counting = unpickling(0)
        assert traced(counting, lambda: ckpt.restore(state)) is None
        assert counting.ended and counting.calls > 1000, counting.calls  # the unpickler's calls
        raised = 0
        for at in range(1, counting.calls + 1, counting.calls // 80):
            with torch.no_grad():
                model[0].weight.add_(1.0)  # the next restore must put the values back
            trace = unpickling(at)
            raised += interrupted_restore(trace, ckpt, state, model, wanted)
            assert step.is_dir() and not list(run.glob(".step_*")), trace.where
            trace.error.__traceback__ = None
            assert ckpt.restore(state) == 1, trace.where
            assert_same(model.state_dict(), wanted)
        assert raised >= 40, raised
