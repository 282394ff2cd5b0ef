"""Retention never deletes the checkpoint the run just wrote, whatever larger steps the run holds.

``keep_last`` counts steps by number. A larger step the run did not write (a
stray copy, a crafted directory) or no longer follows (the checkpoints after a
``restore(step=N)`` that rolled back) used to take the kept places, and every
new checkpoint was deleted right after its commit.
"""

from __future__ import annotations

from pathlib import Path

import torch

import stalwart
from stalwart.layout import MANIFEST_NAME, step_dir_name
from stalwart.storage.local import LocalStorage

from .conftest import make_parts, train_steps


def _values(parts) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in parts.model.state_dict().items()}


def test_a_stray_larger_step_does_not_make_retention_delete_each_new_checkpoint(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    stray = run / step_dir_name(900_000)
    stray.mkdir(parents=True)
    (stray / MANIFEST_NAME).write_text("{}")  # named and marked like a checkpoint, but none
    parts = make_parts()
    with stalwart.CheckpointManager(run, keep_last=1, handle_signals=False) as ckpt:
        for step in (1, 2, 3):
            train_steps(parts, 1)
            assert ckpt.save(step, parts.state, force=True)
            ckpt.wait()
            assert LocalStorage(run).committed_steps() == [step, 900_000]
    wanted = _values(parts)
    fresh = make_parts()
    with stalwart.CheckpointManager(run, keep_last=1, handle_signals=False) as ckpt:
        assert ckpt.restore(fresh.state) == 3  # the stray fails its check and is set aside
    for key, value in wanted.items():
        assert torch.equal(fresh.model.state_dict()[key], value), key


def test_after_a_rollback_the_new_checkpoints_are_kept(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        for step in (100, 200):
            train_steps(parts, 1)
            ckpt.save(step, parts.state, force=True)
    with stalwart.CheckpointManager(run, keep_last=1, handle_signals=False) as ckpt:
        assert ckpt.restore(parts.state, step=100) == 100
        train_steps(parts, 1)
        assert ckpt.save(150, parts.state, force=True)
        ckpt.wait()
        # 100 goes (keep_last=1), 200 is the newest step, 150 is this run's own.
        assert LocalStorage(run).committed_steps() == [150, 200]
        train_steps(parts, 1)
        assert ckpt.save(175, parts.state, force=True)
        ckpt.wait()
        wanted = _values(parts)
        assert LocalStorage(run).committed_steps() == [175, 200]
    fresh = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(fresh.state, step=175) == 175
    for key, value in wanted.items():
        assert torch.equal(fresh.model.state_dict()[key], value), key
