"""Read DCP's ``.metadata`` without running code from it.

``.metadata`` is a pickle, and ``FileSystemReader.read_metadata`` calls
``pickle.load`` on it, so a crafted file runs any code it likes the moment the
checkpoint is opened (even by ``stalwart inspect``). Checksums in MANIFEST.json
do not help: whoever can write the checkpoint can write a manifest that matches it.

This module owns the restricted reading and validation of that file: an
unpickler that can build only the handful of plain-data classes DCP writes there
(torch 2.9 through 2.13 write the same set), never lets a pickle change the state
of a class or any other shared object, and checks the result's shape and bounds
(including that every data file named in it lies inside the checkpoint
directory) before anyone uses it.

Public entry points: ``read_dcp_metadata`` and, for readers that resolve the
metadata file themselves (``stalwart.safe_load.SafeFileSystemReader``),
``read_metadata_file``.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
import struct
from collections.abc import Callable
from typing import IO, Any, ClassVar, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
)
from stalwart.manifest import open_checkpoint_file

__all__ = [
    "TORCH_DTYPES",
    "TORCH_LAYOUTS",
    "checked_metadata",
    "data_file_sizes",
    "metadata_from_bytes",
    "read_dcp_metadata",
    "read_metadata_file",
]

_METADATA_FILE = ".metadata"
_TAMPERED = "the file is not a genuine DCP metadata file or was tampered with"
_MAX_NDIM = 64  # torch itself refuses tensors of more dimensions
_MAX_KEY_PATH = 256  # parts of one planner_data key path: far deeper than any state dict

# Classes whose fresh instances the pickle fills in (NEWOBJ then BUILD). These are
# plain dataclasses; TensorProperties.__setstate__ only unpacks a tuple.
_BUILDABLE: frozenset[type] = frozenset(
    {
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _StorageInfo,
    }
)


TORCH_LAYOUTS: dict[str, torch.layout] = {
    str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)
}
"""Every ``torch.layout`` by its ``str`` (``"torch.strided"``): what metadata may name."""
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}
"""Every ``torch.dtype`` by its attribute name in torch (aliases too: ``float``, ``float32``)."""


def _layout_by_name(name: str) -> torch.layout:
    # Stands in for torch.serialization._get_layout, which is what
    # torch.layout pickles as: same answer, but its cache is a function attribute
    # and ours is out of a pickle's reach, and nothing but a layout comes back.
    if not isinstance(name, str) or name not in TORCH_LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch.layout {name!r}")
    return TORCH_LAYOUTS[name]


def _mem_format_encoding(value: int) -> _MEM_FORMAT_ENCODING:
    # The enum class itself is also Enum's functional API: called with more
    # arguments it builds new classes. Only the one-argument lookup is needed.
    return _MEM_FORMAT_ENCODING(value)


def _path_classes() -> dict[tuple[str, str], Callable[..., pathlib.PurePath]]:
    # StorageMeta.checkpoint_id is the Path the writer was given. Constructing a
    # path touches no file. A path of the other OS family cannot be instantiated
    # here, so it comes back as its pure counterpart, as a string would.
    on_windows = os.name == "nt"
    classes: dict[str, Callable[..., pathlib.PurePath]] = {
        "PurePath": pathlib.PurePath,
        "PurePosixPath": pathlib.PurePosixPath,
        "PureWindowsPath": pathlib.PureWindowsPath,
        "Path": pathlib.Path,
        "PosixPath": pathlib.PurePosixPath if on_windows else pathlib.PosixPath,
        "WindowsPath": pathlib.WindowsPath if on_windows else pathlib.PureWindowsPath,
    }
    # Python 3.13 (only) defines the classes in pathlib._local, and its pickles
    # name that module.
    return {
        (module, name): cls
        for module in ("pathlib", "pathlib._local")
        for name, cls in classes.items()
    }


def _allowed_globals() -> dict[tuple[str, str], object]:
    """Every global a DCP ``.metadata`` pickle may name, as (module, name) -> object.

    Found by recording ``find_class`` while unpickling metadata that torch 2.13
    wrote for models, Adam state, python values, bfloat16/bool/int64 and
    channels-last tensors; torch 2.9's metadata.py and filesystem.py define and
    pickle the same classes. Nothing here runs code when called: dataclass
    constructors, ``torch.Size``, a layout lookup, an enum lookup, path
    constructors, and dtype objects (not callable at all).
    """
    dcp_metadata = "torch.distributed.checkpoint.metadata"
    allowed: dict[tuple[str, str], object] = {
        (dcp_metadata, "Metadata"): Metadata,
        (dcp_metadata, "TensorStorageMetadata"): TensorStorageMetadata,
        (dcp_metadata, "BytesStorageMetadata"): BytesStorageMetadata,
        (dcp_metadata, "ChunkStorageMetadata"): ChunkStorageMetadata,
        (dcp_metadata, "TensorProperties"): TensorProperties,
        (dcp_metadata, "MetadataIndex"): MetadataIndex,
        (dcp_metadata, "StorageMeta"): StorageMeta,
        (dcp_metadata, "_MEM_FORMAT_ENCODING"): _mem_format_encoding,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout_by_name,
    }
    # A dtype pickles as the name of its torch attribute (torch.float32 ->
    # "torch", "float32"). Taking them from torch keeps new dtypes loadable.
    for name, value in TORCH_DTYPES.items():
        allowed["torch", name] = value
    allowed.update(_path_classes())
    return allowed


_ALLOWED_GLOBALS = _allowed_globals()


class _Refused(pickle.UnpicklingError):
    """Raised inside the unpickler; turned into UnsafeCheckpointError with the file name."""


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-python unpickler, restricted to DCP metadata, over bytes in memory.

    The C unpickler only lets a subclass filter globals. That is not enough: its
    BUILD opcode sets attributes on whatever object is on the stack, including an
    allowed class itself, an enum member or a function, so a pickle could rewrite
    ``Metadata`` or poison a cache for the rest of the process; and it grows its
    memo to whatever index a PUT names (a 9-byte file can make it zero-fill
    64 GiB). The python one lets every opcode that could reach beyond the file
    be checked: BUILD, the extension-registry opcodes (whose cache hands out
    objects without asking ``find_class``), and every length that would allocate
    before reading. It reads straight from the in-memory bytes and skips
    the framing layer (frames only group reads), which makes it about a third faster.
    """

    stack: list[Any]  # set by load()

    def __init__(self, data: bytes | memoryview) -> None:
        super().__init__(io.BytesIO(b""))
        self._input = io.BytesIO(data)
        self._size = len(data)

    def load(self) -> Any:
        # pickle._Unpickler.load, less the _Unframer: its per-opcode python
        # read() is a third of the time, and frames are a buffering hint only.
        source = self._input
        self.read = read = source.read
        self.readinto = source.readinto
        self.readline = source.readline
        self.metastack: list[list[Any]] = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        dispatch = self.dispatch
        me = cast(pickle.Unpickler, self)
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](me)
        except _STOP as stop:
            return cast(Any, stop).value

    def _left(self) -> int:
        return self._size - self._input.tell()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[module, name]
        except KeyError:
            raise _Refused(f"refused to load global '{module}.{name}'") from None

    def _load_build(self) -> None:
        target = self.stack[-2]
        if type(target) not in _BUILDABLE:
            what = (
                f"class {target.__module__}.{target.__qualname__}"
                if isinstance(target, type)
                else f"a {type(target).__module__}.{type(target).__qualname__} object"
            )
            raise _Refused(f"refused to set the state of {what}")
        _BASE_BUILD(cast(pickle.Unpickler, self))

    def _load_frame(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._left():
            raise pickle.UnpicklingError(f"a frame of {size} bytes, past the end of the data")

    def _load_bytearray8(self) -> None:
        # The base allocates (and zero-fills) the claimed length before reading.
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._left():
            raise pickle.UnpicklingError(f"a bytearray of {size} bytes, past the end of the data")
        self.append(bytearray(self.read(size)))

    def _load_extension(self) -> None:
        raise _Refused("refused an extension-registry object (DCP metadata names none)")

    dispatch: ClassVar[dict[int, Callable[[pickle.Unpickler], None]]] = {
        **pickle._Unpickler.dispatch,
        pickle.BUILD[0]: cast(Callable[[pickle.Unpickler], None], _load_build),
        pickle.FRAME[0]: cast(Callable[[pickle.Unpickler], None], _load_frame),
        pickle.BYTEARRAY8[0]: cast(Callable[[pickle.Unpickler], None], _load_bytearray8),
        **dict.fromkeys(
            (pickle.EXT1[0], pickle.EXT2[0], pickle.EXT4[0]),
            cast(Callable[[pickle.Unpickler], None], _load_extension),
        ),
    }


_BASE_BUILD = pickle._Unpickler.dispatch[pickle.BUILD[0]]
# Raised by the STOP opcode with the loaded object; private to pickle, as is _Unpickler.
_STOP: type[Exception] = pickle._Stop  # type: ignore[attr-defined]


_MALFORMED: tuple[type[Exception], ...] = (pickle.UnpicklingError, EOFError, struct.error)
_MALFORMED += (LookupError, TypeError, ValueError, AttributeError, ArithmeticError, RecursionError)
"""What the restricted unpickler and the inert constructors raise for malformed bytes."""


def _unpickle_metadata(
    stream: IO[bytes], size: int, where: str, file_size: Callable[[str], int]
) -> Metadata:
    # Read it whole first, and no more than the regular file's size: a crafted
    # length field then asks an in-memory buffer for more than it has (a short
    # read, "truncated"), not the file object, which would allocate the claimed
    # size up front.
    data = stream.read(size)
    try:
        obj = _MetadataUnpickler(data).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(
            f"{where}: {exc} (only DCP metadata classes are allowed); {_TAMPERED}",
            path=where,
        ) from exc
    except _MALFORMED as exc:
        # Only inert constructors can run, so these (EOFError, KeyError from a bad
        # memo index, ...) mean the bytes are not a well-formed metadata pickle.
        raise CheckpointCorruptError(
            f"{where}: not a readable DCP metadata file (truncated or not a pickle: "
            f"{type(exc).__name__}: {exc})",
            path=where,
        ) from exc
    except Exception as exc:
        # Anything else (an error raised into this thread: DataLoader's handler
        # raises RuntimeError when a worker dies) is no proof of damage.
        raise CheckpointCorruptError(
            f"{where}: reading the metadata failed ({type(exc).__name__}: {exc}); not "
            "taken as damage, the checkpoint is kept",
            path=where,
            transient=True,
        ) from exc
    return _check_bounds(_check_structure(obj, where), where, file_size)


def _is_plain_file_name(name: object) -> bool:
    # FileSystemReader joins this onto the checkpoint directory; "../x" or an
    # absolute path would read any file on the machine into the loaded tensors.
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\:\0")
    )


