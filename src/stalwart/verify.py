"""Reading a checkpoint's manifest and checking its files against it, before any byte is deserialized.

``read_manifest`` reads MANIFEST.json (bounded, without following links) and
checks it belongs to its directory; ``file_problems`` is the one place the file
checks (size, then xxh3-128) live; ``verify_checkpoint`` is restore's gate.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from stalwart.errors import CheckpointCorruptError, CheckpointNotFoundError
from stalwart.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    hash_file,
    open_checkpoint_file,
)
from stalwart.storage.local import step_of_dir_name

__all__ = [
    "VERIFY_THREADS",
    "FileProblem",
    "checksum_problem",
    "file_problems",
    "read_manifest",
    "size_problem",
    "verify_checkpoint",
]

VERIFY_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Files of one checkpoint read and hashed at the same time when verifying."""


def read_manifest(path: Path) -> Manifest:
    """Read and validate ``<path>/MANIFEST.json``, and check it belongs to ``path``.

    The manifest is read without following a link and only if it is a regular
    file of at most ``MAX_MANIFEST_BYTES``. In a directory named like a step
    (``step_000000200``) the manifest must record that step: an older step
    renamed or copied to a newer name is corrupt, not restored as the newer one.
    Raises ``CheckpointNotFoundError`` without a manifest, ``CheckpointCorruptError``
    (transient for an I/O error) or ``UnsupportedFormatError``.
    """
    manifest_path = path / MANIFEST_NAME
    where = str(manifest_path)
    try:
        with open_checkpoint_file(path, MANIFEST_NAME) as stream:
            # One byte past the limit is enough to know it is too large.
            text = stream.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{path} is not a committed checkpoint (no {MANIFEST_NAME})"
        ) from exc
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{manifest_path}: cannot read ({exc.strerror or exc})", path=where, transient=True
        ) from exc
    manifest = Manifest.from_json(text, source=where)
    named = step_of_dir_name(path.name)
    if named is not None and named != manifest.step:
        raise CheckpointCorruptError(
            f"{manifest_path}: says step {manifest.step}, but the directory is "
            f"{path.name} (step {named}); a checkpoint renamed or copied to another "
            "step's name is not that step",
            path=where,
        )
    return manifest


@dataclasses.dataclass(frozen=True, slots=True)
class FileProblem:
    """One file of a checkpoint that does not match its manifest."""

    file: str
    """Path relative to the checkpoint directory."""
    reason: str
    transient: bool = False
    """True when the file could not be read (an I/O error that may pass)."""
    cause: OSError | None = None
    """The I/O error behind a transient problem."""

    def error(self, checkpoint: Path) -> CheckpointCorruptError:
        """The problem as an exception, its ``cause`` chained."""
        where = checkpoint / self.file
        error = CheckpointCorruptError(
            f"{where}: {self.reason}", path=str(where), transient=self.transient
        )
        error.__cause__ = self.cause
        return error


def size_problem(entry: FileEntry, size: int) -> FileProblem | None:
    """The problem of a file of ``size`` bytes listed as ``entry``, or None when it fits."""
    if size == entry.size:
        return None
    return FileProblem(
        entry.path, f"size {size} bytes, manifest says {entry.size} (truncated or overwritten)"
    )


def checksum_problem(entry: FileEntry, digest: str) -> FileProblem | None:
    """The problem of a file whose xxh3-128 is ``digest``, or None when it is the manifest's."""
    if digest == entry.xxh3_128:
        return None
    return FileProblem(
        entry.path,
        f"checksum mismatch (xxh3-128 {digest}, manifest says {entry.xxh3_128}); "
        "the file is damaged",
    )


def file_problems(
    path: Path,
    manifest: Manifest,
    *,
    checksums: bool = True,
    part: tuple[int, int] = (0, 1),
    first_only: bool = False,
    advance: Callable[[int], None] | None = None,
) -> list[FileProblem]:
    """Every file of ``manifest`` against the disk: sizes of all, then xxh3-128 checksums.

    The one place the file checks live: restore stops at the first problem
    (``first_only``), ``stalwart verify`` and ``ls --verify`` report them all.
    ``part=(rank, world_size)`` checksums only every world_size-th file, so that
    ranks share the reading. ``advance(n)`` is told the bytes of each file hashed.
    """
    problems: list[FileProblem] = []
    sized: set[str] = set()
    for entry in manifest.files:
        try:
            # Opened, not stat()ed: stat would follow a link out of the checkpoint.
            with open_checkpoint_file(path, entry.path) as stream:
                size = stream.size
        except FileNotFoundError:
            problems.append(FileProblem(entry.path, "missing (listed in the manifest)"))
        except CheckpointCorruptError as exc:
            problems.append(FileProblem(entry.path, str(exc).removeprefix(f"{exc.path}: ")))
        except OSError as exc:
            problems.append(
                FileProblem(entry.path, f"cannot read ({exc.strerror or exc})", True, exc)
            )
        else:
            problem = size_problem(entry, size)
            if problem is None:
                sized.add(entry.path)
                continue
            problems.append(problem)
        if first_only:
            return problems
    if not checksums:
        return problems
    rank, world = part
    mine = [entry for entry in manifest.files[rank::world] if entry.path in sized]

    def check(entry: FileEntry) -> FileProblem | None:
        try:
            _size, digest = hash_file(entry.path, within=path)
        except CheckpointCorruptError as exc:
            return FileProblem(entry.path, str(exc).removeprefix(f"{exc.path}: "))
        except OSError as exc:
            return FileProblem(entry.path, f"cannot read ({exc.strerror or exc})", True, exc)
        finally:
            if advance is not None:
                advance(entry.size)
        return checksum_problem(entry, digest)

    # Files are read and hashed side by side (xxh3 and file reads release the GIL),
    # so a checkpoint of several files verifies at the disk's speed, not one file's.
    workers = min(len(mine), VERIFY_THREADS)
    pool = (
        concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="stalwart-verify")
        if workers > 1
        else None
    )
    try:
        for problem in pool.map(check, mine) if pool is not None else map(check, mine):
            if problem is not None:
                problems.append(problem)
                if first_only:
                    break
    finally:
        if pool is not None:
            # After the first problem, files not yet started are not read at all.
            pool.shutdown(wait=True, cancel_futures=True)
    return problems


def verify_checkpoint(
    path: Path, *, checksums: bool = True, part: tuple[int, int] = (0, 1)
) -> Manifest:
    """Check every file against the manifest (size, then xxh3-128) before anything is deserialized.

    Raises ``CheckpointCorruptError`` naming the first bad file.
    """
    manifest = read_manifest(path)
    problems = file_problems(path, manifest, checksums=checksums, part=part, first_only=True)
    if problems:
        raise problems[0].error(path)
    return manifest
