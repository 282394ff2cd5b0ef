"""``ChecksummingWriter``: DCP's files, byte for byte what torch writes, hashed while written."""

from __future__ import annotations

import gc
import io
import math
import sys
import threading
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from stalwart import hashed_file, records
from stalwart import writer as writer_module
from stalwart.manifest import hash_file
from stalwart.writer import (
    ChecksummingWriter,
    RecordTemplates,
    record_settings,
    without_zip_crc,
)

_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"


def torch_save_bytes(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def record_bytes(templates: RecordTemplates, tensor: torch.Tensor) -> bytes:
    parts = templates.record(tensor, record_settings())
    return b"".join(bytes(memoryview(b).cast("B")) for b in parts)


def layouts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 33, generator=g)
    return [
        torch.randn(17, 5, generator=g),
        torch.randn(3, 4, 5, generator=g).to(torch.bfloat16),
        torch.randint(0, 2, (9,), generator=g).bool(),
        torch.tensor(7, dtype=torch.int64),  # 0-d: an optimizer's step
        torch.empty(0, 3),
        big[5:9],  # a view into a larger storage: plain torch.save
        big.t(),  # not contiguous: plain torch.save
    ]


@pytest.mark.parametrize("index", range(len(layouts())))
def test_a_record_is_the_bytes_torch_save_writes_for_new_data_of_a_known_layout(index: int) -> None:
    templates = RecordTemplates()
    with without_zip_crc():
        first = layouts()[index]
        assert record_bytes(templates, first) == torch_save_bytes(first)
        # The same layout with other values: header and trailer come from the template.
        second = first.clone() if first.is_contiguous() else first
        if second.is_floating_point() and second.numel():
            second.mul_(3).add_(1)
        assert record_bytes(templates, second) == torch_save_bytes(second)


def test_templates_are_made_only_for_tensors_that_own_their_whole_storage() -> None:
    templates = RecordTemplates()
    with without_zip_crc():
        for tensor in layouts():
            templates.record(tensor, record_settings())
    assert len(templates) == 4  # not the empty tensor, the view or the transposed tensor


def test_a_tensor_with_python_attributes_is_saved_as_torch_save_writes_it() -> None:
    """torch.save pickles a tensor's Python attributes with it: such a tensor's record
    is its own torch.save (attributes and all), never cut from or into a template of
    its layout, before or after a plain tensor of that layout."""
    templates = RecordTemplates()
    plain, marked = torch.randn(6), torch.randn(6)
    marked.tag = {"shard": 3}  # type: ignore[attr-defined]
    with without_zip_crc():
        for tensor in (marked, plain, marked, plain):
            assert record_bytes(templates, tensor) == torch_save_bytes(tensor)
        assert torch_save_bytes(marked) != torch_save_bytes(marked.clone())
    assert len(templates) == 1  # the plain tensor's only


def test_a_changed_storage_alignment_gets_a_template_of_its_own() -> None:
    from torch.utils.serialization import config

    templates = RecordTemplates()
    tensor = torch.randn(8, 8)
    before = config.save.storage_alignment
    with without_zip_crc():
        record_bytes(templates, tensor)
        try:
            config.save.storage_alignment = 4096
            assert record_bytes(templates, tensor) == torch_save_bytes(tensor)
        finally:
            config.save.storage_alignment = before
    assert len(templates) == 2


def test_with_the_zip_crc_on_every_record_is_a_plain_torch_save() -> None:
    templates = RecordTemplates()
    tensor = torch.randn(8, 8)
    assert record_bytes(templates, tensor) == torch_save_bytes(tensor)
    assert len(templates) == 0


def state() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(40, 30, generator=g),
        "b": torch.randn(30, generator=g).to(torch.bfloat16),
        "step": torch.tensor(12),
        "extra": {"epoch": 3, "name": "run"},
        "ids": [1, 2, 3],
    }


def save(sd: dict[str, object], path: Path, *, threads: int = 1, templates=None):
    writer = ChecksummingWriter(path, threads=threads, templates=templates or RecordTemplates())
    try:
        with warnings.catch_warnings(), without_zip_crc():
            warnings.filterwarnings("ignore", message=_NO_DIST)
            dcp.save(sd, storage_writer=writer, no_dist=True)
        writer.sync()
    finally:
        writer.close()
    return writer


