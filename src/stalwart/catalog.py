"""The public read API: what checkpoints a run (or a durable tier) holds, and in what state.

Everything here only reads, except nothing: listing, checking and planning a gc
sweep never write to, move or delete anything, and never deserialize tensor data
or run a full unpickler (DCP ``.metadata`` goes through ``stalwart.safe_load``'s
restricted reader). The CLI renders these results; programs can use them too::

    from stalwart import catalog

    for info in catalog.list_run("runs/exp1"):
        catalog.check_step(info, checksums=True)
        print(info.name, info.status, [str(p) for p in info.problems])

A run directory is input from outside: entries that are links, FIFOs or devices
are never listed (``LocalStorage.scan``), sizes are taken with ``lstat`` and a
manifest is read only when it is a regular file (``pipeline.read_manifest``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from stalwart.errors import CheckpointCorruptError, CheckpointNotFoundError, UnsupportedFormatError
from stalwart.events import read_events
from stalwart.history import (
    VERDICT_EVENTS,
    RunHistory,
    read_history,
    resume_verdicts,
    verdict_mark,
)
from stalwart.layout import (
    DCP_METADATA_NAME,
    EVENTS_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    parse_checkpoint_name,
    step_dir_name,
)
from stalwart.manifest import Manifest
from stalwart.pipeline import file_problems, read_manifest, verify_checkpoint
from stalwart.safe_load import read_dcp_metadata
from stalwart.storage.base import StepEntry
from stalwart.storage.durable import (
    DurableTier,
    OrphanGroup,
    RemoteStep,
    data_dir_name,
    size_mismatches,
)
from stalwart.storage.local import LocalStorage

__all__ = [
    "VERDICT_EVENTS",
    "GcItem",
    "Problem",
    "RunHistory",
    "StepInfo",
    "StoreGcItem",
    "age_text",
    "check_files",
    "check_metadata",
    "check_step",
    "dir_usage",
    "kind_of_dir",
    "list_run",
    "list_store",
    "load_manifest",
    "plan_gc",
    "plan_store_gc",
    "read_checkpoint",
    "read_events",
    "read_history",
    "resume_verdicts",
    "scan_run",
    "strip_source",
    "verdict_mark",
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
    return strip_source(str(exc), checkpoint / MANIFEST_NAME, checkpoint / DCP_METADATA_NAME)


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
    """Read DCP's ``.metadata`` with the restricted unpickler; a ``Problem`` when it would not load."""
    try:
        read_dcp_metadata(checkpoint)
    except CheckpointNotFoundError:
        return Problem(file=DCP_METADATA_NAME, reason="missing: not a DCP checkpoint")
    except CheckpointCorruptError as exc:
        return Problem(file=DCP_METADATA_NAME, reason=_reason(exc, checkpoint))
    except OSError as exc:
        return Problem(file=DCP_METADATA_NAME, reason=f"cannot read ({exc.strerror or exc})")
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
    import concurrent.futures  # only listing a store needs threads

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


# ----------------------------------------------------------------- planning a gc sweep


@dataclasses.dataclass(slots=True, kw_only=True)
class GcItem:
    """One entry of a run as ``stalwart gc`` sees it: removed only when ``remove`` is True."""

    name: str
    path: Path
    step: int | None
    kind: str
    """``tmp``, ``del``, ``corrupt``, ``committed`` or ``uncommitted step directory``."""
    bytes: int
    files: int
    age_s: float | None = None
    """Seconds since the newest file under it changed (None: not looked at, or gone)."""
    remove: bool = False
    gone: bool = False
    """Removed by someone else between the listing and the look at its age."""
    reason: str | None = None
    """Why it is kept (None when it is to be removed)."""


