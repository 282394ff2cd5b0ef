"""The arithmetic behind `stalwart plan`, pinned on worked examples and by properties."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.cli.planner import (
    ASSUMED_NODE_MTBF_S,
    GPU_MEMORY,
    STRATEGIES,
    PlanInputs,
    checkpoint_bytes_per_param,
    choose_strategy,
    daly_interval,
    make_plan,
    overhead_fraction,
    state_bytes_per_param,
    wall_time_ratio,
    young_interval,
)
from stalwart.cli.units import parse_bandwidth, parse_count, parse_duration, parse_size

from .conftest import cli

MIN, HOUR, DAY = 60.0, 3600.0, 86400.0
GB = 1e9


def plan(**kwargs: object) -> dict:
    return make_plan(PlanInputs(**kwargs))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- worked examples


def test_7b_adamw_on_8x80gb_does_not_fit_ddp_and_fits_fsdp2():
    """16 B/param * 7e9 = 112 GB > 60 GB (75% of 80 GB); sharded over 8: 14 GB per GPU."""
    p = plan(params=7 * 10**9, gpus_per_node=8, gpu_memory=80 * GB)
    assert p["memory"]["state_total_bytes"] == 112 * GB
    assert p["memory"]["gpu_budget_bytes"] == 60 * GB
    assert p["memory"]["fits_ddp"] is False
    assert p["strategy"] == "fsdp2"
    assert p["memory"]["state_per_gpu_bytes"] == 14 * GB


def test_a_bare_gpu_memory_is_refused_with_a_hint_never_read_as_bytes(capsys):
    """`--gpu-mem 80` once meant 80 bytes and recommended CPU offload for 7B on 64 GPUs."""
    code, _out, err = cli(capsys, "plan", "--params", "7B", "--gpus", "8", "--nodes", "8",
                          "--gpu-mem", "80")  # fmt: skip
    assert code == 2
    assert "80GB or 80GiB" in err and "Traceback" not in err
    code, out, err = cli(capsys, "plan", "--params", "7B", "--gpus", "8", "--nodes", "8",
                         "--gpu-mem", "80GB", "--json")  # fmt: skip
    assert code == 0, err
    p = json.loads(out)
    assert p["strategy"] == "fsdp2"
    assert p["memory"]["state_per_gpu_bytes"] == pytest.approx(112 * GB / 64)
    with pytest.raises(ValueError, match=r"did you mean 80 GB"):
        plan(params=7 * 10**9, gpus_per_node=8, nodes=8, gpu_memory=80)
    code, _out, err = cli(capsys, "plan", "--params", "7B", "--host-mem", "512")
    assert code == 2 and "512GB or 512GiB" in err


def test_daly_interval_for_5_minutes_and_24_hours_is_about_117_minutes():
    """sqrt(2CM) = 7200 s and sqrt(C/2M) = 1/24, so 7200 (1 + 1/72 + 1/5184) - 300 = 7001.39 s."""
    assert young_interval(5 * MIN, 24 * HOUR) == pytest.approx(7200.0)
    tau = daly_interval(5 * MIN, 24 * HOUR)
    assert tau == pytest.approx(7200 * (1 + 1 / 72 + 1 / 5184) - 300)
    assert tau / MIN == pytest.approx(116.69, abs=0.01)


def test_daly_interval_is_the_mtbf_when_a_checkpoint_costs_twice_the_mtbf():
    assert daly_interval(2 * HOUR, 1 * HOUR) == HOUR
    assert daly_interval(10 * HOUR, 1 * HOUR) == HOUR
    # just below the threshold the formula gives (2 + 2/3 + 2/9 - 2) M = 0.889 M
    assert daly_interval(2 * HOUR - 1e-6, HOUR) / HOUR == pytest.approx(8 / 9, rel=1e-6)


def test_a_small_model_fits_one_gpu_and_gets_ddp():
    p = plan(params=125 * 10**6, gpus_per_node=8, gpu_memory=GPU_MEMORY["a100-40"])
    assert p["strategy"] == "ddp"
    assert p["memory"]["state_per_gpu_bytes"] == 125e6 * 16
    assert "DistributedDataParallel" in p["code"]["wrap"]


def test_a_model_under_memory_pressure_on_small_gpus_gets_fsdp2():
    """1.3B AdamW is 20.8 GB of state: over the 18 GB budget of a 24 GB L4, 2.6 GB sharded over 8."""
    p = plan(params=1_300_000_000, gpus_per_node=8, gpu_memory=GPU_MEMORY["l4"])
    assert p["strategy"] == "fsdp2"
    assert p["memory"]["state_per_gpu_bytes"] == pytest.approx(2.6 * GB)
    assert "fully_shard(model" in p["code"]["wrap"]
    assert "offload_policy" not in p["code"]["wrap"]


def test_a_very_large_model_gets_cpu_offload_or_zero_infinity():
    """70B AdamW: 1.12 TB of state, 140 GB per GPU sharded over 8: over the 60 GB budget."""
    p = plan(params=70 * 10**9, gpus_per_node=8, gpu_memory=80 * GB)
    assert p["strategy"] == "fsdp2-offload"
    assert "CPUOffloadPolicy()" in p["code"]["wrap"]
    assert "not checked" in p["strategy_reason"]
    roomy = plan(params=70 * 10**9, gpus_per_node=8, gpu_memory=80 * GB, host_memory=2e12)
    assert roomy["strategy"] == "fsdp2-offload"
    assert roomy["memory"]["host_per_node_bytes"] == pytest.approx(1.12e12)
    tight = plan(params=70 * 10**9, gpus_per_node=8, gpu_memory=80 * GB, host_memory=1e12)
    assert tight["strategy"] == "zero-infinity"
    assert tight["code"]["launch"].startswith("deepspeed ")


def test_more_nodes_make_a_model_fit_fsdp2_again():
    p = plan(params=70 * 10**9, gpus_per_node=8, nodes=4, gpu_memory=80 * GB)
    assert p["strategy"] == "fsdp2"
    assert p["memory"]["state_per_gpu_bytes"] == pytest.approx(35 * GB)
    assert "--nnodes=4 --nproc-per-node=8" in p["code"]["launch"]


def test_the_state_model_is_16_bytes_per_parameter_for_adamw_in_either_precision():
    mixed = state_bytes_per_param("bf16", "adamw")
    assert (mixed.weights, mixed.grads, mixed.master, mixed.optimizer) == (2, 2, 4, 8)
    full = state_bytes_per_param("fp32", "adamw")
    assert (full.weights, full.grads, full.master, full.optimizer) == (4, 4, 0, 8)
    assert mixed.total == full.total == 16
    assert state_bytes_per_param("fp16", "sgd").total == 12
    assert state_bytes_per_param("bf16", "adafactor").total == 8
    assert checkpoint_bytes_per_param("adamw") == 12
    assert checkpoint_bytes_per_param("sgd") == 8
    assert checkpoint_bytes_per_param("adafactor") == 4


def test_checkpoint_size_stalls_and_time_to_durable_for_7b_on_one_node():
    """84 GB per node at 2 GB/s blocks 42 s; async stages 10.5 GB per rank at 10 GB/s: 1.05 s."""
    p = plan(params=7 * 10**9, gpus_per_node=8, write_bw=2 * GB, copy_bw=10 * GB)
    ck = p["checkpoint"]
    assert ck["total_bytes"] == 84 * GB
    assert ck["per_rank_bytes"] == 10.5 * GB
    assert ck["per_node_bytes"] == 84 * GB
    assert ck["sync_stall_s"] == pytest.approx(42.0)
    assert ck["async_stall_s"] == pytest.approx(1.05)
    assert ck["async_save"] is True
    assert ck["time_to_durable_s"] == pytest.approx(43.05)
    assert p["interval"]["cost_s"] == pytest.approx(1.05)


def test_ddp_stages_the_whole_replica_on_every_rank_but_writes_only_its_share():
    p = plan(params=100 * 10**6, gpus_per_node=4, write_bw=1 * GB, copy_bw=10 * GB)
    ck = p["checkpoint"]
    assert p["strategy"] == "ddp"
    assert ck["per_rank_bytes"] == 1.2 * GB / 4
    assert ck["staged_per_rank_bytes"] == 1.2 * GB
    assert ck["async_stall_s"] == pytest.approx(0.12)


def test_job_mtbf_is_node_mtbf_divided_by_nodes_and_the_interval_uses_daly():
    p = plan(
        params=7 * 10**9, gpus_per_node=8, nodes=4, node_mtbf=24 * HOUR, write_bw=2 * GB,
        copy_bw=10 * GB,
    )  # fmt: skip
    iv = p["interval"]
    assert iv["mtbf_s"] == 6 * HOUR
    assert iv["daly_s"] == pytest.approx(daly_interval(iv["cost_s"], 6 * HOUR))
    assert iv["recommended_s"] == pytest.approx(iv["daly_s"])
    assert iv["failures_per_day"] == pytest.approx(4.0)
    restart = p["checkpoint"]["restart_s"]
    assert restart == pytest.approx(300 + 21 * GB / (2 * GB))
    assert iv["expected_lost_per_failure_s"] == pytest.approx(
        iv["recommended_s"] / 2 + p["checkpoint"]["sync_stall_s"] + restart
    )


def test_a_given_job_mtbf_overrides_the_node_mtbf():
    p = plan(params=10**9, nodes=8, node_mtbf=24 * HOUR, job_mtbf=1 * HOUR)
    assert p["interval"]["mtbf_s"] == HOUR


def test_without_an_mtbf_fault_tolerance_assumes_one_and_resume_plans_no_interval():
    assumed = plan(params=10**9, nodes=2)
    assert assumed["interval"]["mtbf_s"] == ASSUMED_NODE_MTBF_S / 2
    assert "assumed" in assumed["interval"]["mtbf_source"]
    resume = plan(params=10**9, need="resume")
    assert resume["interval"]["recommended_s"] is None
    assert "every_seconds=3600" in resume["code"]["manager"]
    assert "--max-restarts=0" in resume["code"]["launch"]


def test_the_manager_line_uses_steps_when_the_step_time_is_known():
    p = plan(params=7 * 10**9, gpus_per_node=8, node_mtbf=24 * HOUR, step_time=1.5)
    steps = round(p["interval"]["recommended_s"] / 1.5)
    assert p["interval"]["every_steps"] == steps
    assert p["code"]["manager"] == (
        f'stalwart.CheckpointManager("runs/exp1", every_steps={steps}, keep_last=3, '
        "async_save=True)"
    )


def test_async_interval_is_never_shorter_than_the_time_a_save_takes_to_be_durable():
    """Slow storage, fast copies: Daly would save every few minutes, but saves cannot overlap."""
    p = plan(params=7 * 10**9, gpus_per_node=8, node_mtbf=2 * HOUR, write_bw=50e6)
    iv, ck = p["interval"], p["checkpoint"]
    assert iv["daly_s"] < ck["async_time_to_durable_s"]
    assert iv["recommended_s"] == pytest.approx(ck["async_time_to_durable_s"])
    assert any("cannot overlap" in w for w in p["warnings"])


def test_without_host_memory_for_staging_the_plan_falls_back_to_sync_saves():
    p = plan(params=7 * 10**9, gpus_per_node=8, host_memory=64 * GB)
    assert p["checkpoint"]["async_save"] is False
    assert "async_save" not in p["code"]["manager"]
    assert any("planning sync saves" in w for w in p["warnings"])


def test_overhead_matches_daly_complete_model_by_hand():
    """tau = 1 h, C = 60 s, M = 24 h, R = 10 min: M e^(R/M) (e^((tau+C)/M) - 1) / tau."""
    tau, c, m, r = HOUR, 60.0, DAY, 600.0
    ratio = m * math.exp(r / m) * (math.exp((tau + c) / m) - 1) / tau
    assert wall_time_ratio(tau, c, m, r) == pytest.approx(ratio, rel=1e-12)
    assert overhead_fraction(tau, c, m, r) == pytest.approx(1 - 1 / ratio)
    # first order: C/tau + tau/2M + R/M = 1.67% + 2.08% + 0.69% = 4.44%
    assert overhead_fraction(tau, c, m, r) == pytest.approx(0.0437, abs=1e-4)


@pytest.mark.parametrize(
    ("text", "value"),
    [("125M", 125 * 10**6), ("1.3B", 1_300_000_000), ("7b", 7 * 10**9), ("7e9", 7 * 10**9),
     ("70B", 70 * 10**9), ("350K", 350_000), ("1T", 10**12), ("2G", 2 * 10**9)],
)  # fmt: skip
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [("80GB", 80e9), ("80G", 80e9), ("80GiB", 80 * 2**30), ("40 GB", 40e9), ("512MB", 512e6),
     ("1TB", 1e12), ("2048B", 2048)],
)  # fmt: skip
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [("2GB/s", 2e9), ("500MB/s", 500e6), ("1GiB/s", 2**30), ("10Gb/s", 1.25e9),
     ("10Gbps", 1.25e9), ("2GB", 2e9), ("800Mbit/s", 100e6)],
)  # fmt: skip
def test_parse_bandwidth(text, value):
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize(
    ("text", "value"),
    [("24h", DAY), ("30m", 30 * MIN), ("90s", 90.0), ("7d", 7 * DAY), ("1h30m", 90 * MIN),
     ("1.5h", 90 * MIN), ("2w", 14 * DAY)],
)  # fmt: skip
def test_parse_duration(text, value):
    assert parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize(
    ("parse", "text", "fragment"),
    [
        (parse_count, "7X", "unknown suffix"),
        (parse_count, "seven", "not a number"),
        (parse_count, "0", "less than one"),
        (parse_size, "80GQ", "unknown unit"),
        (parse_size, "80", "no unit: give one, e.g. 80GB or 80GiB"),
        (parse_bandwidth, "2", "no unit: give one, e.g. 2GB/s"),
        (parse_bandwidth, "2GB/h", "unknown unit"),
        (parse_duration, "24", "give a number with a unit"),
        (parse_duration, "3 fortnights", "unknown unit"),
    ],
)
def test_parse_errors_name_the_value_and_the_fix(parse, text, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        parse(text)
    assert repr(text) in str(info.value)


def test_plan_inputs_refuse_nonsense_naming_the_field():
    with pytest.raises(ValueError, match="gpus_per_node"):
        PlanInputs(params=10**9, gpus_per_node=0)
    with pytest.raises(ValueError, match="precision"):
        PlanInputs(params=10**9, precision="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="usable_fraction"):
        PlanInputs(params=10**9, usable_fraction=1.5)
    with pytest.raises(ValueError, match="write_bw"):
        PlanInputs(params=10**9, write_bw=0)


# ----------------------------------------------------------------------------- properties

seconds = st.floats(min_value=1.0, max_value=1e7, allow_nan=False, allow_infinity=False)


def _below_threshold(cost: float, mtbf: float) -> bool:
    return cost < 2 * mtbf


@given(cost=seconds, mtbf=seconds, factor=st.floats(min_value=1.001, max_value=100.0))
def test_a_longer_mtbf_never_shortens_the_interval(cost, mtbf, factor):
    """Within the formula's domain C < 2M (above it Daly's tau = M jumps; pinned separately)."""
    if not (_below_threshold(cost, mtbf) and _below_threshold(cost, mtbf * factor)):
        return
    assert daly_interval(cost, mtbf * factor) > daly_interval(cost, mtbf)
    assert young_interval(cost, mtbf * factor) > young_interval(cost, mtbf)


@given(cost=seconds, mtbf=seconds, factor=st.floats(min_value=1.001, max_value=100.0))
def test_a_costlier_checkpoint_never_shortens_the_interval(cost, mtbf, factor):
    if not _below_threshold(cost * factor, mtbf):
        return
    assert daly_interval(cost * factor, mtbf) >= daly_interval(cost, mtbf)
    assert young_interval(cost * factor, mtbf) > young_interval(cost, mtbf)


@given(cost=seconds, mtbf=seconds)
def test_daly_saves_a_little_more_often_than_young_and_loses_no_more_time(cost, mtbf):
    if not _below_threshold(cost, mtbf):
        return
    daly, young = daly_interval(cost, mtbf), young_interval(cost, mtbf)
    assert 0 < daly < young
    assert wall_time_ratio(daly, cost, mtbf, 0.0) <= wall_time_ratio(young, cost, mtbf, 0.0) * (
        1 + 1e-12
    )


def _exact_optimum(cost: float, mtbf: float) -> float:
    """Golden-section search of Daly's complete model over log(tau)."""
    lo, hi = math.log(1e-6 * mtbf), math.log(5 * mtbf)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if wall_time_ratio(math.exp(a), cost, mtbf, 0.0) < wall_time_ratio(
            math.exp(b), cost, mtbf, 0.0
        ):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2)


