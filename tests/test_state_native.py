"""TrainState's model and optimizer sections match DCP's get_state_dict on every save.

After a first save checks it against DCP, TrainState rebuilds the FQN-keyed
state dicts from the plain ``state_dict()`` calls. Every test here compares
each save with a fresh ``get_state_dict`` call, across the changes that must
send it back to DCP: new param groups, replaced parameters, hyperparameters
moved by a scheduler, optimizer state appearing for more parameters.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import stalwart

from .conftest import assert_same


def assert_aliases_dcp(a: Any, b: Any, where: str = "") -> None:
    """``a`` is ``b`` rebuilt: the same key order and types, tensors over the same memory
    (not merely equal values, as conftest's ``assert_same`` checks), equal plain values."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape, where
        assert a.dtype == b.dtype and not a.requires_grad and not b.requires_grad, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            assert_aliases_dcp(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_aliases_dcp(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def check(state: stalwart.TrainState) -> None:
    sd = state.state_dict()
    model_sd, optim_sd = get_state_dict(state.model, state.optimizers)
    assert_aliases_dcp(sd["model"], model_sd, "model")
    assert_aliases_dcp(sd["optimizer"], optim_sd, "optimizer")


def step(model: nn.Module, *optimizers: torch.optim.Optimizer, width: int = 8) -> None:
    loss = model(torch.randn(4, width)).square().mean()
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def mlp(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width))


def test_later_saves_are_rebuilt_and_equal_to_dcp() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = stalwart.TrainState(model=model, optimizer=opt, scheduler=sched)
    state.state_dict()  # fresh optimizer: DCP, whose state is cleared again
    assert not opt.state
    for _ in range(4):
        step(model, opt)
        sched.step()  # the lr in the param group changes between saves
        check(state)
    assert state._native.rebuilt >= 3


def test_structure_changes_go_back_to_dcp() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(mlp(), nn.Linear(8, 8))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    state = stalwart.TrainState(model=model, optimizer=opt)
    step(model, opt)
    check(state)
    check(state)
    before = state._native.rebuilt
    # A new param group: the FQN list of the optimizer changes.
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.01})
    check(state)
    step(model, opt)  # momentum buffers now exist for the new group too
    check(state)
    check(state)
    # A replaced parameter object under the same name.
    old = model[1].weight
    with torch.no_grad():
        model[1].weight = nn.Parameter(old.clone())
    opt.param_groups[1]["params"][0] = model[1].weight
    opt.state[model[1].weight] = opt.state.pop(old)
    check(state)
    step(model, opt)
    check(state)
    # A new buffer adds a key.
    model[0][1].register_buffer("seen", torch.zeros(3))
    check(state)
    check(state)
    assert state._native.rebuilt > before


def test_tied_weights_multiple_optimizers_and_partial_state() -> None:
    torch.manual_seed(2)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 8, bias=False)
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 8, bias=False)
            self.head.weight = self.embed.weight
            self.unused = nn.Linear(8, 8)  # never gets a gradient: no optimizer state

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.embed(x)))

    model = Tied()
    a = torch.optim.Adam([model.embed.weight, *model.unused.parameters()], lr=1e-3)
    b = torch.optim.SGD(model.body.parameters(), lr=0.1, momentum=0.5)
    state = stalwart.TrainState(model=model, optimizer=[a, b])
    step(model, a, b)
    for _ in range(3):
        check(state)
        step(model, a, b)
    assert state._native.rebuilt >= 2


def test_a_submodule_named_like_a_wrapper_is_left_to_dcp() -> None:
    # "module" is the DDP wrapper's attribute, but here it is a real submodule whose
    # name stays in the FQN: the rebuild would drop it, so the check keeps DCP.
    torch.manual_seed(3)
    model = nn.Sequential()
    model.add_module("module", mlp())
    opt = torch.optim.Adam(model.parameters())
    state = stalwart.TrainState(model=model, optimizer=opt)
    step(model, opt)
    for _ in range(3):
        check(state)
    assert state._native.rebuilt == 0
    assert state._native.learned == 1  # the failed check is not repeated on every save


DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, {root!r})
    from tests.test_state_native import check, step, mlp
    import stalwart
    dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=0, world_size=1)
    torch.manual_seed(0)
    model = DDP(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = stalwart.TrainState(model=model, optimizer=opt)
    for _ in range(3):
        step(model, opt)
        check(state)
    assert not any(k.startswith("module.") for k in state.state_dict()["model"])
    print("rebuilt", state._native.rebuilt)
    dist.destroy_process_group()
    """
)


def test_ddp_keys_drop_the_wrapper_prefix_like_dcp(tmp_path) -> None:
    root = str(__import__("pathlib").Path(__file__).parent.parent)
    script = DDP_SCRIPT.format(root=root, store=str(tmp_path / "store"))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert int(proc.stdout.split("rebuilt")[1]) >= 2, proc.stdout


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})


def _saved(
    run: Any, optimizer: Any
) -> tuple[nn.Module, torch.optim.Optimizer, stalwart.TrainState, stalwart.CheckpointManager]:
    """A stepped model saved at step 1 (its structure learned by that save), the manager open."""
    model = mlp()
    opt = optimizer(model.parameters())
    state = stalwart.TrainState(model=model, optimizer=opt)
    step(model, opt)
    ckpt = stalwart.CheckpointManager(run, async_save=False, handle_signals=False)
    ckpt.save(1, state, force=True)
    return model, opt, state, ckpt


def test_a_restore_into_objects_a_save_has_seen_reads_into_the_rebuild(tmp_path) -> None:
    """After a save learned the structure, a restore into the same objects takes the
    rebuild (one ``model.state_dict()``, no DCP mapping) and is exact."""
    torch.manual_seed(4)
    model, opt, state, ckpt = _saved(
        tmp_path / "run", functools.partial(torch.optim.AdamW, lr=1e-2)
    )
    try:
        saved = _snapshot(model, opt)
        weight = model[0].weight
        for _ in range(2):
            step(model, opt)
        calls = []
        model.register_state_dict_post_hook(lambda *_: calls.append(1))
        before = state._native.rebuilt
        ckpt.restore(state, step=1)
        assert state._native.rebuilt == before + 1
        assert len(calls) == 1
        assert model[0].weight is weight  # loaded in place, into the live parameter
        assert_same(_snapshot(model, opt), saved)
    finally:
        ckpt.close()


def test_a_restore_after_the_structure_changed_goes_back_to_dcp(tmp_path) -> None:
    """A buffer registered after the save (a key the checkpoint lacks): the learned
    structure no longer matches, so DCP maps the keys (and the new structure is
    checked), strict restore refuses with the state untouched, and a non-strict
    one loads what was saved."""
    torch.manual_seed(5)
    optimizer = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    model, opt, state, ckpt = _saved(tmp_path / "run", optimizer)
    try:
        saved = _snapshot(model, opt)
        step(model, opt)
        model[1].register_buffer("seen", torch.ones(3))
        now = _snapshot(model, opt)
        before, learned = state._native.rebuilt, state._native.learned
        with pytest.raises(stalwart.StateMismatchError, match="seen"):
            ckpt.restore(state, step=1)
        assert (state._native.rebuilt, state._native.learned) == (before, learned + 1)
        assert_same(_snapshot(model, opt), now)
        ckpt.restore(state, step=1, strict=False)  # the new structure, checked by the last
        assert state._native.rebuilt == before + 1
        restored = _snapshot(model, opt)
        assert torch.equal(restored["model"].pop("1.seen"), torch.ones(3))
        assert_same(restored, saved)
    finally:
        ckpt.close()
