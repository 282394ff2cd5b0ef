"""events.jsonl: one JSON line per save, restore, skip and cleanup, with timings.

Plain data, no torch. Lines are appended with a single ``write`` on a file opened
with ``O_APPEND``, so concurrent writers never interleave inside a line, and a
crash leaves at most one torn last line, which readers skip.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["EVENTS_NAME", "EventLog", "read_events"]

EVENTS_NAME = "events.jsonl"
logger = logging.getLogger("stalwart")


class EventLog:
    """Appends events to ``<run>/events.jsonl`` and mirrors them to the ``stalwart`` logger.

    Thread-safe (one ``os.write`` per line). ``path=None`` only logs, for ranks
    other than the one that owns the run directory.
    """

    def __init__(self, path: Path | None, *, rank: int = 0) -> None:
        self.path = path
        self.rank = rank
        self._host = socket.gethostname()

    def emit(self, event: str, level: int = logging.INFO, /, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {
            "time": round(time.time(), 6),
            "event": event,
            "rank": self.rank,
            "pid": os.getpid(),
            "host": self._host,
            **fields,
        }
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        logger.log(level, "%s %s", event, text)
        if self.path is not None:
            line = (json.dumps(record, default=str, allow_nan=True) + "\n").encode()
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            except OSError as exc:
                # The event log is a diagnostic; a full disk must fail the save that
                # needs the space, not the bookkeeping around it.
                logger.warning("could not append to %s: %s", self.path, exc)
        return record


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events of an events.jsonl file, skipping torn or garbled lines."""
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_NAME
    if not p.exists():
        return
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record
