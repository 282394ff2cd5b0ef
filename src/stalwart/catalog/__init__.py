"""The public read API: what checkpoints a run (or a durable tier) holds, and in what state.

Everything here only reads: listing, checking and planning a gc
sweep never write to, move or delete anything, and never deserialize tensor data
or run a full unpickler (DCP ``.metadata`` goes through ``stalwart.safe_load``'s
restricted reader). The CLI renders these results; programs can use them too::

    from stalwart import catalog

    for info in catalog.list_run("runs/exp1"):
        catalog.check_step(info, checksums=True)
        print(info.name, info.status, [str(p) for p in info.problems])

A run directory is input from outside: entries that are links, FIFOs or devices
are never listed (``LocalStorage.scan``), sizes are taken with ``lstat`` and a
manifest is read only when it is a regular file (``pipeline.read_manifest``).
"""

from __future__ import annotations

from stalwart.catalog.steps import (
    Problem,
    StepInfo,
    check_files,
    check_metadata,
    check_step,
    dir_usage,
    kind_of_dir,
    list_run,
    list_steps,
    list_store,
    load_manifest,
    read_checkpoint,
    scan_run,
    strip_source,
    verify_checkpoint,
)
from stalwart.catalog.sweep import GcItem, StoreGcItem, age_text, plan_gc, plan_store_gc
from stalwart.events import read_events
from stalwart.history import (
    VERDICT_EVENTS,
    RunHistory,
    read_history,
    resume_verdicts,
    verdict_mark,
)

__all__ = [
    "VERDICT_EVENTS",
    "GcItem",
    "Problem",
    "RunHistory",
    "StepInfo",
    "StoreGcItem",
    "age_text",
    "check_files",
    "check_metadata",
    "check_step",
    "dir_usage",
    "kind_of_dir",
    "list_run",
    "list_steps",
    "list_store",
    "load_manifest",
    "plan_gc",
    "plan_store_gc",
    "read_checkpoint",
    "read_events",
    "read_history",
    "resume_verdicts",
    "scan_run",
    "strip_source",
    "verdict_mark",
    "verify_checkpoint",
]
