"""Running tests/distributed/worker.py under real torchrun, and reading what it reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

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


def launch_ranks(
    script: Path, *args: str, world: int = 2, timeout: float = 120
) -> list[tuple[int | None, str, str]]:
    """``script`` as ``world`` ranks without torchrun (whose agent would stop every
    rank once one died, where a test wants to see how the others fail): each rank's
    (return code, stdout, stderr)."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False)
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[2] / "src"),
        "PYTHONUNBUFFERED": "1",
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_RUN_ID": f"ranks-{os.getpid()}-{store.port}",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    del store  # kept until every rank ended: it is their rendezvous
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


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
