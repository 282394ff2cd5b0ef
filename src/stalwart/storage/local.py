"""Checkpoints in a directory of a POSIX filesystem.

Layout of a run directory::

    step_000000200/                  committed: holds MANIFEST.json
    .step_000000400.tmp-<hex>/       being written, or abandoned by a crash
    .step_000000100.del-<hex>/       being deleted by retention

Publishing is ``rename(2)`` of the staging directory to its final name followed
by an fsync of the run directory: rename is atomic, so a reader sees either no
``step_…`` directory or a complete one, and the fsync makes the new name survive
a power loss.

A run directory is input from outside, so nothing here follows a symbolic link
when it writes or deletes: ``scan`` lists only real directories (a ``step_…``
that is a link, file, FIFO or device is not a checkpoint and is never listed,
so retention and gc never touch it), ``delete`` removes at most a link itself,
never what it points to, and ``shutil.rmtree`` never descends into links (its
fd-based walk refuses a link at the top and unlinks links inside).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from stalwart.errors import CheckpointSaveError
from stalwart.layout import (
    MANIFEST_NAME,
    hidden_name,
    parse_checkpoint_name,
    step_dir_name,
    step_of_dir_name,
)
from stalwart.storage.base import StepEntry, StepStatus

__all__ = ["LocalStorage", "fsync_dir", "fsync_file", "step_dir_name", "step_of_dir_name"]

logger = logging.getLogger("stalwart")


def fsync_dir(path: Path) -> None:
    """fsync a directory so that entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A run directory on a local or network POSIX filesystem. See the module docstring."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def step_path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def path_of(self, name: str) -> Path:
        return self.root / name

    def begin(self, step: int) -> Path:
        staging = self.root / hidden_name(step, "tmp")
        staging.mkdir(parents=False, exist_ok=False)
        return staging

    def commit(self, staging: Path, step: int, manifest_json: str) -> Path:
        final = self.step_path(step)
        manifest_tmp = staging / (MANIFEST_NAME + ".tmp")
        with open(manifest_tmp, "w", encoding="utf-8") as f:
            f.write(manifest_json)
            f.flush()
            os.fsync(f.fileno())
        os.replace(manifest_tmp, staging / MANIFEST_NAME)
        fsync_dir(staging)
        if os.path.lexists(final):
            raise CheckpointSaveError(
                f"{final} already exists; a committed checkpoint is never overwritten "
                f"(delete it first, or save under another step)"
            )
        try:
            os.rename(staging, final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise CheckpointSaveError(
                    f"{final} appeared while committing; another writer is using {self.root}"
                ) from exc
            raise
        try:
            fsync_dir(self.root)
        except OSError as exc:
            # The rename happened: the checkpoint exists and its files are durable.
            # Only the new name may not survive a power loss, in which case the
            # checkpoint simply does not exist; reporting failure here would be wrong.
            logger.warning("fsync of %s after committing %s failed: %s", self.root, final.name, exc)
        return final

    def abort(self, staging: Path) -> None:
        _remove(staging)

    def scan(self) -> list[StepEntry]:
        """Every checkpoint-named real directory of the run (committed, staging, moved aside).

        Entries that are symbolic links, files, FIFOs or devices are skipped (only
        ``lstat``, nothing is opened): stalwart never made them.
        """
        entries = [
            StepEntry(name=name, path=self.root / name, step=step, status=status)
            for name, step, status in self._entries()
        ]
        entries.sort(key=lambda e: (e.step if e.step is not None else -1, e.name))
        return entries

    def committed_steps(self) -> list[int]:
        return sorted(step for _, step, status in self._entries() if status == "committed")

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` is committed, looked up directly (the run may hold many steps).

        The same test as ``scan``'s: a real directory of that name holding a manifest.
        """
        path = self.step_path(step)
        return _is_real_dir(path) and _holds_manifest(os.fspath(path))

    def newest_committed(self) -> int | None:
        """The newest committed step (None: none), without a stat of every older one."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return None
        steps = (step_of_dir_name(name) for name in names)
        for step in sorted((s for s in steps if s is not None), reverse=True):
            if self.is_committed(step):
                return step
        return None

    def _entries(self) -> Iterator[tuple[str, int, StepStatus]]:
        # One pass of scandir, whose entries know their type without a stat on
        # most filesystems: a save lists the run, which may hold a thousand kept
        # steps; only a committed name costs a stat (of its manifest).
        root = os.fspath(self.root)
        try:
            listing = os.scandir(root)
        except FileNotFoundError:
            return
        with listing:
            for entry in listing:
                name = entry.name
                parsed = parse_checkpoint_name(name)
                if parsed is None:
                    continue
                try:
                    real_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    real_dir = False
                if not real_dir:
                    logger.debug(
                        "%s is not a real directory (a link?): not a checkpoint",
                        os.path.join(root, name),
                    )
                    continue
                status: StepStatus
                if parsed.kind == "step":
                    # A step directory without a manifest cannot come from our rename
                    # protocol (the manifest is in place before the rename); it was
                    # copied or damaged by hand, and does not count as committed.
                    committed = _holds_manifest(os.path.join(root, name))
                    status = "committed" if committed else "incomplete"
                else:
                    status = "corrupt" if parsed.kind == "corrupt" else "incomplete"
                yield name, parsed.step, status

    def quarantine(self, step: int) -> Path:
        """Move a committed step that failed verification out of the way, keeping it for inspection."""
        path = self.step_path(step)
        aside = self.root / hidden_name(step, "corrupt")
        os.rename(path, aside)
        fsync_dir(self.root)
        return aside

    def delete(self, step: int) -> None:
        path = self.step_path(step)
        # Rename first: the checkpoint stops existing atomically, so a crash in the
        # middle of rmtree leaves a hidden directory for gc, never a committed
        # step with missing files.
        doomed = self.root / hidden_name(step, "del")
        os.rename(path, doomed)
        fsync_dir(self.root)
        _remove(doomed)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _holds_manifest(directory: str) -> bool:
    """Whether ``directory`` holds a manifest, a regular file (a link to one counts, as
    for ``Path.is_file``): what makes a step directory committed. Raises what
    ``Path.is_file`` raises (a permission error), not only False."""
    try:
        return stat.S_ISREG(os.stat(os.path.join(directory, MANIFEST_NAME)).st_mode)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
            return False
        raise


def _remove(path: Path) -> None:
    """Remove ``path``, best effort: a directory tree without following any link in it
    (rmtree's fd-based walk), or just the entry itself when it is a link or a file."""
    if _is_real_dir(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        os.unlink(path)
    except OSError:
        pass
