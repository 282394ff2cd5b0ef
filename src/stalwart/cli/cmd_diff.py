"""``stalwart diff A B``: which tensors and values differ between two checkpoints, and by how much.

Both checkpoints are verified against their manifests first, then read a batch
of tensors at a time through ``stalwart.safe_load`` (no code from either
checkpoint runs), so memory stays around two batches whatever the model size.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch
from rich.text import Text
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from stalwart.catalog import verify_checkpoint
from stalwart.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    UsageError,
    format_value,
    make_console,
    new_table,
    non_negative_float,
    resolve_checkpoint,
)
from stalwart.export import TensorEntry, iter_tensors, iter_values
from stalwart.safe_load import read_dcp_metadata

__all__ = ["add_parser", "diff_checkpoints", "run"]

EPILOG = """\
forms:
  stalwart diff CKPT_A CKPT_B             two checkpoint directories
  stalwart diff RUN --step 100 --step 200 two steps of one run
  stalwart diff RUN_A RUN_B [--step N]    the newest (or step N) of two runs

For every key of either checkpoint: tensors of equal dtype and shape are
compared element by element (max |a - b|, in float64, and the number of
elements with |a - b| > --atol; NaN equals NaN); a changed dtype or shape, a
key present in only one checkpoint, and non-tensor values (optimizer
hyperparameters, RNG state, data position) that differ are reported too.

exit status (like diff(1)):
  0  the checkpoints hold the same keys and equal values (within --atol)
  1  something differs, or a checkpoint is corrupt or uncommitted (printed)
  2  usage error: missing path, not a run or checkpoint, unknown step, wrong
     number of checkpoints or steps
