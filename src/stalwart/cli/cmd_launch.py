"""``stalwart launch``: torchrun with defaults that make a run survive failures.

A thin wrapper over ``torch.distributed.run`` (torchrun): it adds no launcher
logic of its own, it only fills in the options people forget (restarts, a
rendezvous that works on one node and on many, a log directory beside the run)
and then replaces itself with torchrun, so signals reach torchrun directly.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any, TextIO

from stalwart.cli.common import EXIT_OK, UsageError

__all__ = ["add_parser", "build_command", "run"]

EPILOG = """\
examples:
  stalwart launch --nproc-per-node 2 train.py --lr 3e-4
  stalwart launch --nnodes 2 --rdzv-endpoint node0:29500 --nproc-per-node 8 train.py
  stalwart launch --dry-run --nproc-per-node 4 train.py     # print the torchrun command

Defaults: --max-restarts 3 (torch elastic restarts every worker when one dies;
the script resumes from its newest committed checkpoint), --standalone for one
node (a free port, no rendezvous server to set up), c10d rendezvous with
--rdzv-id stalwart for several nodes, --monitor-interval 1. With --run-dir,
per-rank logs go to RUN/logs. Everything after the script name is passed to the
script unchanged.

exit status: the exit status of torchrun (0 when every worker finished),
2 for usage errors.
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "launch",
        help="run a training script under torchrun with restart-friendly defaults",
        description=textwrap.fill(
            "Start a training script with torch.distributed.run (torchrun), filling in "
            "restart and rendezvous defaults, then hand the process over to torchrun.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nproc-per-node", default="1", help="workers per node (default 1; 'gpu' for one per GPU)"
    )
    parser.add_argument(
        "--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic (default 1)"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="worker-group restarts (default 3)"
    )
    parser.add_argument(
        "--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (several nodes)"
    )
    parser.add_argument("--rdzv-id", default="stalwart", help="rendezvous id shared by all nodes")
    parser.add_argument("--run-dir", default=None, help="write per-rank logs to RUN_DIR/logs")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the torchrun command and exit"
    )
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(func=run)


def build_command(args: argparse.Namespace) -> list[str]:
    """The full ``python -m torch.distributed.run ...`` command line for ``args``."""
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    script = Path(args.script)
    if not script.is_file():
        raise UsageError(f"{script}: no such training script")
    single_node = args.nnodes in ("1", "1:1") and args.rdzv_endpoint is None
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if single_node:
        cmd.append("--standalone")
    else:
        if args.rdzv_endpoint is None:
            raise UsageError(
                "--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the same on every node)"
            )
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
        ]
    cmd += [
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--max-restarts={args.max_restarts}",
        "--monitor-interval=1",
    ]
    if args.run_dir is not None:
        # Keep each rank's output per attempt, and still show it on the console.
        cmd += [f"--log-dir={Path(args.run_dir) / 'logs'}", "--redirects=3", "--tee=3"]
    return [*cmd, str(script), *args.script_args]


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    cmd = build_command(args)
    if args.dry_run:
        out.write(shlex.join(cmd) + "\n")
        return EXIT_OK
    out.flush()
    err.flush()
    os.execv(cmd[0], cmd)
    raise AssertionError("unreachable: execv returned")  # pragma: no cover
