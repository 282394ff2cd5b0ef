"""Where checkpoint bytes live, and the commit primitive of each kind of storage."""

from stalwart.storage.base import CheckpointStorage, DurableMirror, StepEntry
from stalwart.storage.local import LocalStorage, fsync_dir, step_dir_name

__all__ = [
    "CheckpointStorage",
    "DurableMirror",
    "LocalStorage",
    "StepEntry",
    "fsync_dir",
    "step_dir_name",
]
