"""A damaged checkpoint is never loaded: restore falls back to the newest good one, exactly.

A run with committed steps 1, 2 and 3 of a small model + AdamW + scheduler is
built once; every test damages a private copy of it on disk (flipped bytes,
truncation, deleted files, read errors from the OS) and restores through the
public API. The files of step 3 are enumerated from its directory, so a new
file in the format is covered without editing this module.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stalwart
from stalwart.cli.main import main
from stalwart.manifest import MANIFEST_NAME
from stalwart.pipeline import verify_checkpoint

from ..conftest import Parts, assert_same, make_parts, snapshot, train_steps
from .faulty import DAMAGES, FaultyStorage, checkpoint_files, copy_run, events_of, flip_byte

STEP3 = "step_000000003"


@dataclasses.dataclass(frozen=True)
class Pristine:
    run: Path
    files: list[str]
    """Files of step 3, relative to its directory, as found on disk."""
    expected: dict[int, dict]
    """``snapshot`` of the training state right after each step was saved."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    run = tmp_path_factory.mktemp("pristine") / "run"
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    parts = make_parts()
    expected = {}
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        for step in (1, 2, 3):
            train_steps(parts, 2)
            assert ckpt.save(step, parts.state)
            # snapshot() draws from every RNG; the restored RNGs must give the same draws.
            # deepcopy: the optimizer's state tensors are live and change with training.
            expected[step] = copy.deepcopy(snapshot(parts))
    files = checkpoint_files(run / STEP3)
    # The enumeration must cover the manifest, DCP's metadata and the tensor data.
    assert MANIFEST_NAME in files and ".metadata" in files, files
    assert any(f.endswith(".distcp") for f in files), files
    return Pristine(run=run, files=files, expected=expected)


def fresh_parts() -> Parts:
    torch.manual_seed(12345)  # a restarted process starts from other weights and RNG states
    return make_parts()


def weights(parts: Parts) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in parts.model.state_dict().items()}


def manager(run: Path) -> stalwart.CheckpointManager:
    return stalwart.CheckpointManager(run, keep_last=None, handle_signals=False)


def damaged_copies(pristine: Pristine, tmp: Path, damage: str) -> Iterator[tuple[str, Path]]:
    """For each file of step 3: a fresh copy of the run with that file damaged."""
    for name in pristine.files:
        if damage == "delete" and name == MANIFEST_NAME:
            continue  # without its manifest a directory is no checkpoint: tested on its own below
        run = copy_run(pristine.run, tmp / f"{damage}-{name.strip('.')}" / "run")
        DAMAGES[damage](run / STEP3 / name)
        yield name, run


def assert_skip_logged(run: Path, step: int, file: Path) -> dict:
    skips = [e for e in events_of(run, "restore_skipped") if e["step"] == step]
    assert len(skips) == 1, skips
    assert skips[0]["file"] == str(file), skips[0]
    assert str(file) in skips[0]["reason"] and len(skips[0]["reason"]) > len(str(file)) + 5
    return skips[0]


def moved_aside(run: Path, step: int) -> list[str]:
    return sorted(n for n in os.listdir(run) if n.startswith(f".step_{step:09d}.corrupt-"))


# ------------------------------------------------------------------ fallback


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_restore_falls_back_to_the_previous_step_exactly(
    pristine: Pristine, tmp_path: Path, damage: str
) -> None:
    """Whatever file of the newest checkpoint is damaged, restore loads step 2 bit for bit."""
    for name, run in damaged_copies(pristine, tmp_path, damage):
        parts = fresh_parts()
        with manager(run) as ckpt:
            assert ckpt.restore(parts.state) == 2, (damage, name)
        assert_same(pristine.expected[2], snapshot(parts), f"{damage} {name}")
        assert_skip_logged(run, 3, run / STEP3 / name)
        restored = events_of(run, "restore")
        assert [e["step"] for e in restored] == [2], (damage, name)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_checkpoint_is_moved_aside(pristine: Pristine, tmp_path: Path, damage: str) -> None:
    """Bad content is moved out of the way as ``.step_….corrupt-…`` and logged."""
    for name, run in damaged_copies(pristine, tmp_path, damage):
        with manager(run) as ckpt:
            assert ckpt.restore(fresh_parts().state) == 2
            assert ckpt.all_steps() == [1, 2], (damage, name)
        aside = moved_aside(run, 3)
        assert len(aside) == 1 and not (run / STEP3).exists(), (damage, name, os.listdir(run))
        # The evidence is kept for inspection, damage included.
        kept = [f for f in pristine.files if not (damage == "delete" and f == name)]
        assert checkpoint_files(run / aside[0]) == kept
        quarantine = events_of(run, "quarantine")
        assert [(e["step"], e["path"]) for e in quarantine] == [(3, str(run / aside[0]))]


