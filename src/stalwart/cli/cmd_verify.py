"""``stalwart verify RUN|CKPT``: prove checkpoints intact, file by file, before anyone relies on them."""

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
    check_files,
    check_metadata,
    classify,
    existing_dir,
    format_bytes,
    load_manifest,
    make_console,
    name_step,
    new_table,
    progress_bar,
    scan,
)
from stalwart.manifest import MANIFEST_NAME, Manifest

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
        todo = [(target.resolve().name, target, name_step(target))]
    else:
        todo = []
        for entry in scan(target):
            if entry.status == "committed":
                todo.append((entry.name, entry.path, entry.step))
            else:
                skipped.append(
                    {
                        "name": entry.name,
                        "path": str(entry.path),
                        "step": entry.step,
                        "status": entry.status,
                    }
                )
    manifests = [load_manifest(path) for _name, path, _step in todo]
    total = sum(m.total_bytes for m in manifests if isinstance(m, Manifest))
    results: list[dict[str, Any]] = []
    with progress_bar(total, "verifying") as advance:
        for (name, path, dir_step), manifest in zip(todo, manifests, strict=True):
            results.append(_verify_one(name, path, dir_step, manifest, advance))
    ok = bool(results) and all(r["ok"] for r in results)
    return {
        "target": str(target),
        "kind": kind,
        "ok": ok,
        "checkpoints": results,
        "skipped": skipped,
    }


def _verify_one(
    name: str, path: Path, dir_step: int | None, manifest: Manifest | Problem, advance: Any
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "name": name,
        "path": str(path),
        "step": dir_step,
        "ok": False,
        "files": None,
        "bytes": None,
        "problems": [],
    }
    if isinstance(manifest, Problem):
        result["problems"] = [manifest.to_dict()]
        return result
    problems = check_files(path, manifest, checksums=True, advance=advance)
    if dir_step is not None and manifest.step != dir_step:
        problems.append(
            Problem(
                file=MANIFEST_NAME,
                reason=f"records step {manifest.step}, but the directory is {name}",
            )
        )
    if not problems and (bad := check_metadata(path)) is not None:
        problems.append(bad)
    result.update(
        step=manifest.step,
        ok=not problems,
        files=len(manifest.files),
        bytes=manifest.total_bytes,
        problems=[p.to_dict() for p in problems],
    )
    return result


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
