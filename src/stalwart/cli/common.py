"""What the CLI commands share: naming runs and checkpoints on the command line, printing.

Only reads: nothing here writes to, moves or deletes anything in a run directory,
and nothing deserializes tensor data or runs a full unpickler (DCP ``.metadata``
goes through ``stalwart.safe_load``'s restricted reader).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TextIO

from rich import box
from rich.console import Console
from rich.table import Table

from stalwart import catalog, history
from stalwart.errors import DurableStoreError, StalwartError
from stalwart.events import NotRegularFileError
from stalwart.history import RunHistory
from stalwart.layout import EVENTS_NAME, MANIFEST_NAME, parse_checkpoint_name
from stalwart.progress import progress_bar
from stalwart.storage.durable import DurableTier
from stalwart.storage.remote import RetryPolicy, is_url

__all__ = [
    "EXIT_BAD",
    "EXIT_OK",
    "EXIT_USAGE",
    "STORE_RETRY",
    "UsageError",
    "classify",
    "existing_dir",
    "format_bytes",
    "format_mapping",
    "format_seconds",
    "format_time",
    "format_value",
    "is_url",
    "iso_utc",
    "listing_error",
    "make_console",
    "name_step",
    "new_table",
    "non_negative_float",
    "open_tier",
    "progress_bar",
    "read_history",
    "resolve_checkpoint",
    "run_directory",
    "store_error",
]

EXIT_OK = 0
"""Everything asked for was done and everything checked is good."""
EXIT_BAD = 1
"""A checkpoint is corrupt, unreadable or missing its manifest."""
EXIT_USAGE = 2
"""The command line is wrong: missing path, not a run or checkpoint, unknown step."""


class UsageError(StalwartError):
    """The user named something the command cannot work on; exit status 2."""


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
    """Whether ``path`` (an existing directory) is a run or one checkpoint of a run
    (``catalog.kind_of_dir``); anything else is a ``UsageError``."""
    try:
        kind = catalog.kind_of_dir(path)
    except OSError as exc:
        raise listing_error(path, exc) from None
    if kind is None:
        raise UsageError(
            f"{path} is neither a stalwart run directory (no step_* checkpoints, no "
            f"{EVENTS_NAME}) nor a checkpoint directory (no {MANIFEST_NAME})"
        )
    return kind


def run_directory(text: str, refusal: Callable[[Path], str]) -> Path:
    """The run directory named on the command line. A checkpoint directory is a
    ``UsageError``: "TEXT is a checkpoint directory, and " + ``refusal(its run)``."""
    directory = existing_dir(text)
    if classify(directory) == "checkpoint":
        raise UsageError(
            f"{text} is a checkpoint directory, and {refusal(directory.resolve().parent)}"
        )
    return directory


def name_step(path: Path) -> int | None:
    """The step a checkpoint directory's name says it holds, or None for another name."""
    parsed = parse_checkpoint_name(path.name)
    return None if parsed is None else parsed.step


def resolve_checkpoint(target: str, *, step: int | None) -> Path:
    """The checkpoint directory that ``target`` and ``--step`` name, or ``UsageError``."""
    directory = existing_dir(target)
    if classify(directory) == "checkpoint":
        if step is not None:
            raise UsageError(
                f"--step selects a checkpoint of a run, but {target} is already a checkpoint "
                "directory; drop --step, or pass the run directory"
            )
        return directory
    try:
        entries = catalog.scan_run(directory)
    except OSError as exc:
        raise listing_error(directory, exc) from None
    committed = [e for e in entries if e.status == "committed" and e.step is not None]
    if step is None:
        if not committed:
            others = ", ".join(e.name for e in entries) or "no checkpoints at all"
            raise UsageError(f"no committed checkpoint in {target} ({others})")
        return committed[-1].path
    for e in committed:
        if e.step == step:
            return e.path
    for e in entries:
        if e.step == step:
            raise UsageError(
                f"step {step} of {target} is not committed ({e.name} is {e.status}); "
                f"inspect it directly with `stalwart inspect {e.path}`"
            )
    shown = ", ".join(str(e.step) for e in committed[-10:]) or "none"
    raise UsageError(f"no checkpoint of step {step} in {target} (committed steps: {shown})")


