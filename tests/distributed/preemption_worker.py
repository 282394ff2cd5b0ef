"""A training script that gets preempted: for the grace-window, worker-shield and auto tests.

Runs in one process (``python preemption_worker.py ...``) or under torchrun
(DDP over gloo). Saves go through a ``LocalStorage`` whose commit takes
``--commit-delay`` seconds (the fault-injection pattern of the test suite:
subclass the real backend), so a save has a known, real duration. Preemption
is a real signal: the script sends SIGTERM to itself after the save call of
``--term-after-step``, or the test sends it to the process group (as torchrun
and SLURM do) once ``--ready-file`` exists. It prints ``start S``, ``preempted
at step N``, ``workers alive N`` and exits 143 when preempted.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import torch

import stalwart
from stalwart.signals import shielded_worker_init
from stalwart.storage.local import LocalStorage


class SlowCommit(LocalStorage):
    """The real local storage, with a commit that takes ``delay`` seconds longer."""

    def __init__(self, root: str, delay: float) -> None:
        super().__init__(root)
        self.delay = delay

    def commit(self, staging: Path, step: int, manifest_json: str) -> Path:
        time.sleep(self.delay)
        return super().commit(staging, step, manifest_json)


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), float(i))


def say(message: str) -> None:
    os.write(sys.stdout.fileno(), (message + "\n").encode())


def build_loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    if args.loader == "resumable":
        return stalwart.ResumableDataLoader(
            Samples(), batch_size=4, shuffle=True, seed=1, num_workers=args.workers
        )
    init = shielded_worker_init() if args.loader == "plain-shielded" else None
    return torch.utils.data.DataLoader(
        Samples(), batch_size=4, num_workers=args.workers, worker_init_fn=init
    )


def forever(loader: torch.utils.data.DataLoader):  # type: ignore[no-untyped-def]
    if isinstance(loader, stalwart.ResumableDataLoader):
        yield from loader.forever()
    while True:
        yield from loader


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", default="2", help="an integer, or auto")
    ap.add_argument("--mtbf", type=float, default=None)
    ap.add_argument("--grace", type=float, default=None)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--commit-delay", type=float, default=0.0)
    ap.add_argument("--term-after-step", type=int, default=None)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument(
        "--loader", choices=["resumable", "plain", "plain-shielded"], default="resumable"
    )
    ap.add_argument("--ready-file", default=None, help="created once the loop has run a step")
    ap.add_argument("--iter-early", action="store_true", help="start the workers first")
    args = ap.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    rank = stalwart.init_distributed("gloo")[0] if distributed else 0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = build_loader(args)
    batches = None
    if args.iter_early:
        # The workers start before the manager installs its handlers (unshielded
        # workers die of a group SIGTERM either way; this is the harder order).
        batches = forever(loader)
    state = stalwart.TrainState(model=model, optimizer=optimizer)
    if isinstance(loader, stalwart.ResumableDataLoader):
        state = stalwart.TrainState(model=model, optimizer=optimizer, data=loader)
    every = args.every if args.every == "auto" else int(args.every)
    code = 0
    with stalwart.CheckpointManager(
        args.run_dir,
        every_steps=every,
        mtbf_seconds=args.mtbf,
        grace_seconds=args.grace,
        async_save=args.async_save,
        keep_last=None,
        storage=SlowCommit(args.run_dir, args.commit_delay),
    ) as ckpt:
        start = ckpt.restore(state) or 0
        say(f"rank {rank} start {start}")
        batches = forever(loader) if batches is None else batches
        for step in range(start, args.steps):
            x = next(batches)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.ready_file and step == start:
                Path(args.ready_file).touch()
            ckpt.save(step + 1, state, metrics={"loss": loss.item()})
            if args.term_after_step == step + 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if ckpt.preempted:
                next(batches)  # the workers still serve batches after the emergency save
                alive = [p for p in multiprocessing.active_children() if p.is_alive()]
                say(f"rank {rank} preempted at step {step + 1}")
                say(f"rank {rank} workers alive {len(alive)}")
                code = 143
                break
    del model, state, optimizer
    if distributed:
        stalwart.shutdown_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
