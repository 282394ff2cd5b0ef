"""Measurements that run inside one fresh benchmark process each (see ``run.py``).

Every public ``job_*`` function builds its own training state, measures one
method (or the physical references) and returns plain JSON data. ``run.py``
calls them in processes forked from a clean server that has only imported
torch, so the peak-RSS numbers of one method never include another's memory.

Times are seconds from ``time.perf_counter``; sizes are bytes; RSS is MiB.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import stalwart
from stalwart.pipeline import stage_state_dict

MiB = 2**20
_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"
_IO_CHUNK = 8 * MiB  # what stalwart's hash_file reads per call; the raw read uses the same
_WRITE_CHUNK = 64 * MiB

# --------------------------------------------------------------------- memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


class PeakRSS:
    """Peak resident memory above the RSS at ``__enter__``, in MiB (VmHWM after a reset)."""

    def __enter__(self) -> PeakRSS:
        self.resettable = reset_peak_rss()
        self.base_kib = _status_kib("VmRSS")
        self.delta_mib = math.nan
        return self

    def __exit__(self, *exc: object) -> None:
        peak = _status_kib("VmHWM")
        # Without a reset the high-water mark may predate this block; report it anyway.
        self.delta_mib = max(peak - self.base_kib, 0) / 1024


# ---------------------------------------------------------------------- state


class Block(nn.Module):
    """A transformer-like MLP block: pre-norm, 4x expansion, residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


N_BLOCKS = 8


def width_for(state_bytes: int, blocks: int = N_BLOCKS) -> int:
    """Width whose stack of ``blocks`` has ``state_bytes`` of fp32 params + AdamW moments."""
    # params per block: 8 w^2 + 7 w; three fp32 copies (param, exp_avg, exp_avg_sq).
    per_block = state_bytes / blocks / 12
    width = (-7 + math.sqrt(49 + 32 * per_block)) / 16
    return max(16, int(round(width / 16)) * 16)


