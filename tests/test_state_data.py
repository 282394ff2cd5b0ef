"""TrainState(data=...) with each supported data source, through a real checkpoint."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.utils.data import Dataset

import stalwart
from stalwart.sampler import ResumableSampler, SeededDataset, SeededSampler

warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
from torchdata import stateful_dataloader  # noqa: E402 - after the warning filter above


class Noisy(Dataset):
    def __len__(self) -> int:
        return 26

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(2) + index


def _stateful(workers: int):
    sampler = SeededSampler(ResumableSampler(Noisy(), shuffle=True, seed=4))
    loader = stateful_dataloader.StatefulDataLoader(
        SeededDataset(Noisy()),
        sampler=sampler,
        batch_size=3,
        num_workers=workers,
        generator=torch.Generator(),
    )
    return loader, sampler


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_mid_epoch_through_a_checkpoint(tmp_path, workers):
    loader, sampler = _stateful(workers)
    sampler.set_epoch(0)
    reference = list(loader)

    loader, sampler = _stateful(workers)
    sampler.set_epoch(0)
    it = iter(loader)
    seen = [next(it) for _ in range(4)]
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(4, stalwart.TrainState(data=loader, rng=False))
    del it

    loader, sampler = _stateful(workers)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(stalwart.TrainState(data=loader, rng=False)) == 4
    sampler.set_epoch(0)
    rest = list(loader)
    assert len(seen) + len(rest) == len(reference)
    for got, want in zip(seen + rest, reference, strict=True):
        assert torch.equal(got, want)


def test_resumable_dataloader_position_and_epoch_go_into_the_checkpoint(tmp_path):
    loader = stalwart.ResumableDataLoader(Noisy(), batch_size=4, shuffle=True, seed=1)
    batches = loader.forever()
    for _ in range(9):  # 7 batches per epoch: this is epoch 1, batch 2
        next(batches)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(9, stalwart.TrainState(data=loader, rng=False))
    reference = [next(batches) for _ in range(5)]

    fresh = stalwart.ResumableDataLoader(Noisy(), batch_size=4, shuffle=True, seed=1, num_workers=2)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(stalwart.TrainState(data=fresh, rng=False)) == 9
    assert fresh.epoch == 1
    resumed = fresh.forever()
    for want in reference:
        assert torch.equal(next(resumed), want)

    manifest = json.loads((tmp_path / "step_000000009" / "MANIFEST.json").read_text())
    assert manifest["epoch"] == 1
