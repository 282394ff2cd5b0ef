"""The DataLoader of a bit-exact resume: :class:`ResumableDataLoader`.

A ``torch.utils.data.DataLoader`` over a :class:`stalwart.sampler.ResumableSampler`
that counts the samples its iterator actually returned to the training loop
(workers prefetch, so the sampler's own count runs ahead), draws the iterator's
base seed from its own generator seeded from ``(seed, epoch)`` instead of the
global torch RNG, and by default seeds every ``dataset[index]`` call from
:func:`stalwart.sampler.sample_seed` (:class:`stalwart.sampler.SeededDataset`).
Its state is the sampler's (see :mod:`stalwart.sampler` for the format and the
reasoning). It also keeps digests of the consumed batches' indices and content
for the exact-resume certificate.

This module owns the loader and its pass bookkeeping; it imports
:mod:`stalwart.sampler`, never the reverse.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from stalwart.rng import derive_seed
from stalwart.sampler import ResumableSampler, SeededDataset, check_int, sample_seed
from stalwart.signals import shielded_worker_init

__all__ = ["ResumableDataLoader"]

# Domain tag of the iterator's base seed; distinct from stalwart.sampler's tags so
# that seeds derived for different purposes from one user seed stay apart.
_TAG_BASE = 0x62617365  # "base"
_CONTENT_LIMIT = 1 << 20
"""Bytes of each tensor a batch-content digest reads (a prefix: the digest must stay cheap)."""


def _content_digest(h: xxhash.xxh3_64, value: Any) -> bool:
    """Feed a collated batch's content into ``h``; False when some part cannot be read cheaply.

    CPU tensors and numpy arrays contribute their dtype, shape and up to
    ``_CONTENT_LIMIT`` bytes; plain scalars and strings their ``repr``. A CUDA
    tensor is not read (it would synchronise the device): the batch's indices
    still identify it.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse or value.is_nested:
            return False
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        t = value.detach()
        if t.is_contiguous() and t.nbytes <= _CONTENT_LIMIT:
            try:
                h.update(t.numpy().data)  # the common case: no copy, a microsecond
                return True
            except (TypeError, RuntimeError):
                pass  # a dtype numpy lacks (bfloat16), a lazy conjugate
        flat = t.reshape(-1)[: max(_CONTENT_LIMIT // max(t.element_size(), 1), 1)]
        h.update(flat.contiguous().view(torch.uint8).numpy().tobytes())
        return True
    if isinstance(value, (list, tuple)):
        return all([_content_digest(h, v) for v in value])
    if isinstance(value, Mapping):
        h.update(repr(sorted(map(str, value))).encode())
        return all([_content_digest(h, value[k]) for k in value])
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        h.update(repr(value).encode())
        return True
    tobytes = getattr(value, "tobytes", None)
    if callable(tobytes) and hasattr(value, "dtype") and hasattr(value, "shape"):
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(memoryview(tobytes())[:_CONTENT_LIMIT])
        return True
    return False


@dataclass(eq=False)
class _Pass:
    """One ``iter(loader)``: where it started and the batches issued but not yet returned."""

    epoch: int
    start: int
    generation: int
    issued: deque[int] = field(default_factory=deque)  # sizes of issued batches, in issue order
    keys: deque[int] = field(default_factory=deque)  # digests of their indices, same order
    returned: int = 0  # this rank's samples returned to the loop so far


class _ResumableBatchSampler(Sampler[list[Any]]):
    """Batches of one pass, recording each issued batch's size in the pass's FIFO.

    The DataLoader pulls batches from here ahead of the loop (prefetch); with
    ``in_order=True`` it returns them in issue order, so each batch the loop receives
    pops the oldest record. Keys are ``(index, sample_seed)`` pairs when seeded.
    """

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool, seeded: bool):
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.seeded = seeded
        self.current: _Pass | None = None

    def batches_from(self, start: int) -> int:
        count = self.sampler._rank_count(start)
        if self.drop_last:
            return count // self.batch_size
        return math.ceil(count / self.batch_size)

    def __iter__(self) -> Iterator[list[Any]]:
        assert self.current is not None, "ResumableDataLoader.__iter__ sets the pass first"
        return self._batches(self.current)

    def _batches(self, p: _Pass) -> Iterator[list[Any]]:
        indices = self.sampler._rank_indices(p.epoch, p.start)
        seed, size = self.sampler.seed, self.batch_size
        for lo in range(0, len(indices), size):
            chunk = indices[lo : lo + size]
            if len(chunk) < size and self.drop_last:
                return
            batch: list[Any] = (
                [(i, sample_seed(seed, p.epoch, i)) for i in chunk] if self.seeded else chunk
            )
            p.keys.append(xxhash.xxh3_64_intdigest(array("q", chunk).tobytes()))
            p.issued.append(len(batch))
            yield batch

    def __len__(self) -> int:
        return self.batches_from(0)


class _LoaderIterator(Iterator[Any]):
    """What ``iter(ResumableDataLoader)`` returns: the DataLoader's iterator plus position accounting."""

    def __init__(self, loader: ResumableDataLoader, p: _Pass, inner: Iterator[Any] | None):
        self._loader = loader
        self._pass = p
        self._inner = inner
        self._done = False

    def __iter__(self) -> _LoaderIterator:
        return self

    def __len__(self) -> int:
        return self._loader._batch_sampler.batches_from(self._pass.start)

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        p, sampler = self._pass, self._loader.resumable_sampler
        if self._loader._current_pass is not p or sampler._generation != p.generation:
            raise RuntimeError(
                "this iterator of a ResumableDataLoader was superseded: a newer iter(loader), "
                "load_state_dict or set_epoch changed the position; call iter(loader) again"
            )
        if self._inner is None:
            batch_size = None
        else:
            try:
                batch = next(self._inner)
            except StopIteration:
                batch_size = None
            except Exception:
                # The DataLoader skips a batch whose loading raised (the next call returns
                # the following batch), as an uninterrupted run would: it counts as consumed.
                if p.issued:
                    p.keys.popleft()
                    self._advance(p.issued.popleft())
                raise
            else:
                batch_size = p.issued.popleft()
                self._loader._note_consumed(p.keys.popleft(), batch)
        if batch_size is None:
            assert not p.issued, "the DataLoader stopped with issued batches not returned"
            self._done = True
            sampler._set_position(p.epoch + 1, 0)
            raise StopIteration
        self._advance(batch_size)
        return batch

    def _advance(self, size: int) -> None:
        p = self._pass
        p.returned += size
        sampler = self._loader.resumable_sampler
        sampler._set_position(p.epoch, sampler._position_after(p.start, p.returned))


class ResumableDataLoader(DataLoader[Any]):
    """A ``DataLoader`` whose ``state_dict`` is the position the training loop consumed.

    Same constructor as ``torch.utils.data.DataLoader``, plus keyword-only ``seed``,
    ``rank``, ``world_size`` and ``per_sample_seed``. Without ``sampler`` it builds a
    :class:`ResumableSampler` from ``shuffle`` (default False, as DataLoader),
    ``seed`` (default 0), ``drop_last``, ``rank`` and ``world_size``; ``drop_last``
    also drops a last incomplete batch, as in DataLoader. An explicit ``sampler``
    must be a :class:`ResumableSampler` (then ``shuffle``/``seed``/``rank``/
    ``world_size`` belong to it and must not be given here).

    Guarantees:

    - ``state_dict()`` counts the samples of the batches the iterator has *returned*
      (prefetched batches are not counted); ``load_state_dict()`` then the next
      ``iter(loader)`` continue at exactly the next unconsumed sample, with any
      ``num_workers`` and any world size. Every ``iter(loader)`` starts at the next
      unconsumed sample: breaking out of a loop and iterating again continues.
    - An iterator that runs to its end moves the loader to ``(epoch + 1, 0)``. Loop
      over epochs with ``for epoch in range(loader.epoch, n_epochs): for batch in
      loader: ...``, or over steps with ``it = loader.forever()`` and ``next(it)``.
    - Creating an iterator never touches the global torch RNG: the workers' base
      seed comes from the loader's own generator, seeded from ``(seed, epoch)``.
    - With ``per_sample_seed=True`` (default) the dataset is wrapped in
      :class:`SeededDataset` (``loader.dataset`` is the wrapper, attributes fall
      through) and each sample's randomness depends only on ``(seed, epoch, index)``.
    - Workers survive a preemption signal sent to the whole job (torchrun signals each
      rank's process group, SLURM every process): ``worker_init_fn`` runs
      :func:`stalwart.signals.shield_worker` first, then yours, so the rank still gets
      its batches while it writes the emergency checkpoint.

    Not supported (``ValueError``/``TypeError`` at construction): ``batch_size=None``,
    ``batch_sampler``, ``generator``, ``in_order=False`` and iterable-style datasets
    (use torchdata's ``StatefulDataLoader`` for those).

    All ranks must consume the same number of batches between saves (lockstep, as DDP
    forces); the state is then the same on every rank. Use a loader and its iterators
    from one thread.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: ResumableSampler | None = None,
        batch_sampler: Iterable[list[int]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        per_sample_seed: bool = True,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "ResumableDataLoader needs a map-style dataset (__len__ and __getitem__), got an "
                f"IterableDataset ({type(dataset).__name__}); use torchdata's StatefulDataLoader "
                "with a stateful IterableDataset instead"
            )
        if batch_size is None:
            raise ValueError(
                "ResumableDataLoader needs a batch_size (the position is counted in samples of "
                "returned batches), got batch_size=None; pass batch_size=1 for single samples"
            )
        batch_size = check_int("batch_size", batch_size, minimum=1)
        if batch_sampler is not None:
            raise ValueError(
                "ResumableDataLoader builds its own batch sampler to count consumed samples; "
                "pass batch_size/drop_last and a ResumableSampler instead of batch_sampler"
            )
        if generator is not None:
            raise ValueError(
                "ResumableDataLoader derives its generator from (seed, epoch) so that iter() "
                "never depends on other RNG use; pass seed=... instead of generator=..."
            )
        if not in_order:
            raise ValueError(
                "ResumableDataLoader needs in_order=True: it matches returned batches to issued "
                "ones by order; drop in_order=False"
            )
        if sampler is None:
            sampler = ResumableSampler(
                dataset,  # type: ignore[arg-type]  # map-style datasets are Sized
                shuffle=bool(shuffle),
                seed=0 if seed is None else seed,
                drop_last=drop_last,
                rank=rank,
                world_size=world_size,
            )
        elif not isinstance(sampler, ResumableSampler):
            raise TypeError(
                f"ResumableDataLoader takes a ResumableSampler as sampler, got "
                f"{type(sampler).__name__}; wrap the dataset with ResumableSampler(dataset, ...) "
                "or pass shuffle/seed and no sampler"
            )
        else:
            given = {
                name: value
                for name, value in (
                    ("shuffle", shuffle),
                    ("seed", seed),
                    ("rank", rank),
                    ("world_size", world_size),
                )
                if value is not None
            }
            if given:
                raise ValueError(
                    f"{sorted(given)} belong to the ResumableSampler when one is passed; set them "
                    "on ResumableSampler(...) and leave them out here"
                )
        self.resumable_sampler: ResumableSampler = sampler
        self.per_sample_seed = per_sample_seed
        self._current_pass: _Pass | None = None
        self._reset_consumed()
        super().__init__(
            SeededDataset(dataset) if per_sample_seed else dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            # Workers ignore a preemption signal sent to the whole job (torchrun,
            # SLURM): dead workers would fail the next batch before the rank saved.
            worker_init_fn=shielded_worker_init(worker_init_fn),
            multiprocessing_context=multiprocessing_context,
            generator=torch.Generator(),
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=True,
        )
        self._batch_sampler = _ResumableBatchSampler(
            sampler, batch_size, drop_last, seeded=per_sample_seed
        )
        # DataLoader forbids setting batch_sampler after __init__ (its __setattr__ guard).
        # Letting it build a plain BatchSampler first keeps `sampler`, `batch_size` and
        # `drop_last` what the user passed; the recording batch sampler replaces it here.
        object.__setattr__(self, "batch_sampler", self._batch_sampler)

    # --- position ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (before the first batch of a pass: the one it will read)."""
        return self.resumable_sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; no-op for the current epoch (see :meth:`ResumableSampler.set_epoch`)."""
        self.resumable_sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position consumed by the loop, in :class:`ResumableSampler`'s format.

        Call it from the training thread between batches; it reflects every batch
        returned so far and none that is only prefetched. Identical on all ranks when
        they are in lockstep, so a checkpoint needs one copy (any rank's).
        """
        return self.resumable_sampler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue at ``state_dict``'s position on the next ``iter(loader)``.

        Validates like :meth:`ResumableSampler.load_state_dict` (``ValueError``).
        Iterators made before become unusable (``RuntimeError`` on ``next``).
        """
        self.resumable_sampler.load_state_dict(state_dict)
        self._current_pass = None
        self._reset_consumed()

    # --- the certificate's view -------------------------------------------------------

    def _reset_consumed(self) -> None:
        self._indices_hash = xxhash.xxh3_64()
        self._content_hash = xxhash.xxh3_64()
        self._content_known = True
        self._batches_consumed = 0

    def _note_consumed(self, keys: int, batch: Any) -> None:
        self._indices_hash.update(keys.to_bytes(8, "little"))
        if self._content_known:
            self._content_known = _content_digest(self._content_hash, batch)
        self._batches_consumed += 1

    def take_fingerprint(self) -> tuple[str | None, str | None]:
        """Digests (hex) of the indices and of the content of the batches returned since the last call.

        Used by the exact-resume certificate once per step; resets the
        digests. ``(None, None)`` when no batch was returned since; the
        content digest is None when a batch held something it cannot read
        cheaply (a CUDA tensor). Training thread only.
        """
        if self._batches_consumed == 0:
            return None, None
        out = (
            self._indices_hash.hexdigest(),
            self._content_hash.hexdigest() if self._content_known else None,
        )
        self._reset_consumed()
        return out

    # --- iteration --------------------------------------------------------------------

    def __iter__(self) -> _LoaderIterator:  # type: ignore[override]  # wraps DataLoader's iterator
        """Start a pass at the next unconsumed sample; earlier iterators become unusable."""
        sampler = self.resumable_sampler
        p = _Pass(epoch=sampler.epoch, start=sampler.consumed, generation=sampler._generation)
        self._current_pass = p
        self._batch_sampler.current = p
        if self._batch_sampler.batches_from(p.start) == 0:
            # Nothing left in this epoch (a position saved after its last batch): skip
            # starting workers; the iterator only moves on to the next epoch.
            return _LoaderIterator(self, p, None)
        self.generator.manual_seed(derive_seed(_TAG_BASE, sampler.seed, p.epoch))
        return _LoaderIterator(self, p, super().__iter__())

    def forever(self) -> Iterator[Any]:
        """Yield batches without end, epoch after epoch, from the next unconsumed sample.

        For step-based loops: ``it = loader.forever()`` then ``batch = next(it)`` per
        step. The position is exact after each ``next``. Raises ``ValueError`` when a
        whole epoch has no batch (it would loop forever).
        """
        while True:
            fresh = self.resumable_sampler.consumed == 0
            empty = True
            for batch in self:
                empty = False
                yield batch
            if empty and fresh:
                raise ValueError(
                    f"an epoch of this loader has no batch ({self.resumable_sampler.dataset_len} "
                    f"samples, world_size={self.resumable_sampler.world_size}, "
                    f"batch_size={self._batch_sampler.batch_size}, drop_last="
                    f"{self._batch_sampler.drop_last}); use a larger dataset or drop_last=False"
                )
