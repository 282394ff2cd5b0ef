"""Loading a checkpoint runs no code from it: stalwart.safe_load against real DCP files."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import random
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from stalwart.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_dcp_metadata,
    safe_load,
    tensor_table,
)

# --------------------------------------------------------------------------- helpers


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(idx))


def _trained_state(seed: int) -> dict[str, Any]:
    """Model + Adam after one step, plus extras of many dtypes and python values."""
    torch.manual_seed(seed)
    model = _Model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-3 * (seed + 1))
    model(torch.tensor([0, 1, 4])).square().sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "extra": {
            "bf16": torch.randn(3, 2, generator=gen).to(torch.bfloat16),
            "i64": torch.randint(-(2**40), 2**40, (4,), generator=gen),
            "mask": torch.rand(5, generator=gen) > 0.5,
            "scalar": torch.tensor(float(seed) + 0.25),
            "nested": {"deeper": {"f32": torch.randn(2, 2, 2, generator=gen)}},
            "step": 100 + seed,
            "loss": 0.5 + seed,
            "name": f"run-{seed}",
            "nothing": None if seed == 0 else "something",
            "ints": [seed, seed + 1, seed + 2],
            "pair": (seed, f"s{seed}"),
        },
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_identical(got: Any, want: Any, where: str = "") -> None:
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, where
        assert got.shape == want.shape, where
        assert torch.equal(_bits(got), _bits(want)), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_identical(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_identical(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def _save(state: dict[str, Any], directory: Path) -> Path:
    dcp.save(state, checkpoint_id=directory)
    return directory


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return _save(_trained_state(0), tmp_path / "step_000000010")


def _genuine_metadata(directory: Path) -> Metadata:
    # The test wrote this file itself, so the full unpickler is fine here.
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    assert isinstance(metadata, Metadata)
    return metadata


def _write_metadata(directory: Path, metadata: object) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


class _Exploit:
    """Unpickles into a side effect: creates ``target``."""

    def __init__(self, how: str, target: Path) -> None:
        self.how = how
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        if self.how == "os.system":
            return (os.system, (f"touch {shlex.quote(str(self.target))}",))
        if self.how == "exec":
            return (exec, (f"open({str(self.target)!r}, 'w').close()",))
        assert self.how == "Path.touch"
        return (pathlib.Path.touch, (self.target,))


# The global each payload names in a protocol-4 pickle (what .metadata uses).
_PAYLOAD_GLOBALS = {
    "os.system": f"{os.system.__module__}.system",
    "exec": "builtins.exec",
    "Path.touch": "pathlib.Path.touch",
}


# ----------------------------------------------------------------- genuine checkpoints


def test_safe_load_round_trips_model_optimizer_and_python_values_bit_exactly(
    checkpoint: Path,
) -> None:
    want = _trained_state(0)
    target = _trained_state(1)  # same structure, every value different
    with pytest.raises(AssertionError):
        _assert_identical(target, want)

    safe_load(target, checkpoint)

    _assert_identical(target, want)


def test_read_dcp_metadata_matches_dcp_own_reader(checkpoint: Path) -> None:
    ours = read_dcp_metadata(checkpoint)
    theirs = dcp.FileSystemReader(checkpoint).read_metadata()

    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for fqn, entry in theirs.state_dict_metadata.items():
        assert ours.state_dict_metadata[fqn] == entry, fqn
        if hasattr(entry, "properties"):
            assert ours.state_dict_metadata[fqn].properties.dtype == entry.properties.dtype
            assert ours.state_dict_metadata[fqn].properties.layout == entry.properties.layout
            assert (
                ours.state_dict_metadata[fqn].properties.memory_format
                == entry.properties.memory_format
            )
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    assert ours.version == theirs.version


def test_read_dcp_metadata_accepts_the_metadata_file_itself(checkpoint: Path) -> None:
    by_file = read_dcp_metadata(checkpoint / ".metadata")
    by_dir = read_dcp_metadata(str(checkpoint))
    assert by_file.state_dict_metadata == by_dir.state_dict_metadata


def test_safe_reader_keeps_storage_meta_and_load_id_handling(checkpoint: Path) -> None:
    reader = SafeFileSystemReader(checkpoint)
    metadata = reader.read_metadata()
    assert metadata.storage_meta is not None
    assert metadata.storage_meta.load_id == reader.load_id


def test_safe_reader_and_planner_work_with_dcp_load_directly(checkpoint: Path) -> None:
    target = _trained_state(1)
    dcp.load(target, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner())
    _assert_identical(target, _trained_state(0))


def test_channels_last_and_every_dtype_metadata_is_readable(tmp_path: Path) -> None:
    """Every dtype torch can save, and a channels-last tensor, pass the allow-list."""
    state = {
        "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        **{
            f"t_{dtype}".replace(".", "_"): torch.zeros(2, dtype=dtype)
            for dtype in (
                torch.float16,
                torch.float64,
                torch.complex64,
                torch.int8,
                torch.uint8,
                torch.int16,
                torch.int32,
                torch.float8_e4m3fn,
            )
        },
    }
    directory = _save(state, tmp_path / "ck")
    rows = {row["fqn"]: row for row in tensor_table(read_dcp_metadata(directory))}
    assert rows["t_torch_float8_e4m3fn"]["dtype"] == "float8_e4m3fn"
    assert rows["cl"]["shape"] == [2, 3, 4, 5]


# ----------------------------------------------------------------- tampered .metadata


@pytest.mark.parametrize("how", sorted(_PAYLOAD_GLOBALS))
def test_crafted_metadata_is_refused_without_running_it(
    checkpoint: Path, tmp_path: Path, how: str
) -> None:
    marker = tmp_path / f"pwned-{how}"
    metadata = _genuine_metadata(checkpoint)
    # Buried deep inside otherwise genuine metadata, as an attacker would.
    metadata.storage_meta.modules = ["model", _Exploit(how, marker)]
    _write_metadata(checkpoint, metadata)
    metadata_file = str(checkpoint / ".metadata")

    with pytest.raises(UnsafeCheckpointError) as read_err:
        read_dcp_metadata(checkpoint)
    with pytest.raises(UnsafeCheckpointError) as load_err:
        safe_load(_trained_state(1), checkpoint)

    assert not marker.exists()
    for err in (read_err.value, load_err.value):
        assert err.path == metadata_file
        assert metadata_file in str(err)
        assert f"'{_PAYLOAD_GLOBALS[how]}'" in str(err)
    assert isinstance(load_err.value.__cause__, CheckpointException)

    # The threat is real: the same bytes run the payload under a plain unpickler.
    pickle.loads((checkpoint / ".metadata").read_bytes())
    assert marker.exists()


def _build_pickle(*parts: bytes) -> bytes:
    return b"\x80\x04" + b"".join(parts) + b"."


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


# BUILD on the object left by a GLOBAL sets attributes on that shared object:
# (None, {name: 1}) is the "slot state" form, which uses setattr.
_SET_ATTR = b"N}" + _str("pwned") + b"K\x01s\x86b"


@pytest.mark.parametrize(
    ("payload", "shared"),
    [
        pytest.param(
            _build_pickle(_global("torch.distributed.checkpoint.metadata", "Metadata"), _SET_ATTR),
            lambda: Metadata,
            id="class-attribute",
        ),
        pytest.param(
            _build_pickle(_global("torch", "float32"), _SET_ATTR),
            lambda: torch.float32,
            id="dtype-attribute",
        ),
        pytest.param(
            _build_pickle(
                _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                b"K\x00\x85R",  # _MEM_FORMAT_ENCODING(0): the shared enum member
                _SET_ATTR,
            ),
            lambda: __import__(
                "torch.distributed.checkpoint.metadata", fromlist=["_MEM_FORMAT_ENCODING"]
            )._MEM_FORMAT_ENCODING(0),
            id="enum-member-attribute",
        ),
    ],
)
def test_metadata_cannot_modify_allowed_classes_or_shared_objects(
    tmp_path: Path, payload: bytes, shared: Any
) -> None:
    metadata_file = tmp_path / ".metadata"
    metadata_file.write_bytes(payload)

    try:
        with pytest.raises(UnsafeCheckpointError, match="refused to set the state of"):
            read_dcp_metadata(metadata_file)
        assert not hasattr(shared(), "pwned")
    finally:
        # Keep a failure here from leaking into every later test in the process.
        if hasattr(shared(), "pwned"):
            delattr(shared(), "pwned")


def test_a_find_class_allow_list_alone_would_let_metadata_rewrite_a_class(
    tmp_path: Path,
) -> None:
    """Why the BUILD check exists: the C unpickler with only find_class is fooled."""

    class FindClassOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            assert (module, name) == ("torch.distributed.checkpoint.metadata", "Metadata")
            return Metadata

    payload = _build_pickle(_global("torch.distributed.checkpoint.metadata", "Metadata"), _SET_ATTR)
    try:
        FindClassOnly(io.BytesIO(payload)).load()
        assert getattr(Metadata, "pwned", None) == 1
    finally:
        if hasattr(Metadata, "pwned"):
            delattr(Metadata, "pwned")


def test_metadata_pointing_outside_the_checkpoint_is_refused(
    checkpoint: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.pt"
    stolen = torch.full((5, 4), 42.0)  # the shape of model.embed.weight
    torch.save(stolen, secret)
    metadata = _genuine_metadata(checkpoint)
    for index, info in metadata.storage_data.items():
        if index.fqn == "model.embed.weight":
            info.relative_path = "../secret.pt"
            info.offset, info.length = 0, secret.stat().st_size
    _write_metadata(checkpoint, metadata)

    with pytest.raises(UnsafeCheckpointError, match=r"'\.\./secret\.pt'"):
        read_dcp_metadata(checkpoint)
    target = _trained_state(1)
    with pytest.raises(UnsafeCheckpointError):
        safe_load(target, checkpoint)
    assert not torch.equal(target["model"]["embed.weight"], stolen)

    # Plain DCP follows the path and loads a file from outside the checkpoint.
    dcp.load(target, checkpoint_id=checkpoint)
    assert torch.equal(target["model"]["embed.weight"], stolen)


# ------------------------------------------------- allowed classes, impossible numbers


def _entry(metadata: Metadata, fqn: str) -> Any:
    return metadata.state_dict_metadata[fqn]


def _stored(metadata: Metadata, fqn: str) -> Any:
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


def _negative_size(m: Metadata) -> None:
    _entry(m, "model.proj.weight").size = torch.Size([-3, 4])


def _huge_tensor(m: Metadata) -> None:
    # 2**40 float32 elements: 4 TiB if a reader allocated the declared size.
    entry = _entry(m, "model.proj.weight")
    entry.size = torch.Size([2**20, 2**20])
    entry.chunks[0].sizes = torch.Size([2**20, 2**20])


def _huge_but_chunk_small(m: Metadata) -> None:
    _entry(m, "model.proj.weight").size = torch.Size([2**20, 2**20])


def _chunk_outside(m: Metadata) -> None:
    _entry(m, "model.proj.weight").chunks[0].offsets = torch.Size([2, 0])


def _chunk_wrong_rank(m: Metadata) -> None:
    _entry(m, "model.proj.weight").chunks[0].sizes = torch.Size([3])


def _data_past_file_end(m: Metadata) -> None:
    _stored(m, "model.proj.weight").offset = 10**9


def _chunk_bigger_than_its_bytes(m: Metadata) -> None:
    _stored(m, "model.proj.weight").length = 8


def _chunk_without_data(m: Metadata) -> None:
    for index in list(m.storage_data):
        if index.fqn == "model.proj.weight":
            del m.storage_data[index]


def _planner_data_not_a_dict(m: Metadata) -> None:
    m.planner_data = ["model", "proj"]


def _planner_data_huge_index(m: Metadata) -> None:
    m.planner_data = {"extra.ints.0": ("extra", "ints", 2**40)}


def _planner_data_bad_part(m: Metadata) -> None:
    m.planner_data = {"extra.step": ("extra", 1.5)}


@pytest.mark.parametrize(
    ("tamper", "complaint"),
    [
        (_negative_size, "has size"),
        (_huge_tensor, "needs 4398046511104 bytes"),
        (_huge_but_chunk_small, "more than the"),
        (_chunk_outside, "not inside it"),
        (_chunk_wrong_rank, "not inside it"),
        (_data_past_file_end, "which has"),
        (_chunk_bigger_than_its_bytes, "its stored data has 8"),
        (_chunk_without_data, "no stored data"),
        (_planner_data_not_a_dict, "planner_data is a list"),
        (_planner_data_huge_index, "list indices below"),
        (_planner_data_bad_part, "list indices below"),
    ],
)
def test_metadata_of_allowed_classes_with_impossible_numbers_is_corrupt(
    checkpoint: Path, tamper: Callable[[Metadata], None], complaint: str
) -> None:
    """Checked before anything is allocated or indexed: corrupt, naming the file."""
    metadata = _genuine_metadata(checkpoint)
    tamper(metadata)
    _write_metadata(checkpoint, metadata)
    with pytest.raises(CheckpointCorruptError, match=complaint) as err:
        read_dcp_metadata(checkpoint)
    assert err.value.path == str(checkpoint / ".metadata")
    with pytest.raises(CheckpointCorruptError, match=complaint):
        safe_load(_trained_state(1), checkpoint)


def test_genuine_metadata_passes_the_bounds_checks(checkpoint: Path) -> None:
    metadata = read_dcp_metadata(checkpoint)
    assert (
        metadata.state_dict_metadata.keys()
        == _genuine_metadata(checkpoint).state_dict_metadata.keys()
    )


def test_metadata_that_is_a_link_or_a_device_is_never_read(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A symlink to /dev/zero would be read forever; a link elsewhere would load that file."""
    real = tmp_path / "real.metadata"
    (checkpoint / ".metadata").rename(real)
    (checkpoint / ".metadata").symlink_to(real)
    with pytest.raises(CheckpointCorruptError, match="symbolic link") as err:
        read_dcp_metadata(checkpoint)
    assert err.value.path == str(checkpoint / ".metadata")
    (checkpoint / ".metadata").unlink()
    os.mkfifo(checkpoint / ".metadata")
    with pytest.raises(CheckpointCorruptError, match="a FIFO"):
        read_dcp_metadata(checkpoint)


