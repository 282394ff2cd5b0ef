"""Reading a checkpoint's files once: checked in memory, then handed to DCP from there.

A restore used to read every file twice: once to check its size and xxh3-128
against the manifest, once more when DCP read the data, with one ``torch.load``
per tensor. ``VerifiedFiles`` reads each file into memory once, in large
reads, and hashes it there; a file is used only after its whole checksum
matched, and the checked bytes are the very bytes used, so nothing of a
damaged or swapped file is ever deserialized, even one changed on disk after
the check. ``VerifiedFileReader`` is the DCP ``StorageReader`` that serves a
load plan from those bytes. An I/O error while reading is an error that
restore falls back from (a map would turn it into SIGBUS).

A tensor item DCP wrote is a ``torch.save`` of one tensor: a zip archive whose
``data.pkl`` says which storage record holds its bytes, with what shape. When
that pickle is byte for byte the one torch writes for a contiguous tensor of
the dtype and shape the (already checked) DCP metadata records, the tensor is
a view of the storage record's bytes: nothing is unpickled at all. Any other
item (another layout, another torch's pickle, a compressed or zip64 archive)
goes through ``torch.load(weights_only=True)`` on the same bytes, as before.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import io
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from stalwart.dcp_metadata import metadata_from_bytes
from stalwart.device_read import read_to_device
from stalwart.errors import CheckpointCorruptError
from stalwart.framing import UnavailableError, decode_tensor, framed_data
from stalwart.layout import DCP_METADATA_JSON_NAME, DCP_METADATA_NAME
from stalwart.manifest import Manifest, open_checkpoint_file
from stalwart.metadata_json import metadata_from_json
from stalwart.safe_load import SafeFileSystemReader, read_dcp_metadata
from stalwart.streamed import Span, StreamedFile, keep_spans, stream_check
from stalwart.verify import (
    VERIFY_THREADS,
    FileProblem,
    checksum_problem,
    file_problems,
    read_manifest,
    size_problem,
)
from stalwart.workers import Workers

__all__ = [
    "UnavailableError",
    "VerifiedFileReader",
    "VerifiedFiles",
    "decode_tensor",
    "framed_data",
    "verified_checkpoint",
]

_CHECKERS = Workers("stalwart-check", VERIFY_THREADS)
"""Files of one checkpoint checked at the same time by a restore (``VerifiedFiles``)."""
_METADATA = DCP_METADATA_NAME
_METADATA_JSON = DCP_METADATA_JSON_NAME
"""DCP's metadata file (the global one; ``dcp_metadata`` reads it)."""

_CHUNK = 8 * 1024 * 1024
"""Bytes per read call."""

_POPULATE_MIN = 2 * 1024 * 1024
"""Files from this size up are read into memory faulted in by one call."""


class _Held:
    """One file's bytes, read into memory once.

    Read, never mapped: a map would keep reading the file after it was checked
    (another writer's bytes would reach the decoder unverified), and a disk
    error on a mapped page kills the process with SIGBUS where a read raises
    an error that restore falls back from.
    """

    __slots__ = ("view",)

    def __init__(self, stream: io.FileIO, size: int) -> None:
        self.view = _read_whole(stream, size) if size else memoryview(b"")


def _buffer(size: int) -> mmap.mmap | bytearray:
    """Fresh memory for ``size`` bytes, its pages faulted in by one call.

    Faulting in fresh pages one by one costs more than the read itself
    (measured for 256 MiB: 184 ms into a bytearray, 112 ms into anonymous
    memory mapped with MAP_POPULATE, 47 ms into an already-touched buffer;
    huge pages were faster when free and ten times slower when the kernel had
    to compact for them, so they are not asked for). The memory is anonymous:
    the file is read into it, never mapped.
    """
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if size >= _POPULATE_MIN and populate:
        try:
            return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        except (OSError, ValueError):
            pass  # refused (strict overcommit): a bytearray says MemoryError
    return bytearray(size)


def _read_whole(stream: io.FileIO, size: int) -> memoryview:
    """``size`` bytes of ``stream`` (fewer if it is shorter now: a size problem)."""
    view = memoryview(_buffer(size))
    done = 0
    while done < size:
        n = stream.readinto(view[done : done + _CHUNK])
        if not n:
            return view[:done]
        done += n
    return view


