"""Benchmark stalwart's checkpointing against its peers and the machine's physical limits.

    .venv/bin/python benchmarks/run.py            # full: ~64 MiB, 256 MiB, 1 GiB states
    .venv/bin/python benchmarks/run.py --quick    # ~16 MiB and ~64 MiB, under two minutes

Writes ``<out>/<name>.md``, ``<name>.json`` and ``<name>.png`` (the plot needs
matplotlib and is skipped with a message without it) and prints the markdown.
Then runs ``durable.py`` (the durable tier against a local S3 server), which
writes ``<out>/durable.md`` and ``durable.json`` (``durable-<name>`` for any
other name than ``full``); its ratio table, or why it did not run, ends the
markdown. See docs/benchmarks.md for what each column means.

Every measurement runs in its own process, forked from a server that has only
imported torch and stalwart (multiprocessing's ``forkserver``), so one method's
peak RSS never includes another's memory and no process pays torch's import.
Methods run one after another, never concurrently: the numbers are meant to be
read as ratios between rows of one run on one machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import restart  # noqa: E402
import train_stats  # noqa: E402

# The parent never imports torch (the job processes do, once, in the forkserver):
# method names are listed here and checked against measure.py by the job itself.
SAVE_METHODS = (
    "stalwart_sync",
    "stalwart_async",
    "torch_save",
    "dcp_save",
    "dcp_async_thread",
    "dcp_async_process",
)
TRAIN_VARIANTS = ("stalwart_sync", "stalwart_async", "torch_save")
# The physical floor of an async save in the loop (memcpy + a raw-write thread), and the
# same with every byte hashed as it is written; full mode only.
TRAIN_REFERENCES = ("floor_async", "floor_async_xxh3")

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """``64M``, ``64MB``, ``64MiB``, ``1G`` or a byte count; binary units."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 64M, 256MB or 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="small sizes, fewer repeats: under two minutes"
    )
    p.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        help="comma-separated state sizes (default 64M,256M,1G; quick: 16M,64M)",
    )
    p.add_argument("--repeats", type=int, help="timed rounds per size (default 5; quick: 2)")
    p.add_argument(
        "--train-size",
        type=parse_size,
        default=None,
        help="state size of the training-loop model (default 64M)",
    )
    p.add_argument(
        "--every",
        type=lambda s: [int(x) for x in s.split(",")],
        help="checkpoint intervals (steps) of the training loop, comma-separated "
        "(default 5,20; quick: 5)",
    )
    p.add_argument(
        "--segment-saves",
        type=int,
        help="checkpoints per timed segment of the training loop (default 4; quick: 3)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="pairs of without/with segments per process (default 4; quick: 2)",
    )
    p.add_argument(
        "--passes",
        type=int,
        help="processes per training-loop variant, at different times of the run, their "
        "pairs pooled (default 2; quick: 1)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in every measurement process (default 1: on a shared "
        "host, torch's multi-threaded copies and matmuls stall whenever a neighbour takes a "
        "core, and a training step leaves no core to a background save; 0 keeps torch's default)",
    )
    p.add_argument("--no-train", action="store_true", help="skip the training-loop overhead part")
    p.add_argument(
        "--restart-size",
        type=parse_size,
        default=None,
        help="state size of the restart part: new interpreters that import and restore "
        "(default 256M; quick: 16M)",
    )
    p.add_argument(
        "--restart-repeats",
        type=int,
        help="new processes per method and cache state in the restart part (default 3; quick: 1)",
    )
    p.add_argument(
        "--no-durable", action="store_true", help="skip the durable tier (benchmarks/durable.py)"
    )
    p.add_argument(
        "--durable-timeout",
        type=float,
        help="seconds for the whole durable-tier benchmark (default 1200; quick: 180)",
    )
    p.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    p.add_argument("--name", help="output file stem (default: quick or full)")
    p.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS.json",
        help="measure nothing: write the targets, the markdown and the plot again from the "
        "JSON of an earlier run (after a change to the report), next to it",
    )
    p.add_argument("--workdir", help="where checkpoints are written (default: the system temp dir)")
    p.add_argument(
        "--timeout", type=float, help="seconds per measurement process (default 600; quick: 60)"
    )
    args = p.parse_args(argv)
    args.sizes = args.sizes or [
        parse_size(s) for s in (("16M", "64M") if args.quick else ("64M", "256M", "1G"))
    ]
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.train_size = args.train_size or parse_size("64M")
    args.restart_size = args.restart_size or parse_size("16M" if args.quick else "256M")
    args.restart_repeats = args.restart_repeats or (1 if args.quick else 3)
    args.every = args.every or ([5] if args.quick else [5, 20])
    args.segment_saves = args.segment_saves or (3 if args.quick else 4)
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.passes = args.passes or (1 if args.quick else 2)
    args.name = args.name or ("quick" if args.quick else "full")
    args.timeout = args.timeout or (60.0 if args.quick else 600.0)
    args.durable_timeout = args.durable_timeout or (180.0 if args.quick else 1200.0)
    if min(args.repeats, args.rounds, args.passes, args.segment_saves, *args.every) < 1:
        p.error("--repeats, --every, --segment-saves, --rounds and --passes must be at least 1")
    return args


