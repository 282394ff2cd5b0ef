"""`stalwart restore-test`: a checkpoint restores into a freshly built model and runs.

Runs are made with the public API; the factory is a real module written into
tmp_path; corruption is injected by editing files on disk. One case runs the
installed script as a real process while the test holds the run's lock.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import stalwart

from .conftest import assert_one_line_error, flip_byte
from .conftest import cli as run_cli

FACTORY = """\
import torch

HIDDEN = {hidden}


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def build():
    torch.manual_seed(1)  # not the training init: only a real load gives the saved loss
    model = torch.nn.Sequential(
        torch.nn.Linear(4, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(123)
    batch = (torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
    return {{"model": model, "optimizer": optimizer, "extra": {{"epoch": 0}}, "batch": batch,
            "loss_fn": loss_fn}}


def broken():
    raise RuntimeError("dataset path /data/x is not mounted")


def not_a_dict():
    return 42
"""


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def make_run(run: Path, *, poison: bool = False) -> Path:
    """Steps 10 and 20 of an MLP + AdamW; metrics: training ``loss`` and ``val_loss`` on the fixed batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"epoch": 0}
    state = stalwart.TrainState(model=model, optimizer=opt, extra=extra)
    x_val, y_val = fixed_batch()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        for step in range(1, 21):
            x, y = torch.randn(16, 4), torch.randn(16, 2)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 0:
                if poison:
                    with torch.no_grad():
                        model[2].bias[0] = float("nan")
                with torch.no_grad():
                    val = torch.nn.functional.mse_loss(model(x_val), y_val)
                ckpt.save(step, state, metrics={"loss": loss.item(), "val_loss": val.item()})
    return run


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("pristine") / "run")


@pytest.fixture
def run(pristine_run: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine run, free to damage."""
    return Path(shutil.copytree(pristine_run, tmp_path / "run", symlinks=True))


def write_factory(directory: Path, name: str = "train_factory", *, hidden: int = 8) -> Path:
    path = directory / f"{name}.py"
    path.write_text(FACTORY.format(hidden=hidden))
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    return run_cli(capsys, "restore-test", *argv)


def checks(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


# ----------------------------------------------------------------------- passing


def test_newest_checkpoint_passes_and_json_reports_every_check(capsys, pristine_run, tmp_path):
    factory = write_factory(tmp_path)
    code, out, err = cli(capsys, pristine_run, "--build", f"{factory}:build", "--json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["ok"] is True
    assert report["step"] == 20
    assert report["path"].endswith("step_000000020")
    assert [c["name"] for c in report["checks"]] == [
        "build",
        "load",
        "finite",
        "forward",
        "metric",
        "train_step",
    ]
    assert checks(report) == {
        "build": "pass",
        "load": "pass",
        "finite": "pass",
        "forward": "pass",
        "metric": "info",  # the training loss of another batch: reported, not enforced
        "train_step": "skip",
    }
    assert all(isinstance(c["seconds"], float) for c in report["checks"] if c["status"] != "skip")
    assert isinstance(report["loss"], float)
    assert report["metric"]["name"] == "loss" and report["metric"]["enforced"] is False


def test_restored_loss_matches_the_metric_saved_with_the_checkpoint(capsys, pristine_run, tmp_path):
    """The factory's own init gives another loss, so a match proves the weights were loaded."""
    factory = write_factory(tmp_path)
    for step in ("10", "20"):
        code, out, err = cli(
            capsys,
            pristine_run,
            "--build",
            f"{factory}:build",
            "--step",
            step,
            "--expect-metric",
            "val_loss",
            "--rtol",
            "1e-6",
        )
        assert code == 0, out + err
        assert f"PASS: step {step}" in out


def test_expect_metric_fails_when_the_loss_differs(capsys, pristine_run, tmp_path):
    factory = write_factory(tmp_path)
    code, out, _ = cli(
        capsys, pristine_run, "--build", f"{factory}:build", "--expect-metric", "loss", "--json"
    )
    assert code == 1
    report = json.loads(out)
    assert checks(report)["metric"] == "fail"
    assert report["metric"]["close"] is False and report["metric"]["enforced"] is True


def test_train_step_runs_one_optimizer_step(capsys, pristine_run, tmp_path):
    factory = write_factory(tmp_path)
    code, out, err = cli(
        capsys, pristine_run, "--build", f"{factory}:build", "--train-step", "--json"
    )
    assert code == 0, out + err
    report = json.loads(out)
    assert checks(report)["train_step"] == "pass"
    assert "parameters finite" in report["checks"][-1]["detail"]


def test_module_spec_is_imported_from_path(capsys, pristine_run, tmp_path):
    write_factory(tmp_path, "factory_from_path")
    code, out, err = cli(
        capsys, pristine_run, "--build", "factory_from_path:build", "--path", tmp_path
    )
    assert code == 0, out + err
    assert str(tmp_path.resolve()) not in sys.path, "sys.path is left as it was"


def test_a_file_factory_imports_from_path_while_building(capsys, pristine_run, tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "spec").mkdir()
    write_factory(tmp_path / "lib", "restore_test_helper_mod")
    outer = tmp_path / "spec" / "outer.py"
    outer.write_text(
        "def build():\n    import restore_test_helper_mod\n\n    return restore_test_helper_mod.build()\n"
    )
    code, out, err = cli(
        capsys, pristine_run, "--build", f"{outer}:build", "--path", tmp_path / "lib"
    )
    assert code == 0, out + err
    assert str((tmp_path / "lib").resolve()) not in sys.path, "sys.path is left as it was"


# ----------------------------------------------------------------------- the checkpoint fails


def test_a_model_of_another_shape_is_a_mismatch_naming_the_tensors(capsys, pristine_run, tmp_path):
    factory = write_factory(tmp_path, hidden=16)
    code, out, err = cli(capsys, pristine_run, "--build", f"{factory}:build", "--json")
    assert code == 1, err
    report = json.loads(out)
    assert report["ok"] is False
    load = report["checks"][1]
    assert load["name"] == "load" and load["status"] == "fail"
    assert "StateMismatchError" in load["detail"]
    assert "0.weight: checkpoint [8, 4], model [16, 4]" in load["detail"]
    assert checks(report)["forward"] == "skip"


def test_a_corrupt_file_fails_naming_the_file(capsys, run, tmp_path):
    data_file = run / "step_000000020" / "__0_0.distcp"
    flip_byte(data_file)
    factory = write_factory(tmp_path)
    code, out, _ = cli(capsys, run, "--build", f"{factory}:build")
    assert code == 1
    assert "FAIL: load" in out
    assert "__0_0.distcp: checksum mismatch" in out
    # Read-only: a restore test never moves a bad checkpoint aside, unlike restore.
    assert data_file.exists()


def test_non_finite_weights_fail(capsys, tmp_path):
    run = make_run(tmp_path / "nan_run", poison=True)
    factory = write_factory(tmp_path)
    code, out, _ = cli(capsys, run, "--build", f"{factory}:build", "--json")
    assert code == 1
    report = json.loads(out)
    assert checks(report)["finite"] == "fail"
    assert "model.2.bias" in report["checks"][2]["detail"]


# ----------------------------------------------------------------------- usage errors


def test_a_factory_that_raises_is_a_usage_error_showing_its_message(capsys, pristine_run, tmp_path):
    factory = write_factory(tmp_path)
    code, out, err = cli(capsys, pristine_run, "--build", f"{factory}:broken")
    assert code == 2
    assert out == ""
    assert_one_line_error(
        err, "RuntimeError: dataset path /data/x is not mounted", "train_factory.py:"
    )


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("train_factory", "expected MODULE:FUNCTION"),
        ("no_such_module_xyz:build", "no module named 'no_such_module_xyz'"),
        ("{dir}/train_factory.py:nope", "has no attribute 'nope'"),
        ("{dir}/missing.py:build", "no such file"),
        ("{dir}/train_factory.py:not_a_dict", "returned a int"),
    ],
)
def test_bad_build_specs_are_usage_errors(capsys, pristine_run, tmp_path, spec, fragment):
    write_factory(tmp_path)
    code, _out, err = cli(capsys, pristine_run, "--build", spec.format(dir=tmp_path))
    assert code == 2
    assert_one_line_error(err, fragment)


