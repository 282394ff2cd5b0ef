"""The NaN / loss-spike guard in one process: skip, roll back past the bad data, limits, events."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stalwart
from stalwart.events import read_events
from tests.support.docs import run_section_example

from .conftest import assert_same, cli, flip_byte, make_parts, seed_all


class Poisoned(torch.utils.data.Dataset):
    """A regression set whose sample ``bad`` has a target 10^4 times too large (a corrupt record)."""

    def __init__(self, n: int = 80, bad: int | None = None) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randn(n, 2, generator=g)
        if bad is not None:
            self.y[bad] = 1e4

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def guard_events(run: Path, name: str = "guard") -> list[dict]:
    return [e for e in read_events(run) if e["event"] == name]


def train(
    run: Path,
    *,
    steps: int,
    bad: int | None = None,
    policy: stalwart.GuardPolicy | None = None,
    every: int = 5,
    stop_at: int | None = None,
) -> dict:
    """A guarded loop over ``Poisoned`` (no shuffle, 2 samples a step: step s reads 2s-2, 2s-1)."""
    seed_all(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = stalwart.ResumableDataLoader(Poisoned(bad=bad), batch_size=2, shuffle=False)
    state = stalwart.TrainState(model=model, optimizer=opt, data=loader)
    policy = policy or stalwart.GuardPolicy(warmup=5, spike_factor=20.0)
    trained: list[int] = []
    decisions: list[stalwart.GuardDecision] = []
    with (
        stalwart.CheckpointManager(run, every_steps=every, keep_last=2) as ckpt,
        stalwart.Guard(ckpt, state, policy) as guard,
    ):
        step = ckpt.restore(state) or 0
        batches = loader.forever()
        while step < (stop_at or steps):
            x, y, idx = next(batches)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
            decision = guard.check(step + 1, loss, norm)
            if decision.action != "ok":
                decisions.append(decision)
            if decision.action == "rollback":
                assert decision.restored_step is not None
                step, batches = decision.restored_step, loader.forever()
                continue
            if decision.ok:
                opt.step()
                trained.extend(int(i) for i in idx)
            step += 1
            ckpt.save(step, state, metrics={"loss": loss.item()})
        verdict = ckpt.resume_verdict
    return {
        "trained": trained,
        "decisions": decisions,
        "guard": guard,
        "verdict": verdict,
        "model": {k: v.clone() for k, v in model.state_dict().items()},
    }


def test_a_spike_rolls_back_to_the_newest_checkpoint_and_skips_its_data_window(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    out = train(run, steps=30, bad=37)  # step 19 reads samples 36 and 37
    (decision,) = out["decisions"]
    assert (decision.action, decision.step, decision.reason) == ("rollback", 19, "spike")
    assert decision.restored_step == 15
    window = {"from": {"epoch": 0, "consumed": 30}, "to": {"epoch": 0, "consumed": 38}}
    assert decision.skipped == {**window, "samples": 8}
    # Steps 16-18 ran once before the rollback; after it, training continues at sample 38.
    assert out["trained"].count(30) == 1 and 37 not in out["trained"]
    assert out["trained"][-30:] == list(range(38, 68))
    (event,) = guard_events(run)
    assert (event["action"], event["step"], event["restored_step"]) == ("rollback", 19, 15)
    assert event["skipped"]["samples"] == 8
    (rank,) = event["ranks"]
    assert rank["rank"] == 0 and rank["reasons"] == ["spike"]
    assert rank["loss"] > 20 * rank["median"] > 0
    assert math.isfinite(rank["grad_norm"])
    assert out["guard"].rollbacks == 1 and out["guard"].skips == 0
    assert all(math.isfinite(float(v.abs().max())) for v in out["model"].values())


def test_the_rolled_back_run_equals_one_that_never_read_the_window(tmp_path: Path) -> None:
    """Bit for bit: restoring the state and moving the data position is all a rollback does."""
    guarded = train(tmp_path / "a", steps=30, bad=37)
    # The same run, made by hand: train to 15, then continue from sample 38.
    seed_all(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = Poisoned(bad=37)
    reference = train(tmp_path / "b", steps=15)
    model.load_state_dict(reference["model"])
    sampler = stalwart.ResumableSampler(len(data), shuffle=False)
    sampler.load_state_dict({**sampler.state_dict(), "consumed": 38})
    loader = stalwart.ResumableDataLoader(data, batch_size=2, sampler=sampler)
    # The guarded run's SGD has no state, so a fresh one continues it exactly.
    for _, (x, y, _) in zip(range(15), loader, strict=False):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert_same(guarded["model"], model.state_dict())


def test_a_nan_loss_is_skipped_and_recorded(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run) as ckpt, stalwart.Guard(ckpt, parts.state) as guard:
        assert guard.check(1, torch.tensor(0.5), grad_norm=1.0).ok
        decision = guard.check(2, torch.tensor(float("nan")), grad_norm=1.0)
        assert (decision.action, decision.reason, decision.restored_step) == (
            "skip", "nonfinite_loss", None,
        )  # fmt: skip
        assert guard.check(3, 0.4).ok
        assert guard.median == pytest.approx(0.45)  # the NaN never entered the median
    (event,) = guard_events(run)
    assert (event["step"], event["action"], event["reason"]) == (2, "skip", "nonfinite_loss")
    assert math.isnan(event["ranks"][0]["loss"]) and event["ranks"][0]["grad_norm"] == 1.0


def test_an_infinite_gradient_norm_is_its_own_reason(tmp_path: Path) -> None:
    parts = make_parts()
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with stalwart.Guard(ckpt, parts.state) as guard:
            decision = guard.check(1, 0.3, grad_norm=torch.tensor(float("inf")))
    assert (decision.action, decision.reason) == ("skip", "nonfinite_grad")
    (event,) = guard_events(tmp_path / "run")
    assert event["ranks"][0]["grad_norm"] == math.inf


def test_nonfinite_values_can_roll_back_too(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    policy = stalwart.GuardPolicy(on_nonfinite="rollback")
    with stalwart.CheckpointManager(run) as ckpt, stalwart.Guard(ckpt, parts.state, policy) as g:
        beats: list[int] = []
        ckpt.heartbeats.append(beats.append)
        ckpt.save(4, parts.state)
        before = {k: v.clone() for k, v in parts.model.state_dict().items()}
        with torch.no_grad():
            for p in parts.model.parameters():
                p.fill_(float("nan"))
        decision = g.check(7, float("nan"))
        assert (decision.action, decision.restored_step) == ("rollback", 4)
        assert_same(before, parts.model.state_dict())
        assert beats == [4, 4]  # the save, then the rollback: a Watchdog sees progress
    # No data in the state: nothing to skip, and the event says so.
    (event,) = guard_events(run)
    assert event["restored_step"] == 4 and event["skipped"] is None


def test_a_rollback_without_a_checkpoint_skips_the_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    policy = stalwart.GuardPolicy(on_nonfinite="rollback")
    with stalwart.CheckpointManager(run) as ckpt, stalwart.Guard(ckpt, parts.state, policy) as g:
        decision = g.check(3, float("inf"))
    assert decision.action == "skip"
    (event,) = guard_events(run)
    assert event["note"] == "no checkpoint to roll back to"


def test_a_rollback_passes_over_a_corrupt_newest_checkpoint(tmp_path: Path) -> None:
    """A rollback goes to the newest checkpoint that verifies, and the skipped window starts there."""
    run = tmp_path / "run"
    data = torch.utils.data.TensorDataset(torch.arange(40.0))
    loader = stalwart.ResumableDataLoader(data, batch_size=2, shuffle=False)
    parts = make_parts(data=loader)
    policy = stalwart.GuardPolicy(on_nonfinite="rollback")
    with stalwart.CheckpointManager(run) as ckpt, stalwart.Guard(ckpt, parts.state, policy) as g:
        batches = loader.forever()
        for step in range(1, 11):  # 2 samples a step: position 2 * step
            next(batches)
            if step in (4, 8):
                ckpt.save(step, parts.state, force=True)
        flip_byte(run / "step_000000008" / "__0_0.distcp")
        decision = g.check(11, math.nan)
        assert (decision.action, decision.restored_step) == ("rollback", 4)
        assert decision.skipped == {
            "from": {"epoch": 0, "consumed": 8},
            "to": {"epoch": 0, "consumed": 20},
            "samples": 12,
        }
        assert next(loader.forever())[0].tolist() == [20.0, 21.0]
        # With every checkpoint damaged, there is nothing to go back to: the step is skipped.
        flip_byte(run / "step_000000004" / "__0_0.distcp")
        decision = g.check(12, math.nan)
        assert (decision.action, decision.restored_step) == ("skip", None)
    skipped = [e["step"] for e in read_events(run) if e["event"] == "restore_skipped"]
    assert skipped == [8, 4]
    assert [e["action"] for e in guard_events(run)] == ["rollback", "skip"]


def test_a_rollback_that_became_a_skip_counts_against_the_skip_limit(tmp_path: Path) -> None:
    """Before the first checkpoint no rollback happens, so max_rollbacks must not stop the run."""
    parts = make_parts()
    policy = stalwart.GuardPolicy(on_nonfinite="rollback", max_rollbacks=1, max_skips=3)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with stalwart.Guard(ckpt, parts.state, policy) as guard:
            assert [guard.check(s, math.nan).action for s in (1, 2, 3)] == ["skip"] * 3
            with pytest.raises(stalwart.GuardLimitError, match="one skip more than max_skips=3"):
                guard.check(4, math.nan)
    assert guard.skips == 3 and guard.rollbacks == 0
    (limit,) = guard_events(tmp_path / "run", "guard_limit")
    assert (limit["action"], limit["step"]) == ("skip", 4)


def test_spikes_are_not_judged_before_the_warmup(tmp_path: Path) -> None:
    parts = make_parts()
    policy = stalwart.GuardPolicy(warmup=3, spike_factor=2.0)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with stalwart.Guard(ckpt, parts.state, policy) as guard:
            assert [guard.check(s, v).action for s, v in enumerate([1.0, 9.0, 1.0], 1)] == [
                "ok", "ok", "ok",
            ]  # fmt: skip
            # Median of (1, 9, 1) is 1: 1.5 is not a spike.
            assert guard.check(4, 1.5).ok
            # Median of (1, 9, 1, 1.5) is 1.25.
            assert guard.check(5, 2.6).reason == "spike"


def test_too_many_rollbacks_raise_on_the_one_over_the_limit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    policy = stalwart.GuardPolicy(
        warmup=5, spike_factor=20.0, on_nonfinite="rollback", max_rollbacks=1, per_checks=50
    )
    parts = make_parts()
    with stalwart.CheckpointManager(run) as ckpt, stalwart.Guard(ckpt, parts.state, policy) as g:
        ckpt.save(1, parts.state)
        assert g.check(2, math.nan).action == "rollback"
        with pytest.raises(stalwart.GuardLimitError, match="max_rollbacks=1 allows within 50"):
            g.check(2, math.nan)
    (limit,) = guard_events(run, "guard_limit")
    assert (limit["action"], limit["limit"], limit["step"]) == ("rollback", 1, 2)
    assert len(guard_events(run)) == 1  # the refused rollback did not happen


def test_the_limit_is_a_sliding_window_of_checks(tmp_path: Path) -> None:
    parts = make_parts()
    policy = stalwart.GuardPolicy(max_skips=1, per_checks=3)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with stalwart.Guard(ckpt, parts.state, policy) as guard:
            assert guard.check(1, math.nan).action == "skip"
            assert guard.check(2, 1.0).ok and guard.check(3, 1.0).ok
            assert guard.check(4, math.nan).action == "skip"  # the first left the window
            with pytest.raises(stalwart.GuardLimitError):
                guard.check(5, math.nan)


def test_a_rollback_after_a_resume_does_not_read_as_a_divergence(tmp_path: Path) -> None:
    """The lost attempt trained the window the rollback skips: only steps before it are compared."""
    run = tmp_path / "run"
    # The median starts empty in a new process: 3 redone steps make the warmup.
    policy = stalwart.GuardPolicy(warmup=3, spike_factor=20.0)
    train(run, steps=30, stop_at=18)  # attempt 1 trains to 18 (checkpoint 15), then "crashes"
    out = train(run, steps=30, bad=37, policy=policy)  # redoes 16-18, then step 19 spikes
    assert [d.action for d in out["decisions"]] == ["rollback"]
    verdict = out["verdict"]
    assert verdict is not None and verdict.event == "resume_verified", verdict
    assert verdict.through == 18
    events = [e["event"] for e in read_events(run) if e["event"].startswith("resume_")]
    assert events == ["resume_verified"]


def test_a_rollback_to_a_step_this_attempt_saved_last_is_not_judged_as_a_resume(
    tmp_path: Path,
) -> None:
    """The bad step right after a save rolls back to that save: still a rollback, not a resume.

    Attempt 1 trained steps 1-18 and committed nothing; attempt 2 (no restore) saves step
    15, and step 16 spikes. Its steps after the rollback read other data than attempt 1's
    by design, so comparing them would report a divergence that is not one.
    """
    run = tmp_path / "run"
    train(run, steps=18, every=100)
    out = train(run, steps=30, bad=31, every=15)  # step 16 reads samples 30 and 31
    assert [(d.action, d.step, d.restored_step) for d in out["decisions"]] == [("rollback", 16, 15)]
    assert [e["event"] for e in read_events(run) if e["event"] == "resume_diverged"] == []
    assert out["verdict"] is None or out["verdict"].event != "resume_diverged"


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("on_spike", "ignore", "on_spike must be 'skip' or 'rollback'"),
        ("spike_factor", 1.0, "spike_factor must be a number above 1"),
        ("spike_factor", -4.0, "spike_factor must be a number above 1"),
        ("spike_factor", math.nan, "spike_factor must be a number above 1"),
        ("spike_factor", math.inf, "spike_factor must be a number above 1"),
        ("spike_factor", 10**400, "spike_factor must be a number above 1"),  # overflowed in check
        ("spike_factor", "4", "spike_factor must be a number above 1"),
        ("window", 0, "window must be an int >= 1"),
        ("max_rollbacks", -1, "max_rollbacks must be an int >= 0"),
        ("warmup", 500, "warmup (500) cannot exceed window (100)"),
    ],
)
def test_a_bad_policy_names_the_field(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        stalwart.GuardPolicy(**{field: value})


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, "600"])
def test_a_bad_timeout_is_refused_before_any_group_is_made(tmp_path: Path, timeout: Any) -> None:
    parts = make_parts()
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            stalwart.Guard(ckpt, parts.state, timeout=timeout)


def test_a_loss_that_is_not_a_scalar_is_refused(tmp_path: Path) -> None:
    parts = make_parts()
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with stalwart.Guard(ckpt, parts.state) as guard:
            with pytest.raises(
                ValueError, match=r"loss must be a scalar, got a tensor of shape \(2,\)"
            ):
                guard.check(1, torch.ones(2))


@pytest.mark.parametrize(
    "make",
    [
        float,
        torch.tensor,
        lambda v: torch.tensor([v], dtype=torch.bfloat16, requires_grad=True),
        np.float32,
        np.float64,
        np.array,
        pytest.param(
            lambda v: torch.tensor(v, device="cuda"),
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
    ids=[
        "float",
        "0-d tensor",
        "bf16 tensor with grad",
        "np.float32",
        "np.float64",
        "0-d ndarray",
        "cuda tensor",
    ],
)
def test_every_kind_of_real_scalar_is_judged_alike(tmp_path: Path, make: Any) -> None:
    """A loss is whatever the loop has at hand: the same values give the same decisions."""
    parts = make_parts()
    policy = stalwart.GuardPolicy(warmup=3, spike_factor=4.0, on_spike="skip")
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with stalwart.Guard(ckpt, parts.state, policy) as guard:
            actions = [
                guard.check(s, make(v), make(1.0)).action
                for s, v in enumerate([1.0, 1.0, 1.0, 8.0, math.nan, 1.0], start=1)
            ]
    assert actions == ["ok", "ok", "ok", "skip", "skip", "ok"]


@pytest.mark.parametrize(
    ("value", "error", "fragment"),
    [
        (np.ones(2), ValueError, r"loss must be a scalar, got a numpy array of shape \(2,\)"),
        (torch.tensor(True), TypeError, "loss must be a number or a scalar tensor, got bool"),
        (np.bool_(True), TypeError, "loss must be a number or a scalar tensor, got bool"),
        (torch.tensor(1 + 2j), TypeError, "got complex"),
        ("0.5", TypeError, "got str"),
    ],
)
def test_a_loss_that_is_not_a_real_scalar_is_refused(
    tmp_path: Path, value: Any, error: type[Exception], fragment: str
) -> None:
    parts = make_parts()
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        with stalwart.Guard(ckpt, parts.state) as guard:
            with pytest.raises(error, match=fragment):
                guard.check(1, value)
            assert guard.checks == 0


def test_ls_and_report_show_the_rollback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train(run, steps=30, bad=37)
    code, out, _ = cli(capsys, "ls", run)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("guard at step 19: "))
    assert line.startswith("guard at step 19: rollback to step 15 (spike on rank 0: loss ")
    assert line.endswith("; skipped samples from epoch 0 position 30 to epoch 0 position 38 (8)")
    code, out, _ = cli(capsys, "ls", run, "--json")
    report = json.loads(out)
    (incident,) = report["incidents"]
    assert (incident["event"], incident["action"], incident["restored_step"]) == (
        "guard", "rollback", 15,
    )  # fmt: skip
    (resume,) = report["resumes"]  # checkpoint 15 itself is gone by now (keep_last=2)
    assert (resume["restored_step"], resume["mark"]) == (15, "rollback")
    code, out, _ = cli(capsys, "report", run, "--json", "--out", tmp_path / "report")
    summary = json.loads(out)["summary"]
    (problem,) = summary["problems"]
    assert problem["event"] == "guard" and problem["detail"] == incident["message"]
    assert [r["resume"] for r in summary["restores"]] == ["rollback (guard)"]


def test_ls_and_report_survive_crafted_incident_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """events.jsonl is input from outside: any JSON in an incident's fields still gives a line."""
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run) as ckpt:
        ckpt.save(1, parts.state, force=True)
    now = list(read_events(run))[-1]["time"]
    crafted = [
        {"action": "rollback", "restored_step": [1], "ranks": 5, "skipped": {"from": "x"}},
        {"action": "rollback", "restored_step": 1, "skipped": "x", "note": {"a": 1},
         "ranks": [{"reasons": 7, "rank": {}}, {"reasons": ["spike"], "median": "m"}]},
        {"action": {"x": 1}, "step": "s", "ranks": [None, "r"]},
    ]  # fmt: skip
    with (run / "events.jsonl").open("a") as f:
        for i, fields in enumerate(crafted):
            f.write(json.dumps({"event": "guard", "time": now + i, **fields}) + "\n")
        f.write(json.dumps({"event": "watchdog", "time": now, "stacks": [], "silent_s": {}}) + "\n")
        f.write(json.dumps({"event": "guard_limit", "time": now, "message": 3}) + "\n")
        f.write(json.dumps({"event": "guard", "time": 10**400, "action": "skip"}) + "\n")
    code, out, _ = cli(capsys, "ls", run)
    assert code == 0
    assert (
        sum(x.startswith(("guard at", "watchdog at", "guard_limit at")) for x in out.splitlines())
        == 6
    )
    assert "rollback to step [1] (None); skipped samples from epoch None" in out
    code, out, _ = cli(capsys, "ls", run, "--json")
    assert code == 0
    incidents = json.loads(out)["incidents"]
    assert [i["restored_step"] for i in incidents][:2] == [None, 1]
    assert incidents[-1]["time"].startswith("invalid")
    code, out, _ = cli(capsys, "report", run, "--json", "--out", tmp_path / "report")
    assert (
        code == 0 and len(json.loads(out)["summary"]["problems"]) == 5
    )  # a time no date can show is left out


def test_the_operations_guide_example_runs(tmp_path: Path) -> None:
    proc = run_section_example(tmp_path, "operations.md", "NaN and loss spikes")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "1 rollback(s), 0 skip(s)"
    (event,) = guard_events(tmp_path / "runs" / "guarded")
    assert event["step"] == 26 and event["restored_step"] == 20  # step 26 reads sample 100
