"""One new file written with large writes, hashed (xxh3-128) as it is written.

``HashedFile`` is what ``stalwart.writer`` writes every data file and
``.metadata`` through: buffers are hashed as they are queued and go to the
kernel in ``writev`` calls of up to 16 MiB at explicit offsets, with a
write-back hint after each batch (``sync_file_range``, Linux); the whole pages
of a large page-aligned buffer can go to the disk with ``O_DIRECT`` straight
from where they are (``add_direct``: consecutive ones in one ``writev`` with
the framing between them copied into frame pages, on a thread of its own
while the caller goes on), and a packed file's
buffers through reused page-aligned bounce buffers (``pack``), falling back
to the page cache where the filesystem refuses direct I/O. ``sync`` fsyncs on the descriptor that wrote, so a write-back
error is reported to it; every OSError names the file. ``Task`` runs a
function in a thread of its own and re-raises its exception in whoever waits.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from stalwart.file_io import (
    BOUNCE_BYTES,
    BOUNCE_POOL,
    DIRECT_ALIGN,
    FRAME_POOL,
    after,
    start_write_back,
    write_at,
)
from stalwart.manifest import FileEntry
from stalwart.workers import Workers, refused_new_work

__all__ = [
    "BATCH_BYTES",
    "BOUNCE_BYTES",
    "DIRECT_ALIGN",
    "O_DIRECT",
    "HashedFile",
    "Task",
    "write_at",
]

BATCH_BYTES = 16 * 2**20
"""Bytes gathered before one ``writev``: large enough that the syscall cost vanishes."""
BATCH_BUFFERS = 512
"""Buffers gathered before one ``writev``; Linux accepts at most 1024 (IOV_MAX)."""
O_DIRECT = getattr(os, "O_DIRECT", 0)
"""0 where the platform has no direct I/O (then every write is buffered)."""


class Task:
    """``fn(*args)`` in a writer thread; ``result`` waits and re-raises its exception.

    The threads are kept between saves (``stalwart.workers``: a thread's start
    and join cost about a millisecond each here, and a save runs one task per
    file it writes). No task waits for another one. While the interpreter
    exits (a script that never closed its manager), when executors take no
    more work, the task gets a thread of its own, or runs inline where even
    that is refused.
    """

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._future = _WRITERS.submit(fn, *args)

    def result(self) -> Any:
        return self._future.result()

    def wait(self) -> BaseException | None:
        """Wait for the task; its exception, returned, not raised. Only an exception
        raised into the waiting thread (an interrupt) comes out of this."""
        return self._future.exception()


_WRITERS = Workers("stalwart-writer", 8)
"""Writer threads of every save of the process (one per file written and its fsync)."""
_DIRECT_WRITERS = Workers("stalwart-direct", 8)
"""Threads of the gathered direct writes (``HashedFile._flush_gather``), at most one
in flight per file."""


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset`` (positional: the file's offset is the
    writer thread's, ``write_at``)."""
    done = 0
    while done < view.nbytes:
        written = os.pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "write wrote nothing")
        done += written


