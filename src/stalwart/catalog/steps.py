"""Listing and checking the checkpoints of a run directory or of a durable tier.

Reads only; see the package docstring (``stalwart.catalog``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from stalwart.errors import CheckpointCorruptError, CheckpointNotFoundError, UnsupportedFormatError
from stalwart.layout import (
    DCP_METADATA_JSON_NAME,
    DCP_METADATA_NAME,
    EVENTS_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    parse_checkpoint_name,
    step_dir_name,
)
from stalwart.manifest import Manifest
from stalwart.metadata_json import read_metadata_json
from stalwart.pipeline import file_problems, read_manifest, verify_checkpoint
from stalwart.safe_load import read_dcp_metadata
from stalwart.storage.base import StepEntry
from stalwart.storage.durable import DurableTier, RemoteStep, data_dir_name, size_mismatches
from stalwart.storage.local import LocalStorage
from stalwart.storage.remote import RetryPolicy, is_url

__all__ = [
    "Problem",
    "StepInfo",
    "check_files",
    "check_metadata",
    "check_step",
    "dir_usage",
    "kind_of_dir",
    "list_run",
    "list_steps",
    "list_store",
    "load_manifest",
    "read_checkpoint",
    "scan_run",
    "strip_source",
    "verify_checkpoint",
]

Status = Literal["committed", "incomplete", "corrupt"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """Why one file of a checkpoint (or the whole entry, ``file=None``) is bad."""

    file: str | None
    """Path relative to the checkpoint (``MANIFEST.json``, ``__0_0.distcp``, ...); None: the entry."""
    reason: str

    def to_dict(self) -> dict[str, str | None]:
        return {"file": self.file, "reason": self.reason}

    def __str__(self) -> str:
        return self.reason if self.file is None else f"{self.file}: {self.reason}"


@dataclasses.dataclass(slots=True, kw_only=True)
class StepInfo:
    """One checkpoint of a run directory or of a durable tier, as listed.

    ``status`` starts as the listing says (a manifest present: committed) and
    turns ``corrupt`` when ``check_step`` (local) or ``list_store`` finds a problem.
    """

    name: str
    """``step_000000200``, ``.step_000000400.tmp-…``; the step prefix in a store."""
    path: str
    """Where it is: a local path, or ``<url>/step_…`` in a store."""
    step: int | None
    status: Status
    problems: list[Problem] = dataclasses.field(default_factory=list)
    manifest: Manifest | None = None
    """The validated manifest, when there is one."""
    checked: Literal["size", "checksum"] | None = None
    """What was checked of a committed checkpoint's files (None: nothing yet)."""
    bytes: int | None = None
    """The manifest's total, or the bytes found on disk (or in the store) without one."""
    files: int | None = None
    modified: float | None = None
    """Unix time of the directory (or newest object); for entries without a manifest."""
    objects: int | None = None
    """Objects under the step prefix (a durable tier only)."""
    stored_bytes: int | None = None
    """Bytes of every object under the step prefix (a durable tier only)."""


# ----------------------------------------------------------------- one checkpoint


def strip_source(message: str, *sources: str | Path) -> str:
    """``message`` without a leading ``source: `` (library messages start with the file or
    URL they are about; a listing already names it)."""
    for source in map(str, sources):
        if message.startswith(source + ": "):
            return message[len(source) + 2 :]
        if message.startswith(source + " "):
            return message[len(source) + 1 :]
    return message


def _reason(exc: Exception, checkpoint: Path) -> str:
    return strip_source(
        str(exc),
        checkpoint / MANIFEST_NAME,
        checkpoint / DCP_METADATA_NAME,
        checkpoint / DCP_METADATA_JSON_NAME,
    )


def load_manifest(checkpoint: Path) -> Manifest | Problem:
    """The checkpoint's validated manifest (``pipeline.read_manifest``), or the ``Problem``
    that makes it unusable."""
    try:
        return read_manifest(checkpoint)
    except CheckpointNotFoundError:
        return Problem(
            file=MANIFEST_NAME,
            reason="missing: the checkpoint was never committed (an unfinished or abandoned save)",
        )
    except (UnsupportedFormatError, CheckpointCorruptError) as exc:
        return Problem(file=MANIFEST_NAME, reason=_reason(exc, checkpoint))


