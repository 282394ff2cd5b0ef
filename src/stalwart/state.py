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
``per_rank.rank_<r>`` (``with_rank_values``), which a restore puts back in
place of the shared copy (rank 0's at a world size that lacks this rank).

Non-tensor values must be plain data (None, bool, int, float, str, bytes, and
lists, tuples and dicts of them). That is what makes loading safe: stalwart
reads them back with ``torch.load(weights_only=True)``, which cannot construct
arbitrary objects, so a checkpoint can never run code. Anything else is refused
at save time with the key that holds it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
import xxhash
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
    set_optimizer_state_dict,
    set_state_dict,
)

from stalwart import distributed
from stalwart.errors import StateMismatchError
from stalwart.rng import capture_rng_state, restore_rng_state

__all__ = ["TrainState", "flat_keys"]

logger = logging.getLogger("stalwart")

_BUILTIN_SECTIONS = ("model", "optimizer", "scheduler", "scaler", "data", "rng", "extra")
_META = "_stalwart"
_PER_RANK = "per_rank"
"""Section of values that differ between ranks: ``per_rank.rank_<r>`` is rank r's own copy."""
_EXTRA_KEYS = "keys:extra"
"""Digest key of the list of ``extra``'s keys (a rank with keys of its own saves all of it)."""
_RESERVED = frozenset({"model", "optimizer", "rng", "extra", _META, _PER_RANK})
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
        modules = _named_modules(model)
        optimizers = _named_optimizers(optimizer)
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
        self.units = _units(modules, optimizers)
        self.optimizers = [opt for unit in self.units for opt in unit.optimizers]
        self.modules = {".".join(path): module for path, module in modules}
        """Every module of the state by its section path (``model``, ``model.G``, ``ema``)."""
        self._native_sections = {name for unit in self.units for name in unit.sections}
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
            _check_plain({name: sd[name] for name in self._native_sections}, "")
        for name, obj in self.components.items():
            sd[name] = _blob(obj.state_dict(), f"[{name!r}]")
            candidates.append((f"section:{name}", (name,)))
        if self.rng:
            sd["rng"] = {f"rank_{distributed.get_rank()}": _blob(capture_rng_state(), "['rng']")}
        if self.extra is not None:
            sd["extra"] = _blob(dict(self.extra), "['extra']")
            candidates.extend((f"extra:{k}", ("extra", k)) for k in self.extra)
            # Keys of a rank's own (extra["batch_rank_1"]): then the whole dict is per rank.
            candidates.append((_EXTRA_KEYS, ("extra",)))
        meta["sections"] = sorted(sd)
        sd[_META] = _blob(meta, f"[{_META!r}]")
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
            key: _digest(list(_value_at(sd, path)) if key == _EXTRA_KEYS else _value_at(sd, path))
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
            value = _value_at(sd, path)
            if key.startswith("extra:"):
                own["extra"][path[1]] = value
            elif key.startswith("section:") or key == _EXTRA_KEYS:
                own["sections"][path[0]] = value
            else:
                own["tensors"].append([list(path), value])
        out = dict(sd)
        out[_PER_RANK] = {f"rank_{distributed.get_rank()}": _blob(own, f"[{_PER_RANK!r}]")}
        return out

    @property
    def _native(self) -> _NativeStateDict:
        """The fast path of the first module with optimizers (the single-model case)."""
        for unit in self.units:
            if unit.optimizers:
                return unit.native
        return _NativeStateDict()

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
        """Placeholders for every non-module, non-optimizer entry of the checkpoint.

        Of the per-rank copies only this rank's and rank 0's (the fallback at
        another world size) are read.
        """
        target: dict[str, Any] = {}
        wanted_ranks = {f"rank_{distributed.get_rank()}", "rank_0"}
        for key, md in metadata.state_dict_metadata.items():
            section, _, rest = key.partition(".")
            if section in self._native_sections:
                continue
            if section == _PER_RANK and rest.split(".", 1)[0] not in wanted_ranks:
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
        """Raise ``StateMismatchError`` when the state and the checkpoint differ in
        tensor shapes (always) or in keys (strict), leaving the live objects as they were."""
        fresh = [opt for opt in self.optimizers if not opt.state]
        try:
            self._check(metadata, _with_own_blobs(blobs), strict)
        except StateMismatchError:
            for opt in fresh:  # get_state_dict gave them a zero-lr step's state
                opt.state.clear()
            raise

    def _check(self, metadata: Metadata, blobs: Mapping[str, Any], strict: bool) -> None:
        live_native = self._live_native()
        # DCP reports a shape difference as a failed read, which would pass for
        # corruption and send a good checkpoint aside: name it as the mismatch it is.
        shapes = _shape_mismatches(metadata, live_native)
        if shapes:
            raise StateMismatchError(
                f"the checkpoint does not match the state to restore: {len(shapes)} tensor "
                f"shapes differ: {_preview(shapes)}; build the model (and optimizer) with the "
                "configuration it was trained with"
            )
        if not strict:
            return
        blobbed = sorted(
            name
            for name in self._native_sections
            if isinstance(metadata.state_dict_metadata.get(name), BytesStorageMetadata)
        )
        if blobbed:
            raise StateMismatchError(
                f"the checkpoint stores {', '.join(map(repr, blobbed))} as one rank's blob (a "
                "module or optimizer passed by keyword to an older stalwart); this state saves "
                "it through DCP. Restore with strict=False to skip it, or from a newer checkpoint"
            )
        saved = set(metadata.state_dict_metadata)
        saved_sections = {k.split(".", 1)[0] for k in saved} - {_META, _PER_RANK}
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
        """The live module and optimizer state dicts to load in place (only saved keys unless strict)."""
        saved = set(metadata.state_dict_metadata)
        saved_sections = {
            k.split(".", 1)[0]
            for k, md in metadata.state_dict_metadata.items()
            if not isinstance(md, BytesStorageMetadata) or "." in k
        }
        live = self._live_native()
        return {
            name: tree if strict else _only_saved(tree, name, saved)
            for name, tree in live.items()
            if name in saved_sections
        }

    def _live_native(self) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for unit in self.units:
            unit.live(tree)
        return tree

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Put a state dict (as produced by ``state_dict``) back into the live objects.

        This rank's per-rank copies (``per_rank.rank_<r>``) replace the shared
        ones; a rank the checkpoint has none for (another world size) takes rank
        0's, with a warning that the resume is not exact.
        """
        state_dict = _with_own_values(state_dict)
        meta = _unblob(state_dict.get(_META)) or {}
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


_ATOMIC = frozenset({int, float, bool, str, bytes, type(None)})
"""Leaf types whose containers need no per-element visit (exact types: no subclasses)."""


_WRAPPERS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module"})
"""Path segments of DDP, torch.compile and activation-checkpoint wrappers, absent from FQNs."""


class _Unit:
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
        self.native = _NativeStateDict()

    @property
    def sections(self) -> set[str]:
        return {path[0] for path in (self.model_path, self.optim_path) if path}

    def _optim_arg(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        return self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers

    def collect(self, sd: dict[str, Any]) -> bool:
        """Put the live state into ``sd``; True when every optimizer had no state yet."""
        if not self.optimizers:
            assert self.model_path is not None
            _put(sd, self.model_path, get_model_state_dict(self.module))
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
        _put(sd, self.optim_path, optim_sd)
        if self.model_path is not None:
            _put(sd, self.model_path, model_sd)
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
            traverse_state_dict(_get(sd, base), lambda p, v: visit(base, p, v))
        if self.optimizers and not wrapped:
            assert self.optim_path is not None
            obase = self.optim_path
            traverse_state_dict(_get(sd, obase), lambda p, v: visit(obase, p, v))
        return found

    def live(self, tree: dict[str, Any]) -> None:
        """Put the live state dicts (DCP loads into them in place) into ``tree``."""
        if self.optimizers:
            model_sd, optim_sd = get_state_dict(self.module, self._optim_arg())
            if self.model_path is not None:
                _put(tree, self.model_path, model_sd)
            assert self.optim_path is not None
            _put(tree, self.optim_path, optim_sd)
        elif self.model_path is not None:
            _put(tree, self.model_path, get_model_state_dict(self.module))

    def load(self, state_dict: Mapping[str, Any], *, strict: bool, fresh: bool) -> None:
        options = StateDictOptions(strict=strict)
        model_sd = _get(state_dict, self.model_path) if self.model_path else None
        optim_sd = _get(state_dict, self.optim_path) if self.optim_path else None
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


def _named_modules(model: Any) -> list[tuple[tuple[str, ...], torch.nn.Module]]:
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


def _named_optimizers(
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


def _units(
    modules: list[tuple[tuple[str, ...], torch.nn.Module]],
    optimizers: list[tuple[tuple[str, ...] | None, torch.optim.Optimizer, str]],
) -> list[_Unit]:
    """Bind each optimizer to the module holding all its parameters (refused when none does)."""
    units = [_Unit(module, path) for path, module in modules]
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
            same = _Unit(owner.module, None, path)
            units.append(same)
        elif same.module is not owner.module:
            raise ValueError(f"{label} and another optimizer named alike train different modules")
        same.optimizers.append(opt)
    return units


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


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping[str, Any], path: tuple[str | int, ...]) -> Any:
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


def _value_at(sd: Mapping[str, Any], path: tuple[str | int, ...]) -> Any:
    """The value at ``path``; a blob section is looked into (its 1-tuple skipped)."""
    head = str(path[0])
    return _get({head: _unblob(sd.get(head))}, path)


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor"


def _has_dtensor(module: torch.nn.Module) -> bool:
    return any(_is_dtensor(p) for p in module.parameters())


def _digest(value: Any) -> str:
    """xxh3-128 of a value's exact content (tensor bytes, dtype and shape; plain data)."""
    h = xxhash.xxh3_128()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach()
            t = t.cpu() if t.device.type != "cpu" else t
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(v, Mapping):
            h.update(b"{")
            for k, x in v.items():
                feed(k)
                feed(x)
            h.update(b"}")
        elif isinstance(v, (list, tuple)):
            h.update(b"[" if isinstance(v, list) else b"(")
            for x in v:
                feed(x)
            h.update(b"]")
        else:
            h.update(repr((type(v).__name__, v)).encode())

    feed(value)
    return h.hexdigest()


