"""Restore under attack: crafted records, files changed between check and use, an
optimizer of another kind. Each case is refused with a clear error, or gives
exactly what torch itself would; the live state stays untouched when refused."""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.manifest import FileEntry
from stalwart.pipeline import load_checkpoint
from stalwart.reader import VerifiedFileReader, VerifiedFiles, decode_tensor, verified_checkpoint
from stalwart.safe_load import read_dcp_metadata, safe_load
from stalwart.verify import read_manifest

from .conftest import assert_same, make_parts, snapshot, train_steps


def saved(run: Path, width: int) -> tuple[Path, dict]:
    parts = make_parts(hidden=width)
    train_steps(parts, 2)
    with stalwart.CheckpointManager(run, every_steps=1) as ckpt:
        ckpt.save(2, parts.state)
    return next(run.glob("step_*")), snapshot(parts)


# ------------------------------------------------------------ check, then use


def test_the_metadata_used_is_the_metadata_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both metadata files replaced on disk right after their checksums matched: the
    restore uses the bytes it checked, never the files' new content."""
    ckpt, _ = saved(tmp_path / "a", 64)
    other, _ = saved(tmp_path / "b", 32)
    original = read_dcp_metadata(ckpt).state_dict_metadata
    verify = VerifiedFiles.verify

    def verify_then_swap(self: VerifiedFiles, names: object) -> None:
        names = list(names)  # type: ignore[call-overload]
        verify(self, names)
        for name in {".metadata", ".metadata.json"} & set(names):
            shutil.copyfile(other / name, ckpt / name)

    monkeypatch.setattr(VerifiedFiles, "verify", verify_then_swap)
    files, metadata = verified_checkpoint(ckpt)
    files.close()
    assert metadata.state_dict_metadata == original


def test_data_files_overwritten_after_their_check_are_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every data file overwritten (same size) right after its checksum matched: the
    restore gives the checked values, as it never reads a file a second time."""
    ckpt, want = saved(tmp_path / "a", 64)
    verify = VerifiedFiles.verify

    def verify_then_overwrite(self: VerifiedFiles, names: object) -> None:
        names = list(names)  # type: ignore[call-overload]
        verify(self, names)
        for name in names:
            if name.endswith(".distcp"):
                size = (ckpt / name).stat().st_size
                (ckpt / name).write_bytes(b"\xff" * size)

    monkeypatch.setattr(VerifiedFiles, "verify", verify_then_overwrite)
    parts = make_parts(hidden=64)
    load_checkpoint(ckpt, parts.state)
    assert_same(want["model"], dict(parts.model.state_dict()))
    assert_same(want["optimizer"], torch.optim.Optimizer.state_dict(parts.optimizer))


def _overcommit_refuses_a_tebibyte() -> bool:
    """Whether the kernel fails a 1 TiB allocation at once (mode 1 would grant it and
    the zero-fill would bring in the OOM killer)."""
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() in ("0", "2")
    except OSError:
        return False


@pytest.mark.skipif(not _overcommit_refuses_a_tebibyte(), reason="needs Linux's overcommit check")
def test_a_file_too_big_to_hold_is_a_clear_error_not_a_memory_error(tmp_path: Path) -> None:
    """A (sparse) file of 1 TiB whose manifest entry says so: holding it in memory fails
    with a CheckpointCorruptError every rank can agree on, not a MemoryError."""
    ckpt, _ = saved(tmp_path / "a", 16)
    manifest = read_manifest(ckpt)
    entry = next(e for e in manifest.files if e.path.endswith(".distcp"))
    os.truncate(ckpt / entry.path, 2**40)
    files = [dataclasses.replace(e, size=2**40) if e is entry else e for e in manifest.files]
    held = VerifiedFiles(ckpt, dataclasses.replace(manifest, files=files))
    with pytest.raises(stalwart.CheckpointCorruptError, match="cannot hold") as info:
        held.verify([entry.path])
    assert info.value.transient


def test_metadata_pointing_a_tensor_at_another_shape_s_record_is_a_clear_error(
    tmp_path: Path,
) -> None:
    """Metadata (consistent with its manifest) whose storage entry for one tensor names
    another tensor's record: the reader names the item and both shapes."""
    ckpt, _ = saved(tmp_path / "a", 16)
    metadata = read_dcp_metadata(ckpt)
    index = {i.fqn: i for i in metadata.storage_data}
    metadata.storage_data[index["model.0.weight"]] = metadata.storage_data[index["model.0.bias"]]
    files = VerifiedFiles(ckpt, read_manifest(ckpt))
    target = {"model.0.weight": torch.zeros(16, 4)}
    reader = VerifiedFileReader(ckpt, files=files, metadata=metadata)
    with pytest.raises(
        stalwart.CheckpointCorruptError, match=r"'model.0.weight' holds shape \[16\]"
    ):
        safe_load(target, ckpt, metadata=metadata, reader=reader)
    files.close()
    assert not target["model.0.weight"].any()


