"""``stalwart launch``: torchrun with restart defaults, and a real run through it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.cli.main import main

WORKER = Path(__file__).with_name("worker.py")


def test_dry_run_prints_a_standalone_torchrun_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--nproc-per-node", "2", str(WORKER), "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "-m torch.distributed.run --standalone" in out
    assert "--max-restarts=3" in out and "--nproc-per-node=2" in out
    assert out.rstrip().endswith(f"{WORKER} --steps 4")


def test_multi_node_needs_a_rendezvous_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--nnodes", "2", str(WORKER)]) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err
    assert (
        main(["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "h:1", str(WORKER)]) == 0
    )
    assert "--rdzv-backend=c10d --rdzv-endpoint=h:1 --rdzv-id=stalwart" in capsys.readouterr().out


def test_missing_script_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["launch", str(tmp_path / "nope.py")]) == 2
    assert "no such training script" in capsys.readouterr().err


def test_launch_restarts_a_killed_rank_and_the_run_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        str(Path(sys.executable).with_name("stalwart")),
        "launch",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(run),
        str(WORKER),
        "--run-dir",
        str(run),
        "--steps",
        "12",
        "--kill-rank",
        "0",
        "--kill-after-step",
        "6",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run / "step_000000012" / "MANIFEST.json").exists()
    logs = "".join(p.read_text() for p in (run / "logs").rglob("stdout.log"))
    assert "start 4" in logs  # the restarted workers resumed from step 4
