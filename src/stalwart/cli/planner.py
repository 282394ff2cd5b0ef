"""Capacity and checkpoint-interval planning: pure arithmetic behind ``stalwart plan``.

No torch, no I/O: every function maps numbers to numbers, so the arithmetic can
be pinned by worked examples and property tests. Units are bytes, bytes per
second and seconds throughout; ``stalwart.cli.units`` reads what people type
(``7B``, ``80GB``, ``2GB/s``, ``24h``).

The models, and what they leave out
-----------------------------------

*Training state per parameter* (the ZeRO paper's accounting: Rajbhandari et al.
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
section 3.1): mixed precision (``bf16``/``fp16``) keeps 2-byte parameters and
2-byte gradients for compute plus an fp32 master copy of the weights (4 bytes);
``fp32`` keeps 4-byte parameters and gradients and no master copy. Optimizer
state is fp32: AdamW keeps two moments (8 bytes), SGD one momentum buffer (4
bytes; plain SGD without momentum keeps none, so this over-estimates it), and
Adafactor a factored second moment of O(rows + cols) per matrix, counted as 0.
So AdamW costs 16 bytes per parameter in either precision, SGD 12, Adafactor 8.
Activations, the temporarily unsharded layer of FSDP, communication buffers,
the CUDA context and allocator fragmentation are *not* modeled: they must fit in
the headroom left by ``usable_fraction`` (75% of GPU memory by default).

*Checkpoint content*: what a restore needs to continue exactly, i.e. the fp32
weights (the master copy in mixed precision: with FSDP2's
``MixedPrecisionPolicy`` the sharded parameters *are* fp32) and the optimizer
state; gradients and low-precision compute copies are not saved. AdamW: 12 bytes
per parameter. DCP writes each replicated tensor once (deduplicated across
ranks) and each shard by its owner, so every rank writes about 1/world of it.

*Failures* are independent and exponentially distributed: a job on N nodes whose
node MTBF is M_node fails with MTBF M = M_node / N.

*Checkpoint interval*: Young (1974), "A first order approximation to the
optimum checkpoint interval", Communications of the ACM 17(9):530-531, gives
tau = sqrt(2 C M) for checkpoint cost C and MTBF M. Daly (2006), "A higher order
estimate of the optimum checkpoint interval for restart dumps", Future
Generation Computer Systems 22(3):303-312, refines it to
tau = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C for C < 2M, and
tau = M otherwise, and gives the expected wall-clock time of a job of solve time
T_s as M e^(R/M) (e^((tau + C)/M) - 1) T_s / tau with restart time R. Both
count tau as compute time between the ends of two checkpoints, excluding C.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from stalwart.cli.units import format_size
from stalwart.continuous import check_seconds, daly_interval, young_interval  # shared

__all__ = [
    "ASSUMED_NODE_MTBF_S",
    "GPU_MEMORY",
    "OPTIMIZERS",
    "PRECISIONS",
    "STRATEGIES",
    "PlanInputs",
    "StateBytes",
    "checkpoint_bytes_per_param",
    "choose_strategy",
    "code_lines",
    "daly_interval",
    "make_plan",
    "overhead_fraction",
    "state_bytes_per_param",
    "wall_time_ratio",
    "young_interval",
]

Precision = Literal["bf16", "fp16", "fp32"]
Optimizer = Literal["adamw", "sgd", "adafactor"]
Strategy = Literal["ddp", "fsdp2", "fsdp2-offload", "zero-infinity"]
Need = Literal["fault-tolerance", "resume"]

PRECISIONS: tuple[Precision, ...] = ("bf16", "fp16", "fp32")
OPTIMIZERS: tuple[Optimizer, ...] = ("adamw", "sgd", "adafactor")
STRATEGIES: tuple[Strategy, ...] = ("ddp", "fsdp2", "fsdp2-offload", "zero-infinity")
"""From lightest to heaviest; ``choose_strategy`` returns the first that fits."""

GPU_MEMORY: dict[str, int] = {
    "h100": 80 * 10**9,
    "a100-40": 40 * 10**9,
    "a100-80": 80 * 10**9,
    "h200": 141 * 10**9,
    "l4": 24 * 10**9,
}
"""Nominal memory of common GPUs, in decimal bytes as the vendor states it."""

ASSUMED_NODE_MTBF_S = 6000 * 3600.0
"""Node MTBF assumed when none is given: about 6,000 hours.