class HashedFile:
    """One new file written with large ``writev`` calls and hashed as it is written.

    ``add`` hashes buffers and queues them; every 16 MiB they go to the kernel
    in one ``writev`` from the caller's thread. (An I/O thread per file that
    overlapped the ``writev`` with the next items' preparation was measured
    too: no faster here, and up to 3x the CPU time on 2 cores; only direct
    writes from bounce buffers, see ``pack``, have a thread of their own.) ``finish``
    writes what is queued and returns the file's manifest entry; ``sync``
    waits for the last direct write, fsyncs and closes the file (on the same
    descriptor, so that a write-back error is reported to it). OSErrors name
    the file.
    """

    def __init__(self, path: Path, *, overlap: bool = True) -> None:
        """``overlap``: gathered direct writes run on a thread of their own while the
        caller goes on (``_flush_gather``); False: in the caller's thread, which
        costs less CPU time (a save in the background, which nobody waits for)."""
        self.path = path
        self.overlap = overlap
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.hash = xxhash.xxh3_128()
        self.size = 0
        self._direct_fd: int | None = None
        self._direct_ok = bool(O_DIRECT)
        self._direct_done = 0  # by the caller's thread (``add_direct``)
        self._bounced_done = 0  # by the I/O thread (packed bounce buffers)
        self._io: ThreadPoolExecutor | None = None
        self._slots: list[tuple[memoryview, Future[None] | None]] = []
        self._next_slot = 0
        self._leases: contextlib.ExitStack | None = None
        self._runs: list[tuple[int, list[Any]]] = []
        """Queued buffers, as runs of consecutive bytes: (file offset, buffers)."""
        self._packing = False
        self._fill = 0
        """While packing: bytes at the start of the current bounce buffer not yet submitted."""
        self._last_run_bytes = 0
        self._pending_buffers = 0
        self._pending_bytes = 0
        self._gather: list[memoryview] = []
        """Page-aligned pieces for one direct write, consecutive in the file from ``_gather_at``."""
        self._gather_at = 0
        self._gather_bytes = 0
        self._frames: memoryview | None = None
        self._frames_busy: memoryview | None = None
        """The frame pages of the gathered write in flight (``_writing``), if any."""
        self._frame_lease: contextlib.ExitStack | None = None
        self._frames_used = 0
        self._writing: Future[None] | None = None
        """The gathered direct write in flight on a ``_DIRECT_WRITERS`` thread, if any."""
        self._abandoning = threading.Lock()
        """``abandon`` can run in two threads at once: a file's fsync task ends with
        it, and the writer's cleanup calls it for a file whose task it never saw
        (an exception raised into the saving thread between the two). One of them
        closes the descriptor; a second close could close another file's."""
        self.framing_bytes = 0
        """Bytes of record framing sent with direct pieces (counted in ``direct_bytes``
        once written, unless the filesystem refused direct I/O)."""

    @property
    def direct(self) -> bool:
        """Whether direct writes are still worth trying for this file."""
        return self._direct_ok

    @property
    def direct_bytes(self) -> int:
        """Bytes written with O_DIRECT, past the page cache (complete once ``sync`` returned)."""
        return self._direct_done + self._bounced_done

    def pack(self) -> bool:
        """Send every later ``add`` to the disk with O_DIRECT, packed into bounce buffers.

        For a file of many buffers too small to go direct one by one (the
        records of a state of many small tensors): they are copied end to end
        into the page-aligned bounce buffers, hashed there, and each full
        buffer is written by this file's I/O thread while the caller goes on;
        the file's last partial page goes through the page cache at ``finish``.
        A copy into a reused buffer costs less CPU than filling and accounting
        new page-cache pages, and the file takes no page cache. False, and
        nothing changed, where direct I/O is off, the file's end is not
        page-aligned, or no bounce buffer can be mapped.
        """
        if self._packing:
            return True
        if not self._direct_ok or self.size % DIRECT_ALIGN or self._open_direct() is None:
            return False
        try:
            self._free_slot()
        except OSError:  # no memory map left: the page cache, as without packing
            return False
        self._flush_gather()
        self._wait_gathered()  # packed writes use the direct descriptor from here
        self.flush()
        self._packing = True
        return True

    def _pack(self, view: memoryview) -> None:
        """Copy ``view`` into the bounce buffers at the file's end; submit each one filled."""
        n, done = view.nbytes, 0
        while done < n:
            bounce = self._free_slot()  # waits for the write from it, if any, to end
            take = min(n - done, BOUNCE_BYTES - self._fill)
            dest = bounce[self._fill : self._fill + take]
            dest[:] = view[done : done + take]
            self.hash.update(dest)
            done += take
            self._fill += take
            self.size += take
            if self._fill == BOUNCE_BYTES:
                self._fill = 0
                self._submit(bounce, self.size - BOUNCE_BYTES)

    def _submit_fill(self) -> tuple[memoryview, int] | None:
        """Submit the whole pages packed so far; the partial page left (view, offset), if any."""
        fill, self._fill = self._fill, 0
        if not fill:
            return None
        bounce = self._slots[self._next_slot][0]
        whole = fill - fill % DIRECT_ALIGN
        start = self.size - fill
        if whole:
            self._submit(bounce[:whole], start)
        return (bounce[whole:fill], start + whole) if whole < fill else None

    def add_direct(self, view: memoryview, address: int) -> bool:
        """Write ``view`` (at ``address`` in memory) at the file's end with O_DIRECT.

        Only for a view of whole pages at a page-aligned address, at a
        page-aligned end of file; False (nothing done) otherwise or where the
        filesystem refuses direct I/O, and the caller adds it buffered instead.
        The view goes to the disk from where it is, with the views before and
        after it that are consecutive in the file (``_gather_direct``), in a
        write started by ``finish`` at the latest and waited for by ``sync``;
        in a packed file, at once, after the packed bytes before it. The view
        must stay unchanged until ``sync`` returned (or ``abandon``).
        """
        n = view.nbytes
        if (
            not self._direct_ok
            or n == 0
            or n % DIRECT_ALIGN
            or self.size % DIRECT_ALIGN
            or address % DIRECT_ALIGN
        ):
            return False
        fd = self._open_direct()
        if fd is None:
            return False
        # Queued buffered bytes before it stay queued: every write is positional.
        self._submit_fill()  # packed bytes before it: whole pages, the end being aligned
        offset = self.size
        if not self._packing:
            self.hash.update(view)
            self._gather_direct(view, offset)
        else:
            with self._naming_errors():
                done = self._write_direct(fd, view, offset)
                self.hash.update(view)
                if done < n:
                    write_at(self.fd, [view[done:]], offset + done)
            self._direct_done += done
        self.size += n
        return True

    def _gather_direct(self, view: memoryview, offset: int) -> None:
        """Queue ``view`` (whole pages, page-aligned in memory, at ``offset``) for one
        direct write with the pieces before it.

        Pieces are written together while they are consecutive in the file: the
        framing queued between the last one and this (whole pages, both ends
        being page-aligned) is copied into frame pages and goes with them. The
        queue is written once it holds ``BOUNCE_BYTES``, or when the file's
        bytes stop being consecutive: a file of 1.3 MB staged tensors goes out
        in one write per 8 MiB instead of one per tensor (O_DIRECT costs CPU
        per call: 64 MiB in 1.3 MB writes took 11.5-14.3 ms of CPU here, in
        8 MiB ones 4.4-6.3 ms).
        """
        end = self._gather_at + self._gather_bytes
        if self._gather and end != offset:
            frame = self._frame_between(end, offset)
            if frame is None:
                self._flush_gather()
            else:
                self._gather.append(frame)
                self._gather_bytes += frame.nbytes
        if not self._gather:
            self._gather_at = offset
        self._gather.append(view)
        self._gather_bytes += view.nbytes
        if self._gather_bytes >= BOUNCE_BYTES or len(self._gather) >= BATCH_BUFFERS:
            self._flush_gather()

    def _frame_between(self, start: int, end: int) -> memoryview | None:
        """The queued bytes ``[start, end)`` copied into frame pages (and no longer
        queued), if one run holds exactly them and they fit; else None."""
        if not self._runs:
            return None
        run_at, run = self._runs[-1]
        length = end - start
        if run_at != start or self._last_run_bytes != length:
            return None
        if self._frames is None:
            if self._frame_lease is None:
                self._frame_lease = contextlib.ExitStack()
            try:
                self._frames = self._frame_lease.enter_context(FRAME_POOL.lease())
            except OSError:  # no memory map left: these bytes go through the page cache
                return None
        if self._frames_used + length > self._frames.nbytes:
            return None
        dest = self._frames[self._frames_used : self._frames_used + length]
        at = 0
        for piece in run:  # flat byte views (``add``)
            dest[at : at + piece.nbytes] = piece
            at += piece.nbytes
        self._frames_used += length
        self._runs.pop()
        self._pending_buffers -= len(run)
        self._pending_bytes -= length
        self._last_run_bytes = 0  # the run before it (if any) does not end at the file's end
        self.framing_bytes += length
        return dest

    def _flush_gather(self) -> None:
        """Write the queued direct pieces in one direct ``writev`` (buffered where the
        filesystem refuses direct I/O); with ``overlap``, start it on a
        ``_DIRECT_WRITERS`` thread once the write before it ended, and the
        caller prepares and hashes the next pieces meanwhile. The frame pages
        it copies go with it, and the next pieces get the other set
        (``_frames_busy``)."""
        if not self._gather:
            return
        pieces, at = self._gather, self._gather_at
        self._gather, self._gather_bytes = [], 0
        self._wait_gathered()
        if self.overlap:
            self._writing = _DIRECT_WRITERS.submit(self._write_gathered, pieces, at)
            self._frames, self._frames_busy = self._frames_busy, self._frames
        else:
            self._write_gathered(pieces, at)
        self._frames_used = 0

    def _wait_gathered(self, *, raise_error: bool = True) -> None:
        """Wait for the gathered write in flight, if any; raise its error (``raise_error``).

        It counts as in flight until the wait ended: an interrupt raised into
        the waiting thread leaves it for the next wait (``abandon`` closes no
        descriptor under a write)."""
        writing = self._writing
        if writing is not None:
            error = writing.exception()
            self._writing = None
            if error is not None and raise_error:
                raise error

    def _write_gathered(self, pieces: list[memoryview], at: int) -> None:
        """``pieces`` at ``at``, direct, the rest buffered; on a ``_DIRECT_WRITERS`` thread
        with ``overlap`` (positional writes only: the caller's thread seeks ``fd``)."""
        fd = self._direct_fd
        with self._naming_errors():
            direct = self._write_direct_many(fd, pieces, at) if fd is not None else 0
            done = direct
            for piece in after(pieces, direct):
                _pwrite_all(self.fd, piece, at + done)
                done += piece.nbytes
        self._direct_done += direct

    def _write_direct_many(self, fd: int, pieces: list[memoryview], offset: int) -> int:
        """``_write_direct`` of consecutive page-aligned ``pieces`` with ``writev``."""
        done, pending = 0, list(pieces)
        while pending and self._direct_ok:
            try:
                os.lseek(fd, offset + done, os.SEEK_SET)
                written = os.writev(fd, pending)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_ok = False  # as in _write_direct: the rest is buffered
                break
            if written <= 0:
                raise OSError(errno.EIO, "direct write wrote nothing")
            done += written
            pending = after(pending, written)
            if pending and done % DIRECT_ALIGN:
                self._direct_ok = False  # a short write left an unaligned rest
        return done

    def _free_slot(self) -> memoryview:
        """The next bounce buffer, once the write from it (if any) is done."""
        if not self._slots:
            with contextlib.ExitStack() as leases:
                buffers = [leases.enter_context(BOUNCE_POOL.lease()) for _ in range(2)]
                self._leases = leases.pop_all()  # kept until abandon; on error, given back
            self._slots = [(buf, None) for buf in buffers]
            self._io = ThreadPoolExecutor(1, thread_name_prefix="stalwart-direct")
        buf, pending = self._slots[self._next_slot]
        if pending is not None:
            pending.result()  # re-raises the I/O thread's error here
        return buf

    def _submit(self, bounce: memoryview, offset: int) -> None:
        assert self._io is not None
        try:
            future: Future[None] | None = self._io.submit(self._write_bounced, bounce, offset)
        except RuntimeError as exc:
            if not refused_new_work(exc):
                raise
            # No new work at this point of the interpreter's exit: inline, one
            # write at a time as on the I/O thread.
            self._drain()
            self._write_bounced(bounce, offset)
            future = None
        self._slots[self._next_slot] = (self._slots[self._next_slot][0], future)
        self._next_slot = (self._next_slot + 1) % len(self._slots)

    def _write_bounced(self, piece: memoryview, offset: int) -> None:
        """On the I/O thread: ``piece`` at ``offset``, direct, or buffered once direct
        I/O stopped (positional writes only: the caller's thread seeks ``fd``)."""
        with self._naming_errors():
            fd = self._direct_fd
            done = self._write_direct(fd, piece, offset) if fd is not None else 0
            self._bounced_done += done
            _pwrite_all(self.fd, piece[done:], offset + done)

    def _drain(self, *, raise_first: bool = True) -> None:
        """Wait for every bounced write, then raise the first error (``raise_first``)."""
        slots, self._slots = self._slots, [(buf, None) for buf, _pending in self._slots]
        first = None
        for _buf, pending in slots:
            if pending is not None:
                first = first or pending.exception()
        if first is not None and raise_first:
            raise first

    def _write_direct(self, fd: int, view: memoryview, offset: int) -> int:
        """pwrite ``view`` (page-aligned) at ``offset`` with O_DIRECT; the bytes written.

        Fewer than all when the filesystem refuses direct I/O after all
        (EINVAL) or a short write leaves an unaligned rest: direct writes then
        stop for this file, and the caller writes the rest buffered.
        """
        done, n = 0, view.nbytes
        while done < n and self._direct_ok:
            try:
                written = os.pwrite(fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # This filesystem (or this write's alignment) takes no direct
                # I/O after all: the rest of the file goes through the page cache.
                self._direct_ok = False
                break
            if written <= 0:
                raise OSError(errno.EIO, "direct write wrote nothing")
            done += written
            if done < n and done % DIRECT_ALIGN:
                self._direct_ok = False  # a short write left an unaligned rest
        return done

    def _open_direct(self) -> int | None:
        """A second descriptor of this very file, for direct writes; None if there is none.

        Opened by path, so it must be the file ``fd`` created: not through a
        symbolic link (``O_NOFOLLOW``), and the same device and inode as
        ``fd`` (a file swapped in at the path since then is left alone, and
        this file gets buffered writes only).
        """
        if self._direct_fd is None and self._direct_ok:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | O_DIRECT)
            except OSError:
                # EINVAL: no direct I/O on this filesystem; ELOOP: a link at the path.
                self._direct_ok = False
                return None
            mine, theirs = os.fstat(self.fd), os.fstat(fd)
            if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
                os.close(fd)
                self._direct_ok = False
                return None
            self._direct_fd = fd
        return self._direct_fd

    def _close_direct(self) -> None:
        # Only once no bounced write is in flight: a descriptor closed under a
        # write could be reused by another file and take its data.
        fd, self._direct_fd = self._direct_fd, None
        if fd is not None:
            os.close(fd)

    def add(self, buffers: Sequence[Any]) -> None:
        """Queue ``buffers`` for writing; they must stay unchanged until ``finish``.

        A flat byte view (a record's parts: ``RecordTemplates`` keeps its
        framing as views) is queued as it is, anything else as one made once
        here, never a view per buffer per write: in a save written in the
        background, whose records stay alive while the training thread runs,
        those views were objects enough to set off Python's full collections
        (an async save of 768 small tensors, alternately with the code before:
        23.5-24.2 ms of CPU against 26.8-28.1, full collections from one per 14
        saves to one per 20).
        """
        if self._packing:
            for buf in buffers:
                self._pack(memoryview(buf).cast("B"))
            return
        runs = self._runs
        if runs and runs[-1][0] + self._last_run_bytes == self.size:
            run = runs[-1][1]
        else:  # the first run, or a direct write came in between
            run = []
            runs.append((self.size, run))
            self._last_run_bytes = 0
        update, total = self.hash.update, 0
        for buf in buffers:
            if type(buf) is not memoryview or buf.format != "B" or buf.ndim != 1:
                buf = memoryview(buf).cast("B")
            update(buf)
            run.append(buf)
            total += buf.nbytes
        self.size += total
        self._last_run_bytes += total
        self._pending_bytes += total
        self._pending_buffers += len(buffers)
        if self._pending_bytes >= BATCH_BYTES or self._pending_buffers >= BATCH_BUFFERS:
            self.flush()

    def flush(self) -> None:
        """Write the queued runs at their offsets, then start their write-back."""
        if not self._runs:
            return
        runs, self._runs = self._runs, []
        self._pending_buffers = self._pending_bytes = 0
        start = runs[0][0]
        with self._naming_errors():
            for offset, run in runs:
                write_at(self.fd, run, offset)
        start_write_back(self.fd, start, self.size - start)

    def finish(self) -> FileEntry:
        """Write what is queued: the file's entry (size, xxh3-128); not yet durable.

        The last gathered direct write may still be in flight when this returns:
        ``sync`` waits for it (and raises its error) before the fsync. Queued
        buffered bytes, written here, wait for it anyway where the filesystem
        holds the file's lock for a direct write that extends it (ext4)."""
        self._flush_gather()
        tail = self._submit_fill()
        self._drain()  # first: the file's writes end in one order, whatever the threads did
        if tail is not None:
            with self._naming_errors():
                write_at(self.fd, [tail[0]], tail[1])
        self.flush()
        return FileEntry(path=self.path.name, size=self.size, xxh3_128=self.hash.hexdigest())

    def sync(self) -> None:
        """fsync and close: the file is durable once this returns."""
        try:
            self._wait_gathered()
            with self._naming_errors():
                os.fsync(self.fd)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close without fsync (after a failure, or once synced); idempotent, and safe
        to call from two threads at once."""
        with self._abandoning:
            self._gather, self._gather_bytes = [], 0  # never written: the file is abandoned
            self._wait_gathered(raise_error=False)  # its frame pages and descriptors in use
            self._frames = self._frames_busy = None
            if self._frame_lease is not None:
                self._frame_lease.close()  # the frame pages back to the pool
                self._frame_lease = None
            # A failed save's error was raised already. (Not a suppress(Exception):
            # it would swallow an interrupt raised into this thread while it waits.)
            self._drain(raise_first=False)
            if self._io is not None:
                self._io.shutdown(wait=True)
                self._io = None
            if self._leases is not None:
                self._leases.close()  # the bounce buffers back to the pool
                self._leases = None
                self._slots = []
            self._close_direct()
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)

    @contextlib.contextmanager
    def _naming_errors(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            exc.filename = str(self.path)  # writev and fsync errors name no file by themselves
            raise
