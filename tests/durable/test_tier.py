"""The durable tier's commit protocol against a real S3 server (and fsspec on a local path)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.manifest import MANIFEST_NAME
from stalwart.pipeline import verify_checkpoint
from stalwart.storage.durable import DurableTier, data_dir_name
from stalwart.storage.local import LocalStorage

from ..conftest import flip_byte
from .conftest import FAST, run_events, use_endpoint, verify_durable


def _checkpoint(directory: Path, step: int, *, seed: int = 0, width: int = 64) -> Path:
    """A real committed local checkpoint of a small model."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, width)
    state = stalwart.TrainState(model=model, optimizer=torch.optim.Adam(model.parameters()))
    with stalwart.CheckpointManager(directory, keep_last=None, handle_signals=False) as ckpt:
        ckpt.save(step, state, force=True)
    return LocalStorage(directory).step_path(step)


def test_upload_commits_the_manifest_last_and_download_verifies(
    tmp_path, s3_env, s3_bucket, fault_proxy, monkeypatch
):
    local = _checkpoint(tmp_path / "run", 10)
    use_endpoint(monkeypatch, fault_proxy.endpoint)  # no faults: it only logs the requests
    tier = DurableTier(f"s3://{s3_bucket}/exp", retry=FAST)
    assert tier.committed_steps() == []
    result = tier.upload(local)
    puts = [path for method, path, _outcome in fault_proxy.log if method == "PUT"]
    assert puts[-1].endswith(f"/exp/step_000000010/{MANIFEST_NAME}")
    assert not any(MANIFEST_NAME in path for path in puts[:-1])
    assert result.bytes > 0 and not result.already
    assert tier.committed_steps() == [10]
    manifest_bytes = (local / MANIFEST_NAME).read_bytes()
    keys = sorted(o.key for o in tier.client.list_objects())
    data = f"step_000000010/{data_dir_name(manifest_bytes)}"
    assert keys == sorted(
        [f"step_000000010/{MANIFEST_NAME}"]
        + [f"{data}/{p.name}" for p in local.iterdir() if p.name != MANIFEST_NAME]
    )
    # Uploading again is a no-op: this exact checkpoint is already committed.
    assert tier.upload(local).already

    target = LocalStorage(tmp_path / "other")
    (tmp_path / "other").mkdir()
    staging = target.begin(10)
    got = tier.download(10, staging)
    assert got == manifest_bytes
    target.commit(staging, 10, got.decode())
    assert verify_checkpoint(target.step_path(10)).step == 10
    for p in local.iterdir():
        assert (target.step_path(10) / p.name).read_bytes() == p.read_bytes()


def test_a_step_without_manifest_does_not_exist_and_gc_removes_it_after_grace(
    tmp_path, s3_env, s3_bucket
):
    tier = DurableTier(f"s3://{s3_bucket}/exp", retry=FAST)
    tier.upload(_checkpoint(tmp_path / "a", 5))
    # An upload cut short: data objects, no manifest.
    tier.client.put_bytes("step_000000009/data-0123456789abcdef/__0_0.distcp", b"x" * 100)
    # The loser of a race beside a committed step.
    tier.client.put_bytes("step_000000005/data-fedcba9876543210/__0_0.distcp", b"y" * 10)
    assert tier.committed_steps() == [5]
    assert [s.step for s in tier.scan()] == [5, 9]
    assert tier.orphans(older_than=3600) == []  # too young: may be an upload in progress
    orphans = sorted(o.key for o in tier.orphans(older_than=0, now=time.time() + 1))
    assert orphans == [
        "step_000000005/data-fedcba9876543210/__0_0.distcp",
        "step_000000009/data-0123456789abcdef/__0_0.distcp",
    ]
    tier.remove(orphans)
    assert [s.step for s in tier.scan()] == [5]
    target = tmp_path / "dl"
    target.mkdir()
    tier.download(5, target)  # the committed step is intact


