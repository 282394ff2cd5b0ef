"""A restart's wait: a new interpreter imports, builds its model, then restores.

    .venv/bin/python benchmarks/restart.py --state-bytes 256M [--repeats 3] [--workdir DIR]

The restores in ``measure.py`` run in a process that imported torch and
stalwart long before. After a failure, every rank starts a new interpreter:
it imports torch and its checkpoint library, builds the model and optimizer,
and only then restores. This times that wait, from the interpreter's start
until the state is restored, for stalwart (``CheckpointManager(run)`` and
``restore(state)`` of the newest checkpoint, verified) and for
``torch.load(weights_only=True)`` + ``load_state_dict`` of the same state, with
the checkpoint's pages dropped from the cache (a new host) and cached (the same
host). A raw read of the checkpoint's bytes, in such a process too, is the
floor. The model's construction is timed but left out of the wait: it is the
user's own, the same whatever restores into it. ``run.py`` runs it as the report's last part; its JSON is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
METHODS = ("raw_read", "stalwart", "torch_load")


def _child(method: str, workdir: Path, state_bytes: int, cold: bool, threads: int) -> None:
    """One restart, in this fresh interpreter; prints its timings as JSON."""
    started = time.monotonic()
    times: dict[str, float] = {}
    if method != "raw_read":
        import torch

        times["import_torch_s"] = time.monotonic() - started
        torch.set_num_threads(threads)
        if method == "stalwart":
            mark = time.monotonic()
            import torch.distributed.checkpoint

            times["import_dcp_s"] = time.monotonic() - mark
            mark = time.monotonic()
            import stalwart

            times["import_stalwart_s"] = time.monotonic() - mark
    times["imports_s"] = time.monotonic() - started
    sys.path.insert(0, str(HERE))
    import measure  # imports stalwart: after the imports above were timed

    target = workdir / ("run" if method != "torch_load" else "state.pt")
    if method != "raw_read":
        model, opt, state = measure._fresh_target(state_bytes)
    dropped = measure.drop_page_cache(target) if cold else False
    os.sync()
    t0 = time.monotonic()
    if method == "raw_read":
        measure.read_tree(target)
    elif method == "stalwart":
        manager = stalwart.CheckpointManager(target, keep_last=None, handle_signals=False)
        step = manager.restore(state)
        assert step == 1, step
    else:
        sd = torch.load(target, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
    t1 = time.monotonic()
    if method != "raw_read":
        expected = measure.build_state(state_bytes)[0]
        assert measure.same_params(model, expected), f"{method} restored other values"
    times.update(restore_s=t1 - t0, build_s=t0 - started - times["imports_s"], started_at=started)
    print(json.dumps({"times": times, "cold_dropped": dropped}))


def _prepare(workdir: Path, state_bytes: int) -> None:
    """The checkpoint every restart restores: one stalwart step, and the same state torch.saved."""
    sys.path.insert(0, str(HERE))
    import measure
    import torch

    import stalwart

    model, opt, state = measure.build_state(state_bytes)
    with stalwart.CheckpointManager(workdir / "run", keep_last=None, handle_signals=False) as m:
        m.save(1, state, force=True)
    with open(workdir / "state.pt", "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    print(
        json.dumps(
            {"bytes": measure.state_nbytes(model, opt), **measure.describe_state(model, opt)}
        )
    )


def _spawn(args: list[str], timeout: float) -> tuple[dict[str, Any], float]:
    """Run this script with ``args`` in a new interpreter: its JSON, and when it was started."""
    spawned = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-5:])
        raise RuntimeError(f"{' '.join(args[:2])} exited with {proc.returncode}: {tail}")
    return json.loads(proc.stdout.splitlines()[-1]), spawned


def measure_restarts(
    workdir: Path, state_bytes: int, repeats: int, threads: int = 1, timeout: float = 300.0
) -> dict[str, Any]:
    """Best of ``repeats`` rounds of every method, cold then warm, in turn; see the module doc."""
    workdir.mkdir(parents=True, exist_ok=True)
    state, _ = _spawn(["prepare", str(workdir), str(state_bytes)], timeout)
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        m: {"cold": [], "warm": []} for m in METHODS
    }
    for i in range(repeats):
        order = METHODS[i % len(METHODS) :] + METHODS[: i % len(METHODS)]
        for cache in ("cold", "warm"):
            for method in order:
                child = ["child", method, str(workdir), str(state_bytes), cache, str(threads)]
                out, spawned = _spawn(child, timeout)
                times = out["times"]
                # The wait: the interpreter's start, the imports and the restore; not the
                # model's construction (the user's own, the same for every method).
                times["startup_s"] = times.pop("started_at") - spawned
                times["restart_s"] = times["startup_s"] + times["imports_s"] + times["restore_s"]
                samples[method][cache].append({**times, "cold_dropped": out["cold_dropped"]})
    result: dict[str, Any] = {"state": state, "repeats": repeats, "methods": {}}
    for method, caches in samples.items():
        entry: dict[str, Any] = {}
        for cache, runs in caches.items():
            keys = [k for k in runs[0] if k.endswith("_s")]
            entry[cache] = {k: min(r[k] for r in runs) for k in keys}
            entry[cache]["samples"] = runs
        entry["cold_dropped"] = all(r["cold_dropped"] for r in caches["cold"])
        result["methods"][method] = entry
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        method, workdir, nbytes, cache, threads = argv[1:]
        _child(method, Path(workdir), int(nbytes), cache == "cold", int(threads))
        return 0
    if argv and argv[0] == "prepare":
        _prepare(Path(argv[1]), int(argv[2]))
        return 0
    sys.path.insert(0, str(HERE))
    from run import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-bytes", type=parse_size, default=parse_size("256M"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    import shutil
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="stalwart-restart-", dir=args.workdir))
    try:
        print(json.dumps(measure_restarts(workdir, args.state_bytes, args.repeats, args.threads)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
