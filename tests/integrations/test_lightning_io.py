"""StalwartCheckpointIO: commit, checksums, verified load with fallback, safe loading, rotation.

The ``test_lightning_*`` cases marked "ported" follow Lightning's own
``tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py`` and
``test_async_checkpoint.py`` (Lightning 2.6), run against this plugin.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("lightning")

from lightning.pytorch import Trainer  # after the importorskip
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from stalwart.errors import CheckpointCorruptError, CheckpointNotFoundError
from stalwart.integrations.lightning import StalwartCheckpointIO
from stalwart.pipeline import verify_checkpoint
from tests.conftest import flip_byte
from tests.hostile.harness import resign

pytestmark = [
    # Lightning's advice about workers, logging intervals and its own deprecations.
    pytest.mark.filterwarnings("ignore::UserWarning:lightning.*"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
]


def _checkpoint(step: int, value: float) -> dict[str, Any]:
    """A checkpoint dict shaped like Lightning's: tensors, nested plain data, int keys."""
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"layer.weight": torch.full((3, 2), value), "layer.bias": torch.zeros(3)},
        "optimizer_states": [
            {
                "state": {0: {"momentum_buffer": torch.ones(3, 2)}},
                "param_groups": [{"lr": 0.1, "params": [0, 1]}],
            }
        ],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {"best_model_path": "", "best_k_models": {}}
        },
        "hyper_parameters": {"lr": 0.1, "layers": (3, 2)},
    }


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]


def _data_file(ckpt: Path) -> Path:
    (step_dir,) = [p for p in ckpt.iterdir() if p.name.startswith("step_")]
    return next(p for p in step_dir.iterdir() if p.suffix == ".distcp")


# ---------------------------------------------------------------- the plugin alone


def test_save_commits_a_verified_checkpoint_that_loads_back_equal(tmp_path: Path) -> None:
    io = StalwartCheckpointIO()
    saved = _checkpoint(7, 1.5)
    io.save_checkpoint(saved, tmp_path / "epoch=0-step=7.ckpt")

    step_dir = tmp_path / "epoch=0-step=7.ckpt" / "step_000000007"
    manifest = verify_checkpoint(step_dir)
    assert manifest.metrics["global_step"] == 7
    assert all(len(f.xxh3_128) == 32 for f in manifest.files)
    loaded = io.load_checkpoint(tmp_path / "epoch=0-step=7.ckpt")
    assert torch.equal(loaded["state_dict"]["layer.weight"], saved["state_dict"]["layer.weight"])
    assert loaded["optimizer_states"][0]["state"][0]["momentum_buffer"].sum() == 6
    assert loaded["hyper_parameters"] == {"lr": 0.1, "layers": (3, 2)}
    assert loaded["callbacks"] == saved["callbacks"]


def test_saving_the_same_path_again_commits_a_new_step_and_drops_the_old(tmp_path: Path) -> None:
    io = StalwartCheckpointIO()
    last = tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(5, 1.0), last)
    io.save_checkpoint(_checkpoint(5, 2.0), last)  # same global step: never an overwrite
    io.save_checkpoint(_checkpoint(10, 3.0), last)

    assert sorted(p.name for p in last.iterdir() if p.name.startswith("step_")) == [
        "step_000000010"
    ]
    assert io.load_checkpoint(last)["state_dict"]["layer.weight"][0, 0] == 3.0
    assert [e["step"] for e in _events(last) if e["event"] == "save"] == [5, 6, 10]


def test_a_value_that_is_not_plain_data_is_refused_at_save_with_its_key(tmp_path: Path) -> None:
    bad = {**_checkpoint(1, 1.0), "hyper_parameters": {"path": Path("/data")}}
    with pytest.raises(TypeError, match=r"hyper_parameters.*path.*PosixPath"):
        StalwartCheckpointIO().save_checkpoint(bad, tmp_path / "last.ckpt")
    assert not any((tmp_path / "last.ckpt").glob("step_*"))


