"""DeepSpeed through stalwart: committed, verified, bit-exact resumes, on CPU in real processes.

Each test trains a tiny model with a real DeepSpeed engine in a subprocess
(``deepspeed_worker.py``), alone or under torchrun with two gloo ranks, and
compares a resumed run with an uninterrupted one: per-step losses and final
weights must be equal, bit for bit.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from stalwart.errors import CheckpointCorruptError, UnsafeCheckpointError
from stalwart.manifest import FileEntry, Manifest, hash_file
from tests.conftest import flip_byte
from tests.support.interrupts import KILLED, RaiseAtCall, names_the_error, traced
from tests.support.torchrun import ok, starts, torchrun

pytest.importorskip("deepspeed", reason="the stalwart[deepspeed] extra is not installed")

WORKER = Path(__file__).parent / "deepspeed_worker.py"
SRC = Path(__file__).parents[2] / "src"


@pytest.fixture(autouse=True)
def deepspeed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build DeepSpeed's CPU extension once per environment, in the venv (about 30 s), not per run."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(SRC), path) if p))


def run(directory: Path, out: Path, *args: str, check: bool = True) -> str:
    """One single-process training run of the worker; its stdout."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--dir", str(directory), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def assert_resumed_exactly(resumed: Path, reference: Path, start: int) -> None:
    a, b = torch.load(resumed), torch.load(reference)
    assert a["start"] == start
    assert a["losses"] == {s: v for s, v in b["losses"].items() if s > start}
    assert a["weights"].keys() == b["weights"].keys()
    for name, tensor in b["weights"].items():
        assert torch.equal(a["weights"][name], tensor), name


def forge(step_dir: Path, name: str, payload: bytes) -> None:
    """Replace ``name`` with ``payload`` and rewrite the manifest to match: a crafted checkpoint."""
    (step_dir / name).write_bytes(payload)
    manifest = Manifest.from_json((step_dir / "MANIFEST.json").read_text())
    size, digest = hash_file(step_dir / name)
    assert name in {e.path for e in manifest.files}
    files = [
        dataclasses.replace(e, size=size, xxh3_128=digest) if e.path == name else e
        for e in manifest.files
    ]
    (step_dir / "MANIFEST.json").write_text(dataclasses.replace(manifest, files=files).to_json())


