"""``ChecksummingWriter`` and the save path given awkward inputs: views, odd dtypes,
shared storage, many layouts, and staging directories holding links or FIFOs."""

from __future__ import annotations

import os
import pickle
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from stalwart.errors import CheckpointCorruptError, CheckpointSaveError
from stalwart.manifest import hash_file
from stalwart.pipeline import _foreign_files
from stalwart.writer import ChecksummingWriter, RecordTemplates, without_zip_crc

_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"


def awkward_state(scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(10, 12, generator=g) * scale
    shared = torch.randn(6, 4, generator=g) * scale
    return {
        "offset_view": base[3:7],  # storage offset, storage larger than the view
        "column": base[:, 2],  # not contiguous, storage larger than the view
        "transposed": (torch.randn(5, 7, generator=g) * scale).t(),  # owns its storage
        "expanded": torch.randn(1, 4, generator=g).expand(3, 4) * 1,  # stride 0 after * 1
        "broadcast": torch.randn(4, generator=g).expand(3, 4),  # stride 0: a storage smaller
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(scale),
        "bool": torch.randn(13, generator=g) > 0,
        "bf16": (torch.randn(3, 5, generator=g) * scale).to(torch.bfloat16),
        "complex": torch.randn(4, 3, dtype=torch.complex64, generator=g) * scale,
        "f8": (torch.randn(16, generator=g) * scale).to(torch.float8_e4m3fn),
        "int8": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=g),
        "shared_a": shared,  # two entries, one storage
        "shared_b": shared,
        "shared_view": shared[1:],
    }


def dcp_save(sd: dict[str, torch.Tensor], storage_writer: object) -> None:
    with warnings.catch_warnings(), without_zip_crc():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.save(sd, storage_writer=storage_writer, no_dist=True)


def dcp_load(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v.contiguous()) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    return target


def records(path: Path) -> dict[str, bytes]:
    """Each item's record in ``path``'s data file, by key, at the offsets ``.metadata`` gives."""
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own test files
    data = (path / "__0_0.distcp").read_bytes()
    return {
        index.fqn: data[info.offset : info.offset + info.length]
        for index, info in metadata.storage_data.items()
    }


def gaps(path: Path) -> list[bytes]:
    """The bytes of ``path``'s data file that no record covers, in order."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    data = (path / "__0_0.distcp").read_bytes()
    spans = sorted((i.offset, i.offset + i.length) for i in metadata.storage_data.values())
    ends = [0] + [end for _start, end in spans]
    starts = [start for start, _end in spans] + [len(data)]
    return [data[e:s] for e, s in zip(ends, starts, strict=True) if s > e]


def test_awkward_tensors_are_written_byte_for_byte_as_torch_writes_them(tmp_path: Path) -> None:
    """Every record is torch's; records start 64-byte aligned, with zeros between them."""
    templates = RecordTemplates()
    for n, scale in enumerate((1.0, -2.5)):  # the second save builds records from templates
        sd = awkward_state(scale)
        ours, theirs = tmp_path / f"ours{n}", tmp_path / f"theirs{n}"
        writer = ChecksummingWriter(ours, threads=1, templates=templates)
        try:
            dcp_save(sd, writer)
            writer.sync()
        finally:
            writer.close()
        dcp_save(sd, FileSystemWriter(theirs, single_file_per_rank=True, thread_count=1))
        assert records(ours) == records(theirs)
        assert all(len(gap) < 64 and not gap.strip(b"\0") for gap in gaps(ours))
        metadata = pickle.loads((ours / ".metadata").read_bytes())
        assert all(info.offset % 64 == 0 for info in metadata.storage_data.values())
        for entry in writer.written:
            assert (entry.size, entry.xxh3_128) == hash_file(ours / entry.path)
        back = dcp_load(ours, sd)
        for key, value in sd.items():
            assert back[key].dtype == value.dtype, key
            got, want = back[key].reshape(-1), value.contiguous().reshape(-1)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
    assert len(templates) > 0


def test_an_adapter_file_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "adapter.pt").symlink_to(outside)
    with pytest.raises(OSError, match="symbolic link"):
        _foreign_files(staging, set())


def test_an_adapter_folder_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.pt").write_bytes(b"secret")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "adapter").symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError, match="symbolic link"):
        _foreign_files(staging, set())


def test_an_adapter_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "ok.pt").write_bytes(b"fine")
    os.mkfifo(staging / "sub" / "pipe")
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(_foreign_files(staging, set()))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # unblock the open so that the thread ends
        fd = os.open(staging / "sub" / "pipe", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("listing the staging directory waited on a FIFO")
    (result,) = outcome
    assert isinstance(result, CheckpointCorruptError) and "FIFO" in str(result)


def test_adapter_files_are_listed_with_their_checksums(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "a.pt").write_bytes(b"adapter")
    (staging / "__0_0.distcp").write_bytes(b"dcp")
    (staging / ".metadata").write_bytes(b"meta")
    entries = _foreign_files(staging, {".metadata"})
    assert [(e.path, e.size, e.xxh3_128) for e in entries] == [
        ("sub/a.pt", 7, hash_file(staging / "sub" / "a.pt")[1])
    ]


@pytest.mark.parametrize("name", ["MANIFEST.json", "MANIFEST.json.tmp"])
def test_an_adapter_file_named_as_the_commit_s_manifest_is_refused(
    tmp_path: Path, name: str
) -> None:
    (tmp_path / name).write_text("{}")
    with pytest.raises(CheckpointSaveError, match="written by the commit"):
        _foreign_files(tmp_path, set())


class _Holder:
    """A stateful object whose state is the awkward tensors."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.sd)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd = dict(sd)


def test_stalwart_restores_every_awkward_tensor_bit_exact(tmp_path: Path) -> None:
    import stalwart

    for step, scale in ((1, 1.0), (2, 3.0)):  # the second save writes from templates
        saved = _Holder(awkward_state(scale))
        with stalwart.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
            assert ckpt.save(step, stalwart.TrainState(rng=False, holder=saved), force=True)
        back = _Holder({k: torch.zeros_like(v.contiguous()) for k, v in saved.sd.items()})
        with stalwart.CheckpointManager(tmp_path, handle_signals=False) as ckpt:
            assert ckpt.restore(stalwart.TrainState(rng=False, holder=back)) == step
        for key, value in saved.sd.items():
            got, want = back.sd[key].contiguous().reshape(-1), value.contiguous().reshape(-1)
            assert got.dtype == want.dtype, key
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
