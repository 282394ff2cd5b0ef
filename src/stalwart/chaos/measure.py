"""Goodput, lost work and recovery times of a chaos run, from its record and ``events.jsonl``.

Plain data: a ``ChaosRecord`` (progress lines and faults, stamped with
``time.time()``) and the run's event records go in, one JSON-ready dict comes
out (``measure``). The definitions, which ``docs/operations.md`` repeats:

- *window*: from the first progress line of the first attempt to the end of the
  run (the deadline, or the last progress line when the training finished).
  Lines that arrive after the deadline, while the command stops, do not count.
  The first start-up (imports, building the model) is outside it: it is paid
  once, with or without failures.
- *goodput*: steps gained over the window (the last step reached minus the
  first) per second of the window. Redone steps count once.
- *step time*: seconds of pure compute per step, from consecutive progress
  lines of fault-free stretches (never across a fault, never the first line of
  an attempt, which includes the restore), minus the save stalls the ``save``
  events record in those stretches. ``ideal`` is its inverse: the steps/s of a
  run that never saves and never fails.
- per failure (``kill``, ``term``, or an exit no fault caused):
  *lost steps*: the last step the failed attempt reported minus the step the
  next attempt restored (its ``restore`` event; 0 after ``restore_none``);
  *detection*: fault -> the supervisor saw the command exit;
  *restart*: exit -> the restore began (the ``restore`` event's time minus its
  ``seconds``); *restore*: that ``seconds``; *first step*: restore end -> the
  next attempt's first progress line. Their sum is the *recovery*. A failure
  whose next attempt did not reach a progress line before the end has no
  recovery numbers (``null``).
- ``stop`` faults: the seconds the process was stopped; no restart, no loss
  but time.

Progress lines arrive after the step they report (the demo prints after its
save), so the last step a killed attempt reached may be one more than it
reported: lost work is a lower bound by at most one step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from stalwart.chaos.supervisor import Attempt, ChaosRecord, Injected

__all__ = ["measure", "pure_step_time"]

_RESTORE_EVENTS = ("restore", "restore_none")


def measure(record: ChaosRecord, events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The chaos run's numbers as JSON data (see the module docstring for each definition).

    Keys: ``window`` (start, end, seconds), ``steps`` (first, last, gained),
    ``goodput_steps_per_s``, ``step_time_s``, ``ideal_steps_per_s``,
    ``goodput_fraction`` (useful compute over wall time), ``checkpoint`` (saves,
    median stall, every_steps, interval_s), ``failures`` (one dict each),
    ``stops``, ``counts``, ``breakdown_s`` (where the window's time went).
    Raises ``ValueError`` when no progress line was seen.
    """
    record = _until_end(record)
    evs = sorted((e for e in events if _well_formed(e)), key=lambda e: e["time"])
    with_steps = [a for a in record.attempts if a.steps]
    if not with_steps:
        raise ValueError(
            "the command printed no progress line matching the step pattern: nothing to measure"
        )
    start_t, first = with_steps[0].steps[0]
    end_t = record.ended
    if record.completed:
        end_t = with_steps[-1].steps[-1][0]
    last = _last_step(record, evs, with_steps[-1])
    window = max(end_t - start_t, 1e-9)
    saves = [e for e in evs if e.get("event") == "save" and start_t <= e["time"] <= end_t]
    step_time = pure_step_time(record, evs)
    failures = [_failure(record, evs, i) for i in _failed_attempts(record)]
    stops = [
        {
            "at": f.time - record.started,
            "seconds": _stop_end(record, f, end_t) - f.time,
            "step": f.step,
            "rank": f.rank,
        }
        for f in record.faults
        if f.fault.kind == "stop"
    ]
    gained = last - first
    checkpoint = _checkpoint(saves, evs, step_time)
    for f in failures:
        if f["recovery_s"] is None and f["at"] is not None:
            # Cut off by the end of the run: recovering until then.
            f["recovering_at_end_s"] = max(end_t - (record.started + f["at"]), 0.0)
    return {
        "window": {"start": start_t, "end": end_t, "seconds": window},
        "startup_s": start_t - record.started,
        "completed": record.completed,
        "steps": {"first": first, "last": last, "gained": gained},
        "goodput_steps_per_s": gained / window,
        "step_time_s": step_time,
        "ideal_steps_per_s": None if not step_time else 1.0 / step_time,
        "goodput_fraction": None if step_time is None else gained * step_time / window,
        "checkpoint": checkpoint,
        "failures": failures,
        "stops": stops,
        "counts": {
            "attempts": len(record.attempts),
            "restarts": len(record.attempts) - 1,
            "faults": {
                k: sum(f.fault.kind == k for f in record.faults) for k in ("kill", "stop", "term")
            },
            "unplanned": len(record.unplanned),
            "skipped": len(record.skipped),
        },
        "breakdown_s": _breakdown(window, gained, step_time, saves, failures, stops),
    }