def test_data_file_swapped_for_a_link_after_the_metadata_was_read_is_refused(
    checkpoint: Path, tmp_path: Path
) -> None:
    metadata = read_dcp_metadata(checkpoint)
    data = next(checkpoint.glob("*.distcp"))
    moved = tmp_path / data.name
    data.rename(moved)
    data.symlink_to(moved)
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        safe_load(_trained_state(1), checkpoint, metadata=metadata)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_numbers_in_allowed_metadata_load_or_raise_corrupt_within_the_data_size(
    genuine_metadata: tuple[Path, bytes], data: st.DataObject
) -> None:
    """Sizes, offsets, lengths and planner_data replaced by any integers: bounded or refused."""
    directory, original = genuine_metadata
    metadata = pickle.loads(original)
    numbers = st.integers(-5, 2**62) | st.sampled_from([0, 1, 2, 3, 6, 2**31, 2**40])
    for fqn, entry in metadata.state_dict_metadata.items():
        if hasattr(entry, "size") and data.draw(st.booleans(), label=f"{fqn} size"):
            entry.size = torch.Size(data.draw(st.lists(numbers, max_size=3), label="size"))
        for chunk in getattr(entry, "chunks", []):
            if data.draw(st.booleans(), label="chunk"):
                chunk.sizes = torch.Size(data.draw(st.lists(numbers, max_size=3), label="sizes"))
                chunk.offsets = torch.Size(data.draw(st.lists(numbers, max_size=3), label="off"))
    for info in metadata.storage_data.values():
        if data.draw(st.booleans(), label="storage"):
            info.offset = data.draw(numbers, label="offset")
            info.length = data.draw(numbers, label="length")
    if data.draw(st.booleans(), label="planner"):
        metadata.planner_data = data.draw(
            st.dictionaries(
                st.text(max_size=3), st.lists(numbers | st.text(max_size=2), max_size=3)
            )
            | st.none()
            | st.integers(),
            label="planner_data",
        )
    path = directory / ".metadata"
    try:
        path.write_bytes(pickle.dumps(metadata))
        loaded = read_dcp_metadata(path)
    except CheckpointCorruptError:
        return
    finally:
        path.write_bytes(original)
    data_bytes = sum(f.stat().st_size for f in directory.glob("*.distcp"))
    rows = tensor_table(loaded)
    assert sum(r["nbytes"] for r in rows if r["kind"] == "tensor") <= data_bytes


