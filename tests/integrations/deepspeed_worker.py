"""A DeepSpeed training worker for the integration tests: one process, or each rank under torchrun.

It trains a tiny MLP with a DeepSpeed engine (ZeRO stage ``--stage``) on a
``ResumableDataLoader`` with random noise in the loss, saves with
``engine.save_checkpoint`` every ``--save-every`` steps through
``DeepSpeedCheckpointer``, resumes with ``engine.load_checkpoint``, and can SIGKILL one rank
(once, on the first attempt) after a step or between DeepSpeed's files of a
save. Rank 0 writes per-step losses and the final weights to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

import stalwart
from stalwart.integrations.deepspeed import DeepSpeedCheckpointer

FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def say(message: str) -> None:
    # One write per line: two ranks share torchrun's stdout.
    os.write(sys.stdout.fileno(), (message + "\n").encode())


def init() -> tuple[int, int]:
    """A process group: torchrun's (restart-safe), or a one-process group of our own."""
    if "RANK" in os.environ:
        return stalwart.init_distributed("gloo")
    os.environ["LOCAL_RANK"] = "0"  # DeepSpeed asks for it even with a group in place
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return 0, 1


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-after-step", type=int, default=None)
    p.add_argument("--kill-in-save", type=int, default=None, help="step whose save is cut short")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, _world = init()

    import deepspeed

    dataset = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=torch.Generator().manual_seed(1)),
        torch.randn(64, 2, generator=torch.Generator().manual_seed(2)),
    )
    loader = stalwart.ResumableDataLoader(dataset, batch_size=4, shuffle=True, seed=3)
    model = build()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        # torch's Adam: DeepSpeed's fused one would be compiled at first use (a minute, on CI).
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    engine, _opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    ckpt = DeepSpeedCheckpointer(engine, args.dir, data=loader, keep_last=2)
    if args.kill_in_save is not None and rank == args.kill_rank and FIRST_ATTEMPT:
        cut_save_short(engine, args.kill_in_save)
    latest = os.path.join(args.dir, "latest")
    if rank == 0 and os.path.exists(latest):
        with open(latest) as f:
            say(f"latest {f.read().strip()} committed {sorted(ckpt.manager.all_steps())}")
    engine.load_checkpoint(args.dir)  # unchanged: verified, with fallback
    start = engine.global_steps
    say(f"rank {rank} start {start}")
    losses = {}
    batches = loader.forever()
    for step in range(start, args.steps):
        x, y = next(batches)
        noise = 0.01 * torch.randn_like(x)  # the global RNG must come back too
        loss = torch.nn.functional.mse_loss(engine(x + noise), y)
        engine.backward(loss)
        engine.step()
        losses[step + 1] = loss.item()
        say(
            f"rank {rank} step {step + 1} loss {loss.item():.10f} x {x.sum().item():.6f} noise {noise.sum().item():.6f}"
        )
        if (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.dir, client_state={"step": step + 1})
        if rank == args.kill_rank and step + 1 == args.kill_after_step and FIRST_ATTEMPT:
            os.kill(os.getpid(), signal.SIGKILL)
    weights = {k: v.detach().clone() for k, v in full_weights(engine).items()}
    if rank == 0:
        torch.save({"losses": losses, "weights": weights, "start": start}, args.out)
    ckpt.close()
    dist.barrier()
    del engine
    dist.destroy_process_group()


def full_weights(engine) -> dict[str, torch.Tensor]:
    """The whole model on every rank (ZeRO-3 gathers its partitions)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def cut_save_short(engine, step: int) -> None:
    """SIGKILL this rank when DeepSpeed hands it the optimizer shard of ``step``'s save."""
    seam = engine.checkpoint_engine
    real = seam.save

    def save(state_dict, path):
        if f"global_step{step}" in str(path) and "optim_states" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(state_dict, path)

    seam.save = save


if __name__ == "__main__":
    main()
