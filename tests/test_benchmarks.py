"""`make bench --quick` runs end to end and reports every method and every reference.

Speed targets are benchmark results, not unit tests: nothing here asserts them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAVE_METHODS = (
    "stalwart_sync",
    "stalwart_async",
    "torch_save",
    "dcp_save",
    "dcp_async_thread",
    "dcp_async_process",
)
RESTORING_METHODS = ("stalwart_sync", "torch_save", "dcp_save")
REFERENCES = (
    "memcpy_s",
    "clone_s",
    "xxh3_s",
    "raw_write_s",
    "raw_read_cold_s",
    "raw_read_warm_s",
    "place_cold_s",
    "place_warm_s",
    "check_place_cold_s",
    "check_place_warm_s",
    "check_place_fresh_cold_s",
    "check_place_fresh_warm_s",
)
TRAIN_VARIANTS = ("stalwart_sync", "stalwart_async", "torch_save")
DURABLE_BACKENDS = ("obstore", "fsspec")
DURABLE_OPS = ("stalwart_upload", "raw_put", "stalwart_download", "raw_get", "raw_get_to_disk")
DURABLE_RATIOS = ("upload_x_raw_put", "download_x_raw_get", "download_x_raw_get_to_disk")


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bench")
    work = tmp_path_factory.mktemp("bench-work")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run.py"),
            "--quick",
            "--out",
            str(out),
            "--workdir",
            str(work),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,  # about 100 s on 2 busy cores (the durable tier 12 s, new interpreters 22 s)
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "| target |" in proc.stdout, "the markdown table is printed"
    return out, json.loads((out / "quick.json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_quick_mode_measures_every_method_at_every_size(quick_run: tuple[Path, dict]) -> None:
    _out, results = quick_run
    assert len(results["sizes"]) == 2
    for entry in results["sizes"]:
        for method in SAVE_METHODS:
            m = entry["methods"][method]
            assert "error" not in m, f"{entry['label']} {method}: {m.get('error')}"
            assert positive(m["stall_s"]) and positive(m["e2e_s"]), (entry["label"], method, m)
            assert m["stall_s"] <= m["e2e_s"] * 1.001, (entry["label"], method, m)
            assert m["peak_rss_mib"] >= 0
        for method in RESTORING_METHODS:
            rs = entry["methods"][method]["restore"]
            assert positive(rs["restore_cold_s"]) and positive(rs["restore_warm_s"]), (method, rs)


@pytest.mark.slow
def test_quick_mode_measures_every_physical_reference(quick_run: tuple[Path, dict]) -> None:
    _out, results = quick_run
    for entry in results["sizes"]:
        refs = entry["references"]
        assert "error" not in refs, refs.get("error")
        for key in REFERENCES:
            assert positive(refs[key]), (entry["label"], key, refs.get(key))
        assert positive(entry["bytes"])


def direct_io_works(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` takes O_DIRECT (tmpfs refuses it)."""
    probe = directory / "direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return bool(getattr(os, "O_DIRECT", 0))


