"""What the CLI commands share: finding runs and checkpoints, checking files, printing.

Only reads: nothing here writes to, moves or deletes anything in a run directory,
and nothing deserializes tensor data or runs a full unpickler (DCP ``.metadata``
goes through ``stalwart.safe_load``'s restricted reader).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TextIO

from rich import box
from rich.console import Console
from rich.table import Table

from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DurableStoreError,
    StalwartError,
    UnsupportedFormatError,
)
from stalwart.events import EVENTS_NAME, NotRegularFileError, read_events
from stalwart.lock import LOCK_NAME
from stalwart.manifest import MANIFEST_NAME, Manifest
from stalwart.pipeline import file_problems, read_manifest
from stalwart.progress import progress_bar
from stalwart.safe_load import read_dcp_metadata
from stalwart.storage.base import StepEntry
from stalwart.storage.durable import DurableTier
from stalwart.storage.local import LocalStorage
from stalwart.storage.remote import RetryPolicy, is_url

__all__ = [
    "EXIT_BAD",
    "EXIT_OK",
    "EXIT_USAGE",
    "STORE_RETRY",
    "DurableHistory",
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
    "is_url",
    "iso_utc",
    "load_manifest",
    "make_console",
    "name_step",
    "new_table",
    "non_negative_float",
    "open_tier",
    "progress_bar",
    "read_history",
    "scan",
    "store_error",
    "strip_source",
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
        return Problem(
            file=MANIFEST_NAME,
            reason=strip_source(str(exc), checkpoint / MANIFEST_NAME, checkpoint / _DCP_METADATA),
        )
    except CheckpointCorruptError as exc:
        return Problem(
            file=MANIFEST_NAME,
            reason=strip_source(str(exc), checkpoint / MANIFEST_NAME, checkpoint / _DCP_METADATA),
        )


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
        return Problem(
            file=_DCP_METADATA,
            reason=strip_source(str(exc), checkpoint / MANIFEST_NAME, checkpoint / _DCP_METADATA),
        )
    except OSError as exc:
        return Problem(file=_DCP_METADATA, reason=f"cannot read ({exc.strerror or exc})")
    return None


def strip_source(message: str, *sources: str | Path) -> str:
    """``message`` without a leading ``source: `` (library messages start with the file or
    URL they are about; the CLI already names it)."""
    for source in map(str, sources):
        if message.startswith(source + ": "):
            return message[len(source) + 2 :]
        if message.startswith(source + " "):
            return message[len(source) + 1 :]
    return message


# ----------------------------------------------------------------- events


@dataclasses.dataclass(slots=True)
class RunHistory:
    """What ``events.jsonl`` says about each step, for ``ls``."""

    timings: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Timings of the last ``save`` event of each step (stall_s, write_s, ...)."""
    skip_reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    """Reason of the last ``restore_skipped`` event of each step."""
    durable: DurableHistory = dataclasses.field(default_factory=lambda: DurableHistory())
    """What the events say about the run's durable tier."""


def _int_step(record: Mapping[str, Any]) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _url(value: Any) -> str | None:
    return value.rstrip("/") if isinstance(value, str) and value else None


@dataclasses.dataclass(slots=True)
class _TierRecord:
    """The upload history of one durable URL."""

    durable: set[int] = dataclasses.field(default_factory=set)
    """Steps uploaded (or downloaded from it) and not deleted by durable retention since."""
    uploads: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """The last ``upload`` event of each step."""
    failures: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """The last ``upload_failed`` event of each step not uploaded since."""
    unreachable: dict[str, Any] | None = None
    """The last ``durable_unreachable`` event, if no upload succeeded after it."""
    behind: list[int] = dataclasses.field(default_factory=list)
    """``durable_behind`` steps of the last close, minus those uploaded since."""


@dataclasses.dataclass(slots=True)
class DurableHistory:
    """Which steps of a run reached its durable tier, according to ``events.jsonl``.

    Runs can be reopened with another ``durable=`` URL, so everything is kept per
    URL: ``upload`` and ``download`` events name theirs; ``durable_delete``,
    ``upload_failed`` and the other durable events belong to the URL of the
    ``open`` before them. The tier shown is the newest ``open`` event's, else that
    of the newest upload. A step restored from the tier (``download``) is in it.
    """

    _seen: str | None = None
    _session: str | None = None  # the durable URL of the newest ``open`` (None: none then)
    _tiers: dict[str, _TierRecord] = dataclasses.field(default_factory=dict)

    def feed(self, record: Mapping[str, Any]) -> None:
        """Take one event (in log order)."""
        event = record.get("event")
        step = _int_step(record)
        if event == "open":
            self._session = _url(record.get("durable"))
            self._seen = self._session or self._seen
            return
        url = _url(record.get("url")) if event in ("upload", "download") else None
        url = url or self._session
        if url is None:
            return
        tier = self._tiers.setdefault(url, _TierRecord())
        if event == "upload" and step is not None:
            self._seen = url
            tier.durable.add(step)
            tier.uploads[step] = dict(record)
            tier.failures.pop(step, None)
            tier.unreachable = None
            tier.behind = [s for s in tier.behind if s != step]
        elif event == "download" and step is not None:
            tier.durable.add(step)  # it was restored from there, so it is there
        elif event == "durable_delete" and step is not None:
            tier.durable.discard(step)
        elif event == "upload_failed" and step is not None:
            tier.failures[step] = dict(record)
        elif event == "durable_unreachable":
            tier.unreachable = dict(record)
        elif event == "durable_behind":
            steps = record.get("steps")
            tier.behind = (
                [s for s in steps if isinstance(s, int)] if isinstance(steps, list) else []
            )

    @property
    def url(self) -> str | None:
        """The run's durable URL (no credentials), or None when it never had one."""
        return self._session or self._seen

    def _tier(self) -> _TierRecord:
        url = self.url
        return self._tiers.get(url, _TierRecord()) if url is not None else _TierRecord()

    @property
    def steps(self) -> set[int]:
        """Steps durable in the current tier: uploaded and not deleted by its retention."""
        return set(self._tier().durable)

    @property
    def last_step(self) -> int | None:
        """The newest durable step (what ``CheckpointManager.last_durable_step`` reported)."""
        return max(self._tier().durable, default=None)

    def upload_of(self, step: int) -> dict[str, Any] | None:
        """The last ``upload`` event of ``step`` to the current tier."""
        return self._tier().uploads.get(step)

    @property
    def failures(self) -> list[dict[str, Any]]:
        """``upload_failed`` events of steps never uploaded afterwards, oldest step first."""
        tier = self._tier()
        return [tier.failures[s] for s in sorted(tier.failures)]

    @property
    def unreachable(self) -> dict[str, Any] | None:
        return self._tier().unreachable

    @property
    def behind(self) -> list[int]:
        return list(self._tier().behind)


def read_history(run: Path, warn: TextIO) -> RunHistory:
    """Read the run's ``events.jsonl``; an absent log gives an empty history, an unreadable one a warning."""
    history = RunHistory()
    try:
        for record in read_events(run):
            history.durable.feed(record)
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
    except NotRegularFileError as exc:
        print(f"stalwart: warning: {exc}; showing no timings", file=warn)
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
