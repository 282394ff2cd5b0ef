"""The storage writer of a save: DCP's file layout, written at the disk's speed, hashed while written.

``ChecksummingWriter`` is a ``torch.distributed.checkpoint`` ``StorageWriter``
(a ``FileSystemWriter`` whose ``write_data`` and ``finish`` are stalwart's
own). DCP still plans the save, so resharding and every DCP reader keep
working; what changes is how the bytes reach the disk:

- Each item is the same bytes as DCP's ``torch.save`` of it (the zip record
  torch's ``FileSystemReader`` reads, zip CRC-32 off, see ``without_zip_crc``),
  but a tensor's record is built from a cached header and trailer around the
  tensor's own memory (``RecordTemplates``): no pickling per item after the
  first save of a layout, no copy of the tensor (``stalwart.records``). A
  file's records are prepared before its writes start (``_prepared``).
- Each record starts at a 64-byte aligned offset of its file (zeros fill the
  gaps, which no reader reads: DCP reads a record by its offset and length),
  so a tensor's data, 64-byte aligned within its record by torch, is aligned
  in the file as in memory: 256 MiB written with 15% less CPU time here.
- The records go out in ``os.writev`` calls of up to 16 MiB straight from the
  tensors' memory, and the xxh3-128 of the whole file is computed from the
  same buffers on the way, so nothing reads the file back (``written`` holds
  every file's size and checksum, as the manifest records them).
- The kernel is asked to start writing each batch to the disk as soon as it
  is in the page cache (``sync_file_range``, Linux), so the final fsync
  waits for the tail of the file only, not for all of it: 64 MiB written and
  fsynced in 24 ms instead of 33 ms here. Each file is fsynced once, and the
  fsync is what makes it durable and what reports any write-back error.
- The whole pages of a large tensor's data (1 MiB and up) are written with
  ``O_DIRECT`` from the tensor's own memory straight to the disk: no copy
  into the page cache, which is most of a buffered write's CPU time (64 MiB:
  about 3 ms of CPU instead of 17 ms here). Direct I/O needs page-aligned
  memory: an async save's staging buffers are (``staging.StagingArea``); a
  live tensor's memory (a sync save) is 64-byte aligned, so the bytes before
  its first page boundary in memory go with the record's header through the
  page cache, and the record is placed so that the rest starts on a page
  boundary of the file (``_add_direct_record``; the record itself stays
  64-byte aligned). A sync save of the 256 MiB benchmark state, alternated
  with the bounce-buffer copy this replaced: best 55 ms of CPU against 114,
  and 452 ms against 495 of wall time. Consecutive such records go out in
  one direct write of up to 8 MiB, the framing pages between them copied
  along (``HashedFile.add_direct``): O_DIRECT costs CPU per call more than
  per byte (64 MiB in 1.3 MB writes: 12 ms; in 8 MiB ones: 5 ms).
- Each such write of a synchronous save, which training waits for, runs on
  a thread of its own while the caller prepares and hashes the next one's
  records, and the file's fsync waits for the last
  (``HashedFile._flush_gather``). A sync save of the 64 MiB benchmark state
  keeps the disk writing from 4.5 ms after the save began, with 1.4 ms of
  gaps in all between its 7 writes; alternately with the writes in the
  caller's thread, 12 saves each, twice: median 44.4 ms against 48.5, and
  43.8 against 44.2. A save in the background writes them from its own
  thread, which costs less CPU time (async saves of the same state
  alternately with threaded writes, 16 each, twice: median 22.6 ms of CPU
  against 24.0, and 24.3 against 24.7).
- In a save written in the background (async), once 1 MiB of tensor
  records went through the page cache, the rest of the file is packed
  (``HashedFile.pack``): every later record that does not go direct by
  itself, however small, is copied end to end into reused page-aligned
  bounce buffers, written by the file's I/O thread, and goes direct too, all
  but the file's last partial page. That costs less CPU time (the 64 MiB
  benchmark state, tensors of 1.3 MB, saved packed: 39 ms against 50 ms,
  best of 10, and 20 ms for a raw write) but more wall time on a disk whose
  direct writes are slower than the page cache's write-back (the same state
  in one benchmark run: 94 ms against 79 ms), so a synchronous save, which
  training waits for, is not packed.
  The rest goes through the page cache, at explicit offsets. A filesystem that refuses direct I/O (at open or at
  any write, ``EINVAL``) gets buffered writes for the rest of the file.
- A write that fails, in any writer thread, raises in the caller's thread:
  ``dcp.save`` fails, never returns over a short file (torch 2.13's
  ``FileSystemWriter`` loses its other threads' errors).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from stalwart.hashed_file import BOUNCE_BYTES, DIRECT_ALIGN, HashedFile, Task
from stalwart.layout import DCP_METADATA_JSON_NAME
from stalwart.manifest import FileEntry
from stalwart.records import RecordTemplates, record_settings, without_zip_crc
from stalwart.save_plan import SavePlanCache, encode_metadata
from stalwart.staging import is_staging_buffer

__all__ = ["ChecksummingWriter", "RecordTemplates", "record_settings", "without_zip_crc"]

_RECORD_ALIGN = 64
"""Each record starts at a multiple of this in its file (zero bytes between records).
torch aligns a tensor's data to 64 bytes within its record, so the data is then
64-byte aligned in the file as in memory: the kernel's copy into the page cache
costs about a tenth less than from unaligned offsets (256 MiB: ~5 ms of CPU).
DCP reads every record by its offset and length, so the gaps are never read."""
_DIRECT_MIN = 2**20
"""Tensor data smaller than this goes through the page cache (at most a page of
padding per record buys nothing for small tensors)."""
_PACK_AFTER = 2**20
"""Once this many bytes of tensor records went through the page cache, the rest
of the file is packed (``HashedFile.pack``): every later record that does not go
direct on its own is copied end to end into the bounce buffers and written
with O_DIRECT. A file whose large tensors go direct by themselves (an async
save's page-aligned staging buffers) and whose other records are few stays as
it is: packing would cut the large ones' direct writes into small ones."""
_PREPARE_COPIES = 64 * 2**20
"""Bytes of tensor copies (a GPU tensor's, a view's) prepared ahead of their writes."""
_PREPARE_RECORDS = 64
"""Records prepared ahead of their writes, at most (``_prepared``)."""
_ZEROS = memoryview(bytes(DIRECT_ALIGN))
_METADATA = ".metadata"

# --------------------------------------------------------------------------- files


def _write_file(
    path: Path,
    storage_key: str,
    items: list[WriteItem],
    planner: SavePlanner,
    templates: RecordTemplates,
    pack: bool = False,
    earlier: Sequence[WriteResult] = (),
    records: PreparedRecords | None = None,
) -> tuple[list[WriteResult], HashedFile, PreparedRecords | None]:
    """Write ``items`` into the new file ``path`` as DCP's ``FileSystemWriter`` lays them out.

    ``pack``: the file may be packed (see ``_PACK_AFTER``). ``earlier``: the
    last save's results for this file, each reused where it is the same
    (``_result``). ``records``: the last save's prepared records of this
    file, for a state of staged tensors (``_prepared``); None: none are kept.
    Returns the write results, the file, written and hashed but not yet
    fsynced, and this save's prepared records (None where ``records`` was).
    """
    results: list[WriteResult] = []
    kept = None if records is None else PreparedRecords()
    out = HashedFile(path, overlap=not pack)  # a save in the background spares CPU instead
    try:
        packed = False
        may_pack = pack  # until packing was tried
        cached = 0  # bytes of tensor records written through the page cache
        for item, tensor, buffers in _prepared(items, planner, templates, records, kept):
            if (
                tensor is not None
                and tensor.nbytes >= _DIRECT_MIN
                and _direct_candidate(out, tensor, buffers, packed)
            ):
                offset = _add_direct_record(out, tensor, buffers)
            else:
                if may_pack and tensor is not None and cached >= _PACK_AFTER:
                    may_pack = False  # tried once: the file packs from here, or never
                    packed = _start_packing(out)
                pad = -out.size % _RECORD_ALIGN
                offset = out.size + pad
                out.add([_ZEROS[:pad], *buffers] if pad else buffers)
                if may_pack and tensor is not None:
                    cached += tensor.nbytes
            results.append(_result(earlier, len(results), item, storage_key, offset, out.size))
        out.finish()
    except BaseException:
        out.abandon()
        raise
    return results, out, kept


def _result(
    earlier: Sequence[WriteResult], n: int, item: WriteItem, key: str, offset: int, end: int
) -> WriteResult:
    """The ``n``-th item's write result: ``earlier[n]`` where it says the same, else a new one.

    A save of an unchanged layout writes every record where the last one did.
    Reusing its results (DCP's plan cache hands back the same ``WriteItem``
    objects) keeps two objects per item from being made and kept to the end of
    a save: in a save written in the background, enough of them to set off
    Python's full collections, which hold the training thread's GIL too.
    """
    length = end - offset
    if n < len(earlier):
        last = earlier[n]
        info = last.storage_data
        if (
            last.index is item.index
            and last.size_in_bytes == length
            and type(info) is _StorageInfo
            and info.relative_path == key
            and info.offset == offset
            and info.length == length
        ):
            return last
    return WriteResult(
        index=item.index, size_in_bytes=length, storage_data=_StorageInfo(key, offset, length)
    )


_Prepared = tuple[WriteItem, "torch.Tensor | None", list[Any]]
"""An item, its tensor (None for bytes) and its record's buffers."""


@dataclasses.dataclass(slots=True)
class PreparedRecords:
    """One file's records as a save of staged tensors prepared them, for the next save's reuse.

    ``records[n]`` is the ``n``-th item's (in file order) where its record can
    be reused, else None; ``settings`` is the ``record_settings()`` they were
    prepared under.
    """

    settings: tuple[Any, ...] | None = None
    records: list[_Prepared | None] = dataclasses.field(default_factory=list)


def _prepared(
    items: list[WriteItem],
    planner: SavePlanner,
    templates: RecordTemplates,
    earlier: PreparedRecords | None = None,
    kept: PreparedRecords | None = None,
) -> Iterator[_Prepared]:
    """Each item with its tensor (None for bytes) and its record's buffers, in file order.

    Byte items first, then tensors: the order DCP's own writer uses. Records
    are prepared ahead of their writes, ``_PREPARE_RECORDS`` at a time: the
    per-item Python then runs in one go instead of between the writes and
    checksums of megabytes, which evict what it works on from the CPU's
    caches (the 64 MiB benchmark state, 30 saves each way, alternating with
    the interleaved loop: the writing thread's CPU time of an async save best
    16.8 ms against 19.5, median 21.0 against 22.9; of a sync save best 31.4
    against 34.1). No more at a time: a record's buffers are a few Python
    objects, and thousands of them alive at once (a model of thousands of
    tensors, all prepared first) set off Python's collections, full ones
    among them, in a save written in the background: an async save of 2,304
    small tensors took 58.6 ms of CPU with 64 at a time, 64.9 ms with 256,
    and collections ran 1.8 / 0.17 / 0 times per save against 11.9 / 1.1 /
    0.03. Copies (a GPU tensor's, a view's own bytes) are made at most
    ``_PREPARE_COPIES`` bytes ahead, so a state on the GPU is never all on
    the host at once.

    ``kept`` (when given) receives every record that a later save may reuse,
    and ``earlier`` is the last save's: an async save's staging area
    (``staging.StagingArea``) hands every save the same buffer objects,
    which nobody else holds or reshapes, so an item that resolves to the
    very buffer its last record was built from (by the same planned item,
    under the same settings) gets that record again: its framing and its
    view of the buffer's memory, no new object. Only a staging buffer's
    record built around its own memory is kept: never one holding a copy of
    the bytes (``torch.save``'s), nor one of a tensor made anew for this
    save (a sharded tensor's staged copy), which a kept record would hold
    on to until the next save. An async save of the benchmark's 2,304 small
    tensors, alternately with the code before, two runs: median CPU time
    31.6-31.9 ms against 37.6-38.3; of its 192: 5.9-6.3 ms against 6.7-7.0.
    """
    settings = record_settings()
    last = earlier.records if earlier is not None and earlier.settings == settings else []
    if kept is not None:
        kept.settings = settings
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
    ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
    ready: list[_Prepared] = []
    copied = 0
    for n, item in enumerate(ordered):
        data = planner.resolve_data(item)
        reusable: _Prepared | None = None
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO), "a BYTE_IO item resolves to BytesIO"
            ready.append((item, None, [data.getbuffer()]))
        else:
            assert isinstance(data, torch.Tensor), "a tensor item resolves to a tensor"
            if (
                n < len(last)
                and (reusable := last[n]) is not None
                and reusable[0] is item
                and reusable[1] is data
            ):
                ready.append(reusable)
            else:
                reusable = None
                tensor = data.detach() if data.requires_grad else data
                if not tensor.is_cpu:
                    tensor = tensor.cpu()
                    copied += tensor.nbytes
                if tensor.untyped_storage().nbytes() != tensor.nbytes:
                    tensor = tensor.clone()  # a view: write only its own bytes, as DCP does
                    copied += tensor.nbytes
                ready.append((item, tensor, templates.record(tensor, settings)))
                if (
                    kept is not None
                    and tensor is data
                    and len(ready[-1][2]) == 3  # header, a view of the tensor's memory, trailer
                    and is_staging_buffer(data)
                ):
                    reusable = ready[-1]
        if kept is not None:
            kept.records.append(reusable)
        if copied >= _PREPARE_COPIES or len(ready) >= _PREPARE_RECORDS:
            yield from ready
            ready, copied = [], 0
    yield from ready


