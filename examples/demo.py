"""`make demo`: SIGKILL one rank of a DDP run, let torchrun recover it, prove nothing changed.

Two ``torchrun`` commands, each training ``examples/charlm.py`` on 2 ranks
(DistributedDataParallel over gloo, on CPU):

a. the reference run, trained to the end without interruption;
b. the same run in another directory with ``--max-restarts=1``: rank 1 SIGKILLs
   itself right after the optimizer update of step ``--crash-at``, before that
   step's checkpoint is written. Rank 0's next checkpoint collective fails, and
   torchrun stops it and starts both ranks again;
c. the restarted ranks restore the newest committed checkpoint by themselves and
   train to the end, all inside the same torchrun command.

Then (a) and (c) are compared with ``torch.equal``: every tensor of the full
model and optimizer state (gathered on rank 0), the scheduler and data position,
each rank's RNG states, and each rank's losses of the steps both ran. The exit
code is 0 only when all of them are identical and the kill, the restart and the
resume really happened: torchrun logged the killed rank's exit code -9, the
ranks' second attempt started at the newest committed checkpoint, and
``events.jsonl`` has that restore.

``--single`` runs the single-process version instead: a reference process, a
process that SIGKILLs itself, and a fresh process that resumes its run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from stalwart.catalog import VERDICT_EVENTS
from stalwart.events import read_events

HERE = Path(__file__).resolve().parent
CHARLM = HERE / "charlm.py"
REPO = HERE.parent
# A prefix of the message: PYTHONWARNINGS splits its value at commas.
_DCP_NO_DIST_WARNING = "torch.distributed is disabled"
# charlm.py's first line in every process: "charlm rank 1/2 attempt 0 pid 123: start 0 (fresh), ..."
_START = re.compile(r"^charlm(?: rank (\d+)/\d+)? attempt (\d+) pid (\d+): start (\d+)")
# torchrun's agent logs through Python logging: "E1129 15:14:20.298000 31631 .../api.py:1002] msg".
_AGENT = re.compile(r"^[DIWE]\d{4} [\d:.]+ \d+ \S+\] (.*)$")
# The agent's line for the first worker that failed in an attempt.
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# The last line of a worker's traceback when its checkpoint collective failed.
_SAVE_ERROR = re.compile(r"^\[rank(\d+)\]: \S*CheckpointSaveError: (.*)$")


@dataclass(slots=True)
class Proc:
    """One command whose output is streamed with a label and kept in log files.

    ``show_err`` picks which stderr lines are printed (and how); all of them go
    to the ``.stderr.log`` file.
    """

    label: str
    popen: subprocess.Popen[str]
    log: Path
    err_log: Path
    show_err: Callable[[str], str | None]
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0
    threads: list[threading.Thread] = field(default_factory=list)

    def pump(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log, "w", encoding="utf-8") as f:
            for line in self.popen.stdout:
                f.write(line)
                say(f"  [{self.label}] {line}")

    def pump_err(self) -> None:
        assert self.popen.stderr is not None
        with open(self.err_log, "w", encoding="utf-8") as f:
            for line in self.popen.stderr:
                f.write(line)
                shown = self.show_err(line.rstrip("\n"))
                if shown is not None:
                    say(f"  [{self.label}] {shown}\n")

    def reap(self) -> None:
        self.popen.wait()
        # Timed here, not in wait(): the runs end in any order.
        self.seconds = time.perf_counter() - self.started

    def wait(self) -> int:
        *pumps, reaper = self.threads
        reaper.join()
        # DataLoader workers of a SIGKILLed process hold its output open until they
        # notice their parent is gone (up to 5 s); they print nothing, so don't wait.
        for pump in pumps:
            pump.join(timeout=1.0)
        assert self.popen.returncode is not None
        return self.popen.returncode

    def stdout_lines(self) -> list[str]:
        return self.log.read_text(encoding="utf-8").splitlines()

    def stderr_text(self) -> str:
        return self.err_log.read_text(encoding="utf-8")


_print_lock = threading.Lock()


def say(text: str) -> None:
    with _print_lock:  # whole lines only: two runs may print at the same time
        print(text, end="", flush=True)


def shorten(text: str, width: int = 150) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def show_all(line: str) -> str:
    return f"stderr: {line}"


def show_torchrun(line: str) -> str | None:
    """The lines of torchrun's stderr worth showing live: the agent's own, and failed saves."""
    agent = _AGENT.match(line)
    if agent is not None:
        return "torchrun: " + shorten(agent.group(1).split(" of binary: ")[0])
    failed = _SAVE_ERROR.match(line)
    if failed is not None:
        # "rank 1 is gone (connection closed); the job must restart (...): checkpoint
        # coordination ...": what happened comes first; the whole traceback is in the log.
        return f"rank {failed.group(1)}: CheckpointSaveError: {failed.group(2).split(': ')[0]}"
    return None


def start(
    label: str,
    workdir: Path,
    cmd: list[str],
    show_err: Callable[[str], str | None],
    env: Mapping[str, str] | None = None,
) -> Proc:
    popen = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    name = label.strip().replace(" ", "-")
    proc = Proc(label, popen, workdir / f"{name}.log", workdir / f"{name}.stderr.log", show_err)
    proc.threads = [
        threading.Thread(target=proc.pump, daemon=True),
        threading.Thread(target=proc.pump_err, daemon=True),
        threading.Thread(target=proc.reap, daemon=True),
    ]
    for thread in proc.threads:
        thread.start()
    return proc


def charlm(label: str, workdir: Path, args: list[str]) -> Proc:
    """One plain charlm.py process (no process group)."""
    # torch.distributed.checkpoint warns on every single-process save that it
    # assumes a single process; that is the intent here, so keep the demo's output
    # to what it shows.
    env = {"PYTHONWARNINGS": f"ignore:{_DCP_NO_DIST_WARNING}:UserWarning"}
    return start(label, workdir, [sys.executable, str(CHARLM), *args], show_all, env)


def torchrun(label: str, workdir: Path, nproc: int, restarts: int, args: list[str]) -> Proc:
    """charlm.py on ``nproc`` ranks under torchrun (one node, a free port of its own)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", str(CHARLM), *args,
    ]  # fmt: skip
    # One thread per rank (charlm sets it too); set here, torchrun warns that it sets it.
    return start(label, workdir, cmd, show_torchrun, {"OMP_NUM_THREADS": "1"})


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) pairs of nested dicts, lists and tuples."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flatten(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, tree


