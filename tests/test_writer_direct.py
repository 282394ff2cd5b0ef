"""Direct writes: the whole pages of a large tensor's data go to the disk with O_DIRECT.

An async save's staging buffers are page-aligned (``StagingArea``), so the
writer can send their data past the page cache from where it is; a live
tensor's (a sync save) is 64-byte aligned, so its bytes before its first page
boundary in memory go buffered and the rest from where it is too. These tests
check the layout that makes that possible (data from a page boundary in memory
on a page boundary of the file, records still torch's bytes), that the files read back exactly with torch's own reader, and
that the direct path really ran. Failures of a direct write (EINVAL from a
filesystem that takes no direct I/O, ENOSPC) are in tests/faults/test_direct_writes.py.
"""

from __future__ import annotations

import dis
import io
import mmap
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import stalwart
from stalwart import file_io, hashed_file, records
from stalwart import writer as writer_module
from stalwart.manifest import hash_file
from stalwart.safe_load import read_dcp_metadata
from stalwart.staging import PAGE_ALIGNED_MIN, StagingArea, page_aligned_empty
from stalwart.writer import ChecksummingWriter, RecordTemplates, without_zip_crc

from .support.interrupts import KILLED, raised_into

PAGE = 4096


def live_state() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "big": torch.randn(1024, 700),  # 2.7 MiB: whole pages only
        "odd": torch.randn(3, 100_003),  # 1.1 MiB: whole pages, then a partial one
        "half": torch.randn(512, 512).to(torch.bfloat16),  # 512 KiB: below the threshold
        "large": torch.randn(1_100_003),  # 4.2 MiB
        "small": torch.randn(10),
        "step": 7,
    }


def save(sd: dict[str, object], path: Path, *, pack: bool = False) -> list:
    """What a save writes through ``ChecksummingWriter``; ``pack`` as in the background."""
    writer = ChecksummingWriter(path, templates=RecordTemplates(), pack=pack)
    try:
        with warnings.catch_warnings(), without_zip_crc():
            warnings.filterwarnings("ignore")
            dcp.save(sd, storage_writer=writer, no_dist=True)
        writer.sync()
        return list(writer.written)
    finally:
        writer.close()