def build_model(state_bytes: int, *, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    width = width_for(state_bytes)
    return nn.Sequential(*[Block(width) for _ in range(N_BLOCKS)])


def build_state(
    state_bytes: int, *, seed: int = 0
) -> tuple[nn.Module, torch.optim.Optimizer, stalwart.TrainState]:
    """Model + ``torch.optim.AdamW`` after one real step on random gradients."""
    model = build_model(state_bytes, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, stalwart.TrainState(model=model, optimizer=opt)


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(tensors_of({"model": model.state_dict(), "optimizer": opt.state_dict()}))


def state_nbytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(model, opt))


def describe_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    tensors = state_tensors(model, opt)
    return {
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "tensors": len(tensors),
        "params": sum(p.numel() for p in model.parameters()),
        "width": model[0].norm.normalized_shape[0],
        "blocks": N_BLOCKS,
    }


# -------------------------------------------------------------------- helpers


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, then its parent (a careful user's finish)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))
    fsync_path(root.parent)


def drop_page_cache(root: Path) -> bool:
    """Evict the (clean, fsynced) pages of every file under ``root``; True if the call worked."""
    ok = True
    paths = [root] if root.is_file() else [Path(d) / n for d, _, fs in os.walk(root) for n in fs]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def tree_bytes(root: Path) -> int:
    if root.is_file():
        return root.stat().st_size
    return sum((Path(d) / n).stat().st_size for d, _, fs in os.walk(root) for n in fs)


def last_event(run_dir: Path, kind: str) -> dict[str, Any]:
    lines = (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    for line in reversed(lines):
        event = json.loads(line)
        if event.get("event") == kind:
            return event
    raise RuntimeError(f"no {kind!r} event in {run_dir / 'events.jsonl'}")


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        # DCP warns when it runs without a process group; that is the single-process intent.
        warnings.filterwarnings("ignore", message=_NO_DIST)
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


# ----------------------------------------------------------------- references


def job_references(state_bytes: int, repeats: int, workdir: str) -> dict[str, Any]:
    """Physical floors on the same bytes: memcpy, hashing, raw write+fsync, raw read."""
    model, opt, _state = build_state(state_bytes)
    tensors = state_tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {"bytes": nbytes, "state": describe_state(model, opt)}

    # memcpy into preallocated (already faulted-in) buffers: the floor of a staged stall.
    buffers = [torch.empty_like(t) for t in tensors]
    for b, t in zip(buffers, tensors, strict=True):
        b.copy_(t)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors, strict=True):
            b.copy_(t)
        times.append(time.perf_counter() - t0)
    out["memcpy_s"] = median(times)
    del buffers

    # clone into fresh allocations: what a copy costs when the pages must be faulted in.
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        clones = [t.clone() for t in tensors]
        times.append(time.perf_counter() - t0)
        del clones
    out["clone_s"] = median(times)

    flat = torch.empty(nbytes, dtype=torch.uint8)
    flat.random_(0, 256)
    view = memoryview(flat.numpy())

    import xxhash  # stalwart's checksum

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        xxhash.xxh3_128(view).hexdigest()
        times.append(time.perf_counter() - t0)
    out["xxh3_s"] = median(times)

    root = Path(tempfile.mkdtemp(prefix="raw-", dir=workdir))
    write_times, cold_times, warm_times = [], [], []
    cold_ok = True
    readbuf = bytearray(_IO_CHUNK)
    try:
        for i in range(repeats):
            # A new file each time: a checkpoint never overwrites blocks in place, and
            # allocating fresh blocks is part of the cost on ext4/xfs.
            path = root / f"raw{i}.bin"
            t0 = time.perf_counter()
            with open(path, "wb", buffering=0) as f:
                for off in range(0, nbytes, _WRITE_CHUNK):
                    f.write(view[off : off + _WRITE_CHUNK])
                os.fsync(f.fileno())
            fsync_path(root)
            write_times.append(time.perf_counter() - t0)
            for cold in (True, False):
                if cold:
                    cold_ok = drop_page_cache(path) and cold_ok
                t0 = time.perf_counter()
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(readbuf):
                        pass
                (cold_times if cold else warm_times).append(time.perf_counter() - t0)
            path.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out.update(
        raw_write_s=median(write_times),
        raw_read_cold_s=median(cold_times),
        raw_read_warm_s=median(warm_times),
        page_cache_drop=cold_ok,
    )
    return out


# ---------------------------------------------------------------------- saves


def _stalwart_breakdown(
    model: nn.Module, opt: torch.optim.Optimizer, state: stalwart.TrainState, repeats: int
) -> dict[str, float]:
    """Where stalwart's async stall goes: torch's get_state_dict, the rest of
    TrainState.state_dict (RNG capture, plain-data check), and the staging copy."""
    get_sd, train_sd, stage = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        get_state_dict(model, opt)
        t1 = time.perf_counter()
        sd = state.state_dict()
        t2 = time.perf_counter()
        staged = stage_state_dict(sd)
        t3 = time.perf_counter()
        del staged, sd
        get_sd.append(t1 - t0)
        train_sd.append(t2 - t1)
        stage.append(t3 - t2)
    return {
        "get_state_dict_s": median(get_sd),
        "trainstate_state_dict_s": median(train_sd),
        "stage_copy_s": median(stage),
    }


def _save_stalwart(
    run_dir: Path, state: stalwart.TrainState, repeats: int, *, async_save: bool
) -> dict[str, Any]:
    stalls, e2e, rss, events = [], [], [], []
    # keep_last=None: retention deletes are a policy cost, measured in the training loop.
    with stalwart.CheckpointManager(
        run_dir, async_save=async_save, keep_last=None, handle_signals=False
    ) as mgr:
        mgr.save(0, state, force=True)  # warm-up: lazy imports and first-call costs
        mgr.wait()
        for i in range(1, repeats + 1):
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                mgr.save(i, state, force=True)
                t1 = time.perf_counter()
                mgr.wait()
                t2 = time.perf_counter()
            stalls.append(t1 - t0)
            e2e.append(t2 - t0)
            rss.append(peak.delta_mib)
            events.append(last_event(run_dir, "save"))
        last = mgr.storage.step_path(repeats)
    result: dict[str, Any] = {
        "stall_s": median(stalls),
        "e2e_s": median(e2e),
        "peak_rss_mib": max(rss),
        "disk_bytes": tree_bytes(last),
        "events": {
            k: median([float(e[k]) for e in events])
            for k in ("stall_s", "stage_s", "write_s", "checksum_s", "commit_s", "total_s")
        },
    }
    if not async_save:
        # The sync stall is the whole save; the event's numbers are the authority.
        result["stall_wall_s"] = result["stall_s"]
        result["stall_s"] = result["events"]["stall_s"]
        result["e2e_s"] = result["events"]["total_s"]
    return result


def _save_torch(root: Path, model: nn.Module, opt: torch.optim.Optimizer, repeats: int) -> Any:
    def save_once(i: int) -> Path:
        final = root / f"ckpt_{i}.pt"
        tmp = root / f".ckpt_{i}.pt.tmp"
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        with open(tmp, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(root)
        return final

    return _time_blocking_saves(save_once, root, repeats)


def _save_dcp(root: Path, model: nn.Module, opt: torch.optim.Optimizer, repeats: int) -> Any:
    def save_once(i: int) -> Path:
        path = root / f"step_{i}"
        model_sd, optim_sd = get_state_dict(model, opt)
        with quiet_dcp():
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path, no_dist=True)
        fsync_tree(path)  # FileSystemWriter fsyncs its files; the directories are ours to sync
        return path

    return _time_blocking_saves(save_once, root, repeats)


def _time_blocking_saves(save_once: Callable[[int], Path], root: Path, repeats: int) -> Any:
    save_once(0)  # warm-up
    times, rss = [], []
    path = root
    for i in range(1, repeats + 1):
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            path = save_once(i)
            times.append(time.perf_counter() - t0)
        rss.append(peak.delta_mib)
    return {
        "stall_s": median(times),
        "e2e_s": median(times),
        "peak_rss_mib": max(rss),
        "disk_bytes": tree_bytes(path),
    }, path


def _child_processes_hwm_kib() -> int:
    import multiprocessing

    total = 0
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{child.pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
    return total


def _save_dcp_async(
    root: Path, model: nn.Module, opt: torch.optim.Optimizer, repeats: int, *, process: bool
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    notes = []
    if process:
        # DCP's process-based executor reads the rank and broadcasts a TCPStore address
        # over the default group, so it fails without one ("Default process group has
        # not been initialized"); a single-rank gloo group on a FileStore satisfies it.
        import torch.distributed as dist

        store_path = root / "filestore"
        dist.init_process_group(
            "gloo", store=dist.FileStore(str(store_path), 1), rank=0, world_size=1
        )
        notes.append("needs a process group: single-rank gloo on a FileStore")

    def save_once(i: int) -> tuple[float, float, Path]:
        path = root / f"step_{i}"
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, opt)
        with quiet_dcp():
            fut = dcp.async_save(
                {"model": model_sd, "optimizer": optim_sd},
                checkpoint_id=path,
                no_dist=not process,
                async_checkpointer_type=kind,
            )
        t1 = time.perf_counter()
        fut.result()
        fsync_tree(path)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, path

    try:
        t_stall, t_e2e, _ = save_once(0)  # warm-up (a process executor spawns its worker here)
        notes.append(f"first call (warm-up, not counted): stall {t_stall:.3f}s, e2e {t_e2e:.3f}s")
        stalls, e2e, rss, child_rss = [], [], [], []
        path = root
        for i in range(1, repeats + 1):
            child_before = _child_processes_hwm_kib()
            with PeakRSS() as peak:
                stall, total, path = save_once(i)
            stalls.append(stall)
            e2e.append(total)
            rss.append(peak.delta_mib)
            child_rss.append((_child_processes_hwm_kib() - child_before) / 1024)
        result: dict[str, Any] = {
            "stall_s": median(stalls),
            "e2e_s": median(e2e),
            "peak_rss_mib": max(rss),
            "disk_bytes": tree_bytes(path),
            "notes": notes,
        }
        if process:
            result["worker_peak_rss_growth_mib"] = max(child_rss)
            result["notes"].append(
                "peak RSS is the training process only; the checkpoint worker process "
                "also holds the data (worker_peak_rss_growth_mib)"
            )
        return result
    finally:
        if process:
            import torch.distributed as dist

            dist.destroy_process_group()


# -------------------------------------------------------------------- restores


def _time_restores(
    restore_once: Callable[[], None], files: Path, repeats: int
) -> dict[str, Any]:
    warm, cold, rss = [], [], []
    cold_ok = True
    restore_once()  # warm-up
    for _ in range(repeats):
        for is_cold in (True, False):
            if is_cold:
                cold_ok = drop_page_cache(files) and cold_ok
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                restore_once()
                (cold if is_cold else warm).append(time.perf_counter() - t0)
            rss.append(peak.delta_mib)
    return {
        "restore_warm_s": median(warm),
        "restore_cold_s": median(cold),
        "restore_peak_rss_mib": max(rss),
        "page_cache_drop": cold_ok,
    }


def _restore_stalwart(run_dir: Path, state_bytes: int, model: nn.Module, repeats: int) -> Any:
    target_model, _opt, target = build_state(state_bytes, seed=1)
    with stalwart.CheckpointManager(run_dir, keep_last=None, handle_signals=False) as mgr:
        step = mgr.latest_step()
        assert step is not None

        def restore_once() -> None:
            got = mgr.restore(target, step=step)
            assert got == step

        result = _time_restores(restore_once, mgr.storage.step_path(step), repeats)
    assert same_params(target_model, model), "stalwart restore did not restore the parameters"
    return result


def _restore_torch(path: Path, state_bytes: int, model: nn.Module, repeats: int) -> Any:
    target_model, target_opt, _ = build_state(state_bytes, seed=1)

    def restore_once() -> None:
        sd = torch.load(path, weights_only=True)
        target_model.load_state_dict(sd["model"])
        target_opt.load_state_dict(sd["optimizer"])

    result = _time_restores(restore_once, path, repeats)
    assert same_params(target_model, model), "torch.load did not restore the parameters"
    return result


def _restore_dcp(path: Path, state_bytes: int, model: nn.Module, repeats: int) -> Any:
    target_model, target_opt, _ = build_state(state_bytes, seed=1)

    def restore_once() -> None:
        model_sd, optim_sd = get_state_dict(target_model, target_opt)
        sd = {"model": model_sd, "optimizer": optim_sd}
        with quiet_dcp():
            dcp.load(sd, checkpoint_id=path, no_dist=True)
        set_state_dict(
            target_model, target_opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"]
        )

    result = _time_restores(restore_once, path, repeats)
    assert same_params(target_model, model), "dcp.load did not restore the parameters"
    return result


# ------------------------------------------------------------------------ jobs

SAVE_METHODS = (
    "stalwart_sync",
    "stalwart_async",
    "torch_save",
    "dcp_save",
    "dcp_async_thread",
    "dcp_async_process",
)


def job_save(method: str, state_bytes: int, repeats: int, workdir: str) -> dict[str, Any]:
    """Save (and, for the methods that have their own format, restore) with one method."""
    model, opt, state = build_state(state_bytes)
    root = Path(tempfile.mkdtemp(prefix=f"{method}-", dir=workdir))
    out: dict[str, Any] = {"bytes": state_nbytes(model, opt)}
    try:
        if method in ("stalwart_sync", "stalwart_async"):
            run_dir = root / "run"
            out.update(_save_stalwart(run_dir, state, repeats, async_save=method.endswith("async")))
            if method == "stalwart_async":
                out["breakdown"] = _stalwart_breakdown(model, opt, state, repeats)
            else:
                out["restore"] = _restore_stalwart(run_dir, state_bytes, model, repeats)
        elif method == "torch_save":
            result, path = _save_torch(root, model, opt, repeats)
            out.update(result)
            out["restore"] = _restore_torch(path, state_bytes, model, repeats)
        elif method == "dcp_save":
            result, path = _save_dcp(root, model, opt, repeats)
            out.update(result)
            out["restore"] = _restore_dcp(path, state_bytes, model, repeats)
        elif method in ("dcp_async_thread", "dcp_async_process"):
            out.update(
                _save_dcp_async(root, model, opt, repeats, process=method.endswith("process"))
            )
        else:
            raise ValueError(f"unknown method {method!r}; known: {', '.join(SAVE_METHODS)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


# -------------------------------------------------------------- training loop

TRAIN_VARIANTS = ("stalwart_sync", "stalwart_async", "torch_save")


def _make_step(model: nn.Module, opt: torch.optim.Optimizer, batch: int) -> Callable[[], None]:
    width = model[0].norm.normalized_shape[0]
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def job_train(
    variant: str, state_bytes: int, every: int, segment_steps: int, rounds: int, workdir: str
) -> dict[str, Any]:
    """Wall time of ``segment_steps`` training steps with a checkpoint every ``every`` steps,
    over the same number of steps without; segments alternate to cancel drift on a noisy host."""
    model, opt, state = build_state(state_bytes)
    batch = 8
    step = _make_step(model, opt, batch)
    # Grow the batch until a step takes ~25 ms (the regime the overhead targets assume).
    while True:
        for _ in range(2):
            step()
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        step_s = (time.perf_counter() - t0) / 3
        if step_s >= 0.02 or batch >= 4096:
            break
        batch *= 2
        step = _make_step(model, opt, batch)
    root = Path(tempfile.mkdtemp(prefix=f"train-{variant}-", dir=workdir))
    saves = 0

    if variant in ("stalwart_sync", "stalwart_async"):
        mgr = stalwart.CheckpointManager(
            root / "run",
            every_steps=every,
            keep_last=3,
            async_save=variant.endswith("async"),
            handle_signals=False,
        )

        def checkpoint(i: int) -> None:
            nonlocal saves
            saves += mgr.save(i, state)

        def finish() -> None:
            mgr.wait()

        def close() -> None:
            mgr.close()

    elif variant == "torch_save":
        mgr = None

        def checkpoint(i: int) -> None:
            nonlocal saves
            if i % every:
                return
            final, tmp = root / f"ckpt_{i}.pt", root / f".ckpt_{i}.pt.tmp"
            with open(tmp, "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_path(root)
            old = root / f"ckpt_{i - 3 * every}.pt"  # keep the last 3, as stalwart does
            old.unlink(missing_ok=True)
            saves += 1

        def finish() -> None:
            pass

        def close() -> None:
            pass

    else:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(TRAIN_VARIANTS)}")

    checkpoint(0)  # warm-up: lazy imports and first-call costs are not the loop's overhead
    finish()
    saves = 0
    base_times, ckpt_times = [], []
    counter = 0
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(segment_steps):
                step()
            base_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(segment_steps):
                step()
                counter += 1
                checkpoint(counter)
            finish()  # an in-flight async save is charged to the segment that started it
            ckpt_times.append(time.perf_counter() - t0)
    finally:
        close()
        shutil.rmtree(root, ignore_errors=True)
    base, ckpt = sum(base_times), sum(ckpt_times)
    return {
        "bytes": state_nbytes(model, opt),
        "batch": batch,
        "step_s": base / (rounds * segment_steps),
        "every": every,
        "steps": rounds * segment_steps,
        "saves": saves,
        "base_s": base,
        "ckpt_s": ckpt,
        "overhead": ckpt / base - 1,
    }


JOBS: dict[str, Callable[..., dict[str, Any]]] = {
    "references": job_references,
    "save": job_save,
    "train": job_train,
}


def run_child(job: str, kwargs: dict[str, Any], result_path: str, log_path: str) -> None:
    """Entry point of one benchmark process: run ``job``, write its JSON to ``result_path``.

    stdout and stderr go to ``log_path`` so that library chatter (DCP's process
    executor logs at INFO) does not interleave with the runner's table.
    """
    import traceback

    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    try:
        result: dict[str, Any] = {"ok": True, "result": JOBS[job](**kwargs)}
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    Path(result_path).write_text(json.dumps(result), encoding="utf-8")
