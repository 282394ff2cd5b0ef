"""The boundary between a verified checkpoint and the live objects it restores.

``pipeline.load_checkpoint`` knows how to check files and read DCP data
safely; it does not know what a training state is. Whatever holds live state
(``TrainState``, or an integration's own object for Lightning or DeepSpeed)
implements ``Restorable``: asked once per restore, it returns a
``RestorePlan``, and the pipeline drives that plan through the same steps on
every rank, each agreed across ranks (a failure on one rank fails all)::

    plan = state.plan_restore(metadata, strict=strict)
    plan.prepare()                    # optional: runs while the data files are checked
    staged = plan.staged()            # fresh placeholders, read before the check
    plan.check(staged)                # StateMismatchError: nothing live changed
    in_place = plan.in_place()        # live tensors, read into after the check
    plan.apply({**staged, **in_place})

or ``plan.discard()`` when the restore stops before ``apply``. ``prepare``
is optional (a plan without it is driven the same way): work that needs only
the metadata, such as computing the live state dicts, done while the data
files' checksums are still being computed; it may change live objects only
in ways ``discard`` undoes, and a damaged file is reported before anything it
raises. This protocol
is the whole of that surface: a plan holds what it computed from the live
objects (a state dict, for which a fresh optimizer is given its state from the
checkpoint's metadata, ``stalwart.state.optim_state``) and reuses it from
``check`` to ``apply``, so it is computed once per restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["Restorable", "RestorePlan"]


@runtime_checkable
class RestorePlan(Protocol):
    """One restore of one checkpoint into live objects, on one rank.

    Called from the restoring thread, in the order of the module docstring,
    each method once. Targets are state dicts in DCP's layout (tensors of the
    saved global shapes or live, possibly sharded, tensors; ``None`` for a
    bytes entry), which the pipeline fills with ``safe_load``.
    """

    def staged(self) -> dict[str, Any]:
        """Targets read before the check, into memory no live object uses."""
        ...

    def check(self, staged: Mapping[str, Any]) -> None:
        """Raise ``StateMismatchError`` when the checkpoint does not fit the live
        objects, which are then as they were before the plan was made."""
        ...

    def in_place(self) -> dict[str, Any]:
        """Targets read after the check passed on every rank, usually live tensors."""
        ...

    def apply(self, loaded: Mapping[str, Any]) -> None:
        """Put what was read (``staged`` and ``in_place``, filled) into the live objects."""
        ...

    def discard(self) -> None:
        """The restore stops before ``apply`` (on this rank or another): undo what
        the plan itself did to live objects. Never raises."""
        ...


@runtime_checkable
class Restorable(Protocol):
    """Live state that ``pipeline.load_checkpoint`` can restore (``TrainState`` is one)."""

    def plan_restore(self, metadata: Metadata, *, strict: bool) -> RestorePlan:
        """A plan to restore the checkpoint described by ``metadata`` (DCP's, read
        safely); ``strict`` refuses keys the state and the checkpoint do not share.
        Reads nothing and changes no live object."""
        ...
