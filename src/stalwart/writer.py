"""The storage writer of a save: DCP's file layout, written at the disk's speed, hashed while written.

``ChecksummingWriter`` is a ``torch.distributed.checkpoint`` ``StorageWriter``
(a ``FileSystemWriter`` whose ``write_data`` and ``finish`` are stalwart's
own). DCP still plans the save, so resharding and every DCP reader keep
working; what changes is how the bytes reach the disk:

- Each item is the same bytes as DCP's ``torch.save`` of it (the zip record
  torch's ``FileSystemReader`` reads, zip CRC-32 off, see ``without_zip_crc``),
  but a tensor's record is built from a cached header and trailer around the
  tensor's own memory (``RecordTemplates``): no pickling per item after the
  first save of a layout, no copy of the tensor.
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
- The page-aligned part of a large tensor's data whose memory is page-aligned
  (an async save's staging buffers are, see ``staging.StagingArea``) is
  written with ``O_DIRECT`` from that memory straight to the disk: no copy
  into the page cache, which is most of a buffered write's CPU time (64 MiB:
  about 3 ms of CPU instead of 17 ms here). Such a record is placed so that
  its data starts on a page boundary of the file (the record itself stays
  64-byte aligned). Consecutive such records go out in one direct write of up
  to 8 MiB, the framing pages between them copied along
  (``HashedFile.add_direct``): O_DIRECT costs CPU per call more than per byte
  (64 MiB in 1.3 MB writes: 12 ms; in 8 MiB ones: 5 ms). A live tensor's memory (a synchronous save) is not
  page-aligned: from 4 MiB up its data goes direct too, copied through
  reused page-aligned bounce buffers and written by the file's I/O thread
  (``HashedFile.add_direct``). In a save written in the background (async),
  once 1 MiB of tensor records went through the page cache, the rest of the
  file is packed (``HashedFile.pack``): every later record that does not go
  direct by itself, however small, is copied end to end into the bounce
  buffers and goes direct too, all but the file's last partial page. That
  costs less CPU time (the 64 MiB benchmark state, tensors of 1.3 MB, saved
  packed: 39 ms against 50 ms, best of 10, and 20 ms for a raw write) but
  more wall time on a disk whose direct writes are slower than the page
  cache's write-back (the same state in one benchmark run: 94 ms against
  79 ms), so a synchronous save, which training waits for, is not packed.
  The rest goes through the page cache, at explicit offsets. A filesystem that refuses direct I/O (at open or at
  any write, ``EINVAL``) gets buffered writes for the rest of the file.
- A write that fails, in any writer thread, raises in the caller's thread:
  ``dcp.save`` fails, never returns over a short file (torch 2.13's
  ``FileSystemWriter`` loses its other threads' errors).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
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
from stalwart.save_plan import SavePlanCache, encode_metadata

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
_BOUNCE_MIN = 4 * 2**20
"""Data not page-aligned in memory (a live tensor: torch aligns to 64 bytes) goes
direct, through a bounce buffer, from this size up. Smaller pieces gain nothing:
each is a synchronous direct write plus a hand-over to the file's I/O thread,
where the page cache absorbs a buffered one at once (measured on the 64 MiB
benchmark state, 1.3 MB tensors: no less CPU, 6-15% more wall time; at 5.6 MB
tensors, a quarter to a third less CPU than buffered)."""
_PACK_AFTER = 2**20
"""Once this many bytes of tensor records went through the page cache, the rest
of the file is packed (``HashedFile.pack``): every later record that does not go
direct on its own is copied end to end into the bounce buffers and written
with O_DIRECT. A file whose large tensors go direct by themselves (an async
save's page-aligned staging buffers) and whose other records are few stays as
it is: packing would cut the large ones' direct writes into small ones."""
_ZEROS = bytes(DIRECT_ALIGN)
_METADATA = ".metadata"

_CRC_LOCK = threading.Lock()
_CRC_USERS = 0
_CRC_BEFORE = True


def _save_config() -> Any:
    """torch's ``config.save`` when it has the ``compute_crc32`` setting, else None."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - torch without the setting
        return None
    save_config = getattr(config, "save", None)
    return save_config if hasattr(save_config, "compute_crc32") else None


@contextlib.contextmanager
def without_zip_crc() -> Iterator[None]:
    """Let ``torch.save`` skip the CRC-32 of its zip records while a checkpoint is written.

    Every file already gets an xxh3-128 checksum that restore verifies before
    reading a byte, so the zip CRC is redundant; computing it is a fifth of a
    save's CPU time (256 MiB: 236 ms -> 180 ms without), and without it a
    record's bytes outside the tensor data no longer depend on the data, which
    is what lets ``RecordTemplates`` reuse them. The setting is process-wide
    (torch reads it when a ``torch.save`` starts): a ``torch.save`` of your own
    running in another thread at the same moment writes its zip without CRC
    too, which ``torch.load`` reads as usual. Torch builds without the setting
    are left as they are.
    """
    global _CRC_USERS, _CRC_BEFORE
    save_config = _save_config()
    if save_config is None:  # pragma: no cover - torch without the setting
        yield
        return
    with _CRC_LOCK:
        if _CRC_USERS == 0:
            _CRC_BEFORE = bool(save_config.compute_crc32)
            save_config.compute_crc32 = False
        _CRC_USERS += 1
    try:
        yield
    finally:
        with _CRC_LOCK:
            _CRC_USERS -= 1
            if _CRC_USERS == 0:
                save_config.compute_crc32 = _CRC_BEFORE


def record_settings() -> tuple[Any, ...] | None:
    """The ``torch.save`` settings a record's framing depends on; None when it depends on the data.

    With the zip CRC on, every record's header holds a checksum of its data,
    so no framing can be reused. Read once per file written, not per tensor.
    """
    save_config = _save_config()
    if save_config is None or save_config.compute_crc32:
        return None
    return (getattr(save_config, "storage_alignment", None),)


# --------------------------------------------------------------------------- records


def _torch_save_bytes(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)
"""dtypes whose tensors ``Tensor.numpy`` takes as they are (no bfloat16, no float8)."""


def _data_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (a contiguous tensor that owns its whole storage)."""
    if tensor.dtype in _NUMPY_DTYPES and tensor.dim():
        return tensor.numpy().data.cast("B")  # a third of the time of the general path
    return tensor.reshape(-1).view(torch.uint8).numpy().data


class RecordTemplates:
    """The bytes ``torch.save`` writes around a tensor's data, per layout, for reuse.

    With the zip CRC off, ``torch.save`` of a plain contiguous CPU tensor is
    ``header + data + trailer`` where header and trailer depend only on the
    layout (dtype, shape, stride, size); this keeps them so that a later save
    of the same layout writes the record with no pickling and no copy. A
    template is cut out of one real ``torch.save`` of the first such tensor,
    whose data write is recognised by its address and skipped (no copy of the
    data), so the bytes are torch's own. Any other tensor (a view into a larger storage,
    a subclass, a quantized or conjugated tensor) or a torch computing the CRC
    gets a plain ``torch.save``, and so does a tensor whose data torch did not
    write in one piece from its own memory. Thread-safe; one instance is meant
    to live as long as the run (the layouts of a run's saves repeat). At most
    ``MAX_LAYOUTS`` layouts are kept, the oldest dropped first, so a run whose
    shapes keep changing does not grow it without bound.
    """

    MAX_LAYOUTS = 4096
    """Layouts kept (a few hundred bytes each); far more than a model's distinct shapes."""

    def __init__(self) -> None:
        self._parts: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._parts)

    def record(self, tensor: torch.Tensor, settings: tuple[Any, ...] | None) -> list[Any]:
        """The buffers whose concatenation is ``torch.save(tensor)``'s output, in order.

        ``settings`` is ``record_settings()``, read when the file was started.
        """
        layout = _layout(tensor)
        if layout is None or settings is None:
            return [_torch_save_bytes(tensor)]
        key = (*layout, *settings)
        parts = self._parts.get(key)
        if parts is None:
            parts = _cut_framing(tensor)
            if parts is None:
                return [_torch_save_bytes(tensor)]
            with self._lock:
                self._parts[key] = parts
                while len(self._parts) > self.MAX_LAYOUTS:
                    del self._parts[next(iter(self._parts))]
        header, trailer = parts
        return [header, _data_view(tensor), trailer]


