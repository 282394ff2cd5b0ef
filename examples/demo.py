"""`make demo`: kill a training run with SIGKILL, resume it, and prove nothing changed.

Three processes of ``examples/charlm.py``:

a. a reference run, trained to the end without interruption;
b. the same run in another directory, SIGKILLed right after the optimizer update
   of step ``--crash-at`` (its uncommitted steps are lost);
c. a fresh process on (b)'s directory, which restores the newest committed
   checkpoint and trains to the end.

(a) and (b) run side by side. Then every tensor of (a)'s and (c)'s final model,
optimizer and scheduler state (and the RNG state and the losses of the steps
both ran) is compared with ``torch.equal``. The exit code is 0 only when all of
them are identical and the crash and the resume really happened.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from stalwart.events import read_events

HERE = Path(__file__).resolve().parent
CHARLM = HERE / "charlm.py"
REPO = HERE.parent
# A prefix of the message: PYTHONWARNINGS splits its value at commas.
_DCP_NO_DIST_WARNING = "torch.distributed is disabled"


@dataclass(slots=True)
class Proc:
    """One charlm.py process whose output is streamed with a label and kept in a log file."""

    label: str
    popen: subprocess.Popen[str]
    log: Path
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0
    threads: list[threading.Thread] = field(default_factory=list)

    def pump(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log, "w", encoding="utf-8") as f:
            for line in self.popen.stdout:
                f.write(line)
                with _print_lock:  # whole lines only: two runs print at the same time
                    print(f"  [{self.label}] {line}", end="", flush=True)

    def reap(self) -> None:
        self.popen.wait()
        # Timed here, not in wait(): the runs end in any order.
        self.seconds = time.perf_counter() - self.started

    def wait(self) -> int:
        pump, reaper = self.threads
        reaper.join()
        # DataLoader workers of a SIGKILLed process hold its stdout open until they
        # notice their parent is gone (up to 5 s); they print nothing, so don't wait.
        pump.join(timeout=1.0)
        assert self.popen.returncode is not None
        return self.popen.returncode


_print_lock = threading.Lock()


def start(label: str, workdir: Path, args: list[str]) -> Proc:
    cmd = [sys.executable, str(CHARLM), *args]
    # torch.distributed.checkpoint warns on every single-process save that it
    # assumes a single process; that is the intent here, so keep the demo's output
    # to what it shows.
    env = {**os.environ, "PYTHONWARNINGS": f"ignore:{_DCP_NO_DIST_WARNING}:UserWarning"}
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
    )
    proc = Proc(label, popen, workdir / f"{label.strip()}.log")
    proc.threads = [
        threading.Thread(target=proc.pump, daemon=True),
        threading.Thread(target=proc.reap, daemon=True),
    ]
    for thread in proc.threads:
        thread.start()
    return proc


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
    b_losses: dict[int, float] = b.pop("losses")
    a_losses = {s: a["losses"][s] for s in b_losses}
    a.pop("losses")
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
    bad_losses = [s for s in b_losses if a_losses[s] != b_losses[s]]
    if bad_losses:
        differ.append(
            f"losses of steps {bad_losses[0]}..{bad_losses[-1]} ({len(bad_losses)} steps)"
        )
    return n_tensors, differ


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
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--crash-workers", type=int, default=0, help="DataLoader workers of the run that crashes"
    )
    p.add_argument(
        "--resume-workers", type=int, default=0, help="DataLoader workers of the resumed run"
    )
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    workdir: Path = args.workdir.resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    ref_dir, run_dir = workdir / "reference", workdir / "interrupted"
    ref_out, resumed_out = workdir / "reference-final.pt", workdir / "resumed-final.pt"
    common = ["--steps", str(args.steps), "--every", str(args.every)]
    common += ["--batch-size", str(args.batch_size)]
    # The last checkpoint the crashed run commits: its save of --crash-at never happens.
    expected_resume = (args.crash_at - 1) // args.every * args.every

    console.print(
        f"[bold]stalwart demo[/]: {args.steps} steps, a checkpoint every {args.every}, "
        f"SIGKILL after step {args.crash_at}, then resume ({workdir})"
    )
    t0 = time.perf_counter()
    # (a) and (b) are independent, so they share the machine; each uses one thread.
    reference = start(
        "reference", workdir, [*common, "--run-dir", str(ref_dir), "--out", str(ref_out)]
    )
    crashing = start(
        "crashing ",
        workdir,
        [*common, "--run-dir", str(run_dir), "--crash-at", str(args.crash_at),
         "--num-workers", str(args.crash_workers)],
    )  # fmt: skip
    ref_rc, crash_rc = reference.wait(), crashing.wait()
    crash_pid = crashing.popen.pid
    resuming = start(
        "resumed  ",
        workdir,
        [*common, "--run-dir", str(run_dir), "--out", str(resumed_out),
         "--num-workers", str(args.resume_workers)],
    )  # fmt: skip
    resume_rc = resuming.wait()
    total_s = time.perf_counter() - t0

    problems: list[str] = []
    if ref_rc != 0:
        problems.append(
            f"the reference run failed (exit code {ref_rc}); see {workdir}/reference.log"
        )
    if crash_rc != -signal.SIGKILL:
        problems.append(f"the crashing run ended with {crash_rc}, not SIGKILL ({-signal.SIGKILL})")
    if resume_rc != 0:
        problems.append(
            f"the resumed run failed (exit code {resume_rc}); see {workdir}/resumed.log"
        )
    restores = [e for e in read_events(run_dir) if e.get("event") == "restore"]
    resumed_from = restores[-1]["step"] if restores else None
    if resumed_from != expected_resume:
        problems.append(f"resumed from step {resumed_from}, expected {expected_resume}")
    n_tensors = 0
    differ: list[str] = []
    if not problems:
        n_tensors, differ = compare(ref_out, resumed_out)
    exact = not problems and not differ

    ref_saves = saves(ref_dir)
    crash_saves, resume_saves = saves(run_dir, crash_pid), saves(run_dir, resuming.popen.pid)
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
        "checkpoints written",
        str(len(ref_saves)),
        f"{len(crash_saves)} + {len(resume_saves)}",
    )
    table.add_row(
        "save stall, median / max",
        stall_text(ref_saves),
        stall_text(crash_saves + resume_saves),
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
    console.print()
    console.print(table)
    for problem in problems:
        console.print(f"[red]problem:[/] {problem}")
    if exact:
        console.print(
            f"[bold green]exact: yes[/] - all {n_tensors} tensors of model, optimizer and RNG state "
            f"are bit-identical (torch.equal), as are the losses of steps {expected_resume + 1}..{args.steps}"
        )
    else:
        shown = ", ".join(differ[:10]) + (
            f" and {len(differ) - 10} more" if len(differ) > 10 else ""
        )
        console.print(
            f"[bold red]exact: NO[/] - {shown or 'not compared (see the problems above)'}"
        )
    console.print(f"demo took {total_s:.1f} s. Inspect the run:")
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
            "problems": problems,
            "differ": differ,
            "tensors_compared": n_tensors,
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
        args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
