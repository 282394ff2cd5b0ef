"""The restore protocol: ``load_checkpoint`` drives a ``RestorePlan``, whoever implements it.

TrainState is one ``Restorable``; an integration can bring its own. The live
module and optimizer state dicts, whose construction gives a fresh optimizer its
state (from the checkpoint's metadata, or by DCP's own step where the metadata
cannot), are built once per restore (counted with torch's own ``state_dict``
hooks, not by replacing stalwart code), and a rank whose check passed leaves a
fresh optimizer empty when another rank's check fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import stalwart
from stalwart import reader
from stalwart.pipeline import load_checkpoint
from stalwart.restore_protocol import Restorable, RestorePlan
from stalwart.safe_load import read_dcp_metadata
from stalwart.state import native

from .conftest import assert_same, flip_byte, make_parts, train_steps
from .support.interrupts import open_fds


def saved_checkpoint(run: Path, **parts_kwargs: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    """A committed checkpoint of ``make_parts`` after two steps, and its model's tensors."""
    parts = make_parts(**parts_kwargs)
    train_steps(parts, 2)
    with stalwart.CheckpointManager(run, every_steps=1) as ckpt:
        ckpt.save(2, parts.state)
    weights = {k: v.clone() for k, v in parts.model.state_dict().items()}
    return next(run.glob("step_*")), weights


class Weights:
    """A Restorable of its own: the model's tensors of a checkpoint, into a plain dict."""

    def __init__(self, expected: set[str]) -> None:
        self.expected = expected
        self.tensors: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []

    def plan_restore(self, metadata: Metadata, *, strict: bool) -> WeightsPlan:
        self.calls.append("plan_restore")
        return WeightsPlan(self, metadata)


class WeightsPlan:
    def __init__(self, owner: Weights, metadata: Metadata) -> None:
        self.owner = owner
        self.metadata = metadata

    def staged(self) -> dict[str, Any]:
        self.owner.calls.append("staged")
        model = {
            key.removeprefix("model."): torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for key, md in self.metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
        }
        return {"model": model}

    def check(self, staged: Mapping[str, Any]) -> None:
        self.owner.calls.append("check")
        if set(staged["model"]) != self.owner.expected:
            raise stalwart.StateMismatchError(f"expected {sorted(self.owner.expected)}")

    def in_place(self) -> dict[str, Any]:
        self.owner.calls.append("in_place")
        return {}

    def apply(self, loaded: Mapping[str, Any]) -> None:
        self.owner.calls.append("apply")
        self.owner.tensors = dict(loaded["model"])

    def discard(self) -> None:
        self.owner.calls.append("discard")


def test_train_state_and_its_plan_implement_the_protocol(tmp_path: Path) -> None:
    ckpt, _ = saved_checkpoint(tmp_path / "run")
    state = make_parts().state
    assert isinstance(state, Restorable)
    metadata = read_dcp_metadata(ckpt)
    assert isinstance(state.plan_restore(metadata, strict=True), RestorePlan)
    assert isinstance(Weights(set()), Restorable)


def test_a_restorable_of_its_own_restores_through_load_checkpoint(tmp_path: Path) -> None:
    ckpt, weights = saved_checkpoint(tmp_path / "run")
    target = Weights(set(weights))
    manifest = load_checkpoint(ckpt, target)
    assert manifest.step == 2
    assert target.calls == ["plan_restore", "staged", "check", "in_place", "apply"]
    assert_same(target.tensors, weights)


def test_a_plan_whose_check_fails_is_discarded_and_never_applied(tmp_path: Path) -> None:
    ckpt, weights = saved_checkpoint(tmp_path / "run")
    target = Weights({*weights, "3.weight"})
    with pytest.raises(stalwart.StateMismatchError, match="expected"):
        load_checkpoint(ckpt, target)
    assert target.calls == ["plan_restore", "staged", "check", "discard"]
    assert target.tensors == {}


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-optimizer", "stepped-optimizer"])
def test_a_restore_builds_the_live_state_dicts_once(
    tmp_path: Path, fresh: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's ``get_state_dict`` runs at most once per restore, for the check and the
    in-place load together; a restore into objects whose structure is known (here:
    the second) takes the rebuild, with one ``model.state_dict()`` and no DCP call."""
    ckpt, weights = saved_checkpoint(tmp_path / "run")
    parts = make_parts()
    if not fresh:
        train_steps(parts, 1)
    calls = {"model": 0, "optimizer": 0, "dcp": 0}

    def count(name: str) -> Any:
        def hook(*_: Any) -> None:
            calls[name] += 1

        return hook

    real = native.get_state_dict

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["dcp"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "get_state_dict", counted)
    parts.model.register_state_dict_post_hook(count("model"))
    parts.optimizer.register_state_dict_pre_hook(count("optimizer"))
    load_checkpoint(ckpt, parts.state)
    assert calls["dcp"] == 1
    assert_same(dict(parts.model.state_dict()), weights)
    assert parts.optimizer.state  # the saved Adam moments came back
    train_steps(parts, 1)
    calls.update(model=0, optimizer=0, dcp=0)
    load_checkpoint(ckpt, parts.state)
    assert calls == {"model": 1, "optimizer": 1, "dcp": 0}
    assert_same(dict(parts.model.state_dict()), weights)


WORKER = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist

    import stalwart

    rank, _ = stalwart.init_distributed("gloo")


    def build(hidden):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)


    model, opt = build(8)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with stalwart.CheckpointManager(sys.argv[1], every_steps=1) as ckpt:
        ckpt.save(1, stalwart.TrainState(model=model, optimizer=opt, rng=False))
        # Rank 1 is built with another width: its check fails, rank 0's passes.
        fresh, fresh_opt = build(8 if rank == 0 else 16)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        try:
            ckpt.restore(stalwart.TrainState(model=fresh, optimizer=fresh_opt, rng=False))
            outcome = "restored"
        except stalwart.StateMismatchError:
            outcome = "mismatch"
        kept = all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
        print(f"rank {rank} {outcome} optimizer_state={len(fresh_opt.state)} kept={kept}")
    dist.barrier()
    del model, fresh
    dist.destroy_process_group()
    """
)


