"""Continuous checkpointing (``every_steps="auto"``) and the recovery point of every save.

With ``every_steps="auto"`` the next save starts as soon as the previous one is
durable (committed here and, with a durable tier, uploaded), but never sooner
than the optimum interval of Young and Daly for the measured cost: saving more
often than that costs more stall time than it saves in expected lost work.

- C, the cost, is the measured stall of a save (mean of the last few): the time
  the training loop waits for it (the staging copy of an async save, the whole
  of a sync save).
- M is ``mtbf_seconds``, the job's mean time between failures.
- tau = ``daly_interval(C, M)`` is the compute time between the end of one save's
  stall and the start of the next; ``young_interval`` is its first-order form.

So the interval between saves is max(time to durable, tau + C). A cheap async
stall and a short MTBF give a save every few seconds, each started the moment
its predecessor is safe; an expensive sync save and a long MTBF give the
classic interval. The first save happens at the first ``save`` call (it
measures the cost).

Rank 0 decides (it commits and uploads, so it knows when a checkpoint is
durable); the others follow through the all-reduce every ``save`` runs.

Every save also records its *recovery point*: when it starts, how many steps
(and seconds) of training are covered by no durable checkpoint yet, i.e. what a
failure at that moment would cost. It is the ``recovery_point`` event in
``events.jsonl`` (``steps_at_risk``, ``seconds_at_risk``) and the ``at risk``
column of ``stalwart ls``.
"""

from __future__ import annotations

import logging
import math
import time

from stalwart.events import EventLog
from stalwart.policy import SavePolicy
from stalwart.preemption import SaveTimes
from stalwart.saving import SaveWriter
from stalwart.staging import AsyncSaver
from stalwart.storage.base import newest_committed

__all__ = ["ContinuousSchedule", "check_seconds", "daly_interval", "young_interval"]


def check_seconds(**values: float) -> None:
    """``ValueError`` naming the first of ``values`` that is not a positive, finite number."""
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")


def young_interval(cost: float, mtbf: float) -> float:
    """Young's first-order optimum checkpoint interval, sqrt(2 C M) (Young 1974).

    ``cost`` C is the time one checkpoint blocks the job, ``mtbf`` M the job's
    mean time between failures; the result is compute time between checkpoints.
    """
    check_seconds(cost=cost, mtbf=mtbf)
    return math.sqrt(2.0 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum checkpoint interval (Daly 2006, FGCS 22(3)).

    tau = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C for C < 2M,
    and tau = M for C >= 2M (checkpoints so costly that the job can barely
    progress; the formula then has a jump from 0.89 M up to M at C = 2M).

    >>> round(daly_interval(300, 86400) / 60, 1)  # C = 5 min, M = 24 h
    116.7
    """
    check_seconds(cost=cost, mtbf=mtbf)
    if cost >= 2.0 * mtbf:
        return mtbf
    x = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost


class ContinuousSchedule:
    """The save decision of one rank (``due``) and the recovery point of each save. Training thread.

    For ``every_steps="auto"`` it applies the rule of the module docstring;
    otherwise it asks the ``SavePolicy``. ``times`` is fed by ``writer`` (see
    ``stalwart.preemption.GracePlanner``).
    """

    def __init__(
        self,
        policy: SavePolicy,
        writer: SaveWriter,
        times: SaveTimes,
    ) -> None:
        self.policy = policy
        self.writer = writer
        self.times = times
        self.events: EventLog = writer.events
        self.saver: AsyncSaver | None = writer.background

    def interval_s(self) -> float | None:
        """tau, the Young/Daly compute time between saves (None: no save measured, or not auto)."""
        stall = self.times.stall_s()
        if not self.policy.auto or stall is None or self.policy.mtbf_seconds is None:
            return None
        return daly_interval(max(stall, 1e-6), self.policy.mtbf_seconds)

    def durable(self) -> bool:
        """Whether the last save is committed and, with a durable tier, uploaded (rank 0's view)."""
        if self.saver is not None and self.saver.busy:
            return False
        tiers = self.writer.tiers
        return tiers is None or not tiers.uploader.pending

    def due(self, step: int, *, seconds_since_last: float) -> bool:
        """Whether this rank asks for a save at ``step`` (without preemption; local and cheap)."""
        if not self.policy.auto:
            return self.policy.due(step, seconds_since_last=seconds_since_last)
        if not self.writer.is_leader or not self.durable():
            return False
        tau = self.interval_s()
        return tau is None or seconds_since_last >= tau

    def durable_step(self) -> int | None:
        """The newest step a failure now would resume from (rank 0's view)."""
        tiers = self.writer.tiers
        if tiers is not None:
            return tiers.uploader.last_durable_step
        return newest_committed(self.writer.storage)

    def save_starting(self, step: int) -> None:
        """Record the recovery point just before the save of ``step`` starts (rank 0 writes it)."""
        if not self.writer.is_leader:
            return
        durable = self.durable_step()
        began = None if durable is None else self.times.committed.get(durable)
        self.events.emit(
            "recovery_point",
            logging.DEBUG,
            step=step,
            durable_step=durable,
            steps_at_risk=None if durable is None else step - durable,
            seconds_at_risk=None if began is None else round(time.monotonic() - began, 3),
            interval_s=self._rounded(self.interval_s()),
            auto=self.policy.auto,
        )

    @staticmethod
    def _rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)
