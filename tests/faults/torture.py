"""SIGKILL torture: kill saving jobs at random instants, check every resume exactly.

A script (``python tests/faults/torture.py --trials 1000 --json out.json``, or
``make torture``) and a library for ``tests/faults/test_torture.py``.

Each scenario runs series of trials in one run directory. A *job* (one
process, or a real 2-process gloo group for ``2-rank``, forked from a fork
server that has torch and stalwart imported) restores the newest checkpoint,
checks that what it loaded is exactly the state of the step it reports (every
value is a known function of the step), checks that torn steps
cannot be restored, saves the next step and waits for it, then saves
continuously until it is SIGKILLed at a random instant within its save cycle.
Between jobs this process checks the run as the kill left it: every committed
checkpoint verifies, every checkpoint committed in the durable tier downloads
and verifies, and the next job must restore the newest committed step, never
one that only exists as debris. The phase the kill hit is estimated from the
debris it left (staging, ``.del-`` and remote uncommitted prefixes), from
events.jsonl and from whether the job was inside ``save``.

Scenarios: ``sync`` and ``async`` saves; ``durable``: sync or async saves (by
job) plus an upload thread to a ``file://`` tier, where a quarter of the trials
also lose the local run directory, so that the resume downloads; ``2-rank``:
sync saves of a 2-process gloo group, one rank or both killed (a survivor is
killed a moment later, unless its save already failed cleanly).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

import stalwart
from stalwart.errors import CheckpointNotFoundError
from stalwart.events import read_events
from stalwart.manifest import MANIFEST_NAME
from stalwart.pipeline import verify_checkpoint
from stalwart.storage.durable import DurableTier
from stalwart.storage.local import LocalStorage

SCENARIOS = ("sync", "async", "durable", "2-rank")
PHASES = ("before write", "writing", "commit", "retention", "upload", "idle")
OUTCOMES = ("restored-exact", "fell-back-older", "none", "failure")
KEEP_LAST = 2
SERIES = 50
"""Trials per run directory: debris from earlier trials stays around (it must never be
taken for a checkpoint), but not without bound."""
DEFAULT_MIX = {"sync": 0.3, "async": 0.3, "durable": 0.28, "2-rank": 0.12}
JOB_START_TIMEOUT = 120.0
LOSE_LOCAL = 0.25
"""The share of durable trials that also lose the local run directory after the kill."""


# ------------------------------------------------------------ the known state


def state_for(step: int, rank: int = 0) -> tuple[stalwart.TrainState, torch.nn.Module, dict]:
    """A TrainState whose every value is a function of ``step`` (and ``rank``)."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * 1e-3 + step + i)
    # One replicated value and one that differs between ranks: each rank must get
    # its own back (extra values that differ are saved per rank).
    extra = {"step_copy": step, "tag": f"s{step}", "rank_value": step * 100 + rank}
    return stalwart.TrainState(model=model, extra=extra, rng=False), model, extra


def differences(step: int, model: torch.nn.Module, extra: dict, rank: int = 0) -> list[str]:
    """How ``model`` and ``extra`` differ from the state of ``step`` (empty when equal)."""
    _state, ref_model, ref_extra = state_for(step, rank)
    out = [
        f"rank {rank}: {name} differs from step {step}'s"
        for (name, got), want in zip(
            model.state_dict().items(), ref_model.state_dict().values(), strict=True
        )
        if not torch.equal(got, want)
    ]
    if extra != ref_extra:
        out.append(f"rank {rank}: extra {extra!r} is not step {step}'s {ref_extra!r}")
    return out


# ------------------------------------------------------------------- the job


@dataclass(kw_only=True)
class JobSpec:
    run: str
    scenario: str
    rank: int = 0
    world: int = 1
    store: str = ""
    durable: str | None = None
    torn: list[int] = field(default_factory=list)
    async_save: bool = False
    gap: float = 0.0
    seed: int = 0


