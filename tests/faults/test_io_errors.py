"""A failed save never damages an earlier checkpoint and never leaves a committed partial one.

Faults come from the operating system (a file-size limit that makes writes fail
with EFBIG; a real full tmpfs and a real read-only bind mount in a private
mount namespace, where the machine allows one) or from ``FaultyStorage``, a
subclass of the real ``LocalStorage`` that raises ``OSError`` at a chosen point
of the commit protocol. After every failure: the error is a
``CheckpointSaveError`` naming the step with the OS error chained, nothing new
is committed, no staging directory is left, every earlier checkpoint is
byte-identical and restores exactly, ``events.jsonl`` says ``save_failed``, and
the manager keeps working.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart

from ..conftest import assert_same, make_parts, snapshot, train_steps
from .faulty import FaultyStorage, events_of, leftovers, tree_digest

REPO = Path(__file__).resolve().parents[2]


def manager(run: Path, **kwargs: Any) -> stalwart.CheckpointManager:
    kwargs.setdefault("keep_last", None)
    return stalwart.CheckpointManager(run, handle_signals=False, **kwargs)


def model_state(seed: int, n: int = 4) -> tuple[stalwart.TrainState, dict[str, torch.Tensor]]:
    """A state whose weights are a function of ``seed``, and a copy of them."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(n, n)
    return (
        stalwart.TrainState(model=model, extra={"seed": seed}, rng=False),
        {k: v.clone() for k, v in model.state_dict().items()},
    )


def restored_weights(run: Path, step: int | None = None) -> tuple[int | None, dict]:
    state, _ = model_state(999)
    with manager(run) as ckpt:
        got = ckpt.restore(state, step=step)
    assert state.model is not None
    return got, {k: v.clone() for k, v in state.model.state_dict().items()}


def assert_failed_cleanly(
    run: Path, exc: BaseException, *, step: int, committed: list[int], digest: dict
) -> None:
    """The common promise of every failed save."""
    assert isinstance(exc, stalwart.CheckpointSaveError), repr(exc)
    assert f"step {step}" in str(exc), str(exc)
    assert sorted(int(p.name[5:]) for p in run.glob("step_*")) == committed
    assert leftovers(run) == [], os.listdir(run)
    assert tree_digest(run) == digest  # earlier checkpoints: same bytes
    failed = [e for e in events_of(run, "save_failed") if e["step"] == step]
    assert failed, "no save_failed event"
    assert failed[-1]["error"], failed[-1]


# ------------------------------------------------------------------ the OS says no


CHILD_EFBIG = r"""
import errno, json, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG
import torch, stalwart
from tests.faults.faulty import exception_chain, leftovers, tree_digest
from tests.faults.test_io_errors import model_state
from pathlib import Path

run, limit = Path(sys.argv[1]), int(sys.argv[2])
out = {}

def describe(exc):
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "cause": None if exc.__cause__ is None else [type(exc.__cause__).__name__,
                                                    getattr(exc.__cause__, "errno", None)],
        "chain": [[type(e).__name__, getattr(e, "errno", None)] for e in exception_chain(exc)],
    }

resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
    out["first"] = ckpt.save(1, model_state(1)[0])
    before = tree_digest(run)
    try:
        ckpt.save(2, model_state(2, n=512)[0])  # 1 MiB of weights, over the limit
    except stalwart.CheckpointSaveError as exc:
        out["sync"] = describe(exc)
    out["sync_steps"] = ckpt.all_steps()
    out["sync_leftovers"] = leftovers(run)
    out["sync_intact"] = tree_digest(run) == before
    out["later"] = ckpt.save(3, model_state(3)[0])

with stalwart.CheckpointManager(run, keep_last=None, async_save=True, handle_signals=False) as ckpt:
    before = tree_digest(run)
    out["async_submitted"] = ckpt.save(4, model_state(4, n=512)[0])
    try:
        ckpt.wait()
    except stalwart.CheckpointSaveError as exc:
        out["async"] = describe(exc)
    out["async_steps"] = ckpt.all_steps()
    out["async_leftovers"] = leftovers(run)
    out["async_intact"] = tree_digest(run) == before
    out["async_later"] = ckpt.save(5, model_state(5)[0])
    ckpt.wait()
    out["steps"] = ckpt.all_steps()
print("RESULT " + json.dumps(out))
"""


