"""The checks that need a CUDA GPU, in one run of a few minutes (see ``gpu.sh``).

    benchmarks/gpu.sh              # on a machine with a CUDA GPU
    benchmarks/gpu.sh --dry-run    # the same code paths on the CPU (a self-check)

Checks (each prints one ``PASS``/``FAIL`` line; the exit status is 1 if any failed):

- pinned staging: `StagingArea.stage` (what an async save stages with) copies a GPU tensor into pinned host memory;
- per-device RNG: a restore brings back every CUDA generator's stream;
- DDP save/restore on one GPU: a single-rank DDP model and its AdamW state save and restore bit-exact;

and measurements (one ``RATIO`` line each):

- D2H staging stall: ``StagingArea.stage`` over a copy into preallocated pinned
  buffers (the floor of a device-to-host stall);
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


def check_ddp_roundtrip(device: torch.device, root: Path) -> str:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=dist.FileStore(str(root / "store"), 1), rank=0, world_size=1
    )
    try:
        ids = [device.index or 0] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model_of(MiB, device), device_ids=ids)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        ddp(torch.randn(8, ddp.module[0].in_features, device=device)).sum().backward()
        opt.step()
        saved = [p.detach().clone() for p in ddp.parameters()]
        saved_opt = {
            (i, k): v.clone()
            for i, st in opt.state_dict()["state"].items()
            for k, v in st.items()
            if isinstance(v, torch.Tensor)
        }
        with stalwart.CheckpointManager(root / "ddp", handle_signals=False) as ckpt:
            ckpt.save(1, stalwart.TrainState(model=ddp, optimizer=opt), force=True)
        blank = model_of(MiB, device)
        with torch.no_grad():
            for p in blank.parameters():
                p.zero_()  # so that only the restore can make the values equal again
        fresh = nn.parallel.DistributedDataParallel(blank, device_ids=ids)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        with stalwart.CheckpointManager(root / "ddp", handle_signals=False) as ckpt:
            assert ckpt.restore(stalwart.TrainState(model=fresh, optimizer=fresh_opt)) == 1
        for a, b in zip(saved, fresh.parameters(), strict=True):
            assert torch.equal(a, b.detach()), "DDP parameters come back bit-exact"
        back_opt = fresh_opt.state_dict()["state"]
        assert saved_opt, "AdamW has state after one step"
        for (i, k), v in saved_opt.items():
            assert torch.equal(v, back_opt[i][k]), f"optimizer state {i}.{k} comes back bit-exact"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return f"single-rank DDP on {backend}: parameters and AdamW state saved and restored bit-exact"


def measure_d2h_stall(device: torch.device, nbytes: int, repeats: int) -> tuple[float, str]:
    tensors = [torch.randn(nbytes // 4 // 8, device=device) for _ in range(8)]
    pinned = [torch.empty(t.shape, pin_memory=device.type == "cuda") for t in tensors]

    def floor() -> float:
        t0 = time.perf_counter()
        for b, t in zip(pinned, tensors, strict=True):
            b.copy_(t, non_blocking=True)
        sync(device)
        return time.perf_counter() - t0

    area = StagingArea()
    source = {f"t{i}": t for i, t in enumerate(tensors)}
    area.stage(source)  # allocate the buffers once, as the first save does

    def stage() -> float:
        t0 = time.perf_counter()
        area.stage(source)
        return time.perf_counter() - t0

    f, s = best(floor, repeats), best(stage, repeats)
    return s / f, f"stage {s * 1e3:.1f} ms vs pinned copy {f * 1e3:.1f} ms"


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
    sys.exit(main())
