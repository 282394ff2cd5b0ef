"""The plan cache on 2 real gloo ranks: a layout change on any rank, or of a DTensor's sharding, is planned anew."""

from __future__ import annotations

import json
from pathlib import Path

from ..support.torchrun import ok, torchrun

WORKER = Path(__file__).parent / "save_plan_worker.py"


def test_every_save_reads_back_and_only_an_unchanged_layout_reuses_the_plan(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report.json"
    ok(torchrun(2, str(tmp_path / "ckpt"), str(out), script=WORKER))
    reports = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    for report in reports:
        assert all(report["reads_back"].values()), report
    # Only the coordinator plans globally: a miss per new layout, a hit for the repeat;
    # rank 1's new key alone is a new layout, although rank 0's own plan is unchanged.
    assert reports[0]["counts"] == {
        "first": [1, 0],
        "same layout": [1, 1],
        "other sharding": [2, 1],
        "rank 1 adds a key": [3, 1],
    }