# ------------------------------------------------------------ tampered non-tensor values


@pytest.mark.parametrize(
    ("how", "refused"),
    [
        ("os.system", f"{os.system.__module__}.system"),
        # torch.save pickles with protocol 2, where a method is getattr(cls, name).
        ("Path.touch", "getattr"),
    ],
)
def test_crafted_non_tensor_value_is_refused_without_running_it(
    tmp_path: Path, how: str, refused: str
) -> None:
    marker = tmp_path / f"pwned-{how}"
    directory = _save(
        {"w": torch.ones(3), "extra": {"evil": _Exploit(how, marker)}}, tmp_path / "ck"
    )
    assert not marker.exists()  # saving ran nothing

    with pytest.raises(UnsafeCheckpointError) as err:
        safe_load({"w": torch.zeros(3), "extra": {"evil": None}}, directory)

    assert not marker.exists()
    assert "'extra.evil'" in str(err.value)
    assert refused in str(err.value)
    assert isinstance(err.value.__cause__, CheckpointException)

    # The threat is real: plain dcp.load runs the payload.
    dcp.load({"w": torch.zeros(3), "extra": {"evil": None}}, checkpoint_id=directory)
    assert marker.exists()


# ------------------------------------------------------------------- corrupt metadata


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.9, -1])
def test_truncated_metadata_is_corrupt_with_path(checkpoint: Path, keep: float) -> None:
    metadata_file = checkpoint / ".metadata"
    data = metadata_file.read_bytes()
    metadata_file.write_bytes(data[:-1] if keep == -1 else data[: int(len(data) * keep)])

    with pytest.raises(CheckpointCorruptError) as err:
        read_dcp_metadata(checkpoint)

    assert type(err.value) is CheckpointCorruptError
    assert err.value.path == str(metadata_file)
    assert str(metadata_file) in str(err.value)


