"""Rank, world size and small agreements across ranks; a leaf helper.

Every function works without an initialized process group (a single process is
rank 0 of a world of 1), so the single-process path needs no launcher.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["get_rank", "get_world_size", "is_distributed"]


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when torch.distributed is initialized (and ``group`` spans more than this process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return group is None or dist.get_world_size(group) >= 1


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed(group) else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1
