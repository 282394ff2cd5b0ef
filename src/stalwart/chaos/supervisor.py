"""The chaos supervisor: run a training command, inject faults, restart it, stop at a deadline.

It plays the part of a job scheduler with a bad day. It starts the command in
a session of its own (so the whole command, torchrun and its ranks included,
can be signalled as one), reads its output line by line with the time each
line arrived, injects each ``Fault`` when due, and after every exit that is not
a finished run starts the command again, which must resume from its run
directory (as ``examples/charlm.py`` and every stalwart loop do). At the
deadline it sends SIGTERM to the command, and SIGKILL after ``stop_grace``.

Everything is recorded as plain data (``ChaosRecord``) with ``time.time()``
stamps, the clock of ``events.jsonl``, so ``stalwart.chaos.measure`` can put
the two side by side. Linux only (``/proc``, process groups).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from stalwart.chaos.procs import target_pid
from stalwart.chaos.schedule import Fault
from stalwart.events import open_regular
from stalwart.redact import known_secrets, redact_text, url_secrets

__all__ = [
    "DEFAULT_STEP_PATTERN",
    "Attempt",
    "ChaosRecord",
    "Injected",
    "Supervisor",
    "redacted_command",
]

DEFAULT_STEP_PATTERN = r"^\s*step\s+(\d+)\b"
"""A progress line: ``step 120  loss 2.31 ...`` (the first group is the step
completed). ``examples/charlm.py --log-every 1`` prints one per step."""

_POLL_S = 0.02


@dataclasses.dataclass(slots=True, kw_only=True)
class Attempt:
    """One start of the command, until it exited."""

    index: int
    pid: int
    started: float
    ended: float | None = None
    """When the supervisor saw the command exit (``time.time()``)."""
    returncode: int | None = None
    steps: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    """(arrival time, step) of every progress line, in order."""
    log: str = ""
    """File with the command's output (stdout and stderr) of this attempt."""

    def first_step(self) -> tuple[float, int] | None:
        return self.steps[0] if self.steps else None

    def max_step(self) -> int | None:
        return max((s for _, s in self.steps), default=None)


@dataclasses.dataclass(slots=True, kw_only=True)
class Injected:
    """A fault as it happened."""

    fault: Fault
    time: float
    """When the signal was sent (``time.time()``)."""
    attempt: int
    pid: int
    """Process signalled (for ``term``: the leader of the command's process group)."""
    rank: int | None
    """Rank of that process (RANK in its environment); None for a single-process command."""
    step: int | None
    """Last progress step seen before the fault."""
    resumed: float | None = None
    """``stop``: when SIGCONT was sent."""
    escalated: bool = False
    """``term``: the command outlived its grace period and was SIGKILLed."""


