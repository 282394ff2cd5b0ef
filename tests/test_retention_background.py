"""Retention frees a deleted checkpoint's files in the background, and never lets the run
hold more on disk than it would with the removal in place."""

from __future__ import annotations

import threading
from pathlib import Path

import stalwart
from stalwart.layout import parse_checkpoint_name
from stalwart.storage import local
from stalwart.storage.local import LocalStorage

from .support.interrupts import small_state


def leftovers(run: Path, kind: str) -> list[str]:
    """Names of the run's hidden directories of ``kind`` (``del``: being removed)."""
    return sorted(
        p.name
        for p in run.iterdir()
        if (parsed := parse_checkpoint_name(p.name)) is not None and parsed.kind == kind
    )


def test_a_deleted_checkpoint_is_freed_in_the_background_before_the_next_save_writes(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _model, _opt, state = small_state()
    release = threading.Event()
    with stalwart.CheckpointManager(run, keep_last=1, handle_signals=False) as ckpt:
        assert ckpt.save(1, state, force=True)
        # The one remover thread is held, as a slow filesystem would hold it.
        held = local._REMOVERS.submit(release.wait, 60)
        try:
            assert ckpt.save(2, state, force=True)  # retention deletes step 1
            # Gone at once as a checkpoint; its files wait for the remover.
            assert ckpt.all_steps() == [2]
            assert not (run / "step_000000001").exists()
            (doomed,) = leftovers(run, "del")
            assert (run / doomed / "MANIFEST.json").exists()

            # The next save takes no space before that removal ran.
            saving = threading.Thread(target=ckpt.save, args=(3, state), kwargs={"force": True})
            saving.start()
            saving.join(1.0)
            assert saving.is_alive(), "the save did not wait for the pending removal"
            assert leftovers(run, "tmp") == [] and ckpt.all_steps() == [2]
        finally:
            release.set()
        saving.join(60)
        assert not saving.is_alive() and held.result() is True
        assert ckpt.all_steps() == [3]
        assert doomed not in leftovers(run, "del")  # step 2's may still be going
        assert ckpt.save(4, state, force=True)
    # close waited for the removal of step 3: nothing is left being deleted.
    assert leftovers(run, "del") == [] and LocalStorage(run).committed_steps() == [4]
    restored = small_state()[2]
    with stalwart.CheckpointManager(run, handle_signals=False) as again:
        assert again.restore(restored) == 4


def test_a_storage_that_deletes_for_a_command_frees_the_files_before_it_returns(
    tmp_path: Path,
) -> None:
    """``stalwart`` commands and integrations build their own storage: no background."""
    run = tmp_path / "run"
    _model, _opt, state = small_state()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, state, force=True)
    release = threading.Event()
    held = local._REMOVERS.submit(release.wait, 60)  # a background removal could not run
    try:
        LocalStorage(run).delete(1)
        assert leftovers(run, "del") == [] and LocalStorage(run).committed_steps() == [2]
    finally:
        release.set()
    assert held.result() is True
