"""Several modules and optimizers, per-rank values and agreed restores under real torchrun.

The GAN of examples/gan.py (BatchNorm in both networks, an EMA generator passed
by keyword, sharded under FSDP2) is SIGKILLed on one rank and restarted by
torchrun; every tensor of every rank and every loss must equal an uninterrupted
run's. tests/distributed/multimodel_worker.py checks per-rank extra and state
and a restore that fails on one rank.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from stalwart.safe_load import read_dcp_metadata

from ..conftest import assert_same
from ..support.torchrun import ok, starts, torchrun

GAN = Path(__file__).parents[2] / "examples" / "gan.py"
WORKER = Path(__file__).parent / "multimodel_worker.py"
STEPS = "16"


def gan(tmp: Path, name: str, kind: str, *args: str, restarts: int = 0) -> Path:
    out = tmp / name
    ok(
        torchrun(
            2,
            "--parallel",
            kind,
            "--run-dir",
            str(tmp / f"{name}-run"),
            "--steps",
            STEPS,
            "--out",
            str(out),
            *args,
            restarts=restarts,
            script=GAN,
        )
    )
    return out


def losses(out: Path, rank: int) -> list[tuple[str, str]]:
    lines = Path(f"{out}.losses.rank{rank}").read_text().splitlines()
    return [(line.split()[0], line) for line in lines]


@pytest.mark.parametrize(
    ("kind", "save"),
    [("ddp", []), ("fsdp2", []), ("ddp", ["--async-save"]), ("fsdp2", ["--async-save"])],
    ids=str,
)
def test_killed_gan_resumes_bit_exact_on_every_rank(
    tmp_path: Path, kind: str, save: list[str]
) -> None:
    """Weights, BatchNorm buffers, the EMA, both optimizers, per-rank extra and every loss."""
    ref = gan(tmp_path, "ref", kind)
    killed = gan(
        tmp_path, "killed", kind, "--crash-at", "12", "--crash-rank", "1", *save, restarts=1
    )
    for rank in range(2):
        a = torch.load(f"{ref}.rank{rank}", weights_only=False)
        b = torch.load(f"{killed}.rank{rank}", weights_only=False)
        assert set(a) == set(b) and {"model.G", "model.D", "ema", "extra"} <= set(a)
        assert_same(a, b, f"rank {rank}")
        reference = dict(losses(ref, rank))
        redone = losses(killed, rank)
        assert len(redone) > int(STEPS)  # steps 11 and 12 ran twice
        assert all(reference[step] == line for step, line in redone)
    # BatchNorm statistics differ between ranks, so each rank saved its own copy.
    keys = set(read_dcp_metadata(tmp_path / "killed-run" / "step_000000015").state_dict_metadata)
    assert {"per_rank.rank_0", "per_rank.rank_1"} <= keys
    assert "ema.0.weight" in keys  # the EMA went through DCP, not as one rank's blob
    manifest = json.loads(
        (tmp_path / "killed-run" / "step_000000015" / "MANIFEST.json").read_text()
    )
    ema = "fsdp2" if kind == "fsdp2" else "replicated"
    assert manifest["topology"]["modules"] == {"model.G": kind, "model.D": kind, "ema": ema}


def test_uninterrupted_runs_differ_per_rank(tmp_path: Path) -> None:
    """The comparison above can fail: the ranks' BatchNorm statistics really differ."""
    out = gan(tmp_path, "ref", "ddp")
    a = torch.load(f"{out}.rank0", weights_only=False)
    b = torch.load(f"{out}.rank1", weights_only=False)
    with pytest.raises(AssertionError):
        assert_same(a["model.D"], b["model.D"])


def test_per_rank_extra_and_state_come_back_to_their_rank(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    ok(torchrun(2, "--run-dir", run, "--steps", "4", script=WORKER))
    proc = ok(torchrun(2, "--run-dir", run, "--steps", "6", script=WORKER))
    # The two ranks share one stdout, so their lines may interleave: match each whole report.
    reports = re.findall(
        r"rank \d start \d+ mine \d+ n \d+ keys [\w,]+?only_on_rank_\d", proc.stdout
    )
    assert sorted(reports) == [
        "rank 0 start 4 mine 4 n 4 keys mine,only_on_rank_0",
        "rank 1 start 4 mine 1004 n 104 keys mine,only_on_rank_1",
    ], proc.stdout
    manifest = json.loads((tmp_path / "run" / "step_000000006" / "MANIFEST.json").read_text())
    assert manifest["topology"]["parallelism"] == "ddp"
    assert manifest["topology"]["modules"] == {"model": "ddp"}


def test_restore_failing_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    ok(torchrun(2, "--run-dir", run, "--steps", "4", script=WORKER))
    proc = torchrun(2, "--run-dir", run, "--fail-load-rank", "1", timeout=120, script=WORKER)
    assert proc.returncode != 0
    out = proc.stdout
    assert "rank 0 restore-error StateMismatchError" in out, out + proc.stderr[-3000:]
    assert "rank 1 restore-error StateMismatchError" in out, out
    assert "injected load failure on rank 1" in out
    assert set(starts(proc)) == set(), out  # no rank went on training


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_per_rank_values_at_another_world_size_fall_back_to_rank_0_with_a_warning(
    tmp_path: Path, kind: str
) -> None:
    """Objects with per-rank values never make a strict restore fail at another world size."""
    run = str(tmp_path / "run")
    common = ("--parallel", kind, "--run-dir", run, "--every", "4")
    ok(torchrun(2, *common, "--steps", "8", script=GAN))
    proc = ok(torchrun(3, *common, "--steps", "10", script=GAN))
    assert set(starts(proc)) == {8}, proc.stdout
    assert "no per-rank values for rank_2" in proc.stderr, proc.stderr[-3000:]
    assert "no per-rank values for rank_0" not in proc.stderr
