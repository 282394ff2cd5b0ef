"""``stalwart chaos``: goodput of a training command under injected faults, against Young/Daly.

The harness (``stalwart.chaos``) runs the command, kills, stops and preempts it
on a schedule, restarts it after every failure and measures, from its progress
lines and the run's ``events.jsonl``, the goodput, the work lost per failure
and the recovery split. This module adds the prediction ``stalwart plan`` makes
(Daly's complete model, ``planner.wall_time_ratio``) for the *measured*
checkpoint cost, interval, restart cost and failure rate, writes JSON and a
PNG, and renders the comparison.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, TextIO

from stalwart.chaos import (
    DEFAULT_STEP_PATTERN,
    FAULT_KINDS,
    ChaosRecord,
    Fault,
    Supervisor,
    measure,
    parse_schedule,
    poisson_schedule,
)
from stalwart.chaos.plot import draw_chaos
from stalwart.cli.common import EXIT_OK, UsageError, make_console
from stalwart.cli.planner import wall_time_ratio
from stalwart.continuous import daly_interval, young_interval
from stalwart.errors import StalwartError
from stalwart.events import read_events
from stalwart.layout import EVENTS_NAME

__all__ = ["JSON_NAME", "PNG_NAME", "add_parser", "predict", "run", "torchrun_command"]

JSON_NAME = "chaos.json"
PNG_NAME = "chaos.png"

EPILOG = """\
examples:
  stalwart chaos --run-dir runs/c --duration 60 --schedule kill@10,stop@25:3,term@40:grace=5 \\
      -- python examples/charlm.py --run-dir runs/c --steps 100000 --every 25 --log-every 1
  stalwart chaos --run-dir runs/c --duration 120 --mtbf 30 --faults kill,term --seed 1 \\
      --nproc 2 -- examples/charlm.py --run-dir runs/c --steps 100000 --log-every 1

faults (--schedule KIND@SECONDS[:ARG], comma-separated; seconds from the start):
  kill@T           SIGKILL one training process (--target-rank; default the highest)
  stop@T:S         SIGSTOP it for S seconds (default 3), then SIGCONT
  term@T:grace=G   SIGTERM to the whole command, SIGKILL after G seconds (default 30)
A fault due while the command is (re)starting waits for its first progress line.

The command must resume from its run directory when started again (every
stalwart loop does: `start = ckpt.restore(state) or 0`) and print one progress
line per step matching --step-pattern (default "step N ..."). Ranks are found
through /proc (Linux). Writes OUT/chaos.json, OUT/chaos.png and the command's
output of each attempt in OUT/logs/ (OUT defaults to RUN_DIR/chaos).

