"""A small GAN with an EMA generator, checkpointed with stalwart.

Two networks with BatchNorm, two optimizers, an exponential moving average
(EMA) of the generator's weights and a per-rank running loss, all in one
``TrainState``. The data are 2-D points on a ring with per-sample random
augmentation, loaded by ``stalwart.ResumableDataLoader`` (optionally with worker
processes). Everything that made a ported DCGAN resume inexactly under torchrun
is here: BatchNorm statistics that differ between ranks, an EMA copy that is
replicated under DDP and sharded under FSDP2, and a per-rank value in ``extra``.

It runs as one process, or under torchrun with both networks in DDP or FSDP2
(gloo on CPU), in seconds::

    python examples/gan.py --run-dir runs/gan --steps 40
    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 \\
        examples/gan.py --run-dir runs/gan2 --parallel fsdp2 --crash-at 14 --crash-rank 1

``--crash-at STEP`` makes rank ``--crash-rank`` SIGKILL itself right after step
STEP (only in torchrun's first attempt, so the restarted workers finish); the
run resumes from the newest checkpoint and ends bit-exact with a run that was
never interrupted. ``--out FILE`` writes every rank's final tensors (weights,
buffers, EMA, optimizer states) to ``FILE.rank<r>`` and its losses to
``FILE.losses.rank<r>`` for such a comparison.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)

import stalwart

FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class Ring(torch.utils.data.Dataset[torch.Tensor]):
    """Points on a ring; each sample is jittered and rotated at random when read."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> torch.Tensor:
        angle = 2 * math.pi * i / len(self) + random.uniform(-0.05, 0.05)
        point = torch.tensor([math.cos(angle), math.sin(angle)])
        return point + 0.02 * torch.randn(2)  # seeded per sample by ResumableDataLoader


def networks(hidden: int, latent: int) -> tuple[nn.Module, nn.Module]:
    generator = nn.Sequential(
        nn.Linear(latent, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 2)
    )
    discriminator = nn.Sequential(
        nn.Linear(2, hidden), nn.BatchNorm1d(hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1)
    )
    return generator, discriminator


def wrap(module: nn.Module, parallel: str, world: int) -> nn.Module:
    """DDP, FSDP2 (each Linear a unit, then the root) or the module itself."""
    if world == 1 or parallel == "none":
        return module
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in module:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


@torch.no_grad()
def update_ema(ema: nn.Module, generator: nn.Module, decay: float) -> None:
    """EMA of the weights; the BatchNorm statistics are copied (as torch's AveragedModel can)."""
    source = (
        generator.module
        if isinstance(generator, nn.parallel.DistributedDataParallel)
        else generator
    )
    for e, g in zip(ema.parameters(), source.parameters(), strict=True):
        e.lerp_(g, 1 - decay)  # sharded alike under FSDP2: each rank updates its own shard
    for e, g in zip(ema.buffers(), source.buffers(), strict=True):
        e.copy_(g)


def final_tensors(state: stalwart.TrainState) -> dict[str, object]:
    """Every module's and optimizer's full state (sharded tensors gathered), on every rank."""
    full = StateDictOptions(full_state_dict=True)
    out: dict[str, object] = {}
    for unit in state.units:
        name = ".".join(unit.model_path or unit.optim_path or ())
        if unit.optimizers:
            model_sd, optim_sd = get_state_dict(unit.module, unit.optimizers, options=full)
            out[f"{name}/optimizer"] = optim_sd
        else:
            model_sd = get_model_state_dict(unit.module, options=full)
        if unit.model_path is not None:
            out[name] = {k: v.clone() for k, v in model_sd.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--parallel", choices=["ddp", "fsdp2", "none"], default="ddp")
    ap.add_argument("--hidden", type=int, default=33, help="odd: FSDP2 shards unevenly")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--crash-rank", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    rank, world = stalwart.init_distributed("gloo")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)  # the same initial weights on every rank
    latent = 4
    generator, discriminator = networks(args.hidden, latent)
    ema = copy.deepcopy(generator).requires_grad_(False)
    generator = wrap(generator, args.parallel, world)
    discriminator = wrap(discriminator, args.parallel, world)
    if args.parallel == "fsdp2":
        ema = wrap(ema, "fsdp2", world)  # sharded like the generator it follows
    torch.manual_seed(100 + rank)  # a noise stream of each rank's own
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    loader = stalwart.ResumableDataLoader(
        Ring(),
        batch_size=args.batch,
        shuffle=True,
        seed=1,
        drop_last=True,
        num_workers=args.workers,
    )
    extra = {"loss_avg": 0.0}  # this rank's running loss: a per-rank value
    state = stalwart.TrainState(
        model={"G": generator, "D": discriminator},
        optimizer={"G": opt_g, "D": opt_d},
        ema=ema,
        data=loader,
        extra=extra,
    )
    losses: list[str] = []
    with stalwart.CheckpointManager(
        args.run_dir, every_steps=args.every, keep_last=2, async_save=args.async_save
    ) as ckpt:
        start = ckpt.restore(state) or 0
        print(f"rank {rank} start {start}", flush=True)
        batches = loader.forever()
        real_label, fake_label = torch.ones(args.batch, 1), torch.zeros(args.batch, 1)
        for step in range(start, args.steps):
            real = next(batches)
            fake = generator(torch.randn(args.batch, latent))
            # The optimizers clear the gradients: under FSDP2, module.zero_grad()
            # after a forward misses the sharded gradients (docs/multi-model.md).
            opt_d.zero_grad()
            F.binary_cross_entropy_with_logits(discriminator(real), real_label).backward()
            loss_d = F.binary_cross_entropy_with_logits(discriminator(fake.detach()), fake_label)
            loss_d.backward()
            opt_d.step()
            opt_g.zero_grad()
            loss_g = F.binary_cross_entropy_with_logits(discriminator(fake), real_label)
            loss_g.backward()
            opt_g.step()
            update_ema(ema, generator, decay=0.9)
            extra["loss_avg"] = 0.9 * extra["loss_avg"] + 0.1 * loss_g.item()
            losses.append(f"{step + 1} {loss_d.item()!r} {loss_g.item()!r}")
            if args.out:
                with open(f"{args.out}.losses.rank{rank}", "a") as f:
                    f.write(losses[-1] + "\n")
            if FIRST_ATTEMPT and args.crash_at == step + 1 and rank == args.crash_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.save(step + 1, state, metrics={"loss_g": loss_g.item()})
    if args.out:
        torch.save({**final_tensors(state), "extra": dict(extra)}, f"{args.out}.rank{rank}")
    print(f"rank {rank} done {args.steps} loss_avg {extra['loss_avg']:.4f}", flush=True)
    del generator, discriminator, ema, state, opt_g, opt_d
    stalwart.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
