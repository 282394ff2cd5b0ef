"""``stalwart plan``: how to parallelize a model, how big its checkpoints are, how often to save.

The arithmetic is in ``stalwart.cli.planner`` (pure functions, sources cited there);
this module parses the command line, optionally measures a disk, and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from stalwart.cli.common import EXIT_OK, UsageError, existing_dir, make_console, new_table
from stalwart.cli.planner import GPU_MEMORY, OPTIMIZERS, PRECISIONS, PlanInputs, make_plan
from stalwart.cli.units import format_size, parse_bandwidth, parse_count, parse_duration, parse_size

__all__ = ["add_parser", "measure_disk", "run"]

EPILOG = """\
model (see docs/operations.md for the derivation and sources):
  training state per parameter (ZeRO paper): mixed precision (bf16/fp16) keeps
  2-byte weights + 2-byte grads + 4-byte fp32 master weights; fp32 keeps 4 + 4.
  Optimizer state is fp32: AdamW 8 bytes, SGD (momentum) 4, Adafactor ~0.
  DDP is chosen when the whole state fits in --mem-fraction of one GPU, else
  FSDP2 when the state sharded over every GPU fits, else FSDP2 with CPU offload
  (or ZeRO-Infinity when --host-mem is given and too small). Activations are
  not modeled: they must fit in the headroom.
  A checkpoint holds fp32 weights + optimizer state (AdamW: 12 bytes/param).
  Sync stall = checkpoint bytes per node / --write-bw; async stall = bytes a rank
  stages / --copy-bw. Interval: Young (1974) sqrt(2CM) and Daly (2006)'s
  higher-order estimate, with C the stall and M = node MTBF / nodes.

units:
  sizes and bandwidths need a unit: 80GB and 80G are decimal, 80GiB binary,
  512B bytes; 2GB/s bytes and 10Gb/s bits per second. A bare number (--gpu-mem 80)
  is refused with a hint, never read as bytes.

examples:
  stalwart plan --params 7B --gpus 8 --gpu h100 --mtbf 24h --write-bw 2GB/s
  stalwart plan --params 70B --gpus 8 --nodes 16 --gpu-mem 80GB --mtbf-job 6h --json
  stalwart plan --params 1.3B --measure /mnt/checkpoints --step-time 0.8s

exit status:
  0  the plan was printed
  2  usage error: an unreadable number or unit, an unknown GPU, --measure on a
     missing or unwritable directory
