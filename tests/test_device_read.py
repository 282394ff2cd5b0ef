"""A restore onto a CUDA device reads through two pinned buffers (``device_read``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stalwart
from stalwart import device_read

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_tensors_larger_than_a_buffer_come_back_bit_exact_onto_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_read, "BOUNCE", 1024 * 1024 + 12)  # many turns, odd lengths
    torch.manual_seed(0)
    holder = torch.nn.Module()
    values = {
        "a": torch.randn(1500, 700, device="cuda"),
        "b": torch.randn(333, 777, device="cuda").to(torch.bfloat16),
        "c": torch.randint(0, 1000, (40_099,), device="cuda"),  # past SMALL_ITEM: streamed
    }
    for key, value in values.items():
        holder.register_buffer(key, value.clone())
    state = stalwart.TrainState(model=holder, rng=False)
    calls: list[int] = []
    real = device_read.read_to_device

    def counted(checked, reads):  # type: ignore[no-untyped-def]
        calls.append(len(reads))
        real(checked, reads)

    monkeypatch.setattr("stalwart.reader.read_to_device", counted)
    with stalwart.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        ckpt.save(1, state, force=True)
        for buf in holder.buffers():
            buf.zero_()
        assert ckpt.restore(state) == 1
    assert sum(calls) == 3, "every tensor went through the pinned buffers"
    for key, value in values.items():
        assert torch.equal(getattr(holder, key), value), key
