"""Load DCP checkpoints without running code from them.

The threat is a checkpoint directory that came from somewhere else: shared by a
colleague, downloaded with a model, copied off a bucket other people can write.
Plain ``torch.distributed.checkpoint.load`` trusts it completely:

- ``.metadata`` is a pickle, and ``FileSystemReader.read_metadata`` calls
  ``pickle.load`` on it, so a crafted file runs any code it likes the moment the
  checkpoint is opened (even by ``stalwart inspect``).
- Every non-tensor value (python ints, lists, optimizer hyperparameters, ...) is a
  ``torch.save`` blob inside a ``.distcp`` file, and ``DefaultLoadPlanner.load_bytes``
  reads it with ``torch.load(weights_only=False)``: a full unpickler again.

Checksums in MANIFEST.json do not help: whoever can write the checkpoint can
write a manifest that matches it.

So ``.metadata`` is read by ``stalwart.dcp_metadata`` with a restricted
unpickler that builds only DCP's plain-data classes and checks the result
before anyone uses it (``read_dcp_metadata`` is re-exported here). This module
owns the rest of a load: the reader, the planner and ``safe_load``. Non-tensor
values go through ``torch.load(weights_only=True)``, torch's own restricted
unpickler (plain python data first through a C unpickler that resolves no
global but protocol 2's two bytes constructors, ``_plain_value``); a user who
stores an object of their own class there allowlists it
with ``torch.serialization.add_safe_globals``, knowingly. Tensor data was
already read with ``weights_only=True`` by DCP itself.

Public entry points: ``read_dcp_metadata``, ``tensor_table``, ``safe_load`` and,
for callers that drive ``dcp.load`` themselves, ``SafeFileSystemReader`` plus
``SafeLoadPlanner``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _version as _dcp_version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from stalwart.dcp_metadata import read_dcp_metadata, read_metadata_file
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StalwartError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from stalwart.manifest import open_checkpoint_file
from stalwart.state.plain import is_plain_data

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_dcp_metadata",
    "safe_load",
    "tensor_table",
    "weights_only_detail",
]


class _NoFollowFileSystem(FileSystem):
    """DCP's local filesystem, except that reading never follows a link or reads a device.

    Files were checked against the manifest before the load; opening them again
    this way means a file swapped for a link (or a FIFO) after that check is
    refused too, rather than read from wherever it points.
    """

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        file = os.fspath(path)
        try:
            with open_checkpoint_file(os.path.dirname(file), os.path.basename(file)) as stream:
                # Buffered like DCP's own open(): it reads many small records.
                yield io.BufferedReader(stream)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise CheckpointCorruptError(
                f"{file}: cannot read ({exc.strerror or exc})", path=file, transient=True
            ) from exc


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the restricted unpickler.

    Everything else, including the parent's handling of ``storage_meta``,
    ``load_id`` and rank-local metadata files (``rank=``), is unchanged.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, metadata: Metadata | None = None, **kwargs: Any
    ) -> None:
        super().__init__(path, **kwargs)
        self.fs = _NoFollowFileSystem()
        # dcp.load swallows read_metadata's exception (it logs it and retries a
        # rank-local file), so safe_load reads the real cause from here.
        self.metadata_errors: list[StalwartError] = []
        # Metadata already read (safely) by the caller: unpickling it again with
        # the pure-Python unpickler is the slowest part of a small restore.
        self._known_metadata = metadata
        self._unexpected: BaseException | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # **kwargs must stay in the signature: dcp.load looks for it to decide
        # whether to retry with rank=.
        rank = kwargs.get("rank")
        if rank is not None and self._unexpected is not None:
            # dcp.load retries any failed read with a rank-local file, and some torch
            # versions then report only the retry's "no such file": the first error
            # (not a missing or damaged file, an interrupt's, say) is the one to see.
            raise self._unexpected
        try:
            if self._known_metadata is not None and rank is None:
                metadata = self._known_metadata
            else:
                metadata = self._read_metadata_file(rank)
        except StalwartError:
            raise
        except BaseException as exc:
            self._unexpected = exc
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_metadata_file(self, rank: int | None) -> Metadata:
        path = self._get_metadata_path(rank)
        where = os.fspath(path)
        try:
            try:
                return read_metadata_file(os.path.dirname(where), os.path.basename(where))
            except FileNotFoundError as exc:
                raise CheckpointNotFoundError(f"{where}: no DCP metadata file") from exc
        except StalwartError as exc:
            self.metadata_errors.append(exc)
            raise


def weights_only_detail(exc: BaseException) -> str:
    # torch wraps the refusal in a page of advice and chains the original, which
    # names what was refused ("Unsupported global: GLOBAL getattr ...",
    # "... GLOBAL posix.system whose module posix is blocked").
    inner = exc.__context__
    if isinstance(inner, pickle.UnpicklingError) and str(inner).strip():
        return str(inner).strip()
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        return text.split(marker, 1)[1].strip().split("\n\n", 1)[0].strip()
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class _NotPlainError(Exception):
    """A value that is not plain python data: ``torch.load(weights_only=True)`` decides."""


def _latin1(text: Any, encoding: Any = None) -> bytes:
    """What protocol 2 pickles non-empty bytes as (``_codecs.encode(str, "latin1")``), and
    nothing else."""
    if type(text) is not str or encoding != "latin1":
        raise _NotPlainError("_codecs.encode called other than for bytes")
    return text.encode("latin1")


def _empty_bytes(*args: Any) -> bytes:
    """What protocol 2 pickles ``b""`` as (``bytes()``), and nothing else."""
    if args:
        raise _NotPlainError("bytes called with arguments")
    return b""


class _PlainUnpickler(pickle.Unpickler):
    """Python's C unpickler resolving no global but protocol 2's bytes constructors.

    Without a global nothing can be called or instantiated: the result can only
    be None, bools, numbers, strings, bytes and containers of them.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        if name == "bytes" and module in ("__builtin__", "builtins"):
            return _empty_bytes  # b"" in protocol 2
        raise _NotPlainError(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _NotPlainError("a persistent id (a tensor's storage)")


def _plain_value(value: io.BytesIO) -> tuple[bool, Any]:
    """``(True, obj)`` when ``value`` is the ``torch.save`` of plain python data, else
    ``(False, None)``.

    A quarter of ``torch.load(weights_only=True)``'s time for the small values a
    state holds (an optimizer's hyperparameters, counters): the same zip reader,
    then a restricted C unpickler instead of torch's Python one. Whatever this
    refuses or cannot read (a tensor, an allowlisted class, damaged bytes, an
    opcode or memo index ``_plain_opcodes`` does not allow) goes to
    ``torch.load(weights_only=True)``, which accepts or refuses it as before.
    """
    try:
        reader = torch._C.PyTorchFileReader(value)
        pickled = reader.get_record("data.pkl")
        if not _plain_opcodes(pickled):
            return False, None
        obj = _PlainUnpickler(io.BytesIO(pickled), encoding="utf-8").load()
    except Exception:
        return False, None
    # A global that no REDUCE called (a crafted pickle) would be left in the value.
    return (True, obj) if is_plain_data(obj) else (False, None)


_PLAIN_OPCODES = frozenset(
    {
        "PROTO", "STOP", "MARK", "NONE", "NEWTRUE", "NEWFALSE",
        "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE",
        "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
        "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS",
        "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "GLOBAL", "REDUCE",
    }
)  # fmt: skip
"""The protocol 2 opcodes ``torch.save`` writes for plain data, all of which torch's
weights-only unpickler reads too."""

_MEMO_OPCODES = frozenset({"BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"})


def _plain_opcodes(pickled: bytes) -> bool:
    """Only ``_PLAIN_OPCODES``, and no memo index above the opcode count so far.

    Python's C unpickler grows its memo to whatever index a ``PUT`` names (a
    9-byte pickle can make it zero-fill 64 GiB): with indices bounded by the
    pickle's own length, the memo never outgrows it. ``pickletools.genops``
    reads every argument from the bytes themselves (no length is allocated
    before it is there) and builds nothing.
    """
    try:
        for count, (op, arg, _pos) in enumerate(pickletools.genops(pickled)):
            if op.name not in _PLAIN_OPCODES:
                return False
            if op.name in _MEMO_OPCODES and not (isinstance(arg, int) and 0 <= arg <= count):
                return False
    except ValueError:  # malformed
        return False
    return True


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``.

    Plain python data (numbers, strings, None, lists, tuples, dicts), tensors and
    the classes allowlisted with ``torch.serialization.add_safe_globals`` load;
    anything else raises ``UnsafeCheckpointError`` naming the value's key.
    """

    def create_local_plan(self) -> LoadPlan:
        """DCP's local plan, with each plain tensor saved whole in one chunk planned directly.

        DCP plans every tensor through its resharding search (about 15 us a
        tensor here). A plain tensor whose checkpoint entry is one chunk of the
        same shape at offset 0 gets exactly the one read item that search
        returns; everything else (sharded tensors, other chunkings, a size
        that differs, a key the checkpoint lacks, a checkpoint from before torch
        2.4's key scheme) is planned by DCP itself, one value at a time, in order.
        """
        if self.metadata is None or not self.flatten_state_dict or self._keys_of_torch_2_3():
            return super().create_local_plan()
        saved = self.metadata.state_dict_metadata
        strict = not self.allow_partial_load
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            item = _whole_tensor_read(fqn, obj, saved.get(fqn))
            if item is not None:
                items.append(item)
            else:
                items += create_default_local_load_plan({fqn: obj}, self.metadata, strict).items
        return LoadPlan(items)

    def _keys_of_torch_2_3(self) -> bool:
        """Whether DCP would switch to torch 2.3's flattened keys for this checkpoint
        (its own test, in ``DefaultLoadPlanner.create_local_plan``); True when unsure."""
        assert self.metadata is not None
        missing = self.metadata.state_dict_metadata.keys() - self.state_dict.keys()
        if not missing:
            return False
        if getattr(_dcp_version, "_derived_version", "") is not None:
            return True  # a torch without that switch, or one in use: DCP decides
        _dcp_version._derived_version = "2_3"
        try:
            old, _ = flatten_state_dict(self.original_state_dict)
        finally:
            _dcp_version._derived_version = None
        return bool(old.keys() & missing)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            plain, obj = _plain_value(value)
            if not plain:
                value.seek(0)
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's weights-only unpickler raises this for every global or
            # opcode it refuses.
            raise UnsafeCheckpointError(
                f"non-tensor value {fqn!r}: refused by torch.load(weights_only=True): "
                f"{weights_only_detail(exc)}"
            ) from exc
        except Exception as exc:
            # Its bytes passed their checksum: not proof of damage (transient, see
            # _convert_checkpoint_exception), whatever raised it.
            raise CheckpointCorruptError(
                f"non-tensor value {fqn!r} is unreadable: {type(exc).__name__}: {exc}",
                transient=True,
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _whole_tensor_read(fqn: str, obj: Any, md: Any) -> ReadItem | None:
    """The one read item DCP plans for a plain tensor whose checkpoint entry is one
    chunk of its own shape at offset 0; None for anything else."""
    if type(obj) is not torch.Tensor or not isinstance(md, TensorStorageMetadata):
        return None
    if len(md.chunks) != 1:
        return None
    chunk = md.chunks[0]
    size = obj.size()
    if not (md.size == size == chunk.sizes and len(chunk.offsets) == len(size)):
        return None
    if any(chunk.offsets):
        return None
    zeros = torch.Size([0] * len(size))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, zeros, 0),
        dest_offsets=zeros,
        storage_index=MetadataIndex(fqn, chunk.offsets, 0),
        storage_offsets=zeros,
        lengths=md.size,
    )


def _copy_error(exc: StalwartError) -> StalwartError:
    if isinstance(exc, CheckpointCorruptError):
        return type(exc)(str(exc), path=exc.path, transient=exc.transient)
    return type(exc)(*exc.args)


def _convert_checkpoint_exception(
    exc: CheckpointException, reader: SafeFileSystemReader, checkpoint_dir: str
) -> StalwartError:
    failures = [failure for failure, _trace in exc.failures.values()]
    ours = [f for f in failures if isinstance(f, StalwartError)] + reader.metadata_errors
    for kind in (UnsafeCheckpointError, CheckpointCorruptError, StalwartError):
        for err in ours:
            if isinstance(err, kind):
                return _copy_error(err)
    ranks = sorted(exc.failures)
    first = failures[0] if failures else exc
    if isinstance(first, RuntimeError) and str(first).startswith("Missing key in checkpoint"):
        return StateMismatchError(
            f"{checkpoint_dir}: {first} Load into a state dict with the checkpoint's keys "
            "(`stalwart inspect` lists them)."
        )
    # Transient: a read that failed (EIO, ...) says nothing about the bytes, and
    # neither does any other error raised here after the files and the metadata
    # passed their checks (a signal handler's RuntimeError lands wherever the
    # thread is, MemoryError, ...). Restore falls back without moving the
    # checkpoint aside; only a check's finding (above) is proof of damage.
    return CheckpointCorruptError(
        f"{checkpoint_dir}: DCP load failed on rank(s) {ranks}: {type(first).__name__}: "
        f"{first} (after every check passed: not taken as damage, the checkpoint is kept)",
        path=checkpoint_dir,
        transient=True,
    )


def raise_interrupt(exc: CheckpointException) -> None:
    """Raise the KeyboardInterrupt (or SystemExit, ...) DCP caught and wrapped, as it is:
    Ctrl-C during a save or a restore must stop the program, not become a failed save
    that a training loop may catch and go on from, or a damaged checkpoint to skip."""
    for _rank, (inner, _trace) in sorted(exc.failures.items()):
        if not isinstance(inner, Exception):
            raise inner


def safe_load(
    state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    *,
    process_group: torch.distributed.ProcessGroup | None = None,
    metadata: Metadata | None = None,
    reader: SafeFileSystemReader | None = None,
) -> None:
    """``dcp.load`` into ``state_dict`` in place, without running code from the checkpoint.

    Collective: every rank of ``process_group`` calls it (or a single process
    with no process group). Blocks until the data is read. ``reader`` replaces
    the default ``SafeFileSystemReader(checkpoint_dir, metadata=metadata)`` (a
    restore passes ``stalwart.reader.VerifiedFileReader``, which reads each file once).

    Raises ``UnsafeCheckpointError`` when metadata or a non-tensor value would
    need a full unpickler, ``CheckpointCorruptError`` for any other failure DCP
    reports (transient unless a check of stalwart's found the damage: an error
    after every check passed is no proof of it), ``StateMismatchError`` when
    ``state_dict`` has a key the checkpoint lacks and ``CheckpointNotFoundError``
    when ``checkpoint_dir`` is not a directory. DCP's ``CheckpointException``
    (a ``BaseException``) is chained as ``__cause__``.
    """
    directory = os.fspath(checkpoint_dir)
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(f"{directory}: no such checkpoint directory")
    if reader is None:
        reader = SafeFileSystemReader(directory, metadata=metadata)
    single = process_group is None and not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():
            # DCP warns that it runs without a process group; for one process that is the intent.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
            dcp_load(
                state_dict,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                process_group=process_group,
                no_dist=single,
            )
    except CheckpointException as exc:
        raise_interrupt(exc)
        raise _convert_checkpoint_exception(exc, reader, directory) from exc
    # dcp.load falls back to a rank-local metadata file when .metadata fails to
    # read; a tampered .metadata must still fail the load.
    for err in reader.metadata_errors:
        if isinstance(err, UnsafeCheckpointError):
            raise _copy_error(err)


def tensor_table(metadata: Metadata) -> list[dict[str, Any]]:
    """One row per stored value, sorted by fully qualified name, for ``stalwart inspect``.

    Row keys: ``fqn``; ``kind`` (``"tensor"`` or ``"bytes"``, a pickled python
    value); ``dtype`` (e.g. ``"float32"``), ``shape`` (list of ints) and ``nbytes``
    (of the whole, unsharded tensor), each ``None`` for bytes; ``chunks``, the
    number of stored pieces (shards), 1 for bytes.
    """
    rows: list[dict[str, Any]] = []
    for fqn in sorted(metadata.state_dict_metadata):
        entry = metadata.state_dict_metadata[fqn]
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            rows.append(
                {
                    "fqn": fqn,
                    "kind": "tensor",
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": list(entry.size),
                    "nbytes": entry.size.numel() * dtype.itemsize,
                    "chunks": len(entry.chunks),
                }
            )
        else:
            rows.append(
                {
                    "fqn": fqn,
                    "kind": "bytes",
                    "dtype": None,
                    "shape": None,
                    "nbytes": None,
                    "chunks": 1,
                }
            )
    return rows
