"""Decoding a tensor item of a DCP data file without unpickling it.

A tensor item DCP wrote is a ``torch.save`` of one tensor: a zip archive whose
``data.pkl`` says which storage record holds its bytes, with what shape. When
that pickle is byte for byte the one torch writes for a contiguous tensor of
the dtype and shape the (already checked) DCP metadata records, the tensor is
its storage record's bytes: ``decode_tensor`` gives it as a view of checked
bytes in memory, and ``framed_data`` finds where those bytes lie in the item
from the bytes around them alone (the zip framing; one parse per layout), so
that restore can read them straight into place. Anything else (another
layout, another torch's pickle, a compressed or zip64 archive) returns None,
and the caller goes through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["UnavailableError", "decode_tensor", "framed_data"]

_STORAGE_TYPES = {
    torch.float32: "FloatStorage",
    torch.float64: "DoubleStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}
"""The storage class ``torch.save`` names for each dtype decoded directly."""


def decode_tensor(
    view: memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The tensor the ``torch.save`` archive ``view`` holds, as a view of its bytes, or None.

    Returns a
    tensor only when the archive is uncompressed, little-endian, and its
    ``data.pkl`` is byte for byte what ``torch.save`` writes for a contiguous
    CPU tensor of ``dtype`` and ``shape`` over a storage of exactly its
    elements, so that reading the storage bytes as such a tensor is what
    unpickling would give. None means "use torch.load": never a guess.
    """
    found = framed_data(len(view), lambda a, b: bytes(view[a:b]), dtype, shape)
    if found is None:
        return None
    start, nbytes = found
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # frombuffer keeps the buffer alive and allows a start at any byte.
    return torch.frombuffer(view[start : start + nbytes], dtype=dtype).view(shape)


class UnavailableError(LookupError):
    """Raised by a ``framed_data`` reader for bytes it does not have."""


def framed_data(
    size: int, get: Callable[[int, int], bytes], dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[int, int] | None:
    """``(start, nbytes)`` of the raw data in a ``torch.save`` record of ``size`` bytes
    when it is exactly the record ``decode_tensor`` accepts, else None.

    ``get(start, end)`` returns the record's bytes ``[start, end)``; it may raise
    ``UnavailableError`` (then the answer is None), so a caller holding only the
    record's framing can tell where its data lies without having the data.
    """
    if sys.byteorder != "little" or dtype not in _STORAGE_TYPES or min(shape, default=0) < 0:
        return None
    key = (size, dtype, shape)
    known = _FRAMINGS.get(key)
    if known is not None:
        # The answer depends only on the bytes around the data (the parse reads
        # nothing inside it): the same bytes there as a record already parsed,
        # the same answer.
        start, nbytes, head, tail = known
        try:
            if get(0, start) == head and get(start + nbytes, size) == tail:
                return start, nbytes
        except UnavailableError:
            pass
    found = _parse_framing(size, get, dtype, shape)
    if found is not None:
        if len(_FRAMINGS) >= _MAX_FRAMINGS:
            _FRAMINGS.clear()
        start, nbytes = found
        _FRAMINGS[key] = (start, nbytes, get(0, start), get(start + nbytes, size))
    return found


_FRAMINGS: dict[tuple[int, torch.dtype, tuple[int, ...]], tuple[int, int, bytes, bytes]] = {}
"""Framings parsed, per (record size, dtype, shape): a checkpoint's records of one
layout share theirs, so each is parsed once (a few hundred bytes each)."""

_MAX_FRAMINGS = 4096


def _parse_framing(
    size: int, get: Callable[[int, int], bytes], dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[int, int] | None:
    try:
        records = _zip_records(size, get)
        if records is None:
            return None
        prefixes = {name.split("/", 1)[0] for name in records}
        if len(prefixes) != 1:
            return None
        prefix = prefixes.pop()
        pkl, order, data = (
            records.get(f"{prefix}/{n}") for n in ("data.pkl", "byteorder", "data/0")
        )
        if pkl is None or order is None or data is None:
            return None
        if any(
            name.startswith(f"{prefix}/data/") and name != f"{prefix}/data/0" for name in records
        ):
            return None
        if get(order[0], order[0] + order[1]) != b"little":
            return None
        numel = 1
        for n in shape:
            numel *= n
        if data[1] != numel * dtype.itemsize:
            return None
        if get(pkl[0], pkl[0] + pkl[1]) != _tensor_pickle(dtype, shape):
            return None
    except UnavailableError:
        return None
    return data


def _zip_records(size: int, get: Callable[[int, int], bytes]) -> dict[str, tuple[int, int]] | None:
    """``{name: (data offset, size)}`` of a stored (uncompressed) zip archive of ``size``
    bytes read through ``get``, or None for anything else (zip64, a comment,
    compression, a bound out of range)."""
    end = size - 22
    if end < 0:
        return None
    eocd = get(end, end + 22)
    if eocd[:4] != b"PK\x05\x06":
        return None
    count, cd_size, cd_offset, comment = struct.unpack_from("<10xHIIH", eocd)
    if comment or cd_offset + cd_size > end or count == 0xFFFF:
        return None
    records: dict[str, tuple[int, int]] = {}
    pos = cd_offset
    for _ in range(count):
        if pos + 46 > end:
            return None
        head = get(pos, pos + 46)
        if head[:4] != b"PK\x01\x02":
            return None
        method, packed, n, n_name, n_extra, n_comment, local = struct.unpack_from(
            "<10xH8xIIHHH8xI", head
        )
        if pos + 46 + n_name > end:
            return None
        name = get(pos + 46, pos + 46 + n_name).decode("utf-8", "replace")
        pos += 46 + n_name + n_extra + n_comment
        if method != 0 or packed != n or n == 0xFFFFFFFF or local + 30 > end:
            return None
        local_head = get(local, local + 30)
        if local_head[:4] != b"PK\x03\x04":
            return None
        l_name, l_extra = struct.unpack_from("<HH", local_head, 26)
        start = local + 30 + l_name + l_extra
        if start + n > end or name in records:
            return None
        records[name] = (start, n)
    return records


class _Storage:
    """Stands for the tensor's storage in ``_tensor_pickle`` (a persistent id)."""


class _TensorStandIn:
    """Pickles as ``torch.save`` pickles a contiguous, offset-0, detached CPU tensor."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        stride: list[int] = []
        step = 1
        for size in reversed(self.shape):
            stride.append(step)
            step *= size
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        args = (_STORAGE, 0, self.shape, tuple(reversed(stride)), False, hooks)
        return (torch._utils._rebuild_tensor_v2, args)


_STORAGE = _Storage()


class _TorchSavePickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, key: tuple[Any, ...]) -> None:
        super().__init__(file, protocol=2)
        self._key = key

    def persistent_id(self, obj: Any) -> Any:
        return self._key if obj is _STORAGE else None


@functools.lru_cache(maxsize=1024)
def _tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` ``torch.save`` writes for a contiguous CPU tensor of ``dtype``
    and ``shape`` whose storage is its elements (record ``0``)."""
    numel = 1
    for size in shape:
        numel *= size
    storage_type = getattr(torch, _STORAGE_TYPES[dtype])
    out = io.BytesIO()
    _TorchSavePickler(out, ("storage", storage_type, "0", "cpu", numel)).dump(_TensorStandIn(shape))
    return out.getvalue()
