"""stage -> write -> checksum -> commit, and the verified load that mirrors it.

The commit protocol lives in ``commit_checkpoint`` and nowhere else. Saving
runs either in the caller's thread (sync) or, after a staging copy of the
state, in one background thread (async); both run the same ``write_and_commit``.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    StalwartError,
)
from stalwart.manifest import MANIFEST_NAME, FileEntry, Manifest, hash_file
from stalwart.safe_load import read_dcp_metadata, safe_load
from stalwart.state import TrainState
from stalwart.storage.base import CheckpointStorage

__all__ = [
    "AsyncSaver",
    "SaveResult",
    "commit_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "stage_state_dict",
    "verify_checkpoint",
    "write_and_commit",
]

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@dataclasses.dataclass(slots=True, kw_only=True)
class SaveResult:
    """What one committed save did and how long each phase took (seconds)."""

    step: int
    path: Path
    bytes: int
    files: int
    write_s: float
    checksum_s: float
    commit_s: float

    def timings(self) -> dict[str, float]:
        return {
            "write_s": round(self.write_s, 6),
            "checksum_s": round(self.checksum_s, 6),
            "commit_s": round(self.commit_s, 6),
        }


# --------------------------------------------------------------------------- save


def stage_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A private CPU copy of ``state_dict`` that training may not touch while it is written.

    Tensors are copied to CPU (through pinned memory and a non-blocking copy on
    CUDA, then one synchronize); plain values are deep-copied.
    """
    cuda_copies = False

    def copy_value(value: Any) -> Any:
        nonlocal cuda_copies
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.device.type == "cuda":
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out.copy_(t, non_blocking=True)
                cuda_copies = True
                return out
            return t.to("cpu", copy=True)
        if isinstance(value, Mapping):
            return {k: copy_value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy_value(v) for v in value]
        if isinstance(value, tuple):
            return tuple(copy_value(v) for v in value)
        return copy.deepcopy(value)

    staged = copy_value(state_dict)
    if cuda_copies:
        torch.cuda.synchronize()
    assert isinstance(staged, dict)
    return staged


