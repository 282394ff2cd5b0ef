"""DCP's metadata as JSON: ``.metadata.json``, which a restore reads instead of the pickle.

Every checkpoint stalwart writes keeps DCP's ``.metadata`` (a pickle) for
DCP's own readers and any other tool, and next to it the same ``Metadata``
as JSON, listed and checksummed in the manifest like every other file. A
restore of such a checkpoint reads the JSON: parsing it is ``json.loads`` in
C and one constructor call per object, where reading the pickle safely takes
python's pure-python unpickler (the C one cannot be restricted enough, see
``stalwart.dcp_metadata``), one interpreted opcode at a time. For a 192-tensor
AdamW state that was 10 to 22 ms of every restore; the JSON takes about 1 ms.

Nothing in the JSON can run code or name a class: ``decode`` builds only
DCP's metadata classes, from JSON's own values, each checked for type before
it is used. The result then goes through exactly the checks the pickle's does
(``dcp_metadata.metadata_from_json``): structure, bounds against the data
files' sizes, file names inside the checkpoint.

The format, version 1 (one JSON object):

- ``format``: ``"stalwart.dcp-metadata"``; ``version``: 1;
- ``dcp_version``: ``Metadata.version`` (a string or null);
- ``state_dict_metadata``: ``{fqn: null}`` for a non-tensor value
  (``BytesStorageMetadata``), ``{fqn: [dtype, layout, requires_grad,
  memory_format, pin_memory, size, [[offsets, sizes], ...]]}`` for a tensor:
  dtype and layout as torch names them (``"float32"``, ``"torch.strided"``),
  memory_format one of ``contiguous_format``, ``channels_last`` and
  ``preserve_format`` (the only ones DCP's pickle can hold either);
- ``planner_data``: ``{key: [part, ...]}`` (DCP's flattening map) or null;
- ``storage_data``: ``[[fqn, offset or null, index or null, relative_path,
  byte offset, length, transform_descriptors or null], ...]``, in the order of
  the pickle's dict;
- ``storage_meta``: null or ``[checkpoint_id, is_path, save_id, load_id,
  modules]``.

A sidecar of a later version is not read (``decode`` returns None): the
restore reads the pickle, as it does for a checkpoint without one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from stalwart.dcp_metadata import TORCH_DTYPES, TORCH_LAYOUTS, checked_metadata, data_file_sizes
from stalwart.errors import CheckpointCorruptError
from stalwart.layout import DCP_METADATA_JSON_NAME
from stalwart.manifest import open_checkpoint_file

__all__ = ["FORMAT", "VERSION", "decode", "encode", "metadata_from_json", "read_metadata_json"]

FORMAT = "stalwart.dcp-metadata"
VERSION = 1

_DTYPE_NAMES: dict[torch.dtype, str] = {
    value: str(value).removeprefix("torch.") for value in TORCH_DTYPES.values()
}
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_MEMORY_FORMAT_NAMES = {value: name for name, value in _MEMORY_FORMATS.items()}
_KEYS = frozenset(
    {
        "format",
        "version",
        "dcp_version",
        "state_dict_metadata",
        "planner_data",
        "storage_data",
        "storage_meta",
    }
)
_HAS_DESCRIPTORS = "transform_descriptors" in {f.name for f in dataclasses.fields(_StorageInfo)}
_PATH_TYPE = type(pathlib.Path())
_INT64 = 2**63


class _UnencodableError(Exception):
    """Metadata this format cannot hold exactly; no sidecar is written for it."""


def encode(metadata: Metadata) -> bytes | None:
    """``metadata`` as version-1 JSON, or None when the format cannot hold it exactly
    (then only ``.metadata`` is written, and a restore reads that)."""
    try:
        document = {
            "format": FORMAT,
            "version": VERSION,
            "dcp_version": _optional_str(metadata.version),
            "state_dict_metadata": {
                fqn: _encode_entry(entry) for fqn, entry in metadata.state_dict_metadata.items()
            },
            "planner_data": _encode_planner_data(metadata.planner_data),
            "storage_data": [
                _encode_storage(index, info) for index, info in _dict(metadata.storage_data).items()
            ],
            "storage_meta": _encode_storage_meta(metadata.storage_meta),
        }
    except (_UnencodableError, AttributeError, TypeError):
        # The twin is an optimisation: metadata it cannot hold never fails a save.
        return None
    return json.dumps(document, separators=(",", ":")).encode()


def _dict(value: object) -> dict[Any, Any]:
    if type(value) is not dict:
        raise _UnencodableError
    return value


def _optional_str(value: object) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _UnencodableError


def _ints(value: object) -> list[int]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise _UnencodableError
    return list(value)


def _encode_entry(entry: object) -> list[Any] | None:
    if type(entry) is BytesStorageMetadata:
        return None
    if type(entry) is not TensorStorageMetadata or type(entry.properties) is not TensorProperties:
        raise _UnencodableError
    p = entry.properties
    if (
        p.dtype not in _DTYPE_NAMES
        or str(p.layout) not in TORCH_LAYOUTS
        or p.memory_format not in _MEMORY_FORMAT_NAMES
        or type(p.requires_grad) is not bool
        or type(p.pin_memory) is not bool
    ):
        raise _UnencodableError
    return [
        _DTYPE_NAMES[p.dtype],
        str(p.layout),
        p.requires_grad,
        _MEMORY_FORMAT_NAMES[p.memory_format],
        p.pin_memory,
        _ints(entry.size),
        [[_ints(c.offsets), _ints(c.sizes)] for c in entry.chunks],
    ]


def _encode_planner_data(planner_data: object) -> dict[str, list[Any]] | None:
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict):
        raise _UnencodableError
    out: dict[str, list[Any]] = {}
    for key, path in planner_data.items():
        if (
            type(key) is not str
            or type(path) is not tuple
            or not all(type(part) in (str, int) for part in path)
        ):
            raise _UnencodableError
        out[key] = list(path)
    return out


def _encode_storage(index: MetadataIndex, info: _StorageInfo) -> list[Any]:
    descriptors = getattr(info, "transform_descriptors", None)
    if (
        type(index) is not MetadataIndex
        or type(info) is not _StorageInfo
        or not (index.index is None or type(index.index) is int)
        or type(info.offset) is not int
        or type(info.length) is not int
        or not (
            descriptors is None
            or (type(descriptors) is list and all(type(d) is str for d in descriptors))
        )
    ):
        raise _UnencodableError
    return [
        _optional_str(index.fqn),
        None if index.offset is None else _ints(index.offset),
        index.index,
        _optional_str(info.relative_path),
        info.offset,
        info.length,
        descriptors,
    ]


def _encode_storage_meta(meta: object) -> list[Any] | None:
    if meta is None:
        return None
    if type(meta) is not StorageMeta or type(meta.modules) is not list:
        raise _UnencodableError
    checkpoint_id = meta.checkpoint_id
    is_path = type(checkpoint_id) is _PATH_TYPE
    return [
        str(checkpoint_id) if is_path else _optional_str(checkpoint_id),
        is_path,
        _optional_str(meta.save_id),
        _optional_str(meta.load_id),
        [_optional_str(m) for m in meta.modules],
    ]


def metadata_from_json(
    data: bytes | memoryview, where: str, file_size: Callable[[str], int]
) -> Metadata | None:
    """The checked metadata in ``.metadata.json``'s ``data`` (the content of ``where``).

    Decoded without any class lookup (``decode``), then held to exactly the
    checks of ``dcp_metadata.metadata_from_bytes``, ``file_size(name)`` giving
    the data files' sizes. None for a later version of the format (read
    ``.metadata`` instead). Raises ``CheckpointCorruptError`` and
    ``UnsafeCheckpointError`` as ``read_dcp_metadata`` does.
    """
    metadata = decode(data, where)
    return None if metadata is None else checked_metadata(metadata, where, file_size)


def read_metadata_json(checkpoint: str | os.PathLike[str]) -> Metadata | None:
    """The checked metadata of ``checkpoint``'s ``.metadata.json``, read without following a
    link; None when there is none (a checkpoint of DCP itself or of an older stalwart)
    or it is of a later format version. Raises as ``metadata_from_json``; an
    unreadable file is a transient ``CheckpointCorruptError``."""
    directory = os.fspath(checkpoint)
    where = os.path.join(directory, DCP_METADATA_JSON_NAME)
    try:
        with open_checkpoint_file(directory, DCP_METADATA_JSON_NAME) as stream:
            data = stream.read(stream.size)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{where}: cannot read ({exc.strerror or exc})", path=where, transient=True
        ) from exc
    return metadata_from_json(data, where, data_file_sizes(directory))


class _MalformedError(Exception):
    """A value of the wrong type or form; becomes CheckpointCorruptError."""


def decode(data: bytes | memoryview, where: str) -> Metadata | None:
    """The ``Metadata`` in ``data``, not yet checked for consistency or bounds
    (``metadata_from_json`` does that); None for a later version of
    the format. Raises ``CheckpointCorruptError`` for anything else malformed."""
    try:
        document = json.loads(bytes(data))
        if type(document) is not dict or document.get("format") != FORMAT:
            raise _MalformedError("not a stalwart DCP metadata document")
        if document.get("version") != VERSION:
            if type(document.get("version")) is int and document["version"] > VERSION:
                return None
            raise _MalformedError(f"version {document.get('version')!r}")
        if set(document) != _KEYS:
            raise _MalformedError(f"keys {sorted(document)}")
        return Metadata(
            state_dict_metadata=_decode_entries(document["state_dict_metadata"]),
            planner_data=_decode_planner_data(document["planner_data"]),
            storage_data=_decode_storage(document["storage_data"]),
            storage_meta=_decode_storage_meta(document["storage_meta"]),
            version=_str(document["dcp_version"], optional=True),
        )
    except (_MalformedError, ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
        # ValueError covers JSON syntax, bad UTF-8 and integers too long to parse.
        raise CheckpointCorruptError(
            f"{where}: not valid stalwart DCP metadata JSON: {type(exc).__name__}: {exc}",
            path=where,
        ) from exc


def _str(value: object, *, optional: bool = False) -> Any:
    if type(value) is str or (optional and value is None):
        return value
    raise _MalformedError(f"expected a string, got {type(value).__name__}")


def _size(value: object) -> torch.Size:
    # torch.Size holds any python int; a shape or offset is an int64 that is not negative.
    if type(value) is not list or not all(type(v) is int and 0 <= v < _INT64 for v in value):
        raise _MalformedError(f"expected a list of integers in [0, 2**63), got {_short(value)}")
    return torch.Size(value)


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bool(value: object) -> bool:
    if type(value) is not bool:
        raise _MalformedError(f"expected true or false, got {type(value).__name__}")
    return value


def _decode_entries(entries: object) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    if type(entries) is not dict:
        raise _MalformedError("state_dict_metadata is not an object")
    out: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, entry in entries.items():
        if entry is None:
            out[fqn] = BytesStorageMetadata()
            continue
        if type(entry) is not list or len(entry) != 7 or type(entry[6]) is not list:
            raise _MalformedError(f"tensor entry {fqn!r} is not a list of 7 fields")
        dtype, layout, requires_grad, memory_format, pin_memory, size, chunks = entry
        chunk_list = []
        for chunk in chunks:
            if type(chunk) is not list or len(chunk) != 2:
                raise _MalformedError(f"a chunk of {fqn!r} is not [offsets, sizes]")
            chunk_list.append(ChunkStorageMetadata(offsets=_size(chunk[0]), sizes=_size(chunk[1])))
        out[fqn] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=TORCH_DTYPES[_str(dtype)],
                layout=TORCH_LAYOUTS[_str(layout)],
                requires_grad=_bool(requires_grad),
                memory_format=_MEMORY_FORMATS[_str(memory_format)],
                pin_memory=_bool(pin_memory),
            ),
            size=_size(size),
            chunks=chunk_list,
        )
    return out


def _decode_planner_data(planner_data: object) -> dict[str, tuple[Any, ...]] | None:
    if planner_data is None:
        return None
    if type(planner_data) is not dict:
        raise _MalformedError("planner_data is not an object")
    out: dict[str, tuple[Any, ...]] = {}
    for key, path in planner_data.items():
        if type(path) is not list:
            raise _MalformedError(f"planner_data[{key!r}] is not a list")
        out[key] = tuple(path)
    return out


def _decode_storage(storage: object) -> dict[MetadataIndex, _StorageInfo]:
    if type(storage) is not list:
        raise _MalformedError("storage_data is not a list")
    out: dict[MetadataIndex, _StorageInfo] = {}
    for row in storage:
        if type(row) is not list or len(row) != 7:
            raise _MalformedError("a storage_data row is not a list of 7 fields")
        fqn, offset, index, relative_path, byte_offset, length, descriptors = row
        if not (index is None or type(index) is int):
            raise _MalformedError(f"storage index of {fqn!r} is {type(index).__name__}")
        if type(byte_offset) is not int or type(length) is not int:
            raise _MalformedError(f"offset or length of {fqn!r} is not an integer")
        extra: dict[str, Any] = {}
        if descriptors is not None:
            if type(descriptors) is not list or not all(type(d) is str for d in descriptors):
                raise _MalformedError(f"transform_descriptors of {fqn!r} are not a list of strings")
            if not _HAS_DESCRIPTORS:
                raise _MalformedError(
                    f"data of {fqn!r} is stored transformed ({descriptors}), which this "
                    f"version of torch ({torch.__version__}) cannot read; use a newer torch"
                )
            extra["transform_descriptors"] = descriptors
        key = MetadataIndex(
            fqn=_str(fqn), offset=None if offset is None else _size(offset), index=index
        )
        out[key] = _StorageInfo(
            relative_path=_str(relative_path), offset=byte_offset, length=length, **extra
        )
    return out


def _decode_storage_meta(meta: object) -> StorageMeta | None:
    if meta is None:
        return None
    if type(meta) is not list or len(meta) != 5:
        raise _MalformedError("storage_meta is not a list of 5 fields")
    checkpoint_id, is_path, save_id, load_id, modules = meta
    if type(modules) is not list:
        raise _MalformedError("storage_meta's modules are not a list")
    return StorageMeta(
        checkpoint_id=pathlib.Path(_str(checkpoint_id))
        if _bool(is_path)
        else _str(checkpoint_id, optional=True),
        save_id=_str(save_id, optional=True),
        load_id=_str(load_id, optional=True),
        modules=[_str(m) for m in modules],
    )