def _own_rank_entry(sd: Mapping[str, Any], *, warn: bool) -> dict[str, Any] | None:
    ranks = sd.get(_PER_RANK)
    if not ranks:
        return None
    key = f"rank_{distributed.get_rank()}"
    if key not in ranks:
        if warn:
            logger.warning(
                "the checkpoint has no per-rank values for %s (saved by %d ranks); this rank "
                "takes rank 0's buffers and per-rank extra/state values, so the run is not "
                "bit-exact",
                key,
                len(ranks),
            )
        key = "rank_0"
    entry = _unblob(ranks.get(key))
    return entry if isinstance(entry, dict) else None


def _with_own_blobs(sd: Mapping[str, Any], *, warn: bool = False) -> dict[str, Any]:
    """``sd`` with this rank's per-rank ``extra`` values and sections in place of the shared ones."""
    own = _own_rank_entry(sd, warn=warn)
    out = dict(sd)
    if own is None:
        return out
    if own.get("extra") and "extra" in out:
        out["extra"] = ({**_unblob(out["extra"]), **own["extra"]},)
    for name, value in own.get("sections", {}).items():
        if name in out:
            out[name] = (value,)
    return out


def _with_own_values(sd: Mapping[str, Any]) -> dict[str, Any]:
    """``_with_own_blobs`` plus this rank's own copies of module and optimizer tensors."""
    out = _with_own_blobs(sd, warn=True)
    own = _own_rank_entry(sd, warn=False)
    for path, value in (own or {}).get("tensors", []):
        parent = _get(out, tuple(path[:-1]))
        if isinstance(parent, dict) and isinstance(parent.get(path[-1]), torch.Tensor):
            parent[path[-1]] = value  # only where the state has it (strict=False may not)
    return out


