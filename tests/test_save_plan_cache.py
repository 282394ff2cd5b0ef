"""``SavePlanCache``: a save reuses the last save's plan only while the layout is the same."""

from __future__ import annotations

import dataclasses
import io
import pickle
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.utils import find_state_dict_object

import stalwart
from stalwart.save_plan import CachingSavePlanner, SavePlanCache
from stalwart.writer import ChecksummingWriter, RecordTemplates, record_settings, without_zip_crc

from .conftest import assert_same

_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"


def save(sd: dict[str, object], path: Path, cache: SavePlanCache) -> None:
    """One ``dcp.save`` as the pipeline runs it: stalwart's writer and planner, one cache."""
    writer = ChecksummingWriter(path, templates=RecordTemplates(), plans=cache)
    try:
        with warnings.catch_warnings(), without_zip_crc():
            warnings.filterwarnings("ignore", message=_NO_DIST)
            planner = CachingSavePlanner(cache, settings=record_settings())
            dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
        writer.sync()
    finally:
        writer.close()


def staging(root: Path) -> Path:
    """A new directory named as a save's staging directory (names of one length, each unique)."""
    return root / f".step_000000001.tmp-{uuid.uuid4().hex}"


def dcp_load(target: dict[str, object], path: Path) -> dict[str, object]:
    """torch's own reader, not stalwart's: the files are standard DCP files."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    return target


def zeros_like(sd: dict[str, object]) -> dict[str, object]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def base() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 6, generator=g),
        "ids": torch.arange(12, dtype=torch.float32),
        "lr": 0.1,
        "name": "run",
    }


def reshaped(sd: dict[str, object]) -> None:
    sd["w"] = sd["w"].reshape(6, 4).clone()  # the same bytes, another shape


def retyped(sd: dict[str, object]) -> None:
    sd["ids"] = torch.arange(12, dtype=torch.int32)  # the same byte count, another dtype


def new_key(sd: dict[str, object]) -> None:
    sd["bias"] = torch.ones(6)


def dropped_key(sd: dict[str, object]) -> None:
    del sd["ids"]


def grad_flag(sd: dict[str, object]) -> None:
    sd["w"] = sd["w"].clone().requires_grad_(True)


def longer_value(sd: dict[str, object]) -> None:
    sd["name"] = "n" * 1000  # every later record moves: new storage offsets


CHANGES: dict[str, Callable[[dict[str, object]], None]] = {
    "reshaped tensor": reshaped,
    "dtype of the same size": retyped,
    "new key": new_key,
    "dropped key": dropped_key,
    "requires_grad": grad_flag,
}


def check_reads_back(sd: dict[str, object], path: Path) -> None:
    back = dcp_load(zeros_like(sd), path)
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
            assert torch.equal(back[key], value.detach()), key
        else:
            assert back[key] == value, key
    md = pickle.loads((path / ".metadata").read_bytes())
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            entry = md.state_dict_metadata[key]
            assert (entry.size, entry.properties.dtype) == (value.shape, value.dtype), key
            assert entry.properties.requires_grad == value.requires_grad, key
    assert set(md.state_dict_metadata) == set(sd)


def saved_twice(tmp_path: Path) -> tuple[SavePlanCache, dict[str, object], Path, Path]:
    """``base()`` saved twice with one cache: (cache, the state, the second save's
    directory, a fresh directory for a third save)."""
    cache, sd = SavePlanCache(), base()
    a, b, c = staging(tmp_path), staging(tmp_path), staging(tmp_path)
    save(sd, a, cache)
    save(sd, b, cache)
    return cache, sd, b, c


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_layout_is_planned_anew_and_reads_back_exactly(
    tmp_path: Path, change: str
) -> None:
    cache, sd, b, c = saved_twice(tmp_path)
    assert (cache.misses, cache.hits) == (1, 1)
    CHANGES[change](sd)
    save(sd, c, cache)
    assert (cache.misses, cache.hits) == (2, 1)
    check_reads_back(sd, c)
    check_reads_back(base(), b)


def test_new_storage_offsets_under_the_same_plan_are_written_to_the_metadata(
    tmp_path: Path,
) -> None:
    """A longer value moves the records after it: the plan is reused, ``.metadata`` is not."""
    cache, sd, b, c = saved_twice(tmp_path)
    longer_value(sd)
    save(sd, c, cache)
    assert (cache.misses, cache.hits) == (1, 2)
    check_reads_back(sd, c)
    offsets = [
        sorted(i.offset for i in pickle.loads((p / ".metadata").read_bytes()).storage_data.values())
        for p in (b, c)
    ]
    assert offsets[0] != offsets[1]


def test_an_unchanged_layout_reuses_the_plan_and_new_values_are_written(tmp_path: Path) -> None:
    cache = SavePlanCache()
    for n in range(3):
        sd = base()
        sd["w"] = sd["w"] + n
        sd["lr"] = 0.1 * (n + 1)
        path = staging(tmp_path)
        save(sd, path, cache)
        check_reads_back(sd, path)
    assert (cache.misses, cache.hits) == (1, 2)


def test_a_reused_metadata_pickle_is_the_pickle_of_this_saves_metadata(tmp_path: Path) -> None:
    """Only the directory's name and the save id change: the bytes are pickle's own."""
    cache = SavePlanCache()
    ids = set()
    for _ in range(3):
        path = staging(tmp_path)
        save(base(), path, cache)
        data = (path / ".metadata").read_bytes()
        md = pickle.loads(data)
        assert md.storage_meta.checkpoint_id == path
        assert pickle.dumps(md) == data
        ids.add(md.storage_meta.save_id)
    assert len(ids) == 3


def test_a_key_that_holds_the_last_directory_name_is_not_spliced(tmp_path: Path) -> None:
    """A state key containing the last save's directory name: the name is in the bytes
    twice, so replacing it would rename the key too; the metadata is pickled anew."""
    cache = SavePlanCache()
    first, second = staging(tmp_path), staging(tmp_path)
    sd = {**base(), f"x/{first.name}": torch.ones(3)}
    save(sd, first, cache)
    save(sd, second, cache)
    data = (second / ".metadata").read_bytes()
    md = pickle.loads(data)
    assert md.storage_meta.checkpoint_id == second
    assert f"x/{first.name}" in md.state_dict_metadata
    assert pickle.dumps(md) == data
    check_reads_back(sd, second)


def test_a_directory_name_of_another_length_is_pickled_anew(tmp_path: Path) -> None:
    cache = SavePlanCache()
    save(base(), tmp_path / "short", cache)
    save(base(), tmp_path / "a_longer_name", cache)
    data = (tmp_path / "a_longer_name" / ".metadata").read_bytes()
    assert pickle.loads(data).storage_meta.checkpoint_id == tmp_path / "a_longer_name"
    check_reads_back(base(), tmp_path / "a_longer_name")


def test_the_global_plan_is_rebuilt_for_another_number_of_ranks() -> None:
    """The key is every rank's local plan: one more rank is another layout."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(base(), None, True)
    plan = planner.create_local_plan()
    cache = SavePlanCache()
    built = DefaultSavePlanner().create_global_plan([plan])
    cache.keep_global_plan([plan], *built)
    assert cache.global_plan([plan]) is not None
    assert cache.global_plan([plan, plan]) is None
    assert cache.global_plan([]) is None


