"""Rolling a run back to an earlier step: its newer committed steps moved aside, kept.

A run that goes on training from an older step (``restore(state, step=N)``,
after a loss spike, say) must not keep its newer steps as the run's own: a
``restore()`` without ``step`` would load the newest of them, from the
abandoned trajectory, and saves of their step numbers would be skipped (a
checkpoint is never overwritten). ``roll_back(run, to=N)`` moves every
committed step newer than ``N`` into one hidden directory of the run,
``.rolled-back-<N>-<hex>/``, by renames in the run's own filesystem: nothing is
copied, deleted or rewritten, and a step moved aside is a complete checkpoint
that ``stalwart verify`` still checks and a rename brings back.

It holds the run lock (``stalwart.lock``) while it works, so it never runs
beside a manager writing the run. Renames go newest step first, each made
durable (the directory fsynced) before the next: a rollback cut short leaves
the newest steps moved and some older ones in place, and running it again
finishes it.

The exact-resume certificate's fingerprint logs (``<run>/fingerprints/``) go
aside with the steps: they hold the abandoned trajectory's steps, and a later
restore would compare the new trajectory with them and report a divergence
that is the rollback's purpose. The next restore after a rollback therefore has
nothing earlier to compare with (``resume_unverified``) until the run records
steps again.

A run with a durable tier holds its newer steps there too, and ``restore()``
would download them again: ``roll_back`` refuses it unless the caller rolled
the tier back first, as ``CheckpointManager.rollback`` does
(``TierSync.roll_back``: a step only the tier holds is downloaded, so that it
is kept aside with the others, then the tier's newer steps are deleted).

``list_set_aside(run)`` names what rollbacks set aside (``stalwart ls``).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.errors import CheckpointNotFoundError, DurableStoreError, RollbackError, StalwartError
from stalwart.events import EventLog
from stalwart.history import read_history
from stalwart.layout import EVENTS_NAME, FINGERPRINT_DIR, step_dir_name, step_of_dir_name
from stalwart.lock import RunLock
from stalwart.redact import redact_url
from stalwart.storage.local import LocalStorage, fsync_dir

if TYPE_CHECKING:
    from stalwart.certificate import Certificate
    from stalwart.distributed import Coordinator
    from stalwart.tiers import TierSync

__all__ = [
    "ASIDE_PREFIX",
    "RollbackPlan",
    "SetAside",
    "list_set_aside",
    "plan_rollback",
    "roll_back",
    "roll_back_tiers",
    "rollback_run",
]

ASIDE_PREFIX = ".rolled-back-"
"""Where a rollback puts the newer steps: ``<run>/.rolled-back-<step>-<12 hex>/step_N``."""


@dataclasses.dataclass(frozen=True, slots=True)
class RollbackPlan:
    """What ``roll_back`` does: the step kept newest, and the newer steps to move aside."""

    run: Path
    to: int
    newer: list[int]
    """Committed steps newer than ``to``, newest first (the order they are moved in)."""
    aside: Path
    """The hidden directory they go to (made only when there is something to move)."""


def _check_step(step: object) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"the step to roll back to must be an int >= 0, got {step!r}")


def _entry(aside: Path, step: int) -> dict[str, Any]:
    """One step of the report: its number, its directory's name, where it goes."""
    return {"step": step, "name": step_dir_name(step), "to": str(aside / step_dir_name(step))}


