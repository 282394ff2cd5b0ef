"""Every file-system call of a save or a restore, failed one at a time (SQLite-style).

An LD_PRELOAD shim (tests/support/iofault.c) sits between the process and libc:
it numbers the real calls made under a case's directory (stalwart's own,
DCP's and torch's writes, the file:// durable tier's) and makes call number N
fail with ENOSPC, EIO, EDQUOT or EROFS (once, or, for a disk that stays full,
from N on). A first run of each scenario only counts the calls; then one case
per (N, errno) runs in a child process that arms the shim through ctypes, so
that hundreds of cases share one start-up.

After every case:

- the error, if any, is a ``StalwartError`` (``CheckpointSaveError`` for a
  save); a restore (from the run directory, or on a fresh machine from the
  durable tier alone) returns a checkpoint bit-exact, the newest or the previous;
- the previous checkpoint is byte-identical and restores bit-exact;
- every committed step verifies (nothing half-written is taken for a
  checkpoint) and restore finds the newest one, bit-exact; for the durable
  tier, a fresh machine restoring from the tier alone does too;
- a good checkpoint is never moved aside because of a failed read;
- the next save succeeds.

In the test suite every call is failed at least once (the errno rotates with
N) and every call of the commit itself with all four errnos; ``FAULTS_ALL=1``
(``make faults``) runs every call with every errno.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from stalwart.pipeline import verify_checkpoint
from stalwart.storage.durable import DurableTier
from stalwart.storage.local import LocalStorage, step_dir_name
from stalwart.storage.remote import RetryPolicy
from tests.support.iofault import Shim, build, preload_env, read_log

from .faulty import tree_digest

REPO = Path(__file__).resolve().parents[2]
ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EDQUOT": errno.EDQUOT, "EROFS": errno.EROFS}
SCENARIOS = ("sync", "async", "durable", "restore", "download", "full")
"""``download``: a restore on a fresh machine, from the durable tier alone;
``full``: a sync save on a disk that stays broken: call N and every call after it fail."""
READS = ("restore", "download")
TIERED = ("durable", "download")
FAST = RetryPolicy(initial_backoff=0.02, max_backoff=0.1, deadline=30.0, request_timeout=10.0)
"""Retries of the durable tier: a failed call is retried within a tenth of a second."""


# ------------------------------------------------------------------ the child process


def model_state(seed: int) -> tuple[stalwart.TrainState, dict[str, torch.Tensor]]:
    """A model and optimizer whose values are a function of ``seed``, and a copy of the weights."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # momentum buffers: the optimizer state is saved too
    state = stalwart.TrainState(model=model, optimizer=optimizer, extra={"seed": seed}, rng=False)
    return state, {k: v.clone() for k, v in model.state_dict().items()}


def _manager(run: Path, mode: str, tier: Path | None = None) -> stalwart.CheckpointManager:
    kwargs: dict[str, Any] = {"keep_last": None, "handle_signals": False}
    if mode == "async":
        kwargs["async_save"] = True
    if mode in TIERED and tier is not None:
        kwargs["durable"] = stalwart.DurableConfig(url=tier.as_uri(), retry=FAST, keep_last=None)
    return stalwart.CheckpointManager(run, **kwargs)


