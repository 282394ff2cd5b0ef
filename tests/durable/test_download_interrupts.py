"""An error raised into the training thread while a restore downloads from the durable tier.

The local copy is gone (a new node), so ``restore`` fetches the checkpoint from
the object store into a staging directory, checks it, commits it locally and
loads it. Ctrl-C, or DataLoader's SIGCHLD handler raising RuntimeError, can
land anywhere in that: here a trace function raises it at the N-th function
entry of the download part (from ``RestoreWalk._download`` to the load), for N
across all of it (``tests/faults/test_interrupts.py`` covers the load itself).

After each: the error comes out (Ctrl-C as itself), no staging directory is
left in the run, a local step directory exists only as a complete checkpoint
that verifies, nothing is moved aside, no descriptor stays open once the error
is dropped, and the next restore is exact. At the end the durable copy is
still committed and verifies.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from stalwart.pipeline import verify_checkpoint
from stalwart.storage.durable import DurableTier
from stalwart.storage.remote import RetryPolicy

from ..conftest import assert_same
from ..support.interrupts import (
    KILLED,
    RaiseBetween,
    fds_settle,
    interrupted_restore,
    open_fds,
    small_state,
    traced,
)
from .conftest import FAST, use_endpoint, verify_durable

STRIDE = 3
"""Every 3rd function entry of the download part (about 70 of its 210 here)."""


def in_download(at: int, error: BaseException) -> RaiseBetween:
    """Counting the entries from the durable download's start to the load of what it fetched."""
    return RaiseBetween(at, error, "_download", "load_checkpoint")


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("error", [KILLED, KeyboardInterrupt()], ids=["handler", "ctrl-c"])
def test_an_error_raised_into_a_durable_download_at_any_call_loses_nothing(
    tmp_path: Path, s3_env: dict[str, str], s3_bucket: str, error: BaseException
) -> None:
    url = f"s3://{s3_bucket}/interrupted"
    model, _opt, state = small_state()
    run = tmp_path / "run"
    durable = stalwart.DurableConfig(url=url, retry=FAST)
    with stalwart.CheckpointManager(run, durable=durable, handle_signals=False) as ckpt:
        ckpt.save(1, state, force=True)
        assert ckpt.wait_durable(60)
    wanted = {k: v.clone() for k, v in model.state_dict().items()}
    local = run / "step_000000001"

    def lose_the_local_copy() -> None:
        shutil.rmtree(local, ignore_errors=True)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # the next restore must put the values back

    with stalwart.CheckpointManager(run, durable=durable, handle_signals=False) as ckpt:
        lose_the_local_copy()
        counting = in_download(0, error)
        assert traced(counting, lambda: ckpt.restore(state)) is None
        assert counting.ended and counting.calls > 100, counting.calls  # the download was counted
        assert_same(model.state_dict(), wanted)
        raised = 0
        for at in range(1, counting.calls + 1, STRIDE):
            lose_the_local_copy()
            fds = open_fds()
            trace = in_download(at, error)
            raised += interrupted_restore(trace, ckpt, state, model, wanted)
            where = trace.where
            leftovers = [p.name for p in run.iterdir() if p.name.startswith(".step_")]
            assert not leftovers, (where, leftovers)  # no staging left, nothing moved aside
            if local.exists():
                assert verify_checkpoint(local).step == 1, where
            trace.error.__traceback__ = None
            assert not fds_settle(fds), (where, fds_settle(fds))
            assert ckpt.restore(state) == 1, where
            assert_same(model.state_dict(), wanted)
        assert raised > counting.calls // STRIDE // 2, raised
    tier = DurableTier(url, retry=FAST)
    assert tier.committed_steps() == [1]
    verify_durable(tier, 1, tmp_path)


def test_ctrl_c_stops_a_download_whose_requests_are_being_retried(
    tmp_path: Path, s3_env: dict[str, str], s3_bucket: str, fault_proxy: Any, monkeypatch: Any
) -> None:
    """A real SIGINT while every range request of a download fails (the store is down) and
    is retried on the transfer threads: KeyboardInterrupt comes out within seconds, not
    once each request's retries reach their deadline (a minute here, 15 by default)."""
    url = f"s3://{s3_bucket}/stuck"
    torch.manual_seed(0)
    state = stalwart.TrainState(model=torch.nn.Sequential(torch.nn.Linear(64, 64)))
    with stalwart.CheckpointManager(
        tmp_path / "run", durable=stalwart.DurableConfig(url=url, retry=FAST), handle_signals=False
    ) as ckpt:
        ckpt.save(1, state, force=True)
        assert ckpt.wait_durable(60)
    manifest_bytes = DurableTier(url, retry=FAST).manifest_bytes(1)
    use_endpoint(monkeypatch, fault_proxy.endpoint)
    fault_proxy.down = True
    patient = RetryPolicy(initial_backoff=0.2, max_backoff=1.0, deadline=60.0, request_timeout=5.0)
    tier = DurableTier(url, retry=patient)
    dest = tmp_path / "dest"
    dest.mkdir()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            tier.download(1, dest, manifest_bytes=manifest_bytes)
    finally:
        timer.cancel()
    took = time.monotonic() - started
    assert fault_proxy.failures["down"] > 0  # the requests did fail and retry
    assert took < 10, f"Ctrl-C took {took:.1f} s to stop the download"