def test_a_damaged_checkpoint_falls_back_to_the_newest_older_one_with_an_event(
    tmp_path: Path,
) -> None:
    io = StalwartCheckpointIO()
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "epoch=0-step=5.ckpt")
    io.save_checkpoint(_checkpoint(10, 10.0), tmp_path / "epoch=0-step=10.ckpt")
    io.save_checkpoint(_checkpoint(15, 15.0), tmp_path / "epoch=0-step=15.ckpt")
    io.save_checkpoint(_checkpoint(15, 15.0), tmp_path / "last.ckpt")
    flip_byte(_data_file(tmp_path / "last.ckpt"))
    flip_byte(_data_file(tmp_path / "epoch=0-step=15.ckpt"))

    loaded = io.load_checkpoint(tmp_path / "last.ckpt")

    assert loaded["global_step"] == 10  # not the damaged 15s, not an older one
    (fallback,) = [
        e for e in _events(tmp_path / "epoch=0-step=10.ckpt") if e["event"] == "restore_fallback"
    ]
    assert fallback["requested"] == str(tmp_path / "last.ckpt")
    assert len(fallback["skipped"]) == 2
    assert all("checksum" in s or "xxh3" in s for s in fallback["skipped"])


def test_a_crafted_pickle_named_last_ckpt_is_never_unpickled(tmp_path: Path) -> None:
    io = StalwartCheckpointIO()
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "epoch=0-step=5.ckpt")
    marker = tmp_path / "pwned"
    torch.save({"state_dict": _Exploit(marker)}, tmp_path / "last.ckpt")  # Lightning's own format

    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 5
    assert not marker.exists()


def test_a_crafted_checkpoint_with_valid_checksums_is_refused_without_running_it(
    tmp_path: Path,
) -> None:
    io = StalwartCheckpointIO()
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "last.ckpt")
    io.save_checkpoint(_checkpoint(9, 9.0), tmp_path / "last-v1.ckpt")
    step_dir = tmp_path / "last-v1.ckpt" / "step_000000009"
    marker = tmp_path / "pwned"
    for f in step_dir.iterdir():
        if f.name != "MANIFEST.json":
            f.unlink()
    dcp.save({"lightning": ({"global_step": 9, "x": _Exploit(marker)},)}, checkpoint_id=step_dir)
    resign(step_dir)  # checksums that match the crafted files

    loaded = io.load_checkpoint(tmp_path / "last-v1.ckpt")

    assert loaded["global_step"] == 5
    assert not marker.exists()


def test_a_missing_path_raises_file_not_found_and_nothing_valid_raises_corrupt(
    tmp_path: Path,
) -> None:
    io = StalwartCheckpointIO()
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        io.load_checkpoint(tmp_path / "nope.ckpt")
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "last.ckpt")
    flip_byte(_data_file(tmp_path / "last.ckpt"))
    with pytest.raises(CheckpointCorruptError, match=r"no checkpoint at or before .*last\.ckpt"):
        io.load_checkpoint(tmp_path / "last.ckpt")


def test_remove_checkpoint_deletes_the_directory_atomically(tmp_path: Path) -> None:
    io = StalwartCheckpointIO()
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "epoch=0-step=5.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0-step=5.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0-step=5.ckpt")  # gone already: nothing to do
    assert os.listdir(tmp_path) == []


def test_async_save_snapshots_tensors_before_returning(tmp_path: Path) -> None:
    """Ported: test_async_checkpoint_should_snapshot_values_before_mutation."""
    io = StalwartCheckpointIO(async_save=True)
    t = torch.tensor([0.0])
    io.save_checkpoint({"global_step": 1, "w": t}, tmp_path / "last.ckpt")
    t.add_(1.0)  # the training thread steps on at once
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["w"], torch.tensor([0.0]))
    assert io.last_stall_s is not None


def test_bad_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="keep_versions must be an integer >= 1"):
        StalwartCheckpointIO(keep_versions=0)
    with pytest.raises(ValueError, match="durable must be an object-store URL"):
        StalwartCheckpointIO(durable="/mnt/backup")


# ------------------------------------------------------------------- with a Trainer