def check_files(
    checkpoint: Path,
    manifest: Manifest,
    *,
    checksums: bool,
    advance: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Every bad file of ``manifest``: the checks restore runs (``pipeline.file_problems``),
    all reported; ``advance`` is called with the bytes checksummed."""
    return [
        Problem(file=p.file, reason=p.reason)
        for p in file_problems(checkpoint, manifest, checksums=checksums, advance=advance)
    ]


def check_metadata(checkpoint: Path) -> Problem | None:
    """Read DCP's ``.metadata`` with the restricted unpickler, and ``.metadata.json`` where
    there is one; a ``Problem`` when either would not load or they disagree (a
    restore reads the JSON, DCP's own readers the pickle)."""
    name = DCP_METADATA_NAME
    try:
        pickled = read_dcp_metadata(checkpoint)
        name = DCP_METADATA_JSON_NAME
        twin = read_metadata_json(checkpoint)
    except CheckpointNotFoundError:
        return Problem(file=name, reason="missing: not a DCP checkpoint")
    except CheckpointCorruptError as exc:
        return Problem(file=name, reason=_reason(exc, checkpoint))
    except OSError as exc:
        return Problem(file=name, reason=f"cannot read ({exc.strerror or exc})")
    if twin is not None and twin != pickled:
        return Problem(
            file=name,
            reason=f"does not hold the same metadata as {DCP_METADATA_NAME}; one of them was "
            "tampered with or written by another tool",
        )
    return None


def dir_usage(path: Path) -> tuple[int, int]:
    """``(bytes, files)`` under ``path``, links not followed; entries that vanish or cannot be
    read are skipped."""
    total = files = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                            files += 1
                    except OSError:
                        continue
        except OSError:
            continue
    return total, files


# ----------------------------------------------------------------- a run directory


def scan_run(run: str | os.PathLike[str]) -> list[StepEntry]:
    """Every checkpoint-named real directory of ``run`` by name alone (``lstat`` only, no file
    read), oldest step first; empty when ``run`` does not exist, ``OSError`` when it cannot
    be listed."""
    return LocalStorage(run).scan()


def kind_of_dir(path: str | os.PathLike[str]) -> Literal["run", "checkpoint"] | None:
    """Whether the existing directory ``path`` is a run, one checkpoint of a run, or neither.

    A checkpoint holds MANIFEST.json or DCP's ``.metadata``, or carries a
    checkpoint's name (``step_…``, ``.step_….tmp-…``); a run holds checkpoints,
    ``events.jsonl`` or the run lock. ``OSError`` when it cannot be listed.
    """
    p = Path(path)
    if (
        (p / MANIFEST_NAME).is_file()
        or (p / DCP_METADATA_NAME).is_file()
        or parse_checkpoint_name(p.resolve().name) is not None
    ):
        return "checkpoint"
    if (p / EVENTS_NAME).is_file() or (p / LOCK_NAME).is_file() or scan_run(p):
        return "run"
    return None


def list_run(
    run: str | os.PathLike[str], *, skip_reasons: Mapping[int, str] | None = None
) -> list[StepInfo]:
    """Every checkpoint-named real directory of ``run``, oldest step first, manifests read.

    The files of committed entries are not checked yet (``check_step`` does
    that); a committed entry whose manifest is unusable is ``corrupt`` already.
    An entry without a usable manifest has its size from disk. ``skip_reasons``
    (step -> why restore skipped it, from ``events.jsonl``) explains quarantined
    entries. Raises ``OSError`` when the directory cannot be listed.
    """
    infos: list[StepInfo] = []
    for entry in scan_run(run):
        if entry.status == "committed":
            info = read_checkpoint(entry.path)
        else:
            info = StepInfo(
                name=entry.name, path=str(entry.path), step=entry.step, status=entry.status
            )
            reason = (skip_reasons or {}).get(entry.step) if entry.step is not None else None
            info.problems.append(_leftover_problem(entry.name, reason))
            if (entry.path / MANIFEST_NAME).is_file():
                manifest = load_manifest(entry.path)
                if isinstance(manifest, Manifest):
                    _summarize(info, manifest)
        if info.manifest is None:
            info.bytes, info.files = dir_usage(entry.path)
            info.modified = _mtime(entry.path)
        infos.append(info)
    return infos


def read_checkpoint(path: str | os.PathLike[str]) -> StepInfo:
    """One checkpoint directory, whatever its name, with its manifest read but its files not
    checked yet (``check_step``).

    ``step`` is what the name says (None for a name that is not a checkpoint's);
    an unusable or missing manifest makes it ``corrupt`` at once, with ``bytes``
    and ``files`` left None.
    """
    p = Path(path)
    parsed = parse_checkpoint_name(p.name)
    info = StepInfo(
        name=p.resolve().name,
        path=str(p),
        step=None if parsed is None else parsed.step,
        status="committed",
    )
    manifest = load_manifest(p)
    if isinstance(manifest, Problem):
        info.status, info.checked = "corrupt", "size"
        info.problems.append(manifest)
    else:
        _summarize(info, manifest)
    return info


def _summarize(info: StepInfo, manifest: Manifest) -> None:
    info.manifest = manifest
    info.bytes, info.files = manifest.total_bytes, len(manifest.files)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _leftover_problem(name: str, skip_reason: str | None) -> Problem:
    """Why an entry that is not a committed checkpoint is not one, from its name."""
    parsed = parse_checkpoint_name(name)
    kind = None if parsed is None else parsed.kind
    if kind == "corrupt":
        why = skip_reason or "it failed verification"
        return Problem(file=None, reason=f"moved aside by restore: {why}")
    if kind == "del":
        return Problem(file=None, reason="being deleted by retention")
    if kind == "tmp":
        return Problem(file=None, reason="not committed: a save in progress or abandoned")
    return Problem(file=MANIFEST_NAME, reason="missing: a step directory that was never committed")


def check_step(
    info: StepInfo, *, checksums: bool, advance: Callable[[int], None] | None = None
) -> StepInfo:
    """Check a committed local checkpoint as restore would, recording every problem in ``info``.

    Sizes (and with ``checksums`` xxh3-128 and DCP metadata that loads safely) of
    every file; a manifest recording another step than the directory's name is a
    problem too. Entries that are not committed are left as they are; call it once
    per entry. Returns ``info``.
    """
    if info.status != "committed" and info.checked is None:
        return info
    info.checked = "checksum" if checksums else "size"
    path = Path(info.path)
    if info.manifest is not None:
        info.problems.extend(check_files(path, info.manifest, checksums=checksums, advance=advance))
        if info.step is not None and info.manifest.step != info.step:
            info.problems.append(
                Problem(
                    file=MANIFEST_NAME,
                    reason=f"records step {info.manifest.step}, but the directory is {info.name}",
                )
            )
        if checksums and not info.problems and (bad := check_metadata(path)) is not None:
            info.problems.append(bad)
    if info.problems:
        info.status = "corrupt"
    return info


# ----------------------------------------------------------------- a durable tier


def list_store(tier: DurableTier, *, workers: int = 8) -> list[StepInfo]:
    """Every step prefix of the durable tier, checked: each object its manifest lists
    exists with the listed size. No data object is read.

    One listing, then one GET per committed manifest (``workers`` in parallel).
    Raises ``DurableStoreError`` or ``FileNotFoundError`` when the store cannot be read.
    """
    steps = tier.scan()
    committed = [s for s in steps if s.committed]
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix="stalwart-ls"
    ) as pool:
        blobs = list(pool.map(lambda s: _fetch(tier, s), committed))
    manifests = {s.step: blob for s, blob in zip(committed, blobs, strict=True)}
    return [_store_step(tier, s, manifests.get(s.step)) for s in steps]


def _fetch(tier: DurableTier, step: RemoteStep) -> bytes | None:
    """The step's manifest bytes; None when it vanished since the listing (being deleted)."""
    try:
        return tier.manifest_bytes(step.step)
    except FileNotFoundError:
        return None


def _store_step(tier: DurableTier, step: RemoteStep, blob: bytes | None) -> StepInfo:
    name = step_dir_name(step.step)
    info = StepInfo(
        name=name,
        path=f"{tier.url}/{name}",
        step=step.step,
        status="incomplete",
        bytes=step.bytes,
        files=len(step.objects),
        objects=len(step.objects),
        stored_bytes=step.bytes,
        modified=step.modified or None,
    )
    if not step.committed:
        info.problems.append(
            Problem(
                file=None,
                reason=f"no {MANIFEST_NAME}: an upload in progress or cut short; never "
                "restored (gc removes it once older than the grace period)",
            )
        )
        return info
    if blob is None:
        info.problems.append(
            Problem(file=MANIFEST_NAME, reason="deleted while listing: the step is being removed")
        )
        return info
    info.status, info.checked = "committed", "size"
    source = f"{info.path}/{MANIFEST_NAME}"
    try:
        manifest = Manifest.from_json(blob, source=source)
    except (CheckpointCorruptError, UnsupportedFormatError) as exc:
        info.status = "corrupt"
        info.problems.append(Problem(file=MANIFEST_NAME, reason=strip_source(str(exc), source)))
        return info
    _summarize(info, manifest)
    info.problems.extend(_store_problems(step, manifest, data_dir_name(blob)))
    if manifest.step != step.step:
        info.problems.append(
            Problem(
                file=MANIFEST_NAME, reason=f"records step {manifest.step}, but the prefix is {name}"
            )
        )
    if info.problems:
        info.status = "corrupt"
    return info


def _store_problems(step: RemoteStep, manifest: Manifest, data: str) -> list[Problem]:
    """Every file of ``manifest`` whose object is missing or has another size."""
    prefix = f"{step_dir_name(step.step)}/{data}"
    sizes = {o.key: o.size for o in step.objects}
    return [
        Problem(file=entry.path, reason=f"missing: no object {prefix}/{entry.path}")
        if size is None
        else Problem(
            file=entry.path,
            reason=f"size mismatch (object has {size} bytes, manifest says {entry.size})",
        )
        for entry, size in size_mismatches(sizes, prefix, manifest)
    ]


def list_steps(
    location: str | os.PathLike[str], *, retry: RetryPolicy | None = None
) -> list[StepInfo]:
    """The steps of a run directory (``list_run``, files not checked yet) or of a durable tier
    URL (``list_store``, object sizes checked), oldest first.

    A URL is opened with credentials from the environment and ``retry`` (the
    tier's default when None). Raises ``OSError`` for a directory that cannot be
    listed, ``DurableStoreError`` or ``FileNotFoundError`` for a store that cannot be read.
    """
    if not is_url(location):
        return list_run(location)
    tier = DurableTier(str(location), retry=retry)
    try:
        return list_store(tier)
    finally:
        tier.stop()