def _direct_candidate(
    out: HashedFile, tensor: torch.Tensor, buffers: list[Any], packed: bool = False
) -> bool:
    """A templated record (header, data, trailer) whose data goes out with O_DIRECT on its own.

    In a packed file, only data of at least a bounce buffer's size (written
    from where it is, no copy, worth the short direct write of the packed
    bytes before it): the rest is packed.
    """
    least = BOUNCE_BYTES if packed else _DIRECT_MIN
    return (
        out.direct
        and len(buffers) == 3
        and tensor.nbytes >= least
        and len(buffers[0]) % _RECORD_ALIGN == 0
        and tensor.data_ptr() % _RECORD_ALIGN == 0  # torch's allocator; not numpy's (16)
    )


def _start_packing(out: HashedFile) -> bool:
    """Zeros up to the file's next page boundary, then ``out.pack()``; whether it packs.

    The zeros are a gap between records, which no reader reads (every record
    is read by its offset and length).
    """
    pad = -out.size % DIRECT_ALIGN
    if pad:
        out.add([_ZEROS[:pad]])
    return out.pack()


def _add_direct_record(out: HashedFile, tensor: torch.Tensor, buffers: list[Any]) -> int:
    """Add a record whose data's first page boundary in memory falls on one in the file;
    returns its offset.

    Direct I/O takes memory and file offsets aligned to the page (the disk's
    block and DMA alignment divide it). A live tensor's data is 64-byte
    aligned only (torch's allocator: here a large one starts 64 bytes past a
    page), so its first bytes up to a page boundary in memory (``skip``, under
    a page) are written with the header through the page cache, and the
    record is placed so that the rest starts on a page boundary of the file
    too: its whole pages then go out with O_DIRECT from the tensor's own
    memory, no copy (or buffered, where the file refuses that), its last
    partial page and the trailer through the page cache. A staged tensor's
    data is page-aligned (``skip`` is 0). The padding before the record keeps
    it 64-byte aligned (the header's length is a multiple of 64, as is the
    data's address, so the pad is too).
    """
    header, data, trailer = buffers
    skip = -tensor.data_ptr() % DIRECT_ALIGN
    pad = -(out.size + len(header) + skip) % DIRECT_ALIGN
    if pad:
        out.add([_ZEROS[:pad]])
    offset = out.size
    out.add([header, data[:skip]] if skip else [header])
    end = skip + (data.nbytes - skip) // DIRECT_ALIGN * DIRECT_ALIGN
    pages = data[skip:end]
    if not out.add_direct(pages, tensor.data_ptr() + skip):
        out.add([pages])
    out.add([data[end:], trailer])
    return offset