def _job(spec: JobSpec, conn: Connection, progress: Any) -> None:
    """Restore, check, save the next step, report; then save until killed.

    ``progress[0]`` is the newest step handed to ``save``, ``progress[1]`` is 1
    while inside ``save``: what the parent reads to tell "idle" from "before write".
    """
    torch.set_num_threads(1)
    # A survivor's failed save is expected here; events.jsonl keeps it, stderr need not.
    logging.getLogger("stalwart").setLevel(logging.CRITICAL)
    try:
        if spec.world > 1:
            store = torch.distributed.FileStore(spec.store, spec.world)
            torch.distributed.init_process_group(
                "gloo", store=store, rank=spec.rank, world_size=spec.world
            )
        manager = stalwart.CheckpointManager(
            spec.run,
            keep_last=KEEP_LAST,
            async_save=spec.async_save,
            durable=spec.durable,
            handle_signals=False,
            save_timeout=60.0,
        )
        report = _resume(manager, spec)
        conn.send(report)
        _save_forever(manager, spec, report["first_step"], progress)
    except BaseException as exc:
        conn.send(
            {"error": f"rank {spec.rank}: {traceback.format_exc()}", "kind": type(exc).__name__}
        )


def _resume(manager: stalwart.CheckpointManager, spec: JobSpec) -> dict[str, Any]:
    state, model, extra = state_for(-1, spec.rank)
    restored = manager.restore(state)
    problems = [] if restored is None else differences(restored, model, extra, spec.rank)
    for step in spec.torn:
        try:
            manager.restore(state_for(-1, spec.rank)[0], step=step)
        except CheckpointNotFoundError:
            continue
        problems.append(f"torn step {step} was restored")
    report: dict[str, Any] = {
        "restored": restored,
        "all_steps": manager.all_steps(),
        "problems": problems,
        "cycle": None,
    }
    step = 1 if restored is None else restored + 1
    if restored is None:
        report["cycle"] = _warm_up(spec)
    else:
        # The next save after a resume must work; in an empty run the first save is
        # left to the loop, so that a kill can tear it.
        t0 = time.perf_counter()
        manager.save(step, state_for(step, spec.rank)[0], force=True)
        manager.wait()
        report["cycle"] = time.perf_counter() - t0
        if manager.is_leader:
            try:
                verify_checkpoint(manager.storage.step_path(step))
            except Exception as exc:
                problems.append(f"the first save after the resume (step {step}) is bad: {exc}")
        step += 1
    report["first_step"] = step
    return report


def _warm_up(spec: JobSpec) -> float:
    """Save once elsewhere and return how long it took.

    The first save of a process pays for lazy imports inside DCP; in an empty run
    the first save is the one to be killed, so it must be an ordinary one.
    """
    # Collective under 2 ranks: one directory for the whole job, left for the series
    # to remove (a rank may still be closing when the other one is done).
    scratch = spec.store + "-warmup"
    with stalwart.CheckpointManager(scratch, keep_last=1, handle_signals=False) as warm:
        warm.save(0, state_for(0, spec.rank)[0], force=True)
        t0 = time.perf_counter()
        warm.save(1, state_for(1, spec.rank)[0], force=True)
        return time.perf_counter() - t0


def _save_forever(
    manager: stalwart.CheckpointManager, spec: JobSpec, step: int, progress: Any
) -> None:
    rng = random.Random(spec.seed)
    while True:
        state = state_for(step, spec.rank)[0]
        progress[0] = step
        progress[1] = 1
        manager.save(step, state, force=True)
        progress[1] = 0
        time.sleep(rng.uniform(0.0, spec.gap))
        step += 1


# ------------------------------------------------------------- the evidence


@dataclass(kw_only=True)
class Trial:
    scenario: str
    series: int
    index: int
    phase: str = "idle"
    kill: str = "sole"
    survivor: str | None = None
    lost_local: bool = False
    kill_after_s: float = 0.0
    attempted: int | None = None
    expected: int | None = None
    torn: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    restored: int | None = None
    outcome: str = "failure"
    problems: list[str] = field(default_factory=list)