class _Counting(StalwartCheckpointIO):
    """Counts Lightning's calls into the plugin (the plugin itself runs unchanged)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: dict[str, list[Any]] = {"save": [], "load": [], "remove": []}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self.calls["save"].append(path)
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Any = None
    ) -> dict[str, Any]:
        self.calls["load"].append((str(path), weights_only))
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.calls["remove"].append(path)
        super().remove_checkpoint(path)


def _trainer(
    tmp_path: Path, io: StalwartCheckpointIO, ck: ModelCheckpoint, **kwargs: Any
) -> Trainer:
    options: dict[str, Any] = {
        "max_epochs": 2,
        "limit_train_batches": 1,
        "limit_val_batches": 0,
        "limit_test_batches": 1,
        **kwargs,
    }
    return Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        plugins=[io],
        callbacks=ck,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def test_lightning_checkpoint_plugin_called(tmp_path: Path) -> None:
    """Ported: test_checkpoint_plugin_called (the names, rotation and reload Lightning expects)."""
    io = _Counting()
    ck = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = _trainer(tmp_path, io, ck)
    trainer.fit(BoringModel())

    assert {p.name for p in tmp_path.glob("*.ckpt")} == {"epoch=1-step=2.ckpt", "last.ckpt"}
    assert ck.best_model_path == str(tmp_path / "epoch=1-step=2.ckpt")
    assert ck.last_model_path == str(tmp_path / "last.ckpt")
    assert len(io.calls["save"]) == 4
    assert len(io.calls["remove"]) == 1
    trainer.test(BoringModel(), ckpt_path=ck.last_model_path)
    assert io.calls["load"] == [(str(tmp_path / "last.ckpt"), None)]

    # A second run into the same directory: Lightning's version counter, same plugin.
    ck = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(tmp_path, io, ck).fit(BoringModel())
    assert {p.name for p in tmp_path.glob("*.ckpt")} == {
        "epoch=1-step=2.ckpt",
        "last.ckpt",
        "epoch=1-step=2-v1.ckpt",
        "last-v1.ckpt",
    }
    assert ck.last_model_path == str(tmp_path / "last-v1.ckpt")
    for name in ("epoch=1-step=2.ckpt", "last.ckpt", "epoch=1-step=2-v1.ckpt", "last-v1.ckpt"):
        assert io.load_checkpoint(tmp_path / name)["global_step"] == 2


def test_lightning_async_top_k_rotation(tmp_path: Path) -> None:
    """Ported: test_async_checkpoint_plugin (validate, then fit; top-2 by step over 3 epochs)."""
    io = _Counting(async_save=True)
    ck = ModelCheckpoint(dirpath=tmp_path, save_top_k=2, monitor="step", mode="max")
    trainer = _trainer(tmp_path, io, ck, max_epochs=3)
    trainer.validate(BoringModel())
    trainer.fit(BoringModel())

    assert len(io.calls["save"]) == 3
    assert len(io.calls["remove"]) == 1
    assert {p.name for p in tmp_path.glob("*.ckpt")} == {
        "epoch=1-step=2.ckpt",
        "epoch=2-step=3.ckpt",
    }
    assert io.load_checkpoint(tmp_path / "epoch=2-step=3.ckpt")["global_step"] == 3


def test_fit_ckpt_path_last_resumes_from_the_newest_checkpoint_that_verifies(
    tmp_path: Path,
) -> None:
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    _trainer(
        tmp_path, StalwartCheckpointIO(), ck, max_epochs=-1, max_steps=6, limit_train_batches=10
    ).fit(BoringModel())
    flip_byte(_data_file(tmp_path / "last.ckpt"))
    flip_byte(_data_file(tmp_path / "epoch=0-step=6.ckpt"))

    io = _Counting()
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = _trainer(tmp_path, io, ck, max_epochs=-1, max_steps=7, limit_train_batches=10)
    trainer.fit(BoringModel(), ckpt_path="last")

    assert io.calls["load"] == [(str(tmp_path / "last.ckpt"), None)]
    (fallback,) = [
        e for e in _events(tmp_path / "epoch=0-step=4.ckpt") if e["event"] == "restore_fallback"
    ]
    assert fallback["path"] == str(tmp_path / "epoch=0-step=4.ckpt" / "step_000000004")
    assert trainer.global_step == 7
    # Steps 5 and 6 were redone; the new save of step 6 replaced the damaged last.ckpt.
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 6


class _Exploit:
    """Pickles to a call that touches ``target``: proof that a load ran checkpoint code."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.target))}",))


def test_exploit_payload_is_live(tmp_path: Path) -> None:
    """The threat is real: Lightning's default loader (full unpickling) runs the payload."""
    marker = tmp_path / "pwned"
    torch.save({"x": _Exploit(marker)}, tmp_path / "evil.ckpt")
    torch.load(tmp_path / "evil.ckpt", weights_only=False)
    deadline = time.monotonic() + 5
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists()


