"""Writing a checkpoint once the ranks decided to save: open, write, commit, account for it.

The manager decides *whether* to save (policy, preemption, upload health: the
first collective of a save). ``SaveWriter`` does the rest, on every rank: it
opens the save (``pipeline.open_save``: the staging directory, the state
collected on every rank, one collective), hands it to the commit protocol
(``pipeline.write_and_commit``: two collectives) in the caller's thread or in
the background writer, and on rank 0 records the ``save`` event, queues the
step for the durable tier and applies local retention. It maps every failure to
one ``CheckpointSaveError`` (or the user's own ``TypeError``/``ValueError``)
with a ``save_failed`` event.

Retention's deletions run in a thread of their own (``Deletions``), after the
commit, while training goes on: deleting a checkpoint is mostly the
filesystem freeing its blocks, which a sync save made the training thread wait
for (a 256 MiB checkpoint's unlink took 46 ms here, on ext4 mounted with
``discard``; a sync save of that state about 200 ms). The next save waits for
them before it starts, so a save never writes while the last one's deletions
still hold their disk space, and ``CheckpointManager.wait`` and ``close`` wait
for them too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from stalwart.distributed import Coordinator, RankError
from stalwart.errors import CheckpointSaveError, CoordinationError
from stalwart.events import EventLog
from stalwart.gc_pause import gc_paused
from stalwart.pipeline import (
    AsyncSaver,
    OpenedSave,
    SaveResult,
    StagingArea,
    open_save,
    write_and_commit,
)
from stalwart.policy import RetentionPolicy
from stalwart.provenance import Provenance
from stalwart.retention import apply_retention
from stalwart.save_plan import SavePlanCache
from stalwart.state import TrainState
from stalwart.storage.base import CheckpointStorage, is_committed
from stalwart.tiers import TierSync
from stalwart.workers import Workers
from stalwart.writer import RecordTemplates

__all__ = ["Deletions", "SaveWriter", "peer_failure"]

_DELETERS = Workers("stalwart-retention", 1)
"""The thread that runs retention's deletions, for every run of the process: one, so its
work runs in the order it was handed over (``Deletions.wait`` relies on it)."""


def peer_failure(events: EventLog, step: int | None, exc: CoordinationError) -> CheckpointSaveError:
    """The error of a failed ``save`` collective, with its event: what happened first, in one line."""
    message = str(exc)
    if step is not None:
        message += f"; the checkpoint of step {step} was not written"
    events.emit("save_failed", logging.ERROR, step=step, error=message)
    return CheckpointSaveError(message)


def _nothing() -> None:
    pass


class Deletions:
    """Passes of ``run`` (one retention pass) in the retention thread, one at a time.

    ``request`` returns at once: it starts a pass, or, while one runs, asks for
    one more after it (however many requests came meanwhile), so that a step
    committed during a pass is still considered. ``wait`` returns once every
    pass requested before it ended. ``run`` reports its own failures (a
    retention pass never raises, see ``SaveWriter.apply_retention``).
    """

    def __init__(self, run: Callable[[], None]) -> None:
        self._run = run
        self._lock = threading.Lock()
        self._future: concurrent.futures.Future[None] | None = None
        self._running = False
        self._again = False
        self._drain = False  # a pass may be queued that no future here stands for

    def request(self) -> None:
        with self._lock:
            if self._running:
                self._again = True
                return
            self._running = True
            try:
                self._future = _DELETERS.submit(self._passes)
            except BaseException:
                # An interrupt raised into the hand-over (a signal handler's, at
                # a call inside submit): without this, every later request would
                # only ask the pass that never started for one more, and nothing
                # would be deleted again in this process. Had the pass been
                # queued already, it runs as well (passes hold the retention
                # lock, so they still run one at a time), and ``wait`` waits
                # for the queue to drain.
                self._running = False
                self._future = None
                self._drain = True
                raise

    def _passes(self) -> None:
        try:
            while True:
                self._run()
                with self._lock:
                    if not self._again:
                        self._running = False
                        return
                    self._again = False
        except BaseException:
            with self._lock:
                self._running = self._again = False
            raise

    def wait(self) -> None:
        """Block until the requested passes ended (an interrupt raised into this thread
        comes out; the passes go on)."""
        if self._drain:
            # A pass handed over when an interrupt came may be queued: the one
            # retention thread runs its work in order, so once this no-op ran,
            # so had that pass.
            _DELETERS.submit(_nothing).result()
            self._drain = False
        while True:
            with self._lock:
                future = self._future
            if future is None:
                return
            concurrent.futures.wait([future])
            with self._lock:
                if self._future is future:
                    self._future = None
                    return


class SaveWriter:
    """Writes the saves the manager decided on (see the module docstring). Training thread only.

    ``async_coord`` (a coordinator of its own, never the training thread's)
    makes saves asynchronous: the state is staged into reused CPU buffers and
    written by one background thread, at most one save in flight.
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        coord: Coordinator,
        events: EventLog,
        provenance: Provenance,
        *,
        retention: RetentionPolicy,
        async_coord: Coordinator | None,
    ) -> None:
        self.storage = storage
        self.coord = coord
        self.async_coord = async_coord
        self.events = events
        self.provenance = provenance
        self.retention = retention
        self.world_size = coord.world_size
        self.is_leader = coord.is_leader
        self.async_save = async_coord is not None
        self.background = AsyncSaver() if async_coord is not None else None
        self.staging = StagingArea()
        self.templates = RecordTemplates()
        """The ``torch.save`` framing of the state's tensor layouts, reused by every save."""
        self.plans = SavePlanCache()
        """DCP's plan, ``.metadata`` and small values of the state's layout, reused likewise."""
        self.tiers: TierSync | None = None
        """The durable link on rank 0, set by the manager once it exists."""
        self.last_save_time = time.monotonic()
        """When the last save was handed over (or the run restored): the time policy's clock."""
        self.last_saved_step: int | None = None
        """The newest step saved or restored by this run; saving it again is skipped."""
        self.last_committed: int | None = None
        """The step this writer committed last (retention never deletes it)."""
        self.observer: Callable[[int, float, float], None] | None = None
        """Told (step, stall_s, total_s) of every committed save, on every rank, in the committing thread."""
        self._retention_lock = threading.Lock()
        self.deletions = Deletions(self.apply_retention)
        """Retention after each commit, in the retention thread (see the module docstring)."""

    def save(
        self, step: int, state: TrainState, metrics: dict[str, Any], *, emergency: bool
    ) -> bool:
        """Write the decided save of ``step`` (collective); False when it exists already.

        Sync: returns after the commit. Async: after the staging copy (and
        after the commit for an ``emergency`` save).
        """
        # At most one save in flight: wait for the previous one before staging this
        # one, and report its failure before this step is taken on; and for its
        # deletions, so that their disk space is free before this one writes.
        self.wait()
        with gc_paused():
            return self._save(step, state, metrics, emergency=emergency)

    def wait(self) -> None:
        """Block until an in-flight async save is committed (raise its error if it failed)
        and the last commit's retention deletions are done."""
        if self.background is not None:
            self.background.wait()
        self.deletions.wait()

    def _save(
        self, step: int, state: TrainState, metrics: dict[str, Any], *, emergency: bool
    ) -> bool:
        t0 = time.perf_counter()
        opened = self._open(step, state)
        if opened is None:
            return False
        previous, handed = self.last_saved_step, False
        try:
            opened.state_dict = state.with_rank_values(opened.state_dict, opened.shared)
            fields = self.provenance.fields(
                state, world_size=self.world_size, hosts=opened.hosts, metrics=metrics
            )
            self.last_saved_step = step
            if self.background is None:
                # (write_and_commit removes the directory on failure, and commits it
                # under another name: removing it again below is a no-op.)
                result = self._write(opened, fields, self.coord)
            else:
                stall = time.perf_counter() - t0
                coord = self.async_coord
                assert coord is not None

                def job() -> SaveResult:
                    result = self._write(opened, fields, coord, pack=True)
                    self._after_commit(
                        result,
                        stall_s=stall,
                        stage_s=stall,
                        total_s=time.perf_counter() - t0,
                        emergency=emergency,
                    )
                    return result

                self.background.submit(job)
                handed = True
        except BaseException:
            # Until the write or the background job takes the staging directory over,
            # it is this call's to remove: an error here, or an interrupt raised into
            # the training thread (a signal handler's), leaves none behind.
            if not handed:
                self.last_saved_step = previous
                self._discard(opened)
            raise
        self.last_save_time = time.monotonic()
        if self.background is None:
            stall = time.perf_counter() - t0
            self._after_commit(
                result, stall_s=stall, stage_s=0.0, total_s=stall, emergency=emergency
            )
        elif emergency:
            # A preempted job may be killed at any moment after the grace period:
            # make the emergency checkpoint durable before returning.
            self.background.wait()
        return True

    def _discard(self, opened: OpenedSave) -> None:
        """Remove ``opened``'s staging directory (the leader made it); a no-op once
        it was committed (renamed) or removed already."""
        if opened.staging is not None and self.coord.is_leader:
            self.storage.abort(opened.staging)

    def _open(self, step: int, state: TrainState) -> OpenedSave | None:
        """Collective 2: stage the directory, collect the state on every rank, agree; None: skip."""

        def collect() -> tuple[dict[str, Any], dict[str, str]]:
            staged = state.state_dict()
            if self.background is not None:
                staged = self.staging.stage(staged)
                if self.staging.dropped:
                    self.plans.drop_records()  # they hold the buffers just dropped
            # Digests of the values that may differ between ranks (buffers, extra,
            # stateful objects) travel in the same gather.
            return staged, state.rank_digests(staged)

        def exists() -> bool:
            return step == self.last_saved_step or is_committed(self.storage, step)

        peer: list[RankError] = []

        def from_peer(rep: RankError) -> BaseException:
            peer.append(rep)
            if rep.kind == "CheckpointSaveError":
                return CheckpointSaveError(rep.message)
            return CheckpointSaveError(
                f"saving step {step} failed: rank {rep.rank} could not collect its state: "
                f"{rep.kind}: {rep.message}"
            )

        try:
            opened = open_save(
                self.storage,
                step,
                collect,
                exists=exists,
                coordinator=self.coord,
                remote=from_peer,
            )
        except CoordinationError as exc:
            raise peer_failure(self.events, step, exc) from None
        except Exception as exc:
            if peer:
                self.events.emit(
                    "save_failed",
                    logging.ERROR,
                    step=step,
                    error=f"{peer[0].kind}: {peer[0].message}",
                    rank_failed=peer[0].rank,
                )
                raise
            self.events.emit("save_failed", logging.ERROR, step=step, error=str(exc))
            if isinstance(exc, (TypeError, ValueError, CheckpointSaveError)):
                raise  # a mistake in what the user put in the state: show it as is
            raise CheckpointSaveError(
                f"saving step {step} failed: collecting the state raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if opened.staging is None:
            self.events.emit(
                "save_skipped",
                logging.WARNING,
                step=step,
                reason="a checkpoint of this step already exists; checkpoints are never overwritten",
            )
            return None
        return opened

    def _write(
        self, opened: OpenedSave, fields: dict[str, Any], coord: Coordinator, *, pack: bool = False
    ) -> SaveResult:
        """Collectives 3 and 4: write and commit (``pipeline.write_and_commit``), in any thread.

        ``pack``: written in the background (see ``ChecksummingWriter``).
        """
        try:
            return write_and_commit(
                self.storage,
                opened,
                fields,
                coordinator=coord,
                templates=self.templates,
                plans=self.plans,
                pack=pack,
            )
        except CheckpointSaveError as exc:
            self.events.emit("save_failed", logging.ERROR, step=opened.step, error=str(exc))
            if self.last_saved_step == opened.step:
                self.last_saved_step = None
            raise

    def _after_commit(
        self, result: SaveResult, *, stall_s: float, stage_s: float, total_s: float, emergency: bool
    ) -> None:
        self.last_committed = result.step
        if self.observer is not None:
            self.observer(result.step, stall_s, total_s)
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
        if self.tiers is not None:
            self.tiers.committed(result.step, emergency=emergency)
        self.deletions.request()

    def apply_retention(self) -> None:
        """Delete what the local retention lets go, never a step not yet durable, nor
        the step this run committed, saved or restored last.

        Rank 0, any thread, one pass at a time (the retention thread's and the
        durable tier's, which calls it once a step is durable). Never raises an
        ``Exception``: a pass that fails (the run directory unreadable, say) costs
        disk space, never a checkpoint, so training goes on; it is a
        ``delete_failed`` event and a warning.
        """
        guard: contextlib.AbstractContextManager[set[int]] = (
            self.tiers.holding() if self.tiers is not None else contextlib.nullcontext(set())
        )
        # The run's own recovery point is never let go, whatever larger steps the
        # directory holds: the checkpoints after a restore(step=N) that rolled back,
        # or a stray copy from another run. keep_last counts steps by number, so
        # without this each new checkpoint would be deleted right after its commit.
        own = {s for s in (self.last_committed, self.last_saved_step) if s is not None}
        try:
            with self._retention_lock, guard as protected:
                apply_retention(
                    self.storage, self.retention, self.events, protected={*protected, *own}
                )
        except Exception as exc:
            self.events.emit(
                "delete_failed",
                logging.WARNING,
                step=None,
                error=f"retention failed: {type(exc).__name__}: {exc}",
            )
