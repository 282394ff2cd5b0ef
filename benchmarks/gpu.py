"""The checks that need a CUDA GPU, in one run of a few minutes (see ``gpu.sh``).

    benchmarks/gpu.sh              # on a machine with a CUDA GPU
    benchmarks/gpu.sh --dry-run    # the same code paths on the CPU (a self-check)

Checks (each prints one ``PASS``/``FAIL`` line; the exit status is 1 if any failed):

- pinned staging: `StagingArea.stage` (what an async save stages with) copies a GPU tensor into pinned host memory;
- per-device RNG: a restore brings back every CUDA generator's stream;
- DDP and FSDP2 save/restore on one GPU: a single-rank DDP or FSDP2 model and its AdamW
  state save and restore bit-exact (NCCL);
- exact resume: training with dropout on the GPU, stopped at step 10 and resumed into
  new objects, ends bit-identical to the same 20 steps never stopped;

and measurements (one ``RATIO`` line each):

- D2H staging stall: ``StagingArea.stage`` over a copy into preallocated pinned
  buffers (the floor of a device-to-host stall);
- async save stall: what ``save()`` with ``async_save=True`` keeps training waiting
  for, over the same pinned copy of the model's parameters;
- H2D restore: a verified restore onto the GPU over a raw read of the files plus
  a pinned host-to-device copy of the same bytes.

``--dry-run`` runs everything with device ``cpu`` (gloo instead of nccl), so a
test on a machine without a GPU proves the script runs and prints every line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import stalwart
from stalwart.staging import StagingArea

MiB = 2**20
_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_of(nbytes: int, device: torch.device) -> nn.Module:
    width = max(16, int(math.sqrt(nbytes / 4 / 4)))  # four width x width fp32 layers
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)]).to(device)


def best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def check_pinned_staging(device: torch.device, _root: Path) -> str:
    source = {"w": torch.randn(256, 256, device=device)}
    staged = StagingArea().stage(source)
    assert staged["w"].device.type == "cpu", "the staged copy is on the host"
    assert torch.equal(staged["w"], source["w"].cpu()), "the staged copy has the values"
    if device.type == "cuda":
        assert staged["w"].is_pinned(), "a GPU tensor is staged into pinned memory"
        return "staged into pinned host memory"
    return "staged into host memory (CPU dry run: nothing to pin)"


def check_device_rng(device: torch.device, root: Path) -> str:
    model = model_of(MiB, device)
    state = stalwart.TrainState(model=model)
    with stalwart.CheckpointManager(root / "rng", handle_signals=False) as ckpt:
        ckpt.save(1, state, force=True)
        expected = torch.rand(4, device=device)
        torch.rand(16, device=device)  # move every stream on
        assert ckpt.restore(state) == 1
    again = torch.rand(4, device=device)
    assert torch.equal(again, expected), "the device generator continues where it was saved"
    return f"{device.type} generator stream continues after restore"


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2 parameters and optimizer state), else the tensor."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _roundtrip(kind: str, device: torch.device, root: Path) -> str:
    """One step of AdamW on a single-rank DDP or FSDP2 model, saved, restored into a
    model whose parameters were zeroed and a fresh optimizer, compared bit for bit."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=dist.FileStore(str(root / f"store-{kind}"), 1), rank=0, world_size=1
    )
    try:
        ids = [device.index or 0] if device.type == "cuda" else None

        def build(zero: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
            model = model_of(MiB, device)
            if kind == "ddp":
                model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
            else:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh(device.type, (1,))
                for layer in model:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
            if zero:
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()  # so that only the restore can make the values equal again
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

        model, opt = build(zero=False)
        width = next(model.parameters()).shape[-1]
        model(torch.randn(8, width, device=device)).sum().backward()
        opt.step()
        saved = [_plain(p.detach()).clone() for p in model.parameters()]
        saved_opt = {
            (i, k): _plain(v).clone()
            for i, st in opt.state_dict()["state"].items()
            for k, v in st.items()
            if isinstance(v, torch.Tensor)
        }
        with stalwart.CheckpointManager(root / kind, handle_signals=False) as ckpt:
            ckpt.save(1, stalwart.TrainState(model=model, optimizer=opt), force=True)
        fresh, fresh_opt = build(zero=True)
        with stalwart.CheckpointManager(root / kind, handle_signals=False) as ckpt:
            assert ckpt.restore(stalwart.TrainState(model=fresh, optimizer=fresh_opt)) == 1
        for a, b in zip(saved, fresh.parameters(), strict=True):
            assert b.device.type == device.type, f"a parameter came back on {b.device}"
            assert torch.equal(a, _plain(b.detach())), "parameters come back bit-exact"
        back_opt = fresh_opt.state_dict()["state"]
        assert saved_opt, "AdamW has state after one step"
        for (i, k), v in saved_opt.items():
            got = _plain(back_opt[i][k])
            assert torch.equal(v, got), f"optimizer state {i}.{k} comes back bit-exact"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    what = "DDP" if kind == "ddp" else "FSDP2"
    return (
        f"single-rank {what} on {backend}: parameters and AdamW state saved and restored bit-exact"
    )


def check_ddp_roundtrip(device: torch.device, root: Path) -> str:
    return _roundtrip("ddp", device, root)


def check_fsdp2_roundtrip(device: torch.device, root: Path) -> str:
    return _roundtrip("fsdp2", device, root)


def check_device_restore(device: torch.device, root: Path) -> str:
    """A restore onto the device of tensors larger than a pinned buffer, of odd sizes and
    several dtypes, into live tensors that were overwritten: every byte comes back."""
    torch.manual_seed(2)
    tensors = {
        "big": torch.randn(3001, 3517, device=device),  # 42 MB: more than one pinned buffer
        "odd": torch.randn(1023, 517, device=device),
        "bf16": torch.randn(2049, 1031, device=device).to(torch.bfloat16),
        "ints": torch.randint(0, 2**31 - 1, (777, 555), device=device),
    }
    saved = {k: v.clone() for k, v in tensors.items()}
    holder = nn.Module()
    for key, value in tensors.items():
        holder.register_buffer(key, value)
    state = stalwart.TrainState(model=holder, rng=False)
    with stalwart.CheckpointManager(root / "device", handle_signals=False) as ckpt:
        ckpt.save(1, state, force=True)
        for t in tensors.values():
            t.zero_()  # so that only the restore can make the values equal again
        assert ckpt.restore(state) == 1
    sync(device)
    for key, value in saved.items():
        assert tensors[key].device == value.device, f"{key} came back on {tensors[key].device}"
        assert torch.equal(tensors[key], value), f"{key} comes back bit-exact"
    total = sum(v.nbytes for v in saved.values()) / MiB
    return f"{total:.0f} MiB in 4 tensors (fp32, bf16, int64) restored onto {device.type} bit-exact"


def check_exact_resume(device: torch.device, root: Path) -> str:
    """Training with dropout on the device, stopped and resumed through a checkpoint into
    new objects, ends bit-identical to the same training never stopped."""
    torch.use_deterministic_algorithms(True)
    try:

        def parts() -> tuple[nn.Module, torch.optim.Optimizer]:
            model = nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.3), nn.Linear(256, 8))
            return model.to(device), torch.optim.AdamW(model.parameters(), lr=1e-3)

        def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
            for _ in range(steps):
                x = torch.randn(32, 64, device=device)  # drawn from the device generator
                opt.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                opt.step()

        torch.manual_seed(1)
        straight, straight_opt = parts()
        train(straight, straight_opt, 20)
        torch.manual_seed(1)
        first, first_opt = parts()
        train(first, first_opt, 10)
        with stalwart.CheckpointManager(root / "exact", handle_signals=False) as ckpt:
            ckpt.save(10, stalwart.TrainState(model=first, optimizer=first_opt), force=True)
        torch.manual_seed(99)  # a new process's generators, and new objects
        second, second_opt = parts()
        with stalwart.CheckpointManager(root / "exact", handle_signals=False) as ckpt:
            assert ckpt.restore(stalwart.TrainState(model=second, optimizer=second_opt)) == 10
        train(second, second_opt, 10)
        for a, b in zip(straight.parameters(), second.parameters(), strict=True):
            assert torch.equal(a, b), "a resumed run ends where the unstopped run ends"
    finally:
        torch.use_deterministic_algorithms(False)
    return f"20 steps with dropout on {device.type}, resumed at step 10: bit-identical"


