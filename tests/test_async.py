"""Async saves: bounded memory over many saves, one save in flight, exit waits."""

from __future__ import annotations

import gc
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.pipeline import StagingArea


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_staging_reuses_its_buffers_between_saves() -> None:
    area = StagingArea()
    sd = {"w": torch.randn(64, 64), "nested": {"b": torch.zeros(3)}, "n": 4}
    first = area.stage(sd)
    sd["w"].add_(1.0)
    second = area.stage(sd)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same memory, overwritten
    assert torch.equal(second["w"], sd["w"]) and second["n"] == 4
    assert area.nbytes == (64 * 64 + 3) * 4
    area.stage({"w": torch.randn(8)})  # a new layout drops the buffers it no longer needs
    assert area.nbytes == 8 * 4


def test_a_stage_of_an_unchanged_layout_keeps_no_new_object_per_tensor() -> None:
    """The buffers' bookkeeping is reused as it is: a new object kept per tensor and
    save lives on into the next save, and thousands of them (a large model) set off
    Python's full collections while the background writer runs."""
    area = StagingArea()
    sd = {f"t{i}": torch.randn(3) for i in range(50)}
    sd["w"] = torch.nn.Parameter(torch.randn(4))
    area.stage(sd)
    slots = list(area._slots)
    second = area.stage(sd)
    assert len(area._slots) == 51 and all(a is b for a, b in zip(slots, area._slots, strict=True))
    assert all(torch.equal(second[k], v) for k, v in sd.items())
    sd["t7"] = torch.randn(5)  # one changed shape: a new buffer for it alone
    third = area.stage(sd)
    changed = [k for k, (a, b) in enumerate(zip(slots, area._slots, strict=True)) if a is not b]
    assert changed == [7] and torch.equal(third["t7"], sd["t7"])


def test_staging_buffers_are_known_as_such_and_saved_as_plain_tensors() -> None:
    """The writer tells a staging buffer from any other tensor (only a buffer's records
    are kept from save to save), by a weak registry, not a mark on the tensor: a
    buffer's torch.save is that of a plain tensor, and a dropped buffer is forgotten."""
    import io
    import weakref

    from stalwart.staging import is_staging_buffer

    area = StagingArea()
    source = {"big": torch.randn(2**19), "small": torch.randn(5)}  # page-aligned and not
    staged = area.stage(source)
    for k, buf in staged.items():
        assert is_staging_buffer(buf) and not is_staging_buffer(source[k])
        assert not is_staging_buffer(buf.view(buf.shape)) and not buf.__dict__
        saved, plain = io.BytesIO(), io.BytesIO()
        torch.save(buf, saved)
        torch.save(buf.clone(), plain)
        assert saved.getvalue() == plain.getvalue()
    gone = weakref.ref(staged["small"])
    del staged, buf
    area.stage({"big": source["big"]})  # "small" is dropped
    gc.collect()
    assert gone() is None
    assert not is_staging_buffer(torch.randn(5))


def test_a_stage_says_whether_it_dropped_a_buffer_of_the_last_one() -> None:
    area = StagingArea()
    sd: dict[str, object] = {"a": torch.randn(3), "b": torch.randn(4)}
    area.stage(sd)
    assert not area.dropped  # nothing before it
    area.stage(sd)
    assert not area.dropped
    area.stage({**sd, "c": torch.randn(2)})  # one more: appended, nothing dropped
    assert not area.dropped
    area.stage(sd)  # one fewer
    assert area.dropped
    area.stage({"a": sd["a"], "b": torch.randn(5)})  # one replaced
    assert area.dropped