def assert_reads_back_exactly(path: Path, written: list, tensors: dict[str, torch.Tensor]) -> None:
    """Every file ``written`` lists matches its size and xxh3, and DCP reads ``tensors`` back."""
    for entry in written:
        assert (entry.size, entry.xxh3_128) == hash_file(path / entry.path)
    back = {k: torch.zeros_like(v) for k, v in tensors.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.load(back, storage_reader=FileSystemReader(path), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def torch_save_bytes(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    with without_zip_crc():
        torch.save(tensor, buf)
    return buf.getvalue()


def takes_direct_io(directory: Path) -> bool:
    """Whether this platform and the filesystem of ``directory`` take O_DIRECT writes."""
    if not hashed_file.O_DIRECT:
        return False
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | hashed_file.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / "probe")
    return True


def staged_tensor() -> torch.Tensor:
    t = page_aligned_empty(torch.Size([PAGE_ALIGNED_MIN // 4]), torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    return t


def offset_tensor(n: int, offset: int) -> torch.Tensor:
    """``n`` numbered bytes (uint8) at ``offset`` bytes past a page boundary, owning
    all of its storage (as a tensor of a state does; a view of a larger one
    would be copied by the writer)."""
    mapped = mmap.mmap(-1, n + offset)  # page-aligned
    t = torch.frombuffer(memoryview(mapped)[offset : offset + n], dtype=torch.uint8)
    t.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    assert t.data_ptr() % PAGE == offset and t.untyped_storage().nbytes() == n
    return t


def unaligned_tensor() -> torch.Tensor:
    """One and a half bounce buffers of data 64 bytes past a page boundary (a live tensor's case)."""
    return offset_tensor(3 * hashed_file.BOUNCE_BYTES // 2, 64)


@pytest.mark.parametrize("swap", ["symlink", "another file"])
def test_a_file_swapped_at_the_path_never_gets_the_direct_writes(tmp_path: Path, swap: str) -> None:
    """The direct descriptor is opened by path: a link or another file put there after
    the file was created (by someone who can write the staging directory) must not
    receive the data; the file being written gets it, buffered."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious" * 1024)
    path = tmp_path / "staging" / "__0_0.distcp"
    path.parent.mkdir()
    out = hashed_file.HashedFile(path)
    try:
        path.rename(tmp_path / "moved")  # the descriptor still writes this inode
        if swap == "symlink":
            path.symlink_to(outside)
        else:
            path.write_bytes(b"decoy")
        t = staged_tensor()
        view = records._data_view(t)
        assert out.add_direct(view, t.data_ptr()) in (True, False)
        if out.size == 0:  # not taken: the caller adds it buffered
            out.add([view])
        entry = out.finish()
        out.sync()
    finally:
        out.abandon()
    assert out.direct_bytes == 0
    assert outside.read_bytes() == b"precious" * 1024
    if swap == "another file":
        assert path.read_bytes() == b"decoy"
    written = (tmp_path / "moved").read_bytes()
    assert written == bytes(view) and (entry.size, entry.xxh3_128) == hash_file(tmp_path / "moved")


def test_large_staging_buffers_are_page_aligned_and_own_their_storage() -> None:
    staged = StagingArea().stage(live_state())
    for key in ("big", "odd"):
        t = staged[key]
        assert t.data_ptr() % PAGE == 0, key
        assert t.untyped_storage().nbytes() == t.nbytes and t.storage_offset() == 0, key
    assert staged["half"].nbytes < PAGE_ALIGNED_MIN
    for key in ("big", "odd", "half", "small"):
        assert torch.equal(staged[key], live_state()[key]), key  # type: ignore[arg-type]
    empty = page_aligned_empty(torch.Size([0]), torch.float32)
    assert empty.numel() == 0


@pytest.fixture(params=["one by one", "packed"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Records sent direct one at a time, or the whole file packed into the bounce
    buffers (the writer packs the rest of a file once ``_PACK_AFTER`` bytes of
    tensor records went through the page cache)."""
    monkeypatch.setattr(writer_module, "_PACK_AFTER", 2**62 if request.param == "one by one" else 0)
    return str(request.param)


@pytest.mark.parametrize("source", ["staged", "live"])
def test_direct_data_lands_on_a_page_boundary_and_reads_back_exactly(
    tmp_path: Path, source: str, packing: str
) -> None:
    live = live_state()
    sd = StagingArea().stage(live) if source == "staged" else live
    written = save(sd, tmp_path / "ckpt", pack=packing == "packed")
    for entry in written:
        assert (entry.size, entry.xxh3_128) == hash_file(tmp_path / "ckpt" / entry.path)
    metadata = read_dcp_metadata(tmp_path / "ckpt")
    data = (tmp_path / "ckpt" / "__0_0.distcp").read_bytes()
    by_key = {index.fqn: info for index, info in metadata.storage_data.items()}
    # One by one: every tensor of 1 MiB or more; packed: none (none is a bounce buffer's size).
    direct = ("big", "odd", "large") if packing == "one by one" else ()
    for key in ("big", "odd", "half", "large", "small"):
        info = by_key[key]
        record = data[info.offset : info.offset + info.length]
        assert info.offset % 64 == 0, key  # every record stays 64-byte aligned
        assert record == torch_save_bytes(live[key]), key  # type: ignore[arg-type]
        raw = live[key].reshape(-1).view(torch.uint8).numpy().tobytes()  # type: ignore[union-attr]
        start = info.offset + record.index(raw[:256])
        if key in direct:
            # Its first page boundary in memory is one in the file: from there on,
            # its whole pages can go out with O_DIRECT from where they are.
            address = sd[key].data_ptr()  # type: ignore[union-attr]
            assert (start + -address % PAGE) % PAGE == 0, key
            assert source == "live" or address % PAGE == 0, key
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in live.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.load(back, storage_reader=FileSystemReader(tmp_path / "ckpt"), no_dist=True)
    for key, value in live.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[key], value), key
    assert back["step"] == 7


def count_direct_bytes(
    monkeypatch: pytest.MonkeyPatch, framing: dict[str, int] | None = None
) -> dict[str, int]:
    """Bytes of data each data file sent past the page cache, by the name of its folder
    (the record framing sent along with them goes to ``framing``)."""
    direct: dict[str, int] = {}
    sync = hashed_file.HashedFile.sync

    def counting_sync(self: hashed_file.HashedFile) -> None:
        sync(self)  # the last direct write ended before the fsync
        if self.path.suffix == ".distcp":
            direct[self.path.parent.name] = self.direct_bytes - self.framing_bytes
            if framing is not None:
                framing[self.path.parent.name] = self.framing_bytes

    monkeypatch.setattr(hashed_file.HashedFile, "sync", counting_sync)
    return direct


def test_a_packed_file_goes_direct_but_for_its_last_partial_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once ``_PACK_AFTER`` bytes of tensor records went through the page cache,
    every later record (small ones, framing, padding) is copied into the bounce
    buffers: the rest of the file but its last partial page goes past the page
    cache, and it reads back exactly."""
    direct_io = takes_direct_io(tmp_path)
    direct = count_direct_bytes(monkeypatch)
    torch.manual_seed(0)
    many = {f"w{i}": torch.randn(97, 101 + i) for i in range(120)}  # 4.7 MiB, none above 45 KB
    largest = max(t.nbytes for t in many.values())
    written = save(dict(many), tmp_path / "packed", pack=True)
    size = (tmp_path / "packed" / "__0_0.distcp").stat().st_size
    # The first _PACK_AFTER bytes (and the record that crossed it) through the page cache.
    rest = size - size % PAGE - writer_module._PACK_AFTER - largest - 2 * PAGE
    assert rest > 3 * 2**20
    assert (rest <= direct["packed"] < size) if direct_io else direct["packed"] == 0
    assert_reads_back_exactly(tmp_path / "packed", written, many)
    # From the first tensor record on, when packing starts at once.
    monkeypatch.setattr(writer_module, "_PACK_AFTER", 0)
    save(dict(many), tmp_path / "all", pack=True)
    size = (tmp_path / "all" / "__0_0.distcp").stat().st_size
    assert direct["all"] == (size - size % PAGE if direct_io else 0)
    # Below the threshold, or not in the background, the same records go through the page cache.
    save(dict(many), tmp_path / "sync")
    assert direct["sync"] == 0
    monkeypatch.setattr(writer_module, "_PACK_AFTER", 2**62)
    save(dict(many), tmp_path / "buffered", pack=True)
    assert direct["buffered"] == 0


def test_an_async_save_of_large_page_aligned_buffers_and_few_small_ones_is_not_packed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staged buffers of 1 MiB and more go direct from where they are; packing the
    small records between them would cut those writes into short ones. Under
    ``_PACK_AFTER`` bytes of small records, the file is not packed: exactly the
    large buffers' whole pages go direct."""
    direct_io = takes_direct_io(tmp_path)
    direct = count_direct_bytes(monkeypatch)
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(300, 1000) for i in range(6)}  # 1.1 MiB each
    state |= {f"b{i}": torch.randn(1000) for i in range(6)}  # 4 KB each
    staged = StagingArea().stage(state)
    save(staged, tmp_path / "async", pack=True)
    pages = sum(t.nbytes - t.nbytes % PAGE for k, t in state.items() if k.startswith("w"))
    assert direct["async"] == (pages if direct_io else 0)


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "no-memory-map-for-frames"])
def test_consecutive_staged_tensors_go_direct_together_with_the_framing_between_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frames: bool
) -> None:
    """Each page-aligned tensor's whole pages would be one direct write each; the
    framing between two of them (the last partial page, the trailer, the next
    header: whole pages of the file) is copied into frame pages, so consecutive
    tensors go out in a few large writes. The file is the same bytes. Where no
    frame pages can be mapped, each tensor goes direct alone, the framing buffered."""
    direct_io = takes_direct_io(tmp_path) and frames
    framing: dict[str, int] = {}
    direct = count_direct_bytes(monkeypatch, framing)
    writes: list[int] = []
    many = hashed_file.HashedFile._write_direct_many

    def counting(self, fd, pieces, offset):  # type: ignore[no-untyped-def]
        writes.append(sum(p.nbytes for p in pieces))
        return many(self, fd, pieces, offset)

    monkeypatch.setattr(hashed_file.HashedFile, "_write_direct_many", counting)
    torch.manual_seed(0)
    state = {f"w{i:02d}": torch.randn(257, 1031 + i) for i in range(24)}  # ~1 MiB each
    staged = StagingArea().stage(state)
    if not frames:

        def no_map(*_args: object) -> None:
            raise OSError(12, "Cannot allocate memory")

        monkeypatch.setattr(file_io.mmap, "mmap", no_map)
        monkeypatch.setattr(file_io.FRAME_POOL, "_idle", [])
    written = save(staged, tmp_path / "async", pack=True)
    pages = sum(t.nbytes - t.nbytes % PAGE for t in state.values())
    if direct_io:
        assert direct["async"] == pages
        # One or two pages of framing between two tensors, all of it sent with them.
        assert 0 < framing["async"] <= 2 * PAGE * len(state), framing
        assert sum(writes) == pages + framing["async"]
        assert len(writes) <= (pages + framing["async"]) // hashed_file.BOUNCE_BYTES + 1, writes
        assert len(writes) < len(state) // 3, writes
    elif frames or not takes_direct_io(tmp_path):  # no direct I/O: every byte buffered
        assert direct["async"] == framing["async"] == 0 and not writes
    else:  # one direct write per tensor, the framing between them buffered
        assert direct["async"] == pages and framing["async"] == 0
        assert len(writes) == len(state), writes
    assert_reads_back_exactly(tmp_path / "async", written, state)


def test_gathered_writes_stop_where_the_file_stops_being_consecutive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attacks on the gathering: more framing between two staged tensors than the
    frame pages hold (many small records), live tensors in between (64 bytes past
    a page, the most bytes before a page boundary: 4032, and from numpy's
    allocator, only 16-byte aligned: buffered), a batch of buffered records
    flushed in between, a frame pool of one page, and a tensor of exactly the
    gather's size. Each breaks the run of consecutive pieces; the file is the
    same bytes every time."""
    monkeypatch.setattr(hashed_file, "BATCH_BYTES", 2**20)  # buffered flushes in between
    monkeypatch.setattr(file_io.FRAME_POOL, "_idle", [])
    monkeypatch.setattr(file_io.FRAME_POOL, "size", PAGE)  # one page of frames
    torch.manual_seed(0)
    live: dict[str, torch.Tensor] = {}
    for i in range(3):
        live[f"a{i}"] = torch.randn(300, 1001 + i)  # ~1.1 MiB, staged: page-aligned
    live |= {f"s{i:03d}": torch.randn(1000 + i) for i in range(120)}  # 480 KB of small ones
    live["exact"] = torch.randn(hashed_file.BOUNCE_BYTES // 4)  # the gather's size
    live |= {f"b{i}": torch.randn(257, 1031 + i) for i in range(4)}
    sd: dict[str, object] = dict(StagingArea().stage(live))
    sd["live"] = torch.randn(1_300_007)  # live, 5.2 MiB: 64-byte aligned
    sd["far"] = offset_tensor(2**20 + 999, PAGE - 64)  # 4032 bytes before a page boundary
    sd["numpy"] = offset_tensor(2**20 + 5, 16)  # numpy's allocator aligns to 16 bytes
    sd["after"] = StagingArea().stage({"t": torch.randn(600, 700)})["t"]
    written = save(sd, tmp_path / "mixed", pack=False)
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert_reads_back_exactly(tmp_path / "mixed", written, tensors)
    metadata = read_dcp_metadata(tmp_path / "mixed")
    assert all(info.offset % 64 == 0 for info in metadata.storage_data.values())


def test_the_direct_path_runs_for_staged_and_for_live_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted on the real files: bytes past the page cache per file (none where the
    platform or the filesystem has no direct I/O: then the same files, buffered).
    A live tensor (torch aligns it to 64 bytes) goes direct from its first page
    boundary in memory on, from where it is: no bounce buffer is ever taken."""
    monkeypatch.setattr(writer_module, "_PACK_AFTER", 2**62)  # one record at a time
    direct_io = takes_direct_io(tmp_path)
    direct = count_direct_bytes(monkeypatch)
    live = live_state()
    bounce_leases: list[int] = []
    lease = file_io.BOUNCE_POOL.lease

    def counting_lease():  # type: ignore[no-untyped-def]
        bounce_leases.append(1)
        return lease()

    monkeypatch.setattr(file_io.BOUNCE_POOL, "lease", counting_lease)
    save(StagingArea().stage(live), tmp_path / "staged")
    save(live, tmp_path / "live")
    tensors = {k: v for k, v in live.items() if isinstance(v, torch.Tensor)}
    pages = {k: v.nbytes - v.nbytes % PAGE for k, v in tensors.items()}
    staged_direct = pages["big"] + pages["odd"] + pages["large"]
    # From each live tensor's first page boundary in memory, its whole pages.
    live_direct = sum(
        (t.nbytes - -t.data_ptr() % PAGE) // PAGE * PAGE
        for t in tensors.values()
        if t.nbytes >= 2**20
    )
    assert any(t.data_ptr() % PAGE for t in tensors.values() if t.nbytes >= 2**20)
    assert direct["staged"] == (staged_direct if direct_io else 0)
    assert direct["live"] == (live_direct if direct_io else 0)
    assert bounce_leases == [], "a bounce buffer was taken without packing"


def test_an_async_manager_save_restores_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(700, 700), torch.nn.Linear(700, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 700)).sum().backward()
    opt.step()
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with stalwart.CheckpointManager(tmp_path, every_steps=1, async_save=True) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with stalwart.CheckpointManager(tmp_path, every_steps=1) as ckpt:
        assert ckpt.restore(state) == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key


