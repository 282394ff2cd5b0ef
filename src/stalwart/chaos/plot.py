"""The PNG of a chaos run: progress against time with the faults, and each recovery split.

Needs matplotlib, imported when called; draws on a ``Figure`` with the Agg
canvas, never through ``pyplot`` (no global state, no display), as
``stalwart report`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from stalwart.chaos.supervisor import ChaosRecord

__all__ = ["RECOVERY_PARTS", "draw_chaos"]

RECOVERY_PARTS = (
    ("detection_s", "detection", "tab:red"),
    ("restart_s", "restart", "tab:orange"),
    ("restore_s", "restore", "tab:green"),
    ("first_step_s", "first step", "tab:blue"),
)
"""The parts of a recovery, in order: (key in a failure's dict, label, colour)."""

_FAULT_COLOURS = {"kill": "tab:red", "term": "tab:orange", "stop": "tab:gray"}


def draw_chaos(
    record: ChaosRecord,
    measured: dict[str, Any],
    predicted: dict[str, Any] | None,
    path: Path | BinaryIO,
    *,
    saves: Sequence[tuple[float, int]] = (),
    title: str = "",
) -> None:
    """Draw the run into ``path`` (PNG). ImportError without matplotlib.

    Top: the step each progress line reported against seconds since the start,
    one colour per attempt; faults as vertical lines (stops shaded); committed
    saves as ticks; the ideal rate, the measured goodput and the predicted
    goodput as lines from the window's start. Bottom: one bar per failure,
    split into detection, restart, restore and first step.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 1.4]})
    t0 = record.started
    for attempt in record.attempts:
        if attempt.steps:
            top.plot(
                [t - t0 for t, _ in attempt.steps],
                [s for _, s in attempt.steps],
                ".",
                markersize=3,
                label=f"attempt {attempt.index}",
            )
    if saves:
        top.plot(
            [t - t0 for t, _ in saves],
            [s for _, s in saves],
            "|",
            color="black",
            markersize=9,
            label="checkpoint committed",
        )
    for injected in record.faults:
        colour = _FAULT_COLOURS[injected.fault.kind]
        x = injected.time - t0
        if injected.fault.kind == "stop":
            end = (injected.resumed or record.ended) - t0
            top.axvspan(x, end, color=colour, alpha=0.25)
        else:
            top.axvline(x, color=colour, linewidth=1.5, alpha=0.8)
        top.annotate(injected.fault.kind, (x, 1.0), xycoords=("data", "axes fraction"),
                     xytext=(2, -12), textcoords="offset points", fontsize=8, color=colour)  # fmt: skip
    _rate_lines(top, measured, predicted, t0)
    top.set_xlabel("seconds since the chaos run started")
    top.set_ylabel("training step")
    top.grid(True, alpha=0.3)
    top.legend(loc="lower right", fontsize=8)
    top.set_title(title or _headline(measured, predicted), fontsize=10)
    _recovery_bars(bottom, measured["failures"])
    fig.savefig(path, format="png")


def _headline(measured: dict[str, Any], predicted: dict[str, Any] | None) -> str:
    text = f"goodput {measured['goodput_steps_per_s']:.2f} steps/s"
    if measured["goodput_fraction"] is not None:
        text += f" = {measured['goodput_fraction']:.1%} of ideal"
    if predicted is not None and predicted.get("goodput_fraction") is not None:
        text += f"; Young/Daly predicts {predicted['goodput_fraction']:.1%}"
    return text


def _rate_lines(
    ax: Any, measured: dict[str, Any], predicted: dict[str, Any] | None, t0: float
) -> None:
    start = measured["window"]["start"] - t0
    end = measured["window"]["end"] - t0
    first = measured["steps"]["first"]
    rates = [("measured goodput", measured["goodput_steps_per_s"], "-", "black")]
    if measured["ideal_steps_per_s"] is not None:
        rates.append(
            ("ideal (no saves, no failures)", measured["ideal_steps_per_s"], ":", "tab:green")
        )
    if predicted is not None and predicted.get("goodput_steps_per_s") is not None:
        rates.append(
            ("Young/Daly prediction", predicted["goodput_steps_per_s"], "--", "tab:purple")
        )
    top_step = max(measured["steps"]["last"], first + 1)
    for label, rate, style, colour in rates:
        # Clipped at the top of the data, so the ideal line does not squash the plot.
        until = min(end, start + (top_step * 1.1 - first) / rate) if rate > 0 else end
        ax.plot([start, until], [first, first + rate * (until - start)], style, color=colour,
                linewidth=1.3, label=f"{label}: {rate:.2f} steps/s")  # fmt: skip


def _recovery_bars(ax: Any, failures: list[dict[str, Any]]) -> None:
    shown = [f for f in failures if f.get("detection_s") is not None]
    if not shown:
        ax.text(0.5, 0.5, "no failures", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        return
    labels = []
    for y, failure in enumerate(shown):
        left = 0.0
        for key, label, colour in RECOVERY_PARTS:
            width = failure.get(key)
            if width is None:
                continue
            ax.barh(y, width, left=left, color=colour, label=label if y == 0 else None)
            left += width
        lost = failure.get("lost_steps")
        ax.annotate(f"{lost if lost is not None else '?'} steps lost", (left, y),
                    xytext=(4, -3), textcoords="offset points", fontsize=8)  # fmt: skip
        labels.append(f"{failure['kind']} at {failure['at']:.0f} s")
    ax.set_yticks(range(len(shown)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the fault to the first step after it")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, ncol=4, frameon=False)
