"""Preemption within its grace window: a real process, a real SIGTERM, saves of a known duration.

The script (tests/distributed/preemption_worker.py) commits through a storage
whose commit takes ``--commit-delay`` seconds, so a save's duration is known;
the test gives a grace window shorter or longer than that and reads which
action the emergency save chose from ``events.jsonl``, what was committed, and
where the next run resumes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stalwart
from stalwart.events import read_events
from stalwart.preemption import MARGIN_S, SAFETY, GraceAction, SaveTimes, plan

from .conftest import make_parts

SCRIPT = Path(__file__).parent / "distributed" / "preemption_worker.py"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run_script(run: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), "--run-dir", str(run), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def events_of(run: Path, name: str) -> list[dict]:
    return [e for e in read_events(run) if e["event"] == name]


def committed(run: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in run.glob("step_*") if p.is_dir())


# ------------------------------------------------------------------ the decision, pure


def test_plan_saves_when_flush_and_save_fit_in_the_time_left():
    d = plan(time_left_s=10.0, full_s=2.0, flush_s=1.0, in_flight=True)
    assert d.action is GraceAction.SAVE


def test_plan_flushes_only_when_the_full_save_does_not_fit_but_the_write_does():
    d = plan(time_left_s=2.0, full_s=2.0, flush_s=1.0, in_flight=True)
    assert d.action is GraceAction.FLUSH
    assert "2.00 s" in d.reason


def test_plan_skips_with_the_numbers_when_nothing_fits():
    d = plan(time_left_s=1.0, full_s=2.0, flush_s=0.0, in_flight=False)
    assert d.action is GraceAction.SKIP
    assert "2.00 s" in d.reason and "1.00 s left" in d.reason


def test_plan_margin_is_applied_at_the_boundary():
    exact = 2.0 * SAFETY + MARGIN_S
    assert plan(time_left_s=exact, full_s=2.0, flush_s=0.0, in_flight=False).action == 0
    assert plan(time_left_s=exact - 0.01, full_s=2.0, flush_s=0.0, in_flight=False).action == 2


def test_plan_tries_the_full_save_when_nothing_was_measured_or_no_window_given():
    assert plan(time_left_s=0.1, full_s=None, flush_s=0.0, in_flight=False).action == 0
    assert plan(time_left_s=None, full_s=99.0, flush_s=9.0, in_flight=True).action == 0


def test_save_times_keep_the_worst_recent_save_and_the_mean_stall():
    times = SaveTimes()
    assert times.full_s() is None and times.write_s() is None and times.stall_s() is None
    times.record(1, stall_s=0.1, total_s=1.0)
    times.record(2, stall_s=0.3, total_s=0.5)
    assert times.full_s() == 1.0
    assert times.write_s() == pytest.approx(0.9)
    assert times.stall_s() == pytest.approx(0.2)
    for step in range(3, 3 + SaveTimes.WINDOW):
        times.record(step, stall_s=0.1, total_s=0.2)
    assert times.full_s() == 0.2  # the slow first save has left the window
    assert sorted(times.committed) == list(range(3, 3 + SaveTimes.WINDOW))


@pytest.mark.parametrize("grace", [0, -1.0, "30", True, float("nan"), float("inf")])
def test_grace_seconds_must_be_a_positive_number(tmp_path, grace):
    with pytest.raises(ValueError, match=r"grace_seconds must be .* got"):
        stalwart.CheckpointManager(tmp_path, grace_seconds=grace)


def test_a_signal_is_handled_by_the_next_save_in_process(tmp_path):
    """In-process: the measured save times feed the decision; a long window saves."""
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path, every_steps=2, grace_seconds=60) as ckpt:
        assert ckpt.save(2, p.state)
        os.kill(os.getpid(), signal.SIGTERM)
        assert not ckpt.preempted
        assert ckpt.save(3, p.state)
        assert ckpt.preempted
    (event,) = events_of(tmp_path, "preemption")
    assert event["action"] == "save" and event["step"] == 3
    assert event["save_estimate_s"] is not None and event["time_left_s"] <= 60


# ------------------------------------------------------------------ real processes


def test_sigterm_with_a_grace_shorter_than_a_save_skips_it_and_says_why(tmp_path):
    run = tmp_path / "run"
    args = ["--every", "2", "--commit-delay", "1.0", "--grace", "0.6"]
    proc = run_script(run, *args, "--term-after-step", "5")
    assert proc.returncode == 143, proc.stdout + proc.stderr[-3000:]
    assert "rank 0 preempted at step 6" in proc.stdout
    (skipped,) = events_of(run, "preemption_skipped")
    assert skipped["step"] == 6 and skipped["action"] == "skip"
    assert skipped["save_estimate_s"] >= 1.0 and skipped["time_left_s"] <= 0.6
    assert "does not" in skipped["reason"] and "fit" in skipped["reason"]
    assert committed(run) == [2, 4]  # nothing half-written, the last checkpoint kept
    resumed = run_script(run, "--every", "2", "--steps", "8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "rank 0 start 4" in resumed.stdout


def test_sigterm_with_a_grace_longer_than_a_save_writes_the_emergency_checkpoint(tmp_path):
    run = tmp_path / "run"
    args = ["--every", "2", "--commit-delay", "1.0", "--grace", "30"]
    proc = run_script(run, *args, "--term-after-step", "5")
    assert proc.returncode == 143, proc.stdout + proc.stderr[-3000:]
    (event,) = events_of(run, "preemption")
    assert event["action"] == "save" and event["step"] == 6
    saves = {e["step"]: e for e in events_of(run, "save")}
    assert saves[6]["emergency"] and saves[6]["total_s"] >= 1.0
    assert committed(run) == [2, 4, 6]
    resumed = run_script(run, "--every", "2", "--steps", "8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "rank 0 start 6" in resumed.stdout


def test_async_grace_that_fits_the_inflight_write_but_not_a_save_flushes_it(tmp_path):
    """The write of step 4 is in flight at the signal: it is finished, step 5 is not saved."""
    run = tmp_path / "run"
    args = ["--every", "1", "--async-save", "--commit-delay", "1.0", "--grace", "2.0"]
    proc = run_script(run, *args, "--steps", "8", "--term-after-step", "4")
    assert proc.returncode == 143, proc.stdout + proc.stderr[-3000:]
    (event,) = events_of(run, "preemption")
    assert event["action"] == "flush" and event["step"] == 5, event
    assert event["in_flight"] and event["last_saved_step"] == 4
    assert not events_of(run, "preemption_skipped")
    assert committed(run) == [1, 2, 3, 4]


def test_async_grace_longer_than_flush_and_save_writes_both(tmp_path):
    run = tmp_path / "run"
    args = ["--every", "1", "--async-save", "--commit-delay", "1.0", "--grace", "30"]
    proc = run_script(run, *args, "--steps", "8", "--term-after-step", "4")
    assert proc.returncode == 143, proc.stdout + proc.stderr[-3000:]
    (event,) = events_of(run, "preemption")
    assert event["action"] == "save" and event["in_flight"]
    assert committed(run) == [1, 2, 3, 4, 5]
    assert [e["step"] for e in events_of(run, "save") if e["emergency"]] == [5]


# ------------------------------------------------------- DataLoader workers and killpg


def preempt_group(run: Path, *args: str) -> tuple[subprocess.Popen[str], str, str]:
    """Start the script in its own process group, SIGTERM the whole group once it trains."""
    ready = run.parent / "ready"
    cmd = [sys.executable, str(SCRIPT), "--run-dir", str(run), "--ready-file", str(ready)]
    cmd += ["--steps", "100000", "--every", "100000", "--workers", "2", "--step-sleep", "0.02"]
    cmd += ["--iter-early"]
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the script did not start training"
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGTERM)  # as torchrun and SLURM do: the rank and its workers
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, out, err


@pytest.mark.parametrize("loader", ["resumable", "plain-shielded"])
def test_workers_survive_sigterm_to_the_process_group_until_the_emergency_save(tmp_path, loader):
    run = tmp_path / "run"
    proc, out, err = preempt_group(run, "--loader", loader)
    assert proc.returncode == 143, out + err[-3000:]
    assert "rank 0 workers alive 2" in out, out
    saves = events_of(run, "save")
    assert len(saves) == 1 and saves[0]["emergency"], saves
    assert committed(run) == [saves[0]["step"]]


def test_unshielded_workers_die_of_a_group_sigterm_and_the_emergency_save_is_lost(tmp_path):
    """The failure the shield prevents (and proof that the test above reaches the workers)."""
    run = tmp_path / "run"
    proc, out, err = preempt_group(run, "--loader", "plain")
    assert proc.returncode not in (0, 143), out
    assert "killed by signal" in err, err[-3000:]
    assert committed(run) == []
