"""MANIFEST.json: the commit marker and table of contents of one checkpoint.

Plain data only (no torch, no torch.distributed). The manifest lists every file
of the checkpoint with its size and xxh3-128 checksum, so a reader can prove a
checkpoint intact before deserializing a single byte. It also carries a
checksum of its own body, so a flipped bit inside the manifest itself is caught
rather than trusted.

Schema (format version 1)::

    {
      "format": "stalwart-checkpoint",
      "format_version": 1,
      "step": 200, "epoch": 3,                       # epoch is null when unknown
      "created": "2026-11-29T14:25:33.123456+00:00", "created_unix": 1795...,
      "world_size": 1,
      "files": [{"path": "__0_0.distcp", "size": 123, "xxh3_128": "hex"}, ...],
      "metadata": {...}, "config": {...}, "config_hash": "sha256 hex" | null,
      "code": {"git_commit": "...", "git_dirty": false, "git_root": "..."} | null,
      "versions": {"stalwart": "...", "torch": "...", "python": "..."},
      "hostname": "...", "metrics": {...}, "topology": {...},
      "manifest_xxh3_128": "hex of the canonical JSON of everything above"
    }
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import io
import json
import math
import mmap
import os
import stat
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import xxhash

from stalwart.errors import CheckpointCorruptError, UnsupportedFormatError
from stalwart.files import not_regular
from stalwart.layout import MANIFEST_NAME

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_JSON_DEPTH",
    "MAX_MANIFEST_BYTES",
    "CheckpointFile",
    "FileEntry",
    "Manifest",
    "buffer_size",
    "canonical_json",
    "git_info",
    "hash_file",
    "open_checkpoint_file",
    "stable_hash",
    "to_json_data",
]

FORMAT_NAME = "stalwart-checkpoint"
FORMAT_VERSION = 1
_SELF_CHECKSUM_KEY = "manifest_xxh3_128"
_YEAR_10000 = 253_402_300_800  # created_unix past this has no ISO date (``created``)
_HASH_CHUNK = 8 * 1024 * 1024
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""A MANIFEST.json larger than this is corrupt (a real one is kilobytes per thousand files)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of lists and dicts a manifest may have (user config and metadata included)."""

# O_NOFOLLOW: a checkpoint file that is a link could name any file on the machine.
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = os.O_RDONLY | _NO_FOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | _NO_FOLLOW | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_no_follow(directory: str | os.PathLike[str], relative: str) -> int:
    # Every component below ``directory`` is opened relative to its parent without
    # following links, so neither the file nor a folder on its way can point out
    # of the checkpoint. A link anywhere fails with ELOOP (or ENOTDIR).
    parts = PurePosixPath(relative).parts
    parent = os.open(directory, _DIR_FLAGS & ~_NO_FOLLOW)
    try:
        for part in parts[:-1]:
            child = os.open(part, _DIR_FLAGS, dir_fd=parent)
            os.close(parent)
            parent = child
        return os.open(parts[-1], _READ_FLAGS, dir_fd=parent)
    finally:
        os.close(parent)


class CheckpointFile(io.FileIO):
    """A regular file of a checkpoint, open for reading (``open_checkpoint_file``).

    ``size`` is its size when it was opened. ``with`` closes it through
    ``io.FileIO``'s own ``__exit__``, which runs no Python code: an exception a
    signal handler raises into the thread (Ctrl-C) cannot fall between the end
    of the block and the close, as it can at a generator context manager's exit.
    """

    size: int


def open_checkpoint_file(directory: str | os.PathLike[str], relative: str) -> CheckpointFile:
    """Open ``directory/relative`` for reading, refusing anything odd; use it in ``with``.

    The file is opened without following symbolic links (in ``relative``'s
    components too) and checked with ``fstat`` to be a regular file, so a link
    out of the checkpoint, a FIFO or a device (``/dev/zero`` reads forever) is
    never read. Raises ``OSError`` with ``errno.ELOOP`` for a link, ``OSError``
    for other I/O failures and ``CheckpointCorruptError`` naming the file for
    something that is not a regular file. Any thread.
    """
    where = os.path.join(os.fspath(directory), relative)
    try:
        fd = _open_no_follow(directory, relative)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # EMLINK: the BSDs' answer
            raise OSError(
                errno.ELOOP,
                "is a symbolic link; stalwart never follows links inside a checkpoint",
                where,
            ) from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointCorruptError(
                f"{where}: not a regular file ({not_regular(info)}); a checkpoint "
                "holds only regular files",
                path=where,
            )
        os.set_blocking(fd, True)
        stream = CheckpointFile(fd, "rb")  # owns fd from here (no Python code runs in it)
    except BaseException:
        os.close(fd)
        raise
    stream.size = info.st_size
    return stream


