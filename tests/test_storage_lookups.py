"""A save looks up the run's steps it needs directly: its cost does not grow with the kept steps.

A run that keeps every 1000th step of a million holds a thousand checkpoints;
listing them (a stat of each manifest) on every save added about 60 ms of CPU
time and 35 ms of stall to each save of a small model. The direct look-ups
must agree with ``scan`` on every kind of entry a run directory can hold.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from stalwart.layout import (
    MANIFEST_NAME,
    CheckpointName,
    hidden_name,
    parse_checkpoint_name,
    parse_step_key,
    step_dir_name,
    step_of_dir_name,
)
from stalwart.storage.base import StepEntry, is_committed, newest_committed
from stalwart.storage.local import LocalStorage

from .conftest import make_parts, train_steps


def _committed_dir(run: Path, step: int) -> Path:
    path = run / step_dir_name(step)
    path.mkdir(parents=True)
    (path / MANIFEST_NAME).write_text("{}")
    return path


def _mixed_run(run: Path) -> None:
    """Committed steps 1 and 3, and at higher steps everything that is not one."""
    _committed_dir(run, 1)
    _committed_dir(run, 3)
    (run / step_dir_name(5)).mkdir()  # no manifest: incomplete
    os.symlink(run / step_dir_name(3), run / step_dir_name(7))  # a link to a committed step
    (run / step_dir_name(9)).write_text("{}")  # a file named like a step
    (run / step_dir_name(10)).mkdir()
    (run / step_dir_name(10) / MANIFEST_NAME).mkdir()  # the manifest is a directory
    (run / hidden_name(11, "tmp")).mkdir()
    (run / hidden_name(12, "del")).mkdir()
    (run / "step_12").mkdir()  # too few digits: not a checkpoint name


def test_direct_lookups_agree_with_scan_on_every_kind_of_entry(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _mixed_run(run)
    storage = LocalStorage(run)
    scanned = {e.step for e in storage.scan() if e.status == "committed"}
    assert scanned == {1, 3}
    assert storage.committed_steps() == [1, 3]
    for step in range(14):
        assert storage.is_committed(step) == (step in scanned), step
    assert storage.newest_committed() == 3
    (run / step_dir_name(3) / MANIFEST_NAME).unlink()
    assert storage.newest_committed() == 1 and not storage.is_committed(3)
    assert [e.status for e in storage.scan() if e.step == 3] == ["incomplete"]


def test_lookups_of_a_run_that_does_not_exist_yet(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "absent")
    assert storage.newest_committed() is None
    assert not storage.is_committed(0)
    assert storage.committed_steps() == [] and storage.scan() == []


class _Counting(LocalStorage):
    """The real ``LocalStorage``, counting how often the run is listed."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.listings = 0

    def scan(self) -> list[StepEntry]:
        self.listings += 1
        return super().scan()

    def committed_steps(self) -> list[int]:
        self.listings += 1
        return super().committed_steps()


class _ProtocolOnly:
    """A storage with only the protocol's methods (no direct look-ups): the fallback."""

    def __init__(self, root: Path) -> None:
        self._local = LocalStorage(root)

    def begin(self, step: int) -> Path:
        return self._local.begin(step)

    def path_of(self, name: str) -> Path:
        return self._local.path_of(name)

    def step_path(self, step: int) -> Path:
        return self._local.step_path(step)

    def commit(self, staging: Path, step: int, manifest_json: str) -> Path:
        return self._local.commit(staging, step, manifest_json)

    def abort(self, staging: Path) -> None:
        self._local.abort(staging)

    def scan(self) -> list[StepEntry]:
        return self._local.scan()

    def committed_steps(self) -> list[int]:
        return self._local.committed_steps()

    def quarantine(self, step: int) -> Path:
        return self._local.quarantine(step)

    def delete(self, step: int) -> None:
        self._local.delete(step)


