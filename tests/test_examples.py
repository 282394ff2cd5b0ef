"""The examples and the quickstart run, and a SIGKILLed run resumes bit-exact.

Each case runs real processes: ``examples/demo.py`` starts ``examples/charlm.py``
three times (reference, SIGKILLed, resumed) and compares the final states.
"""

from __future__ import annotations

import importlib.util
import json
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


@pytest.mark.slow
def test_sigkilled_run_resumes_bit_exact(tmp_path: Path) -> None:
    proc, summary = run_demo(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["crash_returncode"] == -signal.SIGKILL
    assert summary["resumed_from"] == 15
    assert summary["exact"], summary["differ"]
    assert summary["tensors_compared"] > 50  # model, both AdamW moments, RNG: not an empty diff
    assert summary["saves"] == {"reference": 6, "crashed": 3, "resumed": 3}
    assert "exact: yes" in proc.stdout


@pytest.mark.slow
def test_resume_is_exact_when_the_worker_count_changes(tmp_path: Path) -> None:
    """Killed while two DataLoader workers prefetch, resumed with none: same result."""
    proc, summary = run_demo(tmp_path, "--crash-workers", "2", "--resume-workers", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["crash_returncode"] == -signal.SIGKILL
    assert summary["resumed_from"] == 15
    assert summary["exact"], summary["differ"]


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
