"""A small character-level transformer trained with stalwart checkpointing.

The model reads Python source code (the standard library's own files, so the
example needs no download) and learns to predict the next byte. Everything that
makes exact resume hard in real training is here on purpose:

- dropout, so the global torch RNG advances every step;
- a shuffled data order, so the data position and sampler seed matter;
- AdamW state and a warmup + cosine learning-rate schedule;
- optional DataLoader worker processes, which prefetch ahead of the loop.

Run it, kill it at any moment, run the same command again: it continues from the
newest committed checkpoint and ends with the same weights, bit for bit, as a
run that was never interrupted::

    python examples/charlm.py --run-dir runs/charlm --steps 300 --every 25
    python examples/charlm.py --run-dir runs/charlm --steps 300 --every 25 --crash-at 140
    python examples/charlm.py --run-dir runs/charlm --steps 300 --every 25   # resumes at 125

``--crash-at STEP`` makes the process SIGKILL itself right after the optimizer
update of step STEP, before that step's checkpoint could be written: the same
as a power cut, an OOM kill or a lost node. ``examples/demo.py`` drives the
whole experiment and compares the results.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import signal
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stalwart

# A fixed, sorted list of standard-library modules, about 670 KB of Python source
# on CPython 3.11. A fixed list (not a directory walk) keeps the corpus the same
# whatever else is installed next to the standard library.
CORPUS_MODULES = (
    "argparse.py",
    "collections/__init__.py",
    "contextlib.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "json/decoder.py",
    "json/encoder.py",
    "pprint.py",
    "random.py",
    "statistics.py",
    "tempfile.py",
    "textwrap.py",
)

VOCAB_SIZE = 256  # bytes: no tokenizer to build, save or get wrong


def load_corpus() -> tuple[torch.Tensor, str]:
    """The corpus as a uint8 tensor of bytes, and a short hash of it (the dataset version)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in CORPUS_MODULES:
        path = stdlib / name
        # Some distributions strip sources; skipping is still deterministic on one machine.
        if path.is_file():
            parts.append(path.read_bytes())
    if not parts:
        raise FileNotFoundError(
            f"none of the corpus modules were found under {stdlib}; this Python installation "
            "ships without standard-library sources"
        )
    data = b"\n".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), hashlib.sha256(data).hexdigest()[
        :16
    ]


class WindowDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Index ``i`` is the window of ``context + 1`` bytes starting at ``i * stride``.

    The dataset itself is deterministic; the random order comes from the loader's
    shuffle, whose state stalwart checkpoints.
    """

    def __init__(self, data: torch.Tensor, *, context: int, stride: int) -> None:
        self.data = data
        self.context = context
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.data) - self.context - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        chunk = self.data[start : start + self.context + 1].long()
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """A pre-norm GPT block: causal self-attention, then an MLP, each with dropout."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        # Attention dropout draws from the global torch RNG too: one more stream
        # that has to continue exactly where it stopped.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + self.resid_drop(self.proj(y))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(
        self, *, context: int, d_model: int, n_layers: int, n_heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class WarmupCosine:
    """Learning-rate factor: linear warmup, then cosine decay to 10% of the peak.

    A module-level callable class rather than a lambda: LambdaLR's state then
    records ``warmup`` and ``total`` (it saves a callable object's attributes), and
    the schedule itself is code that the resumed process rebuilds identically.
    """

    def __init__(self, *, warmup: int, total: int) -> None:
        self.warmup = warmup
        self.total = total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--run-dir", required=True, help="checkpoint directory; resumed if it has checkpoints"
    )
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument("--every", type=int, default=25, help="save a checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--crash-at", type=int, default=None, metavar="STEP",
                   help="SIGKILL this process right after the optimizer update of STEP, before its save")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help="write the final model, optimizer and scheduler state here (torch.save)")  # fmt: skip
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args(argv)


# Settings that define the training run (what the manifest's config records). The
# rest (paths, save frequency, worker count, fault injection) may change between a
# run and its resume without changing the result.
RUN_CONFIG = (
    "steps", "seed", "batch_size", "context", "d_model", "layers", "heads",
    "dropout", "lr", "warmup",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # One intra-op thread: reductions then run in the same order in every
    # process, so a resumed process computes the same floats as the original.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # Seed every generator a fresh run uses, so two fresh runs are identical too;
    # after a restore, stalwart puts back the states they had reached.
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    data, data_hash = load_corpus()
    dataset = WindowDataset(data, context=args.context, stride=args.context)
    # shuffle=True: the order is a function of (seed, epoch), so a resumed process
    # can rebuild it. drop_last=True keeps every batch the same shape.
    loader = stalwart.ResumableDataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        seed=args.seed,
        num_workers=args.num_workers,
    )
    model = CharLM(
        context=args.context,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        dropout=args.dropout,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, WarmupCosine(warmup=args.warmup, total=args.steps)
    )
    extra: dict[str, Any] = {"tokens_seen": 0}
    state = stalwart.TrainState(
        model=model, optimizer=opt, scheduler=sched, data=loader, extra=extra
    )
    config = {k: getattr(args, k) for k in RUN_CONFIG}
    metadata = {
        "dataset": "cpython-stdlib-source",
        "dataset_sha256_16": data_hash,
        "dataset_bytes": len(data),
    }

    losses: dict[int, float] = {}
    with stalwart.CheckpointManager(
        args.run_dir,
        every_steps=args.every,
        keep_last=args.keep_last,
        metadata=metadata,
        config=config,
    ) as ckpt:
        start = ckpt.restore(state) or 0
        print(
            f"charlm pid {os.getpid()}: {'resumed at step ' + str(start) if start else 'fresh start'}, "
            f"{len(dataset)} windows from {len(data) / 1e3:.0f} KB of stdlib source, "
            f"{sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, "
            f"workers={args.num_workers}",
            flush=True,
        )
        model.train()
        # Step-based loop across epochs; after a restore it starts at the next
        # sample the interrupted run had not consumed.
        batches = loader.forever()
        t0 = time.perf_counter()
        for step in range(start, args.steps):
            x, y = next(batches)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            extra["tokens_seen"] += y.numel()
            losses[step + 1] = loss.item()
            if args.crash_at is not None and step + 1 == args.crash_at:
                # A real crash: no exception handler, no atexit, no final save. Work
                # since the last committed checkpoint is lost and must be redone.
                print(f"charlm: step {step + 1} done, SIGKILL before its save", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            saved = ckpt.save(step + 1, state, metrics={"loss": losses[step + 1]})
            if (step + 1) % args.log_every == 0 or saved or step + 1 == args.steps:
                print(
                    f"step {step + 1:5d}  loss {losses[step + 1]:.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                    f"{(time.perf_counter() - t0) / (step + 1 - start) * 1e3:5.1f} ms/step"
                    + ("  [checkpoint]" if saved else ""),
                    flush=True,
                )
            if ckpt.preempted:
                print(
                    f"charlm: preempted, stopped after the checkpoint of step {step + 1}",
                    flush=True,
                )
                return 0

    if args.out is not None:
        final = {
            "step": args.steps,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "tokens_seen": extra["tokens_seen"],
            # Losses of the steps this process ran: the resumed run's must match
            # the reference run's for the same steps.
            "losses": losses,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(final, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