def _buckets(items: list[WriteItem], count: int) -> list[list[WriteItem]]:
    """``items`` split into ``count`` lists of about equal bytes (largest first, greedy)."""
    if count == 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(count)]
    sizes = [0] * count
    for n, item in enumerate(i for i in items if i.type == WriteItemType.BYTE_IO):
        buckets[n % count].append(item)
    tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
    for item in sorted(tensors, key=_item_bytes, reverse=True):
        smallest = sizes.index(min(sizes))
        buckets[smallest].append(item)
        sizes[smallest] += _item_bytes(item)
    return [b for b in buckets if b] or [[]]


def _item_bytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


class ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` layout, written by stalwart (see the module docstring).

    One instance per save and rank, used by ``dcp.save`` in the caller's
    thread. ``threads`` files per rank are written concurrently, one writer
    thread each (the caller's thread writes the first); an error in any of
    them is raised from ``write_data`` in the caller's thread. Files are
    fsynced in the background while DCP goes on (the coordinator writes
    ``.metadata`` meanwhile); ``sync`` waits for every fsync and raises the
    first error. After ``sync`` returned, ``written`` lists this rank's files
    (and, on the coordinator, ``.metadata``) with their sizes and xxh3-128,
    each durable. ``close`` releases descriptors and threads, whatever
    happened; ``templates`` is kept across saves to skip ``torch.save`` for
    layouts seen before, and ``plans`` (when given, kept across saves too)
    to reuse the last save's ``.metadata`` pickle when only its names changed.
    ``pack`` lets its files be packed (``_PACK_AFTER``): for a save in the
    background, whose CPU time competes with training and whose wall time
    nobody waits for. ``staged``: the state's tensors are the staging area's
    buffers (``staging.StagingArea``), the same objects save after save, which
    nobody else holds or reshapes: each file's prepared records are kept in
    ``plans`` and reused (``_prepared``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int = 1,
        templates: RecordTemplates,
        plans: SavePlanCache | None = None,
        pack: bool = False,
        staged: bool = False,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads}: a rank needs at least one writer thread")
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=threads)
        self.templates = templates
        self.plans = plans
        self.pack = pack
        self.staged = staged
        self.written: list[FileEntry] = []
        self._files: list[HashedFile] = []
        self._syncs: list[Task] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data
        assert isinstance(prefix, _StoragePrefix), "prepare_global_plan names each rank's files"
        jobs = [
            (Path(self.path) / f"{prefix.prefix}{n}.distcp", f"{prefix.prefix}{n}.distcp", bucket)
            for n, bucket in enumerate(_buckets(plan.items, self.thread_count))
        ]
        outcomes = self._write_all(jobs, planner)
        for _results, out, _records in outcomes:
            self._files.append(out)  # closed by close() from here on, whatever comes
        if self.plans is not None:
            for (_path, key, _items), (results, _out, records) in zip(jobs, outcomes, strict=True):
                self.plans.keep_file_results(key, results, records)
        for _results, out, _records in outcomes:
            self._sync_later(out)
        future: Future[list[WriteResult]] = Future()
        future.set_result([r for results, _out, _records in outcomes for r in results])
        return future

    def _write_all(
        self, jobs: list[tuple[Path, str, list[WriteItem]]], planner: SavePlanner
    ) -> list[tuple[list[WriteResult], HashedFile, PreparedRecords | None]]:
        """Write every job's file; the first job in this thread, the others in threads of their own."""
        plans = self.plans
        earlier = [plans.file_results(key) if plans is not None else [] for _, key, _ in jobs]
        records = [self._records(key) for _, key, _ in jobs]
        others = [
            Task(_write_file, *job, planner, self.templates, self.pack, last, mine)
            for job, last, mine in zip(jobs[1:], earlier[1:], records[1:], strict=True)
        ]
        outcomes: list[tuple[list[WriteResult], HashedFile, PreparedRecords | None]] = []
        failure: BaseException | None = None
        try:
            outcomes.append(
                _write_file(*jobs[0], planner, self.templates, self.pack, earlier[0], records[0])
            )
        except BaseException as exc:
            failure = exc
        for task in others:
            try:
                # A writer thread's exception is raised here, in the caller's thread.
                outcomes.append(task.result())
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            for _results, out, _records in outcomes:
                out.abandon()
            raise failure
        return outcomes

    def _records(self, key: str) -> PreparedRecords | None:
        """The last save's prepared records of file ``key`` to reuse (a state of staged
        tensors only: ``staged``); None where none are kept."""
        if not self.staged or self.plans is None:
            return None
        return self.plans.file_records(key) or PreparedRecords()

    def _sync_later(self, out: HashedFile) -> None:
        """Finish ``out`` (one of ``_files``) and start its fsync."""
        self.written.append(out.finish())  # names the file by out.path, as renamed
        self._syncs.append(Task(out.sync))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` as DCP's ``FileSystemWriter`` does (coordinator only), hashed,
        and its JSON twin ``.metadata.json`` (``stalwart.metadata_json``)."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        data, json_data = (
            encode_metadata(metadata) if self.plans is None else self.plans.metadata_files(metadata)
        )
        self._write_small(_METADATA, data)
        if json_data is not None:
            self._write_small(DCP_METADATA_JSON_NAME, json_data)

    def _write_small(self, name: str, data: bytes) -> None:
        tmp = Path(self.path) / f"{name}.tmp"
        out = HashedFile(tmp)
        self._files.append(out)  # closed by close(), whatever comes
        try:
            out.add([data])
            out.finish()
            os.replace(tmp, Path(self.path) / name)
        except BaseException:
            out.abandon()
            raise
        out.path = Path(self.path) / name
        self._sync_later(out)

    def sync(self) -> None:
        """Wait until every file written is durable; raise the first fsync error. Then ``close``."""
        try:
            for pending in self._syncs:
                pending.result()
        finally:
            self.close()

    def close(self) -> None:
        """Wait for the fsync threads, close every descriptor still open; idempotent.

        The fsyncs' errors are ``sync``'s to report; an interrupt raised into this
        thread while it waits comes out, once every file is closed.
        """
        try:
            for pending in self._syncs:
                pending.wait()
        finally:
            for out in self._files:
                out.abandon()
