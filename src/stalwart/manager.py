"""CheckpointManager: when to save, what to keep, which checkpoint to restore."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

from stalwart.certificate import Certificate, Verdict
from stalwart.distributed import Coordinator
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CoordinationError,
    DurableStoreError,
    StalwartError,
    UnsupportedFormatError,
)
from stalwart.events import EVENTS_NAME, EventLog
from stalwart.lock import RunLock
from stalwart.manifest import MANIFEST_NAME, Manifest, git_info, stable_hash, to_json_data
from stalwart.pipeline import (
    AsyncSaver,
    SaveResult,
    StagingArea,
    load_checkpoint,
    write_and_commit,
)
from stalwart.policy import RetentionPolicy, SavePolicy
from stalwart.progress import progress_bar
from stalwart.redact import redact_url
from stalwart.state import TrainState
from stalwart.storage.durable import DurableTier
from stalwart.storage.local import LocalStorage, step_dir_name
from stalwart.storage.remote import RetryPolicy, is_url
from stalwart.upload import Uploader

__all__ = ["CheckpointManager"]

logger = logging.getLogger("stalwart")

_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
_SAME = object()
"""Default of the durable retention arguments: the same as the local ones."""


def local_cache_dir(url: str) -> Path:
    """The node-local directory that stages checkpoints for ``directory=<URL>``.

    Stable per URL (and user), so a restarted job on the same node finds the
    checkpoints it already has instead of downloading them again.
    """
    import hashlib

    base = Path(os.environ.get("STALWART_LOCAL_DIR") or tempfile.gettempdir())
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    tail = "".join(c if c.isalnum() or c in "-_." else "_" for c in url.split("://", 1)[1])
    return base / f"stalwart-{os.getuid()}" / f"{tail[-48:]}-{digest}"


def _stalwart_version() -> str:
    from stalwart import __version__

    return __version__


def _layout(module: torch.nn.Module, world_size: int) -> str:
    """How one module is laid out across ranks: ddp, fsdp2, replicated or plain."""
    if any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in module.modules()):
        return "ddp"  # also a container (nn.ModuleDict) of DDP-wrapped modules
    if any(type(p).__name__ == "DTensor" for p in module.parameters()):
        return "fsdp2"
    # An unwrapped module: every rank holds all of it (an EMA copy, a frozen teacher).
    return "replicated" if world_size > 1 else "plain"


def _module_layouts(state: TrainState, world_size: int) -> dict[str, str]:
    """The layout of every module of ``state`` by its section (``model``, ``model.G``, ``ema``)."""
    return {name: _layout(module, world_size) for name, module in state.modules.items()}


def _parallelism(state: TrainState, world_size: int = 1) -> str:
    """The layout of the trained model (``model=``), for the manifest: one word, or ``mixed``."""
    layouts = _module_layouts(state, world_size)
    main = {v for k, v in layouts.items() if k == "model" or k.startswith("model.")}
    kinds = main or set(layouts.values())
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


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
        durable: a durable tier: an object-store URL (``s3://bucket/prefix``,
            ``gs://…``, ``az://…``, or any fsspec URL). Every committed
            checkpoint (every ``durable_every``-th) is uploaded in the
            background; ``save`` never waits for the network. ``restore`` takes
            the newest checkpoint that verifies in either tier, downloading it
            when the local copy is missing or bad. ``directory`` may itself be
            such a URL: checkpoints are then staged in a node-local directory
            (``$STALWART_LOCAL_DIR`` or the temp dir) and uploaded.
        durable_every: upload every n-th committed checkpoint (emergency
            checkpoints and the last one before ``close`` always).
        durable_keep_last / durable_keep_every: retention in the durable tier
            (default: the same as ``keep_last`` / ``keep_every``).
        durable_options: options of the store client (obstore config keys such
            as ``endpoint`` or ``region``; fsspec storage options), for settings
            the environment does not give. Credentials are best left to the
            environment; values given here never appear in logs or errors.
        durable_max_pending: checkpoints that may wait for upload while the
            durable tier is slow or down; local retention keeps them.
        durable_retry: timeouts and backoff of object-store requests
            (``stalwart.RetryPolicy``; by default each request has 120 s, and one
            upload keeps retrying a failing store for 15 minutes with
            exponential backoff and jitter before it is reported as an
            ``upload_failed`` event and tried again later).
        durable_close_timeout: seconds ``close`` waits for uploads in progress
            (None: as long as it takes). Steps still pending are uploaded by the
            next run that opens the same directory.
        metadata: JSON data recorded in every manifest (dataset version, ...).
        config: the run's configuration (dict, dataclass or argparse Namespace),
            recorded in every manifest with a stable hash.
        process_group: the group to coordinate ranks on (None: the default group
            when torch.distributed is initialized).
        handle_signals: on SIGTERM or SIGUSR1, set ``preempted`` and make the next
            ``save`` write a checkpoint whatever the policy says (so a preempted
            job loses nothing). The handlers are installed only in the main
            thread and removed by ``close``.
        save_timeout: seconds a rank waits for the others in a checkpoint
            collective. A rank that died or hung makes every other rank's save
            fail with ``CheckpointSaveError`` after at most this long.

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
        save_timeout: float = 600.0,
        durable_every: int = 1,
        durable_keep_last: Any = _SAME,
        durable_keep_every: Any = _SAME,
        durable_options: Mapping[str, Any] | None = None,
        durable_max_pending: int = 2,
        durable_retry: RetryPolicy | None = None,
        durable_close_timeout: float | None = 600.0,
    ) -> None:
        if is_url(directory) and not str(directory).startswith("file://"):
            url = str(directory)
            if durable is not None and durable != url:
                raise ValueError(
                    f"directory is the URL {redact_url(url)!r} and durable is "
                    f"{redact_url(str(durable))!r}: give one URL (directory=URL alone), or a "
                    "local directory plus durable=URL"
                )
            durable = url
            directory = local_cache_dir(redact_url(url))
            # The local copy only stages uploads; the durable tier keeps the history.
            if durable_keep_last is _SAME:
                durable_keep_last = keep_last
            if durable_keep_every is _SAME:
                durable_keep_every = keep_every
            keep_last, keep_every = 1, None
        elif is_url(directory):
            directory = str(directory)[len("file://") :]
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        self.save_policy = SavePolicy(every_steps=every_steps, every_seconds=every_seconds)
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
        if durable is not None and not is_url(durable):
            raise ValueError(
                "durable must be an object-store URL such as 's3://bucket/prefix', "
                f"got {redact_url(str(durable))!r}"
            )
        self.durable_retention = RetentionPolicy(
            keep_last=keep_last if durable_keep_last is _SAME else durable_keep_last,
            keep_every=keep_every if durable_keep_every is _SAME else durable_keep_every,
        )
        if (
            isinstance(durable_every, bool)
            or not isinstance(durable_every, int)
            or durable_every < 1
        ):
            raise ValueError(f"durable_every must be a positive integer, got {durable_every!r}")
        self.durable_every = durable_every
        if durable_retry is not None and not isinstance(durable_retry, RetryPolicy):
            raise TypeError(
                f"durable_retry must be a stalwart.RetryPolicy, got {type(durable_retry).__name__}"
            )
        self._durable_retry = durable_retry or RetryPolicy()
        self._durable_close_timeout = durable_close_timeout
        if not (isinstance(save_timeout, (int, float)) and save_timeout > 0):
            raise ValueError(
                f"save_timeout must be a positive number of seconds, got {save_timeout!r}"
            )
        self.directory = Path(directory)
        self.process_group = process_group
        self.metadata = to_json_data(dict(metadata or {}), what="metadata")
        self.config = None if config is None else to_json_data(config, what="config")
        self.config_hash = None if config is None else stable_hash(self.config)
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
        self.tier: DurableTier | None = None
        """The durable tier (on the rank that commits), or None."""
        durable_steps: list[int] | None = None
        durable_down: str | None = None
        self.durable_url = None if durable is None else redact_url(durable).rstrip("/")
        error: BaseException | None = None
        try:
            self._prepare_directory()
            if self.is_leader:
                self._lock.acquire()
                if durable is not None:
                    self.tier = DurableTier(
                        durable, options=durable_options, retry=self._durable_retry
                    )
                    durable_steps, durable_down = self._probe_durable(self.tier)
        except (OSError, StalwartError, ValueError, ImportError) as exc:
            error = exc
            if self.is_leader:
                self._lock.release()
        reports = self._coord.all_gather(
            None if error is None else f"{type(error).__name__}: {error}"
        )
        if error is not None:
            self._coord.destroy()
            raise error
        for rank, report in enumerate(reports):
            if report is not None:
                self._lock.release()
                raise CheckpointSaveError(f"rank {rank} cannot use {self.directory}: {report}")
        self.storage = LocalStorage(self.directory)
        self.events = EventLog(
            self.directory / EVENTS_NAME if self.is_leader else None, rank=self.rank
        )
        self._certificate = Certificate(self.directory, rank=self.rank, world_size=self.world_size)
        self._saver = AsyncSaver() if async_save else None
        self._uploader: Uploader | None = None
        self._commits = 0
        self._staging = StagingArea()
        self.async_save = async_save
        self._closed = False
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._hosts: list[str] | None = None
        self.resharded: bool | None = None
        """After ``restore``: True when the checkpoint was written at another world size."""
        self._code = git_info(sys.argv[0] if sys.argv and sys.argv[0] else os.getcwd())
        self._signalled = threading.Event()
        self._preempted = False
        self._old_handlers: dict[int, Any] = {}
        if handle_signals:
            self._install_signal_handlers()
        self.events.emit(
            "open",
            directory=str(self.directory),
            world_size=self.world_size,
            async_save=async_save,
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            keep_every=keep_every,
            durable=self.durable_url,
        )
        if self.tier is not None:
            self._start_uploads(durable_max_pending, durable_steps, durable_down)

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

    @staticmethod
    def _probe_durable(tier: DurableTier) -> tuple[list[int] | None, str | None]:
        """List the durable tier once, briefly: refusals raise now, an outage only warns."""
        probe = RetryPolicy(
            deadline=10.0, initial_backoff=0.2, max_backoff=2.0, request_timeout=10.0
        )
        try:
            return tier.committed_steps(retry=probe), None
        except DurableStoreError as exc:
            if not exc.transient:
                raise DurableStoreError(
                    f"the durable tier {tier.url} refuses this run: {exc}; check the bucket, "
                    "the credentials and the permissions",
                    transient=False,
                ) from None
            return None, str(exc)

    def _start_uploads(
        self, max_pending: int, durable_steps: list[int] | None, down: str | None
    ) -> None:
        """Start the upload thread and queue what an earlier run left behind."""
        assert self.tier is not None
        if down is not None:
            # Down for now: train anyway, uploads catch up when it returns.
            self.events.emit("durable_unreachable", logging.WARNING, error=down)
        self._uploader = Uploader(
            self.tier,
            self.storage,
            self.events,
            retention=self.durable_retention,
            max_pending=max_pending,
            on_durable=self._apply_retention,
        )
        local = self.storage.committed_steps()
        if durable_steps:
            self._uploader.last_durable_step = durable_steps[-1]
            behind = [s for s in local if s > durable_steps[-1]]
        else:
            behind = local[-1:]
        for step in behind:
            self._uploader.enqueue(step)

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
        self._signalled.set()

    # ---------------------------------------------------------------- queries

    @property
    def preempted(self) -> bool:
        """True once a preemption signal reached any rank; the loop should stop.

        In a single process it turns true as soon as the signal arrives. With
        several ranks it turns true on every rank at the same ``save`` call (the
        ranks agree on it there, with one small all-reduce), after that call
        wrote the emergency checkpoint.
        """
        if not self._coord.distributed:
            return self._preempted or self._signalled.is_set()
        return self._preempted

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (not verified; ``restore`` verifies)."""
        return self.storage.committed_steps()

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether the policy (or a pending preemption) asks for a save at ``step``, on this rank.

        Local and cheap; ``save`` decides with all ranks together.
        """
        if self._preempted or self._signalled.is_set():
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
        if self._saver is not None and not self._saver.busy:
            self._saver.wait()  # surface a failure of the previous background save now
        upload_failed = self._uploader is not None and self._uploader.failed
        self._certificate.record(step, state.components.get("data"), metrics_json)
        due_here = force or self.should_save(step)
        try:
            # One all-reduce per call: the save decision, preemption, upload health and
            # the resume certificate's progress travel together.
            reduced = self._coord.max_ints(
                self._signalled.is_set(), due_here, upload_failed, *self._certificate.flags()
            )
            signalled, due, upload_failed = (bool(v) for v in reduced[:3])
            diverged, pending, through = reduced[3:]
            self._settle_certificate(diverged, pending, through)
        except CoordinationError as exc:
            raise self._peer_failure(step if due_here else None, exc) from None
        if upload_failed:
            # Every rank stops here together; rank 0 has the reason.
            if self._uploader is not None:
                self._uploader.raise_error()
            raise CheckpointSaveError(
                f"saving step {step} refused: an upload to the durable tier failed on rank 0 "
                "(see its error and events.jsonl)"
            )
        emergency = signalled and not self._preempted
        if signalled:
            self._preempted = True
        if not (due or emergency):
            return False
        exists = step == self._last_saved_step or step in self.storage.committed_steps()
        try:
            exists = self._coord.broadcast(exists)
        except CoordinationError as exc:
            raise self._peer_failure(step, exc) from None
        if exists:
            self.events.emit(
                "save_skipped",
                logging.WARNING,
                step=step,
                reason="a checkpoint of this step already exists; checkpoints are never overwritten",
            )
            return False
        if self._saver is not None:
            # At most one save in flight: wait for the previous one before staging
            # this one, and report its failure before this step is taken on.
            self._saver.wait()
        t0 = time.perf_counter()
        # Collecting (and, async, staging) the state can fail on one rank only; the
        # ranks agree on that before any of them starts writing.
        local_error: Exception | None = None
        staged: dict[str, Any] = {}
        digests: dict[str, str] = {}
        try:
            staged = state.state_dict()
            if self._saver is not None:
                staged = self._staging.stage(staged)
            digests = state.rank_digests(staged)
        except Exception as exc:
            local_error = exc
        try:
            # One gather carries both each rank's error and the digests of its
            # values that may differ between ranks (buffers, extra, stateful objects).
            gathered = self._coord.all_gather(
                (
                    None if local_error is None else f"{type(local_error).__name__}: {local_error}",
                    digests,
                )
            )
            reports = [report for report, _ in gathered]
            manifest = self._manifest(step, state, metrics_json)
        except CoordinationError as exc:
            raise self._peer_failure(step, exc) from None
        if local_error is not None:
            self.events.emit("save_failed", logging.ERROR, step=step, error=str(local_error))
            if isinstance(local_error, (TypeError, ValueError)):
                raise local_error  # a mistake in what the user put in the state: show it as is
            raise CheckpointSaveError(
                f"saving step {step} failed: collecting the state raised "
                f"{type(local_error).__name__}: {local_error}"
            ) from local_error
        for rank, report in enumerate(reports):
            if report is not None:
                self.events.emit(
                    "save_failed", logging.ERROR, step=step, error=report, rank_failed=rank
                )
                raise CheckpointSaveError(
                    f"saving step {step} failed: rank {rank} could not collect its state: {report}"
                )
        staged = state.with_rank_values(staged, [d for _, d in gathered])
        self._last_saved_step = step
        if self._saver is None:
            try:
                result = write_and_commit(self.storage, staged, manifest, coordinator=self._coord)
            except CheckpointSaveError as exc:
                self.events.emit("save_failed", logging.ERROR, step=step, error=str(exc))
                self._last_saved_step = None
                raise
            self._last_save_time = time.monotonic()
            stall = time.perf_counter() - t0
            self._after_commit(
                result, stall_s=stall, stage_s=0.0, total_s=stall, emergency=emergency
            )
            return True
        stall = time.perf_counter() - t0
        self._last_save_time = time.monotonic()
        coord = self._async_coord

        def job() -> SaveResult:
            try:
                result = write_and_commit(self.storage, staged, manifest, coordinator=coord)
            except CheckpointSaveError as exc:
                self.events.emit("save_failed", logging.ERROR, step=step, error=str(exc))
                if self._last_saved_step == step:
                    self._last_saved_step = None
                raise
            self._after_commit(
                result,
                stall_s=stall,
                stage_s=stall,
                total_s=time.perf_counter() - t0,
                emergency=emergency,
            )
            return result

        self._saver.submit(job)
        if emergency:
            # A preempted job may be killed at any moment after the grace period:
            # make the emergency checkpoint durable before returning.
            self._saver.wait()
        return True

    def _manifest(self, step: int, state: TrainState, metrics: dict[str, Any]) -> Manifest:
        if self._hosts is None:
            self._hosts = self._coord.all_gather(socket.gethostname())
        return Manifest(
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
            metrics=metrics,
            topology={
                "world_size": self.world_size,
                "parallelism": _parallelism(state, self.world_size),
                "modules": _module_layouts(state, self.world_size),
                "hosts": {str(r): h for r, h in enumerate(self._hosts)},
            },
        )

    def _after_commit(
        self, result: SaveResult, *, stall_s: float, stage_s: float, total_s: float, emergency: bool
    ) -> None:
        if not self.is_leader:
            return
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
            emergency=emergency,
            **result.timings(),
        )
        self._commits += 1
        if self._uploader is not None and (emergency or self._commits % self.durable_every == 0):
            self._uploader.enqueue(result.step)
        self._apply_retention()

    def _apply_retention(self) -> None:
        guard: contextlib.AbstractContextManager[set[int]] = (
            self._uploader.holding()
            if self._uploader is not None
            else contextlib.nullcontext(set())
        )
        with guard as protected:
            # Never delete locally what is not yet durable (queued or uploading).
            for step in self.retention.to_delete(self.storage.committed_steps()):
                if step in protected:
                    continue
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
        # The leader lists both tiers once, so every rank walks the same candidates.
        entries = self.storage.scan()
        local = [e.step for e in entries if e.status == "committed" and e.step is not None]
        remote: list[int] = []
        if self.tier is not None:
            try:
                remote = self.tier.committed_steps()
            except DurableStoreError as exc:
                self.events.emit("durable_unreachable", logging.WARNING, error=str(exc))
        local, remote = self._coord.broadcast((local, remote))
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
                        coordinator=self._coord,
                    )
                except CheckpointCorruptError as exc:
                    last_error = exc
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
                elapsed = time.perf_counter() - t0
                newer = [s for s in committed if s > candidate]
                self.resharded = manifest.world_size != self.world_size
                # Exactness is the certificate's verdict (resume_verified /
                # resume_diverged) once the redone steps are compared, never claimed here.
                self.events.emit(
                    "restore",
                    step=candidate,
                    source=source,
                    seconds=round(elapsed, 6),
                    bytes=manifest.total_bytes,
                    saved_world_size=manifest.world_size,
                    world_size=self.world_size,
                    same_world_size=not self.resharded,
                    newer_steps=newer,
                )
                self._certificate.expect(candidate)
                self._warn_if_ddp_resume_inexact(state)
                self._last_save_time = time.monotonic()
                self._last_saved_step = candidate
                return candidate
            if step is not None and last_error is not None:
                raise last_error
        incomplete = [e.name for e in entries if e.status == "incomplete"]
        self.events.emit(
            "restore_none",
            reason="no committed checkpoint verified" if candidates else "no committed checkpoint",
            incomplete=incomplete,
        )
        return None

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

    def _peer_failure(self, step: int | None, exc: CoordinationError) -> CheckpointSaveError:
        """The error of a failed ``save`` collective, with its event: what happened first, in one line."""
        message = str(exc)
        if step is not None:
            message += f"; the checkpoint of step {step} was not written"
        self.events.emit("save_failed", logging.ERROR, step=step, error=message)
        return CheckpointSaveError(message)

    def _skip_bad(self, candidate: int, source: str, exc: CheckpointCorruptError) -> None:
        self.events.emit(
            "restore_skipped",
            logging.WARNING,
            step=candidate,
            source=source,
            reason=str(exc),
            file=exc.path,
        )
        if not self.is_leader or exc.transient or not self.storage.step_path(candidate).exists():
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

    def _download(self, step: int) -> None:
        """Rank 0 fetches ``step`` from the durable tier into the local tier; all ranks agree."""
        error: tuple[str, str | None, bool] | None = None
        if self.is_leader:
            assert self.tier is not None
            try:
                self._fetch(self.tier, step)
            except CheckpointCorruptError as exc:
                error = (str(exc), exc.path, exc.transient)
            except (StalwartError, OSError) as exc:
                error = (f"download from {self.durable_url} failed: {exc}", None, True)
        error = self._coord.broadcast(error)
        if error is not None:
            message, path, transient = error
            raise CheckpointCorruptError(message, path=path, transient=transient)

    def _fetch(self, tier: DurableTier, step: int) -> None:
        t0 = time.perf_counter()
        manifest_bytes = tier.manifest_bytes(step)
        source = f"{tier.url}/{step_dir_name(step)}/{MANIFEST_NAME}"
        manifest = Manifest.from_json(manifest_bytes, source=source)
        staging = self.storage.begin(step)
        try:
            with progress_bar(
                manifest.total_bytes, f"stalwart: downloading step {step}", min_bytes=64 * 2**20
            ) as advance:
                tier.download(step, staging, advance=advance, manifest_bytes=manifest_bytes)
            self.storage.commit(staging, step, manifest_bytes.decode("utf-8"))
        except BaseException:
            self.storage.abort(staging)
            raise
        seconds = time.perf_counter() - t0
        self.events.emit(
            "download",
            step=step,
            url=tier.url,
            bytes=manifest.total_bytes,
            seconds=round(seconds, 6),
            throughput_MBps=round(manifest.total_bytes / 1e6 / max(seconds, 1e-9), 1),
        )

    def _warn_if_ddp_resume_inexact(self, state: TrainState) -> None:
        model = state.model
        if not (
            isinstance(model, torch.nn.parallel.DistributedDataParallel)
            and self.world_size >= 3
            and not model.find_unused_parameters
        ):
            return
        # DDP regroups gradient buckets after its first iteration; a resumed process
        # all-reduces its first step with the initial grouping, and with 3+ ranks the
        # summation order (so the last bits) differs from the uninterrupted run.
        self.events.emit(
            "warning",
            logging.WARNING,
            reason=(
                "DDP with 3 or more ranks resumes bit-exactly only with "
                "DistributedDataParallel(..., find_unused_parameters=True), which keeps "
                "the initial gradient buckets; without it the first steps after a resume "
                "differ in the last bits (see docs/distributed.md)"
            ),
        )

    # -------------------------------------------------------------- lifecycle

    def wait(self) -> None:
        """Block until an in-flight async save is committed; raise its error if it failed."""
        if self._saver is not None:
            self._saver.wait()

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
        if self._uploader is None:
            return True
        return self._uploader.wait(timeout)

    @property
    def last_durable_step(self) -> int | None:
        """Newest step known to be committed in the durable tier (None: none yet, or no tier)."""
        return None if self._uploader is None else self._uploader.last_durable_step

    @property
    def pending_uploads(self) -> list[int]:
        """Committed steps queued for, or being, uploaded to the durable tier (oldest first)."""
        return [] if self._uploader is None else self._uploader.pending

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
                self._finish_uploads()
        finally:
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
            self._old_handlers.clear()
            self._lock.release()
            verdict = self._certificate.finish()
            if verdict is not None:
                self._emit_verdict(verdict)
            self._certificate.close()
            self.events.emit("close")
            for coord in (self._coord, self._async_coord):
                if coord is not None:
                    coord.destroy()

    def _finish_uploads(self) -> None:
        uploader = self._uploader
        if uploader is None:
            return
        newest = self.latest_step()
        if newest is not None and (
            uploader.last_durable_step is None or newest > uploader.last_durable_step
        ):
            uploader.enqueue(newest)  # the run's last checkpoint is always made durable
        left = uploader.close(self._durable_close_timeout)
        if left:
            self.events.emit(
                "durable_behind",
                logging.WARNING,
                steps=left,
                reason=(
                    f"not yet uploaded to {self.durable_url} when closing; the next run that "
                    f"opens {self.directory} uploads them"
                ),
            )

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
