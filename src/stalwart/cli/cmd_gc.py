"""``stalwart gc RUN``: sweep what crashed saves and interrupted deletions left behind.

Only hidden entries that stalwart itself names as not committed are ever
removed: ``.step_*.tmp-*`` (a save in progress or abandoned), ``.step_*.del-*``
(a retention deletion interrupted after its rename) and, with ``--corrupt``,
``.step_*.corrupt-*`` (moved aside by restore). A committed ``step_*``
directory is never touched, whatever state it is in.

The run lock (``<run>/.lock``, see ``stalwart.lock``) tells whether a manager
is writing the run. gc takes it, non-blocking, with the same ``RunLock`` class,
so that no manager starts writing while it sweeps; a trainer that starts during
those moments gets ``RunLockedError`` naming gc's pid. When another process
holds the lock, gc refuses, unless ``--force``: then it removes only entries
older than the grace period, since a younger ``.tmp-`` may be the save being
written right now.

Given a durable tier URL instead of a run, gc removes the tier's orphans: objects
no committed manifest refers to (uploads cut short, the loser of a commit race,
data left by an interrupted deletion). An object store has no lock and no rename,
so an upload in progress looks exactly like an abandoned one; only age tells them
apart. Orphans are therefore removed per data directory, and only when its newest
object is older than the grace period.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any, TextIO

from rich.text import Text

from stalwart.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    UsageError,
    classify,
    dir_usage,
    existing_dir,
    format_bytes,
    is_url,
    make_console,
    new_table,
    open_tier,
    scan,
    store_error,
)
from stalwart.errors import DurableStoreError, RunLockedError
from stalwart.events import EVENTS_NAME, EventLog
from stalwart.lock import LOCK_NAME, RunLock, lock_file_problem, read_lock_holder
from stalwart.plan import parse_duration
from stalwart.storage.durable import DurableTier, OrphanGroup
from stalwart.storage.remote import redact_url

__all__ = ["add_parser", "collect_garbage", "collect_store_garbage", "run"]

EPILOG = """\
what is removed (all of it hidden, none of it ever restored):
  .step_N.tmp-*      a save in progress, or abandoned by a crash
  .step_N.del-*      a retention deletion interrupted between its rename and rmtree
  .step_N.corrupt-*  only with --corrupt: a checkpoint restore moved aside after it
                     failed verification (kept by default, for inspection)
Only entries whose newest file is older than --grace are removed. Committed
checkpoints (step_N/) are never touched, nor a step_N/ without MANIFEST.json.

the run lock:
  gc takes <run>/.lock while it sweeps, so no manager starts writing meanwhile.
  If a running trainer holds it, gc refuses (exit 1); with --force it removes
  only entries older than --grace, which a live save cannot be if the grace
  period is longer than a save takes.

