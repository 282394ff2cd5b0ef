"""A small character-level transformer trained with stalwart checkpointing.

The model reads Python source code (the standard library's own files, so the
example needs no download) and learns to predict the next byte. Everything that
makes exact resume hard in real training is here on purpose:

- dropout, so the global torch RNG advances every step (a different stream on
  every rank);
- a shuffled data order, split across ranks, so the data position and sampler
  seed matter;
- AdamW state and a warmup + cosine learning-rate schedule;
- optional DataLoader worker processes, which prefetch ahead of the loop.

It runs as one plain process, or as several ranks under ``torchrun`` with the
model wrapped in DistributedDataParallel (gloo on CPU). Either way: run it, kill
it (or one of its ranks) at any moment, run it again, and it continues from the
newest committed checkpoint and ends with the same weights, bit for bit, as a
run that was never interrupted::

    python examples/charlm.py --run-dir runs/charlm --steps 300 --every 25
    python examples/charlm.py --run-dir runs/charlm --steps 300 --every 25 --crash-at 140
    python examples/charlm.py --run-dir runs/charlm --steps 300 --every 25   # resumes at 125

Under torchrun, with one restart allowed, the recovery happens inside one
command: rank 1 kills itself after step 140, torchrun restarts both ranks, and
they resume at step 125::

    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 \
        examples/charlm.py --run-dir runs/charlm2 --steps 300 --crash-at 140 --crash-rank 1

``--crash-at STEP`` makes rank ``--crash-rank`` SIGKILL itself right after the
optimizer update of step STEP, before that step's checkpoint could be written:
the same as a power cut, an OOM kill or a lost node. Under torchrun it does so
only in the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so the restarted
workers finish. ``examples/demo.py`` drives the whole experiment and compares
the results.
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.nn.parallel import DistributedDataParallel

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


def say(line: str) -> None:
    """Print one line with a single write, so lines of ranks sharing a pipe never interleave.

    ``print`` writes the text and the newline separately; with unbuffered output
    (``python -u``) two ranks' lines can then merge into one.
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


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
    p.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--crash-at", type=int, default=None, metavar="STEP",
                   help="SIGKILL a rank right after the optimizer update of STEP, before its save "
                        "(under torchrun: in the first attempt only)")  # fmt: skip
    p.add_argument("--crash-rank", type=int, default=0, metavar="R",
                   help="the rank that --crash-at kills (default 0)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help="rank 0 writes the final full model, optimizer and scheduler state here "
                        "(torch.save); every rank r writes its RNG states and losses to OUT.rank{r}")  # fmt: skip
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
    # Under torchrun: the default process group, built so that torchrun's restarts
    # reconnect reliably. A plain process gets (0, 1) and no group.
    rank, world = stalwart.init_distributed("gloo")
    if not 0 <= args.crash_rank < world:
        raise ValueError(
            f"--crash-rank must be in [0, {world}) for {world} rank(s), got {args.crash_rank}"
        )
    code = train(args, rank, world)
    # train() has returned, so the DDP model is no longer referenced: an orderly
    # teardown now keeps gloo from aborting the process at exit.
    stalwart.shutdown_distributed()
    return code


