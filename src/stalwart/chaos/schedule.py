"""Fault schedules for ``stalwart chaos``: what to inject, when, and for how long.

Plain data, no processes. A schedule is a list of ``Fault`` sorted by time, in
seconds from the start of the chaos run. It comes from text the user types
(``parse_schedule("kill@10,stop@25:3,term@40:grace=5")``) or from a seeded
Poisson process (``poisson_schedule(mtbf=20, duration=60, seed=0)``).

The kinds of fault, and what they model:

- ``kill``: SIGKILL of one training process (a rank): a crash, an OOM kill, a
  lost node. Work since the last committed checkpoint is lost.
- ``stop``: SIGSTOP for ``seconds``, then SIGCONT: a hung or descheduled
  process. Nothing is lost but time; no restart.
- ``term``: SIGTERM to the whole command, then SIGKILL after ``grace`` seconds:
  a scheduler's preemption. stalwart's manager saves on SIGTERM, so nothing
  should be lost when the save fits in the grace period.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Literal

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_STOP_S",
    "FAULT_KINDS",
    "MAX_FAULTS",
    "Fault",
    "parse_schedule",
    "poisson_schedule",
]

FaultKind = Literal["kill", "stop", "term"]
FAULT_KINDS: tuple[FaultKind, ...] = ("kill", "stop", "term")
DEFAULT_STOP_S = 3.0
"""How long a ``stop`` without ``:SECONDS`` keeps the process stopped."""
DEFAULT_GRACE_S = 30.0
"""How long a ``term`` without ``:grace=`` waits before SIGKILL (Kubernetes' default)."""
MAX_FAULTS = 10_000
"""Most faults ``poisson_schedule`` expects (duration / mtbf): a denser schedule is a typo,
and drawing it would not end."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """One fault: ``kind`` at ``at`` seconds after the chaos run started."""

    kind: FaultKind
    """``kill``, ``stop`` or ``term`` (module docstring)."""
    at: float
    """Seconds after the start of the chaos run; a fault due while the command is
    starting waits for its first step."""
    seconds: float = 0.0
    """``stop``: how long the process stays stopped; 0 for the other kinds."""
    grace: float = 0.0
    """``term``: seconds between SIGTERM and SIGKILL; 0 for the other kinds."""

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(
                f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}"
            )
        for name in ("at", "seconds", "grace"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"fault {name} must be a finite number >= 0, got {value!r}")

    def text(self) -> str:
        """The fault as ``parse_schedule`` reads it: ``kill@10``, ``stop@25:3``, ``term@40:grace=5``."""
        if self.kind == "stop":
            return f"stop@{self.at:g}:{self.seconds:g}"
        if self.kind == "term":
            return f"term@{self.at:g}:grace={self.grace:g}"
        return f"kill@{self.at:g}"


def parse_schedule(text: str) -> list[Fault]:
    """Faults from ``KIND@SECONDS[:ARG]`` items separated by commas, sorted by time.

    ``kill@10``; ``stop@25:3`` (stopped 3 s; default ``DEFAULT_STOP_S``);
    ``term@40:grace=5`` or ``term@40:5`` (default ``DEFAULT_GRACE_S``). Raises
    ``ValueError`` naming the item and the expected form.
    """
    faults = [_parse_item(item.strip()) for item in text.split(",") if item.strip()]
    if not faults:
        raise ValueError(f"the schedule {text!r} names no fault; expected e.g. 'kill@10,stop@25:3'")
    return sorted(faults, key=lambda f: f.at)


def _parse_item(item: str) -> Fault:
    form = "KIND@SECONDS[:ARG], e.g. kill@10, stop@25:3, term@40:grace=5"
    kind, sep, rest = item.partition("@")
    if not sep or kind not in FAULT_KINDS:
        raise ValueError(
            f"schedule item {item!r}: expected {form} with KIND one of {', '.join(FAULT_KINDS)}"
        )
    at_text, _, arg = rest.partition(":")
    at = _seconds(item, at_text)
    if kind == "kill":
        if arg:
            raise ValueError(
                f"schedule item {item!r}: kill takes no argument; write kill@{at_text}"
            )
        return Fault(kind="kill", at=at)
    if kind == "stop":
        return Fault(kind="stop", at=at, seconds=_seconds(item, arg) if arg else DEFAULT_STOP_S)
    name, eq, value = arg.partition("=")
    if eq and name != "grace":
        raise ValueError(f"schedule item {item!r}: term takes grace=SECONDS, got {name!r}")
    grace_text = value if eq else arg
    return Fault(
        kind="term", at=at, grace=_seconds(item, grace_text) if grace_text else DEFAULT_GRACE_S
    )


def _seconds(item: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"schedule item {item!r}: {text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"schedule item {item!r}: seconds must be finite and >= 0, got {text!r}")
    return value


def poisson_schedule(
    *,
    mtbf: float,
    duration: float,
    seed: int,
    kinds: tuple[FaultKind, ...] = ("kill",),
    stop_seconds: float = DEFAULT_STOP_S,
    grace: float = DEFAULT_GRACE_S,
) -> list[Fault]:
    """Faults at the arrivals of a Poisson process of mean gap ``mtbf`` within ``duration``.

    Each fault's kind is drawn uniformly from ``kinds``. The same ``seed`` gives the
    same schedule, so a run can be repeated.
    """
    if not (math.isfinite(mtbf) and mtbf > 0):
        raise ValueError(f"mtbf must be a positive number of seconds, got {mtbf!r}")
    if not kinds or any(k not in FAULT_KINDS for k in kinds):
        raise ValueError(f"kinds must be among {', '.join(FAULT_KINDS)}, got {kinds!r}")
    if duration / mtbf > MAX_FAULTS:
        raise ValueError(
            f"mtbf {mtbf:g} s over {duration:g} s means about {duration / mtbf:.3g} faults, "
            f"more than {MAX_FAULTS}; give a longer mtbf"
        )
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = rng.expovariate(1.0 / mtbf)
    while at < duration:
        kind = rng.choice(kinds)
        faults.append(
            Fault(
                kind=kind,
                at=round(at, 3),
                seconds=stop_seconds if kind == "stop" else 0.0,
                grace=grace if kind == "term" else 0.0,
            )
        )
        at += rng.expovariate(1.0 / mtbf)
    return faults
