"""The operator commands `plan`, `gc`, `diff`, `export` and `report` on real runs.

Runs are made with the public API (and one with torchrun: a 2-rank FSDP2
checkpoint); damage is done by editing files on disk and ages by setting mtimes.
Commands run in-process through ``main([...])`` unless a real process is the point.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import stalwart
from stalwart.export import export_checkpoint
from stalwart.safe_load import read_dcp_metadata

from .conftest import assert_one_line_error, cli, flip_byte

WORKER = Path(__file__).parent / "distributed" / "worker.py"
HOUR = 3600.0


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def make_state(model: torch.nn.Module) -> tuple[stalwart.TrainState, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return stalwart.TrainState(model=model, optimizer=opt, extra={"epoch": 0}), opt


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Committed steps 10, 20, 30 of a small MLP + AdamW (a few optimizer steps apart)."""
    run = tmp_path_factory.mktemp("ops") / "run"
    torch.manual_seed(0)
    model = make_model()
    state, opt = make_state(model)
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        for step in range(1, 31):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step % 10 == 0:
                ckpt.save(step, state)
    return run


@pytest.fixture
def run(pristine_run: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine run, free to damage."""
    return Path(shutil.copytree(pristine_run, tmp_path / "run", symlinks=True))


def restored(run: Path, step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer restored from ``step`` through the public API."""
    model = make_model()
    state, opt = make_state(model)
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        assert ckpt.restore(state, step=step) == step
    return model, opt


def age(path: Path, seconds: float) -> None:
    """Set the mtime of ``path`` and everything under it ``seconds`` into the past."""
    then = time.time() - seconds
    for root, _dirs, files in os.walk(path):
        for name in files:
            os.utime(Path(root) / name, (then, then))
    os.utime(path, (then, then))


def make_leftover(run: Path, name: str, size: int = 1000, seconds_old: float = 0.0) -> Path:
    path = run / name
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"\0" * size)
    if seconds_old:
        age(path, seconds_old)
    return path


@pytest.mark.parametrize("command", ["plan", "gc", "diff", "export", "report"])
def test_every_new_help_documents_the_exit_statuses(capsys, command):
    code, out, _err = cli(capsys, command, "--help")
    assert code == 0
    assert "exit status" in out
    statuses = (0, 2) if command == "plan" else (0, 1, 2)
    assert all(f"  {n}  " in out for n in statuses)


# ----------------------------------------------------------------------------- plan


def test_plan_json_for_7b_on_eight_h100s_recommends_fsdp2_and_daly_interval(capsys):
    code, out, err = cli(
        capsys, "plan", "--params", "7B", "--gpus", "8", "--gpu", "h100", "--mtbf", "24h",
        "--write-bw", "2GB/s", "--step-time", "1.2s", "--json",
    )  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert plan["strategy"] == "fsdp2"
    assert plan["memory"]["fits_ddp"] is False
    assert plan["checkpoint"]["total_bytes"] == 84e9
    assert plan["checkpoint"]["sync_stall_s"] == pytest.approx(42.0)
    assert plan["interval"]["mtbf_s"] == 24 * HOUR
    assert plan["interval"]["recommended_s"] == pytest.approx(plan["interval"]["daly_s"])
    steps = plan["interval"]["every_steps"]
    assert f"every_steps={steps}" in plan["code"]["manager"]
    assert plan["code"]["launch"].startswith("torchrun --standalone --nproc-per-node=8")
    assert plan["sources"]["write_bw"] == "given"


def test_plan_human_output_has_the_recommendation_interval_and_lines_to_paste(capsys):
    code, out, _err = cli(capsys, "plan", "--params", "125M", "--gpu", "a100-40", "--mtbf", "30d")
    assert code == 0
    assert "recommendation: DDP" in out
    assert "Daly" in out and "Young" in out
    assert "activations not modeled" in out
    assert 'stalwart.CheckpointManager("runs/exp1", every_seconds=' in out
    assert "torchrun --standalone --nproc-per-node=1" in out
    assert "\x1b[" not in out


