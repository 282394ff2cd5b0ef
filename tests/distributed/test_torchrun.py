"""DDP and FSDP2 under real torchrun with gloo on CPU: kills, restarts, failures, resharding.

Every test launches ``python -m torch.distributed.run --standalone`` (a free
port each time) on tests/distributed/worker.py and compares what the workers
wrote with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ..conftest import assert_same
from ..support.torchrun import WORKER, final, ok, starts, torchrun

STEPS = 24


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    refs = {}
    for kind in ("ddp", "fsdp"):
        d = tmp_path_factory.mktemp(f"ref-{kind}")
        ok(torchrun(2, "--kind", kind, "--run-dir", str(d / "run"), "--out", str(d / "final.pt")))
        refs[kind] = final(d / "final.pt", 2)
    return refs


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize(
    "kill",
    [["--kill-after-step", "10"], ["--kill-in-save", "16"]],
    ids=["mid-step", "mid-save"],
)
def test_sigkilled_rank_is_restarted_by_torchrun_and_resumes_exactly(
    tmp_path: Path, reference: dict, kind: str, kill: list[str]
) -> None:
    proc = ok(
        torchrun(
            2,
            "--kind",
            kind,
            "--run-dir",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "final.pt"),
            "--kill-rank",
            "1",
            *kill,
            restarts=1,
        )
    )
    first, *rest = sorted(set(starts(proc)))
    assert first == 0 and rest and rest[0] > 0, proc.stdout  # a restart resumed from a checkpoint
    assert_same(reference[kind], final(tmp_path / "final.pt", 2))


def test_comparison_with_reference_can_fail(tmp_path: Path, reference: dict) -> None:
    ok(
        torchrun(
            2,
            "--run-dir",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "f.pt"),
            "--steps",
            str(STEPS - 1),
        )
    )
    with pytest.raises(AssertionError):
        assert_same(reference["ddp"], final(tmp_path / "f.pt", 2))


@pytest.mark.parametrize("hang", [False, True], ids=["raises", "hangs"])
def test_rank_failing_during_save_fails_the_save_on_every_rank(tmp_path: Path, hang: bool) -> None:
    run = tmp_path / "run"
    extra = ["--hang"] if hang else []
    t0 = time.monotonic()
    proc = torchrun(
        2,
        "--run-dir",
        str(run),
        "--fail-rank",
        "1",
        "--fail-step",
        "8",
        "--save-timeout",
        "5",
        *extra,
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    out = proc.stdout
    if hang:
        # The hung rank never answers; rank 0 must give up after the timeout, not wait forever.
        assert "rank 0 save-error step 8" in out, out + proc.stderr[-3000:]
    else:
        assert "rank 0 save-error step 8" in out and "rank 1 save-error step 8" in out, out
        assert "injected failure on rank 1" in out
    assert elapsed < 90
    assert not (run / "step_000000008").exists()
    assert (run / "step_000000004" / "MANIFEST.json").exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".step_000000008.tmp")] or hang
    # the previous checkpoint still restores
    ok(torchrun(2, "--run-dir", str(run), "--steps", "6"))


def test_ddp_checkpoint_holds_one_copy_of_the_state_not_one_per_rank(tmp_path: Path) -> None:
    ok(torchrun(2, "--run-dir", str(tmp_path / "two"), "--steps", "4"))
    ok(torchrun(1, "--run-dir", str(tmp_path / "one"), "--steps", "4"))

    def data_bytes(run: Path) -> int:
        m = json.loads((run / "step_000000004" / "MANIFEST.json").read_text())
        return sum(f["size"] for f in m["files"] if f["path"].endswith(".distcp"))

    two, one = data_bytes(tmp_path / "two"), data_bytes(tmp_path / "one")
    assert two < 1.25 * one, (two, one)
    m = json.loads((tmp_path / "two" / "step_000000004" / "MANIFEST.json").read_text())
    per_rank = [0, 0]  # DCP names rank r's data files __{r}_{i}.distcp (one per writer thread)
    for f in m["files"]:
        if f["path"].endswith(".distcp"):
            per_rank[int(f["path"].split("_")[2])] += f["size"]
    assert min(per_rank) > 0.5 * max(per_rank), per_rank  # spread across both ranks
    assert m["topology"]["parallelism"] == "ddp" and m["world_size"] == 2


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (1, 2), (2, 4)])
def test_resharding_restore(tmp_path: Path, kind: str, save_world: int, load_world: int) -> None:
    reshard(tmp_path, kind, save_world, load_world)


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (1, 2)])
def test_resharding_restore_reads_large_shards_into_place(
    tmp_path: Path, save_world: int, load_world: int
) -> None:
    """Weights of 512 KiB per shard: read from the checked file straight into the
    target (2 -> 1: each saved shard fills a slice of the whole tensor) or through
    a fresh tensor narrowed to this rank's part (1 -> 2)."""
    reshard(tmp_path, "fsdp", save_world, load_world, "--width", "16384")


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_resharding_restore_of_shards_written_direct(tmp_path: Path, kind: str) -> None:
    """Sync saves of live tensors of 4 MiB and more (each FSDP shard of the first
    weight and its Adam moments, the whole ones under DDP) go to the disk with
    O_DIRECT from their own memory, the bytes before their first page boundary
    buffered; this checks they read back exactly at another world size.
    tests/test_writer_direct.py checks that the bytes went direct."""
    width = 2**17 if kind == "fsdp" else 2**16  # 16 x width fp32 per rank: 4 MiB
    reshard(tmp_path, kind, 2, 1, "--width", str(width))


