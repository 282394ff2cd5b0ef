"""The fuzz harness: a pristine run, ways to damage a copy of it, and the worker that restores it.

``Worker`` keeps one ``worker.py`` subprocess (memory-limited) and feeds it one
case at a time with a time limit; a case that hangs or kills it is reported as
such and the next case gets a fresh worker. ``damage`` applies a case (a plain
dict, so hypothesis can draw it and a summary can count it) to a copy of the
pristine run; ``resign`` makes the manifest match whatever is on disk, which
is what someone who can write the run directory can always do.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import os
import pickle
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import xxhash
from hypothesis import strategies as st

import stalwart
from stalwart.manifest import MANIFEST_NAME, canonical_json

from ..conftest import make_parts, train_steps
from .worker import MARK, weights_digest

ROOT = Path(__file__).parents[2]
STEPS = (1, 2, 3)
NEWEST = "step_000000003"
PREVIOUS = "step_000000002"
MEMORY_LIMIT = 3 * 2**30
"""RLIMIT_AS of the worker. Restoring the test run peaks at about 0.9 GiB of address
space here (torch included); a reader that allocates what a crafted size declares fails."""
CASE_SECONDS = 60.0
"""A restore of this tiny run takes well under a second; a case past this hangs."""
FUZZ_EXAMPLES = int(os.environ.get("STALWART_FUZZ_EXAMPLES", "12"))
"""Examples per fuzzed class; ``make fuzz`` raises it."""


@dataclasses.dataclass(frozen=True)
class Pristine:
    run: Path
    digests: dict[int, str]
    """Weights digest right after each step was saved."""
    files: list[str]
    """Files of the newest step, MANIFEST.json included."""


def build_pristine(run: Path) -> Pristine:
    torch.manual_seed(0)
    parts = make_parts()
    digests = {}
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        for step in STEPS:
            train_steps(parts, 1)
            assert ckpt.save(step, parts.state)
            digests[step] = weights_digest(parts.model)
    files = sorted(p.name for p in (run / NEWEST).iterdir())
    return Pristine(run=run, digests=digests, files=files)


# ------------------------------------------------------------------ manifests


def hostile_json() -> st.SearchStrategy[Any]:
    """JSON values meant to break a reader: huge and negative numbers, NaN, bad paths, nesting."""
    leaves = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=6)
        | st.sampled_from([2**63, -(2**63), 10**30, "\x00", "../a", "/a", "a/../b", "a//b"])
    )
    return st.recursive(
        leaves,
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids),
        max_leaves=6,
    )


def sign(body: dict[str, Any]) -> str:
    body = {k: v for k, v in body.items() if k != "manifest_xxh3_128"}
    body["manifest_xxh3_128"] = xxhash.xxh3_128_hexdigest(canonical_json(body).encode())
    return json.dumps(body, allow_nan=True)


def resign(step_dir: Path, edit: Any = None) -> None:
    """Make ``step_dir``'s manifest list what is on disk now, re-signed; ``edit(body)`` first."""
    path = step_dir / MANIFEST_NAME
    body = json.loads(path.read_text())
    for entry in body["files"]:
        file = step_dir / entry["path"]
        entry.update(_listed_as(file))
    if edit is not None:
        edit(body)
    path.write_text(sign(body))


def _listed_as(file: Path) -> dict[str, Any]:
    # What a careless (link-following) writer would record: the target's size and
    # content; for a device or FIFO, nothing (size 0).
    try:
        if file.is_file():
            return {
                "size": file.stat().st_size,
                "xxh3_128": xxhash.xxh3_128_hexdigest(file.read_bytes()),
            }
    except OSError:
        pass
    return {"size": 0, "xxh3_128": xxhash.xxh3_128_hexdigest(b"")}


# ------------------------------------------------------------------ damage


def _edit_file(file: Path, how: str, amount: int, positions: list[tuple[float, int]]) -> None:
    data = bytearray(file.read_bytes())
    if how == "flip" and data:
        for where, bit in positions:
            data[min(int(where * len(data)), len(data) - 1)] ^= 1 << (bit % 8)
    elif how == "truncate":
        data = data[: max(0, len(data) - 1 - amount % max(len(data), 1))]
    elif how == "extend":
        data += bytes([amount % 256]) * (1 + amount % 4096)
    file.write_bytes(bytes(data))


def _link_target(run: Path, file: Path, target: str) -> str:
    return {
        "dev_zero": "/dev/zero",
        "self": file.name,
        "previous": str(run / PREVIOUS / file.name),
        "outside": str(run.parent / "outside.bin"),
    }[target]


