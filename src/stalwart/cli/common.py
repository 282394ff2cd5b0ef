"""What the CLI commands share: finding runs and checkpoints, checking files, printing.

Only reads: nothing here writes to, moves or deletes anything in a run directory,
and nothing deserializes tensor data or runs a full unpickler (DCP ``.metadata``
goes through ``stalwart.safe_load``'s restricted reader).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TextIO

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StalwartError,
    UnsupportedFormatError,
)
from stalwart.events import EVENTS_NAME, read_events
from stalwart.lock import LOCK_NAME
from stalwart.manifest import MANIFEST_NAME, Manifest
from stalwart.pipeline import file_problems, read_manifest
from stalwart.safe_load import read_dcp_metadata
from stalwart.storage.base import StepEntry
from stalwart.storage.local import LocalStorage

__all__ = [
    "EXIT_BAD",
    "EXIT_OK",
    "EXIT_USAGE",
    "Problem",
    "RunHistory",
    "UsageError",
    "check_files",
    "check_metadata",
    "classify",
    "dir_usage",
    "existing_dir",
    "format_bytes",
    "format_mapping",
    "format_seconds",
    "format_time",
    "iso_utc",
    "load_manifest",
    "make_console",
    "name_step",
    "new_table",
    "progress_bar",
    "read_history",
    "scan",
]

EXIT_OK = 0
"""Everything asked for was done and everything checked is good."""
EXIT_BAD = 1
"""A checkpoint is corrupt, unreadable or missing its manifest."""
EXIT_USAGE = 2
"""The command line is wrong: missing path, not a run or checkpoint, unknown step."""

# The names a checkpoint directory has in a run (committed, staging, moved aside).
_CHECKPOINT_NAME_RE = re.compile(r"^\.?step_(\d{9,})(\.(tmp|del|corrupt)-[0-9a-f]+)?$")
_DCP_METADATA = ".metadata"
_TIMING_KEYS = ("stall_s", "write_s", "checksum_s", "commit_s", "total_s", "throughput_MBps")


class UsageError(StalwartError):
    """The user named something the command cannot work on; exit status 2."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """Why one file of a checkpoint is bad."""

    file: str
    """Path relative to the checkpoint directory (``MANIFEST.json``, ``__0_0.distcp``, ...)."""
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"file": self.file, "reason": self.reason}

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


# ----------------------------------------------------------------- locating things


def existing_dir(text: str) -> Path:
    """The directory named on the command line, or ``UsageError`` saying what is wrong with it."""
    path = Path(text)
    try:
        path.stat()
    except FileNotFoundError:
        raise UsageError(f"{text}: no such file or directory") from None
    except OSError as exc:
        raise UsageError(f"{text}: cannot access ({exc.strerror or exc})") from None
    if not path.is_dir():
        raise UsageError(
            f"{text} is a file, not a directory; pass a run directory (holding step_* "
            f"checkpoints) or a checkpoint directory (holding {MANIFEST_NAME})"
        )
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"{text}: permission denied (cannot list the directory)")
    return path


def classify(path: Path) -> Literal["run", "checkpoint"]:
    """Whether ``path`` (an existing directory) is a run or one checkpoint of a run.

    A checkpoint holds MANIFEST.json or DCP's ``.metadata``, or carries a
    checkpoint's name (``step_…``, ``.step_….tmp-…``); a run holds checkpoints,
    ``events.jsonl`` or the run lock. Anything else is a ``UsageError``.
    """
    if (
        (path / MANIFEST_NAME).is_file()
        or (path / _DCP_METADATA).is_file()
        or _CHECKPOINT_NAME_RE.match(path.resolve().name)
    ):
        return "checkpoint"
    if (path / EVENTS_NAME).is_file() or (path / LOCK_NAME).is_file() or scan(path):
        return "run"
    raise UsageError(
        f"{path} is neither a stalwart run directory (no step_* checkpoints, no "
        f"{EVENTS_NAME}) nor a checkpoint directory (no {MANIFEST_NAME})"
    )


def name_step(path: Path) -> int | None:
    """The step a checkpoint directory's name says it holds, or None for another name."""
    m = _CHECKPOINT_NAME_RE.match(path.name)
    return int(m.group(1)) if m else None


def scan(run: Path) -> list[StepEntry]:
    """``LocalStorage.scan`` with an unreadable directory reported as a ``UsageError``."""
    try:
        return list(LocalStorage(run).scan())
    except OSError as exc:
        raise UsageError(f"{run}: cannot list the directory ({exc.strerror or exc})") from None


def dir_usage(path: Path) -> tuple[int, int]:
    """``(bytes, files)`` under ``path``; entries that vanish or cannot be read are skipped."""
    total = files = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                            files += 1
                    except OSError:
                        continue
        except OSError:
            continue
    return total, files


# ----------------------------------------------------------------- checking files


