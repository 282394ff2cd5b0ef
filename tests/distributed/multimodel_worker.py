"""A DDP worker whose extra and stateful values differ per rank, and whose restore can fail on one rank.

Launched by tests/distributed/test_multimodel.py under torchrun. Each rank keeps
``extra["mine"]`` and a ``Counter`` whose state (keys included) is its own; with
``--fail-load-rank R`` the counter of rank R raises inside ``load_state_dict``.
"""

from __future__ import annotations

import argparse
import sys

import torch

import stalwart


class Counter:
    """A stateful object whose state dict has a key of each rank's own."""

    def __init__(self, rank: int, fail: bool) -> None:
        self.rank, self.fail, self.n = rank, fail, 0

    def state_dict(self) -> dict:
        return {"n": self.n, f"seen_by_rank_{self.rank}": True}

    def load_state_dict(self, sd: dict) -> None:
        if self.fail:
            raise RuntimeError(f"injected load failure on rank {self.rank}")
        self.n = sd["n"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--fail-load-rank", type=int, default=None)
    args = ap.parse_args()
    rank, _world = stalwart.init_distributed("gloo")
    torch.manual_seed(0)
    # A container of DDP modules: its manifest layout is ddp, not replicated.
    model = torch.nn.ModuleDict(
        {
            "net": torch.nn.parallel.DistributedDataParallel(
                torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
            )
        }
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = Counter(rank, fail=rank == args.fail_load_rank)
    extra = {"mine": -1, f"only_on_rank_{rank}": -1}
    state = stalwart.TrainState(model=model, optimizer=opt, extra=extra, counter=counter)
    code = 0
    with stalwart.CheckpointManager(args.run_dir, every_steps=2, save_timeout=30) as ckpt:
        try:
            start = ckpt.restore(state) or 0
        except stalwart.StalwartError as exc:
            print(f"rank {rank} restore-error {type(exc).__name__}: {exc}", flush=True)
            code = 4
        else:
            print(
                f"rank {rank} start {start} mine {extra['mine']} n {counter.n} "
                f"keys {','.join(sorted(extra))}",
                flush=True,
            )
            torch.manual_seed(10 + rank)
            for step in range(start, args.steps):
                opt.zero_grad()
                model["net"](torch.randn(4, 3)).pow(2).mean().backward()
                opt.step()
                extra["mine"] = 1000 * rank + step + 1
                extra[f"only_on_rank_{rank}"] = step  # a key of this rank's own
                counter.n = 100 * rank + step + 1
                ckpt.save(step + 1, state)
    del model, state, opt
    stalwart.shutdown_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