def damage(run: Path, case: dict[str, Any]) -> None:
    """Apply ``case`` to the run directory ``run`` (a copy of the pristine run)."""
    newest = run / NEWEST
    kind = case["kind"]
    if kind in ("flip", "truncate", "extend"):
        _edit_file(newest / case["file"], kind, case.get("amount", 0), case.get("positions", []))
    elif kind == "swap":
        shutil.copyfile(run / PREVIOUS / case["file"], newest / case["file"])
    elif kind == "rename":
        shutil.rmtree(newest)
        (shutil.copytree if case["copy"] else os.rename)(run / PREVIOUS, newest)
    elif kind == "symlink":
        (run.parent / "outside.bin").write_bytes(b"\0" * 4096)
        target = _link_target(run, newest / case["file"], case["target"])
        (newest / case["file"]).unlink()
        os.symlink(target, newest / case["file"])
    elif kind == "fifo":
        (newest / case["file"]).unlink()
        os.mkfifo(newest / case["file"])
    elif kind == "manifest":
        edit = _manifest_edit(case["field"], case["value"])
        path = newest / MANIFEST_NAME
        body = json.loads(path.read_text())
        edit(body)
        path.write_text(sign(body) if case["resign"] else json.dumps(body, allow_nan=True))
        return
    elif kind == "manifest_text":
        (newest / MANIFEST_NAME).write_text(case["text"])
        return
    elif kind == "metadata":
        # The JSON twin by default: what a restore reads. The pickle only matters
        # to a restore of a checkpoint without one (an older stalwart's), so
        # tampering with it drops the twin unless the case says otherwise.
        target = case.get("file", ".metadata.json")
        if target == ".metadata.json":
            _tamper_metadata_json(newest / target, case["changes"])
        else:
            _tamper_metadata(newest / target, case["changes"])
            if case.get("drop_twin", True):
                (newest / ".metadata.json").unlink()
                resign(newest, _unlist(".metadata.json"))
    else:
        raise AssertionError(f"unknown damage {kind!r}")
    if case.get("resign"):
        resign(newest)


def _manifest_edit(field: str, value: Any) -> Any:
    def edit(body: dict[str, Any]) -> None:
        if field.startswith("files."):
            key = field.split(".", 1)[1]
            if key == "entry":
                body["files"][0] = value
            else:
                body["files"][0][key] = value
        else:
            body[field] = value

    return edit


def _tamper_metadata(path: Path, changes: list[tuple[str, int, str, Any]]) -> None:
    """Set fields of DCP metadata objects (allowed classes only) and pickle it again.

    Each change is ``(what, index, field, value)``: ``what`` is ``tensor``,
    ``chunk`` or ``storage`` (the index-th such object, wrapping) or ``planner``.
    """
    # The test wrote this file itself, so the full unpickler is fine here.
    metadata = pickle.loads(path.read_bytes())
    tensors = [e for e in metadata.state_dict_metadata.values() if hasattr(e, "chunks")]
    chunks = [c for e in tensors for c in e.chunks]
    storage = list(metadata.storage_data.values())
    for what, index, field, value in changes:
        if what == "planner":
            metadata.planner_data = value
            continue
        pool = {"tensor": tensors, "chunk": chunks, "storage": storage}[what]
        target = pool[index % len(pool)]
        if field in ("size", "offsets", "sizes"):
            value = torch.Size(value)
        setattr(target, field, copy.deepcopy(value))
    path.write_bytes(pickle.dumps(metadata))


def _tamper_metadata_json(path: Path, changes: list[tuple[str, int, str, Any]]) -> None:
    """``_tamper_metadata``'s changes made to ``.metadata.json`` (stalwart.metadata_json's
    layout: a tensor is ``[dtype, layout, requires_grad, memory_format, pin_memory,
    size, chunks]``, a storage row ``[fqn, offset, index, file, byte offset, length,
    transforms]``)."""
    doc = json.loads(path.read_text())
    tensors = [e for e in doc["state_dict_metadata"].values() if e is not None]
    chunks = [c for e in tensors for c in e[6]]
    storage = doc["storage_data"]
    for what, index, field, value in changes:
        if what == "planner":
            doc["planner_data"] = value
        elif what == "tensor":
            assert field == "size", field
            tensors[index % len(tensors)][5] = value
        elif what == "chunk":
            chunks[index % len(chunks)][{"offsets": 0, "sizes": 1}[field]] = value
        else:
            storage[index % len(storage)][{"offset": 4, "length": 5}[field]] = value
    path.write_text(json.dumps(doc))


