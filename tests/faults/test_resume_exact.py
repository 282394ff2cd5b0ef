"""A run SIGKILLed anywhere resumes bit-for-bit like one that was never stopped.

Real processes, real SIGKILL, 2 DataLoader workers with random augmentation,
dropout, AdamW, StepLR and GradScaler. Compared at the end: parameters,
optimizer state, scheduler, scaler, data position, user extras, every RNG
stream and the next batch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import assert_same

SCRIPT = Path(__file__).with_name("train_script.py")
STEPS = 30


def _run(run_dir: Path, out: Path, *extra: str, expect_kill: bool = False) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--run-dir",
            str(run_dir),
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    if expect_kill:
        assert proc.returncode == -9, (
            f"expected SIGKILL, got {proc.returncode}\n{proc.stderr[-3000:]}"
        )
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("reference")
    _run(d / "run", d / "final.pt", "--num-workers", "2")
    return torch.load(d / "final.pt", weights_only=False)


@pytest.mark.parametrize(
    ("first", "second", "resume_at"),
    [
        # killed after step 13's update, before its save: mid-epoch (11 batches per epoch)
        (["--kill-after-step", "13"], ["--num-workers", "2"], 12),
        # same crash, resumed with another worker count
        (["--kill-after-step", "13", "--num-workers", "2"], ["--num-workers", "0"], 12),
        # killed at an epoch boundary, resumed with 1 worker
        (["--kill-after-step", "23", "--num-workers", "0"], ["--num-workers", "1"], 20),
        # killed while the step-16 checkpoint is being written
        (["--kill-in-save", "16", "--kill-delay", "0.005"], ["--num-workers", "2"], None),
        # async save in flight when killed
        (["--kill-in-save", "20", "--async-save", "--kill-delay", "0.0"], ["--async-save"], None),
    ],
    ids=["mid-epoch", "workers-2-to-0", "epoch-boundary", "mid-save", "mid-async-save"],
)
def test_killed_run_resumes_exactly(
    tmp_path: Path, reference: dict, first, second, resume_at
) -> None:
    run = tmp_path / "run"
    _run(run, tmp_path / "never.pt", *first, expect_kill=True)
    out = _run(run, tmp_path / "final.pt", *second)
    start = int(out.split("start ", 1)[1].split()[0])
    if resume_at is not None:
        assert start == resume_at
    else:
        assert start > 0
    assert_same(reference, torch.load(tmp_path / "final.pt", weights_only=False))


def test_the_comparison_detects_a_lost_step(tmp_path: Path, reference: dict) -> None:
    """A run that skips one step must not compare equal (the check above can fail)."""
    _run(tmp_path / "run", tmp_path / "short.pt", "--steps", str(STEPS - 1))
    with pytest.raises(AssertionError):
        assert_same(reference, torch.load(tmp_path / "short.pt", weights_only=False))
