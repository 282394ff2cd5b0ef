"""Property-based fuzzing of whole checkpoints: restore ends at a good older step or None, nothing else.

Three classes of damage to the newest step of a three-step run, each drawn by
hypothesis and run in the memory- and time-limited worker:

- ``files``: bytes flipped, files truncated, extended, swapped with the previous
  step's, the previous step renamed or copied to the newest name, links
  (to ``/dev/zero``, to itself, to another step, out of the run) and FIFOs in
  place of files; each re-signed or not;
- ``manifest``: any field of MANIFEST.json replaced by hostile JSON, re-signed or not;
- ``metadata``: DCP metadata with sizes, chunks, offsets, lengths and
  planner_data replaced, in the JSON twin a restore reads or in the pickle
  (rebuilt from allowed classes; the twin dropped or kept), re-signed.

``STALWART_FUZZ_EXAMPLES`` sets the examples per class (``make fuzz`` runs many); the
summary is printed at the end of the session (``-s``) and written to the file
``STALWART_FUZZ_REPORT`` names, if set.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .harness import (
    FUZZ_EXAMPLES,
    NEWEST,
    Pristine,
    Summary,
    Worker,
    damage,
    fresh_copy,
    hostile_json,
    judge_restore,
)

FILES = ["MANIFEST.json", ".metadata", ".metadata.json", "__0_0.distcp"]
"""The files of every step of the pristine run (checked by ``test_the_fuzzed_files_are_all_there``)."""

SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_positions = st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)), min_size=1, max_size=4)


def _file_cases() -> st.SearchStrategy[dict[str, Any]]:
    data_files = st.sampled_from([".metadata", ".metadata.json", "__0_0.distcp"])
    signed = st.booleans()
    return st.one_of(
        st.fixed_dictionaries(
            {"kind": st.just("flip"), "file": st.sampled_from(FILES), "positions": _positions}
        ),
        st.fixed_dictionaries(
            {
                "kind": st.sampled_from(["flip", "truncate", "extend"]),
                "file": data_files,
                "positions": _positions,
                "amount": st.integers(0, 2**16),
                "resign": signed,
            }
        ),
        st.fixed_dictionaries(
            {
                "kind": st.sampled_from(["truncate", "extend"]),
                "file": st.just("MANIFEST.json"),
                "amount": st.integers(0, 2**16),
            }
        ),
        st.fixed_dictionaries({"kind": st.just("swap"), "file": st.sampled_from(FILES)}),
        st.fixed_dictionaries({"kind": st.just("swap"), "file": data_files, "resign": signed}),
        st.fixed_dictionaries({"kind": st.just("rename"), "copy": st.booleans()}),
        st.fixed_dictionaries(
            {
                "kind": st.just("symlink"),
                "file": data_files,
                "target": st.sampled_from(["dev_zero", "self", "previous", "outside"]),
                "resign": signed,
            }
        ),
        st.fixed_dictionaries({"kind": st.just("fifo"), "file": data_files, "resign": signed}),
    )


_FIELDS = [
    "format",
    "format_version",
    "step",
    "epoch",
    "created_unix",
    "world_size",
    "files",
    "metadata",
    "config",
    "versions",
    "hostname",
    "metrics",
    "topology",
    "files.path",
    "files.size",
    "files.xxh3_128",
    "files.entry",
]


def _manifest_cases() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "kind": st.just("manifest"),
            "field": st.sampled_from(_FIELDS),
            "value": hostile_json(),
            "resign": st.booleans(),
        }
    )


_numbers = st.integers(-3, 2**62) | st.sampled_from([0, 1, 2, 4, 8, 64, 2**31, 2**40])
_shapes = st.lists(_numbers, max_size=3)


def _metadata_cases() -> st.SearchStrategy[dict[str, Any]]:
    index = st.integers(0, 50)
    change = st.one_of(
        st.tuples(st.just("tensor"), index, st.just("size"), _shapes),
        st.tuples(st.just("chunk"), index, st.sampled_from(["offsets", "sizes"]), _shapes),
        st.tuples(st.just("storage"), index, st.sampled_from(["offset", "length"]), _numbers),
        st.tuples(
            st.just("planner"),
            st.just(0),
            st.just(""),
            st.none()
            | _numbers
            | st.dictionaries(
                st.text(max_size=8),
                st.lists(_numbers | st.text(max_size=4), max_size=4),
                max_size=3,
            ),
        ),
    )
    return st.fixed_dictionaries(
        {
            "kind": st.just("metadata"),
            "changes": st.lists(change, min_size=1, max_size=3),
            "resign": st.just(True),
            "file": st.sampled_from([".metadata.json", ".metadata"]),
            "drop_twin": st.booleans(),
        }
    )


def _run_case(
    cls: str, case: dict[str, Any], pristine: Pristine, worker: Worker, summary: Summary
) -> None:
    run = fresh_copy(pristine, pristine.run.parent / "case")
    damage(run, case)
    verify = worker.run({"op": "cli", "argv": ["verify", str(run / NEWEST)]})
    answer = worker.run({"op": "restore", "run": str(run)})
    try:
        assert verify["outcome"] == "exited", (case, verify)
        assert "Traceback" not in verify["err"], (case, verify)
        outcome = judge_restore(pristine, case, answer)
    except AssertionError:
        summary.failed += 1
        raise
    summary.add(cls, case, outcome, answer)


def test_the_fuzzed_files_are_all_there(pristine: Pristine) -> None:
    assert sorted(pristine.files) == sorted(FILES)


@SETTINGS
@given(case=_file_cases())
def test_fuzz_damaged_files(
    case: dict[str, Any], pristine: Pristine, worker: Worker, summary: Summary
) -> None:
    _run_case("files", case, pristine, worker, summary)


@SETTINGS
@given(case=_manifest_cases())
def test_fuzz_manifest_fields(
    case: dict[str, Any], pristine: Pristine, worker: Worker, summary: Summary
) -> None:
    _run_case("manifest", case, pristine, worker, summary)


@SETTINGS
@given(case=_metadata_cases())
def test_fuzz_dcp_metadata(
    case: dict[str, Any], pristine: Pristine, worker: Worker, summary: Summary
) -> None:
    _run_case("metadata", case, pristine, worker, summary)