def load_manifest(checkpoint: Path) -> Manifest | Problem:
    """The checkpoint's validated manifest, or the ``Problem`` that makes it unusable."""
    try:
        return read_manifest(checkpoint)
    except CheckpointNotFoundError:
        return Problem(
            file=MANIFEST_NAME,
            reason="missing: the checkpoint was never committed (an unfinished or abandoned save)",
        )
    except UnsupportedFormatError as exc:
        return Problem(file=MANIFEST_NAME, reason=_strip_source(str(exc), checkpoint))
    except CheckpointCorruptError as exc:
        return Problem(file=MANIFEST_NAME, reason=_strip_source(str(exc), checkpoint))


def check_files(
    checkpoint: Path,
    manifest: Manifest,
    *,
    checksums: bool,
    advance: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Every bad file of ``manifest``: the checks restore runs (``pipeline.file_problems``), all reported."""
    return [
        Problem(file=p.file, reason=p.reason)
        for p in file_problems(checkpoint, manifest, checksums=checksums, advance=advance)
    ]


def check_metadata(checkpoint: Path) -> Problem | None:
    """Read DCP's ``.metadata`` with the restricted unpickler; a ``Problem`` when it would not load."""
    try:
        read_dcp_metadata(checkpoint)
    except CheckpointNotFoundError:
        return Problem(file=_DCP_METADATA, reason="missing: not a DCP checkpoint")
    except CheckpointCorruptError as exc:
        return Problem(file=_DCP_METADATA, reason=_strip_source(str(exc), checkpoint))
    except OSError as exc:
        return Problem(file=_DCP_METADATA, reason=f"cannot read ({exc.strerror or exc})")
    return None


def _strip_source(message: str, checkpoint: Path) -> str:
    # Library messages start with the full file path; the CLI already names the file.
    for prefix in (str(checkpoint / MANIFEST_NAME), str(checkpoint / _DCP_METADATA)):
        if message.startswith(prefix + ": "):
            return message[len(prefix) + 2 :]
        if message.startswith(prefix + " "):
            return message[len(prefix) + 1 :]
    return message


# ----------------------------------------------------------------- events


@dataclasses.dataclass(slots=True)
class RunHistory:
    """What ``events.jsonl`` says about each step, for ``ls``."""

    timings: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Timings of the last ``save`` event of each step (stall_s, write_s, ...)."""
    skip_reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    """Reason of the last ``restore_skipped`` event of each step."""


def read_history(run: Path, warn: TextIO) -> RunHistory:
    """Read the run's ``events.jsonl``; an absent log gives an empty history, an unreadable one a warning."""
    history = RunHistory()
    try:
        for record in read_events(run):
            step = record.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            if record.get("event") == "save":
                history.timings[step] = {
                    key: float(record[key])
                    for key in _TIMING_KEYS
                    if isinstance(record.get(key), (int, float))
                    and not isinstance(record[key], bool)
                }
            elif record.get("event") == "restore_skipped" and isinstance(record.get("reason"), str):
                history.skip_reasons[step] = record["reason"]
    except OSError as exc:
        print(
            f"stalwart: warning: cannot read {run / EVENTS_NAME} ({exc.strerror or exc}); "
            "showing no timings",
            file=warn,
        )
    return history


# ----------------------------------------------------------------- output


def make_console(stream: TextIO) -> Console:
    """A console on ``stream``: colour only on a terminal, wide lines when piped.

    Rich assumes 80 columns when the stream is not a terminal, which would fold
    file names and tensor names in tables meant for ``grep``.
    """
    if stream.isatty():
        return Console(file=stream, highlight=False)
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) > 0 else 200
    return Console(file=stream, highlight=False, no_color=True, width=width, color_system=None)


@contextmanager
def progress_bar(total_bytes: int, description: str) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr when stderr is a terminal; yields ``advance(n)``.

    The bar is transient (gone when done) so the report on stdout stays clean.
    """
    if not sys.stderr.isatty() or total_bytes <= 0:
        yield lambda _n: None
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=total_bytes)
        yield lambda n: progress.advance(task, n)


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_time(unix: float | None) -> str:
    """Local time to the second, e.g. ``2026-11-29 14:25:33``."""
    if unix is None:
        return "-"
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")


def new_table(*columns: str, right: tuple[str, ...] = (), wrap: tuple[str, ...] = ()) -> Table:
    """A borderless table with a rule under the header, plain enough for ``grep`` and ``awk``.

    Columns in ``right`` are right-aligned; only columns in ``wrap`` may wrap,
    so numbers and names never break across lines on a narrow terminal.
    """
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for name in columns:
        table.add_column(
            name,
            justify="right" if name in right else "left",
            no_wrap=name not in wrap,
            overflow="fold",
        )
    return table


def format_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.1f}ms"
    return f"{value:.2f}s"


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_mapping(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in values.items()) or "-"


def iso_utc(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).isoformat()
