"""Bit-exact resume of the data side: position, augmentation and the global RNG, with real workers."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, SequentialSampler

from stalwart.loader import ResumableDataLoader
from stalwart.rng import capture_rng_state, restore_rng_state
from stalwart.sampler import (
    ResumableSampler,
    SeededDataset,
    SeededSampler,
)

from .conftest import seed_all

N = 22  # samples
B = 4  # batch size: 6 batches an epoch, the last one of 2
PER_EPOCH = 6
STEPS = 15  # two and a half epochs
SEED = 11


class AugmentedDataset(Dataset[torch.Tensor]):
    """A sample is its index plus one draw each from torch, python `random` and numpy (augmentation)."""

    def __init__(self, n: int = N, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.fail_at:
            raise KeyError(index)
        return torch.tensor(
            [float(index), torch.rand(()).item(), random.random(), float(np.random.rand())],
            dtype=torch.float64,
        )


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def train_step_draws() -> torch.Tensor:
    """What a training step takes from the global generators (dropout, noise, ...)."""
    return torch.cat(
        [torch.rand(2, dtype=torch.float64), torch.tensor([random.random(), np.random.rand()])]
    )


def make_loader(num_workers: int, **kwargs: Any) -> ResumableDataLoader:
    return ResumableDataLoader(
        AugmentedDataset(),
        batch_size=B,
        shuffle=True,
        seed=SEED,
        num_workers=num_workers,
        **kwargs,
    )


def run(it: Iterator[torch.Tensor], steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    batches, draws = [], []
    for _ in range(steps):
        batches.append(next(it))
        draws.append(train_step_draws())
    return batches, draws


def assert_bit_identical(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"step {step} differs:\n{a}\n{b}"


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """2.5 epochs with 2 workers, never stopped: batches and the training loop's draws."""
    seed_all(0)
    return run(make_loader(num_workers=2).forever(), STEPS)


@pytest.mark.parametrize(
    ("stop_after", "workers_after"),
    [
        (3, 0),  # mid-epoch 0
        (8, 0),  # mid-epoch 1
        (PER_EPOCH, 0),  # exactly at the end of epoch 0
        (8, 1),  # 2 workers -> 1
        (2 * PER_EPOCH, 2),  # end of epoch 1, same worker count
    ],
)
def test_step_loop_resumed_in_a_new_loader_is_bit_identical(
    uninterrupted: tuple[list[torch.Tensor], list[torch.Tensor]],
    stop_after: int,
    workers_after: int,
) -> None:
    seed_all(0)
    first = make_loader(num_workers=2)
    batches, draws = run(first.forever(), stop_after)
    data_state, rng_state = first.state_dict(), capture_rng_state()
    del first

    seed_all(12345)  # a new process starts with other generator states
    second = make_loader(num_workers=workers_after)
    second.load_state_dict(data_state)
    restore_rng_state(rng_state)
    more_batches, more_draws = run(second.forever(), STEPS - stop_after)

    assert_bit_identical(batches + more_batches, uninterrupted[0])
    assert_bit_identical(draws + more_draws, uninterrupted[1])


def epochs(loader: ResumableDataLoader, n_epochs: int, stop_after: int | None = None) -> list[Any]:
    """The recommended epoch loop; returns the batches, or (batches, state) when stopped early."""
    seen: list[Any] = []
    for _epoch in range(loader.epoch, n_epochs):
        for batch in loader:
            seen.append(batch)
            if len(seen) == stop_after:
                return [seen, loader.state_dict()]
    return seen


@pytest.mark.parametrize("stop_after", [5, PER_EPOCH, PER_EPOCH + 1])
def test_epoch_loop_resumed_mid_epoch_or_at_its_end_is_bit_identical(stop_after: int) -> None:
    expected = epochs(make_loader(num_workers=0), 3)
    assert len(expected) == 3 * PER_EPOCH
    first, state = epochs(make_loader(num_workers=2), 3, stop_after=stop_after)
    second = make_loader(num_workers=0)
    second.load_state_dict(state)
    assert_bit_identical(first + epochs(second, 3), expected)


def test_iterating_with_zero_workers_leaves_every_global_generator_untouched() -> None:
    loader = make_loader(num_workers=0)
    seed_all(3)
    before = capture_rng_state()
    for _ in range(2):
        for _batch in loader:
            pass
    after = capture_rng_state()
    assert after["python"] == before["python"]
    assert after["numpy"] == before["numpy"]
    assert torch.equal(after["torch"], before["torch"])


def test_plain_dataloader_iter_advances_the_global_rng_resumable_does_not() -> None:
    """The base-seed trap: iter() draws from the global torch RNG even with num_workers=0."""
    before = torch.get_rng_state()
    iter(DataLoader(AugmentedDataset(), batch_size=B))
    assert not torch.equal(torch.get_rng_state(), before), "the trap is gone from torch?"

    before = torch.get_rng_state()
    for workers in (0, 2):
        it = iter(make_loader(num_workers=workers))
        next(it)
        del it
    assert torch.equal(torch.get_rng_state(), before)


