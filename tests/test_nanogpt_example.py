"""examples/nanogpt.py in one process: SIGKILLed and resumed, with and without the porting fix.

The fixed loop resumes bit-exactly and the certificate says so; the naive port
(nanoGPT's prefetched batch) resumes on other data and the certificate names
the first redone step, where it starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from stalwart.events import read_events

from .conftest import assert_same

REPO = Path(__file__).resolve().parents[1]
NANOGPT = REPO / "examples" / "nanogpt.py"
STEPS, EVERY, CRASH = "30", "10", "25"


def nanogpt(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "PYTHONWARNINGS": "ignore:torch.distributed is disabled:UserWarning",
    }
    cmd = [sys.executable, str(NANOGPT), "--steps", STEPS, "--every", EVERY, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def crash_and_resume(run: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    crashed = nanogpt("--run-dir", run, "--crash-at", CRASH, *flags)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    resumed = nanogpt("--run-dir", run, "--out", out, *flags)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "start 20" in resumed.stdout, resumed.stdout
    return resumed


def verdicts(run: Path) -> list[dict]:
    return [e for e in read_events(run) if str(e.get("event", "")).startswith("resume_")]


def test_fixed_port_resumes_bit_exact_and_the_certificate_says_verified(tmp_path: Path) -> None:
    ref = nanogpt("--run-dir", tmp_path / "ref", "--out", tmp_path / "ref.pt", "--fixed")
    assert ref.returncode == 0, ref.stderr
    resumed = crash_and_resume(tmp_path / "run", tmp_path / "res.pt", "--fixed")

    a = torch.load(f"{tmp_path}/ref.pt.rank0", weights_only=False)
    b = torch.load(f"{tmp_path}/res.pt.rank0", weights_only=False)
    losses = b.pop("losses")
    assert sorted(losses) == list(range(21, 31))
    assert all(losses[s] == a["losses"][s] for s in losses)
    a.pop("losses")
    assert_same(a, b)
    # The crashed process recorded steps 21..24 (it died before its save of 25).
    assert "nanogpt: resume verified exact through step 24 on 1 rank" in resumed.stdout
    (verdict,) = verdicts(tmp_path / "run")
    assert verdict["event"] == "resume_verified"
    assert (verdict["restored_step"], verdict["through"]) == (20, 24)


def test_naive_port_is_reported_diverged_at_the_first_redone_step(tmp_path: Path) -> None:
    ref = nanogpt("--run-dir", tmp_path / "ref", "--out", tmp_path / "ref.pt")
    assert ref.returncode == 0, ref.stderr
    resumed = crash_and_resume(tmp_path / "run", tmp_path / "res.pt")

    # The certificate is right: the resumed run really trained on other data.
    a = torch.load(f"{tmp_path}/ref.pt.rank0", weights_only=False)
    b = torch.load(f"{tmp_path}/res.pt.rank0", weights_only=False)
    assert b["losses"][21] != a["losses"][21]
    assert not torch.equal(a["model"]["tok.weight"], b["model"]["tok.weight"])

    (verdict,) = verdicts(tmp_path / "run")
    assert verdict["event"] == "resume_diverged", json.dumps(verdict)
    assert (verdict["step"], verdict["rank"], verdict["rng"]) == (21, 0, "different")
    assert (verdict["before"], verdict["after"]) == (a["losses"][21], b["losses"][21])
    assert "batch drawn before the save" in verdict["message"]
    assert "resume diverged at step 21 on rank 0: loss" in resumed.stdout
    assert "resume diverged at step 21" in resumed.stderr  # the logged warning
