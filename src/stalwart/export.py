"""Read a DCP checkpoint tensor by tensor, and write it out as one safetensors or torch file.

A checkpoint written by any number of ranks (DDP, FSDP2 shards, any world
size) is read back as whole, unsharded tensors, a batch of at most
``batch_bytes`` at a time, through ``stalwart.safe_load`` (restricted
unpickler for ``.metadata`` and for every non-tensor value), so neither reading
nor exporting can run code from the checkpoint, and memory stays bounded by the
batch (or by the largest single tensor).

The safetensors file is written directly, without the ``safetensors`` package:
its format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian
header length N, N bytes of JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with spaces
to a multiple of 8, then the raw little-endian bytes of every tensor, packed in
the order of their offsets. The header depends only on dtypes and shapes, which
DCP's metadata has, so it is written first and tensors are streamed after it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import struct
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from stalwart.errors import CheckpointCorruptError, StalwartError
from stalwart.layout import DCP_METADATA_NAME
from stalwart.pipeline import verify_checkpoint
from stalwart.safe_load import read_dcp_metadata, safe_load
from stalwart.storage.local import fsync_dir

__all__ = [
    "SAFETENSORS_DTYPES",
    "Format",
    "Only",
    "TensorEntry",
    "check_sizes",
    "export_checkpoint",
    "iter_tensors",
    "iter_values",
    "safetensors_header",
    "select_tensors",
    "stored_bytes",
]

Only = Literal["model", "all"]
Format = Literal["safetensors", "torch"]

DEFAULT_BATCH_BYTES = 256 * 1024 * 1024

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
"""torch dtypes and their safetensors names; anything else cannot be exported as safetensors."""

_MODEL_PREFIX = "model."


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One whole tensor of a checkpoint, as the metadata describes it."""

    fqn: str
    """Key in the checkpoint (``model.0.weight``, ``optimizer.state.0.weight.exp_avg``)."""
    name: str
    """Key in the export (``0.weight`` for model tensors exported with ``only="model"``)."""
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def select_tensors(metadata: Metadata, only: Only) -> tuple[list[TensorEntry], list[str]]:
    """``(tensors, skipped)``: the tensors ``only`` picks, sorted by name, and the other keys.

    ``only="model"`` picks the ``model.`` tensors and drops that prefix, so the
    names are those of ``model.state_dict()`` (DDP's ``module.`` prefix is
    already gone: ``TrainState`` saves through ``get_state_dict``). ``"all"``
    picks every tensor under its full key. Non-tensor values (optimizer
    hyperparameters, RNG states, user values) are never exported; they are in
    ``skipped`` with the tensors ``only`` left out.
    """
    if only not in ("model", "all"):
        raise ValueError(f"only must be 'model' or 'all', got {only!r}")
    tensors: list[TensorEntry] = []
    skipped: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or (
            only == "model" and not fqn.startswith(_MODEL_PREFIX)
        ):
            skipped.append(fqn)
            continue
        name = fqn.removeprefix(_MODEL_PREFIX) if only == "model" else fqn
        tensors.append(
            TensorEntry(fqn=fqn, name=name, dtype=md.properties.dtype, shape=tuple(md.size))
        )
    tensors.sort(key=lambda t: t.name)
    skipped.sort()
    return tensors, skipped


def _batches(entries: Sequence[TensorEntry], batch_bytes: int) -> Iterator[list[TensorEntry]]:
    batch: list[TensorEntry] = []
    size = 0
    for entry in entries:
        if batch and size + entry.nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.nbytes
    if batch:
        yield batch


