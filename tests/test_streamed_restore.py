"""Restore of large tensors: each data file is checked by streaming it once, then the
tensors' raw data is read straight into the live tensors from the checked file.

These tests attack the gap that design opens between the check and the read: a
file written to, swapped or cut short after its checksum matched is refused,
the live state is left untouched when that is found before the read, and a
state partly read from such a file is never handed back as a fresh start.
"""

from __future__ import annotations

import io
import itertools
import os
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import xxhash

import stalwart
from stalwart.manifest import FileEntry, hash_file
from stalwart.pipeline import load_checkpoint
from stalwart.reader import (
    UnavailableError,
    VerifiedFileReader,
    VerifiedFiles,
    decode_tensor,
    framed_data,
    verified_checkpoint,
)
from stalwart.safe_load import read_dcp_metadata, safe_load
from stalwart.streamed import CHUNK, EDGE, StreamedFile, stream_check
from stalwart.verify import FileProblem, read_manifest

from .conftest import assert_same

WIDTH = 384  # 384 x 384 fp32 = 576 KiB per weight: above SMALL_ITEM, read into place


def build(seed: int, *, trained: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        for _ in range(2):
            model(torch.randn(4, WIDTH)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return model, opt


def values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": {
            k: {n: t.clone() for n, t in s.items()}
            for k, s in torch.optim.Optimizer.state_dict(opt)["state"].items()
        },
    }


def saved(run: Path, steps: tuple[int, ...] = (2,)) -> dict[int, dict]:
    """Checkpoints of a model with large weights at ``steps``, and the values of each."""
    model, opt = build(0)
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    want = {}
    with stalwart.CheckpointManager(run, every_steps=1, keep_last=None) as ckpt:
        for step in steps:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            ckpt.save(step, state)
            want[step] = values(model, opt)
    return want


def data_file(run: Path, step: int) -> Path:
    return next((run / f"step_{step:09d}").glob("*.distcp"))


def scribble(path: Path) -> None:
    """Write over bytes in the middle of ``path`` in place (same inode, same size)."""
    time.sleep(0.02)  # a later timestamp even on a kernel with coarse file times
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x7f" * 64)


# ------------------------------------------------------------------ the fast path


def test_large_tensors_are_read_into_place_from_one_streamed_read(tmp_path: Path) -> None:
    want = saved(tmp_path)
    path = tmp_path / "step_000000002"
    model, opt = build(1, trained=False)  # fresh objects: the optimizer has no state
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    files, _ = verified_checkpoint(path)
    streamed = {n for n in files.reads if files.streamed(n) is not None}
    assert streamed == {data_file(tmp_path, 2).name}
    files.close()
    load_checkpoint(path, state)
    assert_same(want[2], values(model, opt))