Meta's Llama 3 report (Dubey et al. 2024, section 3.3.4) counts 419 unexpected
interruptions in 54 days of pre-training on 16,384 H100s (2,048 nodes of 8):
54 * 24 h * 2,048 / 419 = 6,335 node-hours per failure.
"""

# ----------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StateBytes:
    """Bytes of training state per parameter, by part (see the module docstring)."""

    weights: int
    """Parameters as the model computes with them (2 in mixed precision, 4 in fp32)."""
    grads: int
    """Gradients, same dtype as the weights."""
    master: int
    """fp32 master copy of the weights (mixed precision only)."""
    optimizer: int
    """Optimizer state, fp32."""

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.optimizer


_OPTIMIZER_BYTES: dict[str, int] = {"adamw": 8, "sgd": 4, "adafactor": 0}


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}")


def state_bytes_per_param(precision: str, optimizer: str) -> StateBytes:
    """Training-state bytes per parameter (ZeRO paper accounting; module docstring).

    >>> state_bytes_per_param("bf16", "adamw").total
    16
    """
    _check_choice(precision, PRECISIONS, "precision")
    _check_choice(optimizer, OPTIMIZERS, "optimizer")
    low = precision != "fp32"
    return StateBytes(
        weights=2 if low else 4,
        grads=2 if low else 4,
        master=4 if low else 0,
        optimizer=_OPTIMIZER_BYTES[optimizer],
    )


def checkpoint_bytes_per_param(optimizer: str) -> int:
    """Checkpoint bytes per parameter: fp32 weights plus fp32 optimizer state (AdamW: 12)."""
    _check_choice(optimizer, OPTIMIZERS, "optimizer")
    return 4 + _OPTIMIZER_BYTES[optimizer]


def choose_strategy(
    *,
    state_bytes: float,
    world_size: int,
    nodes: int,
    gpu_memory: float,
    usable_fraction: float = 0.75,
    host_memory: float | None = None,
) -> Strategy:
    """The lightest parallelism whose per-device training state fits.

    - ``ddp``: the whole state (``state_bytes``) fits in ``usable_fraction`` of one GPU;
    - ``fsdp2``: the state sharded over all ``world_size`` GPUs fits there;
    - ``fsdp2-offload``: it does not, so sharded state lives in host memory
      (FSDP2 ``CPUOffloadPolicy``, or DeepSpeed ZeRO-3 with CPU offload); each
      node holds ``state_bytes / nodes``, which must fit in ``usable_fraction``
      of ``host_memory`` when that is known;
    - ``zero-infinity``: not even host memory holds it; offload to NVMe
      (DeepSpeed ZeRO-Infinity).
    """
    budget = usable_fraction * gpu_memory
    if state_bytes <= budget:
        return "ddp"
    if state_bytes / world_size <= budget:
        return "fsdp2"
    if host_memory is None or state_bytes / nodes <= usable_fraction * host_memory:
        return "fsdp2-offload"
    return "zero-infinity"


# ----------------------------------------------------------------------- intervals


def wall_time_ratio(interval: float, cost: float, mtbf: float, restart: float) -> float:
    """Expected wall-clock time per unit of useful compute (Daly 2006, complete model).

    M e^(R/M) (e^((tau + C)/M) - 1) / tau: failures are Poisson with mean time
    M, each costs a restart R plus the work since the last checkpoint, and each
    checkpoint blocks for C. Always > 1; equals 1 + C/tau when M is infinite.
    """
    check_seconds(interval=interval, mtbf=mtbf)
    if cost < 0 or restart < 0:
        raise ValueError(f"cost and restart must be >= 0, got {cost!r} and {restart!r}")
    return mtbf * math.exp(restart / mtbf) * math.expm1((interval + cost) / mtbf) / interval


def overhead_fraction(interval: float, cost: float, mtbf: float, restart: float) -> float:
    """Fraction of wall-clock time not spent on useful compute: 1 - 1 / ``wall_time_ratio``."""
    return 1.0 - 1.0 / wall_time_ratio(interval, cost, mtbf, restart)


# ----------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    """Everything ``make_plan`` needs, in bytes, bytes/s and seconds."""

    params: int
    """Number of model parameters."""
    precision: Precision = "bf16"
    """``bf16``/``fp16``: mixed precision with fp32 master weights; ``fp32``: none."""
    optimizer: Optimizer = "adamw"
    """``adamw``, ``sgd`` (with momentum) or ``adafactor``."""
    gpus_per_node: int = 1
    """GPUs (ranks) per node."""
    nodes: int = 1
    """Number of nodes."""
    gpu_memory: float = GPU_MEMORY["h100"]
    """Memory of one GPU, bytes."""
    usable_fraction: float = 0.75
    """Share of GPU (and host) memory the training state may use; the rest is headroom."""
    host_memory: float | None = None
    """Host memory per node, bytes; None: not checked."""
    node_mtbf: float | None = None
    """Mean time between failures of one node, seconds."""
    job_mtbf: float | None = None
    """MTBF of the whole job, seconds; overrides ``node_mtbf / nodes``."""
    write_bw: float = 1e9
    """Checkpoint write bandwidth per node, bytes/s."""
    read_bw: float | None = None
    """Checkpoint read bandwidth per node, bytes/s; None: same as ``write_bw``."""
    copy_bw: float = 10e9
    """Device-to-host (staging) copy bandwidth per rank, bytes/s, for async saves."""
    restart_overhead: float = 300.0
    """Seconds from a failure until training runs again, without reading the checkpoint
    (detection, rescheduling, process start, process group setup)."""
    step_time: float | None = None
    """Seconds per training step, to express the interval in steps."""
    need: Need = "fault-tolerance"
    """``fault-tolerance``: plan the interval against failures; ``resume``: only
    survive planned stops (preemption, time limits) and resume exactly."""

    def __post_init__(self) -> None:
        _check_choice(self.precision, PRECISIONS, "precision")
        _check_choice(self.optimizer, OPTIMIZERS, "optimizer")
        _check_choice(self.need, ("fault-tolerance", "resume"), "need")
        for name in ("params", "gpus_per_node", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("gpu_memory", "write_bw", "copy_bw"):
            _positive_field(name, getattr(self, name))
        for name in ("host_memory", "node_mtbf", "job_mtbf", "read_bw", "step_time"):
            if getattr(self, name) is not None:
                _positive_field(name, getattr(self, name))
        for name in ("gpu_memory", "host_memory"):
            value = getattr(self, name)
            # No accelerator or host has under 1 MiB: 80 here means 80 GB given in the wrong unit.
            if value is not None and value < 2**20:
                raise ValueError(
                    f"{name} is in bytes, got {value!r}; did you mean {value!r} GB "
                    f"({name}={value!r}e9)?"
                )
        if not 0 < self.usable_fraction <= 1:
            raise ValueError(f"usable_fraction must be in (0, 1], got {self.usable_fraction!r}")
        if self.restart_overhead < 0:
            raise ValueError(f"restart_overhead must be >= 0, got {self.restart_overhead!r}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


def _positive_field(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def make_plan(inputs: PlanInputs) -> dict[str, Any]:
    """The whole plan as JSON data (the ``stalwart plan --json`` object, without ``code``).

    Keys: ``inputs``, ``memory``, ``strategy``, ``checkpoint``, ``interval``,
    ``retention``, ``warnings``. All sizes in bytes, times in seconds.
    """
    p = inputs
    world = p.world_size
    per_param = state_bytes_per_param(p.precision, p.optimizer)
    state_total = p.params * per_param.total
    strategy = choose_strategy(
        state_bytes=state_total,
        world_size=world,
        nodes=p.nodes,
        gpu_memory=p.gpu_memory,
        usable_fraction=p.usable_fraction,
        host_memory=p.host_memory,
    )
    sharded = strategy != "ddp"
    per_gpu = state_total / world if strategy == "fsdp2" else state_total
    if strategy in ("fsdp2-offload", "zero-infinity"):
        per_gpu = 0.0  # only the working layer, which is not modeled
    warnings: list[str] = []

    ckpt_total = float(p.params * checkpoint_bytes_per_param(p.optimizer))
    per_rank_written = ckpt_total / world
    per_node_written = ckpt_total / p.nodes
    # The async staging copy is of the rank's whole state dict: the full replica
    # under DDP (DCP deduplicates only when writing), the shard under FSDP2.
    per_rank_staged = per_rank_written if sharded else ckpt_total
    read_bw = p.read_bw if p.read_bw is not None else p.write_bw
    write_s = per_node_written / p.write_bw
    async_stall = per_rank_staged / p.copy_bw
    async_durable = async_stall + write_s
    use_async = async_stall < write_s
    host_used = state_total / p.nodes if strategy in ("fsdp2-offload", "zero-infinity") else 0.0
    staging_per_node = per_rank_staged * p.gpus_per_node
    if (
        use_async
        and p.host_memory is not None
        and host_used + staging_per_node > p.usable_fraction * p.host_memory
    ):
        use_async = False
        warnings.append(
            f"async saves would stage {format_size(staging_per_node)} per node, more than the "
            "host memory left: planning sync saves"
        )
    cost = async_stall if use_async else write_s
    durable_lag = write_s if use_async else 0.0
    restore_read_s = per_node_written / read_bw
    restart = p.restart_overhead + restore_read_s

    if p.job_mtbf is not None:
        mtbf: float | None = p.job_mtbf
        mtbf_source = "given (--mtbf-job)"
    elif p.node_mtbf is not None:
        mtbf = p.node_mtbf / p.nodes
        mtbf_source = f"node MTBF / {p.nodes} node{'s' if p.nodes > 1 else ''}"
    elif p.need == "fault-tolerance":
        mtbf = ASSUMED_NODE_MTBF_S / p.nodes
        mtbf_source = (
            f"assumed: {ASSUMED_NODE_MTBF_S / 3600:.0f} h per node (Llama 3 report) / "
            f"{p.nodes} nodes; pass --mtbf"
        )
    else:
        mtbf, mtbf_source = None, "not given"

    interval: dict[str, Any]
    if mtbf is None:
        interval = {
            "mtbf_s": None,
            "mtbf_source": mtbf_source,
            "cost_s": cost,
            "young_s": None,
            "daly_s": None,
            "recommended_s": None,
            "every_steps": None,
            "expected_lost_per_failure_s": None,
            "failures_per_day": None,
            "overhead_fraction": None,
        }
    else:
        young = young_interval(cost, mtbf) if cost > 0 else 0.0
        daly = daly_interval(cost, mtbf) if cost > 0 else 0.0
        recommended = daly
        if use_async and recommended < async_durable:
            # One async save in flight at a time: saving more often than a save
            # takes to become durable would make every save wait for the last.
            recommended = async_durable
            warnings.append(
                "the interval is raised to the time an async save takes to become durable "
                f"({async_durable:.0f} s): saves cannot overlap"
            )
        if cost >= 2 * mtbf:
            warnings.append(
                "a checkpoint costs more than twice the job's MTBF: the job will rarely make "
                "progress; make checkpoints cheaper (faster storage, async, more nodes) first"
            )
        recommended = max(recommended, 1.0)
        lost = recommended / 2 + durable_lag + restart
        interval = {
            "mtbf_s": mtbf,
            "mtbf_source": mtbf_source,
            "cost_s": cost,
            "young_s": young,
            "daly_s": daly,
            "recommended_s": recommended,
            "every_steps": (
                max(1, round(recommended / p.step_time)) if p.step_time is not None else None
            ),
            "expected_lost_per_failure_s": lost,
            "failures_per_day": 86400.0 / mtbf,
            "overhead_fraction": overhead_fraction(recommended, cost, mtbf, restart + durable_lag),
        }
    if strategy == "zero-infinity":
        warnings.append(
            "the sharded state does not fit in host memory either: this needs NVMe offload "
            "(DeepSpeed ZeRO-Infinity), which stalwart does not drive in this version"
        )
    if sharded and p.nodes > 1 and strategy == "fsdp2":
        per_node_shard = state_total / p.gpus_per_node
        if per_node_shard <= p.usable_fraction * p.gpu_memory:
            warnings.append(
                "the state also fits sharded within one node: HSDP (FSDP2 with a 2-D mesh, "
                "sharding inside a node and replicating across nodes) keeps the all-gathers "
                "on the fast intra-node links"
            )

    keep_last = 3
    retention = {
        "keep_last": keep_last,
        "disk_per_run_bytes": (keep_last + 1) * ckpt_total,
        "reason": (
            "restore falls back to the previous checkpoint when the newest fails verification; "
            "keeping 3 leaves that fallback a fallback. Disk: 3 kept plus 1 being written"
        ),
        "tiering": _tiering_advice(write_s, interval.get("recommended_s")),
    }
    plan: dict[str, Any] = {
        "inputs": {
            **dataclasses.asdict(p),
            "world_size": world,
            "read_bw": read_bw,
        },
        "memory": {
            "bytes_per_param": dataclasses.asdict(per_param) | {"total": per_param.total},
            "state_total_bytes": state_total,
            "state_per_gpu_bytes": per_gpu,
            "gpu_budget_bytes": p.usable_fraction * p.gpu_memory,
            "fits_ddp": state_total <= p.usable_fraction * p.gpu_memory,
            "host_per_node_bytes": state_total / p.nodes
            if strategy in ("fsdp2-offload", "zero-infinity")
            else None,
            "not_modeled": "activations, FSDP's unsharded working layer, communication "
            "buffers, CUDA context and fragmentation: they must fit in the headroom",
        },
        "strategy": strategy,
        "strategy_reason": _strategy_reason(p, strategy, state_total),
        "checkpoint": {
            "bytes_per_param": checkpoint_bytes_per_param(p.optimizer),
            "total_bytes": ckpt_total,
            "per_rank_bytes": per_rank_written,
            "per_node_bytes": per_node_written,
            "staged_per_rank_bytes": per_rank_staged,
            "staging_host_memory_per_node_bytes": per_rank_staged * p.gpus_per_node,
            "sync_stall_s": write_s,
            "async_stall_s": async_stall,
            "async_time_to_durable_s": async_durable,
            "time_to_durable_s": async_durable if use_async else write_s,
            "async_save": use_async,
            "restore_read_s": restore_read_s,
            "restart_s": restart,
        },
        "interval": interval,
        "retention": retention,
        "warnings": warnings,
    }
    plan["code"] = code_lines(p, strategy, use_async=use_async, interval=interval)
    return plan


_RESUME_ONLY_INTERVAL_S = 3600
"""Periodic saves when only planned stops matter: a safety net against a hard kill."""


def code_lines(
    p: PlanInputs, strategy: Strategy, *, use_async: bool, interval: dict[str, Any]
) -> dict[str, str]:
    """The lines to paste: how to wrap the model, the manager, and the launch command.

    Keys: ``wrap``, ``manager``, ``launch``. ``interval`` is the plan's
    ``interval`` section.
    """
    every_steps = interval.get("every_steps")
    seconds = interval.get("recommended_s")
    if every_steps is not None:
        when = f"every_steps={every_steps}"
    elif seconds is not None:
        when = f"every_seconds={max(1, round(seconds))}"
    else:
        when = f"every_seconds={_RESUME_ONLY_INTERVAL_S}"
    manager = (
        f'stalwart.CheckpointManager("runs/exp1", {when}, keep_last=3'
        + (", async_save=True" if use_async else "")
        + ")"
    )
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(p.precision)
    if strategy == "ddp":
        wrap = "model = torch.nn.parallel.DistributedDataParallel(model.cuda(), device_ids=[local_rank])"
        if low is not None:
            wrap += f"\n# forward and loss under torch.autocast('cuda', dtype={low})"
    elif strategy == "zero-infinity":
        wrap = (
            "engine, optimizer, _, _ = deepspeed.initialize(model=model, "
            'config="ds_zero3_nvme.json")  # ZeRO-3, offload_param and offload_optimizer '
            'on {"device": "nvme"}'
        )
    else:
        kwargs = []
        wrap = ""
        if low is not None:
            wrap = f"mp = MixedPrecisionPolicy(param_dtype={low}, reduce_dtype=torch.float32)\n"
            kwargs.append("mp_policy=mp")
        if strategy == "fsdp2-offload":
            kwargs.append("offload_policy=CPUOffloadPolicy()")
        args = "".join(f", {k}" for k in kwargs)
        wrap += (
            f"for block in model.layers:\n    fully_shard(block{args})\nfully_shard(model{args})"
        )
    restarts = 3 if p.need == "fault-tolerance" else 0
    if p.nodes == 1:
        launch = f"torchrun --standalone --nproc-per-node={p.gpus_per_node} --max-restarts={restarts} train.py"
    else:
        launch = (
            f"torchrun --nnodes={p.nodes} --nproc-per-node={p.gpus_per_node} "
            "--rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29500 --rdzv-id=exp1 "
            f"--max-restarts={restarts} train.py"
        )
    if strategy == "zero-infinity":
        launch = f"deepspeed --num_nodes={p.nodes} --num_gpus={p.gpus_per_node} train.py"
        manager = (
            "# stalwart does not drive DeepSpeed in this version; checkpoint every "
            f"{when.split('=')[1]} {'steps' if every_steps is not None else 's'} with "
            "engine.save_checkpoint()"
        )
    return {"wrap": wrap, "manager": manager, "launch": launch}


def _strategy_reason(p: PlanInputs, strategy: Strategy, state_total: float) -> str:
    budget = p.usable_fraction * p.gpu_memory
    whole = f"the whole training state, {format_size(state_total)},"
    if strategy == "ddp":
        return f"{whole} fits one GPU's {format_size(budget)} budget: replicate it"
    shard = state_total / p.world_size
    over = f"{whole} exceeds one GPU's {format_size(budget)} budget"
    if strategy == "fsdp2":
        return f"{over}; sharded over {p.world_size} GPUs it is {format_size(shard)} each"
    still = f"{over}; even sharded over {p.world_size} GPUs it is {format_size(shard)} each"
    per_node = format_size(state_total / p.nodes)
    if strategy == "fsdp2-offload":
        checked = (
            f"fits {format_size(p.usable_fraction * p.host_memory)} of host memory"
            if p.host_memory is not None
            else "must fit host memory (not checked: pass --host-mem)"
        )
        return f"{still}: offload it to host memory, where each node's {per_node} {checked}"
    assert p.host_memory is not None
    return (
        f"{still}, and each node's {per_node} exceeds "
        f"{format_size(p.usable_fraction * p.host_memory)} of host memory: offload to NVMe"
    )


def _tiering_advice(write_s: float, interval_s: float | None) -> str:
    if interval_s is not None and write_s > 0.1 * interval_s:
        return (
            "writing takes more than 10% of the interval: write to node-local NVMe and copy to "
            "durable shared storage in the background, keeping only the newest locally"
        )
    if write_s > 600:
        return (
            "a save takes over 10 minutes to become durable: consider node-local NVMe as a "
            "first tier, copied to durable storage in the background"
        )
    return "shared storage is fast enough for this size: write checkpoints to it directly"
