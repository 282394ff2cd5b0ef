"""A ``restore(step=N)`` that rolls back says what a run going on from there will meet.

Newer committed steps stay the run's: saves of their step numbers are skipped
(a checkpoint is never overwritten) and a ``restore()`` without ``step`` loads
the newest of them. The restore warns, once, naming them and what to do.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import stalwart
from stalwart.layout import EVENTS_NAME, MANIFEST_NAME, step_dir_name

from .conftest import make_parts, train_steps


def _events(run: Path, kind: str) -> list[dict]:
    lines = (run / EVENTS_NAME).read_text(encoding="utf-8").splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _run_with_steps(run: Path, steps: tuple[int, ...]):
    parts = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        for step in steps:
            train_steps(parts, 1)
            assert ckpt.save(step, parts.state, force=True)
    return parts


def test_a_rollback_names_the_newer_steps_and_what_they_will_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    parts = _run_with_steps(run, (100, 200, 300))
    with (
        caplog.at_level(logging.WARNING, logger="stalwart"),
        stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt,
    ):
        assert ckpt.restore(parts.state, step=100) == 100
        (event,) = _events(run, "restore_rollback")
        assert event["step"] == 100 and event["newer_steps"] == [200, 300]
        reason = event["reason"]
        assert "skips saving those step numbers" in reason and "loads step 300" in reason
        assert str(run) in reason
        assert any("restore_rollback" in r.getMessage() for r in caplog.records)
        # What it says is what happens.
        assert ckpt.save(200, parts.state, force=True) is False
        assert ckpt.save(250, parts.state, force=True) is True
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(parts.state) == 300


@pytest.mark.parametrize("step", [None, 300])
def test_a_restore_of_the_newest_step_is_no_rollback(tmp_path: Path, step: int | None) -> None:
    run = tmp_path / "run"
    parts = _run_with_steps(run, (100, 200, 300))
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(parts.state, step=step) == 300
    assert _events(run, "restore_rollback") == []


def test_a_fallback_past_a_damaged_newest_step_is_no_rollback(tmp_path: Path) -> None:
    """restore() without step falls back over a damaged checkpoint to an older one: that
    is the newest good one, not a choice to go back, and the damaged one is set aside."""
    run = tmp_path / "run"
    parts = _run_with_steps(run, (100, 200))
    data = next(p for p in (run / "step_000000200").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(parts.state) == 100
    assert _events(run, "restore_rollback") == []


def test_thousands_of_newer_steps_give_a_warning_of_bounded_length(tmp_path: Path) -> None:
    """Crafted: 3,000 directories named and marked like newer checkpoints. The warning
    names the first ten and says how many the run goes on to skip past."""
    run = tmp_path / "run"
    parts = _run_with_steps(run, (1,))
    for step in range(2, 3002):
        crafted = run / step_dir_name(step)
        crafted.mkdir()
        (crafted / MANIFEST_NAME).write_text("{}")
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(parts.state, step=1) == 1
    (event,) = _events(run, "restore_rollback")
    assert len(event["newer_steps"]) == 3000
    reason = event["reason"]
    assert "(2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...)" in reason and "loads step 3001" in reason
    assert len(reason) < 600, len(reason)
