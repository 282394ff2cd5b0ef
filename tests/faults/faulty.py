"""Helpers for fault tests: a storage backend that fails on purpose, and damage to real files.

``FaultyStorage`` subclasses the real ``LocalStorage`` (nothing of stalwart is
mocked): every method runs the real code unless its fault is armed, and then it
fails the way a filesystem does (``OSError`` with a real errno), at a precise
point of the commit protocol.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from stalwart.events import read_events
from stalwart.manifest import MANIFEST_NAME
from stalwart.storage.local import LocalStorage

__all__ = [
    "DAMAGES",
    "Fault",
    "FaultyStorage",
    "checkpoint_files",
    "copy_run",
    "events_of",
    "exception_chain",
    "flip_byte",
    "leftovers",
    "tree_digest",
]

Fault = Literal["begin", "commit", "manifest_written", "fsync", "delete", "quarantine"]
"""Where ``FaultyStorage`` fails:

- ``begin``: creating the staging directory (a run directory that turned read-only);
- ``commit``: at the start of the commit, before the manifest and the rename;
- ``manifest_written``: after MANIFEST.json was written into staging in full,
  before the rename (the worst moment: staging looks complete);
- ``fsync``: the manifest's temporary file is written but its fsync reports EIO;
- ``delete``: retention deleting an old step (a full disk cannot even rename);
- ``quarantine``: restore moving a corrupt step aside (a read-only run directory).
"""

_ERRORS: dict[str, tuple[type[OSError], int]] = {
    "begin": (PermissionError, errno.EROFS),
    "commit": (OSError, errno.EIO),
    "manifest_written": (OSError, errno.EIO),
    "fsync": (OSError, errno.EIO),
    "delete": (OSError, errno.ENOSPC),
    "quarantine": (PermissionError, errno.EROFS),
}


class FaultyStorage(LocalStorage):
    """``LocalStorage`` that raises ``OSError`` at ``fault`` once ``after`` calls there succeeded.

    ``times`` limits how many calls fail (None: every call from then on);
    ``delay_s`` makes a failing call take that long first (a slow, dying disk);
    ``raised`` records the errors raised, for the test to compare with what the
    caller saw. Set ``fault = None`` to heal the storage.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        fault: Fault | None,
        *,
        after: int = 0,
        times: int | None = None,
        delay_s: float = 0.0,
    ) -> None:
        super().__init__(root)
        self.fault = fault
        self.after = after
        self.times = times
        self.delay_s = delay_s
        self.calls: dict[str, int] = {}
        self.raised: list[OSError] = []

    def _armed(self, where: Fault) -> bool:
        n = self.calls.get(where, 0)
        self.calls[where] = n + 1
        if self.fault != where or n < self.after:
            return False
        return self.times is None or len(self.raised) < self.times

    def _fail(self, where: Fault, path: Path) -> OSError:
        cls, code = _ERRORS[where]
        if self.delay_s:
            time.sleep(self.delay_s)
        exc = cls(code, f"{os.strerror(code)} (injected at {where})", str(path))
        self.raised.append(exc)
        return exc

    def begin(self, step: int) -> Path:
        if self._armed("begin"):
            raise self._fail("begin", self.root)
        return super().begin(step)

    def commit(self, staging: Path, step: int, manifest_json: str) -> Path:
        if self._armed("commit"):
            raise self._fail("commit", staging)
        if self._armed("manifest_written"):
            # What LocalStorage.commit leaves just before its rename: a durable, valid
            # manifest inside the staging directory.
            with open(staging / MANIFEST_NAME, "w", encoding="utf-8") as f:
                f.write(manifest_json)
                f.flush()
                os.fsync(f.fileno())
            raise self._fail("manifest_written", staging / MANIFEST_NAME)
        if self._armed("fsync"):
            tmp = staging / (MANIFEST_NAME + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(manifest_json)
                f.flush()
                raise self._fail("fsync", tmp)
        return super().commit(staging, step, manifest_json)

    def delete(self, step: int) -> None:
        if self._armed("delete"):
            raise self._fail("delete", self.step_path(step))
        super().delete(step)

    def quarantine(self, step: int) -> Path:
        if self._armed("quarantine"):
            raise self._fail("quarantine", self.step_path(step))
        return super().quarantine(step)


# ------------------------------------------------------------------ inspecting a run


def checkpoint_files(checkpoint: Path) -> list[str]:
    """Every file of a checkpoint directory, relative to it, enumerated from the disk."""
    return sorted(
        p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()
    )


def tree_digest(run: Path) -> dict[str, tuple[int, str]]:
    """``{relative path: (size, sha256)}`` of every file of every committed step of ``run``."""
    out: dict[str, tuple[int, str]] = {}
    for step_dir in sorted(run.glob("step_*")):
        for rel in checkpoint_files(step_dir):
            data = (step_dir / rel).read_bytes()
            out[f"{step_dir.name}/{rel}"] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def leftovers(run: Path) -> list[str]:
    """Names of staging (``.tmp-``) and half-deleted (``.del-``) entries in ``run``."""
    return sorted(n for n in os.listdir(run) if ".tmp-" in n or ".del-" in n)


def events_of(run: Path, event: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run) if e.get("event") == event]


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception reachable from it, breadth first.

    Follows ``__cause__``, ``__context__`` and the per-rank ``failures`` of DCP's
    ``CheckpointException`` (values are ``(exception, traceback)`` pairs).
    """
    out: list[BaseException] = []
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                inner = value[0] if isinstance(value, tuple) else value
                if isinstance(inner, BaseException):
                    todo.append(inner)
    return out


# ------------------------------------------------------------------ damaging files


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR the byte at ``offset`` (negative counts from the end) with ``mask``, in place."""
    assert mask & 0xFF, "a zero mask changes nothing"
    size = path.stat().st_size
    pos = offset % size
    with open(path, "r+b") as f:
        f.seek(pos)
        old = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([old ^ (mask & 0xFF)]))


def _flip_start(path: Path) -> None:
    flip_byte(path, 0)


def _flip_middle(path: Path) -> None:
    flip_byte(path, path.stat().st_size // 2, 0x01)


def _flip_end(path: Path) -> None:
    flip_byte(path, -1, 0x80)


def _truncate_empty(path: Path) -> None:
    os.truncate(path, 0)


def _truncate_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _delete(path: Path) -> None:
    path.unlink()


DAMAGES: dict[str, Callable[[Path], None]] = {
    "flip_start": _flip_start,
    "flip_middle": _flip_middle,
    "flip_end": _flip_end,
    "truncate_empty": _truncate_empty,
    "truncate_half": _truncate_half,
    "delete": _delete,
}
"""Ways one file of a checkpoint gets damaged, by name."""


def copy_run(src: Path, dst: Path) -> Path:
    """A private copy of a run directory (the lock file is a plain file; flock is not copied)."""
    shutil.copytree(src, dst, symlinks=True)
    return dst
