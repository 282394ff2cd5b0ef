"""Applying a ``RetentionPolicy`` to the primary tier: deleting what the policy lets go.

The policy (``policy.py``) only decides; this module deletes, on the committing
rank, after a commit and after an upload made a step durable (the upload
thread), so it may run from two threads: the caller passes the steps that must
stay (queued or uploading) and holds them steady for the duration of the call.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from stalwart.events import EventLog
from stalwart.policy import RetentionPolicy
from stalwart.storage.base import CheckpointStorage

__all__ = ["apply_retention"]


def apply_retention(
    storage: CheckpointStorage,
    policy: RetentionPolicy,
    events: EventLog,
    *,
    protected: Collection[int] = (),
) -> list[int]:
    """Delete the committed steps ``policy`` lets go, except ``protected``; return those deleted.

    A failed deletion is logged as ``delete_failed`` and never raised: it costs
    disk space, never a checkpoint, and training goes on.
    """
    deleted: list[int] = []
    if policy.keeps_all:
        return deleted  # no need to list the steps (a run may hold thousands)
    for step in policy.to_delete(storage.committed_steps()):
        if step in protected:
            continue
        try:
            storage.delete(step)
        except OSError as exc:
            events.emit("delete_failed", logging.WARNING, step=step, error=str(exc))
        else:
            events.emit("delete", step=step, reason="retention")
            deleted.append(step)
    return deleted
