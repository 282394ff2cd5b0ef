"""One conversation per save: the checkpoint collectives of a save, counted on real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

from ..support.torchrun import ok, torchrun

WORKER = Path(__file__).parent / "collectives_worker.py"
MAX_PER_SAVE = 4
"""docs/architecture.md: decide (all-reduce), open (all-gather: staging directory,
state collected, per-rank digests, hosts), reports (all-gather: files), outcome
(all-gather: the commit)."""


def test_a_distributed_save_runs_at_most_four_collectives_and_a_skipped_call_one(
    tmp_path: Path,
) -> None:
    run, out = tmp_path / "run", tmp_path / "counts.json"
    ok(torchrun(2, str(run), str(out), script=WORKER))
    for rank in (0, 1):
        report = json.loads(Path(f"{out}.rank{rank}").read_text())
        assert report["steps"] == [2, 4, 6]
        saving = [c["n"] for c in report["counts"] if c["saved"]]
        idle = [c["n"] for c in report["counts"] if not c["saved"]]
        assert len(saving) == 3 and len(idle) == 3, report
        assert all(0 < n <= MAX_PER_SAVE for n in saving), report
        assert idle == [1, 1, 1], report  # only the save decision