def _restored(run: Path, *, step: int | None = None, tier: Path | None = None) -> tuple[Any, Any]:
    state, _ = model_state(999)
    with _manager(run, "durable" if tier else "sync", tier) as ckpt:
        got = ckpt.restore(state, step=step)
    assert state.model is not None
    return got, state.model.state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def make_template(root: Path, mode: str) -> Path:
    """A run with step 1 committed (steps 1 and 2 to restore from), and its durable tier.

    For ``download`` only the tier is kept: the case's machine has no local copy.
    """
    template = root / f"template-{mode}"
    tier = template / "tier" if mode in TIERED else None
    with _manager(template / "run", mode, tier) as ckpt:
        assert ckpt.save(1, model_state(1)[0])
        if mode in READS:
            assert ckpt.save(2, model_state(2)[0])
    if mode == "download":
        shutil.rmtree(template / "run")
    return template


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_case(shim: Shim, mode: str, case: Path, fail_at: int, err: int, log: Path | None) -> dict:
    """One case: arm the shim on ``case``, save step 2 (or restore), disarm, check everything."""
    run, tier = case / "run", (case / "tier" if mode in TIERED else None)
    problems: list[str] = []
    outcome = "ok"
    ckpt = _manager(run, mode, tier)
    state, _ = model_state(999 if mode in READS else 2)
    got: Any = None
    shim.arm(case, fail_at=fail_at, errno=err, log=log, persistent=mode == "full")
    try:
        if mode in READS:
            got = ckpt.restore(state)
        else:
            ckpt.save(2, state)
            ckpt.wait()
            if mode == "durable" and not ckpt.wait_durable(timeout=60):
                problems.append("the upload did not finish within 60 s")
    except stalwart.StalwartError as exc:
        outcome = _describe(exc)
        if mode not in READS and not isinstance(exc, stalwart.CheckpointSaveError):
            problems.append(f"a save raised {outcome}, not a CheckpointSaveError")
    except BaseException as exc:
        outcome = _describe(exc)
        problems.append(f"not a StalwartError: {outcome}\n{traceback.format_exc()}")
    finally:
        calls = shim.disarm()
        hit = shim.failed_op()
    try:
        ckpt.close()
    except stalwart.StalwartError as exc:
        problems.append(f"close raised {_describe(exc)} after the case had returned")
    except BaseException as exc:
        problems.append(f"close raised a non-StalwartError: {_describe(exc)}")
    if mode in READS and outcome == "ok":
        assert state.model is not None
        weights = state.model.state_dict()
        if got not in (1, 2) or not _same(weights, model_state(got)[1]):
            problems.append(f"restore returned {got!r} and weights that are not that step's")
        outcome = f"restored step {got}"
    elif (
        mode in ("sync", "async", "full")
        and outcome != "ok"
        and 2 in LocalStorage(run).committed_steps()
    ):
        # A save that reported failure committed nothing (the durable tier's errors
        # come after the local commit, which stands).
        problems.append(f"the save raised {outcome}, yet step 2 is committed")
    return {"calls": calls, "hit": hit, "outcome": outcome, "problems": problems}


def check_run(mode: str, case: Path, before: dict) -> list[str]:
    """The promises that hold after any case, checked with the shim disarmed."""
    if mode == "download":
        return _check_download(case)
    run, tier = case / "run", (case / "tier" if mode == "durable" else None)
    problems: list[str] = []
    now = tree_digest(run)
    kept = {k: v for k, v in now.items() if k in before}
    if kept != before:
        problems.append(
            "an earlier checkpoint changed: " + ", ".join(sorted(set(before) ^ set(kept)))
        )
    committed = LocalStorage(run).committed_steps()
    expected_old = [1, 2] if mode == "restore" else [1]
    if committed[: len(expected_old)] != expected_old or not set(committed) <= {1, 2}:
        problems.append(f"committed steps {committed}, expected {expected_old} (+ [2])")
    for step in committed:
        try:
            verify_checkpoint(run / step_dir_name(step))
        except stalwart.StalwartError as exc:
            problems.append(f"committed step {step} does not verify: {_describe(exc)}")
    if problems:
        return problems
    newest = max(committed)
    got, weights = _restored(run)
    if got != newest or not _same(weights, model_state(newest)[1]):
        problems.append(f"restore gave step {got}, expected step {newest} bit-exact")
    got, weights = _restored(run, step=1)
    if got != 1 or not _same(weights, model_state(1)[1]):
        problems.append("step 1 does not restore bit-exact")
    if tier is not None and _files(tier / step_dir_name(1)) != _files(template_tier(case)):
        problems.append("step 1 in the durable tier changed")
    # The next save works (and lands in the durable tier, when there is one).
    with _manager(run, mode, tier) as ckpt:
        saved = ckpt.save(3, model_state(3)[0])
        ckpt.wait()
        if tier is not None and not ckpt.wait_durable(timeout=60):
            problems.append("the next save's upload did not finish")
        if not saved or 3 not in ckpt.all_steps():
            problems.append(f"the next save did not commit: steps {ckpt.all_steps()}")
    if tier is not None:
        problems += _check_tier(case, tier, must_have=3)
    return problems


def _check_download(case: Path) -> list[str]:
    """After a failed download: the tier untouched, nothing torn locally, the next restore and save work."""
    run, tier = case / "run", case / "tier"
    problems = []
    if _files(tier) != _files(case.parent / "template-download" / "tier"):
        problems.append("the durable tier changed during a restore")
    committed = LocalStorage(run).committed_steps()
    if not set(committed) <= {1, 2}:
        problems.append(f"local committed steps {committed}")
    for step in committed:
        try:
            verify_checkpoint(run / step_dir_name(step))
        except stalwart.StalwartError as exc:
            problems.append(f"downloaded step {step} does not verify: {_describe(exc)}")
    if problems:
        return problems
    got, weights = _restored(run, tier=tier)
    if got != 2 or not _same(weights, model_state(2)[1]):
        problems.append(f"the next restore gave step {got}, expected step 2 bit-exact")
    with _manager(run, "download", tier) as ckpt:
        if not ckpt.save(3, model_state(3)[0]) or not ckpt.wait_durable(timeout=60):
            problems.append("the next save did not commit and upload")
    return problems


