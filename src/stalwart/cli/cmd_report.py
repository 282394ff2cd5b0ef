"""``stalwart report RUN``: a PNG timeline and an HTML page of a run's saves, restores and failures."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import textwrap
from pathlib import Path
from typing import Any, TextIO

from stalwart.cli.common import (
    EXIT_OK,
    UsageError,
    format_bytes,
    format_seconds,
    format_time,
    make_console,
    run_directory,
)
from stalwart.cli.timeline import draw_timeline, read_run, render_html, summarize
from stalwart.errors import StalwartError
from stalwart.layout import EVENTS_NAME

__all__ = ["add_parser", "run"]

EPILOG = """\
Reads RUN/events.jsonl (written by CheckpointManager) and writes, into --out
(default RUN/report/):
  timeline.png  seconds per save (total, and the stall that blocked training),
                write throughput, and one row per event kind: starts and
                restarts, restores, skipped and quarantined checkpoints,
                failed saves
  report.html   the image inlined, a summary table, every restore and every
                problem with its reason; one self-contained file
Drawing needs matplotlib (pip install matplotlib); nothing else does.

exit status:
  0  the report was written
  1  RUN has no events.jsonl (or no readable events), matplotlib is not
     installed, or a file could not be written
  2  usage error: RUN is missing, a file, or not a run directory
"""

PNG_NAME = "timeline.png"
HTML_NAME = "report.html"


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="draw a run's save/restore/failure timeline (PNG) and an HTML summary",
        description=textwrap.fill(
            "Turn a run's events.jsonl into a timeline image (save stall and total time per "
            "save, throughput, restores, skips, quarantines, failures) and an HTML page "
            "embedding it with a summary table.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", metavar="RUN", help="run directory")
    parser.add_argument(
        "--out", metavar="DIR", help="directory to write into (default RUN/report), created"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def _require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise StalwartError(
            "`stalwart report` draws with matplotlib, which is not installed; "
            "install it with `pip install matplotlib`"
        )


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    directory = run_directory(
        args.run,
        lambda run: f"`report` reads a run's {EVENTS_NAME}; try `stalwart report {run}`",
    )
    events = directory / EVENTS_NAME
    if not events.is_file():
        raise StalwartError(
            f"{args.run} has no {EVENTS_NAME}: nothing to report (CheckpointManager writes "
            "it in the run directory)"
        )
    _require_matplotlib()
    timeline = read_run(directory)
    if not timeline.all:
        raise StalwartError(f"{events} holds no readable events: nothing to report")
    summary = summarize(timeline)
    target = Path(args.out) if args.out is not None else directory / "report"
    if args.out is None and target.is_symlink():
        # RUN/report is inside the run, which is input from outside: never write through it.
        raise StalwartError(
            f"{target} is a symbolic link; stalwart never writes through a link in a run "
            "directory: remove it, or name another directory with --out"
        )
    if target.exists() and not target.is_dir():
        raise UsageError(f"--out {target} is a file; name a directory")
    target.mkdir(parents=True, exist_ok=True)
    png, page = target / PNG_NAME, target / HTML_NAME
    image = io.BytesIO()
    try:
        draw_timeline(timeline, image, title=f"checkpoint timeline of {directory.resolve().name}")
    except ImportError as exc:
        raise StalwartError(
            f"`stalwart report` needs a working matplotlib ({exc}); "
            "install it with `pip install matplotlib`"
        ) from None
    _replace(png, image.getvalue())
    _replace(page, render_html(str(directory), summary, image.getvalue()).encode())
    report = {"run": str(directory), "png": str(png), "html": str(page), "summary": summary}
    if args.json:
        out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
    else:
        _render(report, out)
    return EXIT_OK


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` as a new file renamed into place: a link already at ``path`` is
    replaced, never written through."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _render(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    s = report["summary"]
    lines = [
        f"run {report['run']}: {s['events']} events, {format_time(s['first_time'])} to "
        f"{format_time(s['last_time'])}, {s['starts']} start(s)",
        f"saves: {s['saves']} ({s['async_saves']} async, {s['emergency_saves']} emergency); "
        f"stall median {format_seconds(s['stall_s']['median'])}, max "
        f"{format_seconds(s['stall_s']['max'])}; total median "
        f"{format_seconds(s['total_s']['median'])}; newest "
        f"{format_bytes(s['last_checkpoint_bytes'])}",
        f"restores: {len(s['restores'])}; problems: {len(s['problems'])}",
    ]
    for r in s["restores"]:
        lines.append(
            f"  {format_time(r['time'])} restore of step {r['step']}: resume {r['resume']}"
        )
    for p in s["problems"]:
        lines.append(f"  {format_time(p['time'])} {p['event']} step {p['step']}: {p['detail']}")
    lines.append(f"wrote {report['png']}")
    lines.append(f"wrote {report['html']}")
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)