def _debris(run: Path) -> dict[str, list[str]]:
    """Hidden step directories (staging, deleting) and what each holds."""
    out: dict[str, list[str]] = {}
    try:
        names = os.listdir(run)
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith(".step_") and (".tmp-" in name or ".del-" in name):
            try:
                out[name] = sorted(os.listdir(run / name))
            except FileNotFoundError:
                continue
    return out


def _remote_uncommitted(tier: DurableTier | None) -> set[tuple[int, int]]:
    if tier is None:
        return set()
    return {(s.step, len(s.objects)) for s in tier.scan() if not s.committed}


def classify(
    run: Path,
    before: dict[str, list[str]],
    remote_before: set[tuple[int, int]],
    tier: DurableTier | None,
    in_save: bool,
) -> str:
    """Estimate which phase of the save cycle a kill hit, from what it left behind."""
    new = {n: files for n, files in _debris(run).items() if n not in before}
    if any(".del-" in n for n in new):
        return "retention"
    staging = [files for n, files in new.items() if ".tmp-" in n]
    if any(f.startswith(MANIFEST_NAME) for files in staging for f in files):
        return "commit"
    if any(staging):
        return "writing"
    if staging:
        return "before write"
    committed = LocalStorage(run).committed_steps()
    events = list(read_events(run))
    saved = {e.get("step") for e in events if e.get("event") == "save"}
    if committed and committed[-1] not in saved:
        return "commit"  # renamed into place, the save not yet logged
    if tier is not None:
        if _remote_uncommitted(tier) - remote_before:
            return "upload"
        uploaded = {e.get("step") for e in events if e.get("event", "").startswith("upload")}
        if any(s in saved and s not in uploaded for s in committed):
            return "upload"
    elif len(committed) > KEEP_LAST:
        return "retention"
    return "before write" if in_save else "idle"


def check_run(run: Path, tier: DurableTier | None, scratch: Path) -> tuple[set[int], list[str]]:
    """Committed steps of both tiers, and what is wrong with any of them."""
    problems = []
    local = set(LocalStorage(run).committed_steps())
    for step in sorted(local):
        try:
            verify_checkpoint(LocalStorage(run).step_path(step))
        except Exception as exc:
            problems.append(f"committed step {step} does not verify: {exc}")
    remote: set[int] = set()
    if tier is not None:
        remote = set(tier.committed_steps())
        for step in sorted(remote):
            dest = scratch / f"download-{step}"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            try:
                tier.download(step, dest)
            except Exception as exc:
                problems.append(f"durable step {step} does not download whole: {exc}")
            finally:
                shutil.rmtree(dest, ignore_errors=True)
    return local | remote, problems


# ------------------------------------------------------------------ a series