@pytest.mark.parametrize("damage", ["flip_middle", "delete"])
def test_training_resumed_after_a_fallback_saves_the_skipped_step_again(
    pristine: Pristine, tmp_path: Path, damage: str
) -> None:
    """Once step 3 was found bad, reaching step 3 again writes a fresh, good checkpoint."""
    for name, run in damaged_copies(pristine, tmp_path, damage):
        parts = fresh_parts()
        with manager(run) as ckpt:
            assert ckpt.restore(parts.state) == 2
            train_steps(parts, 2)
            assert ckpt.save(3, parts.state), (damage, name)
            assert ckpt.all_steps() == [1, 2, 3]
        with manager(run) as ckpt:
            assert ckpt.restore(fresh_parts().state) == 3, (damage, name)


def test_read_error_skips_the_checkpoint_but_keeps_it(pristine: Pristine, tmp_path: Path) -> None:
    """An OS error while reading (ELOOP here) may pass: skip the step, do not move it aside."""
    run = copy_run(pristine.run, tmp_path / "run")
    data = next(f for f in pristine.files if f.endswith(".distcp"))
    target = run / STEP3 / data
    kept = tmp_path / "kept.distcp"
    target.rename(kept)
    target.symlink_to(target.name)  # a link to itself: stat() fails with ELOOP
    parts = fresh_parts()
    with manager(run) as ckpt:
        assert ckpt.restore(parts.state) == 2
    assert_same(pristine.expected[2], snapshot(parts))
    skip = assert_skip_logged(run, 3, target)
    assert "cannot read" in skip["reason"]
    assert (run / STEP3).is_dir() and not moved_aside(run, 3)
    with pytest.raises(stalwart.CheckpointCorruptError) as caught:
        verify_checkpoint(run / STEP3)
    assert caught.value.transient and isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ELOOP

    target.unlink()
    kept.rename(target)  # the read error is gone; so is the reason to skip step 3
    parts = fresh_parts()
    with manager(run) as ckpt:
        assert ckpt.restore(parts.state) == 3
    assert_same(pristine.expected[3], snapshot(parts))


def test_read_errors_on_every_checkpoint_stop_the_restore_instead_of_starting_over(
    pristine: Pristine, tmp_path: Path
) -> None:
    """Every checkpoint failing in a way that may pass (a read error) is no reason to
    train from step 0 and throw the run's progress away: restore raises, transient,
    and keeps them all; once the error is gone the newest one restores."""
    run = copy_run(pristine.run, tmp_path / "run")
    data = next(f for f in pristine.files if f.endswith(".distcp"))
    for step in (1, 2, 3):
        target = run / f"step_{step:09d}" / data
        target.rename(tmp_path / f"kept{step}")
        target.symlink_to(target.name)  # a link to itself: stat() fails with ELOOP
    parts = fresh_parts()
    before = weights(parts)
    with manager(run) as ckpt:
        with pytest.raises(stalwart.CheckpointCorruptError, match="kept in place") as caught:
            ckpt.restore(parts.state)
        assert caught.value.transient
        assert ckpt.all_steps() == [1, 2, 3]
    assert_same(before, weights(parts))
    for step in (1, 2, 3):
        assert not moved_aside(run, step)
    assert [e["step"] for e in events_of(run, "restore_skipped")] == [3, 2, 1]
    assert not events_of(run, "restore_none")
    for step in (1, 2, 3):
        target = run / f"step_{step:09d}" / data
        target.unlink()
        (tmp_path / f"kept{step}").rename(target)
    with manager(run) as ckpt:
        assert ckpt.restore(parts.state) == 3
    assert_same(pristine.expected[3], snapshot(parts))