@settings(max_examples=50)
@given(mtbf=st.floats(min_value=600.0, max_value=1e7), share=st.floats(1e-6, 0.1))
def test_daly_is_within_half_a_percent_of_the_exact_optimum_when_checkpoints_are_cheap(mtbf, share):
    cost = share * mtbf
    tau = daly_interval(cost, mtbf)
    assert tau == pytest.approx(_exact_optimum(cost, mtbf), rel=5e-3)


@given(cost=seconds, mtbf=seconds, restart=st.floats(0.0, 1e5), factor=st.floats(1.01, 100.0))
def test_a_longer_mtbf_means_less_overhead_at_the_recommended_interval(cost, mtbf, restart, factor):
    if not (cost < 0.5 * mtbf and restart < mtbf):
        return
    before = overhead_fraction(daly_interval(cost, mtbf), cost, mtbf, restart)
    after = overhead_fraction(daly_interval(cost, mtbf * factor), cost, mtbf * factor, restart)
    assert 0 < after < before < 1


params = st.integers(min_value=10**6, max_value=10**13)
gpus = st.integers(min_value=1, max_value=16)
nodes = st.integers(min_value=1, max_value=64)
memory = st.floats(min_value=8e9, max_value=2e11)


def _rank(strategy: str) -> int:
    return STRATEGIES.index(strategy)  # type: ignore[arg-type]


