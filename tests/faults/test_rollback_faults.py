"""A rollback whose renames fail: real failed calls (the LD_PRELOAD shim), not mocks.

The first run of the child records the calls of a rollback of one run; then,
on an identical copy, each of its renames and directory fsyncs is failed in
turn (EIO, ENOSPC). Every case must:

- raise ``OSError`` (the CLI's exit 1), naming nothing it did not do;
- leave every step either in place or whole in the aside directory, never
  half moved, and the run's newest step restorable;
- log the steps it moved (``rollback`` event, with those ``left``);
- be finished by running the rollback again, with the shim disarmed, the
  certificate's fingerprint logs included.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.layout import EVENTS_NAME, MANIFEST_NAME, step_dir_name
from stalwart.rollback import ASIDE_PREFIX, roll_back
from stalwart.storage.local import LocalStorage
from tests.support.iofault import Shim, build, preload_env, read_log

REPO = Path(__file__).resolve().parents[2]
STEPS = (100, 200, 300)


def _make_run(run: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    state = stalwart.TrainState(model=model, rng=False)
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        for step in STEPS:
            with torch.no_grad():
                model.weight.add_(1.0)
            assert ckpt.save(step, state, force=True)


def _whole(directory: Path) -> bool:
    return (directory / MANIFEST_NAME).is_file()


def _rollbacks(run: Path) -> list[dict]:
    lines = (run / EVENTS_NAME).read_text(encoding="utf-8").splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "rollback"]


def child(work: Path) -> dict:
    """Record one rollback, then fail each rename and directory fsync of it on a copy."""
    template = work / "template"
    _make_run(template)
    shim = Shim()
    recorded = work / "recorded"
    shutil.copytree(template, recorded)
    log = work / "calls.log"
    shim.arm(recorded, log=log)
    roll_back(recorded, to=100)
    shim.disarm()
    targets = [op for op in read_log(log) if op.op in ("rename", "fsync", "mkdir")]
    cases = []
    for i, op in enumerate(targets):
        err = (errno.EIO, errno.ENOSPC)[i % 2]
        case = work / f"case{i}"
        shutil.copytree(template, case)
        shim.arm(case, fail_at=op.seq, errno=err)
        raised = None
        try:
            roll_back(case, to=100)
        except OSError as exc:
            raised = exc.errno
        failed = shim.failed_op()
        shim.disarm()
        in_place = [s for s in STEPS if _whole(case / step_dir_name(s))]
        asides = [p for p in case.iterdir() if p.name.startswith(ASIDE_PREFIX)]
        aside = sorted(
            int(p.name.removeprefix("step_")) for a in asides for p in a.iterdir() if _whole(p)
        )
        events = _rollbacks(case)
        logs_aside = any((a / "fingerprints").is_dir() for a in asides)
        rerun = roll_back(case, to=100)
        cases.append(
            {
                "op": op.op,
                "failed": failed,
                "errno": err,
                "raised": raised,
                "in_place": in_place,
                "aside": aside,
                "events": [{"moved": e["moved"], "left": e["left"]} for e in events if e["moved"]],
                "rerun_moved": [m["step"] for m in rerun["moved"]],
                "after": LocalStorage(case).committed_steps(),
                "logs_aside": logs_aside,
                "logs_left": (case / "fingerprints").exists(),
            }
        )
    return {"calls": len(read_log(log)), "cases": cases}


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("iofault"))


def test_every_failed_rename_or_fsync_of_a_rollback_keeps_every_step_whole(
    shim: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults.test_rollback_faults", str(tmp_path.resolve())],
        cwd=REPO,
        env=preload_env(shim, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(lines[-1][len("RESULT ") :])
    ops = [c["op"] for c in report["cases"]]
    # mkdir, the fingerprint logs' rename, then each step's (each followed by fsyncs).
    assert ops.count("rename") == 3 and "fsync" in ops and "mkdir" in ops, ops
    for case in report["cases"]:
        where = json.dumps(case)
        assert case["failed"].startswith(case["op"]), where
        assert case["raised"] == case["errno"], where
        # Each step exactly once, whole: in place or aside.
        assert sorted(case["in_place"] + case["aside"]) == sorted(STEPS), where
        assert 100 in case["in_place"], where
        moved = sorted(case["aside"], reverse=True)
        if moved:
            # The logs went first; what was moved is logged, with what is left.
            assert case["logs_aside"], where
            assert case["events"] == [
                {"moved": moved, "left": [s for s in (300, 200) if s not in moved]}
            ], where
        # Once finished, the abandoned trajectory's fingerprints are out of the run.
        assert not case["logs_left"], where
        # A rerun finishes: only step 100 is left committed.
        assert case["rerun_moved"] == [s for s in (300, 200) if s not in moved], where
        assert case["after"] == [100], where


if __name__ == "__main__":
    work = Path(sys.argv[1])
    os.makedirs(work, exist_ok=True)
    print("RESULT " + json.dumps(child(work)), flush=True)