def progress(label: str, seconds: float, status: str) -> None:
    """One finished part of the run, on stderr."""
    print(f"  {label:<40} {seconds:6.1f}s  {status}", file=sys.stderr, flush=True)


class Runner:
    """Runs measurement jobs one at a time, each in a fresh process from a torch-preloaded forkserver."""

    def __init__(self, workdir: Path, timeout: float, threads: int) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        # The server imports these once; every job process is a fork of it. "__main__"
        # (this script) comes first: importing it puts benchmarks/ on the server's
        # sys.path, which python 3.11's forkserver does not pass on by itself.
        self.ctx.set_forkserver_preload(
            ["__main__", "torch", "torch.distributed.checkpoint", "stalwart", "measure"]
        )
        self.workdir = workdir
        self.timeout = timeout
        self.threads = threads
        self.count = 0

    def run(self, job: str, label: str, **kwargs: Any) -> dict[str, Any]:
        self.count += 1
        result_path = self.workdir / f"job{self.count}.json"
        log_path = self.workdir / f"job{self.count}.log"
        kwargs.setdefault("workdir", str(self.workdir))
        t0 = time.perf_counter()
        proc = self.ctx.Process(
            target=_run_child,
            args=(job, kwargs, str(result_path), str(log_path), self.threads),
        )
        proc.start()
        proc.join(self.timeout)
        if proc.is_alive():
            proc.kill()  # our own child, by its pid
            proc.join()
            outcome: dict[str, Any] = {"ok": False, "error": f"timed out after {self.timeout:.0f}s"}
        elif result_path.exists():
            outcome = json.loads(result_path.read_text(encoding="utf-8"))
        else:
            outcome = {"ok": False, "error": f"process exited with code {proc.exitcode}"}
        elapsed = time.perf_counter() - t0
        status = "ok" if outcome["ok"] else f"FAILED: {outcome['error']}"
        progress(label, elapsed, status)
        if not outcome["ok"]:
            log = (
                log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
            )
            print("\n".join("    | " + line for line in log.splitlines()[-15:]), file=sys.stderr)
            return {"error": outcome["error"]}
        return outcome["result"]


