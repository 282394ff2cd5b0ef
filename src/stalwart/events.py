"""events.jsonl: one JSON line per save, restore, skip and cleanup, with timings.

Plain data, no torch. Lines are appended with a single ``write`` on a file opened
with ``O_APPEND``, so concurrent writers never interleave inside a line, and a
crash leaves at most one torn last line, which readers skip.

The run directory is input from outside. The log is opened with ``O_NOFOLLOW``
and ``O_NONBLOCK`` and used only when ``fstat`` says it is a regular file: a
symbolic link, FIFO or device planted as ``events.jsonl`` is never written
through (the writer warns once and drops its lines; saves go on) nor read (the
reader raises ``OSError``, which the CLI shows as a warning). Readers bound each
line (``MAX_LINE_BYTES``) and the nesting of its JSON (``MAX_DEPTH``): a longer
or deeper line is skipped and counted, like a torn one.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.files import not_regular
from stalwart.layout import EVENTS_NAME

__all__ = [
    "EVENTS_NAME",
    "MAX_DEPTH",
    "MAX_LINE_BYTES",
    "EventLog",
    "NotRegularFileError",
    "ReadStats",
    "open_regular",
    "read_events",
]

MAX_LINE_BYTES = 1 << 20
"""Longest line readers parse (1 MiB); stalwart's own lines are well under 64 KiB."""
MAX_DEPTH = 32
"""Deepest nesting of lists and objects readers accept in one event (stalwart writes 3)."""
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
        self._refused = False

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
            self._append(self.path, line)
        return record

    def _append(self, path: Path, line: bytes) -> None:
        try:
            fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except NotRegularFileError as exc:
            # Warn once: a link planted in the run must not flood the log either.
            if not self._refused:
                logger.warning("%s; events are not recorded until it is removed", exc)
            self._refused = True
            return
        except OSError as exc:
            # The event log is a diagnostic; a full disk must fail the save that
            # needs the space, not the bookkeeping around it.
            logger.warning("could not append to %s: %s", path, exc)
            return
        try:
            try:
                os.write(fd, line)
            finally:
                os.close(fd)  # a failing close (EIO, EROFS) is a failed append too
        except OSError as exc:
            logger.warning("could not append to %s: %s", path, exc)


class NotRegularFileError(OSError):
    """A file stalwart reads or writes in a run directory is a link, FIFO or device.

    ``str()`` is the message alone (it names the path), without ``[Errno N]``.
    """

    def __str__(self) -> str:
        return str(self.strerror)


def open_regular(path: Path, flags: int) -> int:
    """``os.open(path, flags)`` of a regular file, never through a symbolic link.

    ``O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK`` are added (a FIFO neither blocks the
    open nor is used); the returned descriptor is blocking again. Opened for
    writing, the file must also have a single name: a hard link to a file
    elsewhere would be written like a symbolic link. Raises ``NotRegularFileError``
    naming ``path`` and what it is instead.
    """
    # lstat first: opening a device node can have effects of its own; the fstat
    # below still decides, for an entry swapped in between.
    what = not_regular(os.lstat(path)) if os.path.lexists(path) else None
    if what is not None:
        raise _refusal(path, what, errno.EINVAL)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        # ELOOP for a link, ENXIO for a FIFO without a reader: swapped in meanwhile.
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise _refusal(path, "not a regular file", exc.errno) from exc
        raise
    try:
        what = not_regular(os.fstat(fd), writing=bool(flags & (os.O_WRONLY | os.O_RDWR)))
        if what is not None:
            raise _refusal(path, what, errno.EINVAL)
        os.set_blocking(fd, True)
    except BaseException:  # an interrupt too: the descriptor is not handed out
        os.close(fd)
        raise
    return fd


def _refusal(path: Path, what: str, code: int) -> NotRegularFileError:
    return NotRegularFileError(
        code,
        f"{path} is {what}, not a regular file; stalwart does not use it: remove it",
    )


@dataclasses.dataclass(slots=True)
class ReadStats:
    """What ``read_events`` skipped: lines that were torn, not JSON, too long or too deep."""

    skipped: int = 0


def read_events(
    path: str | os.PathLike[str], *, stats: ReadStats | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the events of an events.jsonl file (or of a run directory's), skipping lines
    that are torn, garbled, not a JSON object, longer than ``MAX_LINE_BYTES`` or nested
    deeper than ``MAX_DEPTH``; ``stats.skipped`` counts them.

    Nothing when the file is absent; ``OSError`` (``NotRegularFileError``) when it is
    a link, FIFO or device.
    """
    stats = stats if stats is not None else ReadStats()
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_NAME
    try:
        fd = open_regular(p, os.O_RDONLY)
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES:
                stats.skipped += 1
                if not line.endswith(b"\n"):
                    _skip_rest_of_line(f)
                continue
            record = _parse(line)
            if record is None:
                if line.strip():
                    stats.skipped += 1
                continue
            yield record


def _skip_rest_of_line(f: Any) -> None:
    while (chunk := f.readline(MAX_LINE_BYTES)) and not chunk.endswith(b"\n"):
        pass


def _parse(line: bytes) -> dict[str, Any] | None:
    """One event, or None for a line that is not a JSON object of bounded depth."""
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        # RecursionError: the C decoder's own guard against a deeply nested line.
        return None
    if not isinstance(record, dict) or _depth_exceeds(record, MAX_DEPTH):
        return None
    return record


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/dicts deeper than ``limit`` (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False