@pytest.mark.slow
def test_the_persist_reference_is_a_raw_write_timed_in_a_saves_place(
    quick_run: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The raw write the persist goal divides by takes its turn among the saves of each
    round, as a save does; the writes at the rounds' edges are shown beside it."""
    out, results = quick_run
    md = (out / "quick.md").read_text(encoding="utf-8")
    assert md.count("*ref: the same raw write at the rounds' edges*") == 2
    for entry in results["sizes"]:
        refs = entry["references"]
        samples = refs["samples"]
        repeats = entry["methods"]["stalwart_sync"]["repeats"]
        # One per timed round among the saves; at the edges two per timed round, and
        # one per extra round that the references get (at least three rounds).
        assert len(samples["write_in_round"]) == repeats, samples
        assert len(samples["write"]) == 2 * repeats + max(3 - repeats, 0), samples
        assert refs["raw_write_s"] == min(samples["write_in_round"])
        assert refs["raw_write_edge_s"] == min(samples["write"])
        every_cpu = samples["write_cpu"] + samples["write_in_round_cpu"]
        assert refs["raw_write_cpu_s"] == min(every_cpu)
    persist = [t for t in results["targets"] if t["target"].startswith("persist")]
    assert persist and all("raw write among the saves" in t["detail"] for t in persist)
    assert all("at the rounds' edges" in t["detail"] for t in persist)
    assert not list((tmp_path_factory.getbasetemp()).rglob("round*.bin")), "left behind"


@pytest.mark.slow
def test_quick_mode_measures_a_raw_direct_write_and_compares_persist_with_it(
    quick_run: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Stalwart writes large tensors past the page cache: the report also shows what a
    raw direct write of the same bytes does on this disk, next to the buffered one."""
    out, results = quick_run
    if not direct_io_works(tmp_path_factory.getbasetemp()):
        assert all("raw_write_direct_s" not in e["references"] for e in results["sizes"])
        return
    md = (out / "quick.md").read_text(encoding="utf-8")
    assert md.count("*ref: raw sequential direct write (O_DIRECT) + fsync*") == 2
    assert md.count("*ref: the same direct write at the rounds' edges*") == 2
    for entry in results["sizes"]:
        refs = entry["references"]
        samples = refs["samples"]
        assert positive(refs["raw_write_direct_s"]), refs
        assert positive(refs["raw_write_direct_cpu_s"]), refs
        assert len(samples["write_direct"]) == len(samples["write"])
        assert len(samples["write_direct_in_round"]) == len(samples["write_in_round"])
        assert refs["raw_write_direct_s"] == min(samples["write_direct_in_round"])
        assert refs["raw_write_direct_edge_s"] == min(samples["write_direct"])
    persist = [t for t in results["targets"] if t["target"].startswith("persist")]
    assert len(persist) == 2
    for row in persist:
        assert "raw direct write (O_DIRECT" in row["detail"], row
    assert not list((tmp_path_factory.getbasetemp()).rglob("direct*.bin")), "left behind"


@pytest.mark.slow
def test_quick_mode_measures_the_training_loop(quick_run: tuple[Path, dict]) -> None:
    _out, results = quick_run
    runs = results["training"]["runs"]
    assert {r["variant"] for r in runs} == set(TRAIN_VARIANTS)
    for run in runs:
        assert "error" not in run, f"{run['variant']}: {run.get('error')}"
        assert positive(run["base_s"]) and positive(run["ckpt_s"]) and run["saves"] > 0, run
    side = results["training"]["side_by_side"]
    assert "error" not in side, side.get("error")
    assert side["every"] == 5 and set(side["variants"]) == {
        "stalwart_async",
        "floor_async",
        "floor_async_xxh3",
    }
    for name, run in side["variants"].items():
        assert positive(run["base_s"]) and run["saves"] > 0, (name, run)
        assert run["rounds"] == side["rounds"] >= 2 and math.isfinite(run["overhead"]), (name, run)
    # Each variant's saves are its own: stalwart's manager committed its checkpoints.
    assert side["variants"]["stalwart_async"]["logged_stalls_s"], side


@pytest.mark.slow
def test_quick_mode_writes_markdown_json_and_plot(quick_run: tuple[Path, dict]) -> None:
    out, results = quick_run
    md = (out / "quick.md").read_text(encoding="utf-8")
    assert results["meta"]["command"] in md
    assert results["meta"]["torch"] in md
    # lightning is a pinned dev dependency now: its row says it is not benchmarked yet.
    assert "Lightning" in md and ("not installed" in md or "not benchmarked yet" in md)
    statuses = {t["status"] for t in results["targets"]}
    assert statuses <= {"PASS", "MISS", "N/A"} and len(results["targets"]) >= 9
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "quick.png").stat().st_size > 0


@pytest.mark.slow
def test_quick_mode_measures_the_durable_tier_with_both_backends(
    quick_run: tuple[Path, dict],
) -> None:
    out, results = quick_run
    summary = results["durable"]
    assert set(summary) == {"name", "error", "elapsed_s"}
    assert summary["name"] == "durable-quick" and summary["error"] is None
    assert summary["elapsed_s"] > 0
    durable = json.loads((out / "durable-quick.json").read_text(encoding="utf-8"))
    assert durable["error"] is None
    assert len(durable["sizes"]) == 1
    for entry in durable["sizes"]:
        assert set(entry["backends"]) == set(DURABLE_BACKENDS)
        for backend, result in entry["backends"].items():
            assert "error" not in result, f"{backend}: {result.get('error')}"
            for op in DURABLE_OPS:
                m = result["ops"][op]
                assert positive(m["seconds"]) and positive(m["mb_s"]), (backend, op, m)
                assert len(m["samples"]) == durable["meta"]["repeats"]
            for key in DURABLE_RATIOS:
                assert positive(result["ratios"][key]), (backend, key, result["ratios"])
        for op in DURABLE_OPS:
            assert positive(entry["obstore_over_fsspec"][op]), (op, entry["obstore_over_fsspec"])
    md = (out / "durable-quick.md").read_text(encoding="utf-8")
    assert durable["meta"]["command"] in md and "obstore ÷ fsspec" in md
    assert "Durable tier: throughput ratios" in (out / "quick.md").read_text(encoding="utf-8")


def test_durable_benchmark_says_so_when_the_s3_server_does_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import run

    import durable

    def no_server() -> None:
        raise RuntimeError("SeaweedFS binary 'weed' not found")

    monkeypatch.setattr(durable, "start_server", no_server)
    rc = durable.main(["--quick", "--out", str(tmp_path), "--workdir", str(tmp_path)])
    assert rc == 1
    results = json.loads((tmp_path / "durable-quick.json").read_text(encoding="utf-8"))
    assert "did not start" in results["error"] and "weed' not found" in results["error"]
    assert results["sizes"] == []
    md = (tmp_path / "durable-quick.md").read_text(encoding="utf-8")
    assert "Durable tier: not measured" in md and "weed' not found" in md
    section = run.durable_section(results, "durable-quick")
    assert "not measured" in section and "weed' not found" in section


def test_quick_mode_measures_the_certificate_cost(quick_run: tuple[Path, dict]) -> None:
    out, results = quick_run
    cert = results["certificate"]
    assert "error" not in cert, cert
    for key in ("fingerprint_s", "fingerprint_data_s", "save_not_due_s", "tiny_step_s"):
        assert positive(cert[key]), (key, cert)
    assert "## Exact-resume certificate: cost per step" in (out / "quick.md").read_text()


@pytest.mark.slow
def test_quick_mode_times_a_restart_in_new_interpreters(quick_run: tuple[Path, dict]) -> None:
    """A restart imports torch and its library in a new interpreter, then restores: each
    method's wait is split into its parts, and only stalwart's imports include DCP's."""
    out, results = quick_run
    restart = results["restart"]
    assert "error" not in restart, restart
    assert positive(restart["state"]["bytes"])
    for method in ("raw_read", "stalwart", "torch_load"):
        for cache in ("cold", "warm"):
            t = restart["methods"][method][cache]
            assert positive(t["restore_s"]) and positive(t["startup_s"]), (method, cache, t)
            parts = t["startup_s"] + t["imports_s"] + t["restore_s"]
            assert math.isclose(t["restart_s"], parts), (method, cache, t)
    stalwart_cold = restart["methods"]["stalwart"]["cold"]
    for key in ("import_torch_s", "import_dcp_s", "import_stalwart_s"):
        assert positive(stalwart_cold[key]), (key, stalwart_cold)
    assert (
        stalwart_cold["imports_s"]
        >= stalwart_cold["import_torch_s"] + stalwart_cold["import_dcp_s"]
    )
    assert "import_dcp_s" not in restart["methods"]["torch_load"]["cold"]
    assert restart["methods"]["raw_read"]["cold"]["imports_s"] < stalwart_cold["import_torch_s"]
    md = (out / "quick.md").read_text(encoding="utf-8")
    assert "## A restart's wait: a new interpreter" in md
    assert "| stalwart: `CheckpointManager(run).restore(state)` (verified) |" in md


def test_a_restart_that_restores_other_values_fails_the_measurement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each new interpreter checks what it restored against the saved model: a checkpoint
    holding other values makes the measurement fail instead of timing a wrong restore."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import measure
    import restart
    import torch

    nbytes = 256 * 1024
    restart._spawn(["prepare", str(tmp_path), str(nbytes)], timeout=120)
    out, _ = restart._spawn(["child", "torch_load", str(tmp_path), str(nbytes), "warm", "1"], 120)
    assert positive(out["times"]["restore_s"])
    other, other_opt, _state = measure.build_state(nbytes, seed=5)
    torch.save(
        {"model": other.state_dict(), "optimizer": other_opt.state_dict()}, tmp_path / "state.pt"
    )
    with pytest.raises(RuntimeError, match="restored other values"):
        restart._spawn(["child", "torch_load", str(tmp_path), str(nbytes), "warm", "1"], 120)


def test_the_restart_section_gives_throughput_against_the_raw_read_and_says_when_not_cold() -> None:
    def timed(restore: float, imports: float = 1.0) -> dict[str, float]:
        return {
            "startup_s": 0.02,
            "imports_s": imports,
            "restore_s": restore,
            "restart_s": 0.02 + imports + restore,
        }

    stalwart = {
        "cold": {
            **timed(0.2, 1.5),
            "import_torch_s": 1.0,
            "import_dcp_s": 0.4,
            "import_stalwart_s": 0.1,
        },
        "warm": timed(0.1, 1.5),
        "cold_dropped": True,
    }
    results = {
        "restart": {
            "state": {"bytes": 2**28},
            "repeats": 3,
            "methods": {
                "raw_read": {
                    "cold": timed(0.1, 0.0),
                    "warm": timed(0.04, 0.0),
                    "cold_dropped": True,
                },
                "stalwart": stalwart,
                "torch_load": {"cold": timed(0.16), "warm": timed(0.08), "cold_dropped": False},
            },
        }
    }
    lines: list[str] = []
    bench_report()._restart_section(results, lines.append)
    text = "\n".join(lines)
    assert "(~256 MiB state)" in text
    row = next(line for line in lines if line.startswith("| stalwart"))
    assert row.endswith("| 200.0 ms | 100.0 ms | 1720.0 ms | 12% | 0.50 | 0.40 |"), row
    assert "restore 1.25 cold, 1.25 warm; the whole restart 1.46 cold" in text
    assert "torch.distributed.checkpoint 400.0 ms" in text
    assert "could not be dropped" in text
    lines.clear()
    results["restart"]["methods"]["torch_load"]["cold_dropped"] = True
    bench_report()._restart_section(results, lines.append)
    assert not any("could not be dropped" in line for line in lines)


def test_quick_mode_measures_each_methods_cost_per_call_and_splits_the_misses_by_it(
    quick_run: tuple[Path, dict],
) -> None:
    """The same tensors holding almost no bytes: every method's save CPU time and warm
    restore, and the CPU and restore targets' notes say how much of them it is."""
    out, results = quick_run
    per_call = results["per_call"]
    assert "error" not in per_call, per_call
    assert per_call["tensors"] == 192 and per_call["bytes"] < 2**20
    methods = per_call["methods"]
    assert set(methods) == {"stalwart_sync", "stalwart_async", "torch_save", "dcp_save"}
    for name, m in methods.items():
        assert positive(m["cpu_s"]), (name, m)
        assert len(m["samples"]["cpu"]) == per_call["repeats"]
    for name in RESTORING_METHODS:
        assert positive(methods[name]["restore_warm_s"]), (name, methods[name])
    assert positive(methods["stalwart_sync"]["restore_fresh_warm_s"])
    by_target: dict[str, list[str]] = {}
    for t in results["targets"]:
        by_target.setdefault(t["target"], []).append(t["detail"])
    for name in ("writer CPU time", "async save's CPU time", "restore (verified)"):
        details = [d for target, ds in by_target.items() if target.startswith(name) for d in ds]
        assert details and all("of these 192 tensors costs" in d for d in details), name
    many = per_call["many"]
    assert many["tensors"] == 2304 and set(many["methods"]) == set(methods)
    for name, m in many["methods"].items():
        assert positive(m["cpu_s"]) and len(m["samples"]["cpu"]) == many["repeats"], name
    md = (out / "quick.md").read_text()
    assert "## Cost per call apart from the bytes" in md
    assert "| stalwart sync (a verified restore) |" in md
    assert "The same on 2,304 tensors" in md and "and what each of the 2,112 more tensors" in md
    table = md.split("The same on 2,304 tensors", 1)[1].split("\n\n", 2)[1].splitlines()
    (row,) = [line for line in table if line.startswith("| stalwart async |")]
    assert row.count(" µs") == 1, row  # per tensor: its save's; it restores nothing
    (row,) = [line for line in table if line.startswith("| stalwart sync")]
    assert row.count(" µs") == 3, row  # its save, its restore, its restore into fresh objects


def test_render_writes_the_same_report_again_from_a_runs_json(
    quick_run: tuple[Path, dict], tmp_path: Path
) -> None:
    """--render measures nothing: from the JSON alone it writes the run's report again,
    the targets recomputed (here by the same code, so the same markdown)."""
    out, results = quick_run
    json_path = tmp_path / "quick.json"
    stripped = {k: v for k, v in results.items() if k != "targets"}
    json_path.write_text(json.dumps(stripped), encoding="utf-8")
    durable = f"{results['durable']['name']}.json"  # its section comes from its own JSON
    (tmp_path / durable).write_bytes((out / durable).read_bytes())
    render = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--render"]
    proc = subprocess.run([*render, str(json_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "quick.md").read_text() == (out / "quick.md").read_text()
    assert json.loads(json_path.read_text())["targets"] == results["targets"]
    (tmp_path / "other.json").write_text('{"not": "a run"}', encoding="utf-8")
    proc = subprocess.run([*render, str(tmp_path / "other.json")], capture_output=True, text=True)
    assert proc.returncode == 2 and "not the JSON of a benchmark run" in proc.stderr
    assert not (tmp_path / "other.md").exists()


@pytest.mark.slow
def test_a_run_from_before_the_writes_among_the_saves_renders_as_it_was(
    quick_run: tuple[Path, dict],
) -> None:
    """A run whose raw writes were timed at the rounds' edges only (no edge keys: its
    reference is those writes) is not described as timed among the saves."""
    import copy

    _out, results = quick_run
    report = bench_report()
    old = copy.deepcopy({k: v for k, v in results.items() if k != "targets"})
    for entry in old["sizes"]:
        entry["references"].pop("raw_write_edge_s")
        entry["references"].pop("raw_write_direct_edge_s", None)
    report.analyze(old)
    md = report.markdown(old)
    assert "among the saves" not in md and "rounds' edges" not in md
    assert "floor of persist (a new file) |" in md
    new = copy.deepcopy({k: v for k, v in results.items() if k != "targets"})
    report.analyze(new)
    assert "raw write among the saves" in report.markdown(new)


def bench_measure(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/measure.py, loaded as a module (its neighbours on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # measure imports its neighbours
    spec = importlib.util.spec_from_file_location(
        "bench_measure", ROOT / "benchmarks" / "measure.py"
    )
    assert spec is not None and spec.loader is not None
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    return measure


def test_each_method_comes_first_once_in_as_many_rounds_as_there_are_methods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measure = bench_measure(monkeypatch)
    names = list(measure.INTERLEAVED)
    orders = [measure._rotated(names, i) for i in range(1, len(names) + 1)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert sorted(order[0] for order in orders) == sorted(names)


def test_the_raw_writes_take_turns_among_the_saves_under_names_no_method_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timing job keeps each rotation member's latest file under its name: a raw
    write named like a method would delete that method's checkpoint."""
    measure = bench_measure(monkeypatch)
    assert len(measure.RAW_IN_ROUND) == 2
    assert not set(measure.RAW_IN_ROUND) & set(measure.METHODS)
    names = [*measure.INTERLEAVED, *measure.RAW_IN_ROUND]
    orders = [measure._rotated(names, i) for i in range(1, len(names) + 1)]
    assert sorted(order[0] for order in orders) == sorted(names)
    with pytest.raises(ValueError, match="not one of the raw writes"):
        measure._raw_write_in_round(None, 1, "torch_save", {}, {})


def test_the_stall_breakdown_times_the_staging_copy_into_reused_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stall's staging copy is timed as every save but the first makes it: into the
    buffers an earlier save left, no buffer allocated while timed. The first save's
    copy into fresh memory is reported apart."""
    import stalwart.staging

    measure = bench_measure(monkeypatch)
    model, opt, state = measure.build_state(measure.TINY_BYTES)
    tensors = sum(1 for _ in measure.tensors_of(state.state_dict()))
    made: list[object] = []
    real = stalwart.staging._new_buffer

    def counted(t: Any, pinned: bool) -> Any:
        made.append(t)
        return real(t, pinned)

    monkeypatch.setattr(stalwart.staging, "_new_buffer", counted)
    parts = measure._stalwart_stall_breakdown(model, opt, state, repeats=3)
    assert len(made) == tensors, "buffers allocated for the first copy only"
    assert set(parts) == {
        "get_state_dict_s",
        "trainstate_state_dict_s",
        "stage_copy_s",
        "stage_copy_fresh_s",
    }
    assert all(positive(v) for v in parts.values())


def test_the_stall_parts_name_where_their_staging_copy_went() -> None:
    report = bench_report()
    old = {"trainstate_state_dict_s": 0.002, "get_state_dict_s": 0.01, "stage_copy_s": 0.068}
    assert report._stall_parts(old).endswith("stage copy into fresh memory 68.0 ms")
    new = {**old, "stage_copy_s": 0.015, "stage_copy_fresh_s": 0.07}
    text = report._stall_parts(new)
    assert "stage copy into the reused buffers 15.0 ms" in text
    assert "first save, into fresh memory: 70.0 ms" in text


def test_certificate_job_measures_the_per_step_cost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job alone, small: every number is a real, positive time, and the markdown shows it."""
    measure = bench_measure(monkeypatch)
    cert = measure.job_certificate(str(tmp_path), calls=100, rounds=2)
    assert all(positive(cert[k]) for k in ("fingerprint_s", "save_not_due_s", "tiny_step_s"))
    assert cert["fingerprint_x_tiny_step"] == cert["fingerprint_s"] / cert["tiny_step_s"]
    report = bench_report()
    lines: list[str] = []
    report._certificate_section({"certificate": cert}, lines.append)
    assert any(line.startswith("| fingerprint (RNG digest") for line in lines)


def bench_report() -> Any:
    """benchmarks/report.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def floor_row(
    async_run: dict[str, float],
    floor_run: dict[str, float],
    every: int = 5,
    side_by_side: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The "physical floor" target of one training row (stalwart async vs the floor)."""
    run = {"every": every, "bytes": 64 * 2**20, "step_s": 0.04}
    training: dict[str, Any] = {
        "runs": [
            {**run, "variant": "stalwart_async", **async_run},
            {**run, "variant": "torch_save", "overhead": 0.6},
            {**run, "variant": "floor_async", **floor_run},
        ]
    }
    if side_by_side is not None:
        training["side_by_side"] = side_by_side
    results: dict[str, Any] = {"sizes": [], "training": training}
    bench_report().analyze(results)
    (row,) = [t for t in results["targets"] if "physical floor" in t["target"]]
    return row


@pytest.mark.parametrize(("floor", "status"), [(0.02, "PASS"), (0.0, "N/A"), (-0.01, "N/A")])
def test_the_floor_target_is_reported_even_when_the_floor_costs_nothing(
    floor: float, status: str
) -> None:
    async_run = {"overhead": 0.03, "blocked_share": 0.01, "background_share": 0.02}
    row = floor_row(async_run, {"overhead": floor})
    assert row["status"] == status, row


def test_the_floor_target_is_judged_on_the_side_by_side_run_when_there_is_one() -> None:
    """The two overheads it compares come from the same moments of the host."""
    apart_async = {"overhead": 0.18, "blocked_share": 0.08, "background_share": 0.10}
    apart_floor = {"overhead": 0.06, "blocked_share": 0.05, "background_share": 0.01}
    side = {
        "every": 5,
        "rounds": 8,
        "variants": {
            "stalwart_async": {"overhead": 0.20, "blocked_share": 0.1, "rounds": 8, "bytes": 2**26},
            "floor_async": {"overhead": 0.125, "blocked_share": 0.08, "rounds": 8, "bytes": 2**26},
            "floor_async_xxh3": {
                "overhead": 0.16,
                "blocked_share": 0.08,
                "rounds": 8,
                "bytes": 2**26,
            },
        },
    }
    row = floor_row(apart_async, apart_floor, side_by_side=side)
    assert row["value"] == pytest.approx(0.20 / 0.125) and row["status"] == "PASS", row
    assert "side by side in one process" in row["detail"], row
    assert "stalwart async +18.0%, floor +6.0%" in row["detail"], row  # the other rows, told
    assert "hashes every byte (as a checksummed save must) +16.0%, 1.25x" in row["detail"], row
    # Without it (or when it failed, or at another interval), the separate runs decide.
    for other in (None, {"error": "timed out"}, {**side, "every": 20}):
        row = floor_row(apart_async, apart_floor, side_by_side=other)
        assert row["value"] == pytest.approx(3.0) and row["status"] == "MISS", (other, row)
        assert "side by side" not in row["detail"], row


def test_the_training_section_shows_the_side_by_side_run_or_says_it_failed() -> None:
    run = {
        "every": 5,
        "bytes": 2**26,
        "batch": 8,
        "threads": 1,
        "rounds": 8,
        "step_s": 0.023,
        "saves": 32,
        "overhead": 0.2,
        "blocked_share": 0.1,
        "background_share": 0.1,
        "save_call_s": 0.009,
        "save_call_max_s": 0.011,
        "logged_stall_s": 0.008,
    }
    side = {
        "every": 5,
        "rounds": 8,
        "variants": {
            "stalwart_async": {**run, "overhead": 0.195},
            "floor_async": {**run, "overhead": 0.12},
            "floor_async_xxh3": {"error": "timed out"},
        },
    }

    def section(side_by_side: dict[str, Any] | None) -> str:
        training: dict[str, Any] = {"runs": [{**run, "variant": "stalwart_async"}]}
        if side_by_side is not None:
            training["side_by_side"] = side_by_side
        lines: list[str] = []
        bench_report()._training_section({"training": training}, lines.append)
        return "\n".join(lines)

    shown = section(side)
    assert "Side by side in one process, checkpoint every 5 steps" in shown, shown
    assert "| stalwart async | 23.0 ms | 32 | +19.5% | +10.0% | +10.0% | 8 |" in shown, shown
    assert "| *ref: memcpy + raw write in a thread (async floor)* | 23.0 ms | 32 | +12.0%" in shown
    assert "hashing every byte as it writes (floor with checksum)* | error | | timed out" in shown
    failed = section({"error": "process exited with code 1"})
    assert "Side by side in one process: failed (process exited with code 1)" in failed, failed
    assert "Side by side" not in section(None)  # a run from before this measurement


@pytest.mark.parametrize(
    ("total", "blocked", "ratio"), [(0.001, 0.05, 0.3 / 0.05), (0.06, 0.05, 0.3 / 0.06)]
)
def test_a_floor_whose_background_measured_negative_counts_at_least_its_blocked_time(
    total: float, blocked: float, ratio: float
) -> None:
    """Steps beside the floor's writer cannot run faster than without it: that is noise."""
    async_run = {"overhead": 0.3, "blocked_share": 0.1, "background_share": 0.2}
    floor_run = {"overhead": total, "blocked_share": blocked, "background_share": total - blocked}
    row = floor_row(async_run, floor_run)
    assert row["value"] == pytest.approx(ratio)
    assert ("taken as its blocked time alone" in row["detail"]) == (total < blocked)


def restore_rows(
    restore: dict[str, float], floors: dict[str, float] | None = None
) -> dict[str, dict[str, Any]]:
    """The restore targets of one size whose raw read took 100 ms cold, 50 ms warm."""
    refs = {
        **(floors or {}),
        "memcpy_s": 0.01,
        "raw_write_s": 0.1,
        "raw_write_cpu_s": 0.03,
        "xxh3_s": 0.005,
        "raw_read_cold_s": 0.1,
        "raw_read_warm_s": 0.05,
        "page_cache_drop": True,
    }
    sync = {
        "stall_s": 0.1,
        "e2e_s": 0.1,
        "cpu_s": 0.04,
        "events": {"write_s": 0.09, "checksum_s": 0.0, "commit_s": 0.005},
        "restore": {"page_cache_drop": True, **restore},
    }
    entry = {"label": "64 MiB", "bytes": 64 * 2**20, "references": refs}
    results: dict[str, Any] = {"sizes": [{**entry, "methods": {"stalwart_sync": sync}}]}
    bench_report().analyze(results)
    return {t["target"]: t for t in results["targets"] if "restore" in t["target"]}


@pytest.mark.parametrize(
    ("fresh_warm", "status", "worst"),
    [(0.05, "PASS", "cold"), (0.1, "MISS", "fresh objects, warm")],
)
def test_the_restore_target_holds_only_when_every_case_does(
    fresh_warm: float, status: str, worst: str
) -> None:
    """Cold and warm, into live and into fresh objects: the worst of the four decides."""
    rows = restore_rows(
        {
            "restore_cold_s": 0.11,  # 0.91x
            "restore_warm_s": 0.05,  # 1.0x
            "restore_fresh_cold_s": 0.1,  # 1.0x
            "restore_fresh_warm_s": fresh_warm,  # 1.0x, or 0.5x
            "restore_peak_rss_mib": 70.0,
        }
    )
    row = rows["restore (verified) >= 0.8x raw read"]
    assert row["status"] == status and row["detail"].startswith(f"worst case {worst};"), row
    assert row["value"] == pytest.approx(min(0.1 / 0.11, 0.05 / fresh_warm))
    memory = rows["restore's peak extra memory <= one checkpoint's size"]
    assert memory["status"] == "MISS" and memory["value"] == pytest.approx(70 / 64), memory


def test_the_restore_target_names_the_floor_of_placing_the_bytes_and_of_checking_first() -> None:
    """A miss is told against what bounds it: the read into the tensors, then the check."""
    restore = {
        "restore_cold_s": 0.2,
        "restore_warm_s": 0.1,
        "restore_peak_rss_mib": 8.0,
    }
    floors = {
        "place_cold_s": 0.125,  # 0.8x cold
        "place_warm_s": 0.1,  # 0.5x warm
        "check_place_cold_s": 0.16,
        "check_place_warm_s": 0.08,
    }
    detail = restore_rows(restore, floors)["restore (verified) >= 0.8x raw read"]["detail"]
    assert "reading the files into the tensors alone, with no check, is 0.80x cold, 0.50x warm" in (
        detail
    ), detail
    assert "(read + xxh3, then read into place) is 0.62x cold, 0.62x warm" in detail, detail
    assert "this restore takes 1.25x / 1.25x the floor's time" in detail, detail
    # Without the new reference (a run from before it), the detail is as it was.
    old = restore_rows(restore)["restore (verified) >= 0.8x raw read"]["detail"]
    assert "into the tensors alone" not in old and old.startswith("worst case"), old


def test_the_restore_into_fresh_objects_is_told_against_its_own_floor() -> None:
    """A restore into fresh objects allocates its optimizer's state: so does its floor."""
    restore = {
        "restore_cold_s": 0.2,
        "restore_warm_s": 0.1,
        "restore_fresh_cold_s": 0.25,
        "restore_fresh_warm_s": 0.2,
        "restore_peak_rss_mib": 8.0,
    }
    floors = {
        "check_place_cold_s": 0.16,
        "check_place_warm_s": 0.08,
        "check_place_fresh_cold_s": 0.2,  # 0.5x cold
        "check_place_fresh_warm_s": 0.125,  # 0.4x warm
    }
    detail = restore_rows(restore, floors)["restore (verified) >= 0.8x raw read"]["detail"]
    assert (
        "the floor of a checked restore into fresh objects (that memory allocated anew inside "
        "the timing) is 0.50x cold, 0.40x warm, and this restore takes 1.25x / 1.60x its time"
        in detail
    ), detail
    # A run from before that reference: the fresh objects' part ends where it did.
    old = restore_rows(restore, {k: v for k, v in floors.items() if "fresh" not in k})
    assert (
        "checked restore into fresh objects"
        not in old["restore (verified) >= 0.8x raw read"]["detail"]
    )


def bench_train_stats() -> Any:
    """benchmarks/train_stats.py, loaded as a module."""
    path = ROOT / "benchmarks" / "train_stats.py"
    spec = importlib.util.spec_from_file_location("bench_train_stats", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_samples(base: list[float], ckpt: list[float], saves: int = 4) -> dict[str, Any]:
    return {
        "every": 5,
        "segment_steps": 20,
        "saves": saves,
        "base_segments_s": base,
        "ckpt_segments_s": ckpt,
        "blocked_segments_s": [b * 0.05 for b in base],
        "save_calls_s": [0.01] * saves,
        "logged_stalls_s": [0.009] * saves,
    }


def test_the_training_overhead_is_the_median_of_back_to_back_pairs() -> None:
    """A host that slows down for one pair moves that pair's two segments alike: the
    pairs' ratios stay 1.1 where the ratio of the medians would read 3.3."""
    summary = bench_train_stats().train_summary(train_samples([1.0, 1.0, 3.0], [1.1, 3.3, 3.3]))
    assert summary["overhead"] == pytest.approx(0.1)
    assert summary["blocked_share"] == pytest.approx(0.05)
    assert summary["background_share"] == pytest.approx(0.05)
    assert summary["rounds"] == 3 and summary["step_s"] == pytest.approx(1.0 / 20)


def test_a_variants_processes_are_pooled_and_a_failed_one_left_out() -> None:
    stats = bench_train_stats()
    first = stats.train_summary(train_samples([1.0, 1.0], [1.2, 1.2]))
    second = stats.train_summary(train_samples([2.0, 2.0], [2.2, 2.2], saves=3))
    pooled = stats.pooled_train_runs([first, {"error": "timed out"}, second])
    assert pooled["rounds"] == 4 and pooled["processes"] == 2 and pooled["saves"] == 7
    assert pooled["overhead"] == pytest.approx((1.2 + 1.1) / 2 - 1)  # the median of four pairs
    assert stats.pooled_train_runs([{"error": "a"}, {"error": "b"}]) == {"error": "a"}


def test_the_floor_target_is_judged_at_the_interval_the_goal_names_only() -> None:
    async_run = {"overhead": 0.3, "blocked_share": 0.1, "background_share": 0.2}
    floor_run = {"overhead": 0.05, "blocked_share": 0.02, "background_share": 0.03}
    assert floor_row(async_run, floor_run)["status"] == "MISS"  # 6x at every 5 steps
    row = floor_row(async_run, floor_run, every=20)
    assert row["status"] == "N/A" and row["value"] == pytest.approx(6.0)
    assert "shown, not judged" in row["detail"]


def _async_cpu_row(refs: dict[str, float], async_run: dict[str, Any]) -> dict[str, Any]:
    """The async save's CPU target row of a 64 MiB result with ``refs`` (plus the stall
    references) and the async method's numbers ``async_run``."""
    refs = {"memcpy_s": 0.010, "clone_s": 0.012, "raw_write_s": 0.1, **refs}
    events = {"write_s": 0.09, "checksum_s": 0.0, "commit_s": 0.005, "stage_s": 0.01}
    run = {"stall_s": 0.1, "e2e_s": 0.1, "cpu_s": 0.04, "events": events}
    entry = {"label": "64 MiB", "bytes": 64 * 2**20, "references": refs}
    methods = {"stalwart_sync": run, "stalwart_async": {**run, "stall_s": 0.01, **async_run}}
    results: dict[str, Any] = {"sizes": [{**entry, "methods": methods}]}
    bench_report().analyze(results)
    (row,) = [t for t in results["targets"] if t["target"].startswith("async save's CPU")]
    return row


def test_the_async_cpu_target_names_the_floor_of_a_staged_checksummed_save() -> None:
    """memcpy + xxh3 + a raw write, direct and buffered, each as a ratio to the raw write."""
    refs = {"xxh3_s": 0.006, "raw_write_cpu_s": 0.020, "raw_write_direct_cpu_s": 0.004}
    row = _async_cpu_row(refs, {"cpu_s": 0.05})
    assert row["value"] == pytest.approx(2.5)
    assert "the floor of a staged, checksummed save): 20.0 ms (1.00x) with" in row["detail"]
    assert "36.0 ms (1.80x) through the page cache" in row["detail"]
    del refs["raw_write_direct_cpu_s"]  # an older run's results: no floor named
    assert "staged" not in _async_cpu_row(refs, {"cpu_s": 0.05})["detail"]
    assert "of it, the training thread" not in row["detail"]  # no split measured: none claimed


def test_the_async_cpu_target_splits_the_save_into_the_training_thread_and_the_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The save of least CPU time, split into its caller's thread and the rest; the
    background part as a ratio to the raw write's CPU time."""
    measure = bench_measure(monkeypatch)
    split = measure._cpu_split([0.05, 0.03, 0.04], [0.02, 0.012, 0.001])
    assert split == {"caller_cpu_s": 0.012, "background_cpu_s": pytest.approx(0.018)}
    assert measure._cpu_split([0.05], []) == {}  # not paired: nothing claimed
    row = _async_cpu_row({"xxh3_s": 0.006, "raw_write_cpu_s": 0.020}, {**split, "cpu_s": 0.03})
    assert "of it, the training thread 12.0 ms" in row["detail"]
    assert "the background writer 18.0 ms, 0.90x the raw write's" in row["detail"]