def test_a_crashed_local_write_s_temporary_file_is_an_orphan(tmp_path):
    # The file:// client publishes each object from a private temporary file; a crash
    # between the write and the link leaves that file, which gc must be able to see.
    tier = DurableTier((tmp_path / "store").as_uri(), retry=FAST)
    tier.upload(_checkpoint(tmp_path / "a", 5))
    data = next(o.key for o in tier.client.list_objects() if o.key.endswith(".distcp"))
    leftovers = [f"{data}.tmp-0123456789ab", f"step_000000005/{MANIFEST_NAME}.tmp-ba9876543210"]
    for key in leftovers:
        tier.client.put_bytes(key, b"partial")
    groups = {g.name: g.committed for g in tier.orphan_groups()}
    assert groups == {
        f"{data.rsplit('/', 1)[0]}/": True,
        f"step_000000005/{MANIFEST_NAME}.tmp-ba9876543210": True,
    }
    orphans = sorted(o.key for o in tier.orphans(older_than=0, now=time.time() + 1))
    assert orphans == sorted(leftovers)
    tier.remove(orphans)
    verify_durable(tier, 5, tmp_path)  # the committed checkpoint kept every object it names


def test_download_refuses_a_manifest_of_another_step_and_a_missing_data_object(
    tmp_path, s3_env, s3_bucket
):
    tier = DurableTier(f"s3://{s3_bucket}/exp", retry=FAST)
    tier.upload(_checkpoint(tmp_path / "a", 5))
    manifest_bytes = tier.manifest_bytes(5)
    # A manifest copied under another step's prefix does not pass for that step.
    tier.client.put_bytes(f"step_000000006/{MANIFEST_NAME}", manifest_bytes)
    (tmp_path / "six").mkdir()
    with pytest.raises(stalwart.CheckpointCorruptError, match="says step 5"):
        tier.download(6, tmp_path / "six")
    data = f"step_000000005/{data_dir_name(manifest_bytes)}"
    tier.remove([f"{data}/__0_0.distcp"])
    (tmp_path / "five").mkdir()
    with pytest.raises(stalwart.CheckpointCorruptError, match=r"__0_0\.distcp is missing"):
        tier.download(5, tmp_path / "five")


def test_two_writers_racing_for_one_step_exactly_one_commits(tmp_path, s3_env, s3_bucket):
    url = f"s3://{s3_bucket}/shared"
    a = _checkpoint(tmp_path / "a", 7, seed=1)
    b = _checkpoint(tmp_path / "b", 7, seed=2)
    outcomes: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(name: str, path: Path) -> None:
        tier = DurableTier(url, retry=FAST)
        barrier.wait()
        try:
            outcomes[name] = tier.upload(path)
        except Exception as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=run, args=(n, p)) for n, p in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [v for v in outcomes.values() if isinstance(v, Exception)]
    assert len(errors) == 1, outcomes
    assert isinstance(errors[0], stalwart.CommitConflictError)
    assert "already committed" in str(errors[0]) and "own prefix" in str(errors[0])
    winner = a if not isinstance(outcomes["a"], Exception) else b
    tier = DurableTier(url, retry=FAST)
    target = tmp_path / "dl"
    target.mkdir()
    # The winner's checkpoint is whole: the loser's data went to its own data prefix.
    assert tier.download(7, target) == (winner / MANIFEST_NAME).read_bytes()


