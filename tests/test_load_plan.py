"""SafeLoadPlanner's local plan: plain tensors saved whole are planned directly, and the
plan is DCP's own, item for item, whatever the state and the checkpoint hold."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan

import stalwart.safe_load as safe_load_module
from stalwart.safe_load import SafeLoadPlanner


def _tensor_md(shape: tuple[int, ...], *chunks: tuple[tuple[int, ...], tuple[int, ...]]) -> Any:
    size = torch.Size(shape)
    found = chunks or ((tuple(0 for _ in shape), shape),)
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=size,
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in found],
    )


def _metadata(entries: dict[str, Any]) -> Metadata:
    return Metadata(state_dict_metadata=entries)


def _plan(planner: DefaultLoadPlanner, state: dict[str, Any], md: Metadata) -> LoadPlan:
    planner.set_up_planner(state, md, True)
    return planner.create_local_plan()


def _fields(plan: LoadPlan) -> list[tuple[Any, ...]]:
    # MetadataIndex leaves its ``index`` hint out of equality: compare it too.
    return [
        (
            item.type,
            item.dest_index,
            item.dest_index.index,
            item.dest_offsets,
            item.storage_index,
            item.storage_index.index,
            item.storage_offsets,
            item.lengths,
        )
        for item in plan.items
    ]


def _outcome(planner: DefaultLoadPlanner, state: dict[str, Any], md: Metadata) -> Any:
    try:
        plan = _plan(planner, state, md)
    except Exception as exc:  # the same error, word for word
        return (type(exc), str(exc))
    return _fields(plan), list(planner.state_dict), dict(planner.mappings)


def _model_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    return {"model": dict(model.state_dict()), "step": 7, "scalar": torch.tensor(2.5)}


def _saved_like(state: dict[str, Any]) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for key, value in state["model"].items():
        entries[f"model.{key}"] = _tensor_md(tuple(value.shape))
    entries["step"] = BytesStorageMetadata()
    entries["scalar"] = _tensor_md(())
    return entries


CASES: dict[str, Any] = {}


def _case(name: str) -> Any:
    def register(fn: Any) -> Any:
        CASES[name] = fn
        return fn

    return register


@_case("every key, saved whole")
def _same() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    return state, _saved_like(state), False


@_case("checkpoint has more keys (a split restore)")
def _more_saved() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    entries = _saved_like(state)
    entries["optim.state.0.exp_avg"] = _tensor_md((3, 4))
    entries["extra"] = BytesStorageMetadata()
    return state, entries, False


@_case("a key the checkpoint lacks, strict")
def _missing_strict() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    entries = _saved_like(state)
    del entries["model.0.bias"]
    return state, entries, False


@_case("a key the checkpoint lacks, partial load")
def _missing_partial() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    entries = _saved_like(state)
    del entries["model.0.bias"]
    return state, entries, True


@_case("another size")
def _other_size() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    entries = _saved_like(state)
    entries["model.0.weight"] = _tensor_md((3, 5))
    return state, entries, False


@_case("saved in two chunks")
def _two_chunks() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    entries = _saved_like(state)
    entries["model.0.weight"] = _tensor_md((3, 4), ((0, 0), (2, 4)), ((2, 0), (1, 4)))
    return state, entries, False


@_case("one chunk at an offset")
def _offset_chunk() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    entries = _saved_like(state)
    entries["model.0.weight"] = _tensor_md((3, 4), ((1, 0), (2, 4)))
    return state, entries, False


@_case("a tensor where the checkpoint has bytes")
def _tensor_for_bytes() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    entries = _saved_like(state)
    entries["model.0.weight"] = BytesStorageMetadata()
    return state, entries, False


@_case("a plain value where the checkpoint has a tensor")
def _value_for_tensor() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    entries = _saved_like(state)
    entries["step"] = _tensor_md((1,))
    return state, entries, False


@_case("a tensor subclass")
def _subclass() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    state["model"]["0.weight"] = torch.nn.Parameter(state["model"]["0.weight"])
    return state, _saved_like(state), False


@_case("torch 2.3's keys: a dict saved whole")
def _old_keys() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    state["hparams"] = {"lr": 0.1, "betas": [0.9, 0.99]}
    entries = _saved_like(state)
    entries["hparams"] = BytesStorageMetadata()
    return state, entries, False


@_case("an empty container the checkpoint has as a value")
def _empty_container() -> tuple[dict[str, Any], dict[str, Any], bool]:
    state = _model_state()
    state["notes"] = {}
    entries = _saved_like(state)
    entries["notes"] = BytesStorageMetadata()
    return state, entries, False


@pytest.mark.parametrize("name", sorted(CASES))
def test_local_plan_is_dcps_own(name: str) -> None:
    state, entries, partial = CASES[name]()
    ours = _outcome(SafeLoadPlanner(allow_partial_load=partial), _copy(state), _metadata(entries))
    theirs = _outcome(
        DefaultLoadPlanner(allow_partial_load=partial), _copy(state), _metadata(entries)
    )
    assert ours == theirs


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}


def test_plain_tensors_skip_dcps_search(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    dcp_plan = safe_load_module.create_default_local_load_plan

    def counting(state_dict: dict[str, Any], *args: Any) -> LoadPlan:
        calls.append(list(state_dict))
        return dcp_plan(state_dict, *args)

    monkeypatch.setattr(safe_load_module, "create_default_local_load_plan", counting)
    state, entries, _ = CASES["checkpoint has more keys (a split restore)"]()
    plan = _plan(SafeLoadPlanner(), state, _metadata(entries))
    # Only the non-tensor value went to DCP; the model's tensors and the 0-d one did not.
    assert calls == [["step"]]
    assert len(plan.items) == len(state["model"]) + 2

    calls.clear()
    state, entries, _ = CASES["saved in two chunks"]()
    _plan(SafeLoadPlanner(), state, _metadata(entries))
    assert ["model.0.weight"] in calls  # resharding is DCP's business
