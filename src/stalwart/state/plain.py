"""Plain data: what a blob section may hold, and how it is stored.

Non-tensor values must be plain data (None, bool, int, float, str, bytes, and
lists, tuples and dicts of them). That is what makes loading safe: stalwart
reads them back with ``torch.load(weights_only=True)``, which cannot construct
arbitrary objects, so a checkpoint can never run code. Anything else is refused
at save time with the key that holds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "ATOMIC",
    "LEAVES",
    "META",
    "PLAIN_LEAVES",
    "blob",
    "check_plain",
    "is_plain_data",
    "preview",
    "unblob",
]

META = "_stalwart"
"""Section of TrainState's own bookkeeping (sections saved, which optimizers were fresh)."""
PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.Size)
"""Non-tensor leaf types a state may hold."""
ATOMIC = frozenset({int, float, bool, str, bytes, type(None)})
"""Leaf types whose containers need no per-element visit (exact types: no subclasses)."""
_CONTAINERS = frozenset({list, tuple, dict})


def is_plain_data(obj: Any) -> bool:
    """Whether ``obj`` holds nothing but ``ATOMIC`` values in lists, tuples and dicts,
    exactly those types (a subclass's pickle may not say what it holds); iterative:
    any depth, and containers that contain themselves.

    A restore reads a value with the plain unpickler only if this holds of what it
    read (``safe_load``); a save reuses a value's ``torch.save`` bytes only if it
    holds (``save_plan``).
    """
    seen: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        kind = type(item)
        if kind in ATOMIC:
            continue
        if kind not in _CONTAINERS:
            return False
        if id(item) in seen:
            continue
        seen.add(id(item))
        if kind is dict:
            todo.extend(item.keys())
            todo.extend(item.values())
        else:
            todo.extend(item)
    return True


def blob(value: Any, where: str) -> tuple[Any]:
    """One section as a single DCP entry: DCP's traversal keeps a tuple whole."""
    check_plain(value, where)
    return (_to_cpu(value),)


def unblob(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 1:
        return value[0]
    return value


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    kind = type(value)  # exact: a namedtuple or list subclass is stored as the plain type
    if kind in (list, tuple) and all(type(v) in ATOMIC for v in value):
        return list(value) if kind is list else value
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value


def preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


LEAVES = (torch.Tensor, *PLAIN_LEAVES)


def _where(prefix: str, path: tuple[Any, ...]) -> str:
    return prefix + "".join(f"[{p!r}]" for p in path)


def check_plain(sd: Any, prefix: str) -> None:
    _check_plain(sd, (), prefix)


def _check_plain(value: Any, path: tuple[Any, ...], prefix: str) -> None:
    # The path is built only for an error message: formatting it for every
    # element would cost more than the walk itself on a large optimizer state.
    # (A function of its own, not a nested one: a recursive closure is a
    # reference cycle, left for the collector by every save.)
    if isinstance(value, LEAVES):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(
                    f"state{_where(prefix, path)} has a key of type {type(k).__name__} "
                    f"({k!r}); checkpoint keys must be strings or integers"
                )
            if not isinstance(v, LEAVES):
                _check_plain(v, (*path, k), prefix)
        return
    if isinstance(value, (list, tuple)):
        if all(type(v) in ATOMIC for v in value):
            return  # e.g. the 625 ints of random.getstate(): no per-element walk
        for i, v in enumerate(value):
            _check_plain(v, (*path, i), prefix)
        return
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        # Its state_dict() in extra would save, but never load back into the object.
        raise TypeError(
            f"state{_where(prefix, path)} is a {type(value).__name__}; pass modules and "
            "optimizers to TrainState by keyword (TrainState(..., ema=ema_model)) so they "
            "are saved through DCP and loaded back into the object (docs/multi-model.md)"
        )
    raise TypeError(
        f"state{_where(prefix, path)} is a {type(value).__module__}."
        f"{type(value).__qualname__}; stalwart stores only tensors and plain data (None, "
        "bool, int, float, str, bytes, lists, tuples, dicts) because loading any other "
        "object needs an unpickler that can run code. Store the object's state_dict() or "
        "plain values instead."
    )
