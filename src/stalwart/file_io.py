"""The system-level pieces of ``HashedFile``: positional writes, write-back hints,
page-aligned buffers for direct I/O."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator

__all__ = [
    "BOUNCE_BYTES",
    "BOUNCE_POOL",
    "DIRECT_ALIGN",
    "FRAME_BYTES",
    "FRAME_POOL",
    "BufferPool",
    "after",
    "start_write_back",
    "write_at",
]

DIRECT_ALIGN = 4096
"""File offset, memory address and length granularity of a direct write: the
page size, a multiple of the logical block size of every disk."""
_SYNC_FILE_RANGE_WRITE = 2
"""``SYNC_FILE_RANGE_WRITE`` of <linux/fs.h>: start write-back, wait for nothing."""


def _find_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_SYNC_FILE_RANGE = _find_sync_file_range()


def start_write_back(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to the disk now.

    Only a hint that makes the later fsync shorter: a failure here (an
    unsupported filesystem) is ignored, because the fsync that follows
    writes whatever is left and reports every write-back error itself.
    """
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


BOUNCE_BYTES = 8 * 2**20
"""Size of one bounce buffer: large direct writes, and a copy that stays in cache."""


class BufferPool:
    """Page-aligned buffers of ``size`` bytes for direct writes, reused across saves.

    Each writing thread leases one for as long as a view takes; at most
    ``KEEP`` idle ones are kept (mapped once, so their pages are not faulted
    in again on every save).
    """

    KEEP = 4

    def __init__(self, size: int = BOUNCE_BYTES) -> None:
        self.size = size
        self._idle: list[memoryview] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lease(self) -> Iterator[memoryview]:
        with self._lock:
            buf = self._idle.pop() if self._idle else None
        if buf is None:
            buf = memoryview(mmap.mmap(-1, self.size))
        try:
            yield buf
        finally:
            with self._lock:
                if len(self._idle) < self.KEEP:
                    self._idle.append(buf)


BOUNCE_POOL = BufferPool()

FRAME_BYTES = 64 * DIRECT_ALIGN
"""Page-aligned scratch per file for the record framing between two direct pieces
(a record's last partial page, its trailer, the next one's padding and header:
one or two pages each), so that consecutive direct pieces go out in one write."""

FRAME_POOL = BufferPool(FRAME_BYTES)


def after(pieces: list[memoryview], count: int) -> list[memoryview]:
    """``pieces`` without their first ``count`` bytes."""
    rest = list(pieces)
    while rest and count >= rest[0].nbytes:
        count -= rest[0].nbytes
        rest.pop(0)
    if rest and count:
        rest[0] = rest[0][count:]
    return rest


def write_at(fd: int, pending: list[memoryview], offset: int) -> None:
    """Write ``pending`` at ``offset`` of ``fd``, whatever short writes happen.

    ``lseek`` then ``writev`` rather than ``pwritev``: Python's ``os.pwritev``
    calls ``pwritev2``, which interposers and tracers of file I/O (the I/O
    fault shim of the tests among them) may not see. Only the file's own
    writer thread uses ``fd``, so the seek and the write cannot interleave
    with another write.
    """
    os.lseek(fd, offset, os.SEEK_SET)
    while pending:
        written = os.writev(fd, pending)
        if written == 0 and any(b.nbytes for b in pending):
            # No progress and no error: retrying would loop forever.
            raise OSError(errno.EIO, "writev wrote nothing")
        # A short write (a signal, a filesystem's limit): go on after what it took.
        pending = after(pending, written)