def plan_rollback(run: Path, *, to: int, durable_done: bool = False) -> RollbackPlan:
    """What rolling ``run`` back to step ``to`` would move; reads only.

    Raises ``CheckpointNotFoundError`` (naming the committed steps) when ``to`` is
    not a committed step of ``run``, and ``RollbackError`` when the run's
    events name a durable tier, unless ``durable_done`` (the manager rolled the
    tier back already: ``TierSync.roll_back``).
    """
    _check_step(to)
    storage = LocalStorage(run)
    committed = storage.committed_steps()
    if to not in committed:
        shown = ", ".join(map(str, committed[-10:])) or "none"
        raise CheckpointNotFoundError(
            f"no committed checkpoint of step {to} in {run} (committed steps: {shown}); "
            "a run is rolled back to one of its committed steps"
        )
    durable = None if durable_done else read_history(run).durable.url
    if durable is not None:
        raise RollbackError(
            f"{run} uploads to the durable tier {redact_url(durable)}, which holds its steps "
            f"too: a restore() would download the newer ones from there again. Roll back in "
            f"a process that opens the run with it: CheckpointManager({str(run)!r}, "
            f"durable=URL).rollback({to}) rolls back both tiers"
        )
    newer = sorted((s for s in committed if s > to), reverse=True)
    aside = run / f"{ASIDE_PREFIX}{to}-{uuid.uuid4().hex[:12]}"
    return RollbackPlan(run=run, to=to, newer=newer, aside=aside)


def roll_back(
    run: Path,
    *,
    to: int,
    dry_run: bool = False,
    events: EventLog | None = None,
    take_lock: bool = True,
    durable_done: bool = False,
) -> dict[str, Any]:
    """Move every committed step of ``run`` newer than ``to`` aside (see the module).

    Returns the report ``stalwart rollback --json`` prints; the move is logged
    to ``events`` (default: the run's ``events.jsonl``) as a ``rollback`` event.
    Raises what ``plan_rollback`` raises, ``RunLockedError`` when another
    process holds the run lock (a dry run only lists, without the lock), and
    ``OSError`` when a rename fails (the steps moved before it stay moved; the
    report of a rerun lists what is left). ``take_lock=False`` and
    ``durable_done`` are for the manager, which holds the lock already and
    rolls its durable tier back first.
    """
    plan = plan_rollback(run, to=to, durable_done=durable_done)
    moved: list[dict[str, Any]] = []
    if dry_run or not plan.newer:
        return _report(plan, moved, dry_run=dry_run)
    lock = RunLock(run)
    if take_lock:
        lock.acquire()
    try:
        # Listed again under the lock: a manager may have saved, or another rollback
        # moved the steps, since the plan.
        plan = plan_rollback(run, to=to, durable_done=durable_done)
        if not plan.newer:
            return _report(plan, moved, dry_run=False)
        os.mkdir(plan.aside, 0o755)
        fsync_dir(run)
        fingerprints: str | None = None
        try:
            # The logs first: a rollback cut short after them is finished by a rerun,
            # which moves only steps (with nothing newer left, a rerun moves nothing).
            logs = run / FINGERPRINT_DIR
            if logs.is_dir() and not logs.is_symlink():
                os.rename(logs, plan.aside / FINGERPRINT_DIR)
                fingerprints = str(plan.aside / FINGERPRINT_DIR)
                fsync_dir(plan.aside)
                fsync_dir(run)
            for step in plan.newer:
                entry = _entry(plan.aside, step)
                os.rename(run / entry["name"], entry["to"])
                # Moved from here on, durable or not yet: the event must say so.
                moved.append(entry)
                fsync_dir(plan.aside)
                fsync_dir(run)
        finally:
            if moved or fingerprints:
                (events or EventLog(run / EVENTS_NAME)).emit(
                    "rollback",
                    step=to,
                    moved=[m["step"] for m in moved],
                    left=plan.newer[len(moved) :],
                    path=str(plan.aside),
                    fingerprints=fingerprints,
                )
    finally:
        lock.release()
    return _report(plan, moved, dry_run=False, fingerprints=fingerprints)


