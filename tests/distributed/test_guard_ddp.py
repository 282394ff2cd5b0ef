"""The guard on two real DDP ranks (gloo on CPU, torchrun): a NaN only rank 1 sees moves both.

Rank 0's loss is finite at the injected step; only the guard's one all-reduce
tells it that rank 1's is not. Had rank 0 applied the step while rank 1 skipped
it, their DDP replicas would differ at the end: the digests say they do not.
"""

from __future__ import annotations

import re
from pathlib import Path

from stalwart.events import read_events

from ..support.torchrun import ok, torchrun

WORKER = Path(__file__).parent / "guard_worker.py"


def reports(stdout: str, rank: int) -> tuple[list[str], dict[str, str]]:
    """(decision lines, the done line's fields) of one rank."""
    decisions = re.findall(rf"^rank {rank} (step \d+ .*)$", stdout, re.MULTILINE)
    (done,) = re.findall(
        rf"^rank {rank} done digest (\w+) checks (\d+) collectives (\d+)", stdout, re.MULTILINE
    )
    return decisions, dict(zip(("digest", "checks", "collectives"), done, strict=True))


def test_a_nan_on_one_rank_makes_both_skip_the_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(
        torchrun(2, "--run-dir", str(run), "--nan-rank", "1", "--nan-step", "7", script=WORKER)
    )
    (d0, done0), (d1, done1) = reports(proc.stdout, 0), reports(proc.stdout, 1)
    assert d0 == d1 == ["step 7 skip nonfinite_loss restored None skipped None"]
    assert done0["digest"] == done1["digest"]
    # One all-reduce per check, on every rank: 16 steps, none redone.
    assert done0["checks"] == done0["collectives"] == done1["collectives"] == "16"
    (event,) = [e for e in read_events(run) if e["event"] == "guard"]
    assert (event["step"], event["action"], event["reason"]) == (7, "skip", "nonfinite_loss")
    (flagged,) = event["ranks"]
    assert flagged["rank"] == 1 and flagged["reasons"] == ["nonfinite_loss"]


def test_a_nan_on_one_rank_rolls_both_back_past_the_same_window(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(
        torchrun(
            2,
            "--run-dir",
            str(run),
            "--nan-rank",
            "1",
            "--nan-step",
            "7",
            "--on-nonfinite",
            "rollback",
            script=WORKER,
        )
    )
    (d0, done0), (d1, done1) = reports(proc.stdout, 0), reports(proc.stdout, 1)
    window = "{'from': {'epoch': 0, 'consumed': 16}, 'to': {'epoch': 0, 'consumed': 28}"
    assert (
        d0 == d1 == [f"step 7 rollback nonfinite_loss restored 4 skipped {window}, 'samples': 12}}"]
    )
    assert done0["digest"] == done1["digest"]
    # Steps 5-7 ran twice: 16 + 3 checks, each one all-reduce.
    assert done0["checks"] == done0["collectives"] == done1["collectives"] == "19"
    (event,) = [e for e in read_events(run) if e["event"] == "guard"]
    assert (event["action"], event["restored_step"], event["skipped"]["samples"]) == (
        "rollback", 4, 12,
    )  # fmt: skip
    assert [r["rank"] for r in event["ranks"]] == [1]
    verdicts = [e["event"] for e in read_events(run) if e["event"].startswith("resume_")]
    assert verdicts == []  # a rollback is no resume: nothing to verify, nothing diverged