def pinned_copy(device: torch.device, tensors: list[torch.Tensor]) -> Callable[[], float]:
    """The floor of a device-to-host stall: a timed copy of ``tensors`` into
    preallocated pinned buffers."""
    pinned = [torch.empty(t.shape, pin_memory=device.type == "cuda") for t in tensors]

    def floor() -> float:
        t0 = time.perf_counter()
        for b, t in zip(pinned, tensors, strict=True):
            b.copy_(t, non_blocking=True)
        sync(device)
        return time.perf_counter() - t0

    return floor


def measure_d2h_stall(device: torch.device, nbytes: int, repeats: int) -> tuple[float, str]:
    tensors = [torch.randn(nbytes // 4 // 8, device=device) for _ in range(8)]
    floor = pinned_copy(device, tensors)
    area = StagingArea()
    source = {f"t{i}": t for i, t in enumerate(tensors)}
    area.stage(source)  # allocate the buffers once, as the first save does

    def stage() -> float:
        t0 = time.perf_counter()
        area.stage(source)
        return time.perf_counter() - t0

    f, s = best(floor, repeats), best(stage, repeats)
    return s / f, f"stage {s * 1e3:.1f} ms vs pinned copy {f * 1e3:.1f} ms"


def measure_async_stall(
    device: torch.device, root: Path, nbytes: int, repeats: int
) -> tuple[float, str]:
    """What training waits for in ``save()`` with ``async_save=True``, over a copy of the
    same parameters into preallocated pinned buffers."""
    model = model_of(nbytes, device)
    floor = pinned_copy(device, [p.detach() for p in model.parameters()])
    state = stalwart.TrainState(model=model, rng=False)
    ckpt = stalwart.CheckpointManager(root / "async", async_save=True, handle_signals=False)
    step = 0

    def stall() -> float:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        ckpt.save(step, state, force=True)
        took = time.perf_counter() - t0
        ckpt.wait()  # the write, off the clock, before the next save
        return took

    try:
        stall()  # the first save allocates the staging buffers
        f, s = best(floor, repeats), best(stall, repeats)
    finally:
        ckpt.close()
    return s / f, f"save() returns in {s * 1e3:.1f} ms vs pinned copy {f * 1e3:.1f} ms"


def measure_h2d_restore(
    device: torch.device, root: Path, nbytes: int, repeats: int
) -> tuple[float, str]:
    model = model_of(nbytes, device)
    state = stalwart.TrainState(model=model, rng=False)
    ckpt = stalwart.CheckpointManager(root / "h2d", handle_signals=False)
    ckpt.save(1, state, force=True)
    step_dir = ckpt.storage.step_path(1)
    files = [p for p in step_dir.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(total, dtype=torch.uint8, device=device)

    def floor() -> float:
        t0 = time.perf_counter()
        view, offset = memoryview(host.numpy()), 0
        for p in files:
            with open(p, "rb", buffering=0) as f:
                offset += f.readinto(view[offset:]) or 0
        on_device.copy_(host, non_blocking=True)
        sync(device)
        return time.perf_counter() - t0

    def restore() -> float:
        t0 = time.perf_counter()
        assert ckpt.restore(state, step=1) == 1
        sync(device)
        return time.perf_counter() - t0

    f, r = best(floor, repeats), best(restore, repeats)
    ckpt.close()
    mbps = total / MiB / r
    return (
        r / f,  # restore over the floor, as the RATIO line names it (1.0x: no overhead)
        f"restore {r * 1e3:.1f} ms ({mbps:,.0f} MiB/s) vs read + H2D copy {f * 1e3:.1f} ms",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run on the CPU: a self-check")
    p.add_argument("--size", type=int, default=256, help="state size in MiB (default 256)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("FAIL cuda: no CUDA device; use --dry-run for the CPU self-check", flush=True)
        return 1
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    print(f"device {device} torch {torch.__version__} stalwart {stalwart.__version__}", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="stalwart-gpu-") as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        root = Path(tmp)
        checks = {
            "pinned staging": check_pinned_staging,
            "per-device RNG": check_device_rng,
            "DDP save/restore": check_ddp_roundtrip,
            "FSDP2 save/restore": check_fsdp2_roundtrip,
            "device restore": check_device_restore,
            "exact resume": check_exact_resume,
        }
        for name, check in checks.items():
            try:
                print(f"PASS {name}: {check(device, root)}", flush=True)
            except Exception as exc:  # every check runs; each failure is reported
                failed += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        nbytes = args.size * MiB
        for name, measure in (
            (
                "D2H staging stall / pinned copy",
                lambda: measure_d2h_stall(device, nbytes, args.repeats),
            ),
            (
                "async save stall / pinned copy",
                lambda: measure_async_stall(device, root, nbytes, args.repeats),
            ),
            (
                "H2D restore / (read + pinned H2D copy)",
                lambda: measure_h2d_restore(device, root, nbytes, args.repeats),
            ),
        ):
            try:
                ratio, detail = measure()
                print(f"RATIO {name}: {ratio:.2f}x ({detail})", flush=True)
            except Exception as exc:
                failed += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # cuBLAS is deterministic with a fixed workspace, which the exact-resume check asks for.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.exit(main())
