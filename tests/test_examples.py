"""The examples and the quickstart run, and a killed run resumes bit-exact.

Each case runs real processes: ``examples/demo.py`` runs ``examples/charlm.py``
under torchrun on 2 ranks twice (a reference, and a run in which one rank is
SIGKILLed and torchrun restarts both), or with ``--single`` as three plain
processes (reference, SIGKILLed, resumed), and compares the final states.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "demo.py"
QUICKSTART = REPO / "docs" / "quickstart.md"
DISTRIBUTED = REPO / "docs" / "distributed.md"


def run_demo(
    tmp_path: Path, *extra: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    summary = tmp_path / "summary.json"
    # Small settings: 30 steps, a checkpoint every 5, killed after step 17, so the
    # resume must start at 15 and redo 16 and 17.
    cmd = [sys.executable, str(DEMO), "--workdir", str(tmp_path / "demo"), "--steps", "30"]
    cmd += ["--every", "5", "--crash-at", "17", "--batch-size", "8"]
    cmd += ["--summary-json", str(summary), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert summary.exists(), f"demo wrote no summary:\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(summary.read_text())


def load_demo_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stalwart_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the module executes.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_rank_sigkilled_under_torchrun_is_restarted_and_resumes_bit_exact(
    tmp_path: Path,
) -> None:
    """Rank 1 dies by SIGKILL; within the same torchrun both ranks restart at step 15 and match."""
    proc, summary = run_demo(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["mode"] == "torchrun" and summary["nproc"] == 2
    assert summary["torchrun_returncode"] == 0  # recovered inside one torchrun command
    assert summary["killed_rank"] == 1
    assert summary["killed_exitcode"] == -signal.SIGKILL  # from torchrun's own log
    assert summary["restarts"] == 1
    assert summary["starts"] == {"0": {"0": 0, "1": 0}, "1": {"0": 15, "1": 15}}
    assert summary["resumed_from"] == 15
    assert summary["exact"], summary["differ"]
    # model, both AdamW moments, each rank's RNG: not an empty diff
    assert summary["tensors_compared"] > 50
    assert summary["saves"] == {"reference": 6, "first_attempt": 3, "after_restart": 3}
    assert "exact: yes" in proc.stdout
    # stalwart's own verdict agrees; rank 0 recorded step 17 in the save rank 1 never reached.
    line = "resume verified exact through step 17 on 2 ranks"
    assert summary["certificate"] == line
    assert f"certificate: {line}" in proc.stdout


@pytest.mark.slow
def test_three_ranks_resume_bit_exact(tmp_path: Path) -> None:
    """With 3 ranks the all-reduce's order of addition matters: DDP must not re-bucket after a resume."""
    proc, summary = run_demo(tmp_path, "--nproc", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["killed_rank"] == 2 and summary["killed_exitcode"] == -signal.SIGKILL
    assert summary["starts"]["1"] == {"0": 15, "1": 15, "2": 15}
    assert summary["exact"], summary["differ"]


@pytest.mark.slow
def test_single_process_sigkilled_run_resumes_bit_exact(tmp_path: Path) -> None:
    proc, summary = run_demo(tmp_path, "--single")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["mode"] == "single"
    assert summary["crash_returncode"] == -signal.SIGKILL
    assert summary["resumed_from"] == 15
    assert summary["exact"], summary["differ"]
    assert summary["tensors_compared"] > 50
    assert summary["saves"] == {"reference": 6, "crashed": 3, "resumed": 3}
    assert "exact: yes" in proc.stdout
    # The killed process recorded step 16, not 17: it died before that step's save.
    assert summary["certificate"] == "resume verified exact through step 16 on 1 rank"


@pytest.mark.slow
def test_resume_is_exact_when_the_worker_count_changes(tmp_path: Path) -> None:
    """Killed while two DataLoader workers prefetch, resumed with none: same result."""
    proc, summary = run_demo(tmp_path, "--single", "--crash-workers", "2", "--resume-workers", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["crash_returncode"] == -signal.SIGKILL
    assert summary["resumed_from"] == 15
    assert summary["exact"], summary["differ"]
    # Batch digests do not depend on the worker count: the certificate verifies too.
    assert summary["certificate"] == "resume verified exact through step 16 on 1 rank"


def test_compare_reports_a_one_ulp_difference(tmp_path: Path) -> None:
    """The demo's verdict could fail: one changed bit in one optimizer moment is reported."""
    demo = load_demo_module()
    state: dict[str, Any] = {
        "model": {"w": torch.ones(3)},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}},
        "losses": {1: 0.5, 2: 0.25},
    }
    torch.save(state, tmp_path / "a.pt")
    state["optimizer"]["state"][0]["exp_avg"][1] = torch.nextafter(
        torch.tensor(0.0), torch.tensor(1.0)
    )
    state["losses"] = {2: 0.25}
    torch.save(state, tmp_path / "b.pt")
    n_tensors, differ = demo.compare(tmp_path / "a.pt", tmp_path / "b.pt")
    assert n_tensors == 2
    assert differ == ["optimizer.state.0.exp_avg"]


def test_compare_runs_reports_a_difference_in_one_ranks_rng(tmp_path: Path) -> None:
    """Each rank's own file is compared too: one changed RNG byte on rank 1 is reported."""
    demo = load_demo_module()
    for name in ("a", "b"):
        torch.save({"model": {"w": torch.ones(2)}}, tmp_path / f"{name}.pt")
        for rank in range(2):
            rng = torch.arange(8, dtype=torch.uint8)
            if name == "b" and rank == 1:
                rng[3] += 1
            per_rank = {"torch_rng": rng, "losses": {1: 0.5}}
            torch.save(per_rank, tmp_path / f"{name}.pt.rank{rank}")
    n_tensors, differ = demo.compare_runs(tmp_path / "a.pt", tmp_path / "b.pt", 2)
    assert n_tensors == 3
    assert differ == ["rank1.torch_rng"]


def test_quickstart_script_runs_and_resumes(tmp_path: Path) -> None:
    """The script in docs/quickstart.md trains, and a second run restores its last checkpoint."""
    blocks = re.findall(r"```python\n(.*?)```", QUICKSTART.read_text(), flags=re.DOTALL)
    assert blocks, "docs/quickstart.md has no python block"
    script = tmp_path / "quickstart.py"
    script.write_text(blocks[0])
    outputs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-X", "faulthandler", str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outputs.append(proc.stdout.strip())
    assert outputs == [
        "started at step 0, newest checkpoint: step 200",
        "started at step 200, newest checkpoint: step 200",
    ]


def test_distributed_doc_script_runs_and_resumes_under_torchrun(tmp_path: Path) -> None:
    """The DDP script in docs/distributed.md trains on 2 ranks, and a second launch resumes it."""
    blocks = re.findall(r"```python\n(.*?)```", DISTRIBUTED.read_text(), flags=re.DOTALL)
    assert blocks, "docs/distributed.md has no python block"
    script = tmp_path / "train.py"
    script.write_text(blocks[0])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outputs = []
    for _ in range(2):
        proc = subprocess.run(
            [*cmd, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
        outputs.append(proc.stdout.strip())
    assert outputs == [
        "started at step 0, newest checkpoint: step 200",
        "started at step 200, newest checkpoint: step 200",
    ]
    manifest = json.loads(
        (tmp_path / "runs" / "ddp" / "step_000000200" / "MANIFEST.json").read_text()
    )
    assert manifest["world_size"] == 2 and manifest["topology"]["parallelism"] == "ddp"