class Series:
    """Trials in one run directory: start a job, kill it, check, start the next."""

    def __init__(
        self,
        ctx: mp.context.BaseContext,
        scenario: str,
        root: Path,
        number: int,
        rng: random.Random,
    ) -> None:
        self.ctx, self.scenario, self.number, self.rng = ctx, scenario, number, rng
        self.root = root / f"{scenario}-{number}"
        self.run = self.root / "run"
        self.run.mkdir(parents=True)
        self.tier: DurableTier | None = None
        self.durable: str | None = None
        if scenario == "durable":
            remote = self.root / "durable"
            remote.mkdir()
            self.durable = f"file://{remote.resolve()}"
            self.tier = DurableTier(self.durable)
        self.world = 2 if scenario == "2-rank" else 1
        self.cycle = 0.15
        self._jobs = 0

    def _start(self, torn: list[int]) -> tuple[list[Any], list[Connection], Any]:
        self._jobs += 1
        store = str(self.root / f"store-{self._jobs}")
        # No lock: a job killed while holding it would block every later read here.
        progress = self.ctx.Array("q", [0, 0] * self.world, lock=False)
        procs, conns = [], []
        # Uploads overlap the next save when it is async, and the idle gap when it is sync.
        async_save = self.scenario == "async" or (
            self.scenario == "durable" and self.rng.random() < 0.5
        )
        for rank in range(self.world):
            spec = JobSpec(
                run=str(self.run),
                scenario=self.scenario,
                rank=rank,
                world=self.world,
                store=store,
                durable=self.durable,
                torn=torn,
                async_save=async_save,
                gap=self.cycle / 2,
                seed=self.rng.randrange(2**31),
            )
            mine, theirs = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=_job_rank, args=(spec, theirs, progress, 2 * rank), daemon=True
            )
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(mine)
        return procs, conns, progress

    def _reports(self, procs: list[Any], conns: list[Connection]) -> list[dict[str, Any]]:
        reports = []
        for rank, conn in enumerate(conns):
            if not conn.poll(JOB_START_TIMEOUT):
                reports.append({"error": f"rank {rank} did not report in {JOB_START_TIMEOUT}s"})
                continue
            try:
                reports.append(conn.recv())
            except EOFError:
                reports.append({"error": f"rank {rank} died before reporting"})
        return reports

    def run_trials(self, n: int) -> list[Trial]:
        trials: list[Trial] = []
        pending: Trial | None = None
        for k in range(n + 1):
            debris_before = _debris(self.run)
            remote_before = _remote_uncommitted(self.tier)
            procs, conns, progress = self._start(pending.torn if pending else [])
            reports = self._reports(procs, conns)
            if pending is None and any("error" in r for r in reports):
                pending = Trial(scenario=self.scenario, series=self.number, index=k)
                pending.phase = "before write"  # the job never got to a kill
            if pending is not None:
                trials.append(self._judge(pending, reports))
            cycles = [r["cycle"] for r in reports if r.get("cycle")]
            if cycles:
                self.cycle = 0.7 * self.cycle + 0.3 * max(cycles)
            if k == n or any("error" in r for r in reports):
                # After a failed resume the run is no longer a known state: stop the series.
                self._kill(procs, range(self.world))
                break
            pending = self._kill_at_random(procs, conns, progress, debris_before, remote_before)
            pending.index = k + 1
            first = reports[0].get("first_step", 1)
            if pending.attempted is None or pending.attempted < first - 1:
                pending.attempted = first - 1
        return trials

    def _kill(self, procs: list[Any], ranks: Any) -> None:
        for rank in ranks:
            procs[rank].kill()
        for rank in ranks:
            procs[rank].join(30)

    def _kill_at_random(
        self,
        procs: list[Any],
        conns: list[Connection],
        progress: Any,
        debris_before: dict[str, list[str]],
        remote_before: set[tuple[int, int]],
    ) -> Trial:
        trial = Trial(scenario=self.scenario, series=self.number, index=0)
        trial.kill_after_s = self.rng.uniform(0.0, 2.0 * self.cycle)
        first: list[int] = [0]
        if self.world > 1:
            trial.kill = self.rng.choice(["rank 0", "rank 1", "both"])
            first = {"rank 0": [0], "rank 1": [1], "both": [0, 1]}[trial.kill]
        time.sleep(trial.kill_after_s)
        self._kill(procs, first)
        in_save = any(progress[2 * r + 1] for r in first)
        # The newest save begun when the kill struck (a survivor's later attempts fail).
        trial.attempted = max(progress[2 * r] for r in range(self.world)) or None
        trial.phase = classify(self.run, debris_before, remote_before, self.tier, in_save)
        survivors = [r for r in range(self.world) if r not in first]
        if survivors:
            time.sleep(self.rng.uniform(0.0, self.cycle))
            self._kill(procs, survivors)
            trial.survivor = "killed"
        for rank, (proc, conn) in enumerate(zip(procs, conns, strict=True)):
            try:
                late = conn.recv() if conn.poll(0) else None
            except EOFError:
                late = None  # killed: the pipe just closed
            if late is not None and rank in survivors and late["kind"] == "CheckpointSaveError":
                # A dead peer must fail the survivor's save cleanly, never hang it.
                trial.survivor = "CheckpointSaveError"
            elif late is not None:
                trial.problems.append(f"job failed before the kill: {late.get('error')}")
            elif proc.exitcode != -9:
                trial.problems.append(f"rank {rank} ended with {proc.exitcode}, not SIGKILL")
            conn.close()
        committed, problems = check_run(self.run, self.tier, self.root)
        trial.problems += problems
        trial.expected = max(committed) if committed else None
        trial.committed = sorted(committed)
        trial.torn = sorted(
            {
                int(name[len(".step_") :].split(".")[0])
                for name in _debris(self.run)
                if ".tmp-" in name and name not in debris_before
            }
            | {step for step, _n in _remote_uncommitted(self.tier) - remote_before} - committed
        )
        if self.tier is not None and self.rng.random() < LOSE_LOCAL:
            self._lose_local(trial)
        return trial

    def _lose_local(self, trial: Trial) -> None:
        """The machine is gone: only the durable tier is left to resume from."""
        assert self.tier is not None
        remote = self.tier.committed_steps()
        if not remote:
            return  # nothing durable yet: a lost machine would start over, untested here
        shutil.rmtree(self.run)
        self.run.mkdir()
        trial.lost_local = True
        trial.expected = max(remote)
        trial.committed = []
        trial.torn = [s for s in trial.torn if s > trial.expected]

    def _judge(self, trial: Trial, reports: list[dict[str, Any]]) -> Trial:
        for report in reports:
            if "error" in report:
                trial.problems.append(report["error"])
            trial.problems += report.get("problems", [])
        if not any("error" in r for r in reports):
            trial.restored = reports[0]["restored"]
            if any(r["restored"] != trial.restored for r in reports):
                trial.problems.append(f"ranks restored different steps: {reports}")
            if trial.restored != trial.expected:
                trial.problems.append(
                    f"restored step {trial.restored}, the newest committed one is {trial.expected}"
                )
            # Listed at the resume, before its first save: debris must not show up.
            listed = set(reports[0]["all_steps"]) - {trial.expected}
            if not listed <= set(trial.committed):
                trial.problems.append(
                    f"all_steps lists {sorted(listed - set(trial.committed))}: not committed"
                )
        if trial.problems:
            trial.outcome = "failure"
        elif trial.restored is None:
            trial.outcome = "none"
        elif trial.attempted is not None and trial.restored < trial.attempted:
            trial.outcome = "fell-back-older"
        else:
            trial.outcome = "restored-exact"
        return trial