"""

_CHUNK_ELEMENTS = 1 << 22
_PREVIEW = 80


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "diff",
        help="compare the tensors and values of two checkpoints",
        description=textwrap.fill(
            "Verify two checkpoints, then report which tensors differ (max absolute "
            "difference, number of differing elements), which changed dtype or shape, which "
            "keys exist in only one, and which non-tensor values differ.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "targets",
        nargs="+",
        metavar="A [B]",
        help="two checkpoint or run directories, or one run directory with two --step",
    )
    parser.add_argument(
        "--step",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="a step of a run; give it twice with one run, once or twice with two runs",
    )
    parser.add_argument(
        "--atol",
        type=non_negative_float,
        default=0.0,
        metavar="X",
        help="elements with |a - b| <= X count as equal (default 0: exactly equal)",
    )
    parser.add_argument(
        "--all", action="store_true", help="list equal entries too, not only the differences"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def _resolve(targets: list[str], steps: list[int]) -> tuple[Path, Path]:
    if len(targets) == 2 and len(steps) <= 2:
        step_a = steps[0] if steps else None
        step_b = steps[-1] if steps else None
        return (
            resolve_checkpoint(targets[0], step=step_a),
            resolve_checkpoint(targets[1], step=step_b),
        )
    if len(targets) == 1 and len(steps) == 2:
        return (
            resolve_checkpoint(targets[0], step=steps[0]),
            resolve_checkpoint(targets[0], step=steps[1]),
        )
    raise UsageError(
        f"got {len(targets)} director{'y' if len(targets) == 1 else 'ies'} and {len(steps)} "
        "--step; give two checkpoints (diff A B), or one run and two steps "
        "(diff RUN --step 100 --step 200)"
    )


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    a, b = _resolve(args.targets, args.step)
    report = diff_checkpoints(a, b, atol=args.atol)
    if args.json:
        out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
    else:
        _render(report, out, show_all=args.all)
    return EXIT_OK if report["identical"] else EXIT_BAD


def diff_checkpoints(a: Path, b: Path, *, atol: float = 0.0) -> dict[str, Any]:
    """Verify both checkpoints, compare every key, and return the ``--json`` report.

    Raises ``CheckpointCorruptError`` or ``CheckpointNotFoundError`` (from
    ``verify_checkpoint``) before reading any tensor when either is bad.
    """
    manifest_a, manifest_b = verify_checkpoint(a), verify_checkpoint(b)
    meta_a, meta_b = read_dcp_metadata(a), read_dcp_metadata(b)
    rows: dict[str, dict[str, Any]] = {}
    tensors: list[TensorEntry] = []
    values: list[str] = []
    for key in sorted(set(meta_a.state_dict_metadata) | set(meta_b.state_dict_metadata)):
        row = _compare_metadata(key, meta_a, meta_b)
        rows[key] = row
        if row["status"] is None and row["kind"] == "tensor":
            tensors.append(
                TensorEntry(
                    fqn=key,
                    name=key,
                    dtype=getattr(torch, row["dtype_a"]),
                    shape=tuple(row["shape_a"]),
                )
            )
        elif row["status"] is None:
            values.append(key)
    pairs = zip(iter_tensors(a, tensors), iter_tensors(b, tensors), strict=True)
    for (entry, ta), (_same, tb) in pairs:
        rows[entry.fqn].update(_compare_tensors(ta, tb, atol))
    for (key, va), (_same_key, vb) in zip(
        iter_values(a, values), iter_values(b, values), strict=True
    ):
        equal = _equal(va, vb)
        rows[key].update(
            status="equal" if equal else "changed",
            detail=None if equal else f"{_preview(va)} -> {_preview(vb)}",
        )
    entries = list(rows.values())
    counts: dict[str, int] = {}
    for row in entries:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return {
        "a": str(a),
        "b": str(b),
        "step_a": manifest_a.step,
        "step_b": manifest_b.step,
        "atol": atol,
        "identical": all(row["status"] == "equal" for row in entries),
        "counts": counts,
        "entries": entries,
    }


def _describe(md: Any) -> tuple[str, str | None, list[int] | None]:
    if isinstance(md, TensorStorageMetadata):
        return "tensor", str(md.properties.dtype).removeprefix("torch."), list(md.size)
    return "value", None, None


def _compare_metadata(key: str, meta_a: Metadata, meta_b: Metadata) -> dict[str, Any]:
    md_a = meta_a.state_dict_metadata.get(key)
    md_b = meta_b.state_dict_metadata.get(key)
    kind_a, dtype_a, shape_a = _describe(md_a) if md_a is not None else (None, None, None)
    kind_b, dtype_b, shape_b = _describe(md_b) if md_b is not None else (None, None, None)
    row: dict[str, Any] = {
        "key": key,
        "kind": kind_a or kind_b,
        "status": None,
        "dtype_a": dtype_a,
        "dtype_b": dtype_b,
        "shape_a": shape_a,
        "shape_b": shape_b,
        "numel": None,
        "differing": None,
        "max_abs_diff": None,
        "detail": None,
    }
    if md_b is None:
        row.update(status="only_a", detail="only in A")
    elif md_a is None:
        row.update(status="only_b", detail="only in B")
    elif kind_a != kind_b:
        row.update(status="kind", detail=f"{kind_a} in A, {kind_b} in B")
    elif dtype_a != dtype_b:
        row.update(status="dtype", detail=f"dtype {dtype_a} -> {dtype_b}")
    elif shape_a != shape_b:
        row.update(status="shape", detail=f"shape {tuple(shape_a or ())} -> {tuple(shape_b or ())}")
    return row


def _chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        yield flat[start : start + _CHUNK_ELEMENTS]


def _compare_tensors(a: torch.Tensor, b: torch.Tensor, atol: float) -> dict[str, Any]:
    """Count differing elements and the max |a - b|, chunk by chunk, in float64 (int64 for integers)."""
    differing = 0
    max_abs = 0.0
    exact = not (a.dtype.is_floating_point or a.dtype.is_complex)
    for ca, cb in zip(_chunks(a), _chunks(b), strict=True):
        if exact:
            wa = ca.to(torch.int64) if ca.dtype != torch.uint64 else ca.to(torch.float64)
            wb = cb.to(torch.int64) if cb.dtype != torch.uint64 else cb.to(torch.float64)
            d = (wa - wb).abs().to(torch.float64)
        else:
            wide = torch.complex128 if a.dtype.is_complex else torch.float64
            wa, wb = ca.to(wide), cb.to(wide)
            same = (wa == wb) | (torch.isnan(wa) & torch.isnan(wb))
            d = torch.where(
                same, torch.zeros((), dtype=torch.float64), (wa - wb).abs().to(torch.float64)
            )
        differing += int((d > atol).sum()) + int(torch.isnan(d).sum())
        if d.numel():
            m = float(d.max())
            max_abs = m if math.isnan(m) or math.isnan(max_abs) else max(max_abs, m)
    return {
        "status": "changed" if differing else "equal",
        "numel": a.numel(),
        "differing": differing,
        "max_abs_diff": max_abs,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and bool(a == b)


def _preview(value: Any) -> str:
    text = format_value(value) if not isinstance(value, (dict, list, tuple)) else repr(value)
    if isinstance(value, torch.Tensor):
        text = f"tensor{tuple(value.shape)}"
    return text if len(text) <= _PREVIEW else text[: _PREVIEW - 1] + "…"


_STATUS_TEXT = {
    "equal": "equal",
    "changed": "changed",
    "shape": "shape changed",
    "dtype": "dtype changed",
    "kind": "kind changed",
    "only_a": "only in A",
    "only_b": "only in B",
}


def _render(report: dict[str, Any], out: TextIO, *, show_all: bool) -> None:
    console = make_console(out)
    console.print(
        f"A: {report['a']} (step {report['step_a']})\nB: {report['b']} (step {report['step_b']})",
        markup=False,
        soft_wrap=True,
    )
    shown = [r for r in report["entries"] if show_all or r["status"] != "equal"]
    if shown:
        table = new_table(
            "key",
            "status",
            "max |a-b|",
            "differing",
            "detail",
            right=("max |a-b|", "differing"),
            wrap=("key", "detail"),
        )
        for r in shown:
            table.add_row(
                Text(r["key"]),
                Text(
                    _STATUS_TEXT[r["status"]],
                    style="green" if r["status"] == "equal" else "bold red",
                ),
                "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.6g}",
                "-" if r["differing"] is None else f"{r['differing']}/{r['numel']}",
                Text(r["detail"] or ""),
            )
        console.print(table)
    total = len(report["entries"])
    tol = f" (atol {report['atol']:g})" if report["atol"] else ""
    if report["identical"]:
        console.print(f"identical: {total} entries equal{tol}", markup=False, soft_wrap=True)
    else:
        parts = ", ".join(
            f"{n} {_STATUS_TEXT[s]}" for s, n in sorted(report["counts"].items()) if s != "equal"
        )
        console.print(
            f"{total - report['counts'].get('equal', 0)} of {total} entries differ{tol}: {parts}",
            markup=False,
            soft_wrap=True,
        )
