"""Measurements that run inside one fresh benchmark process each (see ``run.py``).

Every public ``job_*`` function builds its own training state, measures one
method (or the physical references) and returns plain JSON data. ``run.py``
calls them in processes forked from a clean server that has only imported
torch, so the peak-RSS numbers of one method never include another's memory.

Times are seconds from ``time.perf_counter``; sizes are bytes; RSS is MiB.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import math
import mmap
import os
import resource
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import train_stats  # benchmarks/ is on the path, as for measure itself
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import stalwart
from stalwart.file_io import DIRECT_ALIGN

MiB = 2**20
_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"
_IO_CHUNK = 8 * MiB  # what stalwart's hash_file reads per call; the raw read uses the same
_WRITE_CHUNK = 8 * MiB

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
    return max(16, round(width / 16) * 16)


def build_model(state_bytes: int, *, seed: int = 0, blocks: int = N_BLOCKS) -> nn.Sequential:
    torch.manual_seed(seed)
    width = width_for(state_bytes, blocks)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


def build_state(
    state_bytes: int, *, seed: int = 0, blocks: int = N_BLOCKS
) -> tuple[nn.Module, torch.optim.Optimizer, stalwart.TrainState]:
    """Model + ``torch.optim.AdamW`` after one real step on random gradients."""
    model = build_model(state_bytes, seed=seed, blocks=blocks)
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


median = train_stats.median  # one definition, shared with the runner's pooling


def best(values: list[float]) -> float:
    """The fastest of the repeats: on a shared machine, noise only ever adds time."""
    return min(values) if values else math.nan


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


def files_under(root: Path) -> list[Path]:
    """``root`` itself when it is a file, else every file under it."""
    if root.is_file():
        return [root]
    return [Path(d) / n for d, _, fs in os.walk(root) for n in fs]


def drop_page_cache(root: Path) -> bool:
    """Evict the (clean, fsynced) pages of every file under ``root``; True if the call worked."""
    ok = True
    for path in files_under(root):
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
    return sum(path.stat().st_size for path in files_under(root))


def read_tree(root: Path) -> int:
    """Read every file under ``root`` (or the file ``root``) once, in large reads: the bytes read."""
    buf = bytearray(_IO_CHUNK)
    total = 0
    for path in sorted(files_under(root)):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


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


class References:
    """Physical floors on the same bytes as the state: memcpy, hashing, raw write+fsync, raw read."""

    def __init__(
        self, tensors: list[torch.Tensor], root: Path, *, fresh_from: int | None = None
    ) -> None:
        self.tensors = tensors
        self.fresh_from = len(tensors) if fresh_from is None else fresh_from
        """Index of the first tensor a restore into fresh objects allocates anew (the
        optimizer's state: a new optimizer has none); those before it (the model's)
        exist already."""
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # Preallocated and faulted in: the copy a reused staging buffer would do.
        self.buffers = [torch.empty_like(t) for t in tensors]
        self.memcpy()
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8)
        self.flat.random_(0, 256)
        self.view = memoryview(self.flat.numpy())
        self.readbuf = bytearray(_IO_CHUNK)
        self.page_cache_drop = True
        # The same bytes in page-aligned memory, for direct writes (None: no O_DIRECT here).
        self.aligned: memoryview | None = None
        if getattr(os, "O_DIRECT", 0):
            self.aligned = memoryview(mmap.mmap(-1, max(self.nbytes, 1)))
            self.aligned[: self.nbytes] = self.view
        self.direct_refused = False

    def memcpy(self) -> float:
        t0 = time.perf_counter()
        for b, t in zip(self.buffers, self.tensors, strict=True):
            b.copy_(t)
        return time.perf_counter() - t0

    def clone(self) -> float:
        """The same copy into fresh allocations, whose pages fault in on first touch."""
        t0 = time.perf_counter()
        clones = [t.clone() for t in self.tensors]
        elapsed = time.perf_counter() - t0
        del clones
        return elapsed

    def xxh3(self) -> float:
        import xxhash  # stalwart's checksum

        t0 = time.perf_counter()
        xxhash.xxh3_128(self.view).hexdigest()
        return time.perf_counter() - t0

    def write(self, i: int, stem: str = "raw") -> tuple[float, float, Path]:
        """Write the bytes to a new file and fsync it and its directory: (seconds, CPU seconds, path).

        A new file each time: a checkpoint never overwrites blocks in place, and
        allocating fresh blocks is part of the cost on ext4/xfs.
        """
        path = self.root / f"{stem}{i}.bin"
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for off in range(0, self.nbytes, _WRITE_CHUNK):
                f.write(self.view[off : off + _WRITE_CHUNK])
            os.fsync(f.fileno())
        fsync_path(self.root)
        return time.perf_counter() - t0, cpu_seconds() - c0, path

    def write_direct(self, i: int) -> tuple[float, float] | None:
        """The same bytes written with O_DIRECT in 8 MiB writes, fsynced, directory fsynced:
        (seconds, CPU seconds), None where the filesystem refuses direct I/O.

        What this disk does with the page cache out of the way, which is how
        stalwart writes large tensors (``stalwart.hashed_file``); the buffered
        raw write stays the persist goal's reference.
        """
        if self.aligned is None or self.direct_refused:
            return None
        path = self.root / f"direct{i}.bin"
        whole = self.nbytes - self.nbytes % DIRECT_ALIGN
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        except OSError:  # EINVAL: a filesystem without direct I/O (tmpfs)
            self.direct_refused = True
            return None
        try:
            try:
                for off in range(0, whole, _WRITE_CHUNK):
                    os.pwrite(fd, self.aligned[off : min(off + _WRITE_CHUNK, whole)], off)
                if whole < self.nbytes:  # the last partial page, through the page cache
                    with open(path, "r+b", buffering=0) as tail:
                        tail.seek(whole)
                        tail.write(self.view[whole:])
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_path(self.root)
            return time.perf_counter() - t0, cpu_seconds() - c0
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct_refused = True  # opened, but the writes refused (some FUSE mounts)
            return None
        finally:
            path.unlink(missing_ok=True)

    def _drop_if_cold(self, path: Path, cold: bool) -> None:
        if cold:
            self.page_cache_drop = drop_page_cache(path) and self.page_cache_drop

    def _into_buffers(self, f: Any, targets: list[torch.Tensor] | None = None) -> None:
        """Read ``f`` from its position on into ``targets`` (default ``self.buffers``),
        one after the other."""
        for b in self.buffers if targets is None else targets:
            f.readinto(memoryview(b.reshape(-1).view(torch.uint8).numpy()))

    def read(self, path: Path, *, cold: bool) -> float:
        self._drop_if_cold(path, cold)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(self.readbuf):
                pass
        return time.perf_counter() - t0

    def place(self, path: Path, *, cold: bool) -> float:
        """The floor of any restore, checked or not: the file read into the target tensors.

        The same reads as ``read``, but each lands in state-sized memory
        (``self.buffers``, preallocated like a live model's) instead of one
        reused 8 MiB buffer that stays in the CPU's cache. No check, no
        metadata: what a restore cannot do without.
        """
        self._drop_if_cold(path, cold)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            self._into_buffers(f)
        return time.perf_counter() - t0

    def check_then_place(self, path: Path, *, cold: bool, fresh: bool = False) -> float:
        """The floor of a restore that checks every byte before it writes any live tensor.

        One pass reads the file and hashes it (xxh3-128, chunk by chunk), a
        second reads it into the target tensors (``self.buffers``, preallocated
        like a live model's), from the page cache the first pass filled.
        Nothing else: no metadata, no framing, no planning. Holding the whole
        file in memory instead of reading it twice costs the same copy.

        ``fresh``: the floor of the same restore into fresh objects, where the
        optimizer's state (the tensors from ``fresh_from`` on) is allocated
        inside the timing (``torch.empty_like``), as such a restore allocates
        it. Whether its pages fault in then depends on what the allocator hands
        back, in this process as in the restore's (``clone`` shows how a fresh
        allocation fared in this run).
        """
        import xxhash

        self._drop_if_cold(path, cold)
        t0 = time.perf_counter()
        digest = xxhash.xxh3_128()
        chunk = memoryview(self.readbuf)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(chunk):
                digest.update(chunk[:n])
            digest.hexdigest()
            f.seek(0)
            targets = (
                self.buffers[: self.fresh_from]
                + [torch.empty_like(t) for t in self.tensors[self.fresh_from :]]
                if fresh
                else self.buffers
            )
            self._into_buffers(f, targets)
        elapsed = time.perf_counter() - t0
        del targets
        return elapsed


# -------------------------------------------------------------------- methods


class Method:
    """One way to save (and maybe restore) a training state, set up over one directory.

    ``save(i)`` returns ``(stall_s, e2e_s, path)``: how long the training thread
    was blocked, and how long until the checkpoint was durable.
    """

    restores = False

    def __init__(
        self, root: Path, model: nn.Module, opt: torch.optim.Optimizer, state: stalwart.TrainState
    ) -> None:
        self.root, self.model, self.opt, self.state = root, model, opt, state
        root.mkdir(parents=True, exist_ok=True)

    def save(self, i: int) -> tuple[float, float, Path]:
        raise NotImplementedError

    def restore(
        self, path: Path, model: nn.Module, opt: torch.optim.Optimizer, state: stalwart.TrainState
    ) -> None:
        raise NotImplementedError

    def details(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class StalwartMethod(Method):
    restores = True
    async_save = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # keep_last=None: retention deletes are a policy cost, measured in the training loop.
        self.mgr = stalwart.CheckpointManager(
            self.root / "run", async_save=self.async_save, keep_last=None, handle_signals=False
        )
        self.events: list[dict[str, Any]] = []
        self.caller_cpu: list[float] = []
        """CPU time of the thread that called save and wait, per save (an async save's
        training-thread part: the staging copy and the save's own bookkeeping)."""

    def save(self, i: int) -> tuple[float, float, Path]:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        self.mgr.save(i, self.state, force=True)
        t1 = time.perf_counter()
        self.mgr.wait()
        t2 = time.perf_counter()
        self.caller_cpu.append(time.thread_time() - c0)
        event = last_event(self.root / "run", "save")
        assert event["step"] == i
        self.events.append(event)
        if not self.async_save:
            # Sync: the whole save blocks; the event's own numbers are the authority.
            return float(event["stall_s"]), float(event["total_s"]), self.mgr.storage.step_path(i)
        return t1 - t0, t2 - t0, self.mgr.storage.step_path(i)

    def restore(self, path: Path, model: Any, opt: Any, state: stalwart.TrainState) -> None:
        step = int(path.name.split("_")[-1])
        assert self.mgr.restore(state, step=step) == step

    def details(self) -> dict[str, Any]:
        keys = ("stall_s", "stage_s", "write_s", "checksum_s", "commit_s", "total_s")
        # The phases of the fastest save, so that they add up to its total.
        fastest = min(self.events, key=lambda e: float(e["total_s"]))
        return {
            "events": {k: float(fastest.get(k, math.nan)) for k in keys},
            "caller_cpu": list(self.caller_cpu),
        }

    def close(self) -> None:
        self.mgr.close()


class StalwartAsyncMethod(StalwartMethod):
    restores = False  # the same format and restore path as stalwart sync
    async_save = True


class TorchSaveMethod(Method):
    """torch.save of model and optimizer state dicts, flushed, fsynced, renamed into place."""

    restores = True

    def save(self, i: int) -> tuple[float, float, Path]:
        t0 = time.perf_counter()
        final, tmp = self.root / f"ckpt_{i}.pt", self.root / f".ckpt_{i}.pt.tmp"
        sd = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        with open(tmp, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(self.root)
        t = time.perf_counter() - t0
        return t, t, final

    def restore(self, path: Path, model: nn.Module, opt: torch.optim.Optimizer, state: Any) -> None:
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])


class DcpSaveMethod(Method):
    """dcp.save of get_state_dict's model and optimizer dicts (DCP's own recipe), then fsync."""

    restores = True

    def save(self, i: int) -> tuple[float, float, Path]:
        t0 = time.perf_counter()
        path = self.root / f"step_{i}"
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        with quiet_dcp():
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path, no_dist=True)
        fsync_tree(path)  # FileSystemWriter fsyncs its files; the directories are ours to sync
        t = time.perf_counter() - t0
        return t, t, path

    def restore(self, path: Path, model: nn.Module, opt: torch.optim.Optimizer, state: Any) -> None:
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optimizer": optim_sd}
        with quiet_dcp():
            dcp.load(sd, checkpoint_id=path, no_dist=True)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