def test_add_direct_takes_whole_pages_at_page_aligned_addresses_only(tmp_path: Path) -> None:
    """A view at an address off a page boundary, of a length not whole pages, or at a
    file end off a page boundary is refused (False, nothing added, no thread or
    buffer taken): the caller adds it buffered, and the file is the same."""
    t = unaligned_tensor()
    staged = staged_tensor()
    out = hashed_file.HashedFile(tmp_path / "f")
    try:
        assert not out.add_direct(records._data_view(t), t.data_ptr())
        aligned = records._data_view(staged)
        assert not out.add_direct(aligned[: PAGE + 1], staged.data_ptr())
        assert out.size == 0 and out._io is None and not out._slots
        out.add([b"x"])
        assert not out.add_direct(aligned, staged.data_ptr())
        out.add([bytes(PAGE - 1)])
        assert out.add_direct(aligned, staged.data_ptr()) == takes_direct_io(tmp_path)
        if out.size == PAGE:
            out.add([aligned])
        entry = out.finish()
        out.sync()
    finally:
        out.abandon()
    want = b"x" + bytes(PAGE - 1) + bytes(aligned)
    assert (tmp_path / "f").read_bytes() == want
    assert (entry.size, entry.xxh3_128) == hash_file(tmp_path / "f")
    assert out.direct_bytes == (len(aligned) if takes_direct_io(tmp_path) else 0)