def listing_error(run: Path, exc: OSError) -> UsageError:
    """A run directory that could not be listed, as a one-line ``UsageError``."""
    return UsageError(f"{run}: cannot list the directory ({exc.strerror or exc})")


STORE_RETRY = RetryPolicy(
    initial_backoff=0.5, max_backoff=5.0, deadline=30.0, request_timeout=60.0, connect_timeout=10.0
)
"""How long a command keeps trying an unreachable store: a person is waiting, so 30 s, not the
manager's 15 minutes; refusals (missing bucket, denied access) fail at once."""


def open_tier(url: str) -> DurableTier:
    """The durable tier at ``url``, credentials from the environment; a ``UsageError`` if it
    cannot be opened (a malformed URL, a missing client library, bad store options)."""
    try:
        return DurableTier(url, retry=STORE_RETRY)
    except (DurableStoreError, ValueError, ImportError) as exc:
        raise UsageError(f"{exc}") from None


def store_error(exc: OSError) -> UsageError:
    """A one-line ``UsageError`` for a store that could not be listed or read.

    The store's own message says what failed (status, bucket); the hint says what
    a person usually has to fix: the URL or the credentials the environment holds.
    """
    message = str(exc) or type(exc).__name__
    if isinstance(exc, DurableStoreError) and exc.transient:
        hint = "the store did not answer; check the endpoint (AWS_ENDPOINT_URL) and the network"
    else:
        hint = (
            "check the bucket and prefix in the URL and the credentials in the environment "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
            "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY)"
        )
    # One line (the store client already drops the XML body of S3 errors).
    text = " ".join(message.split())
    return UsageError(f"{text}; {hint}")


# ----------------------------------------------------------------- events


def read_history(run: Path, warn: TextIO) -> RunHistory:
    """Read the run's ``events.jsonl``; an absent log gives an empty history, an unreadable one a warning."""
    try:
        return history.read_history(run)
    except NotRegularFileError as exc:
        print(f"stalwart: warning: {exc}; showing no timings", file=warn)
    except OSError as exc:
        print(
            f"stalwart: warning: cannot read {run / EVENTS_NAME} ({exc.strerror or exc}); "
            "showing no timings",
            file=warn,
        )
    return RunHistory()


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


def non_negative_float(text: str) -> float:
    """argparse ``type=`` for a tolerance: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, NaN, infinite, an int beyond floats).

    Manifests and event logs are input from outside: their numbers may be anything JSON
    can hold, and showing one must never crash a command.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _invalid(value: Any) -> str:
    text = repr(value)
    return f"invalid ({text if len(text) <= 24 else text[:21] + '...'})"


def format_bytes(n: int | None) -> str:
    """``1.5 GiB``, ``512 B``; ``-`` for None and ``invalid (...)`` for a value that is not a
    finite size >= 0."""
    if n is None:
        return "-"
    value = _finite(n)
    if value is None or value < 0:
        return _invalid(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_time(unix: float | None) -> str:
    """Local time to the second, e.g. ``2026-11-29 14:25:33``; ``invalid (...)`` for a value
    that is no time a date can show (infinite, NaN, beyond year 9999, before 1970)."""
    if unix is None:
        return "-"
    value = _finite(unix)
    if value is None or value < 0:
        return _invalid(unix)
    try:
        return datetime.datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError):
        return _invalid(unix)


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
    if _finite(value) is None:
        return _invalid(value)
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
    """ISO 8601 in UTC; ``invalid (...)`` for a value that is no time a date can show."""
    value = _finite(unix)
    if value is None or value < 0:
        return _invalid(unix)
    try:
        return datetime.datetime.fromtimestamp(value, datetime.timezone.utc).isoformat()
    except (OverflowError, ValueError, OSError):
        return _invalid(unix)
