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


def _edit(state: dict[str, Any], entries: dict[str, Any], change: str) -> None:
    """Apply one named change to a state and the checkpoint entries saved from it."""
    if change == "more saved":
        entries["optim.state.0.exp_avg"] = _tensor_md((3, 4))
        entries["extra"] = BytesStorageMetadata()
    elif change == "missing":
        del entries["model.0.bias"]
    elif change == "other size":
        entries["model.0.weight"] = _tensor_md((3, 5))
    elif change == "two chunks":
        entries["model.0.weight"] = _tensor_md((3, 4), ((0, 0), (2, 4)), ((2, 0), (1, 4)))
    elif change == "offsets of another rank":  # crafted: one offset for a 2-d tensor
        entries["model.0.weight"] = _tensor_md((3, 4), ((0,), (3, 4)))
    elif change == "offset chunk":
        entries["model.0.weight"] = _tensor_md((3, 4), ((1, 0), (2, 4)))
    elif change == "bytes for tensor":
        entries["model.0.weight"] = BytesStorageMetadata()
    elif change == "tensor for value":
        entries["step"] = _tensor_md((1,))
    elif change == "subclass":
        state["model"]["0.weight"] = torch.nn.Parameter(state["model"]["0.weight"])
    elif change == "old keys":
        state["hparams"] = {"lr": 0.1, "betas": [0.9, 0.99]}
        entries["hparams"] = BytesStorageMetadata()
    elif change == "empty container":
        state["notes"] = {}
        entries["notes"] = BytesStorageMetadata()
    else:
        assert change == "none", change


CASES: dict[str, tuple[str, bool]] = {
    "every key, saved whole": ("none", False),
    "checkpoint has more keys (a split restore)": ("more saved", False),
    "a key the checkpoint lacks, strict": ("missing", False),
    "a key the checkpoint lacks, partial load": ("missing", True),
    "another size": ("other size", False),
    "saved in two chunks": ("two chunks", False),
    "one chunk at an offset": ("offset chunk", False),
    "a chunk whose offsets have another rank": ("offsets of another rank", False),
    "a tensor where the checkpoint has bytes": ("bytes for tensor", False),
    "a plain value where the checkpoint has a tensor": ("tensor for value", False),
    "a tensor subclass": ("subclass", False),
    "torch 2.3's keys: a dict saved whole": ("old keys", False),
    "an empty container the checkpoint has as a value": ("empty container", False),
}
"""Each case: the change to a plain model's state and checkpoint, and whether the load is partial."""


def _build(name: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
    change, partial = CASES[name]
    state = _model_state()
    entries = _saved_like(state)
    _edit(state, entries, change)
    return state, entries, partial


@pytest.mark.parametrize("name", sorted(CASES))
def test_local_plan_is_dcps_own(name: str) -> None:
    state, entries, partial = _build(name)
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
    state, entries, _ = _build("checkpoint has more keys (a split restore)")
    plan = _plan(SafeLoadPlanner(), state, _metadata(entries))
    # Only the non-tensor value went to DCP; the model's tensors and the 0-d one did not.
    assert calls == [["step"]]
    assert len(plan.items) == len(state["model"]) + 2

    calls.clear()
    state, entries, _ = _build("saved in two chunks")
    _plan(SafeLoadPlanner(), state, _metadata(entries))
    assert ["model.0.weight"] in calls  # resharding is DCP's business
