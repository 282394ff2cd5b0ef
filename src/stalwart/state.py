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

Non-tensor values must be plain data (None, bool, int, float, str, bytes, and
lists, tuples and string-keyed dicts of them). That is what makes loading safe:
stalwart reads them back with ``torch.load(weights_only=True)``, which cannot
construct arbitrary objects, so a checkpoint can never run code. Anything else
is refused at save time with the key that holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any, Protocol, runtime_checkable

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

__all__ = ["Stateful", "TrainState", "flat_keys"]

logger = logging.getLogger("stalwart")

_BUILTIN_SECTIONS = ("model", "optimizer", "scheduler", "scaler", "data", "rng", "extra")
_META = "_stalwart"
# Sections whose structure is the component's own business and may legitimately
# differ between save and restore (worker counts, device counts): they are
# loaded in the shape the checkpoint has and handed to the component as is.
_OPAQUE_SECTIONS = ("data", "rng", _META)
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.Size)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


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
        """The whole state, referencing live tensors (copy before mutating them)."""
        sd: dict[str, Any] = {}
        meta: dict[str, Any] = {"sections": []}
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
        for name, obj in self.components.items():
            sd[name] = obj.state_dict()
        if self.rng:
            sd["rng"] = {f"rank_{distributed.get_rank()}": capture_rng_state()}
        if self.extra is not None:
            sd["extra"] = dict(self.extra)
        meta["sections"] = sorted(sd)
        sd[_META] = meta
        _check_plain(sd)
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

    def load_target(self, metadata: Metadata, *, strict: bool = True) -> dict[str, Any]:
        """The state dict to fill from a checkpoint with ``metadata``.

        Model and optimizer tensors are the live ones (so sharded models load in
        place); other sections take the checkpoint's own structure. With
        ``strict``, the keys of each section must match the checkpoint's exactly.
        """
        saved = set(metadata.state_dict_metadata)
        saved_sections = {k.split(".", 1)[0] for k in saved}
        target: dict[str, Any] = {}
        live: dict[str, Any] = {}
        if self.model is not None:
            if self.optimizers:
                live["model"], live["optimizer"] = get_state_dict(self.model, self._optim_arg())
            else:
                live["model"] = get_model_state_dict(self.model)
        for name, obj in self.components.items():
            if name not in _OPAQUE_SECTIONS:
                live[name] = obj.state_dict()
        if self.extra is not None:
            live["extra"] = dict(self.extra)

        problems: list[str] = []
        wanted = set(live) | set(self.components) | ({"rng"} if self.rng else set())
        for name in sorted(wanted - saved_sections):
            if name == "rng" or not strict:
                continue
            if name in live and not flat_keys(live[name]):
                continue  # an empty section (a disabled GradScaler) saves no keys
            problems.append(f"the state has {name!r} but the checkpoint does not")
        for name in sorted(saved_sections - wanted - {_META}):
            if strict:
                problems.append(f"the checkpoint has {name!r} but the state does not")

        for name, tree in live.items():
            have = flat_keys(tree, name)
            want = {k for k in saved if k.split(".", 1)[0] == name}
            if strict and have != want:
                missing, unexpected = sorted(want - have), sorted(have - want)
                if missing:
                    problems.append(
                        f"keys in the checkpoint but not in the state: {_preview(missing)}"
                    )
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

        for name in ("model", "optimizer"):
            if name in live and (strict or name in saved_sections):
                target[name] = live[name] if strict else _only_saved(live[name], name, saved)
        for key in sorted(saved):
            section = key.split(".", 1)[0]
            if section in ("model", "optimizer") or section not in (wanted | {_META}):
                continue
            path = (metadata.planner_data or {}).get(key)
            if path is None:
                path = tuple(key.split("."))
            md = metadata.state_dict_metadata[key]
            if isinstance(md, TensorStorageMetadata):
                placeholder: Any = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            else:
                assert isinstance(md, BytesStorageMetadata)
                placeholder = None
            set_element(target, path, placeholder)
        return target

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Put a full state dict (as produced by ``state_dict``) back into the live objects."""
        meta = state_dict.get(_META) or {}
        if self.model is not None:
            options = StateDictOptions(strict=strict)
            if self.optimizers and "optimizer" in state_dict:
                set_state_dict(
                    self.model,
                    self._optim_arg(),
                    model_state_dict=state_dict["model"],
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
                obj.load_state_dict(state_dict[name])
        if self.extra is not None and "extra" in state_dict:
            if strict:
                self.extra.clear()
            self.extra.update(state_dict["extra"])
        if self.rng and "rng" in state_dict:
            key = f"rank_{distributed.get_rank()}"
            ranks = state_dict["rng"]
            if key in ranks:
                restore_rng_state(ranks[key])
            else:
                logger.warning(
                    "the checkpoint has no RNG state for %s (saved ranks: %s); RNG streams "
                    "continue from their current state, so the run is not bit-exact",
                    key,
                    ", ".join(sorted(ranks)),
                )

    def _optim_arg(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        return self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers


def _preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def _only_saved(tree: dict[str, Any], prefix: str, saved: set[str]) -> dict[str, Any]:
    """A copy of ``tree`` without the leaves the checkpoint lacks (for strict=False)."""
    out: dict[str, Any] = {}

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        if ".".join([prefix, *map(str, path)]) in saved:
            set_element(out, path, value)

    traverse_state_dict(tree, visit)
    return out


def _check_plain(sd: Mapping[str, Any]) -> None:
    def walk(value: Any, where: str) -> None:
        if isinstance(value, (torch.Tensor, *_PLAIN_LEAVES)):
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"state{where} has a key of type {type(k).__name__} ({k!r}); checkpoint "
                        "keys must be strings (torch.distributed.checkpoint turns them into "
                        "strings, so the value would come back under another key)"
                    )
                walk(v, f"{where}[{k!r}]")
            return
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")
            return
        raise TypeError(
            f"state{where} is a {type(value).__module__}.{type(value).__qualname__}; stalwart stores "
            "only tensors and plain data (None, bool, int, float, str, bytes, lists, tuples, dicts) "
            "because loading any other object needs an unpickler that can run code. Store the "
            "object's state_dict() or plain values instead."
        )

    walk(sd, "")
