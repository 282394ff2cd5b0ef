"""``stalwart verify RUN|CKPT``: prove checkpoints intact, file by file, before anyone relies on them."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any, TextIO

from rich.text import Text

from stalwart import catalog
from stalwart.catalog import StepInfo
from stalwart.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    classify,
    existing_dir,
    format_bytes,
    listing_error,
    make_console,
    new_table,
    progress_bar,
)

__all__ = ["add_parser", "run", "verify_target"]

EPILOG = """\
Each checkpoint is checked the way restore checks it, but every bad file is
reported, not only the first: MANIFEST.json parses and matches its own checksum,
every file it lists exists with the listed size and xxh3-128 checksum, and DCP's
.metadata loads with stalwart's restricted unpickler (nothing in it can run code).
For a run, every committed checkpoint is verified; incomplete and moved-aside
(corrupt) entries are listed but not verified, and do not change the exit status.

exit status:
  0  every checkpoint verified is good
  1  a checkpoint is corrupt (the file and the reason are printed), a checkpoint
     directory has no MANIFEST.json, or a run has no committed checkpoint
  2  usage error: missing path, a file, or not a run or checkpoint directory
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="checksum every file of a checkpoint, or of every committed checkpoint of a run",
        description=textwrap.fill(
            "Verify one checkpoint directory, or every committed checkpoint of a run "
            "directory, against its manifest. Reads every byte; shows a progress bar on stderr "
            "when stderr is a terminal.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="RUN|CKPT", help="run directory or checkpoint directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    report = verify_target(existing_dir(args.target))
    if args.json:
        out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
    else:
        _render(report, out)
    return EXIT_OK if report["ok"] else EXIT_BAD


def verify_target(target: Path) -> dict[str, Any]:
    """The ``--json`` report: target, kind, ok, checkpoints (verified) and skipped (not verified)."""
    kind = classify(target)
    skipped: list[dict[str, Any]] = []
    if kind == "checkpoint":
        todo = [catalog.read_checkpoint(target)]
    else:
        todo = []
        try:
            entries = catalog.scan_run(target)
        except OSError as exc:
            raise listing_error(target, exc) from None
        for entry in entries:
            if entry.status == "committed":
                todo.append(catalog.read_checkpoint(entry.path))
            else:
                skipped.append(
                    {
                        "name": entry.name,
                        "path": str(entry.path),
                        "step": entry.step,
                        "status": entry.status,
                    }
                )
    total = sum(i.manifest.total_bytes for i in todo if i.manifest is not None)
    with progress_bar(total, "verifying") as advance:
        results = [
            _result(catalog.check_step(info, checksums=True, advance=advance)) for info in todo
        ]
    ok = bool(results) and all(r["ok"] for r in results)
    return {
        "target": str(target),
        "kind": kind,
        "ok": ok,
        "checkpoints": results,
        "skipped": skipped,
    }


def _result(info: StepInfo) -> dict[str, Any]:
    """One checked checkpoint as a ``checkpoints`` entry of the report."""
    manifest = info.manifest
    return {
        "name": info.name,
        "path": info.path,
        "step": info.step if manifest is None else manifest.step,
        "ok": not info.problems,
        "files": None if manifest is None else len(manifest.files),
        "bytes": None if manifest is None else manifest.total_bytes,
        "problems": [p.to_dict() for p in info.problems],
    }


def _render(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    results = report["checkpoints"]
    if results:
        console.print(f"verify {report['target']}", markup=False, soft_wrap=True)
        table = new_table(
            "step", "result", "files", "size", "name", right=("step", "files", "size")
        )
        for r in results:
            table.add_row(
                "-" if r["step"] is None else str(r["step"]),
                Text("ok", style="green") if r["ok"] else Text("CORRUPT", style="bold red"),
                "-" if r["files"] is None else str(r["files"]),
                format_bytes(r["bytes"]),
                Text(r["name"]),
            )
        console.print(table)
    for r in results:
        for p in r["problems"]:
            console.print(
                f"{Path(r['path']) / p['file']}: {p['reason']}", markup=False, soft_wrap=True
            )
    for s in report["skipped"]:
        console.print(f"not verified: {s['name']} ({s['status']})", markup=False, soft_wrap=True)
    bad = sum(1 for r in results if not r["ok"])
    if not results:
        console.print(
            f"{report['target']}: no committed checkpoint to verify", markup=False, soft_wrap=True
        )
    elif bad:
        console.print(f"{bad} of {len(results)} checkpoints CORRUPT", markup=False, soft_wrap=True)
    else:
        size = format_bytes(sum(r["bytes"] for r in results))
        console.print(
            f"all {len(results)} checkpoints good ({size} checksummed)",
            markup=False,
            soft_wrap=True,
        )
