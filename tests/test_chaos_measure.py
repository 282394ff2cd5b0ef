"""The arithmetic of ``stalwart chaos``: schedules, the measurement's definitions, the prediction."""

from __future__ import annotations

import pytest

from stalwart.chaos import (
    Attempt,
    ChaosRecord,
    Fault,
    Injected,
    measure,
    parse_schedule,
    poisson_schedule,
)
from stalwart.cli.cmd_chaos import predict
from stalwart.cli.planner import wall_time_ratio


def test_a_schedule_reads_each_kind_with_its_argument_and_sorts_by_time():
    faults = parse_schedule("term@40:grace=5, kill@10,stop@25:3,stop@30,term@50:7")
    assert [f.text() for f in faults] == [
        "kill@10",
        "stop@25:3",
        "stop@30:3",
        "term@40:grace=5",
        "term@50:grace=7",
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("boom@3", "KIND one of kill, stop, term"),
        ("kill@soon", "'soon' is not a number"),
        ("kill@5:3", "kill takes no argument"),
        ("term@5:wait=3", "term takes grace=SECONDS"),
        ("stop@-1", "finite and >= 0"),
        (" , ", "names no fault"),
    ],
)
def test_a_bad_schedule_item_is_named_with_the_expected_form(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_schedule(text)


def test_a_poisson_schedule_repeats_with_its_seed_and_stays_inside_the_duration():
    a = poisson_schedule(mtbf=5, duration=100, seed=3, kinds=("kill", "term"))
    assert a == poisson_schedule(mtbf=5, duration=100, seed=3, kinds=("kill", "term"))
    assert a != poisson_schedule(mtbf=5, duration=100, seed=4, kinds=("kill", "term"))
    assert all(0 < f.at < 100 for f in a)
    assert {f.kind for f in a} == {"kill", "term"}
    # About duration / mtbf arrivals (20); a Poisson count of mean 20 is in [5, 40] all but ~1e-4.
    assert 5 <= len(a) <= 40


def _record() -> tuple[ChaosRecord, list[dict]]:
    """A run of known timings: 0.1 s steps, a 0.5 s save stall after step 20, a kill after
    step 25, a restart whose restore of step 20 takes 0.4 s."""
    t = 1000.0
    lines0 = [(t + 2 + 0.1 * s + (0.5 if s > 20 else 0.0), s) for s in range(1, 26)]
    a0 = Attempt(index=0, pid=1, started=t, ended=1005.05, returncode=-9, steps=lines0)
    a1 = Attempt(
        index=1, pid=2, started=1005.1, steps=[(1008.2 + 0.1 * (s - 21), s) for s in range(21, 39)]
    )
    kill = Injected(
        fault=Fault(kind="kill", at=5), time=1005.01, attempt=0, pid=1, rank=None, step=25
    )
    record = ChaosRecord(
        command=["x"], started=t, deadline=1010.0, ended=1010.0, attempts=[a0, a1], faults=[kill]
    )
    events = [
        {"time": 1000.5, "event": "open", "every_steps": 10},
        {"time": 1004.5, "event": "save", "step": 20, "stall_s": 0.5},
        {"time": 1007.0, "event": "open", "every_steps": 10},
        {"time": 1008.0, "event": "restore", "step": 20, "seconds": 0.4},
    ]
    return record, events


def test_measure_follows_the_documented_definitions():
    record, events = _record()
    m = measure(record, events)
    assert m["step_time_s"] == pytest.approx(0.1)  # the 0.5 s stall is taken out
    assert m["window"]["seconds"] == pytest.approx(1010.0 - 1002.1)
    assert m["steps"] == {"first": 1, "last": 38, "gained": 37}
    assert m["goodput_steps_per_s"] == pytest.approx(37 / 7.9)
    assert m["checkpoint"]["every_steps"] == 10
    assert m["checkpoint"]["interval_s"] == pytest.approx(1.0)
    (failure,) = m["failures"]
    assert failure["kind"] == "kill"
    assert (failure["step_reached"], failure["restored_step"], failure["lost_steps"]) == (25, 20, 5)
    assert failure["detection_s"] == pytest.approx(0.04)
    assert failure["restart_s"] == pytest.approx(1008.0 - 0.4 - 1005.05)
    assert failure["restore_s"] == pytest.approx(0.4)
    assert failure["first_step_s"] == pytest.approx(0.2)
    parts = ("detection_s", "restart_s", "restore_s", "first_step_s")
    assert sum(failure[k] for k in parts) == pytest.approx(failure["recovery_s"])
    b = m["breakdown_s"]
    assert (b["useful"], b["saves"], b["redone"]) == pytest.approx((3.7, 0.5, 0.5))
    assert b["recovery"] == pytest.approx(failure["recovery_s"] - 0.1)
    assert sum(b.values()) == pytest.approx(m["window"]["seconds"])


def test_a_restore_none_means_everything_since_the_start_was_lost():
    record, events = _record()
    events[-1] = {"time": 1008.0, "event": "restore_none"}
    (failure,) = measure(record, events)["failures"]
    assert (failure["restored_step"], failure["lost_steps"], failure["restore_s"]) == (0, 25, 0.0)


def test_without_a_progress_line_there_is_nothing_to_measure():
    record = ChaosRecord(
        command=["x"], started=0.0, deadline=1.0, attempts=[Attempt(index=0, pid=1, started=0.0)]
    )
    with pytest.raises(ValueError, match="no progress line"):
        measure(record, [])


def test_the_prediction_is_dalys_model_for_the_measured_numbers():
    record, events = _record()
    m = measure(record, events)
    p = predict(m)
    mtbf, restart = m["window"]["seconds"], m["failures"][0]["recovery_s"] - 0.1
    assert p["mtbf_s"] == pytest.approx(mtbf)
    assert p["restart_s"] == pytest.approx(restart)
    assert p["goodput_fraction"] == pytest.approx(1 / wall_time_ratio(1.0, 0.5, mtbf, restart))
    assert p["goodput_steps_per_s"] == pytest.approx(p["goodput_fraction"] / 0.1)
    assert p["daly_goodput_fraction"] >= p["goodput_fraction"]  # Daly's interval is the optimum
    assert p["expected_lost_steps_per_failure"] == 5
    assert p["measured_lost_steps_per_failure"] == 5


def test_without_failures_only_the_saves_cost_time_in_the_prediction():
    record, events = _record()
    record.faults.clear()
    record.attempts[0].ended = None
    del record.attempts[1:]
    p = predict(measure(record, events))
    assert p["failures"] == 0 and p["mtbf_s"] is None
    assert p["goodput_fraction"] == pytest.approx(1 / (1 + 0.5 / 1.0))


def test_steps_reported_after_the_deadline_do_not_count():
    record, events = _record()
    record.attempts[1].steps.append((1010.5, 39))  # trained on while stopping
    m = measure(record, events)
    assert m["steps"]["last"] == 38
    assert m["window"]["end"] == 1010.0


def test_an_exit_no_fault_caused_is_an_unplanned_failure_measured_from_the_exit():
    record, events = _record()
    record.faults.clear()
    record.unplanned.append(0)
    m = measure(record, events)
    (failure,) = m["failures"]
    assert failure["kind"] == "unplanned"
    assert failure["at"] == pytest.approx(5.05)  # the exit is all the harness knows of it
    assert (failure["detection_s"], failure["lost_steps"]) == (0.0, 5)
    assert predict(m)["failures"] == 1


def test_events_of_the_wrong_type_are_ignored_not_a_crash():
    """A crafted events.jsonl: fields of the wrong type or out of range leave the numbers alone."""
    record, events = _record()
    expected = measure(record, events)
    crafted = [
        {"time": True, "event": "save", "step": 10, "stall_s": 9.0},
        {"time": float("nan"), "event": "save", "step": 10, "stall_s": 9.0},
        {"time": float("inf"), "event": "restore", "step": 3},
        {"time": "1004.6", "event": "save", "step": 10, "stall_s": 9.0},
        {"time": 1004.6, "event": ["save"], "step": 10},
        {"time": 1004.7, "event": "save", "step": "ten", "stall_s": [1]},
        {"time": 1004.8, "event": "save", "step": 20, "stall_s": "x", "emergency": "yes"},
        {"time": 1000.6, "event": "open", "every_steps": "10"},
        {"time": 1008.05, "event": "restore", "step": {"x": 1}, "seconds": "slow"},
    ]
    m = measure(record, events + crafted)
    assert m["failures"] == expected["failures"]
    assert m["step_time_s"] == pytest.approx(expected["step_time_s"])
    assert m["checkpoint"]["every_steps"] == 10
    assert m["checkpoint"]["stall_median_s"] == pytest.approx(0.5)


def test_a_poisson_schedule_too_dense_to_inject_is_refused_at_once():
    with pytest.raises(ValueError, match="faults"):
        poisson_schedule(mtbf=1e-9, duration=3600, seed=0)


def test_a_stop_whose_process_died_stopped_lasts_until_its_attempt_ended():
    record, events = _record()
    stop = Injected(
        fault=Fault(kind="stop", at=4, seconds=100), time=1004.0, attempt=0, pid=1, rank=None,
        step=20,
    )  # fmt: skip
    record.faults.insert(0, stop)
    (measured,) = measure(record, events)["stops"]
    assert measured["seconds"] == pytest.approx(1005.05 - 1004.0)