def local_plan(
    planner: DefaultSavePlanner, sd: dict[str, object], *, coordinator: bool = True
) -> SavePlan:
    planner.set_up_planner(sd, None, coordinator)
    return planner.create_local_plan()


def to_value(sd: dict[str, object]) -> None:
    sd["ids"] = [1, 2, 3]  # a tensor's key now holds plain data


def to_tensor(sd: dict[str, object]) -> None:
    sd["lr"] = torch.tensor(0.1)  # plain data's key now holds a tensor


def reordered(sd: dict[str, object]) -> None:
    items = list(sd.items())
    sd.clear()
    sd.update(reversed(items))


def nested(sd: dict[str, object]) -> None:
    sd["w"] = {"inner": sd.pop("w")}  # another key after flattening


def transposed(sd: dict[str, object]) -> None:
    sd["w"] = sd["w"].t().contiguous().t()  # the same shape, another stride and new memory


LOCAL_CHANGES: dict[str, Callable[[dict[str, object]], None]] = {
    **CHANGES,
    "tensor becomes plain data": to_value,
    "plain data becomes a tensor": to_tensor,
    "keys reordered": reordered,
    "nested under a new key": nested,
    "transposed view": transposed,
}


@pytest.mark.parametrize("change", list(LOCAL_CHANGES))
def test_the_local_plan_is_dcps_own_after_any_change(change: str) -> None:
    """With a cache primed on ``base()``, a changed state gets exactly DCP's fresh local plan."""
    cache = SavePlanCache()
    primed = local_plan(CachingSavePlanner(cache, settings=None), base())
    sd = base()
    LOCAL_CHANGES[change](sd)
    mine = local_plan(CachingSavePlanner(cache, settings=None), sd)
    assert mine == local_plan(DefaultSavePlanner(), sd)
    if change == "transposed view":  # nothing a write item records changed: reused
        assert all(a is b for a, b in zip(mine.items, primed.items, strict=True))
    else:
        assert mine.items != primed.items


