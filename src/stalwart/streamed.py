"""A restore's data files, checked by streaming them once, then read straight into place.

Holding a whole data file in memory to check it before use costs more than
reading it: 256 MiB of fresh pages take longer to fault in than the read
itself, the checked bytes are then copied once more into the live tensors, and
unmapping them costs more again. A ``StreamedFile`` instead:

1. streams the file once through two reused buffers, hashing one while the
   next is read (xxh3 releases the GIL), and keeps a copy of the few spans a
   decoder will look at: every small item whole, and the first and last
   ``EDGE`` bytes of each large one (a ``torch.save`` record's framing);
2. after its size and xxh3-128 matched the manifest, serves those kept bytes
   (the very bytes checked) to every decoder, and reads a large tensor's raw
   data region with ``preadv`` straight into its target tensor, through the
   descriptor it checked;
3. refuses to read if the file was written to since it was checked: the
   descriptor stays open from check to read, so a rename or delete of the
   path changes nothing, and any write to the file changes its status
   (size, modification or status-change time), which is compared before
   and after every read (``check_unchanged``).

Only raw tensor data is read a second time, never anything that is decoded;
pickles, zip framing and metadata are always the checked copies. Extra memory
is two chunk buffers (4 MiB, or the file's size if smaller) plus the kept
spans, not a checkpoint's size.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import io
import itertools
import os
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

from stalwart.errors import CheckpointCorruptError
from stalwart.manifest import FileEntry, buffer_size, open_checkpoint_file
from stalwart.verify import VERIFY_THREADS, FileProblem, checksum_problem, size_problem
from stalwart.workers import Workers

__all__ = ["EDGE", "SMALL_ITEM", "Span", "StreamedFile", "keep_spans", "stream_check"]

CHUNK = 4 * 1024 * 1024
"""Bytes per streamed read. Measured here, warm: 4 MiB chunks streamed 64 MiB in
8.8 ms against 14 ms for 8 MiB and 25 ms for 16 MiB (fresh buffers are faulted
in, and a chunk still in the shared cache hashes faster); no slower at 1 GiB."""

READ_THREADS = max(1, min(2, os.cpu_count() or 1))
"""Threads reading tensor data into place (preadv releases the GIL)."""

_READERS = Workers("stalwart-read", READ_THREADS)
_HASHERS = Workers("stalwart-hash", VERIFY_THREADS)
"""One hashing thread per file streamed at a time (``VerifiedFiles`` checks up to
``VERIFY_THREADS`` files at once)."""

SMALL_ITEM = 256 * 1024
"""Items up to this size are kept whole while streaming (decoded from memory)."""

EDGE = 4096
"""Bytes kept at each end of a larger item: a ``torch.save`` record's framing."""

Span = tuple[int, int]


def _identity(info: os.stat_result) -> tuple[int, ...]:
    """What changes when anything writes to the file (or it is swapped under the fd)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class StreamedFile:
    """One data file whose checksum matched: its kept spans and its open descriptor.

    ``span(start, end)`` gives kept bytes (None when that range was not kept);
    ``read_into(view, offset)`` fills ``view`` from the file. Close it when done.
    """

    def __init__(
        self, where: str, fd: int, identity: tuple[int, ...], kept: dict[Span, bytearray]
    ) -> None:
        self.where = where
        self._fd = fd
        # Owns fd: an io.FileIO closes it when dropped, in C, should an error raised
        # into the thread (Ctrl-C) skip the close that cleanup code owes.
        self._owner = io.FileIO(fd, "rb")
        self._identity = identity
        self._starts = sorted(a for a, _ in kept)
        self._spans = {a: (b, data) for (a, b), data in kept.items()}

    def span(self, start: int, end: int) -> memoryview | None:
        """The checked bytes ``[start, end)`` if a kept span holds them, else None
        (a writable view: a tensor decoded from it may share its memory)."""
        # Kept spans are merged, so at most one (the last starting at or before
        # ``start``) can hold the range.
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return None
        a = self._starts[i]
        b, data = self._spans[a]
        if end > b:
            return None
        return memoryview(data)[start - a : end - a]

    def check_unchanged(self) -> None:
        """Raise ``CheckpointCorruptError`` if the file was written to since its check."""
        if _identity(os.fstat(self._fd)) != self._identity:
            raise CheckpointCorruptError(
                f"{self.where}: changed on disk after its checksum was checked (another "
                "process wrote to it); it is not used",
                path=self.where,
            )

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` (writable bytes) with the file's bytes from ``offset``.

        An I/O error or a short read (the file shrank) raises
        ``CheckpointCorruptError``, transient for an I/O error.
        """
        done, size = 0, view.nbytes
        while done < size:
            try:
                n = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                raise CheckpointCorruptError(
                    f"{self.where}: cannot read ({exc.strerror or exc})",
                    path=self.where,
                    transient=True,
                ) from exc
            if n == 0:
                raise CheckpointCorruptError(
                    f"{self.where}: ended at byte {offset + done} while reading up to "
                    f"{offset + size} (truncated after its check)",
                    path=self.where,
                )
            done += n

    def read_many(self, reads: list[tuple[memoryview, int]]) -> None:
        """``read_into`` each ``(view, offset)``, in pieces on ``READ_THREADS`` threads
        (from the page cache this is a memory copy, which one core does not saturate)."""
        pieces = [
            (view[done : done + CHUNK], offset + done)
            for view, offset in reads
            for done in range(0, view.nbytes, CHUNK)
        ]
        if len(pieces) <= 1 or READ_THREADS == 1:
            for view, offset in pieces:
                self.read_into(view, offset)
            return
        pending = [_READERS.submit(self.read_into, view, offset) for view, offset in pieces]
        concurrent.futures.wait(pending)  # every read stopped before anything is raised
        for done in pending:
            done.result()  # the first error

    def close(self) -> None:
        self._fd = -1
        self._owner.close()


