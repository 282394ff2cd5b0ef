"""DeepSpeed training that survives a crash: stalwart under ``engine.save_checkpoint``.

Run it, kill it (Ctrl-C, SIGKILL, a lost node), run it again: it continues
from the newest checkpoint that verifies, with the same data order and random
numbers, so the run ends bit-identical to one that was never interrupted
(tested in one process and on two ranks resuming from step 4; on two ranks
DeepSpeed's own optimizer restore from step 2 differs by about 1e-7, see
docs/integrations.md)::

    python examples/deepspeed_resume.py --dir runs/ds --steps 20
    torchrun --nproc-per-node=2 examples/deepspeed_resume.py --dir runs/ds --stage 2
    python examples/deepspeed_resume.py --dir runs/ds --durable file:///tmp/ds-store

The lines that are stalwart's are marked ``# stalwart``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import stalwart
from stalwart.integrations.deepspeed import DeepSpeedCheckpointer  # stalwart


def init_process_group() -> int:
    """torchrun's process group (restart-safe, see stalwart.init_distributed), or one of our own."""
    if "RANK" in os.environ:
        return stalwart.init_distributed("gloo")[0]
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asks for it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="runs/deepspeed")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--durable", default=None, help="object store URL (s3://, file://, ...)")
    args = parser.parse_args()
    rank = init_process_group()

    import deepspeed  # after the process group: DeepSpeed then uses it as it is

    g = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1))
    loader = stalwart.ResumableDataLoader(dataset, batch_size=8, shuffle=True, seed=0)  # stalwart
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    on_gpu = torch.cuda.is_available()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        # On a CPU, torch's Adam: DeepSpeed's fused one is compiled at first use (a minute).
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": not on_gpu}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    ckpt = DeepSpeedCheckpointer(  # stalwart
        engine, args.dir, data=loader, keep_last=2, durable=args.durable
    )
    engine.load_checkpoint(args.dir)  # unchanged: now the newest checkpoint that verifies
    start = engine.global_steps  # (RNG and data position come back with it)
    if rank == 0:
        print(f"start {start}", flush=True)

    batches = loader.forever()
    for step in range(start, args.steps):
        x, y = next(batches)
        x = x + 0.01 * torch.randn_like(x)  # random augmentation: resumed exactly too
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.8f}", flush=True)
        if (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.dir)  # unchanged: now committed and verified

    ckpt.close()  # stalwart: waits for the durable upload
    dist.barrier()
    del engine
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