def _files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def template_tier(case: Path) -> Path:
    return case.parent / "template-durable" / "tier" / step_dir_name(1)


def _check_tier(case: Path, tier: Path, must_have: int) -> list[str]:
    """A fresh machine (empty local directory) restores the tier's newest step bit-exact."""
    remote = DurableTier(tier.as_uri(), retry=FAST).committed_steps()
    if must_have not in remote:
        return [f"durable tier has steps {remote}, missing step {must_have}"]
    fresh = case / f"fresh-{must_have}"
    shutil.rmtree(fresh, ignore_errors=True)
    got, weights = _restored(fresh, tier=tier)
    if got != max(remote) or not _same(weights, model_state(max(remote))[1]):
        return [f"restore from the durable tier gave {got}, expected {max(remote)} bit-exact"]
    return []


COMMIT_CALLS = 12
"""Calls of the local commit from the manifest's open on: write, fsync, close, rename,
fsync of the staging directory (open, fsync, close), rename into place, fsync of the run."""


def plan(
    total: int, commit_from: int, exhaustive: bool, commit_calls: int = COMMIT_CALLS
) -> list[tuple[int, str]]:
    """The (N, errno name) cases: all of them, or each N once (errno rotating) plus the commit x4."""
    names = list(ERRNOS)
    if exhaustive:
        return [(n, name) for n in range(1, total + 1) for name in names]
    cases = [(n, names[n % len(names)]) for n in range(1, total + 1)]
    commit = range(commit_from, min(total, commit_from + commit_calls - 1) + 1)
    cases += [(n, name) for n in commit for name in names]
    return sorted(set(cases))


def worker(mode: str, work: Path, exhaustive: bool) -> dict:
    """Count the calls of ``mode``, then run every planned case; returns the summary."""
    shim = Shim()
    template = make_template(work, mode)
    before = tree_digest(template / "run")
    # The counting run: the same scenario with nothing failed, with its log.
    case = work / "count"
    shutil.copytree(template, case, symlinks=True)
    log = work / f"{mode}.log"
    first = run_case(shim, mode, case, 0, 0, log)
    assert first["outcome"] in ("ok", "restored step 2") and not first["problems"], first
    ops = read_log(log)
    commit_from = next(
        (op.seq for op in ops if op.op == "open" and op.path.endswith("MANIFEST.json.tmp")),
        max(1, first["calls"] - 8),
    )
    summary: dict[str, Any] = {
        "mode": mode,
        "calls": first["calls"],
        "ops": sorted({op.op for op in ops}),
        "files": sorted({Path(op.path).name for op in ops if op.op == "write"}),
        "cases": 0,
        "failed_ops": {},
        "outcomes": {},
        "problems": [],
    }
    t0 = time.perf_counter()
    # The durable scenario's local commit is the sync one's: each of its calls fails once.
    commit_calls = 0 if mode == "durable" else COMMIT_CALLS
    for n, name in plan(first["calls"], commit_from, exhaustive, commit_calls):
        case = work / f"{mode}-{n}-{name}"
        shutil.copytree(template, case, symlinks=True)
        result = run_case(shim, mode, case, n, ERRNOS[name], None)
        if not result["hit"]:
            result["problems"].append(f"call {n} was never made (only {result['calls']} calls)")
        result["problems"] += check_run(mode, case, before)
        kind = result["hit"].split(" ", 1)[0] or "none"
        summary["failed_ops"][kind] = summary["failed_ops"].get(kind, 0) + 1
        key = result["outcome"].split(":", 1)[0]
        summary["outcomes"][key] = summary["outcomes"].get(key, 0) + 1
        summary["cases"] += 1
        for problem in result["problems"]:
            summary["problems"].append(f"{mode} call {n} ({result['hit']}) {name}: {problem}")
        shutil.rmtree(case, ignore_errors=True)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


# ------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("iofault"))


