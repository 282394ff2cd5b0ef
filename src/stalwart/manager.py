"""CheckpointManager: when to save, what to keep, which checkpoint to restore.

The manager owns policy and the conversation between ranks around a save or a
restore; the work is elsewhere: the commit protocol in ``pipeline``, the
primary tier behind ``storage.base.CheckpointStorage``, the durable tier in
``tiers``, manifest provenance in ``provenance``, preemption signals in
``signals``, deleting old steps in ``retention``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal, NamedTuple

from stalwart.certificate import Certificate, Verdict
from stalwart.continuous import ContinuousSchedule
from stalwart.distributed import Coordinator
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointSaveError,
    CoordinationError,
    StalwartError,
)
from stalwart.events import EVENTS_NAME, EventLog
from stalwart.lock import RunLock
from stalwart.manifest import to_json_data
from stalwart.policy import RetentionPolicy, SavePolicy
from stalwart.preemption import GracePlanner, check_grace
from stalwart.provenance import Provenance
from stalwart.redact import redact_url
from stalwart.restoring import RestoreWalk, warn_if_ddp_resume_inexact
from stalwart.rollback import rollback_run
from stalwart.saving import SaveWriter, peer_failure
from stalwart.signals import PreemptionSignals
from stalwart.state import TrainState
from stalwart.storage.base import CheckpointStorage
from stalwart.storage.local import LocalStorage
from stalwart.tiers import DurableConfig, TierSync, open_durable, resolve_directory
from stalwart.tiers import local_cache_dir as local_cache_dir  # its earlier home

__all__ = ["CheckpointManager"]

logger = logging.getLogger("stalwart")


class _SaveVote(NamedTuple):
    """This manager's part of a save's all-reduce (max over ranks); the certificate's flags follow."""

    signalled: int
    due: int
    upload_failed: int
    grace: int  # a ``GraceAction``: the most cautious emergency save wins


