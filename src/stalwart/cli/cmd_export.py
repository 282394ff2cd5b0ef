"""``stalwart export RUN|CKPT --to FILE``: one checkpoint's tensors as one safetensors or torch file."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any, TextIO

from stalwart.cli.common import (
    EXIT_OK,
    UsageError,
    format_bytes,
    make_console,
    progress_bar,
    resolve_checkpoint,
)
from stalwart.errors import StalwartError
from stalwart.export import SAFETENSORS_DTYPES, Format, export_checkpoint, select_tensors
from stalwart.safe_load import read_dcp_metadata

__all__ = ["add_parser", "run"]

EPILOG = """\
The checkpoint is verified first (every file's size and xxh3-128 checksum, as
restore does); a corrupt checkpoint is not exported. Tensors are assembled whole
from however many ranks wrote them (DDP, FSDP2 shards, any world size) and read
without running any code from the checkpoint.

--only model (default) exports the model's tensors under the names of
model.state_dict() (the "model." prefix dropped), ready for
model.load_state_dict(safetensors.torch.load_file(FILE)). --only all exports
every tensor (model and optimizer state) under its full checkpoint key.
Non-tensor values (optimizer hyperparameters, RNG state, data position, user
values) are never exported.

--format safetensors (default, or when FILE ends in .safetensors) streams one
batch of tensors at a time; --format torch (default when FILE ends in .pt, .pth
or .bin) writes torch.save of a flat {name: tensor} dict and holds every
exported tensor in memory. FILE appears only once complete.

exit status:
  0  exported
  1  the checkpoint is corrupt or uncommitted, or writing FILE failed
  2  usage error: missing path, not a run or checkpoint, unknown step, FILE
     exists (without --overwrite) or its directory does not, a dtype the format
     cannot hold
"""

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "export",
        help="consolidate a (sharded) checkpoint into one safetensors or torch file",
        description=textwrap.fill(
            "Verify a checkpoint, then write its tensors, assembled from every rank's "
            "shards, into one safetensors file (streamed tensor by tensor) or one torch.save "
            "file.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="RUN|CKPT", help="run directory or checkpoint directory")
    parser.add_argument(
        "--step", type=int, metavar="N", help="with a run directory: the step (default: newest)"
    )
    parser.add_argument("--to", required=True, metavar="FILE", help="the file to write")
    parser.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        help="file format (default: from FILE's suffix, else safetensors)",
    )
    parser.add_argument(
        "--only",
        choices=("model", "all"),
        default="model",
        help="model: model tensors, named as in model.state_dict() (default); all: every tensor",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    checkpoint = resolve_checkpoint(args.target, step=args.step)
    dest = Path(args.to)
    if dest.is_dir():
        raise UsageError(f"--to {args.to} is a directory; name the file to write")
    if dest.exists() and not args.overwrite:
        raise UsageError(f"--to {args.to} already exists; pass --overwrite to replace it")
    if not dest.parent.is_dir():
        raise UsageError(f"--to {args.to}: directory {dest.parent} does not exist")
    fmt: Format = args.format or ("torch" if dest.suffix in _TORCH_SUFFIXES else "safetensors")
    # The metadata is read here for the dtype check and the progress bar's total;
    # export reads it again after verifying, so a corrupt .metadata still fails
    # there, naming the bad file.
    try:
        entries, _skipped = select_tensors(read_dcp_metadata(checkpoint), args.only)
    except (OSError, StalwartError):
        entries = []
    if fmt == "safetensors":
        for e in entries:
            if e.dtype not in SAFETENSORS_DTYPES:
                raise UsageError(
                    f"tensor {e.fqn!r} has dtype {e.dtype}, which safetensors cannot hold; "
                    "use --format torch"
                )
    with progress_bar(sum(e.nbytes for e in entries), "exporting") as advance:
        report = export_checkpoint(checkpoint, dest, fmt=fmt, only=args.only, advance=advance)
    if args.json:
        out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
    else:
        console = make_console(out)
        console.print(
            f"exported {len(report['tensors'])} tensors ({format_bytes(report['tensor_bytes'])}) "
            f"of step {report['step']} from {report['source']}\n"
            f"to {report['path']} ({report['format']}, {format_bytes(report['bytes'])}); "
            f"{len(report['skipped'])} other entries not exported",
            markup=False,
            soft_wrap=True,
        )
    return EXIT_OK
