"""Errors raised into a thread at a chosen line, as a signal handler raises them.

A Python signal handler runs in the main thread between two bytecodes and its
exception propagates from wherever that thread was. DataLoader's SIGCHLD
handler does so when a worker dies, Ctrl-C does with KeyboardInterrupt. A trace
function can raise at an exact line, which makes such a race repeatable.
"""

from __future__ import annotations

import gc
import inspect
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import stalwart

__all__ = [
    "KILLED",
    "RaiseAtCall",
    "RaiseBetween",
    "fds_settle",
    "interrupted_restore",
    "names_the_error",
    "open_fds",
    "raise_at",
    "raised_into",
    "small_state",
    "traced",
]

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


STALWART = str(Path(stalwart.__file__).parent)


def ours(frame: Any) -> bool:
    return frame is not None and frame.f_code.co_filename.startswith(STALWART)


class RaiseAtCall:
    """A trace function raising ``error`` at the ``at``-th entry of a function of
    stalwart's, or of one it calls (``ThreadPoolExecutor.submit``, DCP's): not
    deeper, where the standard library's own ``except Exception`` (logging's, for
    one) swallows what it gets. Left out, where Python itself ignores any
    error (a signal handler's too): generators, whose entry may be their close,
    the calls a generator makes while it is closed (a ``finally`` or a ``with``'s
    exit seeing ``GeneratorExit``: when the collector closes one left suspended by
    an earlier interrupted call, that runs in whatever call is traced then), and
    weakref callbacks and finalizers, which run when an object dies."""

    def __init__(self, at: int, error: BaseException) -> None:
        # A fresh copy each time: one instance raised again and again would carry
        # every earlier traceback along, and formatting it would grow without end.
        self.at, self.error, self.calls = at, type(error)(*error.args), 0
        self.where: str | None = None

    def __call__(self, frame: Any, event: str, _arg: Any) -> None:
        code = frame.f_code
        if (
            event != "call"
            or code.co_flags & inspect.CO_GENERATOR
            or _ignored_by_python(code)
            or isinstance(sys.exc_info()[1], GeneratorExit)
        ):
            return
        if ours(frame) or ours(frame.f_back):
            self.calls += 1
            if self.calls == self.at:
                self.where = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
                raise self.error


class RaiseAfterReturn(RaiseAtCall):
    """``RaiseAtCall`` raising at the first function entry after stalwart's function
    ``name`` returned (in the traced thread)."""

    def __init__(self, error: BaseException, name: str) -> None:
        super().__init__(1, error)
        self.name, self.returned = name, False

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and not self.returned:
            # Trace only ``name``'s frames locally: their "return" arms the trap.
            return self if frame.f_code.co_name == self.name and ours(frame) else None
        if event == "return":
            self.returned = True
            return None
        if self.returned:
            return super().__call__(frame, event, arg)
        return None


class RaiseBetween(RaiseAtCall):
    """``RaiseAtCall`` counting only the entries from the first entry of stalwart's
    function ``start`` to the first entry of its function ``end`` after it."""

    def __init__(self, at: int, error: BaseException, start: str, end: str) -> None:
        super().__init__(at, error)
        self.start, self.end = start, end
        self.started = self.ended = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and ours(frame):
            name = frame.f_code.co_name
            self.started = self.started or name == self.start
            self.ended = self.ended or (self.started and name == self.end)
        if self.started and not self.ended:
            super().__call__(frame, event, arg)


def _ignored_by_python(code: Any) -> bool:
    return code.co_name == "__del__" or code.co_filename.endswith(
        ("/weakref.py", "/_weakrefset.py")
    )


def open_fds() -> set[str]:
    """This process's open descriptors: those ``/proc/self/fd`` lists that are still
    open once it is listed. Left out: the listing's own descriptor, whose number
    depends on what else is open at that moment (a descriptor another thread opens
    and closes meanwhile, retention's scan of the run directory say, moves it to the
    next number, which would then look new in a later listing), and any descriptor
    closed meanwhile."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        found.add(name)
    return found


def traced(trace: RaiseAtCall, fn: Any) -> BaseException | None:
    sys.settrace(trace)
    try:
        fn()
    except BaseException as exc:
        return exc
    finally:
        sys.settrace(None)
    return None


def names_the_error(exc: BaseException | None, error: BaseException) -> bool:
    while exc is not None:
        if exc is error or (str(error) and str(error) in str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def fds_settle(before: set[str]) -> set[str]:
    """Descriptors opened since ``before`` still open once the last error is dropped
    (a check still running in its thread closes its file when it ends)."""
    for _ in range(100):
        if open_fds() <= before:
            break
        gc.collect()
        time.sleep(0.02)
    return open_fds() - before


def interrupted_restore(
    trace: RaiseAtCall, ckpt: Any, state: Any, model: Any, wanted: dict[str, Any], step: int = 1
) -> bool:
    """``ckpt.restore(state)`` under ``trace``: True when its error came out (Ctrl-C as
    itself), False when a library's own ``except Exception`` took it (the fast decoder of
    a small value falls back to torch.load) and the restore went on to ``step``, leaving
    ``model`` with the ``wanted`` state dict."""
    from ..conftest import assert_same

    got: list[int | None] = []
    outcome = traced(trace, lambda: got.append(ckpt.restore(state)))
    if outcome is None:
        assert got == [step] and isinstance(trace.error, Exception), (trace.where, got)
        assert_same(model.state_dict(), wanted)
        return False
    assert names_the_error(outcome, trace.error), (trace.where, outcome)
    if not isinstance(trace.error, Exception):
        assert outcome is trace.error, (trace.where, outcome)
    return True


def small_state(
    extra: dict[str, Any] | None = None, width: int = 64
) -> tuple[Any, Any, stalwart.TrainState]:
    """A two-layer model and its Adam after one step (so with optimizer state), and their
    ``TrainState`` (with ``extra``): what the interrupt sweeps save and restore.
    ``width`` 640 makes the first weight and its moments 1.6 MB each: written with
    O_DIRECT (``stalwart.writer``)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, width)).sum().backward()
    opt.step()
    return model, opt, stalwart.TrainState(model=model, optimizer=opt, extra=extra)
