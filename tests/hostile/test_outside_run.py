"""A run directory is input from outside: nothing in it makes stalwart write outside it.

Links, FIFOs and hard links are planted where stalwart writes (``.lock``,
``events.jsonl``, step directories, staging and deletion leftovers); every test
asserts that the file or directory outside the run is byte-for-byte unchanged,
and that nothing hangs on a FIFO.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

import stalwart
from stalwart.errors import RunLockedError
from stalwart.events import EventLog, NotRegularFileError, read_events
from stalwart.storage.local import LocalStorage

from ..conftest import assert_one_line_error, cli, make_parts

SECRET_BYTES = b"precious bytes outside the run\n"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the run that must never change."""
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(SECRET_BYTES)
    return path


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run with committed steps 1 and 2 (and no manager open)."""
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        ckpt.save(1, parts.state)
        ckpt.save(2, parts.state)
    return run


def plant_lock_link(run: Path, target: Path) -> None:
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(target)


# ----------------------------------------------------------------- the lock


def test_manager_refuses_a_lock_that_is_a_symlink_and_leaves_its_target_alone(
    run: Path, outside: Path
) -> None:
    plant_lock_link(run, outside)
    with pytest.raises(RunLockedError, match=r"\.lock is a symbolic link.*Remove"):
        stalwart.CheckpointManager(run)
    assert outside.read_bytes() == SECRET_BYTES


def test_a_dangling_lock_link_does_not_create_its_target(run: Path, tmp_path: Path) -> None:
    target = tmp_path / "outside-new-file"
    plant_lock_link(run, target)
    with pytest.raises(RunLockedError, match="symbolic link"):
        stalwart.CheckpointManager(run)
    assert not target.exists()


def test_manager_refuses_a_lock_that_is_a_hard_link(run: Path, outside: Path) -> None:
    (run / ".lock").unlink(missing_ok=True)
    os.link(outside, run / ".lock")
    with pytest.raises(RunLockedError, match="hard link"):
        stalwart.CheckpointManager(run)
    assert outside.read_bytes() == SECRET_BYTES


def test_a_fifo_as_lock_is_refused_without_blocking(run: Path) -> None:
    (run / ".lock").unlink(missing_ok=True)
    os.mkfifo(run / ".lock")
    started = time.monotonic()
    with pytest.raises(RunLockedError, match="FIFO"):
        stalwart.CheckpointManager(run)
    assert time.monotonic() - started < 10


def test_the_manager_works_again_once_the_link_is_removed(run: Path, outside: Path) -> None:
    plant_lock_link(run, outside)
    with pytest.raises(RunLockedError):
        stalwart.CheckpointManager(run)
    (run / ".lock").unlink()
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        assert ckpt.all_steps() == [1, 2]
    assert outside.read_bytes() == SECRET_BYTES


def test_gc_dry_run_lists_and_never_writes_through_a_lock_link(
    run: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plant_lock_link(run, outside)
    code, out, _err = cli(capsys, "gc", run, "--dry-run", "--grace", "0s")
    assert code == 0, out
    assert "symbolic link" in out
    assert outside.read_bytes() == SECRET_BYTES


def test_gc_refuses_a_lock_link_in_one_line(
    run: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plant_lock_link(run, outside)
    code, _out, err = cli(capsys, "gc", run, "--grace", "0s")
    assert code == 1
    assert_one_line_error(err, ".lock is a symbolic link")
    assert outside.read_bytes() == SECRET_BYTES


# ----------------------------------------------------------------- events.jsonl


def test_events_are_never_appended_through_a_link(
    run: Path, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (run / "events.jsonl").unlink()
    (run / "events.jsonl").symlink_to(outside)
    parts = make_parts()
    with caplog.at_level(logging.WARNING, logger="stalwart"):
        with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
            ckpt.save(3, parts.state)
            ckpt.save(4, parts.state)
    assert outside.read_bytes() == SECRET_BYTES
    refusals = [r for r in caplog.records if "events.jsonl is a symbolic link" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3, 4]


def test_events_are_never_appended_to_a_hard_link(run: Path, outside: Path) -> None:
    (run / "events.jsonl").unlink()
    os.link(outside, run / "events.jsonl")
    EventLog(run / "events.jsonl").emit("save", step=3)
    assert outside.read_bytes() == SECRET_BYTES


def test_a_fifo_as_events_log_blocks_neither_saves_nor_ls(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "events.jsonl").unlink()
    os.mkfifo(run / "events.jsonl")
    started = time.monotonic()
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        ckpt.save(3, make_parts().state)
    code, out, err = cli(capsys, "ls", run)
    assert time.monotonic() - started < 30
    assert code == 0, err
    assert "step_000000003" in out or "3" in out
    assert "FIFO" in err


def test_read_events_refuses_a_link(tmp_path: Path, outside: Path) -> None:
    (tmp_path / "events.jsonl").symlink_to(outside)
    with pytest.raises(NotRegularFileError, match="symbolic link"):
        list(read_events(tmp_path))


def test_event_log_writes_a_regular_file(tmp_path: Path) -> None:
    EventLog(tmp_path / "events.jsonl").emit("save", step=1)
    assert [r["step"] for r in read_events(tmp_path)] == [1]


# ----------------------------------------------------------------- step directories


def fake_checkpoint(directory: Path) -> dict[str, bytes]:
    """A directory outside the run that looks like a checkpoint; returns its files' bytes."""
    directory.mkdir(parents=True)
    (directory / "MANIFEST.json").write_text("{}")
    (directory / "__0_0.distcp").write_bytes(SECRET_BYTES)
    return snapshot_tree(directory)