def test_failure_to_move_a_corrupt_step_aside_does_not_stop_the_fallback(
    pristine: Pristine, tmp_path: Path
) -> None:
    """Moving aside is housekeeping: a run directory that refuses it still restores step 2."""
    run = copy_run(pristine.run, tmp_path / "run")
    data = next(f for f in pristine.files if f.endswith(".distcp"))
    flip_byte(run / STEP3 / data, 1)
    parts = fresh_parts()
    with stalwart.CheckpointManager(
        run, keep_last=None, handle_signals=False, storage=FaultyStorage(run, "quarantine")
    ) as ckpt:
        assert ckpt.restore(parts.state) == 2
    assert_same(pristine.expected[2], snapshot(parts))
    assert_skip_logged(run, 3, run / STEP3 / data)
    assert (run / STEP3).is_dir()


def test_every_checkpoint_corrupt_restores_nothing(pristine: Pristine, tmp_path: Path) -> None:
    run = copy_run(pristine.run, tmp_path / "run")
    data = next(f for f in pristine.files if f.endswith(".distcp"))
    for step in (1, 2, 3):
        flip_byte(run / f"step_{step:09d}" / data, 17)
    parts = fresh_parts()
    before = weights(parts)
    with manager(run) as ckpt:
        assert ckpt.restore(parts.state) is None
        assert ckpt.all_steps() == []
    assert_same(before, weights(parts))  # nothing was loaded into the state
    for step in (1, 2, 3):
        assert_skip_logged(run, step, run / f"step_{step:09d}" / data)
        assert len(moved_aside(run, step)) == 1
    skipped = [e["step"] for e in events_of(run, "restore_skipped")]
    assert skipped == [3, 2, 1]  # newest first
    assert len(events_of(run, "restore_none")) == 1
    assert not events_of(run, "restore")


# ------------------------------------------------------------------ explicit step


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_restore_of_a_damaged_step_raises_naming_the_file(
    pristine: Pristine, tmp_path: Path, damage: str
) -> None:
    """``restore(step=3)`` never falls back; the error names the file; the state is untouched."""
    for name, run in damaged_copies(pristine, tmp_path, damage):
        parts = fresh_parts()
        before = weights(parts)
        bad = run / STEP3 / name
        with manager(run) as ckpt:
            with pytest.raises(stalwart.CheckpointCorruptError) as info:
                ckpt.restore(parts.state, step=3)
        assert info.value.path == str(bad), (damage, name)
        assert str(bad) in str(info.value), (damage, name)
        assert_same(before, weights(parts), f"{damage} {name}")
        assert_skip_logged(run, 3, bad)


