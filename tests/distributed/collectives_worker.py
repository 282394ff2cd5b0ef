"""Counts the checkpoint collectives of each ``save`` on every rank (run by test_collectives.py).

Usage: torchrun --nproc-per-node=2 collectives_worker.py RUN_DIR OUT_JSON [--async]
"""

from __future__ import annotations

import json
import sys

import torch

import stalwart


def main() -> int:
    run, out = sys.argv[1], sys.argv[2]
    async_save = "--async" in sys.argv[3:]
    rank, _world = stalwart.init_distributed("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    state = stalwart.TrainState(model=model, extra={"rank_value": rank})
    counts = []
    with stalwart.CheckpointManager(
        run, every_steps=2, handle_signals=False, async_save=async_save
    ) as ckpt:
        for step in range(1, 7):
            before = ckpt._coord.collectives
            saved = ckpt.save(step, state)
            ckpt.wait()
            counts.append({"step": step, "saved": saved, "n": ckpt._coord.collectives - before})
        steps = ckpt.all_steps()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"counts": counts, "steps": steps}, f)
    stalwart.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
