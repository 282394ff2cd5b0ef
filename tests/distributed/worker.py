"""A DDP / FSDP2 training worker for the distributed tests, launched with torchrun.

It trains a small MLP on a ResumableDataLoader with random augmentation,
checkpoints through stalwart, can kill one of its ranks (once, on the first
torchrun attempt) after a step or while a checkpoint is being written, and
writes the final full state (gathered on rank 0) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import stalwart

FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
_LOG = None


def say(message: str) -> None:
    # One write per line: the ranks share torchrun's stdout, and a line split
    # over two writes can interleave with another rank's.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (message + "\n").encode())
    if _LOG is not None:
        _LOG.write(message + "\n")


class Augmented(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i] * random.uniform(0.9, 1.1) + 0.05 * torch.randn(16), self.y[i], i


class Exploding:
    """A Stateful whose state_dict raises on one rank at one step (a rank failing mid-save)."""

    def __init__(self, rank: int, fail_rank: int | None, fail_step: int | None, hang: bool) -> None:
        self.rank, self.fail_rank, self.fail_step, self.hang = rank, fail_rank, fail_step, hang
        self.step = 0

    def state_dict(self) -> dict:
        if self.rank == self.fail_rank and self.step == self.fail_step:
            if self.hang:
                time.sleep(3600)
            raise OSError(f"injected failure on rank {self.rank} at step {self.step}")
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def build_model(kind: str, world: int, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(width, 4),
    )
    if kind == "ddp" and world > 1:
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp" and world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[3], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kind", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--width", type=int, default=64, help="hidden width of the model")
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--kill-rank", type=int, default=None)
    ap.add_argument("--kill-after-step", type=int, default=None)
    ap.add_argument("--kill-in-save", type=int, default=None)
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--fail-step", type=int, default=None)
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--save-timeout", type=float, default=60.0)
    ap.add_argument("--term-rank", type=int, default=None)
    ap.add_argument("--term-after-step", type=int, default=None)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--restore-step", type=int, default=None)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--log-to", default=None, help="also append this rank's messages to a file")
    ap.add_argument("--durable", default=None, help="durable tier URL (credentials from env)")
    args = ap.parse_args()

    rank, world = stalwart.init_distributed("gloo")
    global _LOG
    if args.log_to:
        _LOG = open(args.log_to, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)

    model = build_model(args.kind, world, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    loader = stalwart.ResumableDataLoader(
        Augmented(), batch_size=4, shuffle=True, seed=5, num_workers=0
    )
    probe = Exploding(rank, args.fail_rank, args.fail_step, args.hang)
    state = stalwart.TrainState(
        model=model, optimizer=optimizer, scheduler=scheduler, data=loader, probe=probe
    )
    code = 0
    retry = stalwart.RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=30.0)
    durable = (
        None if args.durable is None else stalwart.DurableConfig(url=args.durable, retry=retry)
    )
    with stalwart.CheckpointManager(
        args.run_dir,
        every_steps=args.every,
        keep_last=3,
        save_timeout=args.save_timeout,
        async_save=args.async_save,
        # A rank that hangs on purpose should die at torchrun's first SIGTERM
        # rather than wait out torchrun's grace period with the flag set.
        handle_signals=not args.hang,
        durable=durable,
    ) as ckpt:
        start = ckpt.restore(state, step=args.restore_step) or 0
        say(f"rank {rank} start {start} resharded {ckpt.resharded}")
        batches = loader.forever()
        step = start
        seen: list[int] = []
        for step in range(start, args.steps):
            x, y, idx = next(batches)
            seen.extend(int(i) for i in idx)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            probe.step = step + 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if FIRST_ATTEMPT and rank == args.kill_rank and args.kill_after_step == step + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if FIRST_ATTEMPT and rank == args.kill_rank and args.kill_in_save == step + 1:
                threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()
            if FIRST_ATTEMPT and rank == args.term_rank and args.term_after_step == step + 1:
                os.kill(os.getpid(), signal.SIGTERM)
            try:
                ckpt.save(step + 1, state)
            except stalwart.CheckpointSaveError as exc:
                say(f"rank {rank} save-error step {step + 1}: {type(exc).__name__}: {exc}")
                code = 3
                break
            if ckpt.preempted:
                say(f"rank {rank} preempted at step {step + 1}")
                code = 143
                break
        with open(f"{args.run_dir}.seen.rank{rank}", "w") as f:
            f.write(" ".join(map(str, seen)))
    if args.out and code == 0:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=full)
        payload = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict(),
            "data": loader.state_dict(),
            "rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        if rank == 0:
            torch.save(payload, args.out)
        torch.save(
            {"rng": payload["rng"], "python_rng": payload["python_rng"]}, f"{args.out}.rank{rank}"
        )
    del model, state, optimizer
    if code == 3:
        # A failed collective leaves the default group unusable too; skip the barrier.
        sys.stdout.flush()
        os._exit(code)
    stalwart.shutdown_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