def _unlist(name: str) -> Any:
    def edit(body: dict[str, Any]) -> None:
        body["files"] = [e for e in body["files"] if e["path"] != name]

    return edit


# ------------------------------------------------------------------ the worker


class Worker:
    """One memory-limited worker subprocess; ``run(case)`` answers within ``CASE_SECONDS``."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.restarts = 0

    def _start(self) -> subprocess.Popen[str]:
        # No GPU: a CUDA context reserves far more address space than the cap allows,
        # and these cases are about files, not devices.
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        # The worker imports the same stalwart as this process (and tests from ROOT).
        source = Path(stalwart.__file__).parents[1]
        env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])
        with self.log.open("a") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.hostile.worker", str(MEMORY_LIMIT)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        self.proc = proc
        ready = self._read(proc, 120.0)
        assert ready == {"ready": True}, f"worker did not start: {ready}; see {self.log}"
        return proc

    def _read(self, proc: subprocess.Popen[str], seconds: float) -> dict[str, Any]:
        assert proc.stdout is not None
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                self.stop()
                return {"outcome": "hang", "seconds": seconds}
            line = proc.stdout.readline()
            if not line:
                code = proc.wait()
                self.stop()
                return {"outcome": "died", "returncode": code}
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])  # type: ignore[no-any-return]

    def run(self, request: dict[str, Any], seconds: float = CASE_SECONDS) -> dict[str, Any]:
        proc = self.proc if self.proc is not None else self._start()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        answer = self._read(proc, seconds)
        if answer["outcome"] in ("hang", "died"):
            self.restarts += 1
        return answer

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.proc = None


# ------------------------------------------------------------------ judging


def fresh_copy(pristine: Pristine, where: Path) -> Path:
    if where.exists():
        shutil.rmtree(where)
    run = where / "run"
    shutil.copytree(pristine.run, run, symlinks=True)
    return run


def judge_restore(pristine: Pristine, case: dict[str, Any], answer: dict[str, Any]) -> str:
    """The outcome's name for the summary; raises AssertionError for anything not allowed.

    Allowed: None, or a step whose weights are that step's. A re-signed case may
    also restore the newest step with other weights (loading their tensors is
    what someone who can write the run can do), or raise StateMismatchError
    (their checkpoint does not fit the state, as one of another model would not).
    """
    if answer["outcome"] == "raised" and case.get("resign"):
        # A re-signed checkpoint may be one of another model: refused loudly,
        # as any checkpoint that does not fit the state is.
        assert answer["type"] == "stalwart.errors.StateMismatchError", f"{case}: {answer}"
        return "refused: state mismatch"
    assert answer["outcome"] == "restored", f"{case}: {answer}"
    assert answer["peak_bytes"] < MEMORY_LIMIT, answer
    step = answer["step"]
    if step is None:
        return "none"
    assert step in pristine.digests, (case, answer)
    if answer["digest"] == pristine.digests[step]:
        return f"step {step}"
    assert case.get("resign") and step == 3, f"step {step} restored with other weights: {case}"
    return "step 3 (their tensors)"


class Summary:
    """Cases per class and kind, and their outcomes, for ``make fuzz``."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.failed = 0
        self.peak = 0

    def add(self, cls: str, case: dict[str, Any], outcome: str, answer: dict[str, Any]) -> None:
        self.counts[cls, case["kind"], outcome] += 1
        self.peak = max(self.peak, int(answer.get("peak_bytes", 0)))

    def text(self, restarts: int) -> str:
        lines = ["hostile fuzz summary (class / damage / outcome: cases)"]
        for cls in sorted({c for c, _k, _o in self.counts}):
            total = sum(n for (c, _k, _o), n in self.counts.items() if c == cls)
            lines.append(f"  {cls}: {total} cases")
            for (c, kind, outcome), n in sorted(self.counts.items()):
                if c == cls:
                    lines.append(f"    {kind:<14} {outcome:<24} {n}")
        lines.append(
            f"  cases not allowed (escaped exception, hang, wrong weights, over the limit): "
            f"{self.failed}; worker restarts: {restarts}; peak address space: "
            f"{self.peak / 2**30:.2f} GiB (limit {MEMORY_LIMIT / 2**30:.0f} GiB)"
        )
        return "\n".join(lines)