@pytest.mark.parametrize(
    "content",
    [random.Random(0).randbytes(4096), b"hello, world\n", pickle.dumps({"not": "metadata"})],
    ids=["random", "text", "other-pickle"],
)
def test_garbage_metadata_is_corrupt_with_path(checkpoint: Path, content: bytes) -> None:
    (checkpoint / ".metadata").write_bytes(content)

    with pytest.raises(CheckpointCorruptError) as read_err:
        read_dcp_metadata(checkpoint)
    with pytest.raises(CheckpointCorruptError) as load_err:
        safe_load(_trained_state(1), checkpoint)

    assert read_err.value.path == str(checkpoint / ".metadata")
    assert load_err.value.path == str(checkpoint / ".metadata")


_DCP_METADATA = "torch.distributed.checkpoint.metadata"


def _metadata_pickle(planner_data_value: bytes) -> bytes:
    """A protocol-4 Metadata whose planner_data maps "a" to the given pickle fragment."""
    return _build_pickle(
        _global(_DCP_METADATA, "Metadata"),
        b")\x81}(",  # Metadata.__new__, then its state dict
        _str("state_dict_metadata") + b"}",
        _str("storage_data") + b"}",
        _str("planner_data") + b"}" + _str("a") + planner_data_value + b"s",
        b"ub",
    )


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        # Each claims a length of 1 TiB in a file of a dozen bytes: the unpickler
        # must not allocate (or zero-fill) it before finding the data missing.
        (b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little") + b".", "bytearray of 1099511627776"),
        (b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + b"N.", "frame of 1099511627776"),
        # A memo slot at index 2**32-1: the C unpickler would zero-fill a 64 GiB memo
        # array for it; this reader keeps a dict, and the file is just not metadata.
        (b"\x80\x04Nr\xff\xff\xff\xff.", "top-level object is NoneType"),
        # Lists nested 200,000 deep: refused by the checks, not a RecursionError
        # from printing the offending value.
        (_metadata_pickle(b"]" * 200_000 + b"a" * 199_999 + b"\x85"), "nested too deep"),
        # A StorageMeta is strings only: not a place for structure of the file's choosing.
        (
            _build_pickle(
                _global(_DCP_METADATA, "Metadata"),
                b")\x81}(",
                _str("state_dict_metadata") + b"}",
                _str("storage_data") + b"}",
                _str("storage_meta") + _global(_DCP_METADATA, "StorageMeta"),
                b")\x81}" + _str("modules") + b"]K\x01as" + b"b",
                b"ub",
            ),
            "storage_meta is not a StorageMeta of strings",
        ),
    ],
    ids=[
        "bytearray-length",
        "frame-length",
        "memo-index",
        "deep-nesting",
        "storage-meta-structure",
    ],
)
def test_crafted_lengths_and_nesting_are_corrupt_not_allocated_or_crashing(
    tmp_path: Path, payload: bytes, complaint: str
) -> None:
    metadata_file = tmp_path / ".metadata"
    metadata_file.write_bytes(payload)
    with pytest.raises(CheckpointCorruptError, match=complaint) as err:
        read_dcp_metadata(metadata_file)
    assert err.value.path == str(metadata_file)


