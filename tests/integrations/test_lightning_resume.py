"""ExactResume: a Lightning run SIGKILLed mid-epoch and resumed with ``fit(ckpt_path="last")``
ends bit-identical to one that was never interrupted (one process, and DDP x2 under torchrun).

Each run is a real process (``lightning_worker.py``); checkpoints every 5 steps,
20 steps of 24 batches per epoch, killed at the start of step 13.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests.support.torchrun import ok, torchrun

WORKER = Path(__file__).with_name("lightning_worker.py")


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(WORKER), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def _losses(out: Path, rank: int) -> dict[int, str]:
    """Step -> loss as written (repr: exact); a redone step must repeat the lost attempt's."""
    seen: dict[int, str] = {}
    for line in Path(f"{out}.losses.rank{rank}").read_text().splitlines():
        step, loss = line.split()
        assert seen.setdefault(int(step), loss) == loss, f"rank {rank} step {step} differs on redo"
    return seen


def _assert_bit_identical(a: Path, b: Path, ranks: int) -> None:
    for rank in range(ranks):
        assert _losses(a, rank) == _losses(b, rank)
        wa = torch.load(f"{a}.rank{rank}", weights_only=True)
        wb = torch.load(f"{b}.rank{rank}", weights_only=True)
        assert wa.keys() == wb.keys()
        for key in wa:
            assert torch.equal(wa[key], wb[key]), f"rank {rank} {key} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The uninterrupted run of a loader kind, made once per module (with or without
    ExactResume it is the same run: capturing the RNG draws nothing)."""
    made: dict[str, Path] = {}

    def get(loader: str) -> Path:
        if loader not in made:
            base = tmp_path_factory.mktemp(f"straight-{loader}")
            ok(_run("--dir", base / "ck", "--out", base / "out", "--loader", loader))
            made[loader] = base / "out"
        return made[loader]

    return get


# The example's demo (below) runs a sync save with ResumableDataLoader on every
# test run; these add torchdata's loader, and an async save that the SIGKILL of
# step 11 may catch mid-write (step 10's save then falls back to step 5's).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("loader", "extra", "kill_at"),
    [("stateful", (), 13), ("resumable", ("--async-save",), 11)],
    ids=["stateful", "async"],
)
def test_sigkill_mid_epoch_then_fit_last_is_bit_identical(
    tmp_path: Path,
    straight: Callable[[str], Path],
    loader: str,
    extra: tuple[str, ...],
    kill_at: int,
) -> None:
    resumed = tmp_path / "out"
    args = ("--dir", tmp_path / "ck", "--out", resumed, "--loader", loader, *extra)
    killed = _run(*args, "--kill-at", kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert len(_losses(resumed, 0)) == kill_at
    proc = ok(_run(*args))

    assert "Restored all states" in proc.stderr + proc.stdout
    _assert_bit_identical(straight(loader), resumed, 1)


def test_without_exact_resume_the_same_kill_diverges(
    tmp_path: Path, straight: Callable[[str], Path]
) -> None:
    """The control: Lightning alone restores weights and data position, not the RNG."""
    resumed = tmp_path / "out"
    killed = _run("--dir", tmp_path / "ck", "--out", resumed, "--no-exact", "--kill-at", 13)
    assert killed.returncode == -9, killed.stderr[-2000:]  # the divergence is the resume's
    ok(_run("--dir", tmp_path / "ck", "--out", resumed, "--no-exact"))
    with pytest.raises(AssertionError, match="differs"):
        _assert_bit_identical(straight("resumable"), resumed, 1)


@pytest.mark.slow
def test_ddp_rank_killed_and_restarted_by_torchrun_is_bit_identical(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight" / "out", tmp_path / "resumed" / "out"
    ok(torchrun(2, "--ddp", "--dir", str(tmp_path / "ck0"), "--out", str(straight), script=WORKER))

    proc = ok(
        torchrun(
            2,
            "--ddp",
            "--dir",
            str(tmp_path / "ck1"),
            "--out",
            str(resumed),
            "--kill-at",
            "13",
            "--kill-rank",
            "1",
            restarts=1,
            script=WORKER,
        )
    )

    assert Path(f"{resumed}.killed").exists()
    assert "Restored all states" in proc.stdout + proc.stderr
    _assert_bit_identical(straight, resumed, 2)


def test_lightning_resume_example_demo_is_bit_identical(tmp_path: Path) -> None:
    example = Path(__file__).parents[2] / "examples" / "lightning_resume.py"
    cmd = [sys.executable, str(example), "--demo", "--workdir", str(tmp_path)]
    cmd += ["--steps", "20", "--every", "5", "--kill-at", "13"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)

    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "killed run exited with -9" in proc.stdout
    assert "weights identical: True; losses of all 20 steps identical: True" in proc.stdout
