"""``stalwart ls RUN``: every checkpoint of a run, committed or not, with its state and cost."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any, TextIO

from rich.text import Text

from stalwart.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    Problem,
    RunHistory,
    UsageError,
    check_files,
    check_metadata,
    classify,
    dir_usage,
    existing_dir,
    format_bytes,
    format_mapping,
    format_seconds,
    format_time,
    iso_utc,
    load_manifest,
    make_console,
    new_table,
    progress_bar,
    read_history,
    scan,
)
from stalwart.manifest import MANIFEST_NAME, Manifest
from stalwart.storage.base import StepEntry

__all__ = ["add_parser", "list_run", "run"]

EPILOG = """\
statuses:
  committed   has a valid MANIFEST.json and every file has the size it lists
              (with --verify: and the checksum, and DCP metadata that loads safely)
  incomplete  a save in progress or abandoned by a crash (.step_*.tmp-*), or being
              deleted; never restored
  corrupt     a committed checkpoint that fails the check above, or one that restore
              moved aside (.step_*.corrupt-*) after it failed verification

exit status:
  0  the run was listed and no committed checkpoint failed its check
  1  a committed checkpoint failed the size check (or, with --verify, the checksum)
  2  usage error: RUN is missing, is a file, or is not a run directory
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "ls",
        help="list the checkpoints of a run",
        description=textwrap.fill(
            "List every checkpoint of a run directory, oldest step first: status, "
            "creation time, size, world size, metrics and save timings (from events.jsonl). "
            "Without --verify only sizes are checked, which reads no file content.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run", metavar="RUN", help="run directory (the one given to CheckpointManager)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also checksum every file of each committed checkpoint (reads all their bytes)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    directory = existing_dir(args.run)
    if classify(directory) == "checkpoint":
        raise UsageError(
            f"{args.run} is a checkpoint directory, and `ls` lists a run; "
            f"try `stalwart inspect {args.run}`, or `stalwart ls {directory.resolve().parent}`"
        )
    report = list_run(directory, verify=args.verify, warn=err)
    if args.json:
        out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
    else:
        _render(report, out)
    failed = any(e["status"] == "corrupt" and e["checked"] is not None for e in report["entries"])
    return EXIT_BAD if failed else EXIT_OK


def list_run(run: Path, *, verify: bool, warn: TextIO) -> dict[str, Any]:
    """The ``--json`` report: run, verified, latest_step, counts and one entry per checkpoint."""
    entries = scan(run)
    history = read_history(run, warn)
    manifests = {e.name: load_manifest(e.path) for e in entries if e.status == "committed"}
    total = sum(m.total_bytes for m in manifests.values() if isinstance(m, Manifest))
    rows: list[dict[str, Any]] = []
    with progress_bar(total if verify else 0, "verifying") as advance:
        for entry in entries:
            if entry.status == "committed":
                rows.append(_committed_row(entry, manifests[entry.name], verify, history, advance))
            else:
                rows.append(_other_row(entry, history))
    counts = {status: 0 for status in ("committed", "incomplete", "corrupt")}
    for row in rows:
        counts[row["status"]] += 1
    committed = [r["step"] for r in rows if r["status"] == "committed"]
    return {
        "run": str(run),
        "verified": verify,
        "latest_step": max(committed) if committed else None,
        "counts": counts,
        "entries": rows,
    }


def _base_row(entry: StepEntry, history: RunHistory) -> dict[str, Any]:
    return {
        "name": entry.name,
        "path": str(entry.path),
        "step": entry.step,
        "status": entry.status,
        "checked": None,
        "problems": [],
        "created": None,
        "created_unix": None,
        "bytes": None,
        "files": None,
        "world_size": None,
        "epoch": None,
        "metrics": {},
        "timings": history.timings.get(entry.step) if entry.step is not None else None,
    }


def _fill_from_manifest(row: dict[str, Any], manifest: Manifest) -> None:
    row.update(
        created=manifest.created,
        created_unix=manifest.created_unix,
        bytes=manifest.total_bytes,
        files=len(manifest.files),
        world_size=manifest.world_size,
        epoch=manifest.epoch,
        metrics=manifest.metrics,
    )


def _fill_from_disk(row: dict[str, Any], path: Path) -> None:
    size, files = dir_usage(path)
    try:
        mtime: float | None = path.stat().st_mtime
    except OSError:
        mtime = None
    row.update(
        created=None if mtime is None else iso_utc(mtime),
        created_unix=mtime,
        bytes=size,
        files=files,
    )


def _committed_row(
    entry: StepEntry,
    manifest: Manifest | Problem,
    verify: bool,
    history: RunHistory,
    advance: Any,
) -> dict[str, Any]:
    row = _base_row(entry, history)
    row["checked"] = "checksum" if verify else "size"
    if isinstance(manifest, Problem):
        _fill_from_disk(row, entry.path)
        problems = [manifest]
    else:
        _fill_from_manifest(row, manifest)
        problems = check_files(entry.path, manifest, checksums=verify, advance=advance)
        if manifest.step != entry.step:
            problems.append(
                Problem(
                    file=MANIFEST_NAME,
                    reason=f"records step {manifest.step}, but the directory is {entry.name}",
                )
            )
        if verify and not problems and (bad := check_metadata(entry.path)) is not None:
            problems.append(bad)
    if problems:
        row["status"] = "corrupt"
        row["problems"] = [p.to_dict() for p in problems]
    return row


def _other_row(entry: StepEntry, history: RunHistory) -> dict[str, Any]:
    row = _base_row(entry, history)
    manifest = load_manifest(entry.path) if (entry.path / MANIFEST_NAME).is_file() else None
    if isinstance(manifest, Manifest):
        _fill_from_manifest(row, manifest)
    else:
        _fill_from_disk(row, entry.path)
    if entry.status == "corrupt":
        reason = history.skip_reasons.get(entry.step) if entry.step is not None else None
        row["problems"] = [
            {
                "file": None,
                "reason": "moved aside by restore: " + (reason or "it failed verification"),
            }
        ]
    elif ".del-" in entry.name:
        row["problems"] = [{"file": None, "reason": "being deleted by retention"}]
    elif entry.name.startswith("."):
        row["problems"] = [
            {"file": None, "reason": "not committed: a save in progress or abandoned"}
        ]
    else:
        row["problems"] = [
            {"file": MANIFEST_NAME, "reason": "missing: a step directory that was never committed"}
        ]
    return row


_STATUS_STYLE = {"committed": "green", "incomplete": "yellow", "corrupt": "bold red"}


def _render(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    entries = report["entries"]
    if not entries:
        console.print(f"{report['run']}: no checkpoints", markup=False, soft_wrap=True)
        return
    console.print(f"run {report['run']}", markup=False, soft_wrap=True)
    table = new_table(
        "step",
        "status",
        "created",
        "size",
        "files",
        "world",
        "stall",
        "write",
        "metrics",
        right=("step", "size", "files", "world", "stall", "write"),
        wrap=("created", "metrics"),
    )
    for e in entries:
        timings = e["timings"] or {}
        table.add_row(
            "-" if e["step"] is None else str(e["step"]),
            Text(e["status"], style=_STATUS_STYLE[e["status"]]),
            format_time(e["created_unix"]),
            format_bytes(e["bytes"]),
            "-" if e["files"] is None else str(e["files"]),
            "-" if e["world_size"] is None else str(e["world_size"]),
            format_seconds(timings.get("stall_s")),
            format_seconds(timings.get("write_s")),
            Text(format_mapping(e["metrics"])),
        )
    console.print(table)
    for e in entries:
        for p in e["problems"]:
            where = e["name"] if p["file"] is None else f"{e['name']}/{p['file']}"
            console.print(f"{where}: {p['reason']}", markup=False, soft_wrap=True)
    counts = report["counts"]
    latest = report["latest_step"]
    console.print(
        f"newest committed step: {'none' if latest is None else latest}; "
        f"{counts['committed']} committed, {counts['incomplete']} incomplete, "
        f"{counts['corrupt']} corrupt",
        markup=False,
        soft_wrap=True,
    )
    console.print(
        "checked: sizes and checksums"
        if report["verified"]
        else "checked: sizes only (use --verify to checksum every file)",
        markup=False,
        soft_wrap=True,
    )