def keep_spans(items: Iterable[Span]) -> list[Span]:
    """The spans to keep for items ``(offset, length)``: small ones whole, large ones'
    edges; sorted and merged."""
    spans: list[Span] = []
    for offset, length in items:
        if length <= SMALL_ITEM:
            spans.append((offset, offset + length))
        else:
            spans += [(offset, offset + EDGE), (offset + length - EDGE, offset + length)]
    merged: list[Span] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def stream_check(
    directory: str, entry: FileEntry, spans: list[Span], count: Callable[[], None]
) -> StreamedFile | FileProblem:
    """Stream ``entry``'s file once, check its size and xxh3-128, keep ``spans``.

    ``count()`` is called when the file is opened (VerifiedFiles counts reads).
    Returns the checked file (open) or the problem found; never raises for the
    file's content or an I/O error.
    """
    where = os.path.join(directory, entry.path)
    try:
        with open_checkpoint_file(directory, entry.path) as stream:
            size = stream.size
            count()
            problem = size_problem(entry, size)
            if problem is not None:
                return problem
            fd = os.dup(stream.fileno())
        try:
            identity = _identity(os.fstat(fd))
            digest, got, kept = _stream(fd, spans, size)
            problem = size_problem(entry, got) or checksum_problem(entry, digest)
        except BaseException:
            os.close(fd)
            raise
    except FileNotFoundError:
        return FileProblem(entry.path, "missing (listed in the manifest)")
    except CheckpointCorruptError as exc:
        return FileProblem(entry.path, str(exc).removeprefix(f"{exc.path}: "))
    except OSError as exc:
        return FileProblem(entry.path, f"cannot read ({exc.strerror or exc})", True, exc)
    if problem is not None:
        os.close(fd)
        return problem
    return StreamedFile(where, fd, identity, kept)


def _stream(fd: int, spans: list[Span], size: int) -> tuple[str, int, dict[Span, bytearray]]:
    """(xxh3-128 hex, bytes read, kept spans) of the file behind ``fd``, read from 0;
    ``size`` (its size when opened) bounds the buffers, not the read."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead
        except OSError:
            pass
    hasher = xxhash.xxh3_128()
    # Two new buffers of CHUNK cost 3 ms here (zero-filled): a small file's are its size.
    buffers = [bytearray(buffer_size(size, CHUNK)) for _ in range(2)]
    kept: dict[Span, bytearray] = {span: bytearray() for span in spans}
    todo = list(spans)
    pos = 0
    hashing: concurrent.futures.Future[Any] | None = None
    try:
        for turn in itertools.count():
            view = memoryview(buffers[turn % 2])
            # The buffer hashed two turns ago is free: the last turn waited for it.
            n = os.readv(fd, [view])
            if hashing is not None:
                hashing.result()
                hashing = None
            if not n:
                break
            chunk = view[:n]
            hashing = _HASHERS.submit(hasher.update, chunk)
            while todo and todo[0][0] < pos + n:
                a, b = todo[0]
                kept[a, b] += chunk[max(a, pos) - pos : min(b, pos + n) - pos]
                if b > pos + n:
                    break
                todo.pop(0)
            pos += n
    finally:
        if hashing is not None:  # a failed read: the buffer is in use until hashed
            concurrent.futures.wait([hashing])
    return hasher.hexdigest(), pos, kept
