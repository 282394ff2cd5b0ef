"""The fast path of ``get_state_dict`` for a model of plain tensors, taken by saves
and restores."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

__all__ = ["NativeStateDict"]

_WRAPPERS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module"})
"""Path segments of DDP, torch.compile and activation-checkpoint wrappers, absent from FQNs."""


class NativeStateDict:
    """``get_state_dict(model, optimizers)`` without recomputing every FQN on each save.

    DCP's ``get_state_dict`` maps every parameter to its FQN, and every optimizer
    entry to its parameter, on each call: about 1.7 ms for a 50-block MLP on one
    core, a third of the time of the staging copy of its 64 MiB state. For a
    model of plain tensors (no FSDP, no DTensor) that mapping changes only when
    the model's keys, its parameter objects or the optimizers' param groups do.
    The first save with a given structure runs DCP and rebuilds the same result
    from the plain ``state_dict()`` calls; only when the two are identical (same
    keys in the same order, tensors over the same memory, the same optimizer
    state objects, equal param groups) do later saves with that structure take
    the rebuild. Anything else (a sharded model, a hook that changes the keys,
    an optimizer that has not stepped yet) always goes through DCP.

    A restore's live state dicts (the targets DCP reads into in place) come from
    here too, so a restore into objects a save or restore has seen skips DCP's
    mapping, and a restart's first restore learns the structure for the saves.
    """

    def __init__(self) -> None:
        self._structure: tuple[Any, ...] | None = None  # the structure the rebuild serves
        self._rejected: tuple[Any, ...] | None = None  # one whose rebuild differed: not retried
        self._model_keys: list[tuple[str, str]] = []  # (DCP key, plain key), in DCP's order
        self._fqns: list[list[str]] = []  # per optimizer: the FQN of each parameter index
        self.rebuilt = 0  # saves served by the rebuild (the tests check it is used)
        self.learned = 0  # checks of a rebuild against DCP

    def __call__(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], fresh: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        if fresh or _is_sharded(model):
            return get_state_dict(model, optimizers)
        plain = model.state_dict(keep_vars=True)
        structure = _structure_of(plain, optimizers)
        if structure is not None and structure == self._structure:
            self.rebuilt += 1
            return self._rebuild(plain, optimizers)
        model_sd, optim_sd = get_state_dict(model, optimizers)
        self._structure = None
        if structure is not None and structure != self._rejected:
            self._learn(structure, plain, optimizers, model_sd, optim_sd)
        return model_sd, optim_sd

    def _learn(
        self,
        structure: tuple[Any, ...],
        plain: dict[str, Any],
        optimizers: list[torch.optim.Optimizer],
        model_sd: dict[str, Any],
        optim_sd: dict[str, Any],
    ) -> None:
        self.learned += 1
        order = {key: key for key in plain}
        for key in list(order):
            fqn = ".".join(part for part in key.split(".") if part not in _WRAPPERS)
            if fqn != key:  # DCP renames by pop-and-insert, which moves the key last
                order[fqn] = order.pop(key)
        self._model_keys = list(order.items())
        groups = iter(optim_sd.get("param_groups", []))
        self._fqns = []
        try:
            for opt in optimizers:
                self._fqns.append([fqn for _ in opt.param_groups for fqn in next(groups)["params"]])
            rebuilt = self._rebuild(plain, optimizers)
        except (StopIteration, KeyError, IndexError, TypeError):
            self._rejected = structure
            return
        if _identical(rebuilt, (model_sd, optim_sd)):
            self._structure = structure
        else:
            self._rejected = structure

    def _rebuild(
        self, plain: dict[str, Any], optimizers: list[torch.optim.Optimizer]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        # model.state_dict() returns an OrderedDict, and so does DCP. (detach, not
        # torch.no_grad(): see staging.StagingArea.stage.)
        model_sd = type(plain)((key, plain[source].detach()) for key, source in self._model_keys)
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        for opt, fqns in zip(optimizers, self._fqns, strict=True):
            osd = opt.state_dict()
            for index, value in osd["state"].items():
                state[fqns[index]] = value
            for group in osd["param_groups"]:
                group["params"] = [fqns[index] for index in group["params"]]
                groups.append(group)
        return model_sd, {"state": state, "param_groups": groups}


def _is_sharded(model: torch.nn.Module) -> bool:
    # FSDP1 gathers in state_dict(); FSDP2 and tensor parallelism hold DTensors.
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())


def _structure_of(
    plain: dict[str, Any], optimizers: list[torch.optim.Optimizer]
) -> tuple[Any, ...] | None:
    params = []
    for value in plain.values():
        kind = type(value)
        if kind is torch.nn.Parameter:
            params.append(id(value))
        elif kind is not torch.Tensor:
            return None  # a DTensor, a tensor subclass or extra state: DCP's business
    groups = tuple(
        tuple(tuple(map(id, group["params"])) for group in opt.param_groups) for opt in optimizers
    )
    return tuple(plain), tuple(params), groups


def _identical(a: Any, b: Any) -> bool:
    """Same structure, tensors over the same memory, equal plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            type(a) is type(b) is torch.Tensor
            and a.data_ptr() == b.data_ptr()
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.device == b.device
            and a.requires_grad == b.requires_grad
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) or (a != a and b != b)  # NaN equals NaN here