def _job_rank(spec: JobSpec, conn: Connection, progress: Any, offset: int) -> None:
    _job(spec, conn, _Slice(progress, offset))


class _Slice:
    """Two cells of a shared array, indexed 0 and 1 (one rank's progress)."""

    def __init__(self, array: Any, offset: int) -> None:
        self.array, self.offset = array, offset

    def __getitem__(self, i: int) -> int:
        return int(self.array[self.offset + i])

    def __setitem__(self, i: int, value: int) -> None:
        self.array[self.offset + i] = value


# ------------------------------------------------------------------ the whole


@dataclass(kw_only=True)
class Result:
    trials: list[Trial]
    seconds: float

    @property
    def failures(self) -> list[Trial]:
        return [t for t in self.trials if t.outcome == "failure"]

    def table(self) -> list[dict[str, Any]]:
        """One row per scenario and phase hit: trials and outcome counts."""
        rows = []
        for scenario in SCENARIOS:
            for phase in PHASES:
                hit = [t for t in self.trials if t.scenario == scenario and t.phase == phase]
                if not hit:
                    continue
                counts = Counter(t.outcome for t in hit)
                rows.append(
                    {"scenario": scenario, "phase": phase, "trials": len(hit)}
                    | {o: counts.get(o, 0) for o in OUTCOMES}
                )
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "trials": len(self.trials),
            "seconds": round(self.seconds, 1),
            "failures": len(self.failures),
            "table": self.table(),
            "by_scenario": {
                s: dict(Counter(t.outcome for t in self.trials if t.scenario == s))
                for s in SCENARIOS
            },
            "resumed_from_durable_only": sum(t.lost_local for t in self.trials),
            "2-rank_kills": dict(
                Counter(f"{t.kill}, survivor {t.survivor}" for t in self.trials if t.kill != "sole")
            ),
            "detail": [asdict(t) for t in self.trials],
        }


