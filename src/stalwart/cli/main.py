"""The ``stalwart`` command: ``ls``, ``inspect`` and ``verify`` a run's checkpoints.

Every command only reads. Errors the user can fix print one line,
``stalwart: error: ...``, on stderr and no traceback; exit statuses are 0 (good),
1 (a checkpoint is bad), 2 (usage error), as each ``--help`` says.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from stalwart import __version__
from stalwart.cli import (
    cmd_diff,
    cmd_export,
    cmd_gc,
    cmd_inspect,
    cmd_launch,
    cmd_ls,
    cmd_plan,
    cmd_report,
    cmd_restore_test,
    cmd_verify,
)
from stalwart.cli.common import EXIT_BAD, EXIT_USAGE, UsageError
from stalwart.errors import StalwartError

__all__ = ["build_parser", "main"]

EPILOG = """\
exit status (every command):
  0  done, and everything checked is good
  1  a checkpoint is corrupt, unreadable or uncommitted (see each command's --help)
  2  usage error: bad arguments, missing path, not a run or checkpoint, unknown step

Run `stalwart COMMAND --help` for a command's options.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stalwart",
        description="Look after the checkpoints of stalwart training runs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"stalwart {__version__} (torch {torch.__version__})",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in (cmd_ls, cmd_inspect, cmd_verify, cmd_launch):
        command.add_parser(subparsers)
    for command in (cmd_plan, cmd_gc, cmd_diff, cmd_export, cmd_report, cmd_restore_test):
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    Never raises for expected failures, including argparse's own exits (``--help``
    returns 0, bad arguments 2), so tests can call it in-process.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exc:
        return _status(exc.code)
    try:
        status: int = args.func(args, out=sys.stdout, err=sys.stderr)
    except UsageError as exc:
        return _error(str(exc), EXIT_USAGE)
    except StalwartError as exc:
        return _error(str(exc), EXIT_BAD)
    except BrokenPipeError:
        # `stalwart ls RUN | head`: the reader left; say nothing, and keep Python's
        # exit-time flush of stdout from raising again.
        _silence_stdout()
        return EXIT_BAD
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return _error(f"{where}{exc.strerror or exc}", EXIT_BAD)
    except KeyboardInterrupt:
        return 130
    return status


def _error(message: str, status: int) -> int:
    print(f"stalwart: error: {message}", file=sys.stderr)
    return status


def _status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return EXIT_USAGE


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
