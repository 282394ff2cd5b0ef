"""Rank, world size, and the few collectives checkpointing needs; a leaf helper.

Every function works without an initialized process group (a single process is
rank 0 of a world of 1), so the single-process path needs no launcher.

Checkpoint coordination runs on dedicated gloo groups with a timeout
(``Coordinator``), never on the training group: a save can then neither
deadlock with training collectives nor wait forever for a dead rank. A
collective that fails (timeout, peer gone) raises ``CoordinationError`` and
marks the coordinator broken, because after a timeout the ranks no longer agree
on how many collectives each has run; the job must restart (torchrun does).

``init_distributed`` and ``shutdown_distributed`` wrap torch.distributed's own
init and teardown with the two fixes that make elastic restarts and clean exits
reliable on gloo (see their docstrings). They add no launcher and no collective
of their own.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CoordinationError,
    StalwartError,
    StateMismatchError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)

__all__ = [
    "Coordinator",
    "RankError",
    "default_backend",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "shutdown_distributed",
]

logger = logging.getLogger("stalwart")
T = TypeVar("T")

# What gloo (and the TCP stack under it) says when the process at the other end is gone.
_PEER_GONE = (
    ("connection reset", "connection reset"),
    ("connection closed", "connection closed"),
    ("broken pipe", "broken pipe"),
    ("connection refused", "connection refused"),
    ("end of file", "connection closed"),
)


_ERROR_TYPES: dict[str, type[StalwartError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointCorruptError,
        CheckpointNotFoundError,
        StateMismatchError,
        UnsafeCheckpointError,
        UnsupportedFormatError,
    )
}
"""Errors that cross ranks as themselves; any other kind arrives as ``RankError.fallback``."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankError:
    """An error one rank raised in ``Coordinator.agree``, as every rank receives it."""

    rank: int
    kind: str
    """The exception's class name."""
    message: str
    path: str | None = None
    transient: bool = False

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> RankError:
        return cls(
            rank,
            type(exc).__name__,
            str(exc),
            getattr(exc, "path", None),
            bool(getattr(exc, "transient", False)),
        )

    def error(self, fallback: type[StalwartError] = CheckpointCorruptError) -> StalwartError:
        """The same kind of stalwart error on this rank, its message prefixed with the rank."""
        cls = _ERROR_TYPES.get(self.kind, fallback)
        message = f"rank {self.rank}: {self.message}"
        if issubclass(cls, CheckpointCorruptError):
            return cls(message, path=self.path, transient=self.transient)
        return cls(message)


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when torch.distributed is initialized (and this process is in ``group``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return group is None or dist.get_rank(group) >= 0


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed(group) else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1


class Coordinator:
    """Collectives for checkpointing: one gloo group, a timeout, and a broken flag.

    A single process gets a coordinator without a group whose collectives are
    identities. All methods are collective over the group: every rank calls
    them in the same order, from one thread per coordinator.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, timeout: float, name: str) -> None:
        self.group = group
        self.timeout = timeout
        self.name = name
        self.rank = get_rank(group) if group is not None else 0
        self.world_size = get_world_size(group) if group is not None else 1
        self.broken: str | None = None
        self.collectives = 0
        """Collectives this coordinator has run (a single process counts none)."""

    @classmethod
    def create(
        cls, process_group: dist.ProcessGroup | None, *, timeout: float, name: str
    ) -> Coordinator:
        """A coordinator over the ranks of ``process_group`` (the default group when None).

        Collective when torch.distributed is initialized: every rank of the
        default group must call it, in the same order (``new_group`` requires it).
        """
        if not is_distributed():
            return cls(None, timeout=timeout, name=name)
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout),
        )
        return cls(group, timeout=timeout, name=name)

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        if self.broken is not None:
            raise CoordinationError(
                f"checkpoint coordination ({self.name}) is unusable since an earlier collective "
                f"failed ({self.broken}); restart the job (torchrun --max-restarts does) to recover"
            )
        self.collectives += 1
        try:
            return fn()
        except (RuntimeError, ValueError, OSError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.broken = f"{what}: {detail}"
            # The backend's traceback says nothing more than its first line, which the
            # message keeps: no chained cause, so the user reads one line, not forty.
            raise CoordinationError(
                f"{self.failure_headline(detail)}: checkpoint coordination ({self.name}) failed "
                f"in {what} on rank {self.rank} ({detail})"
            ) from None

    def failure_headline(self, detail: str) -> str:
        """What a failed collective most likely means, first: "rank 1 is gone (connection reset); ..."."""
        text = detail.lower()
        # With two ranks the peer is known; with more, gloo's message names an address only.
        peer = f"rank {1 - self.rank}" if self.world_size == 2 else "another rank"
        restart = "the job must restart (torchrun --max-restarts restarts it)"
        for needle, reason in _PEER_GONE:
            if needle in text:
                return f"{peer} is gone ({reason}); {restart}"
        if "timed out" in text or "timeout" in text:
            return (
                f"{peer} did not answer within the {self.timeout:g} s timeout (dead or hung); "
                f"{restart}"
            )
        return f"a checkpoint collective failed (a rank died, hung or raised); {restart}"

    def broadcast(self, obj: T) -> T:
        """``obj`` of rank 0, on every rank."""
        if not self.distributed:
            return obj
        box: list[Any] = [obj]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._run("broadcast", lambda: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]  # type: ignore[no-any-return]

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._run("all_gather", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def agree(
        self,
        fn: Callable[[], T],
        *,
        catch: tuple[type[BaseException], ...] = (StalwartError,),
        remote: Callable[[RankError], BaseException] | None = None,
    ) -> T:
        """Run ``fn`` on every rank; return this rank's result, or raise on every rank.

        THE one way ranks agree on an outcome: one all-gather carries each
        rank's error (or none). When ``fn`` raised one of ``catch`` on any rank,
        every rank raises: the rank that failed first (lowest rank) raises its
        own exception unchanged; the others raise ``remote(RankError)`` (by
        default the same kind of stalwart error, "rank N: ..."). Exceptions not
        in ``catch`` propagate on their rank at once (a bug, not an outcome).
        Collective.
        """
        local, _ = self._agreed(fn, catch, remote, share=False)
        return local

    def agree_all(
        self,
        fn: Callable[[], T],
        *,
        catch: tuple[type[BaseException], ...] = (StalwartError,),
        remote: Callable[[RankError], BaseException] | None = None,
    ) -> list[T]:
        """``agree``, returning every rank's result in rank order, in the same one all-gather.

        Results travel by pickle: return small values (names, digests, file
        lists) and keep big ones in a closure.
        """
        _, shared = self._agreed(fn, catch, remote, share=True)
        return shared

    def _agreed(
        self,
        fn: Callable[[], T],
        catch: tuple[type[BaseException], ...],
        remote: Callable[[RankError], BaseException] | None,
        *,
        share: bool,
    ) -> tuple[T, list[T]]:
        result: Any = None
        local: BaseException | None = None
        try:
            result = fn()
        except catch as exc:
            local = exc
        report = None if local is None else RankError.of(self.rank, local)
        gathered = self.all_gather((report, result if share and local is None else None))
        failed = [rep for rep, _ in gathered if rep is not None]
        if failed:
            first = failed[0]
            if local is not None and first.rank == self.rank:
                raise local
            raise (remote or RankError.error)(first)
        return result, [value for _, value in gathered]  # type: ignore[misc]

    def flags_max(self, *flags: bool) -> list[bool]:
        """Element-wise OR of boolean flags across ranks: one small all-reduce."""
        return [bool(v) for v in self.max_ints(*flags)]

    def max_ints(self, *values: int) -> list[int]:
        """Element-wise maximum of integers (bools count as 0/1) across ranks: one small all-reduce."""
        if not self.distributed:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group))
        return [int(v) for v in t.tolist()]

    def destroy(self) -> None:
        if self.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except (RuntimeError, ValueError) as exc:
                logger.debug("destroying the %s group failed: %s", self.name, exc)
        self.group = None


def default_backend() -> str:
    """The process group's backend for this node: ``"cuda:nccl,cpu:gloo"`` when CUDA
    is available and every local rank (torchrun's ``LOCAL_WORLD_SIZE``) has a GPU
    of its own, else ``"gloo"``, which works for CPU tensors and, slower, for CUDA
    ones. The same on every rank of a node, so that all ranks agree."""
    if not torch.cuda.is_available():
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if local_world > gpus:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            logger.warning(
                "%d processes on this node but %d GPU(s): not one each, so the process "
                "group uses gloo (collectives of CUDA tensors go through host memory); "
                "start at most %d process(es) per node for NCCL",
                local_world,
                gpus,
                gpus,
            )
        return "gloo"
    return "cuda:nccl,cpu:gloo"


def init_distributed(backend: str | None = None, *, timeout: float = 1800.0) -> tuple[int, int]:
    """``init_process_group`` from torchrun's environment that survives elastic restarts.

    After torchrun restarts its workers (a rank was killed), a plain
    ``init_process_group("gloo")`` can fail intermittently: gloo's full-mesh
    connect reads the previous attempt's addresses from the store and dials
    them ("Connection refused"). This builds the group on the agent's TCPStore
    (``MASTER_ADDR``/``MASTER_PORT``) under a prefix keyed by the store endpoint
    and, with a single agent, ``TORCHELASTIC_RESTART_COUNT``, so each attempt
    has a namespace of its own.

    Returns ``(rank, world_size)``. Without torchrun's variables it initializes
    nothing and returns ``(0, 1)``. ``backend`` defaults to ``default_backend()``:
    NCCL for CUDA tensors and gloo for CPU ones when every local rank has a GPU
    of its own (each rank then uses GPU ``LOCAL_RANK``), gloo alone otherwise.
    Call once per process, before building the model.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if backend is None:
        backend = default_backend()
    if "nccl" in backend:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:
            raise ValueError(
                f"init_distributed({backend!r}): local rank {local_rank} has no GPU of its "
                f"own ({gpus} visible); start at most {gpus} process(es) per node "
                "(torchrun --nproc-per-node), or use backend='gloo'"
            )
        torch.cuda.set_device(local_rank)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    # One agent (one node): its restart count numbers the attempts for every worker.
    # Several agents count restarts each on their own (a replacement node starts at
    # 0), so there the key is the store endpoint, which torch elastic renews for
    # every rendezvous round.
    single_agent = os.environ.get("GROUP_WORLD_SIZE", "1") == "1"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if single_agent else "round"
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host,
        port,
        world_size=world,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore(f"stalwart/{run_id}/{host}:{port}/attempt-{attempt}", store)  # type: ignore[attr-defined]
    dist.init_process_group(
        backend,
        store=prefixed,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return rank, world


def shutdown_distributed() -> None:
    """End a distributed run in order: barrier, collect garbage, destroy the process group.

    DDP or FSDP2 on gloo that exits without an orderly teardown aborts at exit
    about one run in six ("terminate called without an active exception"), and
    torchrun then reports a finished job as failed. Delete your references to
    the wrapped model (``del model``) first, then call this on every rank. Safe
    to call without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
    except RuntimeError as exc:
        logger.warning("barrier at shutdown failed: %s", exc)
    gc.collect()
    dist.destroy_process_group()
