"""The hang watchdog on two real DDP ranks (gloo on CPU, torchrun): rank 1 sleeps in user code.

Rank 0 then waits for rank 1 inside DDP's gradient all-reduce; neither beats
its watchdog again. Both dump their stacks and exit with the watchdog's status,
and torchrun, allowed one restart, brings the job back from the newest checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

from stalwart.events import read_events
from stalwart.layout import WATCHDOG_DIR

from ..support.torchrun import ok, starts, torchrun

WORKER = Path(__file__).parent / "guard_worker.py"
TIMEOUT = 3.0
HANG = ("--hang-rank", "1", "--hang-step", "6", "--watchdog", str(TIMEOUT))


def test_a_hung_rank_and_its_waiting_peer_both_dump_their_stacks_and_exit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = torchrun(2, "--run-dir", str(run), *HANG, script=WORKER)
    assert proc.returncode != 0
    # torchrun's failure summary: the hung rank ended with the watchdog's status; rank 0 with
    # it too, or with the error of the collective its peer's exit broke, or by torchrun's
    # signal (then it may not be listed): never 0.
    summary = re.findall(r"^\s+rank\s*: (\d) .*\n\s+exitcode\s*: (-?\d+)", proc.stderr, re.M)
    codes = dict(summary)
    assert codes["1"] == "124" and codes.get("0") != "0", proc.stderr[-3000:]
    (hung_at,) = re.findall(r"^rank 1 hangs at step 6 at ([\d.]+)$", proc.stdout, re.MULTILINE)
    events = {e["rank"]: e for e in read_events(run) if e["event"] == "watchdog"}
    assert sorted(events) == [0, 1]
    for rank, event in events.items():
        # Both last beat at the save of step 5; they fire within a poll of the timeout.
        assert event["step"] == 5 and event["exit_code"] == 124, event
        assert TIMEOUT <= event["silent_s"] < TIMEOUT + 3, event
        assert event["time"] - float(hung_at) < TIMEOUT + 3, (rank, event, hung_at)
        text = (run / event["stacks"]).read_text()
        assert text.startswith(f"stalwart watchdog: rank {rank} ")
    hung = (run / events[1]["stacks"]).read_text()
    assert "in hang_in_user_code" in hung
    waiting = (run / events[0]["stacks"]).read_text()
    assert "in hang_in_user_code" not in waiting and "guard_worker.py" in waiting
    names = sorted(p.name.split("-")[0] for p in (run / WATCHDOG_DIR).iterdir())
    assert names == ["rank00000", "rank00001"]


def test_torchrun_restarts_the_job_after_the_watchdog_and_it_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(torchrun(2, "--run-dir", str(run), *HANG, restarts=1, script=WORKER))
    # First attempt from 0; the restart resumes from step 4 (a checkpoint every 4 steps).
    assert sorted(starts(proc)) == [0, 0, 4, 4], proc.stdout
    assert len(re.findall(r"^rank \d done digest", proc.stdout, re.MULTILINE)) == 2
    assert len([e for e in read_events(run) if e["event"] == "watchdog"]) == 2
