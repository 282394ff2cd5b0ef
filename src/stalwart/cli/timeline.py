"""A run's history from ``events.jsonl``: summary numbers, a PNG timeline and an HTML page.

``read_timeline`` and ``summarize`` are plain data (no torch, no matplotlib).
``draw_timeline`` needs matplotlib, imported when called; it draws on a
``Figure`` with the Agg canvas directly, never through ``pyplot``, so it
touches no global matplotlib state and needs no display.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import html
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from stalwart.events import read_events
from stalwart.history import VERDICT_EVENTS, verdict_mark

__all__ = [
    "INCIDENT_EVENTS",
    "PROBLEM_EVENTS",
    "Timeline",
    "describe_incident",
    "draw_timeline",
    "read_run",
    "read_timeline",
    "render_html",
    "summarize",
]

PROBLEM_EVENTS = (
    "save_failed",
    "restore_skipped",
    "quarantine",
    "quarantine_failed",
    "delete_failed",
    "save_skipped",
    "restore_failed",
    "resume_diverged",
    "guard",
    "guard_limit",
    "watchdog",
)
"""Events that the report lists one by one, with their reason."""
INCIDENT_EVENTS = ("guard", "guard_limit", "watchdog")
"""Training incidents (``stalwart.Guard``, ``stalwart.Watchdog``), described by ``describe_incident``."""


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _mapping(value: Any) -> dict[str, Any]:
    """``value`` when it is a dict, else an empty one: events.jsonl is input from outside."""
    return value if isinstance(value, dict) else {}


def _items(value: Any) -> list[Any]:
    """``value`` when it is a list, else an empty one: events.jsonl is input from outside."""
    return value if isinstance(value, list) else []


def _culprits(record: dict[str, Any]) -> str:
    """``nonfinite_loss on rank 1: loss nan`` for each rank the guard's event names."""
    parts = []
    for r in _items(record.get("ranks")):
        if not isinstance(r, dict):
            continue
        reasons = _items(r.get("reasons"))
        values = f"loss {_value(r.get('loss'))}"
        if r.get("grad_norm") is not None:
            values += f", grad norm {_value(r.get('grad_norm'))}"
        if "spike" in reasons and r.get("median") is not None:
            values += f" vs median {_value(r.get('median'))}"
        parts.append(f"{'/'.join(map(str, reasons))} on rank {r.get('rank')}: {values}")
    return "; ".join(parts) or str(record.get("reason"))


def describe_incident(record: dict[str, Any]) -> str:
    """One line for a ``guard``, ``guard_limit`` or ``watchdog`` event, as ``ls`` and ``report`` show it.

    Any JSON value in any field gives a line (a crafted or garbled event must
    not stop ``ls``): a field of the wrong type reads as missing.
    """
    event = record.get("event")
    if event == "watchdog":
        stacks = record.get("stacks")
        return (
            f"rank {record.get('rank')} made no progress for {_value(record.get('silent_s'))} s "
            f"after step {record.get('step')} (timeout {_value(record.get('timeout'))} s); "
            + (f"stacks in {stacks}" if stacks else "stacks could not be written")
            + (f"; exited {record['exit_code']}" if record.get("exit_code") is not None else "")
        )
    if event == "guard_limit":
        return str(record.get("message") or f"too many {record.get('action')}s")
    action = record.get("action")
    line = f"{action} ({_culprits(record)})"
    if action == "rollback":
        line = f"rollback to step {record.get('restored_step')} ({_culprits(record)})"
        skipped = record.get("skipped")
        if isinstance(skipped, dict):
            start, end = _mapping(skipped.get("from")), _mapping(skipped.get("to"))
            line += (
                f"; skipped samples from epoch {start.get('epoch')} position "
                f"{start.get('consumed')} to epoch {end.get('epoch')} position {end.get('consumed')}"
                + (f" ({skipped['samples']})" if skipped.get("samples") is not None else "")
            )
    if record.get("note"):
        line += f"; {record['note']}"
    return line


