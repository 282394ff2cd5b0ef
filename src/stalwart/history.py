"""What a run's ``events.jsonl`` says about each step: save timings, why restore skipped
it, which steps reached the durable tier, and the exact-resume certificate's verdicts.

Plain data over ``events.read_events``; no torch, no I/O beyond reading the log.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from stalwart.events import read_events

__all__ = [
    "VERDICT_EVENTS",
    "DurableHistory",
    "RunHistory",
    "history_of",
    "read_history",
    "resume_verdicts",
    "verdict_mark",
]

TIMING_KEYS = ("stall_s", "write_s", "checksum_s", "commit_s", "total_s", "throughput_MBps")
"""The timings of a ``save`` event a history keeps."""


@dataclasses.dataclass(slots=True)
class RunHistory:
    """What ``events.jsonl`` says about each step, for ``ls``."""

    timings: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Timings of the last ``save`` event of each step (stall_s, write_s, ...)."""
    skip_reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    """Reason of the last ``restore_skipped`` event of each step."""
    at_risk: dict[int, int] = dataclasses.field(default_factory=dict)
    """Steps covered by no durable checkpoint when the save of each step began (its
    ``recovery_point`` event: the recovery point the run had then)."""
    durable: DurableHistory = dataclasses.field(default_factory=lambda: DurableHistory())
    """What the events say about the run's durable tier."""


def _int_step(record: Mapping[str, Any]) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _url(value: Any) -> str | None:
    return value.rstrip("/") if isinstance(value, str) and value else None


@dataclasses.dataclass(slots=True)
class _TierRecord:
    """The upload history of one durable URL."""

    durable: set[int] = dataclasses.field(default_factory=set)
    """Steps uploaded (or downloaded from it) and not deleted by durable retention since."""
    uploads: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """The last ``upload`` event of each step."""
    failures: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """The last ``upload_failed`` event of each step not uploaded since."""
    unreachable: dict[str, Any] | None = None
    """The last ``durable_unreachable`` event, if no upload succeeded after it."""
    behind: list[int] = dataclasses.field(default_factory=list)
    """``durable_behind`` steps of the last close, minus those uploaded since."""


@dataclasses.dataclass(slots=True)
class DurableHistory:
    """Which steps of a run reached its durable tier, according to ``events.jsonl``.

    Runs can be reopened with another ``durable=`` URL, so everything is kept per
    URL: ``upload`` and ``download`` events name theirs; ``durable_delete``,
    ``upload_failed`` and the other durable events belong to the URL of the
    ``open`` before them. The tier shown is the newest ``open`` event's, else that
    of the newest upload. A step restored from the tier (``download``) is in it.
    """

    _seen: str | None = None
    _session: str | None = None  # the durable URL of the newest ``open`` (None: none then)
    _tiers: dict[str, _TierRecord] = dataclasses.field(default_factory=dict)

    def feed(self, record: Mapping[str, Any]) -> None:
        """Take one event (in log order)."""
        event = record.get("event")
        step = _int_step(record)
        if event == "open":
            self._session = _url(record.get("durable"))
            self._seen = self._session or self._seen
            return
        url = _url(record.get("url")) if event in ("upload", "download") else None
        url = url or self._session
        if url is None:
            return
        tier = self._tiers.setdefault(url, _TierRecord())
        if event == "upload" and step is not None:
            self._seen = url
            tier.durable.add(step)
            tier.uploads[step] = dict(record)
            tier.failures.pop(step, None)
            tier.unreachable = None
            tier.behind = [s for s in tier.behind if s != step]
        elif event == "download" and step is not None:
            tier.durable.add(step)  # it was restored from there, so it is there
        elif event == "durable_delete" and step is not None:
            tier.durable.discard(step)
        elif event == "upload_failed" and step is not None:
            tier.failures[step] = dict(record)
        elif event == "durable_unreachable":
            tier.unreachable = dict(record)
        elif event == "durable_behind":
            steps = record.get("steps")
            tier.behind = (
                [s for s in steps if isinstance(s, int)] if isinstance(steps, list) else []
            )

    @property
    def url(self) -> str | None:
        """The run's durable URL (no credentials), or None when it never had one."""
        return self._session or self._seen

    def _tier(self) -> _TierRecord:
        url = self.url
        return self._tiers.get(url, _TierRecord()) if url is not None else _TierRecord()

    @property
    def steps(self) -> set[int]:
        """Steps durable in the current tier: uploaded and not deleted by its retention."""
        return set(self._tier().durable)

    @property
    def last_step(self) -> int | None:
        """The newest durable step (what ``CheckpointManager.last_durable_step`` reported)."""
        return max(self._tier().durable, default=None)

    def upload_of(self, step: int) -> dict[str, Any] | None:
        """The last ``upload`` event of ``step`` to the current tier."""
        return self._tier().uploads.get(step)

    @property
    def failures(self) -> list[dict[str, Any]]:
        """``upload_failed`` events of steps never uploaded afterwards, oldest step first."""
        tier = self._tier()
        return [tier.failures[s] for s in sorted(tier.failures)]

    @property
    def unreachable(self) -> dict[str, Any] | None:
        return self._tier().unreachable

    @property
    def behind(self) -> list[int]:
        return list(self._tier().behind)


