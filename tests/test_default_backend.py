"""``init_distributed``'s choice of backend: NCCL only where every local rank has a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

import stalwart
from stalwart.distributed import default_backend


def gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This process sees ``count`` CUDA devices (torch's answers, not stalwart's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_without_cuda_the_backend_is_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_backend() == "gloo"


@pytest.mark.parametrize(("local_world", "count"), [("1", 1), ("2", 2), ("2", 8)])
def test_a_gpu_for_every_local_rank_gives_nccl_for_cuda_and_gloo_for_cpu(
    monkeypatch: pytest.MonkeyPatch, local_world: str, count: int
) -> None:
    gpus(monkeypatch, count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    assert default_backend() == "cuda:nccl,cpu:gloo"


@pytest.mark.parametrize(("local_rank", "warns"), [("0", True), ("1", False)])
def test_more_local_ranks_than_gpus_is_gloo_on_every_rank_and_rank_0_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, local_rank: str, warns: bool
) -> None:
    gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with caplog.at_level(logging.WARNING, logger="stalwart"):
        assert default_backend() == "gloo"
    said = [r.getMessage() for r in caplog.records if "GPU" in r.getMessage()]
    if warns:
        assert said and "2 processes on this node but 1 GPU(s)" in said[0], said
        assert "at most 1 process(es) per node" in said[0]
    else:
        assert not said


def test_nccl_for_a_rank_without_a_gpu_is_refused_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus(monkeypatch, 1)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "1")  # never dialled: the check comes first
    with pytest.raises(ValueError, match=r"local rank 1 has no GPU of its own \(1 visible\)") as e:
        stalwart.init_distributed("nccl")
    assert "--nproc-per-node" in str(e.value) and "backend='gloo'" in str(e.value)
