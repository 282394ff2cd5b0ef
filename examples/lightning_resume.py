"""A Lightning run that survives SIGKILL and resumes bit-identically: the few lines to change.

Compared with a plain Lightning script, three things differ (marked ``# stalwart``):

1. ``Trainer(plugins=[StalwartCheckpointIO()])``: every checkpoint is committed
   atomically with a checksummed manifest; loading verifies it first, falls back
   to the newest older checkpoint that verifies, and never unpickles.
2. ``callbacks=[..., ExactResume()]``: every rank's RNG state goes into the
   checkpoint and comes back at the first resumed batch.
3. A stateful data loader (``stalwart.ResumableDataLoader``; torchdata's
   ``StatefulDataLoader`` works too), so a mid-epoch resume continues at the
   same sample instead of replaying the epoch.

Then ``trainer.fit(model, loader, ckpt_path="last")`` starts fresh the first
time and resumes after a crash.

Run ``python examples/lightning_resume.py --demo`` to see it: a reference run,
a run that SIGKILLs itself mid-epoch (``--kill-at``), and a fresh process that
resumes it; the demo compares the final weights and every step's loss with
``torch.equal`` and exits 0 only when they are identical.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import stalwart
from stalwart.integrations.lightning import ExactResume, StalwartCheckpointIO


class Regressor(L.LightningModule):
    """A small MLP with dropout: its result depends on the RNG stream, not only the data."""

    def __init__(self, hidden: int = 32, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(hidden, 1),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class LossLog(Callback):
    """Appends ``step loss`` per step (to compare runs), and SIGKILLs the process at ``kill_at``."""

    def __init__(self, path: Path, kill_at: int | None) -> None:
        self.path = path
        self.kill_at = kill_at

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no final checkpoint

    def on_train_batch_end(self, trainer: L.Trainer, _m: object, outputs: dict, *_: object) -> None:
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step} {outputs['loss'].item()!r}\n")


def train(workdir: Path, steps: int, every: int, kill_at: int | None) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)
    )
    loader = stalwart.ResumableDataLoader(data, batch_size=8, shuffle=True, seed=0)  # stalwart
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        plugins=[StalwartCheckpointIO()],  # stalwart
        callbacks=[
            ModelCheckpoint(
                dirpath=workdir / "checkpoints", every_n_train_steps=every, save_last=True
            ),
            ExactResume(),  # stalwart
            LossLog(workdir / "losses.txt", kill_at),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    trainer.fit(model, loader, ckpt_path="last")
    torch.save(model.state_dict(), workdir / "final.pt")


def losses(workdir: Path) -> dict[int, str]:
    """Step -> loss (exact repr); the steps a resume redid must repeat the killed run's."""
    seen: dict[int, str] = {}
    for line in (workdir / "losses.txt").read_text().splitlines():
        step, loss = line.split()
        if seen.setdefault(int(step), loss) != loss:
            raise SystemExit(f"step {step} gave another loss when it was redone")
    return seen


def demo(workdir: Path, steps: int, every: int, kill_at: int) -> int:
    """Reference run, killed run, resumed run; 0 when the result is bit-identical."""

    def run(name: str, *extra: str) -> int:
        cmd = [sys.executable, __file__, "--workdir", str(workdir / name)]
        cmd += ["--steps", str(steps), "--every", str(every), *extra]
        return subprocess.run(cmd, check=False).returncode

    if run("reference") != 0:
        return 1
    code = run("crashed", "--kill-at", str(kill_at))
    print(f"killed run exited with {code} (SIGKILL is {-signal.SIGKILL})")
    if code != -signal.SIGKILL or run("crashed") != 0:
        return 1
    ref, res = workdir / "reference", workdir / "crashed"
    a, b = torch.load(ref / "final.pt"), torch.load(res / "final.pt")
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    same_losses = losses(ref) == losses(res)
    print(
        f"weights identical: {same_weights}; losses of all {steps} steps identical: {same_losses}"
    )
    return 0 if same_weights and same_losses else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("runs/lightning_resume"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, help="SIGKILL this process at the start of this step")
    p.add_argument(
        "--demo", action="store_true", help="reference, killed and resumed runs, compared"
    )
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.demo:
        kill_at = args.kill_at if args.kill_at is not None else args.steps // 2 + args.every // 2
        sys.exit(demo(args.workdir, args.steps, args.every, kill_at))
    train(args.workdir, args.steps, args.every, args.kill_at)


if __name__ == "__main__":
    main()