def run_child(
    code: str, *args: str, prefix: list[str] | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    proc = subprocess.run(
        [*(prefix or []), sys.executable, "-c", code, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


@pytest.fixture(scope="module")
def efbig(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One child process that hits RLIMIT_FSIZE (256 KiB) in a sync and in an async save."""
    run = tmp_path_factory.mktemp("efbig") / "run"
    return run, run_child(CHILD_EFBIG, str(run), str(256 * 1024))


def test_file_too_large_fails_the_save_and_nothing_else(efbig: tuple[Path, dict]) -> None:
    run, out = efbig
    assert out["first"] is True
    sync = out["sync"]
    assert sync["type"] == "CheckpointSaveError" and "step 2" in sync["message"], sync
    # The OS error is kept: somewhere in the chain of causes is EFBIG itself.
    assert ["OSError", errno.EFBIG] in sync["chain"], sync["chain"]
    assert out["sync_steps"] == [1] and out["sync_leftovers"] == [] and out["sync_intact"]
    assert out["later"] is True  # the manager stays usable
    assert out["steps"] == [1, 3, 5]
    assert [e["step"] for e in events_of(run, "save_failed")] == [2, 4]
    for step, seed in ((1, 1), (3, 3), (5, 5)):
        got, weights = restored_weights(run, step)
        assert got == step
        assert_same(model_state(seed)[1], weights, f"step {step}")
    assert restored_weights(run)[0] == 5


def test_file_too_large_in_a_background_save_surfaces_on_wait(efbig: tuple[Path, dict]) -> None:
    _run, out = efbig
    assert out["async_submitted"] is True
    err = out["async"]
    assert err["type"] == "CheckpointSaveError" and "step 4" in err["message"], err
    assert ["OSError", errno.EFBIG] in err["chain"], err["chain"]
    assert out["async_steps"] == [1, 3] and out["async_leftovers"] == [] and out["async_intact"]
    assert out["async_later"] is True


def test_file_too_large_is_named_in_the_message_and_chained_as_the_cause(
    efbig: tuple[Path, dict],
) -> None:
    _run, out = efbig
    for err in (out["sync"], out["async"]):
        assert err["cause"] == ["OSError", errno.EFBIG], err
        assert os.strerror(errno.EFBIG) in err["message"], err["message"]


CHILD_NAMESPACE = r"""
import errno, json, os, subprocess, sys
import torch, stalwart
from tests.faults.faulty import exception_chain, leftovers, tree_digest
from tests.faults.test_io_errors import model_state
from pathlib import Path

mount = Path(sys.argv[1])
run = mount / "run"
out = {}
with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
    out["first"] = ckpt.save(1, model_state(1)[0])
    before = tree_digest(run)
    try:
        ckpt.save(2, model_state(2, n=512)[0])  # 1 MiB on a 512 KiB filesystem
    except stalwart.CheckpointSaveError as exc:
        out["enospc"] = [str(exc), [getattr(e, "errno", None) for e in exception_chain(exc)]]
    out["enospc_steps"] = ckpt.all_steps()
    out["enospc_leftovers"] = leftovers(run)
    out["enospc_intact"] = tree_digest(run) == before
    out["later"] = ckpt.save(3, model_state(3)[0])

    # A read-only bind mount over the run directory: remounting the filesystem itself
    # would fail with EBUSY, since the run lock is open for writing.
    subprocess.run(["mount", "--bind", str(run), str(run)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(run)], check=True)
    before = tree_digest(run)
    try:
        ckpt.save(4, model_state(4)[0])
    except stalwart.CheckpointSaveError as exc:
        out["erofs"] = [str(exc), getattr(exc.__cause__, "errno", None)]
    out["erofs_steps"] = ckpt.all_steps()
    out["erofs_intact"] = tree_digest(run) == before
    state, _ = model_state(999)
    out["erofs_restore"] = ckpt.restore(state)
    out["erofs_restored_exactly"] = all(
        torch.equal(a, b) for a, b in zip(state.model.state_dict().values(),
                                          model_state(3)[1].values()))
print("RESULT " + json.dumps(out))
"""


def _namespace_prefix(mount: Path) -> list[str] | None:
    """``unshare`` + tmpfs mount of 512 KiB at ``mount``, or None where the machine forbids it."""
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("mount") is None:
        return None
    script = 'mount -t tmpfs -o size=512k stalwart-test "$0" && exec "$@"'
    probe = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, str(mount), "true"],
        capture_output=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return None
    return [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, str(mount)]


def test_full_disk_and_read_only_mount_for_real(tmp_path: Path) -> None:
    """A 512 KiB tmpfs in a private mount namespace: ENOSPC, then EROFS from a read-only bind mount."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    prefix = _namespace_prefix(mount)
    if prefix is None:
        pytest.skip("unprivileged user + mount namespaces (unshare -rm) are not available")
    out = run_child(CHILD_NAMESPACE, str(mount), prefix=prefix)
    assert out["first"] is True
    message, errnos = out["enospc"]
    assert "step 2" in message and errno.ENOSPC in errnos, out["enospc"]
    assert out["enospc_steps"] == [1] and out["enospc_leftovers"] == [] and out["enospc_intact"]
    assert out["later"] is True
    message, cause_errno = out["erofs"]
    assert "step 4" in message and cause_errno == errno.EROFS, out["erofs"]
    assert out["erofs_steps"] == [1, 3] and out["erofs_intact"]
    assert out["erofs_restore"] == 3 and out["erofs_restored_exactly"]


# ------------------------------------------------------------------ a faulty backend


@pytest.mark.parametrize("fault", ["commit", "manifest_written", "fsync"])
def test_failed_commit_leaves_nothing_and_harms_nothing(tmp_path: Path, fault: str) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    storage = FaultyStorage(run, None)
    with manager(run, storage=storage) as ckpt:
        train_steps(parts, 2)
        assert ckpt.save(1, parts.state)
        expected = copy.deepcopy(snapshot(parts))  # optimizer state is live
        digest = tree_digest(run)
        storage.fault = fault  # type: ignore[assignment]
        train_steps(parts, 2)
        with pytest.raises(stalwart.CheckpointSaveError) as info:
            ckpt.save(2, parts.state)
        assert storage.raised and info.value.__cause__ is storage.raised[0]
        assert_failed_cleanly(run, info.value, step=2, committed=[1], digest=digest)
        assert ckpt.all_steps() == [1]

        storage.fault = None  # the disk recovers; so does the run
        assert ckpt.save(2, parts.state)
        assert ckpt.all_steps() == [1, 2]
    restored = make_parts()
    with manager(run) as ckpt:
        assert ckpt.restore(restored.state, step=1) == 1
    assert_same(expected, snapshot(restored))


def test_read_only_run_directory_after_saves_started(tmp_path: Path) -> None:
    """Creating the staging directory fails with EROFS (root ignores chmod, so the backend says it)."""
    run = tmp_path / "run"
    parts = make_parts()
    storage = FaultyStorage(run, "begin", after=1)
    with manager(run, storage=storage) as ckpt:
        train_steps(parts, 1)
        assert ckpt.save(1, parts.state)
        expected = copy.deepcopy(snapshot(parts))  # optimizer state is live
        digest = tree_digest(run)
        for step in (2, 3):
            train_steps(parts, 1)
            with pytest.raises(stalwart.CheckpointSaveError) as info:
                ckpt.save(step, parts.state)
            assert isinstance(info.value.__cause__, PermissionError)
            assert info.value.__cause__.errno == errno.EROFS
            assert_failed_cleanly(run, info.value, step=step, committed=[1], digest=digest)
        restored = make_parts()
        assert ckpt.restore(restored.state) == 1  # reading still works
        assert_same(expected, snapshot(restored))


def test_full_disk_during_retention_does_not_stop_training(tmp_path: Path) -> None:
    """Deleting old checkpoints fails with ENOSPC: logged as delete_failed, every save still lands."""
    run = tmp_path / "run"
    parts = make_parts()
    storage = FaultyStorage(run, "delete")
    with manager(run, keep_last=1, storage=storage) as ckpt:
        for step in (1, 2, 3, 4):
            train_steps(parts, 1)
            assert ckpt.save(step, parts.state)
        assert ckpt.all_steps() == [1, 2, 3, 4]
        failed = events_of(run, "delete_failed")
        assert {e["step"] for e in failed} == {1, 2, 3}
        assert all(os.strerror(errno.ENOSPC) in e["error"] for e in failed), failed
        assert not events_of(run, "delete")
        assert leftovers(run) == []

        storage.fault = None  # space comes back: the next save's retention catches up
        train_steps(parts, 1)
        assert ckpt.save(5, parts.state)
        expected = copy.deepcopy(snapshot(parts))  # optimizer state is live
        assert ckpt.all_steps() == [5]
        assert sorted(e["step"] for e in events_of(run, "delete")) == [1, 2, 3, 4]
        assert leftovers(run) == []
    restored = make_parts()
    with manager(run) as ckpt:
        assert ckpt.restore(restored.state) == 5
    assert_same(expected, snapshot(restored))


# ------------------------------------------------------------------ async saves


@pytest.mark.parametrize("surfaces_on", ["save", "wait", "close"])
def test_background_failure_surfaces_on_the_next_call(tmp_path: Path, surfaces_on: str) -> None:
    """An async save that fails is raised, chained, by the next save, wait or close: never lost."""
    run = tmp_path / "run"
    parts = make_parts()
    storage = FaultyStorage(run, None, times=1)
    ckpt = manager(run, async_save=True, storage=storage)
    try:
        assert ckpt.save(1, parts.state)
        ckpt.wait()
        digest = tree_digest(run)
        storage.fault = "commit"
        train_steps(parts, 1)
        assert ckpt.save(2, parts.state)  # handed to the background writer
        train_steps(parts, 1)
        next_call = {
            "save": lambda: ckpt.save(3, parts.state),
            "wait": ckpt.wait,
            "close": ckpt.close,
        }[surfaces_on]
        with pytest.raises(stalwart.CheckpointSaveError) as info:
            next_call()
        assert info.value.__cause__ is storage.raised[0]
        assert_failed_cleanly(run, info.value, step=2, committed=[1], digest=digest)
    finally:
        ckpt.close()


def test_background_failure_surfaces_from_the_context_manager(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()

    def train() -> None:
        with manager(run, async_save=True, storage=FaultyStorage(run, "manifest_written")) as ckpt:
            assert ckpt.save(1, parts.state)  # returns at once; the failure comes later

    with pytest.raises(stalwart.CheckpointSaveError) as info:
        train()
    assert isinstance(info.value.__cause__, OSError)
    assert_failed_cleanly(run, info.value, step=1, committed=[], digest={})


def test_step_whose_background_save_failed_can_be_saved_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    with manager(run, async_save=True, storage=FaultyStorage(run, "commit", times=1)) as ckpt:
        assert ckpt.save(1, parts.state)
        with pytest.raises(stalwart.CheckpointSaveError):
            ckpt.wait()
        assert ckpt.save(1, parts.state, force=True)  # the disk is fine again: retry
        ckpt.wait()
        assert ckpt.all_steps() == [1]


def test_save_that_reports_an_earlier_failure_is_not_lost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    # Step 1's write fails slowly, so save(2) finds it still running and waits on it.
    slow = FaultyStorage(run, "commit", times=1, delay_s=0.5)
    with manager(run, async_save=True, storage=slow) as ckpt:
        assert ckpt.save(1, parts.state)
        train_steps(parts, 1)
        with pytest.raises(stalwart.CheckpointSaveError, match="step 1"):
            ckpt.save(2, parts.state)
        assert ckpt.save(2, parts.state)
        ckpt.wait()
        assert ckpt.all_steps() == [2]