def test_a_changed_layout_frees_the_replaced_staging_buffers_when_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer keeps an async save's prepared records, which view the staging
    buffers; a save whose layout replaced buffers lets the records go as it stages
    them, so the old buffers are freed then, as before records were kept, not once
    the background write got to it (a model of many GiB would hold two staged copies
    meanwhile). The background write is held back here to tell the two apart."""
    import threading
    import weakref

    from stalwart import writer as writer_module

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    state = stalwart.TrainState(model=model)
    go = threading.Event()
    real = writer_module._write_file

    def held_back(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert go.wait(30)
        return real(*args, **kwargs)

    with stalwart.CheckpointManager(tmp_path, every_steps=1, async_save=True) as ckpt:
        writer = ckpt._writer
        for step in (1, 2):
            ckpt.save(step, state)
            ckpt.wait()
        assert writer.plans._records  # an unchanged layout's records are kept
        old = [weakref.ref(buf) for buf, _pinned in writer.staging._slots]
        monkeypatch.setattr(writer_module, "_write_file", held_back)
        model[1] = torch.nn.Linear(8, 16)  # new shapes: two buffers replaced
        try:
            ckpt.save(3, state)  # staged; its write waits
            gc.collect()
            alive = {id(buf) for buf, _pinned in writer.staging._slots}
            dead = [r() is None for r in old]
            assert sum(dead) == 2
            assert all(dead[k] or id(r()) in alive for k, r in enumerate(old))
        finally:
            go.set()
        ckpt.wait()
        assert writer.plans._records  # the new layout's, kept for the next save
    restored = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(stalwart.TrainState(model=restored), step=3)
    for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_leaves_no_reference_cycle_of_its_own(tmp_path: Path, async_save: bool) -> None:
    """Nothing stalwart builds in a save is left for the cyclic collector: a recursive
    closure (the staging walk's) once kept every source tensor of a save alive until
    a collection, 771 of them for a 2,304-tensor state. (torch.save's pickler class
    and the JSON encoder's closures are the standard library's and torch's own.)"""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = stalwart.TrainState(model=model, optimizer=opt, extra={"cfg": {"lr": 0.1}})
    with stalwart.CheckpointManager(tmp_path, every_steps=1, async_save=async_save) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state)
        ckpt.wait()
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            ckpt.save(3, state)
            ckpt.wait()
            gc.collect()
            ours = [
                o
                for o in gc.garbage
                if isinstance(o, torch.Tensor)
                or getattr(o, "__module__", None) in {"stalwart", *stalwart_modules()}
            ]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert ours == []


def stalwart_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith("stalwart.")}


def test_staging_matches_buffers_by_position_whatever_the_layout_does_next() -> None:
    area = StagingArea()
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    first = area.stage({"a": a, "b": b, "n": {"c": torch.arange(5)}})
    assert first["a"].data_ptr() != first["b"].data_ptr()  # same shape, own buffers
    # The same shapes in another order, a dtype change and a new key: every
    # staged value equals its source and no two share memory.
    half = torch.randn(16, 16).half()
    second = area.stage({"b": b, "a": half, "n": {"c": torch.arange(5)}, "z": torch.ones(2)})
    assert torch.equal(second["b"], b) and torch.equal(second["a"], half)
    assert second["a"].dtype == torch.float16 and torch.equal(second["z"], torch.ones(2))
    ptrs = [t.data_ptr() for t in (second["a"], second["b"], second["n"]["c"], second["z"])]
    assert len(set(ptrs)) == 4
    assert second["b"].data_ptr() == first["a"].data_ptr()  # reused: first slot, same layout
    assert area.nbytes == 16 * 16 * 4 + 16 * 16 * 2 + 5 * 8 + 2 * 4
    third = area.stage({"only": torch.zeros(3)})  # fewer tensors: the rest is dropped
    assert torch.equal(third["only"], torch.zeros(3)) and area.nbytes == 3 * 4


def test_staged_copies_are_detached_exact_and_independent_of_the_source() -> None:
    area = StagingArea()
    weight = torch.nn.Parameter(torch.randn(32, 32))
    ids = list(range(300))
    sd = {
        "w": weight,
        "t": torch.arange(10, dtype=torch.int64)[::2],  # a strided view
        "rng": (3, tuple(range(625)), None),
        "groups": [{"params": ids, "lr": 0.1}],
    }
    staged = area.stage(sd)
    assert torch.equal(staged["w"], weight) and not staged["w"].requires_grad
    assert staged["w"].grad_fn is None and weight.grad_fn is None  # nothing recorded
    assert torch.equal(staged["t"], sd["t"]) and staged["t"].is_contiguous()
    assert staged["rng"] == sd["rng"] and staged["groups"] == sd["groups"]
    with torch.no_grad():
        weight.add_(1.0)
    ids.append(300)
    sd["groups"][0]["lr"] = 0.2
    assert not torch.equal(staged["w"], weight)  # a copy, not a view
    assert staged["groups"][0]["params"] == list(range(300)) and staged["groups"][0]["lr"] == 0.1


