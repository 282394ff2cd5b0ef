"""MANIFEST.json: round trips, self-checksum, version gate, JSON-only content."""

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.errors import CheckpointCorruptError, UnsupportedFormatError
from stalwart.manifest import FORMAT_VERSION, FileEntry, Manifest, stable_hash, to_json_data

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
entries = st.builds(
    FileEntry,
    path=st.from_regex(r"[a-z_]{1,8}(\.distcp)?", fullmatch=True),
    size=st.integers(0, 2**40),
    xxh3_128=st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
)


@given(
    step=st.integers(0, 10**9),
    files=st.lists(entries, min_size=1, max_size=5, unique_by=lambda e: e.path),
    metadata=st.dictionaries(st.text(max_size=5), json_values, max_size=3),
    metrics=st.dictionaries(st.text(max_size=5), st.floats(allow_nan=False), max_size=3),
    epoch=st.none() | st.integers(0, 1000),
)
def test_manifest_round_trips(step, files, metadata, metrics, epoch):
    m = Manifest(
        step=step, files=files, metadata=metadata, metrics=metrics, epoch=epoch, config={"lr": 0.1}
    )
    back = Manifest.from_json(m.to_json())
    assert back.step == step
    assert sorted(back.files, key=lambda f: f.path) == sorted(files, key=lambda f: f.path)
    assert back.metadata == metadata
    assert back.metrics == metrics
    assert back.epoch == epoch
    assert back.created_unix == m.created_unix


def _manifest() -> Manifest:
    return Manifest(step=7, files=[FileEntry(path="a.distcp", size=3, xxh3_128="0" * 32)])


def test_edited_manifest_fails_its_self_checksum():
    data = json.loads(_manifest().to_json())
    data["step"] = 8
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        Manifest.from_json(json.dumps(data))


def test_newer_format_version_is_refused_with_the_fix():
    data = _manifest().to_dict()
    data.pop("manifest_xxh3_128")
    data["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError, match="upgrade stalwart"):
        Manifest.from_json(json.dumps(data))


@pytest.mark.parametrize("text", ["", "{", "[]", '{"format": "other"}', "\x00\x01"])
def test_garbage_is_corrupt(text):
    with pytest.raises(CheckpointCorruptError):
        Manifest.from_json(text)


def test_file_entries_cannot_escape_the_checkpoint():
    m = _manifest()
    m.files = [FileEntry(path="../../etc/passwd", size=1, xxh3_128="0" * 32)]
    with pytest.raises(CheckpointCorruptError, match="bad file entry"):
        Manifest.from_json(m.to_json())


def test_config_hash_is_stable_across_key_order():
    assert stable_hash({"a": 1, "b": [1, 2]}) == stable_hash({"b": [1, 2], "a": 1})
    assert stable_hash({"a": 1}) != stable_hash({"a": 2})


def test_to_json_data_accepts_dataclasses_and_names_bad_keys():
    @dataclasses.dataclass
    class Cfg:
        lr: float = 0.1
        layers: tuple[int, ...] = (1, 2)

    assert to_json_data(Cfg(), what="config") == {"lr": 0.1, "layers": [1, 2]}
    with pytest.raises(TypeError, match=r"config\['model'\] is a object"):
        to_json_data({"model": object()}, what="config")