def train(args: argparse.Namespace, rank: int, world: int) -> int:
    """The training run of this rank; the return value is the process's exit code."""
    # TORCHELASTIC_RESTART_COUNT is torchrun's attempt number: 0 first, 1 after a restart.
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # One intra-op thread: reductions then run in the same order in every
    # process, so a resumed process computes the same floats as the original.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # The model's initial weights come from the shared seed, so every rank builds
    # the same model (DDP would broadcast rank 0's anyway) ...
    torch.manual_seed(args.seed)

    data, data_hash = load_corpus()
    dataset = WindowDataset(data, context=args.context, stride=args.context)
    # shuffle=True: the order is a function of (seed, epoch), so a resumed process
    # can rebuild it; each rank takes every world-th sample of it. drop_last=True
    # keeps every batch the same shape.
    loader = stalwart.ResumableDataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        seed=args.seed,
        num_workers=args.num_workers,
    )
    model: nn.Module = CharLM(
        context=args.context,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        dropout=args.dropout,
    )
    n_params = sum(p.numel() for p in model.parameters())
    if world > 1:
        # find_unused_parameters=True also keeps DDP from re-bucketing the gradients
        # after its first iteration. A resumed process would otherwise run its first
        # step with the initial buckets where the uninterrupted run had the rebuilt
        # ones; with 3 or more ranks the all-reduce then adds the ranks' gradients
        # in another order and the result differs in the last bits.
        model = DistributedDataParallel(model, find_unused_parameters=True)
    # ... and dropout draws from a stream of its own on each rank, so the ranks do
    # not drop the same units. stalwart saves and restores each rank's stream.
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
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
    who = f"charlm rank {rank}/{world}" if world > 1 else "charlm"

    losses: dict[int, float] = {}
    code = 0
    # Every rank builds the manager and calls restore and save at the same steps;
    # rank 0 writes the manifest and events.jsonl, every rank writes its shard.
    with stalwart.CheckpointManager(
        args.run_dir,
        every_steps=args.every,
        keep_last=args.keep_last,
        metadata=metadata,
        config=config,
    ) as ckpt:
        start = ckpt.restore(state) or 0
        # demo.py reads this line: "start N" is the step this process begins at.
        say(
            f"{who} attempt {attempt} pid {os.getpid()}: start {start} "
            f"({'resumed' if start else 'fresh'}), {len(dataset)} windows from "
            f"{len(data) / 1e3:.0f} KB of stdlib source, {n_params / 1e3:.0f}k parameters, "
            f"batch {args.batch_size} x {world} rank(s), workers={args.num_workers}"
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
            loss.backward()  # DDP averages the gradients across ranks here
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            extra["tokens_seen"] += y.numel() * world
            losses[step + 1] = loss.item()
            if args.crash_at == step + 1 and rank == args.crash_rank and attempt == 0:
                # A real crash: no exception handler, no atexit, no final save. Work
                # since the last committed checkpoint is lost and must be redone.
                say(f"{who}: step {step + 1} done, SIGKILL before its save")
                os.kill(os.getpid(), signal.SIGKILL)
            # Every rank calls save at every step; the ranks decide together whether
            # it writes. The last step is always saved: a finished run keeps its end.
            last = step + 1 == args.steps
            saved = ckpt.save(step + 1, state, force=last, metrics={"loss": losses[step + 1]})
            if rank == 0 and ((step + 1) % args.log_every == 0 or saved or last):
                say(
                    f"step {step + 1:5d}  loss {losses[step + 1]:.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                    f"{(time.perf_counter() - t0) / (step + 1 - start) * 1e3:5.1f} ms/step"
                    + ("  [checkpoint]" if saved else "")
                )
            if ckpt.preempted:
                # Every rank sees this at the same step, after the emergency
                # checkpoint. 143 (128 + SIGTERM) tells a scheduler the job was
                # preempted, not finished; running the command again resumes it.
                say(f"{who}: preempted, stopped after the checkpoint of step {step + 1}")
                code = 143
                break

    if args.out is not None and code == 0:
        # Full (unsharded) state on rank 0, keyed as a plain model's: the same
        # layout with or without DDP. Collective: every rank calls it.
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(model, opt, options=full)
        if rank == 0:
            final = {
                "step": args.steps,
                "world_size": world,
                "model": model_sd,
                "optimizer": optim_sd,
                "scheduler": sched.state_dict(),
                "data": loader.state_dict(),
                "tokens_seen": extra["tokens_seen"],
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(final, args.out)
        per_rank = {
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            # Losses of the steps this process ran: a resumed run's must match
            # the reference run's for the same steps.
            "losses": losses,
        }
        torch.save(per_rank, f"{args.out}.rank{rank}")
    return code


if __name__ == "__main__":
    sys.exit(main())