def test_an_unchanged_state_reuses_the_local_items_and_the_rank_kind_is_part_of_the_key() -> None:
    cache = SavePlanCache()
    first = local_plan(CachingSavePlanner(cache, settings=None), base())
    again = local_plan(CachingSavePlanner(cache, settings=None), base())
    assert again == first and all(a is b for a, b in zip(again.items, first.items, strict=True))
    other = local_plan(CachingSavePlanner(cache, settings=None), base(), coordinator=False)
    assert other == local_plan(DefaultSavePlanner(), base(), coordinator=False)
    assert not any(a is b for a, b in zip(other.items, first.items, strict=True))


class Marked(torch.Tensor):
    """A tensor subclass: DCP may plan it its own way (as DTensor does), so it is never cached."""


def test_a_tensor_subclass_is_planned_by_dcp_every_time() -> None:
    cache = SavePlanCache()
    sd = base()
    sd["w"] = sd["w"].as_subclass(Marked)
    first = local_plan(CachingSavePlanner(cache, settings=None), sd)
    again = local_plan(CachingSavePlanner(cache, settings=None), sd)
    assert again == first == local_plan(DefaultSavePlanner(), sd)
    assert not any(a is b for a, b in zip(again.items, first.items, strict=True))


def test_the_planner_sees_dcps_flattened_state_and_finds_every_item_as_dcp_does() -> None:
    sd = base()
    sd["opt"] = {"state": {0: {"m": torch.ones(3)}}, "groups": [{"lr": 0.1}]}
    sd["sub"] = torch.zeros(2, 2).as_subclass(Marked)
    mine, ref = CachingSavePlanner(SavePlanCache(), settings=None), DefaultSavePlanner()
    plan = local_plan(mine, sd)
    local_plan(ref, sd)
    assert list(mine.state_dict) == list(ref.state_dict) and mine.mappings == ref.mappings
    for item in plan.items:
        assert mine.lookup_object(item.index) is find_state_dict_object(ref.state_dict, item.index)
    w = next(i for i in plan.items if i.index.fqn == "w")
    with pytest.raises(ValueError, match="can't find by offset"):
        mine.lookup_object(dataclasses.replace(w.index, offset=torch.Size([1, 0])))
    with pytest.raises(ValueError, match="can't find by offset"):
        mine.lookup_object(dataclasses.replace(w.index, offset=torch.Size([0])))
    with pytest.raises(ValueError, match="Could not find FQN"):
        mine.lookup_object(dataclasses.replace(w.index, fqn="missing"))