def load(path: Path) -> dict[str, object]:
    target = {
        "w": torch.zeros(40, 30),
        "b": torch.zeros(30, dtype=torch.bfloat16),
        "step": torch.tensor(0),
        "extra": {"epoch": 0, "name": ""},
        "ids": [0, 0, 0],
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    return target


@pytest.mark.parametrize("threads", [1, 2])
def test_torch_dcp_load_reads_back_every_value(tmp_path: Path, threads: int) -> None:
    templates = RecordTemplates()
    for n in range(2):  # the second save writes from templates
        sd = state()
        save(sd, tmp_path / f"ckpt{n}", threads=threads, templates=templates)
        back = load(tmp_path / f"ckpt{n}")
        for key in ("w", "b", "step"):
            assert torch.equal(back[key], sd[key]), key
        assert back["extra"] == sd["extra"] and back["ids"] == sd["ids"]


@pytest.mark.parametrize("threads", [1, 2])
def test_checksums_computed_while_writing_are_those_of_the_files(
    tmp_path: Path, threads: int
) -> None:
    writer = save(state(), tmp_path / "ckpt", threads=threads)
    on_disk = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert sorted(e.path for e in writer.written) == on_disk
    assert len([n for n in on_disk if n.endswith(".distcp")]) == threads
    for entry in writer.written:  # sync() ran: every file is complete
        assert (entry.size, entry.xxh3_128) == hash_file(tmp_path / "ckpt" / entry.path)


def test_a_failed_write_in_a_writer_thread_fails_the_save(tmp_path: Path) -> None:
    """torch's own FileSystemWriter loses this error and returns as if it had saved."""
    path = tmp_path / "ckpt"
    path.mkdir()
    # The second writer thread's file exists already: its O_EXCL create fails for real.
    (path / "__0_1.distcp").write_bytes(b"in the way")
    with pytest.raises(CheckpointException) as info:
        save(state(), path, threads=2)
    ((error, _trace),) = info.value.failures.values()
    assert isinstance(error, FileExistsError)
    assert Path(error.filename).name == "__0_1.distcp"
    assert not (path / ".metadata").exists()


def test_at_least_one_writer_thread(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="threads=0"):
        ChecksummingWriter(tmp_path, threads=0, templates=RecordTemplates())


def test_the_zip_crc_setting_is_restored_after_the_save() -> None:
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    with without_zip_crc():
        assert config.save.compute_crc32 is False
    assert config.save.compute_crc32 == before


def test_the_templates_stay_bounded_over_a_run_whose_shapes_keep_changing() -> None:
    templates = RecordTemplates()
    with without_zip_crc():
        settings = record_settings()
        for n in range(1, RecordTemplates.MAX_LAYOUTS + 50):
            templates.record(torch.zeros(n, dtype=torch.uint8), settings)
        assert len(templates) == RecordTemplates.MAX_LAYOUTS
        # The newest layouts are kept, and every record is still torch's bytes.
        tensor = torch.arange(7, dtype=torch.uint8)
        assert record_bytes(templates, tensor) == torch_save_bytes(tensor)


def test_a_data_write_torch_does_not_make_in_one_piece_falls_back_to_torch_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if torch wrote the tensor's data in pieces (or from a copy): no framing can be cut.
    monkeypatch.setattr(records, "_address_of", lambda view: -1)
    templates = RecordTemplates()
    tensor = torch.randn(9, 3)
    with without_zip_crc():
        assert record_bytes(templates, tensor) == torch_save_bytes(tensor)
    assert len(templates) == 0


def test_a_write_that_makes_no_progress_fails_instead_of_looping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module.os, "writev", lambda fd, buffers: 0)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            save(state(), tmp_path / "ckpt")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the writer retried a write that made no progress forever"
    ((error,),) = [outcome]
    assert isinstance(error, CheckpointException)
    ((inner, _trace),) = error.failures.values()
    assert isinstance(inner, OSError) and inner.filename.endswith("__0_0.distcp")