def test_a_file_truncated_after_the_size_pass_is_refused_before_use(tmp_path: Path) -> None:
    """VerifiedFiles re-checks the size of what it read, not only of what the manifest
    pass saw: a file cut short in between is a size problem, never a short buffer."""
    ckpt, _ = saved(tmp_path / "a", 16)
    manifest = read_manifest(ckpt)
    entry = next(e for e in manifest.files if e.path.endswith(".distcp"))
    os.truncate(ckpt / entry.path, entry.size // 2)
    files = VerifiedFiles(ckpt, manifest)
    with pytest.raises(stalwart.CheckpointCorruptError, match="truncated") as info:
        files.verify([entry.path])
    assert not info.value.transient
    with pytest.raises(stalwart.CheckpointCorruptError, match="truncated"):
        files.held(entry.path)


def test_after_a_bad_file_the_files_not_started_are_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, _ = saved(tmp_path / "a", 16)
    manifest = read_manifest(ckpt)
    names = [f"x{i}.bin" for i in range(40)]
    for name in names:
        (ckpt / name).write_bytes(b"y" * 4096)
    files = [*manifest.files, *(FileEntry(path=n, size=4096, xxh3_128="0" * 32) for n in names)]
    checked = VerifiedFiles(ckpt, dataclasses.replace(manifest, files=files))
    read = VerifiedFiles._read

    def slow_read(self: VerifiedFiles, name: str) -> object:
        if name != "x0.bin":
            time.sleep(0.05)  # the bad first file is seen while the others are in flight
        return read(self, name)

    monkeypatch.setattr(VerifiedFiles, "_read", slow_read)
    with pytest.raises(stalwart.CheckpointCorruptError, match=r"x0\.bin: checksum mismatch"):
        checked.verify(names)
    assert sum(checked.reads.values()) <= len(names) // 2, checked.reads


# ------------------------------------------------------------ crafted records


def _members(tensor: torch.Tensor) -> list[tuple[str, bytes]]:
    out = io.BytesIO()
    torch.save(tensor, out)
    with zipfile.ZipFile(io.BytesIO(out.getvalue())) as zf:
        return [(info.filename, zf.read(info)) for info in zf.infolist()]


def _rezip(members: list[tuple[str, bytes]], *, zip64: bool = False) -> memoryview:
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are the point of one case
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, data in members:
                with zf.open(name, "w", force_zip64=zip64) as f:
                    f.write(data)
    return memoryview(bytearray(out.getvalue()))


def test_a_rebuilt_archive_of_the_same_records_still_decodes() -> None:
    tensor = torch.randn(3, 4)
    got = decode_tensor(_rezip(_members(tensor)), torch.float32, (3, 4))
    assert got is not None and torch.equal(got, tensor)


def test_a_storage_record_of_the_wrong_length_is_not_decoded() -> None:
    for data in (b"\0" * 44, b"\0" * 52, b""):
        members = [
            (name, data if name.endswith("/data/0") else blob)
            for name, blob in _members(torch.randn(3, 4))
        ]
        assert decode_tensor(_rezip(members), torch.float32, (3, 4)) is None


def test_duplicate_names_are_not_decoded() -> None:
    members = _members(torch.randn(3, 4))
    record = next(m for m in members if m[0].endswith("/data/0"))
    for crafted in ([*members, record], [record, *members]):
        assert decode_tensor(_rezip(crafted), torch.float32, (3, 4)) is None


def test_a_zip64_archive_decodes_to_the_same_tensor_or_not_at_all() -> None:
    """Local zip64 headers (sizes in an extra field) are skipped by their lengths: the
    bytes decoded are the record's, exactly what torch.load reads."""
    tensor = torch.randn(3, 4)
    got = decode_tensor(_rezip(_members(tensor), zip64=True), torch.float32, (3, 4))
    assert got is None or torch.equal(got, tensor)
    loaded = torch.load(io.BytesIO(bytes(_rezip(_members(tensor), zip64=True))), weights_only=True)
    assert torch.equal(loaded, tensor)


def test_offsets_pointing_outside_the_record_are_not_decoded() -> None:
    view = _rezip(_members(torch.randn(3, 4)))
    end = bytes(view).rindex(b"PK\x05\x06")
    central = int.from_bytes(view[end + 16 : end + 20], "little")
    for field, value in (
        (central + 42, len(view) + 10),
        (central + 42, 2**32 - 1),
        (end + 16, len(view)),
    ):
        bent = bytearray(view)
        bent[field : field + 4] = value.to_bytes(4, "little")
        assert decode_tensor(memoryview(bent), torch.float32, (3, 4)) is None


# ------------------------------------------------------------ optimizer of another kind


def _sgd_checkpoint(run: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with stalwart.CheckpointManager(run, every_steps=1) as ckpt:
        ckpt.save(1, stalwart.TrainState(model=model, optimizer=opt, rng=False))
    return next(run.glob("step_*"))


def test_an_optimizer_of_another_kind_is_a_clear_mismatch_and_stays_untouched(
    tmp_path: Path,
) -> None:
    path = _sgd_checkpoint(tmp_path)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(stalwart.StateMismatchError, match="betas"):
        load_checkpoint(path, stalwart.TrainState(model=model, optimizer=opt, rng=False))
    assert not opt.state and [dict(g) for g in opt.param_groups] == groups


def test_an_optimizer_of_another_kind_loads_the_shared_keys_when_not_strict(
    tmp_path: Path,
) -> None:
    """strict=False loads the keys both have; the optimizer's own state comes from its
    own initialisation, never SGD's momentum buffers (which Adam cannot load: its
    load_state_dict raised KeyError 'step' with the live state half restored)."""
    path = _sgd_checkpoint(tmp_path)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    load_checkpoint(path, stalwart.TrainState(model=model, optimizer=opt, rng=False), strict=False)
    assert opt.param_groups[0]["lr"] == 0.1
    assert all("momentum_buffer" not in state for state in opt.state.values())


def test_a_fresh_optimizer_under_a_scheduler_is_still_restored_without_a_step(
    tmp_path: Path,
) -> None:
    """A scheduler adds ``initial_lr`` to the param groups: saved and live groups still
    agree, so the state comes from the metadata, not from a step."""
    ckpt, want = saved(tmp_path, 16)
    parts = make_parts(hidden=16)
    assert "initial_lr" in parts.optimizer.param_groups[0]
    steps = [0]
    parts.optimizer.register_step_pre_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    load_checkpoint(ckpt, parts.state)
    assert steps == [0]
    assert_same(want["optimizer"], torch.optim.Optimizer.state_dict(parts.optimizer))


def test_param_groups_split_otherwise_are_a_clear_mismatch_and_stay_untouched(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with stalwart.CheckpointManager(tmp_path, every_steps=1) as ckpt:
        ckpt.save(1, stalwart.TrainState(model=model, optimizer=opt, rng=False))
    path = next(tmp_path.glob("step_*"))
    for groups in ([{"params": [0]}, {"params": [1]}], [{"params": [0]}]):
        fresh = torch.nn.Linear(4, 2)
        params = list(fresh.parameters())
        live = torch.optim.Adam([{"params": [params[i] for i in g["params"]]} for g in groups])
        before = [dict(g) for g in live.param_groups]
        with pytest.raises(stalwart.StateMismatchError, match="optimizer"):
            load_checkpoint(path, stalwart.TrainState(model=fresh, optimizer=live, rng=False))
        assert not live.state and [dict(g) for g in live.param_groups] == before