def _layout(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """The key of a tensor whose record a template can build, else None."""
    if (
        type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.requires_grad
        or not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or tensor.nbytes == 0  # no data record to cut the framing around: torch.save it
        or tensor.untyped_storage().nbytes() != tensor.nbytes
    ):
        return None
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.nbytes)


class _FramingCapture:
    """A file-like target for ``torch.save`` that keeps every write but the tensor's data.

    torch's zip writer hands each record's bytes to ``write`` in one call, the
    data record straight from the tensor's memory; that one call is
    recognised by its address and length and only counted, so cutting a
    layout's framing copies no tensor data.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._address = tensor.data_ptr()
        self._nbytes = tensor.nbytes
        self.before: list[bytes] = []
        self.after: list[bytes] = []
        self.data_writes = 0

    def write(self, chunk: Any) -> int:
        view = memoryview(chunk)
        if view.nbytes == self._nbytes and _address_of(view) == self._address:
            self.data_writes += 1
        else:
            (self.after if self.data_writes else self.before).append(bytes(view))
        return view.nbytes

    def flush(self) -> None:
        pass


def _address_of(view: memoryview) -> int:
    address: int = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return address


def _cut_framing(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """Header and trailer that ``torch.save(tensor)`` writes around the tensor's data.

    None when no single write was the tensor's data (a torch that writes it in
    pieces or from a copy): then no framing can be cut, and the record is a
    plain ``torch.save``.
    """
    capture = _FramingCapture(tensor)
    torch.save(tensor, capture)  # type: ignore[arg-type]  # a file-like with write and flush
    # Exactly one write was the data itself: the framing is the rest, in order.
    if capture.data_writes != 1:
        return None
    return b"".join(capture.before), b"".join(capture.after)


# --------------------------------------------------------------------------- files


def _write_file(
    path: Path,
    storage_key: str,
    items: list[WriteItem],
    planner: SavePlanner,
    templates: RecordTemplates,
    pack: bool = False,
) -> tuple[list[WriteResult], HashedFile]:
    """Write ``items`` into the new file ``path`` as DCP's ``FileSystemWriter`` lays them out.

    ``pack``: the file may be packed (see ``_PACK_AFTER``). Returns the write
    results and the file, written and hashed but not yet fsynced.
    """
    results: list[WriteResult] = []
    settings = record_settings()
    out = HashedFile(path)
    try:
        # Byte items first, then tensors: the order DCP's own writer uses.
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
        ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
        packed = False
        may_pack = pack  # until packing was tried
        cached = 0  # bytes of tensor records written through the page cache
        for item in ordered:
            data = planner.resolve_data(item)
            tensor = None
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO), "a BYTE_IO item resolves to BytesIO"
                buffers: list[Any] = [data.getbuffer()]
            else:
                assert isinstance(data, torch.Tensor), "a tensor item resolves to a tensor"
                tensor = data.detach() if data.requires_grad else data
                if not tensor.is_cpu:
                    tensor = tensor.cpu()
                if tensor.untyped_storage().nbytes() != tensor.nbytes:
                    tensor = tensor.clone()  # a view: write only its own bytes, as DCP does
                buffers = templates.record(tensor, settings)
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
            length = out.size - offset
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=length,
                    storage_data=_StorageInfo(storage_key, offset, length),
                )
            )
        out.finish()
    except BaseException:
        out.abandon()
        raise
    return results, out


def _direct_candidate(
    out: HashedFile, tensor: torch.Tensor, buffers: list[Any], packed: bool = False
) -> bool:
    """A templated record (header, data, trailer) whose data goes out with O_DIRECT on its own.

    In a packed file, only data at a page-aligned address and at least a
    bounce buffer's size (written from where it is, no copy, worth the short
    direct write of the packed bytes before it): the rest is packed.
    """
    aligned = tensor.data_ptr() % DIRECT_ALIGN == 0
    if packed:
        least = BOUNCE_BYTES if aligned else 2**63
    else:
        least = _DIRECT_MIN if aligned else _BOUNCE_MIN
    return (
        out.direct
        and len(buffers) == 3
        and tensor.nbytes >= least
        and len(buffers[0]) % _RECORD_ALIGN == 0
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
    """Add a record whose data starts on a page boundary of the file; returns its offset.

    The padding before it keeps the record 64-byte aligned (the header's
    length is a multiple of 64); the data's whole pages go out with O_DIRECT
    (or buffered, where the file refuses that), its last partial page and the
    trailer through the page cache.
    """
    header, data, trailer = buffers
    pad = -(out.size + len(header)) % DIRECT_ALIGN
    if pad:
        out.add([_ZEROS[:pad]])
    offset = out.size
    out.add([header])
    whole = data.nbytes - data.nbytes % DIRECT_ALIGN
    head = data[:whole]
    if not out.add_direct(head, tensor.data_ptr()):
        out.add([head])
    out.add([data[whole:], trailer])
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
    nobody waits for.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int = 1,
        templates: RecordTemplates,
        plans: SavePlanCache | None = None,
        pack: bool = False,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads}: a rank needs at least one writer thread")
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=threads)
        self.templates = templates
        self.plans = plans
        self.pack = pack
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
        for _results, out in outcomes:
            self._sync_later(out)
        future: Future[list[WriteResult]] = Future()
        future.set_result([r for results, _out in outcomes for r in results])
        return future

    def _write_all(
        self, jobs: list[tuple[Path, str, list[WriteItem]]], planner: SavePlanner
    ) -> list[tuple[list[WriteResult], HashedFile]]:
        """Write every job's file; the first job in this thread, the others in threads of their own."""
        others = [Task(_write_file, *job, planner, self.templates, self.pack) for job in jobs[1:]]
        outcomes: list[tuple[list[WriteResult], HashedFile]] = []
        failure: BaseException | None = None
        try:
            outcomes.append(_write_file(*jobs[0], planner, self.templates, self.pack))
        except BaseException as exc:
            failure = exc
        for task in others:
            try:
                # A writer thread's exception is raised here, in the caller's thread.
                outcomes.append(task.result())
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            for _results, out in outcomes:
                out.abandon()
            raise failure
        return outcomes

    def _sync_later(self, out: HashedFile) -> None:
        self._files.append(out)
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
        """Wait for the fsync threads, close every descriptor still open; idempotent."""
        for pending in self._syncs:
            with contextlib.suppress(BaseException):  # sync() reports them; close() only cleans up
                pending.result()
        for out in self._files:
            out.abandon()
