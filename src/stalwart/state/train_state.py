"""TrainState: everything a training run must get back, as one state dict.

The state dict has one section per component::

    {"model": ..., "optimizer": ...,        # via torch.distributed.checkpoint.state_dict,
                                            # so DDP and FSDP2 models work unchanged
                                            # (model={"G": .., "D": ..}: model.G, optimizer.G, ...)
     "<module or optimizer keyword>": ...,  # the same way (ema=..., optD=...)
     "scheduler": ..., "scaler": ...,       # their own state_dict()
     "data": ...,                           # data position (sampler / loader state)
     "rng": {"rank_0": {...}},              # RNG streams of each rank
     "extra": {...},                        # user values (plain data and tensors)
     "<name>": ...,                         # any other Stateful passed by keyword
     "per_rank": {"rank_0": ...},           # each rank's own copy of values that differ
     "_stalwart": {...}}                    # bookkeeping of TrainState itself

Modules and optimizers are handed to DCP as they are: their tensors are written
as tensors, each rank writes its own shards, and a restore at another world
size reshards them. Each optimizer is bound to the module holding all its
parameters. Every other section is a *blob*: its state dict, moved to CPU and
wrapped in a 1-tuple, which DCP's traversal keeps whole and stores as one
entry. A blob comes back exactly as it was saved (empty dicts and lists,
integer keys and nesting included), which DCP's per-key flattening would not
guarantee (it drops empty containers).

DCP stores a tensor that is not sharded once, written by one rank, and so does
it with a blob. Values that may differ between ranks (module buffers such as
BatchNorm statistics, all of a plain module, each key of ``extra``, each
stateful object) are digested at save time (``rank_digests``); the manager
gathers the digests, and a value that differs is also written by each rank as
``per_rank.rank_<r>`` (``with_rank_values``, ``state.per_rank``), which a restore
puts back in place of the shared copy (rank 0's at a world size that lacks this
rank).

Non-tensor values must be plain data (``state.plain``), so that loading can
never run code. A restore goes through ``plan_restore`` (``state.restore``, the
``RestorePlan`` of ``stalwart.restore_protocol``) and ends in ``load_state_dict``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from stalwart import distributed
from stalwart.rng import capture_rng_state, packed_rng_state, restore_rng_state
from stalwart.state.native import NativeStateDict
from stalwart.state.per_rank import EXTRA_KEYS, PER_RANK, digest, value_at, with_own_values
from stalwart.state.plain import META, blob, check_plain, unblob
from stalwart.state.restore import TrainStatePlan
from stalwart.state.units import bind_units, named_modules, named_optimizers

__all__ = ["TrainState"]

logger = logging.getLogger("stalwart")

_RESERVED = frozenset({"model", "optimizer", "rng", "extra", META, PER_RANK})


class TrainState:
    """One object over everything that must come back after a crash.

    Implements torch's ``Stateful`` protocol (``state_dict``/``load_state_dict``)
    and stalwart's ``Restorable`` (``plan_restore``, used by ``load_checkpoint``).
    Call from the training thread; every rank holds its own TrainState over its
    own (possibly sharded) model.

    ``model`` is a module or a dict of modules by name; ``optimizer`` one
    optimizer, a list, or a dict by name, each bound to the module that holds
    all its parameters (a form that cannot be saved correctly raises
    ``ValueError`` here, with the supported forms). ``rng=True`` captures python
    ``random``, numpy's global RNG, torch CPU and every CUDA device, separately
    for each rank. ``extra`` is a dict of user values restored in place (the
    same dict object is updated). Further keyword arguments are modules and
    optimizers (saved through DCP like ``model``) or other objects with
    ``state_dict``/``load_state_dict``. See docs/multi-model.md.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | Mapping[str, torch.nn.Module] | None = None,
        optimizer: torch.optim.Optimizer
        | Iterable[torch.optim.Optimizer]
        | Mapping[str, torch.optim.Optimizer]
        | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        data: Any = None,
        rng: bool = True,
        extra: MutableMapping[str, Any] | None = None,
        **stateful: Any,
    ) -> None:
        modules = named_modules(model)
        optimizers = named_optimizers(optimizer)
        if optimizers and not modules:
            raise ValueError(
                "optimizer was given without model; the optimizer state is keyed by the "
                "model's parameter names, so pass model= too"
            )
        self.model = model if isinstance(model, torch.nn.Module) else None
        if not isinstance(rng, bool):
            raise TypeError(f"rng must be True or False, got {rng!r}")
        self.rng = rng
        if extra is not None and not isinstance(extra, MutableMapping):
            raise TypeError(f"extra must be a dict (restored in place), got {type(extra).__name__}")
        self.extra = extra
        _warn_state_dicts_in_extra(extra)
        self.components: dict[str, Any] = {}
        for name, obj in (
            ("scheduler", scheduler),
            ("scaler", scaler),
            ("data", data),
            *stateful.items(),
        ):
            if obj is None:
                continue
            if name in _RESERVED:
                raise ValueError(
                    f"{name!r} is a reserved section name of TrainState; pick another keyword"
                )
            if isinstance(obj, torch.nn.Module):
                modules.append(((name,), obj))
            elif isinstance(obj, torch.optim.Optimizer):
                optimizers.append(((name,), obj, f"{name}="))
            elif not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            ):
                raise TypeError(
                    f"{name}= must have state_dict() and load_state_dict() methods; "
                    f"got {type(obj).__name__}"
                )
            else:
                self.components[name] = obj
        self.units = bind_units(modules, optimizers)
        self.optimizers = [opt for unit in self.units for opt in unit.optimizers]
        self.modules = {".".join(path): module for path, module in modules}
        """Every module of the state by its section path (``model``, ``model.G``, ``ema``)."""
        self.native_sections = {name for unit in self.units for name in unit.sections}
        self._candidates: list[tuple[str, tuple[str | int, ...]]] = []

    # ------------------------------------------------------------------ saving

    def state_dict(self) -> dict[str, Any]:
        """The whole state: live module/optimizer tensors, CPU copies of everything else.

        Modules and optimizers go to DCP as they are (sharded tensors stay
        sharded); every other section is one blob (see the module docstring).
        Values that may differ between ranks are noted for ``rank_digests``.
        """
        sd: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        fresh_paths: list[str] = []
        candidates: list[tuple[str, tuple[str | int, ...]]] = []
        for unit in self.units:
            fresh = unit.collect(sd)
            if fresh:
                fresh_paths.append(".".join(unit.optim_path or ()))
            if distributed.is_distributed():
                candidates.extend(unit.rank_local_paths(sd))
        if self.optimizers:
            meta["optimizer_fresh"] = len(fresh_paths) == sum(
                1 for unit in self.units if unit.optimizers
            )
            meta["fresh_optimizers"] = fresh_paths
        if self.units:
            check_plain({name: sd[name] for name in self.native_sections}, "")
        for name, obj in self.components.items():
            sd[name] = blob(obj.state_dict(), f"[{name!r}]")
            candidates.append((f"section:{name}", (name,)))
        if self.rng:
            sd["rng"] = {
                f"rank_{distributed.get_rank()}": blob(
                    packed_rng_state(capture_rng_state()), "['rng']"
                )
            }
        if self.extra is not None:
            sd["extra"] = blob(dict(self.extra), "['extra']")
            candidates.extend((f"extra:{k}", ("extra", k)) for k in self.extra)
            # Keys of a rank's own (extra["batch_rank_1"]): then the whole dict is per rank.
            candidates.append((EXTRA_KEYS, ("extra",)))
        meta["sections"] = sorted(sd)
        sd[META] = blob(meta, f"[{META!r}]")
        self._candidates = candidates
        return sd

    def rank_digests(self, sd: Mapping[str, Any]) -> dict[str, str]:
        """Digests of the values of ``sd`` that may differ between ranks (no collective).

        ``sd`` is the last ``state_dict()`` or a staged copy of it. The manager
        all-gathers these (a few bytes per buffer, never the tensors) and passes
        every rank's digests to ``with_rank_values``.
        """
        if not distributed.is_distributed():
            return {}
        return {
            key: digest(list(value_at(sd, path)) if key == EXTRA_KEYS else value_at(sd, path))
            for key, path in self._candidates
        }

    def with_rank_values(self, sd: dict[str, Any], digests: list[dict[str, str]]) -> dict[str, Any]:
        """``sd`` plus a ``per_rank.rank_<r>`` section holding this rank's own copy of
        every value whose digest differs between ranks (``digests[r]`` is rank r's).

        Every rank calls it with the same ``digests``, so the ranks agree on which
        values are per rank; the shared copy stays in its section too (it is the
        one a strict key check and a restore at another world size read).
        """
        keys = set().union(*digests) if digests else set()
        differ = sorted(k for k in keys if len({d.get(k) for d in digests}) > 1)
        if not differ:
            return sd
        own: dict[str, Any] = {"tensors": [], "extra": {}, "sections": {}}
        paths = dict(self._candidates)
        for key in differ:
            path = paths.get(key)
            if path is None:
                continue  # a value other ranks have and this one lacks
            value = value_at(sd, path)
            if key.startswith("extra:"):
                own["extra"][path[1]] = value
            elif key.startswith("section:") or key == EXTRA_KEYS:
                own["sections"][path[0]] = value
            else:
                own["tensors"].append([list(path), value])
        out = dict(sd)
        out[PER_RANK] = {f"rank_{distributed.get_rank()}": blob(own, f"[{PER_RANK!r}]")}
        return out

    @property
    def _native(self) -> NativeStateDict:
        """The fast path of the first module with optimizers (the single-model case)."""
        for unit in self.units:
            if unit.optimizers:
                return unit.native
        return NativeStateDict()

    @property
    def epoch(self) -> int | None:
        """The data epoch, when the data source or ``extra`` knows it (for the manifest)."""
        data = self.components.get("data")
        value = getattr(data, "epoch", None)
        if value is None and self.extra is not None:
            value = self.extra.get("epoch")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    # --------------------------------------------------------------- restoring

    def plan_restore(self, metadata: Metadata, *, strict: bool = True) -> TrainStatePlan:
        """A ``RestorePlan`` for the checkpoint described by ``metadata``: reads nothing,
        changes nothing live (see ``stalwart.restore_protocol`` and ``state.restore``)."""
        return TrainStatePlan(self, metadata, strict=strict)

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Put a state dict (as produced by ``state_dict``) back into the live objects.

        This rank's per-rank copies (``per_rank.rank_<r>``) replace the shared
        ones; a rank the checkpoint has none for (another world size) takes rank
        0's, with a warning that the resume is not exact.
        """
        state_dict = with_own_values(state_dict)
        meta = unblob(state_dict.get(META)) or {}
        fresh = meta.get("fresh_optimizers")
        for unit in self.units:
            path = ".".join(unit.optim_path or ())
            unit.load(
                state_dict,
                strict=strict,
                fresh=bool(meta.get("optimizer_fresh")) if fresh is None else path in fresh,
            )
        for name, obj in self.components.items():
            if name in state_dict:
                obj.load_state_dict(unblob(state_dict[name]))
        if self.extra is not None and "extra" in state_dict:
            extra = unblob(state_dict["extra"])
            if strict:
                self.extra.clear()
            self.extra.update(extra)
        if self.rng and "rng" in state_dict:
            key = f"rank_{distributed.get_rank()}"
            ranks = state_dict["rng"]
            if key in ranks:
                restore_rng_state(unblob(ranks[key]))
            else:
                logger.warning(
                    "the checkpoint has no RNG state for %s (saved ranks: %s); RNG streams "
                    "continue from their current state, so the run is not bit-exact",
                    key,
                    ", ".join(sorted(ranks)),
                )


def _warn_state_dicts_in_extra(extra: Mapping[str, Any] | None) -> None:
    for key, value in (extra or {}).items():
        if (
            isinstance(value, OrderedDict)
            and value
            and all(isinstance(v, torch.Tensor) for v in value.values())
        ):
            logger.warning(
                "extra[%r] looks like a module's state_dict(): a restore puts it back into "
                "extra, never into the module. Pass the module itself by keyword instead "
                "(TrainState(..., %s=module)); see docs/multi-model.md",
                key,
                key,
            )