def test_packing_many_buffers_across_bounce_buffers_gives_their_concatenation(
    tmp_path: Path,
) -> None:
    """Buffers of every size (0 bytes, a few bytes, more than a bounce buffer) cross
    the bounce buffers' ends at odd offsets; a page-aligned view in the middle
    goes from where it is. The file is their concatenation, hashed as written,
    and changing a buffer after ``add`` returned changes nothing (it was copied)."""
    gen = torch.Generator().manual_seed(1)
    sizes = [0, 3, 64, 4095, 4097, 1, 2**20 + 17, hashed_file.BOUNCE_BYTES + 5, 333, 7]
    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    aligned = staged_tensor()
    out = hashed_file.HashedFile(tmp_path / "f")
    want = b""
    try:
        assert out.pack() == takes_direct_io(tmp_path)
        for n, part in enumerate(parts):
            view = part.numpy().data
            out.add([view])
            want += bytes(view)
            part.zero_()
            if n == 5:  # pad to a page, then page-aligned memory, direct as it is
                pad = -out.size % PAGE
                out.add([bytes(pad)])
                data = records._data_view(aligned)
                assert out.add_direct(data, aligned.data_ptr()) == takes_direct_io(tmp_path)
                if out.size == len(want) + pad:
                    out.add([data])
                want += bytes(pad) + bytes(data)
        entry = out.finish()
        out.sync()
    finally:
        out.abandon()
    assert (tmp_path / "f").read_bytes() == want
    assert (entry.size, entry.xxh3_128) == hash_file(tmp_path / "f")
    if takes_direct_io(tmp_path):
        assert out.direct_bytes == len(want) - len(want) % PAGE


