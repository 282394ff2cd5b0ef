"""SIGKILL at random moments during saves never leaves a checkpoint that loads wrong.

A child process (forked from a fork server that has torch and stalwart
imported, so each trial costs milliseconds, not an interpreter start) saves
continuously a state whose every value is a known function of the step. The
test kills it at a random moment with SIGKILL, then restores in this process:
whatever ``restore`` loads must be exactly the state of the step it reports,
and every committed checkpoint must verify.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.pipeline import verify_checkpoint
from stalwart.storage.local import LocalStorage

TRIALS = 50


def _state_for(step: int) -> tuple[stalwart.TrainState, torch.nn.Module, dict]:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * 1e-3 + step + i)
    extra = {"step_copy": step, "tag": f"s{step}"}
    return stalwart.TrainState(model=model, extra=extra, rng=False), model, extra


def _save_forever(run_dir: str, first_step: int, ready: mp.synchronize.Event) -> None:
    torch.set_num_threads(1)
    # The first save of a process pays for lazy imports inside DCP; pay it elsewhere
    # so the random kill times below fall on ordinary saves.
    with stalwart.CheckpointManager(run_dir + "-warmup", keep_last=1, handle_signals=False) as warm:
        warm.save(first_step, _state_for(0)[0], force=True)
    step = first_step
    with stalwart.CheckpointManager(run_dir, keep_last=2, handle_signals=False) as ckpt:
        ready.set()
        while True:
            state, _model, _extra = _state_for(step)
            ckpt.save(step, state)
            step += 1


@pytest.fixture(scope="module")
def ctx() -> mp.context.ForkServerContext:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "stalwart"])
    return context


def test_sigkill_at_random_moments_during_save(
    tmp_path: Path, ctx: mp.context.ForkServerContext
) -> None:
    rng = random.Random(1234)
    run = tmp_path / "run"
    storage = LocalStorage(run)
    next_step = 1
    restored_steps = []
    interrupted_saves = 0
    for _trial in range(TRIALS):
        ready = ctx.Event()
        proc = ctx.Process(target=_save_forever, args=(str(run), next_step, ready))
        proc.start()
        assert ready.wait(60), "child did not start"
        proc.join(rng.uniform(0.0, 0.25))
        proc.kill()
        proc.join(30)
        assert proc.exitcode == -9

        entries = storage.scan()
        interrupted_saves += any(e.status == "incomplete" for e in entries)
        for e in entries:
            if e.status == "committed":
                verify_checkpoint(e.path)  # every committed checkpoint is whole
        state, model, extra = _state_for(-1)
        with stalwart.CheckpointManager(run, keep_last=2, handle_signals=False) as ckpt:
            step = ckpt.restore(state)
        if step is None:
            continue
        _ref_state, ref_model, _ref_extra = _state_for(step)
        for (name, got), want in zip(
            model.state_dict().items(), ref_model.state_dict().values(), strict=True
        ):
            assert torch.equal(got, want), f"trial {_trial}: {name} of step {step} differs"
        assert extra == {"step_copy": step, "tag": f"s{step}"}
        restored_steps.append(step)
        next_step = max(s for s in storage.committed_steps()) + 1
    assert len(restored_steps) >= TRIALS // 2, "too few trials got as far as a committed save"
    assert interrupted_saves >= 5, "kills did not land inside saves often enough to test anything"
