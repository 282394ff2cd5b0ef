"""``CheckpointManager.rollback`` on real gloo ranks: one move, the same answer everywhere."""

from __future__ import annotations

import json
from pathlib import Path

from ..support.torchrun import ok, torchrun

WORKER = Path(__file__).parent / "rollback_worker.py"


def test_every_rank_gets_the_steps_moved_and_the_error_for_a_step_not_committed(
    tmp_path: Path,
) -> None:
    run, out = tmp_path / "run", tmp_path / "report.json"
    ok(torchrun(2, str(run), str(out), script=WORKER))
    for rank in (0, 1):
        report = json.loads(Path(f"{out}.rank{rank}").read_text())
        assert report["moved"] == [6, 4] and report["steps"] == [2], report
        assert "no committed checkpoint of step 3" in report["missing"], report
        assert report["saved_again"] is True and report["restored"] == 4, report
        assert report["same"] is True, report
    asides = [p for p in run.iterdir() if p.name.startswith(".rolled-back-2-")]
    assert len(asides) == 1 and sorted(p.name for p in asides[0].iterdir()) == [
        "fingerprints",
        "step_000000004",
        "step_000000006",
    ]
