"""``ExactResume``: every rank's RNG state in a Lightning checkpoint, back at the first resumed batch.

Part of ``stalwart.integrations.lightning`` (import it from there); see that
module and docs/integrations.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from stalwart.distributed import get_rank
from stalwart.rng import capture_rng_state, restore_rng_state

__all__ = ["ExactResume"]

logger = logging.getLogger("stalwart")


class ExactResume(Callback):
    """Adds every rank's RNG state to Lightning's checkpoint; restores it at the first resumed batch.

    Lightning's checkpoint has no RNG state, and after ``fit(ckpt_path=...)``
    the dropout masks and random augmentations differ from the run that was
    not interrupted. This callback captures python ``random``, numpy, torch CPU
    and CUDA generators of *each* rank when a checkpoint is taken (the ranks
    gather them, since only rank 0 writes) and puts each rank's own back at the
    start of the first batch after the restore, not at load time: Lightning
    creates the data iterator in between, and that draws from the global RNG.
    A rank beyond the saved world size gets nothing restored (a warning).

    The data position must come from a stateful loader: ``stalwart.ResumableDataLoader``
    or torchdata's ``StatefulDataLoader`` (Lightning saves and restores its
    state itself); with a plain ``DataLoader`` a mid-epoch resume replays batches.
    """

    def __init__(self) -> None:
        self._pending: Mapping[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return "stalwart.ExactResume"

    def state_dict(self) -> dict[str, Any]:
        """Every rank's RNG state, by rank (collective: Lightning calls it on every rank)."""
        mine = capture_rng_state()
        if dist.is_available() and dist.is_initialized():
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        else:
            states = [mine]
        return {"world_size": len(states), "rng": {f"rank_{r}": s for r, s in enumerate(states)}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("rng")
        if not isinstance(rng, Mapping):
            raise ValueError(
                f"ExactResume state has no 'rng' section (keys: {sorted(state_dict)}); "
                "it was not saved by stalwart.integrations.lightning.ExactResume"
            )
        mine = rng.get(f"rank_{get_rank()}")
        if mine is None:
            logger.warning(
                "ExactResume: the checkpoint has RNG states of %d ranks, none for rank %d; "
                "this rank's random streams start afresh",
                len(rng),
                get_rank(),
            )
        self._pending = mine

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            restore_rng_state(pending)
