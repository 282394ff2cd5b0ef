"""The exact-resume certificate and the failure reports with real ranks (gloo on CPU).

examples/nanogpt.py under torchrun x2 (DDP) has rank 1 SIGKILLed and torchrun
restart both ranks: with the porting guide's fix the run ends bit-identical to
an uninterrupted one and the ranks agree that the resume is verified; without
it they report where it diverged. FSDP2 (tests/distributed/worker.py) gets the
same verdict. A save on the surviving rank of a job whose peer was SIGKILLed
says so in one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from stalwart.events import read_events

from ..conftest import assert_same
from ..support.torchrun import launch_ranks, ok, torchrun

REPO = Path(__file__).resolve().parents[2]
NANOGPT = REPO / "examples" / "nanogpt.py"


def nanogpt_torchrun(*args: str | Path, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--max-restarts={restarts}", "--monitor-interval=0.2", str(NANOGPT),
        "--steps", "30", "--every", "10", *map(str, args),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def verdicts(run: Path) -> list[dict]:
    return [e for e in read_events(run) if str(e.get("event", "")).startswith("resume_")]


def test_ddp_fixed_port_resumes_bit_exact_and_is_verified_on_both_ranks(tmp_path: Path) -> None:
    ok(nanogpt_torchrun("--run-dir", tmp_path / "ref", "--out", tmp_path / "ref.pt", "--fixed"))
    proc = ok(
        nanogpt_torchrun(
            "--run-dir",
            tmp_path / "run",
            "--out",
            tmp_path / "res.pt",
            "--fixed",
            "--crash-at",
            "25",
            "--crash-rank",
            "1",
            restarts=1,
        )
    )
    assert "nanogpt rank 1: step 25 done, SIGKILL before its save" in proc.stdout
    assert proc.stdout.count("attempt 1: start 20") == 2, proc.stdout
    for rank in (0, 1):
        a = torch.load(f"{tmp_path}/ref.pt.rank{rank}", weights_only=False)
        b = torch.load(f"{tmp_path}/res.pt.rank{rank}", weights_only=False)
        losses = b.pop("losses")
        assert losses and all(losses[s] == a["losses"][s] for s in losses), rank
        a.pop("losses")
        assert_same(a, b, f"rank{rank}")
    # Rank 0 recorded step 25 (it was in that step's save when rank 1 died).
    assert "nanogpt: resume verified exact through step 25 on 2 ranks" in proc.stdout
    (verdict,) = verdicts(tmp_path / "run")
    assert (verdict["event"], verdict["through"], verdict["world_size"]) == (
        "resume_verified", 25, 2,
    )  # fmt: skip


def test_ddp_naive_port_is_reported_diverged(tmp_path: Path) -> None:
    proc = ok(
        nanogpt_torchrun(
            "--run-dir", tmp_path / "run", "--crash-at", "25", "--crash-rank", "1", restarts=1
        )
    )
    (verdict,) = verdicts(tmp_path / "run")
    assert verdict["event"] == "resume_diverged"
    assert (verdict["step"], verdict["rank"], verdict["rng"]) == (21, 0, "different")
    assert "resume diverged at step 21 on rank 0" in proc.stdout


def test_fsdp2_resume_is_verified(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(
        torchrun(
            2,
            "--kind",
            "fsdp",
            "--run-dir",
            str(run),
            "--kill-rank",
            "1",
            "--kill-after-step",
            "10",
            restarts=1,
        )
    )
    (verdict,) = verdicts(run)
    assert verdict["event"] == "resume_verified", verdict
    assert (verdict["restored_step"], verdict["world_size"]) == (8, 2)
    assert verdict["through"] >= 9


_PEER_DIES = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import stalwart

    rank, world = stalwart.init_distributed("gloo", timeout=60)
    state = stalwart.TrainState(model=torch.nn.Linear(2, 2))
    try:
        with stalwart.CheckpointManager(sys.argv[1], every_steps=10, save_timeout=30) as ckpt:
            for step in range(1, 20):
                if rank == 1 and step == 5:
                    os.kill(os.getpid(), signal.SIGKILL)
                ckpt.save(step, state)
    finally:
        stalwart.shutdown_distributed()
    """
)


def test_a_save_after_a_peer_was_sigkilled_says_so_in_one_line(tmp_path: Path) -> None:
    """Step 5 is not due (every 10): the error must not claim that saving it failed."""
    script = tmp_path / "peer_dies.py"
    script.write_text(_PEER_DIES)
    run = tmp_path / "run"
    (code0, _, err0), (code1, _, _) = launch_ranks(script, str(run))
    assert code1 == -signal.SIGKILL
    assert code0 == 1, err0
    last = err0.strip().splitlines()[-1]
    # The uncaught error's line (torch prefixes a rank's stderr with "[rank0]: ").
    assert "stalwart.errors.CheckpointSaveError: rank 1 is gone (" in last, err0
    assert "the job must restart" in last
    assert "step 5" not in last and "saving step" not in err0
    # One exception, not a chain of three.
    assert err0.count("Traceback (most recent call last)") == 1, err0
    assert "direct cause" not in err0 and "During handling" not in err0, err0
    (failed,) = [e for e in read_events(run) if e["event"] == "save_failed"]
    assert failed["step"] is None and failed["error"].startswith("rank 1 is gone (")
