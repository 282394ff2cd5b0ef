"""A small but complete training run, killed and resumed by tests/faults/test_resume_exact.py.

Random augmentation in ``__getitem__`` (torch, python and numpy RNGs) runs in
DataLoader workers; the model has dropout; AdamW, a StepLR scheduler and a
GradScaler all carry state. At the end the script writes everything that must
match an uninterrupted run to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading

import numpy as np
import torch

import stalwart


class AugmentedDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 44) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(16) * 0.1
        scale = random.uniform(0.9, 1.1) * float(np.random.uniform(0.95, 1.05))
        return self.x[i] * scale + noise, self.y[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--kill-after-step", type=int, default=None)
    ap.add_argument("--kill-in-save", type=int, default=None)
    ap.add_argument("--kill-delay", type=float, default=0.01)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)

    loader = stalwart.ResumableDataLoader(
        AugmentedDataset(), batch_size=4, shuffle=True, seed=3, num_workers=args.num_workers
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    extra = {"losses": 0.0}
    state = stalwart.TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        data=loader,
        extra=extra,
    )
    with stalwart.CheckpointManager(
        args.run_dir, every_steps=args.every, keep_last=2, async_save=args.async_save
    ) as ckpt:
        start = ckpt.restore(state) or 0
        print(f"start {start} data {loader.state_dict()}", flush=True)
        batches = loader.forever()
        for step in range(start, args.steps):
            x, y = next(batches)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            extra["losses"] += float(loss.detach())
            if args.kill_after_step == step + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.kill_in_save == step + 1:
                threading.Timer(args.kill_delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            ckpt.save(step + 1, state, metrics={"loss": float(loss.detach())})
            if args.kill_in_save == step + 1:
                threading.Event().wait(5)  # the timer kills us while saving or just after
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "data": loader.state_dict(),
            "extra": extra,
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": [a.tolist() if hasattr(a, "tolist") else a for a in np.random.get_state()],
            },
            "next_batch": next(batches),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
