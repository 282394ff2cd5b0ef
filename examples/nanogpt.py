"""A nanoGPT-shaped training script ported to stalwart, with the port's one trap and its fix.

The shape of karpathy's nanoGPT ``train.py``, written small: a GPT of two
blocks, token data in an ``np.memmap`` (generated into the run directory, so
no download), random batches drawn with ``torch.randint`` from the global RNG,
gradient accumulation, gradient clipping, a warmup + cosine learning rate set
by hand every iteration, and DDP under ``torchrun``. A step takes milliseconds
on a CPU.

The naive port replaces nanoGPT's ``torch.save`` checkpointing with
stalwart's ten lines and keeps the loop as it is. That loop draws the *next*
batch inside the micro-step, before the iteration ends (to overlap data loading
with compute)::

    x, y = get_batch()                  # before the loop
    for step ...:
        for micro ...:
            loss = model(x, y)
            x, y = get_batch()          # the next batch, drawn now
            loss.backward()
        ...
        ckpt.save(step + 1, state)      # the RNG saved here is past that batch

The checkpoint holds an RNG that has already drawn the next batch, and not the
batch itself: a resumed run draws other data and silently trains on it.
stalwart's exact-resume certificate notices ("resume diverged at step k ...
RNG different ..."). ``--fixed`` applies the fix from docs/porting.md: draw
each batch at the top of its micro-step, after the previous save, so the saved
RNG is exactly where the next step starts::

    python examples/nanogpt.py --run-dir runs/gpt --fixed --crash-at 25
    python examples/nanogpt.py --run-dir runs/gpt --fixed     # resumes; "resume verified exact ..."
    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 \\
        examples/nanogpt.py --run-dir runs/gpt2 --fixed --crash-at 25 --crash-rank 1

``--crash-at STEP`` makes rank ``--crash-rank`` SIGKILL itself after the
optimizer update of STEP, before its save (under torchrun only in the first
attempt). ``--out OUT`` writes each rank's final model, optimizer, RNG states
and losses to ``OUT.rank{r}`` for a bit-exact comparison with another run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import stalwart

VOCAB = 64


# --- data ------------------------------------------------------------------------------


def make_tokens(path: Path, n_tokens: int) -> np.memmap:
    """A learnable token stream (a noisy walk over the vocabulary) in an ``np.memmap``, made once.

    Written to a temporary name and renamed, so ranks that start together never
    read a half-written file.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        gen = np.random.default_rng(1234)  # its own generator: the global ones stay untouched
        steps = gen.choice(np.array([1, 1, 2, 3, -1]), size=n_tokens)
        tokens = (np.cumsum(steps) % VOCAB).astype(np.uint16)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        out = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(n_tokens,))
        out[:] = tokens
        out.flush()
        del out
        os.replace(tmp, path)
    return np.memmap(path, dtype=np.uint16, mode="r")


class Batches:
    """nanoGPT's ``get_batch``: random windows of the token file, drawn from the global torch RNG."""

    def __init__(self, data: np.memmap, *, batch_size: int, block_size: int) -> None:
        self.data = data
        self.batch_size = batch_size
        self.block_size = block_size

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(self.data) - self.block_size, (self.batch_size,))
        x = torch.stack(
            [torch.from_numpy(self.data[i : i + self.block_size].astype(np.int64)) for i in ix]
        )
        y = torch.stack(
            [
                torch.from_numpy(self.data[i + 1 : i + 1 + self.block_size].astype(np.int64))
                for i in ix
            ]
        )
        return x, y


# --- model -----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, *, block_size: int, n_layer: int, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def get_lr(it: int, *, lr: float, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to lr / 10 (nanoGPT's schedule, a function of the step)."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min((it - warmup) / max(total - warmup, 1), 1.0)
    return lr / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - lr / 10)


# --- training --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--fixed", action="store_true",
                   help="draw each batch after the previous save (the porting guide's fix)")  # fmt: skip
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--crash-at", type=int, default=None, metavar="STEP")
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = stalwart.init_distributed("gloo")
    try:
        return train(args, rank, world)
    finally:
        stalwart.shutdown_distributed()


def train(args: argparse.Namespace, rank: int, world: int) -> int:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    data = make_tokens(args.run_dir / "data" / "train.bin", 20_000)
    get_batch = Batches(data, batch_size=args.batch_size, block_size=args.block_size)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module = GPT(block_size=args.block_size, n_layer=2, n_embd=32, n_head=2, dropout=0.1)
    if world > 1:
        model = DistributedDataParallel(model)
    # As nanoGPT: each rank draws its own batches and dropout masks.
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = stalwart.TrainState(model=model, optimizer=opt)
    losses: dict[int, float] = {}

    with stalwart.CheckpointManager(args.run_dir, every_steps=args.every, keep_last=2) as ckpt:
        start = ckpt.restore(state) or 0
        print(f"nanogpt rank {rank}/{world} attempt {attempt}: start {start}", flush=True)
        model.train()
        if not args.fixed:
            x, y = get_batch()  # nanoGPT: the first batch, before the loop
        for step in range(start, args.steps):
            for group in opt.param_groups:
                group["lr"] = get_lr(step, lr=args.lr, warmup=5, total=args.steps)
            total = 0.0
            for micro in range(args.grad_accum):
                if args.fixed:
                    x, y = get_batch()  # the fix: drawn after the previous save
                last_micro = micro == args.grad_accum - 1
                sync = (
                    model.no_sync()
                    if isinstance(model, DistributedDataParallel) and not last_micro
                    else contextlib.nullcontext()
                )
                with sync:
                    loss = model(x, y) / args.grad_accum
                    if not args.fixed:
                        x, y = get_batch()  # the trap: the next batch, before the save
                    loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[step + 1] = total
            if args.crash_at == step + 1 and rank == args.crash_rank and attempt == 0:
                print(
                    f"nanogpt rank {rank}: step {step + 1} done, SIGKILL before its save",
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.save(step + 1, state, force=step + 1 == args.steps, metrics={"loss": total})
        verdict = ckpt.resume_verdict
        if rank == 0 and verdict is not None:
            print(f"nanogpt: {verdict.line()}", flush=True)

    if args.out is not None:
        plain = model.module if isinstance(model, DistributedDataParallel) else model
        final: dict[str, Any] = {
            "model": plain.state_dict(),
            "optimizer": opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "losses": losses,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(final, f"{args.out}.rank{rank}")
    del model, state, opt
    return 0


if __name__ == "__main__":
    sys.exit(main())