def _save_each(ckpt: stalwart.CheckpointManager, parts: Any, steps: range) -> None:
    """A step of training and a save (waited for) at each of ``steps``."""
    for step in steps:
        train_steps(parts, 1)
        assert ckpt.save(step, parts.state, force=True)
        ckpt.wait()


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_that_keep_every_step_never_list_the_run(tmp_path: Path, async_save: bool) -> None:
    run = tmp_path / "run"
    for step in range(100):
        _committed_dir(run, 1000 + step)  # steps of an earlier process, all kept
    storage = _Counting(run)
    parts = make_parts()
    with stalwart.CheckpointManager(
        run, storage=storage, keep_last=None, async_save=async_save, handle_signals=False
    ) as ckpt:
        _save_each(ckpt, parts, range(2000, 2004))
        assert storage.listings == 0
        # A step already committed (by the earlier process) is never written again.
        assert not ckpt.save(1050, parts.state, force=True)
        assert storage.listings == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    points = [e for e in events if e["event"] == "recovery_point"]
    # (The skipped save of 1050 records its recovery point too: step 2003.)
    assert [p["durable_step"] for p in points] == [1099, 2000, 2001, 2002, 2003]
    assert [e["step"] for e in events if e["event"] == "save_skipped"] == [1050]


def test_retention_lists_the_run_once_per_save(tmp_path: Path) -> None:
    run = tmp_path / "run"
    storage = _Counting(run)
    parts = make_parts()
    with stalwart.CheckpointManager(
        run, storage=storage, keep_last=2, handle_signals=False
    ) as ckpt:
        _save_each(ckpt, parts, range(1, 6))
        assert storage.listings == 5
    assert LocalStorage(run).committed_steps() == [4, 5]


def test_a_storage_without_direct_lookups_is_listed_instead(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _mixed_run(run)
    storage = _ProtocolOnly(run)
    assert isinstance(storage, stalwart.storage.CheckpointStorage)
    assert newest_committed(storage) == 3
    assert [s for s in range(14) if is_committed(storage, s)] == [1, 3]
    parts = make_parts()
    with stalwart.CheckpointManager(
        run, storage=storage, keep_last=None, handle_signals=False
    ) as ckpt:
        assert not ckpt.save(3, parts.state, force=True)  # committed already
        train_steps(parts, 1)
        assert ckpt.save(20, parts.state, force=True)
    assert newest_committed(storage) == 20 == LocalStorage(run).newest_committed()


@pytest.mark.parametrize(
    "name",
    ["step_0000000005", "step_000000005\n", "step_00000005"],
    ids=["ten-digits", "trailing-newline", "eight-digits"],
)
def test_a_step_spelt_otherwise_is_no_checkpoint_and_restore_takes_the_one_before(
    tmp_path: Path, name: str
) -> None:
    """A copy (or a crafted directory) named like step 5 but not as stalwart names it
    used to be listed as step 5, and a restore then failed on ``step_000000005``,
    which does not exist, instead of taking step 3."""
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        train_steps(parts, 1)
        ckpt.save(3, parts.state, force=True)
        wanted = {k: v.clone() for k, v in parts.model.state_dict().items()}
        train_steps(parts, 1)
        ckpt.save(5, parts.state, force=True)
    os.rename(run / step_dir_name(5), run / name)
    assert parse_checkpoint_name(name) is None and step_of_dir_name(name) is None
    assert parse_checkpoint_name(hidden_name(5, "tmp").replace("000000005", name[5:])) is None
    assert parse_step_key(f"{name}/{MANIFEST_NAME}") is None
    storage = LocalStorage(run)
    assert storage.committed_steps() == [3] and storage.newest_committed() == 3
    assert [e.name for e in storage.scan()] == [step_dir_name(3)]
    fresh = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(fresh.state) == 3
        for key, value in wanted.items():
            assert torch.equal(fresh.model.state_dict()[key], value), key
        assert ckpt.save(5, fresh.state, force=True)  # step 5 is not taken
    assert LocalStorage(run).committed_steps() == [3, 5]
    assert (run / name).is_dir()  # never touched


def test_steps_past_nine_digits_are_named_and_parsed_alike(tmp_path: Path) -> None:
    for step in (0, 7, 999_999_999, 1_000_000_000, 12_345_678_901):
        name = step_dir_name(step)
        assert step_of_dir_name(name) == step
        assert parse_checkpoint_name(hidden_name(step, "del")) == CheckpointName(step, "del")
        assert parse_step_key(f"{name}/{MANIFEST_NAME}") == (step, MANIFEST_NAME)
    run = tmp_path / "run"
    _committed_dir(run, 1_000_000_000)
    _committed_dir(run, 999_999_999)
    assert LocalStorage(run).committed_steps() == [999_999_999, 1_000_000_000]
    assert LocalStorage(run).newest_committed() == 1_000_000_000