def _checksum_files(directory: Path) -> list[FileEntry]:
    """Hash and fsync every file under ``directory`` (DCP fsyncs too; this proves it on our side)."""
    entries = []
    for root, _dirs, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            size, digest = hash_file(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            entries.append(
                FileEntry(path=path.relative_to(directory).as_posix(), size=size, xxh3_128=digest)
            )
    entries.sort(key=lambda e: e.path)
    return entries


def commit_checkpoint(storage: CheckpointStorage, staging: Path, manifest: Manifest) -> Path:
    """THE COMMIT PROTOCOL. A checkpoint exists only once this returns.

    1. Every rank has written its files into ``staging`` and fsynced them
       (``write_and_commit`` before calling this).
    2. Sizes and checksums of all files are in ``manifest.files``; in a
       distributed save every rank reported them and passed the barrier.
    3. The committing rank writes MANIFEST.json into ``staging`` (fsynced), then
       the storage publishes it: rename into place and fsync of the parent on a
       POSIX filesystem, the manifest object written last on an object store.
    4. A checkpoint without a valid manifest does not exist: readers ignore it,
       and ``stalwart gc`` sweeps it.
    """
    assert manifest.files, "a checkpoint without files cannot be committed"
    return storage.commit(staging, manifest.step, manifest.to_json())


def write_and_commit(
    storage: CheckpointStorage,
    state_dict: dict[str, Any],
    manifest: Manifest,
    *,
    before_commit: Callable[[Path], None] | None = None,
) -> SaveResult:
    """Write ``state_dict`` with DCP into a fresh staging directory and commit it.

    On any failure the staging directory is removed and ``CheckpointSaveError``
    raised with the cause chained; earlier checkpoints are never touched.
    ``before_commit`` runs between checksumming and commit (tests use it to
    crash there).
    """
    staging: Path | None = None
    try:
        staging = storage.begin(manifest.step)
        t0 = time.perf_counter()
        writer = FileSystemWriter(staging, single_file_per_rank=True, sync_files=True)
        try:
            with warnings.catch_warnings():
                # DCP warns that it runs without a process group; here that is the intent.
                warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
                dcp_save(state_dict, storage_writer=writer, no_dist=True)
        except CheckpointException as exc:
            raise CheckpointSaveError(
                f"writing step {manifest.step} failed: {_first_failure(exc)}"
            ) from exc
        t1 = time.perf_counter()
        manifest.files = _checksum_files(staging)
        t2 = time.perf_counter()
        if before_commit is not None:
            before_commit(staging)
        final = commit_checkpoint(storage, staging, manifest)
        staging = None
        t3 = time.perf_counter()
    except CheckpointSaveError:
        if staging is not None:
            storage.abort(staging)
        raise
    except (OSError, StalwartError, ValueError, TypeError, RuntimeError) as exc:
        if staging is not None:
            storage.abort(staging)
        raise CheckpointSaveError(f"saving step {manifest.step} failed: {exc}") from exc
    return SaveResult(
        step=manifest.step,
        path=final,
        bytes=manifest.total_bytes,
        files=len(manifest.files),
        write_s=t1 - t0,
        checksum_s=t2 - t1,
        commit_s=t3 - t2,
    )


def _first_failure(exc: CheckpointException) -> str:
    for rank, (inner, _trace) in sorted(exc.failures.items()):
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return str(exc)


class AsyncSaver:
    """One background thread that writes and commits staged checkpoints, one at a time.

    ``submit`` is called from the training thread after staging; it first waits
    for the previous save, so at most one save is in flight and at most one
    staged copy exists. A background failure is kept and raised, chained, by the
    next ``submit``, ``wait`` or ``close`` (it never disappears).
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="stalwart-save"
        )
        self._pending: concurrent.futures.Future[Any] | None = None

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def submit(self, job: Callable[[], Any]) -> None:
        self.wait()
        self._pending = self._pool.submit(job)

    def wait(self) -> Any:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except CheckpointSaveError:
            raise
        except Exception as exc:
            raise CheckpointSaveError(
                f"background save failed: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


# --------------------------------------------------------------------------- load


def read_manifest(path: Path) -> Manifest:
    """Read and validate ``<path>/MANIFEST.json``."""
    manifest_path = path / MANIFEST_NAME
    try:
        text = manifest_path.read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{path} is not a committed checkpoint (no {MANIFEST_NAME})"
        ) from exc
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{manifest_path}: cannot read ({exc})", path=str(manifest_path)
        ) from exc
    return Manifest.from_json(text, source=str(manifest_path))


def verify_checkpoint(path: Path, *, checksums: bool = True) -> Manifest:
    """Check every file against the manifest (size, then xxh3-128) before anything is deserialized.

    Raises ``CheckpointCorruptError`` naming the first bad file.
    """
    manifest = read_manifest(path)
    for entry in manifest.files:
        file = path / entry.path
        try:
            size = file.stat().st_size
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"{file}: missing (listed in the manifest)", path=str(file)
            ) from exc
        except OSError as exc:
            raise CheckpointCorruptError(f"{file}: cannot read ({exc})", path=str(file)) from exc
        if size != entry.size:
            raise CheckpointCorruptError(
                f"{file}: size {size} bytes, manifest says {entry.size} (truncated or overwritten)",
                path=str(file),
            )
    if checksums:
        for entry in manifest.files:
            file = path / entry.path
            try:
                _size, digest = hash_file(file)
            except OSError as exc:
                raise CheckpointCorruptError(
                    f"{file}: cannot read ({exc})", path=str(file)
                ) from exc
            if digest != entry.xxh3_128:
                raise CheckpointCorruptError(
                    f"{file}: checksum mismatch (xxh3-128 {digest}, manifest says {entry.xxh3_128}); "
                    "the file is damaged",
                    path=str(file),
                )
    return manifest


def load_checkpoint(path: Path, state: TrainState, *, strict: bool = True) -> Manifest:
    """Verify, then load the checkpoint at ``path`` into ``state`` without running checkpoint code."""
    manifest = verify_checkpoint(path)
    metadata = read_dcp_metadata(path)
    target = state.load_target(metadata, strict=strict)
    safe_load(target, path)
    state.load_state_dict(target, strict=strict)
    return manifest