def test_durable_copy_is_uploaded_and_restores_a_wiped_local_directory(tmp_path: Path) -> None:
    store = tmp_path / "store"
    io = StalwartCheckpointIO(durable=f"file://{store}")
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "run" / "last.ckpt")
    io.save_checkpoint(_checkpoint(10, 10.0), tmp_path / "run" / "last.ckpt")
    assert (store / "last.ckpt" / "step_000000010" / "MANIFEST.json").is_file()

    for step_dir in (tmp_path / "run" / "last.ckpt").glob("step_*"):
        flip_byte(next(step_dir.glob("*.distcp")))  # the local disk went bad
    loaded = io.load_checkpoint(tmp_path / "run" / "last.ckpt")

    assert loaded["global_step"] == 10
    assert torch.equal(loaded["state_dict"]["layer.weight"], torch.full((3, 2), 10.0))
    (fallback,) = [
        e for e in _events(tmp_path / "run" / "last.ckpt") if e["event"] == "restore_fallback"
    ]
    assert "step_000000010" in fallback["skipped"][0]
    assert not list((tmp_path / "run").glob(".*"))  # the download's scratch directory is gone


def test_removing_a_checkpoint_removes_its_durable_copies(tmp_path: Path) -> None:
    store = tmp_path / "store"
    io = StalwartCheckpointIO(durable=f"file://{store}")
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "run" / "epoch=0-step=5.ckpt")
    io.remove_checkpoint(tmp_path / "run" / "epoch=0-step=5.ckpt")
    assert not list((store / "epoch=0-step=5.ckpt").rglob("MANIFEST.json"))


def test_fabric_save_and_load_go_through_the_plugin(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[StalwartCheckpointIO()])
    model = fabric.setup(torch.nn.Linear(3, 2))
    fabric.save(tmp_path / "ck", {"model": model, "step": 3, "note": "x"})
    verify_checkpoint(tmp_path / "ck" / "step_000000000")

    other = fabric.setup(torch.nn.Linear(3, 2))
    state: dict[str, Any] = {"model": other, "step": 0}
    rest = fabric.load(tmp_path / "ck", state)

    assert state["step"] == 3 and rest == {"note": "x"}
    assert torch.equal(other.weight, model.weight)