@dataclasses.dataclass(slots=True)
class Timeline:
    """The events of one run, by kind, oldest first; each a dict as in ``events.jsonl``."""

    saves: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    restores: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    problems: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``PROBLEM_EVENTS`` records."""
    opens: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``open`` records: one per manager started (a job start or restart)."""
    other: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Everything else (``close``, ``delete``, ``restore_none``, ...)."""

    @property
    def all(self) -> list[dict[str, Any]]:
        merged = [*self.saves, *self.restores, *self.problems, *self.opens, *self.other]
        return sorted(merged, key=lambda r: r["time"])


_LAST_TIME = 253402300799.0
"""9999-12-31T23:59:59Z, the last second ``datetime`` can show."""


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, a bool, NaN, infinite, too big)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        return None
    return number if math.isfinite(number) else None


def _time(value: Any) -> bool:
    number = _number(value)
    return number is not None and 0 <= number <= _LAST_TIME


def read_timeline(records: Iterable[dict[str, Any]]) -> Timeline:
    """Sort event records by kind; records without a ``time`` a date can show (seconds since
    1970, before year 10000) or without a string ``event`` are dropped."""
    timeline = Timeline()
    for record in records:
        if not _time(record.get("time")) or not isinstance(record.get("event"), str):
            continue
        event = record["event"]
        if event == "save":
            timeline.saves.append(record)
        elif event == "restore":
            timeline.restores.append(record)
        elif event in PROBLEM_EVENTS:
            timeline.problems.append(record)
        elif event == "open":
            timeline.opens.append(record)
        else:
            timeline.other.append(record)
    for part in (timeline.saves, timeline.restores, timeline.problems, timeline.opens):
        part.sort(key=lambda r: r["time"])
    timeline.other.sort(key=lambda r: r["time"])
    return timeline


def read_run(run: Path) -> Timeline:
    """``read_timeline`` of ``<run>/events.jsonl`` (torn or garbled lines are skipped)."""
    return read_timeline(read_events(run))


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p95": None, "max": None}
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p95": p95,
        "max": ordered[-1],
    }


def _values(records: Iterable[dict[str, Any]], key: str) -> list[float]:
    return [v for r in records if (v := _number(r.get(key))) is not None]


def summarize(timeline: Timeline) -> dict[str, Any]:
    """Counts and timing statistics (seconds, bytes, MB/s) of a run, as JSON data."""
    everything = timeline.all
    first = everything[0]["time"] if everything else None
    last = everything[-1]["time"] if everything else None
    saves = timeline.saves
    counts: dict[str, int] = {}
    for record in everything:
        counts[record["event"]] = counts.get(record["event"], 0) + 1
    last_bytes = _number(saves[-1].get("bytes")) if saves else None
    return {
        "first_time": first,
        "last_time": last,
        "span_s": None if first is None or last is None else last - first,
        "events": len(everything),
        "counts": counts,
        "starts": len(timeline.opens),
        "saves": len(saves),
        "async_saves": sum(1 for s in saves if s.get("async_save") is True),
        "emergency_saves": sum(1 for s in saves if s.get("emergency") is True),
        "steps_saved": [s.get("step") for s in saves],
        "stall_s": _stats(_values(saves, "stall_s")),
        "total_s": _stats(_values(saves, "total_s")),
        "stall_total_s": sum(_values(saves, "stall_s")),
        "throughput_MBps": _stats(_values(saves, "throughput_MBps")),
        "last_checkpoint_bytes": None if last_bytes is None else int(last_bytes),
        "restores": [
            {
                "time": r["time"],
                "step": r.get("step"),
                "seconds": _number(r.get("seconds")),
                # Older events.jsonl called it "exact"; it only ever meant this.
                "same_world_size": r.get("same_world_size", r.get("exact")),
                "resume": "rollback (guard)"
                if _is_rollback(timeline, r)
                else verdict_mark(_verdict_of(timeline, r)),
            }
            for r in timeline.restores
        ],
        "problems": [
            {
                "time": p["time"],
                "event": p["event"],
                "step": p.get("step"),
                "detail": describe_incident(p)
                if p["event"] in INCIDENT_EVENTS
                else str(
                    p.get("reason")
                    or p.get("error")
                    or p.get("message")
                    or (f"moved to {p['path']}" if p.get("path") else "")
                ),
            }
            for p in timeline.problems
        ],
    }


def _verdict_of(timeline: Timeline, restore: dict[str, Any]) -> dict[str, Any] | None:
    """The certificate's verdict on ``restore``: the first verdict event after it, before the next restore."""
    later = [r for r in timeline.restores if r["time"] > restore["time"]]
    until = later[0]["time"] if later else math.inf
    for record in _verdicts(timeline):
        if restore["time"] <= record["time"] < until and record.get("restored_step") == restore.get(
            "step"
        ):
            return record
    return None


