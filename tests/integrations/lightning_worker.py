"""A tiny Lightning training run for the integration tests: one process, or DDP under torchrun.

Writes every rank's per-step losses to ``<out>.losses.rank<R>`` (one ``step loss``
line per step, flushed) and, when training ends, the model's weights to
``<out>.rank<R>``. ``--kill-at N`` SIGKILLs the process (``--kill-rank``: only
that rank) at the start of global step N, once: a marker file makes a torchrun
restart run to the end. Resumes with ``fit(ckpt_path="last")``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import stalwart
from stalwart.integrations.lightning import ExactResume, StalwartCheckpointIO


class Net(L.LightningModule):
    """Dropout makes the result depend on the RNG; SGD with momentum on its optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"hidden": 16, "lr": 0.01})
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Record(Callback):
    """Per-step losses to a file, and a SIGKILL of this process at one step."""

    def __init__(self, out: str, kill_at: int | None, kill_rank: int | None) -> None:
        self.out = out
        self.kill_at = kill_at
        self.kill_rank = kill_rank

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        rank = trainer.global_rank
        marker = Path(f"{self.out}.killed")
        if (
            self.kill_at is not None
            and trainer.global_step == self.kill_at
            and self.kill_rank in (None, rank)
            and not marker.exists()
        ):
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, _m: object, outputs: dict, *_: object) -> None:
        with open(f"{self.out}.losses.rank{trainer.global_rank}", "a") as f:
            f.write(f"{trainer.global_step} {outputs['loss'].item()!r}\n")


def loader(kind: str) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(
        torch.randn(96, 4, generator=g), torch.randn(96, 1, generator=g)
    )
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=4, shuffle=True, generator=g)
    return stalwart.ResumableDataLoader(ds, batch_size=4, shuffle=True, seed=0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--loader", choices=["resumable", "stateful"], default="resumable")
    p.add_argument("--no-exact", action="store_true", help="leave ExactResume out")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--ddp", action="store_true")
    args = p.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    if args.ddp:
        # Before Lightning: its own init_process_group would reuse the previous
        # attempt's store keys after a torchrun restart (docs/distributed.md).
        stalwart.init_distributed("gloo")
    torch.manual_seed(0)
    model = Net()
    # Each rank draws other dropout masks: a resume that gave every rank rank 0's
    # RNG state (what Lightning's rank-0 save alone would hold) is not exact.
    torch.manual_seed(1000 + int(os.environ.get("RANK", "0")))
    callbacks: list[Callback] = [
        Record(args.out, args.kill_at, args.kill_rank),
        ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_last=True),
    ]
    if not args.no_exact:
        callbacks.append(ExactResume())
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy="ddp" if args.ddp else "auto",
        use_distributed_sampler=False,  # ResumableDataLoader shards by rank itself
        plugins=[StalwartCheckpointIO(async_save=args.async_save)],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader(args.loader), ckpt_path="last")
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        f"{args.out}.rank{trainer.global_rank}",
    )
    if args.ddp:
        del trainer, model
        stalwart.shutdown_distributed()


if __name__ == "__main__":
    main()