def merge(timing: dict[str, Any], isolated: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """One size's entry: times from the interleaved job, peak RSS from the isolated ones."""
    if "error" in timing:
        return {
            "bytes": nbytes,
            "references": {"error": timing["error"]},
            "methods": {m: {"error": timing["error"]} for m in SAVE_METHODS},
        }
    references = {**timing["references"], "state": timing["state"]}
    methods: dict[str, Any] = {}
    for method in SAVE_METHODS:
        iso = isolated[method]
        timed = timing["methods"].get(method)
        if "error" in iso:
            methods[method] = {"error": iso["error"]}
            continue
        if timed is None:  # timed in its own process (dcp_async_process)
            methods[method] = {k: v for k, v in iso.items() if k != "restore_peak_rss_mib"}
            continue
        m = dict(timed)
        m["peak_rss_mib"] = iso["peak_rss_mib"]
        m["isolated"] = iso["isolated"]
        m["notes"] = iso.get("notes", [])
        if "restore" in m:
            m["restore"] = {**m["restore"], "restore_peak_rss_mib": iso["restore_peak_rss_mib"]}
        methods[method] = m
    return {"bytes": timing["bytes"], "references": references, "methods": methods}


def _run_child(
    job: str, kwargs: dict[str, Any], result_path: str, log_path: str, threads: int
) -> None:
    import measure  # in the job process: preloaded by the forkserver

    measure.run_child(job, kwargs, result_path, log_path, threads=threads)


def lightning_status() -> str:
    import importlib.util

    for name in ("lightning", "pytorch_lightning"):
        if importlib.util.find_spec(name) is not None:
            return f"installed ({name}) but not benchmarked yet"
    return "not installed"


def render(path: Path) -> int:
    """Write the targets, the markdown and the plot of an earlier run again from its JSON."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"cannot read the results {path}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(results, dict) or "meta" not in results or "sizes" not in results:
        print(f"{path} is not the JSON of a benchmark run (no meta and sizes)", file=sys.stderr)
        return 2
    results.pop("targets", None)
    report.analyze(results)
    durable_md = ""
    durable = results.get("durable")
    if durable and (path.parent / f"{durable['name']}.json").exists():
        saved = json.loads((path.parent / f"{durable['name']}.json").read_text(encoding="utf-8"))
        durable_md = durable_section(saved, durable["name"])
    md = report.markdown(results) + durable_md
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    path.with_suffix(".md").write_text(md, encoding="utf-8")
    plot_note = report.plot(results, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.md')}, {path}; {plot_note}", file=sys.stderr)
    return 0


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree on PYTHONPATH
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        return render(args.render)
    started = time.perf_counter()
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="stalwart-bench-", dir=args.workdir))
    meta = {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "cwd": os.getcwd(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": _version("torch"),
        "stalwart": _version("stalwart"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mode": "quick" if args.quick else "full",
        "repeats": args.repeats,
        "workdir": str(workdir),
        "filesystem": filesystem_of(workdir),
        "lightning": lightning_status(),
        "loadavg_start": round(os.getloadavg()[0], 2),
    }
    results: dict[str, Any] = {"meta": meta, "sizes": [], "training": None}
    runner = Runner(workdir, args.timeout, args.threads)
    try:
        for nbytes in args.sizes:
            label = size_label(nbytes)
            print(f"state ~{label}:", file=sys.stderr, flush=True)
            entry: dict[str, Any] = {"label": label, "requested_bytes": nbytes}
            timing = runner.run(
                "timing",
                "all methods and references, interleaved",
                state_bytes=nbytes,
                repeats=args.repeats,
            )
            isolated = {
                method: runner.run(
                    "isolated",
                    f"{method}, in its own process",
                    method=method,
                    state_bytes=nbytes,
                    repeats=args.repeats,
                )
                for method in SAVE_METHODS
            }
            entry.update(merge(timing, isolated, nbytes))
            entry["references"]["torch_threads"] = timing.get("torch_threads")
            meta.setdefault("torch_threads", timing.get("torch_threads"))
            results["sizes"].append(entry)
        if not args.no_train:
            print(
                f"training loop (~{size_label(args.train_size)} state):",
                file=sys.stderr,
                flush=True,
            )
            runs = []
            variants = TRAIN_VARIANTS + (() if args.quick else TRAIN_REFERENCES)
            for every in args.every:
                # Each variant runs in --passes processes, the variants in turn and
                # in reverse order on the next pass: a host that changes over the
                # run weighs on every variant alike. Their samples are pooled.
                done: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
                for n in range(args.passes):
                    for variant in variants if n % 2 == 0 else variants[::-1]:
                        done[variant].append(
                            runner.run(
                                "train",
                                f"{variant}, checkpoint every {every} steps "
                                f"(pass {n + 1} of {args.passes})",
                                variant=variant,
                                state_bytes=args.train_size,
                                every=every,
                                segment_steps=args.segment_saves * every,
                                rounds=args.rounds,
                            )
                        )
                for variant in variants:
                    runs.append(
                        {
                            "variant": variant,
                            "every": every,
                            **train_stats.pooled_train_runs(done[variant]),
                        }
                    )
            # The target against the physical floor: stalwart async and the floors in one
            # process, their segments taking turns (measure.job_train_side_by_side).
            floor_every = (
                report.TRAIN_FLOOR_EVERY
                if report.TRAIN_FLOOR_EVERY in args.every
                else args.every[0]
            )
            side_by_side = runner.run(
                "train_side_by_side",
                f"stalwart async and the floors side by side, checkpoint every {floor_every} steps",
                state_bytes=args.train_size,
                every=floor_every,
                segment_steps=args.segment_saves * floor_every,
                rounds=args.rounds * args.passes,
            )
            results["training"] = {
                "requested_bytes": args.train_size,
                "threads": args.threads,
                "runs": runs,
                "side_by_side": side_by_side,
            }
        print("exact-resume certificate:", file=sys.stderr, flush=True)
        results["certificate"] = runner.run("certificate", "fingerprint cost per step")
        print("cost per call apart from the bytes:", file=sys.stderr, flush=True)
        results["per_call"] = runner.run(
            "per_call", "the same tensors holding almost no bytes", repeats=args.repeats
        )
        print(f"a restart (~{size_label(args.restart_size)} state):", file=sys.stderr, flush=True)
        results["restart"] = run_restarts(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    durable_md = ""
    if not args.no_durable:
        durable_name = "durable" if args.name == "full" else f"durable-{args.name}"
        durable_results = run_durable(args, out_dir, durable_name)
        results["durable"] = {
            "name": durable_name,
            "error": durable_results.get("error"),
            "elapsed_s": durable_results.get("meta", {}).get("elapsed_s"),
        }
        durable_md = durable_section(durable_results, durable_name)
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    meta["loadavg_end"] = round(os.getloadavg()[0], 2)

    report.analyze(results)
    md = report.markdown(results) + durable_md
    stem = out_dir / args.name
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(md, encoding="utf-8")
    plot_note = report.plot(results, stem.with_suffix(".png"))
    print(md)
    print(f"wrote {stem}.md, {stem}.json; {plot_note}", file=sys.stderr)
    return 0


def run_restarts(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """``restart.py``'s new interpreters (they import torch; this process does not)."""
    t0 = time.perf_counter()
    try:
        result = restart.measure_restarts(
            workdir / "restart",
            args.restart_size,
            args.restart_repeats,
            threads=args.threads,
            timeout=args.timeout,
        )
        status = "ok"
    except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
        status = f"FAILED: {result['error']}"
    progress("new interpreters, cold and warm", time.perf_counter() - t0, status)
    return result


def run_durable(args: argparse.Namespace, out_dir: Path, name: str) -> dict[str, Any]:
    """Run durable.py in a process of its own; its results, or ``{"error": why}``.

    A process of its own keeps the S3 server's clients and their threads out of
    this one, and lets a hung transfer be stopped: SIGTERM first, so the
    benchmark stops its server and deletes the server's data on the way out.
    """
    print("durable tier (benchmarks/durable.py):", file=sys.stderr, flush=True)
    command = [sys.executable, str(HERE / "durable.py"), "--out", str(out_dir), "--name", name]
    command += ["--quick"] if args.quick else []
    command += ["--workdir", args.workdir] if args.workdir else []
    result_path = out_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)  # an earlier run's file must not pass for this run's
    # stdout is the markdown, which this run prints in its own report; progress goes to stderr.
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        proc.wait(args.durable_timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # our own child, by its pid
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return {"error": f"durable.py did not finish within {args.durable_timeout:.0f} s"}
    if result_path.exists():
        results: dict[str, Any] = json.loads(result_path.read_text(encoding="utf-8"))
        return results
    return {"error": f"durable.py exited with code {proc.returncode} and wrote no results"}


def durable_section(results: dict[str, Any], name: str) -> str:
    """The durable tier's ratio table for this run's markdown, or why it is missing."""
    import durable  # its top level imports no torch

    table = durable.summary_markdown(results)
    if "meta" in results and not results.get("error"):
        table += f"\nAll durable-tier tables: `{name}.md` next to this file.\n"
    return table


def filesystem_of(path: Path) -> str:
    """The mount (device, type) holding ``path``, from /proc/mounts."""
    try:
        best = ("", "?", "?")
        real = os.path.realpath(path)
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best[0]
                ):
                    best = (mnt, dev, fstype)
        return f"{best[2]} on {best[1]} (mounted at {best[0]})"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