def test_plan_measure_times_a_real_fsynced_file_and_removes_it(capsys, tmp_path):
    code, out, err = cli(
        capsys, "plan", "--params", "1.3B", "--measure", tmp_path, "--measure-size", "16MB",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    measured = plan["measured"]
    assert measured["bytes"] == 16 * 10**6
    assert measured["write_bw"] > 0 and measured["read_bw"] > 0 and measured["copy_bw"] > 0
    assert plan["inputs"]["write_bw"] == measured["write_bw"]
    assert plan["sources"]["write_bw"] == f"measured in {tmp_path}"
    assert list(tmp_path.iterdir()) == [], "the test file is removed"

    code, out, _err = cli(
        capsys, "plan", "--params", "1.3B", "--measure", tmp_path, "--measure-size", "8MB",
        "--write-bw", "3GB/s", "--json",
    )  # fmt: skip
    plan = json.loads(out)
    assert plan["inputs"]["write_bw"] == 3e9 and plan["sources"]["write_bw"] == "given"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--params", "7X"], "unknown suffix 'X'"),
        (["--params", "7B", "--mtbf", "24"], "give a number with a unit"),
        (["--params", "7B", "--gpu", "h300"], "invalid choice: 'h300'"),
        (["--params", "7B", "--write-bw", "fast"], "bandwidth 'fast'"),
        (["--params", "7B", "--gpus", "0"], "must be at least 1"),
        (["--gpus", "8"], "--params"),
        (["--params", "7B", "--mtbf", "1h", "--mtbf-job", "1h"], "not allowed with"),
    ],
)
def test_plan_bad_arguments_exit_2_naming_the_value(capsys, argv, fragment):
    code, _out, err = cli(capsys, "plan", *argv)
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err


def test_plan_measure_of_a_missing_directory_is_a_one_line_usage_error(capsys, tmp_path):
    code, _out, err = cli(capsys, "plan", "--params", "7B", "--measure", tmp_path / "nope")
    assert code == 2
    assert_one_line_error(err, "nope: no such file or directory")


# ----------------------------------------------------------------------------- gc


def test_gc_removes_old_leftovers_keeps_young_ones_and_never_a_committed_checkpoint(capsys, run):
    old_tmp = make_leftover(run, ".step_000000040.tmp-0a1b2c3d4e5f", 1000, 2 * HOUR)
    old_del = make_leftover(run, ".step_000000005.del-00aa11bb22cc", 500, 3 * HOUR)
    young_tmp = make_leftover(run, ".step_000000050.tmp-ffeeddccbbaa", 700)
    aside = make_leftover(run, ".step_000000007.corrupt-abcdefabcdef", 300, 5 * HOUR)
    committed = sorted(p.name for p in run.glob("step_*"))

    code, out, err = cli(capsys, "gc", run, "--json")
    assert code == 0, err
    report = json.loads(out)
    actions = {e["name"]: e["action"] for e in report["entries"]}
    assert actions[old_tmp.name] == "removed" and actions[old_del.name] == "removed"
    assert actions[young_tmp.name] == "kept" and actions[aside.name] == "kept"
    assert report["removed"] == 2 and report["bytes_freed"] == 1500
    assert report["lock"]["state"] == "free"
    assert not old_tmp.exists() and not old_del.exists()
    assert young_tmp.exists() and aside.exists()
    assert sorted(p.name for p in run.glob("step_*")) == committed
    assert cli(capsys, "verify", run)[0] == 0, "committed checkpoints are intact"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "gc" and events[-1]["bytes_freed"] == 1500
    with stalwart.CheckpointManager(run) as ckpt:  # gc released the run lock
        assert ckpt.latest_step() == 30


def test_gc_dry_run_lists_but_removes_nothing(capsys, run):
    old = make_leftover(run, ".step_000000040.tmp-0a1b2c3d4e5f", 1000, 2 * HOUR)
    code, out, _err = cli(capsys, "gc", run, "--dry-run")
    assert code == 0
    assert old.name in out and "would remove" in out
    assert "would remove 1 entries" in out
    assert old.exists()


def test_gc_grace_period_is_configurable(capsys, run):
    leftover = make_leftover(run, ".step_000000040.tmp-0a1b2c3d4e5f", 10, 10 * 60)
    assert json.loads(cli(capsys, "gc", run, "--json")[1])["removed"] == 0
    assert leftover.exists()
    assert json.loads(cli(capsys, "gc", run, "--grace", "5m", "--json")[1])["removed"] == 1
    assert not leftover.exists()


