"""The public surface is small, listed, and stable."""

import stalwart
from stalwart import errors

EXPECTED = {
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CommitConflictError",
    "CoordinationError",
    "DurableConfig",
    "DurableStoreError",
    "Guard",
    "GuardDecision",
    "GuardLimitError",
    "GuardPolicy",
    "ResumableDataLoader",
    "ResumableSampler",
    "RetryPolicy",
    "RollbackError",
    "RunLockedError",
    "StalwartError",
    "StateMismatchError",
    "TrainState",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "Watchdog",
    "__version__",
    "init_distributed",
    "shutdown_distributed",
}


def test_all_lists_exactly_the_public_names():
    assert set(stalwart.__all__) == EXPECTED
    assert len(stalwart.__all__) == len(EXPECTED)


def test_every_exported_name_exists():
    for name in stalwart.__all__:
        assert getattr(stalwart, name) is not None, name


def test_every_error_derives_from_stalwart_error_and_a_builtin():
    builtins = {
        "CheckpointNotFoundError": FileNotFoundError,
        "CheckpointCorruptError": ValueError,
        "UnsafeCheckpointError": ValueError,
        "UnsupportedFormatError": ValueError,
        "StateMismatchError": ValueError,
        "CheckpointSaveError": RuntimeError,
        "CoordinationError": RuntimeError,
        "RunLockedError": RuntimeError,
        "CommitConflictError": RuntimeError,
        "DurableStoreError": OSError,
        "GuardLimitError": RuntimeError,
        "RollbackError": RuntimeError,
    }
    for name, builtin in builtins.items():
        cls = getattr(errors, name)
        assert issubclass(cls, stalwart.StalwartError), name
        assert issubclass(cls, builtin), name
    assert issubclass(stalwart.UnsafeCheckpointError, stalwart.CheckpointCorruptError)
    assert issubclass(stalwart.CommitConflictError, stalwart.CheckpointSaveError)


def test_local_storage_satisfies_the_storage_protocol(tmp_path):
    from stalwart.storage import CheckpointStorage, LocalStorage

    assert isinstance(LocalStorage(tmp_path), CheckpointStorage)
    assert not isinstance(object(), CheckpointStorage)