def test_two_managers_committing_the_same_step_one_gets_a_clear_error(tmp_path, s3_env, s3_bucket):
    url = f"s3://{s3_bucket}/race"
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(name: str) -> None:
        model = torch.nn.Linear(8, 8)
        state = stalwart.TrainState(model=model)
        with stalwart.CheckpointManager(
            tmp_path / name,
            durable=stalwart.DurableConfig(url=url, retry=FAST),
            handle_signals=False,
        ) as ckpt:
            barrier.wait()
            ckpt.save(3, state)
            try:
                results[name] = ckpt.wait_durable(30)
            except stalwart.CheckpointSaveError as exc:
                results[name] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in ("x", "y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(type(v).__name__ for v in results.values()) == ["CommitConflictError", "bool"]
    loser = next(n for n, v in results.items() if isinstance(v, Exception))
    events = run_events(tmp_path / loser)
    assert any(
        e["event"] == "upload_failed" and "CommitConflictError" in e["error"] for e in events
    )


def test_a_local_file_damaged_after_commit_is_never_uploaded_as_committed(
    tmp_path, s3_env, s3_bucket
):
    local = _checkpoint(tmp_path / "run", 4)
    data = next(p for p in local.iterdir() if p.suffix == ".distcp")
    flip_byte(data, data.stat().st_size // 2)
    tier = DurableTier(f"s3://{s3_bucket}/exp", retry=FAST)
    with pytest.raises(stalwart.CheckpointCorruptError, match="no longer matches"):
        tier.upload(local)
    assert tier.committed_steps() == []
    assert tier.client.list_objects() == []  # its data objects were removed again


def test_a_damaged_durable_copy_is_detected_before_use_and_restore_falls_back(
    tmp_path, s3_env, s3_bucket
):
    url = f"s3://{s3_bucket}/exp"
    model = torch.nn.Linear(16, 16)
    state = stalwart.TrainState(model=model)
    saved = {}
    with stalwart.CheckpointManager(
        tmp_path / "run",
        durable=stalwart.DurableConfig(url=url, retry=FAST),
        handle_signals=False,
    ) as ckpt:
        for step in (1, 2):
            model.weight.data.fill_(float(step))
            ckpt.save(step, state)
            saved[step] = model.weight.detach().clone()
        assert ckpt.wait_durable(30)
    tier = DurableTier(url, retry=FAST)
    manifest_bytes = tier.manifest_bytes(2)
    key = f"step_000000002/{data_dir_name(manifest_bytes)}/__0_0.distcp"
    blob = bytearray(tier.client.get_bytes(key))
    blob[-20] ^= 0x01
    tier.client.put_bytes(key, bytes(blob))
    # The node lost its disk: only the durable tier is left.
    fresh = torch.nn.Linear(16, 16)
    with stalwart.CheckpointManager(
        tmp_path / "new",
        durable=stalwart.DurableConfig(url=url, retry=FAST),
        handle_signals=False,
    ) as ckpt:
        assert ckpt.restore(stalwart.TrainState(model=fresh)) == 1
    assert torch.equal(fresh.weight, saved[1])
    events = run_events(tmp_path / "new")
    skipped = [e for e in events if e["event"] == "restore_skipped"]
    assert skipped and skipped[0]["step"] == 2 and "damaged" in skipped[0]["reason"]
    assert not (tmp_path / "new" / "step_000000002").exists()


def test_credentials_never_appear_in_events_manifests_logs_or_errors(
    tmp_path, s3_env, s3_bucket, fault_proxy, monkeypatch, caplog
):
    secret, key = s3_env["AWS_SECRET_ACCESS_KEY"], s3_env["AWS_ACCESS_KEY_ID"]
    caplog.set_level(logging.DEBUG)
    messages: list[str] = []
    url = f"s3://{s3_bucket}/creds"
    model = torch.nn.Linear(8, 8)
    state = stalwart.TrainState(model=model)
    # A conflict, retries through a failing network, and a restore.
    DurableTier(url, retry=FAST).upload(_checkpoint(tmp_path / "other", 1, seed=9))
    use_endpoint(monkeypatch, fault_proxy.endpoint)
    fault_proxy.fail_rate = 0.5
    with stalwart.CheckpointManager(
        tmp_path / "run",
        durable=stalwart.DurableConfig(url=url, retry=FAST),
        handle_signals=False,
    ) as ckpt:
        for step in (1, 2):
            try:
                ckpt.save(step, state)
                ckpt.wait_durable(60)
            except stalwart.CheckpointSaveError as exc:
                messages.append(str(exc))
    fault_proxy.fail_rate = 0.0
    assert fault_proxy.failures
    # Wrong secret: the store refuses, the error says so without the secret.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret[::-1])
    with pytest.raises(stalwart.DurableStoreError) as refused:
        stalwart.CheckpointManager(tmp_path / "run2", durable=url, handle_signals=False)
    messages.append(str(refused.value))
    assert "refuses" in str(refused.value)
    # One line with the store's error code, not its XML error document.
    assert "SignatureDoesNotMatch" in str(refused.value) and "<?xml" not in str(refused.value)
    # Credentials in the URL itself are redacted too.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    try:
        tier = DurableTier(f"s3://{key}:{secret}@{s3_bucket}/x", retry=FAST)
        messages += [repr(tier), tier.url]
        tier.committed_steps()
    except stalwart.DurableStoreError as exc:
        messages.append(str(exc))
    texts = messages + [r.getMessage() for r in caplog.records]
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            texts.append(path.read_bytes().decode("utf-8", "replace"))
    assert any("CommitConflictError" in t for t in texts)
    for text in texts:
        assert secret not in text
        assert key not in text