def compare(reference: Path, resumed: Path) -> tuple[int, list[str]]:
    """Number of tensors compared, and the keys that differ (bit for bit) between two final states."""
    a = torch.load(reference, weights_only=True)
    b = torch.load(resumed, weights_only=True)
    # The resumed process only ran the steps after its restore point; compare
    # the losses of those steps.
    b_losses: dict[int, float] = b.pop("losses", {})
    a_all: dict[int, float] = a.pop("losses", {})
    flat_a, flat_b = dict(flatten(a)), dict(flatten(b))
    differ = sorted(k for k in flat_a.keys() ^ flat_b.keys())
    n_tensors = 0
    for key in sorted(flat_a.keys() & flat_b.keys()):
        x, y = flat_a[key], flat_b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            n_tensors += 1
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            same = type(x) is type(y) and x == y
        if not same:
            differ.append(key)
    bad_losses = [s for s in b_losses if a_all.get(s) != b_losses[s]]
    if bad_losses:
        differ.append(
            f"losses of steps {bad_losses[0]}..{bad_losses[-1]} ({len(bad_losses)} steps)"
        )
    return n_tensors, differ


def compare_runs(reference: Path, resumed: Path, nproc: int) -> tuple[int, list[str]]:
    """``compare`` over rank 0's full state and every rank's own file (``OUT.rank{r}``)."""
    n_tensors, differ = compare(reference, resumed)
    for r in range(nproc):
        n, d = compare(Path(f"{reference}.rank{r}"), Path(f"{resumed}.rank{r}"))
        n_tensors += n
        differ += [f"rank{r}.{key}" for key in d]
    return n_tensors, differ


