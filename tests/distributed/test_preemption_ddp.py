"""Preemption of a DDP job under real torchrun (2 ranks, gloo on CPU): SIGTERM to torchrun.

torchrun forwards the signal to each rank's process group (the rank and its
DataLoader workers) and SIGKILLs them 30 s later. The ranks agree on the
emergency action in ``save`` and do the same thing; their workers survive
until the emergency save is done.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stalwart.events import read_events

from ..support.torchrun import ok, starts, torchrun

SCRIPT = Path(__file__).with_name("preemption_worker.py")


def preempt_torchrun(run: Path, *args: str) -> tuple[int, str, str]:
    """Run 2 DDP ranks under torchrun; SIGTERM torchrun once a regular save is committed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["--monitor-interval=0.2", str(SCRIPT), "--run-dir", str(run), "--steps", "100000"]
    cmd += ["--every", "2", "--workers", "1", "--iter-early", "--step-sleep", "0.05", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and agent.poll() is None:
            if (run / "events.jsonl").exists() and any(
                e["event"] == "save" for e in read_events(run)
            ):
                break
            time.sleep(0.1)
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=90)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    return agent.returncode, out, err


def committed(run: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in run.glob("step_*") if p.is_dir())


def test_sigterm_to_torchrun_with_a_long_grace_saves_on_every_rank_and_resumes(tmp_path):
    run = tmp_path / "run"
    _, out, err = preempt_torchrun(run, "--async-save", "--commit-delay", "1.0", "--grace", "30")
    assert "rank 0 preempted" in out and "rank 1 preempted" in out, out + err[-3000:]
    assert "rank 0 workers alive 1" in out and "rank 1 workers alive 1" in out, out
    (event,) = [e for e in read_events(run) if e["event"] == "preemption"]
    assert event["action"] == "save"
    emergency = [e["step"] for e in read_events(run) if e["event"] == "save" and e["emergency"]]
    assert emergency == [event["step"]] and committed(run)[-1] == event["step"]
    step = event["step"]
    resumed = ok(torchrun(2, "--run-dir", str(run), "--steps", str(step + 2), script=SCRIPT))
    assert starts(resumed) == [step, step], resumed.stdout


def test_sigterm_to_torchrun_with_a_grace_shorter_than_a_save_skips_on_every_rank(tmp_path):
    run = tmp_path / "run"
    _, out, err = preempt_torchrun(run, "--commit-delay", "1.0", "--grace", "0.5")
    assert "rank 0 preempted" in out and "rank 1 preempted" in out, out + err[-3000:]
    (skipped,) = [e for e in read_events(run) if e["event"] == "preemption_skipped"]
    assert skipped["save_estimate_s"] >= 1.0 and skipped["time_left_s"] <= 0.5
    assert not [e for e in read_events(run) if e["event"] == "save" and e["emergency"]]
    assert committed(run) and all(s % 2 == 0 for s in committed(run))
    assert not list(run.glob(".step_*"))  # nothing was started and left half-written
