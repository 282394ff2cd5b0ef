"""Preemption within its grace window: from measured save times to what the emergency save does.

A preempted job gets a fixed time between SIGTERM and SIGKILL: torchrun waits
30 s for its workers after forwarding the signal (``--shutdown-timeout`` or
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` in torch 2.13), SLURM waits ``KillWait``
(default 30 s) after the signal of a time limit or a preemption (``GraceTime``
of the partition's QOS, or ``--signal=TERM@<seconds>`` to be told earlier),
Kubernetes ``terminationGracePeriodSeconds`` (default 30 s). A save that does not fit is
cut by SIGKILL: it costs nothing on disk (no manifest, no checkpoint) but it
takes the time that an in-flight async write, or the upload of the last
checkpoint, needed to finish.

With ``CheckpointManager(grace_seconds=G)``, the save that sees the signal
chooses from this rank's measured save times (``SaveTimes``) and the time left
(G minus the seconds since the signal arrived), in this order:

1. ``save``: flush an in-flight async write, then write a full checkpoint of
   this step, when both fit;
2. ``flush``: only finish the in-flight async write (the state staged at the
   previous save), when that fits;
3. ``skip``: nothing, with a ``preemption_skipped`` event that gives the
   estimates and the time left.

"Fits" means the estimate times ``SAFETY`` plus ``MARGIN_S`` is at most the
time left. Without a measured save yet it tries the full save (nothing to lose
on disk). Each rank votes in the all-reduce every ``save`` runs anyway; the
most cautious vote wins, so every rank does the same thing. Without
``grace_seconds`` every preemption writes the full checkpoint, as before.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import threading
import time
from typing import Any

from stalwart.events import EventLog
from stalwart.saving import SaveWriter
from stalwart.signals import PreemptionSignals
from stalwart.staging import AsyncSaver

__all__ = [
    "MARGIN_S",
    "SAFETY",
    "Decision",
    "GraceAction",
    "GracePlanner",
    "SaveTimes",
    "check_grace",
    "plan",
]

SAFETY = 1.25
"""A save is planned at this many times its measured duration (the disk may be slower now)."""
MARGIN_S = 0.25
"""Seconds kept free in the grace window besides the save: the loop's exit, closing files."""


class SaveTimes:
    """This rank's recent save timings: the inputs of the grace decision and the auto schedule.

    ``record`` is called by the thread that committed a save (the training
    thread, or the background writer), the readers run in the training thread;
    thread-safe. Durations are the most recent ``WINDOW`` saves' worst case
    (``full_s``, ``write_s``), and their mean stall (``stall_s``).
    """

    WINDOW = 5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=self.WINDOW
        )
        self.committed: dict[int, float] = {}
        """Committed step -> ``time.monotonic()`` when its save began (the state's time)."""

    def record(self, step: int, stall_s: float, total_s: float) -> None:
        """A save of ``step`` committed: it stalled the loop ``stall_s`` and took ``total_s`` in all."""
        with self._lock:
            self._samples.append((stall_s, max(total_s, stall_s)))
            self.committed[step] = time.monotonic() - total_s
            for old in sorted(self.committed)[: -self.WINDOW]:
                del self.committed[old]

    def full_s(self) -> float | None:
        """A whole save, from collecting the state to the commit (None: none measured)."""
        with self._lock:
            return max((t for _, t in self._samples), default=None)

    def write_s(self) -> float | None:
        """The background part of an async save: write and commit after the staging copy."""
        with self._lock:
            return max((t - s for s, t in self._samples), default=None)

    def stall_s(self) -> float | None:
        """The time a save blocks the training loop: the checkpoint cost of Young and Daly."""
        with self._lock:
            if not self._samples:
                return None
            return sum(s for s, _ in self._samples) / len(self._samples)


class GraceAction(enum.IntEnum):
    """What an emergency save does; a larger value is more cautious (the ranks take the max)."""

    SAVE = 0
    FLUSH = 1
    SKIP = 2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One rank's choice for its emergency save, with the numbers behind it."""

    action: GraceAction
    reason: str
    time_left_s: float | None
    """The grace window minus the seconds since the signal (None: no window given)."""
    full_s: float | None
    """Estimated full save (None: none measured yet)."""
    flush_s: float
    """Estimated rest of the in-flight async write (0: none in flight)."""

    def fields(self) -> dict[str, Any]:
        return {
            "time_left_s": None if self.time_left_s is None else round(self.time_left_s, 3),
            "save_estimate_s": None if self.full_s is None else round(self.full_s, 3),
            "flush_estimate_s": round(self.flush_s, 3),
            "reason": self.reason,
        }


def _needed(seconds: float) -> float:
    return seconds * SAFETY + MARGIN_S