def iter_tensors(
    checkpoint: Path,
    entries: Sequence[TensorEntry],
    *,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
    """Yield ``(entry, whole tensor)`` in the order of ``entries``, loaded a batch at a time.

    Each batch is one ``safe_load`` into freshly allocated CPU tensors, whatever
    the world size that wrote the checkpoint (DCP assembles shards). Shapes come
    from ``.metadata``, input from outside: ``check_sizes`` runs before anything
    is allocated. A tensor
    is only valid until the iterator advances past its batch; nothing is
    checksummed here (call ``verify_checkpoint`` first). Single process, no
    process group.
    """
    check_sizes(checkpoint, entries)
    for batch in _batches(entries, batch_bytes):
        target: dict[str, Any] = {e.fqn: torch.empty(e.shape, dtype=e.dtype) for e in batch}
        safe_load(target, checkpoint)
        for entry in batch:
            yield entry, target[entry.fqn]
        del target


def stored_bytes(checkpoint: Path) -> int:
    """Bytes of the regular files in ``checkpoint`` (``lstat`` only, nothing opened)."""
    total = 0
    with os.scandir(checkpoint) as it:
        for entry in it:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def check_sizes(
    checkpoint: Path, entries: Sequence[TensorEntry], *, together: bool = False
) -> None:
    """Raise ``CheckpointCorruptError`` unless every tensor of ``entries`` (``together``: all of
    them at once) could be held in the files of ``checkpoint``.

    DCP stores tensor bytes uncompressed, so a shape that needs more bytes than the
    checkpoint's files hold comes from damaged or crafted metadata; allocating it
    would exhaust memory instead of failing with a message.
    """
    available = stored_bytes(checkpoint)
    for e in entries:
        if any(not isinstance(d, int) or d < 0 for d in e.shape):
            raise CheckpointCorruptError(
                f"{checkpoint / DCP_METADATA_NAME}: tensor {e.fqn!r} has shape "
                f"{_shape(e.shape)}; the metadata is damaged or crafted",
                path=DCP_METADATA_NAME,
            )
        if e.nbytes > available:
            raise CheckpointCorruptError(
                f"{checkpoint / DCP_METADATA_NAME}: tensor {e.fqn!r} has shape {_shape(e.shape)}, "
                f"{e.nbytes} bytes, more than all files of the checkpoint hold ({available} "
                "bytes); the metadata is damaged or crafted",
                path=DCP_METADATA_NAME,
            )
    needed = sum(e.nbytes for e in entries)
    if together and needed > available:
        raise CheckpointCorruptError(
            f"{checkpoint / DCP_METADATA_NAME}: its tensors need {needed} bytes together, "
            f"more than all files of the checkpoint hold ({available} bytes); the metadata is "
            "damaged or crafted",
            path=DCP_METADATA_NAME,
        )


def _shape(shape: tuple[Any, ...]) -> str:
    text = repr(list(shape))
    return text if len(text) <= 80 else text[:77] + "..."


def iter_values(checkpoint: Path, fqns: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """Yield ``(key, value)`` for non-tensor entries, read with ``torch.load(weights_only=True)``."""
    if not fqns:
        return
    target: dict[str, Any] = dict.fromkeys(fqns)
    safe_load(target, checkpoint)
    yield from ((fqn, target[fqn]) for fqn in fqns)


def safetensors_header(
    entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None
) -> bytes:
    """The header bytes (length prefix included) of a safetensors file holding ``entries``, in order.

    Raises ``ValueError`` for a dtype safetensors has no name for, or a
    duplicate name.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for e in entries:
        dtype = SAFETENSORS_DTYPES.get(e.dtype)
        if dtype is None:
            raise ValueError(
                f"tensor {e.fqn!r} has dtype {e.dtype}, which safetensors cannot hold; "
                "export with --format torch"
            )
        if e.name in header:
            raise ValueError(f"two tensors would be exported as {e.name!r}")
        header[e.name] = {
            "dtype": dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    # The tensor was allocated by iter_tensors (contiguous, CPU, offset 0), so its
    # bytes are one run of memory: hand that to write() without another copy.
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return
    buffer = (ctypes.c_ubyte * n).from_address(tensor.data_ptr())
    f.write(memoryview(buffer).cast("B"))


def export_checkpoint(
    checkpoint: Path,
    dest: Path,
    *,
    fmt: Format = "safetensors",
    only: Only = "model",
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    advance: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Verify ``checkpoint`` against its manifest, then write its tensors to ``dest`` as one file.

    ``fmt="safetensors"`` streams tensor by tensor (memory: one batch);
    ``fmt="torch"`` writes ``torch.save`` of a flat ``{name: tensor}`` dict,
    which needs every exported tensor in memory at once. The file appears at
    ``dest`` only when complete (written beside it, fsynced, renamed); an
    existing ``dest`` is replaced. ``advance(n)`` is called with the bytes of
    each tensor written. Returns the report of ``stalwart export --json``.

    Raises ``CheckpointCorruptError`` when a file fails verification,
    ``CheckpointNotFoundError`` for an uncommitted checkpoint, ``ValueError``
    for a tensor safetensors cannot hold.
    """
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"fmt must be 'safetensors' or 'torch', got {fmt!r}")
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raise StalwartError(
            "exporting needs a little-endian machine (safetensors is little-endian)"
        )
    manifest = verify_checkpoint(checkpoint)
    metadata = read_dcp_metadata(checkpoint)
    entries, skipped = select_tensors(metadata, only)
    file_meta = {"format": "pt", "stalwart_step": str(manifest.step), "stalwart_only": only}
    header = safetensors_header(entries, file_meta) if fmt == "safetensors" else b""
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "xb") as f:
            if fmt == "safetensors":
                f.write(header)
                for entry, tensor in iter_tensors(checkpoint, entries, batch_bytes=batch_bytes):
                    _write_tensor(f, tensor)
                    if advance is not None:
                        advance(entry.nbytes)
            else:
                # torch.save needs every tensor in memory at once.
                check_sizes(checkpoint, entries, together=True)
                flat: dict[str, torch.Tensor] = {}
                for entry, tensor in iter_tensors(checkpoint, entries, batch_bytes=batch_bytes):
                    flat[entry.name] = tensor
                    if advance is not None:
                        advance(entry.nbytes)
                torch.save(flat, f)
                del flat
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    fsync_dir(dest.parent)
    return {
        "source": str(checkpoint),
        "step": manifest.step,
        "path": str(dest),
        "format": fmt,
        "only": only,
        "bytes": dest.stat().st_size,
        "tensor_bytes": sum(e.nbytes for e in entries),
        "tensors": [
            {
                "name": e.name,
                "fqn": e.fqn,
                "dtype": str(e.dtype).removeprefix("torch."),
                "shape": list(e.shape),
                "nbytes": e.nbytes,
            }
            for e in entries
        ],
        "skipped": skipped,
    }
