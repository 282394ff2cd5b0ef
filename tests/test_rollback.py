"""Rolling a run back: the newer steps moved aside, kept; training goes on from the step.

After ``restore(state, step=N)`` a run's newer steps would otherwise stay its
newest: ``restore()`` would load them and saves of their step numbers would
be skipped. ``CheckpointManager.rollback`` and ``stalwart rollback`` move them
aside, under the run lock, and refuse what they cannot do safely.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.cli.main import main
from stalwart.layout import EVENTS_NAME, MANIFEST_NAME, step_dir_name
from stalwart.rollback import ASIDE_PREFIX
from stalwart.storage.durable import DurableTier
from stalwart.storage.remote import RetryPolicy

from .conftest import assert_same, make_parts, snapshot, train_steps

STEPS = (100, 200, 300)
FAST = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=20.0, request_timeout=10.0)


def _events(run: Path, kind: str) -> list[dict]:
    lines = (run / EVENTS_NAME).read_text(encoding="utf-8").splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _run(run: Path, steps: tuple[int, ...] = STEPS, **kwargs):
    parts = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False, **kwargs) as ckpt:
        for step in steps:
            train_steps(parts, 1)
            assert ckpt.save(step, parts.state, force=True)
    return parts


def _asides(run: Path) -> list[Path]:
    return sorted(p for p in run.iterdir() if p.name.startswith(ASIDE_PREFIX))


def _listing(run: Path) -> list[str]:
    return sorted(os.listdir(run))


def test_a_rollback_makes_the_step_the_newest_and_training_goes_on_from_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    parts = _run(run)
    old_200 = (run / step_dir_name(200) / MANIFEST_NAME).read_bytes()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(parts.state, step=100) == 100
        (warning,) = _events(run, "restore_rollback")
        assert "call rollback(100) on this manager" in warning["reason"]
        assert ckpt.rollback(100) == [300, 200]
        assert ckpt.all_steps() == [100]
        # The steps moved aside are whole checkpoints, byte for byte.
        (aside,) = _asides(run)
        assert sorted(os.listdir(aside)) == ["fingerprints", step_dir_name(200), step_dir_name(300)]
        assert (aside / step_dir_name(200) / MANIFEST_NAME).read_bytes() == old_200
        (event,) = _events(run, "rollback")
        assert event["step"] == 100 and event["moved"] == [300, 200] and event["left"] == []
        assert event["path"] == str(aside)
        # Training goes on from 100: step 200 is saved again, not skipped.
        train_steps(parts, 1)
        assert ckpt.save(200, parts.state, force=True) is True
        expected = snapshot(parts)
    fresh = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(fresh.state) == 200
    assert_same(snapshot(fresh), expected)
    assert main(["verify", str(aside / step_dir_name(300))]) == 0
    capsys.readouterr()


def test_the_command_lists_with_dry_run_then_moves_and_a_rerun_has_nothing_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _run(run)
    before = _listing(run)
    assert main(["rollback", str(run), "--to", "200", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would move {step_dir_name(300)} -> " in out and step_dir_name(200) + " ->" not in out
    assert _listing(run) == before and _events(run, "rollback") == []

    assert main(["rollback", str(run), "--to", "200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["to"] == 200 and [m["step"] for m in report["moved"]] == [300]
    assert report["fingerprints"] == str(Path(report["aside"]) / "fingerprints")
    assert Path(report["moved"][0]["to"]).is_dir()
    assert sorted(n for n in os.listdir(run) if n.startswith("step_")) == [
        step_dir_name(100),
        step_dir_name(200),
    ]

    assert main(["rollback", str(run), "--to", "200"]) == 0
    assert "nothing to roll back: step 200 is the newest" in capsys.readouterr().out
    assert len(_asides(run)) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "150"], "no committed checkpoint of step 150"),
        (["--to", "abc"], "invalid int value"),
        (["--to", "-5"], "--to is a step number >= 0"),
    ],
)
def test_a_step_that_is_not_committed_is_a_usage_error_and_moves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    run = tmp_path / "run"
    _run(run)
    before = _listing(run)
    assert main(["rollback", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "150" in args:
        assert "committed steps: 100, 200, 300" in err
    assert _listing(run) == before


def test_the_manager_names_the_committed_steps_for_a_step_it_does_not_hold(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _run(run)
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        with pytest.raises(stalwart.CheckpointNotFoundError, match="committed steps: 100, 200"):
            ckpt.rollback(250)
        with pytest.raises(ValueError, match="int >= 0"):
            ckpt.rollback(True)  # type: ignore[arg-type]
        assert ckpt.all_steps() == list(STEPS)


def test_a_checkpoint_directory_instead_of_a_run_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _run(run)
    assert main(["rollback", str(run / step_dir_name(100)), "--to", "100"]) == 2
    assert "is a checkpoint directory" in capsys.readouterr().err


def test_the_command_refuses_while_a_trainer_holds_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second process: a trainer with the run open, waiting. Nothing is moved."""
    run = tmp_path / "run"
    _run(run)
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import pathlib, sys, time
                import stalwart
                with stalwart.CheckpointManager({str(run)!r}, keep_last=None,
                                                handle_signals=False):
                    pathlib.Path({str(ready)!r}).touch()
                    sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if ready.exists() or holder.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), "the trainer process did not open the run"
        before = _listing(run)
        assert main(["rollback", str(run), "--to", "100"]) == 1
        err = capsys.readouterr().err
        assert "already being written by pid" in err and str(holder.pid) in err, err
        assert _listing(run) == before
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)


