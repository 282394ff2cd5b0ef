"""Two DDP ranks under torchrun with a durable tier: the node's disk is lost, the job resumes exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stalwart.storage.durable import DurableTier

from ..conftest import assert_same
from ..support.torchrun import final, ok, starts, torchrun


@pytest.mark.slow
def test_ddp_job_restores_from_the_durable_tier_after_losing_its_disk(
    tmp_path: Path, s3_env: dict, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/ddp"
    ref = tmp_path / "ref"
    ok(torchrun(2, "--run-dir", str(ref / "run"), "--out", str(ref / "final.pt")))

    run = tmp_path / "node-a"
    ok(torchrun(2, "--run-dir", str(run), "--steps", "12", "--durable", url))
    assert DurableTier(url).committed_steps() == [4, 8, 12]
    shutil.rmtree(run)  # the node is gone with its local tier

    proc = ok(
        torchrun(
            2,
            "--run-dir",
            str(tmp_path / "node-b"),
            "--out",
            str(tmp_path / "final.pt"),
            "--durable",
            url,
        )
    )
    assert starts(proc) == [12, 12], proc.stdout
    assert_same(final(ref / "final.pt", 2), final(tmp_path / "final.pt", 2))
    assert DurableTier(url).committed_steps()[-1] == 24