def _check_structure(obj: object, where: str) -> Metadata:
    # A pickle of allowed classes can still hold anything in any field; check what
    # DCP and tensor_table rely on so a bad file fails here, with its name.
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: not valid DCP metadata: {what}", path=where)

    if type(obj) is not Metadata:
        raise bad(f"top-level object is {type(obj).__qualname__}, expected Metadata")
    entries = getattr(obj, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise bad("state_dict_metadata is not a dict")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise bad(f"state_dict_metadata key {fqn!r} is not a string")
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            raise bad(f"entry {fqn!r} is {type(entry).__qualname__}")
        properties = getattr(entry, "properties", None)
        chunks = getattr(entry, "chunks", None)
        if (
            type(properties) is not TensorProperties
            or not isinstance(getattr(properties, "dtype", None), torch.dtype)
            or type(getattr(entry, "size", None)) is not torch.Size
            or not isinstance(chunks, list)
            or not all(
                type(chunk) is ChunkStorageMetadata
                and type(getattr(chunk, "offsets", None)) is torch.Size
                and type(getattr(chunk, "sizes", None)) is torch.Size
                for chunk in chunks
            )
        ):
            raise bad(f"tensor entry {fqn!r} lacks a dtype, size or chunk list")
    storage = getattr(obj, "storage_data", None)
    if not isinstance(storage, dict):
        raise bad("storage_data is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise bad("storage_data does not map MetadataIndex to _StorageInfo")
        relative_path = getattr(info, "relative_path", None)
        if not _is_plain_file_name(relative_path):
            raise UnsafeCheckpointError(
                f"{where}: data of {index.fqn!r} is said to be in {relative_path!r}, "
                f"which is not a file name inside the checkpoint directory; {_TAMPERED}",
                path=where,
            )
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise bad(f"data of {index.fqn!r} has offset {offset!r}, length {length!r}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        ):
            raise bad(f"data of {index.fqn!r} has transform_descriptors {descriptors!r}")
    storage_meta = getattr(obj, "storage_meta", None)
    if storage_meta is not None and not _is_plain_storage_meta(storage_meta):
        raise bad(f"storage_meta is not a StorageMeta of strings: {_short(storage_meta)}")
    return obj


def _is_plain_storage_meta(meta: object) -> bool:
    # Read by DCP's reader (load_id) and printed by tools: strings only, no
    # structure of the pickle's choosing.
    if type(meta) is not StorageMeta:
        return False
    modules = getattr(meta, "modules", None)
    return (
        isinstance(getattr(meta, "checkpoint_id", None), (str, pathlib.PurePath, type(None)))
        and all(
            isinstance(getattr(meta, name, None), (str, type(None)))
            for name in ("save_id", "load_id")
        )
        and isinstance(modules, list)
        and all(type(module) is str for module in modules)
    )


def _check_bounds(metadata: Metadata, where: str, file_size: Callable[[str], int]) -> Metadata:
    """Every number in ``metadata`` against the others and the data files' real sizes.

    Whoever can write a checkpoint can build metadata from allowed classes alone:
    a tensor of negative size or of 2**40 elements, a chunk outside its tensor,
    data past the end of its file, a planner_data index that makes a list of a
    trillion entries. Anything that could make a reader allocate more than the
    checkpoint holds, or index out of range, fails here as ``CheckpointCorruptError``.
    ``file_size(name)`` is a data file's size (raising CheckpointCorruptError
    for a missing, linked or non-regular file).
    """

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: not valid DCP metadata: {what}", path=where)

    sizes: dict[str, int] = {}
    stored: dict[tuple[str, tuple[int, ...] | None], _StorageInfo] = {}
    for index, info in metadata.storage_data.items():
        offset = index.offset
        if type(index.fqn) is not str or not (offset is None or _is_shape(offset)):
            raise bad(f"storage index {index.fqn!r} at {offset!r} is malformed")
        name = info.relative_path
        if name not in sizes:
            sizes[name] = file_size(name)
        if info.offset + info.length > sizes[name]:
            raise bad(
                f"data of {index.fqn!r} is bytes {info.offset}..{info.offset + info.length} "
                f"of {name}, which has {sizes[name]} bytes"
            )
        stored[index.fqn, None if offset is None else tuple(offset)] = info
    # Data of the whole checkpoint: what a reader may allocate for its tensors.
    budget = sum(sizes.values())
    wanted = 0
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        wanted += _tensor_bytes(fqn, entry, stored, bad)
        if wanted > budget:
            raise bad(
                f"its tensors (up to {fqn!r}) need {wanted} bytes, more than the "
                f"{budget} bytes of data the checkpoint holds"
            )
    _check_planner_data(metadata.planner_data, len(metadata.state_dict_metadata), bad)
    return metadata


def _is_shape(value: object) -> bool:
    return (
        type(value) is torch.Size
        and len(value) <= _MAX_NDIM
        and all(type(d) is int and d >= 0 for d in value)
    )


def _tensor_bytes(
    fqn: str,
    entry: TensorStorageMetadata,
    stored: dict[tuple[str, tuple[int, ...] | None], _StorageInfo],
    bad: Callable[[str], CheckpointCorruptError],
) -> int:
    """Bytes of the whole tensor ``fqn``, once its shape and chunks are proven consistent."""
    size = entry.size
    if not _is_shape(size):
        raise bad(f"tensor {fqn!r} has size {_short(size)}")
    itemsize = entry.properties.dtype.itemsize
    numel = math.prod(size)
    in_chunks = 0
    for chunk in entry.chunks:
        offsets, lengths = chunk.offsets, chunk.sizes
        if not (_is_shape(offsets) and _is_shape(lengths)) or not (
            len(offsets) == len(lengths) == len(size)
            and all(o + n <= d for o, n, d in zip(offsets, lengths, size, strict=True))
        ):
            raise bad(
                f"tensor {fqn!r} of size {list(size)} has a chunk at {_short(offsets)} of "
                f"size {_short(lengths)}, not inside it"
            )
        info = stored.get((fqn, tuple(offsets)))
        if info is None:
            raise bad(f"tensor {fqn!r} has no stored data for its chunk at {list(offsets)}")
        chunk_numel = math.prod(lengths)
        if not info.transform_descriptors and chunk_numel * itemsize > info.length:
            raise bad(
                f"tensor {fqn!r}'s chunk at {list(offsets)} needs {chunk_numel * itemsize} "
                f"bytes, but its stored data has {info.length}"
            )
        in_chunks += chunk_numel
    if in_chunks > numel:
        raise bad(f"tensor {fqn!r} has {in_chunks} elements in its chunks, but only {numel}")
    return numel * itemsize


def _check_planner_data(
    planner_data: object, entries: int, bad: Callable[[str], CheckpointCorruptError]
) -> None:
    # DCP unflattens the loaded values along these key paths (set_element), and
    # an integer part becomes a list index: list positions are filled up to it.
    if planner_data is None:
        return
    if not isinstance(planner_data, dict):
        raise bad(f"planner_data is a {type(planner_data).__qualname__}, expected a dict")
    for key, path in planner_data.items():
        if not (
            isinstance(key, str)
            and isinstance(path, (tuple, list))
            and 0 < len(path) <= _MAX_KEY_PATH
            and all(
                type(part) is str or (type(part) is int and 0 <= part < entries) for part in path
            )
        ):
            raise bad(
                f"planner_data maps {_short(key)} to {_short(path)}; expected a key path "
                f"of strings and list indices below {entries}"
            )


def _short(value: object) -> str:
    try:
        text = repr(value)
    except RecursionError:
        # A pickle nests lists 100,000 deep in a few hundred kilobytes.
        return f"a {type(value).__qualname__} nested too deep to print"
    return text if len(text) <= 80 else text[:77] + "..."


def data_file_sizes(directory: str) -> Callable[[str], int]:
    """Sizes of the data files in ``directory``, read without following links."""

    def size_of(name: str) -> int:
        where = os.path.join(directory, name)
        try:
            with open_checkpoint_file(directory, name) as stream:
                return stream.size
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"{where}: missing (named by the DCP metadata)", path=where
            ) from exc
        except OSError as exc:
            raise CheckpointCorruptError(
                f"{where}: cannot read ({exc.strerror or exc})", path=where, transient=True
            ) from exc

    return size_of


def read_metadata_file(directory: str, name: str) -> Metadata:
    """Read and check the metadata file ``name`` in ``directory``, never following a link.

    Raises ``FileNotFoundError`` when there is no such file (the caller knows what
    that means), ``CheckpointCorruptError`` (transient) when it cannot be read,
    and what ``read_dcp_metadata`` documents for its content.
    """
    where = os.path.join(directory, name)
    try:
        with open_checkpoint_file(directory, name) as stream:
            return _unpickle_metadata(stream, stream.size, where, data_file_sizes(directory))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{where}: cannot read ({exc.strerror or exc})", path=where, transient=True
        ) from exc


def metadata_from_bytes(
    data: bytes | memoryview, where: str, file_size: Callable[[str], int]
) -> Metadata:
    """Check and return the metadata pickle ``data`` (the content of ``where``), already read.

    For a caller that checked the bytes itself and must use exactly those (a
    restore passes the bytes whose checksum matched): the same unpickler and
    checks as ``read_metadata_file``, with ``file_size(name)`` the data files'
    sizes (raising ``CheckpointCorruptError`` for one it does not know).
    """
    return _unpickle_metadata(io.BytesIO(data), len(data), where, file_size)


def checked_metadata(obj: object, where: str, file_size: Callable[[str], int]) -> Metadata:
    """``obj`` (decoded from ``where`` by other means) held to every check of
    ``metadata_from_bytes``; ``file_size`` as there (``data_file_sizes``)."""
    return _check_bounds(_check_structure(obj, where), where, file_size)


def read_dcp_metadata(path: str | os.PathLike[str]) -> Metadata:
    """Read a DCP checkpoint's ``.metadata`` without running code from it.

    ``path`` is the checkpoint directory or the metadata file itself (also a
    rank-local ``__<rank>.metadata``). Returns the ``Metadata`` exactly as stored:
    unlike ``FileSystemReader.read_metadata`` it does not fill in ``storage_meta``
    or a ``load_id``. Callable from any rank or thread; reads one file.

    Raises ``UnsafeCheckpointError`` for a pickle naming anything but DCP's
    metadata classes (or trying to modify one), ``CheckpointCorruptError`` for a
    truncated or garbage file, ``CheckpointNotFoundError`` when there is none.
    """
    file = os.fspath(path)
    if os.path.isdir(file):
        file = os.path.join(file, _METADATA_FILE)
    try:
        return read_metadata_file(os.path.dirname(file) or ".", os.path.basename(file))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{file}: no DCP metadata file (is {os.fspath(path)} a DCP checkpoint directory?)"
        ) from exc
    except OSError as exc:
        # EIO and friends: the file may be fine; restore falls back without moving it aside.
        raise CheckpointCorruptError(
            f"{file}: cannot read ({exc.strerror or exc})", path=file, transient=True
        ) from exc
