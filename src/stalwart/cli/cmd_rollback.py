"""``stalwart rollback RUN --to STEP``: make an earlier step the run's newest again.

After ``restore(state, step=N)``, a run that trains on from step N still holds
its newer checkpoints: a ``restore()`` would load the newest of them, and saves
of their step numbers are skipped. This command moves them aside, kept
(``stalwart.rollback``).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any, TextIO

from stalwart.cli.common import EXIT_OK, UsageError, run_directory
from stalwart.errors import CheckpointNotFoundError, RollbackError
from stalwart.rollback import roll_back

__all__ = ["add_parser", "run"]

EPILOG = """\
what it does:
  Every committed step newer than STEP is renamed into one hidden directory of
  the run, <RUN>/.rolled-back-<STEP>-<hex>/step_N: nothing is copied, deleted or
  rewritten. A restore() then loads STEP (or a newer step saved after this), and
  the run saves those step numbers again. The exact-resume certificate's logs
  (<RUN>/fingerprints/) go there too: they hold the abandoned steps. To undo,
  rename them back.

the run lock:
  rollback takes <run>/.lock, as a manager does, so it refuses (exit 1) while a
  trainer writes the run. Stop it first.

a durable tier:
  A run whose events name a durable tier is refused (exit 2): the tier holds
  the newer steps too, and a restore() would download them again. Roll back
  in Python instead: CheckpointManager(RUN, durable=URL).rollback(STEP) rolls
  back both tiers.

exit status:
  0  done (or, with --dry-run, listed); also when no step is newer than STEP
  1  the run is locked by another process, or a rename failed (the steps moved
     before it stay moved: run the command again)
  2  usage error: RUN is not a run directory, STEP is not one of its committed
     steps, or the run has a durable tier
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "rollback",
        help="move a run's steps newer than STEP aside, so that training goes on from STEP",
        description=textwrap.fill(
            "Make STEP the newest committed step of RUN again: every newer committed step "
            "is moved (renamed, kept) into a hidden directory of the run. Use it after "
            "restore(state, step=STEP) when training goes on from there.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", metavar="RUN", help="run directory")
    parser.add_argument(
        "--to",
        type=int,
        required=True,
        metavar="STEP",
        help="the committed step that becomes the run's newest",
    )
    parser.add_argument("--dry-run", action="store_true", help="only list what would be moved")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    if args.to < 0:
        raise UsageError(f"--to is a step number >= 0, got {args.to}")
    directory = run_directory(
        args.run,
        lambda run: f"`rollback` works on a run; try `stalwart rollback {run} --to {args.to}`",
    )
    try:
        report = roll_back(directory, to=args.to, dry_run=args.dry_run)
    except (CheckpointNotFoundError, RollbackError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
        return EXIT_OK
    moved = report["moved"]
    if not moved:
        out.write(f"nothing to roll back: step {args.to} is the newest committed step\n")
        return EXIT_OK
    verb = "would move" if args.dry_run else "moved"
    for entry in moved:
        out.write(f"{verb} {entry['name']} -> {entry['to']}\n")
    steps = ", ".join(str(e["step"]) for e in moved)
    out.write(
        f"{len(moved)} newer step(s) {'would be' if args.dry_run else 'were'} set aside "
        f"({steps}); step {args.to} is the run's newest committed step"
        + (" after that\n" if args.dry_run else "\n")
    )
    return EXIT_OK
