"""A rollback on every rank at once (run by test_rollback_ddp.py).

Usage: torchrun --nproc-per-node=2 rollback_worker.py RUN_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch

import stalwart


def main() -> int:
    run, out = sys.argv[1], sys.argv[2]
    rank, _world = stalwart.init_distributed("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    state = stalwart.TrainState(model=model, extra={"rank_value": rank})
    report: dict = {}
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        for step in (2, 4, 6):
            with torch.no_grad():
                model.weight.add_(1.0)
            assert ckpt.save(step, state, force=True)
        assert ckpt.restore(state, step=2) == 2
        report["moved"] = ckpt.rollback(2)
        report["steps"] = ckpt.all_steps()
        try:
            ckpt.rollback(3)
        except stalwart.CheckpointNotFoundError as exc:
            report["missing"] = str(exc)
        with torch.no_grad():
            model.weight.add_(10.0)
        report["saved_again"] = ckpt.save(4, state, force=True)
        expected = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        report["restored"] = ckpt.restore(state)
        report["same"] = bool(torch.equal(model.weight, expected))
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(report, f)
    stalwart.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
