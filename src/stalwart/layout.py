"""The names stalwart gives things in a run directory and in a durable tier: one place.

Plain data and string parsing only (no I/O, no torch), so every layer may import it::

    runs/exp1/
      step_000000200/                 committed checkpoint (holds MANIFEST.json)
        MANIFEST.json                 the commit marker, written last
        .metadata  __0_0.distcp ...   torch.distributed.checkpoint files
      .step_000000400.tmp-<hex>/      staging: a save in progress, or abandoned by a crash
      .step_000000100.del-<hex>/      being deleted by retention (renamed first, then removed)
      .step_000000300.corrupt-<hex>/  moved aside by restore after it failed verification
      events.jsonl                    one JSON line per save/restore/skip
      fingerprints/                   per-rank step fingerprints (the exact-resume certificate)
      watchdog/rank00001-<ns>.txt     thread stacks of a rank whose hang watchdog fired
      .lock                           the run lock

    s3://bucket/prefix/
      step_000000200/MANIFEST.json
      step_000000200/data-<16 hex>/__0_0.distcp

Anything in a run that does not parse as one of these names is not stalwart's:
nothing lists, restores or deletes it.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Literal

__all__ = [
    "DCP_METADATA_JSON_NAME",
    "DCP_METADATA_NAME",
    "EVENTS_NAME",
    "FINGERPRINT_DIR",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "WATCHDOG_DIR",
    "CheckpointName",
    "HiddenKind",
    "hidden_name",
    "parse_checkpoint_name",
    "parse_step_key",
    "step_dir_name",
    "step_of_dir_name",
]

MANIFEST_NAME = "MANIFEST.json"
"""The commit marker inside a checkpoint directory (or step prefix of a store)."""
DCP_METADATA_NAME = ".metadata"
"""torch.distributed.checkpoint's index of a checkpoint: a pickle, read only by ``safe_load``."""
DCP_METADATA_JSON_NAME = ".metadata.json"
"""The same index as JSON (``stalwart.metadata_json``), which a restore reads instead."""
EVENTS_NAME = "events.jsonl"
"""The run's event log, one JSON object a line."""
FINGERPRINT_DIR = "fingerprints"
"""Per-rank fingerprint logs of the exact-resume certificate."""
WATCHDOG_DIR = "watchdog"
"""Thread stacks dumped by ``stalwart.Watchdog``, one file per rank and firing."""
LOCK_NAME = ".lock"
"""The run lock a writing manager (or ``stalwart gc``) holds."""

HiddenKind = Literal["tmp", "del", "corrupt"]
"""``tmp``: staging of a save; ``del``: a retention deletion; ``corrupt``: quarantined by restore."""

_STEP_DIGITS = 9
_STEP_DIGITS_RE = r"(\d{9}|[1-9]\d{9,})"
"""A step as ``step_dir_name`` writes it: nine digits, or more without a leading zero.
Any other spelling of a step (``step_0000000200``) is not a name stalwart makes: a
listing that took it for step 200 would send a restore to ``step_000000200``.
``\\Z``, not ``$``: a name ending in a newline is no checkpoint either."""
_STEP_RE = re.compile(rf"^step_{_STEP_DIGITS_RE}\Z")
_HIDDEN_RE = re.compile(rf"^\.step_{_STEP_DIGITS_RE}\.(tmp|del|corrupt)-[0-9a-f]+\Z")
_STEP_KEY_RE = re.compile(rf"^step_{_STEP_DIGITS_RE}/(.+)\Z")


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointName:
    """What a checkpoint directory's name says: its step, and committed or which leftover."""

    step: int
    kind: Literal["step"] | HiddenKind
    """``step`` for ``step_N`` (committed if it holds a manifest); else the hidden kind."""


def step_dir_name(step: int) -> str:
    """``step_000000200`` for 200: the committed directory (or store prefix) of ``step``."""
    return f"step_{step:0{_STEP_DIGITS}d}"


def step_of_dir_name(name: str) -> int | None:
    """The step a committed checkpoint directory's name says (``step_000000200`` -> 200), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def hidden_name(step: int, kind: HiddenKind) -> str:
    """A fresh ``.step_N.<kind>-<12 hex>`` name: unique, hidden, never a committed name."""
    return f".{step_dir_name(step)}.{kind}-{uuid.uuid4().hex[:12]}"


def parse_checkpoint_name(name: str) -> CheckpointName | None:
    """The step and kind of a checkpoint directory name (committed or hidden), else None."""
    if m := _STEP_RE.match(name):
        return CheckpointName(step=int(m.group(1)), kind="step")
    if m := _HIDDEN_RE.match(name):
        kind: HiddenKind = m.group(2)  # type: ignore[assignment]  # the regex allows only these
        return CheckpointName(step=int(m.group(1)), kind=kind)
    return None


def parse_step_key(key: str) -> tuple[int, str] | None:
    """``(step, rest)`` for an object key ``step_N/rest`` of a durable tier, else None."""
    m = _STEP_KEY_RE.match(key)
    return (int(m.group(1)), m.group(2)) if m else None
