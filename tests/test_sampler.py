"""ResumableSampler: the epoch's global order, its split over ranks, and resume at any world size."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

from stalwart.loader import ResumableDataLoader
from stalwart.sampler import (
    ResumableSampler,
    SeededDataset,
    SeededSampler,
    sample_seed,
)

sizes = st.integers(min_value=0, max_value=40)
worlds = st.integers(min_value=1, max_value=4)
seeds = st.integers(min_value=-(2**70), max_value=2**70)


def epoch_order(n: int, *, seed: int, shuffle: bool, epoch: int = 0) -> list[int]:
    """The reference global sequence of an epoch: what one rank alone sees, without padding."""
    ref = ResumableSampler(n, seed=seed, shuffle=shuffle, world_size=1, rank=0)
    ref.set_epoch(epoch)
    return list(ref)


def ranks(n: int, world: int, **kwargs: Any) -> list[ResumableSampler]:
    return [ResumableSampler(n, rank=r, world_size=world, **kwargs) for r in range(world)]


@settings(max_examples=150, deadline=None)
@given(n=sizes, world=worlds, seed=seeds, shuffle=st.booleans())
def test_one_epoch_over_all_ranks_covers_every_index_padding_like_distributed_sampler(
    n: int, world: int, seed: int, shuffle: bool
) -> None:
    """drop_last=False: every index at least once; the extra ones repeat the order's start."""
    per_rank = [list(s) for s in ranks(n, world, seed=seed, shuffle=shuffle)]
    order = epoch_order(n, seed=seed, shuffle=shuffle)
    assert sorted(order) == list(range(n))
    total = -(-n // world) * world
    assert all(len(xs) == total // world for xs in per_rank)
    merged = [per_rank[p % world][p // world] for p in range(total)]
    assert merged == [order[p % n] for p in range(total)]


@settings(max_examples=150, deadline=None)
@given(n=sizes, world=worlds, seed=seeds, shuffle=st.booleans())
def test_one_epoch_with_drop_last_has_no_repeat_and_drops_less_than_a_row(
    n: int, world: int, seed: int, shuffle: bool
) -> None:
    per_rank = [list(s) for s in ranks(n, world, seed=seed, shuffle=shuffle, drop_last=True)]
    flat = [i for xs in per_rank for i in xs]
    assert len(flat) == len(set(flat)) == n // world * world
    assert all(len(xs) == n // world for xs in per_rank)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "world"), [(10, 3), (9, 3), (2, 4), (0, 2), (7, 1)])
def test_without_shuffle_each_rank_gets_exactly_distributed_samplers_indices(
    n: int, world: int, drop_last: bool
) -> None:
    data = list(range(n))
    for rank in range(world):
        ours = ResumableSampler(n, shuffle=False, drop_last=drop_last, rank=rank, world_size=world)
        theirs = DistributedSampler(
            data,  # type: ignore[arg-type]
            num_replicas=world,
            rank=rank,
            shuffle=False,
            drop_last=drop_last,
        )
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


@settings(max_examples=50, deadline=None)
@given(seed=seeds, epoch=st.integers(min_value=0, max_value=1000))
def test_order_is_a_function_of_seed_and_epoch_only(seed: int, epoch: int) -> None:
    torch.manual_seed(0)
    first = epoch_order(50, seed=seed, shuffle=True, epoch=epoch)
    torch.manual_seed(1)  # the global RNG must play no part
    before = torch.get_rng_state()
    second = epoch_order(50, seed=seed, shuffle=True, epoch=epoch)
    assert first == second
    assert torch.equal(torch.get_rng_state(), before)


def test_different_epochs_and_seeds_give_different_orders() -> None:
    orders = {
        tuple(epoch_order(50, seed=seed, shuffle=True, epoch=epoch))
        for seed in (0, 1)
        for epoch in (0, 1, 2)
    }
    assert len(orders) == 6
    # seed + epoch must not collide (DistributedSampler seeds its generator with seed + epoch)
    assert epoch_order(50, seed=0, shuffle=True, epoch=1) != epoch_order(
        50, seed=1, shuffle=True, epoch=0
    )


@settings(max_examples=200, deadline=None)
@given(
    n=sizes,
    seed=seeds,
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_resume_at_other_world_sizes_continues_the_global_sequence_without_repeat_or_gap(
    n: int, seed: int, shuffle: bool, drop_last: bool, data: st.DataObject
) -> None:
    """Segments at world sizes N1, N2, ... each resumed from the last one's state."""
    segment_worlds = data.draw(st.lists(worlds, min_size=1, max_size=4), label="worlds")
    order = epoch_order(n, seed=seed, shuffle=shuffle)
    seen: dict[int, int] = {}  # global position -> index
    state: dict[str, Any] | None = None
    for number, world in enumerate(segment_worlds):
        samplers = ranks(n, world, seed=seed, shuffle=shuffle, drop_last=drop_last)
        if state is not None:
            for s in samplers:
                s.load_state_dict(state)
        start = samplers[0].consumed
        left = samplers[0].remaining
        assert all(s.remaining == left for s in samplers), "ranks must get equal counts"
        last = number == len(segment_worlds) - 1
        take = left if last else data.draw(st.integers(0, left), label="take")
        iterators = [iter(s) for s in samplers]
        for j in range(take):  # lockstep, as DDP runs the ranks
            for rank, it in enumerate(iterators):
                seen[start + j * world + rank] = next(it)
        states = [s.state_dict() for s in samplers]
        assert all(st_ == states[0] for st_ in states), "every rank holds the same global state"
        assert states[0]["consumed"] == start + take * world
        state = states[0]
    assert sorted(seen) == list(range(len(seen))), "no gap in the global sequence"
    assert all(index == order[p % n] for p, index in seen.items()), "same sequence as one rank"
    real = [seen[p] for p in range(min(len(seen), n))]
    assert len(real) == len(set(real)), "no repeat before the padding"
    if drop_last:
        assert len(seen) <= n
        assert n - len(seen) < max(segment_worlds)
    else:
        assert set(seen.values()) == set(range(n)), "every index consumed"
        assert len(seen) - n < max(segment_worlds)


def test_exhausting_the_iterator_moves_to_the_next_epoch() -> None:
    s = ResumableSampler(5, seed=3)
    assert list(s)
    assert s.state_dict()["epoch"] == 1
    assert s.consumed == 0
    s.set_epoch(1)  # the usual `set_epoch(epoch)` at the top of the loop is then a no-op
    assert list(s) == epoch_order(5, seed=3, shuffle=True, epoch=1)


def test_set_epoch_keeps_a_restored_position_in_the_same_epoch_and_resets_on_another() -> None:
    s = ResumableSampler(10, seed=0)
    s.load_state_dict({"epoch": 2, "consumed": 4, "seed": 0, "shuffle": True, "dataset_len": 10})
    s.set_epoch(2)
    assert (s.epoch, s.consumed) == (2, 4)
    assert list(s) == epoch_order(10, seed=0, shuffle=True, epoch=2)[4:]
    s.set_epoch(5)
    assert (s.epoch, s.consumed) == (5, 0)


def test_state_counts_indices_handed_out() -> None:
    s = ResumableSampler(10, seed=0, rank=1, world_size=3)
    it = iter(s)
    next(it)
    next(it)
    assert s.state_dict() == {
        "epoch": 0,
        "consumed": 6,
        "seed": 0,
        "shuffle": True,
        "dataset_len": 10,
    }


def test_len_is_the_whole_epoch_and_remaining_the_rest() -> None:
    s = ResumableSampler(10, rank=0, world_size=3)
    it = iter(s)
    next(it)
    assert (len(s), s.remaining) == (4, 3)


def test_an_iterator_superseded_by_load_state_dict_raises() -> None:
    s = ResumableSampler(10)
    it = iter(s)
    next(it)
    s.load_state_dict(s.state_dict())
    with pytest.raises(RuntimeError, match="superseded"):
        next(it)


GOOD = {"epoch": 1, "consumed": 3, "seed": 7, "shuffle": True, "dataset_len": 10}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"dataset_len": 11},
            "saved for a dataset of 11 samples, but this sampler's dataset has 10",
        ),
        ({"seed": 8}, "saved with seed=8, but this sampler has seed=7; construct it with seed=8"),
        ({"shuffle": False}, "saved with shuffle=False, but this sampler has shuffle=True"),
        ({"consumed": -1}, "state_dict['consumed'] must be >= 0, got -1"),
        ({"epoch": 1.5}, "state_dict['epoch'] must be an int, got 1.5"),
        ({"shuffle": 1}, "state_dict['shuffle'] must be a bool, got 1"),
        ({"consumed": None}, "state_dict['consumed'] must be an int, got None"),
    ],
)
def test_a_state_for_another_order_or_of_the_wrong_shape_is_a_value_error(
    change: dict[str, Any], message: str
) -> None:
    s = ResumableSampler(10, seed=7)
    with pytest.raises(ValueError, match=re.escape(message)):
        s.load_state_dict({**GOOD, **change})
    assert (s.epoch, s.consumed) == (0, 0), "a rejected state changes nothing"


def test_a_state_missing_keys_is_a_value_error_naming_them() -> None:
    with pytest.raises(ValueError, match=re.escape("lacks ['consumed', 'dataset_len']")):
        ResumableSampler(10).load_state_dict({"epoch": 0, "seed": 0, "shuffle": True})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "world_size": 2}, "rank must be in [0, world_size), got rank=2"),
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
        ({"seed": "x"}, "seed must be an int, got 'x'"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ResumableSampler(10, **kwargs)


def test_seeded_sampler_pairs_each_index_with_its_sample_seed_and_shares_the_position() -> None:
    inner = ResumableSampler(6, seed=5)
    inner.set_epoch(2)
    seeded = SeededSampler(inner)
    pairs = list(seeded)
    assert [i for i, _ in pairs] == epoch_order(6, seed=5, shuffle=True, epoch=2)
    assert all(s == sample_seed(5, 2, i) for i, s in pairs)
    assert seeded.state_dict() == inner.state_dict()
    assert seeded.epoch == 3


def test_sample_seed_depends_on_seed_epoch_and_index() -> None:
    base = sample_seed(0, 0, 0)
    assert len({base, sample_seed(1, 0, 0), sample_seed(0, 1, 0), sample_seed(0, 0, 1)}) == 4
    assert 0 <= base < 2**64


# --- misuse: a sampler iterated ahead of the loop -----------------------------------------


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index * index])


