"""Restore reads each checkpoint file once, checks it in memory, and feeds DCP from there.

Structure, not timing: how many times each file is read, how many bytes the
process read with read(2) (``/proc/self/io``), how many tensor items were
decoded without unpickling, and that a damaged file is refused before any
item of it is deserialized.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.pipeline import load_checkpoint
from stalwart.reader import VerifiedFileReader, VerifiedFiles, decode_tensor, verified_checkpoint
from stalwart.safe_load import read_dcp_metadata, safe_load
from stalwart.verify import read_manifest

from .conftest import assert_same, flip_byte, make_parts, snapshot, train_steps
from .support.interrupts import open_fds


def saved(run: Path, width: int = 64) -> tuple[Path, dict]:
    """A committed checkpoint of ``make_parts(hidden=width)`` after two steps, and its snapshot."""
    parts = make_parts(hidden=width)
    train_steps(parts, 2)
    with stalwart.CheckpointManager(run, every_steps=1) as ckpt:
        ckpt.save(2, parts.state)
    want = snapshot(parts)
    return next(run.glob("step_*")), want


def archive(tensor: torch.Tensor) -> memoryview:
    out = io.BytesIO()
    torch.save(tensor, out)
    return memoryview(bytearray(out.getvalue()))


# ------------------------------------------------------------------ files read once


def test_load_reads_every_file_once_and_decodes_tensors_without_unpickling(
    tmp_path: Path,
) -> None:
    ckpt, want = saved(tmp_path / "run")
    metadata = read_dcp_metadata(ckpt)
    files = VerifiedFiles(ckpt, read_manifest(ckpt))
    parts = make_parts(hidden=64)
    plan = parts.state.plan_restore(metadata, strict=True)
    staged, readers = plan.staged(), []
    for target in (staged, None):
        if target is None:
            plan.check(staged)
            target = plan.in_place()
        reader = VerifiedFileReader(ckpt, files=files, metadata=metadata)
        safe_load(target, ckpt, metadata=metadata, reader=reader)
        readers.append(reader)
    plan.apply({**staged, **plan.in_place()})
    files.close()
    data_files = {e.path for e in files.manifest.files if e.path.endswith(".distcp")}
    assert data_files and set(files.reads) == data_files
    assert all(count == 1 for count in files.reads.values()), files.reads
    tensors = sum(1 for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks"))
    assert sum(r.decoded for r in readers) == tensors
    assert_same(want["model"], dict(parts.model.state_dict()))
    assert_same(want["optimizer"], torch.optim.Optimizer.state_dict(parts.optimizer))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_a_restore_reads_each_byte_of_the_checkpoint_once(tmp_path: Path) -> None:
    """The old restore read every byte twice with read(2) (checksum, then DCP); the
    checked bytes are now the ones DCP is served from."""
    ckpt, want = saved(tmp_path / "run", width=512)
    total = sum(e.size for e in read_manifest(ckpt).files)

    def rchar() -> int:
        text = Path("/proc/self/io").read_text()
        return int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("rchar")))

    parts = make_parts(hidden=512)
    before = rchar()
    load_checkpoint(ckpt, parts.state)
    read = rchar() - before
    assert total > 16_000 and total <= read < 1.5 * total, (read, total)
    assert_same(want["model"], dict(parts.model.state_dict()))


def test_ranks_share_the_checking_and_each_file_is_checked_before_use(tmp_path: Path) -> None:
    """Rank 1 of 2 checks only its share up front; a file it needs later is checked then."""
    ckpt, _ = saved(tmp_path / "run")
    manifest = read_manifest(ckpt)
    files, metadata = verified_checkpoint(ckpt, part=(1, 2))
    both = {".metadata", ".metadata.json"}
    data = [e.path for e in manifest.files if e.path not in both]
    share = set(data[1::2])
    # Every rank checks both metadata files (it reads the JSON one).
    assert set(files.reads) == share | both
    assert metadata.state_dict_metadata
    other = next(e.path for e in manifest.files if e.path not in share)
    assert len(files.held(other).view) == next(e.size for e in manifest.files if e.path == other)
    assert files.reads[other] == 1


# ------------------------------------------------------------------ damage


def test_a_damaged_file_is_refused_before_anything_is_deserialized(tmp_path: Path) -> None:
    ckpt, _ = saved(tmp_path / "run")
    data = next(ckpt.glob("*.distcp"))
    flip_byte(data, data.stat().st_size // 2)
    files = VerifiedFiles(ckpt, read_manifest(ckpt))
    with pytest.raises(stalwart.CheckpointCorruptError, match="checksum mismatch") as info:
        files.verify([data.name])
    assert info.value.path == str(data) and not info.value.transient
    parts = make_parts(hidden=64)
    before = {k: v.clone() for k, v in parts.model.state_dict().items()}
    with pytest.raises(stalwart.CheckpointCorruptError, match=data.name):
        load_checkpoint(ckpt, parts.state)
    assert_same(before, dict(parts.model.state_dict()))
    assert not parts.optimizer.state


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    ckpt, _ = saved(tmp_path / "run")
    (ckpt / "__9_0.distcp").write_bytes(b"x" * 64)
    files = VerifiedFiles(ckpt, read_manifest(ckpt))
    with pytest.raises(stalwart.CheckpointCorruptError, match="not listed in the manifest"):
        files.verify(["__9_0.distcp"])


def test_a_file_that_became_a_link_is_not_followed(tmp_path: Path) -> None:
    ckpt, _ = saved(tmp_path / "run")
    data = next(ckpt.glob("*.distcp"))
    moved = tmp_path / "elsewhere.distcp"
    data.rename(moved)
    os.symlink(moved, data)
    files = VerifiedFiles(ckpt, read_manifest(ckpt))
    with pytest.raises(stalwart.CheckpointCorruptError, match="symbolic link"):
        files.verify([data.name])


# ------------------------------------------------------------------ direct decoding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4)])
def test_decoding_gives_what_torch_load_gives(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape) * 100).to(dtype)
    view = archive(tensor)
    decoded = decode_tensor(view, dtype, shape)
    assert decoded is not None
    assert_same(torch.load(io.BytesIO(view), weights_only=True), decoded)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(4, 6).t(),  # not contiguous
        torch.randn(10)[2:8],  # a view: torch.save writes the whole storage
        torch.randn(6).requires_grad_(),
    ],
    ids=["transposed", "view-of-larger-storage", "requires-grad"],
)
def test_anything_but_a_plain_contiguous_tensor_is_left_to_torch_load(
    tensor: torch.Tensor,
) -> None:
    assert decode_tensor(archive(tensor), tensor.dtype, tuple(tensor.shape)) is None


def test_a_shape_or_dtype_other_than_the_metadata_says_is_not_decoded() -> None:
    view = archive(torch.randn(3, 4))
    assert decode_tensor(view, torch.float32, (4, 3)) is None
    assert decode_tensor(view, torch.float32, (3, 5)) is None
    assert decode_tensor(view, torch.int32, (3, 4)) is None
    assert decode_tensor(view, torch.float32, (-3, -4)) is None


def test_garbage_is_not_decoded() -> None:
    good = archive(torch.randn(3, 4))
    assert decode_tensor(memoryview(b"PK" + bytes(100)), torch.float32, (3, 4)) is None
    assert decode_tensor(good[:-5], torch.float32, (3, 4)) is None
    bent = bytearray(good)
    start = bytes(bent).index(b"FloatStorage")
    bent[start : start + 5] = b"Doubl"  # the pickle no longer matches byte for byte
    assert decode_tensor(memoryview(bent), torch.float32, (3, 4)) is None


# ------------------------------------------------------------------ checks begun, not waited for


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux's /proc/self/fd")
def test_a_check_begun_and_never_waited_for_is_let_go_by_close(tmp_path: Path) -> None:
    ckpt, _ = saved(tmp_path / "run", width=512)
    before = open_fds()
    files, metadata = verified_checkpoint(ckpt, wait=False)
    assert metadata.state_dict_metadata
    concurrent.futures.wait(list(files._pending.values()))  # checked, each file open
    assert len(open_fds() - before) == len(files._pending) > 0
    files.close()
    assert open_fds() == before  # every checked file's descriptor closed, none leaked


def test_a_read_waits_for_the_check_begun_of_its_file_and_checks_it_once(tmp_path: Path) -> None:
    ckpt, want = saved(tmp_path / "run")
    files, metadata = verified_checkpoint(ckpt, wait=False)
    try:
        parts = make_parts(hidden=64)
        plan = parts.state.plan_restore(metadata, strict=True)

        def read(target: dict) -> dict:
            reader = VerifiedFileReader(ckpt, files=files, metadata=metadata)
            safe_load(target, ckpt, metadata=metadata, reader=reader)
            return target

        staged = read(plan.staged())
        plan.check(staged)
        plan.apply({**staged, **read(plan.in_place())})
    finally:
        files.close()
    data_files = {e.path for e in files.manifest.files if e.path.endswith(".distcp")}
    assert data_files and all(files.reads[name] == 1 for name in data_files), files.reads
    assert_same(want["model"], dict(parts.model.state_dict()))


def test_a_damaged_file_found_by_a_check_begun_earlier_is_raised_by_the_wait(
    tmp_path: Path,
) -> None:
    ckpt, _ = saved(tmp_path / "run")
    data = next(ckpt.glob("*.distcp"))
    flip_byte(data, data.stat().st_size // 2)
    files, _metadata = verified_checkpoint(ckpt, wait=False)  # the metadata files are intact
    try:
        with pytest.raises(stalwart.CheckpointCorruptError, match="checksum mismatch"):
            files.wait_streamed()
        assert files.streamed(data.name) is None
    finally:
        files.close()