@pytest.mark.parametrize(
    ("before", "after"),
    [(0.0, -0.0), (1, True), (1, 1.0), ([1, 2], (1, 2)), ([1, [2]], [1, [2.0]]), ("ab", b"ab")],
)
def test_a_small_value_is_reused_only_when_its_pickle_is_the_same(
    tmp_path: Path, before: object, after: object
) -> None:
    """Values Python calls equal (0.0 == -0.0, 1 == True) are still other bytes."""
    cache = SavePlanCache()
    save({"v": before}, staging(tmp_path), cache)
    path = staging(tmp_path)
    save({"v": after}, path, cache)
    back = dcp_load({"v": None}, path)["v"]
    assert back == after and type(back) is type(after)
    if isinstance(after, float):
        assert str(back) == str(after)  # the sign of zero


class Box(dict):
    """A subclass of a plain type: its pickle names the class, which may save differently."""


def test_a_value_that_is_not_plain_data_is_saved_every_time() -> None:
    cache = SavePlanCache()
    settings = record_settings() or ("no crc",)
    for value in (Box(a=1), {"t": torch.ones(2)}):
        first = cache.saved_value(value, settings).getvalue()
        assert first == cache.saved_value(value, settings).getvalue()
    assert len(cache._values) == 0  # nothing of them was kept


def test_two_managers_in_one_process_keep_their_own_plans(tmp_path: Path) -> None:
    """Unlike DCP's process-wide plan caching, one run never sees another's plan."""
    models = [torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)]  # the same key names and byte counts
    states = [stalwart.TrainState(model=m, rng=False) for m in models]
    managers = [
        stalwart.CheckpointManager(tmp_path / f"run{n}", keep_last=None, handle_signals=False)
        for n in range(2)
    ]
    try:
        for step in (1, 2, 3):
            for manager, state, model in zip(managers, states, models, strict=True):
                with torch.no_grad():
                    model.weight.add_(1.0)
                manager.save(step, state, force=True)
        for n, manager in enumerate(managers):
            fresh = torch.nn.Linear(*models[n].weight.shape[::-1])
            assert manager.restore(stalwart.TrainState(model=fresh, rng=False)) == 3
            assert_same(fresh.state_dict(), models[n].state_dict())
    finally:
        for manager in managers:
            manager.close()


def training(hidden: int, *, buffer: torch.dtype = torch.float32) -> tuple:
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))
    model.register_buffer("counts", torch.zeros(6, dtype=buffer))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(3, 4)).pow(2).mean()
    (loss + 1e-3 * sum(p.sum() for p in model.parameters())).backward()  # every parameter
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model.counts += 1