def test_short_writes_are_continued_where_they_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux writes at most 2 GiB - 4 KiB per call: a large tensor always meets a short write."""
    real = writer_module.os.writev

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        first = next(b for b in buffers if b.nbytes)
        return real(fd, [first[:777]])

    monkeypatch.setattr(writer_module.os, "writev", short_writev)
    sd = state()
    writer = save(sd, tmp_path / "ckpt")
    for entry in writer.written:
        assert (entry.size, entry.xxh3_128) == hash_file(tmp_path / "ckpt" / entry.path)
    back = load(tmp_path / "ckpt")
    for key in ("w", "b", "step"):
        assert torch.equal(back[key], sd[key]), key


def test_a_tensor_changed_after_it_was_hashed_is_caught_by_the_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksum is of the bytes handed over: another thread writing into a tensor
    while it is saved gives a file that fails verification, never one that passes
    with other values."""
    sd = state()
    real_flush = hashed_file.HashedFile.flush
    changed: list[bool] = []

    def flush_after_a_change(self: hashed_file.HashedFile) -> None:
        if not changed and self.path.suffix == ".distcp":
            sd["w"].add_(1.0)  # type: ignore[union-attr]  # after add() hashed it, before writev
            changed.append(True)
        real_flush(self)

    monkeypatch.setattr(hashed_file.HashedFile, "flush", flush_after_a_change)
    writer = save(sd, tmp_path / "ckpt")
    assert changed
    (entry,) = [e for e in writer.written if e.path.endswith(".distcp")]
    assert hash_file(tmp_path / "ckpt" / entry.path) != (entry.size, entry.xxh3_128)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.complex64,
        torch.float8_e4m3fn,
    ],
)
@pytest.mark.parametrize("shape", [(2, 3, 4), (5,), (), (0,), (3, 0)])
def test_a_tensors_bytes_are_its_memory_whatever_its_dtype_and_shape(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """``_data_view`` is the tensor's memory (no copy: a change shows through) as one
    flat run of unsigned bytes, the bytes torch's own byte view gives."""
    from stalwart.records import _data_view

    t = (torch.arange(math.prod(shape)).reshape(shape) * 37 % 11).to(dtype)
    view = _data_view(t)
    assert view.format == "B" and view.ndim == 1 and view.nbytes == t.nbytes
    assert bytes(view) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    if t.numel():
        t.view(-1).view(torch.uint8)[0] = 0xA5
        assert view[0] == 0xA5


def test_an_error_raised_into_the_crc_settings_restore_still_restores_it() -> None:
    """torch's config proxy runs Python code, so an interrupt (Ctrl-C, a signal
    handler's error) can land on the call that puts the zip CRC setting back as
    ``without_zip_crc`` found it: the setting is put back all the same and the
    error goes on. Left off, every later ``torch.save`` of the process would
    write zips without CRC, which Python's own ``zipfile`` then refuses."""
    from torch.utils.serialization import config

    setattr_code = type(config.save).__setattr__.__code__
    calls = 0

    def raise_at_the_restore(frame, event, _arg):  # type: ignore[no-untyped-def]
        nonlocal calls
        if event == "call" and frame.f_code is setattr_code:
            calls += 1
            if calls == 1:  # the call that puts it back (traced from inside the block)
                raise KeyboardInterrupt
        return None

    def interrupted_on_the_way_out() -> None:
        with without_zip_crc():
            assert config.save.compute_crc32 is False
            sys.settrace(raise_at_the_restore)

    assert config.save.compute_crc32 is True
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupted_on_the_way_out()
    finally:
        sys.settrace(None)
    assert calls == 1  # tracing stops at the error it raised
    assert config.save.compute_crc32 is True


def test_a_data_view_keeps_its_tensor_alive_as_long_as_any_piece_of_it() -> None:
    """The writer cuts pieces out of the view (a direct write's whole pages, the bytes
    before them) and may hold them after it dropped the tensor (a copy it made of a
    view or a GPU tensor): the memory must stay the tensor's until the last piece goes."""
    from stalwart.records import _data_view

    t = torch.arange(100_000, dtype=torch.int64)
    want = t.numpy().tobytes()
    alive = weakref.ref(t)
    piece = _data_view(t)[4096:8192]
    del t
    gc.collect()
    assert alive() is not None
    torch.arange(100_000, dtype=torch.int64).neg_()  # memory that a freed tensor would give
    assert bytes(piece) == want[4096:8192]
    del piece
    gc.collect()
    assert alive() is None


class CountingPlanner:
    """Resolves each item to its value by name, counting the calls."""

    def __init__(self, values: dict[str, object]) -> None:
        self.values = values
        self.resolved = 0

    def resolve_data(self, item: WriteItem) -> object:
        self.resolved += 1
        return self.values[item.index.fqn]


@pytest.mark.parametrize("views", [False, True], ids=["own-storage", "views"])
def test_records_are_prepared_ahead_of_their_writes_copies_only_so_far(
    monkeypatch: pytest.MonkeyPatch, views: bool
) -> None:
    """Records are prepared before the first is written (up to ``_PREPARE_RECORDS``),
    unless preparing makes copies (a view's own bytes here, a GPU tensor's on the
    host): then at most ``_PREPARE_COPIES`` bytes of them ahead. Byte items come
    first, as DCP writes."""
    base = torch.arange(8 * 256, dtype=torch.float32)
    values: dict[str, object] = {
        f"t{i}": base[i * 256 : (i + 1) * 256] if views else base[i * 256 : (i + 1) * 256].clone()
        for i in range(8)
    }
    values["extra"] = io.BytesIO(b"pickled bytes")
    items = [WriteItem(index=MetadataIndex(name), type=WriteItemType.TENSOR) for name in values]
    items[-1] = WriteItem(index=MetadataIndex("extra"), type=WriteItemType.BYTE_IO)
    monkeypatch.setattr(writer_module, "_PREPARE_COPIES", 2 * 1024)  # two of the 1 KiB copies
    planner = CountingPlanner(values)
    with without_zip_crc():
        prepared = writer_module._prepared(items, planner, RecordTemplates())  # type: ignore[arg-type]
        first = next(prepared)
        assert planner.resolved == (3 if views else 9)  # the byte item, then the tensors
        got = [first, *prepared]
        assert [item.index.fqn for item, _, _ in got] == ["extra", *(f"t{i}" for i in range(8))]
        assert got[0][1] is None and bytes(got[0][2][0]) == b"pickled bytes"
        for item, tensor, buffers in got[1:]:
            value = values[item.index.fqn]
            assert isinstance(value, torch.Tensor) and isinstance(tensor, torch.Tensor)
            assert (tensor.data_ptr() == value.data_ptr()) is not views  # a view: its own copy
            record = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            assert record == torch_save_bytes(value.clone())


@pytest.mark.parametrize("short_writes", [False, True])
def test_every_kind_of_buffer_is_written_and_hashed_as_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short_writes: bool
) -> None:
    """``HashedFile.add`` keeps flat byte views as they are and casts anything else once:
    floats, a 2-D view, a non-byte format, a slice, bytearray, an empty buffer."""
    import array

    import numpy as np

    floats = array.array("f", [1.5, -2.25, 3.0])
    grid = np.arange(24, dtype=np.uint8).reshape(4, 6)
    wide = np.arange(5, dtype=np.int64)
    buffers: list[object] = [
        b"head",
        bytearray(b"\x00\x01\x02"),
        memoryview(floats),
        memoryview(grid),
        memoryview(wide),
        memoryview(b"0123456789")[3:7],
        b"",
        memoryview(bytes(range(256))),
    ]
    expected = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)  # type: ignore[arg-type]
    if short_writes:
        real = hashed_file.os.writev

        def short_writev(fd: int, pending: list[memoryview]) -> int:
            first = next(b for b in pending if b.nbytes)
            return real(fd, [first.cast("B")[:5]])  # mid-row of a 2-D view

        monkeypatch.setattr(hashed_file.os, "writev", short_writev)
    out = hashed_file.HashedFile(tmp_path / "f")
    try:
        out.add(buffers[:4])
        out.flush()
        out.add(buffers[4:])
        entry = out.finish()
    finally:
        out.abandon()
    assert (tmp_path / "f").read_bytes() == expected
    assert (entry.size, entry.xxh3_128) == hash_file(tmp_path / "f")