def _well_formed(event: dict[str, Any]) -> bool:
    """The event is one stalwart could have written: a finite ``time``, an ``event`` name,
    and ``step``, ``seconds`` and ``stall_s`` absent or numbers >= 0 (``step`` an int).

    ``events.jsonl`` is input from outside the harness: an event that is not well
    formed is left out of every number rather than crash the measurement.
    """
    if not (_number(event.get("time")) and isinstance(event.get("event"), str)):
        return False
    step = event.get("step")
    if step is not None and not (
        isinstance(step, int) and not isinstance(step, bool) and step >= 0
    ):
        return False
    return all(event.get(k) is None or _number(event[k]) for k in ("seconds", "stall_s"))


def _number(value: Any) -> bool:
    """A real, finite number >= 0 (JSON true and false are not numbers here)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _stop_end(record: ChaosRecord, stop: Injected, end_t: float) -> float:
    """When a stop ended: SIGCONT, or the end of its attempt (the process died stopped)
    or of the run, whichever came first."""
    if stop.resumed is not None:
        return stop.resumed
    ended = record.attempts[stop.attempt].ended
    return min(end_t, ended) if ended is not None else end_t


def _until_end(record: ChaosRecord) -> ChaosRecord:
    """The record without the progress lines that came after the deadline (the command
    trains on for a moment after its SIGTERM); a finished run's lines all count."""
    if record.completed:
        return record
    attempts = [
        dataclasses.replace(a, steps=[(t, s) for t, s in a.steps if t <= record.ended])
        for a in record.attempts
    ]
    return dataclasses.replace(record, attempts=attempts)


def _last_step(record: ChaosRecord, events: Sequence[dict[str, Any]], reported: Attempt) -> int:
    """The step the run holds at the end: the last one reported, or, when the final
    attempt was cut off before its first step, the step that attempt restored."""
    final = record.attempts[-1]
    reached = reported.max_step()
    assert reached is not None
    if final is reported:
        return reached
    restore = _restore_of(final, events)
    if restore is None:
        return reached
    return int(restore.get("step") or 0) if restore["event"] == "restore" else 0


def pure_step_time(record: ChaosRecord, events: Sequence[dict[str, Any]]) -> float | None:
    """Seconds per step of fault-free stretches, save stalls taken out (module docstring).

    None when no two consecutive progress lines of an attempt are free of faults.
    """
    cuts = [f.time for f in record.faults] + [
        f.resumed for f in record.faults if f.resumed is not None
    ]
    stall_at = [
        (e["time"], float(e.get("stall_s") or 0.0))
        for e in events
        if _well_formed(e) and e["event"] == "save"
    ]
    seconds, steps = 0.0, 0
    for attempt in record.attempts:
        for (t0, s0), (t1, s1) in itertools.pairwise(attempt.steps):
            if s1 <= s0 or any(t0 < c <= t1 for c in cuts):
                continue
            stalls = sum(stall for t, stall in stall_at if t0 < t <= t1)
            seconds += max(t1 - t0 - stalls, 0.0)
            steps += s1 - s0
    return seconds / steps if steps and seconds > 0 else None


def _failed_attempts(record: ChaosRecord) -> list[int]:
    """Attempts that ended in a failure: a kill or term fault, or an unplanned exit."""
    caused = {f.attempt for f in record.faults if f.fault.kind != "stop"}
    return sorted(caused | set(record.unplanned))