@pytest.mark.parametrize("refusal", ["no memory map", "a link at the path", "unaligned end"])
def test_a_file_that_cannot_be_packed_is_written_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """``pack`` says False and changes nothing where the bounce buffers cannot be
    mapped, the direct descriptor cannot be opened safely, or the file's end is
    not on a page; the buffered file is the same."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    path = tmp_path / "f"
    out = hashed_file.HashedFile(path)
    head = b"h" * (10 if refusal == "unaligned end" else 0)
    try:
        out.add([head])
        if refusal == "no memory map":

            def no_map(*_args: object) -> None:
                raise OSError(12, "Cannot allocate memory")

            monkeypatch.setattr(file_io.mmap, "mmap", no_map)
            monkeypatch.setattr(file_io.BOUNCE_POOL, "_idle", [])
        elif refusal == "a link at the path":
            path.rename(tmp_path / "moved")
            path.symlink_to(outside)
        assert out.pack() is False
        body = bytes(range(256)) * 40_000
        out.add([body])
        entry = out.finish()
        out.sync()
    finally:
        out.abandon()
    target = tmp_path / "moved" if refusal == "a link at the path" else path
    assert target.read_bytes() == head + body
    assert (entry.size, entry.xxh3_128) == hash_file(target)
    assert out.direct_bytes == 0 and outside.read_bytes() == b"precious"


@pytest.mark.parametrize("async_save", [False, True])
def test_a_packed_checkpoint_of_many_small_tensors_restores_exactly(
    tmp_path: Path, async_save: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many tensors far below the direct threshold, 4 MiB and more in all, saved
    through the manager (packed when async, through the page cache when sync) and
    restored through stalwart's own checked reader."""
    direct_io = takes_direct_io(tmp_path)
    direct = count_direct_bytes(monkeypatch)  # one save: one staging folder
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(160, 160) for _ in range(24)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 160)).sum().backward()
    opt.step()
    state = stalwart.TrainState(model=model, optimizer=opt, rng=False)
    total = sum(p.nbytes for p in model.parameters()) * 3
    assert total >= 4 * writer_module._PACK_AFTER
    want = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    with stalwart.CheckpointManager(tmp_path, every_steps=1, async_save=async_save) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
    done = sum(direct.values())
    assert direct and (done > total - 2 * 2**20 if async_save and direct_io else done == 0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            opt.state[p]["exp_avg_sq"].zero_()
    with stalwart.CheckpointManager(tmp_path, every_steps=1) as ckpt:
        assert ckpt.restore(state) == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    for p, m in zip(model.parameters(), moments, strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], m)


