"""CheckpointManager with a durable tier: uploads, retention per tier, node loss, URL-only runs."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

import stalwart
from stalwart.storage.durable import DurableTier

from ..conftest import (
    assert_same,
    flip_byte,
    make_parts,
    seed_all,
    snapshot,
    train_steps,
    uninterrupted,
)
from .conftest import FAST, run_events, verify_durable


def test_every_commit_is_uploaded_and_each_tier_keeps_its_own_retention(
    tmp_path, s3_env, s3_bucket
):
    url = f"s3://{s3_bucket}/exp1"
    parts = make_parts()
    run = tmp_path / "run"
    with stalwart.CheckpointManager(
        run,
        durable=stalwart.DurableConfig(
            url=url, keep_last=3, keep_every=4, retry=FAST, max_pending=10
        ),
        keep_last=2,
        handle_signals=False,
    ) as ckpt:
        for step in range(1, 11):
            train_steps(parts, 1)
            ckpt.save(step, parts.state)
            time.sleep(0.05)  # a training step
        assert ckpt.wait_durable(60)
        assert ckpt.last_durable_step == 10
        assert ckpt.pending_uploads == []
        assert ckpt.all_steps() == [9, 10]
    tier = DurableTier(url, retry=FAST)
    assert tier.committed_steps() == [4, 8, 9, 10]
    for step in (8, 10):
        verify_durable(tier, step, tmp_path)
    events = run_events(run)
    uploads = [e for e in events if e["event"] == "upload"]
    assert [e["step"] for e in uploads] == list(range(1, 11))
    assert all(e["lag_s"] is not None and e["bytes"] > 0 for e in uploads)
    assert {e["step"] for e in events if e["event"] == "durable_delete"} == {1, 2, 3, 5, 6, 7}


def test_durable_every_uploads_every_nth_and_the_last_checkpoint_at_close(
    tmp_path, s3_env, s3_bucket
):
    url = f"s3://{s3_bucket}/every"
    parts = make_parts()
    with stalwart.CheckpointManager(
        tmp_path / "run",
        durable=stalwart.DurableConfig(url=url, every=3, retry=FAST),
        keep_last=None,
    ) as ckpt:
        for step in range(1, 8):
            ckpt.save(step, parts.state)
    assert DurableTier(url, retry=FAST).committed_steps() == [3, 6, 7]


def test_node_loss_restores_from_durable_and_resumes_bit_exact(tmp_path, s3_env, s3_bucket):
    url = f"s3://{s3_bucket}/nodeloss"
    expected = uninterrupted(12)

    seed_all(0)
    first = make_parts()
    run = tmp_path / "node-a"
    with stalwart.CheckpointManager(
        run,
        durable=stalwart.DurableConfig(url=url, retry=FAST),
        every_steps=4,
        handle_signals=False,
    ) as ckpt:
        for step in range(1, 9):
            train_steps(first, 1)
            ckpt.save(step, first.state)
    shutil.rmtree(run)  # the node and its disk are gone

    second = make_parts()
    with stalwart.CheckpointManager(
        tmp_path / "node-b",
        durable=stalwart.DurableConfig(url=url, retry=FAST),
        every_steps=4,
        handle_signals=False,
    ) as ckpt:
        assert ckpt.restore(second.state) == 8
        train_steps(second, 4)
    assert_same(snapshot(second), expected)
    restore = [e for e in run_events(tmp_path / "node-b") if e["event"] in ("download", "restore")]
    assert [e["event"] for e in restore] == ["download", "restore"]
    assert restore[1]["source"] == "durable"


def test_restore_prefers_the_local_copy_and_falls_back_to_durable_when_it_is_damaged(
    tmp_path, s3_env, s3_bucket
):
    url = f"s3://{s3_bucket}/prefer"
    model = torch.nn.Linear(32, 32)
    state = stalwart.TrainState(model=model)
    run = tmp_path / "run"
    with stalwart.CheckpointManager(
        run, durable=stalwart.DurableConfig(url=url, retry=FAST)
    ) as ckpt:
        ckpt.save(5, state)
    expected = model.weight.detach().clone()
    fresh = torch.nn.Linear(32, 32)
    with stalwart.CheckpointManager(
        run, durable=stalwart.DurableConfig(url=url, retry=FAST)
    ) as ckpt:
        assert ckpt.restore(stalwart.TrainState(model=fresh)) == 5
    assert [e.get("source") for e in run_events(run) if e["event"] == "restore"] == ["local"]
    flip_byte(next((run / "step_000000005").glob("*.distcp")))
    fresh = torch.nn.Linear(32, 32)
    with stalwart.CheckpointManager(
        run, durable=stalwart.DurableConfig(url=url, retry=FAST)
    ) as ckpt:
        assert ckpt.restore(stalwart.TrainState(model=fresh)) == 5
    assert torch.equal(fresh.weight, expected)
    events = run_events(run)
    assert [e["source"] for e in events if e["event"] == "restore"] == ["local", "durable"]
    assert any(e["event"] == "quarantine" for e in events)


def test_a_url_alone_stages_locally_and_keeps_history_in_the_store(
    tmp_path, s3_env, s3_bucket, monkeypatch
):
    monkeypatch.setenv("STALWART_LOCAL_DIR", str(tmp_path / "scratch"))
    url = f"s3://{s3_bucket}/urlonly"
    parts = make_parts()
    with stalwart.CheckpointManager(
        url, keep_last=3, durable=stalwart.DurableConfig(url=url, retry=FAST)
    ) as ckpt:
        assert str(ckpt.directory).startswith(str(tmp_path / "scratch"))
        for step in range(1, 6):
            train_steps(parts, 1)
            ckpt.save(step, parts.state)
            ckpt.wait_durable(30)  # a slow training step: every checkpoint gets uploaded
        local = ckpt.all_steps()
    assert local == [5]  # the local copy only stages uploads
    assert DurableTier(url, retry=FAST).committed_steps() == [3, 4, 5]
    expected = snapshot(parts)
    shutil.rmtree(tmp_path / "scratch")
    again = make_parts()
    with stalwart.CheckpointManager(
        url, durable=stalwart.DurableConfig(url=url, retry=FAST)
    ) as ckpt:
        assert ckpt.restore(again.state) == 5
    got = snapshot(again)
    for key in ("model", "optimizer", "scheduler", "scaler", "extra"):
        assert_same(got[key], expected[key], key)


def test_an_fsspec_url_works_as_durable_tier_with_create_only_commits(tmp_path):
    url = (tmp_path / "backup" / "exp").as_uri()
    parts = make_parts()
    with stalwart.CheckpointManager(
        tmp_path / "run", durable=stalwart.DurableConfig(url=url, retry=FAST)
    ) as ckpt:
        for step in (1, 2):
            ckpt.save(step, parts.state)
    tier = DurableTier(url, retry=FAST)
    assert tier.committed_steps() == [1, 2]
    verify_durable(tier, 2, tmp_path)
    # A second run writing a different checkpoint of step 2 into the same place loses.
    other = make_parts(hidden=4)

    def second_run() -> None:
        with stalwart.CheckpointManager(
            tmp_path / "other", durable=stalwart.DurableConfig(url=url, retry=FAST)
        ) as c:
            c.save(2, other.state)
            c.wait_durable(30)

    with pytest.raises(stalwart.CommitConflictError):
        second_run()
    verify_durable(tier, 2, tmp_path)  # the first run's checkpoint is intact


def test_bad_durable_arguments_fail_fast_with_a_clear_message(tmp_path, s3_env, s3_bucket):
    with pytest.raises(ValueError, match="durable must be an object-store URL"):
        stalwart.CheckpointManager(tmp_path / "a", durable="bucket/prefix")
    with pytest.raises(ValueError, match=r"DurableConfig\.every must be a positive integer"):
        stalwart.CheckpointManager(
            tmp_path / "b", durable=stalwart.DurableConfig(url=f"s3://{s3_bucket}/x", every=0)
        )
    with pytest.raises(stalwart.DurableStoreError, match="refuses this run"):
        stalwart.CheckpointManager(tmp_path / "c", durable="s3://no-such-bucket-here/x")
    # A refused tier leaves the directory unlocked for the next try.
    with stalwart.CheckpointManager(tmp_path / "c", durable=f"s3://{s3_bucket}/x") as ckpt:
        assert ckpt.last_durable_step is None