@pytest.mark.parametrize("flag", ["--rtol", "--atol"])
def test_a_negative_tolerance_is_a_usage_error(capsys, pristine_run, tmp_path, flag):
    factory = write_factory(tmp_path)
    code, _out, err = cli(capsys, pristine_run, "--build", f"{factory}:build", flag, "-0.1")
    assert code == 2
    assert flag in err and "'-0.1' must be a finite number >= 0" in err


def test_missing_run_is_a_usage_error(capsys, tmp_path):
    factory = write_factory(tmp_path)
    code, _out, err = cli(capsys, tmp_path / "nope", "--build", f"{factory}:build")
    assert code == 2
    assert_one_line_error(err, "no such file or directory")


def test_unknown_step_is_a_usage_error(capsys, pristine_run, tmp_path):
    factory = write_factory(tmp_path)
    code, _out, err = cli(capsys, pristine_run, "--build", f"{factory}:build", "--step", "15")
    assert code == 2
    assert_one_line_error(err, "no checkpoint of step 15", "10, 20")


# ----------------------------------------------------------------------- beside training


def test_runs_as_a_real_process_while_training_holds_the_run_lock(run, tmp_path):
    script = Path(sys.executable).with_name("stalwart")
    assert script.exists(), f"no console script at {script}: make installs the package with pip"
    write_factory(tmp_path)
    with stalwart.CheckpointManager(run, handle_signals=False):
        with pytest.raises(stalwart.RunLockedError):
            stalwart.CheckpointManager(run, handle_signals=False)
        events = (run / "events.jsonl").read_bytes()
        before = sorted(p.name for p in run.iterdir())
        proc = subprocess.run(
            [str(script), "restore-test", str(run), "--build", "train_factory:build", "--json"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.loads(proc.stdout)["step"] == 20
        assert sorted(p.name for p in run.iterdir()) == before
        assert (run / "events.jsonl").read_bytes() == events, "restore-test must not write the run"


def test_help_documents_the_factory_contract(capsys):
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    out = textwrap.dedent(out)
    for fragment in (
        "FACTORY CONTRACT",
        "loss_fn(model, batch)",
        "--expect-metric",
        "--train-step",
    ):
        assert fragment in out