class _NativeStateDict:
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
        with torch.no_grad():
            # model.state_dict() returns an OrderedDict, and so does DCP.
            model_sd = type(plain)(
                (key, plain[source].detach()) for key, source in self._model_keys
            )
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
    kind = type(value)  # exact: a namedtuple or list subclass is stored as the plain type
    if kind in (list, tuple) and all(type(v) in _ATOMIC for v in value):
        return list(value) if kind is list else value
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value


def _preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def _shape_mismatches(metadata: Metadata, live: dict[str, Any]) -> list[str]:
    """``"<key>: checkpoint [..], <section> [..]"`` for each live tensor saved with another
    (global) shape."""
    saved = metadata.state_dict_metadata
    problems: list[str] = []

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            return
        key = ".".join(map(str, path))
        md = saved.get(key)
        if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.shape):
            section, _, rest = key.partition(".")
            problems.append(f"{rest}: checkpoint {list(md.size)}, {section} {list(value.shape)}")

    traverse_state_dict(live, visit)
    return problems


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


_LEAVES = (torch.Tensor, *_PLAIN_LEAVES)


def _where(prefix: str, path: tuple[Any, ...]) -> str:
    return prefix + "".join(f"[{p!r}]" for p in path)


def _check_plain(sd: Any, prefix: str) -> None:
    # The path is built only for an error message: formatting it for every
    # element would cost more than the walk itself on a large optimizer state.
    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, _LEAVES):
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(
                        f"state{_where(prefix, path)} has a key of type {type(k).__name__} "
                        f"({k!r}); checkpoint keys must be strings or integers"
                    )
                if not isinstance(v, _LEAVES):
                    walk(v, (*path, k))
            return
        if isinstance(value, (list, tuple)):
            if all(type(v) in _ATOMIC for v in value):
                return  # e.g. the 625 ints of random.getstate(): no per-element walk
            for i, v in enumerate(value):
                walk(v, (*path, i))
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

    walk(sd, ())