# ------------------------------------------------------------------ verify CLI


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_verify_reports_the_damaged_file(
    pristine: Pristine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    for name, run in damaged_copies(pristine, tmp_path, damage):
        code = main(["verify", str(run)])
        out = capsys.readouterr().out
        assert code == 1, (damage, name, out)
        assert f"{run / STEP3 / name}:" in out, (damage, name, out)
        assert "1 of 3 checkpoints CORRUPT" in out, out


def test_verify_command_exits_non_zero_naming_the_file(pristine: Pristine, tmp_path: Path) -> None:
    """The installed ``stalwart`` entry point, as a real process."""
    exe = Path(sys.executable).with_name("stalwart")
    assert exe.is_file(), f"{exe}: the package's console script is not installed"
    run = copy_run(pristine.run, tmp_path / "run")
    data = next(f for f in pristine.files if f.endswith(".distcp"))
    flip_byte(run / STEP3 / data, 1000)
    assert main(["verify", str(pristine.run)]) == 0  # the same run, undamaged, is good
    bad = subprocess.run(
        [str(exe), "verify", str(run)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"{run / STEP3 / data}: checksum mismatch" in bad.stdout, bad.stdout


# ------------------------------------------------------------------ not checkpoints


def test_step_directory_without_manifest_is_not_a_checkpoint(
    pristine: Pristine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``step_000000004/`` holding DCP files only (no commit marker) is ignored by restore."""
    run = copy_run(pristine.run, tmp_path / "run")
    uncommitted = run / "step_000000004"
    uncommitted.mkdir()
    for name in pristine.files:
        if name != MANIFEST_NAME:
            (uncommitted / name).write_bytes((run / STEP3 / name).read_bytes())
    parts = fresh_parts()
    with manager(run) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
        assert ckpt.restore(parts.state) == 3
        assert_same(pristine.expected[3], snapshot(parts))
        with pytest.raises(stalwart.CheckpointNotFoundError, match="step 4"):
            ckpt.restore(fresh_parts().state, step=4)
    assert not [e for e in events_of(run, "restore_skipped") if e["step"] == 4]
    assert uncommitted.is_dir() and not moved_aside(run, 4)  # left alone, not ours to move

    assert main(["verify", str(uncommitted)]) == 1
    assert f"{uncommitted / MANIFEST_NAME}: missing" in capsys.readouterr().out


def test_deleted_manifest_uncommits_the_checkpoint(
    pristine: Pristine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Deleting MANIFEST.json takes the checkpoint out of existence: restore loads step 2."""
    run = copy_run(pristine.run, tmp_path / "run")
    (run / STEP3 / MANIFEST_NAME).unlink()
    parts = fresh_parts()
    with manager(run) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        assert ckpt.restore(parts.state) == 2
        assert_same(pristine.expected[2], snapshot(parts))
        with pytest.raises(stalwart.CheckpointNotFoundError, match="step 3"):
            ckpt.restore(fresh_parts().state, step=3)
    assert main(["verify", str(run / STEP3)]) == 1
    assert f"{run / STEP3 / MANIFEST_NAME}: missing" in capsys.readouterr().out


def test_stray_staging_directory_is_ignored(pristine: Pristine, tmp_path: Path) -> None:
    """A save that died before its rename, even with a complete manifest inside, is no checkpoint."""
    run = copy_run(pristine.run, tmp_path / "run")
    stray = run / ".step_000000005.tmp-abc"
    stray.mkdir()
    for name in pristine.files:  # byte-identical to a valid checkpoint, manifest included
        (stray / name).write_bytes((run / STEP3 / name).read_bytes())
    parts = fresh_parts()
    with manager(run) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
        assert ckpt.restore(parts.state) == 3
        assert_same(pristine.expected[3], snapshot(parts))
        with pytest.raises(stalwart.CheckpointNotFoundError):
            ckpt.restore(fresh_parts().state, step=5)
    assert checkpoint_files(stray) == pristine.files  # untouched
    assert not events_of(run, "restore_skipped")


# ------------------------------------------------------------------ property


@settings(
    max_examples=15,
    deadline=None,
    database=None,
)
@given(data=st.data())
def test_any_byte_flip_in_tensor_data_is_caught(pristine: Pristine, data: st.DataObject) -> None:
    """A random byte of the .distcp file XORed with a random mask: never loaded, step 2 restored."""
    name = next(f for f in pristine.files if f.endswith(".distcp"))
    size = (pristine.run / STEP3 / name).stat().st_size
    offset = data.draw(st.integers(0, size - 1), label="offset")
    mask = data.draw(st.integers(1, 255), label="mask")
    with tempfile.TemporaryDirectory() as tmp:
        run = copy_run(pristine.run, Path(tmp) / "run")
        flip_byte(run / STEP3 / name, offset, mask)
        parts = fresh_parts()
        with manager(run) as ckpt:
            assert ckpt.restore(parts.state) == 2
        assert_same(pristine.expected[2], snapshot(parts))
        skip = assert_skip_logged(run, 3, run / STEP3 / name)
        assert "checksum mismatch" in skip["reason"]
        assert len(moved_aside(run, 3)) == 1
