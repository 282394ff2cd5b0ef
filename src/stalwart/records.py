"""A tensor's ``torch.save`` record, built around the tensor's own memory.

DCP's ``FileSystemWriter`` stores each tensor as ``torch.save`` of it: a zip
record of torch's own framing around the tensor's data. With the zip CRC off
(``without_zip_crc``), that framing depends only on the tensor's layout, so
``RecordTemplates`` cuts it once per layout out of a real ``torch.save`` and
later records are that header and trailer around the tensor's memory: no
pickling, no copy. ``writer`` writes the records.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["RecordTemplates", "record_settings", "without_zip_crc"]

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
        _CRC_USERS += 1
    # torch's config proxy runs Python code, so an interrupt (Ctrl-C, a signal
    # handler's error) can land on any of these assignments, even after one took
    # effect: this user is counted before it turns the CRC off, and the last one
    # out puts the setting back even when an error is raised into that call.
    # Left off, every later torch.save of the process would write its zips
    # without CRC, which Python's own zipfile then refuses.
    try:
        save_config.compute_crc32 = False
        yield
    finally:
        with _CRC_LOCK:
            _CRC_USERS -= 1
            if _CRC_USERS == 0:
                try:
                    save_config.compute_crc32 = _CRC_BEFORE
                except BaseException:
                    save_config.compute_crc32 = _CRC_BEFORE
                    raise


def record_settings() -> tuple[Any, ...] | None:
    """The ``torch.save`` settings a record's framing depends on; None when it depends on the data.

    With the zip CRC on, every record's header holds a checksum of its data,
    so no framing can be reused. Read once per file written, not per tensor.
    """
    save_config = _save_config()
    if save_config is None or save_config.compute_crc32:
        return None
    return (getattr(save_config, "storage_alignment", None),)


def _torch_save_bytes(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


_MEMORY = ctypes.c_char * 2**48
"""One ctypes array type over any memory, cut to a tensor's length by slicing its view
(an array type per length would be a type kept forever for every size ever saved)."""


def _data_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (a contiguous CPU tensor that owns its whole storage).

    One flat run of unsigned bytes, cut from a ctypes array over the tensor's
    memory that holds the tensor, so that the view, and any buffer cut from
    it, keeps the tensor alive: under half the time of ``Tensor.numpy``'s view
    (the benchmark's 192 tensors, alternately in one run: 2.0 against 4.9 us
    each), for any dtype.
    """
    nbytes = tensor.nbytes
    if nbytes == 0:
        return memoryview(b"").cast("B")
    array = _MEMORY.from_address(tensor.data_ptr())
    array._tensor = tensor  # type: ignore[attr-defined]
    return memoryview(array)[:nbytes].cast("B")


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
        self._parts: dict[tuple[Any, ...], tuple[memoryview, memoryview]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._parts)

    def record(self, tensor: torch.Tensor, settings: tuple[Any, ...] | None) -> list[Any]:
        """The buffers whose concatenation is ``torch.save(tensor)``'s output, in order.

        Every one a flat view of unsigned bytes (the framing's made once per
        layout), which ``HashedFile.add`` queues without a view of its own.

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
        or tensor.__dict__  # Python attributes, which torch.save pickles with the tensor
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


def _cut_framing(tensor: torch.Tensor) -> tuple[memoryview, memoryview] | None:
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
    return memoryview(b"".join(capture.before)), memoryview(b"".join(capture.after))
