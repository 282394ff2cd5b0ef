"""Which checkpoint to restore: the walk over candidates of both tiers, newest first.

Rank 0 lists both tiers once and every rank walks the same candidates. Each
candidate is tried from the local tier, then from the durable one (downloaded
into the local tier first); a bad one is skipped with the reason (and, when its
content is definitely wrong, moved aside on rank 0) for the next older one. The
manager owns what happens around a restore (its events on failure, the
exact-resume certificate); this module owns the fallback.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from stalwart.distributed import Coordinator
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StalwartError,
    UnsupportedFormatError,
)
from stalwart.events import EventLog
from stalwart.manifest import Manifest
from stalwart.pipeline import load_checkpoint
from stalwart.state import TrainState
from stalwart.storage.base import CheckpointStorage
from stalwart.tiers import TierSync

__all__ = ["RestoreWalk", "Restored", "warn_if_ddp_resume_inexact"]


@dataclasses.dataclass(frozen=True, slots=True)
class Restored:
    """The checkpoint a restore loaded, and where from."""

    step: int
    manifest: Manifest
    source: str
    """``local`` or ``durable``."""
    resharded: bool
    """True when the checkpoint was written at another world size."""


class RestoreWalk:
    """Tries the candidates of a restore on every rank together (collective).

    ``tiers`` is the durable link on rank 0 (None elsewhere and without a tier).
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        coord: Coordinator,
        events: EventLog,
        *,
        tiers: TierSync | None,
        directory: Path,
        durable_url: str | None,
    ) -> None:
        self.storage = storage
        self.coord = coord
        self.events = events
        self.tiers = tiers
        self.directory = directory
        self.durable_url = durable_url

    def run(self, state: TrainState, *, step: int | None, strict: bool) -> Restored | None:
        """Load the newest candidate that verifies (or ``step``) into ``state``; None: none did."""
        # The leader lists both tiers once, so every rank walks the same candidates.
        entries = self.storage.scan()
        local = [e.step for e in entries if e.status == "committed" and e.step is not None]
        remote = [] if self.tiers is None else self.tiers.committed_steps()
        local, remote = self.coord.broadcast((local, remote))
        committed = sorted(set(local) | set(remote))
        if step is not None:
            if step not in committed:
                shown = ", ".join(map(str, committed[-10:])) or "none"
                where = str(self.directory) + (
                    f" or {self.durable_url}" if self.durable_url else ""
                )
                raise CheckpointNotFoundError(
                    f"no committed checkpoint of step {step} in {where} (committed steps: {shown})"
                )
            candidates = [step]
        else:
            candidates = sorted(committed, reverse=True)
        last_error: CheckpointCorruptError | None = None
        kept: CheckpointCorruptError | None = None  # the newest failure that may pass
        touched = False  # a failed candidate had already written into the live tensors
        for candidate in candidates:
            sources = (["local"] if candidate in local else []) + (
                ["durable"] if candidate in remote else []
            )
            for source in sources:
                t0 = time.perf_counter()
                try:
                    if source == "durable":
                        self._download(candidate)
                    manifest = load_checkpoint(
                        self.storage.step_path(candidate),
                        state,
                        strict=strict,
                        coordinator=self.coord,
                    )
                except CheckpointCorruptError as exc:
                    last_error = exc
                    kept = kept or (exc if exc.transient else None)
                    touched = touched or exc.live_modified
                    self._skip_bad(candidate, source, exc)
                    continue
                except UnsupportedFormatError as exc:
                    # An intact checkpoint of a newer stalwart: not ours to move aside,
                    # and not a reason to stop the run; restore(step=N) of it raises.
                    if step is not None:
                        raise
                    self.events.emit(
                        "restore_skipped",
                        logging.WARNING,
                        step=candidate,
                        source=source,
                        reason=str(exc),
                        file=None,
                    )
                    continue
                resharded = manifest.world_size != self.coord.world_size
                newer = [s for s in committed if s > candidate]
                # Exactness is the certificate's verdict (resume_verified /
                # resume_diverged) once the redone steps are compared, never claimed here.
                self.events.emit(
                    "restore",
                    step=candidate,
                    source=source,
                    seconds=round(time.perf_counter() - t0, 6),
                    bytes=manifest.total_bytes,
                    saved_world_size=manifest.world_size,
                    world_size=self.coord.world_size,
                    same_world_size=not resharded,
                    newer_steps=newer,
                )
                if step is not None:
                    self._warn_rollback(candidate, newer)
                return Restored(candidate, manifest, source, resharded)
            if step is not None and last_error is not None:
                raise last_error
        if touched:
            # Starting over from a state that holds part of a checkpoint would be a
            # silent, inexact resume: stop instead.
            error = CheckpointCorruptError(
                f"no checkpoint in {self.directory} could be restored, and a failed one had "
                "already been partly read into the live tensors (its file changed or was cut "
                f"short after its check: {last_error}); rebuild the model and optimizer "
                "before starting over",
                path=None if last_error is None else last_error.path,
            )
            error.live_modified = True
            raise error
        if kept is not None:
            # Committed checkpoints exist and failed only in ways that may pass (a read
            # error, a download, an error raised into the load): starting the run over
            # would throw their progress away. Stop; a restart of the job retries them.
            error = CheckpointCorruptError(
                f"no checkpoint in {self.directory} could be restored now, and at least one "
                f"failed in a way that may pass ({kept}); the checkpoints are kept in place: "
                "restart the job to try them again rather than start the run over",
                path=kept.path,
                transient=True,
            )
            raise error from kept
        incomplete = [e.name for e in entries if e.status == "incomplete"]
        self.events.emit(
            "restore_none",
            reason="no committed checkpoint verified" if candidates else "no committed checkpoint",
            incomplete=incomplete,
        )
        return None

    def _skip_bad(self, candidate: int, source: str, exc: CheckpointCorruptError) -> None:
        self.events.emit(
            "restore_skipped",
            logging.WARNING,
            step=candidate,
            source=source,
            reason=str(exc),
            file=exc.path,
        )
        if (
            not self.coord.is_leader
            or exc.transient
            or not self.storage.step_path(candidate).exists()
        ):
            return
        # Definitely bad content (not a transient read error): move the local copy aside
        # so retention, a download of the durable copy and later saves are not confused.
        try:
            aside = self.storage.quarantine(candidate)
        except OSError as move_exc:
            # Falling back matters more than tidying up: keep going.
            self.events.emit(
                "quarantine_failed", logging.WARNING, step=candidate, error=str(move_exc)
            )
        else:
            self.events.emit("quarantine", step=candidate, path=str(aside))

    def _warn_rollback(self, step: int, newer: list[int]) -> None:
        """Say what a run going on from ``step`` will meet when newer steps are committed."""
        if not newer or not self.coord.is_leader:
            return
        shown = ", ".join(map(str, newer[:10])) + (", ..." if len(newer) > 10 else "")
        self.events.emit(
            "restore_rollback",
            logging.WARNING,
            step=step,
            newer_steps=newer,
            reason=(
                f"restored step {step} while the run holds newer committed steps ({shown}): "
                "a run that goes on from here skips saving those step numbers (a checkpoint is "
                f"never overwritten), and a restore() without step= loads step {newer[-1]}, not "
                f"this run's; if training goes on from step {step}, call rollback({step}) "
                f"on this manager first, which moves them aside, kept, in {self.directory}"
                + (
                    f" and deletes them from {self.durable_url}"
                    if self.durable_url
                    else f" (or, with the trainer stopped, `stalwart rollback "
                    f"{self.directory} --to {step}`)"
                )
            ),
        )

    def _download(self, step: int) -> None:
        """Rank 0 fetches ``step`` from the durable tier into the local tier; all ranks agree."""

        def fetch() -> None:
            if self.tiers is None:
                return
            try:
                self.tiers.download(step)
            except CheckpointCorruptError:
                raise
            except (StalwartError, OSError) as exc:
                raise CheckpointCorruptError(
                    f"download from {self.durable_url} failed: {exc}", transient=True
                ) from exc

        self.coord.agree(
            fetch,
            catch=(CheckpointCorruptError,),
            remote=lambda rep: CheckpointCorruptError(
                rep.message, path=rep.path, transient=rep.transient
            ),
        )


def warn_if_ddp_resume_inexact(events: EventLog, state: TrainState, world_size: int) -> None:
    """Warn when a DDP model of 3+ ranks cannot resume bit-exactly (see the comment)."""
    model = state.model
    if not (
        isinstance(model, torch.nn.parallel.DistributedDataParallel)
        and world_size >= 3
        and not model.find_unused_parameters
    ):
        return
    # DDP regroups gradient buckets after its first iteration; a resumed process
    # all-reduces its first step with the initial grouping, and with 3+ ranks the
    # summation order (so the last bits) differs from the uninterrupted run.
    events.emit(
        "warning",
        logging.WARNING,
        reason=(
            "DDP with 3 or more ranks resumes bit-exactly only with "
            "DistributedDataParallel(..., find_unused_parameters=True), which keeps "
            "the initial gradient buckets; without it the first steps after a resume "
            "differ in the last bits (see docs/distributed.md)"
        ),
    )
