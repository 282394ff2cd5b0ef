"""Saves whose layout changes between them, on real gloo ranks, through one ``SavePlanCache`` each.

Launched by tests/distributed/test_save_plan_cache_dist.py under torchrun. Each
rank saves a DTensor sharded over both ranks, a replicated tensor and a value,
then: the same layout again (the coordinator reuses its plan), the DTensor
sharded on its other dimension, and a key that rank 1 alone adds. After every
save each rank reads the checkpoint back with torch's own ``dcp.load`` into
full tensors and compares them with what was saved. Writes
``<out>.rank<r>`` (JSON): what each save read back, and the coordinator's cache counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import stalwart
from stalwart.save_plan import CachingSavePlanner, SavePlanCache
from stalwart.writer import ChecksummingWriter, RecordTemplates, record_settings, without_zip_crc


def save(sd: dict, path: Path, cache: SavePlanCache) -> None:
    writer = ChecksummingWriter(path, templates=RecordTemplates(), plans=cache)
    try:
        with without_zip_crc():
            planner = CachingSavePlanner(cache, settings=record_settings())
            dcp.save(sd, storage_writer=writer, planner=planner)
        writer.sync()
    finally:
        writer.close()


def staging(root: Path, n: int) -> Path:
    """The same name on every rank, of one length for every save (as the pipeline's)."""
    return root / f".step_{n:09d}.tmp-{hashlib.md5(str(n).encode()).hexdigest()}"


def reads_back(expected: dict, path: Path) -> bool:
    target = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in expected.items()
    }
    dcp.load(target, storage_reader=FileSystemReader(path))
    return all(
        torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v
        for k, v in expected.items()
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out")
    args = ap.parse_args()
    rank, world = stalwart.init_distributed("gloo")
    mesh = init_device_mesh("cpu", (world,))
    root = Path(args.root)
    cache = SavePlanCache()
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    bias = torch.full((6,), 0.5)
    saves = [
        ("first", {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": bias, "lr": 0.1}),
        ("same layout", {"w": distribute_tensor(full + 1, mesh, [Shard(0)]), "b": bias, "lr": 0.2}),
        (
            "other sharding",
            {"w": distribute_tensor(full + 2, mesh, [Shard(1)]), "b": bias, "lr": 0.3},
        ),
        (
            "rank 1 adds a key",
            {"w": distribute_tensor(full + 3, mesh, [Shard(1)]), "b": bias, "lr": 0.4},
        ),
    ]
    if rank == 1:
        saves[3][1]["only_rank_1"] = torch.full((3,), 7.0)
    report: dict = {"reads_back": {}, "counts": {}}
    for n, (name, sd) in enumerate(saves):
        path = staging(root, n)
        save(sd, path, cache)
        torch.distributed.barrier()
        expected = {k: v.full_tensor() if k == "w" else v for k, v in sd.items()}
        if name == "rank 1 adds a key":
            expected["only_rank_1"] = torch.full((3,), 7.0)  # every rank reads rank 1's key
        report["reads_back"][name] = reads_back(expected, path)
        report["counts"][name] = [cache.misses, cache.hits]
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(report))
    stalwart.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