a durable tier (RUN is a URL: s3://bucket/prefix, gs://..., az://..., file:///...):
  gc removes orphans, objects no committed MANIFEST.json refers to: uploads cut
  short, the losing side of a commit race, data of an interrupted deletion. An
  upload in progress looks the same, so a data directory is removed only when
  its newest object is older than --grace (default 1h, which must exceed the
  longest upload plus any clock difference with the store). Committed steps are
  never touched. Credentials come from the environment (AWS_*, ...).

exit status:
  0  done (or, with --dry-run, listed)
  1  the run is locked by another process and --force was not given, or an
     entry could not be removed (the reason is printed)
  2  usage error: RUN is missing, a file, or not a run directory; a bad --grace;
     the store at URL cannot be listed (missing bucket, denied access, unreachable)
"""

DEFAULT_GRACE = 3600.0
"""One hour, for runs and object stores alike: a save or an upload still being written is
younger than that. In a store this is the only guard (no lock, no rename), so it must
exceed the longest upload."""

_GARBAGE_RE = re.compile(r"^\.step_(\d{9,})\.(tmp|del|corrupt)-[0-9a-f]+$")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "gc",
        help="remove abandoned staging and deletion leftovers from a run",
        description=textwrap.fill(
            "Remove the staging directories of abandoned saves (.step_*.tmp-*), "
            "leftovers of interrupted deletions (.step_*.del-*) and, with --corrupt, "
            "checkpoints that restore moved aside (.step_*.corrupt-*), when older than the "
            "grace period. Never removes a committed checkpoint. Reports what was removed "
            "and the bytes freed. Given a durable tier URL, remove its orphan objects "
            "(uploads cut short, lost commit races) older than the grace period.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run", metavar="RUN", help="run directory, or a durable tier URL (s3://bucket/prefix)"
    )
    parser.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    parser.add_argument(
        "--grace",
        type=_duration,
        default=DEFAULT_GRACE,
        metavar="DURATION",
        help="remove only entries whose newest file (or object) is older than this: 30m, 1h, "
        "2d, 0s (default 1h)",
    )
    parser.add_argument(
        "--corrupt",
        action="store_true",
        help="also remove checkpoints that restore moved aside (.step_*.corrupt-*)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="sweep even while another process holds the run lock (entries older than "
        "--grace only)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    if is_url(args.run):
        for flag, given in (("--corrupt", args.corrupt), ("--force", args.force)):
            if given:
                raise UsageError(
                    f"{flag} applies to a run directory, not to a durable tier URL "
                    f"({redact_url(args.run)}); "
                    "for a URL gc removes only orphans older than --grace"
                )
        report = collect_store_garbage(open_tier(args.run), grace=args.grace, dry_run=args.dry_run)
        if args.json:
            out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
        else:
            _render_store(report, out)
        return EXIT_OK if report["ok"] else EXIT_BAD
    directory = existing_dir(args.run)
    if classify(directory) == "checkpoint":
        raise UsageError(
            f"{args.run} is a checkpoint directory, and `gc` sweeps a run; "
            f"try `stalwart gc {directory.resolve().parent}`"
        )
    report = collect_garbage(
        directory,
        grace=args.grace,
        corrupt=args.corrupt,
        force=args.force,
        dry_run=args.dry_run,
    )
    if args.json:
        out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
    else:
        _render(report, out)
    return EXIT_OK if report["ok"] else EXIT_BAD


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


def collect_garbage(
    run: Path, *, grace: float, corrupt: bool, force: bool, dry_run: bool
) -> dict[str, Any]:
    """Sweep ``run`` (or only list, ``dry_run``) and return the ``--json`` report.

    Raises ``RunLockedError`` when another process holds the run lock and
    neither ``force`` nor ``dry_run`` is set.
    """
    lock = RunLock(run)
    lock_state = "free"
    holder: dict[str, Any] | None = None
    try:
        lock.acquire()
    except RunLockedError:
        problem = lock_file_problem(run)
        if problem is not None:
            # A link or FIFO planted as .lock is never written through; a dry run still lists.
            if not dry_run:
                raise
            lock_state = f"unknown ({LOCK_NAME} is {problem})"
        else:
            lock_state, holder = "held", read_lock_holder(run)
            if not (force or dry_run):
                raise _locked(run, holder, grace) from None
    except OSError as exc:
        if not dry_run:
            raise
        lock_state = f"unknown ({exc.strerror or exc})"
    try:
        entries = [_sweep(e.path, grace, corrupt, dry_run) for e in scan(run)]
        removed = [e for e in entries if e["action"] in ("removed", "would remove")]
        if removed and not dry_run:
            EventLog(run / EVENTS_NAME).emit(
                "gc",
                removed=[e["name"] for e in removed],
                bytes_freed=sum(e["bytes_freed"] for e in removed),
                forced=lock_state == "held",
            )
    finally:
        lock.release()
    return {
        "run": str(run),
        "dry_run": dry_run,
        "grace_s": grace,
        "corrupt": corrupt,
        "lock": {"state": lock_state, "holder": holder, "forced": force and lock_state == "held"},
        "ok": not any(e["error"] for e in entries),
        "removed": len(removed),
        "bytes_freed": sum(e["bytes_freed"] for e in removed),
        "entries": entries,
    }


def _locked(run: Path, holder: dict[str, Any], grace: float) -> RunLockedError:
    who = (
        f"pid {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')})"
        if holder.get("pid") is not None
        else "another process"
    )
    return RunLockedError(
        f"{run} is locked by {who}, which may be saving right now; stop it first, or "
        f"rerun with --force to remove only entries older than --grace ({_age(grace)})"
    )


def _sweep(path: Path, grace: float, corrupt: bool, dry_run: bool) -> dict[str, Any]:
    m = _GARBAGE_RE.match(path.name)
    size, files = dir_usage(path) if path.is_dir() else (path.stat().st_size, 1)
    entry: dict[str, Any] = {
        "name": path.name,
        "path": str(path),
        "step": None if m is None else int(m.group(1)),
        "kind": None if m is None else m.group(2),
        "age_s": None,
        "bytes": size,
        "files": files,
        "action": "kept",
        "reason": None,
        "bytes_freed": 0,
        "error": None,
    }
    if m is None:
        # scan() also lists step_N/ directories; committed or not, gc leaves them alone.
        committed = (path / "MANIFEST.json").is_file()
        entry["kind"] = "committed" if committed else "uncommitted step directory"
        entry["reason"] = (
            "a committed checkpoint: never removed by gc"
            if committed
            else "a step directory without MANIFEST.json, not made by the commit protocol: "
            "inspect it, then remove it by hand"
        )
        entry["step"] = int(path.name.removeprefix("step_")) if path.name[5:].isdigit() else None
        return entry
    try:
        age = time.time() - _newest_mtime(path)
    except FileNotFoundError:
        entry.update(action="gone", reason="removed by someone else meanwhile", bytes=0)
        return entry
    entry["age_s"] = age
    if m.group(2) == "corrupt" and not corrupt:
        entry["reason"] = "moved aside by restore, kept for inspection (--corrupt removes it)"
        return entry
    if age < grace:
        entry["reason"] = f"younger than the grace period ({_age(age)} < {_age(grace)})"
        return entry
    if dry_run:
        entry.update(action="would remove", bytes_freed=size)
        return entry
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as exc:
        left, _files = dir_usage(path) if path.is_dir() else (0, 0)
        entry.update(
            action="failed",
            bytes_freed=size - left,
            error=f"{exc.filename or path}: {exc.strerror or exc}",
        )
        return entry
    entry.update(action="removed", bytes_freed=size)
    return entry


def collect_store_garbage(tier: DurableTier, *, grace: float, dry_run: bool) -> dict[str, Any]:
    """Remove the tier's orphans older than ``grace`` (or only list them) and return the report.

    ``DurableTier.orphan_groups`` decides what no committed manifest refers to,
    one group per upload attempt (a data directory or a loose object); a group is
    removed only when its newest object is past the grace period: the oldest
    objects of an upload still in progress may be older than that, but not its
    newest.
    """
    now = time.time()
    try:
        steps = tier.scan()
        groups = tier.orphan_groups(steps)
    except (DurableStoreError, FileNotFoundError) as exc:
        raise store_error(exc) from None
    entries = [_sweep_store(tier, group, grace, now, dry_run) for group in groups]
    removed = [e for e in entries if e["action"] in ("removed", "would remove")]
    return {
        "url": tier.url,
        "dry_run": dry_run,
        "grace_s": grace,
        "ok": not any(e["error"] for e in entries),
        "removed": len(removed),
        "objects_removed": sum(e["objects"] for e in removed),
        "bytes_freed": sum(e["bytes_freed"] for e in entries),
        "committed_steps": sum(1 for step in steps if step.committed),
        "entries": entries,
    }


def _sweep_store(
    tier: DurableTier, group: OrphanGroup, grace: float, now: float, dry_run: bool
) -> dict[str, Any]:
    age = now - group.modified
    entry: dict[str, Any] = {
        "name": group.name,
        "path": f"{tier.url}/{group.name}",
        "step": group.step,
        "kind": "unreferenced" if group.committed else "incomplete",
        "age_s": age,
        "objects": len(group.objects),
        "bytes": group.bytes,
        "action": "kept",
        "reason": (
            "not named by the committed manifest: a lost commit race, a failed attempt or "
            "a crashed write's temporary file"
            if group.committed
            else "no MANIFEST.json: an upload cut short (or in progress), or an interrupted "
            "deletion"
        ),
        "bytes_freed": 0,
        "error": None,
        "keys": sorted(o.key for o in group.objects),
    }
    if age < grace:
        entry["reason"] = (
            f"younger than the grace period ({_age(age)} < {_age(grace)}): "
            "possibly an upload in progress"
        )
        return entry
    if dry_run:
        entry.update(action="would remove", bytes_freed=group.bytes)
        return entry
    try:
        tier.remove(entry["keys"])
    except (DurableStoreError, FileNotFoundError) as exc:
        entry.update(action="failed", error=str(exc))
        return entry
    entry.update(action="removed", bytes_freed=group.bytes)
    return entry


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


_ACTION_STYLE = {"removed": "green", "would remove": "yellow", "failed": "bold red"}


def _render(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    lock = report["lock"]
    if lock["state"] == "held":
        holder = lock["holder"] or {}
        console.print(
            f"note: the run is locked by pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}: only entries older than {_age(report['grace_s'])} "
            "are removed",
            markup=False,
            soft_wrap=True,
        )
    elif lock["state"] != "free":
        console.print(f"note: run lock state {lock['state']}", markup=False, soft_wrap=True)
    entries = [e for e in report["entries"] if e["kind"] != "committed"]
    committed = len(report["entries"]) - len(entries)
    if entries:
        table = new_table(
            "name", "kind", "age", "size", "action", right=("age", "size"), wrap=("action",)
        )
        for e in entries:
            action = Text(e["action"], style=_ACTION_STYLE.get(e["action"], ""))
            if e["reason"]:
                action.append(f": {e['reason']}")
            if e["error"]:
                action.append(f": {e['error']}")
            table.add_row(
                Text(e["name"]),
                e["kind"],
                "-" if e["age_s"] is None else _age(e["age_s"]),
                format_bytes(e["bytes"]),
                action,
            )
        console.print(table)
    verb = "would remove" if report["dry_run"] else "removed"
    console.print(
        f"{verb} {report['removed']} entries, {format_bytes(report['bytes_freed'])}"
        f"{' to free' if report['dry_run'] else ' freed'}; {committed} committed "
        "checkpoints untouched",
        markup=False,
        soft_wrap=True,
    )


def _render_store(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    console.print(
        f"durable tier {report['url']}: orphans older than {_age(report['grace_s'])}",
        markup=False,
        soft_wrap=True,
    )
    if report["entries"]:
        table = new_table(
            "prefix",
            "kind",
            "age",
            "objects",
            "size",
            "action",
            right=("age", "objects", "size"),
            wrap=("action",),
        )
        for e in report["entries"]:
            action = Text(e["action"], style=_ACTION_STYLE.get(e["action"], ""))
            if e["action"] == "kept" or e["error"]:
                action.append(f": {e['error'] or e['reason']}")
            table.add_row(
                Text(e["name"]),
                e["kind"],
                _age(e["age_s"]),
                str(e["objects"]),
                format_bytes(e["bytes"]),
                action,
            )
        console.print(table)
    verb = "would remove" if report["dry_run"] else "removed"
    console.print(
        f"{verb} {report['removed']} entries ({report['objects_removed']} objects), "
        f"{format_bytes(report['bytes_freed'])}{' to free' if report['dry_run'] else ' freed'}; "
        f"{report['committed_steps']} committed steps untouched",
        markup=False,
        soft_wrap=True,
    )
