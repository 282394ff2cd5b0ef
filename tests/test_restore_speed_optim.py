"""A fresh optimizer gets its state from the checkpoint's metadata, never from a step.

DCP's ``get_state_dict`` would run ``optimizer.step()`` on zero gradients to
create the state of an optimizer that has none (a third of a restore's time).
Counted with torch's own step hooks, not by replacing stalwart code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import stalwart
from stalwart.pipeline import load_checkpoint
from stalwart.safe_load import read_dcp_metadata
from stalwart.state.optim_state import materialise_optimizer_state

from .conftest import assert_same

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
}


def build(kind: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, OPTIMIZERS[kind](list(model.parameters()))


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()


def count_steps(opt: torch.optim.Optimizer) -> list[int]:
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    opt.register_step_pre_hook(hook)
    return calls


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_fresh_optimizer_is_restored_without_a_step_and_resumes_bit_exactly(
    tmp_path: Path, kind: str
) -> None:
    model, opt = build(kind, 0)
    for _ in range(2):
        step(model, opt)
    with stalwart.CheckpointManager(tmp_path, every_steps=1) as ckpt:
        ckpt.save(2, stalwart.TrainState(model=model, optimizer=opt, rng=False))
    saved = torch.optim.Optimizer.state_dict(opt)

    fresh_model, fresh_opt = build(kind, 1)
    steps = count_steps(fresh_opt)
    load_checkpoint(
        next(tmp_path.glob("step_*")),
        stalwart.TrainState(model=fresh_model, optimizer=fresh_opt, rng=False),
    )
    assert steps == [0]
    assert_same(saved, torch.optim.Optimizer.state_dict(fresh_opt))

    torch.manual_seed(7)
    step(model, opt)
    torch.manual_seed(7)
    step(fresh_model, fresh_opt)
    assert_same(dict(model.state_dict()), dict(fresh_model.state_dict()))
    assert steps == [1]


def metadata_of(tmp_path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Metadata:
    with stalwart.CheckpointManager(tmp_path, every_steps=1) as ckpt:
        ckpt.save(1, stalwart.TrainState(model=model, optimizer=opt, rng=False))
    return read_dcp_metadata(next(tmp_path.glob("step_*")))


def test_state_is_built_with_the_saved_shapes_dtypes_and_only_for_saved_parameters(
    tmp_path: Path,
) -> None:
    model, opt = build("adam", 0)
    model[2].weight.requires_grad_(False)  # never stepped: no state saved for it
    step(model, opt)
    metadata = metadata_of(tmp_path, model, opt)
    fresh_model, fresh_opt = build("adam", 1)
    assert materialise_optimizer_state(fresh_model, fresh_opt, metadata, "optimizer")
    params = dict(fresh_model.named_parameters())
    assert fresh_opt.state.keys() == {p for n, p in params.items() if n != "2.weight"}
    for name, param in params.items():
        if name == "2.weight":
            continue
        state = fresh_opt.state[param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["exp_avg"].shape == param.shape and state["exp_avg"].dtype == param.dtype
        assert state["step"].shape == () and state["step"].device.type == "cpu"


def test_a_saved_shape_that_differs_leaves_the_optimizer_empty_for_the_check_to_name(
    tmp_path: Path,
) -> None:
    model, opt = build("adam", 0)
    step(model, opt)
    metadata = metadata_of(tmp_path, model, opt)
    torch.manual_seed(0)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    wider_opt = torch.optim.Adam(wider.parameters())
    assert not materialise_optimizer_state(wider, wider_opt, metadata, "optimizer")
    assert not wider_opt.state
    state = stalwart.TrainState(model=wider, optimizer=wider_opt, rng=False)
    with pytest.raises(stalwart.StateMismatchError, match="tensor shapes differ"):
        load_checkpoint(next(tmp_path.glob("step_*")), state)
    assert not wider_opt.state


def test_a_checkpoint_saved_before_the_first_step_restores_an_empty_state(
    tmp_path: Path,
) -> None:
    model, opt = build("adam", 0)
    with stalwart.CheckpointManager(tmp_path, every_steps=1) as ckpt:
        ckpt.save(0, stalwart.TrainState(model=model, optimizer=opt, rng=False))
    fresh_model, fresh_opt = build("adam", 1)
    steps = count_steps(fresh_opt)
    load_checkpoint(
        next(tmp_path.glob("step_*")),
        stalwart.TrainState(model=fresh_model, optimizer=fresh_opt, rng=False),
    )
    assert steps == [0] and not fresh_opt.state
    assert_same(dict(model.state_dict()), dict(fresh_model.state_dict()))