def test_a_check_failing_on_another_rank_leaves_a_fresh_optimizer_empty(tmp_path: Path) -> None:
    """Rank 0's own check passes (and built its optimizer's state to do it); rank 1's
    fails, so rank 0 stops too, with its model and its fresh optimizer as they were."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, str(script), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        assert f"rank {rank} mismatch optimizer_state=0 kept=True" in proc.stdout, proc.stdout


def damage_a_data_file(ckpt: Path) -> Path:
    data = next(ckpt.glob("*.distcp"))
    flip_byte(data, data.stat().st_size // 2)
    return data


class Preparing(Weights):
    """A Restorable whose plan has the optional ``prepare`` step."""

    def __init__(self, expected: set[str], *, fail: bool = False) -> None:
        super().__init__(expected)
        self.fail = fail
        self.prepared = threading.Event()

    def plan_restore(self, metadata: Metadata, *, strict: bool) -> WeightsPlan:
        self.calls.append("plan_restore")
        plan = WeightsPlan(self, metadata)

        def prepare() -> None:
            self.calls.append("prepare")
            self.prepared.set()
            if self.fail:
                raise stalwart.StateMismatchError("prepare found a mismatch")

        plan.prepare = prepare  # type: ignore[attr-defined]
        return plan


def test_a_plans_prepare_runs_while_the_data_files_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each data file's check waits here until ``prepare`` ran: a pipeline that
    waited for the checks before ``prepare`` would see every wait time out."""
    ckpt, weights = saved_checkpoint(tmp_path / "run")
    target = Preparing(set(weights))
    waited: list[bool] = []
    real = reader.stream_check

    def check_after_prepare(*args: Any, **kwargs: Any) -> Any:
        waited.append(target.prepared.wait(timeout=5))
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "stream_check", check_after_prepare)
    load_checkpoint(ckpt, target)
    assert waited and all(waited), waited
    assert target.calls == ["plan_restore", "prepare", "staged", "check", "in_place", "apply"]
    assert_same(target.tensors, weights)


def test_a_damaged_data_file_is_reported_before_what_prepare_raised(tmp_path: Path) -> None:
    ckpt, weights = saved_checkpoint(tmp_path / "run")
    intact = Preparing(set(weights), fail=True)
    with pytest.raises(stalwart.StateMismatchError, match="prepare found"):
        load_checkpoint(ckpt, intact)
    assert intact.calls == ["plan_restore", "prepare", "discard"]
    data = damage_a_data_file(ckpt)
    damaged = Preparing(set(weights), fail=True)
    with pytest.raises(stalwart.CheckpointCorruptError, match=data.name):
        load_checkpoint(ckpt, damaged)
    assert damaged.calls == ["plan_restore", "prepare", "discard"]
    assert damaged.tensors == {}


def test_a_fresh_optimizer_given_state_by_prepare_is_emptied_when_a_data_file_is_damaged(
    tmp_path: Path,
) -> None:
    ckpt, _ = saved_checkpoint(tmp_path / "run")
    data = damage_a_data_file(ckpt)
    parts = make_parts()
    before = {k: v.clone() for k, v in parts.model.state_dict().items()}
    with pytest.raises(stalwart.CheckpointCorruptError, match=data.name):
        load_checkpoint(ckpt, parts.state)
    assert not parts.optimizer.state
    assert_same(before, dict(parts.model.state_dict()))


class Interrupting(Preparing):
    """A Restorable whose plan's prepare is interrupted (Ctrl-C while the data files are checked)."""

    def plan_restore(self, metadata: Metadata, *, strict: bool) -> WeightsPlan:
        plan = super().plan_restore(metadata, strict=strict)

        def prepare() -> None:
            self.calls.append("prepare")
            raise KeyboardInterrupt

        plan.prepare = prepare  # type: ignore[attr-defined]
        return plan


def test_an_interrupt_during_prepare_stays_an_interrupt_even_over_a_damaged_file(
    tmp_path: Path,
) -> None:
    """A damaged file found by the checks must not turn Ctrl-C into a skipped checkpoint."""
    ckpt, weights = saved_checkpoint(tmp_path / "run")
    damage_a_data_file(ckpt)
    target = Interrupting(set(weights))
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(ckpt, target)
    assert target.calls == ["plan_restore", "prepare", "discard"]


class Unplannable(Weights):
    def plan_restore(self, metadata: Metadata, *, strict: bool) -> WeightsPlan:
        raise TypeError("this state cannot plan a restore")


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux's /proc/self/fd")
def test_a_state_that_cannot_plan_leaves_no_check_running_and_no_file_open(tmp_path: Path) -> None:
    ckpt, weights = saved_checkpoint(tmp_path / "run")
    before = open_fds()
    with pytest.raises(TypeError, match="cannot plan"):
        load_checkpoint(ckpt, Unplannable(set(weights)))
    assert open_fds() == before