def test_peak_memory_does_not_grow_over_100_async_saves(tmp_path) -> None:
    """RSS is sampled every 10 saves. A buffer kept per save (or any share of one)
    grows it in every interval; the allocator keeping a freed buffer's memory for
    reuse (glibc does, once a thread first frees one of that size) is a step in one
    interval, once. So the growth less its two largest steps must stay under half
    the state: a leak of 1/160 of the state per save fails."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    state_bytes = sum(
        p.numel() * 4 * 3 for p in model.parameters()
    )  # params + exp_avg + exp_avg_sq
    samples = []
    with stalwart.CheckpointManager(tmp_path, async_save=True, keep_last=2) as ckpt:
        for step in range(1, 111):
            if step > 10:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-3)
            ckpt.save(step, state)
            if step % 10 == 0:
                ckpt.wait()
                samples.append(_rss_bytes())
        assert ckpt.all_steps() == [109, 110]
    steps = sorted(b - a for a, b in itertools.pairwise(samples))
    growth = samples[-1] - samples[0]
    assert growth - sum(steps[-2:]) < state_bytes / 2, (
        f"RSS grew by {growth} bytes over 100 saves, in steps of {steps} every 10 saves "
        f"(state is {state_bytes})"
    )


def test_interpreter_exit_waits_for_the_in_flight_save(tmp_path) -> None:
    """A script that forgets close(): the background save still commits before exit."""
    code = (
        "import torch, stalwart\n"
        "m = torch.nn.Linear(256, 256)\n"
        f"ckpt = stalwart.CheckpointManager({str(tmp_path)!r}, async_save=True)\n"
        "ckpt.save(1, stalwart.TrainState(model=m, rng=False))\n"
        "print('returned', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "returned" in proc.stdout
    assert (tmp_path / "step_000000001" / "MANIFEST.json").exists()


@pytest.mark.parametrize("pack_after", [0, 2**62], ids=["packed", "not-packed"])
def test_background_saves_reusing_their_records_restore_every_step_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pack_after: int
) -> None:
    """Records reused save after save, whether the file is packed into bounce buffers or
    written record by record (large ones direct): every checkpoint restores its own
    step's values, bit for bit, through stalwart's checked restore."""
    from stalwart import writer as writer_module

    monkeypatch.setattr(writer_module, "_PACK_AFTER", pack_after)
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(16, 16) for _ in range(20)], torch.nn.Linear(16, 2**15)
    )  # small records and a 2 MiB weight
    state = stalwart.TrainState(model=model)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    kept: list[dict[str, list[object]]] = []
    with stalwart.CheckpointManager(
        tmp_path, every_steps=1, keep_last=None, async_save=True, handle_signals=False
    ) as ckpt:
        for step in range(1, 5):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5).add_(step)
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(step, state)
            ckpt.wait()
            records = ckpt._writer.plans._records
            kept.append({k: list(v.records) for k, v in records.items()})
    # Every save after the first gives each kept record back as the very same object.
    for before, after in itertools.pairwise(kept):
        assert before.keys() == after.keys() and before
        for key, records in after.items():
            assert any(r is not None for r in records)
            assert all(a is b for a, b in zip(before[key], records, strict=True))
    for step, expected in saved.items():
        target = copy_model_like(model)
        with stalwart.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
            assert ckpt.restore(stalwart.TrainState(model=target), step=step) == step
        for k, v in target.state_dict().items():
            assert torch.equal(v, expected[k]), (step, k)


def copy_model_like(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    target = copy.deepcopy(model)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    return target