exit status:
  0  the run was measured
  1  the command failed on its own before its first progress line, twice in a
     row, or printed no progress line at all
  2  usage error
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "chaos",
        help="run training under injected faults; measure goodput against Young/Daly",
        description=textwrap.fill(
            "Run a training command for a bounded time under a fault schedule (SIGKILL of a "
            "rank, SIGSTOP, SIGTERM with grace), restart it after each failure, and report "
            "goodput, work lost per failure and the recovery split (detection, restart, "
            "restore, first step), against the goodput Young/Daly predicts for the measured "
            "checkpoint cost and failure rate.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-dir", required=True, help="the run directory the command uses")
    parser.add_argument("--duration", type=_positive, default=60.0, help="seconds (default 60)")
    parser.add_argument("--schedule", default=None, help="faults, e.g. kill@10,stop@25:3,term@40")
    parser.add_argument("--mtbf", type=_positive, default=None,
                        help="instead of --schedule: Poisson faults with this mean gap, seconds")  # fmt: skip
    parser.add_argument("--faults", default="kill",
                        help="with --mtbf: kinds to draw from, comma-separated (default kill)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="with --mtbf: random seed (default 0)")
    parser.add_argument("--grace", type=_positive, default=30.0,
                        help="with --mtbf: term's grace period, seconds (default 30)")  # fmt: skip
    parser.add_argument("--nproc", type=int, default=None,
                        help="run the command (SCRIPT ARGS...) under torchrun with N ranks")  # fmt: skip
    parser.add_argument("--target-rank", type=int, default=None,
                        help="rank that kill and stop hit (default: the highest found)")  # fmt: skip
    parser.add_argument("--step-pattern", default=DEFAULT_STEP_PATTERN,
                        help="regex of a progress line; group 1 is the step completed")  # fmt: skip
    parser.add_argument("--stop-grace", type=_positive, default=30.0,
                        help="at the deadline: seconds between SIGTERM and SIGKILL (default 30)")  # fmt: skip
    parser.add_argument(
        "--out", default=None, help="directory for the results (default RUN_DIR/chaos)"
    )
    parser.add_argument("--quiet", action="store_true", help="no line per start, fault and exit")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    parser.set_defaults(func=run)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def torchrun_command(command: list[str], nproc: int) -> list[str]:
    """``command`` (``SCRIPT ARGS`` or ``python SCRIPT ARGS``) under ``torch.distributed.run``.

    No restarts of torchrun's own (``--max-restarts=0``): when a rank dies the
    whole job ends, and the chaos supervisor restarts it, as a scheduler would.
    """
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if len(command) > 1 and Path(command[0]).name.startswith("python"):
        command = command[1:]  # torchrun runs the script with its own interpreter
    if command[0].startswith("-"):
        raise UsageError(
            f"--nproc runs SCRIPT ARGS under torchrun; the command starts with {command[0]!r}"
        )
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=0.2", *command,
    ]  # fmt: skip


def _check_no_inner_restarts(command: list[str]) -> None:
    """Refuse a torchrun command that restarts its workers itself.

    The supervisor sees a failure when the command exits; a torchrun that
    restarts in place never exits, so a kill would look like a hang.
    """
    if not any("torchrun" in Path(a).name or a == "torch.distributed.run" for a in command):
        return
    for i, arg in enumerate(command):
        name, eq, value = arg.partition("=")
        if name.replace("_", "-") != "--max-restarts":
            continue
        value = value if eq else (command[i + 1] if i + 1 < len(command) else "")
        if value != "0":
            raise UsageError(
                f"the torchrun command has {arg}{'' if eq else ' ' + value}: stalwart chaos restarts "
                "the job itself when it ends, so give --max-restarts=0 (or use --nproc)"
            )


def _schedule(args: argparse.Namespace) -> list[Fault]:
    if args.schedule is not None and args.mtbf is not None:
        raise UsageError("give --schedule or --mtbf, not both")
    try:
        if args.schedule is not None:
            return parse_schedule(args.schedule)
        if args.mtbf is not None:
            kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
            bad = [k for k in kinds if k not in FAULT_KINDS]
            if bad or not kinds:
                raise ValueError(
                    f"--faults must name kinds among {', '.join(FAULT_KINDS)}, got {args.faults!r}"
                )
            return poisson_schedule(
                mtbf=args.mtbf,
                duration=args.duration,
                seed=args.seed,
                kinds=kinds,
                grace=args.grace,  # type: ignore[arg-type]
            )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return []  # no faults: a fault-free baseline


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError(
            "no training command: give it after `--`, e.g. `-- python train.py --run-dir RUN`"
        )
    if args.nproc is not None:
        command = torchrun_command(command, args.nproc)
    else:
        _check_no_inner_restarts(command)
    schedule = _schedule(args)
    run_dir = Path(args.run_dir)
    target = Path(args.out) if args.out is not None else run_dir / "chaos"
    for folder in (target, target / "logs"):
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise UsageError(f"{folder} is a link or a file; --out names a directory of results")
    target.mkdir(parents=True, exist_ok=True)

    def note(line: str) -> None:
        if not args.quiet:
            print(f"chaos: {line}", file=err, flush=True)

    try:
        supervisor = Supervisor(
            command,
            schedule=schedule,
            duration=args.duration,
            logs=target / "logs",
            target_rank=args.target_rank,
            step_pattern=args.step_pattern,
            stop_grace=args.stop_grace,
            env={"OMP_NUM_THREADS": "1"} if args.nproc is not None else None,
            notes=note,
        )
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    try:
        record = supervisor.run()
    except RuntimeError as exc:
        raise StalwartError(str(exc)) from None
    except ValueError as exc:  # a fault aimed at a rank the command does not have
        raise UsageError(str(exc)) from None
    try:
        events = list(read_events(run_dir / EVENTS_NAME))
    except OSError as exc:  # a link, FIFO or unreadable file: the run's numbers still count
        print(
            f"stalwart: warning: cannot read {run_dir / EVENTS_NAME} ({exc.strerror or exc}); "
            "measuring without checkpoint events",
            file=err,
        )
        events = []
    try:
        measured = measure(record, events)
    except ValueError as exc:
        raise StalwartError(f"{exc}; see {target / 'logs'}") from None
    predicted = predict(measured)
    result = {"record": record.to_json(), "measured": measured, "predicted": predicted}
    _publish(target / JSON_NAME, (json.dumps(result, indent=2, allow_nan=True) + "\n").encode())
    png = _draw(record, measured, predicted, events, target / PNG_NAME, err)
    if args.json:
        out.write(json.dumps({**result, "png": png}, indent=2, allow_nan=True) + "\n")
    else:
        _render(record, measured, predicted, target, png, out)
    return EXIT_OK


