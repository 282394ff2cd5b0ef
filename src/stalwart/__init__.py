"""stalwart: crash-safe, exact-resume checkpointing for custom PyTorch training.

Quick start::

    state = stalwart.TrainState(model=model, optimizer=opt, scheduler=sched, data=loader)
    with stalwart.CheckpointManager("runs/exp1", every_steps=200, keep_last=3) as ckpt:
        start = ckpt.restore(state) or 0
        for step in range(start, total_steps):
            train_one_step(...)
            ckpt.save(step + 1, state)
            if ckpt.preempted:
                break
"""

from stalwart._version import __version__
from stalwart.distributed import init_distributed, shutdown_distributed
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CommitConflictError,
    CoordinationError,
    DurableStoreError,
    GuardLimitError,
    RollbackError,
    RunLockedError,
    StalwartError,
    StateMismatchError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from stalwart.guard import Guard, GuardDecision, GuardPolicy
from stalwart.loader import ResumableDataLoader
from stalwart.manager import CheckpointManager
from stalwart.sampler import ResumableSampler
from stalwart.state import TrainState
from stalwart.storage.remote import RetryPolicy
from stalwart.tiers import DurableConfig
from stalwart.watchdog import Watchdog

__all__ = [
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CommitConflictError",
    "CoordinationError",
    "DurableConfig",
    "DurableStoreError",
    "Guard",
    "GuardDecision",
    "GuardLimitError",
    "GuardPolicy",
    "ResumableDataLoader",
    "ResumableSampler",
    "RetryPolicy",
    "RollbackError",
    "RunLockedError",
    "StalwartError",
    "StateMismatchError",
    "TrainState",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "Watchdog",
    "__version__",
    "init_distributed",
    "shutdown_distributed",
]
