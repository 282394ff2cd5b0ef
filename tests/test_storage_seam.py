"""The storage seam: each backend satisfies its Protocol, and the manager uses what it is given."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import stalwart
from stalwart.storage.base import CheckpointStorage, DurableMirror
from stalwart.storage.durable import DurableTier
from stalwart.storage.local import LocalStorage

from .conftest import make_parts, train_steps
from .faults.faulty import FaultyStorage


def _protocol_methods(protocol: type) -> list[str]:
    return [
        name
        for name, value in vars(protocol).items()
        if callable(value) and not name.startswith("_")
    ]


def _assert_same_parameters(protocol: type, implementation: object) -> None:
    for name in _protocol_methods(protocol):
        wanted = list(inspect.signature(getattr(protocol, name)).parameters)[1:]
        got = list(inspect.signature(getattr(implementation, name)).parameters)
        assert got == wanted, f"{type(implementation).__name__}.{name}{got} != {wanted}"


@pytest.mark.parametrize("make", [LocalStorage, lambda root: FaultyStorage(root, None)])
def test_primary_backends_satisfy_checkpoint_storage(tmp_path: Path, make) -> None:
    storage = make(tmp_path)
    assert isinstance(storage, CheckpointStorage)
    _assert_same_parameters(CheckpointStorage, storage)


def test_the_durable_tier_satisfies_durable_mirror(tmp_path: Path) -> None:
    tier = DurableTier(tmp_path.as_uri())
    assert isinstance(tier, DurableMirror)
    _assert_same_parameters(DurableMirror, tier)


def test_protocol_check_can_fail(tmp_path: Path) -> None:
    class NoQuarantine:
        def begin(self, step: int) -> Path:
            return tmp_path

    assert not isinstance(NoQuarantine(), CheckpointStorage)


def test_manager_writes_and_reads_through_the_storage_it_is_given(tmp_path: Path) -> None:
    run = tmp_path / "run"
    storage = FaultyStorage(run, None)
    parts = make_parts()
    with stalwart.CheckpointManager(run, storage=storage, handle_signals=False) as ckpt:
        train_steps(parts, 1)
        assert ckpt.save(1, parts.state)
        assert ckpt.restore(make_parts().state) == 1
    assert storage.calls["begin"] == 1 and storage.calls["commit"] == 1


def test_manager_refuses_a_storage_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"storage must implement .*CheckpointStorage.*got str"):
        stalwart.CheckpointManager(tmp_path / "run", storage="s3://bucket")  # type: ignore[arg-type]


def test_durable_config_names_the_field_it_refuses() -> None:
    with pytest.raises(ValueError, match=r"DurableConfig\.max_pending must be a positive integer"):
        stalwart.DurableConfig(url="s3://bucket/run", max_pending=0)
    with pytest.raises(ValueError, match=r"DurableConfig\.keep_last .*got 'all'"):
        stalwart.DurableConfig(url="s3://bucket/run", keep_last="all")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"DurableConfig\.retry must be a stalwart\.RetryPolicy"):
        stalwart.DurableConfig(url="s3://bucket/run", retry=30)  # type: ignore[arg-type]
    assert stalwart.DurableConfig(url="s3://bucket/run", keep_last=None).keep_last is None