class RunsCode:
    """Unpickling this writes a file: proof that a checkpoint ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.mark.parametrize(
    ("stage", "damaged"),
    [(0, "mp_rank_00_model_states.pt"), (2, "zero_pp_rank_0_mp_rank_00_optim_states.pt")],
)
def test_a_damaged_newest_checkpoint_falls_back_and_resumes_bit_exactly(
    tmp_path: Path, stage: int, damaged: str
) -> None:
    """ZeRO 0 and 2, one process: every DeepSpeed file is in the manifest; a flipped byte
    in the newest checkpoint sends the resume to the step before, which replays exactly."""
    run(tmp_path / "run", tmp_path / "ref.pt", "--stage", str(stage), "--steps", "6")
    step6 = tmp_path / "run" / "step_000000006"
    listed = {e["path"] for e in json.loads((step6 / "MANIFEST.json").read_text())["files"]}
    assert {"mp_rank_00_model_states.pt", damaged} <= listed
    flip_byte(step6 / damaged, offset=200)

    out = run(tmp_path / "run", tmp_path / "resumed.pt", "--stage", str(stage), "--steps", "6")

    assert "rank 0 start 4" in out
    # Moved aside, never loaded (the resumed run then saved a new step 6).
    assert len(list((tmp_path / "run").glob(".step_000000006.corrupt-*"))) == 1
    assert_resumed_exactly(tmp_path / "resumed.pt", tmp_path / "ref.pt", start=4)


def test_a_crafted_pickle_with_a_matching_manifest_is_refused_and_never_run(
    tmp_path: Path,
) -> None:
    """ZeRO 3. Checksums cannot stop whoever writes the manifest too: the weights-only decode does."""
    run(tmp_path / "run", tmp_path / "ref.pt", "--stage", "3", "--steps", "6")
    marker = tmp_path / "ran"
    step6 = tmp_path / "run" / "step_000000006"
    buf = io.BytesIO()
    torch.save({"module": RunsCode(marker)}, buf)
    # ZeRO 3 names its model states per rank.
    forge(step6, "zero_pp_rank_0_mp_rank_00_model_states.pt", buf.getvalue())

    out = run(tmp_path / "run", tmp_path / "resumed.pt", "--stage", "3", "--steps", "6")

    assert not marker.exists()
    assert "rank 0 start 4" in out
    assert_resumed_exactly(tmp_path / "resumed.pt", tmp_path / "ref.pt", start=4)


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize("error", [KILLED, KeyboardInterrupt()], ids=["handler", "ctrl-c"])
def test_an_error_raised_into_a_files_decode_is_never_taken_for_damage(
    tmp_path: Path, error: BaseException
) -> None:
    """An error raised into the training thread at any call of the decode of a DeepSpeed
    file whose bytes matched their checksum (DataLoader's handler's RuntimeError, Ctrl-C):
    it comes out as itself or as a transient CheckpointCorruptError, never as the
    UnsafeCheckpointError that moves a good checkpoint aside; a crafted pickle still is."""
    from stalwart.integrations.deepspeed import _decode

    name = "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.arange(6.0)}, "global_steps": 3}, tmp_path / name)
    size, digest = hash_file(tmp_path / name)
    manifest = Manifest(step=3, files=[FileEntry(path=name, size=size, xxh3_128=digest)])
    counting = RaiseAtCall(0, error)
    assert traced(counting, lambda: _decode(tmp_path, manifest, name, "cpu")) is None
    assert counting.calls > 20, counting.calls  # torch.load's own calls are counted too
    for at in range(1, counting.calls + 1):
        trace = RaiseAtCall(at, error)
        outcome = traced(trace, lambda: _decode(tmp_path, manifest, name, "cpu"))
        if outcome is None:
            assert isinstance(error, Exception), trace.where  # a library's except took it
            continue
        assert names_the_error(outcome, trace.error), (trace.where, outcome)
        assert not isinstance(outcome, UnsafeCheckpointError), (trace.where, outcome)
        if isinstance(outcome, CheckpointCorruptError):
            assert outcome.transient, (trace.where, outcome)
        elif not isinstance(error, Exception):
            assert outcome is trace.error, (trace.where, outcome)
    buf = io.BytesIO()
    torch.save({"module": RunsCode(tmp_path / "ran")}, buf)
    (tmp_path / name).write_bytes(buf.getvalue())
    size, digest = hash_file(tmp_path / name)
    manifest = Manifest(step=3, files=[FileEntry(path=name, size=size, xxh3_128=digest)])
    with pytest.raises(UnsafeCheckpointError, match=r"refused by torch\.load"):
        _decode(tmp_path, manifest, name, "cpu")
    assert not (tmp_path / "ran").exists()


def killed_torchrun(tmp_path: Path, stage: int, *kill: str) -> subprocess.CompletedProcess[str]:
    """An uninterrupted two-rank reference run (``ref.pt``), then the same run with ``kill``
    (worker options) under torchrun with one restart (``resumed.pt``); the second's process."""
    common = ("--stage", str(stage), "--steps", "6")

    def launch(name: str, *extra: str, restarts: int = 0) -> subprocess.CompletedProcess[str]:
        directory, out = str(tmp_path / name), str(tmp_path / f"{name}.pt")
        return ok(torchrun(2, "--dir", directory, "--out", out, *common, *extra,
                           restarts=restarts, script=WORKER))  # fmt: skip

    launch("ref")
    return launch("resumed", *kill, restarts=1)


def test_torchrun_rank_killed_mid_run_resumes_bit_exactly(tmp_path: Path) -> None:
    """ZeRO 3 on two gloo ranks: rank 1 is SIGKILLed after step 5, torchrun restarts
    both, they resume from step 4 and end where an uninterrupted run ends."""
    proc = killed_torchrun(tmp_path, 3, "--kill-rank", "1", "--kill-after-step", "5")
    assert starts(proc) == [0, 0, 4, 4]
    assert_resumed_exactly(tmp_path / "resumed.pt", tmp_path / "ref.pt", start=4)


