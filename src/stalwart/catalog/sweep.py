"""Planning a gc sweep: what ``stalwart gc`` would remove from a run or a durable tier, and why.

Plans only; the CLI's ``gc`` carries a plan out. See the package docstring.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from stalwart.catalog.steps import dir_usage, scan_run
from stalwart.layout import MANIFEST_NAME, parse_checkpoint_name
from stalwart.storage.durable import DurableTier, OrphanGroup, RemoteStep

__all__ = ["GcItem", "StoreGcItem", "age_text", "plan_gc", "plan_store_gc"]


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