def hash_file(
    path: str | os.PathLike[str], *, within: str | os.PathLike[str] | None = None
) -> tuple[int, str]:
    """Return ``(size, xxh3-128 hex)`` of a file, read in 8 MiB chunks.

    With ``within``, ``path`` is relative to that checkpoint directory and is read
    through ``open_checkpoint_file`` (no links, regular files only).
    """
    if within is not None:
        with open_checkpoint_file(within, os.fspath(path)) as f:
            return _hash_stream(f)
    with open(path, "rb", buffering=0) as f:
        return _hash_stream(f)


def buffer_size(size: int, chunk: int) -> int:
    """Bytes of a read buffer for a file of ``size`` bytes read ``chunk`` at a time: the
    size rounded up to a page, at most ``chunk`` (the reads go on until the end of the
    file, should it have grown). A new buffer is zero-filled, its pages faulted in:
    two of 4 MiB took 3 ms here, ten times the rest of a 200 KiB file's check (0.3 ms
    for 8 MiB when the allocator hands back memory it kept)."""
    return min(chunk, -(-max(size, 1) // mmap.PAGESIZE) * mmap.PAGESIZE)


def _hash_stream(f: io.FileIO) -> tuple[int, str]:
    h = xxhash.xxh3_128()
    size = 0
    buf = bytearray(buffer_size(os.fstat(f.fileno()).st_size, _HASH_CHUNK))
    view = memoryview(buf)
    while True:
        n = f.readinto(buf)
        if not n:
            break
        h.update(view[:n])
        size += n
    return size, h.hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: equal data gives equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def to_json_data(obj: Any, *, what: str) -> Any:
    """Convert ``obj`` into JSON data, or raise ``TypeError`` naming the first bad key.

    Accepts mappings with string keys, sequences, str, int, float, bool and None;
    dataclasses and ``argparse.Namespace``-like objects become dicts. ``what``
    names the argument in the error message.
    """
    return _to_json_data(obj, "", what)


def _to_json_data(value: Any, where: str, what: str) -> Any:
    # A function of its own, not a nested one: a recursive closure is a reference
    # cycle, left for the collector by every save.
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _to_json_data(dataclasses.asdict(value), where, what)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{what}{where} has a key of type {type(key).__name__} ({key!r}); "
                    "keys must be strings so the manifest stays plain JSON"
                )
            out[key] = _to_json_data(item, f"{where}[{key!r}]", what)
        return out
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [_to_json_data(item, f"{where}[{i}]", what) for i, item in enumerate(value)]
    if hasattr(value, "__dict__") and type(value).__name__ == "Namespace":
        return _to_json_data(vars(value), where, what)
    # numpy and torch scalars
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return _to_json_data(value.item(), where, what)
    raise TypeError(
        f"{what}{where} is a {type(value).__name__}, which JSON cannot hold; "
        "pass str, int, float, bool, None, lists and dicts of them (or a dataclass)"
    )


def stable_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj``: the same config hashes the same on any machine."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def git_info(start: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Commit and dirty flag of the git work tree holding ``start``, or None outside one."""
    try:
        cwd = Path(start).resolve()
        if cwd.is_file():
            cwd = cwd.parent

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()

        root = git("rev-parse", "--show-toplevel")
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return {"git_commit": commit, "git_dirty": dirty, "git_root": root}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint, relative to the checkpoint directory."""

    path: str
    """POSIX path relative to the checkpoint directory."""
    size: int
    """Size in bytes."""
    xxh3_128: str
    """xxh3-128 checksum, lowercase hex."""

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "xxh3_128": self.xxh3_128}


@dataclasses.dataclass(slots=True, kw_only=True)
class Manifest:
    """The content of MANIFEST.json. Build one with the keyword fields; read one with ``from_json``."""

    step: int
    """Training step the checkpoint was taken at (the value passed to ``save``)."""
    files: list[FileEntry]
    """Every file of the checkpoint except MANIFEST.json itself."""
    world_size: int = 1
    """Number of ranks that wrote the checkpoint."""
    epoch: int | None = None
    """Data epoch at save time, when the state knows it."""
    created_unix: float = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).timestamp()
    )
    """Commit time, seconds since the epoch (UTC)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """User metadata given to the manager (dataset version, ...)."""
    config: Any = None
    """User config given to the manager, as JSON data."""
    config_hash: str | None = None
    """sha256 of the canonical JSON of ``config``."""
    code: dict[str, Any] | None = None
    """git commit, dirty flag and root of the training code, when it lives in a repo."""
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    """stalwart, torch and python versions that wrote the checkpoint."""
    hostname: str = ""
    """Host of the rank that committed."""
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Metrics passed to ``save``."""
    topology: dict[str, Any] = dataclasses.field(default_factory=dict)
    """How the state was laid out across ranks (world size, parallelism)."""
    format_version: int = FORMAT_VERSION
    """Schema version; readers refuse newer versions than they know."""

    @property
    def created(self) -> str:
        return datetime.datetime.fromtimestamp(self.created_unix, datetime.timezone.utc).isoformat()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "epoch": self.epoch,
            "created": self.created,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
            "files": [f.to_dict() for f in sorted(self.files, key=lambda f: f.path)],
            "metadata": self.metadata,
            "config": self.config,
            "config_hash": self.config_hash,
            "code": self.code,
            "versions": self.versions,
            "hostname": self.hostname,
            "metrics": self.metrics,
            "topology": self.topology,
        }
        body[_SELF_CHECKSUM_KEY] = xxhash.xxh3_128_hexdigest(canonical_json(body).encode())
        return body

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, allow_nan=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate a manifest; ``source`` names the file in error messages.

        The manifest is input from outside, so it is bounded before it is
        trusted: at most ``MAX_MANIFEST_BYTES`` and ``MAX_JSON_DEPTH`` deep, its
        self-checksum checked before any field is read (``format_version``
        included, so a flipped bit there is damage, not a newer format), then
        every field's type and range. Raises ``CheckpointCorruptError`` for
        anything unreadable or inconsistent (never another exception) and
        ``UnsupportedFormatError`` for an intact manifest of a newer format version.
        """
        data = _parse_bounded_json(text, source)

        def corrupt(what: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(f"{source}: {what}", path=source)

        if not isinstance(data, dict):
            raise corrupt(f'not a stalwart manifest (missing "format": {FORMAT_NAME!r})')
        claimed = data.pop(_SELF_CHECKSUM_KEY, None)
        actual = xxhash.xxh3_128_hexdigest(canonical_json(data).encode())
        if claimed != actual:
            if data.get("format") != FORMAT_NAME:
                raise corrupt(f'not a stalwart manifest (missing "format": {FORMAT_NAME!r})')
            raise corrupt(
                f"manifest checksum mismatch (recorded {_short(claimed)}, computed {actual}); "
                "the manifest was modified or damaged"
            )
        if data.get("format") != FORMAT_NAME:
            raise corrupt(f'not a stalwart manifest (missing "format": {FORMAT_NAME!r})')
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise corrupt(f"format_version is {_short(version)}")
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{source} has format version {version}, but this stalwart reads up to "
                f"version {FORMAT_VERSION}; upgrade stalwart to read it"
            )
        try:
            manifest = cls._from_fields(data, version)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise corrupt(f"malformed manifest ({exc})") from exc
        return manifest

    @classmethod
    def _from_fields(cls, data: dict[str, Any], version: int) -> Manifest:
        """The manifest of a checksummed body; TypeError/ValueError/KeyError for a bad field."""
        files = data["files"]
        if not isinstance(files, list):
            raise TypeError(f"files is {_short(files)}, expected a list")
        entries = [_file_entry(f) for f in files]
        seen: set[str] = set()
        for entry in entries:
            if entry.path in seen:
                raise ValueError(f"file {entry.path!r} is listed twice")
            seen.add(entry.path)
        created_unix = data["created_unix"]
        if isinstance(created_unix, bool) or not isinstance(created_unix, (int, float)):
            raise TypeError(f"created_unix is {_short(created_unix)}")
        if not (math.isfinite(created_unix) and 0 <= created_unix < _YEAR_10000):
            raise ValueError(
                f"created_unix is {created_unix}, expected seconds since 1970 before year 10000"
            )
        return cls(
            step=_as_int(data["step"], "step"),
            files=entries,
            world_size=_as_int(data["world_size"], "world_size", low=1),
            epoch=None if data.get("epoch") is None else _as_int(data["epoch"], "epoch"),
            created_unix=float(created_unix),
            metadata=_dict_field(data, "metadata"),
            config=data.get("config"),
            config_hash=_optional_str(data, "config_hash"),
            code=None if data.get("code") is None else _dict_field(data, "code"),
            versions=_dict_field(data, "versions"),
            hostname=_optional_str(data, "hostname") or "",
            metrics=_dict_field(data, "metrics"),
            topology=_dict_field(data, "topology"),
            format_version=version,
        )


def _short(value: Any) -> str:
    # Values from a hostile manifest can be megabytes long; messages stay one line.
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _parse_bounded_json(text: str | bytes, source: str) -> Any:
    """JSON of at most ``MAX_MANIFEST_BYTES`` and ``MAX_JSON_DEPTH`` deep, or CheckpointCorruptError."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(
            f"{source}: {len(text)} bytes, more than any manifest "
            f"({MAX_MANIFEST_BYTES} bytes at most)",
            path=source,
        )
    try:
        data = json.loads(text)
    except RecursionError as exc:
        # json's C parser refuses very deep nesting this way; anything it does
        # parse is then checked without recursion below.
        raise CheckpointCorruptError(
            f"{source}: nested deeper than {MAX_JSON_DEPTH} levels", path=source
        ) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        # ValueError covers integers too long to convert (Python's digit limit).
        raise CheckpointCorruptError(
            f"{source}: not valid JSON ({_short(str(exc))})", path=source
        ) from exc
    _check_depth(data, source)
    return data


def _check_depth(data: Any, source: str) -> None:
    # Iterative: a recursive walk (json.dumps, canonical_json, dict()) of the
    # parsed value must never meet more nesting than this.
    pending: list[tuple[Any, int]] = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise CheckpointCorruptError(
                f"{source}: nested deeper than {MAX_JSON_DEPTH} levels", path=source
            )
        pending.extend((child, depth + 1) for child in children)


def _file_entry(raw: Any) -> FileEntry:
    if not isinstance(raw, dict):
        raise TypeError(f"file entry {_short(raw)} is not an object")
    path, size, digest = raw["path"], raw["size"], raw["xxh3_128"]
    if not isinstance(path, str) or not _is_relative_file_path(path):
        raise ValueError(
            f"bad file entry {_short(path)}: a file path must be relative, inside the "
            "checkpoint, without '..', '.', empty parts or NUL"
        )
    if not isinstance(digest, str) or len(digest) != 32 or digest.strip("0123456789abcdef"):
        raise ValueError(f"file {path!r} has checksum {_short(digest)}, expected 32 hex digits")
    return FileEntry(path=path, size=_as_int(size, f"size of {path!r}"), xxh3_128=digest)


def _is_relative_file_path(path: str) -> bool:
    parts = path.split("/")
    return (
        bool(path)
        and "\0" not in path
        and "\\" not in path
        and path != MANIFEST_NAME
        and all(part not in ("", ".", "..") for part in parts)
    )


def _dict_field(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{key} is {_short(value)}, expected an object")
    return value


def _optional_str(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{key} is {_short(value)}, expected a string")
    return value


def _as_int(value: Any, what: str, *, low: int = 0) -> int:
    # Python ints are unbounded; 2**63 keeps every value usable as a file size
    # or offset (and refuses Infinity, which JSON lets through as a float).
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} is {_short(value)}, expected an integer")
    if not low <= value < 2**63:
        raise ValueError(f"{what} is {_short(value)}, expected {low} <= value < 2**63")
    return value
