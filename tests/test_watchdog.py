"""The hang watchdog in one process: stacks on disk, an event, a non-zero exit; heartbeats keep it quiet."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.events import read_events
from stalwart.layout import WATCHDOG_DIR
from tests.support.docs import run_section_example

from .conftest import cli

REPO = Path(__file__).resolve().parents[1]

_HANGS = textwrap.dedent(
    """
    import sys, time
    import torch
    import stalwart

    def stuck_in_user_code():
        time.sleep(3600)

    state = stalwart.TrainState(model=torch.nn.Linear(2, 2))
    with stalwart.CheckpointManager(sys.argv[1], every_steps=2) as ckpt:
        with stalwart.Watchdog(ckpt, timeout=1.0, grace=0.2):
            for step in range(1, 4):
                ckpt.save(step, state)
            print("hanging", flush=True)
            stuck_in_user_code()
    """
)

_HANGS_IN_LOGGING = textwrap.dedent(
    """
    import logging, sys, time
    import torch
    import stalwart

    logging.basicConfig(level=logging.INFO)
    handler = logging.getLogger().handlers[0]
    state = stalwart.TrainState(model=torch.nn.Linear(2, 2))
    with stalwart.CheckpointManager(sys.argv[1]) as ckpt:
        with stalwart.Watchdog(ckpt, timeout=1.0, grace=0.5):
            ckpt.save(1, state)
            handler.acquire()  # as a thread stuck writing a log line to a full pipe would
            time.sleep(3600)
    """
)


def run_script(tmp_path: Path, source: str, run: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(script), str(run)], capture_output=True, text=True, env=env, timeout=60
    )


def watchdog_events(run: Path) -> list[dict]:
    return [e for e in read_events(run) if e["event"] == "watchdog"]


def test_a_hang_in_user_code_dumps_the_stacks_and_exits_non_zero(tmp_path: Path) -> None:
    run = tmp_path / "run"
    began = time.monotonic()
    proc = run_script(tmp_path, _HANGS, run)
    took = time.monotonic() - began
    assert proc.returncode == 124, proc.stderr
    assert "hanging" in proc.stdout
    assert took < 30, took
    (dump,) = (run / WATCHDOG_DIR).iterdir()
    assert dump.name.startswith("rank00000-")
    text = dump.read_text()
    assert "made no progress" in text and "last heartbeat at step 3" in text
    assert "in stuck_in_user_code" in text and "Current thread" in text
    (event,) = watchdog_events(run)
    assert event["step"] == 3 and event["exit_code"] == 124 and event["timeout"] == 1.0
    assert event["stacks"] == f"{WATCHDOG_DIR}/{dump.name}"
    assert event["silent_s"] >= 1.0


def test_the_exit_does_not_wait_for_a_lock_the_hung_thread_holds(tmp_path: Path) -> None:
    """The event's log line needs the handler's lock; the exit comes all the same."""
    run = tmp_path / "run"
    proc = run_script(tmp_path, _HANGS_IN_LOGGING, run)
    assert proc.returncode == 124, proc.stderr
    (dump,) = (run / WATCHDOG_DIR).iterdir()
    assert "last heartbeat at step 1" in dump.read_text()


def test_saves_beat_the_heart(tmp_path: Path) -> None:
    """A loop slower than the poll but faster than the timeout never fires."""
    run = tmp_path / "run"
    state = stalwart.TrainState(model=torch.nn.Linear(2, 2))
    with stalwart.CheckpointManager(run, every_steps=100) as ckpt:
        with stalwart.Watchdog(ckpt, timeout=1.0, exit_code=None, poll=0.05) as dog:
            for step in range(1, 31):  # 3 s in all: longer than the timeout
                time.sleep(0.1)
                ckpt.save(step, state)
        assert dog.fired == [] and ckpt.heartbeats == []
    assert watchdog_events(run) == [] and not (run / WATCHDOG_DIR).exists()


def test_record_only_fires_once_per_silence(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = stalwart.TrainState(model=torch.nn.Linear(2, 2))
    with stalwart.CheckpointManager(run) as ckpt:
        with stalwart.Watchdog(ckpt, timeout=0.2, exit_code=None, poll=0.02) as dog:
            time.sleep(1.0)  # one silence: one dump
            ckpt.save(1, state)
            time.sleep(1.0)  # another
            dog.heartbeat()
    assert len(dog.fired) == 2
    assert [e["step"] for e in watchdog_events(run)] == [None, 1]
    assert "in test_record_only_fires_once_per_silence" in dog.fired[0].read_text()


def test_an_explicit_heartbeat_counts(tmp_path: Path) -> None:
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with stalwart.Watchdog(ckpt, timeout=1.5, exit_code=None, poll=0.02) as dog:
            for _ in range(10):
                time.sleep(0.3)
                dog.heartbeat(7)
            assert dog.silent_for < 1.5
        assert dog.fired == []


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"timeout": 0}, "timeout must be a number of seconds > 0, got 0"),
        ({"timeout": 5, "grace": -1}, "grace must be a number of seconds >= 0"),
        ({"timeout": 5, "exit_code": 0}, "exit_code must be an int in 1..255"),
        ({"timeout": -1.0}, "timeout must be a number of seconds > 0, got -1.0"),
        ({"timeout": math.nan}, "timeout must be a number of seconds > 0, got nan"),
        ({"timeout": math.inf}, "timeout must be a number of seconds > 0, got inf"),
        ({"timeout": "5"}, "timeout must be a number of seconds > 0, got '5'"),
        ({"timeout": 5, "grace": math.inf}, "grace must be a number of seconds >= 0"),
        ({"timeout": 5, "poll": math.nan}, "poll must be a number of seconds > 0"),
    ],
)
def test_bad_settings_name_the_field(tmp_path: Path, kwargs: dict, fragment: str) -> None:
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
            stalwart.Watchdog(ckpt, **kwargs)
        assert ckpt.heartbeats == []


def test_ls_shows_where_the_watchdog_left_the_stacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    state = stalwart.TrainState(model=torch.nn.Linear(2, 2))
    with stalwart.CheckpointManager(run) as ckpt:
        with stalwart.Watchdog(ckpt, timeout=0.2, exit_code=None, poll=0.02) as dog:
            ckpt.save(1, state)
            time.sleep(1.0)
    (stacks,) = dog.fired
    code, out, _ = cli(capsys, "ls", run)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("watchdog at step 1: "))
    assert "rank 0 made no progress for " in line
    assert line.endswith(f"after step 1 (timeout 0.2 s); stacks in watchdog/{stacks.name}")


def test_a_watchdog_folder_that_links_out_of_the_run_is_not_written_through(
    tmp_path: Path,
) -> None:
    """The run directory is input from outside: ``watchdog/`` as a symlink must not redirect the dump."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    run.mkdir()
    (run / WATCHDOG_DIR).symlink_to(outside, target_is_directory=True)
    with stalwart.CheckpointManager(run) as ckpt:
        with stalwart.Watchdog(ckpt, timeout=0.2, exit_code=None, poll=0.02) as dog:
            time.sleep(1.0)
    assert list(outside.iterdir()) == [] and dog.fired == []
    (event,) = watchdog_events(run)  # the firing is still recorded, without stacks
    assert event["stacks"] is None


def test_two_watchdogs_on_one_manager_and_a_heartbeat_after_close(tmp_path: Path) -> None:
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        first = stalwart.Watchdog(ckpt, timeout=0.3, exit_code=None, poll=0.02)
        second = stalwart.Watchdog(ckpt, timeout=0.3, exit_code=None, poll=0.02)
        assert ckpt.heartbeats == [first.heartbeat, second.heartbeat]
        first.close()
        first.heartbeat(3)  # harmless: nothing watches any more
        first.close()  # idempotent
        assert ckpt.heartbeats == [second.heartbeat]
        time.sleep(0.8)
        second.close()
    assert first.fired == [] and len(second.fired) == 1


def test_the_operations_guide_example_runs(tmp_path: Path) -> None:
    proc = run_section_example(tmp_path, "operations.md", "Hangs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "watched"
    assert sorted(p.name for p in run.glob("step_*")) == [f"step_{s:09d}" for s in (10, 20, 30)]
    assert watchdog_events(run) == [] and not (run / WATCHDOG_DIR).exists()