def test_torchrun_rank_killed_between_shard_writes_leaves_latest_on_a_committed_tag(
    tmp_path: Path,
) -> None:
    """ZeRO 1: rank 1 dies before writing its optimizer shard of step 6's save. Step 6
    never commits, ``latest`` still names step 4, and the restart replays from 4 exactly."""
    proc = killed_torchrun(tmp_path, 1, "--kill-rank", "1", "--kill-in-save", "6")
    assert "latest global_step4 committed [2, 4]" in proc.stdout
    assert starts(proc) == [0, 0, 4, 4]
    assert_resumed_exactly(tmp_path / "resumed.pt", tmp_path / "ref.pt", start=4)


def test_the_example_resumes_from_its_durable_copy_after_losing_its_disk(tmp_path: Path) -> None:
    """examples/deepspeed_resume.py: checkpoints are uploaded (file:// store), only the
    newest two are kept locally, and with the run directory gone it resumes from the store."""
    example = Path(__file__).parents[2] / "examples" / "deepspeed_resume.py"
    store = (tmp_path / "store").as_uri()

    def example_run(steps: int) -> str:
        proc = subprocess.run(
            [sys.executable, str(example), "--dir", str(tmp_path / "run"), "--durable", store,
             "--steps", str(steps), "--save-every", "2"],
            capture_output=True, text=True, timeout=240,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout

    assert "start 0" in example_run(6)
    assert sorted(p.name for p in (tmp_path / "run").glob("step_*")) == [
        "step_000000004",
        "step_000000006",
    ]
    uploaded = sorted(p.name for p in (tmp_path / "store").iterdir())
    assert "step_000000006" in uploaded
    shutil.rmtree(tmp_path / "run")

    out = example_run(8)

    assert "start 6" in out
    assert "step 8 loss" in out


def test_a_tag_must_name_its_step() -> None:
    from stalwart.integrations.deepspeed import step_of_tag

    assert step_of_tag("global_step12") == 12
    assert step_of_tag("40") == 40
    with pytest.raises(ValueError, match="'best' names no step"):
        step_of_tag("best")


def test_the_run_directory_must_be_local() -> None:
    from stalwart.integrations.deepspeed import DeepSpeedCheckpointer

    with pytest.raises(ValueError, match="give an object store as durable= instead"):
        DeepSpeedCheckpointer(object(), "s3://bucket/run")


@pytest.mark.parametrize(
    "tag", ["global_step-1", "../x", "global_step../3", "global_step１２", "", "12 ", "12\n"]
)
def test_a_tag_that_is_not_a_plain_step_is_refused(tag: str) -> None:
    from stalwart.integrations.deepspeed import step_of_tag

    with pytest.raises(ValueError, match="names no step"):
        step_of_tag(tag)


class FakeEngine:
    """The two methods ``DeepSpeedCheckpointer`` replaces, recording what reaches DeepSpeed."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def save_checkpoint(self, *args, **kwargs):
        self.calls.append(("save", args, kwargs))

    def load_checkpoint(self, *args, **kwargs):
        self.calls.append(("load", args, kwargs))
        return None, None


def test_a_client_state_a_load_would_refuse_is_refused_before_deepspeed_writes(
    tmp_path: Path,
) -> None:
    """torch.load(weights_only=True) refuses such an object at the next resume, which
    would skip every checkpoint saved with it: the save names the key instead."""
    from stalwart.integrations.deepspeed import DeepSpeedCheckpointer

    engine = FakeEngine()
    with DeepSpeedCheckpointer(engine, tmp_path) as ckpt:
        with pytest.raises(TypeError, match=r"\['client_state'\]\['sched'\] is a .*Path"):
            engine.save_checkpoint(tmp_path, client_state={"step": 3, "sched": tmp_path})
        assert engine.calls == []
        engine.save_checkpoint(tmp_path, tag="global_step3", client_state={"step": 3})
        assert engine.calls == [
            ("save", (tmp_path,), {"tag": "global_step3", "client_state": {"step": 3}})
        ]
        assert ckpt.deepspeed_save != engine.save_checkpoint


def test_loading_a_tag_that_was_never_committed_raises_not_found(tmp_path: Path) -> None:
    from stalwart.errors import CheckpointNotFoundError
    from stalwart.integrations.deepspeed import DeepSpeedCheckpointer

    engine = FakeEngine()
    with DeepSpeedCheckpointer(engine, tmp_path):
        assert engine.load_checkpoint(tmp_path) == (None, None)
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint of step 7"):
            engine.load_checkpoint(tmp_path, tag="global_step7")
        with pytest.raises(ValueError, match="names no step"):
            engine.load_checkpoint(tmp_path, tag="../global_step7")
        with pytest.raises(ValueError, match="pass that directory"):
            engine.load_checkpoint(tmp_path / "other")
    assert engine.calls == []  # DeepSpeed's own load never ran


def fake_save(ckpt, directory: Path, tag: str, files: dict[str, object]) -> None:
    """What DeepSpeed's save_checkpoint does through the checkpoint engine, in one process."""
    info = types.SimpleNamespace(tag=tag, save_dir=str(directory), save_latest=True)
    engine = ckpt.engine.checkpoint_engine
    engine.create(info)
    for name, value in files.items():
        engine.save(value, str(directory / tag / name))
    assert engine.commit(info)


def test_a_tag_picks_its_step_and_a_bad_one_raises_instead_of_falling_back(
    tmp_path: Path,
) -> None:
    """In one process without DeepSpeed: the files DeepSpeed hands the checkpoint engine are
    committed with a manifest, read back verified, and a crafted one is never unpickled."""
    from stalwart.errors import CheckpointCorruptError
    from stalwart.integrations.deepspeed import DeepSpeedCheckpointer

    marker = tmp_path / "ran"
    engine = FakeEngine()
    read: list[object] = []

    def deepspeed_load(load_dir, tag, **kwargs):
        read.append(engine.checkpoint_engine.load(os.path.join(load_dir, tag, "model.pt")))
        return os.path.join(load_dir, tag), {"client": 1}

    run_dir = tmp_path / "run"
    with DeepSpeedCheckpointer(engine, run_dir, keep_last=None) as ckpt:
        ckpt.deepspeed_load = deepspeed_load
        fake_save(ckpt, run_dir, "global_step2", {"model.pt": {"w": torch.ones(2)}})
        fake_save(ckpt, run_dir, "global_step4", {"model.pt": {"w": RunsCode(marker)}})
        assert sorted(
            p.name for p in run_dir.iterdir() if p.name.startswith(("step_", ".step"))
        ) == [
            "step_000000002",
            "step_000000004",
        ]

        with pytest.raises(
            CheckpointCorruptError, match=r"weights_only.*Unsupported global: GLOBAL exec"
        ):
            engine.load_checkpoint(run_dir, tag="global_step4")
        assert (run_dir / "step_000000004").is_dir()  # named explicitly: reported, kept
        assert read == []

        path, client = engine.load_checkpoint(run_dir)  # newest that verifies: step 2
        assert (path, client) == (str(run_dir / "step_000000002"), {"client": 1})
        assert torch.equal(read[0]["w"], torch.ones(2))
        assert len(list(run_dir.glob(".step_000000004.corrupt-*"))) == 1
    assert not marker.exists()


def test_a_step_refused_in_both_tiers_is_passed_over_not_downloaded_forever(
    tmp_path: Path,
) -> None:
    """The local copy of step 4 is refused and moved aside; the restore then offers the
    durable copy, refused too: the load goes on to step 2 instead of looping."""
    from stalwart.integrations.deepspeed import DeepSpeedCheckpointer

    run_dir, store = tmp_path / "run", (tmp_path / "store").as_uri()
    with DeepSpeedCheckpointer(FakeEngine(), run_dir, keep_last=None, durable=store) as ckpt:
        fake_save(ckpt, run_dir, "global_step2", {"model.pt": {"w": torch.ones(2)}})
        fake_save(ckpt, run_dir, "global_step4", {"model.pt": {"w": RunsCode(tmp_path / "ran")}})
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [
        "step_000000002",
        "step_000000004",
    ]

    engine = FakeEngine()
    with DeepSpeedCheckpointer(engine, run_dir, keep_last=None, durable=store) as ckpt:
        restores = []
        restore = ckpt.manager.restore

        def counted(*args, **kwargs):
            restores.append(kwargs.get("step"))
            assert len(restores) < 6, f"restored again and again: {restores}"
            return restore(*args, **kwargs)

        ckpt.manager.restore = counted
        assert engine.load_checkpoint(run_dir)[0] == str(run_dir / "step_000000002")
    assert engine.calls == [("load", (str(run_dir),), {"tag": "step_000000002"})]
    assert not (tmp_path / "ran").exists()