def plan_gc(
    run: str | os.PathLike[str], *, grace: float, corrupt: bool, now: float | None = None
) -> list[GcItem]:
    """What ``stalwart gc`` would remove from ``run`` and why, oldest step first; removes nothing.

    Only hidden leftovers are ever planned for removal: ``.step_N.tmp-…``
    (abandoned saves), ``.step_N.del-…`` (interrupted deletions) and, with
    ``corrupt``, ``.step_N.corrupt-…`` (quarantined by restore), each only when
    its newest file is older than ``grace`` seconds (a younger one may be a
    save being written right now). ``step_N`` directories are never removed.
    Raises ``OSError`` when ``run`` cannot be listed.
    """
    when = time.time() if now is None else now
    return [_plan_entry(e.path, grace, corrupt, when) for e in scan_run(run)]


def _plan_entry(path: Path, grace: float, corrupt: bool, now: float) -> GcItem:
    parsed = parse_checkpoint_name(path.name)
    assert parsed is not None, path  # scan lists only checkpoint names
    size, files = dir_usage(path) if path.is_dir() else (path.stat().st_size, 1)
    item = GcItem(
        name=path.name, path=path, step=parsed.step, kind=parsed.kind, bytes=size, files=files
    )
    if parsed.kind == "step":
        committed = (path / MANIFEST_NAME).is_file()
        item.kind = "committed" if committed else "uncommitted step directory"
        item.reason = (
            "a committed checkpoint: never removed by gc"
            if committed
            else f"a step directory without {MANIFEST_NAME}, not made by the commit protocol: "
            "inspect it, then remove it by hand"
        )
        return item
    try:
        item.age_s = now - _newest_mtime(path)
    except FileNotFoundError:
        item.gone, item.bytes, item.reason = True, 0, "removed by someone else meanwhile"
        return item
    if parsed.kind == "corrupt" and not corrupt:
        item.reason = "moved aside by restore, kept for inspection (--corrupt removes it)"
    elif item.age_s < grace:
        item.reason = f"younger than the grace period ({age_text(item.age_s)} < {age_text(grace)})"
    else:
        item.remove = True
    return item


def _newest_mtime(path: Path) -> float:
    """The newest mtime of ``path`` and everything under it: a save still writing is young."""
    newest = path.lstat().st_mtime
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                continue
    return newest


def age_text(seconds: float) -> str:
    """``45s``, ``30m``, ``1.5h``, ``3.0d``: an age or a grace period, for messages."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


@dataclasses.dataclass(slots=True, kw_only=True)
class StoreGcItem:
    """One orphan group of a durable tier (an upload attempt no committed manifest refers to)."""

    group: OrphanGroup
    age_s: float
    remove: bool
    reason: str
    """What the orphan is, or why it is kept."""

    @property
    def keys(self) -> list[str]:
        return sorted(o.key for o in self.group.objects)


def plan_store_gc(
    tier: DurableTier, *, grace: float, now: float | None = None
) -> tuple[list[StoreGcItem], list[RemoteStep]]:
    """The tier's orphan groups with what gc would do to each, and the listing they came from.

    A group is removed only when its newest object is past ``grace``: the oldest
    objects of an upload still in progress may be older than that, but not its
    newest (an object store has no lock and no rename, so age is the only guard).
    Raises ``DurableStoreError`` or ``FileNotFoundError`` when the store cannot be listed.
    """
    when = time.time() if now is None else now
    steps = tier.scan()
    return [_plan_group(g, grace, when) for g in tier.orphan_groups(steps)], steps


def _plan_group(group: OrphanGroup, grace: float, now: float) -> StoreGcItem:
    age = now - group.modified
    if age < grace:
        return StoreGcItem(
            group=group,
            age_s=age,
            remove=False,
            reason=f"younger than the grace period ({age_text(age)} < {age_text(grace)}): "
            "possibly an upload in progress",
        )
    return StoreGcItem(
        group=group,
        age_s=age,
        remove=True,
        reason=(
            "not named by the committed manifest: a lost commit race, a failed attempt or "
            "a crashed write's temporary file"
            if group.committed
            else f"no {MANIFEST_NAME}: an upload cut short (or in progress), or an interrupted "
            "deletion"
        ),
    )