def test_gc_removes_a_checkpoint_restore_moved_aside_only_with_corrupt(capsys, run):
    flip_byte(run / "step_000000030" / "__0_0.distcp")
    model = make_model()
    state, _opt = make_state(model)
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        assert ckpt.restore(state) == 20
    (aside,) = run.glob(".step_000000030.corrupt-*")
    assert json.loads(cli(capsys, "gc", run, "--grace", "0s", "--json")[1])["removed"] == 0
    assert aside.exists()
    code, out, _err = cli(capsys, "gc", run, "--grace", "0s", "--corrupt", "--json")
    assert code == 0
    assert [e["name"] for e in json.loads(out)["entries"] if e["action"] == "removed"] == [
        aside.name
    ]
    assert not aside.exists()
    assert (run / "step_000000020").is_dir()


def test_gc_refuses_while_a_manager_holds_the_lock_and_force_sweeps_only_old_entries(capsys, run):
    old = make_leftover(run, ".step_000000040.tmp-0a1b2c3d4e5f", 100, 2 * HOUR)
    young = make_leftover(run, ".step_000000050.tmp-ffeeddccbbaa", 100)
    with stalwart.CheckpointManager(run, keep_last=None):
        code, _out, err = cli(capsys, "gc", run, "--grace", "0s")
        assert code == 1
        assert_one_line_error(err, f"locked by pid {os.getpid()}", "--force")
        assert old.exists() and young.exists()

        code, out, err = cli(capsys, "gc", run, "--force")
        assert code == 0, err
        assert "only entries older than" in out
        assert not old.exists() and young.exists()


def test_gc_bad_targets_are_usage_errors(capsys, run, tmp_path):
    code, _out, err = cli(capsys, "gc", tmp_path / "missing")
    assert code == 2
    assert_one_line_error(err, "no such file or directory")
    code, _out, err = cli(capsys, "gc", run / "step_000000010")
    assert code == 2
    assert_one_line_error(err, "is a checkpoint directory")
    code, _out, err = cli(capsys, "gc", run, "--grace", "soon")
    assert code == 2 and "duration 'soon'" in err


# ----------------------------------------------------------------------------- diff


def test_diff_of_two_steps_reports_each_changed_tensor_and_by_how_much(capsys, run):
    a_model, a_opt = restored(run, 10)
    b_model, b_opt = restored(run, 20)
    code, out, err = cli(capsys, "diff", run, "--step", "10", "--step", "20", "--json")
    assert code == 1, err
    report = json.loads(out)
    assert (report["step_a"], report["step_b"], report["identical"]) == (10, 20, False)
    rows = {r["key"]: r for r in report["entries"]}
    for name, a in a_model.state_dict().items():
        b = b_model.state_dict()[name]
        row = rows[f"model.{name}"]
        assert row["status"] == "changed"
        assert row["max_abs_diff"] == pytest.approx(float((a.double() - b.double()).abs().max()))
        assert row["differing"] == int((a != b).sum()) and row["numel"] == a.numel()
    exp_avg = rows["optimizer.state.0.weight.exp_avg"]
    a_sd, b_sd = get_state_dict(a_model, a_opt)[1], get_state_dict(b_model, b_opt)[1]
    delta = a_sd["state"]["0.weight"]["exp_avg"] - b_sd["state"]["0.weight"]["exp_avg"]
    assert exp_avg["max_abs_diff"] == pytest.approx(float(delta.abs().max()))
    assert rows["optimizer.param_groups.0.lr"]["status"] == "equal"
    assert rows["rng.rank_0"]["status"] == "changed"


def test_diff_of_a_checkpoint_with_itself_is_identical(capsys, run):
    ckpt = run / "step_000000020"
    code, out, _err = cli(capsys, "diff", ckpt, ckpt)
    assert code == 0
    assert "identical" in out


def test_diff_atol_counts_small_differences_as_equal(capsys, run):
    report = json.loads(cli(capsys, "diff", run, "--step", "10", "--step", "20", "--json")[1])
    rows = {r["key"]: r for r in report["entries"]}
    biggest = rows["model.0.weight"]["max_abs_diff"]
    loose = json.loads(
        cli(capsys, "diff", run, "--step", "10", "--step", "20", "--atol", str(biggest), "--json")[
            1
        ]
    )
    assert {r["key"]: r for r in loose["entries"]}["model.0.weight"]["status"] == "equal"


