"""Errors raised into a thread at a chosen line, as a signal handler raises them.

A Python signal handler runs in the main thread between two bytecodes and its
exception propagates from wherever that thread was. DataLoader's SIGCHLD
handler does so when a worker dies, Ctrl-C does with KeyboardInterrupt. A trace
function can raise at an exact line, which makes such a race repeatable.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["KILLED", "raise_at", "raised_into"]

KILLED = RuntimeError("DataLoader worker (pid 7) is killed by signal: Terminated.")
"""What DataLoader's SIGCHLD handler raises when a worker died of SIGTERM."""


def raise_at(code: Any, marker: str, error: BaseException) -> Callable[..., Any]:
    """A trace function (``sys.settrace``) that raises ``error`` in ``code`` just
    before its first line that holds ``marker``."""
    lines, first = inspect.getsourcelines(code)
    at = first + next(i for i, line in enumerate(lines) if marker in line)

    def local(frame: Any, event: str, _arg: Any) -> Any:
        if event == "line" and frame.f_lineno == at:
            raise error
        return local

    def calls(frame: Any, event: str, _arg: Any) -> Any:
        return local if event == "call" and frame.f_code is code else None

    return calls


def raised_into(code: Any, marker: str, error: BaseException, fn: Callable[[], Any]) -> None:
    """Run ``fn`` with ``error`` raised at ``marker`` in ``code``; assert it comes out as is."""
    sys.settrace(raise_at(code, marker, error))
    try:
        with pytest.raises(type(error)) as raised:
            fn()
    finally:
        sys.settrace(None)
    assert raised.value is error