def test_items_written_back_to_back_restore_like_aligned_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints written before items were 64-byte aligned in their file (each item
    right after the previous one) take the same streamed path and come back exact."""
    import stalwart.writer

    monkeypatch.setattr(stalwart.writer, "_RECORD_ALIGN", 1)
    want = saved(tmp_path)
    path = tmp_path / "step_000000002"
    offsets = sorted(
        (info.offset, info.length) for info in read_dcp_metadata(path).storage_data.values()
    )
    # Back to back, and some tensor record off the 64-byte grid: the old layout.
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(offsets))
    assert any(offset % 64 for offset, _ in offsets)
    model, opt = build(1, trained=False)
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    files, _ = verified_checkpoint(path)
    assert files.streamed(data_file(tmp_path, 2).name) is not None
    files.close()
    load_checkpoint(path, state)
    assert_same(want[2], values(model, opt))


def test_each_file_is_checked_once_and_no_item_needs_a_whole_read(tmp_path: Path) -> None:
    saved(tmp_path)
    path = tmp_path / "step_000000002"
    files, metadata = verified_checkpoint(path)
    model, _ = build(1)
    target = {"model": model.state_dict()}
    reader = VerifiedFileReader(path, files=files, metadata=metadata)
    safe_load(target, path, metadata=metadata, reader=reader)
    assert all(count == 1 for count in files.reads.values()), files.reads
    assert reader.decoded == len(target["model"])
    files.close()


def test_a_live_restore_holds_far_less_than_a_checkpoint_of_extra_memory(tmp_path: Path) -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("needs Linux's resettable VmHWM")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    with stalwart.CheckpointManager(tmp_path, every_steps=1) as ckpt:
        ckpt.save(1, state)
    path = next(tmp_path.glob("step_*"))
    total = sum(e.size for e in read_manifest(path).files)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    load_checkpoint(path, state)  # first-call costs out of the way
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()

    def kib(field: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(field + ":")))

    Path("/proc/self/clear_refs").write_text("5")
    base = kib("VmRSS") * 1024
    load_checkpoint(path, state)
    extra = kib("VmHWM") * 1024 - base
    # Two 4 MiB chunk buffers and the kept spans, not the checkpoint's 72 MiB.
    assert total > 64 * 2**20 and extra <= 0.4 * total, (extra, total)
    assert_same(want, dict(model.state_dict()))


# ------------------------------------------------------------------ check, then read


def _after_streaming(monkeypatch: pytest.MonkeyPatch, act: object) -> None:
    """Run ``act(name)`` on each data file right after its streamed check."""
    stream = VerifiedFiles.stream

    def stream_then_act(self: VerifiedFiles, names: object) -> None:
        names = list(names)  # type: ignore[call-overload]
        stream(self, names)
        for name in names:
            if name.endswith(".distcp"):
                act(self.directory / name)  # type: ignore[operator]

    monkeypatch.setattr(VerifiedFiles, "stream", stream_then_act)


def swap(path: Path) -> None:
    """Put another file of the same size in ``path``'s place."""
    junk = path.with_name("junk")
    junk.write_bytes(b"\xff" * path.stat().st_size)
    os.replace(junk, path)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(scribble, id="written-in-place"),
        pytest.param(lambda p: os.truncate(p, os.path.getsize(p) - 100), id="cut-short"),
        # The checked descriptor still reads the old file, but its last name is gone
        # (its status changed): refused all the same, never the new file's bytes.
        pytest.param(swap, id="replaced"),
    ],
)
def test_a_file_changed_after_its_check_is_refused_and_nothing_live_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: object
) -> None:
    saved(tmp_path)
    model, opt = build(1)
    before = values(model, opt)
    _after_streaming(monkeypatch, change)
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    with pytest.raises(stalwart.CheckpointCorruptError, match="changed on disk after") as info:
        load_checkpoint(tmp_path / "step_000000002", state)
    assert not info.value.live_modified
    assert_same(before, values(model, opt))