def test_augmentation_is_the_same_whatever_the_worker_count_or_world_size() -> None:
    """Every global position holds the same sample values at 1 rank, 2 ranks, then 3 ranks."""
    reference = torch.cat(epochs(make_loader(num_workers=0, per_sample_seed=True), 1))

    def rank_loaders(world: int, batch_size: int, workers: int) -> list[ResumableDataLoader]:
        return [
            ResumableDataLoader(
                AugmentedDataset(),
                batch_size=batch_size,
                shuffle=True,
                seed=SEED,
                rank=rank,
                world_size=world,
                num_workers=workers if rank == 0 else 0,
            )
            for rank in range(world)
        ]

    rows: dict[int, torch.Tensor] = {}
    two = rank_loaders(world=2, batch_size=3, workers=2)
    iterators = [iter(loader) for loader in two]
    for step in range(2):  # lockstep: 2 steps of 3 samples on each of 2 ranks
        for rank, it in enumerate(iterators):
            for j, row in enumerate(next(it)):
                rows[(step * 3 + j) * 2 + rank] = row
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    assert state["consumed"] == 12

    three = rank_loaders(world=3, batch_size=2, workers=1)
    for loader in three:
        loader.load_state_dict(state)
    for rank, loader in enumerate(three):
        local = torch.cat(list(loader))
        for j, row in enumerate(local):
            rows[12 + j * 3 + rank] = row
    assert sorted(rows) == list(range(24)), "10 remaining samples padded to 12 over 3 ranks"
    for position, row in rows.items():
        assert torch.equal(row, reference[position % N]), f"global position {position}"


def test_prefetch_runs_the_sampler_ahead_but_not_the_loaders_position() -> None:
    """The prefetch trap: with workers a sampler has handed out more than the loop consumed."""
    sampler = ResumableSampler(N, seed=SEED)
    plain = DataLoader(AugmentedDataset(), batch_size=B, sampler=sampler, num_workers=2)
    with pytest.warns(UserWarning, match="Use stalwart.ResumableDataLoader"):
        it = iter(plain)
    next(it)
    assert sampler.consumed > B, "workers should have prefetched further than one batch"
    del it

    loader = make_loader(num_workers=2)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["consumed"] == B


def collate_with_indices(rows: list[torch.Tensor]) -> dict[str, Any]:
    return {"x": torch.stack(rows), "index": [int(r[0]) for r in rows]}


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
def test_persistent_workers_pin_memory_and_custom_collate_resume_exactly() -> None:
    def make(workers: int) -> ResumableDataLoader:
        return make_loader(
            workers,
            collate_fn=collate_with_indices,
            pin_memory=True,
            persistent_workers=workers > 0,
        )

    expected = epochs(make(0), 2)
    loader = make(2)
    got: list[dict[str, Any]] = []
    for _epoch in range(loader.epoch, 2):
        it = iter(loader)
        got.append(next(it))
        got.append(next(it))
        # Leaving a pass with prefetched batches in flight, then iterating again, continues
        # right after the last batch returned (the persistent workers' stale batches are dropped).
        got.extend(loader)
    assert [b["index"] for b in got] == [b["index"] for b in expected]
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, expected, strict=True))


def test_a_batch_whose_loading_failed_counts_as_consumed() -> None:
    """DataLoader skips a failed batch; a resume must skip the same one."""
    order = epochs(make_loader(num_workers=0), 1)
    bad = int(order[1][0][0])  # first sample of the second batch
    loader = ResumableDataLoader(
        AugmentedDataset(fail_at=bad), batch_size=B, shuffle=True, seed=SEED
    )
    it = iter(loader)
    next(it)
    with pytest.raises(KeyError):
        next(it)
    assert loader.state_dict()["consumed"] == 2 * B
    assert torch.equal(next(it), order[2])


def test_an_old_iterator_is_unusable_after_a_new_one_or_a_load() -> None:
    loader = make_loader(num_workers=0)
    old = iter(loader)
    next(old)
    iter(loader)
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)
    newer = iter(loader)
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match="superseded"):
        next(newer)


def test_len_is_the_whole_epoch_in_batches() -> None:
    assert len(make_loader(num_workers=0)) == PER_EPOCH
    assert len(make_loader(num_workers=0, drop_last=True)) == N // B