def test_records_are_prepared_at_most_a_batch_ahead_byte_items_included(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A state of many small values never has all their records alive at once."""
    values: dict[str, object] = {f"t{i}": torch.full((3,), float(i)) for i in range(7)}
    values.update({f"b{i}": io.BytesIO(b"v%d" % i) for i in range(3)})
    items = [
        WriteItem(
            index=MetadataIndex(name),
            type=WriteItemType.BYTE_IO if name.startswith("b") else WriteItemType.TENSOR,
        )
        for name in values
    ]
    monkeypatch.setattr(writer_module, "_PREPARE_RECORDS", 4)
    planner = CountingPlanner(values)
    with without_zip_crc():
        prepared = writer_module._prepared(items, planner, RecordTemplates())  # type: ignore[arg-type]
        seen = []
        for n, (item, tensor, buffers) in enumerate(prepared):
            # Each batch of four is prepared when its first record is asked for.
            assert planner.resolved == min(len(values), (n // 4 + 1) * 4), n
            value = values[item.index.fqn]
            if isinstance(value, torch.Tensor):
                record = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
                assert tensor is value and record == torch_save_bytes(value)
            else:
                assert tensor is None and bytes(buffers[0]) == value.getvalue()  # type: ignore[attr-defined]
            seen.append(item.index.fqn)
    assert seen == [*(f"b{i}" for i in range(3)), *(f"t{i}" for i in range(7))]


def test_a_save_of_an_unchanged_layout_reuses_the_last_write_results(tmp_path: Path) -> None:
    """Same layout: the very same results (no objects made per item). A changed layout
    (a tensor grown in the middle of the file) is planned anew and gets new results,
    reused in turn by the next save; the values read back are each save's own."""
    from stalwart.save_plan import SavePlanCache

    from .support.saving import save_cached

    plans, templates = SavePlanCache(), RecordTemplates()

    def save_with_cache(sd: dict[str, object], path: Path) -> list[object]:
        return list(save_cached(sd, path, plans, templates)[1].values())

    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(50 + i, generator=g) for i in range(6)}
    first = save_with_cache(sd, tmp_path / "a")
    sd = {k: v + 1 for k, v in sd.items()}  # new values, the same layout
    second = save_with_cache(sd, tmp_path / "b")
    assert len(second) == 6 and all(a is b for a, b in zip(first, second, strict=True))
    grown = dict(sd, t2=torch.randn(500, generator=g))
    third = save_with_cache(grown, tmp_path / "c")  # planned anew: new items, new results
    assert not any(a is b for a, b in zip(second, third, strict=True))
    assert [r.storage_data.offset for r in third[3:]] != [r.storage_data.offset for r in second[3:]]
    grown = {k: v * 2 for k, v in grown.items()}
    fourth = save_with_cache(grown, tmp_path / "d")
    assert all(a is b for a, b in zip(third, fourth, strict=True))
    for name, expected in (("b", sd), ("d", grown)):
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST)
            dcp.load(target, storage_reader=FileSystemReader(tmp_path / name), no_dist=True)
        for k, v in expected.items():
            assert torch.equal(target[k], v), (name, k)