def plan(
    *, time_left_s: float | None, full_s: float | None, flush_s: float, in_flight: bool
) -> Decision:
    """The emergency save that fits in ``time_left_s`` (see the module docstring). Pure."""

    def decide(action: GraceAction, reason: str) -> Decision:
        return Decision(
            action=action, reason=reason, time_left_s=time_left_s, full_s=full_s, flush_s=flush_s
        )

    if time_left_s is None:
        return decide(GraceAction.SAVE, "no grace window given: always the full save")
    if full_s is None:
        return decide(GraceAction.SAVE, "no save measured yet: trying the full save")
    both = flush_s + full_s
    if _needed(both) <= time_left_s:
        return decide(
            GraceAction.SAVE,
            f"a full save (~{both:.2f} s with the in-flight write) fits in {time_left_s:.2f} s",
        )
    if in_flight and _needed(flush_s) <= time_left_s:
        return decide(
            GraceAction.FLUSH,
            f"a full save (~{both:.2f} s) does not fit in {time_left_s:.2f} s; finishing the "
            f"in-flight async write (~{flush_s:.2f} s) does",
        )
    what = (
        f"neither a full save (~{both:.2f} s) nor the in-flight write (~{flush_s:.2f} s)"
        if in_flight
        else f"a full save (~{full_s:.2f} s) does not"
    )
    return decide(
        GraceAction.SKIP,
        f"{what} fit in the {time_left_s:.2f} s left (x{SAFETY} + {MARGIN_S} s margin); "
        "the newest committed checkpoint stays the recovery point",
    )


def check_grace(grace_seconds: float | None) -> float | None:
    """``grace_seconds`` as a float (None stays None); ``ValueError`` naming the fix otherwise."""
    if grace_seconds is None:
        return None
    if (
        isinstance(grace_seconds, bool)
        or not isinstance(grace_seconds, (int, float))
        or not (grace_seconds > 0 and math.isfinite(grace_seconds))
    ):
        raise ValueError(
            "grace_seconds must be the positive, finite number of seconds between the "
            "preemption signal and SIGKILL (30 under torchrun), or None (no window), "
            f"got {grace_seconds!r}"
        )
    return float(grace_seconds)


class GracePlanner:
    """The manager's side of the grace decision: votes, then carries out what the ranks agreed.

    Training thread only (``SaveTimes`` is the thread-safe part). ``writer``
    is the manager's ``SaveWriter``: its ``observer`` feeds ``times``, its
    ``last_save_time`` dates an in-flight async write, its ``background`` is
    that write. ``signals`` are the manager's handlers.
    """

    def __init__(
        self, grace_seconds: float | None, writer: SaveWriter, signals: PreemptionSignals
    ) -> None:
        self.grace_seconds = check_grace(grace_seconds)
        self.events: EventLog = writer.events
        self.writer = writer
        self.saver: AsyncSaver | None = writer.background
        self.signals = signals
        self.times = SaveTimes()
        writer.observer = self.times.record

    def decide(self) -> Decision:
        """This rank's choice now (see ``plan``)."""
        saver = self.saver
        since = self.signals.seconds_since()
        left = None if self.grace_seconds is None else self.grace_seconds - (since or 0.0)
        in_flight = saver is not None and saver.busy
        flush = 0.0
        write = self.times.write_s()
        if in_flight and write is not None:
            flush = max(0.0, write - (time.monotonic() - self.writer.last_save_time))
        return plan(
            time_left_s=left, full_s=self.times.full_s(), flush_s=flush, in_flight=in_flight
        )

    def vote(self) -> int:
        """This rank's ``GraceAction`` for the all-reduce (SAVE when it saw no signal)."""
        return int(self.decide().action) if self.signals.is_set() else 0

    def carry_out(self, action: int, step: int) -> bool:
        """Do the agreed ``action`` at ``step``'s emergency; True: write the full checkpoint now.

        FLUSH waits for the in-flight async write (raising its error, if any).
        Every rank calls it with the same ``action``; rank 0 records the event.
        """
        agreed = GraceAction(action)
        saver = self.saver
        mine = self.decide()
        since = self.signals.seconds_since()
        fields = {
            "step": step,
            "action": agreed.name.lower(),
            "grace_s": self.grace_seconds,
            "since_signal_s": None if since is None else round(since, 3),
            "in_flight": saver is not None and saver.busy,
            "last_saved_step": self.writer.last_saved_step,
            **mine.fields(),
        }
        if agreed is not mine.action:
            fields["reason"] = f"another rank chose {agreed.name.lower()}; here: {mine.reason}"
        if agreed is GraceAction.SKIP:
            self.events.emit("preemption_skipped", logging.WARNING, **fields)
            return False
        self.events.emit("preemption", logging.WARNING, **fields)
        if agreed is GraceAction.FLUSH and saver is not None:
            saver.wait()
        return agreed is GraceAction.SAVE
