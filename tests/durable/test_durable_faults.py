"""The durable tier under a failing network (a fault-injecting proxy), an outage and SIGKILL."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import stalwart
from stalwart.manifest import MANIFEST_NAME
from stalwart.pipeline import verify_checkpoint
from stalwart.storage.durable import DurableTier

from ..conftest import make_parts, train_steps
from .conftest import FAST, run_events, use_endpoint, verify_durable

ROOT = Path(__file__).resolve().parents[2]


def _verify_all(tier: DurableTier, tmp: Path) -> list[int]:
    steps = tier.committed_steps()
    for step in steps:
        verify_durable(tier, step, tmp)
    return steps


def test_with_30_percent_of_requests_failing_every_checkpoint_becomes_durable(
    tmp_path, s3_env, s3_bucket, fault_proxy, monkeypatch
):
    url = f"s3://{s3_bucket}/flaky"
    use_endpoint(monkeypatch, fault_proxy.endpoint)
    fault_proxy.fail_rate = 0.3  # 503, 500, resets before the request and mid-response
    fault_proxy.delay_s = 0.01
    parts = make_parts(hidden=256)
    run = tmp_path / "run"
    call_times = []
    with stalwart.CheckpointManager(
        run,
        durable=stalwart.DurableConfig(url=url, keep_last=None, max_pending=16, retry=FAST),
        async_save=True,
        keep_last=2,
        handle_signals=False,
    ) as ckpt:
        for step in range(1, 13):
            train_steps(parts, 1)
            t0 = time.perf_counter()
            assert ckpt.save(step, parts.state)
            call_times.append(time.perf_counter() - t0)
            time.sleep(0.1)  # the rest of a training step
        assert ckpt.wait_durable(180)
    assert sum(fault_proxy.failures.values()) >= 10, fault_proxy.failures
    use_endpoint(monkeypatch, s3_env["AWS_ENDPOINT_URL"])
    assert _verify_all(DurableTier(url, retry=FAST), tmp_path) == list(range(1, 13))
    events = run_events(run)
    uploads = [e for e in events if e["event"] == "upload"]
    assert sorted(e["step"] for e in uploads) == list(range(1, 13))
    assert sum(e["retries"] for e in uploads) > 0 or any(
        e["event"] == "upload_retry" for e in events
    )
    stalls = [e["stall_s"] for e in events if e["event"] == "save"]
    upload_s = [e["seconds"] for e in uploads]
    # Training waited only for the staging copy, never for the network.
    print(
        f"faults {dict(fault_proxy.failures)} of {fault_proxy.requests} requests; "
        f"stall max {max(stalls) * 1e3:.1f} ms, upload median {statistics.median(upload_s) * 1e3:.0f} ms"
    )
    assert max(stalls) < statistics.median(upload_s), (stalls, upload_s)
    assert not [e for e in events if e["event"] == "upload_failed" and not e["will_retry"]]


def test_an_outage_keeps_the_newest_undurable_checkpoint_and_uploads_catch_up(
    tmp_path, s3_env, s3_bucket, fault_proxy, monkeypatch
):
    url = f"s3://{s3_bucket}/outage"
    use_endpoint(monkeypatch, fault_proxy.endpoint)
    parts = make_parts()
    run = tmp_path / "run"
    with stalwart.CheckpointManager(
        run,
        durable=stalwart.DurableConfig(url=url, retry=FAST),
        keep_last=1,
        handle_signals=False,
    ) as ckpt:
        ckpt.save(1, parts.state)
        assert ckpt.wait_durable(30)
        fault_proxy.down = True
        stalls = []
        for step in range(2, 8):
            train_steps(parts, 1)
            t0 = time.perf_counter()
            assert ckpt.save(step, parts.state)
            stalls.append(time.perf_counter() - t0)
            time.sleep(0.2)
        # Training went on; nothing newer than step 1 is durable yet.
        assert ckpt.last_durable_step == 1
        assert not ckpt.wait_durable(0.5)
        pending = ckpt.pending_uploads
        assert pending and pending[-1] == 7
        # Local retention (keep_last=1) kept every checkpoint still waiting for upload.
        assert set(pending) <= set(ckpt.all_steps())
        fault_proxy.down = False
        assert ckpt.wait_durable(60)
        assert ckpt.last_durable_step == 7
        assert ckpt.all_steps() == [7]
    assert fault_proxy.failures["down"] > 0
    events = run_events(run)
    assert any(e["event"] in ("upload_retry", "upload_failed") for e in events)
    outage_uploads = [e for e in events if e["event"] == "upload" and e["step"] > 1]
    assert outage_uploads[-1]["step"] == 7 and outage_uploads[-1]["lag_s"] > 0.5
    # Each save during the outage returned after the local commit, not after retries.
    assert max(stalls) < 2.0 and max(stalls) < outage_uploads[-1]["lag_s"]
    use_endpoint(monkeypatch, s3_env["AWS_ENDPOINT_URL"])
    assert 7 in _verify_all(DurableTier(url, retry=FAST), tmp_path)


CHILD = textwrap.dedent(
    """
    import sys, time, torch, stalwart
    from stalwart.storage.remote import RetryPolicy
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    state = stalwart.TrainState(model=model, optimizer=torch.optim.Adam(model.parameters()))
    retry = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=60, request_timeout=30)
    with stalwart.CheckpointManager(sys.argv[1], durable=stalwart.DurableConfig(url=sys.argv[2], retry=retry), handle_signals=False,) as ckpt:
        ckpt.save(1, state)
        time.sleep(120)
    """
)


@pytest.mark.slow
def test_sigkill_during_upload_never_shows_a_partial_commit_and_the_next_run_finishes_it(
    tmp_path, s3_env, s3_bucket, fault_proxy, monkeypatch
):
    url = f"s3://{s3_bucket}/killed"
    run = tmp_path / "run"
    fault_proxy.delay_s = 0.4  # slow enough to kill between the data and the manifest
    env = {**os.environ, **s3_env, "AWS_ENDPOINT_URL": fault_proxy.endpoint}
    env["AWS_ENDPOINT"] = fault_proxy.endpoint
    env["PYTHONPATH"] = str(ROOT / "src")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(run), url], env=env, stdout=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(
                m == "PUT" and p.endswith("/.metadata") and o == "ok" for m, p, o in fault_proxy.log
            ):
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"no data object was uploaded: {fault_proxy.log}")
        time.sleep(0.5)  # the .metadata object lands; the large file is still in parts
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    tier = DurableTier(url, retry=FAST)
    # Some of step 1 reached the store, but it is not committed: nobody can restore it.
    scanned = tier.scan()
    assert [s.step for s in scanned] == [1] and not scanned[0].committed
    assert tier.committed_steps() == []
    assert not any(m == "PUT" and p.endswith(MANIFEST_NAME) for m, p, _o in fault_proxy.log)
    assert verify_checkpoint(run / "step_000000001").step == 1  # committed locally

    # The next run on the same directory uploads what the killed one left behind.
    fault_proxy.delay_s = 0.0
    with stalwart.CheckpointManager(
        run,
        durable=stalwart.DurableConfig(url=url, retry=FAST),
        handle_signals=False,
    ) as ckpt:
        assert ckpt.wait_durable(60)
        assert ckpt.last_durable_step == 1
    assert _verify_all(tier, tmp_path) == [1]
    # The second attempt wrote the same data prefix (it is named after the manifest).
    assert tier.orphans(older_than=0, now=time.time() + 1) == []


def test_gc_grace_period_spares_an_upload_in_progress(tmp_path, s3_env, s3_bucket):
    tier = DurableTier(f"s3://{s3_bucket}/gc", retry=FAST)
    tier.client.put_bytes("step_000000003/data-00000000000000aa/__0_0.distcp", b"z" * 64)
    assert tier.orphans(older_than=60) == []
    assert [o.key for o in tier.orphans(older_than=60, now=time.time() + 120)] == [
        "step_000000003/data-00000000000000aa/__0_0.distcp"
    ]
    parts = make_parts()
    with stalwart.CheckpointManager(
        tmp_path / "run",
        durable=stalwart.DurableConfig(url=f"s3://{s3_bucket}/gc", retry=FAST),
        handle_signals=False,
    ) as ckpt:
        ckpt.save(3, parts.state)
    # The committed step 3 beside the stale attempt: only the attempt is an orphan.
    orphans = tier.orphans(older_than=0, now=time.time() + 1)
    assert [o.key for o in orphans] == ["step_000000003/data-00000000000000aa/__0_0.distcp"]
    tier.remove([o.key for o in orphans])
    assert tier.committed_steps() == [3]