@dataclasses.dataclass(slots=True, kw_only=True)
class ChaosRecord:
    """What a chaos run did: the command's attempts and the faults, in order."""

    command: list[str]
    """The command run, credentials hidden (``redacted_command``): the record is written out."""
    started: float
    deadline: float
    ended: float = 0.0
    """When the run stopped: the deadline, or the moment the command finished."""
    completed: bool = False
    """The command exited 0 (training finished) before the deadline."""
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    faults: list[Injected] = dataclasses.field(default_factory=list)
    unplanned: list[int] = dataclasses.field(default_factory=list)
    """Attempts that ended with a failure no fault caused."""
    schedule: list[Fault] = dataclasses.field(default_factory=list)
    skipped: list[Fault] = dataclasses.field(default_factory=list)
    """Faults not injected: due after the run stopped."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def redacted_command(command: Sequence[str]) -> list[str]:
    """``command`` with its credentials replaced by ``***`` (``stalwart.redact``): the
    user part of URLs, the values of options and variables named like a secret
    (``--token T``, ``--api-key=K``, ``AWS_SECRET_ACCESS_KEY=S``) and of the credential
    environment variables."""
    options: dict[str, str] = {}
    for arg, following in zip(command, [*command[1:], ""], strict=True):
        name, eq, value = arg.partition("=")
        if eq:
            options[name] = value
        elif arg.startswith("-") and following and not following.startswith("-"):
            options[arg] = following
    secrets = known_secrets("", options) + [s for arg in command for s in url_secrets(arg)]
    return [redact_text(arg, secrets) for arg in command]


class Supervisor:
    """Runs ``command`` under ``schedule`` for ``duration`` seconds (see the module docstring).

    Blocking, single-threaded apart from one reader thread per attempt. ``notes``
    receives one human-readable line per start, fault and exit.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        schedule: Sequence[Fault],
        duration: float,
        logs: Path,
        target_rank: int | None = None,
        step_pattern: str = DEFAULT_STEP_PATTERN,
        stop_grace: float = 30.0,
        exit_timeout: float = 120.0,
        max_failed_starts: int = 2,
        env: dict[str, str] | None = None,
        notes: Callable[[str], None] = lambda _line: None,
    ) -> None:
        if not command:
            raise ValueError("no command to run: give it after `--`")
        if not duration > 0:
            raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
        self.command = list(command)
        self.schedule = sorted(schedule, key=lambda f: f.at)
        self.duration = duration
        self.logs = logs
        self.target_rank = target_rank
        self.step_re = re.compile(step_pattern)
        if self.step_re.groups < 1:
            raise ValueError(
                f"the step pattern {step_pattern!r} needs a group that captures the step"
            )
        self.stop_grace = stop_grace
        self.exit_timeout = exit_timeout
        self.max_failed_starts = max_failed_starts
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.notes = notes

    # ------------------------------------------------------------------ the run

    def run(self) -> ChaosRecord:
        """Run the command until the deadline or until it finishes; returns the record.

        Raises ``RuntimeError`` when the command keeps failing on its own
        (``max_failed_starts`` attempts in a row ended without a progress line),
        ``ValueError`` when a fault names a rank the command does not have. On any
        exception the command's whole process group is SIGKILLed first.
        """
        self.logs.mkdir(parents=True, exist_ok=True)
        start = time.time()
        record = ChaosRecord(
            command=redacted_command(self.command),
            started=start,
            deadline=start + self.duration,
            schedule=self.schedule,
        )
        pending = deque(self.schedule)
        failed_starts = 0
        while time.time() < record.deadline:
            attempt, proc, reader = self._spawn(len(record.attempts))
            record.attempts.append(attempt)
            self.notes(f"attempt {attempt.index}: started pid {attempt.pid}")
            try:
                caused = self._watch(record, attempt, proc, pending)
            except BaseException:
                # Ctrl-C, or a fault that cannot be aimed: never leave the command running.
                self._signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            # First the group: a child left behind holds the output pipe open, and the
            # reader ends at its end (what was written before stays readable).
            self._reap_group(proc.pid)
            reader.join(timeout=5.0)
            if attempt.returncode == 0:
                record.completed = True
                self.notes(f"attempt {attempt.index}: finished (exit 0)")
                break
            if attempt.ended is not None and attempt.ended >= record.deadline and not caused:
                break  # stopped at the deadline: not a failure
            self.notes(f"attempt {attempt.index}: exit {attempt.returncode}")
            if not caused:
                record.unplanned.append(attempt.index)
            failed_starts = 0 if attempt.steps else failed_starts + 1
            if failed_starts >= self.max_failed_starts:
                raise RuntimeError(
                    f"the command failed {failed_starts} times in a row before its first progress "
                    f"line (last exit {attempt.returncode}); see {attempt.log}. Does it print lines "
                    f"matching {self.step_re.pattern!r}, and does it run on its own?"
                )
        record.ended = min(time.time(), record.deadline)
        if record.completed and record.attempts[-1].ended is not None:
            record.ended = record.attempts[-1].ended
        record.skipped = list(pending)
        return record

    def _spawn(self, index: int) -> tuple[Attempt, subprocess.Popen[str], threading.Thread]:
        log = self.logs / f"attempt-{index}.log"
        # Never written through a link, or a name of a file elsewhere, left in the folder.
        fd = open_regular(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        sink = os.fdopen(fd, "w", encoding="utf-8")
        try:
            proc = subprocess.Popen(
                self.command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                env=self.env,
                # A session of its own: the command and all it starts form one process
                # group, signalled together on preemption and at the deadline.
                start_new_session=True,
            )
        except BaseException:
            sink.close()
            raise
        attempt = Attempt(index=index, pid=proc.pid, started=time.time(), log=str(log))
        assert proc.stdout is not None
        reader = threading.Thread(target=self._read, args=(proc.stdout, attempt, sink), daemon=True)
        reader.start()
        return attempt, proc, reader

    def _read(self, stream: IO[str], attempt: Attempt, f: IO[str]) -> None:
        with stream, f:
            for line in stream:
                now = time.time()
                f.write(line)
                f.flush()
                step = self._step_of(line)
                if step is not None:
                    attempt.steps.append((now, step))

    def _step_of(self, line: str) -> int | None:
        """The step a progress line reports; None for any other line, and for a group
        that matched no number of up to 18 digits (a pattern wider than the command's
        lines): output, not a step. The reader must go on, or the pipe fills."""
        match = self.step_re.search(line)
        text = match.group(1) if match is not None else None
        if text is None or not (text.isascii() and text.isdigit() and len(text) <= 18):
            return None
        return int(text)

    def _watch(
        self,
        record: ChaosRecord,
        attempt: Attempt,
        proc: subprocess.Popen[str],
        pending: deque[Fault],
    ) -> bool:
        """Inject due faults until the attempt exits or the deadline; True when a fault ended it."""
        caused = False
        kill_at: float | None = None  # SIGKILL the group then (term's grace, or a hung exit)
        stopped: Injected | None = None
        while proc.poll() is None:
            now = time.time()
            if stopped is not None and now >= stopped.time + stopped.fault.seconds:
                self._signal(stopped.pid, signal.SIGCONT)
                stopped.resumed = time.time()
                self.notes(f"  SIGCONT pid {stopped.pid}")
                stopped = None
            if now >= record.deadline:
                if stopped is not None:
                    self._signal(stopped.pid, signal.SIGCONT)
                    stopped.resumed = time.time()
                self._stop_at_deadline(proc)
                break
            if kill_at is not None and now >= kill_at:
                self._signal_group(proc.pid, signal.SIGKILL)
                if record.faults and record.faults[-1].attempt == attempt.index:
                    record.faults[-1].escalated = record.faults[-1].fault.kind == "term"
                kill_at = None
            due = pending and now >= record.started + pending[0].at
            # A fault hits a running training: one due during a (re)start waits for
            # the first progress line, and faults wait while a stop is in progress.
            if due and attempt.steps and stopped is None and not caused:
                injected = self._inject(pending.popleft(), attempt, proc)
                if injected is not None:
                    record.faults.append(injected)
                    if injected.fault.kind == "stop":
                        stopped = injected
                    else:
                        caused = True
                        # term: SIGKILL when the grace period is over; kill: when the
                        # command has not ended exit_timeout after losing a rank.
                        wait = (
                            injected.fault.grace
                            if injected.fault.kind == "term"
                            else self.exit_timeout
                        )
                        kill_at = injected.time + wait
            time.sleep(_POLL_S)
        attempt.returncode = proc.wait()
        attempt.ended = time.time()
        return caused

    def _inject(
        self, fault: Fault, attempt: Attempt, proc: subprocess.Popen[str]
    ) -> Injected | None:
        step = attempt.steps[-1][1] if attempt.steps else None
        if fault.kind == "term":
            # A scheduler preempts the whole job: every process of the command.
            pid, rank = proc.pid, None
        else:
            try:
                pid, rank = target_pid(proc.pid, self.target_rank)
            except ValueError as exc:
                raise ValueError(f"{fault.text()}: {exc}") from None
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[fault.kind]
        now = time.time()
        sent = self._signal_group(pid, sig) if fault.kind == "term" else self._signal(pid, sig)
        if not sent:
            return None
        who = f"rank {rank} " if rank is not None else ""
        self.notes(
            f"  {fault.text()}: {signal.Signals(sig).name} to {who}pid {pid} after step {step}"
        )
        return Injected(fault=fault, time=now, attempt=attempt.index, pid=pid, rank=rank, step=step)

    def _stop_at_deadline(self, proc: subprocess.Popen[str]) -> None:
        self.notes(f"deadline: SIGTERM to the command, SIGKILL after {self.stop_grace:g} s")
        self._signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_grace)
        except subprocess.TimeoutExpired:
            self._signal_group(proc.pid, signal.SIGKILL)

    def _reap_group(self, pgid: int) -> None:
        # What the command left behind (a DataLoader worker, an orphaned rank) must
        # not live on into the next attempt.
        self._signal_group(pgid, signal.SIGKILL)

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> bool:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> bool:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return False
        return True