def grow_param_group(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple:
    extra = torch.nn.Parameter(torch.randn(6))
    model.register_parameter("scale", extra)
    opt.add_param_group({"params": [extra], "lr": 5e-3})
    return model, opt


def retype_buffer(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple:
    model.counts = model.counts.to(torch.int32)  # the same bytes, another dtype
    return model, opt


def rebuild(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple:
    return training(3)  # 4*3 + 3*2 parameters... other shapes, the same key names


def fresh_like(change: str) -> tuple:
    if change == "new param group":
        return grow_param_group(*training(8))
    if change == "buffer dtype":
        return training(8, buffer=torch.int32)
    return training(3)


MANAGER_CHANGES = {
    "new param group": grow_param_group,
    "buffer dtype": retype_buffer,
    "other shapes": rebuild,
}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("change", list(MANAGER_CHANGES))
def test_a_run_whose_model_changes_restores_every_checkpoint_exactly(
    tmp_path: Path, change: str, async_save: bool
) -> None:
    """Background saves too: their staging slots, write results and plans are reused
    from save to save, and none may outlive the layout it was made for."""
    torch.manual_seed(0)
    model, opt = training(8)
    with stalwart.CheckpointManager(
        tmp_path / "run", keep_last=None, handle_signals=False, async_save=async_save
    ) as ckpt:
        for n in (1, 2):
            step(model, opt)
            ckpt.save(n, stalwart.TrainState(model=model, optimizer=opt), force=True)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model, opt = MANAGER_CHANGES[change](model, opt)
        step(model, opt)
        ckpt.save(3, stalwart.TrainState(model=model, optimizer=opt), force=True)

        old_model, old_opt = training(8)
        assert ckpt.restore(stalwart.TrainState(model=old_model, optimizer=old_opt), step=2) == 2
        assert_same(old_model.state_dict(), before)
        new_model, new_opt = fresh_like(change)
        assert ckpt.restore(stalwart.TrainState(model=new_model, optimizer=new_opt), step=3) == 3
        assert_same(new_model.state_dict(), model.state_dict())
        assert_same(new_opt.state_dict(), opt.state_dict())
    # torch's reader agrees: the model section as DCP wrote it.
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp_load(target, tmp_path / "run" / "step_000000003")
    assert_same(target["model"], model.state_dict())


def test_the_manager_reuses_the_plan_of_an_unchanged_state(tmp_path: Path) -> None:
    model, opt = training(8)
    state = stalwart.TrainState(model=model, optimizer=opt, extra={"epoch": 0})
    with stalwart.CheckpointManager(tmp_path / "run", keep_last=None, handle_signals=False) as ckpt:
        for n in range(1, 5):
            step(model, opt)
            state.extra["epoch"] = n
            ckpt.save(n, state, force=True)
        plans = ckpt._writer.plans  # the one cache of this run
        assert plans.misses == 1 and plans.hits == 3
        fresh_model, fresh_opt = training(8)
        fresh = stalwart.TrainState(model=fresh_model, optimizer=fresh_opt, extra={"epoch": -1})
        assert ckpt.restore(fresh) == 4
    assert fresh.extra == {"epoch": 4}
    assert_same(fresh_model.state_dict(), model.state_dict())
    assert_same(fresh_opt.state_dict(), opt.state_dict())


def test_saved_values_are_torch_save_bytes(tmp_path: Path) -> None:
    cache = SavePlanCache()
    settings = record_settings() or ("no crc",)
    value = {"lr": 0.1, "betas": (0.9, 0.99), "name": "x"}
    expected = io.BytesIO()
    torch.save(value, expected)
    assert cache.saved_value(value, settings).getvalue() == expected.getvalue()
    assert cache.saved_value(dict(value), settings).getvalue() == expected.getvalue()


def test_keys_compared_in_place_agree_with_the_keys_made() -> None:
    """``_same_keys`` (no key made per value) answers as ``_item_keys(...) == keys`` would,
    for every change that makes DCP plan anew and for none that does not."""
    from stalwart.save_plan import _item_keys, _same_keys

    base: dict[str, object] = {
        "a": torch.zeros(3),
        "b": "a byte item",
        "c": torch.ones(2, 2, dtype=torch.float16),
    }
    grad = torch.zeros(3)
    grad.requires_grad_(True)
    variants: list[dict[str, object]] = [
        dict(base),
        {**base, "a": torch.full((3,), 7.0)},  # new values, same layout
        {"a2": base["a"], "b": base["b"], "c": base["c"]},  # renamed
        {**base, "a": torch.zeros(3, dtype=torch.float64)},
        {**base, "a": torch.zeros(4)},
        {**base, "a": torch.zeros(3, 1)},
        {**base, "a": grad},
        {**base, "d": torch.zeros(1)},  # one more
        {"a": base["a"], "b": base["b"]},  # one fewer
        {**base, "b": torch.zeros(1)},  # a byte item turned tensor
        {**base, "a": "now bytes"},  # and back
        {"c": base["c"], "b": base["b"], "a": base["a"]},  # reordered
        {**base, "a": torch.nn.Parameter(torch.zeros(3))},  # a subclass: never cached
    ]
    for coordinator in (False, True):
        keys = _item_keys(base, coordinator)
        assert keys is not None
        for n, variant in enumerate(variants):
            for other in (False, True):
                expected = _item_keys(variant, other) == keys
                assert _same_keys(keys, variant, other) is expected, (coordinator, n, other)
    assert _same_keys(_item_keys(base, False), dict(base), False)  # type: ignore[arg-type]