def fork_server() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "stalwart"])
    return ctx


def split(trials: int, mix: dict[str, float]) -> dict[str, int]:
    """Trials per scenario in proportion to ``mix``, summing to ``trials``."""
    total = sum(mix.values())
    counts = {s: int(trials * w / total) for s, w in mix.items()}
    for s in sorted(mix, key=mix.__getitem__, reverse=True)[: trials - sum(counts.values())]:
        counts[s] += 1
    return counts


def run_torture(
    trials: int,
    root: Path,
    *,
    mix: dict[str, float] | None = None,
    seed: int = 0,
    series: int = SERIES,
    on_trial: Callable[[Trial], None] | None = None,
) -> Result:
    """Run ``trials`` kill trials split over the scenarios of ``mix`` under ``root``."""
    ctx = fork_server()
    rng = random.Random(seed)
    t0 = time.perf_counter()
    done: list[Trial] = []
    for scenario, n in split(trials, mix or DEFAULT_MIX).items():
        number = 0
        while n > 0:
            batch = min(n, series)
            got = Series(ctx, scenario, root, number, rng).run_trials(batch)
            for trial in got:
                if on_trial is not None:
                    on_trial(trial)
            done += got
            n -= batch
            number += 1
    return Result(trials=done, seconds=time.perf_counter() - t0)


def print_summary(result: Result) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"stalwart SIGKILL torture: {len(result.trials)} trials")
    for name in ("scenario", "phase hit", "trials", *OUTCOMES):
        table.add_column(name, justify="left" if name in ("scenario", "phase hit") else "right")
    for row in result.table():
        table.add_row(
            row["scenario"], row["phase"], str(row["trials"]), *(str(row[o]) for o in OUTCOMES)
        )
    console = Console(width=None if sys.stdout.isatty() else 110)
    console.print(table)
    for trial in result.failures[:20]:
        console.print(
            f"FAILED {trial.scenario} #{trial.series}.{trial.index} ({trial.phase}): "
            + "; ".join(trial.problems)[:3000],
            markup=False,
            style="red",
        )
    summary = result.to_json()
    console.print(
        f"{len(result.trials)} trials, {len(result.failures)} failures, {result.seconds:.0f} s; "
        f"{summary['resumed_from_durable_only']} resumed from the durable tier alone; "
        f"2-rank kills: {summary['2-rank_kills']}",
        markup=False,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="keep the runs here")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated subset of " + ", ".join(SCENARIOS),
    )
    args = parser.parse_args(argv)
    chosen = args.scenarios.split(",")
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    mix = {s: w for s, w in DEFAULT_MIX.items() if s in chosen}
    root = Path(tempfile.mkdtemp(prefix="stalwart-torture-")) if args.dir is None else args.dir
    root.mkdir(parents=True, exist_ok=True)
    try:
        result = run_torture(
            args.trials,
            root,
            mix=mix,
            seed=args.seed,
            on_trial=lambda t: print(
                f"{t.scenario:8} {t.series}.{t.index:<3} {t.phase:13} {t.outcome}", flush=True
            ),
        )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    print_summary(result)
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
