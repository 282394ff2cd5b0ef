"""Several modules and optimizers in one TrainState: every form saved through DCP, or refused.

A GAN (generator, discriminator, their optimizers, an EMA copy) in each form a
user may write it; each form must come back exactly, keep DCP's FQN keys, and a
form that cannot be saved correctly must be refused when the state is built.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

import stalwart
from stalwart.safe_load import read_dcp_metadata
from stalwart.state import flat_keys

from .conftest import assert_same


def nets() -> dict[str, Any]:
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    d = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 1))
    return {
        "G": g,
        "D": d,
        "optG": torch.optim.Adam(g.parameters(), lr=1e-2),
        "optD": torch.optim.Adam(d.parameters(), lr=1e-2),
        "ema": copy.deepcopy(g).requires_grad_(False),
    }


def train(n: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        fake = n["G"](torch.randn(4, 3))
        n["optD"].zero_grad()
        n["D"](fake.detach()).mean().backward()
        n["optD"].step()
        n["optG"].zero_grad()
        (-n["D"](fake).mean()).backward()
        n["optG"].step()
        with torch.no_grad():
            for e, p in zip(n["ema"].parameters(), n["G"].parameters(), strict=True):
                e.lerp_(p, 0.1)
            for e, b in zip(n["ema"].buffers(), n["G"].buffers(), strict=True):
                e.copy_(b)


def tensors(n: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the run: weights, buffers, EMA and both optimizers' states."""
    out: dict[str, Any] = {}
    for name in ("G", "D", "ema"):
        out[name] = {k: v.clone() for k, v in n[name].state_dict().items()}
    for name in ("optG", "optD"):
        out[name] = copy.deepcopy(n[name].state_dict())
    return out