class DcpAsyncMethod(Method):
    """dcp.async_save with the default stager; stall = until it returns, e2e = until the future."""

    process = False

    def save(self, i: int) -> tuple[float, float, Path]:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        path = self.root / f"step_{i}"
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        with quiet_dcp():
            fut = dcp.async_save(
                {"model": model_sd, "optimizer": optim_sd},
                checkpoint_id=path,
                no_dist=not self.process,
                async_checkpointer_type=kind,
            )
        t1 = time.perf_counter()
        fut.result()
        fsync_tree(path)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, path


class DcpAsyncProcessMethod(DcpAsyncMethod):
    process = True


METHODS: dict[str, type[Method]] = {
    "stalwart_sync": StalwartMethod,
    "stalwart_async": StalwartAsyncMethod,
    "torch_save": TorchSaveMethod,
    "dcp_save": DcpSaveMethod,
    "dcp_async_thread": DcpAsyncMethod,
    "dcp_async_process": DcpAsyncProcessMethod,
}
SAVE_METHODS = tuple(METHODS)
TINY_BYTES = 64 * 1024


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its live children (DCP's worker)."""
    import multiprocessing

    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    ticks = os.sysconf("SC_CLK_TCK")
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{child.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


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


def _stalwart_stall_breakdown(
    model: nn.Module, opt: torch.optim.Optimizer, state: stalwart.TrainState, repeats: int
) -> dict[str, float]:
    """Where stalwart's async stall goes, its parts timed alone: TrainState.state_dict
    (model and optimizer dicts, RNG capture, plain-data check) and the staging
    copy into the buffers an earlier save left (``StagingArea``, as every save
    but a run's first stages); DCP's get_state_dict alone for comparison
    (TrainState rebuilds its result after the first save instead of calling
    it), and the first save's staging copy, into fresh memory."""
    from stalwart.staging import StagingArea

    area = StagingArea()
    t0 = time.perf_counter()
    area.stage(state.state_dict())  # the first save's copy: buffers allocated, pages faulted in
    fresh = time.perf_counter() - t0
    get_sd, train_sd, stage = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        get_state_dict(model, opt)
        t1 = time.perf_counter()
        sd = state.state_dict()
        t2 = time.perf_counter()
        staged = area.stage(sd)
        t3 = time.perf_counter()
        del staged, sd
        get_sd.append(t1 - t0)
        train_sd.append(t2 - t1)
        stage.append(t3 - t2)
    # The parts of the fastest repeat, so that they add up.
    i = min(range(repeats), key=lambda k: train_sd[k] + stage[k])
    return {
        "get_state_dict_s": get_sd[i],
        "trainstate_state_dict_s": train_sd[i],
        "stage_copy_s": stage[i],
        "stage_copy_fresh_s": fresh,
    }


def _stalwart_restore_breakdown(path: Path) -> dict[str, float]:
    """Restore = verify (read + xxh3 of every file) + metadata + DCP load: time the first two alone."""
    from stalwart.metadata_json import read_metadata_json
    from stalwart.pipeline import verify_checkpoint
    from stalwart.safe_load import read_dcp_metadata

    out = {}
    for cold in (True, False):
        if cold:
            drop_page_cache(path)
        t0 = time.perf_counter()
        verify_checkpoint(path)
        out["verify_cold_s" if cold else "verify_warm_s"] = time.perf_counter() - t0
    # Best of three: one sample caught the kernel reclaiming the page cache the
    # cold pass filled (233 ms at 1 GiB once, 10 ms in isolation).
    for key, read in (("read_metadata_s", read_dcp_metadata), ("read_json_s", read_metadata_json)):
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert read(path) is not None
            samples.append(time.perf_counter() - t0)
        out[key] = min(samples)
    return out


def _scrambled_copy(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any, Any]:
    """A restore target shaped like (model, opt) with different values (cheaper than building one)."""
    target_model, target_opt = copy.deepcopy((model, opt))
    with torch.no_grad():
        for p in target_model.parameters():
            p.zero_()
    return target_model, target_opt, stalwart.TrainState(model=target_model, optimizer=target_opt)


def _fresh_target(state_bytes: int, blocks: int = N_BLOCKS) -> tuple[Any, Any, Any]:
    """A newly built model (other values) and an AdamW that has not stepped: what a restart restores into."""
    model = build_model(state_bytes, seed=1, blocks=blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, stalwart.TrainState(model=model, optimizer=opt)


def _warm_up(cls: type[Method], root: Path) -> dict[str, float]:
    """One save (and restore) of a tiny state: lazy imports, first-call costs, DCP's worker."""
    tiny = build_state(TINY_BYTES)
    m = cls(root, *tiny)
    try:
        stall, e2e, path = m.save(0)
        if cls.restores:
            m.restore(path, *_scrambled_copy(tiny[0], tiny[1]))
    finally:
        m.close()
    return {"stall_s": stall, "e2e_s": e2e}


def settle() -> None:
    """Flush the filesystem before a timed write.

    Deleting the previous round's checkpoints leaves work for the next journal
    commit (block frees, and discards on a ``-o discard`` mount such as this
    machine's ext4); the next timed fsync would pay for it. Here nobody does.
    """
    os.sync()


def _remove_checkpoint(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _raw_write_and_read(refs: References, i: int, samples: dict[str, list[float]]) -> None:
    settle()
    elapsed, cpu, raw = refs.write(i)
    samples["write"].append(elapsed)
    samples["write_cpu"].append(cpu)
    settle()
    if (direct := refs.write_direct(i)) is not None:
        samples["write_direct"].append(direct[0])
        samples["write_direct_cpu"].append(direct[1])
    samples["cold"].append(refs.read(raw, cold=True))
    samples["warm"].append(refs.read(raw, cold=False))
    samples["into_cold"].append(refs.place(raw, cold=True))
    samples["into_warm"].append(refs.place(raw, cold=False))
    samples["place_cold"].append(refs.check_then_place(raw, cold=True))
    samples["place_warm"].append(refs.check_then_place(raw, cold=False))
    samples["place_fresh_cold"].append(refs.check_then_place(raw, cold=True, fresh=True))
    samples["place_fresh_warm"].append(refs.check_then_place(raw, cold=False, fresh=True))
    raw.unlink()
    settle()


INTERLEAVED = tuple(name for name in METHODS if name != "dcp_async_process")
RAW_IN_ROUND = ("raw write", "raw direct write")
"""The raw writes' places among the methods of a round (``job_timing``)."""


def _raw_write_in_round(
    refs: References,
    i: int,
    name: str,
    samples: dict[str, list[float]],
    latest: dict[str, Path],
) -> None:
    """One raw write timed where a save is timed: among the round's saves, after a
    neighbour's save and the deletion of its previous checkpoint, its own file kept
    until its next turn as a checkpoint is.

    The persist goal divides by this one. The raw writes at a round's edges
    come after reads and copies that leave the disk quiet for a while, a place
    no save of the rotation has; both are reported (``docs/benchmarks.md``
    has what the two places measured).
    """
    if name == RAW_IN_ROUND[0]:
        elapsed, cpu, path = refs.write(i, stem="round")
        samples["write_in_round"].append(elapsed)
        samples["write_in_round_cpu"].append(cpu)
        if name in latest:
            _remove_checkpoint(latest[name])
        latest[name] = path
    elif name == RAW_IN_ROUND[1]:
        if (direct := refs.write_direct(i)) is not None:  # its file deleted at once
            samples["write_direct_in_round"].append(direct[0])
            samples["write_direct_in_round_cpu"].append(direct[1])
    else:
        raise ValueError(f"{name!r} is not one of the raw writes {RAW_IN_ROUND}")


def _rotated(names: list[str], i: int) -> list[str]:
    """``names`` in round ``i``'s order: rotated by one each round, so that no method is
    always the one right after the references' large writes, reads and deletes."""
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def job_timing(state_bytes: int, repeats: int, workdir: str) -> dict[str, Any]:
    """Time every method and every reference on one state, interleaved: each round runs
    all of them once, so a neighbour's burst on a shared machine hits them alike.

    dcp.async_save (process) is left out: it needs a process group, and with one
    initialized stalwart and DCP take their distributed code paths (see job_isolated).
    """
    model, opt, state = build_state(state_bytes)
    root = Path(tempfile.mkdtemp(prefix="timing-", dir=workdir))
    samples: dict[str, dict[str, list[Any]]] = {
        name: {k: [] for k in ("stall", "e2e", "cpu", "cold", "warm", "fresh_cold", "fresh_warm")}
        for name in INTERLEAVED
    }
    ref_samples: dict[str, list[float]] = {
        k: []
        for k in (
            "memcpy",
            "clone",
            "xxh3",
            "write",
            "write_cpu",
            "write_direct",
            "write_direct_cpu",
            "write_in_round",
            "write_in_round_cpu",
            "write_direct_in_round",
            "write_direct_in_round_cpu",
            "cold",
            "warm",
            "into_cold",
            "into_warm",
            "place_cold",
            "place_warm",
            "place_fresh_cold",
            "place_fresh_warm",
        )
    }
    first_call = {name: _warm_up(METHODS[name], root / "warmup" / name) for name in INTERLEAVED}
    methods = {name: METHODS[name](root / name, model, opt, state) for name in INTERLEAVED}
    refs = References(
        state_tensors(model, opt),
        root / "raw",
        fresh_from=len(list(tensors_of({"model": model.state_dict()}))),
    )
    target = _scrambled_copy(model, opt)
    latest: dict[str, Path] = {}
    try:
        for i in range(1, max(repeats, 3) + 1):
            ref_samples["memcpy"].append(refs.memcpy())
            ref_samples["clone"].append(refs.clone())
            ref_samples["xxh3"].append(refs.xxh3())
            # Raw I/O at the start and at the end of every round: the floor every method
            # is divided by must not hinge on one moment of a shared disk.
            _raw_write_and_read(refs, i, ref_samples)
            if i > repeats:
                continue  # the references get at least three rounds: every ratio divides by them
            for name in _rotated([*methods, *RAW_IN_ROUND], i):
                settle()
                if name in RAW_IN_ROUND:
                    _raw_write_in_round(refs, i, name, ref_samples, latest)
                    continue
                m = methods[name]
                cpu_before = cpu_seconds()
                stall, e2e, path = m.save(i)
                # Nothing else runs here, so this is the save's own CPU time: for a
                # background save, what it takes from the training step's cores.
                samples[name]["cpu"].append(cpu_seconds() - cpu_before)
                samples[name]["stall"].append(stall)
                samples[name]["e2e"].append(e2e)
                if name in latest:
                    _remove_checkpoint(latest[name])
                latest[name] = path
            settle()
            for name, m in methods.items():
                if not m.restores:
                    continue
                for cold in (True, False):
                    if cold:
                        drop_page_cache(latest[name])
                    t0 = time.perf_counter()
                    m.restore(latest[name], *target)
                    samples[name]["cold" if cold else "warm"].append(time.perf_counter() - t0)
                assert same_params(target[0], model), (
                    f"{name}: restore did not bring the parameters back"
                )
                if name == "stalwart_sync":
                    # Into fresh objects too: a restarted job's model and optimizer, built
                    # (untimed) just before, the optimizer without any state yet.
                    for cold in (True, False):
                        fresh = _fresh_target(state_bytes)
                        if cold:
                            drop_page_cache(latest[name])
                        t0 = time.perf_counter()
                        m.restore(latest[name], *fresh)
                        samples[name]["fresh_cold" if cold else "fresh_warm"].append(
                            time.perf_counter() - t0
                        )
                        assert same_params(fresh[0], model), "fresh restore: wrong parameters"
                        del fresh
                with torch.no_grad():
                    for p in target[0].parameters():
                        p.zero_()
            _raw_write_and_read(refs, i, ref_samples)
        out: dict[str, Any] = {
            "bytes": refs.nbytes,
            "state": describe_state(model, opt),
            "torch_threads": torch.get_num_threads(),
            "references": {
                "memcpy_s": best(ref_samples["memcpy"]),
                "clone_s": best(ref_samples["clone"]),
                "xxh3_s": best(ref_samples["xxh3"]),
                # Time: the writes among the methods only, in the same place as a save
                # (see _raw_write_in_round); CPU: every write, wherever it ran.
                "raw_write_s": best(ref_samples["write_in_round"]),
                "raw_write_edge_s": best(ref_samples["write"]),
                "raw_write_cpu_s": best(
                    ref_samples["write_cpu"] + ref_samples["write_in_round_cpu"]
                ),
                **(
                    {
                        "raw_write_direct_s": best(ref_samples["write_direct_in_round"]),
                        "raw_write_direct_edge_s": best(ref_samples["write_direct"]),
                        "raw_write_direct_cpu_s": best(
                            ref_samples["write_direct_cpu"]
                            + ref_samples["write_direct_in_round_cpu"]
                        ),
                    }
                    if ref_samples["write_direct"] and ref_samples["write_direct_in_round"]
                    else {}
                ),
                "raw_read_cold_s": best(ref_samples["cold"]),
                "raw_read_warm_s": best(ref_samples["warm"]),
                "place_cold_s": best(ref_samples["into_cold"]),
                "place_warm_s": best(ref_samples["into_warm"]),
                "check_place_cold_s": best(ref_samples["place_cold"]),
                "check_place_warm_s": best(ref_samples["place_warm"]),
                "check_place_fresh_cold_s": best(ref_samples["place_fresh_cold"]),
                "check_place_fresh_warm_s": best(ref_samples["place_fresh_warm"]),
                "page_cache_drop": refs.page_cache_drop,
                "samples": ref_samples,
            },
            "methods": {},
        }
        for name, m in methods.items():
            smp = samples[name]
            result: dict[str, Any] = {
                "stall_s": best(smp["stall"]),
                "e2e_s": best(smp["e2e"]),
                "cpu_s": best(smp["cpu"]),
                "stall_median_s": median(smp["stall"]),
                "e2e_median_s": median(smp["e2e"]),
                "repeats": repeats,
                "disk_bytes": tree_bytes(latest[name]),
                "first_call": first_call[name],
                "samples": {k: v for k, v in smp.items() if v},
                **m.details(),
            }
            if "caller_cpu" in result:
                result.update(_cpu_split(smp["cpu"], result.pop("caller_cpu")))
            if m.restores:
                result["restore"] = {
                    "restore_cold_s": best(smp["cold"]),
                    "restore_warm_s": best(smp["warm"]),
                    "restore_cold_median_s": median(smp["cold"]),
                    "restore_warm_median_s": median(smp["warm"]),
                    **(
                        {
                            "restore_fresh_cold_s": best(smp["fresh_cold"]),
                            "restore_fresh_warm_s": best(smp["fresh_warm"]),
                        }
                        if smp["fresh_cold"]
                        else {}
                    ),
                    "page_cache_drop": refs.page_cache_drop,
                }
            out["methods"][name] = result
        out["methods"]["stalwart_async"]["breakdown"] = _stalwart_stall_breakdown(
            model, opt, state, repeats
        )
        out["methods"]["stalwart_sync"]["restore"]["breakdown"] = _stalwart_restore_breakdown(
            latest["stalwart_sync"]
        )
    finally:
        for m in methods.values():
            m.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def _cpu_split(cpu: list[float], caller: list[float]) -> dict[str, float]:
    """The save of least CPU time split into its caller's thread and every other thread
    (an async save's background writer and fsyncs): ``cpu[k]`` and ``caller[k]`` are
    the same save's. Empty when they do not pair up."""
    if not cpu or len(cpu) != len(caller):
        return {}
    k = min(range(len(cpu)), key=cpu.__getitem__)
    return {"caller_cpu_s": caller[k], "background_cpu_s": max(cpu[k] - caller[k], 0.0)}


def job_isolated(method: str, state_bytes: int, repeats: int, workdir: str) -> dict[str, Any]:
    """Peak RSS of one method's save (and restore) in a process of its own.

    For dcp.async_save (process), which needs a process group, this is also where it
    is timed (best of ``repeats``): DCP's process executor reads the rank and
    broadcasts a TCPStore address over the default group, and fails without one
    ("Default process group has not been initialized"); a single-rank gloo group on
    a FileStore satisfies it.
    """
    cls = METHODS[method]
    model, opt, state = build_state(state_bytes)
    root = Path(tempfile.mkdtemp(prefix=f"{method}-", dir=workdir))
    out: dict[str, Any] = {"notes": []}
    process = cls is DcpAsyncProcessMethod
    if process:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", store=dist.FileStore(str(root / "filestore"), 1), rank=0, world_size=1
        )
        out["notes"].append("needs a process group: single-rank gloo on a FileStore")
    try:
        out["first_call"] = _warm_up(cls, root / "warmup")
        m = cls(root / "timed", model, opt, state)
        stalls, e2e, cpu, rss, child_rss = [], [], [], [], []
        path = root
        for i in range(1, (repeats if process else 1) + 1):
            child_before = _child_processes_hwm_kib()
            cpu_before = cpu_seconds()
            with PeakRSS() as peak:
                stall, total, path = m.save(i)
            cpu.append(cpu_seconds() - cpu_before)
            stalls.append(stall)
            e2e.append(total)
            rss.append(peak.delta_mib)
            child_rss.append((_child_processes_hwm_kib() - child_before) / 1024)
        out["peak_rss_mib"] = max(rss)
        out["isolated"] = {"stall_s": best(stalls), "e2e_s": best(e2e), "cpu_s": best(cpu)}
        if process:
            out.update(
                stall_s=best(stalls),
                e2e_s=best(e2e),
                cpu_s=best(cpu),
                stall_median_s=median(stalls),
                e2e_median_s=median(e2e),
                repeats=repeats,
                disk_bytes=tree_bytes(path),
                worker_peak_rss_growth_mib=max(child_rss),
                samples={"stall": stalls, "e2e": e2e, "cpu": cpu},
            )
            out["notes"].append("timed in its own process, not interleaved with the others")
        if cls.restores:
            target = _scrambled_copy(model, opt)
            with PeakRSS() as peak:
                m.restore(path, *target)
            out["restore_peak_rss_mib"] = peak.delta_mib
        m.close()
    finally:
        if process:
            import torch.distributed as dist

            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return out


# -------------------------------------------------------------- training loop

TRAIN_VARIANTS = (
    "stalwart_sync",
    "stalwart_async",
    "torch_save",
    "floor_async",
    "floor_async_xxh3",
)


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


class _Checkpointing:
    """One training-loop variant's way to checkpoint: ``checkpoint(i)`` after step ``i``
    (True when it saved), ``finish()`` waits for a save in flight, ``close()`` ends it."""

    def __init__(
        self, variant: str, root: Path, model: nn.Module, opt: Any, state: Any, every: int
    ):
        self.variant, self.root, self.every = variant, root, every
        self.mgr: stalwart.CheckpointManager | None = None
        self.writer: list[threading.Thread] = []
        if variant in ("stalwart_sync", "stalwart_async"):
            self.mgr = stalwart.CheckpointManager(
                root / "run",
                every_steps=every,
                keep_last=3,
                async_save=variant.endswith("async"),
                handle_signals=False,
            )
            self.state = state
        elif variant == "torch_save":
            self.model, self.opt = model, opt
        elif variant in ("floor_async", "floor_async_xxh3"):
            # The physical floor of async checkpointing: memcpy into preallocated buffers,
            # then one thread writes the raw bytes to a new file and fsyncs it. The xxh3
            # variant also hashes every byte as it writes it (xxh3-128, GIL released):
            # the floor of any async save that checksums what it writes.
            self.tensors = state_tensors(model, opt)
            self.buffers = [torch.empty_like(t) for t in self.tensors]
            self.hashed = variant == "floor_async_xxh3"
        else:
            raise ValueError(f"unknown variant {variant!r}; known: {', '.join(TRAIN_VARIANTS)}")

    def checkpoint(self, i: int) -> bool:
        if self.mgr is not None:
            return self.mgr.save(i, self.state)
        if i % self.every:
            return False
        if self.variant == "torch_save":
            final, tmp = self.root / f"ckpt_{i}.pt", self.root / f".ckpt_{i}.pt.tmp"
            with open(tmp, "wb") as f:
                torch.save(
                    {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, f
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_path(self.root)
            old = self.root / f"ckpt_{i - 3 * self.every}.pt"  # keep the last 3, as stalwart does
            old.unlink(missing_ok=True)
            return True
        self.finish()  # at most one save in flight, as stalwart's AsyncSaver
        for b, t in zip(self.buffers, self.tensors, strict=True):
            b.copy_(t)
        thread = threading.Thread(target=self._write, args=(i,))
        thread.start()
        self.writer.append(thread)
        return True

    def _write(self, i: int) -> None:
        import xxhash

        digest = xxhash.xxh3_128()
        with open(self.root / f"raw_{i}.bin", "wb", buffering=0) as f:
            for b in self.buffers:
                view = memoryview(b.reshape(-1).view(torch.uint8).numpy())
                if self.hashed:
                    digest.update(view)
                f.write(view)
            os.fsync(f.fileno())
        digest.hexdigest()
        fsync_path(self.root)
        (self.root / f"raw_{i - 3 * self.every}.bin").unlink(missing_ok=True)

    def finish(self) -> None:
        if self.mgr is not None:
            self.mgr.wait()
        while self.writer:
            self.writer.pop().join()

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
        self.finish()

    def logged_stalls(self) -> list[float]:
        """What the manager itself reports as the stall of each save, to set beside the
        time the loop actually spent inside save()."""
        if self.mgr is None:
            return []
        events = (self.root / "run" / "events.jsonl").read_text(encoding="utf-8").splitlines()
        return [
            float(e["stall_s"])
            for e in map(json.loads, events)
            if e.get("event") == "save" and e.get("step", 0) > 0
        ]


def _training_step(state_bytes: int) -> tuple[Any, Callable[[], None], int]:
    """The benchmark state and a step on it whose batch is grown until it takes ~25 ms
    (the regime the overhead targets assume)."""
    built = build_state(state_bytes)
    model, opt, _state = built
    batch = 8
    step = _make_step(model, opt, batch)
    while True:
        step()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        if min(times) >= 0.02 or batch >= 4096:
            break
        batch *= 2
        step = _make_step(model, opt, batch)
    return built, step, batch


class _Segments:
    """The samples of one variant's pairs of segments (without checkpoints, then with)."""

    def __init__(self, ckpt: _Checkpointing, step: Callable[[], None], every: int) -> None:
        self.ckpt, self.step = ckpt, step
        ckpt.checkpoint(0)  # warm-up: lazy imports and first-call costs are not the overhead
        ckpt.finish()
        self.saves = 0
        self.base: list[float] = []
        self.with_ckpt: list[float] = []
        self.blocked: list[float] = []
        self.save_calls: list[float] = []
        # Start half an interval in, so a segment ends half an interval after its last
        # save: waiting for that save at the segment's end then charges only what a
        # steady-state loop would also wait for, not a whole save started on the
        # segment's last step.
        self.counter = every // 2

    def pair(self, steps: int) -> None:
        step = self.step
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        self.base.append(time.perf_counter() - t0)
        blocked = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
            self.counter += 1
            t1 = time.perf_counter()
            saved = self.ckpt.checkpoint(self.counter)
            t2 = time.perf_counter()
            blocked += t2 - t1
            if saved:
                self.saves += 1
                self.save_calls.append(t2 - t1)
        t1 = time.perf_counter()
        self.ckpt.finish()  # an in-flight async save is charged to the segment that started it
        t2 = time.perf_counter()
        self.with_ckpt.append(t2 - t0)
        self.blocked.append(blocked + t2 - t1)

    def summary(self, *, state_bytes: int, batch: int, every: int, steps: int) -> dict[str, Any]:
        return train_stats.train_summary(
            {
                "bytes": state_bytes,
                "threads": torch.get_num_threads(),
                "batch": batch,
                "every": every,
                "segment_steps": steps,
                "saves": self.saves,
                "base_segments_s": self.base,
                "ckpt_segments_s": self.with_ckpt,
                "blocked_segments_s": self.blocked,
                "save_calls_s": self.save_calls,
                "logged_stalls_s": self.ckpt.logged_stalls(),
            }
        )


def job_train(
    variant: str,
    state_bytes: int,
    every: int,
    segment_steps: int,
    rounds: int,
    workdir: str,
) -> dict[str, Any]:
    """Wall time of ``segment_steps`` training steps with a checkpoint every ``every`` steps,
    over the same number of steps without. Segments alternate (without, with, without, ...),
    and each pair's ratio is taken (``train_stats.train_summary``), so drift and a
    neighbour's burst on a shared host hit both sides alike."""
    # Intra-op threads are set by the runner (--threads, default 1). With every core in
    # torch's pool, a background writer preempts a pool thread and the whole parallel
    # region waits for it; a GPU trainer's host has spare cores instead.
    (model, opt, state), step, batch = _training_step(state_bytes)
    root = Path(tempfile.mkdtemp(prefix=f"train-{variant}-", dir=workdir))
    try:
        ckpt = _Checkpointing(variant, root, model, opt, state, every)
        try:
            segments = _Segments(ckpt, step, every)
            for _ in range(rounds):
                segments.pair(segment_steps)
        finally:
            ckpt.close()
        return segments.summary(
            state_bytes=state_nbytes(model, opt), batch=batch, every=every, steps=segment_steps
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


SIDE_BY_SIDE = ("stalwart_async", "floor_async", "floor_async_xxh3")
"""The variants the target against the physical floor compares, run in one process."""


def job_train_side_by_side(
    state_bytes: int, every: int, segment_steps: int, rounds: int, workdir: str
) -> dict[str, Any]:
    """``job_train`` of stalwart async and the two floors in one process, their pairs
    of segments taking turns (each round in the reverse order of the one before).

    The target compares stalwart's overhead with the floor's; run in separate
    processes at different times, the floor's own overhead moved from +7% to
    +20% between runs on a shared host. Here each of stalwart's pairs has the
    floor's pairs right beside it, on the same model, the same step, the same
    host moment. One variant's background save is finished before the next
    variant's segment starts.
    """
    (model, opt, state), step, batch = _training_step(state_bytes)
    root = Path(tempfile.mkdtemp(prefix="train-side-by-side-", dir=workdir))
    ckpts: dict[str, _Checkpointing] = {}
    try:
        for name in SIDE_BY_SIDE:
            (root / name).mkdir()
            ckpts[name] = _Checkpointing(name, root / name, model, opt, state, every)
        segments = {name: _Segments(c, step, every) for name, c in ckpts.items()}
        for r in range(rounds):
            for name in SIDE_BY_SIDE if r % 2 == 0 else SIDE_BY_SIDE[::-1]:
                segments[name].pair(segment_steps)
        nbytes = state_nbytes(model, opt)
        return {
            "variants": {
                name: s.summary(state_bytes=nbytes, batch=batch, every=every, steps=segment_steps)
                for name, s in segments.items()
            },
            "rounds": rounds,
            "every": every,
        }
    finally:
        for c in ckpts.values():
            c.close()
        shutil.rmtree(root, ignore_errors=True)


def _per_call(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Best over ``rounds`` of the mean seconds per call of ``calls`` calls.

    The best, not the median: microseconds on a shared machine, where a
    neighbour's burst only ever adds time.
    """
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return min(samples)


def job_certificate(workdir: str, calls: int = 2000, rounds: int = 5) -> dict[str, Any]:
    """The exact-resume certificate's cost per step, against a tiny training step and ``save()``.

    ``fingerprint_s``: one step's fingerprint (RNG digest, loss, append to the
    log); ``fingerprint_data_s``: the same with a ``ResumableDataLoader`` batch's
    index and content digests. ``save_not_due_s``: a whole ``save()`` call that
    does not write (the policy check, the fingerprint). ``tiny_step_s``: forward,
    backward and AdamW step of a 4-8-2 MLP on 16 samples, about the cheapest
    real step there is; the ratio to it is an upper bound for any real model.
    """
    from stalwart.certificate import Certificate

    root = Path(tempfile.mkdtemp(prefix="cert-", dir=workdir))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 4)

    def tiny_step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    data = torch.utils.data.TensorDataset(torch.randn(4096, 4))
    loader = stalwart.ResumableDataLoader(data, batch_size=16, shuffle=True, seed=0)
    batches = loader.forever()
    cert = Certificate(root / "alone", rank=0, world_size=1)
    steps = iter(range(1, 10**9))

    def fingerprint() -> None:
        cert.record(next(steps), None, {"loss": 0.5})

    batch = next(batches)

    def fingerprint_data() -> None:
        # What the loader adds per returned batch (index and content digests), then the record.
        loader._note_consumed(0x5EED, batch)
        cert.record(next(steps), loader, {"loss": 0.5})

    state = stalwart.TrainState(model=model, optimizer=opt, data=loader)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        with stalwart.CheckpointManager(root / "run", every_steps=10**9) as ckpt:

            def save_not_due() -> None:
                ckpt.save(next(steps), state, metrics={"loss": 0.5})

            tiny_step()  # AdamW creates its state on the first step
            tiny = _per_call(tiny_step, calls // 4, rounds)
            plain = _per_call(fingerprint, calls, rounds)
            with_data = _per_call(fingerprint_data, calls, rounds)
            not_due = _per_call(save_not_due, calls, rounds)
    cert.close()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "fingerprint_s": plain,
        "fingerprint_data_s": with_data,
        "save_not_due_s": not_due,
        "tiny_step_s": tiny,
        "fingerprint_x_tiny_step": plain / tiny,
        "fingerprint_data_x_tiny_step": with_data / tiny,
        "save_not_due_x_tiny_step": not_due / tiny,
    }


PER_CALL_METHODS = ("stalwart_sync", "stalwart_async", "torch_save", "dcp_save")
MANY_BLOCKS = 96
"""Blocks of the per-call job's second state: 2,304 tensors (a large model's count)."""


def job_per_call(workdir: str, repeats: int) -> dict[str, Any]:
    """Each method's cost per call apart from its bytes: the benchmark's state with its
    tensors (the same 192: 8 blocks and their AdamW state) holding almost no bytes,
    and under ``"many"`` the same for 96 blocks (2,304 tensors).

    Saves (CPU time of every thread, as in ``job_timing``) and warm restores,
    interleaved round by round; stalwart's restore also into fresh objects.
    This is the per-tensor work every call pays at any size (planning, the
    metadata, one record per tensor, the state-dict calls); at the benchmark's
    sizes the rest is the part that grows with the bytes, which the physical
    floors bound. The two counts of tensors give each method's cost per tensor,
    which is what a large model pays on every save. Best of ``repeats`` rounds
    after one untimed round.
    """
    out = _per_call_state(workdir, repeats, N_BLOCKS)
    out["many"] = _per_call_state(workdir, max(2, repeats // 2), MANY_BLOCKS)
    return out


def _per_call_state(workdir: str, repeats: int, blocks: int) -> dict[str, Any]:
    model, opt, state = build_state(TINY_BYTES, blocks=blocks)
    root = Path(tempfile.mkdtemp(prefix="per-call-", dir=workdir))
    methods = {name: METHODS[name](root / name, model, opt, state) for name in PER_CALL_METHODS}
    target = _scrambled_copy(model, opt)
    keys = ("cpu", "restore_warm", "restore_fresh_warm")
    samples: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in methods}
    latest: dict[str, Path] = {}
    try:
        for i in range(repeats + 1):
            for name, m in methods.items():
                settle()
                cpu_before = cpu_seconds()
                _, _, path = m.save(i)
                cpu = cpu_seconds() - cpu_before
                if name in latest:
                    _remove_checkpoint(latest[name])
                latest[name] = path
                restores: dict[str, float] = {}
                if m.restores:
                    m.restore(path, *target)  # the warm restore reads from the page cache
                    t0 = time.perf_counter()
                    m.restore(path, *target)
                    restores["restore_warm"] = time.perf_counter() - t0
                    assert same_params(target[0], model), f"{name}: wrong parameters"
                if name == "stalwart_sync":
                    fresh = _fresh_target(TINY_BYTES, blocks)
                    t0 = time.perf_counter()
                    m.restore(path, *fresh)
                    restores["restore_fresh_warm"] = time.perf_counter() - t0
                    assert same_params(fresh[0], model), "fresh restore: wrong parameters"
                if i == 0:
                    continue  # first calls: lazy imports, a first layout's records
                samples[name]["cpu"].append(cpu)
                for key, seconds in restores.items():
                    samples[name][key].append(seconds)
        return {
            "bytes": state_nbytes(model, opt),
            "tensors": len(state_tensors(model, opt)),
            "repeats": repeats,
            "methods": {
                name: {f"{k}_s": best(v) for k, v in smp.items() if v} | {"samples": smp}
                for name, smp in samples.items()
            },
        }
    finally:
        for m in methods.values():
            m.close()
        shutil.rmtree(root, ignore_errors=True)


JOBS: dict[str, Callable[..., dict[str, Any]]] = {
    "timing": job_timing,
    "isolated": job_isolated,
    "train": job_train,
    "train_side_by_side": job_train_side_by_side,
    "certificate": job_certificate,
    "per_call": job_per_call,
}


def run_child(
    job: str, kwargs: dict[str, Any], result_path: str, log_path: str, *, threads: int = 0
) -> None:
    """Entry point of one benchmark process: run ``job``, write its JSON to ``result_path``.

    stdout and stderr go to ``log_path`` so that library chatter (DCP's process
    executor logs at INFO) does not interleave with the runner's table.
    """
    import traceback

    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        result: dict[str, Any] = {"ok": True, "result": JOBS[job](**kwargs)}
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    Path(result_path).write_text(json.dumps(result), encoding="utf-8")
