"""A fresh optimizer's state, built from a checkpoint's metadata instead of a step.

DCP's ``get_state_dict`` gives an optimizer without state its state by running
a real ``optimizer.step()`` on zero gradients with a zero learning rate
(``_init_optim_state``, DESIGN.md known traps): for Adam that is a full update's
arithmetic over every parameter, a third of a restore's time in one profile.
A restore does not need those values, only tensors of the right shape, dtype
and placement for DCP to read the saved ones into. The checkpoint's metadata
names every saved state entry (``<section>.state.<fqn>.<name>``) with its global
shape and dtype, which is enough to build them: tensors shaped like the parameter
(a sharded parameter gives a sharded state, ``zeros_like`` keeps its placement;
DCP reads every one of them, as each is a saved entry) and zero scalars such as
Adam's ``step``.

They are zeroed, not left uninitialised, because the memory is new to a process
that just started: the first write to each page costs far more than the copy
(on this project's 2-core VM, 77 ms to fill 171 MiB of new memory against 13 ms
to fill it again). The restore builds them while the checkpoint's files are
read and checked in other threads, so zeroing here takes that cost off the
read into place that follows the checks. A new interpreter's restore of a
256 MiB state with its pages dropped from the cache took 260 ms against 286 ms
uninitialised (medians of 5, the two alternating, ``benchmarks/restart.py``'s
child); with the pages cached, 158 ms against 161 ms.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import _get_fqns

__all__ = ["materialise_optimizer_state"]

_ON_PARAM_DEVICE = ("capturable", "fused")
"""Param-group flags under which torch optimizers keep scalar state (``step``) on the
parameter's device rather than on the CPU."""


def materialise_optimizer_state(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    metadata: Metadata,
    section: str,
) -> bool:
    """Give ``optimizer`` (empty, over parameters of ``module``) the state ``metadata``
    records under ``section`` (``optimizer``, ``optimizer.G``, ...), unfilled: the
    restore reads the saved values into it.

    Returns True when the state was built; False, with ``optimizer`` left empty,
    when the saved param groups name other hyperparameters (an optimizer of
    another kind) or some saved entry is not a tensor shaped like its parameter
    or a scalar (a shape that differs): then DCP's own
    initialisation runs, and the restore's shape check names any difference.
    Parameters the checkpoint has no state for get none, as before their first
    step. Call from the restoring thread, before the live state dict is built.
    """
    assert not optimizer.state, "only an optimizer without state is materialised"
    if not _same_kind(optimizer, metadata, f"{section}.param_groups."):
        return False
    entries = _saved_entries(metadata, f"{section}.state.")
    names = {id(p): name for name, p in module.named_parameters()}
    built: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        on_param_device = any(group.get(flag) for flag in _ON_PARAM_DEVICE)
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                return False
            fqns = _get_fqns(module, name)
            if len(fqns) != 1:
                return False  # a flattened FSDP1 parameter: DCP's business
            saved = entries.get(next(iter(fqns)))
            if not saved:
                continue
            state = _state_for(param, saved, on_param_device=on_param_device)
            if state is None:
                return False
            built[param] = state
    for param, state in built.items():
        optimizer.state[param] = state
    return True


def _same_kind(optimizer: torch.optim.Optimizer, metadata: Metadata, prefix: str) -> bool:
    """Whether the saved param groups have the hyperparameters ``optimizer``'s have.

    The state entries of an optimizer of another kind (SGD's ``momentum_buffer``
    for an Adam) are no state this one can step from: only its own step knows
    what it needs, and the restore's key check then names the difference.
    """
    saved = {
        key[len(prefix) :].split(".")[1]  # <group>.<name>[.<item of a tuple>]
        for key in metadata.state_dict_metadata
        if key.startswith(prefix) and key.count(".", len(prefix)) >= 1
    }
    live = {key for group in optimizer.param_groups for key in group}
    return saved == live


def _saved_entries(metadata: Metadata, prefix: str) -> dict[str, dict[str, Any]]:
    """``{fqn: {state name: storage metadata}}`` of the keys under ``prefix``."""
    out: dict[str, dict[str, Any]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            fqn, _, name = key[len(prefix) :].rpartition(".")
            out.setdefault(fqn, {})[name] = md
    return out


def _state_for(
    param: torch.Tensor, saved: dict[str, Any], *, on_param_device: bool
) -> dict[str, torch.Tensor] | None:
    state: dict[str, torch.Tensor] = {}
    for name, md in saved.items():
        if not isinstance(md, TensorStorageMetadata):
            return None  # a python value in the state: only a real step knows it
        shape, dtype = tuple(md.size), md.properties.dtype
        if shape == () and (name == "step" or tuple(param.shape) != ()):
            device = param.device if on_param_device else torch.device("cpu")
            state[name] = torch.zeros((), dtype=dtype, device=device)
        elif shape == tuple(param.shape):
            state[name] = torch.zeros_like(param, dtype=dtype, requires_grad=False)
        else:
            return None
    return state