class VerifiedFiles:
    """The files of one checkpoint, each checked against the manifest (size, then
    xxh3-128) before anything may use it.

    Two ways to check a file. ``verify`` reads it whole into memory and hashes
    it there; ``held`` gives those bytes. ``stream`` (restore's data files, once
    ``keep`` gave the spans its decoders need) hashes it through two reused
    buffers and keeps only those spans; ``streamed`` gives the open, checked
    file (``stalwart.streamed``), from which raw tensor data is read straight
    into place. Held bytes are at most the checkpoint's size; streamed files
    cost two chunk buffers and their kept spans. ``verify``, ``stream``,
    ``held`` and ``streamed`` may be called from any thread; ``close`` lets go
    of everything.
    """

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self._entries = {entry.path: entry for entry in manifest.files}
        self._held: dict[str, _Held] = {}
        self._streamed: dict[str, StreamedFile] = {}
        self._pending: dict[str, concurrent.futures.Future[Any]] = {}
        """Streaming checks begun (``start_stream``) that nobody waited for yet."""
        self._spans: dict[str, list[Span]] = {}
        self._lock = threading.Lock()
        self.reads: collections.Counter[str] = collections.Counter()
        """How many times each file was checked from disk (once, unless it was bad or
        a streamed file held an item only a whole read can decode)."""

    def keep(self, metadata: Metadata) -> None:
        """Learn from the (checked) DCP metadata which spans of each data file its
        decoders will read, so that ``stream`` keeps them (the first call counts)."""
        if self._spans:
            return
        items: dict[str, list[tuple[int, int]]] = {}
        for info in metadata.storage_data.values():
            items.setdefault(info.relative_path, []).append((info.offset, info.length))
        with self._lock:
            self._spans = {name: keep_spans(found) for name, found in items.items()}

    def verify(self, names: Iterable[str]) -> None:
        """Read and check each of ``names`` not held yet, several files side by side.

        Raises ``CheckpointCorruptError`` for the first bad file (in ``names``
        order; transient for an I/O error); nothing of a bad file is kept.
        """
        with self._lock:
            todo = [name for name in dict.fromkeys(names) if name not in self._held]
        self._check(todo, self._read, self._held)

    def stream(self, names: Iterable[str]) -> None:
        """Check each of ``names`` neither held nor streamed yet by streaming it; as
        ``verify`` otherwise (the same errors). Waits for the checks ``start_stream``
        began of any of ``names``."""
        names = list(dict.fromkeys(names))
        self.start_stream(names)
        with self._lock:
            todo = [(name, self._pending.pop(name)) for name in names if name in self._pending]
        self._collect(todo, self._streamed)

    def start_stream(self, names: Iterable[str]) -> None:
        """Begin streaming each of ``names`` not held, streamed or begun yet, without
        waiting: ``stream`` (or ``wait_streamed``) waits and raises what it found;
        ``close`` stops and lets go of checks nobody waited for."""
        with self._lock:
            todo = [
                name
                for name in dict.fromkeys(names)
                if name not in self._held
                and name not in self._streamed
                and name not in self._pending
            ]
            for name in todo:
                self._pending[name] = _CHECKERS.submit(self._stream, name)

    def wait_streamed(self) -> None:
        """Wait for every check ``start_stream`` began; as ``stream``."""
        with self._lock:
            names = list(self._pending)
        self.stream(names)

    def streamed(self, name: str) -> StreamedFile | None:
        """The streamed, checked file ``name``; None if it was held instead."""
        with self._lock:
            return self._streamed.get(name)

    def _check(self, todo: list[str], check: Callable[[str], Any], into: dict[str, Any]) -> None:
        if todo:
            self._collect([(name, _CHECKERS.submit(check, name)) for name in todo], into)

    def _collect(
        self, todo: list[tuple[str, concurrent.futures.Future[Any]]], into: dict[str, Any]
    ) -> None:
        """Take each check's result into ``into``, in order; raise for the first bad file."""
        try:
            for name, future in todo:
                result = future.result()
                if isinstance(result, FileProblem):
                    raise result.error(self.directory)
                with self._lock:
                    into[name] = result
        finally:
            _let_go([future for _name, future in todo], into)

    def _stream(self, name: str) -> StreamedFile | FileProblem:
        entry = self._entries.get(name)
        if entry is None:
            return FileProblem(name, "is not listed in the manifest; the checkpoint is damaged")

        def count() -> None:
            with self._lock:
                self.reads[name] += 1

        with self._lock:
            spans = self._spans.get(name, [])
        return stream_check(os.fspath(self.directory), entry, spans, count)

    def held(self, name: str) -> _Held:
        """The checked bytes of ``name``, reading and checking it first if needed."""
        self.verify([name])
        with self._lock:
            return self._held[name]

    def metadata(self) -> Metadata:
        """The DCP metadata from the checked bytes of ``.metadata.json`` when the manifest
        lists one of a version this reader knows, else unpickled by the restricted
        unpickler from those of ``.metadata`` (never read from disk again: another
        writer's file would be used unchecked); either way held to the same
        checks, its data bounds against the manifest's sizes."""
        if _METADATA_JSON in self._entries:
            where = os.path.join(self.directory, _METADATA_JSON)
            found = metadata_from_json(self.held(_METADATA_JSON).view, where, self._size_of(where))
            if found is not None:
                return found
        where = os.path.join(self.directory, _METADATA)
        return metadata_from_bytes(self.held(_METADATA).view, where, self._size_of(where))

    def _size_of(self, where: str) -> Callable[[str], int]:
        """The manifest's size of a data file the metadata at ``where`` names."""

        def size_of(name: str) -> int:
            entry = self._entries.get(name)
            if entry is None:
                raise CheckpointCorruptError(
                    f"{where}: names {name!r}, which the manifest does not list; "
                    "the checkpoint is damaged",
                    path=where,
                )
            return entry.size

        return size_of

    def close(self) -> None:
        """Let go of every file's bytes and descriptors (a tensor decoded from a held
        file keeps its buffer alive until the tensor is dropped; a restore copies
        them into its targets at once)."""
        with self._lock:
            self._held.clear()
            streamed, self._streamed = list(self._streamed.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        _let_go(pending, {})
        for checked in streamed:
            checked.close()

    def _read(self, name: str) -> _Held | FileProblem:
        entry = self._entries.get(name)
        if entry is None:
            return FileProblem(name, "is not listed in the manifest; the checkpoint is damaged")
        with self._lock:
            self.reads[name] += 1
        try:
            with open_checkpoint_file(self.directory, name) as stream:
                size = stream.size
                problem = size_problem(entry, size)
                if problem is not None:
                    return problem
                held = _Held(stream, size)
            # xxh3 releases the GIL: several files hash side by side.
            digest = xxhash.xxh3_128(held.view).hexdigest()
            got = len(held.view)
        except FileNotFoundError:
            return FileProblem(name, "missing (listed in the manifest)")
        except CheckpointCorruptError as exc:
            return FileProblem(name, str(exc).removeprefix(f"{exc.path}: "))
        except OSError as exc:
            return FileProblem(name, f"cannot read ({exc.strerror or exc})", True, exc)
        except MemoryError:
            # An outcome, not a bug: every rank must hear of it (Coordinator.agree),
            # and the file may be fine where there is more memory.
            return FileProblem(
                name, f"cannot hold its {entry.size} bytes in memory to check and load it", True
            )
        problem = size_problem(entry, got) or checksum_problem(entry, digest)
        return held if problem is None else problem


def _let_go(pending: list[concurrent.futures.Future[Any]], taken: dict[str, Any]) -> None:
    """Stop the checks not started yet and wait for the rest (as ``file_problems``
    does, files not started are not read at all); close each checked file not
    in ``taken`` (another file was bad, or nobody waited for it)."""
    for future in pending:
        future.cancel()
    concurrent.futures.wait(pending)
    for future in pending:
        if not future.cancelled() and future.exception() is None:
            result = future.result()
            if isinstance(result, StreamedFile) and result not in taken.values():
                result.close()


def verified_checkpoint(
    path: Path, *, part: tuple[int, int] = (0, 1), wait: bool = True
) -> tuple[VerifiedFiles, Metadata]:
    """A restore's gate: the manifest (``read_manifest``), the size of every file, the
    DCP metadata, unpickled by the restricted unpickler from the very bytes
    whose checksum matched (``VerifiedFiles.metadata``), and this rank's share
    of the data files checked by streaming them (``VerifiedFiles.stream``),
    keeping the spans the metadata says its decoders need.

    ``part=(rank, world_size)`` takes every world_size-th data file, so the
    ranks share the reading and together check every file; a file a rank's
    load needs from another share is checked when it is needed
    (``VerifiedFileReader``). Raises what ``verify_checkpoint`` and
    ``read_dcp_metadata`` raise; a damaged file before anything the metadata
    says. ``wait=False`` returns while the data files are still being checked
    (``VerifiedFiles.start_stream``), so that work needing only the metadata
    runs meanwhile; ``files.wait_streamed()`` then raises what the checks
    found, and every read waits for the checks of its files. Close the files
    returned.
    """
    manifest = read_manifest(path)
    problems = file_problems(path, manifest, checksums=False, first_only=True)
    if problems:
        raise problems[0].error(path)
    files = VerifiedFiles(path, manifest)
    listed = [entry.path for entry in manifest.files]
    rank, world = part
    share = [name for name in listed if name not in (_METADATA, _METADATA_JSON)][rank::world]
    try:
        # A few KiB each; every rank checks both, whichever it reads (a damaged
        # .metadata is a damaged checkpoint for DCP's own readers).
        indexes = [name for name in (_METADATA_JSON, _METADATA) if name in listed]
        files.verify(indexes)
        try:
            metadata = files.metadata() if indexes else read_dcp_metadata(path)
        except CheckpointCorruptError:
            # A damaged data file is the reason given, before anything the metadata said.
            files.stream(share)
            raise
        files.keep(metadata)
        if wait:
            files.stream(share)
        else:
            files.start_stream(share)
    except BaseException:
        files.close()
        raise
    return files, metadata


@dataclasses.dataclass
class _Pending:
    """A tensor's raw data to read from a streamed file, and what to do once it is read."""

    view: memoryview | None
    """Where to read on the host; None for ``target``'s read through pinned memory."""
    offset: int
    finish: Callable[[], None]
    target: torch.Tensor | None = None
    """A contiguous CUDA tensor the raw data is read onto (``read_to_device``)."""


class VerifiedFileReader(SafeFileSystemReader):
    """``SafeFileSystemReader`` that serves DCP's reads from ``VerifiedFiles``.

    Every file of a load plan is read and checked before any of its items is
    deserialized; tensor items are decoded by ``decode_tensor`` where it is
    safe, by ``torch.load(weights_only=True)`` otherwise; bytes items go to the
    planner (``SafeLoadPlanner`` reads them with ``weights_only=True``).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, files: VerifiedFiles, metadata: Metadata | None
    ) -> None:
        super().__init__(path, metadata=metadata)
        self.files = files
        self._chunks: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.decoded = 0
        """Tensor items decoded without torch.load (the tests check the fast path is taken)."""

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.files.keep(metadata)
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    index = MetadataIndex(fqn, chunk.offsets)
                    self._chunks[index] = (md.properties.dtype, tuple(chunk.sizes))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        # Every file this rank reads is checked before any item is deserialized.
        self.files.stream(per_file)
        for name, items in per_file.items():
            checked = self.files.streamed(name)
            if checked is not None:
                checked.check_unchanged()
                reads: list[_Pending] = []
                items = [
                    item for item in items if not self._read_streamed(checked, item, planner, reads)
                ]
                checked.read_many([(p.view, p.offset) for p in reads if p.view is not None])
                read_to_device(
                    checked, [(p.target, p.offset) for p in reads if p.target is not None]
                )
                checked.check_unchanged()
                for pending in reads:
                    pending.finish()
            if items:
                # Held, or items only a whole read can decode: read and checked in memory.
                view = self.files.held(name).view
                for item in items:
                    self._read_item(name, view, item, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_streamed(
        self, checked: StreamedFile, item: ReadItem, planner: LoadPlanner, reads: list[_Pending]
    ) -> bool:
        """Serve ``item`` from a streamed file: from its kept bytes when it is small,
        else by adding to ``reads`` its raw data's read straight into the target
        (finished once every read is done). False: it needs a whole read."""
        info = self.storage_data[item.storage_index]
        start, length = info.offset, info.length
        kept = checked.span(start, start + length)
        if kept is not None:
            self._read_item(info.relative_path, kept, item, planner, start)
            return True
        expected = self._chunks.get(item.storage_index)
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors or expected is None:
            return False
        dtype, shape = expected

        def framing(a: int, b: int) -> bytes:
            got = checked.span(start + a, start + b)
            if got is None:
                raise UnavailableError(a, b)
            return bytes(got)

        found = framed_data(length, framing, dtype, shape)
        if found is None:
            return False
        data_start, _ = found
        target = planner.resolve_tensor(item).detach()
        whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == shape
        # The stored bytes are the target's own: read into it (on the CPU) or through
        # pinned buffers onto it (on a GPU); else into a fresh tensor, then copied.
        same_bytes = (
            whole
            and target.dtype == dtype
            and tuple(target.shape) == shape
            and target.is_contiguous()
        )
        direct = same_bytes and target.device.type in ("cpu", "cuda")
        source = target if direct else torch.empty(shape, dtype=dtype)

        def finish() -> None:
            if not direct:
                part = narrow_tensor_by_index(source, item.storage_offsets, item.lengths)
                self._copy(item, part, target)
            planner.commit_tensor(item, target)
            self.decoded += 1

        if direct and target.device.type == "cuda":
            reads.append(_Pending(None, start + data_start, finish, target))
        else:
            view = source.reshape(-1).view(torch.uint8).numpy().data
            reads.append(_Pending(view, start + data_start, finish))
        return True

    def _copy(self, item: ReadItem, tensor: torch.Tensor, target: torch.Tensor) -> None:
        if target.size() != tensor.size():
            raise CheckpointCorruptError(
                f"{self.path}: item {item.storage_index.fqn!r} holds shape {list(tensor.size())}, "
                f"the load plan expects {list(target.size())}; the DCP metadata is damaged",
                path=os.fspath(self.path),
            )
        target.copy_(tensor)

    def _read_item(
        self, name: str, view: memoryview, item: ReadItem, planner: LoadPlanner, base: int = 0
    ) -> None:
        """Decode ``item`` from ``view``, the checked bytes of ``name`` from byte ``base``."""
        info = self.storage_data[item.storage_index]
        start, end = info.offset - base, info.offset - base + info.length
        if end > len(view):
            where = os.path.join(os.fspath(self.path), name)
            raise CheckpointCorruptError(
                f"{where}: item {item.storage_index.fqn!r} at bytes {start}..{end} lies past "
                f"the end of the file ({len(view) + base} bytes); the DCP metadata is damaged",
                path=where,
            )
        if info.transform_descriptors:
            # An extension's encoding (compression, ...): DCP's own transforms undo it.
            stream = self.transforms.transform_load_stream(
                item, info.transform_descriptors, io.BytesIO(view[start:end])
            )
            blob = memoryview(stream.read(-1))
        else:
            blob = view[start:end]
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(blob))
            return
        expected = self._chunks.get(item.storage_index)
        tensor = None
        if expected is not None and not info.transform_descriptors:
            tensor = decode_tensor(blob, *expected)
        if tensor is None:
            tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            if expected is not None and not (
                isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == expected[1]
            ):
                held_what = (
                    f"shape {list(tensor.shape)}"
                    if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__
                )
                raise CheckpointCorruptError(
                    f"{self.path}: item {item.storage_index.fqn!r} holds {held_what}, the DCP "
                    f"metadata records shape {list(expected[1])}; the DCP metadata is damaged",
                    path=os.fspath(self.path),
                )
        else:
            self.decoded += 1
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        self._copy(item, tensor, target)
        planner.commit_tensor(item, target)