def test_a_run_with_a_durable_tier_is_refused_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    url = (tmp_path / "store").as_uri()
    parts = _run(run, durable=stalwart.DurableConfig(url=url))
    before = _listing(run)
    assert main(["rollback", str(run), "--to", "100"]) == 2
    err = capsys.readouterr().err
    assert "durable tier" in err and url in err, err
    assert "rollback(100) rolls back both tiers" in err, err
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        with pytest.raises(stalwart.RollbackError, match="durable tier"):
            ckpt.rollback(100)
        assert ckpt.restore(parts.state) == 300
    assert _listing(run) == before


def test_links_and_files_named_like_newer_steps_are_not_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Crafted entries: a link to a checkpoint outside the run and a file, both named
    like newer steps. Only real committed directories are moved."""
    run = tmp_path / "run"
    _run(run, (100, 200))
    outside = tmp_path / "outside"
    _run(outside, (500,))
    (run / step_dir_name(400)).symlink_to(outside / step_dir_name(500))
    (run / step_dir_name(600)).write_text("not a checkpoint")
    assert main(["rollback", str(run), "--to", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["step"] for m in report["moved"]] == [200]
    assert (run / step_dir_name(400)).is_symlink() and (run / step_dir_name(600)).is_file()
    assert (outside / step_dir_name(500) / MANIFEST_NAME).is_file()


def _trajectory(run: Path, steps: range, *, lr_scale: float, restore_to: int | None, cli: bool):
    """Train ``steps`` (saving at even steps, a fingerprint every step); with
    ``restore_to``, restore that step first, rolled back in-process or by the CLI."""
    torch.manual_seed(0)
    parts = make_parts()
    for group in parts.optimizer.param_groups:
        group["lr"] *= lr_scale
    if restore_to is not None and cli:
        assert main(["rollback", str(run), "--to", str(restore_to)]) == 0
    with stalwart.CheckpointManager(run, every_steps=2, keep_last=None, handle_signals=False) as c:
        if restore_to is not None:
            assert c.restore(parts.state, step=None if cli else restore_to) == restore_to
            if not cli:
                assert c.rollback(restore_to) == [6, 4]
            for group in parts.optimizer.param_groups:
                group["lr"] *= lr_scale  # the restore brought the old lr back: change course
        for s in steps:
            train_steps(parts, 1)
            loss = float(parts.model(torch.ones(1, 4)).pow(2).mean().detach())
            c.save(s, parts.state, metrics={"loss": loss})
        return c.resume_verdict


@pytest.mark.parametrize("cli", [False, True], ids=["manager", "cli"])
def test_the_new_trajectory_after_a_rollback_is_not_compared_with_the_abandoned_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cli: bool
) -> None:
    """A rollback changes course on purpose: its fingerprint logs go aside with the
    steps, so the certificate never reports the new steps as a divergence."""
    run = tmp_path / "run"
    _trajectory(run, range(1, 7), lr_scale=1.0, restore_to=None, cli=cli)
    verdict = _trajectory(run, range(3, 7), lr_scale=10.0, restore_to=2, cli=cli)
    capsys.readouterr()
    events = [e["event"] for e in _events_all(run)]
    assert "resume_diverged" not in events, events
    if cli:
        assert verdict is not None and verdict.event == "resume_unverified"
    (aside,) = _asides(run)
    assert (aside / "fingerprints").is_dir()
    (event,) = _events(run, "rollback")
    assert event["fingerprints"] == str(aside / "fingerprints")


def test_without_a_rollback_the_same_change_of_course_is_a_divergence(tmp_path: Path) -> None:
    """The control: the certificate does compare, and the changed course shows."""
    run = tmp_path / "run"
    _trajectory(run, range(1, 7), lr_scale=1.0, restore_to=None, cli=False)
    torch.manual_seed(0)
    parts = make_parts()
    with stalwart.CheckpointManager(run, every_steps=2, keep_last=None, handle_signals=False) as c:
        assert c.restore(parts.state, step=2) == 2
        for group in parts.optimizer.param_groups:
            group["lr"] *= 10.0
        for s in range(3, 7):
            train_steps(parts, 1)
            loss = float(parts.model(torch.ones(1, 4)).pow(2).mean().detach())
            c.save(s, parts.state, metrics={"loss": loss})
    assert "resume_diverged" in [e["event"] for e in _events_all(run)]


def _events_all(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / EVENTS_NAME).read_text().splitlines()]


def test_a_linked_fingerprints_directory_is_left_where_it_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Crafted: the run's fingerprints/ is a link to a directory outside the run. A
    rollback moves the steps and never renames through the link."""
    run = tmp_path / "run"
    _run(run)
    shutil.rmtree(run / "fingerprints")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's")
    (run / "fingerprints").symlink_to(outside)
    assert main(["rollback", str(run), "--to", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["step"] for m in report["moved"]] == [300, 200]
    assert report["fingerprints"] is None
    assert (run / "fingerprints").is_symlink() and (outside / "keep.txt").is_file()


def test_an_events_log_that_is_a_link_stops_the_rollback_before_anything_moves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Crafted: events.jsonl replaced by a link. The run's history cannot be read (so
    whether it has a durable tier is unknown): nothing moves, and the error says why."""
    run = tmp_path / "run"
    _run(run)
    target = tmp_path / "other.jsonl"
    target.write_text((run / EVENTS_NAME).read_text())
    (run / EVENTS_NAME).unlink()
    (run / EVENTS_NAME).symlink_to(target)
    before = _listing(run)
    assert main(["rollback", str(run), "--to", "100"]) == 1
    err = capsys.readouterr().err
    assert EVENTS_NAME in err, err
    assert _listing(run) == before


def test_a_manager_with_the_durable_tier_rolls_both_tiers_back(tmp_path: Path) -> None:
    """The tier's newer steps leave it; one only the tier held is downloaded first and
    kept aside with the others; the step numbers are uploaded again afterwards."""
    run = tmp_path / "run"
    url = (tmp_path / "store").as_uri()
    durable = stalwart.DurableConfig(url=url, keep_last=None, keep_every=None, retry=FAST)
    parts = make_parts()
    with stalwart.CheckpointManager(
        run, keep_last=2, durable=durable, handle_signals=False
    ) as ckpt:
        for step in (100, 200, 300, 400):
            train_steps(parts, 1)
            assert ckpt.save(step, parts.state, force=True)
        assert ckpt.wait_durable()
        assert ckpt.all_steps() == [300, 400]
    tier = DurableTier(url, retry=FAST)
    assert tier.committed_steps() == [100, 200, 300, 400]
    old_manifests = {s: tier.manifest_bytes(s) for s in (200, 300, 400)}
    with stalwart.CheckpointManager(
        run, keep_last=None, durable=durable, handle_signals=False
    ) as ckpt:
        assert ckpt.restore(parts.state, step=100) == 100
        (warning,) = _events(run, "restore_rollback")
        assert "call rollback(100) on this manager first" in warning["reason"]
        assert f"deletes them from {url}" in warning["reason"], warning["reason"]
        assert ckpt.rollback(100) == [400, 300, 200]
        assert tier.committed_steps() == [100]
        assert ckpt.last_durable_step == 100
        (aside,) = _asides(run)
        for step, manifest in old_manifests.items():
            assert (aside / step_dir_name(step) / MANIFEST_NAME).read_bytes() == manifest
        deleted = [e for e in _events_all(run) if e["event"] == "durable_delete"]
        assert [e["step"] for e in deleted] == [400, 300, 200]
        assert all(e["reason"] == "rollback to step 100" for e in deleted)
        train_steps(parts, 1)
        assert ckpt.save(200, parts.state, force=True) is True
        assert ckpt.wait_durable()
        assert tier.committed_steps() == [100, 200]
        assert ckpt.last_durable_step == 200
        expected = snapshot(parts)
        new_200 = (run / step_dir_name(200) / MANIFEST_NAME).read_bytes()
    assert tier.manifest_bytes(200) == new_200 != old_manifests[200]
    fresh = make_parts()
    with stalwart.CheckpointManager(
        run, keep_last=None, durable=durable, handle_signals=False
    ) as ckpt:
        assert ckpt.restore(fresh.state) == 200
    assert_same(snapshot(fresh), expected)


def test_a_step_not_committed_changes_neither_tier(tmp_path: Path) -> None:
    run = tmp_path / "run"
    url = (tmp_path / "store").as_uri()
    durable = stalwart.DurableConfig(url=url, keep_last=None, keep_every=None, retry=FAST)
    _run(run, durable=durable)
    tier = DurableTier(url, retry=FAST)
    with stalwart.CheckpointManager(
        run, keep_last=None, durable=durable, handle_signals=False
    ) as ckpt:
        assert ckpt.wait_durable()
        with pytest.raises(stalwart.CheckpointNotFoundError, match="committed steps"):
            ckpt.rollback(150)
        assert tier.committed_steps() == list(STEPS) and ckpt.all_steps() == list(STEPS)


def test_a_tier_that_fails_stops_the_rollback_before_the_run_changes(tmp_path: Path) -> None:
    """The store stops answering (its root replaced by a file) after the manager opened:
    the rollback raises, the run directory is as it was, and a rerun, once the store
    is back, finishes."""
    run, store = tmp_path / "run", tmp_path / "store"
    durable = stalwart.DurableConfig(
        url=store.as_uri(), keep_last=None, keep_every=None, retry=FAST
    )
    _run(run, durable=durable)
    with stalwart.CheckpointManager(
        run, keep_last=None, durable=durable, handle_signals=False
    ) as ckpt:
        assert ckpt.wait_durable()
        store.rename(tmp_path / "away")
        store.write_text("not a store")
        before = _listing(run)
        with pytest.raises(stalwart.RollbackError, match="back to step 100 failed"):
            ckpt.rollback(100)
        assert _listing(run) == before and ckpt.all_steps() == list(STEPS)
        store.unlink()
        (tmp_path / "away").rename(store)
        assert ckpt.rollback(100) == [300, 200]
    assert DurableTier(store.as_uri(), retry=FAST).committed_steps() == [100]


def test_a_step_set_aside_comes_back_with_a_rename_and_restores_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the docs say undoes a rollback: rename the step back; it is the run's
    newest again and restores bit for bit."""
    run = tmp_path / "run"
    parts = _run(run)
    expected = snapshot(parts)
    assert main(["rollback", str(run), "--to", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (newest,) = [m for m in report["moved"] if m["step"] == 300]
    os.rename(newest["to"], run / step_dir_name(300))
    fresh = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(fresh.state) == 300
    assert_same(snapshot(fresh), expected)


def test_ls_names_what_rollbacks_set_aside_and_ignores_lookalikes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _run(run)
    assert main(["rollback", str(run), "--to", "200"]) == 0
    assert main(["rollback", str(run), "--to", "100"]) == 0
    capsys.readouterr()
    first, second = sorted(_asides(run), key=lambda p: p.stat().st_mtime)
    # Lookalikes: a link to a directory of steps elsewhere, a file, and a directory
    # whose name carries a terminal escape and no step number.
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / step_dir_name(900)).mkdir(parents=True)
    (run / f"{ASIDE_PREFIX}7-link").symlink_to(elsewhere)
    (run / f"{ASIDE_PREFIX}8-file").write_text("not a directory")
    crafted = run / f"{ASIDE_PREFIX}x\x1b[2J-y"
    (crafted / step_dir_name(5)).mkdir(parents=True)
    os.utime(crafted, (time.time() + 60, time.time() + 60))

    assert main(["ls", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(a["path"], a["to"], a["steps"]) for a in report["set_aside"]] == [
        (first.name, 200, [300]),
        (second.name, 100, [200]),
        (crafted.name, None, [5]),
    ]
    assert [e["step"] for e in report["entries"]] == [100]

    assert main(["ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"set aside by a rollback to step 200: 300, in {first.name}/" in out
    assert f"set aside by a rollback to step 100: 200, in {second.name}/" in out
    assert "set aside by a rollback to step ?: 5, in .rolled-back-x\\x1b[2J-y/" in out
    assert "\x1b" not in out and "900" not in out

    # A run whose every step was set aside by hand still shows where they are.
    bare = tmp_path / "bare"
    (bare / f"{ASIDE_PREFIX}3-abc" / step_dir_name(4)).mkdir(parents=True)
    (bare / EVENTS_NAME).write_bytes((run / EVENTS_NAME).read_bytes())
    assert main(["ls", str(bare)]) == 0
    out = capsys.readouterr().out
    assert f"{bare}: no checkpoints" in out
    assert f"set aside by a rollback to step 3: 4, in {ASIDE_PREFIX}3-abc/" in out
