"""Background copies of committed checkpoints to the durable tier.

One thread per manager (on the rank that commits) takes committed steps from a
queue and uploads them with ``DurableMirror.upload`` (``storage.base``), oldest
first, reading them from the primary tier through ``CheckpointStorage``. Training never
waits for it: ``save`` only enqueues. While the store is down the thread keeps
retrying with backoff; the manager's local retention asks ``protected()`` and
never deletes a checkpoint that is queued or being uploaded. At most
``max_pending`` steps wait; when a newer one arrives beyond that, the oldest
waiting one (never the one in flight) is dropped from the queue, so local disk
use stays bounded during a long outage and the newest checkpoint always gets
through when the store returns.

Failures that retrying cannot fix (another writer committed the step, a local
file no longer matches its manifest, access denied) are kept and raised by the
manager's next ``save``, ``wait_durable`` or ``close``; they never disappear.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointSaveError,
    CommitConflictError,
    DurableStoreError,
)
from stalwart.events import EventLog
from stalwart.manifest import MANIFEST_NAME
from stalwart.policy import RetentionPolicy
from stalwart.storage.base import CheckpointStorage, DurableMirror

__all__ = ["Uploader"]


class Uploader:
    """Uploads committed local checkpoints in one background thread (see the module docstring)."""

    def __init__(
        self,
        tier: DurableMirror,
        local: CheckpointStorage,
        events: EventLog,
        *,
        retention: RetentionPolicy,
        max_pending: int = 2,
        on_durable: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(
                f"DurableConfig.max_pending must be a positive integer, got {max_pending!r}"
            )
        self.tier = tier
        self.local = local
        self.events = events
        self.retention = retention
        self.max_pending = max_pending
        self._on_durable = on_durable
        self._cond = threading.Condition()
        self._pending: list[int] = []
        self._inflight: int | None = None
        self._error: BaseException | None = None
        self._gave_up: set[int] = set()
        self._closing = False
        self.last_durable_step: int | None = None
        """Newest step this run knows to be committed in the durable tier."""
        self._thread = threading.Thread(target=self._run, name="stalwart-upload", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training side

    def enqueue(self, step: int) -> None:
        """Queue committed local ``step`` for upload; drop the oldest waiting one beyond the limit."""
        with self._cond:
            if step in self._pending or step == self._inflight or step in self._gave_up:
                return
            self._pending.append(step)
            self._pending.sort()
            while len(self._pending) > self.max_pending:
                dropped = self._pending.pop(0)
                self.events.emit(
                    "upload_skipped",
                    logging.WARNING,
                    step=dropped,
                    reason=(
                        f"the durable tier is behind ({len(self._pending)} newer checkpoints "
                        f"waiting, DurableConfig.max_pending={self.max_pending}); a newer one will be "
                        "uploaded instead"
                    ),
                )
            self._cond.notify_all()

    def forget_after(self, step: int, durable: int | None) -> None:
        """After a rollback to ``step`` (the queue drained): the steps after it no longer
        exist, so a later upload of their numbers counts again; ``durable`` is the
        newest step the tier still holds."""
        with self._cond:
            self._gave_up = {s for s in self._gave_up if s <= step}
            self.last_durable_step = durable

    @contextlib.contextmanager
    def holding(self) -> Iterator[set[int]]:
        """Steps that local retention must keep, held steady for the duration of the block."""
        with self._cond:  # re-entrant: ``pending`` takes it again
            yield set(self.pending)

    @property
    def pending(self) -> list[int]:
        """Steps waiting or in flight, oldest first."""
        with self._cond:
            steps = list(self._pending)
            if self._inflight is not None and self._inflight not in steps:
                steps.insert(0, self._inflight)
            return steps

    def raise_error(self) -> None:
        """Raise (once) a failure that retrying could not fix."""
        with self._cond:
            error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointSaveError):
            raise error
        raise CheckpointSaveError(f"durable upload failed: {error}") from error

    @property
    def failed(self) -> bool:
        with self._cond:
            return self._error is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued step is durable (True) or ``timeout`` passed (False).

        Raises the failure of an upload that cannot succeed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._inflight is not None) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            drained = not self._pending and self._inflight is None
        self.raise_error()
        return drained

    def close(self, timeout: float | None) -> list[int]:
        """Wait up to ``timeout`` for the queue, then stop the thread; return steps left behind."""
        try:
            self.wait(timeout)
        finally:
            with self._cond:
                self._closing = True
                left = self.pending
                self._cond.notify_all()
            self.tier.stop()
            self._thread.join(timeout=30.0)
        return left

    # -------------------------------------------------------------- the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                step = self._pending.pop(0)
                self._inflight = step
            retry_later = False
            try:
                retry_later = self._upload(step)
            except Exception as exc:  # never let the thread die silently
                self._fail(step, exc)
            finally:
                with self._cond:
                    self._inflight = None
                    if retry_later and not self._closing:
                        self._pending.insert(0, step)
                    self._cond.notify_all()
            if retry_later:
                # The store is down: wait before the next round (close wakes us).
                with self._cond:
                    self._cond.wait_for(lambda: self._closing, self.tier.retry.max_backoff)

    def _upload(self, step: int) -> bool:
        """Upload one step; True when it should be tried again later."""
        path = self.local.step_path(step)
        if not (path / MANIFEST_NAME).is_file():
            self.events.emit(
                "upload_skipped",
                logging.WARNING,
                step=step,
                reason="no longer in the local tier (deleted or moved aside before upload)",
            )
            return False

        def on_retry(what: str, attempt: int, delay: float, error: DurableStoreError) -> None:
            self.events.emit(
                "upload_retry",
                logging.WARNING if attempt >= 2 else logging.INFO,
                step=step,
                attempt=attempt + 1,
                delay_s=round(delay, 3),
                error=str(error),
            )

        try:
            result = self.tier.upload(path, on_retry=on_retry)
        except (CommitConflictError, CheckpointCorruptError) as exc:
            self._fail(step, exc)
            return False
        except DurableStoreError as exc:
            if not exc.transient:
                self._fail(step, exc)
                return False
            if self._closing:
                return True
            self.events.emit(
                "upload_failed", logging.WARNING, step=step, error=str(exc), will_retry=True
            )
            return True
        except FileNotFoundError as exc:
            if not (path / MANIFEST_NAME).is_file():
                self.events.emit(
                    "upload_skipped",
                    logging.WARNING,
                    step=step,
                    reason=f"deleted from the local tier during the upload ({exc})",
                )
                return False
            raise
        try:  # the manifest is written at the local commit
            lag: float | None = max(0.0, time.time() - (path / MANIFEST_NAME).stat().st_mtime)
        except OSError:
            lag = None
        with self._cond:
            if self.last_durable_step is None or step >= self.last_durable_step:
                self.last_durable_step = step
        self.events.emit(
            "upload",
            step=step,
            url=self.tier.url,
            bytes=result.bytes,
            seconds=round(result.seconds, 6),
            throughput_MBps=round(result.mbps, 1),
            retries=result.retries,
            lag_s=None if lag is None else round(lag, 3),
            already_durable=result.already,
        )
        self._apply_durable_retention()
        if self._on_durable is not None:
            self._on_durable()
        return False

    def _apply_durable_retention(self) -> None:
        try:
            steps = self.tier.committed_steps()
        except DurableStoreError as exc:
            self.events.emit("durable_delete_failed", logging.WARNING, error=str(exc))
            return
        for step in self.retention.to_delete(steps):
            try:
                self.tier.delete(step)
            except (DurableStoreError, FileNotFoundError) as exc:
                self.events.emit(
                    "durable_delete_failed", logging.WARNING, step=step, error=str(exc)
                )
            else:
                self.events.emit("durable_delete", step=step, reason="retention")

    def _fail(self, step: int, exc: BaseException) -> None:
        self.events.emit(
            "upload_failed",
            logging.ERROR,
            step=step,
            error=f"{type(exc).__name__}: {exc}",
            will_retry=False,
        )
        with self._cond:
            self._gave_up.add(step)  # reported once; never retried by this run
            if self._error is None:
                self._error = exc
            self._cond.notify_all()