def _is_rollback(timeline: Timeline, restore: dict[str, Any]) -> bool:
    """Whether ``restore`` was a guard's rollback: its ``guard`` event follows within the second."""
    return any(
        p["event"] == "guard"
        and p.get("action") == "rollback"
        and p.get("restored_step") == restore.get("step")
        and 0 <= p["time"] - restore["time"] < 1.0
        for p in timeline.problems
    )


def _verdicts(timeline: Timeline) -> list[dict[str, Any]]:
    return [r for r in timeline.all if r["event"] in VERDICT_EVENTS]


_MARKERS: dict[str, tuple[str, str, str]] = {
    # event: (marker, colour, label)
    "restore": ("^", "tab:green", "restore"),
    "open": ("|", "tab:gray", "start / restart"),
    "save_skipped": ("o", "tab:gray", "save skipped"),
    "restore_skipped": ("X", "tab:orange", "restore skipped (bad checkpoint)"),
    "quarantine": ("s", "tab:orange", "moved aside (quarantine)"),
    "quarantine_failed": ("s", "tab:red", "quarantine failed"),
    "delete_failed": ("d", "tab:red", "delete failed"),
    "save_failed": ("X", "tab:red", "save failed"),
    "restore_failed": ("X", "tab:purple", "restore failed"),
    "resume_verified": ("P", "tab:green", "resume verified exact"),
    "resume_diverged": ("X", "tab:red", "resume diverged"),
    "guard": ("v", "tab:olive", "guard: step skipped / rolled back"),
    "guard_limit": ("X", "tab:brown", "guard limit reached"),
    "watchdog": ("*", "tab:red", "watchdog: no progress"),
}