def predict(measured: dict[str, Any]) -> dict[str, Any]:
    """Daly's expected goodput for what the run measured (the model of ``stalwart plan``).

    C: the median save stall; tau: the checkpoint interval in compute seconds
    (every_steps x step time); M: the window over the failures that restarted
    the command; R: the mean recovery less the first step's compute. Stopped
    time is outside the model: the predicted fraction is scaled by the share of
    the window the process was not stopped. Keys ``goodput_fraction`` and
    ``goodput_steps_per_s`` are None, with a ``reason``, when a number is missing.
    """
    step = measured["step_time_s"]
    ck = measured["checkpoint"]
    cost, tau = ck["stall_median_s"], ck["interval_s"]
    window = measured["window"]["seconds"]
    failures = measured["failures"]
    recoveries = [f["recovery_s"] - step for f in failures if f["recovery_s"] is not None and step]
    out: dict[str, Any] = {
        "model": "Daly 2006: wall/compute = M e^(R/M) (e^((tau+C)/M) - 1) / tau",
        "checkpoint_cost_s": cost,
        "interval_s": tau,
        "failures": len(failures),
        "mtbf_s": window / len(failures) if failures else None,
        "restart_s": statistics.fmean(recoveries) if recoveries else None,
        "stopped_share": sum(s["seconds"] for s in measured["stops"]) / window,
        "expected_lost_steps_per_failure": None
        if ck["every_steps"] is None
        else ck["every_steps"] / 2,
        "measured_lost_steps_per_failure": _mean([f["lost_steps"] for f in failures]),
        "goodput_fraction": None,
        "goodput_steps_per_s": None,
        "young_interval_s": None,
        "daly_interval_s": None,
        "daly_goodput_fraction": None,
        "reason": None,
    }
    if step is None or cost is None or tau is None or not cost > 0:
        out["reason"] = "no step time, save stall or interval was measured"
        return out
    mtbf, restart = out["mtbf_s"], out["restart_s"]
    if mtbf is None:
        ratio = 1.0 + cost / tau  # no failure: only the saves cost time
    elif restart is None:
        out["reason"] = "no failure was followed by a step: no restart cost measured"
        return out
    else:
        ratio = wall_time_ratio(tau, cost, mtbf, max(restart, 0.0))
        optimum = daly_interval(cost, mtbf)
        out["young_interval_s"] = young_interval(cost, mtbf)
        out["daly_interval_s"] = optimum
        out["daly_goodput_fraction"] = 1.0 / wall_time_ratio(optimum, cost, mtbf, max(restart, 0.0))
    fraction = (1.0 - out["stopped_share"]) / ratio
    out["goodput_fraction"] = fraction
    out["goodput_steps_per_s"] = fraction / step
    return out