@given(p=params, extra=params, g=gpus, n=nodes, mem=memory)
def test_a_bigger_model_never_gets_a_lighter_strategy(p, extra, g, n, mem):
    def pick(count: int) -> str:
        return choose_strategy(
            state_bytes=16 * count, world_size=g * n, nodes=n, gpu_memory=mem, host_memory=1e12
        )

    assert _rank(pick(p + extra)) >= _rank(pick(p))


@given(p=params, g=gpus, more=gpus, n=nodes, mem=memory, extra_mem=memory)
def test_more_gpus_or_more_memory_never_get_a_heavier_strategy(p, g, more, n, mem, extra_mem):
    def pick(gpus_per_node: int, gpu_memory: float) -> str:
        return choose_strategy(
            state_bytes=16 * p, world_size=gpus_per_node * n, nodes=n, gpu_memory=gpu_memory
        )

    assert _rank(pick(g + more, mem)) <= _rank(pick(g, mem))
    assert _rank(pick(g, mem + extra_mem)) <= _rank(pick(g, mem))


@given(p=params, g=gpus, n=nodes)
def test_checkpoint_bytes_split_evenly_and_add_up(p, g, n):
    ck = plan(params=p, gpus_per_node=g, nodes=n)["checkpoint"]
    assert ck["total_bytes"] == 12 * p
    assert ck["per_rank_bytes"] * g * n == pytest.approx(ck["total_bytes"])
    assert ck["per_node_bytes"] * n == pytest.approx(ck["total_bytes"])


@given(n=st.integers(1, 10**12), h=st.floats(0.01, 1e4))
def test_parsers_read_back_what_they_print(n, h):
    assert parse_count(str(n)) == n
    assert parse_duration(f"{h}h") == pytest.approx(h * HOUR)
