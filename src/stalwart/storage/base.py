"""The boundary between the save pipeline and the place checkpoints are kept.

The pipeline writes a checkpoint's files into a private staging location, then
asks the storage to make it visible in one indivisible step. That is the whole
of what differs between a POSIX directory (rename, then fsync the parent) and an
object store (data objects first, the manifest object last as the marker), so
this protocol is the whole of that surface.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

__all__ = ["CheckpointStorage", "StepEntry", "StepStatus"]

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
    """What the pipeline and the manager need from a place that holds checkpoints.

    ``begin`` and ``commit``/``abort`` are called by the committing rank only;
    ``scan`` and ``delete`` by whoever owns the run directory. None of these
    methods is required to be thread-safe against itself for the same step.
    """

    def begin(self, step: int) -> Path:
        """Create and return a fresh, private staging directory for ``step``."""
        ...

    def path_of(self, name: str) -> Path:
        """Where the entry ``name`` (as returned by ``begin`` or ``commit``) lives, on any rank."""
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

    def delete(self, step: int) -> None:
        """Remove a committed step so that it stops existing at once, then free its space."""
        ...
