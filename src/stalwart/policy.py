"""When to save and what to keep: small policy objects, plain data."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

__all__ = ["RetentionPolicy", "SavePolicy"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SavePolicy:
    """Decides whether ``save(step)`` writes a checkpoint.

    With neither field set, every call saves: the caller decides when.
    """

    every_steps: int | Literal["auto"] | None = None
    """Save when ``step`` is a multiple of this. ``"auto"``: continuous checkpointing, the
    next save as soon as the previous one is durable, at most as often as the Young/Daly
    interval from the measured cost and ``mtbf_seconds`` (``stalwart.continuous``)."""
    every_seconds: float | None = None
    """Save when at least this many seconds passed since the last save (or the start)."""
    mtbf_seconds: float | None = None
    """Mean time between failures of the job, for ``every_steps="auto"`` (and only for it)."""

    @property
    def auto(self) -> bool:
        return self.every_steps == "auto"

    def __post_init__(self) -> None:
        if self.auto or self.mtbf_seconds is not None:
            self._check_auto()
            return
        if self.every_steps is not None and (
            isinstance(self.every_steps, bool)
            or not isinstance(self.every_steps, int)
            or self.every_steps < 1
        ):
            raise ValueError(
                f"every_steps must be a positive integer, 'auto' or None, got {self.every_steps!r}"
            )
        if self.every_seconds is not None and not (
            isinstance(self.every_seconds, (int, float)) and self.every_seconds > 0
        ):
            raise ValueError(
                f"every_seconds must be a positive number or None, got {self.every_seconds!r}"
            )

    def _check_auto(self) -> None:
        if not self.auto:
            raise ValueError(
                f"mtbf_seconds is used only with every_steps='auto', got every_steps="
                f"{self.every_steps!r}; drop mtbf_seconds or pass every_steps='auto'"
            )
        if self.every_seconds is not None:
            raise ValueError(
                "every_steps='auto' chooses the interval itself; drop every_seconds="
                f"{self.every_seconds!r}"
            )
        mtbf = self.mtbf_seconds
        if (
            isinstance(mtbf, bool)
            or not isinstance(mtbf, (int, float))
            or not (mtbf > 0 and math.isfinite(mtbf))
        ):
            raise ValueError(
                "every_steps='auto' needs mtbf_seconds=, the job's mean time between failures "
                f"in seconds, finite (e.g. 86400 for one a day), got {mtbf!r}"
            )

    def due(self, step: int, *, seconds_since_last: float) -> bool:
        """Whether the step or time rule asks for a save (``"auto"`` never asks here: the
        continuous schedule decides from measured times)."""
        if self.auto:
            return False
        if self.every_steps is None and self.every_seconds is None:
            return True
        if isinstance(self.every_steps, int) and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and seconds_since_last >= self.every_seconds


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPolicy:
    """Which committed checkpoints to keep. The newest one is always kept."""

    keep_last: int | None = 3
    """Keep this many newest checkpoints; None keeps all."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (milestones)."""

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    @property
    def keeps_all(self) -> bool:
        """True when no step is ever let go (``keep_last=None``): nothing to list."""
        return self.keep_last is None

    def to_delete(self, steps: Sequence[int]) -> list[int]:
        """Steps (from the committed ``steps``) that this policy lets go, oldest first."""
        ordered = sorted(set(steps))
        if self.keep_last is None or not ordered:  # (keeps_all, narrowed for mypy)
            return []
        keep = set(ordered[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in ordered if s % self.keep_every == 0)
        keep.add(ordered[-1])
        return [s for s in ordered if s not in keep]
