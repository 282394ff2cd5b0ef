"""Modules and optimizers of a TrainState, matched into units saved through DCP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from stalwart.state.native import NativeStateDict

__all__ = ["Unit", "bind_units", "get_at", "named_modules", "named_optimizers", "put_at"]


class Unit:
    """One module and the optimizers over its parameters, saved through DCP's state_dict API.

    ``model_path`` is where the module's state goes in the state dict (None: an
    optimizer-only unit over a module saved by another unit), ``optim_path``
    where the optimizers' state goes (None without optimizers). Keys inside are
    DCP's FQNs, so sharded tensors stay sharded and reshard on load.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        model_path: tuple[str, ...] | None,
        optim_path: tuple[str, ...] | None = None,
    ) -> None:
        self.module = module
        self.model_path = model_path
        self.optim_path = optim_path
        self.optimizers: list[torch.optim.Optimizer] = []
        self.param_ids = {id(p) for p in module.parameters()}
        self.native = NativeStateDict()

    @property
    def sections(self) -> set[str]:
        return {path[0] for path in (self.model_path, self.optim_path) if path}

    def _optim_arg(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        return self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers

    def collect(self, sd: dict[str, Any]) -> bool:
        """Put the live state into ``sd``; True when every optimizer had no state yet."""
        if not self.optimizers:
            assert self.model_path is not None
            put_at(sd, self.model_path, get_model_state_dict(self.module))
            return False
        fresh = [not opt.state for opt in self.optimizers]
        model_sd, optim_sd = self.native(self.module, self.optimizers, any(fresh))
        # get_state_dict initialises an empty optimizer state with a zero-lr
        # step. Undo that on the live optimizer: a run that never saved here
        # would start its first real step from an empty state, and so must we.
        for opt, was_fresh in zip(self.optimizers, fresh, strict=True):
            if was_fresh:
                opt.state.clear()
        # Optimizer first, as stalwart always wrote it: DCP gives each replicated
        # entry to the rank with the least planned bytes so far, in this order,
        # and this order spreads a DDP state evenly over the ranks.
        assert self.optim_path is not None
        put_at(sd, self.optim_path, optim_sd)
        if self.model_path is not None:
            put_at(sd, self.model_path, model_sd)
        return all(fresh)

    def rank_local_paths(self, sd: dict[str, Any]) -> list[tuple[str, tuple[str | int, ...]]]:
        """Paths in ``sd`` of the tensors that can differ between ranks.

        Sharded (DTensor) entries are each rank's own by construction, and DDP
        keeps its parameters (so its optimizer states) equal with its gradient
        all-reduce; every other tensor (buffers such as BatchNorm's running
        statistics, and all of a plain module's state) is a candidate.
        """
        ddp = isinstance(self.module, torch.nn.parallel.DistributedDataParallel)
        wrapped = ddp or _has_dtensor(self.module)
        params = {p.data_ptr() for p in self.module.parameters()} if ddp else set()
        found: list[tuple[str, tuple[str | int, ...]]] = []

        def visit(base: tuple[str, ...], path: tuple[str | int, ...], value: Any) -> None:
            if not isinstance(value, torch.Tensor) or _is_dtensor(value):
                return
            if ddp and value.data_ptr() in params:
                return
            full = (*base, *path)
            found.append(("tensor:" + ".".join(map(str, full)), full))

        if self.model_path is not None:
            base = self.model_path
            traverse_state_dict(get_at(sd, base), lambda p, v: visit(base, p, v))
        if self.optimizers and not wrapped:
            assert self.optim_path is not None
            obase = self.optim_path
            traverse_state_dict(get_at(sd, obase), lambda p, v: visit(obase, p, v))
        return found

    def live(self, tree: dict[str, Any]) -> None:
        """Put the live state dicts (DCP loads into them in place) into ``tree``."""
        if self.optimizers:
            # The saves' fast path, checked against DCP's get_state_dict the first
            # time it serves a structure (its tensors are the live ones).
            fresh = any(not opt.state for opt in self.optimizers)
            model_sd, optim_sd = self.native(self.module, self.optimizers, fresh)
            if self.model_path is not None:
                put_at(tree, self.model_path, model_sd)
            assert self.optim_path is not None
            put_at(tree, self.optim_path, optim_sd)
        elif self.model_path is not None:
            put_at(tree, self.model_path, get_model_state_dict(self.module))

    def load(self, state_dict: Mapping[str, Any], *, strict: bool, fresh: bool) -> None:
        options = StateDictOptions(strict=strict)
        model_sd = get_at(state_dict, self.model_path) if self.model_path else None
        optim_sd = get_at(state_dict, self.optim_path) if self.optim_path else None
        if self.optimizers and optim_sd is not None:
            if self.model_path is None:
                set_optimizer_state_dict(self.module, self._optim_arg(), optim_sd, options=options)
            else:
                set_state_dict(
                    self.module,
                    self._optim_arg(),
                    model_state_dict=model_sd or {},
                    optim_state_dict=optim_sd,
                    options=options,
                )
            if fresh:
                for opt in self.optimizers:
                    opt.state.clear()
        elif model_sd is not None:
            set_model_state_dict(self.module, model_sd, options=options)


_SUPPORTED_FORMS = (
    "supported forms: TrainState(model=net, optimizer=opt) (one module, one or more optimizers "
    "over its parameters); TrainState(model={'G': netG, 'D': netD}, optimizer={'G': optG, "
    "'D': optD}) (or optimizer=[optG, optD], matched by parameters); or modules and optimizers "
    "by keyword: TrainState(model=netG, optimizer=optG, netD=netD, optD=optD, ema=ema)"
)


def named_modules(model: Any) -> list[tuple[tuple[str, ...], torch.nn.Module]]:
    if model is None:
        return []
    if isinstance(model, torch.nn.Module):
        # An nn.ModuleDict stays one module: its keys are FQNs (model.G.weight) as before.
        return [(("model",), model)]
    if isinstance(model, Mapping) and model:
        out: list[tuple[tuple[str, ...], torch.nn.Module]] = []
        for name, module in model.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"model keys must be non-empty names without dots, got {name!r}")
            if not isinstance(module, torch.nn.Module):
                raise TypeError(
                    f"model[{name!r}] must be a torch.nn.Module, got {type(module).__name__}"
                )
            out.append((("model", name), module))
        return out
    raise TypeError(
        "model must be a torch.nn.Module or a non-empty dict of them by name, got "
        f"{type(model).__name__}; {_SUPPORTED_FORMS}"
    )