def _failure(record: ChaosRecord, events: Sequence[dict[str, Any]], index: int) -> dict[str, Any]:
    attempt = record.attempts[index]
    fault = next((f for f in record.faults if f.attempt == index and f.fault.kind != "stop"), None)
    failed_at = fault.time if fault is not None else attempt.ended
    reached = attempt.max_step()
    nxt = record.attempts[index + 1] if index + 1 < len(record.attempts) else None
    out: dict[str, Any] = {
        "attempt": index,
        "kind": fault.fault.kind if fault is not None else "unplanned",
        "at": None if failed_at is None else failed_at - record.started,
        "rank": None if fault is None else fault.rank,
        "exit": attempt.returncode,
        "escalated": fault is not None and fault.escalated,
        "step_reached": reached,
        "restored_step": None,
        "lost_steps": None,
        "detection_s": None,
        "restart_s": None,
        "restore_s": None,
        "first_step_s": None,
        "recovery_s": None,
    }
    if failed_at is not None and attempt.ended is not None:
        out["detection_s"] = attempt.ended - failed_at
    if nxt is None:
        return out
    restore = _restore_of(nxt, events)
    first = nxt.first_step()
    if restore is not None:
        restored = int(restore.get("step") or 0) if restore["event"] == "restore" else 0
        seconds = float(restore.get("seconds") or 0.0) if restore["event"] == "restore" else 0.0
        out["restored_step"] = restored
        if reached is not None:
            out["lost_steps"] = max(reached - restored, 0)
        if attempt.ended is not None:
            out["restart_s"] = max(restore["time"] - seconds - attempt.ended, 0.0)
        out["restore_s"] = seconds
        if first is not None:
            out["first_step_s"] = max(first[0] - restore["time"], 0.0)
    if first is not None and failed_at is not None:
        out["recovery_s"] = first[0] - failed_at
    return out


def _restore_of(attempt: Attempt, events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The attempt's own ``restore``/``restore_none`` event: the first one after it started."""
    until = attempt.ended if attempt.ended is not None else float("inf")
    for e in events:
        if e.get("event") in _RESTORE_EVENTS and attempt.started <= e["time"] <= until:
            return e
    return None


def _checkpoint(
    saves: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]], step_time: float | None
) -> dict[str, Any]:
    regular = [s for s in saves if s.get("emergency") is not True]
    stalls = [float(s.get("stall_s") or 0.0) for s in regular]
    every = next(
        (
            e["every_steps"]
            for e in events
            if e.get("event") == "open" and isinstance(e.get("every_steps"), int)
        ),
        None,
    )
    if every is None:
        # No step policy (every_seconds): the typical gap between saved steps.
        steps = sorted({int(s["step"]) for s in regular if isinstance(s.get("step"), int)})
        gaps = [b - a for a, b in itertools.pairwise(steps)]
        every = int(statistics.median(gaps)) if gaps else None
    return {
        "saves": len(saves),
        "emergency_saves": len(saves) - len(regular),
        "stall_median_s": statistics.median(stalls) if stalls else None,
        "stall_total_s": sum(float(s.get("stall_s") or 0.0) for s in saves),
        "every_steps": every,
        "interval_s": None if every is None or step_time is None else every * step_time,
    }


def _breakdown(
    window: float,
    gained: int,
    step_time: float | None,
    saves: Sequence[dict[str, Any]],
    failures: Sequence[dict[str, Any]],
    stops: Sequence[dict[str, Any]],
) -> dict[str, float | None]:
    """Where the window's seconds went; ``other`` is what the parts do not explain."""
    if step_time is None:
        return {
            "useful": None,
            "saves": None,
            "redone": None,
            "recovery": None,
            "stopped": None,
            "other": None,
        }
    parts = {
        "useful": gained * step_time,
        "saves": sum(float(s.get("stall_s") or 0.0) for s in saves),
        "redone": sum((f["lost_steps"] or 0) for f in failures) * step_time,
        # The first step after a restart is compute, counted as useful or redone.
        "recovery": sum(
            max(f["recovery_s"] - step_time, 0.0)
            if f["recovery_s"] is not None
            else f.get("recovering_at_end_s", 0.0)
            for f in failures
        ),
        "stopped": sum(s["seconds"] for s in stops),
    }
    return {**parts, "other": window - sum(parts.values())}
