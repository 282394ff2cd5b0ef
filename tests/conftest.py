"""Shared fixtures: a small but complete training state."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import stalwart
from stalwart.cli.main import main


@dataclass
class Parts:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    extra: dict
    state: stalwart.TrainState


def seed_all(seed: int) -> None:
    """Seed the global generators a training step draws from: python, numpy, torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_parts(*, hidden: int = 8, extra: dict | None = None, **state_kwargs) -> Parts:
    model = torch.nn.Sequential(
        torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    extra = {"epoch": 0, "best": 1e9} if extra is None else extra
    state = stalwart.TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        extra=extra,
        **state_kwargs,
    )
    return Parts(model, optimizer, scheduler, scaler, extra, state)


def train_steps(parts: Parts, n: int) -> None:
    for _ in range(n):
        x = torch.randn(16, 4)
        loss = parts.model(torch.nn.functional.dropout(x, 0.2)).pow(2).mean()
        parts.optimizer.zero_grad()
        parts.scaler.scale(loss).backward()
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()
        parts.scheduler.step()
        parts.extra["best"] = min(parts.extra["best"], float(loss.detach()))
        random.random()
        np.random.rand()


def snapshot(parts: Parts) -> dict:
    """Everything that must come back, as comparable values."""
    return {
        "model": {k: v.clone() for k, v in parts.model.state_dict().items()},
        "optimizer": torch.optim.Optimizer.state_dict(parts.optimizer),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict(),
        "extra": dict(parts.extra),
        "draws": (torch.rand(3), random.random(), float(np.random.rand())),
    }


def uninterrupted(steps: int, *, seed: int = 0, **parts_kwargs) -> dict:
    """The snapshot of a run of ``steps`` training steps from ``seed`` that never stopped:
    what a resumed run must end identical to."""
    seed_all(seed)
    parts = make_parts(**parts_kwargs)
    train_steps(parts, steps)
    return snapshot(parts)


def assert_same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(autouse=True)
def _piped_console_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's tables are checked at their piped width: a ``COLUMNS`` that the shell
    running the tests exports would fold their last column."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def parts_factory() -> Callable[..., Parts]:
    return make_parts


def cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """Run the ``stalwart`` CLI in-process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, *fragments: str) -> None:
    """A CLI error is one line, no traceback, and names what went wrong."""
    assert err.startswith("stalwart: error: "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def flip_byte(path: Path, offset: int = 100) -> None:
    """Invert one byte of a file in place."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