"""

_MEASURE_CHUNK = 8 * 1024 * 1024


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1], e.g. 0.75")
    return value


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="recommend DDP or FSDP2, checkpoint size, stall and save interval for a model",
        description=textwrap.fill(
            "Estimate the training-state memory of a model, recommend DDP, FSDP2 or "
            "FSDP2 with offload, size its checkpoints, estimate how long a save blocks "
            "training (sync and async), and compute the checkpoint interval that "
            "minimizes lost time (Young's and Daly's formulas), with the lines to paste.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--params",
        required=True,
        type=_arg(parse_count),
        metavar="N",
        help="parameter count: 125M, 1.3B, 7B, 7e9",
    )
    model.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="bf16/fp16: mixed precision with fp32 master weights (default bf16)",
    )
    model.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default adamw")
    model.add_argument(
        "--step-time",
        type=_arg(parse_duration),
        metavar="DURATION",
        help="seconds per training step (e.g. 1.2s), to give the interval in steps",
    )
    hw = parser.add_argument_group("hardware")
    hw.add_argument(
        "--gpus", type=_positive_int, default=1, metavar="N", help="GPUs per node (default 1)"
    )
    hw.add_argument("--nodes", type=_positive_int, default=1, metavar="M", help="nodes (default 1)")
    gpu = hw.add_mutually_exclusive_group()
    gpu.add_argument(
        "--gpu-mem",
        type=_arg(parse_size),
        metavar="SIZE",
        help="memory of one GPU: 80GB, 40GiB (a unit is required: "
        "a bare 80 is refused, not read as bytes)",
    )
    gpu.add_argument(
        "--gpu",
        choices=sorted(GPU_MEMORY),
        help="a GPU model instead of --gpu-mem (default h100, 80 GB)",
    )
    hw.add_argument(
        "--host-mem",
        type=_arg(parse_size),
        metavar="SIZE",
        help="host memory per node, to check that offloaded state fits (default: not checked)",
    )
    hw.add_argument(
        "--mem-fraction",
        type=_fraction,
        default=0.75,
        metavar="F",
        help="share of memory the training state may use; the rest is headroom for "
        "activations (default 0.75)",
    )
    failures = parser.add_argument_group("failures")
    mtbf = failures.add_mutually_exclusive_group()
    mtbf.add_argument(
        "--mtbf",
        type=_arg(parse_duration),
        metavar="DURATION",
        help="mean time between failures of one node: 24h, 30d (default: ~6000h, from "
        "Meta's Llama 3 report)",
    )
    mtbf.add_argument(
        "--mtbf-job",
        type=_arg(parse_duration),
        metavar="DURATION",
        help="mean time between failures of the whole job, instead of --mtbf",
    )
    failures.add_argument(
        "--restart",
        type=_arg(parse_duration),
        default=300.0,
        metavar="DURATION",
        help="time from a failure until training runs again, not counting reading the "
        "checkpoint (default 5m)",
    )
    failures.add_argument(
        "--need",
        choices=("fault-tolerance", "resume"),
        default="fault-tolerance",
        help="fault-tolerance: plan the interval against failures (default); resume: only "
        "planned stops (preemption saves at once), MTBF optional",
    )
    storage = parser.add_argument_group("storage")
    storage.add_argument(
        "--write-bw",
        type=_arg(parse_bandwidth),
        metavar="BW",
        help="checkpoint write bandwidth per node: 2GB/s, 500MB/s, 10Gb/s (default 1GB/s, "
        "or measured)",
    )
    storage.add_argument(
        "--read-bw",
        type=_arg(parse_bandwidth),
        metavar="BW",
        help="read bandwidth per node (default: --write-bw, or measured)",
    )
    storage.add_argument(
        "--copy-bw",
        type=_arg(parse_bandwidth),
        metavar="BW",
        help="device-to-host staging copy per rank, for async saves (default 10GB/s, or "
        "measured host memory copy)",
    )
    storage.add_argument(
        "--measure",
        metavar="DIR",
        help="measure write (with fsync), read and memory-copy bandwidth with a test file in "
        "DIR, removed afterwards",
    )
    storage.add_argument(
        "--measure-size",
        type=_arg(parse_size),
        default=256 * 10**6,
        metavar="SIZE",
        help="size of the --measure test file (default 256MB)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    sources = {"write_bw": "assumed", "read_bw": "= write", "copy_bw": "assumed"}
    measured: dict[str, Any] | None = None
    write_bw, read_bw, copy_bw = 1e9, None, 10e9
    if args.measure is not None:
        measured = measure_disk(existing_dir(args.measure), size=args.measure_size)
        write_bw, read_bw, copy_bw = (
            measured["write_bw"],
            measured["read_bw"],
            measured["copy_bw"],
        )
        where = f"measured in {args.measure}"
        sources = {"write_bw": where, "read_bw": where, "copy_bw": "measured (host memcpy)"}
    if args.write_bw is not None:
        write_bw, sources["write_bw"] = args.write_bw, "given"
    if args.read_bw is not None:
        read_bw, sources["read_bw"] = args.read_bw, "given"
    if args.copy_bw is not None:
        copy_bw, sources["copy_bw"] = args.copy_bw, "given"
    gpu_memory = (
        args.gpu_mem
        if args.gpu_mem is not None
        else GPU_MEMORY[args.gpu if args.gpu is not None else "h100"]
    )
    try:
        inputs = PlanInputs(
            params=args.params,
            precision=args.precision,
            optimizer=args.optimizer,
            gpus_per_node=args.gpus,
            nodes=args.nodes,
            gpu_memory=gpu_memory,
            usable_fraction=args.mem_fraction,
            host_memory=args.host_mem,
            node_mtbf=args.mtbf,
            job_mtbf=args.mtbf_job,
            write_bw=write_bw,
            read_bw=read_bw,
            copy_bw=copy_bw,
            restart_overhead=args.restart,
            step_time=args.step_time,
            need=args.need,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    plan = make_plan(inputs)
    plan["sources"] = sources
    plan["measured"] = measured
    if args.json:
        out.write(json.dumps(plan, indent=2, allow_nan=True) + "\n")
    else:
        _render(plan, args, out)
    return EXIT_OK


def measure_disk(directory: Path, *, size: int) -> dict[str, Any]:
    """Write ``size`` bytes to a test file in ``directory`` with fsync, read them back, copy memory.

    One writer and one reader, so this is a lower bound of what several ranks
    of a node reach together. The read is after ``POSIX_FADV_DONTNEED``; a
    filesystem that ignores it reads from the page cache and looks faster than
    it is. Returns bytes/s under ``write_bw``, ``read_bw``, ``copy_bw``.
    """
    size = max(size, _MEASURE_CHUNK)
    path = directory / f".stalwart-plan-measure-{uuid.uuid4().hex[:12]}"
    chunk = os.urandom(_MEASURE_CHUNK)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise UsageError(
                f"--measure {directory}: cannot create a test file ({exc.strerror or exc})"
            ) from None
        try:
            t0 = time.perf_counter()
            written = 0
            while written < size:
                written += os.write(fd, chunk[: min(_MEASURE_CHUNK, size - written)])
            os.fsync(fd)
            write_s = time.perf_counter() - t0
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = bytearray(_MEASURE_CHUNK)
            t0 = time.perf_counter()
            read = 0
            while n := os.readv(fd, [buf]):
                read += n
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    src = bytearray(min(size, 64 * 1024 * 1024))
    dst = bytearray(len(src))
    t0 = time.perf_counter()
    dst[:] = src
    copy_s = time.perf_counter() - t0
    tiny = 1e-9
    return {
        "directory": str(directory),
        "bytes": written,
        "write_bw": written / max(write_s, tiny),
        "read_bw": read / max(read_s, tiny),
        "copy_bw": len(src) / max(copy_s, tiny),
        "write_s": write_s,
        "read_s": read_s,
    }


# ----------------------------------------------------------------- rendering


def _bw(n: float) -> str:
    return format_size(n) + "/s"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 2 * 3600:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


_STRATEGY_TEXT = {
    "ddp": "DDP",
    "fsdp2": "FSDP2 (fully_shard)",
    "fsdp2-offload": "FSDP2 with CPUOffloadPolicy (or DeepSpeed ZeRO-3 with CPU offload)",
    "zero-infinity": "DeepSpeed ZeRO-Infinity (NVMe offload)",
}


def _section(console: Any, title: str, rows: list[tuple[str, str, str]]) -> None:
    console.print(f"\n{title}", markup=False, soft_wrap=True)
    table = new_table("", "value", "how", right=("value",), wrap=("how",))
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _render(plan: dict[str, Any], args: argparse.Namespace, out: TextIO) -> None:
    console = make_console(out)
    i, mem, ck, iv = plan["inputs"], plan["memory"], plan["checkpoint"], plan["interval"]
    bpp = mem["bytes_per_param"]
    console.print(
        f"plan: {args.params:,} parameters, {i['precision']} + {i['optimizer']}, "
        f"{i['gpus_per_node']} GPU(s) x {i['nodes']} node(s) of {format_size(i['gpu_memory'])}",
        markup=False,
        soft_wrap=True,
    )
    budget = mem["gpu_budget_bytes"]
    per_gpu_how = {
        "ddp": "replicated on every GPU",
        "fsdp2": f"sharded over {i['world_size']} GPUs",
    }.get(plan["strategy"], "offloaded to host memory; only the working layer is on the GPU")
    _section(
        console,
        "memory",
        [
            (
                "per parameter",
                f"{bpp['total']} B",
                f"{bpp['weights']} weights + {bpp['grads']} grads + {bpp['master']} fp32 master "
                f"+ {bpp['optimizer']} optimizer",
            ),
            ("training state", format_size(mem["state_total_bytes"]), "activations not modeled"),
            (
                "budget per GPU",
                format_size(budget),
                f"{i['usable_fraction']:.0%} of {format_size(i['gpu_memory'])}; the rest is headroom",
            ),
            ("state per GPU", format_size(mem["state_per_gpu_bytes"]), per_gpu_how),
        ]
        + (
            [("host per node", format_size(mem["host_per_node_bytes"]), "offloaded state")]
            if mem["host_per_node_bytes"] is not None
            else []
        ),
    )
    console.print(
        f"recommendation: {_STRATEGY_TEXT[plan['strategy']]}: {plan['strategy_reason']}",
        markup=False,
        soft_wrap=True,
    )
    src = plan["sources"]
    mode = "async" if ck["async_save"] else "sync"
    _section(
        console,
        "checkpoint",
        [
            (
                "size",
                format_size(ck["total_bytes"]),
                f"{ck['bytes_per_param']} B/param: fp32 weights + optimizer",
            ),
            ("per rank", format_size(ck["per_rank_bytes"]), "each rank writes its share"),
            ("per node", format_size(ck["per_node_bytes"]), ""),
            (
                "sync stall",
                _dur(ck["sync_stall_s"]),
                f"per node / write {_bw(i['write_bw'])} ({src['write_bw']})",
            ),
            (
                "async stall",
                _dur(ck["async_stall_s"]),
                f"{format_size(ck['staged_per_rank_bytes'])} staged per rank / copy "
                f"{_bw(i['copy_bw'])} ({src['copy_bw']}); needs "
                f"{format_size(ck['staging_host_memory_per_node_bytes'])} host memory per node",
            ),
            ("time to durable", _dur(ck["time_to_durable_s"]), f"{mode} save"),
            (
                "restart",
                _dur(ck["restart_s"]),
                f"{_dur(i['restart_overhead'])} + reading at {_bw(i['read_bw'])} "
                f"({src['read_bw']})",
            ),
        ],
    )
    if iv["recommended_s"] is None:
        console.print(
            "\ninterval: no MTBF given (--need resume): save on preemption (SIGTERM/SIGUSR1, "
            "handled by CheckpointManager) plus an hourly safety net",
            markup=False,
            soft_wrap=True,
        )
    else:
        steps = f" = {iv['every_steps']} steps" if iv["every_steps"] is not None else ""
        _section(
            console,
            f"interval (job MTBF {_dur(iv['mtbf_s'])}: {iv['mtbf_source']}; C = {mode} stall "
            f"{_dur(iv['cost_s'])})",
            [
                ("Young", _dur(iv["young_s"]), "sqrt(2CM), Young 1974"),
                ("Daly", _dur(iv["daly_s"]), "higher-order estimate, Daly 2006"),
                ("recommended", _dur(iv["recommended_s"]) + steps, "compute time between saves"),
                (
                    "lost per failure",
                    _dur(iv["expected_lost_per_failure_s"]),
                    "interval/2 + restart" + (" + time to durable" if ck["async_save"] else ""),
                ),
                ("failures per day", f"{iv['failures_per_day']:.3g}", ""),
                (
                    "overhead",
                    f"{iv['overhead_fraction']:.2%}",
                    "of wall time lost to saves, rework and restarts (Daly's model)",
                ),
            ],
        )
    ret = plan["retention"]
    console.print(
        f"\nretention: keep_last={ret['keep_last']}, about {format_size(ret['disk_per_run_bytes'])} of "
        f"disk. {ret['reason']}.\ntiering: {ret['tiering']}",
        markup=False,
        soft_wrap=True,
    )
    code = plan["code"]
    console.print("\ncode", markup=False, soft_wrap=True)
    for key in ("wrap", "manager", "launch"):
        for line in code[key].splitlines():
            console.print(f"  {line}", markup=False, soft_wrap=True)
    for warning in plan["warnings"]:
        console.print(f"note: {warning}", markup=False, soft_wrap=True)
