"""The data side of a bit-exact resume: position, order and per-sample randomness.

Three things must come back for the batches after a resume to be the batches an
uninterrupted run would have seen:

1. **The position**, as consumed by the training loop. :class:`ResumableSampler`
   keeps it as a *global* position ``(epoch, consumed)``: the epoch's order is a
   function of ``(seed, epoch)`` alone, global position ``p`` goes to rank
   ``p % world_size`` (strided, like ``DistributedSampler``), so the samples the
   ranks have consumed together are always a prefix of the epoch's order and a
   resume at another world size continues that order with no repeat and no gap.
   DataLoader workers prefetch, so the sampler's own count of handed-out indices
   runs ahead of the loop: :class:`ResumableDataLoader` counts what its iterator
   actually returned instead.
2. **The iterator's base seed.** ``iter(DataLoader)`` draws one from the global
   torch RNG, even with ``num_workers=0``; a resumed loop creates its iterator at
   another point of that stream and every random number after it differs.
   :class:`ResumableDataLoader` draws it from its own generator, seeded from
   ``(seed, epoch)``, and never touches the global RNG.
3. **Augmentation randomness.** Workers are seeded from ``base_seed + worker_id``,
   so a sample's augmentation depends on which worker loaded it. With per-sample
   seeding (:class:`SeededDataset` + :class:`SeededSampler`, on by default in
   :class:`ResumableDataLoader`) every ``dataset[index]`` call runs with python
   ``random``, numpy's global and torch's CPU generators seeded from
   :func:`sample_seed` ``(seed, epoch, index)``, and the previous generator states
   are restored after it. The seed travels with the index through the index
   queue, so it is the same whatever the worker count, the worker assignment, the
   world size or the resume point (and persistent workers need no refresh).

State format of :class:`ResumableSampler` and :class:`ResumableDataLoader` (plain
data, identical on every rank when the ranks run in lockstep)::

    {"epoch": int, "consumed": int, "seed": int, "shuffle": bool, "dataset_len": int}

``consumed`` counts global positions of the epoch's sequence (all ranks
together, padding included) consumed before the next batch.

This module owns the position, the order and the per-sample seeding
(:class:`ResumableSampler`, :class:`SeededSampler`, :class:`SeededDataset`,
:func:`sample_seed`); :mod:`stalwart.loader` builds :class:`ResumableDataLoader`
on top of them.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Mapping, Sized
from types import FrameType
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
import xxhash
from torch.utils.data import Dataset, Sampler
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from stalwart.rng import derive_seed, isolated_cpu_rng

__all__ = [
    "ResumableSampler",
    "SeededDataset",
    "SeededSampler",
    "sample_seed",
]

T = TypeVar("T")

# Domain tags keep the seeds derived for different purposes from one user seed apart.
_TAG_ORDER = 0x6F72646572  # "order"
_TAG_SAMPLE = 0x73616D706C65  # "sample"
# (stalwart.loader uses 0x62617365, "base", for the DataLoader iterator's base seed.)
_STATE_KEYS = ("epoch", "consumed", "seed", "shuffle", "dataset_len")
_PREFETCH_WARNING = (
    "a ResumableSampler is being iterated by a torch.utils.data.DataLoader with worker "
    "processes: the workers prefetch, so the sampler's position runs ahead of the batches "
    "the training loop consumed and a resume skips samples. Use stalwart.ResumableDataLoader "
    "(same arguments as DataLoader), which counts what the loop consumed"
)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed under which ``dataset[index]`` runs in ``epoch`` of a run seeded with ``seed``.

    A pure function: the same in every process, worker, rank and resume. Padding
    duplicates of an index in one epoch get the same seed.
    """
    return derive_seed(_TAG_SAMPLE, seed, epoch, index)


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` when it is an int (not a bool) of at least ``minimum``, else ``ValueError`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class ResumableSampler(Sampler[int]):
    """A distributed sampler whose state is the global position ``(epoch, consumed)``.

    - **Order.** Epoch ``e`` visits ``perm(seed, e)`` (``torch.randperm`` on a local
      generator seeded from ``(seed, e)``; ``range(n)`` without shuffle). The global
      RNG is never used. The order depends on torch's ``randperm`` algorithm, so a
      mid-epoch resume across a torch upgrade that changed it would continue another
      order.
    - **Split.** Global position ``p`` goes to rank ``p % world_size`` (strided, like
      ``DistributedSampler``; contiguous blocks would make the consumed set a union
      of per-rank prefixes instead of one prefix, which no single number can hold).
      A pass that starts at ``consumed = c`` gives position ``c + j * world_size + rank``
      to ``rank``.
    - **Padding.** Like ``DistributedSampler``: with ``drop_last=False`` the epoch is
      padded to a multiple of ``world_size`` by continuing the order cyclically from
      its start (a few indices are seen twice); with ``drop_last=True`` the tail that
      does not fill a whole row of ranks is dropped. From a mid-epoch position ``c``
      the remaining ``n - c`` samples are padded or trimmed the same way, so every
      rank always gets the same count. For ``c = 0`` the indices of each rank are
      exactly ``DistributedSampler``'s for the same order.
    - **Epochs.** ``set_epoch(e)`` with a new ``e`` moves to ``(e, 0)``; with the
      current epoch it does nothing, so ``for e in range(s.epoch, E): s.set_epoch(e)``
      keeps a restored mid-epoch position. An iterator that runs to its end moves
      the sampler to ``(epoch + 1, 0)``: calling ``set_epoch`` is optional.
    - ``len(sampler)`` is this rank's count for a whole epoch from position 0 at the
      current world size (``DistributedSampler``'s ``num_samples``), stable across
      a resume so schedules built from it do not change; :attr:`remaining` is the
      count left from the current position.

    **Standalone position.** Iterating the sampler advances its ``consumed`` as indices
    are handed out (assuming all ranks advance together). That is the loop's position
    with ``num_workers=0`` and under torchdata's ``StatefulDataLoader`` (which
    snapshots the sampler when it dispatches each batch), but not with a plain
    ``DataLoader`` with workers, whose prefetching runs ahead: use
    :class:`ResumableDataLoader` there.

    ``rank`` and ``world_size`` default to ``torch.distributed``'s when a process
    group is initialised, else to 0 and 1. Not thread-safe; use it from one thread
    (the DataLoader iterates its sampler in the main process).
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        length = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        self._len = check_int("dataset length", length, minimum=0)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be True or False, got {shuffle!r}")
        self.seed = check_int("seed", seed)
        self.shuffle = shuffle
        self.drop_last = bool(drop_last)
        initialized = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank must be in [0, world_size), got rank={self.rank} with world_size={self.world_size}"
            )
        self._epoch = 0
        self._consumed = 0
        # Bumped by every change of position from outside an iterator (set_epoch,
        # load_state_dict, a new iterator): an iterator made before it must not keep
        # writing its own idea of the position.
        self._generation = 0
        self._order_cache: tuple[int, torch.Tensor] | None = None
        self._warned = False

    # --- position ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Global positions of the current epoch consumed so far (all ranks, padding included)."""
        return self._consumed

    @property
    def dataset_len(self) -> int:
        """The number of samples of the dataset this sampler orders."""
        return self._len

    @property
    def remaining(self) -> int:
        """This rank's count of indices left in the current epoch from the current position."""
        return self._rank_count(self._consumed)

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; no-op when ``epoch`` is the current epoch (keeps a restored position)."""
        epoch = check_int("epoch", epoch, minimum=0)
        if epoch != self._epoch:
            self._set_position(epoch, 0)
            self._generation += 1

    def state_dict(self) -> dict[str, Any]:
        """The position as plain data: ``{"epoch", "consumed", "seed", "shuffle", "dataset_len"}``."""
        return {
            "epoch": self._epoch,
            "consumed": self._consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self._len,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue at the position of ``state_dict`` (from :meth:`state_dict`, any world size).

        Raises ``ValueError`` when keys are missing or of the wrong type, or when the
        state was made for another dataset length, seed or shuffle setting (the order
        would differ, so the position would mean other samples).
        """
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(
                f"sampler state lacks {missing} (has {sorted(state_dict)}); pass the dict from "
                "ResumableSampler.state_dict() or ResumableDataLoader.state_dict()"
            )
        epoch = check_int("state_dict['epoch']", state_dict["epoch"], minimum=0)
        consumed = check_int("state_dict['consumed']", state_dict["consumed"], minimum=0)
        saved_len = check_int("state_dict['dataset_len']", state_dict["dataset_len"], minimum=0)
        saved_seed = check_int("state_dict['seed']", state_dict["seed"])
        saved_shuffle = state_dict["shuffle"]
        if not isinstance(saved_shuffle, bool):
            raise ValueError(f"state_dict['shuffle'] must be a bool, got {saved_shuffle!r}")
        if saved_len != self._len:
            raise ValueError(
                f"the data position was saved for a dataset of {saved_len} samples, but this "
                f"sampler's dataset has {self._len}; restore with the dataset the checkpoint was "
                "made with, or leave the data position out of the restore to start a fresh epoch"
            )
        if saved_seed != self.seed:
            raise ValueError(
                f"the data position was saved with seed={saved_seed}, but this sampler has "
                f"seed={self.seed}; construct it with seed={saved_seed} to continue the same order"
            )
        if saved_shuffle != self.shuffle:
            raise ValueError(
                f"the data position was saved with shuffle={saved_shuffle}, but this sampler has "
                f"shuffle={self.shuffle}; construct it with shuffle={saved_shuffle} to continue "
                "the same order"
            )
        self._set_position(epoch, consumed)
        self._generation += 1

    def _set_position(self, epoch: int, consumed: int) -> None:
        self._epoch = epoch
        self._consumed = consumed

    # --- order ------------------------------------------------------------------------

    def _order(self, epoch: int) -> torch.Tensor:
        cached = self._order_cache
        if cached is not None and cached[0] == epoch:
            return cached[1]
        generator = torch.Generator()
        generator.manual_seed(derive_seed(_TAG_ORDER, self.seed, epoch))
        order = torch.randperm(self._len, generator=generator)
        self._order_cache = (epoch, order)
        return order

    def _rank_count(self, start: int) -> int:
        """This rank's count for a pass over the epoch that starts at global position ``start``."""
        left = max(self._len - start, 0)
        if self.drop_last:
            return left // self.world_size
        return -(-left // self.world_size)

    def _rank_indices(self, epoch: int, start: int) -> list[int]:
        """This rank's indices for a pass over ``epoch`` from global position ``start``."""
        count = self._rank_count(start)
        if count == 0:
            return []
        positions = (
            torch.arange(start + self.rank, start + count * self.world_size, self.world_size)
            % self._len
        )
        if self.shuffle:
            positions = self._order(epoch)[positions]
        indices: list[int] = positions.tolist()
        return indices

    def _position_after(self, start: int, local_count: int) -> int:
        """The global position once every rank has consumed ``local_count`` samples of a pass from ``start``."""
        return start + local_count * self.world_size

    # --- iteration --------------------------------------------------------------------

    def _walk(self) -> Iterator[tuple[int, int]]:
        """Yield ``(index, epoch)`` from the current position, advancing it; to ``(epoch + 1, 0)`` at the end."""
        self._generation += 1
        generation = self._generation
        epoch, start = self._epoch, self._consumed
        if not self._warned and _under_prefetching_loader():
            self._warned = True
            warnings.warn(_PREFETCH_WARNING, UserWarning, stacklevel=2)
        for count, index in enumerate(self._rank_indices(epoch, start), start=1):
            if self._generation != generation:
                raise RuntimeError(
                    "this ResumableSampler iterator was superseded (set_epoch, load_state_dict or "
                    "a newer iter(sampler) changed the position); call iter(sampler) again"
                )
            self._consumed = self._position_after(start, count)
            yield index, epoch
        if self._generation == generation:
            self._set_position(epoch + 1, 0)

    def __iter__(self) -> Iterator[int]:
        """This rank's indices from the current position to the end of the epoch (see the class docstring)."""
        for index, _ in self._walk():
            yield index

    def __len__(self) -> int:
        return self._rank_count(0)

    def position_digest(self) -> str:
        """A digest (hex) of the position and the order it indexes, for the exact-resume certificate."""
        key = (self._epoch, self._consumed, self.seed, self.shuffle, self._len, self.world_size)
        return xxhash.xxh3_64_hexdigest(repr(key).encode())


def _under_prefetching_loader(depth: int = 12) -> bool:
    """True when a plain DataLoader with worker processes is pulling indices from this call stack.

    Its iterator asks the sampler for ``prefetch_factor * num_workers`` batches
    before the loop sees the first one, and keeps that many in flight. Looked up
    once per pass (a few frames), never per index.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if type(frame.f_locals.get("self")) is _MultiProcessingDataLoaderIter:
            return True
        frame = frame.f_back
    return False


class SeededSampler(Sampler[tuple[int, int]]):
    """Yield ``(index, sample_seed(seed, epoch, index))`` pairs of a :class:`ResumableSampler`.

    The pairs are the keys of :class:`SeededDataset`. Use the two together with a
    DataLoader that is not a :class:`ResumableDataLoader`, typically torchdata's
    ``StatefulDataLoader``::

        sampler = SeededSampler(ResumableSampler(ds, seed=0))
        loader = StatefulDataLoader(SeededDataset(ds), sampler=sampler, batch_size=32,
                                    num_workers=4, generator=torch.Generator())

    ``state_dict``/``load_state_dict``/``set_epoch``/``epoch`` are the wrapped sampler's
    (the position is the standalone one: see :class:`ResumableSampler`).
    """

    def __init__(self, sampler: ResumableSampler) -> None:
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(
                f"SeededSampler wraps a ResumableSampler, got {type(sampler).__name__}; "
                "build one with ResumableSampler(dataset, seed=...)"
            )
        self.sampler = sampler

    @property
    def epoch(self) -> int:
        """The wrapped sampler's epoch."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """See :meth:`ResumableSampler.set_epoch`."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`ResumableSampler.state_dict`."""
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """See :meth:`ResumableSampler.load_state_dict`."""
        self.sampler.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        seed = self.sampler.seed
        for index, epoch in self.sampler._walk():
            yield index, sample_seed(seed, epoch, index)

    def __len__(self) -> int:
        return len(self.sampler)


class SeededDataset(Dataset[T], Generic[T]):
    """Run each ``dataset[index]`` under its own seed, taken from the ``(index, seed)`` key.

    Inside the call python ``random``, numpy's global generator and torch's CPU
    generator are seeded from the key's 64-bit seed; afterwards they are restored to
    their state before the call, so with ``num_workers=0`` the training process's
    random streams are not disturbed. CUDA generators are not touched. Keys come from
    :class:`SeededSampler` or :class:`ResumableDataLoader`; the seed is part of the
    key, never an attribute, so it stays right with persistent workers.

    A ``__getitems__`` of the wrapped dataset is bypassed: every sample needs its own
    call to be seeded on its own. Attribute access falls through to the wrapped
    dataset (``loader.dataset.classes`` keeps working). Picklable when the wrapped
    dataset is. Not thread-safe (the generators are process-global).
    """

    def __init__(self, dataset: Dataset[T]) -> None:
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, int]) -> T:
        index, seed = self._split(key)
        with isolated_cpu_rng() as reseed:
            reseed(seed)
            return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[T]:
        # One save/restore of the generators per batch instead of per sample.
        with isolated_cpu_rng() as reseed:
            out = []
            for key in keys:
                index, seed = self._split(key)
                reseed(seed)
                out.append(self.dataset[index])
            return out

    @staticmethod
    def _split(key: object) -> tuple[int, int]:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(
                f"SeededDataset takes (index, sample_seed) keys, got {key!r}; draw indices with "
                "SeededSampler(ResumableSampler(...)) or use ResumableDataLoader"
            )
        index, seed = key
        return int(index), int(seed)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # map-style datasets are Sized

    def __getattr__(self, name: str) -> Any:
        # Dunder lookups (pickle's __setstate__, copy's __deepcopy__) and `dataset` itself
        # must not recurse while the object is being rebuilt without its __dict__.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)
