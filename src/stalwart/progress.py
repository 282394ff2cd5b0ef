"""A byte progress bar on stderr, for the CLI and for long downloads during restore."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(
    total_bytes: int, description: str, *, min_bytes: int = 1
) -> Iterator[Callable[[int], None]]:
    """A transient rich bar on stderr when stderr is a terminal; yields ``advance(nbytes)``.

    Off a terminal (logs, CI) or below ``min_bytes`` it draws nothing: the report
    on stdout and the events stay clean. ``advance`` may be called from several
    threads (rich's ``Progress`` takes its own lock).
    """
    if total_bytes < max(min_bytes, 1) or not sys.stderr.isatty():
        yield lambda _n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

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