def _change_during_read(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Scribble over ``step``'s data file after its first tensor was read into place."""
    read_into = StreamedFile.read_into

    def read_then_scribble(self: StreamedFile, view: memoryview, offset: int) -> None:
        read_into(self, view, offset)
        if f"step_{step:09d}" in self.where and not getattr(self, "scribbled", False):
            self.scribbled = True  # type: ignore[attr-defined]
            scribble(Path(self.where))

    monkeypatch.setattr(StreamedFile, "read_into", read_then_scribble)


def test_a_file_changed_while_read_into_place_falls_back_to_an_older_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = saved(tmp_path, steps=(2, 4))
    _change_during_read(monkeypatch, 4)
    model, opt = build(1)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(stalwart.TrainState(model=model, optimizer=opt, rng=False)) == 2
    # Every tensor step 4 had written is overwritten by step 2's values.
    assert_same(want[2], values(model, opt))
    assert want[2]["model"]["0.weight"].ne(want[4]["model"]["0.weight"]).all()


def test_a_partly_read_state_with_nothing_to_fall_back_to_is_an_error_not_a_fresh_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved(tmp_path)
    _change_during_read(monkeypatch, 2)
    model, opt = build(1)
    with stalwart.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(stalwart.CheckpointCorruptError, match="rebuild the model") as info:
            ckpt.restore(stalwart.TrainState(model=model, optimizer=opt, rng=False))
    assert info.value.live_modified


# ------------------------------------------------------------------ framing


def _record(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def test_framed_data_finds_the_data_from_the_record_s_edges_alone() -> None:
    tensor = torch.arange(200_000, dtype=torch.float32).reshape(400, 500)
    record = _record(tensor)
    whole = framed_data(len(record), lambda a, b: record[a:b], torch.float32, (400, 500))
    assert whole is not None
    start, nbytes = whole
    assert record[start : start + nbytes] == tensor.numpy().tobytes()

    def edges(a: int, b: int) -> bytes:
        if b <= EDGE or a >= len(record) - EDGE:
            return record[a:b]
        raise UnavailableError(a, b)

    assert framed_data(len(record), edges, torch.float32, (400, 500)) == whole
    # Another shape or dtype than the metadata records: not this record.
    assert framed_data(len(record), edges, torch.float32, (500, 400)) is None
    assert framed_data(len(record), edges, torch.int32, (400, 500)) is None


def test_framed_data_without_the_header_is_no_answer() -> None:
    record = _record(torch.zeros(300, 300))

    def tail_only(a: int, b: int) -> bytes:
        if a >= len(record) - EDGE:
            return record[a:b]
        raise UnavailableError(a, b)

    assert framed_data(len(record), tail_only, torch.float32, (300, 300)) is None


def test_a_large_record_of_a_layout_read_whole_still_restores_exactly(tmp_path: Path) -> None:
    """A complex tensor (no direct decoding): its file is read whole and checked, then
    decoded by torch.load(weights_only=True); the values come back exactly."""
    model, opt = build(0)
    model.register_buffer("spectrum", torch.randn(300, 300, dtype=torch.complex64))
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    with stalwart.CheckpointManager(tmp_path, every_steps=1) as ckpt:
        ckpt.save(1, state)
    want = values(model, opt)
    target, target_opt = build(1)
    target.register_buffer("spectrum", torch.zeros(300, 300, dtype=torch.complex64))
    path = tmp_path / "step_000000001"
    load_checkpoint(path, stalwart.TrainState(model=target, optimizer=target_opt, rng=False))
    assert_same(want, values(target, target_opt))
    assert read_dcp_metadata(path).state_dict_metadata["model.spectrum"].properties.dtype == (
        torch.complex64
    )


def test_a_record_parsed_before_does_not_vouch_for_one_that_differs_around_its_data() -> None:
    """Framings are remembered per (size, dtype, shape); a record of the same size whose
    pickle differs (here: claiming another storage type) is parsed afresh and refused."""
    record = _record(torch.ones(200, 200))
    whole = framed_data(len(record), lambda a, b: record[a:b], torch.float32, (200, 200))
    assert whole is not None
    start = record.index(b"FloatStorage")
    bent = record[:start] + b"IntStorage\x00\x00" + record[start + 12 :]
    assert len(bent) == len(record)
    assert framed_data(len(bent), lambda a, b: bent[a:b], torch.float32, (200, 200)) is None
    assert decode_tensor(memoryview(bytearray(bent)), torch.float32, (200, 200)) is None
    assert framed_data(len(record), lambda a, b: record[a:b], torch.float32, (200, 200)) == whole


SIZES = [0, 1, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5]


@pytest.mark.parametrize("size", SIZES)
def test_a_file_of_any_size_around_the_buffers_bounds_is_checked_whole(
    tmp_path: Path, size: int
) -> None:
    """A file's read buffers are its size rounded up to a page, at most ``CHUNK``: every
    byte is still hashed, and a change in the last one is found."""
    data = bytearray(os.urandom(size))
    (tmp_path / "f").write_bytes(data)
    entry = FileEntry(path="f", size=size, xxh3_128=xxhash.xxh3_128(bytes(data)).hexdigest())
    checked = stream_check(os.fspath(tmp_path), entry, [], lambda: None)
    assert isinstance(checked, StreamedFile), checked
    checked.close()
    assert hash_file("f", within=tmp_path) == (size, entry.xxh3_128)
    if size:
        data[-1] ^= 1
        (tmp_path / "f").write_bytes(data)
        problem = stream_check(os.fspath(tmp_path), entry, [], lambda: None)
        assert isinstance(problem, FileProblem) and "checksum" in problem.reason, problem
        assert hash_file("f", within=tmp_path)[1] != entry.xxh3_128


def test_checking_a_small_file_allocates_no_chunk_sized_buffers(tmp_path: Path) -> None:
    """Each new buffer is zero-filled (two of ``CHUNK`` took 3 ms here, ten times the
    check of a 200 KiB file): a small file's check and hash allocate about its size."""
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    entry = FileEntry(path="f", size=len(data), xxh3_128=xxhash.xxh3_128(data).hexdigest())
    tracemalloc.start()
    try:
        checked = stream_check(os.fspath(tmp_path), entry, [], lambda: None)
        assert hash_file("f", within=tmp_path) == (len(data), entry.xxh3_128)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(checked, StreamedFile), checked
    checked.close()
    assert peak < 256 * 1024, peak