def rollback_run(
    coord: Coordinator,
    certificate: Certificate,
    directory: Path,
    step: int,
    events: EventLog,
    tiers: TierSync | None,
) -> list[int]:
    """``CheckpointManager.rollback``: every rank together, rank 0 moving (``roll_back_tiers``).

    ``step`` is checked on every rank before the collective, so a bad one is a
    ``ValueError`` everywhere. Every rank gets rank 0's list of steps moved, or
    its error. The certificate begins a new attempt either way: its logs went
    aside with the steps (or will, on the rerun a failure calls for).
    """
    _check_step(step)

    def move() -> list[int]:
        if not coord.is_leader:
            return []
        return roll_back_tiers(directory, to=step, events=events, tiers=tiers)

    try:
        return coord.agree_all(move)[0]
    finally:
        certificate.restart()


def roll_back_tiers(run: Path, *, to: int, events: EventLog, tiers: TierSync | None) -> list[int]:
    """``CheckpointManager.rollback`` on the committing rank: the durable tier first
    (``TierSync.roll_back``), then the run directory; returns the steps moved aside.

    ``to`` is checked before anything changes. Raises ``CheckpointNotFoundError``
    for a step not committed, and ``RollbackError`` when the tier or a rename
    failed (what was done stays done; a rerun finishes).
    """
    plan_rollback(run, to=to, durable_done=tiers is not None)
    try:
        if tiers is not None:
            uploaded = read_history(run).durable.steps
            tiers.roll_back(to, LocalStorage(run).committed_steps(), uploaded=uploaded)
        report = roll_back(
            run, to=to, events=events, take_lock=False, durable_done=tiers is not None
        )
    except DurableStoreError as exc:  # an OSError and a StalwartError: the tier failed
        raise _failed(run, to, exc) from exc
    except StalwartError:
        raise  # CheckpointNotFoundError (an OSError too), RollbackError: already said
    except OSError as exc:
        raise _failed(run, to, exc) from exc
    return [entry["step"] for entry in report["moved"]]


def _failed(run: Path, to: int, exc: OSError) -> RollbackError:
    return RollbackError(
        f"rolling {run} back to step {to} failed: {exc}; what was moved or deleted "
        "before it stays so, call rollback again to finish"
    )


def _report(
    plan: RollbackPlan,
    moved: list[dict[str, Any]],
    *,
    dry_run: bool,
    fingerprints: str | None = None,
) -> dict[str, Any]:
    listed = [_entry(plan.aside, s) for s in plan.newer] if dry_run else moved
    return {
        "run": str(plan.run),
        "to": plan.to,
        "dry_run": dry_run,
        "aside": str(plan.aside) if listed else None,
        "moved": listed,
        "fingerprints": fingerprints,
    }


@dataclasses.dataclass(frozen=True, slots=True)
class SetAside:
    """One directory a rollback moved steps into (``<run>/.rolled-back-<to>-<hex>/``)."""

    name: str
    to: int | None
    """The step rolled back to, from the name (None: the name carries none)."""
    steps: list[int]
    """The step directories inside, by name (not checked)."""
    mtime: float


def list_set_aside(run: Path) -> list[SetAside]:
    """What rollbacks set aside in ``run``, oldest first; reads names only.

    Only real directories count (a link named like one is not followed), and
    nothing in them is read: ``stalwart verify`` checks a step there. A run
    that cannot be listed gives an empty list (its listing fails elsewhere).
    """
    found: list[SetAside] = []
    try:
        with os.scandir(run) as listing:
            entries = [e for e in listing if e.name.startswith(ASIDE_PREFIX)]
    except OSError:
        return []
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            mtime = entry.stat(follow_symlinks=False).st_mtime
            with os.scandir(entry.path) as inside:
                names = [e.name for e in inside if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue  # gone or unreadable since the listing
        to = entry.name.removeprefix(ASIDE_PREFIX).split("-", 1)[0]
        steps = (step_of_dir_name(name) for name in names)
        found.append(
            SetAside(
                name=entry.name,
                to=int(to) if to.isascii() and to.isdigit() else None,
                steps=sorted(s for s in steps if s is not None),
                mtime=mtime,
            )
        )
    return sorted(found, key=lambda a: (a.mtime, a.name))