def _load_values(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    return target


def test_a_save_of_staged_tensors_reuses_their_records_and_writes_their_new_bytes(
    tmp_path: Path,
) -> None:
    """An async save's staging buffers saved again with new values: every templated
    record is the last save's very object, and each checkpoint holds its own save's
    values. An empty tensor (``torch.save``'d whole), a byte item and a tensor that is
    no staging buffer (a sharded tensor's staged copy is new at every save) get
    records of their own, never kept."""
    from stalwart.save_plan import SavePlanCache
    from stalwart.staging import StagingArea

    from .support.saving import save_cached

    plans, templates, area = SavePlanCache(), RecordTemplates(), StagingArea()
    g = torch.Generator().manual_seed(5)
    source: dict[str, object] = {
        "a": torch.randn(100, generator=g),
        "b": torch.randn(7, 3, generator=g).to(torch.float64),
        "big": torch.randn(2**19, generator=g),  # 2 MiB: a direct record where it can be
        "empty": torch.empty(0),
        "n": 5,
    }

    def save(path: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        staged = area.stage(source)
        staged["copy"] = torch.randn(9, generator=g)  # made anew for this save
        entries, results = save_cached(staged, path, plans, templates, staged=True)
        key = next(e.path for e in entries if e.path.endswith(".distcp"))
        kept = plans.file_records(key)
        assert isinstance(kept, writer_module.PreparedRecords)
        assert len(kept.records) == len(results)  # one entry per item, None where not kept
        records = {r[0].index.fqn: r for r in kept.records if r is not None}
        values = {k: v.clone() for k, v in staged.items() if isinstance(v, torch.Tensor)}
        return records, values

    first, old = save(tmp_path / "1")
    assert sorted(first) == ["a", "b", "big"]  # not the empty tensor's, the byte item's, the copy's
    for t in source.values():
        if isinstance(t, torch.Tensor):
            t.mul_(-3).add_(1)  # new values
    source["a"] = torch.randn(100, generator=g)  # another source object, the same layout
    second, new = save(tmp_path / "2")
    assert all(second[k] is first[k] for k in first)  # the same buffers: the same records
    for path, expected in (("1", old), ("2", new)):
        got = _load_values(tmp_path / path, expected)
        for k, v in expected.items():
            assert torch.equal(got[k], v), (path, k)
    assert not torch.equal(old["a"], new["a"]) and not torch.equal(old["big"], new["big"])


def test_only_a_save_of_staged_tensors_keeps_its_records(tmp_path: Path) -> None:
    """A synchronous save's tensors are the live ones (``state_dict()`` hands out new
    views each time, and a user may reshape one in place): no record is kept."""
    from stalwart.save_plan import SavePlanCache
    from stalwart.staging import StagingArea

    from .support.saving import save_cached

    plans = SavePlanCache()
    staged = StagingArea().stage({"a": torch.ones(4)})
    entries, _ = save_cached(staged, tmp_path / "1", plans, RecordTemplates())
    key = next(e.path for e in entries if e.path.endswith(".distcp"))
    assert plans.file_records(key) is None
    save_cached(staged, tmp_path / "2", plans, RecordTemplates(), staged=True)
    assert plans.file_records(key) is not None
    plans.drop_records()
    assert plans.file_records(key) is None


def test_a_record_is_reused_only_for_its_item_its_buffer_and_its_settings() -> None:
    """``_prepared`` with the last save's records: a hit needs the same planned item, the
    very staging buffer and the same ``torch.save`` settings; anything else is built anew."""
    from stalwart.staging import StagingArea

    values: dict[str, object] = StagingArea().stage({"x": torch.arange(6.0), "y": torch.ones(4)})
    items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.TENSOR) for k in values]
    templates = RecordTemplates()

    def prepare(
        its: list[WriteItem], earlier: writer_module.PreparedRecords | None
    ) -> writer_module.PreparedRecords:
        kept = writer_module.PreparedRecords()
        planner = CountingPlanner(values)
        got = list(writer_module._prepared(its, planner, templates, earlier, kept))  # type: ignore[arg-type]
        for item, _tensor, buffers in got:
            record = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            assert record == torch_save_bytes(values[item.index.fqn])  # type: ignore[arg-type]
        return kept

    with without_zip_crc():
        first = prepare(items, None)
        assert all(r is not None for r in first.records)
        again = prepare(items, first)
        assert all(a is b for a, b in zip(first.records, again.records, strict=True))
        replanned = [WriteItem(index=i.index, type=i.type) for i in items]
        fresh = prepare(replanned, first).records
        assert not any(a is b for a, b in zip(first.records, fresh, strict=True))
        stale = writer_module.PreparedRecords(("other settings",), first.records)
        fresh = prepare(items, stale).records
        assert not any(a is b for a, b in zip(first.records, fresh, strict=True))
        values["y"] = StagingArea().stage({"y": torch.zeros(4)})["y"]  # another buffer
        mixed = prepare(items, first).records
        assert mixed[0] is first.records[0]
        assert mixed[1] is not None and mixed[1] is not first.records[1]
        values["y"] = torch.zeros(4)  # no staging buffer: built every time, never kept
        assert prepare(items, first).records[1] is None