def reshard(tmp_path: Path, kind: str, save_world: int, load_world: int, *extra: str) -> None:
    run = tmp_path / "run"
    ok(
        torchrun(
            save_world,
            "--kind",
            kind,
            "--run-dir",
            str(run),
            "--steps",
            "8",
            "--out",
            str(tmp_path / "saved.pt"),
            *extra,
        )
    )
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    proc = ok(
        torchrun(
            load_world,
            "--kind",
            kind,
            "--run-dir",
            str(run),
            "--steps",
            "8",
            "--out",
            str(tmp_path / "loaded.pt"),
            *extra,
        )
    )
    assert set(starts(proc)) == {8}
    assert "resharded True" in proc.stdout
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    for key in ("model", "optimizer", "scheduler", "data"):
        assert_same(saved[key], loaded[key], key)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    restore = [e for e in events if e["event"] == "restore"][-1]
    assert restore["saved_world_size"] == save_world and restore["world_size"] == load_world
    assert restore["same_world_size"] is False
    # DDP with 3+ ranks and find_unused_parameters=False resumes only to the last bits.
    warned = [e for e in events if "find_unused_parameters=True" in str(e.get("reason"))]
    assert bool(warned) == (kind == "ddp" and load_world >= 3), warned


def test_resharded_resume_continues_the_sample_sequence(tmp_path: Path) -> None:
    """2 ranks for 6 steps, then 1 rank: together they see one global order with no repeat or gap."""
    run = tmp_path / "run"

    def seen(rank: int) -> list[int]:
        return [int(x) for x in Path(f"{run}.seen.rank{rank}").read_text().split()]

    ok(torchrun(2, "--run-dir", str(run), "--steps", "6", "--every", "6"))
    a0, a1 = seen(0), seen(1)
    ok(torchrun(1, "--run-dir", str(run), "--steps", "14", "--every", "100"))
    b = seen(0)
    # 2 ranks x 6 steps x 4 samples = 48 of 64: interleaved global positions 0..47
    merged = [x for pair in zip(a0, a1, strict=True) for x in pair]
    epoch0 = merged + b[:16]
    assert sorted(epoch0) == list(range(64))


def test_sigterm_preempts_all_ranks_with_an_emergency_checkpoint(
    tmp_path: Path, reference: dict
) -> None:
    run = tmp_path / "run"
    proc = torchrun(
        2, "--run-dir", str(run), "--term-rank", "1", "--term-after-step", "9", "--every", "100"
    )
    assert (
        "rank 0 preempted at step 9" in proc.stdout and "rank 1 preempted at step 9" in proc.stdout
    ), proc.stdout
    assert proc.returncode != 0
    assert (run / "step_000000009" / "MANIFEST.json").exists()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "save" and e["step"] == 9 and e["emergency"] for e in events)
    ok(torchrun(2, "--run-dir", str(run), "--out", str(tmp_path / "final.pt"), "--every", "100"))
    assert_same(reference["ddp"], final(tmp_path / "final.pt", 2))


def test_sigterm_to_torchrun_is_forwarded_and_preempts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        "--run-dir",
        str(run),
        "--steps",
        "100000",
        "--every",
        "100000",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "events.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=90)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert "rank 0 preempted" in out and "rank 1 preempted" in out, out + err[-3000:]
    steps = [
        e["step"]
        for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
        if e["event"] == "save"
    ]
    assert steps, "no emergency checkpoint"