def _mean(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _draw(
    record: ChaosRecord,
    measured: dict[str, Any],
    predicted: dict[str, Any],
    events: list[dict[str, Any]],
    path: Path,
    err: TextIO,
) -> str | None:
    saves = [
        (float(e["time"]), int(e["step"]))
        for e in events
        if e.get("event") == "save" and isinstance(e.get("step"), int) and isinstance(e.get("time"), (int, float))
        and record.started <= e["time"] <= record.ended
    ]  # fmt: skip
    image = io.BytesIO()
    try:
        draw_chaos(record, measured, predicted, image, saves=saves)
    except ImportError as exc:
        print(f"chaos: no PNG: matplotlib is not usable ({exc})", file=err)
        return None
    _publish(path, image.getvalue())
    return str(path)


def _publish(path: Path, data: bytes) -> None:
    """``data`` as ``path``: written to a new file of its own, renamed over ``path``, so
    whatever ``path`` was (a link left in a results folder) is replaced, never written
    through, and a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _render(
    record: ChaosRecord,
    measured: dict[str, Any],
    predicted: dict[str, Any],
    target: Path,
    png: str | None,
    out: TextIO,
) -> None:
    m, p = measured, predicted
    counts = m["counts"]
    faults = ", ".join(f"{n} {k}" for k, n in counts["faults"].items() if n) or "none"
    lines = [
        f"chaos: {len(record.attempts)} attempt(s), faults {faults}, {counts['unplanned']} unplanned "
        f"failure(s), {counts['skipped']} fault(s) not reached; window {m['window']['seconds']:.1f} s "
        f"(after a {m['startup_s']:.1f} s first start)"
        + (", training finished" if m["completed"] else ""),
        f"steps {m['steps']['first']} -> {m['steps']['last']}: goodput {m['goodput_steps_per_s']:.2f} "
        f"steps/s; ideal {_rate(m['ideal_steps_per_s'])} (step {_s(m['step_time_s'])} without saves)",
        f"checkpoint: every {m['checkpoint']['every_steps']} steps = {_s(m['checkpoint']['interval_s'])} "
        f"of compute, stall {_s(m['checkpoint']['stall_median_s'])} (median of "
        f"{m['checkpoint']['saves']} saves, {m['checkpoint']['emergency_saves']} emergency)",
    ]
    for f in m["failures"]:
        lines.append(
            f"  {f['kind']} at {_s(f['at'])}: step {f['step_reached']} -> restored "
            f"{f['restored_step']}, lost {f['lost_steps']} steps; detection {_s(f['detection_s'])}, "
            f"restart {_s(f['restart_s'])}, restore {_s(f['restore_s'])}, first step "
            f"{_s(f['first_step_s'])} = {_s(f['recovery_s'])}"
        )
    for s in m["stops"]:
        lines.append(f"  stop at {_s(s['at'])}: stopped {_s(s['seconds'])} after step {s['step']}")
    b = m["breakdown_s"]
    if b["useful"] is not None:
        lines.append(
            "window: " + ", ".join(f"{k} {v:.1f} s" for k, v in b.items() if v is not None)
        )
    if p["goodput_fraction"] is not None and m["goodput_fraction"] is not None:
        lines.append(
            f"goodput: measured {m['goodput_fraction']:.1%} of ideal, Young/Daly predicts "
            f"{p['goodput_fraction']:.1%} (C {_s(p['checkpoint_cost_s'])}, tau {_s(p['interval_s'])}, "
            f"M {_s(p['mtbf_s'])}, R {_s(p['restart_s'])})"
        )
        if p["daly_interval_s"] is not None:
            lines.append(
                f"plan: for this C and M, Daly's interval is {_s(p['daly_interval_s'])} "
                f"({p['daly_interval_s'] / m['step_time_s']:.0f} steps), for "
                f"{p['daly_goodput_fraction']:.1%}"
            )
    else:
        lines.append(
            f"goodput: measured {m['goodput_steps_per_s']:.2f} steps/s; no prediction ({p['reason']})"
        )
    lines.append(f"wrote {target / JSON_NAME}" + (f" and {png}" if png else ""))
    console = make_console(out)
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} steps/s"