def test_an_error_raised_into_a_bounced_writes_submit_is_raised_and_the_write_done_once(
    tmp_path: Path,
) -> None:
    """A signal handler's RuntimeError raised once a packed bounce buffer's write was
    queued is not the executor refusing work: it comes out as it is, and the
    buffer is not written a second time inline (the direct bytes would count it
    twice), nor does the save go on to pack the rest of the view."""
    if not takes_direct_io(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT writes: nothing is bounced")
    t = unaligned_tensor()
    view = records._data_view(t)
    out = hashed_file.HashedFile(tmp_path / "f")
    try:
        assert out.pack()
        out.add([view])  # one bounce buffer filled and queued: the I/O thread started
        submit = ThreadPoolExecutor.submit.__code__
        raised_into(submit, "_adjust_thread_count", KILLED, lambda: out.add([view]))
        out.finish()  # waits for the queued writes
    finally:
        out.abandon()
    # The first view's bounce buffer, and the one the second view filled, queued once.
    assert file_io.BOUNCE_BYTES < view.nbytes < 2 * file_io.BOUNCE_BYTES
    assert out.direct_bytes == 2 * file_io.BOUNCE_BYTES


def test_a_file_abandoned_by_two_threads_at_once_is_closed_once(tmp_path: Path) -> None:
    """A file's fsync task ends with ``abandon``; the writer's cleanup calls it too
    for a file whose task it never saw. One thread is held right after it took the
    descriptor, and the other runs meanwhile: without the file's lock both close the
    same number (a second close can close another file's descriptor)."""
    out = hashed_file.HashedFile(tmp_path / "f")
    code = hashed_file.HashedFile.abandon.__code__
    # Held just before ``self.fd = -1`` is stored, with the old number already
    # loaded: the instruction that stores the attribute, whatever order a Python
    # version's compiler gives the tuple assignment's two stores.
    taken = [
        i.offset
        for i in dis.get_instructions(code)
        if i.opname == "STORE_ATTR" and i.argval == "fd"
    ]
    assert len(taken) == 1, taken
    held, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def trace(frame: Any, event: str, _arg: Any) -> Any:
        if event == "call":
            if frame.f_code is not code:
                return None
            frame.f_trace_opcodes = True
        elif event == "opcode" and frame.f_lasti == taken[0]:
            held.set()
            release.wait(10)
        return trace

    def first() -> None:
        sys.settrace(trace)
        try:
            out.abandon()
        except BaseException as exc:
            errors.append(exc)
        finally:
            sys.settrace(None)

    def second() -> None:
        try:
            out.abandon()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert held.wait(10)
    threads.append(threading.Thread(target=second))
    threads[1].start()
    threads[1].join(0.5)  # done by now without the lock; waiting for it with the lock
    release.set()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert out.fd == -1


def test_a_large_tensor_moved_in_memory_gets_a_new_write_result(tmp_path: Path) -> None:
    """The same layout, but a large tensor's data now at another offset past a page:
    direct I/O places its record by that offset, so the last save's write result for
    it must not be reused (the small one before it is), and every value reads back."""
    from stalwart.save_plan import SavePlanCache

    from .support.saving import save_cached

    plans, templates = SavePlanCache(), RecordTemplates()

    small = torch.arange(10.0)
    first = {"a": small, "big": offset_tensor(2 * 2**20, 64)}
    _, r1 = save_cached(first, tmp_path / "a", plans, templates)
    moved = offset_tensor(2 * 2**20, 128)
    moved.add_(1)
    second = {"a": small + 1, "big": moved}
    w2, r2 = save_cached(second, tmp_path / "b", plans, templates)
    assert_reads_back_exactly(tmp_path / "b", w2, second)
    assert r2["a"] is r1["a"]
    if takes_direct_io(tmp_path):
        assert r2["big"].storage_data.offset != r1["big"].storage_data.offset
    else:  # every byte buffered: the record's place does not depend on the memory's
        assert r2["big"] is r1["big"]


def test_a_sync_save_overlaps_its_direct_writes_and_a_background_save_makes_them_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous save hands each gathered direct write to a ``stalwart-direct``
    thread and goes on preparing the next records (training waits for its wall
    time); a save in the background writes them from its own thread (its CPU
    time is taken from training, and the hand-off costs some). Both read back
    exactly."""
    direct_io = takes_direct_io(tmp_path)
    threads: dict[str, set[str]] = {}
    write_gathered = hashed_file.HashedFile._write_gathered

    def recording(self: hashed_file.HashedFile, pieces: list, at: int) -> None:
        threads.setdefault(self.path.parent.name, set()).add(threading.current_thread().name)
        write_gathered(self, pieces, at)

    monkeypatch.setattr(hashed_file.HashedFile, "_write_gathered", recording)
    monkeypatch.setattr(writer_module, "_PACK_AFTER", 2**62)  # large records only: no packing
    live = live_state()
    tensors = {k: v for k, v in live.items() if isinstance(v, torch.Tensor)}
    written = save(live, tmp_path / "sync")
    assert_reads_back_exactly(tmp_path / "sync", written, tensors)
    written = save(StagingArea().stage(live), tmp_path / "background", pack=True)
    assert_reads_back_exactly(tmp_path / "background", written, tensors)
    if not direct_io:
        assert threads == {}  # nothing gathered: every byte went through the page cache
        return
    me = threading.current_thread().name
    assert threads["sync"] and all(n.startswith("stalwart-direct") for n in threads["sync"])
    assert threads["background"] == {me}, threads


def test_an_interrupt_while_waiting_for_a_direct_write_leaves_it_for_abandon_to_wait_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error raised into the thread waiting for the gathered direct write in
    flight (a signal handler's) leaves that write counted as in flight: ``abandon``
    waits for it before it closes the descriptors it writes through, so a number
    closed under the write cannot be reused by another file and take its bytes."""
    if not takes_direct_io(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT writes: nothing is gathered")
    release = threading.Event()
    write_gathered = hashed_file.HashedFile._write_gathered

    def slow(self: hashed_file.HashedFile, pieces: list, at: int) -> None:
        release.wait(10)  # still writing when the interrupt comes
        write_gathered(self, pieces, at)

    monkeypatch.setattr(hashed_file.HashedFile, "_write_gathered", slow)
    t = staged_tensor()
    view = memoryview(t.numpy()).cast("B")
    out = hashed_file.HashedFile(tmp_path / "f")
    try:
        assert out.add_direct(view, t.data_ptr())
        out._flush_gather()  # the write starts on a stalwart-direct thread
        writing = out._writing
        assert writing is not None and not writing.done()
        wait = hashed_file.HashedFile._wait_gathered.__code__
        raised_into(wait, "writing.exception()", KILLED, out._wait_gathered)
        threading.Timer(0.3, release.set).start()
    finally:
        out.abandon()
    assert writing.done() and writing.exception() is None  # abandon waited for it
    assert out.fd == -1
