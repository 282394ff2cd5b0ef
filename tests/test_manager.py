"""CheckpointManager and TrainState in one process: round trips, policy, retention, errors."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest
import torch

import stalwart
from stalwart.events import read_events
from stalwart.manifest import MANIFEST_NAME

from .conftest import assert_same, make_parts, seed_all, snapshot, train_steps, uninterrupted
from .hostile.harness import sign


def test_restore_brings_back_every_part_of_the_state(tmp_path):
    seed_all(0)
    a = make_parts()
    train_steps(a, 3)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.save(3, a.state, metrics={"loss": 0.5})
    expected = snapshot(a)

    seed_all(123)  # a new process would start from another RNG state
    b = make_parts()
    extra_obj = b.extra
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(b.state) == 3
    assert b.extra is extra_obj  # restored in place
    assert_same(expected, snapshot(b))


def test_training_continues_identically_after_restore(tmp_path):
    want = uninterrupted(6)

    seed_all(0)
    a = make_parts()
    train_steps(a, 2)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, a.state)
    seed_all(99)
    b = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(b.state) == 2
    train_steps(b, 4)
    assert_same(want, snapshot(b))


def test_save_before_the_first_optimizer_step_does_not_change_the_run(tmp_path):
    """get_state_dict initialises an empty optimizer state; the run must not see that."""
    want = uninterrupted(3)

    seed_all(0)
    a = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(0, a.state)
    assert not a.optimizer.state
    train_steps(a, 3)
    assert_same(want, snapshot(a))

    seed_all(5)
    b = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(b.state, step=0) == 0
    assert not b.optimizer.state
    train_steps(b, 3)
    assert_same(want, snapshot(b))


def test_async_save_round_trips_and_does_not_alias_live_tensors(tmp_path):
    seed_all(0)
    a = make_parts()
    train_steps(a, 2)
    expected = snapshot(a)
    with stalwart.CheckpointManager(tmp_path, async_save=True) as ckpt:
        assert ckpt.save(2, a.state)
        with torch.no_grad():  # training goes on while the write runs
            for p in a.model.parameters():
                p.add_(1.0)
        ckpt.wait()
    b = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(b.state) == 2
    assert_same(expected["model"], snapshot(b)["model"])


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("async_save", [False, True])
def test_tuple_and_list_subclasses_are_stored_as_plain_ones(tmp_path, async_save):
    # A restore loads no classes, so subclasses must be saved as the plain type, or the
    # checkpoint could be written but never read back.
    class Steps(list):
        pass

    extra = {"where": Point(1, 2), "steps": Steps([3, 4]), "nested": [Point(5, 6)]}
    with stalwart.CheckpointManager(tmp_path, async_save=async_save) as ckpt:
        ckpt.save(1, stalwart.TrainState(extra=extra))
    back: dict = dict.fromkeys(extra)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(stalwart.TrainState(extra=back)) == 1
    assert back == {"where": (1, 2), "steps": [3, 4], "nested": [(5, 6)]}
    assert type(back["where"]) is tuple and type(back["steps"]) is list


def test_restore_without_checkpoints_returns_none(tmp_path):
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(make_parts().state) is None
        assert ckpt.latest_step() is None
    assert any(e["event"] == "restore_none" for e in read_events(tmp_path))


def test_policy_decides_when_save_writes(tmp_path):
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path, every_steps=3, keep_last=None) as ckpt:
        written = [s for s in range(1, 10) if ckpt.save(s, p.state)]
        assert ckpt.save(10, p.state, force=True)
        assert written == [3, 6, 9]
        assert ckpt.all_steps() == [3, 6, 9, 10]


def test_retention_keeps_last_and_milestones(tmp_path):
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path, keep_last=2, keep_every=4) as ckpt:
        for s in range(1, 10):
            ckpt.save(s, p.state)
        assert ckpt.all_steps() == [4, 8, 9]
    deleted = [e["step"] for e in read_events(tmp_path) if e["event"] == "delete"]
    assert sorted(deleted) == [1, 2, 3, 5, 6, 7]


def test_an_existing_step_is_never_overwritten(tmp_path):
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.save(5, p.state)
        before = (tmp_path / "step_000000005" / MANIFEST_NAME).read_bytes()
        assert not ckpt.save(5, p.state, force=True)
    assert (tmp_path / "step_000000005" / MANIFEST_NAME).read_bytes() == before


def test_manifest_records_what_the_issue_asks_for(tmp_path):
    p = make_parts()
    cfg = {"lr": 0.01, "layers": [4, 8, 2]}
    with stalwart.CheckpointManager(
        tmp_path, metadata={"dataset_version": "v3"}, config=cfg
    ) as ckpt:
        ckpt.save(7, p.state, metrics={"loss": 0.25})
    m = json.loads((tmp_path / "step_000000007" / MANIFEST_NAME).read_text())
    assert m["step"] == 7 and m["world_size"] == 1 and m["epoch"] == 0
    assert m["metadata"] == {"dataset_version": "v3"}
    assert m["config"] == cfg and len(m["config_hash"]) == 64
    assert m["metrics"] == {"loss": 0.25}
    assert m["versions"]["torch"] == torch.__version__
    assert m["versions"]["stalwart"] == stalwart.__version__
    assert {f["path"] for f in m["files"]} >= {".metadata", "__0_0.distcp"}
    assert all(len(f["xxh3_128"]) == 32 and f["size"] > 0 for f in m["files"])


def test_second_manager_on_the_same_directory_is_refused(tmp_path):
    with stalwart.CheckpointManager(tmp_path):
        with pytest.raises(stalwart.RunLockedError, match=f"pid {os.getpid()}"):
            stalwart.CheckpointManager(tmp_path)
    with stalwart.CheckpointManager(tmp_path):  # released on close
        pass


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    code = (
        "import os, signal, stalwart;"
        f"m = stalwart.CheckpointManager({str(tmp_path)!r});"
        "print('locked', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9 and "locked" in proc.stdout
    with stalwart.CheckpointManager(tmp_path):
        pass


def test_directory_that_is_a_file_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        stalwart.CheckpointManager(f)


def test_unwritable_directory_is_a_clear_error():
    # /proc/1 exists and refuses writes to every user, root included.
    with pytest.raises(PermissionError, match=r"/proc/1 is not writable"):
        stalwart.CheckpointManager("/proc/1")


def test_uncreatable_directory_is_a_clear_error():
    with pytest.raises(
        PermissionError, match=r"cannot create checkpoint directory /sys/kernel/stalwart"
    ):
        stalwart.CheckpointManager("/sys/kernel/stalwart/run")


def test_restore_of_a_missing_step_lists_the_steps(tmp_path):
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(4, p.state)
        with pytest.raises(stalwart.CheckpointNotFoundError, match=r"step 5 .*committed steps: 4"):
            ckpt.restore(p.state, step=5)


def test_state_missing_a_checkpoint_key_is_refused_unless_not_strict(tmp_path):
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, make_parts(hidden=8).state)
    small = stalwart.TrainState(model=torch.nn.Sequential(torch.nn.Linear(4, 8)))
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(
            stalwart.StateMismatchError,
            match=r"in the checkpoint but not in the state: .*model\.2\.bias",
        ):
            ckpt.restore(small, step=1)
        assert ckpt.restore(small, step=1, strict=False) == 1


@pytest.mark.parametrize("strict", [True, False])
def test_a_model_of_other_shapes_is_a_mismatch_and_the_checkpoint_stays(tmp_path, strict):
    # DCP fails such a read like a damaged file; a good checkpoint must not be moved
    # aside as corrupt (the run would start over), and latest-restore must not skip it.
    saved = make_parts(hidden=8)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, saved.state)
    wider = make_parts(hidden=16)
    before = {k: v.clone() for k, v in wider.model.state_dict().items()}
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(
            stalwart.StateMismatchError,
            match=r"tensor shapes differ: 0\.weight: checkpoint \[8, 4\], model \[16, 4\]",
        ):
            ckpt.restore(wider.state, strict=strict)
        assert ckpt.all_steps() == [1]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".step_")) == []
    assert_same(wider.model.state_dict(), before)  # nothing live was touched
    assert not wider.optimizer.state
    same = make_parts(hidden=8)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(same.state) == 1
    assert_same(same.model.state_dict(), saved.model.state_dict())


def test_state_with_a_key_the_checkpoint_lacks_is_refused_unless_not_strict(tmp_path):
    a = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, stalwart.TrainState(model=a.model))
    b = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(
            stalwart.StateMismatchError,
            match="the state has 'optimizer' but the checkpoint does not",
        ):
            ckpt.restore(b.state)
        assert ckpt.restore(b.state, strict=False) == 1
    assert_same(a.model.state_dict(), b.model.state_dict())


def test_newer_format_version_is_skipped_by_restore_and_refused_for_its_step(tmp_path):
    """An intact (self-checksummed) newer manifest: restore() goes on without it; step=N raises."""
    p = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, p.state)
    path = tmp_path / "step_000000001" / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["format_version"] = 99
    path.write_text(sign(data))
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(p.state) is None
        with pytest.raises(stalwart.UnsupportedFormatError, match="version 99"):
            ckpt.restore(p.state, step=1)
    assert path.is_file()


def test_unpicklable_user_value_is_refused_at_save_and_nothing_is_committed(tmp_path):
    p = make_parts(extra={"epoch": 0, "best": 1.0, "tokenizer": object()})
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(
            TypeError, match=r"state\['extra'\]\['tokenizer'\] is a builtins.object"
        ):
            ckpt.save(1, p.state)
        assert ckpt.all_steps() == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".step", "step"))]


def test_a_component_failing_to_give_its_state_is_a_save_error_with_the_cause(tmp_path):
    class Broken:
        def state_dict(self) -> dict:
            raise RuntimeError("the data stream lost its position")

        def load_state_dict(self, state: dict) -> None:
            pass

    good = make_parts()
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, good.state)
        with pytest.raises(stalwart.CheckpointSaveError, match="lost its position") as caught:
            ckpt.save(2, stalwart.TrainState(model=good.model, stream=Broken()))
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert ckpt.all_steps() == [1]  # the earlier checkpoint is untouched
    failed = [e for e in read_events(tmp_path) if e["event"] == "save_failed"]
    assert failed and failed[-1]["step"] == 2


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(ValueError, match="every_steps"):
        stalwart.CheckpointManager(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="keep_last"):
        stalwart.CheckpointManager(tmp_path, keep_last=0)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ValueError, match="step must be a non-negative integer"):
            ckpt.save(-1, make_parts().state)
        with pytest.raises(TypeError, match="TrainState"):
            ckpt.save(1, {"model": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer was given without model"):
        stalwart.TrainState(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(TypeError, match="scheduler= must have state_dict"):
        stalwart.TrainState(scheduler=3)


def test_sigterm_sets_preempted_and_forces_the_next_save(tmp_path):
    import signal

    p = make_parts()
    with stalwart.CheckpointManager(tmp_path, every_steps=1000) as ckpt:
        assert not ckpt.save(7, p.state)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stalwart.signals.preemption_requested()
        assert not ckpt.preempted  # not before a save handled it: a loop must not leave yet
        assert ckpt.save(8, p.state)
        assert ckpt.preempted
        assert ckpt.all_steps() == [8]
    assert not stalwart.signals.preemption_requested()  # the handlers are gone
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _warmup(step: int, *, warm: int) -> float:
    return min(1.0, (step + 1) / warm)


def test_scheduler_state_with_empty_containers_round_trips(tmp_path):
    """LambdaLR over functools.partial saves lr_lambdas == [{}]; it must come back as is."""
    import functools

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(_warmup, warm=10))
    for _ in range(3):
        opt.step()
        sched.step()
    assert sched.state_dict()["lr_lambdas"] == [{}]
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(
            3, stalwart.TrainState(model=model, optimizer=opt, scheduler=sched, extra={"empty": {}})
        )
    model2 = torch.nn.Linear(2, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, functools.partial(_warmup, warm=10))
    extra2: dict = {}
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        state2 = stalwart.TrainState(model=model2, optimizer=opt2, scheduler=sched2, extra=extra2)
        assert ckpt.restore(state2, strict=False) == 3
    assert sched2.state_dict() == sched.state_dict()
    assert extra2 == {"empty": {}}


def test_a_save_leaves_torch_save_crc_setting_as_it_was(tmp_path):
    from torch.utils.serialization import config  # in every torch stalwart supports (>= 2.9)

    parts = make_parts()
    assert config.save.compute_crc32 is True
    with stalwart.CheckpointManager(tmp_path / "run", async_save=True) as ckpt:
        ckpt.save(1, parts.state)
        ckpt.wait()
        assert config.save.compute_crc32 is True
        config.save.compute_crc32 = False  # the user's own choice is kept too
        try:
            ckpt.save(2, parts.state)
            ckpt.wait()
            assert config.save.compute_crc32 is False
        finally:
            config.save.compute_crc32 = True
        fresh = make_parts()
        assert ckpt.restore(fresh.state) == 2
