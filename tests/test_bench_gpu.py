"""``benchmarks/gpu.sh --dry-run``: the GPU script's code paths run on the CPU and report every line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_script_runs_every_check_and_measurement_on_the_cpu() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh"), "--dry-run", "--size", "4", "--repeats", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    checks = (
        "pinned staging",
        "per-device RNG",
        "DDP save/restore",
        "FSDP2 save/restore",
        "exact resume",
    )
    for check in checks:
        assert any(line.startswith(f"PASS {check}:") for line in lines), (check, proc.stdout)
    ratios = [line for line in lines if line.startswith("RATIO ")]
    assert len(ratios) == 3 and all("x (" in line for line in ratios), proc.stdout
    assert not any(line.startswith("FAIL") for line in lines), proc.stdout


def test_without_a_gpu_the_script_fails_and_says_how_to_self_check() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "--dry-run" in proc.stdout
