"""A guarded DDP training worker for the guard and watchdog tests, launched with torchrun.

It trains a small linear model on a ResumableDataLoader, checks every step with
``stalwart.Guard``, and can make one rank report a NaN loss at one step (the
other rank sees a finite one: only the guard's all-reduce tells it), or hang in
user code at one step on the first torchrun attempt under a ``stalwart.Watchdog``.
Each rank reports its decisions and, at the end, a digest of its parameters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import xxhash

import stalwart

FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def say(message: str) -> None:
    # One write per line: the ranks share torchrun's stdout.
    os.write(sys.stdout.fileno(), (message + "\n").encode())


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def hang_in_user_code() -> None:
    time.sleep(3600)


def digest(model: torch.nn.Module) -> str:
    h = xxhash.xxh3_64()
    for value in model.state_dict().values():
        h.update(value.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--nan-rank", type=int, default=None)
    ap.add_argument("--nan-step", type=int, default=None)
    ap.add_argument("--on-nonfinite", choices=["skip", "rollback"], default="skip")
    ap.add_argument("--hang-rank", type=int, default=None)
    ap.add_argument("--hang-step", type=int, default=None)
    ap.add_argument("--watchdog", type=float, default=None, help="watchdog timeout in seconds")
    args = ap.parse_args()

    rank, _ = stalwart.init_distributed("gloo", timeout=120)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = stalwart.ResumableDataLoader(Regression(), batch_size=2, shuffle=True, seed=1)
    state = stalwart.TrainState(model=model, optimizer=opt, data=loader)
    policy = stalwart.GuardPolicy(on_nonfinite=args.on_nonfinite)
    with stalwart.CheckpointManager(args.run_dir, every_steps=args.every, save_timeout=60) as ckpt:
        guard = stalwart.Guard(ckpt, state, policy, timeout=60)
        step = ckpt.restore(state) or 0
        say(f"rank {rank} start {step}")
        dog = None if args.watchdog is None else stalwart.Watchdog(ckpt, timeout=args.watchdog)
        batches = loader.forever()
        trained: list[int] = []
        injected = False
        while step < args.steps:
            x, y, idx = next(batches)
            if FIRST_ATTEMPT and rank == args.hang_rank and step + 1 == args.hang_step:
                say(f"rank {rank} hangs at step {step + 1} at {time.time():.3f}")
                hang_in_user_code()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            reported = loss.item()
            if rank == args.nan_rank and step + 1 == args.nan_step and not injected:
                reported, injected = float("nan"), True  # once, and only this rank sees it
            decision = guard.check(step + 1, reported)
            if decision.action != "ok":
                say(
                    f"rank {rank} step {step + 1} {decision.action} {decision.reason} "
                    f"restored {decision.restored_step} skipped {decision.skipped}"
                )
            if decision.action == "rollback":
                assert decision.restored_step is not None
                step, batches = decision.restored_step, loader.forever()
                continue
            if decision.ok:
                opt.step()
                trained.extend(int(i) for i in idx)
            step += 1
            ckpt.save(step, state, metrics={"loss": reported})
        if dog is not None:
            dog.close()
        say(
            f"rank {rank} done digest {digest(model.module)} checks {guard.checks} "
            f"collectives {guard.collectives} trained {','.join(map(str, trained))}"
        )
        guard.close()
    del model, state, opt
    stalwart.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
