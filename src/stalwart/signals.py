"""Preemption signals: SIGTERM and SIGUSR1 set a flag that the next ``save`` acts on.

The handler only sets a flag: it runs between bytecodes of the training loop,
and saving from there could interleave with a half-done optimizer step. The
manager reads the flag in ``save``, agrees on it across ranks and writes an
emergency checkpoint.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["PREEMPTION_SIGNALS", "PreemptionSignals"]

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")


class PreemptionSignals:
    """A flag set by SIGTERM or SIGUSR1 once ``install`` ran; ``uninstall`` puts the old handlers back.

    Handlers are installed only from the main thread (Python allows no other);
    elsewhere ``install`` does nothing and the flag stays clear.
    """

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in PREEMPTION_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                self._old[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._flag.set()

    def is_set(self) -> bool:
        """Whether a preemption signal arrived (in this process)."""
        return self._flag.is_set()

    def uninstall(self) -> None:
        """Restore the handlers that were in place before ``install``. Idempotent."""
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old.clear()
