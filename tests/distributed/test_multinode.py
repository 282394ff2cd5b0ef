"""Two torchrun agents on one machine as two "nodes": c10d rendezvous on 127.0.0.1,
node-local scratch directories, one shared run directory. One node is killed
outright (agent and workers); the surviving node's save fails within the save
timeout instead of hanging; the job is then restarted on two nodes, as a
scheduler (SLURM requeue, a Kubernetes restart policy) restarts a job whose
node died, and finishes exactly like an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..conftest import assert_same
from ..support.torchrun import WORKER, final, ok, torchrun

STEPS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_job(
    tmp: Path, run: Path, out: Path, nodes: list[subprocess.Popen[str]], tag: str
) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    # Node A starts first so that it hosts the c10d rendezvous store, as the node
    # named in --rdzv-endpoint does on a real cluster.
    run.parent.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    a = _node(port, tmp / f"node-a-{tag}" / "scratch", run, out)
    nodes.append(a)
    deadline = time.monotonic() + 60
    while not _listening(port):
        assert a.poll() is None and time.monotonic() < deadline, "node A did not start its store"
        time.sleep(0.1)
    b = _node(port, tmp / f"node-b-{tag}" / "scratch", run, out)
    nodes.append(b)
    return a, b


def _worker_output(run: Path) -> str:
    return "".join(p.read_text() for p in run.parent.glob("worker-*.log"))


def _node(port: int, scratch: Path, run: Path, out: Path) -> subprocess.Popen[str]:
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=multinode-test",
        "--rdzv-conf=join_timeout=120,heartbeat=1,last_call_timeout=1",
        "--max-restarts=0",
        "--monitor-interval=0.2",
        str(WORKER),
        "--run-dir",
        str(run),
        "--steps",
        str(STEPS),
        "--every",
        "4",
        "--step-sleep",
        "0.08",
        "--out",
        str(out),
        "--save-timeout",
        "20",
        "--log-to",
        str(run.parent / f"worker-{scratch.parent.name}.log"),
    ]
    env = {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc (workers, their helpers, anything between)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def _kill_node(agent: subprocess.Popen[str]) -> None:
    """SIGKILL an agent and every process under it at once (torchrun starts workers in
    sessions of their own, so a process group kill alone would miss them)."""
    for pid in [agent.pid, *_descendants(agent.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reap(p: subprocess.Popen[str]) -> None:
    p.wait(30)
    if p.stdout is not None and not p.stdout.closed:
        p.stdout.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _saved_steps(run: Path) -> list[int]:
    try:
        lines = (run / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [e["step"] for e in map(json.loads, lines) if e["event"] == "save"]


def _survivor_notices(a: subprocess.Popen[str], run: Path) -> None:
    """The surviving rank notices the dead node at its next collective and does not
    hang: its save fails (when the death fell between two steps' collectives), or
    DDP's gradient all-reduce fails and its worker exits (when it fell in a step)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "save-error" in _worker_output(run):
            assert "rank 1 is gone" in _worker_output(run), _worker_output(run)
            return
        if a.poll() is not None:
            out = a.stdout.read() if a.stdout else ""
            assert a.returncode != 0, out[-4000:]
            assert re.search(r"Connection (reset|closed) by peer", out), out[-4000:]
            return
        time.sleep(0.2)
    _kill_node(a)
    output = a.stdout.read() if a.stdout else ""
    raise AssertionError(
        "the surviving rank did not notice the dead node within 60 s; its log: "
        + _worker_output(run)
        + "; its agent's output: "
        + output[-4000:]
    )


def test_dead_node_fails_the_save_and_the_restarted_job_resumes_exactly(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ok(
        torchrun(
            2, "--run-dir", str(ref / "run"), "--steps", str(STEPS), "--out", str(ref / "final.pt")
        )
    )

    run = tmp_path / "shared" / "run"
    out = tmp_path / "shared" / "final.pt"
    nodes: list[subprocess.Popen[str]] = []
    try:
        a, b = _start_job(tmp_path, run, out, nodes, "first")
        deadline = time.monotonic() + 120
        while max(_saved_steps(run), default=0) < 12 and time.monotonic() < deadline:
            assert a.poll() is None and b.poll() is None, (
                "a node exited early: "
                + (b.stdout.read() if b.poll() is not None and b.stdout else "")[-3000:]
            )
            time.sleep(0.1)
        assert max(_saved_steps(run), default=0) >= 12, "the run made no progress"
        _kill_node(b)
        _reap(b)
        _survivor_notices(a, run)
        _kill_node(a)
        _reap(a)
        a2, b2 = _start_job(tmp_path, run, out, nodes, "second")
        a_out, _ = a2.communicate(timeout=240)
        b_out, _ = b2.communicate(timeout=60)
    finally:
        for p in nodes:
            if p.poll() is None:
                _kill_node(p)
            _reap(p)
    assert a2.returncode == 0, a_out[-4000:]
    assert b2.returncode == 0, b_out[-4000:]
    restores = [
        e
        for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
        if e["event"] == "restore"
    ]
    assert restores and restores[-1]["step"] >= 12
    assert_same(final(ref / "final.pt", 2), final(out, 2))
    for scratch in tmp_path.glob("node-*/scratch"):
        # Node-local disk holds torch's own temporaries, never a piece of a checkpoint.
        stray = [p for p in scratch.rglob("*") if p.suffix == ".distcp" or "step_" in p.name]
        assert not stray, stray


def test_bad_shard_on_one_rank_makes_every_rank_fall_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(torchrun(2, "--run-dir", str(run), "--steps", "8"))
    shard = run / "step_000000008" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = ok(torchrun(2, "--run-dir", str(run), "--steps", "8"))
    assert "rank 0 start 4" in proc.stdout and "rank 1 start 4" in proc.stdout, proc.stdout
    assert list(run.glob(".step_000000008.corrupt-*"))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "restore_skipped" and "__1_0.distcp" in e["reason"] for e in events)
    assert torch.__version__  # keep the torch import honest for type checkers