def named_optimizers(
    optimizer: Any,
) -> list[tuple[tuple[str, ...] | None, torch.optim.Optimizer, str]]:
    """(explicit path or None, optimizer, how the user gave it) for each optimizer."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [(None, optimizer, "optimizer")]
    if isinstance(optimizer, Mapping):
        items: list[tuple[tuple[str, ...] | None, Any, str]] = []
        for name, opt in optimizer.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(
                    f"optimizer keys must be non-empty names without dots, got {name!r}"
                )
            items.append((("optimizer", name), opt, f"optimizer[{name!r}]"))
    else:
        items = [(None, opt, f"optimizer[{i}]") for i, opt in enumerate(optimizer)]
    for _, opt, label in items:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"{label} must be a torch.optim.Optimizer, got {type(opt).__name__}")
    return items


def bind_units(
    modules: list[tuple[tuple[str, ...], torch.nn.Module]],
    optimizers: list[tuple[tuple[str, ...] | None, torch.optim.Optimizer, str]],
) -> list[Unit]:
    """Bind each optimizer to the module holding all its parameters (refused when none does)."""
    units = [Unit(module, path) for path, module in modules]
    owners = list(units)
    for path, opt, label in optimizers:
        ids = {id(p) for group in opt.param_groups for p in group["params"]}
        owner = next((u for u in owners if ids <= u.param_ids), None)
        if owner is None:
            raise ValueError(
                f"{label} updates parameters that belong to no single module of this TrainState; "
                "pass the module it trains too (an optimizer over several modules needs them in "
                f"one nn.ModuleDict); {_SUPPORTED_FORMS}"
            )
        assert owner.model_path is not None
        natural = owner.model_path if owner.model_path[0] == "model" else None
        natural = natural and ("optimizer", *natural[1:])
        if path is None:
            if natural is None:
                raise ValueError(
                    f"{label} trains the module passed as {owner.model_path[0]}=; pass this "
                    f"optimizer by keyword too (e.g. {owner.model_path[0]}_opt=...); "
                    + _SUPPORTED_FORMS
                )
            path = natural
        if path == natural:
            owner.optim_path = path
            owner.optimizers.append(opt)
            continue
        same = next((u for u in units if u.optim_path == path), None)
        if same is None:
            same = Unit(owner.module, None, path)
            units.append(same)
        elif same.module is not owner.module:
            raise ValueError(f"{label} and another optimizer named alike train different modules")
        same.optimizers.append(opt)
    return units


def put_at(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_at(tree: Mapping[str, Any], path: tuple[str | int, ...]) -> Any:
    node: Any = tree
    for key in path:
        found = (isinstance(node, Mapping) and key in node) or (
            isinstance(node, list) and isinstance(key, int) and key < len(node)
        )
        if found:
            node = node[key]
        else:
            return None
    return node


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor"


def _has_dtensor(module: torch.nn.Module) -> bool:
    return any(_is_dtensor(p) for p in module.parameters())
