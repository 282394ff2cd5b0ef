"""``.metadata.json``: the same metadata as DCP's pickle, read by a restore without any class lookup."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import stalwart
from stalwart import metadata_json
from stalwart.dcp_metadata import metadata_from_bytes
from stalwart.reader import verified_checkpoint
from stalwart.save_plan import SavePlanCache

from .conftest import assert_same, make_parts, snapshot, train_steps
from .hostile.harness import resign

NAME = ".metadata.json"


def saved(run: Path, steps: tuple[int, ...] = (2,)) -> tuple[Path, dict]:
    """The newest of ``steps`` saved checkpoints of a small model, and its snapshot."""
    parts = make_parts(hidden=16)
    with stalwart.CheckpointManager(run, every_steps=1) as ckpt:
        done = 0
        for step in steps:
            train_steps(parts, step - done)
            done = step
            ckpt.save(step, parts.state)
    return run / f"step_{steps[-1]:09d}", snapshot(parts)


def pickled(checkpoint: Path) -> Metadata:
    data = (checkpoint / ".metadata").read_bytes()
    return metadata_from_bytes(data, str(checkpoint), lambda name: 1 << 40)


def decoded(data: bytes) -> Metadata:
    metadata = metadata_json.decode(data, "m.json")
    assert metadata is not None
    return metadata


def tensor(shape: list[int], chunks: list[tuple[list[int], list[int]]], **props: Any) -> Any:
    return TensorStorageMetadata(
        properties=TensorProperties(**{"dtype": torch.float32, **props}),
        size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def handmade(**overrides: Any) -> Metadata:
    """Metadata of the kinds a sharded save writes: several chunks, bytes, every property."""
    fields: dict[str, Any] = {
        "state_dict_metadata": {
            "w": tensor([4, 6], [([0, 0], [2, 6]), ([2, 0], [2, 6])]),
            "h": tensor(
                [2, 3, 4, 5],
                [([0, 0, 0, 0], [2, 3, 4, 5])],
                dtype=torch.bfloat16,
                requires_grad=True,
                memory_format=torch.channels_last,
                pin_memory=True,
            ),
            "s": tensor([], [([], [])], dtype=torch.int64),
            "extra.step": BytesStorageMetadata(),
        },
        "planner_data": {"w": ("w",), "extra.step": ("extra", "step"), "l.0": ("l", 0)},
        "storage_data": {
            MetadataIndex("w", [0, 0], 0): _StorageInfo("__0_0.distcp", 0, 48),
            MetadataIndex("w", [2, 0], 1): _StorageInfo("__1_0.distcp", 0, 48),
            MetadataIndex("h", [0, 0, 0, 0]): _StorageInfo("__0_0.distcp", 48, 240),
            MetadataIndex("s", []): _StorageInfo("__0_0.distcp", 288, 8),
            MetadataIndex("extra.step"): _StorageInfo(
                "__0_0.distcp", 296, 20, transform_descriptors=["x"]
            ),
        },
        "storage_meta": StorageMeta(
            checkpoint_id=pathlib.Path("/runs/a/.step_1.tmp-ab"), save_id="id", modules=["m"]
        ),
        "version": "1.0.0",
    }
    fields.update(overrides)
    return Metadata(**fields)


# ------------------------------------------------------------------ the same metadata


def test_every_kind_of_entry_round_trips_to_equal_metadata() -> None:
    original = handmade()
    back = decoded(metadata_json.encode(original) or b"")
    assert back == original
    # == skips MetadataIndex.index; the chunk search of a load uses it.
    assert [i.index for i in back.storage_data] == [i.index for i in original.storage_data]
    assert back.planner_data == original.planner_data
    assert all(type(path) is tuple for path in back.planner_data.values())
    h = back.state_dict_metadata["h"].properties
    assert (h.dtype, h.memory_format, h.requires_grad, h.pin_memory) == (
        torch.bfloat16,
        torch.channels_last,
        True,
        True,
    )


@pytest.mark.parametrize(
    "storage_meta",
    [
        None,
        StorageMeta(checkpoint_id="s3://bucket/run", save_id=None, load_id="l", modules=[]),
        StorageMeta(checkpoint_id=None),
    ],
    ids=["none", "string id", "no id"],
)
def test_storage_meta_and_version_round_trip(storage_meta: StorageMeta | None) -> None:
    original = handmade(storage_meta=storage_meta, version=None, planner_data=None)
    assert decoded(metadata_json.encode(original) or b"") == original


def test_a_saved_checkpoint_s_twin_holds_what_its_pickle_holds(tmp_path: Path) -> None:
    checkpoint, _ = saved(tmp_path / "run")
    data = (checkpoint / NAME).read_bytes()
    assert json.loads(data)["format"] == metadata_json.FORMAT
    assert decoded(data) == pickled(checkpoint)
    assert metadata_json.read_metadata_json(checkpoint) == pickled(checkpoint)


def test_the_second_save_s_spliced_twin_is_what_encoding_it_gives(tmp_path: Path) -> None:
    """The cache replaces the staging directory's name and the save id in the last
    save's bytes; the result must be exactly a fresh encoding of this save's metadata."""
    checkpoint, _ = saved(tmp_path / "run", steps=(1, 2, 3))
    assert metadata_json.encode(pickled(checkpoint)) == (checkpoint / NAME).read_bytes()
    older = tmp_path / "run" / "step_000000002"
    assert metadata_json.encode(pickled(older)) == (older / NAME).read_bytes()


def _named(step: int, save_id: str) -> Metadata:
    meta = StorageMeta(
        checkpoint_id=pathlib.Path(f"/runs/a/.step_{step}.tmp-cd"), save_id=save_id, modules=[]
    )
    return handmade(storage_meta=meta)


def test_the_cache_splices_json_only_where_a_name_is_written_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every answer equals a fresh encoding. The first save's id "__" also occurs in the
    data files' names, so the second save cannot replace it in place and is encoded
    anew; the third save's names replace the second's (no encoding)."""
    encode = metadata_json.encode
    encoded: list[Metadata] = []

    def counting(metadata: Metadata) -> bytes | None:
        encoded.append(metadata)
        return encode(metadata)

    monkeypatch.setattr(metadata_json, "encode", counting)
    cache = SavePlanCache()
    for step, save_id, fresh in ((1, "__", True), (2, "Q8", True), (3, "Q9", False)):
        metadata = _named(step, save_id)
        encoded.clear()
        assert cache.metadata_files(metadata) == (pickle.dumps(metadata), encode(metadata))
        assert (encoded == [metadata]) == fresh, (save_id, encoded)


