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
import hashlib
import json
import math
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from stalwart.errors import CheckpointCorruptError, UnsupportedFormatError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FileEntry",
    "Manifest",
    "canonical_json",
    "git_info",
    "hash_file",
    "stable_hash",
    "to_json_data",
]

FORMAT_NAME = "stalwart-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
_SELF_CHECKSUM_KEY = "manifest_xxh3_128"
_HASH_CHUNK = 8 * 1024 * 1024


def hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Return ``(size, xxh3-128 hex)`` of a file, read in 8 MiB chunks."""
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_HASH_CHUNK)
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

    def walk(value: Any, where: str) -> Any:
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float):
            return value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return walk(dataclasses.asdict(value), where)
        if isinstance(value, Mapping):
            out: dict[str, Any] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"{what}{where} has a key of type {type(key).__name__} ({key!r}); "
                        "keys must be strings so the manifest stays plain JSON"
                    )
                out[key] = walk(item, f"{where}[{key!r}]")
            return out
        if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
            return [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if hasattr(value, "__dict__") and type(value).__name__ == "Namespace":
            return walk(vars(value), where)
        # numpy and torch scalars
        if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
            return walk(value.item(), where)
        raise TypeError(
            f"{what}{where} is a {type(value).__name__}, which JSON cannot hold; "
            "pass str, int, float, bool, None, lists and dicts of them (or a dataclass)"
        )

    return walk(obj, "")


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

        Raises ``CheckpointCorruptError`` for anything unreadable or inconsistent and
        ``UnsupportedFormatError`` for a newer format version.
        """
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{source}: not valid JSON ({exc})", path=source) from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(
                f'{source}: not a stalwart manifest (missing "format": {FORMAT_NAME!r})',
                path=source,
            )
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise CheckpointCorruptError(f"{source}: format_version is {version!r}", path=source)
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{source} has format version {version}, but this stalwart reads up to "
                f"version {FORMAT_VERSION}; upgrade stalwart to read it"
            )
        claimed = data.pop(_SELF_CHECKSUM_KEY, None)
        actual = xxhash.xxh3_128_hexdigest(canonical_json(data).encode())
        if claimed != actual:
            raise CheckpointCorruptError(
                f"{source}: manifest checksum mismatch (recorded {claimed}, computed {actual}); "
                "the manifest was modified or damaged",
                path=source,
            )
        try:
            files = [
                FileEntry(path=str(f["path"]), size=int(f["size"]), xxh3_128=str(f["xxh3_128"]))
                for f in data["files"]
            ]
            for f in files:
                p = Path(f.path)
                if p.is_absolute() or ".." in p.parts or f.size < 0:
                    raise ValueError(f"bad file entry {f.path!r}")
            manifest = cls(
                step=_as_int(data["step"]),
                files=files,
                world_size=_as_int(data["world_size"]),
                epoch=None if data.get("epoch") is None else _as_int(data["epoch"]),
                created_unix=float(data["created_unix"]),
                metadata=dict(data.get("metadata") or {}),
                config=data.get("config"),
                config_hash=data.get("config_hash"),
                code=data.get("code"),
                versions=dict(data.get("versions") or {}),
                hostname=str(data.get("hostname", "")),
                metrics=dict(data.get("metrics") or {}),
                topology=dict(data.get("topology") or {}),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(
                f"{source}: malformed manifest ({exc})", path=source
            ) from exc
        if math.isnan(manifest.created_unix):
            raise CheckpointCorruptError(f"{source}: created_unix is NaN", path=source)
        return manifest


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value
