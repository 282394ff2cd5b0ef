"""Preemption within its grace window: a real process, a real SIGTERM, saves of a known duration.

The script (tests/distributed/preemption_worker.py) commits through a storage
whose commit takes ``--commit-delay`` seconds, so a save's duration is known;
the test gives a grace window shorter or longer than that and reads which
action the emergency save chose from ``events.jsonl``, what was committed, and
where the next run resumes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import stalwart
from stalwart.events import read_events
from stalwart.preemption import MARGIN_S, SAFETY, GraceAction, SaveTimes, plan
from stalwart.signals import shielded_worker_init

from .conftest import make_parts
from .distributed.preemption_worker import SlowCommit

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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_is_handled_by_the_next_save_in_process(tmp_path, signum):
    """In-process: the measured save times feed the decision; a long window saves."""
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path, every_steps=2, grace_seconds=60) as ckpt:
        assert ckpt.save(2, p.state)
        os.kill(os.getpid(), signum)
        assert not ckpt.preempted
        assert ckpt.save(3, p.state)
        assert ckpt.preempted
    (event,) = events_of(tmp_path, "preemption")
    assert event["action"] == "save" and event["step"] == 3
    assert event["save_estimate_s"] is not None and event["time_left_s"] <= 60


def test_a_signal_before_any_save_was_measured_tries_the_full_save(tmp_path):
    """Nothing measured, a tiny window: the full save is tried (nothing to lose on disk)."""
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path, every_steps=100, grace_seconds=0.001) as ckpt:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the window is already over
        assert ckpt.save(1, p.state) and ckpt.preempted
    (event,) = events_of(tmp_path, "preemption")
    assert event["action"] == "save" and event["save_estimate_s"] is None
    assert "no save measured yet" in event["reason"] and event["time_left_s"] < 0
    assert committed(tmp_path) == [1]


def test_the_most_cautious_vote_wins_and_the_event_says_another_rank_chose_it(tmp_path):
    """Ranks all-reduce their ``GraceAction`` with max: a skip anywhere skips everywhere."""
    assert GraceAction.SAVE < GraceAction.FLUSH < GraceAction.SKIP
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path, every_steps=100, grace_seconds=60) as ckpt:
        assert ckpt.save(1, p.state, force=True)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt._grace.vote() == GraceAction.SAVE  # this rank alone would save
        assert not ckpt._grace.carry_out(max(ckpt._grace.vote(), GraceAction.SKIP), 2)
    (skipped,) = events_of(tmp_path, "preemption_skipped")
    assert skipped["action"] == "skip" and skipped["reason"].startswith("another rank chose skip")
    assert committed(tmp_path) == [1]


class TermDuringCommit(SlowCommit):
    """Sends this process a second SIGTERM while the (emergency) checkpoint commits."""

    def commit(self, staging: Path, step: int, manifest_json: str) -> Path:
        os.kill(os.getpid(), signal.SIGTERM)
        return super().commit(staging, step, manifest_json)


def test_a_second_sigterm_during_the_emergency_save_neither_kills_nor_repeats_it(tmp_path):
    p = make_parts()
    slow = TermDuringCommit(str(tmp_path), 0.05)
    with stalwart.CheckpointManager(
        tmp_path, every_steps=100, grace_seconds=30, storage=slow
    ) as ckpt:
        os.kill(os.getpid(), signal.SIGTERM)
        arrived = ckpt._signals.arrived
        assert ckpt.save(1, p.state) and ckpt.preempted  # the handler took the second one
        assert ckpt._signals.arrived == arrived  # the window still runs from the first
    (event,) = events_of(tmp_path, "preemption")
    assert event["step"] == 1
    assert [e["step"] for e in events_of(tmp_path, "save")] == [1]
    assert committed(tmp_path) == [1]


def test_two_managers_in_one_process_both_see_the_signal(tmp_path):
    """The second manager's handlers replace the first's: both flags must still be set."""
    p = make_parts()
    with (
        stalwart.CheckpointManager(tmp_path / "a", every_steps=100) as a,
        stalwart.CheckpointManager(tmp_path / "b", every_steps=100) as b,
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        assert b.save(1, p.state) and b.preempted
        assert a.save(1, p.state) and a.preempted
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_closing_the_first_of_two_managers_leaves_the_second_its_handlers(tmp_path):
    """Closed out of order, the first must not put SIGTERM's default (death) back under the second."""
    p = make_parts()
    a = stalwart.CheckpointManager(tmp_path / "a", every_steps=100)
    with stalwart.CheckpointManager(tmp_path / "b", every_steps=100) as b:
        a.close()
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
        assert b.save(1, p.state) and b.preempted
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


_INIT_MARK = multiprocessing.Value("i", 0)


def mark_worker(worker_id: int) -> None:
    with _INIT_MARK.get_lock():
        _INIT_MARK.value += 1 + worker_id


def test_the_users_worker_init_fn_still_runs_in_every_shielded_worker():
    _INIT_MARK.value = 0
    loader = stalwart.ResumableDataLoader(
        list(range(8)), batch_size=2, shuffle=False, seed=0, num_workers=2,
        worker_init_fn=mark_worker, multiprocessing_context="fork",
    )  # fmt: skip
    assert sum(len(b) for b in loader) == 8
    assert _INIT_MARK.value == 1 + 2  # workers 0 and 1 both ran it


_SHIELD_THREADS = multiprocessing.Value("i", 0)


def count_shields(worker_id: int) -> None:
    shields = [t for t in threading.enumerate() if t.name == "stalwart-shield"]
    with _SHIELD_THREADS.get_lock():
        _SHIELD_THREADS.value = max(_SHIELD_THREADS.value, len(shields))


def test_a_worker_shielded_twice_has_one_signal_reader():
    """A plain loader's ``shielded_worker_init`` given to ``ResumableDataLoader`` (which shields too)."""
    _SHIELD_THREADS.value = 0
    loader = stalwart.ResumableDataLoader(
        list(range(4)), batch_size=2, shuffle=False, seed=0, num_workers=1,
        worker_init_fn=shielded_worker_init(count_shields), multiprocessing_context="fork",
    )  # fmt: skip
    assert sum(len(b) for b in loader) == 4
    assert _SHIELD_THREADS.value == 1


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
    """The write of step 4 is in flight at the signal: it is finished, step 5 is not saved.

    A commit of D = 2 s and a window of 2 D: the flush (~D, needs 1.25 D + 0.25) and
    flush plus save (~2 D, needs 2.5 D + 0.25) are each about 1 s away from the window,
    so a slow write or a slow step on a loaded machine does not change the decision.
    """
    run = tmp_path / "run"
    args = ["--every", "1", "--async-save", "--commit-delay", "2.0", "--grace", "4.0"]
    proc = run_script(run, *args, "--steps", "8", "--term-after-step", "4")
    assert proc.returncode == 143, proc.stdout + proc.stderr[-3000:]
    (event,) = events_of(run, "preemption")
    assert event["action"] == "flush" and event["step"] == 5, event
    assert event["in_flight"] and event["last_saved_step"] == 4
    assert event["save_estimate_s"] >= 2.0 and event["time_left_s"] <= 4.0
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