def test_an_extension_code_cannot_fetch_an_object_find_class_never_saw(tmp_path: Path) -> None:
    """copyreg's extension cache hands out objects without asking find_class."""
    import copyreg

    code = 0x5A17
    copyreg.add_extension("os", "getcwd", code)
    try:
        # Any plain unpickling of the code in this process caches os.getcwd for it.
        assert pickle.loads(b"\x80\x02\x83" + code.to_bytes(2, "little") + b".") is os.getcwd
        metadata_file = tmp_path / ".metadata"
        metadata_file.write_bytes(_build_pickle(b"\x83" + code.to_bytes(2, "little") + b")R"))
        with pytest.raises(UnsafeCheckpointError, match="extension-registry"):
            read_dcp_metadata(metadata_file)
    finally:
        copyreg.remove_extension("os", "getcwd", code)
        copyreg.clear_extension_cache()


def test_metadata_of_many_frames_reads_as_pickle_does(tmp_path: Path) -> None:
    """Frames (64 KiB each) are skipped, not trusted: a large genuine file reads whole."""
    state = {f"layer{i}.weight": torch.full((2, 3), float(i)) for i in range(2000)}
    directory = _save(state, tmp_path / "ck")
    data = (directory / ".metadata").read_bytes()
    assert data.count(pickle.FRAME) >= 2 and len(data) > 2 * 65536
    assert read_dcp_metadata(directory) == _genuine_metadata(directory)