FORMS = {
    "dicts": lambda n: stalwart.TrainState(
        model={"G": n["G"], "D": n["D"]}, optimizer={"G": n["optG"], "D": n["optD"]}, ema=n["ema"]
    ),
    "dict-and-list": lambda n: stalwart.TrainState(
        model={"G": n["G"], "D": n["D"]}, optimizer=[n["optD"], n["optG"]], ema=n["ema"]
    ),
    "keywords": lambda n: stalwart.TrainState(
        model=n["G"], optimizer=n["optG"], netD=n["D"], optD=n["optD"], ema=n["ema"]
    ),
    "module-dict": lambda n: stalwart.TrainState(
        model=torch.nn.ModuleDict({"G": n["G"], "D": n["D"]}),
        optimizer=[n["optG"], n["optD"]],
        ema=n["ema"],
    ),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_of_a_gan_restores_every_tensor(tmp_path: Path, form: str) -> None:
    n = nets()
    train(n, 3)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        ckpt.save(3, FORMS[form](n))
        saved = tensors(n)
        train(n, 2)  # the live objects move on
        with pytest.raises(AssertionError):
            assert_same(saved, tensors(n))
        fresh = nets()  # a new process: fresh modules and optimizers
        assert ckpt.restore(FORMS[form](fresh)) == 3
    assert_same(saved, tensors(fresh))


def test_keyword_modules_and_optimizers_are_saved_as_tensors_with_their_fqns(
    tmp_path: Path,
) -> None:
    n = nets()
    train(n, 1)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        ckpt.save(1, FORMS["keywords"](n))
    md = read_dcp_metadata(tmp_path / "run" / "step_000000001").state_dict_metadata
    for key in ("ema.1.running_mean", "netD.0.weight", "optD.state.0.weight.exp_avg"):
        assert isinstance(md.get(key), TensorStorageMetadata), key


def test_named_collections_keep_dcp_keys_under_the_module_name(tmp_path: Path) -> None:
    n = nets()
    train(n, 1)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        ckpt.save(1, FORMS["dict-and-list"](n))
    keys = set(read_dcp_metadata(tmp_path / "run" / "step_000000001").state_dict_metadata)
    _, optim_g = get_state_dict(n["G"], n["optG"])
    assert flat_keys(optim_g, "optimizer.G") <= keys  # matched by parameters, not list order
    assert "model.D.1.running_var" in keys and "optimizer.D.state.0.weight.exp_avg" in keys


def test_single_model_form_keeps_its_keys(tmp_path: Path) -> None:
    """Checkpoints of model=net, optimizer=opt keep the keys older versions wrote."""
    n = nets()
    train(n, 1)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        ckpt.save(1, stalwart.TrainState(model=n["G"], optimizer=n["optG"], rng=False))
    keys = set(read_dcp_metadata(tmp_path / "run" / "step_000000001").state_dict_metadata)
    model_sd, optim_sd = get_state_dict(n["G"], n["optG"])
    want = flat_keys(model_sd, "model") | flat_keys(optim_sd, "optimizer")
    assert keys - {"_stalwart"} == want


def test_optimizer_of_a_module_not_in_the_state_is_refused_at_construction() -> None:
    n = nets()
    with pytest.raises(ValueError, match=r"optimizer\[1\] updates parameters.*model=\{'G'"):
        stalwart.TrainState(model=n["G"], optimizer=[n["optG"], n["optD"]])


def test_optimizer_over_two_modules_points_to_module_dict() -> None:
    n = nets()
    both = torch.optim.SGD([*n["G"].parameters(), *n["D"].parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"one nn\.ModuleDict"):
        stalwart.TrainState(model={"G": n["G"], "D": n["D"]}, optimizer=[both])


def test_optimizer_of_a_keyword_module_must_be_a_keyword_too() -> None:
    n = nets()
    with pytest.raises(ValueError, match=r"netD=; pass this optimizer by keyword"):
        stalwart.TrainState(model=n["G"], optimizer=[n["optG"], n["optD"]], netD=n["D"])


def test_model_of_another_type_shows_the_supported_forms() -> None:
    with pytest.raises(TypeError, match=r"supported forms: .*model=\{'G': netG"):
        stalwart.TrainState(model=[nets()["G"]])


class Breaks:
    def state_dict(self) -> dict:
        return {"x": 1}

    def load_state_dict(self, sd: dict) -> None:
        raise RuntimeError("size mismatch for weight")


def test_component_failing_to_load_raises_a_state_mismatch(tmp_path: Path) -> None:
    """The same error every rank gets (see tests/distributed/test_multimodel.py)."""
    n = nets()
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        ckpt.save(1, stalwart.TrainState(model=n["G"], thing=Breaks()))
        with pytest.raises(stalwart.StateMismatchError, match="RuntimeError: size mismatch"):
            ckpt.restore(stalwart.TrainState(model=n["G"], thing=Breaks()))


def test_module_in_extra_is_refused_with_the_keyword_form(tmp_path: Path) -> None:
    n = nets()
    state = stalwart.TrainState(model=n["G"], extra={"ema": n["ema"]})
    with (
        stalwart.CheckpointManager(tmp_path / "run") as ckpt,
        pytest.raises(TypeError, match=r"\['ema'\] is a Sequential; pass modules .* by keyword"),
    ):
        ckpt.save(1, state)


def test_module_state_dict_in_extra_warns_that_it_is_not_loaded_into_the_module(
    caplog: pytest.LogCaptureFixture,
) -> None:
    n = nets()
    with caplog.at_level("WARNING", logger="stalwart"):
        stalwart.TrainState(model=n["G"], extra={"ema": n["ema"].state_dict(), "epoch": 0})
    assert "extra['ema'] looks like a module's state_dict()" in caplog.text
    assert "epoch" not in caplog.text


REPO = Path(__file__).resolve().parents[1]


def run_python(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )


def test_runnable_examples_of_the_multi_model_guide_run_and_resume(tmp_path: Path) -> None:
    text = (REPO / "docs" / "multi-model.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "import " in b]
    assert blocks
    for i, block in enumerate(blocks):
        (tmp_path / f"block{i}.py").write_text(block)
        for _ in range(2):  # the second run restores what the first saved
            proc = run_python(tmp_path, f"block{i}.py")
            assert proc.returncode == 0, proc.stderr[-3000:]


def test_gan_example_runs_in_one_process_and_resumes(tmp_path: Path) -> None:
    gan = str(REPO / "examples" / "gan.py")
    first = run_python(tmp_path, gan, "--run-dir", "run", "--steps", "6", "--every", "3")
    assert first.returncode == 0 and "rank 0 start 0" in first.stdout, first.stderr[-3000:]
    again = run_python(tmp_path, gan, "--run-dir", "run", "--steps", "8", "--every", "3")
    assert again.returncode == 0 and "rank 0 start 6" in again.stdout, again.stderr[-3000:]
