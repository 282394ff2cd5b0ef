"""TrainState: everything a training run must get back, as one state dict.

The state dict has one section per component::

    {"model": ..., "optimizer": ...,        # via torch.distributed.checkpoint.state_dict,
                                            # so DDP and FSDP2 models work unchanged
     "scheduler": ..., "scaler": ...,       # their own state_dict()
     "data": ...,                           # data position (sampler / loader state)
     "rng": {"rank_0": {...}},              # RNG streams of each rank
     "extra": {...},                        # user values (plain data and tensors)
     "<name>": ...,                         # any other Stateful passed by keyword
     "_stalwart": {...}}                    # bookkeeping of TrainState itself

Model and optimizer are handed to DCP as they are: their tensors are written
as tensors, each rank writes its own shards, and a restore at another world
size reshards them. Every other section is a *blob*: its state dict, moved to
CPU and wrapped in a 1-tuple, which DCP's traversal keeps whole and stores as
one entry. A blob comes back exactly as it was saved (empty dicts and lists,
integer keys and nesting included), which DCP's per-key flattening would not
guarantee (it drops empty containers).

Non-tensor values must be plain data (None, bool, int, float, str, bytes, and
lists, tuples and dicts of them). That is what makes loading safe: stalwart
reads them back with ``torch.load(weights_only=True)``, which cannot construct
arbitrary objects, so a checkpoint can never run code. Anything else is refused
at save time with the key that holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from stalwart import distributed
from stalwart.errors import StateMismatchError
from stalwart.rng import capture_rng_state, restore_rng_state

__all__ = ["TrainState", "flat_keys"]

logger = logging.getLogger("stalwart")

_BUILTIN_SECTIONS = ("model", "optimizer", "scheduler", "scaler", "data", "rng", "extra")
_META = "_stalwart"
# Written as DCP tensors (sharded, resharded on load); every other section is a blob.
_NATIVE = ("model", "optimizer")
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.Size)


def flat_keys(tree: Mapping[str, Any], prefix: str = "") -> set[str]:
    """Keys of ``tree`` flattened the way DCP names them (``a.b.0.c``)."""
    keys: set[str] = set()

    def visit(path: tuple[str | int, ...], _value: Any) -> None:
        keys.add(".".join(str(p) for p in path))

    traverse_state_dict(dict(tree), visit)
    return {f"{prefix}.{k}" if prefix else k for k in keys}


class TrainState:
    """One object over everything that must come back after a crash.

    Implements torch's ``Stateful`` protocol (``state_dict``/``load_state_dict``).
    Call from the training thread; every rank holds its own TrainState over its
    own (possibly sharded) model.

    ``rng=True`` captures python ``random``, numpy's global RNG, torch CPU and
    every CUDA device, separately for each rank. ``extra`` is a dict of user
    values restored in place (the same dict object is updated). Further keyword
    arguments name other objects with ``state_dict``/``load_state_dict``.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        data: Any = None,
        rng: bool = True,
        extra: MutableMapping[str, Any] | None = None,
        **stateful: Any,
    ) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and model is None:
            raise ValueError(
                "optimizer was given without model; the optimizer state is keyed by the "
                "model's parameter names, so pass model= too"
            )
        self.model = model
        self.optimizers: list[torch.optim.Optimizer] = (
            []
            if optimizer is None
            else [optimizer]
            if isinstance(optimizer, torch.optim.Optimizer)
            else list(optimizer)
        )
        for i, opt in enumerate(self.optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer[{i}] must be a torch.optim.Optimizer, got {type(opt).__name__}"
                )
        if not isinstance(rng, bool):
            raise TypeError(f"rng must be True or False, got {rng!r}")
        self.rng = rng
        if extra is not None and not isinstance(extra, MutableMapping):
            raise TypeError(f"extra must be a dict (restored in place), got {type(extra).__name__}")
        self.extra = extra
        self.components: dict[str, Any] = {}
        for name, obj in (
            ("scheduler", scheduler),
            ("scaler", scaler),
            ("data", data),
            *stateful.items(),
        ):
            if obj is None:
                continue
            if name in _BUILTIN_SECTIONS[:2] or name in ("rng", "extra", _META):
                raise ValueError(
                    f"{name!r} is a reserved section name of TrainState; pick another keyword"
                )
            if not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            ):
                raise TypeError(
                    f"{name}= must have state_dict() and load_state_dict() methods; "
                    f"got {type(obj).__name__}"
                )
            self.components[name] = obj

    # ------------------------------------------------------------------ saving

    def state_dict(self) -> dict[str, Any]:
        """The whole state: live model/optimizer tensors, CPU copies of everything else.

        Model and optimizer go to DCP as they are (sharded tensors stay sharded);
        every other section is one blob (see the module docstring).
        """
        sd: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        if self.model is not None:
            if self.optimizers:
                fresh = [not opt.state for opt in self.optimizers]
                model_sd, optim_sd = get_state_dict(self.model, self._optim_arg())
                # get_state_dict initialises an empty optimizer state with a zero-lr
                # step. Undo that on the live optimizer: a run that never saved here
                # would start its first real step from an empty state, and so must we.
                for opt, was_fresh in zip(self.optimizers, fresh, strict=True):
                    if was_fresh:
                        opt.state.clear()
                meta["optimizer_fresh"] = all(fresh)
                sd["optimizer"] = optim_sd
            else:
                model_sd = get_model_state_dict(self.model)
            sd["model"] = model_sd
            _check_plain(sd, "")
        for name, obj in self.components.items():
            sd[name] = _blob(obj.state_dict(), f"[{name!r}]")
        if self.rng:
            sd["rng"] = {f"rank_{distributed.get_rank()}": _blob(capture_rng_state(), "['rng']")}
        if self.extra is not None:
            sd["extra"] = _blob(dict(self.extra), "['extra']")
        meta["sections"] = sorted(sd)
        sd[_META] = _blob(meta, f"[{_META!r}]")
        return sd

    @property
    def epoch(self) -> int | None:
        """The data epoch, when the data source or ``extra`` knows it (for the manifest)."""
        data = self.components.get("data")
        value = getattr(data, "epoch", None)
        if value is None and self.extra is not None:
            value = self.extra.get("epoch")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    # --------------------------------------------------------------- restoring
    #
    # A restore loads in two phases so that nothing live is touched before the
    # checkpoint is known to fit: first the small blob sections into fresh
    # placeholders (``blob_target``), then ``check``, then model and optimizer
    # into the live tensors (``native_target``), then ``apply``.

    def blob_target(self, metadata: Metadata) -> dict[str, Any]:
        """Placeholders for every non-model, non-optimizer entry of the checkpoint."""
        target: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if key.split(".", 1)[0] in _NATIVE:
                continue
            path = (metadata.planner_data or {}).get(key) or tuple(key.split("."))
            if isinstance(md, TensorStorageMetadata):
                placeholder: Any = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            else:
                assert isinstance(md, BytesStorageMetadata)
                placeholder = None
            set_element(target, path, placeholder)
        return target

    def check(self, metadata: Metadata, blobs: Mapping[str, Any], *, strict: bool = True) -> None:
        """Raise ``StateMismatchError`` when the state and the checkpoint differ in keys (strict)."""
        if not strict:
            return
        saved = set(metadata.state_dict_metadata)
        saved_sections = {k.split(".", 1)[0] for k in saved} - {_META}
        live_native = self._live_native()
        wanted = (
            set(live_native)
            | set(self.components)
            | ({"rng"} if self.rng else set())
            | ({"extra"} if self.extra is not None else set())
        )
        problems: list[str] = []
        for name in sorted(wanted - saved_sections):
            if name == "rng" or (name in live_native and not flat_keys(live_native[name])):
                continue  # RNG may be absent (rng=False at save); an empty section saves no keys
            problems.append(f"the state has {name!r} but the checkpoint does not")
        for name in sorted(saved_sections - wanted):
            problems.append(f"the checkpoint has {name!r} but the state does not")
        found: dict[str, tuple[set[str], set[str]]] = {}
        for name, tree in live_native.items():
            found[name] = (flat_keys(tree, name), {k for k in saved if k.split(".", 1)[0] == name})
        for name in (*self.components, "extra"):
            # The data source's state legitimately changes shape with worker counts.
            if name == "data" or name not in blobs:
                continue
            live = self.extra if name == "extra" else self.components[name].state_dict()
            if live is None:
                continue
            loaded = _unblob(blobs[name])
            if isinstance(live, Mapping) and isinstance(loaded, Mapping):
                found[name] = ({f"{name}.{k}" for k in live}, {f"{name}.{k}" for k in loaded})
        for have, want in found.values():
            missing, unexpected = sorted(want - have), sorted(have - want)
            if missing:
                problems.append(f"keys in the checkpoint but not in the state: {_preview(missing)}")
            if unexpected:
                problems.append(
                    f"keys in the state but not in the checkpoint: {_preview(unexpected)}"
                )
        if problems:
            raise StateMismatchError(
                "the checkpoint does not match the state to restore: "
                + "; ".join(problems)
                + ". Restore into a state built like the one that was saved, or pass strict=False "
                "to load only the keys both have."
            )

    def native_target(self, metadata: Metadata, *, strict: bool = True) -> dict[str, Any]:
        """The live model and optimizer state dicts to load in place (only saved keys unless strict)."""
        saved = set(metadata.state_dict_metadata)
        saved_sections = {k.split(".", 1)[0] for k in saved}
        live = self._live_native()
        return {
            name: tree if strict else _only_saved(tree, name, saved)
            for name, tree in live.items()
            if name in saved_sections
        }

    def _live_native(self) -> dict[str, Any]:
        if self.model is None:
            return {}
        if self.optimizers:
            model_sd, optim_sd = get_state_dict(self.model, self._optim_arg())
            return {"model": model_sd, "optimizer": optim_sd}
        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Put a state dict (as produced by ``state_dict``) back into the live objects."""
        meta = _unblob(state_dict.get(_META)) or {}
        if self.model is not None:
            options = StateDictOptions(strict=strict)
            if self.optimizers and "optimizer" in state_dict:
                set_state_dict(
                    self.model,
                    self._optim_arg(),
                    model_state_dict=state_dict.get("model", {}),
                    optim_state_dict=state_dict["optimizer"],
                    options=options,
                )
                if meta.get("optimizer_fresh"):
                    for opt in self.optimizers:
                        opt.state.clear()
            elif "model" in state_dict:
                set_model_state_dict(self.model, state_dict["model"], options=options)
        for name, obj in self.components.items():
            if name in state_dict:
                obj.load_state_dict(_unblob(state_dict[name]))
        if self.extra is not None and "extra" in state_dict:
            if strict:
                self.extra.clear()
            self.extra.update(_unblob(state_dict["extra"]))
        if self.rng and "rng" in state_dict:
            key = f"rank_{distributed.get_rank()}"
            ranks = state_dict["rng"]
            if key in ranks:
                restore_rng_state(_unblob(ranks[key]))
            else:
                logger.warning(
                    "the checkpoint has no RNG state for %s (saved ranks: %s); RNG streams "
                    "continue from their current state, so the run is not bit-exact",
                    key,
                    ", ".join(sorted(ranks)),
                )

    def _optim_arg(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        return self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers


_ATOMIC = frozenset({int, float, bool, str, bytes, type(None)})
"""Leaf types whose containers need no per-element visit (exact types: no subclasses)."""


def _blob(value: Any, where: str) -> tuple[Any]:
    """One section as a single DCP entry: DCP's traversal keeps a tuple whole."""
    _check_plain(value, where)
    return (_to_cpu(value),)


