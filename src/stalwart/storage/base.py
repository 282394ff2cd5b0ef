"""The boundaries between the save pipeline and the places checkpoints are kept.

The primary tier (``CheckpointStorage``) is where every rank writes and where
the committing rank publishes: the pipeline writes a checkpoint's files into a
private staging location, then asks the storage to make it visible in one
indivisible step. That is the whole of what differs between a POSIX directory
(rename, then fsync the parent) and an object store (data objects first, the
manifest object last as the marker), plus listing and removing what was
published. The manager, the pipeline and the uploader use the primary tier only
through this protocol, so a new primary backend is one new module in
``storage/`` passed as ``CheckpointManager(..., storage=...)``.

The durable tier (``DurableMirror``, implemented by ``storage.durable.DurableTier``)
is not a second primary tier: it holds *copies* of steps the primary tier
already committed. It is fed from ``CheckpointStorage.step_path`` (upload of a
committed directory) and feeds back through ``CheckpointStorage.begin`` and
``commit`` (a download is staged and committed like any save), so the commit
protocol of the primary tier is never bypassed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "CheckpointStorage",
    "DurableMirror",
    "StepEntry",
    "StepStatus",
    "is_committed",
    "newest_committed",
]

StepStatus = Literal["committed", "incomplete", "corrupt"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepEntry:
    """One directory entry of a run: a committed step, an unfinished or abandoned save,
    or a committed step that failed verification and was moved aside."""

    name: str
    path: Path
    step: int | None
    status: StepStatus


@runtime_checkable
class CheckpointStorage(Protocol):
    """What the pipeline, the manager and the uploader need from the primary tier.

    ``begin``, ``commit``/``abort``, ``quarantine`` and ``delete`` are called by
    the committing rank only; ``path_of`` and ``step_path`` on any rank;
    ``scan`` and ``committed_steps`` by whoever reads the run. None of these
    methods is required to be thread-safe against itself for the same step.
    """

    def begin(self, step: int) -> Path:
        """Create and return a fresh, private staging directory for ``step``."""
        ...

    def path_of(self, name: str) -> Path:
        """Where the entry ``name`` (as returned by ``begin`` or ``commit``) lives, on any rank."""
        ...

    def step_path(self, step: int) -> Path:
        """Where committed ``step`` lives (or would live), on any rank."""
        ...

    def commit(self, staging: Path, step: int, manifest_json: str) -> Path:
        """Write the manifest into ``staging`` durably, then publish it as ``step``.

        After this returns the checkpoint exists; if it raises, it does not.
        """
        ...

    def abort(self, staging: Path) -> None:
        """Remove a staging directory that will never be committed; never raises."""
        ...

    def scan(self) -> list[StepEntry]:
        """Every committed step and every unfinished staging directory, oldest step first."""
        ...

    def committed_steps(self) -> list[int]:
        """The committed steps, oldest first (not verified)."""
        ...

    # Optional: ``is_committed(step) -> bool`` and ``newest_committed() -> int | None``,
    # direct look-ups that every save makes (see the functions of the same names
    # below); without them a save lists every committed step of the run.

    def quarantine(self, step: int) -> Path:
        """Move committed ``step``, found bad, out of the way (kept for inspection); return where."""
        ...

    def delete(self, step: int) -> None:
        """Remove a committed step so that it stops existing at once, then free its space."""
        ...


def is_committed(storage: CheckpointStorage, step: int) -> bool:
    """Whether ``step`` is committed in ``storage``: the storage's own ``is_committed``
    when it has one (``LocalStorage`` looks at one directory), else ``committed_steps``."""
    probe = getattr(storage, "is_committed", None)
    return bool(probe(step)) if callable(probe) else step in storage.committed_steps()


def newest_committed(storage: CheckpointStorage) -> int | None:
    """The newest committed step of ``storage`` (None: none): the storage's own
    ``newest_committed`` when it has one, else the last of ``committed_steps``."""
    probe = getattr(storage, "newest_committed", None)
    if callable(probe):
        newest = probe()
        return None if newest is None else int(newest)
    return max(storage.committed_steps(), default=None)


@runtime_checkable
class DurableMirror(Protocol):
    """What the manager and the uploader need from the durable tier (see the module docstring).

    Thread-safe for different steps: the manager uploads from one background
    thread and downloads from the training thread, on the committing rank only.
    """

    url: str
    """Where the tier is, with any credentials redacted (for messages and events)."""

    @property
    def retry(self) -> Any:
        """The tier's ``RetryPolicy`` (its ``max_backoff`` paces a retry round)."""
        ...

    def committed_steps(self, *, retry: Any = None) -> list[int]:
        """Steps committed in the tier, oldest first; ``retry`` overrides the policy."""
        ...

    def manifest_bytes(self, step: int) -> bytes:
        """The exact MANIFEST.json of committed ``step``."""
        ...

    def upload(
        self, checkpoint: Path, *, on_retry: Callable[[str, int, float, Any], None] | None = None
    ) -> Any:
        """Copy the committed primary-tier directory ``checkpoint`` and commit the copy."""
        ...

    def download(
        self,
        step: int,
        destination: Path,
        *,
        advance: Callable[[int], None] | None = None,
        manifest_bytes: bytes | None = None,
    ) -> bytes:
        """Fetch ``step`` into the primary tier's staging directory ``destination``, verified."""
        ...

    def delete(self, step: int) -> None:
        """Remove committed ``step`` from the tier."""
        ...

    def stop(self) -> None:
        """Make every retry loop give up at its next wait (the manager is closing)."""
        ...
