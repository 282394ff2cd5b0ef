"""CheckpointManager: when to save, what to keep, which checkpoint to restore."""

from __future__ import annotations

import logging
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

from stalwart import distributed
from stalwart.errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointSaveError
from stalwart.events import EVENTS_NAME, EventLog
from stalwart.lock import RunLock
from stalwart.manifest import Manifest, git_info, stable_hash, to_json_data
from stalwart.pipeline import (
    AsyncSaver,
    SaveResult,
    load_checkpoint,
    stage_state_dict,
    write_and_commit,
)
from stalwart.policy import RetentionPolicy, SavePolicy
from stalwart.state import TrainState
from stalwart.storage.local import LocalStorage

__all__ = ["CheckpointManager"]

logger = logging.getLogger("stalwart")

_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")


def _stalwart_version() -> str:
    from stalwart import __version__

    return __version__


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
        keep_last / keep_every: retention. The newest ``keep_last`` committed
            checkpoints are kept, plus every one whose step is a multiple of
            ``keep_every``; the newest is never deleted, and nothing is deleted
            before the new checkpoint is committed. ``keep_last=None`` keeps all.
        async_save: stage the state into memory and write it in a background
            thread; ``save`` returns after the copy.
        durable: a second, durable tier (object store URL). Not available in
            this version; passing it raises ``NotImplementedError``.
        metadata: JSON data recorded in every manifest (dataset version, ...).
        config: the run's configuration (dict, dataclass or argparse Namespace),
            recorded in every manifest with a stable hash.
        process_group: the group to coordinate ranks on (None: the default group
            when torch.distributed is initialized).
        handle_signals: on SIGTERM or SIGUSR1, set ``preempted`` and make the next
            ``save`` write a checkpoint whatever the policy says (so a preempted
            job loses nothing). The handlers are installed only in the main
            thread and removed by ``close``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = False,
        durable: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        config: Any = None,
        process_group: Any = None,
        handle_signals: bool = True,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        self.save_policy = SavePolicy(every_steps=every_steps, every_seconds=every_seconds)
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
        if durable is not None:
            raise NotImplementedError(
                f"durable={durable!r}: the durable object-store tier is not part of this stalwart "
                "version; checkpoints stay in the local directory"
            )
        if distributed.get_world_size(process_group) > 1:
            raise NotImplementedError(
                "multi-rank checkpointing is not part of this stalwart version; run with one process"
            )
        self.directory = Path(directory)
        self.process_group = process_group
        self.rank = distributed.get_rank(process_group)
        self.world_size = distributed.get_world_size(process_group)
        self.metadata = to_json_data(dict(metadata or {}), what="metadata")
        self.config = None if config is None else to_json_data(config, what="config")
        self.config_hash = None if config is None else stable_hash(self.config)
        self._prepare_directory()
        self.storage = LocalStorage(self.directory)
        self._lock = RunLock(self.directory)
        self._lock.acquire()
        self.events = EventLog(self.directory / EVENTS_NAME, rank=self.rank)
        self._saver = AsyncSaver() if async_save else None
        self.async_save = async_save
        self._closed = False
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._code = git_info(sys.argv[0] if sys.argv and sys.argv[0] else os.getcwd())
        self._preempted = threading.Event()
        self._old_handlers: dict[int, Any] = {}
        if handle_signals:
            self._install_signal_handlers()
        self.events.emit(
            "open",
            directory=str(self.directory),
            async_save=async_save,
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            keep_every=keep_every,
        )

    # ------------------------------------------------------------------ setup

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

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in _PREEMPTION_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only set a flag: the handler runs between bytecodes of the training loop,
        # and saving from here could interleave with a half-done optimizer step.
        self._preempted.set()

    # ---------------------------------------------------------------- queries

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived; the loop should save and stop."""
        return self._preempted.is_set()

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (not verified; ``restore`` verifies)."""
        return self.storage.committed_steps()

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would write (policy or a pending preemption)."""
        if self.preempted:
            return True
        since = time.monotonic() - self._last_save_time
        return self.save_policy.due(step, seconds_since_last=since)

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
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a stalwart.TrainState, got {type(state).__name__}")
        if not (force or self.should_save(step)):
            return False
        metrics_json = to_json_data(dict(metrics or {}), what="metrics")
        if self._saver is not None and self._saver.busy is False:
            self._saver.wait()  # surface a failure of the previous background save now
        if step == self._last_saved_step or step in self.storage.committed_steps():
            self.events.emit(
                "save_skipped",
                logging.WARNING,
                step=step,
                reason="a checkpoint of this step already exists; checkpoints are never overwritten",
            )
            return False
        t0 = time.perf_counter()
        state_dict = state.state_dict()
        manifest = Manifest(
            step=step,
            files=[],
            world_size=self.world_size,
            epoch=state.epoch,
            metadata=self.metadata,
            config=self.config,
            config_hash=self.config_hash,
            code=self._code,
            versions={
                "stalwart": _stalwart_version(),
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            hostname=socket.gethostname(),
            metrics=metrics_json,
            topology={
                "world_size": self.world_size,
                "ranks": {"0": {"host": socket.gethostname()}},
            },
        )
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        if self._saver is None:
            try:
                result = write_and_commit(self.storage, state_dict, manifest)
            except CheckpointSaveError as exc:
                self.events.emit("save_failed", logging.ERROR, step=step, error=str(exc))
                self._last_saved_step = None
                raise
            stall = time.perf_counter() - t0
            self._after_commit(result, stall_s=stall, stage_s=0.0, total_s=stall)
            return True
        staged = stage_state_dict(state_dict)
        del state_dict
        stall = time.perf_counter() - t0

        def job() -> SaveResult:
            try:
                result = write_and_commit(self.storage, staged, manifest)
            except CheckpointSaveError as exc:
                self.events.emit("save_failed", logging.ERROR, step=step, error=str(exc))
                raise
            self._after_commit(
                result, stall_s=stall, stage_s=stall, total_s=time.perf_counter() - t0
            )
            return result

        self._saver.submit(job)
        return True

    def _after_commit(
        self, result: SaveResult, *, stall_s: float, stage_s: float, total_s: float
    ) -> None:
        self.events.emit(
            "save",
            step=result.step,
            path=str(result.path),
            bytes=result.bytes,
            files=result.files,
            async_save=self.async_save,
            stall_s=round(stall_s, 6),
            stage_s=round(stage_s, 6),
            total_s=round(total_s, 6),
            throughput_MBps=round(
                result.bytes / 1e6 / max(result.write_s + result.checksum_s, 1e-9), 1
            ),
            **result.timings(),
        )
        self._apply_retention()

    def _apply_retention(self) -> None:
        for step in self.retention.to_delete(self.storage.committed_steps()):
            try:
                self.storage.delete(step)
            except OSError as exc:
                # A failed deletion costs disk space, never a checkpoint; keep training.
                self.events.emit("delete_failed", logging.WARNING, step=step, error=str(exc))
            else:
                self.events.emit("delete", step=step, reason="retention")

    # ---------------------------------------------------------------- restore

    def restore(
        self, state: TrainState, *, step: int | None = None, strict: bool = True
    ) -> int | None:
        """Load the newest committed checkpoint that verifies (or ``step``) into ``state``.

        Returns the step restored, or None when the run has no committed
        checkpoint. Every file is checked against the manifest before anything
        is deserialized; a bad checkpoint is skipped (logged with the reason, in
        ``events.jsonl`` too, and moved aside as ``.step_….corrupt-…``) for the
        next older one. With ``step``, a bad checkpoint raises
        ``CheckpointCorruptError`` instead, and a missing one
        ``CheckpointNotFoundError``. ``strict=False`` loads only the keys both
        the state and the checkpoint have.
        """
        self._check_open()
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a stalwart.TrainState, got {type(state).__name__}")
        self.wait()
        entries = self.storage.scan()
        committed = [e.step for e in entries if e.status == "committed" and e.step is not None]
        if step is not None:
            if step not in committed:
                shown = ", ".join(map(str, committed[-10:])) or "none"
                raise CheckpointNotFoundError(
                    f"no committed checkpoint of step {step} in {self.directory} (committed steps: {shown})"
                )
            candidates = [step]
        else:
            candidates = sorted(committed, reverse=True)
        for candidate in candidates:
            path = self.storage.step_path(candidate)
            t0 = time.perf_counter()
            try:
                manifest = load_checkpoint(path, state, strict=strict)
            except CheckpointCorruptError as exc:
                self.events.emit(
                    "restore_skipped",
                    logging.WARNING,
                    step=candidate,
                    reason=str(exc),
                    file=exc.path,
                )
                if step is not None:
                    raise
                if not isinstance(exc.__cause__, OSError):
                    # Definitely bad content (not a transient read error): move it aside so
                    # retention and later saves of this step are not confused by it.
                    aside = self.storage.quarantine(candidate)
                    self.events.emit("quarantine", step=candidate, path=str(aside))
                continue
            elapsed = time.perf_counter() - t0
            newer = [s for s in committed if s > candidate]
            self.events.emit(
                "restore",
                step=candidate,
                seconds=round(elapsed, 6),
                bytes=manifest.total_bytes,
                world_size=manifest.world_size,
                exact=manifest.world_size == self.world_size,
                newer_steps=newer,
            )
            self._last_save_time = time.monotonic()
            self._last_saved_step = candidate
            return candidate
        incomplete = [e.name for e in entries if e.status == "incomplete"]
        self.events.emit(
            "restore_none",
            reason="no committed checkpoint verified" if candidates else "no committed checkpoint",
            incomplete=incomplete,
        )
        return None

    # -------------------------------------------------------------- lifecycle

    def wait(self) -> None:
        """Block until an in-flight async save is committed; raise its error if it failed."""
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        """Wait for an in-flight save, remove signal handlers, release the run directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._saver is not None:
                self._saver.close()
        finally:
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
            self._old_handlers.clear()
            self._lock.release()
            self.events.emit("close")

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