def test_a_sampler_inside_a_dataloader_with_workers_warns_once_naming_the_fix() -> None:
    sampler = ResumableSampler(64, seed=1)
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=4, sampler=sampler, num_workers=2)
    with pytest.warns(UserWarning, match="Use stalwart.ResumableDataLoader") as caught:
        for _ in zip(range(3), loader, strict=False):
            pass
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(loader))  # a second pass: no second warning


def test_a_seeded_sampler_inside_a_dataloader_with_workers_warns() -> None:
    sampler = SeededSampler(ResumableSampler(64, seed=1))
    dataset = SeededDataset(_Squares())
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=1)
    with pytest.warns(UserWarning, match="ResumableDataLoader"):
        next(iter(loader))


@pytest.mark.parametrize(
    "make",
    [
        lambda s: iter(s),
        lambda s: iter(torch.utils.data.DataLoader(_Squares(), batch_size=4, sampler=s)),
        lambda s: iter(ResumableDataLoader(_Squares(), batch_size=4, sampler=s, num_workers=2)),
    ],
    ids=["standalone", "dataloader-without-workers", "resumable-dataloader-with-workers"],
)
def test_the_correct_uses_do_not_warn(make: Any) -> None:
    sampler = ResumableSampler(64, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        it = make(sampler)
        for _ in range(3):
            next(it)