def snapshot_tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_step_link_is_not_a_checkpoint_and_retention_leaves_its_target(
    run: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere" / "step"
    files = fake_checkpoint(elsewhere)
    (run / "step_000000000").symlink_to(elsewhere, target_is_directory=True)
    assert [e.name for e in LocalStorage(run).scan()] == ["step_000000001", "step_000000002"]
    parts = make_parts()
    with stalwart.CheckpointManager(run, keep_last=1) as ckpt:
        ckpt.save(3, parts.state)
        assert ckpt.all_steps() == [3]
    assert snapshot_tree(elsewhere) == files


def test_delete_removes_a_link_itself_never_its_target(run: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "step"
    files = fake_checkpoint(elsewhere)
    (run / "step_000000009").symlink_to(elsewhere, target_is_directory=True)
    LocalStorage(run).delete(9)
    assert not os.path.lexists(run / "step_000000009")
    assert [p for p in run.iterdir() if ".del-" in p.name] == []
    assert snapshot_tree(elsewhere) == files


def test_deleting_a_step_never_descends_a_link_inside_it(run: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "data"
    files = fake_checkpoint(elsewhere)
    (run / "step_000000001" / "shards").symlink_to(elsewhere, target_is_directory=True)
    LocalStorage(run).delete(1)
    assert not (run / "step_000000001").exists()
    assert snapshot_tree(elsewhere) == files


@pytest.mark.parametrize("kind", ["tmp", "del", "corrupt"])
def test_gc_never_sweeps_through_a_leftover_that_is_a_link(
    run: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "elsewhere" / "leftover"
    files = fake_checkpoint(elsewhere)
    link = run / f".step_000000005.{kind}-0123456789ab"
    link.symlink_to(elsewhere, target_is_directory=True)
    old = time.time() - 7200
    os.utime(elsewhere, (old, old))
    code, _out, err = cli(capsys, "gc", run, "--grace", "0s", "--corrupt")
    assert code == 0, err
    assert snapshot_tree(elsewhere) == files
    assert elsewhere.is_dir()


def test_gc_sweeps_a_real_leftover_without_following_a_link_inside(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "elsewhere" / "data"
    files = fake_checkpoint(elsewhere)
    leftover = run / ".step_000000007.tmp-0123456789ab"
    leftover.mkdir()
    (leftover / "shards").symlink_to(elsewhere, target_is_directory=True)
    (leftover / "__0_0.distcp").write_bytes(b"x" * 10)
    code, out, err = cli(capsys, "gc", run, "--grace", "0s")
    assert code == 0, err
    assert "removed 1 entries" in out
    assert not os.path.lexists(leftover)
    assert snapshot_tree(elsewhere) == files


def test_commit_refuses_a_dangling_link_at_the_final_name(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    target = tmp_path / "nowhere"
    (tmp_path / "step_000000004").symlink_to(target)
    staging = storage.begin(4)
    with pytest.raises(stalwart.errors.CheckpointSaveError, match="already exists"):
        storage.commit(staging, 4, "{}")
    assert not target.exists()


def test_ls_does_not_hang_on_fifos_in_the_run(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(run / "step_000000008")
    os.mkfifo(run / ".step_000000009.tmp-0123456789ab")
    code, out, err = cli(capsys, "ls", run)
    assert code == 0, err
    assert "step_000000008" not in out
    code, out, err = cli(capsys, "gc", run, "--dry-run", "--grace", "0s")
    assert code == 0, err
    assert ".step_000000009" not in out


# ----------------------------------------------------------------- report output


def test_report_never_writes_through_links_in_the_run(
    run: Path, tmp_path: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "report").mkdir()
    (run / "report" / "timeline.png").symlink_to(outside)
    (run / "report" / "report.html").symlink_to(tmp_path / "outside" / "new.html")
    code, _out, err = cli(capsys, "report", run)
    assert code == 0, err
    assert outside.read_bytes() == SECRET_BYTES
    assert not (tmp_path / "outside" / "new.html").exists()
    assert not (run / "report" / "timeline.png").is_symlink()
    assert (run / "report" / "timeline.png").read_bytes().startswith(b"\x89PNG")


def test_report_refuses_a_report_directory_that_is_a_link(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "outside" / "reports"
    elsewhere.mkdir(parents=True)
    (run / "report").symlink_to(elsewhere, target_is_directory=True)
    code, _out, err = cli(capsys, "report", run)
    assert code == 1
    assert_one_line_error(err, "symbolic link", "--out")
    assert list(elsewhere.iterdir()) == []
