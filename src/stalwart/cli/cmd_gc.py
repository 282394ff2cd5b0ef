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
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any, TextIO

from rich.text import Text

from stalwart import catalog
from stalwart.catalog import GcItem, StoreGcItem, age_text, dir_usage
from stalwart.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    UsageError,
    format_bytes,
    is_url,
    listing_error,
    make_console,
    new_table,
    open_tier,
    run_directory,
    store_error,
)
from stalwart.cli.units import parse_duration
from stalwart.errors import DurableStoreError, RunLockedError
from stalwart.events import EventLog
from stalwart.layout import EVENTS_NAME, LOCK_NAME
from stalwart.lock import RunLock, lock_file_problem, read_lock_holder
from stalwart.redact import redact_url
from stalwart.storage.durable import DurableTier

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
    directory = run_directory(args.run, lambda run: f"`gc` sweeps a run; try `stalwart gc {run}`")
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
        try:
            plan = catalog.plan_gc(run, grace=grace, corrupt=corrupt)
        except OSError as exc:
            raise listing_error(run, exc) from None
        entries = [_sweep(item, dry_run) for item in plan]
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
        f"rerun with --force to remove only entries older than --grace ({age_text(grace)})"
    )


def _sweep(item: GcItem, dry_run: bool) -> dict[str, Any]:
    """Carry out the plan for one entry (remove it, or only say so) and report what happened."""
    entry: dict[str, Any] = {
        "name": item.name,
        "path": str(item.path),
        "step": item.step,
        "kind": item.kind,
        "age_s": item.age_s,
        "bytes": item.bytes,
        "files": item.files,
        "action": "gone" if item.gone else "kept",
        "reason": item.reason,
        "bytes_freed": 0,
        "error": None,
    }
    if not item.remove:
        return entry
    if dry_run:
        entry.update(action="would remove", bytes_freed=item.bytes)
        return entry
    path = item.path
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as exc:
        left, _files = dir_usage(path) if path.is_dir() else (0, 0)
        entry.update(
            action="failed",
            bytes_freed=item.bytes - left,
            error=f"{exc.filename or path}: {exc.strerror or exc}",
        )
        return entry
    entry.update(action="removed", bytes_freed=item.bytes)
    return entry


def collect_store_garbage(tier: DurableTier, *, grace: float, dry_run: bool) -> dict[str, Any]:
    """Remove the tier's orphans older than ``grace`` (or only list them) and return the report.

    ``DurableTier.orphan_groups`` decides what no committed manifest refers to,
    one group per upload attempt (a data directory or a loose object); a group is
    removed only when its newest object is past the grace period: the oldest
    objects of an upload still in progress may be older than that, but not its
    newest.
    """
    try:
        plan, steps = catalog.plan_store_gc(tier, grace=grace, now=time.time())
    except (DurableStoreError, FileNotFoundError) as exc:
        raise store_error(exc) from None
    entries = [_sweep_store(tier, item, dry_run) for item in plan]
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


def _sweep_store(tier: DurableTier, item: StoreGcItem, dry_run: bool) -> dict[str, Any]:
    group = item.group
    entry: dict[str, Any] = {
        "name": group.name,
        "path": f"{tier.url}/{group.name}",
        "step": group.step,
        "kind": "unreferenced" if group.committed else "incomplete",
        "age_s": item.age_s,
        "objects": len(group.objects),
        "bytes": group.bytes,
        "action": "kept",
        "reason": item.reason,
        "bytes_freed": 0,
        "error": None,
        "keys": item.keys,
    }
    if not item.remove:
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


_ACTION_STYLE = {"removed": "green", "would remove": "yellow", "failed": "bold red"}


def _render(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    lock = report["lock"]
    if lock["state"] == "held":
        holder = lock["holder"] or {}
        console.print(
            f"note: the run is locked by pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}: only entries older than {age_text(report['grace_s'])} "
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
                "-" if e["age_s"] is None else age_text(e["age_s"]),
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
        f"durable tier {report['url']}: orphans older than {age_text(report['grace_s'])}",
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
                age_text(e["age_s"]),
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