class CheckpointManager:
    """Saves a run's state into ``directory`` by policy, keeps the newest, restores the newest good one.

    Single-process use needs no process group and no launcher. Use it from the
    training thread; it is not thread-safe. As a context manager it waits for an
    in-flight async save and releases the run directory on exit.

    Arguments:
        directory: the run directory (created if missing). One manager writes it
            at a time; a second gets ``RunLockedError``.
        every_steps / every_seconds: the save policy. ``save(step)`` writes when
            ``step`` is a multiple of ``every_steps`` or ``every_seconds`` passed
            since the last save. With neither, every ``save`` call writes.
            ``every_steps="auto"`` + ``mtbf_seconds``: see ``stalwart.continuous``.
        keep_last / keep_every: retention. The newest ``keep_last`` committed
            checkpoints are kept, plus every one whose step is a multiple of
            ``keep_every``; the newest is never deleted, and nothing is deleted
            before the new checkpoint is committed. ``keep_last=None`` keeps all.
        async_save: stage the state into memory and write it in a background
            thread; ``save`` returns after the copy.
        durable: a durable tier: an object-store URL (``s3://bucket/prefix``,
            ``gs://…``, ``az://…``, or any fsspec URL), or a
            ``stalwart.DurableConfig`` with the URL and the tier's settings
            (upload every n-th checkpoint, retention, client options, retries,
            close timeout). Committed checkpoints are uploaded in the
            background; ``save`` never waits for the network. ``restore`` takes
            the newest checkpoint that verifies in either tier, downloading it
            when the local copy is missing or bad. ``directory`` may itself be
            such a URL: checkpoints are then staged in a node-local directory
            (``$STALWART_LOCAL_DIR`` or the temp dir) and uploaded.
        metadata: JSON data recorded in every manifest (dataset version, ...).
        config: the run's configuration (dict, dataclass or argparse Namespace),
            recorded in every manifest with a stable hash.
        process_group: the group to coordinate ranks on (None: the default group
            when torch.distributed is initialized).
        handle_signals: on SIGTERM or SIGUSR1, make the next ``save`` write a checkpoint
            whatever the policy says and set ``preempted``; with ``grace_seconds`` only what
            fits in that window (``stalwart.preemption``: save, flush or skip). The handlers
            are installed only in the main thread and removed by ``close``.
        save_timeout: seconds a rank waits for the others in a checkpoint
            collective. A rank that died or hung makes every other rank's save
            fail with ``CheckpointSaveError`` after at most this long.
        storage: the primary tier (a ``stalwart.storage.CheckpointStorage``;
            None: ``LocalStorage(directory)``). Every rank must see the same
            storage: rank 0 publishes, every rank writes into its staging.

    With torch.distributed initialized, every rank creates its manager (the
    constructor is collective) and calls ``save`` and ``restore`` at the same
    steps. Rank 0 of the group holds the directory lock, writes the manifest,
    commits, applies retention and writes ``events.jsonl``; every rank writes its
    own shard of the state. Coordination runs on dedicated gloo groups, never on
    the training group.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int | Literal["auto"] | None = None,
        every_seconds: float | None = None,
        mtbf_seconds: float | None = None,
        grace_seconds: float | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = False,
        durable: str | DurableConfig | None = None,
        metadata: Mapping[str, Any] | None = None,
        config: Any = None,
        process_group: Any = None,
        handle_signals: bool = True,
        save_timeout: float = 600.0,
        storage: CheckpointStorage | None = None,
    ) -> None:
        local_dir, self.durable, keep_last, keep_every = resolve_directory(
            directory, durable, keep_last, keep_every
        )
        self.save_policy = SavePolicy(
            every_steps=every_steps, every_seconds=every_seconds, mtbf_seconds=mtbf_seconds
        )
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
        check_grace(grace_seconds)  # before the run directory is locked
        self.durable_retention = (
            None if self.durable is None else self.durable.retention(keep_last, keep_every)
        )
        if not (isinstance(save_timeout, (int, float)) and save_timeout > 0):
            raise ValueError(
                f"save_timeout must be a positive number of seconds, got {save_timeout!r}"
            )
        if storage is not None and not isinstance(storage, CheckpointStorage):
            raise TypeError(
                "storage must implement stalwart.storage.CheckpointStorage (begin, commit, "
                f"abort, path_of, step_path, scan, committed_steps, quarantine, delete), got "
                f"{type(storage).__name__}"
            )
        self.directory = local_dir
        self.storage: CheckpointStorage = (
            storage if storage is not None else LocalStorage(local_dir)
        )
        self.process_group = process_group
        self._provenance = Provenance(metadata=metadata, config=config)
        self.metadata, self.config = self._provenance.metadata, self._provenance.config
        self.config_hash = self._provenance.config_hash
        # Collective from here on: every rank builds its manager in the same order.
        self._coord = Coordinator.create(process_group, timeout=save_timeout, name="checkpoint")
        # The background writer gets a group of its own: two threads must never
        # interleave collectives on one group.
        self._async_coord = (
            Coordinator.create(process_group, timeout=save_timeout, name="async checkpoint")
            if async_save
            else None
        )
        self.rank = self._coord.rank
        self.world_size = self._coord.world_size
        self.is_leader = self._coord.is_leader
        self._lock = RunLock(self.directory)
        self.durable_url = (
            None if self.durable is None else redact_url(self.durable.url).rstrip("/")
        )
        opened = self._open_run()
        self.events = EventLog(
            self.directory / EVENTS_NAME if self.is_leader else None, rank=self.rank
        )
        self._certificate = Certificate(self.directory, rank=self.rank, world_size=self.world_size)
        self._writer = SaveWriter(
            self.storage,
            self._coord,
            self.events,
            self._provenance,
            retention=self.retention,
            async_coord=self._async_coord,
        )
        self._saver = self._writer.background
        self.async_save = async_save
        self._closed = False
        self.resharded: bool | None = None
        """After ``restore``: True when the checkpoint was written at another world size."""
        self.heartbeats: list[Callable[[int], None]] = []
        """Called with the step at the start of every ``save`` (``stalwart.Watchdog`` registers here)."""
        self._signals = PreemptionSignals()
        self._grace = GracePlanner(grace_seconds, self._writer, self._signals)
        self._auto = ContinuousSchedule(self.save_policy, self._writer, self._grace.times)
        self._preempted = False
        if handle_signals:
            self._signals.install()
        self.events.emit(
            "open",
            directory=str(self.directory),
            world_size=self.world_size,
            async_save=async_save,
            every_steps=every_steps,
            every_seconds=every_seconds,
            mtbf_seconds=mtbf_seconds,
            grace_seconds=grace_seconds,
            keep_last=keep_last,
            keep_every=keep_every,
            durable=self.durable_url,
        )
        self.tiers: TierSync | None = None
        """The link to the durable tier, on the rank that commits (None: no tier, or another rank)."""
        if opened is not None:
            assert self.durable is not None and self.durable_retention is not None
            tier, durable_steps, down = opened
            self.tiers = TierSync(
                tier,
                self.storage,
                self.events,
                self.durable,
                retention=self.durable_retention,
                durable_steps=durable_steps,
                down=down,
                on_durable=self._writer.apply_retention,
            )
            self._writer.tiers = self.tiers

    # ------------------------------------------------------------------ setup

    def _open_run(self) -> Any:
        """Every rank checks the directory; rank 0 locks it and opens the durable tier. Collective.

        Returns rank 0's ``open_durable`` result (None elsewhere, or without a
        tier). Any failure on any rank fails the constructor on every rank.
        """

        def open_here() -> Any:
            self._prepare_directory()
            if not self.is_leader:
                return None
            self._lock.acquire()
            return None if self.durable is None else open_durable(self.durable)

        try:
            return self._coord.agree(
                open_here,
                catch=(OSError, StalwartError, ValueError, ImportError),
                remote=lambda rep: CheckpointSaveError(
                    f"rank {rep.rank} cannot use {self.directory}: {rep.kind}: {rep.message}"
                ),
            )
        except BaseException:
            self._lock.release()
            for coord in (self._coord, self._async_coord):
                if coord is not None:
                    coord.destroy()
            raise

    def _prepare_directory(self) -> None:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise NotADirectoryError(
                f"checkpoint directory {d} exists and is a file; pass a directory path "
                "(it is created if missing)"
            )
        try:
            d.mkdir(parents=True, exist_ok=True)
        except PermissionError as exc:
            raise PermissionError(
                f"cannot create checkpoint directory {d}: permission denied; choose a directory "
                "you can write, or fix its parent's permissions"
            ) from exc
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(
                f"checkpoint directory {d} is not writable by this user (uid {os.getuid()}); "
                "fix its permissions or choose another directory"
            )

    # ---------------------------------------------------------------- queries

    @property
    def preempted(self) -> bool:
        """True once a preemption signal was handled by a ``save``; the loop should stop.

        It turns true on every rank at the same ``save`` call (the ranks agree
        there, with one small all-reduce), after that call did its emergency
        save (or skipped it: ``grace_seconds``), so a loop that breaks on it
        right after ``save`` never leaves before that. A signal's arrival is
        ``stalwart.signals.preemption_requested()``, for long sub-loops.
        """
        return self._preempted

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first, once retention's deletions are done (not verified)."""
        self._writer.deletions.wait()
        return self.storage.committed_steps()

    def latest_step(self) -> int | None:
        return max(self.all_steps(), default=None)

    def rollback(self, step: int) -> list[int]:
        """Set the steps after ``step`` aside, kept (and delete them from the durable tier),
        for training to go on from ``step``; returns them. Collective. ``stalwart.rollback``."""
        self._check_open()
        self.wait()
        return rollback_run(
            self._coord, self._certificate, self.directory, step, self.events, self.tiers
        )

    def should_save(self, step: int) -> bool:
        """Whether the policy (or a pending preemption) asks for a save at ``step``, on this rank.

        Local and cheap; ``save`` decides with all ranks together.
        """
        if self._preempted or self._signals.is_set():
            return True
        since = time.monotonic() - self._writer.last_save_time
        return self._auto.due(step, seconds_since_last=since)

    # ------------------------------------------------------------------- save

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        force: bool = False,
        metrics: Mapping[str, Any] | None = None,
    ) -> bool:
        """Write a checkpoint of ``state`` at ``step`` if the policy (or ``force``) says so.

        Returns True when a checkpoint was written (sync) or handed to the
        background writer (async). Blocks for the whole save when sync, and only
        for the staging copy when async. Raises ``CheckpointSaveError`` if this
        save, or an earlier background save, failed; earlier checkpoints are
        never damaged by a failed save.

        Every call, saving or not, also records the fingerprint of the step
        that just ended for the exact-resume certificate (the ``loss`` metrics,
        the batch digest of a ``ResumableDataLoader`` given as ``data=``, the
        RNG digest; see ``stalwart.certificate``), so call it every step and
        report the step's loss in ``metrics``. After a ``restore`` the redone
        steps are compared with the lost run's; see :attr:`resume_verdict`.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a stalwart.TrainState, got {type(state).__name__}")
        metrics_json = to_json_data(dict(metrics or {}), what="metrics")
        for beat in self.heartbeats:
            beat(step)
        if self._saver is not None and not self._saver.busy:
            self._saver.wait()  # surface a failure of the previous background save now
        uploader = None if self.tiers is None else self.tiers.uploader
        self._certificate.record(step, state.components.get("data"), metrics_json)
        due_here = force or self.should_save(step)
        try:
            # Collective 1 of a save, on every call: the save decision, preemption,
            # upload health and the resume certificate's progress in one all-reduce.
            mine = _SaveVote(
                self._signals.is_set(),
                due_here,
                uploader is not None and uploader.failed,
                self._grace.vote(),
            )
            reduced = self._coord.max_ints(*mine, *self._certificate.flags())
            agreed = _SaveVote(*reduced[: len(mine)])
            self._settle_certificate(*reduced[len(mine) :])
        except CoordinationError as exc:
            raise peer_failure(self.events, step if due_here else None, exc) from None
        if agreed.upload_failed:
            # Every rank stops here together; rank 0 has the reason.
            if uploader is not None:
                uploader.raise_error()
            raise CheckpointSaveError(
                f"saving step {step} refused: an upload to the durable tier failed on rank 0 "
                "(see its error and events.jsonl)"
            )
        emergency = bool(agreed.signalled) and not self._preempted
        self._preempted = self._preempted or emergency
        if not (agreed.due or emergency) or (
            emergency and not self._grace.carry_out(agreed.grace, step)
        ):
            return False
        self._auto.save_starting(step)
        return self._writer.save(step, state, metrics_json, emergency=emergency)

    # ---------------------------------------------------------------- restore

    def restore(
        self, state: TrainState, *, step: int | None = None, strict: bool = True
    ) -> int | None:
        """Load the newest committed checkpoint that verifies (or ``step``) into ``state``.

        Returns the step restored, or None when the run has no committed
        checkpoint. Every file is checked against the manifest before anything
        is deserialized; a bad checkpoint is skipped (logged with the reason, in
        ``events.jsonl`` too, and moved aside as ``.step_….corrupt-…``) for the
        next older one; if all failed, one in a way that may pass (a read error),
        a transient ``CheckpointCorruptError`` is raised and all are kept. With
        ``step``, a bad checkpoint raises ``CheckpointCorruptError`` instead, and
        a missing one ``CheckpointNotFoundError``. ``strict=False`` loads only
        the keys both the state and the checkpoint have.
        """
        self._check_open()
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a stalwart.TrainState, got {type(state).__name__}")
        self.wait()
        try:
            return self._restore(state, step=step, strict=strict)
        except CoordinationError as exc:
            error = CheckpointCorruptError(
                f"restoring from {self.directory} failed: {exc}", transient=True
            )
            self.events.emit("restore_failed", logging.ERROR, step=step, error=str(error))
            raise error from None
        except (StalwartError, OSError, ValueError, TypeError) as exc:
            self.events.emit(
                "restore_failed", logging.ERROR, step=step, error=f"{type(exc).__name__}: {exc}"
            )
            raise

    def _restore(self, state: TrainState, *, step: int | None, strict: bool) -> int | None:
        walk = RestoreWalk(
            self.storage,
            self._coord,
            self.events,
            tiers=self.tiers,
            directory=self.directory,
            durable_url=self.durable_url,
        )
        restored = walk.run(state, step=step, strict=strict)
        if restored is None:
            return None
        self.resharded = restored.resharded
        self._certificate.expect(restored.step)
        warn_if_ddp_resume_inexact(self.events, state, self.world_size)
        self._writer.last_save_time = time.monotonic()
        self._writer.last_saved_step = restored.step
        return restored.step

    # ------------------------------------------------------------ certificate

    @property
    def resume_verdict(self) -> Verdict | None:
        """The exact-resume certificate of the last ``restore``, once the ranks agreed on it.

        ``verdict.event`` is ``"resume_verified"`` (the redone steps matched the
        lost attempt's fingerprints through ``verdict.through``),
        ``"resume_diverged"`` (``verdict.divergence`` says where and why) or
        ``"resume_unverified"`` (nothing to compare, ``verdict.reason``);
        ``verdict.line()`` is the one-line summary. None before a restore and
        while the redone steps are still being compared.
        """
        return self._certificate.verdict

    def _settle_certificate(self, diverged: int, pending: int, through: int) -> None:
        verdict = self._certificate.settle(diverged, pending, through, self._coord.all_gather)
        if verdict is not None:
            self._emit_verdict(verdict)

    def _emit_verdict(self, verdict: Verdict) -> None:
        if not self.is_leader:
            return  # the verdict is the same on every rank: one event, one warning
        level = logging.WARNING if verdict.event == "resume_diverged" else logging.INFO
        self.events.emit(verdict.event, level, **verdict.fields())

    # -------------------------------------------------------------- lifecycle

    def wait(self) -> None:
        """Wait for an in-flight async save (raising its error) and for retention's deletions."""
        self._writer.wait()

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Block until every checkpoint queued for upload is in the durable tier.

        Returns True when nothing is left to upload, False when ``timeout``
        seconds passed first. Raises ``CheckpointSaveError`` (for example
        ``CommitConflictError``) when an upload failed in a way retrying cannot
        fix. Without a durable tier, and on ranks other than 0 (rank 0
        uploads), it only waits for an in-flight async save.
        """
        self._check_open()
        self.wait()
        if self.tiers is None:
            return True
        return self.tiers.uploader.wait(timeout)

    @property
    def last_durable_step(self) -> int | None:
        """Newest step known to be committed in the durable tier (None: none yet, or no tier)."""
        return None if self.tiers is None else self.tiers.uploader.last_durable_step

    @property
    def pending_uploads(self) -> list[int]:
        """Committed steps queued for, or being, uploaded to the durable tier (oldest first)."""
        return [] if self.tiers is None else self.tiers.uploader.pending

    def close(self) -> None:
        """Wait for an in-flight save, remove signal handlers, release the run directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                if self._saver is not None:
                    self._saver.close()
            finally:
                self._writer.deletions.wait()
                if self.tiers is not None:
                    self.tiers.close(self.latest_step(), self.directory)
        finally:
            self._signals.uninstall()
            self._lock.release()
            verdict = self._certificate.finish()
            if verdict is not None:
                self._emit_verdict(verdict)
            self._certificate.close()
            self.events.emit("close")
            for coord in (self._coord, self._async_coord):
                if coord is not None:
                    coord.destroy()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"this CheckpointManager for {self.directory} is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointSaveError as close_exc:
            # Do not mask the error that ended the training loop.
            logger.error("background save failed while handling another error: %s", close_exc)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass
