"""Figures of the training-loop benchmark from its samples (no torch: the runner uses it too)."""

from __future__ import annotations

import math
import statistics
from typing import Any


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


TRAIN_SEGMENTS = (
    "base_segments_s",
    "ckpt_segments_s",
    "blocked_segments_s",
    "save_calls_s",
    "logged_stalls_s",
)
"""The per-segment and per-save samples of a training-loop run (pooled across its processes)."""


def train_summary(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with its overhead figures computed from its samples.

    Each pair of segments (without checkpoints, then with) ran back to back, so
    its ratio cancels the drift a shared host brings over a run; the overhead
    is the median of the pairs' ratios, and its share spent blocked in
    ``save()`` the median of the pairs' blocked time over their base.
    """
    pairs = list(zip(run["base_segments_s"], run["ckpt_segments_s"], strict=True))
    blocked = run["blocked_segments_s"]
    overhead = median([c / b for b, c in pairs]) - 1
    blocked_share = median([k / b for (b, _), k in zip(pairs, blocked, strict=True)])
    base = median(run["base_segments_s"])
    return {
        **run,
        "rounds": len(pairs),
        "step_s": base / run["segment_steps"],
        "base_s": base,
        "ckpt_s": median(run["ckpt_segments_s"]),
        "overhead": overhead,
        # The overhead splits into time the loop sat inside save() (or waited for a
        # save at a segment's end) and steps that ran slower beside a background save.
        "blocked_share": blocked_share,
        "background_share": overhead - blocked_share,
        "save_call_s": median(run["save_calls_s"]),
        "save_call_max_s": max(run["save_calls_s"], default=math.nan),
        "logged_stall_s": median(run["logged_stalls_s"]),
    }


def pooled_train_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs in several processes (at different times of the benchmark)
    as one: their samples pooled, the figures recomputed (``train_summary``). A run
    that failed is left out; if every one failed, the first error."""
    ok = [run for run in runs if "error" not in run]
    if not ok:
        return runs[0]
    runs = ok
    first = runs[0]
    pooled = {key: [x for run in runs for x in run[key]] for key in TRAIN_SEGMENTS}
    saves = sum(run["saves"] for run in runs)
    return train_summary({**first, **pooled, "saves": saves, "processes": len(runs)})
