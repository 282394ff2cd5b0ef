"""The CLI on hostile run directories: one line on stderr and exit 1 or 2, or a normal
answer, never a traceback, whatever numbers a (re-signed) manifest, ``events.jsonl``
or DCP's ``.metadata`` hold."""

from __future__ import annotations

import json
import pickle
import string
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stalwart
from stalwart.cli.common import format_bytes, format_seconds, format_time, iso_utc
from stalwart.events import MAX_LINE_BYTES, ReadStats, read_events
from stalwart.manifest import MANIFEST_NAME, canonical_json, hash_file

from ..conftest import assert_one_line_error, cli, make_parts

_SELF_KEY = "manifest_xxh3_128"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("hostile") / "run"
    with stalwart.CheckpointManager(run, keep_last=None) as ckpt:
        ckpt.save(1, make_parts().state)
    return run


@pytest.fixture
def run(pristine: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(pristine, copy)
    return copy


def resign(checkpoint: Path, edit: dict[str, object] | None = None) -> None:
    """Apply ``edit`` to the manifest and make its sizes and checksums match again, the way
    someone who can write the run would: the result passes every checksum."""
    path = checkpoint / MANIFEST_NAME
    data = json.loads(path.read_text())
    data.pop(_SELF_KEY)
    data.update(edit or {})
    for entry in data["files"]:
        entry["size"], entry["xxh3_128"] = hash_file(checkpoint / entry["path"])
    data[_SELF_KEY] = xxhash.xxh3_128_hexdigest(canonical_json(data).encode())
    path.write_text(json.dumps(data, allow_nan=True))


def assert_no_traceback(code: int, out: str, err: str) -> None:
    assert "Traceback" not in err and "Traceback" not in out, err
    assert code in (0, 1, 2), (code, err)
    if err.startswith("stalwart: error: "):
        assert_one_line_error(err)


# ----------------------------------------------------------------- times and sizes


@pytest.mark.parametrize("created", [1e300, float("inf"), float("-inf"), float("nan"), -5.0, 2**80])
@pytest.mark.parametrize("command", ["ls", "inspect", "verify"])
def test_any_created_time_is_shown_or_refused_in_one_line(
    run: Path, created: float, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    resign(run / "step_000000001", {"created_unix": created})
    target = run if command != "inspect" else run / "step_000000001"
    for argv in ([command, target], [command, "--json", target]):
        assert_no_traceback(*cli(capsys, *argv))


@pytest.mark.parametrize(
    "value", [1e300, float("inf"), float("-inf"), float("nan"), -1, 2**1100, "x", None, True]
)
def test_formatting_never_crashes_on_any_number(value: object) -> None:
    for fmt in (format_time, format_bytes, format_seconds, iso_utc):
        text = fmt(value)  # type: ignore[arg-type]
        assert isinstance(text, str) and text


def test_an_impossible_time_is_shown_as_invalid() -> None:
    assert format_time(1e300) == "invalid (1e+300)"
    assert format_bytes(-1) == "invalid (-1)"
    assert format_time(0.0).startswith("19")


# ----------------------------------------------------------------- events.jsonl


def write_events(run: Path, lines: list[bytes]) -> None:
    (run / "events.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))


HOSTILE_LINES = [
    b"[" * 200_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"event":"save","time":1,"step":1,"x":' + b"[" * 40 + b"]" * 40 + b"}",
    b'{"event":"save","time":' + b"9" * 5000 + b',"step":1}',
    b'{"event":"save","time":1e300,"step":1,"total_s":Infinity,"stall_s":NaN,"bytes":1e999}',
    b'{"event":"save","time":Infinity,"step":1e300}',
    b'{"event":"open","time":5,"durable":{"x":1}}',
    b'{"event":"upload","time":6,"step":1,"url":["s3://b"]}',
    b'{"event":"durable_behind","time":7,"steps":"abc"}',
    b'{"event":"restore_skipped","time":-1e308,"step":1,"reason":7}',
    b'{"event":"save","time":8,"step":1,"bytes":' + b"9" * 400 + b"}",
    b"\xff\xfe\x00 not utf-8",
    b'"just a string"',
    b"x" * (MAX_LINE_BYTES + 10),
]


def test_read_events_skips_and_counts_long_and_deep_lines(tmp_path: Path) -> None:
    good = b'{"event":"save","time":1,"step":1}'
    write_events(tmp_path, [HOSTILE_LINES[0], good, HOSTILE_LINES[1], HOSTILE_LINES[2]])
    with (tmp_path / "events.jsonl").open("ab") as f:
        f.write(b"y" * (3 * MAX_LINE_BYTES) + b"\n" + good)
    stats = ReadStats()
    records = list(read_events(tmp_path, stats=stats))
    assert [r["step"] for r in records] == [1, 1]
    assert stats.skipped == 4


def test_ls_and_report_survive_every_hostile_line_at_once(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_events(run, [*HOSTILE_LINES, b'{"event":"save","time":10,"step":1,"total_s":0.5}'])
    assert_no_traceback(*cli(capsys, "ls", run))
    assert_no_traceback(*cli(capsys, "ls", "--json", run))
    code, out, err = cli(capsys, "report", run, "--out", tmp_path / "report")
    assert code == 0, err
    assert "1 events" in out or "events" in out


event_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(string.printable, max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
event_records = st.fixed_dictionaries(
    {},
    optional={
        "event": st.sampled_from(
            [
                "save",
                "restore",
                "open",
                "upload",
                "download",
                "durable_delete",
                "upload_failed",
                "durable_unreachable",
                "durable_behind",
                "restore_skipped",
                "quarantine",
                "gc",
            ]
        )
        | event_values,
        "time": event_values,
        "step": event_values,
        "url": event_values,
        "durable": event_values,
        "steps": event_values,
        "reason": event_values,
        "total_s": event_values,
        "stall_s": event_values,
        "bytes": event_values,
        "throughput_MBps": event_values,
        "seconds": event_values,
    },
)
event_lines = st.one_of(
    st.binary(max_size=64).map(lambda b: b.replace(b"\n", b" ")),
    event_records.map(lambda r: json.dumps(r, allow_nan=True).encode()),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lines=st.lists(event_lines, max_size=8))
def test_ls_survives_any_events_lines(
    lines: list[bytes], run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_events(run, lines)
    assert_no_traceback(*cli(capsys, "ls", run))
    assert_no_traceback(*cli(capsys, "ls", "--json", run))


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lines=st.lists(event_lines, min_size=1, max_size=6))
def test_report_survives_any_events_lines(
    lines: list[bytes], run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_events(run, [*lines, b'{"event":"save","time":10,"step":1,"total_s":0.5}'])
    code, out, err = cli(capsys, "report", "--json", run, "--out", tmp_path / "report")
    assert_no_traceback(code, out, err)
    assert code == 0, err


# ----------------------------------------------------------------- export


def test_export_of_a_tensor_with_a_huge_shape_fails_in_one_line(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = run / "step_000000001"
    meta_path = checkpoint / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())
    name = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    metadata.state_dict_metadata[name].size = torch.Size([2**20, 2**20, 2**10])
    meta_path.write_bytes(pickle.dumps(metadata))
    resign(checkpoint)
    for fmt in ("safetensors", "torch"):
        code, _out, err = cli(
            capsys, "export", checkpoint, "--to", tmp_path / f"w.{fmt}", "--format", fmt
        )
        assert code == 1
        # Refused by the metadata check on read, or by export's size check.
        assert_one_line_error(err, name)
        assert "not valid DCP metadata" in err or "damaged or crafted" in err
    assert not list(tmp_path.glob("*w.*"))