def run_scenario(shim: Path, mode: str, work: Path) -> dict:
    exhaustive = os.environ.get("FAULTS_ALL") == "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults.test_syscall_faults", mode, str(work.resolve())],
        cwd=REPO,
        env=preload_env(shim, FAULTS_ALL="1" if exhaustive else "0", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=3600 if exhaustive else 600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary: dict = json.loads(lines[-1][len("RESULT ") :])
    print(
        f"\n{mode}: {summary['calls']} file-system calls, {summary['cases']} fault cases "
        f"in {summary['seconds']} s; failed calls by kind {summary['failed_ops']}; "
        f"outcomes {summary['outcomes']}"
    )
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("mode", SCENARIOS)
def test_every_failed_call_keeps_every_promise(shim: Path, tmp_path: Path, mode: str) -> None:
    summary = run_scenario(shim, mode, tmp_path)
    assert summary["problems"] == [], "\n".join(summary["problems"][:20])
    calls = summary["calls"]
    exhaustive = os.environ.get("FAULTS_ALL") == "1"
    assert summary["cases"] >= (4 * calls if exhaustive else calls), summary
    # The shim saw the real calls: the restore reads, every save writes its data
    # files (torch's zip writer included), fsyncs them and renames into place.
    if mode in READS:
        assert {"open", "read"} <= set(summary["ops"]), summary["ops"]
    else:
        assert {"mkdir", "open", "write", "fsync", "rename", "close"} <= set(summary["ops"])
        assert {"__0_0.distcp", ".metadata.tmp", "MANIFEST.json.tmp"} <= set(summary["files"])
        # Every fault before the commit completed makes the save fail.
        assert summary["outcomes"].get("CheckpointSaveError", 0) > 0, summary["outcomes"]


def test_the_shim_fails_exactly_the_numbered_call(shim: Path, tmp_path: Path) -> None:
    """Call 2 under the directory fails with the errno asked for; calls elsewhere are not counted."""
    code = (
        "import os, sys, errno\n"
        "from pathlib import Path\n"
        "from tests.support.iofault import Shim\n"
        "d, other = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "s = Shim()\n"
        "s.arm(d, fail_at=2, errno=errno.EDQUOT)\n"
        "(other / 'x').write_bytes(b'not counted')\n"
        "fd = os.open(d / 'f', os.O_WRONLY | os.O_CREAT)\n"
        "try:\n"
        "    os.write(fd, b'abc')\n"
        "except OSError as e:\n"
        "    print('ERRNO', e.errno)\n"
        "os.write(fd, b'abc')\n"
        "os.fsync(fd)\n"
        "os.close(fd)\n"
        "print('CALLS', s.disarm(), s.failed_op())\n"
        "s.arm(d, fail_at=1, errno=errno.ENOSPC, persistent=True)\n"
        "for name in ('g', 'h'):\n"
        "    try:\n"
        "        os.open(d / name, os.O_WRONLY | os.O_CREAT)\n"
        "    except OSError as e:\n"
        "        print('FULL', e.errno)\n"
        "print('AFTER', s.disarm(), sorted(os.listdir(d)))\n"
    )
    (tmp_path / "d").mkdir()
    (tmp_path / "other").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "d"), str(tmp_path / "other")],
        cwd=REPO,
        env=preload_env(shim),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"ERRNO {errno.EDQUOT}" in proc.stdout
    assert f"CALLS 5 write {tmp_path / 'd' / 'f'}" in proc.stdout, proc.stdout
    assert (tmp_path / "d" / "f").read_bytes() == b"abc"
    # Persistent: call 1 and every call after it fail (a disk that stays full).
    assert proc.stdout.count(f"FULL {errno.ENOSPC}") == 2, proc.stdout
    assert "AFTER 2 ['f']" in proc.stdout, proc.stdout


def test_the_shim_sees_torch_s_own_cpp_file_writes(shim: Path, tmp_path: Path) -> None:
    """torch's C++ zip writer (libstdc++ streams, no Python in between) is counted too."""
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from tests.support.iofault import Shim, read_log\n"
        "d = Path(sys.argv[1])\n"
        "s = Shim()\n"
        "s.arm(d, log=d.parent / 'cpp.log')\n"
        "w = torch._C.PyTorchFileWriter(str(d / 'c.zip'))\n"
        "w.write_record('data', b'x' * 100000, 100000)\n"
        "w.write_end_of_file()\n"
        "del w\n"
        "s.disarm()\n"
        "print('OPS', sorted({(op.op, Path(op.path).name) for op in read_log(d.parent / 'cpp.log')}))\n"
    )
    (tmp_path / "d").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "d")],
        cwd=REPO,
        env=preload_env(shim),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for op in ("open", "write", "close"):
        assert f"('{op}', 'c.zip')" in proc.stdout, proc.stdout


def main() -> None:
    mode, work = sys.argv[1], Path(sys.argv[2])
    print("RESULT " + json.dumps(worker(mode, work, os.environ.get("FAULTS_ALL") == "1")))


if __name__ == "__main__":
    main()
