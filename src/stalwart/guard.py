"""The NaN / loss-spike guard: notice a bad step, skip it or roll back past its data.

A step whose loss or gradient norm is not finite, or whose loss jumps far above
its recent values, poisons the weights if the optimizer applies it. The loop
asks :class:`Guard` before ``optimizer.step()``::

    guard = stalwart.Guard(ckpt, state, stalwart.GuardPolicy(on_spike="rollback"))
    decision = guard.check(step + 1, loss, grad_norm)
    if decision.action == "rollback":      # state and data position are already moved
        step, batches = decision.restored_step, loader.forever()
        continue
    if decision.action == "ok":
        optimizer.step()

Every rank calls :meth:`Guard.check` at the same step; the ranks agree with ONE
all-reduce (on the guard's own gloo group, never the training group) that
carries each rank's flags and values, so every rank takes the same action and
the event names the rank that saw the problem. A rollback restores the newest
checkpoint that verifies (``CheckpointManager.restore`` falls back over damaged
ones) and then moves the data position to where the bad step ended: the sample
window from the checkpoint's position to the bad step's end is skipped, and
recorded. Each decision other than "ok" is a ``guard`` event; too many skips or
rollbacks within a window of checks raise :class:`GuardLimitError` (after a
``guard_limit`` event), because a run that keeps failing needs a person.

The exact-resume certificate knows a restore within one attempt for what it is
(``stalwart.certificate``): a deliberate rollback never reads as a divergence.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import numbers
import struct
from collections import deque
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal

from stalwart.distributed import Coordinator
from stalwart.errors import GuardLimitError
from stalwart.manager import CheckpointManager
from stalwart.state import TrainState

__all__ = ["Guard", "GuardDecision", "GuardLimitError", "GuardPolicy"]

Action = Literal["skip", "rollback"]
_ACTIONS = ("skip", "rollback")
_REASONS = ("nonfinite_loss", "nonfinite_grad", "spike")
"""The flags of one check, in the order they travel in the all-reduce (and take precedence)."""
_GIVEN = 1 << len(_REASONS)
"""The bit of a rank's mask that says it passed a gradient norm."""
_SLOTS = 4
"""int64 slots a rank fills in the check's all-reduce: mask, loss, gradient norm, median."""
_NO_VALUE = -(2**63)
"""What a rank puts in the other ranks' value slots: the identity of a max-reduce over int64."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GuardPolicy:
    """What counts as a bad step, what to do about it, and how often that may happen."""

    on_nonfinite: Action = "skip"
    """Action for a loss or gradient norm that is NaN or infinite."""
    on_spike: Action = "rollback"
    """Action for a loss above ``spike_factor`` times the running median."""
    spike_factor: float | None = 4.0
    """A loss above this many times the median of the recent accepted losses is a spike (None: off)."""
    window: int = 100
    """How many recent accepted losses the running median is taken over (per rank)."""
    warmup: int = 20
    """Accepted losses needed before spikes are judged (the first losses of a run fall fast)."""
    max_skips: int = 20
    """Skips allowed within ``per_checks`` checks; one more raises ``GuardLimitError``."""
    max_rollbacks: int = 3
    """Rollbacks allowed within ``per_checks`` checks; one more raises ``GuardLimitError``."""
    per_checks: int = 1000
    """The sliding window of the limits, in calls of ``check`` (redone steps count again)."""

    def __post_init__(self) -> None:
        for name in ("on_nonfinite", "on_spike"):
            value = getattr(self, name)
            if value not in _ACTIONS:
                raise ValueError(f"{name} must be 'skip' or 'rollback', got {value!r}")
        factor = self.spike_factor
        if factor is not None and not (_finite(factor) and factor > 1):
            raise ValueError(
                f"spike_factor must be a number above 1 (or None to turn spike detection off), "
                f"got {factor!r}"
            )
        for name, minimum in (
            ("window", 1),
            ("warmup", 1),
            ("max_skips", 0),
            ("max_rollbacks", 0),
            ("per_checks", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if self.warmup > self.window:
            raise ValueError(
                f"warmup ({self.warmup}) cannot exceed window ({self.window}): the median never "
                f"holds more than window losses; lower warmup or raise window"
            )


def _finite(value: Any) -> bool:
    """A real number that ``check`` can multiply by a float (not inf, NaN or an int past float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class GuardDecision:
    """What every rank does with the step just checked."""

    action: Literal["ok", "skip", "rollback"]
    """``ok``: apply the step. ``skip``: do not apply it (zero the gradients, move on).
    ``rollback``: the state and the data position were moved; continue the loop
    from ``restored_step`` with a new data iterator."""
    step: int
    reason: str | None = None
    """``nonfinite_loss``, ``nonfinite_grad`` or ``spike`` (None when ok)."""
    restored_step: int | None = None
    """After a rollback: the step of the checkpoint restored."""
    skipped: Mapping[str, Any] | None = None
    """After a rollback: the data window skipped, ``{"from", "to", "samples"}``."""

    @property
    def ok(self) -> bool:
        return self.action == "ok"


def _as_float(name: str, value: Any) -> float:
    """A loss or gradient norm as a float: a real number (numpy's included) or a one-element
    tensor or numpy array of a real dtype, on any device."""
    kind = {"Tensor": "tensor", "ndarray": "numpy array"}.get(type(value).__name__)
    if kind is not None and hasattr(value, "item"):
        if math.prod(value.shape) != 1:
            raise ValueError(f"{name} must be a scalar, got a {kind} of shape {tuple(value.shape)}")
        value = value.item()  # a bool or complex dtype comes out as such, refused below
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number or a scalar tensor, got {type(value).__name__}")
    return float(value)


def _bits(value: float) -> int:
    """The IEEE-754 bits of ``value`` as a signed int64 (exact, NaN included)."""
    bits: int = struct.unpack("<q", struct.pack("<d", value))[0]
    return bits


def _unbits(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<q", bits))[0]
    return value


class _Limit:
    """How many actions of one kind happened within the last ``span`` checks."""

    def __init__(self, kind: str, limit: int, span: int) -> None:
        self.kind, self.limit, self.span = kind, limit, span
        self.at: deque[int] = deque()

    def exceeded(self, check: int) -> bool:
        """Count one more at ``check``; True when that is over the limit."""
        self.at.append(check)
        while self.at and self.at[0] <= check - self.span:
            self.at.popleft()
        return len(self.at) > self.limit


class Guard:
    """Checks each step's loss and gradient norm on every rank and agrees on one action.

    ``Guard(ckpt, state, policy)`` is collective when torch.distributed is
    initialized (it creates the guard's own gloo group over the manager's
    ranks): every rank constructs it, in the same order as its other groups.
    ``state`` is the ``TrainState`` the manager saves; a rollback restores it.
    ``policy`` defaults to ``GuardPolicy()``; ``timeout`` is how long a rank
    waits for the others in the check's all-reduce. Use it from the training
    thread; not thread-safe. ``close`` (or the context manager) frees the group.
    """

    def __init__(
        self,
        ckpt: CheckpointManager,
        state: TrainState,
        policy: GuardPolicy | None = None,
        *,
        timeout: float = 600.0,
    ) -> None:
        if not isinstance(ckpt, CheckpointManager):
            raise TypeError(f"ckpt must be a stalwart.CheckpointManager, got {type(ckpt).__name__}")
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a stalwart.TrainState, got {type(state).__name__}")
        self.policy = policy if policy is not None else GuardPolicy()
        if not isinstance(self.policy, GuardPolicy):
            raise TypeError(f"policy must be a stalwart.GuardPolicy, got {type(policy).__name__}")
        if not (_finite(timeout) and timeout > 0):
            # Checked on every rank before the collective group creation, which would
            # otherwise fail on it (timedelta) or, alone, never see it.
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.ckpt, self.state = ckpt, state
        self._coord = Coordinator.create(ckpt.process_group, timeout=timeout, name="guard")
        self.rank, self.world_size = self._coord.rank, self._coord.world_size
        self._recent: deque[float] = deque(maxlen=self.policy.window)
        self._sorted: list[float] = []
        self.checks = 0
        """Calls of ``check`` so far (redone steps included)."""
        self._limits = {
            "skip": _Limit("skip", self.policy.max_skips, self.policy.per_checks),
            "rollback": _Limit("rollback", self.policy.max_rollbacks, self.policy.per_checks),
        }
        self.skips = 0
        self.rollbacks = 0

    # ------------------------------------------------------------------ check

    @property
    def collectives(self) -> int:
        """Collectives the guard ran (one all-reduce per ``check``; none in a single process)."""
        return self._coord.collectives

    @property
    def median(self) -> float | None:
        """The median of this rank's recent accepted losses (None before any)."""
        if not self._sorted:
            return None
        n = len(self._sorted)
        mid = n // 2
        return self._sorted[mid] if n % 2 else (self._sorted[mid - 1] + self._sorted[mid]) / 2

    def check(self, step: int, loss: Any, grad_norm: Any = None) -> GuardDecision:
        """Judge the step whose loss (and gradient norm) was just computed; every rank, every step.

        ``step`` is the loop's number for this step (the one it passes to
        ``save`` after it), used in events only. ``loss`` and ``grad_norm`` are
        numbers or scalar tensors (reading a CUDA tensor waits for the device).
        Call it after ``backward`` (and gradient clipping) and before
        ``optimizer.step()``. Collective: one all-reduce. Returns the agreed
        :class:`GuardDecision`; raises ``GuardLimitError`` on every rank when
        the decision is one too many of its kind within ``per_checks`` checks.
        A rollback restores ``state`` (collective, like ``ckpt.restore``).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        value = _as_float("loss", loss)
        grad = None if grad_norm is None else _as_float("grad_norm", grad_norm)
        median = self.median
        reason, ranks = self._agree(self._flags(value, grad, median), value, grad, median)
        self.checks += 1
        if reason is None:
            self._accept(value)
            return GuardDecision("ok", step)
        action = self.policy.on_spike if reason == "spike" else self.policy.on_nonfinite
        self._enforce_limit(action, step, reason, ranks)
        if action == "rollback":
            return self._rollback(step, reason, ranks)
        self.skips += 1
        self._record("skip", step, reason, ranks)
        return GuardDecision("skip", step, reason)

    def _flags(self, loss: float, grad: float | None, median: float | None) -> list[bool]:
        spike = (
            self.policy.spike_factor is not None
            and math.isfinite(loss)
            and median is not None
            and median > 0
            and len(self._sorted) >= self.policy.warmup
            and loss > self.policy.spike_factor * median
        )
        return [not math.isfinite(loss), grad is not None and not math.isfinite(grad), spike]

    def _agree(
        self, flags: list[bool], loss: float, grad: float | None, median: float | None
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """The first reason any rank flagged, and the flagging ranks' values: ONE all-reduce.

        Each rank fills four int64 slots of its own: its flags as a bit mask and
        the bits of its loss, gradient norm and median as float64. The other
        ranks put the int64 minimum there, which a max-reduce passes through
        unchanged (NaN included), so every rank learns every rank's values with
        no second collective.
        """
        mask = sum(1 << i for i, flag in enumerate(flags) if flag)
        mask |= _GIVEN if grad is not None else 0
        own = [mask, _bits(loss), _bits(math.nan if grad is None else grad)]
        own.append(_bits(math.nan if median is None else median))
        values = [_NO_VALUE] * (_SLOTS * self.world_size)
        values[_SLOTS * self.rank : _SLOTS * (self.rank + 1)] = own
        reduced = self._coord.max_ints(*values)
        flagged: list[dict[str, Any]] = []
        seen: set[str] = set()
        for r in range(self.world_size):
            rmask, rloss, rgrad, rmedian = reduced[_SLOTS * r : _SLOTS * (r + 1)]
            reasons = [name for i, name in enumerate(_REASONS) if rmask & (1 << i)]
            seen.update(reasons)
            if reasons:
                flagged.append(
                    {
                        "rank": r,
                        "reasons": reasons,
                        "loss": _unbits(rloss),
                        "grad_norm": _unbits(rgrad) if rmask & _GIVEN else None,
                        "median": None if math.isnan(m := _unbits(rmedian)) else m,
                    }
                )
        hit = [name for name in _REASONS if name in seen]
        return (hit[0] if hit else None), flagged

    def _accept(self, loss: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(loss)
        bisect.insort(self._sorted, loss)

    # ---------------------------------------------------------------- actions

    def _enforce_limit(
        self, action: str, step: int, reason: str, ranks: list[dict[str, Any]]
    ) -> None:
        limit = self._limits[action]
        if not limit.exceeded(self.checks):
            return
        message = (
            f"the guard would {action} step {step} ({reason}), one {action} more than "
            f"max_{action}s={limit.limit} allows within {limit.span} checks: training keeps "
            f"failing the same way; look at the data and the learning rate around step {step} "
            "(events.jsonl has every guard decision), or raise the limit in GuardPolicy"
        )
        if self.ckpt.is_leader:
            self.ckpt.events.emit(
                "guard_limit",
                logging.ERROR,
                step=step,
                action=action,
                reason=reason,
                limit=limit.limit,
                per_checks=limit.span,
                ranks=ranks,
                message=message,
            )
        raise GuardLimitError(message)

    def _rollback(self, step: int, reason: str, ranks: list[dict[str, Any]]) -> GuardDecision:
        """Restore the newest checkpoint that verifies, then skip the data the bad step window read."""
        data = self.state.components.get("data")
        end = _position(data)
        restored = self.ckpt.restore(self.state)
        if restored is None:
            # Nothing to go back to: not applying the step is all that is left to do. It is
            # the skip limit's to count, not the rollback limit's (the ranks agree on None).
            self._limits["rollback"].at.pop()
            self._enforce_limit("skip", step, reason, ranks)
            self.skips += 1
            self._record("skip", step, reason, ranks, note="no checkpoint to roll back to")
            return GuardDecision("skip", step, reason)
        # A restore is progress: a long one must not read as a hang to a Watchdog.
        for beat in self.ckpt.heartbeats:
            beat(restored)
        start = _position(data)
        if end is not None and data is not None:
            data.load_state_dict(end)
        skipped = _window(start, end)
        self.rollbacks += 1
        self._record("rollback", step, reason, ranks, restored_step=restored, skipped=skipped)
        return GuardDecision("rollback", step, reason, restored_step=restored, skipped=skipped)

    def _record(
        self, action: str, step: int, reason: str, ranks: list[dict[str, Any]], **fields: Any
    ) -> None:
        if not self.ckpt.is_leader:
            return  # the decision is the same on every rank: one event, one warning
        self.ckpt.events.emit(
            "guard",
            logging.WARNING,
            step=step,
            action=action,
            reason=reason,
            ranks=ranks,
            **fields,
        )

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Free the guard's process group. Collective; idempotent."""
        self._coord.destroy()

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _position(data: Any) -> dict[str, Any] | None:
    """The data position ``(epoch, consumed, ...)`` of a ResumableDataLoader or ResumableSampler."""
    state_dict = getattr(data, "state_dict", None)
    if not callable(state_dict):
        return None
    position = state_dict()
    if not (isinstance(position, dict) and {"epoch", "consumed"} <= position.keys()):
        return None
    return dict(position)


def _window(start: dict[str, Any] | None, end: dict[str, Any] | None) -> dict[str, Any] | None:
    """The skipped sample window ``[start, end)`` of global positions, as recorded."""
    if start is None or end is None:
        return None
    samples = end["consumed"] - start["consumed"] if end["epoch"] == start["epoch"] else None
    return {
        "from": {"epoch": start["epoch"], "consumed": start["consumed"]},
        "to": {"epoch": end["epoch"], "consumed": end["consumed"]},
        "samples": samples,
    }
