"""The exact-resume certificate in one process: fingerprints, verdicts, the log, ls and report."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import stalwart
from stalwart import certificate
from stalwart.certificate import Fingerprint, compare, read_attempt, rng_digest
from stalwart.cli.timeline import read_run, summarize
from stalwart.events import read_events

from .conftest import cli, make_parts, seed_all


def step(parts, data_iter=None) -> float:
    """One training step that draws from every global RNG; returns its loss."""
    x = torch.randn(16, 4) if data_iter is None else next(data_iter)[0]
    loss = parts.model(torch.nn.functional.dropout(x, 0.2)).pow(2).mean()
    parts.optimizer.zero_grad()
    loss.backward()
    parts.optimizer.step()
    random.random()
    np.random.rand()
    return float(loss.detach())


def crash_and_resume(run: Path, *, extra_draw: bool = False, loader_kwargs=None) -> list[dict]:
    """Train 7 steps saving at 5 (the "lost" attempt), then resume at 5 and redo 6..8."""
    loader = None
    if loader_kwargs is not None:
        data = torch.utils.data.TensorDataset(torch.randn(200, 4))
        loader = stalwart.ResumableDataLoader(data, batch_size=8, shuffle=True, seed=3)
    seed_all(0)
    parts = make_parts(data=loader)
    it = None if loader is None else loader.forever()
    with stalwart.CheckpointManager(run, every_steps=5) as ckpt:
        for s in range(7):
            ckpt.save(s + 1, parts.state, metrics={"loss": step(parts, it), "time_s": s * 0.1})
    seed_all(123)  # a new process: other generator states until the restore
    parts = make_parts(data=loader)
    with stalwart.CheckpointManager(run, every_steps=5) as ckpt:
        assert ckpt.restore(parts.state) == 5
        it = None if loader is None else loader.forever()
        if extra_draw:
            torch.rand(1)  # a draw the checkpoint does not hold (a prefetched batch)
        if loader_kwargs and loader_kwargs.get("skip"):
            next(it)  # a batch consumed and thrown away: the data position moves on
        for s in range(5, 8):
            ckpt.save(s + 1, parts.state, metrics={"loss": step(parts, it), "time_s": 9.0})
            if s + 1 == 7:
                assert ckpt.resume_verdict is not None
    return [e for e in read_events(run) if e["event"].startswith("resume_")]


def test_rng_digest_changes_with_every_generator_and_only_then() -> None:
    before = rng_digest()
    assert rng_digest() == before
    for draw in (lambda: torch.rand(1), random.random, np.random.rand):
        draw()
        after = rng_digest()
        assert after != before
        before = after


def test_resume_redoing_the_same_steps_is_verified(tmp_path: Path) -> None:
    (verdict,) = crash_and_resume(tmp_path / "run")
    assert verdict["event"] == "resume_verified"
    assert (verdict["restored_step"], verdict["through"]) == (5, 7)
    assert verdict["message"] == "resume verified exact through step 7 on 1 rank"


def test_a_draw_the_checkpoint_does_not_hold_is_diverged_with_rng_different(
    tmp_path: Path,
) -> None:
    (verdict,) = crash_and_resume(tmp_path / "run", extra_draw=True)
    assert verdict["event"] == "resume_diverged"
    assert (verdict["step"], verdict["rank"], verdict["rng"]) == (6, 0, "different")
    assert verdict["metric"] == "loss" and verdict["before"] != verdict["after"]
    assert "drew from the RNG" in verdict["message"]


def test_data_through_the_loader_is_fingerprinted(tmp_path: Path) -> None:
    (verdict,) = crash_and_resume(tmp_path / "run", loader_kwargs={})
    assert verdict["event"] == "resume_verified"
    records = read_attempt(*_first_attempt(tmp_path / "run"))[1]
    assert all(fp.batch is not None and fp.content is not None for fp in records)


def test_a_skipped_batch_is_diverged_with_batch_different(tmp_path: Path) -> None:
    (verdict,) = crash_and_resume(tmp_path / "run", loader_kwargs={"skip": True})
    assert verdict["event"] == "resume_diverged"
    assert (verdict["step"], verdict["batch"]) == (6, "different")
    assert "consumed other data" in verdict["message"]


def _first_attempt(run: Path) -> tuple[Path, str]:
    folder = run / certificate.FINGERPRINT_DIR / "rank-00000"
    return folder, sorted(p.name.split(".")[0] for p in folder.iterdir())[0]


def test_compare_names_the_likely_cause() -> None:
    a = Fingerprint(step=3, losses={"loss": 1.0}, rng="r1", batch="b1", content="c1")
    assert compare(a, a, rank=0) is None
    rng = compare(a, Fingerprint(3, {"loss": 1.0}, "r2", "b1", "c1"), rank=1)
    assert rng is not None and (rng.rank, rng.batch, rng.rng, rng.metric) == (
        1,
        "same",
        "different",
        None,
    )
    batch = compare(a, Fingerprint(3, {"loss": 2.0}, "r2", "b2", "c2"), rank=0)
    assert batch is not None and batch.batch == "different" and "data position" in batch.cause
    loss = compare(a, Fingerprint(3, {"loss": 2.0}, "r1", "b1", "c1"), rank=0)
    assert loss is not None and "nondeterministic" in loss.cause
    assert loss.line().startswith(
        "resume diverged at step 3 on rank 0: loss 1.0 vs 2.0; batch same; RNG same"
    )


def test_a_resume_with_nothing_to_compare_is_unverified(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run) as ckpt:
        ckpt.save(1, parts.state)
    with stalwart.CheckpointManager(run) as ckpt:
        assert ckpt.restore(parts.state) == 1
        ckpt.save(2, parts.state)
        assert ckpt.resume_verdict is not None
        assert ckpt.resume_verdict.event == "resume_unverified"
    (verdict,) = [e for e in read_events(run) if e["event"].startswith("resume_")]
    assert "no earlier attempt recorded a step after step 1" in verdict["reason"]


def test_the_restore_event_no_longer_claims_exactness(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run) as ckpt:
        ckpt.save(1, parts.state)
        ckpt.restore(parts.state)
    (restore,) = [e for e in read_events(run) if e["event"] == "restore"]
    assert restore["same_world_size"] is True and "exact" not in restore


def test_a_failed_restore_is_an_event(tmp_path: Path) -> None:
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run) as ckpt:
        ckpt.save(1, parts.state)
        with pytest.raises(stalwart.CheckpointNotFoundError):
            ckpt.restore(parts.state, step=7)
    (failed,) = [e for e in read_events(run) if e["event"] == "restore_failed"]
    assert failed["step"] == 7 and "no committed checkpoint of step 7" in failed["error"]


def test_the_fingerprint_log_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(certificate, "MAX_RECORDS", 10)
    parts = make_parts()
    with stalwart.CheckpointManager(tmp_path / "run", every_steps=1000) as ckpt:
        for s in range(1, 36):
            ckpt.save(s, parts.state)
    folder, name = _first_attempt(tmp_path / "run")
    lines = [len(p.read_text().splitlines()) for p in folder.iterdir()]
    assert len(lines) == 2 and max(lines) <= 11  # this segment and the previous one, + headers
    header, records = read_attempt(folder, name)
    assert header is not None and header["world_size"] == 1
    assert [fp.step for fp in records] == list(range(21, 36))


def test_only_the_newest_attempts_are_kept(tmp_path: Path) -> None:
    parts = make_parts()
    for s in range(1, certificate.KEEP_ATTEMPTS + 4):
        with stalwart.CheckpointManager(tmp_path / "run", every_steps=1000) as ckpt:
            ckpt.save(s, parts.state)
    folder = tmp_path / "run" / certificate.FINGERPRINT_DIR / "rank-00000"
    assert len(list(folder.iterdir())) == certificate.KEEP_ATTEMPTS


def test_ls_and_report_show_the_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    crash_and_resume(run, extra_draw=True)
    code, out, _ = cli(capsys, "ls", run)
    assert code == 0
    assert "DIVERGED at 6 (rank 0)" in out
    assert "restored step 5: resume diverged at step 6 on rank 0" in out
    code, out, _ = cli(capsys, "ls", run, "--json")
    (row,) = [r for r in json.loads(out)["entries"] if r["step"] == 5]
    assert row["resume"]["verdict"] == "resume_diverged"
    (restore,) = summarize(read_run(run))["restores"]
    assert restore["resume"] == "DIVERGED at 6 (rank 0)" and restore["same_world_size"] is True


def test_ls_and_report_read_old_restore_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An events.jsonl written before the certificate: ``exact`` meant same world size."""
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run) as ckpt:
        ckpt.save(1, parts.state)
    old = {"time": 1.0e9, "event": "restore", "rank": 0, "step": 1, "seconds": 0.1, "exact": True}
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps(old) + "\n")
    code, out, _ = cli(capsys, "ls", run)
    assert code == 0 and "unchecked" in out
    (restore,) = summarize(read_run(run))["restores"]
    assert restore["same_world_size"] is True and restore["resume"] == "unchecked"