def test_diff_reports_dtype_and_shape_changes_and_keys_in_only_one(capsys, tmp_path):
    def save(directory: Path, model: torch.nn.Module) -> None:
        with stalwart.CheckpointManager(directory) as ckpt:
            ckpt.save(1, stalwart.TrainState(model=model))

    torch.manual_seed(0)
    save(tmp_path / "a", torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)))
    save(
        tmp_path / "b",
        torch.nn.Sequential(
            torch.nn.Linear(4, 2).double(), torch.nn.Linear(2, 5), torch.nn.Linear(5, 1)
        ),
    )
    code, out, _err = cli(capsys, "diff", tmp_path / "a", tmp_path / "b", "--json")
    assert code == 1
    status = {r["key"]: r["status"] for r in json.loads(out)["entries"]}
    assert status["model.0.weight"] == "dtype"
    assert status["model.1.weight"] == "shape"
    assert status["model.2.weight"] == "only_b" and status["model.2.bias"] == "only_b"
    code, out, _err = cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert "dtype float32 -> float64" in out and "shape (2, 2) -> (5, 2)" in out
    assert "only in B" in out


def test_diff_treats_nan_in_the_same_place_as_equal(capsys, tmp_path):
    model = torch.nn.Linear(3, 3)
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    with stalwart.CheckpointManager(tmp_path / "run", keep_last=None) as ckpt:
        ckpt.save(1, stalwart.TrainState(model=model, rng=False))
        ckpt.save(2, stalwart.TrainState(model=model, rng=False))
        with torch.no_grad():
            model.weight[1, 2] = 1.0
        ckpt.save(3, stalwart.TrainState(model=model, rng=False))
    assert cli(capsys, "diff", tmp_path / "run", "--step", "1", "--step", "2")[0] == 0
    code, out, _err = cli(capsys, "diff", tmp_path / "run", "--step", "2", "--step", "3", "--json")
    row = next(r for r in json.loads(out)["entries"] if r["key"] == "model.weight")
    assert code == 1 and row["differing"] == 1


def test_diff_refuses_a_corrupt_checkpoint_before_comparing(capsys, run):
    flip_byte(run / "step_000000020" / "__0_0.distcp")
    code, out, err = cli(capsys, "diff", run, "--step", "10", "--step", "20")
    assert code == 1 and out == ""
    assert_one_line_error(err, "step_000000020/__0_0.distcp: checksum mismatch")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "got 1 directory and 0 --step"),
        (["--step", "10", "--step", "99"], "no checkpoint of step 99"),
        (["--step", "1", "--step", "2", "--step", "3"], "and 3 --step"),
    ],
)
def test_diff_usage_errors_exit_2(capsys, run, argv, fragment):
    code, _out, err = cli(capsys, "diff", run, *argv)
    assert code == 2
    assert_one_line_error(err, fragment)


# ----------------------------------------------------------------------------- export


