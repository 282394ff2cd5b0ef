"""``stalwart inspect CKPT``: what one checkpoint holds, without loading any of it.

Reads MANIFEST.json (plain JSON) and DCP's ``.metadata`` through the restricted
unpickler of ``stalwart.safe_load``; no tensor data is read and no full unpickler
runs, so inspecting a checkpoint from an untrusted source is safe.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from pathlib import Path
from typing import Any, TextIO

from rich.text import Text

from stalwart.catalog import Problem, load_manifest
from stalwart.cli.common import (
    EXIT_OK,
    UsageError,
    format_bytes,
    format_mapping,
    format_time,
    make_console,
    new_table,
    resolve_checkpoint,
)
from stalwart.errors import CheckpointCorruptError, CheckpointNotFoundError
from stalwart.layout import DCP_METADATA_NAME, MANIFEST_NAME
from stalwart.manifest import canonical_json
from stalwart.safe_load import read_dcp_metadata, tensor_table

__all__ = ["add_parser", "inspect_checkpoint", "resolve_checkpoint", "run"]

EPILOG = """\
CKPT is a checkpoint directory (step_000000200/), or a run directory: then --step N
picks step N, and without --step the newest committed checkpoint is shown.
inspect reads MANIFEST.json and DCP's .metadata only; it checks no file sizes or
checksums (use `stalwart verify` for that).

exit status:
  0  the checkpoint was shown
  1  its MANIFEST.json or .metadata is corrupt, unreadable, or unsafe to load
  2  usage error: missing path, a file, not a run or checkpoint, unknown step,
     or a run without a committed checkpoint
"""

_CONFIG_PREVIEW = 200


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="show one checkpoint's manifest and tensors",
        description=textwrap.fill(
            "Show a checkpoint's manifest (step, epoch, creation time, world size, "
            "versions, git commit, host, config hash, metadata, metrics, files with sizes and "
            "checksums) and its tensor table (name, dtype, shape, size), without reading tensor data.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="CKPT", help="checkpoint directory, or run directory")
    parser.add_argument(
        "--step", type=int, metavar="N", help="with a run directory: the step to inspect"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"path": ..., "manifest": ..., "tensors": [...]} on stdout',
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    checkpoint = resolve_checkpoint(args.target, step=args.step)
    report = inspect_checkpoint(checkpoint)
    if report["manifest"] is None:
        print(
            f"stalwart: warning: {checkpoint} has no {MANIFEST_NAME}: it was never committed "
            "and would not be restored",
            file=err,
        )
    if args.json:
        out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
    else:
        _render(report, out)
    return EXIT_OK


def inspect_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """The ``--json`` report: ``{"path", "manifest" (or None when uncommitted), "tensors"}``.

    Raises ``CheckpointCorruptError`` (exit 1) when the manifest or the DCP
    metadata cannot be read safely.
    """
    manifest_data: dict[str, Any] | None = None
    if os.path.lexists(checkpoint / MANIFEST_NAME):  # a link is refused by the reader, not skipped
        manifest = load_manifest(checkpoint)
        if isinstance(manifest, Problem):
            raise CheckpointCorruptError(
                f"{checkpoint / str(manifest.file)}: {manifest.reason}", path=manifest.file
            )
        manifest_data = manifest.to_dict()
    try:
        metadata = read_dcp_metadata(checkpoint)
    except CheckpointNotFoundError as exc:
        if manifest_data is None:
            raise UsageError(
                f"{checkpoint} holds neither {MANIFEST_NAME} nor DCP .metadata; "
                "it is not a checkpoint"
            ) from exc
        raise CheckpointCorruptError(
            f"{checkpoint / DCP_METADATA_NAME}: missing, but the checkpoint is committed; "
            "it is damaged",
            path=DCP_METADATA_NAME,
        ) from exc
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{checkpoint / DCP_METADATA_NAME}: cannot read ({exc.strerror or exc})",
            path=DCP_METADATA_NAME,
        ) from exc
    return {"path": str(checkpoint), "manifest": manifest_data, "tensors": tensor_table(metadata)}


def _shape(shape: list[int] | None) -> str:
    return "-" if shape is None else str(tuple(shape))


def _render(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    m = report["manifest"]
    console.print(f"checkpoint {report['path']}", markup=False, soft_wrap=True)
    if m is None:
        console.print(
            "status          not committed (no MANIFEST.json)", markup=False, soft_wrap=True
        )
    else:
        code = m.get("code") or {}
        versions = m.get("versions") or {}
        commit = code.get("git_commit")
        config_text = "-" if m.get("config") is None else canonical_json(m["config"])
        if len(config_text) > _CONFIG_PREVIEW:
            config_text = config_text[:_CONFIG_PREVIEW] + "… (full config in --json)"
        rows: list[tuple[str, str]] = [
            ("step", str(m["step"])),
            ("epoch", "-" if m.get("epoch") is None else str(m["epoch"])),
            ("created", f"{format_time(m['created_unix'])} (UTC {m['created']})"),
            ("world size", str(m["world_size"])),
            ("format version", str(m["format_version"])),
            ("versions", format_mapping(versions)),
            (
                "git commit",
                "-"
                if commit is None
                else f"{commit}{' (dirty)' if code.get('git_dirty') else ''}"
                + (f" in {code['git_root']}" if code.get("git_root") else ""),
            ),
            ("hostname", m.get("hostname") or "-"),
            ("config hash", m.get("config_hash") or "-"),
            ("config", config_text),
            ("metadata", format_mapping(m.get("metadata") or {})),
            ("metrics", format_mapping(m.get("metrics") or {})),
            (
                "size",
                f"{format_bytes(sum(f['size'] for f in m['files']))} in {len(m['files'])} files",
            ),
        ]
        for name, value in rows:
            console.print(f"{name:<15} {value}", markup=False, soft_wrap=True)

    if m is not None:
        console.print("\nfiles", markup=False, soft_wrap=True)
        files = new_table("path", "size", "bytes", "xxh3-128", right=("size", "bytes"))
        for f in m["files"]:
            files.add_row(Text(f["path"]), format_bytes(f["size"]), str(f["size"]), f["xxh3_128"])
        console.print(files)

    console.print("\ntensors", markup=False, soft_wrap=True)
    tensors = new_table(
        "name", "dtype", "shape", "size", "shards", right=("size", "shards"), wrap=("name",)
    )
    n_tensors = n_values = total = 0
    for t in report["tensors"]:
        if t["kind"] == "tensor":
            n_tensors += 1
            total += t["nbytes"]
            tensors.add_row(
                Text(t["fqn"]),
                t["dtype"],
                _shape(t["shape"]),
                format_bytes(t["nbytes"]),
                str(t["chunks"]),
            )
        else:
            n_values += 1
            tensors.add_row(Text(t["fqn"]), "python value", "-", "-", str(t["chunks"]))
    console.print(tensors)
    console.print(
        f"{n_tensors} tensors ({format_bytes(total)}), {n_values} python values",
        markup=False,
        soft_wrap=True,
    )