def test_forever_refuses_an_epoch_without_batches() -> None:
    loader = ResumableDataLoader(AugmentedDataset(3), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="an epoch of this loader has no batch"):
        next(loader.forever())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": None}, ValueError, "needs a batch_size"),
        ({"batch_sampler": [[0]], "batch_size": 1}, ValueError, "instead of batch_sampler"),
        ({"generator": torch.Generator()}, ValueError, "pass seed=... instead of generator"),
        ({"in_order": False}, ValueError, "needs in_order=True"),
        ({"sampler": SequentialSampler(range(N))}, TypeError, "takes a ResumableSampler"),
        ({"sampler": ResumableSampler(N), "shuffle": True}, ValueError, "['shuffle'] belong to"),
    ],
)
def test_unsupported_arguments_are_refused(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        ResumableDataLoader(AugmentedDataset(), **kwargs)


def test_an_iterable_dataset_is_refused() -> None:
    with pytest.raises(TypeError, match="needs a map-style dataset"):
        ResumableDataLoader(Stream(), batch_size=2)  # type: ignore[arg-type]


def test_seeded_dataset_item_depends_only_on_its_key_and_leaves_the_callers_rng_alone() -> None:
    seeded = SeededDataset(AugmentedDataset())
    seed_all(5)
    before = capture_rng_state()
    first = seeded[(3, 99)]
    assert torch.equal(seeded[(3, 99)], first)
    assert not torch.equal(seeded[(3, 100)], first)
    after = capture_rng_state()
    assert after["python"] == before["python"]
    assert after["numpy"] == before["numpy"]
    assert torch.equal(after["torch"], before["torch"])


def test_seeded_dataset_forwards_attributes_and_needs_seeded_keys() -> None:
    seeded = SeededDataset(AugmentedDataset())
    assert seeded.n == N
    assert len(seeded) == N
    with pytest.raises(TypeError, match=r"takes \(index, sample_seed\) keys"):
        seeded[3]  # type: ignore[index]


# --- torchdata's StatefulDataLoader -------------------------------------------------------

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
# torchdata 0.11's StatefulDataLoader.__init__ calls torch.set_vital, deprecated in torch 2.13.
torchdata_warning = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def make_stateful(num_workers: int) -> tuple[Any, SeededSampler]:
    dataset = AugmentedDataset()
    sampler = SeededSampler(ResumableSampler(dataset, seed=SEED))
    loader = stateful_dataloader.StatefulDataLoader(
        SeededDataset(dataset),
        sampler=sampler,
        batch_size=B,
        num_workers=num_workers,
        generator=torch.Generator(),  # keeps iter() off the global RNG, as in ResumableDataLoader
    )
    return loader, sampler


def stateful_epochs(
    loader: Any, sampler: SeededSampler, start: int, stop_after: int | None = None
) -> tuple[list[torch.Tensor], Any]:
    seen: list[torch.Tensor] = []
    for epoch in range(start, 2):
        sampler.set_epoch(epoch)
        for batch in loader:
            seen.append(batch)
            if len(seen) == stop_after:
                return seen, (epoch, loader.state_dict())
    return seen, None


@torchdata_warning
@pytest.mark.parametrize("stop_after", [3, PER_EPOCH + 2])
def test_stateful_dataloader_with_seeded_wrapper_resumes_exactly_with_two_workers(
    stop_after: int,
) -> None:
    expected, _ = stateful_epochs(*make_stateful(num_workers=2), start=0)
    assert len(expected) == 2 * PER_EPOCH
    before = torch.get_rng_state()
    first, (epoch, state) = stateful_epochs(*make_stateful(2), start=0, stop_after=stop_after)
    assert torch.equal(torch.get_rng_state(), before), "iteration touched the global RNG"
    loader, sampler = make_stateful(num_workers=2)
    loader.load_state_dict(state)
    rest, _ = stateful_epochs(loader, sampler, start=epoch)
    assert_bit_identical(first + rest, expected)
    # Same values as ResumableDataLoader gives: per-sample seeds do not depend on the loader.
    assert_bit_identical(expected, epochs(make_loader(num_workers=0), 2))


@torchdata_warning
def test_stateful_dataloader_state_cannot_change_the_worker_count() -> None:
    """torchdata limitation (0.11): its state is per worker; use ResumableDataLoader to change it."""
    loader, sampler = make_stateful(num_workers=2)
    _, (_, state) = stateful_epochs(loader, sampler, start=0, stop_after=2)
    other, _ = make_stateful(num_workers=1)
    other.load_state_dict(state)
    with pytest.raises(AssertionError):
        iter(other)


@torchdata_warning
def test_stateful_dataloader_resumes_the_training_loops_rng_too() -> None:
    """The data loader and capture_rng_state together: the loop's own draws continue as well."""
    make: Callable[[int], tuple[Any, SeededSampler]] = make_stateful
    seed_all(1)
    loader, _ = make(2)
    reference = []
    for batch in loader:
        reference.append(torch.cat([batch.flatten(), train_step_draws()]))
    seed_all(1)
    loader, _ = make(2)
    got = []
    it = iter(loader)
    for _ in range(2):
        got.append(torch.cat([next(it).flatten(), train_step_draws()]))
    state, rng = loader.state_dict(), capture_rng_state()
    del it, loader
    seed_all(77)
    loader, _ = make(2)
    loader.load_state_dict(state)
    restore_rng_state(rng)
    for batch in loader:
        got.append(torch.cat([batch.flatten(), train_step_draws()]))
    assert_bit_identical(got, reference)
