"""Continuous checkpointing (``every_steps="auto"``) and the recovery point of every save.

Real saves through a storage whose commit takes a known time; the tests check
the structure of the schedule from what happened (when each save started and
committed), not hard-coded steps.
"""

from __future__ import annotations

import itertools
import json
import time

import pytest

import stalwart
from stalwart.cli import planner
from stalwart.continuous import daly_interval, young_interval
from stalwart.events import read_events
from stalwart.policy import SavePolicy

from .conftest import cli, make_parts, train_steps
from .distributed.preemption_worker import SlowCommit


def test_auto_needs_a_positive_mtbf():
    with pytest.raises(ValueError, match=r"needs mtbf_seconds=.*got None"):
        SavePolicy(every_steps="auto")
    with pytest.raises(ValueError, match=r"needs mtbf_seconds=.*got -1"):
        SavePolicy(every_steps="auto", mtbf_seconds=-1)


@pytest.mark.parametrize("mtbf", [float("inf"), float("nan"), 0, True])
def test_auto_refuses_a_non_finite_mtbf_at_construction_not_at_the_second_save(tmp_path, mtbf):
    with pytest.raises(ValueError, match=r"needs mtbf_seconds="):
        stalwart.CheckpointManager(tmp_path, every_steps="auto", mtbf_seconds=mtbf)


def test_mtbf_without_auto_and_auto_with_every_seconds_are_refused():
    with pytest.raises(ValueError, match="only with every_steps='auto'"):
        SavePolicy(every_steps=10, mtbf_seconds=3600)
    with pytest.raises(ValueError, match="drop every_seconds"):
        SavePolicy(every_steps="auto", every_seconds=5, mtbf_seconds=3600)
    with pytest.raises(ValueError, match=r"every_steps must be a positive integer, .auto. or"):
        SavePolicy(every_steps="often")  # type: ignore[arg-type]


def test_the_planner_uses_the_library_intervals():
    assert planner.daly_interval is daly_interval and planner.young_interval is young_interval
    assert young_interval(2.0, 100.0) == pytest.approx(20.0)
    assert daly_interval(2.0, 100.0) < young_interval(2.0, 100.0)


def test_daly_interval_never_exceeds_the_mtbf():
    """What the async test below relies on: tau <= M for every cost."""
    for cost in (1e-6, 0.01, 0.1, 0.2, 0.49, 0.5, 1.0, 100.0):
        assert 0 < daly_interval(cost, 0.25) <= 0.25, cost


def timeline(run) -> tuple[list[dict], dict[int, dict]]:
    """(recovery_point events in order, save event by step)."""
    events = list(read_events(run))
    starts = [e for e in events if e["event"] == "recovery_point"]
    saves = {e["step"]: e for e in events if e["event"] == "save"}
    return starts, saves


def test_auto_async_starts_each_save_once_the_previous_one_is_committed(tmp_path):
    """A short MTBF makes the Young/Daly bound tiny: the commit is what paces the saves.

    With M = 0.25 s, tau <= M whatever the measured stall (Daly), so tau stays below
    the 0.3 s commit even when a loaded machine makes the staging copy slow.
    """
    p = make_parts()
    slow = SlowCommit(str(tmp_path), 0.3)
    calls: dict[int, float] = {}
    with stalwart.CheckpointManager(
        tmp_path, every_steps="auto", mtbf_seconds=0.25, async_save=True, storage=slow
    ) as ckpt:
        for step in range(1, 41):
            train_steps(p, 1)
            time.sleep(0.03)
            calls[step] = time.time()
            ckpt.save(step, p.state)
    starts, saves = timeline(tmp_path)
    steps = [e["step"] for e in starts]
    assert steps[0] == 1  # the first call saves: it measures the cost
    assert len(steps) >= 4
    for prev, nxt in itertools.pairwise(starts):
        committed_at = saves[prev["step"]]["time"]
        # never two in flight: the next save started after the previous one committed ...
        assert nxt["time"] >= committed_at
        # ... and soon after: within the Young/Daly bound and a couple of steps
        first_after = min(s for s, t in calls.items() if t >= committed_at)
        assert nxt["step"] <= first_after + 2 + int(nxt["interval_s"] / 0.03), (prev, nxt)
        assert nxt["steps_at_risk"] == nxt["step"] - prev["step"]
        assert nxt["durable_step"] == prev["step"]
        assert nxt["interval_s"] < 0.3 and nxt["auto"]


def test_auto_sync_saves_no_more_often_than_the_young_daly_interval(tmp_path):
    """A sync save of ~0.2 s and an MTBF of 3 s: tau ~ 0.9 s, larger than the save."""
    p = make_parts()
    slow = SlowCommit(str(tmp_path), 0.2)
    with stalwart.CheckpointManager(
        tmp_path, every_steps="auto", mtbf_seconds=3.0, storage=slow
    ) as ckpt:
        for step in range(1, 81):
            train_steps(p, 1)
            time.sleep(0.03)
            ckpt.save(step, p.state)
    starts, saves = timeline(tmp_path)
    assert len(starts) >= 3
    for prev, nxt in itertools.pairwise(starts[1:]):
        tau = nxt["interval_s"]
        stall = saves[prev["step"]]["stall_s"]
        assert tau == pytest.approx(daly_interval(tau_cost(saves, nxt), 3.0), rel=1e-3)
        gap = nxt["time"] - prev["time"]  # stall + compute time between the two saves
        assert gap >= tau + stall * 0.9, (prev, nxt, tau)
        assert gap <= tau + stall + 0.5, (prev, nxt, tau)  # and not much later


def tau_cost(saves: dict[int, dict], start: dict) -> float:
    """The cost the schedule used at ``start``: the mean stall of the saves before it (<= 5)."""
    stalls = [e["stall_s"] for s, e in sorted(saves.items()) if s < start["step"]][-5:]
    return sum(stalls) / len(stalls)


def test_recovery_point_is_in_ls(tmp_path, capsys):
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path, every_steps=3) as ckpt:
        for step in range(1, 10):
            train_steps(p, 1)
            ckpt.save(step, p.state)
    code, out, _ = cli(capsys, "ls", tmp_path, "--json")
    assert code == 0
    at_risk = {e["step"]: e["steps_at_risk"] for e in json.loads(out)["entries"]}
    assert at_risk == {3: None, 6: 3, 9: 3}  # step 3: nothing durable before it
    code, out, _ = cli(capsys, "ls", tmp_path)
    assert "at risk" in out
