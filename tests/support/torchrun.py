"""Running tests/distributed/worker.py under real torchrun, and reading what it reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).parents[1] / "distributed" / "worker.py"
"""The DDP / FSDP2 training worker every torchrun test launches."""


def torchrun(
    nproc: int, *args: str, restarts: int = 0, timeout: float = 240, script: Path = WORKER
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone`` of ``script`` (the test worker by default) with ``args``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.2",
        str(script),
        *args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def final(path: Path, nproc: int) -> dict:
    out = torch.load(path, weights_only=False)
    out["per_rank"] = [torch.load(f"{path}.rank{r}", weights_only=False) for r in range(nproc)]
    return out


def starts(proc: subprocess.CompletedProcess[str]) -> list[int]:
    """The step each rank started from, in order of its ``rank R start S`` report."""
    return [int(step) for step in re.findall(r"rank \d+ start (\d+)", proc.stdout)]