def history_of(records: Iterable[Mapping[str, Any]]) -> RunHistory:
    """The history of events given in log order."""
    history = RunHistory()
    for record in records:
        history.durable.feed(record)
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        if record.get("event") == "save":
            history.timings[step] = {
                key: float(record[key])
                for key in TIMING_KEYS
                if isinstance(record.get(key), (int, float)) and not isinstance(record[key], bool)
            }
        elif record.get("event") == "restore_skipped" and isinstance(record.get("reason"), str):
            history.skip_reasons[step] = record["reason"]
        elif record.get("event") == "recovery_point":
            risk = record.get("steps_at_risk")
            if isinstance(risk, int) and not isinstance(risk, bool):
                history.at_risk[step] = risk
    return history


def read_history(run: str | os.PathLike[str]) -> RunHistory:
    """The history of ``run``'s ``events.jsonl``; empty when there is no log, ``OSError``
    (``NotRegularFileError`` for a link, FIFO or device) when it cannot be read."""
    return history_of(read_events(run))


# ----------------------------------------------------------------- the exact-resume certificate

VERDICT_EVENTS = ("resume_verified", "resume_diverged", "resume_unverified")
"""The events the exact-resume certificate writes after a restore (via the manager)."""


def verdict_mark(record: Mapping[str, Any] | None) -> str:
    """A short mark for a restore's verdict event; ``None`` (a restore with no verdict) is "unchecked".

    A restore without a verdict comes from a stalwart that did not check yet
    (its ``exact`` field only meant "same world size"), or from a run still
    redoing its steps.
    """
    if record is None:
        return "unchecked"
    event = record.get("event")
    if event == "resume_verified":
        return f"exact to {record.get('through')}"
    if event == "resume_diverged":
        return f"DIVERGED at {record.get('step')} (rank {record.get('rank')})"
    return "unverified"


def resume_verdicts(
    records: Iterable[Mapping[str, Any]] | str | os.PathLike[str],
) -> dict[int, Mapping[str, Any] | None]:
    """For each restored step, the verdict event of its last restore (None: no verdict recorded).

    ``records`` are events in log order, or a run directory (its ``events.jsonl``
    is read; ``OSError`` when it is a link, FIFO or cannot be read).
    """
    events: Iterator[Mapping[str, Any]] | Iterable[Mapping[str, Any]] = (
        read_events(records) if isinstance(records, (str, os.PathLike)) else records
    )
    out: dict[int, Mapping[str, Any] | None] = {}
    for record in events:
        event = record.get("event")
        if event == "restore":
            step = record.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                out[step] = None
        elif event in VERDICT_EVENTS:
            step = record.get("restored_step")
            if isinstance(step, int) and not isinstance(step, bool):
                out[step] = record
    return out
