"""Each attack on a run directory reported against stalwart, as a test: restore falls back, verify names the file.

Every case runs in the memory- and time-limited worker: before the fixes these
hung (``.metadata`` linked to ``/dev/zero``), tried to allocate 4 TiB, or
raised RecursionError, OverflowError, ValueError, RuntimeError or
UnsupportedFormatError out of ``restore()``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import stalwart
from stalwart.events import read_events
from stalwart.storage.durable import DurableTier

from ..conftest import cli, make_parts
from .harness import (
    NEWEST,
    Pristine,
    Worker,
    damage,
    fresh_copy,
    judge_restore,
    resign,
    sign,
)

SIGNED_METADATA = [
    ("negative size", [("tensor", 0, "size", [-3, 4])]),
    (
        "2**40 elements",
        [("tensor", 0, "size", [2**20, 2**20]), ("chunk", 0, "sizes", [2**20, 2**20])],
    ),
    ("chunk outside its tensor", [("chunk", 0, "offsets", [10**6, 0])]),
    ("data past the end of its file", [("storage", 0, "offset", 10**12)]),
    ("planner_data of the wrong type", [("planner", 0, "", ["not", "a", "dict"])]),
    ("planner_data index out of range", [("planner", 0, "", {"model.0.weight": ["model", 2**40]})]),
]

MANIFESTS = [
    (
        "deeply nested",
        {"kind": "manifest_text", "text": '{"a":' + "[" * 100_000 + "]" * 100_000 + "}"},
    ),
    (
        "size Infinity",
        {"kind": "manifest", "field": "files.size", "value": float("inf"), "resign": True},
    ),
    (
        "NUL in a path",
        {"kind": "manifest", "field": "files.path", "value": "__0_0\x00.distcp", "resign": True},
    ),
    ("flipped bit in format_version", {"kind": "manifest_text_flip"}),
]


def _flip_format_version(run: Path) -> None:
    path = run / NEWEST / "MANIFEST.json"
    text = path.read_text()
    assert '"format_version": 1,' in text
    path.write_text(text.replace('"format_version": 1,', '"format_version": 3,'))  # 1 ^ 2


def _attack(run: Path, case: dict[str, Any]) -> None:
    if case["kind"] == "manifest_text_flip":
        _flip_format_version(run)
    else:
        damage(run, case)


def _restores_previous(worker: Worker, pristine: Pristine, run: Path, case: dict[str, Any]) -> dict:
    answer = worker.run({"op": "restore", "run": str(run)})
    assert judge_restore(pristine, case, answer) == "step 2", (case, answer)
    return answer


def _skip_event(run: Path) -> dict:
    skips = [e for e in read_events(run) if e.get("event") == "restore_skipped"]
    assert [e["step"] for e in skips] == [3], skips
    return skips[0]


def _verify_fails_naming(worker: Worker, checkpoint: Path, name: str) -> str:
    answer = worker.run({"op": "cli", "argv": ["verify", str(checkpoint)]})
    assert answer["outcome"] == "exited" and answer["code"] != 0, answer
    assert name in answer["out"] + answer["err"], answer
    return answer["out"] + answer["err"]


@pytest.mark.parametrize("target", [".metadata.json", ".metadata"])
@pytest.mark.parametrize(("name", "changes"), SIGNED_METADATA, ids=[n for n, _ in SIGNED_METADATA])
def test_signed_metadata_with_impossible_numbers_falls_back(
    worker: Worker, pristine: Pristine, tmp_path: Path, name: str, changes: list, target: str
) -> None:
    """The JSON twin a restore reads, or the pickle of a checkpoint without a twin."""
    run = fresh_copy(pristine, tmp_path)
    case = {"kind": "metadata", "changes": changes, "resign": True, "file": target}
    damage(run, case)
    assert (run / NEWEST / ".metadata.json").exists() == (target == ".metadata.json")
    _verify_fails_naming(worker, run / NEWEST, target)
    _restores_previous(worker, pristine, run, case)
    assert _skip_event(run)["file"] == str(run / NEWEST / target)


def test_a_signed_pickle_beside_an_honest_twin_is_never_read_but_verify_reports_it(
    worker: Worker, pristine: Pristine, tmp_path: Path
) -> None:
    """A restore reads only the JSON twin, so a crafted ``.metadata`` next to it costs
    nothing; ``stalwart verify`` still checks both and names the pickle."""
    run = fresh_copy(pristine, tmp_path)
    changes = SIGNED_METADATA[1][1]  # 2**40 elements
    case = {"kind": "metadata", "changes": changes, "resign": True, "file": ".metadata"}
    damage(run, {**case, "drop_twin": False})
    out = _verify_fails_naming(worker, run / NEWEST, ".metadata")
    assert ".metadata.json" not in out, out
    answer = worker.run({"op": "restore", "run": str(run)})
    assert judge_restore(pristine, case, answer) == "step 3", answer


def test_twins_that_disagree_fail_verify(
    worker: Worker, pristine: Pristine, tmp_path: Path
) -> None:
    """Both metadata files well formed and signed but not the same metadata: one of
    them lies to its readers, and ``stalwart verify`` says which one it checked last."""
    run = fresh_copy(pristine, tmp_path)
    twin = run / NEWEST / ".metadata.json"
    doc = json.loads(twin.read_text())
    first = next(k for k, v in doc["state_dict_metadata"].items() if v is not None)
    doc["state_dict_metadata"][first][2] = True  # requires_grad: harmless, but not the pickle's
    twin.write_text(json.dumps(doc))
    resign(run / NEWEST)
    out = _verify_fails_naming(worker, run / NEWEST, ".metadata.json")
    assert "does not hold the same metadata" in out, out


@pytest.mark.parametrize(("name", "case"), MANIFESTS, ids=[n for n, _ in MANIFESTS])
def test_hostile_manifest_falls_back_and_every_reader_reports_it(
    worker: Worker, pristine: Pristine, tmp_path: Path, name: str, case: dict[str, Any]
) -> None:
    run = fresh_copy(pristine, tmp_path)
    _attack(run, case)
    _verify_fails_naming(worker, run / NEWEST, "MANIFEST.json")
    for argv in (["inspect", str(run / NEWEST)], ["ls", str(run)]):
        answer = worker.run({"op": "cli", "argv": argv})
        assert answer["outcome"] == "exited", (argv, answer)
        assert "Traceback" not in answer["err"], (argv, answer)
    _restores_previous(worker, pristine, run, case)
    assert "MANIFEST.json" in _skip_event(run)["reason"]


@pytest.mark.parametrize("copy", [False, True], ids=["renamed", "copied"])
def test_an_older_step_under_a_newer_name_is_not_the_newer_step(
    worker: Worker, pristine: Pristine, tmp_path: Path, copy: bool
) -> None:
    run = fresh_copy(pristine, tmp_path)
    case = {"kind": "rename", "copy": copy}
    damage(run, case)
    out = _verify_fails_naming(worker, run / NEWEST, "says step 2")
    assert "MANIFEST.json" in out
    answer = worker.run({"op": "restore", "run": str(run)})
    if copy:  # step 2 is still there and good
        assert judge_restore(pristine, case, answer) == "step 2"
    else:  # step 2 only exists under the wrong name: nothing to restore, not step 3
        assert judge_restore(pristine, case, answer) == "step 1"
    assert "says step 2" in _skip_event(run)["reason"]


@pytest.mark.parametrize(
    ("file", "target"),
    [(".metadata", "dev_zero"), ("__0_0.distcp", "previous"), ("__0_0.distcp", "outside")],
)
def test_links_in_a_checkpoint_are_never_followed(
    worker: Worker, pristine: Pristine, tmp_path: Path, file: str, target: str
) -> None:
    """``/dev/zero`` listed with size 0 hung restore and verify; a link to another run was read."""
    run = fresh_copy(pristine, tmp_path)
    case = {"kind": "symlink", "file": file, "target": target, "resign": True}
    damage(run, case)
    out = _verify_fails_naming(worker, run / NEWEST, file)
    assert "symbolic link" in out
    _restores_previous(worker, pristine, run, case)
    assert "symbolic link" in _skip_event(run)["reason"]


def test_a_fifo_in_place_of_a_file_is_refused_without_waiting_for_a_writer(
    worker: Worker, pristine: Pristine, tmp_path: Path
) -> None:
    run = fresh_copy(pristine, tmp_path)
    case = {"kind": "fifo", "file": ".metadata", "resign": True}
    damage(run, case)
    assert "a FIFO" in _verify_fails_naming(worker, run / NEWEST, ".metadata")
    _restores_previous(worker, pristine, run, case)


def test_a_genuinely_newer_format_is_skipped_by_restore_and_raised_for_its_step(
    pristine: Pristine, tmp_path: Path
) -> None:
    run = fresh_copy(pristine, tmp_path)
    damage(run, {"kind": "manifest", "field": "format_version", "value": 2, "resign": True})
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        assert ckpt.restore(make_parts().state) == 2
        with pytest.raises(stalwart.UnsupportedFormatError, match="upgrade stalwart"):
            ckpt.restore(make_parts().state, step=3)
    assert "format version 2" in _skip_event(run)["reason"]
    assert (run / NEWEST).is_dir(), "an intact newer checkpoint is not moved aside"


def test_durable_copy_with_a_hostile_manifest_falls_back(
    pristine: Pristine, tmp_path: Path
) -> None:
    """The file:// tier's manifest is parsed by the same bounded reader, and its step checked."""
    run = fresh_copy(pristine, tmp_path / "local")
    store = tmp_path / "store"
    with stalwart.CheckpointManager(
        run, keep_last=None, handle_signals=False, durable=f"file://{store}"
    ) as ckpt:
        ckpt.restore(make_parts().state)  # loads step 3; nothing uploaded yet
    with stalwart.CheckpointManager(
        run, keep_last=None, handle_signals=False, durable=f"file://{store}"
    ) as ckpt:
        assert ckpt.save(4, make_parts().state, force=True)
        ckpt.wait()
    remote = store / "step_000000004" / "MANIFEST.json"
    assert remote.is_file()
    body = json.loads(remote.read_text())
    body["files"][0]["size"] = float("inf")
    remote.write_text(sign(body))
    shutil.rmtree(run / "step_000000004")
    with stalwart.CheckpointManager(
        run, keep_last=None, handle_signals=False, durable=f"file://{store}"
    ) as ckpt:
        assert ckpt.restore(make_parts().state) == 3
    skips = [e for e in read_events(run) if e.get("event") == "restore_skipped"]
    assert [(e["step"], e["source"]) for e in skips] == [(4, "durable")], skips


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_durable_manifest_that_is_a_device_or_fifo_is_refused_without_hanging(
    pristine: Pristine, tmp_path: Path, kind: str
) -> None:
    """A store-side MANIFEST.json linked to /dev/zero, or a FIFO, in a file:// tier:
    restore neither reads forever nor waits for a writer; it falls back."""
    run = fresh_copy(pristine, tmp_path / "local")
    store = tmp_path / "store"
    with stalwart.CheckpointManager(
        run, keep_last=None, handle_signals=False, durable=f"file://{store}"
    ) as ckpt:
        ckpt.restore(make_parts().state)
        assert ckpt.save(4, make_parts().state, force=True)
        ckpt.wait()
    remote = store / "step_000000004" / "MANIFEST.json"
    assert remote.is_file()
    remote.unlink()
    if kind == "fifo":
        os.mkfifo(remote)
    else:
        remote.symlink_to("/dev/zero")
    shutil.rmtree(run / "step_000000004")
    with stalwart.CheckpointManager(
        run, keep_last=None, handle_signals=False, durable=f"file://{store}"
    ) as ckpt:
        assert ckpt.restore(make_parts().state) == 3
    # Read directly too (as ls, gc and the upload's commit check do): refused, not retried.
    with pytest.raises(stalwart.DurableStoreError, match="not a regular file") as info:
        DurableTier(f"file://{store}").read_manifest(4)
    assert not info.value.transient


def test_inspect_and_export_refuse_a_step_under_another_name(
    pristine: Pristine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = fresh_copy(pristine, tmp_path)
    damage(run, {"kind": "rename", "copy": True})
    code, out, err = cli(capsys, "export", run / NEWEST, "--to", tmp_path / "w.safetensors")
    assert code != 0 and "says step 2" in err, (out, err)
    assert not (tmp_path / "w.safetensors").exists()
    code, out, err = cli(capsys, "inspect", run / NEWEST)
    assert code != 0 and "says step 2" in out + err, (out, err)


def test_upload_never_reads_through_a_link(pristine: Pristine, tmp_path: Path) -> None:
    """A data file linked out of the run (re-signed to match) is not read, nor sent to the store."""
    run = fresh_copy(pristine, tmp_path)
    damage(run, {"kind": "symlink", "file": "__0_0.distcp", "target": "outside", "resign": True})
    tier = DurableTier(f"file://{tmp_path / 'store'}")
    with pytest.raises(stalwart.CheckpointCorruptError, match="symbolic link") as err:
        tier.upload(run / NEWEST)
    assert err.value.path == str(run / NEWEST / "__0_0.distcp")
    assert tier.committed_steps() == []