def starts(lines: list[str]) -> dict[int, dict[int, tuple[int, int]]]:
    """{attempt: {rank: (pid, start step)}} from charlm.py's first line in every process."""
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for line in lines:
        m = _START.match(line)
        if m is not None:
            rank, attempt, pid, step = (int(g or 0) for g in m.groups())
            out.setdefault(attempt, {})[rank] = (pid, step)
    return out


def saves(run_dir: Path, pid: int | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in read_events(run_dir)
        if e.get("event") == "save" and (pid is None or e.get("pid") == pid)
    ]


def stall_text(events: list[dict[str, Any]]) -> str:
    stalls = [e["stall_s"] * 1e3 for e in events]
    if not stalls:
        return "-"
    return f"{statistics.median(stalls):.1f} / {max(stalls):.1f} ms"


def size_text(events: list[dict[str, Any]]) -> str:
    sizes = [e["bytes"] for e in events]
    return f"{statistics.median(sizes) / 1e6:.2f} MB" if sizes else "-"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=REPO / "runs" / "demo",
                   help="where the runs go; deleted and recreated first")  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--crash-at", type=int, default=190)
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per step on each rank (default 16 with 2 ranks, 32 with --single: "
                        "32 a step in all)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=2, help="ranks of each torchrun run")
    p.add_argument("--crash-rank", type=int, default=None,
                   help="the rank that is killed (default: the last)")  # fmt: skip
    p.add_argument("--single", action="store_true",
                   help="single processes instead of torchrun: reference, SIGKILLed, resumed")  # fmt: skip
    p.add_argument("--crash-workers", type=int, default=0,
                   help="--single: DataLoader workers of the run that crashes")  # fmt: skip
    p.add_argument("--resume-workers", type=int, default=0,
                   help="--single: DataLoader workers of the resumed run")  # fmt: skip
    p.add_argument(
        "--summary-json", type=Path, default=None, help="also write the results as JSON here"
    )
    args = p.parse_args(argv)
    if not 0 < args.crash_at < args.steps:
        p.error(
            f"--crash-at must be between 1 and --steps - 1 ({args.steps - 1}), got {args.crash_at}"
        )
    if args.crash_at <= args.every:
        p.error(
            f"--crash-at ({args.crash_at}) must come after the first checkpoint (--every {args.every})"
        )
    if args.single:
        args.nproc = 1
    elif args.nproc < 2:
        p.error(f"--nproc must be at least 2 (or use --single), got {args.nproc}")
    elif args.crash_workers or args.resume_workers:
        p.error("--crash-workers and --resume-workers apply to --single only")
    if args.crash_rank is None:
        args.crash_rank = args.nproc - 1
    if not 0 <= args.crash_rank < args.nproc:
        p.error(f"--crash-rank must be in [0, {args.nproc}), got {args.crash_rank}")
    if args.batch_size is None:
        args.batch_size = 32 // args.nproc or 1
    return args


@dataclass(slots=True)
class Outcome:
    """What one mode of the demo found, for the shared verdict and JSON summary."""

    table: Table
    problems: list[str]
    ref_out: Path
    resumed_out: Path
    run_dir: Path
    expected_resume: int
    summary: dict[str, Any]


def run_torchrun(args: argparse.Namespace, console: Console, workdir: Path) -> Outcome:
    """(a) a reference torchrun, then (b)+(c): one torchrun in which a rank is killed and restarted."""
    ref_dir, run_dir = workdir / "reference", workdir / "interrupted"
    ref_out, resumed_out = workdir / "reference-final.pt", workdir / "resumed-final.pt"
    common = ["--steps", str(args.steps), "--every", str(args.every)]
    common += ["--batch-size", str(args.batch_size)]
    # The last checkpoint the crash run commits: its save of --crash-at never happens.
    expected_resume = (args.crash_at - 1) // args.every * args.every
    n, victim = args.nproc, args.crash_rank

    console.print(
        f"[bold]stalwart demo[/]: {n} ranks (torchrun, DDP over gloo), {args.steps} steps of "
        f"{args.batch_size} x {n} samples, a checkpoint every {args.every}; rank {victim} is "
        f"SIGKILLed after step {args.crash_at} and torchrun (--max-restarts=1) restarts the "
        f"ranks ({workdir})"
    )
    t0 = time.perf_counter()
    # One after the other: each run's ranks take one core each.
    reference = torchrun(
        "reference", workdir, n, 0, [*common, "--run-dir", str(ref_dir), "--out", str(ref_out)]
    )
    ref_rc = reference.wait()
    crashing = torchrun(
        "crash run",
        workdir,
        n,
        1,
        [*common, "--run-dir", str(run_dir), "--out", str(resumed_out),
         "--crash-at", str(args.crash_at), "--crash-rank", str(victim)],
    )  # fmt: skip
    crash_rc = crashing.wait()
    total_s = time.perf_counter() - t0

    problems: list[str] = []
    if ref_rc != 0:
        problems.append(f"the reference run failed (exit code {ref_rc}); see {reference.err_log}")
    if crash_rc != 0:
        problems.append(
            f"the crash run did not recover (torchrun exit code {crash_rc}); see {crashing.err_log}"
        )
    attempts = starts(crashing.stdout_lines())
    restarts = max(attempts, default=0)
    if sorted(attempts) != [0, 1]:
        problems.append(f"torchrun ran attempts {sorted(attempts)}, expected [0, 1] (one restart)")
    first, second = attempts.get(0, {}), attempts.get(1, {})
    if sorted(first) != list(range(n)) or any(step != 0 for _, step in first.values()):
        problems.append(f"the first attempt's ranks started at {first}, expected step 0 on each")
    resume_steps = sorted({step for _, step in second.values()})
    if sorted(second) != list(range(n)) or resume_steps != [expected_resume]:
        problems.append(
            f"the restarted ranks started at steps {resume_steps or 'none'}, expected "
            f"{expected_resume} on each of {n}"
        )
    killed_line = f"charlm rank {victim}/{n}: step {args.crash_at} done, SIGKILL before its save"
    if killed_line not in crashing.stdout_lines():
        problems.append(f"rank {victim} did not report its SIGKILL after step {args.crash_at}")
    # torchrun's own record of the kill: the agent logs the first failed worker of
    # the attempt with its exit code, -9 for SIGKILL.
    victim_pid = first.get(victim, (None, 0))[0]
    failures = [tuple(map(int, m)) for m in _FAILED.findall(crashing.stderr_text())]
    killed_exit = next((code for code, rank, pid in failures if pid == victim_pid), None)
    if killed_exit != -signal.SIGKILL:
        problems.append(
            f"torchrun's log does not show rank {victim} (pid {victim_pid}) ending with exit code "
            f"-9 (it logged {failures or 'no failure'}); see {crashing.err_log}"
        )
    restores = [e for e in read_events(run_dir) if e.get("event") == "restore"]
    resumed_from = restores[-1]["step"] if restores else None
    if resumed_from != expected_resume:
        problems.append(f"events.jsonl: restored step {resumed_from}, expected {expected_resume}")

    leader_pids = [attempts.get(a, {}).get(0, (None, 0))[0] for a in (0, 1)]
    ref_saves = saves(ref_dir)
    crash_saves, resume_saves = (saves(run_dir, pid) for pid in leader_pids)
    table = Table(title=f"reference vs. rank {victim} killed and restarted", title_justify="left")
    table.add_column("")
    table.add_column("reference", justify="right")
    table.add_column("killed + restarted", justify="right")
    ranks = f"{n} (DDP, gloo)"
    table.add_row("ranks", ranks, ranks)
    redone = args.crash_at - (resumed_from or 0)
    table.add_row(
        "steps trained",
        str(args.steps),
        f"{args.crash_at} + {args.steps - (resumed_from or 0)} ({redone} redone)",
    )
    table.add_row(
        "checkpoints written", str(len(ref_saves)), f"{len(crash_saves)} + {len(resume_saves)}"
    )
    table.add_row(
        "save stall, median / max", stall_text(ref_saves), stall_text(crash_saves + resume_saves)
    )
    table.add_row(
        "bytes per checkpoint", size_text(ref_saves), size_text(crash_saves + resume_saves)
    )
    table.add_row(
        "SIGKILL",
        "-",
        f"rank {victim} after step {args.crash_at}, exit {killed_exit}",
    )
    table.add_row("torchrun restarts", "0", f"{restarts} (--max-restarts=1)")
    table.add_row(
        "resumed from step",
        "-",
        f"{resumed_from} (ranks {', '.join(map(str, sorted(second))) or 'none'})",
    )
    table.add_row(
        "wall time", f"{reference.seconds:.1f} s", f"{crashing.seconds:.1f} s, one torchrun"
    )
    summary = {
        "mode": "torchrun",
        "nproc": n,
        "reference_returncode": ref_rc,
        "torchrun_returncode": crash_rc,
        "killed_rank": victim,
        "killed_step": args.crash_at,
        "killed_exitcode": killed_exit,
        "restarts": restarts,
        "starts": {a: {r: step for r, (_, step) in s.items()} for a, s in attempts.items()},
        "resumed_from": resumed_from,
        "saves": {
            "reference": len(ref_saves),
            "first_attempt": len(crash_saves),
            "after_restart": len(resume_saves),
        },
        "seconds": round(total_s, 3),
    }
    return Outcome(table, problems, ref_out, resumed_out, run_dir, expected_resume, summary)


def run_single(args: argparse.Namespace, console: Console, workdir: Path) -> Outcome:
    """(a) a reference process and (b) a SIGKILLed one side by side, then (c) a resumed process."""
    ref_dir, run_dir = workdir / "reference", workdir / "interrupted"
    ref_out, resumed_out = workdir / "reference-final.pt", workdir / "resumed-final.pt"
    common = ["--steps", str(args.steps), "--every", str(args.every)]
    common += ["--batch-size", str(args.batch_size)]
    expected_resume = (args.crash_at - 1) // args.every * args.every

    console.print(
        f"[bold]stalwart demo[/] (single process): {args.steps} steps, a checkpoint every "
        f"{args.every}, SIGKILL after step {args.crash_at}, then resume ({workdir})"
    )
    t0 = time.perf_counter()
    # (a) and (b) are independent, so they share the machine; each uses one thread.
    reference = charlm(
        "reference", workdir, [*common, "--run-dir", str(ref_dir), "--out", str(ref_out)]
    )
    crashing = charlm(
        "crashing ",
        workdir,
        [*common, "--run-dir", str(run_dir), "--crash-at", str(args.crash_at),
         "--num-workers", str(args.crash_workers)],
    )  # fmt: skip
    ref_rc, crash_rc = reference.wait(), crashing.wait()
    resuming = charlm(
        "resumed  ",
        workdir,
        [*common, "--run-dir", str(run_dir), "--out", str(resumed_out),
         "--num-workers", str(args.resume_workers)],
    )  # fmt: skip
    resume_rc = resuming.wait()
    total_s = time.perf_counter() - t0

    problems: list[str] = []
    if ref_rc != 0:
        problems.append(f"the reference run failed (exit code {ref_rc}); see {reference.log}")
    if crash_rc != -signal.SIGKILL:
        problems.append(f"the crashing run ended with {crash_rc}, not SIGKILL ({-signal.SIGKILL})")
    if resume_rc != 0:
        problems.append(f"the resumed run failed (exit code {resume_rc}); see {resuming.log}")
    restores = [e for e in read_events(run_dir) if e.get("event") == "restore"]
    resumed_from = restores[-1]["step"] if restores else None
    if resumed_from != expected_resume:
        problems.append(f"resumed from step {resumed_from}, expected {expected_resume}")

    ref_saves = saves(ref_dir)
    crash_saves = saves(run_dir, crashing.popen.pid)
    resume_saves = saves(run_dir, resuming.popen.pid)
    table = Table(title="reference vs. crashed-and-resumed", title_justify="left")
    table.add_column("")
    table.add_column("reference", justify="right")
    table.add_column("crashed + resumed", justify="right")
    redone = args.crash_at - (resumed_from or 0)
    table.add_row(
        "steps trained",
        str(args.steps),
        f"{args.crash_at} + {args.steps - (resumed_from or 0)} ({redone} redone)",
    )
    table.add_row(
        "checkpoints written", str(len(ref_saves)), f"{len(crash_saves)} + {len(resume_saves)}"
    )
    table.add_row(
        "save stall, median / max", stall_text(ref_saves), stall_text(crash_saves + resume_saves)
    )
    table.add_row(
        "bytes per checkpoint", size_text(ref_saves), size_text(crash_saves + resume_saves)
    )
    table.add_row("SIGKILL", "-", f"after step {args.crash_at} (exit {crash_rc})")
    table.add_row("resumed from step", "-", str(resumed_from))
    table.add_row("DataLoader workers", "0", f"{args.crash_workers} then {args.resume_workers}")
    table.add_row(
        "wall time",
        f"{reference.seconds:.1f} s",
        f"{crashing.seconds:.1f} + {resuming.seconds:.1f} s",
    )
    summary = {
        "mode": "single",
        "nproc": 1,
        "reference_returncode": ref_rc,
        "crash_returncode": crash_rc,
        "resume_returncode": resume_rc,
        "resumed_from": resumed_from,
        "saves": {
            "reference": len(ref_saves),
            "crashed": len(crash_saves),
            "resumed": len(resume_saves),
        },
        "seconds": round(total_s, 3),
    }
    return Outcome(table, problems, ref_out, resumed_out, run_dir, expected_resume, summary)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    workdir: Path = args.workdir.resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    outcome = (run_single if args.single else run_torchrun)(args, console, workdir)
    # stalwart's own check of the resume: the redone steps' fingerprints against the lost ones.
    certificate = next(
        (
            e
            for e in reversed(list(read_events(outcome.run_dir)))
            if e.get("event") in VERDICT_EVENTS
        ),
        None,
    )
    if certificate is None or certificate["event"] != "resume_verified":
        outcome.problems.append(
            "stalwart's certificate did not verify the resume: "
            + (certificate or {}).get("message", "no verdict in events.jsonl")
        )

    n_tensors = 0
    differ: list[str] = []
    if not outcome.problems:
        n_tensors, differ = compare_runs(outcome.ref_out, outcome.resumed_out, args.nproc)
    exact = not outcome.problems and not differ

    console.print()
    console.print(outcome.table)
    for problem in outcome.problems:
        console.print(f"[red]problem:[/] {problem}")
    if certificate is not None:
        console.print(f"certificate: {certificate.get('message')}", markup=False)
    if exact:
        ranks = "each rank's " if args.nproc > 1 else ""
        console.print(
            f"[bold green]exact: yes[/] - all {n_tensors} tensors (model, optimizer, {ranks}RNG "
            f"state) are bit-identical (torch.equal), as are the scheduler, data position and "
            f"{ranks}losses of steps {outcome.expected_resume + 1}..{args.steps}"
        )
    else:
        shown = ", ".join(differ[:10]) + (
            f" and {len(differ) - 10} more" if len(differ) > 10 else ""
        )
        console.print(
            f"[bold red]exact: NO[/] - {shown or 'not compared (see the problems above)'}"
        )
    console.print(f"demo took {outcome.summary['seconds']:.1f} s. Inspect the run:")
    run_dir = outcome.run_dir
    rel = run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir
    for line in (
        f"  stalwart ls {rel}          # committed checkpoints, sizes, metrics",
        f"  stalwart inspect {rel}     # the newest manifest",
        f"  less {rel}/events.jsonl   # every save, restore and deletion, with timings",
    ):
        console.print(line)

    if args.summary_json is not None:
        summary = {
            "exact": exact,
            "problems": outcome.problems,
            "differ": differ,
            "tensors_compared": n_tensors,
            "certificate": None if certificate is None else certificate.get("message"),
            **outcome.summary,
        }
        args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
