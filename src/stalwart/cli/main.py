"""The ``stalwart`` command: ``ls``, ``inspect`` and ``verify`` a run's checkpoints.

Errors print one line, ``stalwart: error: ...``, on stderr and no traceback:
every ``StalwartError``, ``OSError`` and ``ValueError`` (and arithmetic or
recursion errors a hostile file could provoke) a command raises; exit statuses
are 0 (good), 1 (a checkpoint is bad), 2 (usage error), as each ``--help`` says.

Everything the CLI prints, on stdout and stderr, passes through
``stalwart.redact.redact_text``: credentials in URLs (``s3://KEY:SECRET@``,
``KEY:SECRET@bucket``), signed query parameters, and the user and password parts
of any URL on the command line, wherever they show up again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO, cast

import torch

from stalwart import __version__
from stalwart.cli import (
    cmd_chaos,
    cmd_diff,
    cmd_export,
    cmd_gc,
    cmd_inspect,
    cmd_launch,
    cmd_ls,
    cmd_plan,
    cmd_report,
    cmd_restore_test,
    cmd_rollback,
    cmd_verify,
)
from stalwart.cli.common import EXIT_BAD, EXIT_USAGE, UsageError
from stalwart.errors import StalwartError
from stalwart.redact import redact_text, url_secrets

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
    for command in (
        cmd_plan,
        cmd_gc,
        cmd_rollback,
        cmd_diff,
        cmd_export,
        cmd_report,
        cmd_restore_test,
    ):
        command.add_parser(subparsers)
    cmd_chaos.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    Never raises for expected failures, including argparse's own exits (``--help``
    returns 0, bad arguments 2), so tests can call it in-process. Output goes to
    ``sys.stdout``/``sys.stderr`` of the call, redacted (see the module docstring).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    secrets = [s for arg in args for s in url_secrets(arg)]
    out = cast(TextIO, _Redacting(sys.stdout, secrets))
    err = cast(TextIO, _Redacting(sys.stderr, secrets))
    # Redirected too: argparse, warnings and the logging fallback write to sys.stderr.
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        return _run(args, out, err)


def _run(argv: list[str], out: TextIO, err: TextIO) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return _status(exc.code)
    try:
        status: int = args.func(args, out=out, err=err)
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
    except (ValueError, ArithmeticError, RecursionError, MemoryError) as exc:
        # A run directory is input from outside; whatever a crafted file provokes
        # deep inside a command ends in one line, naming the kind of failure.
        return _error(f"{type(exc).__name__}: {exc or 'no detail'}", EXIT_BAD)
    return status


class _Redacting:
    """A text stream that hides credentials in everything written to it (``redact_text``).

    Each ``write`` is redacted on its own: print and rich write a secret, which never
    holds a newline, in one piece.
    """

    def __init__(self, stream: TextIO, secrets: list[str]) -> None:
        self._stream = stream
        self._secrets = secrets

    def write(self, text: str) -> int:
        self._stream.write(redact_text(text, self._secrets))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        # flush, isatty, fileno, encoding, ...: the underlying stream's.
        return getattr(self._stream, name)


def _error(message: str, status: int) -> int:
    # One line, whatever the message holds (a store's error may carry newlines).
    print(f"stalwart: error: {' '.join(message.split())}", file=sys.stderr)
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