def draw_timeline(timeline: Timeline, path: Path | BinaryIO, *, title: str = "") -> None:
    """Draw the run's timeline as a PNG into ``path`` (a file name or a binary stream);
    needs matplotlib (ImportError without it).

    Top: seconds per save (total, and the part that blocked training), log
    scale when they span more than two decades. Middle: write throughput. Bottom:
    one row per kind of event (starts, restores, skips, quarantines, failures).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    from matplotlib.figure import Figure

    def when(records: Sequence[dict[str, Any]]) -> list[datetime.datetime]:
        return [datetime.datetime.fromtimestamp(r["time"]) for r in records]

    fig = Figure(figsize=(11, 7.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    top, middle, bottom = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.5, 1.6]}
    )
    saves = timeline.saves
    timed = [s for s in saves if _number(s.get("total_s")) is not None]
    emergency = [s for s in timed if s.get("emergency") is True]
    if timed:
        top.plot(
            when(timed),
            [s["total_s"] for s in timed],
            "-o",
            color="tab:blue",
            markersize=7,
            fillstyle="none",
            linewidth=2.5,
            alpha=0.8,
            label="save total (until committed)",
        )
        stalled = [s for s in timed if _number(s.get("stall_s")) is not None]
        top.plot(
            when(stalled),
            [s["stall_s"] for s in stalled],
            "-o",
            color="tab:red",
            markersize=4,
            label="stall (training blocked)",
        )
        if emergency:
            top.plot(
                when(emergency),
                [s["total_s"] for s in emergency],
                "*",
                color="tab:purple",
                markersize=12,
                linestyle="none",
                label="emergency save (preemption)",
            )
        positive = [v for v in _values(timed, "total_s") + _values(timed, "stall_s") if v > 0]
        if positive and max(positive) / min(positive) > 100:
            top.set_yscale("log")
        top.legend(loc="best", fontsize=8)
    else:
        top.text(0.5, 0.5, "no saves recorded", ha="center", va="center", transform=top.transAxes)
    top.set_ylabel("seconds per save")
    top.grid(True, alpha=0.3)
    top.set_title(title or "checkpoint timeline", fontsize=11)

    rated = [s for s in saves if _number(s.get("throughput_MBps")) is not None]
    if rated:
        middle.plot(
            when(rated), [s["throughput_MBps"] for s in rated], "-o", color="tab:cyan", markersize=3
        )
    middle.set_ylabel("write MB/s")
    middle.grid(True, alpha=0.3)

    rows = [name for name in _MARKERS if _has(timeline, name)]
    for y, name in enumerate(rows):
        marker, colour, _label = _MARKERS[name]
        records = _records(timeline, name)
        bottom.plot(
            when(records),
            [y] * len(records),
            marker=marker,
            color=colour,
            linestyle="none",
            markersize=10 if marker != "|" else 16,
            markeredgewidth=2,
        )
        if name != "open":
            for r, t in zip(records, when(records), strict=True):
                bottom.annotate(
                    f"through {r.get('through')}"
                    if name == "resume_verified"
                    else f"step {r.get('step')}",
                    (t, y),
                    textcoords="offset points",
                    xytext=(4, 5),
                    fontsize=7,
                )
    bottom.set_yticks(range(len(rows)), [_MARKERS[n][2] for n in rows], fontsize=8)
    bottom.set_ylim(-0.7, max(len(rows), 1) - 0.3)
    bottom.grid(True, axis="x", alpha=0.3)
    if not rows:
        bottom.text(0.5, 0.5, "no events", ha="center", va="center", transform=bottom.transAxes)
    locator = AutoDateLocator()  # type: ignore[no-untyped-call]
    bottom.xaxis.set_major_locator(locator)
    bottom.xaxis.set_major_formatter(ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    fig.savefig(path, format="png")


def _records(timeline: Timeline, name: str) -> list[dict[str, Any]]:
    if name == "restore":
        return timeline.restores
    if name == "open":
        return timeline.opens
    if name == "resume_verified":
        return [r for r in timeline.other if r["event"] == name]
    return [p for p in timeline.problems if p["event"] == name]


def _has(timeline: Timeline, name: str) -> bool:
    return bool(_records(timeline, name))


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _fmt_time(unix: float | None) -> str:
    if unix is None:
        return "-"
    try:
        return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError):
        return f"invalid time ({unix!r})"


def render_html(run: str, summary: dict[str, Any], png: bytes | None) -> str:
    """A self-contained HTML page: the PNG inlined (base64) and the summary as tables."""
    esc = html.escape
    s = summary
    stall, total, rate = s["stall_s"], s["total_s"], s["throughput_MBps"]
    rows = [
        ("events", str(s["events"])),
        ("first / last event", f"{_fmt_time(s['first_time'])} / {_fmt_time(s['last_time'])}"),
        ("starts (manager opened)", str(s["starts"])),
        (
            "saves",
            f"{s['saves']} ({s['async_saves']} async, {s['emergency_saves']} emergency)",
        ),
        (
            "stall per save",
            f"mean {_fmt_s(stall['mean'])}, median {_fmt_s(stall['median'])}, "
            f"p95 {_fmt_s(stall['p95'])}, max {_fmt_s(stall['max'])}",
        ),
        ("training blocked by saves", _fmt_s(s["stall_total_s"])),
        (
            "total per save",
            f"mean {_fmt_s(total['mean'])}, median {_fmt_s(total['median'])}, "
            f"max {_fmt_s(total['max'])}",
        ),
        (
            "write throughput",
            "-" if rate["median"] is None else f"median {rate['median']:.1f} MB/s",
        ),
        (
            "newest checkpoint size",
            "-"
            if s["last_checkpoint_bytes"] is None
            else f"{s['last_checkpoint_bytes'] / 1e6:.2f} MB",
        ),
        ("restores", str(len(s["restores"]))),
        ("problems", str(len(s["problems"]))),
    ]
    summary_rows = "\n".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    restore_rows = "\n".join(
        f"<tr><td>{esc(_fmt_time(r['time']))}</td><td>{esc(str(r['step']))}</td>"
        f"<td>{esc(_fmt_s(r['seconds']))}</td><td>{esc(str(r['same_world_size']))}</td>"
        f"<td>{esc(r['resume'])}</td></tr>"
        for r in s["restores"]
    )
    problem_rows = "\n".join(
        f"<tr><td>{esc(_fmt_time(p['time']))}</td><td>{esc(p['event'])}</td>"
        f"<td>{esc(str(p['step']))}</td><td>{esc(p['detail'])}</td></tr>"
        for p in s["problems"]
    )
    image = (
        f'<img alt="checkpoint timeline" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}">'
        if png is not None
        else "<p>(no timeline image)</p>"
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>stalwart report: {esc(run)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }}
th {{ background: #f4f4f4; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
</style>
</head>
<body>
<h1>stalwart report</h1>
<p>run: <code>{esc(run)}</code></p>
{image}
<h2>summary</h2>
<table>
{summary_rows}
</table>
<h2>restores</h2>
<table>
<tr><th>time</th><th>step</th><th>took</th><th>same world size</th>
<th>resume (exact-resume certificate)</th></tr>
{restore_rows}
</table>
<h2>problems</h2>
<table>
<tr><th>time</th><th>event</th><th>step</th><th>reason</th></tr>
{problem_rows}
</table>
</body>
</html>
"""