def test_the_lightning_example_of_docs_integrations_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Style guide: examples in docs run (given a model, a dataset and a step count)."""
    import re

    text = (Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    lightning = text[text.index("## Lightning\n") : text.index("## DeepSpeed\n")]
    (block,) = re.findall(r"```python\n(.*?)```", lightning, flags=re.S)
    monkeypatch.chdir(tmp_path)
    prelude = (
        "from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset\n"
        "model, dataset, total_steps = BoringModel(), RandomDataset(32, 64), 3\n"
    )
    namespace: dict[str, Any] = {}
    exec(prelude + block, namespace)

    assert namespace["trainer"].global_step == 3
    assert (
        StalwartCheckpointIO().load_checkpoint(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 3
    )


def test_a_crafted_last_ckpt_claiming_an_old_step_still_falls_back_to_the_newest(
    tmp_path: Path,
) -> None:
    io = StalwartCheckpointIO()
    io.save_checkpoint(_checkpoint(10, 10.0), tmp_path / "epoch=0-step=10.ckpt")
    io.save_checkpoint(_checkpoint(0, 0.0), tmp_path / "last-v1.ckpt")
    flip_byte(_data_file(tmp_path / "last-v1.ckpt"))  # damaged, and claims step 0

    assert io.load_checkpoint(tmp_path / "last-v1.ckpt")["global_step"] == 10


# ---------------------------------------------------------------- hostile layouts


def test_a_last_ckpt_linked_to_another_directory_is_never_read_nor_written_through(
    tmp_path: Path,
) -> None:
    """A link named last.ckpt to a valid, newer checkpoint elsewhere: the load falls back
    to the checkpoints of dirpath, and a save moves the link aside, leaving the target be."""
    io = StalwartCheckpointIO()
    elsewhere, dirpath = tmp_path / "elsewhere", tmp_path / "ckpt"
    io.save_checkpoint(_checkpoint(99, 99.0), elsewhere / "last.ckpt")
    io.save_checkpoint(_checkpoint(5, 5.0), dirpath / "epoch=0-step=5.ckpt")
    (dirpath / "last.ckpt").symlink_to(elsewhere / "last.ckpt", target_is_directory=True)
    before = sorted(p.name for p in (elsewhere / "last.ckpt").iterdir())

    assert io.load_checkpoint(dirpath / "last.ckpt")["global_step"] == 5

    io.save_checkpoint(_checkpoint(6, 6.0), dirpath / "last.ckpt")
    assert not (dirpath / "last.ckpt").is_symlink()
    assert io.load_checkpoint(dirpath / "last.ckpt")["global_step"] == 6
    assert sorted(p.name for p in (elsewhere / "last.ckpt").iterdir()) == before
    io.remove_checkpoint(next(dirpath.glob(".last.ckpt.foreign-*")))  # the link, not its target
    assert io.load_checkpoint(elsewhere / "last.ckpt")["global_step"] == 99


def test_a_step_linked_in_from_outside_dirpath_is_not_a_checkpoint_of_it(tmp_path: Path) -> None:
    io = StalwartCheckpointIO()
    io.save_checkpoint(_checkpoint(99, 99.0), tmp_path / "elsewhere.ckpt")
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "ckpt" / "last.ckpt")
    (tmp_path / "ckpt" / "last.ckpt" / "step_000000099").symlink_to(
        tmp_path / "elsewhere.ckpt" / "step_000000099", target_is_directory=True
    )

    assert io.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 5


def test_a_step_with_a_huge_manifest_is_skipped_without_reading_it(tmp_path: Path) -> None:
    """A crafted step whose MANIFEST.json is 16 GiB (sparse): refused by its size, then fallback."""
    io = StalwartCheckpointIO()
    io.save_checkpoint(_checkpoint(5, 5.0), tmp_path / "epoch=0-step=5.ckpt")
    crafted = tmp_path / "last.ckpt" / "step_000000099"
    crafted.mkdir(parents=True)
    with open(crafted / "MANIFEST.json", "wb") as f:
        f.truncate(16 << 30)

    t0 = time.perf_counter()
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 5
    assert time.perf_counter() - t0 < 10


def test_two_writers_of_one_path_never_overwrite_each_others_commits(tmp_path: Path) -> None:
    """No lock: two plugins saving last.ckpt at once race for each step. The loser's save
    fails with CheckpointSaveError; what is committed is always whole and loads back."""
    import threading

    from stalwart.errors import CheckpointSaveError

    last, errors = tmp_path / "last.ckpt", []

    def writer(who: float) -> None:
        io = StalwartCheckpointIO()
        for step in range(12):
            try:
                io.save_checkpoint({"global_step": step, "w": torch.full((8,), who + step)}, last)
            except Exception as exc:  # anything else fails the test below
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=writer, args=(who,)) for who in (0.0, 100.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert all(
        e.startswith(CheckpointSaveError.__name__)
        and ("already exists" in e or "another writer" in e)
        for e in errors
    ), errors
    (step_dir,) = last.glob("step_*")
    verify_checkpoint(step_dir)
    loaded = StalwartCheckpointIO().load_checkpoint(last)
    assert loaded["w"][0] - loaded["global_step"] in (0.0, 100.0)  # one writer's, whole


@pytest.mark.parametrize("damage", ["manifest", "foreign file"])
def test_an_explicit_path_without_a_readable_manifest_never_falls_forward(
    tmp_path: Path, damage: str
) -> None:
    """Its step is then the step=N of its name: the fallback goes back to 5, never on to 15."""
    io = StalwartCheckpointIO()
    for step in (5, 10, 15):
        io.save_checkpoint(_checkpoint(step, float(step)), tmp_path / f"epoch=0-step={step}.ckpt")
    requested = tmp_path / "epoch=0-step=10.ckpt"
    if damage == "manifest":
        flip_byte(requested / "step_000000010" / "MANIFEST.json", offset=40)
    else:
        for step_dir in requested.iterdir():
            step_dir.rename(tmp_path / f".{step_dir.name}.gone")
        requested.rmdir()
        torch.save({"global_step": 10}, requested)

    assert io.load_checkpoint(requested)["global_step"] == 5
