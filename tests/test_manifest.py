"""MANIFEST.json: round trips, self-checksum, version gate, JSON-only content."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.errors import CheckpointCorruptError, UnsupportedFormatError
from stalwart.manifest import (
    FORMAT_VERSION,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    stable_hash,
    to_json_data,
)

from .hostile.harness import hostile_json, sign

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
    return Manifest(
        step=7,
        files=[FileEntry(path="a.distcp", size=3, xxh3_128="0" * 32)],
        created_unix=1_795_000_000.25,
    )


def test_edited_manifest_fails_its_self_checksum():
    data = json.loads(_manifest().to_json())
    data["step"] = 8
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        Manifest.from_json(json.dumps(data))


def test_newer_format_version_is_refused_with_the_fix():
    data = _manifest().to_dict()
    data["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError, match="upgrade stalwart"):
        Manifest.from_json(sign(data))


def test_a_flipped_bit_in_the_format_version_is_damage_not_a_newer_format():
    """The self-checksum is checked before format_version is believed."""
    text = _manifest().to_json()
    flipped = text.replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 3')
    assert flipped != text
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        Manifest.from_json(flipped)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 10_000, 200_000])
def test_deeply_nested_manifest_is_corrupt_not_a_recursion_error(depth):
    data = _manifest().to_dict()
    data["metadata"] = {"deep": json.loads("[" * min(depth, 900) + "]" * min(depth, 900))}
    text = sign(data) if depth <= 900 else ('{"a":' + "[" * depth + "]" * depth + "}")
    with pytest.raises(CheckpointCorruptError, match="nested deeper"):
        Manifest.from_json(text)


def test_nesting_up_to_the_limit_is_accepted():
    data = _manifest().to_dict()
    data["config"] = json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))
    assert Manifest.from_json(sign(data)).config == data["config"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("size", float("inf")),
        ("size", float("nan")),
        ("size", -1),
        ("size", 2**70),
        ("size", 1.5),
        ("size", True),
        ("path", "a\x00b.distcp"),
        ("path", "/etc/passwd"),
        ("path", "../x.distcp"),
        ("path", "a//b"),
        ("path", "./a"),
        ("path", ""),
        ("path", 7),
        ("xxh3_128", "zz"),
        ("xxh3_128", None),
    ],
)
def test_signed_bad_file_entries_are_corrupt(field, value):
    data = _manifest().to_dict()
    data["files"][0][field] = value
    with pytest.raises(CheckpointCorruptError, match="malformed manifest"):
        Manifest.from_json(sign(data))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", float("inf")),
        ("step", -3),
        ("world_size", 0),
        ("created_unix", float("inf")),
        ("created_unix", float("nan")),
        ("created_unix", "yesterday"),
        ("metadata", [["a", 1]]),
        ("versions", "1.0"),
        ("hostname", 5),
        ("files", {"a": 1}),
        ("files", [[1, 2]]),
    ],
)
def test_signed_bad_fields_are_corrupt(field, value):
    data = _manifest().to_dict()
    data[field] = value
    with pytest.raises(CheckpointCorruptError, match="malformed manifest"):
        Manifest.from_json(sign(data))


def test_a_file_listed_twice_is_corrupt():
    data = _manifest().to_dict()
    data["files"] = data["files"] * 2
    with pytest.raises(CheckpointCorruptError, match="listed twice"):
        Manifest.from_json(sign(data))


def test_oversized_manifest_is_corrupt_before_parsing():
    text = b" " * (MAX_MANIFEST_BYTES + 1)
    with pytest.raises(CheckpointCorruptError, match="more than any manifest"):
        Manifest.from_json(text)


def test_nan_metrics_still_round_trip():
    """A diverged run's NaN loss is legitimate in metrics; only sizes and times must be finite."""
    m = _manifest()
    m.metrics = {"loss": float("nan"), "grad": float("inf")}
    back = Manifest.from_json(m.to_json())
    assert back.metrics["grad"] == float("inf") and back.metrics["loss"] != back.metrics["loss"]


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(
        [
            "format",
            "format_version",
            "step",
            "epoch",
            "created_unix",
            "world_size",
            "files",
            "metadata",
            "config",
            "config_hash",
            "code",
            "versions",
            "hostname",
            "metrics",
            "topology",
            "files.path",
            "files.size",
            "files.xxh3_128",
            "files.entry",
        ]
    ),
    value=hostile_json(),
    resign=st.booleans(),
)
def test_any_field_mutation_parses_or_raises_only_stalwart_errors(field, value, resign):
    """Signed or not, a manifest with any field replaced by any JSON value never escapes otherwise."""
    data = _manifest().to_dict()
    if field.startswith("files."):
        key = field.split(".")[1]
        if key == "entry":
            data["files"][0] = value
        else:
            data["files"][0][key] = value
    else:
        data[field] = value
    unchanged = data == _manifest().to_dict()
    text = sign(data) if resign else json.dumps(data, allow_nan=True)
    try:
        m = Manifest.from_json(text)
    except (CheckpointCorruptError, UnsupportedFormatError):
        return
    assert resign or unchanged, "an edit without re-signing was accepted"
    assert all(0 <= f.size < 2**63 for f in m.files) and 0 <= m.step < 2**63
    json.dumps(m.to_dict(), allow_nan=True)  # what was accepted can be written back


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_damaged_manifest_bytes_parse_or_raise_corrupt(data):
    text = bytearray(_manifest().to_json().encode())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(text) - 1))
        text[pos] = data.draw(st.integers(0, 255))
    try:
        Manifest.from_json(bytes(text))
    except CheckpointCorruptError:
        pass


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