@pytest.fixture(scope="module")
def genuine_metadata(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    directory = _save(
        {"w": torch.ones(2, 3), "b": torch.zeros(1, dtype=torch.bfloat16), "n": 7},
        tmp_path_factory.mktemp("fuzz") / "ck",
    )
    return directory, (directory / ".metadata").read_bytes()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_damaged_metadata_loads_or_raises_checkpoint_corrupt(
    genuine_metadata: tuple[Path, bytes], data: st.DataObject
) -> None:
    """Changed bytes never escape as another exception type, nor modify shared state."""
    directory, original = genuine_metadata
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4), label="changes")):
        pos = data.draw(st.integers(0, len(damaged) - 1), label="position")
        damaged[pos] = data.draw(st.integers(0, 255), label="byte")
    path = directory / ".metadata"
    path.write_bytes(bytes(damaged))
    try:
        result: object = read_dcp_metadata(path)
    except CheckpointCorruptError as err:
        result = err
    if isinstance(result, CheckpointCorruptError):
        # The metadata itself, or a data file it names that is missing or too short.
        assert result.path is not None
        assert Path(result.path).parent == directory
    else:
        assert isinstance(result, Metadata)
    assert not hasattr(Metadata, "pwned")


# --------------------------------------------------------------- safe_load error mapping


