"""A rank SIGKILLed in the middle of a restore, with real ranks (gloo on CPU).

The surviving rank must fail at once with an error naming the dead rank, not
hang and not take the checkpoint for a damaged one: it stays where it is, and
the restarted job restores it.
"""

from __future__ import annotations

import re
import signal
import textwrap
from pathlib import Path

import pytest

from stalwart.events import read_events

from ..support.torchrun import launch_ranks

_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import stalwart

    run, die_in = sys.argv[1], sys.argv[2]

    def die_inside(name):
        # A hook of rank 1's model: SIGKILL once the restore step ``name`` (a
        # function of stalwart's, found on the stack) gets or loads the state.
        def hook(*_args):
            frame = sys._getframe()
            while frame is not None:
                if frame.f_code.co_name == name and "stalwart" in frame.f_code.co_filename:
                    os.kill(os.getpid(), signal.SIGKILL)
                frame = frame.f_back
        return hook

    rank, world = stalwart.init_distributed("gloo", timeout=60)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = stalwart.TrainState(model=model, optimizer=opt)
    if rank == 1 and die_in != "-":
        net.register_state_dict_post_hook(die_inside(die_in))
        net.register_load_state_dict_pre_hook(die_inside(die_in))
    try:
        with stalwart.CheckpointManager(run, every_steps=2, save_timeout=30) as ckpt:
            try:
                start = ckpt.restore(state) or 0
            except stalwart.CheckpointCorruptError as exc:
                print(f"rank {rank} restore-error transient={exc.transient}", flush=True)
                raise
            print(f"rank {rank} start {start}", flush=True)
            for step in range(start, 4):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                ckpt.save(step + 1, state)
    finally:
        stalwart.shutdown_distributed()
    """
)


@pytest.mark.parametrize("die_in", ["prepare", "apply"])
def test_a_peer_killed_during_a_restore_fails_the_restore_and_leaves_the_checkpoint(
    tmp_path: Path, die_in: str
) -> None:
    """``prepare`` builds the live state dicts while the data files are checked,
    before the ranks agree that every check passed; ``apply`` loads what was read
    into the live objects, before the ranks agree that every rank's load passed."""
    script = tmp_path / "restore.py"
    script.write_text(_SCRIPT)
    run = tmp_path / "run"
    for code, out, err in launch_ranks(script, str(run), "-"):
        assert code == 0, out + err[-3000:]
    steps = sorted(p.name for p in run.glob("step_*"))
    assert steps == ["step_000000002", "step_000000004"], steps

    (code0, out0, err0), (code1, out1, _) = launch_ranks(script, str(run), die_in)
    assert code1 == -signal.SIGKILL, out1
    assert code0 not in (0, None), out0 + err0[-3000:]
    assert "start" not in out0 + out1  # neither rank went on training
    assert "rank 0 restore-error transient=True" in out0, out0
    assert re.search(
        r"CheckpointCorruptError: restoring from .* failed: rank 1 is gone \(", err0
    ), err0[-3000:]
    # Not a damaged checkpoint: nothing was skipped or set aside.
    assert sorted(p.name for p in run.glob("step_*")) == steps
    events = read_events(run)
    assert not [e for e in events if "corrupt" in e["event"] or "skip" in e["event"]], events

    results = launch_ranks(script, str(run), "-")
    for code, out, err in results:
        assert code == 0, out + err[-3000:]
    assert sorted(re.findall(r"rank \d start \d+", results[0][1] + results[1][1])) == [
        "rank 0 start 4",
        "rank 1 start 4",
    ]
