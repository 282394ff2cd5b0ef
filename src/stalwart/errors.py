"""Every error stalwart raises on purpose.

Each subclass also derives from the built-in exception that matches its meaning,
so code that already catches ``FileNotFoundError`` or ``ValueError`` keeps
working::

    StalwartError(Exception)
    ├── CheckpointNotFoundError(StalwartError, FileNotFoundError)
    ├── CheckpointCorruptError(StalwartError, ValueError)
    │   └── UnsafeCheckpointError           content that would run code on load
    ├── UnsupportedFormatError(StalwartError, ValueError)
    ├── StateMismatchError(StalwartError, ValueError)
    ├── CheckpointSaveError(StalwartError, RuntimeError)
    │   └── CommitConflictError             another writer committed the same step first
    ├── CoordinationError(StalwartError, RuntimeError)   ranks could not agree in time
    ├── RunLockedError(StalwartError, RuntimeError)
    ├── GuardLimitError(StalwartError, RuntimeError)   bad steps kept coming (stalwart.Guard)
    └── DurableStoreError(StalwartError, OSError)   the object store failed or refused

Backend errors (``OSError`` from the filesystem, DCP's ``CheckpointException``,
which derives from ``BaseException`` and escapes ``except Exception``) are
converted at the boundary into the most specific class here, with the original
chained as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CommitConflictError",
    "CoordinationError",
    "DurableStoreError",
    "GuardLimitError",
    "RollbackError",
    "RunLockedError",
    "StalwartError",
    "StateMismatchError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
]


class StalwartError(Exception):
    """Base class of every error stalwart raises on purpose."""


class CheckpointNotFoundError(StalwartError, FileNotFoundError):
    """No committed checkpoint where one was asked for (a run directory or a step)."""


class CheckpointCorruptError(StalwartError, ValueError):
    """A committed checkpoint whose files do not match its manifest, or whose manifest is unreadable.

    ``path`` names the offending file when one is known. ``transient`` is True
    when the file could not be read at all (an I/O error that may pass), as
    opposed to content that is definitely wrong. ``live_modified`` is True when
    it was found while values were being read into the live tensors (a file
    changed or cut short after its check), which may then hold part of them.
    """

    def __init__(self, message: str, *, path: str | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.transient = transient
        self.live_modified = False


class UnsafeCheckpointError(CheckpointCorruptError):
    """Checkpoint content that would execute code or build arbitrary objects when loaded.

    Raised before any such object is constructed; the file is treated like a
    corrupt one (skipped by ``restore``, reported by ``verify``).
    """


class UnsupportedFormatError(StalwartError, ValueError):
    """A manifest written by a newer format version than this stalwart understands."""


class StateMismatchError(StalwartError, ValueError):
    """The state to restore into and the checkpoint do not have the same keys (strict restore)."""


class CheckpointSaveError(StalwartError, RuntimeError):
    """A save failed; nothing was committed and earlier checkpoints are untouched."""


class CoordinationError(StalwartError, RuntimeError):
    """A checkpoint collective failed: a rank died, hung past the timeout, or raised.

    After one, the ranks no longer agree on the sequence of collectives, so the
    manager refuses further distributed saves; restart the job.
    """


class RunLockedError(StalwartError, RuntimeError):
    """Another live process holds the single-writer lock on the run directory."""


class RollbackError(StalwartError, RuntimeError):
    """A rollback (``CheckpointManager.rollback``, ``stalwart rollback``) that cannot be
    done: the run has a durable tier, or moving a step aside failed."""


class GuardLimitError(StalwartError, RuntimeError):
    """``stalwart.Guard`` met more bad steps than its policy allows within its window.

    Raised on every rank at the same step, after a ``guard_limit`` event.
    """


class CommitConflictError(CheckpointSaveError):
    """Another writer committed the same step to the same durable prefix first.

    Two runs share one ``durable`` prefix: give each run its own prefix. The
    checkpoint that was there first is untouched.
    """


class DurableStoreError(StalwartError, OSError):
    """An object-store request failed, or the store refused it.

    ``transient`` is True for failures that may pass (network errors, 5xx,
    timeouts), False for refusals that retrying cannot fix (missing bucket,
    denied access, bad credentials). Messages never contain credentials.
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