def test_crafted_fingerprint_logs_are_ignored_without_hanging(tmp_path: Path) -> None:
    """The run directory is input from outside: a FIFO, a symlink, a garbled log."""
    run = tmp_path / "run"
    parts = make_parts()
    with stalwart.CheckpointManager(run) as ckpt:
        ckpt.save(1, parts.state)
    folder = run / certificate.FINGERPRINT_DIR / "rank-00000"
    os.mkfifo(folder / "00000000000000000001-1.jsonl")
    (folder / "00000000000000000002-1.jsonl").symlink_to("/etc/passwd")
    (folder / "00000000000000000003-1.jsonl").write_text('{"step": 5, "losses": 3}\n[1]\n\x00\n')
    with stalwart.CheckpointManager(run) as ckpt:
        assert ckpt.restore(parts.state) == 1
        ckpt.save(2, parts.state)
        assert ckpt.resume_verdict is not None
        assert ckpt.resume_verdict.event == "resume_unverified"


def test_a_resume_that_saves_at_other_steps_settles_past_the_lost_attempts_end(
    tmp_path: Path,
) -> None:
    """The lost attempt called save at 6 and 7; the resumed run only at 6 and 8."""
    run = tmp_path / "run"
    seed_all(0)
    parts = make_parts()
    with stalwart.CheckpointManager(run, every_steps=5) as ckpt:
        for s in range(7):
            ckpt.save(s + 1, parts.state, metrics={"loss": step(parts)})
    parts = make_parts()
    with stalwart.CheckpointManager(run, every_steps=5) as ckpt:
        assert ckpt.restore(parts.state) == 5
        ckpt.save(6, parts.state, metrics={"loss": step(parts)})
        assert ckpt.resume_verdict is None  # step 7 may still come
        step(parts)
        ckpt.save(8, parts.state, metrics={"loss": step(parts)})
        verdict = ckpt.resume_verdict
        assert verdict is not None and (verdict.event, verdict.through) == ("resume_verified", 6)


def test_a_sampler_given_as_data_is_fingerprinted_by_its_position() -> None:
    a = stalwart.ResumableSampler(50, seed=4)
    it = iter(a)
    for _ in range(5):
        next(it)
    b = stalwart.ResumableSampler(50, seed=4)
    b.load_state_dict(a.state_dict())
    assert certificate.data_digests(a) == certificate.data_digests(b)
    assert certificate.data_digests(a)[0] is not None
    next(it)
    assert certificate.data_digests(a) != certificate.data_digests(b)