def test_safe_load_maps_missing_data_file_to_corrupt(checkpoint: Path) -> None:
    for data_file in checkpoint.glob("*.distcp"):
        data_file.unlink()

    with pytest.raises(CheckpointCorruptError) as err:
        safe_load(_trained_state(1), checkpoint)

    assert isinstance(err.value.__cause__, CheckpointException)
    assert "__0_0.distcp: missing (named by the DCP metadata)" in str(err.value)


def test_safe_load_maps_key_missing_from_checkpoint_to_state_mismatch(
    checkpoint: Path,
) -> None:
    target = _trained_state(1)
    target["not_in_checkpoint"] = torch.zeros(1)

    with pytest.raises(StateMismatchError, match="not_in_checkpoint"):
        safe_load(target, checkpoint)


def test_safe_load_of_missing_checkpoint_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        safe_load({}, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"\.metadata"):
        safe_load({"w": torch.zeros(1)}, tmp_path / "empty")
    with pytest.raises(CheckpointNotFoundError):
        read_dcp_metadata(tmp_path / "empty")


# ------------------------------------------------------------------------ tensor_table


def test_tensor_table_lists_every_entry_sorted(tmp_path: Path) -> None:
    directory = _save(
        {
            "b": {"w": torch.zeros(2, 3), "half": torch.zeros(5, dtype=torch.bfloat16)},
            "a": torch.tensor(7, dtype=torch.int64),
            "flag": torch.zeros(4, dtype=torch.bool),
            "step": 12,
        },
        tmp_path / "ck",
    )

    rows = tensor_table(read_dcp_metadata(directory))

    def tensor(fqn: str, dtype: str, shape: list[int], nbytes: int) -> dict[str, Any]:
        return {
            "fqn": fqn,
            "kind": "tensor",
            "dtype": dtype,
            "shape": shape,
            "nbytes": nbytes,
            "chunks": 1,
        }

    assert rows == [
        tensor("a", "int64", [], 8),
        tensor("b.half", "bfloat16", [5], 10),
        tensor("b.w", "float32", [2, 3], 24),
        tensor("flag", "bool", [4], 4),
        {"fqn": "step", "kind": "bytes", "dtype": None, "shape": None, "nbytes": None, "chunks": 1},
    ]


def test_dcp_s_rank_local_retry_reports_the_first_read_s_real_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dcp.load retries a failed ``read_metadata`` with ``rank=``; torch 2.11 then reports
    only the retry's missing ``__0.metadata``. The retry re-raises the first error instead."""
    from stalwart.safe_load import SafeFileSystemReader

    directory = _save(_trained_state(0), tmp_path / "ck")
    boom = RuntimeError("the disk went away mid-read")

    calls: list[str] = []

    def failing(_directory: str, name: str) -> Any:
        calls.append(name)
        if len(calls) == 1:
            raise boom
        raise FileNotFoundError(name)  # what a retry would find: no rank-local file

    monkeypatch.setattr("stalwart.safe_load.read_metadata_file", failing)
    reader = SafeFileSystemReader(directory)
    with pytest.raises(RuntimeError) as first:
        reader.read_metadata()
    with pytest.raises(RuntimeError) as retry:
        reader.read_metadata(rank=0)
    assert first.value is boom and retry.value is boom


def test_a_missing_metadata_file_still_lets_dcp_try_the_rank_local_one(tmp_path: Path) -> None:
    from stalwart.errors import CheckpointNotFoundError
    from stalwart.safe_load import SafeFileSystemReader

    directory = _save(_trained_state(0), tmp_path / "ck")
    (directory / ".metadata").unlink()
    reader = SafeFileSystemReader(directory)
    with pytest.raises(CheckpointNotFoundError, match=r"\.metadata: no DCP metadata file"):
        reader.read_metadata()
    with pytest.raises(CheckpointNotFoundError, match=r"__0\.metadata: no DCP metadata file"):
        reader.read_metadata(rank=0)
