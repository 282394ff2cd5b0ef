"""TrainState's ``RestorePlan``: what to read, the check, and the load in place.

A restore reads in two phases so that nothing live is touched before the
checkpoint is known to fit: first every non-module, non-optimizer entry (the
small blob sections) into fresh placeholders (``staged``), then ``check``,
then module and optimizer tensors into the live tensors (``in_place``), then
``apply``. The live module and optimizer state dicts are computed once, by the
check, and reused as the in-place targets: building them runs DCP's
``get_state_dict``, which gives a fresh optimizer its state with a zero-lr
step (DESIGN.md, known traps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from stalwart import distributed
from stalwart.errors import StateMismatchError
from stalwart.state.optim_state import materialise_optimizer_state
from stalwart.state.per_rank import PER_RANK, with_own_blobs
from stalwart.state.plain import META, preview, unblob

if TYPE_CHECKING:
    from stalwart.state.train_state import TrainState

__all__ = ["TrainStatePlan", "flat_keys"]


def flat_keys(tree: Mapping[str, Any], prefix: str = "") -> set[str]:
    """Keys of ``tree`` flattened the way DCP names them (``a.b.0.c``)."""
    keys: set[str] = set()

    def visit(path: tuple[str | int, ...], _value: Any) -> None:
        keys.add(".".join(str(p) for p in path))

    traverse_state_dict(dict(tree), visit)
    return {f"{prefix}.{k}" if prefix else k for k in keys}


class TrainStatePlan:
    """One restore of a checkpoint into a ``TrainState`` (a ``RestorePlan``).

    Call from the restoring thread, each method once, in the order of
    ``stalwart.restore_protocol``.
    """

    def __init__(self, state: TrainState, metadata: Metadata, *, strict: bool) -> None:
        self.state = state
        self.metadata = metadata
        self.strict = strict
        self._live: dict[str, Any] | None = None
        # Optimizers without state before the plan touched them: building the
        # live state dict gives them state (from the metadata, or by DCP's zero-lr
        # step), undone by discard.
        self._fresh = [opt for opt in state.optimizers if not opt.state]

    def prepare(self) -> None:
        """Compute the live module and optimizer state dicts (the check's view and the
        in-place targets) while the data files are still being checked: a fresh
        optimizer gets its state from the metadata here, undone by ``discard``."""
        self._live_native()

    def staged(self) -> dict[str, Any]:
        """Placeholders for every non-module, non-optimizer entry of the checkpoint.

        Of the per-rank copies only this rank's and rank 0's (the fallback at
        another world size) are read.
        """
        target: dict[str, Any] = {}
        wanted_ranks = {f"rank_{distributed.get_rank()}", "rank_0"}
        for key, md in self.metadata.state_dict_metadata.items():
            section, _, rest = key.partition(".")
            if section in self.state.native_sections:
                continue
            if section == PER_RANK and rest.split(".", 1)[0] not in wanted_ranks:
                continue
            path = (self.metadata.planner_data or {}).get(key) or tuple(key.split("."))
            if isinstance(md, TensorStorageMetadata):
                placeholder: Any = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            else:
                assert isinstance(md, BytesStorageMetadata)
                placeholder = None
            set_element(target, path, placeholder)
        return target

    def check(self, staged: Mapping[str, Any]) -> None:
        """Raise ``StateMismatchError`` when the state and the checkpoint differ in
        tensor shapes (always) or in keys (strict), leaving the live objects as they were."""
        try:
            live = self._live_native()
            _check_shapes(self.metadata, live)
            if self.strict:
                _check_keys(self.state, self.metadata, live, with_own_blobs(staged))
        except StateMismatchError:
            self.discard()
            raise

    def in_place(self) -> dict[str, Any]:
        """The live module and optimizer state dicts to load in place (only saved keys
        unless strict)."""
        saved = set(self.metadata.state_dict_metadata)
        saved_sections = {
            k.split(".", 1)[0]
            for k, md in self.metadata.state_dict_metadata.items()
            if not isinstance(md, BytesStorageMetadata) or "." in k
        }
        return {
            name: tree if self.strict else _only_saved(tree, name, saved)
            for name, tree in self._live_native().items()
            if name in saved_sections
        }

    def apply(self, loaded: Mapping[str, Any]) -> None:
        """Put the loaded state dict into the live objects (``TrainState.load_state_dict``)."""
        self.state.load_state_dict(loaded, strict=self.strict)

    def discard(self) -> None:
        """Give the optimizers that were fresh their empty state back."""
        for opt in self._fresh:
            opt.state.clear()

    def _live_native(self) -> dict[str, Any]:
        # Computed once per restore: it is the check's view of the live tensors
        # and, unchanged, the targets DCP reads into.
        if self._live is None:
            tree: dict[str, Any] = {}
            for unit in self.state.units:
                for opt in unit.optimizers:
                    if opt in self._fresh and unit.optim_path is not None:
                        section = ".".join(unit.optim_path)
                        materialise_optimizer_state(unit.module, opt, self.metadata, section)
                unit.live(tree)
            self._live = tree
        return self._live


def _check_shapes(metadata: Metadata, live: dict[str, Any]) -> None:
    # DCP reports a shape difference as a failed read, which would pass for
    # corruption and send a good checkpoint aside: name it as the mismatch it is.
    shapes = _shape_mismatches(metadata, live)
    if shapes:
        raise StateMismatchError(
            f"the checkpoint does not match the state to restore: {len(shapes)} tensor "
            f"shapes differ: {preview(shapes)}; build the model (and optimizer) with the "
            "configuration it was trained with"
        )


def _check_keys(
    state: TrainState, metadata: Metadata, live_native: dict[str, Any], blobs: Mapping[str, Any]
) -> None:
    """Raise ``StateMismatchError`` naming the sections and keys only one side has."""
    blobbed = sorted(
        name
        for name in state.native_sections
        if isinstance(metadata.state_dict_metadata.get(name), BytesStorageMetadata)
    )
    if blobbed:
        raise StateMismatchError(
            f"the checkpoint stores {', '.join(map(repr, blobbed))} as one rank's blob (a "
            "module or optimizer passed by keyword to an older stalwart); this state saves "
            "it through DCP. Restore with strict=False to skip it, or from a newer checkpoint"
        )
    saved = set(metadata.state_dict_metadata)
    saved_sections = {k.split(".", 1)[0] for k in saved} - {META, PER_RANK}
    wanted = (
        set(live_native)
        | set(state.components)
        | ({"rng"} if state.rng else set())
        | ({"extra"} if state.extra is not None else set())
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
    for name in (*state.components, "extra"):
        # The data source's state legitimately changes shape with worker counts.
        if name == "data" or name not in blobs:
            continue
        live = state.extra if name == "extra" else state.components[name].state_dict()
        if live is None:
            continue
        loaded = unblob(blobs[name])
        if isinstance(live, Mapping) and isinstance(loaded, Mapping):
            found[name] = ({f"{name}.{k}" for k in live}, {f"{name}.{k}" for k in loaded})
    for have, want in found.values():
        missing, unexpected = sorted(want - have), sorted(have - want)
        if missing:
            problems.append(f"keys in the checkpoint but not in the state: {preview(missing)}")
        if unexpected:
            problems.append(f"keys in the state but not in the checkpoint: {preview(unexpected)}")
    if problems:
        raise StateMismatchError(
            "the checkpoint does not match the state to restore: "
            + "; ".join(problems)
            + ". Restore into a state built like the one that was saved, or pass strict=False "
            "to load only the keys both have."
        )


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