@pytest.mark.parametrize(
    "overrides",
    [
        {"planner_data": {"w": ["w"]}},  # a list path: the pickle would give a list back
        {"storage_meta": StorageMeta(checkpoint_id=pathlib.PureWindowsPath("C:/r"))},
        {"version": 1},
        {"state_dict_metadata": {"w": "not an entry"}},
        {"state_dict_metadata": {"w": tensor([2], [([0], [2])])}, "storage_data": None},
        {
            "state_dict_metadata": {
                "w": TensorStorageMetadata(TensorProperties(), torch.Size([2]), None)
            }
        },  # type: ignore[arg-type]
    ],
    ids=["list path", "foreign path", "int version", "odd entry", "no storage", "chunks None"],
)
def test_metadata_json_cannot_hold_exactly_gets_no_twin(overrides: dict[str, Any]) -> None:
    assert metadata_json.encode(handmade(**overrides)) is None


# ------------------------------------------------------------------ restore reads it


def test_restore_reads_the_twin_and_not_the_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint, want = saved(tmp_path / "run")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pickle was unpickled")

    monkeypatch.setattr("stalwart.reader.metadata_from_bytes", refuse)
    files, metadata = verified_checkpoint(checkpoint)
    files.close()
    assert metadata == pickled(checkpoint)
    parts = make_parts(hidden=16)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        assert ckpt.restore(parts.state) == 2
    assert_same(want, snapshot(parts))


def _drop_twin(checkpoint: Path) -> None:
    (checkpoint / NAME).unlink()
    resign(
        checkpoint, lambda body: body.update(files=[e for e in body["files"] if e["path"] != NAME])
    )


def _later_twin(checkpoint: Path) -> None:
    (checkpoint / NAME).write_text(json.dumps({"format": metadata_json.FORMAT, "version": 2}))
    resign(checkpoint)
    assert metadata_json.read_metadata_json(checkpoint) is None


@pytest.mark.parametrize("change", [_drop_twin, _later_twin], ids=["no twin", "later version"])
def test_without_a_twin_it_can_read_the_restore_reads_the_pickle(
    tmp_path: Path, change: Any
) -> None:
    """No twin: as an older stalwart wrote it (or a tool that copied only DCP's
    files); a twin of a later format version: left for the pickle, not refused."""
    checkpoint, want = saved(tmp_path / "run")
    change(checkpoint)
    parts = make_parts(hidden=16)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        assert ckpt.restore(parts.state) == 2
    assert_same(want, snapshot(parts))


def test_a_manifest_that_lists_only_the_twin_restores_from_it(tmp_path: Path) -> None:
    """The twin is enough for stalwart (a copy that left out DCP's pickle): it is
    checked and read; nothing is read from a file the manifest does not list."""
    checkpoint, want = saved(tmp_path / "run")
    (checkpoint / ".metadata").unlink()
    resign(
        checkpoint,
        lambda body: body.update(files=[e for e in body["files"] if e["path"] != ".metadata"]),
    )
    parts = make_parts(hidden=16)
    with stalwart.CheckpointManager(tmp_path / "run") as ckpt:
        assert ckpt.restore(parts.state) == 2
    assert_same(want, snapshot(parts))


