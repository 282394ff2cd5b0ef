"""The `stalwart` command on real runs made with the public API.

Most tests call ``main([...])`` in-process; two run the installed entry points as
real subprocesses. Corruption is injected by editing the files on disk.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stalwart

from .conftest import assert_one_line_error, cli, flip_byte

STAGING = ".step_000000030.tmp-abc123"


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with committed steps 10 and 20 of a Linear(4, 2) + Adam, and an abandoned save."""
    run = tmp_path_factory.mktemp("pristine") / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    state = stalwart.TrainState(model=model, optimizer=opt, extra={"epoch": 0})
    with stalwart.CheckpointManager(
        run, keep_last=None, metadata={"dataset_version": "v3"}, config={"lr": 0.001}
    ) as ckpt:
        for step, loss in ((10, 1.5), (20, 0.75)):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            ckpt.save(step, state, metrics={"loss": loss})
    (run / STAGING).mkdir()
    return run


@pytest.fixture
def run(pristine_run: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine run, free to damage."""
    return Path(shutil.copytree(pristine_run, tmp_path / "run", symlinks=True))


# ----------------------------------------------------------------------------- ls


def test_ls_shows_committed_steps_and_the_incomplete_staging_directory(capsys, run):
    code, out, err = cli(capsys, "ls", run)
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:2].isdigit()}
    assert "committed" in rows["10"] and "loss=1.5" in rows["10"]
    assert "committed" in rows["20"] and "loss=0.75" in rows["20"]
    assert "incomplete" in rows["30"]
    assert STAGING in out
    assert "newest committed step: 20; 2 committed, 1 incomplete, 0 corrupt" in out
    assert "\x1b[" not in out, "no colour codes when stdout is not a terminal"


def test_ls_json_has_steps_statuses_and_save_timings(capsys, run):
    code, out, _err = cli(capsys, "ls", run, "--json")
    assert code == 0
    report = json.loads(out)
    assert [(e["step"], e["status"], e["name"]) for e in report["entries"]] == [
        (10, "committed", "step_000000010"),
        (20, "committed", "step_000000020"),
        (30, "incomplete", STAGING),
    ]
    assert report["latest_step"] == 20
    assert report["counts"] == {"committed": 2, "incomplete": 1, "corrupt": 0}
    newest = report["entries"][1]
    assert newest["metrics"] == {"loss": 0.75}
    on_disk = [p for p in (run / "step_000000020").iterdir() if p.name != "MANIFEST.json"]
    assert newest["world_size"] == 1 and newest["epoch"] == 0 and newest["files"] == len(on_disk)
    assert len(on_disk) >= 2  # .metadata and at least one data file
    assert (
        newest["bytes"]
        == sum(p.stat().st_size for p in (run / "step_000000020").iterdir())
        - (run / "step_000000020" / "MANIFEST.json").stat().st_size
    )
    assert newest["timings"]["stall_s"] >= 0 and newest["timings"]["write_s"] > 0
    assert newest["checked"] == "size" and newest["problems"] == []
    assert report["entries"][2]["timings"] is None


def test_ls_size_check_marks_a_truncated_checkpoint_corrupt(capsys, run):
    data = run / "step_000000010" / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    code, out, _err = cli(capsys, "ls", run, "--json")
    assert code == 1
    report = json.loads(out)
    old = report["entries"][0]
    assert old["status"] == "corrupt"
    assert old["problems"][0]["file"] == "__0_0.distcp"
    assert "truncated" in old["problems"][0]["reason"]
    assert report["latest_step"] == 20


def test_ls_finds_a_flipped_byte_only_with_verify(capsys, run):
    flip_byte(run / "step_000000020" / "__0_0.distcp")
    code, out, _err = cli(capsys, "ls", run, "--json")
    assert code == 0
    assert json.loads(out)["entries"][1]["status"] == "committed"

    code, out, _err = cli(capsys, "ls", run, "--verify")
    assert code == 1
    assert "step_000000020/__0_0.distcp: checksum mismatch" in out
    assert "newest committed step: 10; 1 committed, 1 incomplete, 1 corrupt" in out


def test_ls_shows_a_checkpoint_that_restore_moved_aside_as_corrupt(capsys, run):
    flip_byte(run / "step_000000020" / "__0_0.distcp")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    state = stalwart.TrainState(model=model, optimizer=opt, extra={"epoch": 0})
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        assert ckpt.restore(state) == 10
    code, out, _err = cli(capsys, "ls", run, "--json")
    assert code == 0, "a checkpoint already moved aside is reported, not a failure"
    aside = [e for e in json.loads(out)["entries"] if e["step"] == 20]
    assert len(aside) == 1 and aside[0]["status"] == "corrupt"
    assert aside[0]["name"].startswith(".step_000000020.corrupt-")
    assert "checksum mismatch" in aside[0]["problems"][0]["reason"]


def test_ls_of_a_checkpoint_directory_is_a_usage_error(capsys, run):
    code, _out, err = cli(capsys, "ls", run / "step_000000010")
    assert code == 2
    assert_one_line_error(err, "is a checkpoint directory", "stalwart inspect")


# ------------------------------------------------------------------------ inspect


def test_inspect_shows_the_model_tensors_of_the_newest_checkpoint(capsys, run):
    code, out, err = cli(capsys, "inspect", run)
    assert code == 0, err
    assert f"checkpoint {run / 'step_000000020'}" in out
    lines = out.splitlines()
    weight = next(line for line in lines if line.split()[:1] == ["model.weight"])
    bias = next(line for line in lines if line.split()[:1] == ["model.bias"])
    assert "float32" in weight and "(2, 4)" in weight and "32 B" in weight
    assert "float32" in bias and "(2,)" in bias
    assert any(line.split()[:2] == ["step", "20"] for line in lines)
    assert "dataset_version=v3" in out and "loss=0.75" in out
    assert "__0_0.distcp" in out


def test_inspect_json_has_the_manifest_and_the_tensor_table(capsys, run):
    code, out, _err = cli(capsys, "inspect", run, "--step", "10", "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"path", "manifest", "tensors"}
    manifest = report["manifest"]
    assert manifest["step"] == 10 and manifest["world_size"] == 1 and manifest["epoch"] == 0
    assert manifest["metadata"] == {"dataset_version": "v3"}
    assert manifest["config"] == {"lr": 0.001} and len(manifest["config_hash"]) == 64
    assert manifest["metrics"] == {"loss": 1.5}
    assert manifest["versions"]["torch"] == torch.__version__
    on_disk = {p.name for p in (run / "step_000000010").iterdir()} - {"MANIFEST.json"}
    assert {f["path"] for f in manifest["files"]} == on_disk
    assert {".metadata", "__0_0.distcp"} <= on_disk
    tensors = {t["fqn"]: t for t in report["tensors"]}
    assert tensors["model.weight"] == {
        "fqn": "model.weight",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [2, 4],
        "nbytes": 32,
        "chunks": 1,
    }
    assert tensors["model.bias"]["shape"] == [2]
    assert tensors["optimizer.state.weight.exp_avg"]["shape"] == [2, 4]
    assert tensors["extra"]["kind"] == "bytes"  # a blob section: one entry


def test_inspect_of_a_checkpoint_directory_equals_inspect_of_its_step(capsys, run):
    _, by_dir, _ = cli(capsys, "inspect", run / "step_000000010", "--json")
    _, by_step, _ = cli(capsys, "inspect", run, "--step", "10", "--json")
    assert json.loads(by_dir)["tensors"] == json.loads(by_step)["tensors"]
    assert json.loads(by_dir)["manifest"] == json.loads(by_step)["manifest"]


def test_inspect_of_an_unknown_step_is_a_usage_error_listing_the_steps(capsys, run):
    code, out, err = cli(capsys, "inspect", run, "--step", "7")
    assert (code, out) == (2, "")
    assert_one_line_error(err, "no checkpoint of step 7", "committed steps: 10, 20")


def test_inspect_of_an_uncommitted_step_says_so(capsys, run):
    code, _out, err = cli(capsys, "inspect", run, "--step", "30")
    assert code == 2
    assert_one_line_error(err, "step 30", "not committed", STAGING)


def test_inspect_of_an_uncommitted_save_shows_its_tensors_and_warns(capsys, run):
    staging = run / ".step_000000040.tmp-0123abcd"
    shutil.copytree(run / "step_000000020", staging)
    (staging / "MANIFEST.json").unlink()
    code, out, err = cli(capsys, "inspect", staging, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["manifest"] is None
    assert "model.weight" in {t["fqn"] for t in report["tensors"]}
    assert "never committed" in err


def test_inspect_never_runs_code_from_a_crafted_metadata_file(capsys, run, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    (run / "step_000000020" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    code, out, err = cli(capsys, "inspect", run)
    assert not marker.exists()
    assert (code, out) == (1, "")
    assert_one_line_error(err, ".metadata", "refused")


# ------------------------------------------------------------------------- verify


def test_verify_of_a_good_run_exits_0_and_lists_what_it_skipped(capsys, run):
    code, out, err = cli(capsys, "verify", run)
    assert code == 0, out + err
    assert "all 2 checkpoints good" in out
    assert f"not verified: {STAGING} (incomplete)" in out


def test_verify_names_the_file_with_a_flipped_byte(capsys, run):
    flip_byte(run / "step_000000020" / "__0_0.distcp")
    code, out, _err = cli(capsys, "verify", run)
    assert code == 1
    assert f"{run / 'step_000000020' / '__0_0.distcp'}: checksum mismatch" in out
    assert "1 of 2 checkpoints CORRUPT" in out


def test_verify_json_reports_every_bad_file_of_each_checkpoint(capsys, run):
    flip_byte(run / "step_000000020" / "__0_0.distcp")
    flip_byte(run / "step_000000020" / ".metadata", offset=50)
    code, out, _err = cli(capsys, "verify", run, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False and report["kind"] == "run"
    by_step = {c["step"]: c for c in report["checkpoints"]}
    assert by_step[10]["ok"] is True and by_step[10]["problems"] == []
    assert by_step[20]["ok"] is False
    assert {p["file"] for p in by_step[20]["problems"]} == {"__0_0.distcp", ".metadata"}
    assert report["skipped"] == [
        {"name": STAGING, "path": str(run / STAGING), "step": 30, "status": "incomplete"}
    ]


def test_verify_catches_a_truncated_file(capsys, run):
    data = run / "step_000000010" / "__0_0.distcp"
    os.truncate(data, 10)
    code, out, _err = cli(capsys, "verify", run)
    assert code == 1
    assert f"{data}: size 10 bytes" in out and "truncated" in out


def test_verify_catches_an_edited_manifest(capsys, run):
    manifest = run / "step_000000020" / "MANIFEST.json"
    manifest.write_text(manifest.read_text().replace('"loss": 0.75', '"loss": 0.01'))
    code, out, _err = cli(capsys, "verify", run / "step_000000020")
    assert code == 1
    assert f"{manifest}: manifest checksum mismatch" in out


def test_verify_of_one_checkpoint_directory(capsys, run):
    code, out, _err = cli(capsys, "verify", run / "step_000000010", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["kind"] == "checkpoint"
    assert [(c["step"], c["ok"]) for c in report["checkpoints"]] == [(10, True)]


def test_verify_of_an_uncommitted_checkpoint_directory_fails(capsys, run):
    code, out, _err = cli(capsys, "verify", run / STAGING)
    assert code == 1
    assert "MANIFEST.json: missing: the checkpoint was never committed" in out


def test_verify_of_a_run_without_committed_checkpoints_fails(capsys, run):
    for step_dir in run.glob("step_*"):
        shutil.rmtree(step_dir)
    code, out, _err = cli(capsys, "verify", run)
    assert code == 1
    assert "no committed checkpoint to verify" in out


def test_verify_of_a_missing_path_exits_2_with_one_clear_line(capsys, tmp_path):
    missing = tmp_path / "nope"
    code, out, err = cli(capsys, "verify", missing)
    assert (code, out) == (2, "")
    assert_one_line_error(err, str(missing), "no such file or directory")


def test_verify_of_a_file_exits_2(capsys, run):
    code, out, err = cli(capsys, "verify", run / "events.jsonl")
    assert (code, out) == (2, "")
    assert_one_line_error(err, "is a file, not a directory")


def test_verify_of_a_directory_that_is_no_run_exits_2(capsys, tmp_path):
    code, _out, err = cli(capsys, "verify", tmp_path)
    assert code == 2
    assert_one_line_error(err, "neither a stalwart run directory")


# -------------------------------------------------------------------- the command


@pytest.mark.parametrize("command", ["ls", "inspect", "verify"])
def test_every_help_documents_the_exit_statuses(capsys, command):
    code, out, _err = cli(capsys, command, "--help")
    assert code == 0
    assert "exit status:" in out
    assert all(f"  {n}  " in out for n in (0, 1, 2))


def test_bad_arguments_exit_2(capsys):
    assert cli(capsys, "frobnicate")[0] == 2
    assert cli(capsys)[0] == 2
    assert cli(capsys, "inspect", ".", "--step", "ten")[0] == 2


def test_only_working_commands_are_registered(capsys):
    code, out, _err = cli(capsys, "--help")
    assert code == 0
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    assert listed[:3] == ["ls", "inspect", "verify"]
    assert {"launch", "plan", "gc", "diff", "export", "report", "restore-test"} <= set(listed)
    for unfinished in ("bench", "demo"):
        assert unfinished not in listed
        assert cli(capsys, unfinished)[0] == 2


def test_python_dash_m_stalwart_verify_runs_as_a_real_process(run):
    flip_byte(run / "step_000000020" / "__0_0.distcp")
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "verify", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "__0_0.distcp: checksum mismatch" in proc.stdout
    assert "\x1b[" not in proc.stdout + proc.stderr, "no colour or progress bar off a terminal"


def test_the_installed_stalwart_script_lists_a_run(run):
    script = Path(sys.executable).with_name("stalwart")
    assert script.exists(), f"no console script at {script}: make installs the package with pip"
    proc = subprocess.run(
        [str(script), "ls", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert [e["step"] for e in json.loads(proc.stdout)["entries"]] == [10, 20, 30]