def _unblob(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 1:
        return value[0]
    return value


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and all(type(v) in _ATOMIC for v in value):
        return list(value) if isinstance(value, list) else value
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value


def _preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def _only_saved(tree: dict[str, Any], prefix: str, saved: set[str]) -> dict[str, Any]:
    """A copy of ``tree`` without the leaves the checkpoint lacks (for strict=False).

    Top-level containers stay even when emptied: set_state_dict tells a nested
    optimizer state dict from a flattened one by its "state" key.
    """
    out: dict[str, Any] = {k: type(v)() for k, v in tree.items() if isinstance(v, (dict, list))}

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        if ".".join([prefix, *map(str, path)]) in saved:
            set_element(out, path, value)

    traverse_state_dict(tree, visit)
    return out


def _check_plain(sd: Any, prefix: str) -> None:
    def walk(value: Any, where: str) -> None:
        if isinstance(value, (torch.Tensor, *_PLAIN_LEAVES)):
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(
                        f"state{where} has a key of type {type(k).__name__} ({k!r}); checkpoint "
                        "keys must be strings or integers"
                    )
                walk(v, f"{where}[{k!r}]")
            return
        if isinstance(value, (list, tuple)):
            if all(type(v) in _ATOMIC for v in value):
                return  # e.g. the 625 ints of random.getstate(): no per-element walk
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")
            return
        raise TypeError(
            f"state{where} is a {type(value).__module__}.{type(value).__qualname__}; stalwart stores "
            "only tensors and plain data (None, bool, int, float, str, bytes, lists, tuples, dicts) "
            "because loading any other object needs an unpickler that can run code. Store the "
            "object's state_dict() or plain values instead."
        )

    walk(sd, prefix)