def test_a_flipped_bit_in_either_metadata_file_falls_back(tmp_path: Path) -> None:
    """Both files are checked on every restore, whichever is read."""
    for name in (NAME, ".metadata"):
        run = tmp_path / name
        checkpoint, _ = saved(run, steps=(1, 2))
        data = bytearray((checkpoint / name).read_bytes())
        data[len(data) // 2] ^= 0x10
        (checkpoint / name).write_bytes(bytes(data))
        parts = make_parts(hidden=16)
        with stalwart.CheckpointManager(run) as ckpt:
            assert ckpt.restore(parts.state) == 1, name


def test_a_linked_twin_is_not_followed(tmp_path: Path) -> None:
    checkpoint, _ = saved(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere.json"
    (checkpoint / NAME).rename(elsewhere)
    os.symlink(elsewhere, checkpoint / NAME)
    with pytest.raises(stalwart.CheckpointCorruptError, match="symbolic link"):
        metadata_json.read_metadata_json(checkpoint)


# ------------------------------------------------------------------ hostile JSON


def _document() -> dict[str, Any]:
    return json.loads(metadata_json.encode(handmade()) or b"")


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        target: Any = doc
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return edit


MALFORMED = [
    ("not json", lambda doc: "{"),
    ("a list", lambda doc: []),
    ("another format", _set(("format",), "x")),
    ("version 0", _set(("version",), 0)),
    ("version as a string", _set(("version",), "1")),
    ("a missing key", lambda doc: {k: v for k, v in doc.items() if k != "planner_data"}),
    ("an extra key", _set(("code",), "import os")),
    ("bool in a size", _set(("state_dict_metadata", "w", 5), [True, 6])),
    ("float in a size", _set(("state_dict_metadata", "w", 5), [4.0, 6])),
    ("size a string", _set(("state_dict_metadata", "w", 5), "46")),
    ("int past int64", _set(("state_dict_metadata", "w", 5), [2**64, 1])),
    ("unknown dtype", _set(("state_dict_metadata", "w", 0), "__class__")),
    ("unknown layout", _set(("state_dict_metadata", "w", 1), "strided")),
    ("unknown memory format", _set(("state_dict_metadata", "w", 3), "torch.channels_last")),
    ("requires_grad 1", _set(("state_dict_metadata", "w", 2), 1)),
    ("six fields", _set(("state_dict_metadata", "w"), ["float32"] * 6)),
    ("a chunk of three", _set(("state_dict_metadata", "w", 6, 0), [[0, 0], [2, 6], []])),
    ("entry an object", _set(("state_dict_metadata", "w"), {"dtype": "float32"})),
    ("storage row short", _set(("storage_data", 0), ["w", [0, 0], 0, "__0_0.distcp", 0])),
    ("file name a number", _set(("storage_data", 0, 3), 7)),
    ("offset a float", _set(("storage_data", 0, 4), 0.0)),
    ("length NaN", _set(("storage_data", 0, 5), float("nan"))),
    ("index a string", _set(("storage_data", 0, 2), "0")),
    ("descriptors a string", _set(("storage_data", 4, 6), "x")),
    ("planner path a string", _set(("planner_data", "w"), "w")),
    ("storage_meta short", _set(("storage_meta",), ["a", False])),
    ("module an int", _set(("storage_meta", 4), [1])),
    ("is_path a string", _set(("storage_meta", 1), "yes")),
]


@pytest.mark.parametrize(("name", "edit"), MALFORMED, ids=[n for n, _ in MALFORMED])
def test_malformed_json_is_a_corrupt_checkpoint_naming_the_file(name: str, edit: Any) -> None:
    doc = _document()
    out = edit(doc)
    doc = doc if out is None else out
    data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
    with pytest.raises(stalwart.CheckpointCorruptError, match=r"m\.json: not valid stalwart"):
        metadata_json.decode(data, "m.json")


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 200_000 + b"]" * 200_000,
        b'{"format":"stalwart.dcp-metadata","version":1' + b',"x":1' * 10 + b"}",
        b"1" * 5000,
        b"\xff\xfe",
    ],
    ids=["deep nesting", "repeated keys", "5000-digit number", "not utf-8"],
)
def test_hostile_bytes_are_refused_without_a_crash(data: bytes) -> None:
    with pytest.raises(stalwart.CheckpointCorruptError, match=r"m\.json"):
        metadata_json.decode(data, "m.json")


def test_well_formed_json_still_gets_every_metadata_check(tmp_path: Path) -> None:
    """Decoding proves types; the bounds and file names are dcp_metadata's checks, the
    same the pickle gets: a file outside the checkpoint, data past a file's end."""
    checkpoint, _ = saved(tmp_path / "run")
    doc = json.loads((checkpoint / NAME).read_text())
    doc["storage_data"][0][3] = "../../etc/passwd"
    (checkpoint / NAME).write_text(json.dumps(doc))
    with pytest.raises(stalwart.UnsafeCheckpointError, match="not a file name inside"):
        metadata_json.read_metadata_json(checkpoint)
    doc["storage_data"][0][3] = "__0_0.distcp"
    doc["storage_data"][0][4] = 10**12
    (checkpoint / NAME).write_text(json.dumps(doc))
    with pytest.raises(stalwart.CheckpointCorruptError, match=r"which has \d+ bytes"):
        metadata_json.read_metadata_json(checkpoint)