def read_safetensors_by_hand(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse a safetensors file from its specification, without the safetensors package."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n :]
    dtypes = {
        "F32": torch.float32,
        "F64": torch.float64,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
    }
    spans = sorted((info["data_offsets"], name) for name, info in header.items())
    end = 0
    for (begin, stop), _name in spans:
        assert begin == end, "tensors are packed without gaps"
        end = stop
    assert end == len(body), "no trailing bytes"
    tensors = {}
    for name, info in header.items():
        begin, stop = info["data_offsets"]
        raw = bytearray(body[begin:stop])
        dtype = dtypes[info["dtype"]]
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return meta, tensors


def test_export_safetensors_holds_the_model_of_that_step_under_state_dict_names(
    capsys, run, tmp_path
):
    dest = tmp_path / "model.safetensors"
    code, out, err = cli(capsys, "export", run, "--step", "20", "--to", dest, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["step"] == 20 and report["format"] == "safetensors"
    assert report["bytes"] == dest.stat().st_size
    meta, tensors = read_safetensors_by_hand(dest)
    assert meta["stalwart_step"] == "20"
    expected = restored(run, 20)[0].state_dict()
    assert set(tensors) == set(expected) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    model = make_model()
    model.load_state_dict(tensors)  # the names are the model's own


def test_export_is_readable_by_the_safetensors_library(capsys, run, tmp_path):
    import safetensors.torch as safetensors_torch

    dest = tmp_path / "all.safetensors"
    assert cli(capsys, "export", run, "--to", dest, "--only", "all")[0] == 0
    loaded = safetensors_torch.load_file(str(dest))
    _meta, by_hand = read_safetensors_by_hand(dest)
    assert set(loaded) == set(by_hand)
    assert "model.0.weight" in loaded and "optimizer.state.0.weight.exp_avg_sq" in loaded
    for name, value in by_hand.items():
        assert torch.equal(loaded[name], value), name


def test_export_torch_format_is_a_flat_dict_that_loads_with_weights_only(capsys, run, tmp_path):
    dest = tmp_path / "model.pt"
    code, out, _err = cli(capsys, "export", run, "--to", dest)
    assert code == 0
    assert "(torch," in out
    flat = torch.load(dest, weights_only=True)
    expected = restored(run, 30)[0].state_dict()
    assert set(flat) == set(expected)
    assert all(torch.equal(flat[k], v) for k, v in expected.items())


def test_export_only_all_includes_optimizer_state_under_full_keys(capsys, run, tmp_path):
    dest = tmp_path / "all.pt"
    assert cli(capsys, "export", run, "--to", dest, "--only", "all")[0] == 0
    flat = torch.load(dest, weights_only=True)
    model, opt = restored(run, 30)
    _model_sd, optim_sd = get_state_dict(model, opt)
    assert torch.equal(flat["model.2.bias"], model.state_dict()["2.bias"])
    assert torch.equal(
        flat["optimizer.state.2.weight.exp_avg"], optim_sd["state"]["2.weight"]["exp_avg"]
    )
    assert not any(k.startswith(("rng", "extra", "optimizer.param_groups")) for k in flat)


def test_export_in_tiny_batches_writes_the_same_bytes(capsys, run, tmp_path):
    """Bounded memory: one tensor per load gives a byte-identical file."""
    whole = tmp_path / "whole.safetensors"
    assert cli(capsys, "export", run, "--to", whole, "--only", "all")[0] == 0
    tiny = tmp_path / "tiny.safetensors"
    export_checkpoint(run / "step_000000030", tiny, only="all", batch_bytes=1)
    assert tiny.read_bytes() == whole.read_bytes()


def test_export_refuses_a_corrupt_checkpoint_and_leaves_no_file(capsys, run, tmp_path):
    flip_byte(run / "step_000000030" / "__0_0.distcp")
    dest = tmp_path / "out" / "model.safetensors"
    dest.parent.mkdir()
    code, out, err = cli(capsys, "export", run, "--to", dest)
    assert code == 1 and out == ""
    assert_one_line_error(err, "checksum mismatch")
    assert list(dest.parent.iterdir()) == []


def test_export_does_not_overwrite_without_being_asked(capsys, run, tmp_path):
    dest = tmp_path / "model.safetensors"
    dest.write_text("precious")
    code, _out, err = cli(capsys, "export", run, "--to", dest)
    assert code == 2
    assert_one_line_error(err, "already exists", "--overwrite")
    assert dest.read_text() == "precious"
    assert cli(capsys, "export", run, "--to", dest, "--overwrite")[0] == 0
    assert dest.read_bytes()[:8] != b"precious"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--step", "15"], "no checkpoint of step 15"),
        (["--to-missing-dir"], "does not exist"),
    ],
)
def test_export_usage_errors_exit_2(capsys, run, tmp_path, argv, fragment):
    dest = tmp_path / "model.safetensors"
    if argv == ["--to-missing-dir"]:
        argv, dest = [], tmp_path / "nowhere" / "model.safetensors"
    code, _out, err = cli(capsys, "export", run, "--to", dest, *argv)
    assert code == 2
    assert_one_line_error(err, fragment)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of step 4 written by 2 FSDP2 ranks under torchrun (gloo, CPU)."""
    run = tmp_path_factory.mktemp("fsdp") / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=0", "--monitor-interval=0.2", str(WORKER),
        "--kind", "fsdp", "--run-dir", str(run), "--steps", "4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run


def test_export_of_a_two_rank_fsdp2_checkpoint_equals_a_one_process_restore(
    capsys, fsdp_run, tmp_path
):
    checkpoint = fsdp_run / "step_000000004"
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 2
    sharded = read_dcp_metadata(checkpoint).state_dict_metadata["model.0.weight"]
    assert len(sharded.chunks) == 2, "the weight was written as two shards"

    dest = tmp_path / "fsdp.safetensors"
    code, _out, err = cli(capsys, "export", fsdp_run, "--to", dest, "--only", "all")
    assert code == 0, err
    _meta, exported = read_safetensors_by_hand(dest)

    # The worker's model, built unsharded in this one process, restored through the API.
    sys.path.insert(0, str(WORKER.parent))
    try:
        import worker
    finally:
        sys.path.remove(str(WORKER.parent))
    model = worker.build_model("fsdp", 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    state = stalwart.TrainState(model=model, optimizer=opt)
    with stalwart.CheckpointManager(fsdp_run, keep_last=None) as ckpt:
        assert ckpt.restore(state, strict=False) == 4
    model_sd, optim_sd = get_state_dict(model, opt)
    assert {k for k in exported if k.startswith("model.")} == {f"model.{k}" for k in model_sd}
    for name, value in model_sd.items():
        assert torch.equal(exported[f"model.{name}"], value), name
    for param, moments in optim_sd["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(exported[f"optimizer.state.{param}.{moment}"], moments[moment])


def test_diff_reads_a_sharded_checkpoint_whole(capsys, fsdp_run):
    checkpoint = fsdp_run / "step_000000004"
    code, out, _err = cli(capsys, "diff", checkpoint, checkpoint, "--json")
    assert code == 0
    rows = {r["key"]: r for r in json.loads(out)["entries"]}
    assert rows["model.0.weight"]["numel"] == 64 * 16


# ----------------------------------------------------------------------------- report


@pytest.fixture
def eventful_run(run: Path) -> Path:
    """The run after a restore that skipped and quarantined a corrupt checkpoint, and a failed save."""
    flip_byte(run / "step_000000030" / "__0_0.distcp")

    class Failing:
        def state_dict(self) -> dict:
            raise OSError("injected: disk went away")

        def load_state_dict(self, sd: dict) -> None:
            pass

    model = make_model()
    state, _opt = make_state(model)
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        assert ckpt.restore(state) == 20
        ckpt.save(21, state)
        bad = stalwart.TrainState(model=model, extra={"epoch": 0}, failing=Failing())
        with pytest.raises(stalwart.CheckpointSaveError, match="injected") as info:
            ckpt.save(22, bad)
        assert isinstance(info.value.__cause__, OSError)
    return run


def test_report_draws_a_png_and_an_html_page_with_the_summary(capsys, eventful_run, tmp_path):
    out_dir = tmp_path / "report"
    code, out, err = cli(capsys, "report", eventful_run, "--out", out_dir, "--json")
    assert code == 0, err
    report = json.loads(out)
    png = Path(report["png"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1100, 750)
    summary = report["summary"]
    assert summary["saves"] == 4 and summary["steps_saved"] == [10, 20, 30, 21]
    assert summary["starts"] == 2
    assert [r["step"] for r in summary["restores"]] == [20]
    problems = [(p["event"], p["step"]) for p in summary["problems"]]
    assert problems == [("restore_skipped", 30), ("quarantine", 30), ("save_failed", 22)]
    assert summary["stall_s"]["max"] >= summary["stall_s"]["median"] > 0
    page = Path(report["html"]).read_text()
    assert "data:image/png;base64," in page
    assert "checksum mismatch" in page and "injected: disk went away" in page


def test_report_defaults_to_a_folder_in_the_run_and_prints_what_it_wrote(capsys, eventful_run):
    code, out, _err = cli(capsys, "report", eventful_run)
    assert code == 0
    assert (eventful_run / "report" / "timeline.png").is_file()
    assert (eventful_run / "report" / "report.html").is_file()
    assert "restores: 1; problems: 3" in out
    assert cli(capsys, "ls", eventful_run)[0] == 0, "the report folder does not confuse ls"


def test_report_without_matplotlib_fails_with_a_clear_message(run):
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from stalwart.cli.main import main\n"
        f"sys.exit(main(['report', {str(run)!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert_one_line_error(proc.stderr, "matplotlib, which is not installed", "pip install")
    assert not (run / "report").exists()


def test_report_of_a_run_without_events_is_an_error(capsys, run):
    (run / "events.jsonl").unlink()
    code, _out, err = cli(capsys, "report", run)
    assert code == 1
    assert_one_line_error(err, "has no events.jsonl")
    code, _out, err = cli(capsys, "report", run / "step_000000010")
    assert code == 2
    assert_one_line_error(err, "is a checkpoint directory")
