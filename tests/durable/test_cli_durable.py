"""`stalwart ls` and `stalwart gc` with a durable tier: runs that upload, and the store itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import stalwart
from stalwart.manifest import MANIFEST_NAME
from stalwart.storage.durable import DurableTier
from stalwart.storage.remote import RetryPolicy

from ..conftest import assert_one_line_error, cli, make_parts, train_steps
from .conftest import FAST, run_events, use_endpoint, verify_durable

INCOMPLETE = "step_000000009/data-00000000000000aa/__0_0.distcp"
STRAY = "step_000000006/data-00000000000000bb/__0_0.distcp"


def rows(out: str) -> dict[str, list[str]]:
    """Table rows of the human output by step, split into cells."""
    return {
        line.split()[0]: line.split() for line in out.splitlines() if line.strip()[:1].isdigit()
    }


def make_run(run: Path, url: str) -> None:
    """Steps 1-6, every second one uploaded (2, 4, 6), durable retention keeping 2 (so 2 is
    deleted again); then a session without a durable tier commits step 7 locally only."""
    parts = make_parts()
    with stalwart.CheckpointManager(
        run,
        durable=stalwart.DurableConfig(url=url, every=2, keep_last=2, retry=FAST),
        keep_last=None,
        handle_signals=False,
    ) as ckpt:
        for step in range(1, 7):
            train_steps(parts, 1)
            ckpt.save(step, parts.state, metrics={"loss": 1.0 / step})
        assert ckpt.wait_durable(60)
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        train_steps(parts, 1)
        ckpt.save(7, parts.state)


# ----------------------------------------------------------------------------- ls RUN


def test_ls_of_a_run_marks_durable_steps_and_the_ones_not_yet_durable(
    capsys, tmp_path, s3_env, s3_bucket
):
    url = f"s3://{s3_bucket}/exp"
    run = tmp_path / "run"
    make_run(run, url)
    assert DurableTier(url, retry=FAST).committed_steps() == [4, 6]
    uploads = {e["step"]: e for e in run_events(run) if e["event"] == "upload"}
    assert sorted(uploads) == [2, 4, 6]

    code, out, err = cli(capsys, "ls", run, "--json")
    assert code == 0, err
    report = json.loads(out)
    durable = report["durable"]
    assert durable["url"] == url
    assert durable["last_durable_step"] == 6
    assert durable["lag_s"] == uploads[6]["lag_s"] and durable["lag_s"] >= 0
    assert durable["durable_steps"] == [4, 6]  # step 2 was deleted by durable retention
    assert durable["not_durable_steps"] == [7]
    assert durable["durable_only_steps"] == []
    assert durable["upload_failures"] == [] and durable["unreachable"] is None
    marks = {e["step"]: e["durable"] for e in report["entries"]}
    assert marks == {1: False, 2: False, 3: False, 4: True, 5: False, 6: True, 7: False}

    code, out, err = cli(capsys, "ls", run)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.lstrip().startswith("step"))
    assert header.split()[:3] == ["step", "status", "durable"]
    table = rows(out)
    assert [table[str(s)][2] for s in range(1, 8)] == ["no", "no", "no", "yes", "no", "yes", "no"]
    assert all(table[str(s)][1] == "committed" for s in range(1, 8))
    assert f"durable tier {url}: newest durable step 6 (uploaded " in out
    assert "1 committed step not yet durable (7)" in out


def test_ls_of_a_run_shows_steps_left_only_in_the_durable_tier(capsys, tmp_path, s3_env, s3_bucket):
    url = f"s3://{s3_bucket}/tiers"
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(
        run,
        durable=stalwart.DurableConfig(url=url, keep_last=None, retry=FAST),
        keep_last=1,
        handle_signals=False,
    ) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, parts.state)
            assert ckpt.wait_durable(60)  # each upload done before retention runs again
    code, out, err = cli(capsys, "ls", run, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert [e["step"] for e in report["entries"]] == [3]
    assert report["durable"]["durable_only_steps"] == [1, 2]
    assert report["durable"]["not_durable_steps"] == []
    assert DurableTier(url, retry=FAST).committed_steps() == [1, 2, 3]
    code, out, _err = cli(capsys, "ls", run)
    assert "durable only (no longer on local disk): 1, 2" in out
    assert "0 committed steps not yet durable" in out


def test_ls_of_a_run_reports_failing_uploads_while_the_store_is_down(
    capsys, tmp_path, s3_env, s3_bucket, fault_proxy, monkeypatch
):
    use_endpoint(monkeypatch, fault_proxy.endpoint)
    url = f"s3://{s3_bucket}/down"
    run = tmp_path / "run"
    parts = make_parts()
    brief = RetryPolicy(
        initial_backoff=0.05, max_backoff=0.2, deadline=0.5, request_timeout=2.0, request_retries=0
    )
    with stalwart.CheckpointManager(
        run,
        durable=stalwart.DurableConfig(url=url, retry=brief),
        keep_last=None,
        handle_signals=False,
    ) as ckpt:
        ckpt.save(1, parts.state)
        assert ckpt.wait_durable(30)
        fault_proxy.down = True
        ckpt.save(2, parts.state)
        deadline = time.monotonic() + 30
        while not any(e["event"] == "upload_failed" for e in run_events(run)):
            assert time.monotonic() < deadline, run_events(run)
            time.sleep(0.1)
        # An operator looks while training goes on and the store is down.
        code, out, err = cli(capsys, "ls", run, "--json")
        assert code == 0, err
        durable = json.loads(out)["durable"]
        assert durable["last_durable_step"] == 1
        assert durable["not_durable_steps"] == [2]
        assert [f["step"] for f in durable["upload_failures"]] == [2]
        assert durable["upload_failures"][0]["will_retry"] is True
        code, out, _err = cli(capsys, "ls", run)
        assert "upload of step 2 failed (will retry): " in out

        fault_proxy.down = False
        assert ckpt.wait_durable(60)
    code, out, _err = cli(capsys, "ls", run, "--json")
    durable = json.loads(out)["durable"]
    assert durable["last_durable_step"] == 2
    assert durable["upload_failures"] == [] and durable["not_durable_steps"] == []


# ----------------------------------------------------------------------------- ls URL


def test_ls_of_a_url_lists_committed_steps_and_incomplete_uploads(
    capsys, tmp_path, s3_env, s3_bucket
):
    url = f"s3://{s3_bucket}/exp"
    run = tmp_path / "run"
    make_run(run, url)
    tier = DurableTier(url, retry=FAST)
    tier.client.put_bytes(INCOMPLETE, b"z" * 100)  # an upload cut short: no manifest

    code, out, err = cli(capsys, "ls", url, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["url"] == url and report["latest_step"] == 6
    assert report["counts"] == {"committed": 2, "incomplete": 1, "corrupt": 0}
    entries = {e["step"]: e for e in report["entries"]}
    assert sorted(entries) == [4, 6, 9]
    for step in (4, 6):
        manifest = tier.read_manifest(step)
        e = entries[step]
        assert e["status"] == "committed" and e["checked"] == "size"
        assert e["bytes"] == manifest.total_bytes and e["files"] == len(manifest.files)
        assert e["world_size"] == 1 and e["created_unix"] == manifest.created_unix
        assert e["metrics"] == {"loss": pytest.approx(1.0 / step)}
    assert entries[9]["status"] == "incomplete" and entries[9]["bytes"] == 100
    assert "no MANIFEST.json" in entries[9]["problems"][0]["reason"]

    code, out, err = cli(capsys, "ls", url)
    assert code == 0, err
    assert out.splitlines()[0] == f"durable tier {url}"
    table = rows(out)
    assert table["4"][1] == "committed" and table["6"][1] == "committed"
    assert table["9"][1] == "incomplete"
    assert "step_000000009: no MANIFEST.json" in out
    assert "newest committed step: 6; 2 committed, 1 incomplete, 0 corrupt" in out


def test_ls_of_a_url_finds_a_missing_data_object(capsys, tmp_path, s3_env, s3_bucket):
    url = f"s3://{s3_bucket}/exp"
    make_run(tmp_path / "run", url)
    tier = DurableTier(url, retry=FAST)
    victim = next(
        o.key
        for s in tier.scan()
        if s.step == 4
        for o in s.objects
        if o.key.endswith("__0_0.distcp")
    )
    tier.remove([victim])
    code, out, _err = cli(capsys, "ls", url, "--json")
    assert code == 1
    report = json.loads(out)
    bad = next(e for e in report["entries"] if e["step"] == 4)
    assert bad["status"] == "corrupt"
    assert bad["problems"][0]["file"] == "__0_0.distcp"
    assert bad["problems"][0]["reason"].startswith("missing")
    assert report["latest_step"] == 6


def test_ls_of_a_url_finds_an_unreadable_manifest_and_one_of_another_step(
    capsys, tmp_path, s3_env, s3_bucket
):
    url = f"s3://{s3_bucket}/exp"
    make_run(tmp_path / "run", url)
    tier = DurableTier(url, retry=FAST)
    tier.client.put_bytes(f"step_000000008/{MANIFEST_NAME}", b"{not json")
    tier.client.put_bytes(f"step_000000009/{MANIFEST_NAME}", tier.manifest_bytes(4))
    code, out, _err = cli(capsys, "ls", url, "--json")
    assert code == 1
    entries = {e["step"]: e for e in json.loads(out)["entries"]}
    assert entries[8]["status"] == "corrupt" and entries[8]["problems"][0]["file"] == MANIFEST_NAME
    assert not entries[8]["problems"][0]["reason"].startswith(url)  # the row names the file
    assert entries[9]["status"] == "corrupt"
    assert any(
        "records step 4, but the prefix is step_000000009" in p["reason"]
        for p in entries[9]["problems"]
    )
    assert entries[4]["status"] == entries[6]["status"] == "committed"


# ----------------------------------------------------------------------------- gc URL


def test_gc_of_a_url_removes_old_orphans_and_keeps_committed_steps_intact(
    capsys, tmp_path, s3_env, s3_bucket
):
    url = f"s3://{s3_bucket}/exp"
    make_run(tmp_path / "run", url)
    tier = DurableTier(url, retry=FAST)
    tier.client.put_bytes(INCOMPLETE, b"z" * 100)  # an upload cut short
    tier.client.put_bytes(STRAY, b"y" * 50)  # data beside a committed manifest, not its own
    before = {o.key for s in tier.scan() for o in s.objects}

    # Default grace (1h): both orphans are young, nothing is removed.
    code, out, err = cli(capsys, "gc", url, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["grace_s"] == 3600 and report["removed"] == 0
    assert {e["name"]: e["action"] for e in report["entries"]} == {
        "step_000000006/data-00000000000000bb/": "kept",
        "step_000000009/data-00000000000000aa/": "kept",
    }
    assert {o.key for s in tier.scan() for o in s.objects} == before

    code, out, err = cli(capsys, "gc", url, "--grace", "0s", "--dry-run")
    assert code == 0, err
    assert "would remove 2 entries (2 objects), 150 B to free; 2 committed steps untouched" in out
    assert {o.key for s in tier.scan() for o in s.objects} == before

    code, out, err = cli(capsys, "gc", url, "--grace", "0s", "--json")
    assert code == 0, err
    report = json.loads(out)
    kinds = {e["name"]: (e["kind"], e["action"]) for e in report["entries"]}
    assert kinds == {
        "step_000000006/data-00000000000000bb/": ("unreferenced", "removed"),
        "step_000000009/data-00000000000000aa/": ("incomplete", "removed"),
    }
    assert report["bytes_freed"] == 150 and report["objects_removed"] == 2
    assert {o.key for s in tier.scan() for o in s.objects} == before - {INCOMPLETE, STRAY}
    assert tier.committed_steps() == [4, 6]
    for step in (4, 6):
        verify_durable(tier, step, tmp_path)

    code, out, _err = cli(capsys, "gc", url, "--grace", "0s")
    assert code == 0
    assert "removed 0 entries (0 objects), 0 B freed; 2 committed steps untouched" in out


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_a_missing_bucket_is_a_one_line_usage_error(capsys, s3_env, command):
    code, out, err = cli(capsys, command, "s3://no-such-bucket-here/exp")
    assert code == 2 and out == ""
    assert_one_line_error(err, "s3://no-such-bucket-here/exp", "404", "check the bucket")


def test_wrong_credentials_are_a_usage_error_that_does_not_print_them(
    capsys, s3_env, s3_bucket, monkeypatch
):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-right-secret-0123456789")
    code, _out, err = cli(capsys, "ls", f"s3://{s3_bucket}/exp")
    assert code == 2
    assert_one_line_error(err, "403", "credentials")
    assert "not-the-right-secret-0123456789" not in err
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["ls", "--verify"], "--verify checksums local files"),
        (["gc", "--force"], "--force applies to a run directory"),
        (["gc", "--corrupt"], "--corrupt applies to a run directory"),
    ],
)
def test_options_that_mean_nothing_for_a_url_are_refused(capsys, s3_env, s3_bucket, argv, fragment):
    code, _out, err = cli(capsys, argv[0], f"s3://{s3_bucket}/exp", *argv[1:])
    assert code == 2
    assert_one_line_error(err, fragment)
