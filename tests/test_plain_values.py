"""Plain python values of a checkpoint read by a C unpickler that resolves no global."""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stalwart
from stalwart.errors import UnsafeCheckpointError
from stalwart.safe_load import _plain_opcodes, _plain_value, safe_load


def saved(value: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def zipped(pickled: bytes) -> io.BytesIO:
    """A torch.save zip whose data.pkl is ``pickled`` (crafted by hand)."""
    buf = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buf)
    writer.write_record("data.pkl", pickled, len(pickled))
    writer.write_end_of_file()
    buf.seek(0)
    return buf


def same(a: Any, b: Any) -> bool:
    """Equal, of the same types all the way down (0.0 vs -0.0 and NaN told apart)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (a != a and b != b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


PLAIN = [
    None,
    True,
    False,
    0,
    -5,
    2**100,
    -(2**63),
    0.1,
    -0.0,
    math.inf,
    math.nan,
    1e-308,
    "",
    "run é ☃ \U0001f600",
    b"",
    b"\x00\xff" * 300,
    (),
    [],
    {},
    (0.9, 0.999),
    {"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2], "name": None},
    {(1, "a"): [b"x", {"deep": [[[1.5]]]}]},
    [[]] * 3,
]


@pytest.mark.parametrize("value", PLAIN, ids=[repr(v)[:30] for v in PLAIN])
def test_plain_data_reads_as_torch_load_reads_it(value: Any) -> None:
    plain, got = _plain_value(saved(value))
    assert plain
    assert same(got, value)
    if value != b"":  # see the next test
        assert same(got, torch.load(saved(value), weights_only=True))


def test_empty_bytes_read_back_though_torch_load_refuses_them() -> None:
    """Protocol 2 pickles b"" as a call of the ``bytes`` global, which torch's
    allow-list lacks: a state holding b"" could be saved but not restored."""
    with pytest.raises(pickle.UnpicklingError, match="bytes"):
        torch.load(saved(b""), weights_only=True)
    assert _plain_value(saved(b"")) == (True, b"")


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.tuples(inner, inner)
            | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
@settings(max_examples=150, deadline=None)
def test_any_plain_value_reads_back_the_same(value: Any) -> None:
    plain, got = _plain_value(saved(value))
    assert plain and same(got, value)


OTHER = [
    torch.arange(3),
    collections.OrderedDict(a=1),
    torch.Size([2, 3]),
    {1, 2},
    torch.float16,
    {"t": torch.ones(2)},
]


@pytest.mark.parametrize("value", OTHER, ids=[type(v).__name__ for v in OTHER])
def test_anything_else_is_left_to_torch_load(value: Any) -> None:
    assert _plain_value(saved(value)) == (False, None)


class Exploit:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.target))}",))


@pytest.mark.parametrize(
    "pickled",
    [
        # bytes of another codec than protocol 2's latin-1
        b"\x80\x02c_codecs\nencode\nX\x02\x00\x00\x00hiX\x04\x00\x00\x00zlib\x86R.",
        b"\x80\x02c_codecs\nencode\nK\x01X\x06\x00\x00\x00latin1\x86R.",  # not a str
        b"\x80\x02cbuiltins\neval\nX\x01\x00\x00\x001\x85R.",
        b"\x80\x02c__builtin__\nbytes\nK\x05\x85R.",  # bytes(5), not b""
        b"\x80\x02c_codecs\nencode\n.",  # the function itself as the value
        b"\x80\x02]q\x00c__builtin__\nbytes\na.",  # ... or inside a list
        b"\x80\x02X\x01\x00\x00\x001Q.",  # a persistent id: a storage
        b"\x80\x02]q\x00(K\x01",  # cut short
        b"",
    ],
)
def test_a_crafted_pickle_is_never_run_here(pickled: bytes) -> None:
    assert _plain_value(zipped(pickled)) == (False, None)


def test_damaged_bytes_are_left_to_torch_load() -> None:
    data = saved({"a": 1}).getvalue()
    assert _plain_value(io.BytesIO(data[: len(data) // 2])) == (False, None)
    assert _plain_value(io.BytesIO(b"not a zip")) == (False, None)


def test_an_exploit_in_a_value_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    plain, _ = _plain_value(saved(Exploit(marker)))
    assert not plain and not marker.exists()
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2), "x": Exploit(marker)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(UnsafeCheckpointError, match="'x'"):
        safe_load({"w": torch.zeros(2), "x": None}, tmp_path / "ck")
    assert not marker.exists()


def test_a_restore_reads_its_plain_values_without_torch_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    extra = {"epoch": 3, "name": "run", "raw": b"\x01\x02", "none": b"", "hist": [0.5, -0.0]}
    with stalwart.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        # rng=False: the RNG state holds tensors, which torch.load reads (as it should)
        state = stalwart.TrainState(model=model, optimizer=opt, extra=extra, rng=False)
        mgr.save(7, state, force=True)
    calls: list[Any] = []
    real = torch.load

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    m2 = torch.nn.Linear(4, 3)
    o2 = torch.optim.AdamW(m2.parameters())
    state = stalwart.TrainState(model=m2, optimizer=o2, extra=dict.fromkeys(extra), rng=False)
    with stalwart.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        assert mgr.restore(state) == 7
    assert calls == []
    assert same(state.extra, extra)
    assert o2.param_groups[0]["betas"] == (0.8, 0.95) and o2.param_groups[0]["lr"] == 3e-4
    for a, b in zip(m2.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert pickle.dumps(o2.state_dict()["param_groups"]) == pickle.dumps(
        opt.state_dict()["param_groups"]
    )


HUGE_PUT = b"\x80\x02N" + b"r" + (2**31 - 1).to_bytes(4, "little") + b"."
"""``None`` memoised at index 2**31 - 1: Python's C unpickler would zero-fill a 16 GiB memo."""


@pytest.mark.parametrize(
    ("pickled", "plain"),
    [
        (pickle.dumps([1, [2], (3, 4.5), {"a": "b"}], protocol=2), True),
        (HUGE_PUT, False),
        (b"\x80\x02Nr\x05\x00\x00\x00.", False),  # index 5 after two opcodes
        (b"\x80\x02Nq\x01h\x01\x86.", True),  # BINPUT 1, BINGET 1: within the count
        (b"\x80\x02h\x09.", False),  # a GET of an index never put
        (pickle.dumps("x", protocol=4), False),  # FRAME, SHORT_BINUNICODE: not protocol 2
        (b"\x80\x02\x8f.", False),  # EMPTY_SET
        (b"\x80\x02X\x01\x00\x00\x001Q.", False),  # BINPERSID
        (b"\x80\x02X\xff\xff\xff\x7fab.", False),  # a length past the end
        (b"\x80\x02", False),  # no STOP
    ],
)
def test_only_protocol_2_plain_opcodes_with_bounded_memo_indices_pass(
    pickled: bytes, plain: bool
) -> None:
    assert _plain_opcodes(pickled) is plain


def test_a_huge_memo_index_goes_to_torch_load_and_allocates_nothing() -> None:
    assert _plain_value(zipped(HUGE_PUT)) == (False, None)


def test_a_container_that_holds_itself_reads_as_torch_load_reads_it() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    plain, got = _plain_value(saved(loop))
    assert plain and got[1] is got and got[0] == 1
    back = torch.load(saved(loop), weights_only=True)
    assert back[1] is back  # as torch reads it


def test_nesting_deeper_than_the_recursion_limit_is_checked_without_recursion() -> None:
    deep = b"\x80\x02" + b"]" * 20000 + b"a" * 19999 + b"."
    plain, got = _plain_value(zipped(deep))
    assert plain
    for _ in range(19999):
        (got,) = got
    assert got == []


SAMPLE = pickle.dumps(
    {"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2], "n": None, "b": b"xy", "e": b""},
    protocol=2,
)

PLAIN_TYPES = (type(None), bool, int, float, str, bytes, list, tuple, dict)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "delete", "insert"]),
            st.floats(0, 1),
            st.binary(min_size=1, max_size=1),
        ),
        min_size=1,
        max_size=4,
    )
)
@settings(max_examples=300, deadline=None)
def test_a_damaged_pickle_is_refused_or_reads_as_plain_data(
    edits: list[tuple[str, float, bytes]],
) -> None:
    data = bytearray(SAMPLE)
    for how, where, byte in edits:
        at = min(int(where * len(data)), len(data) - 1)
        if how == "set":
            data[at] = byte[0]
        elif how == "delete":
            del data[at]
        else:
            data.insert(at, byte[0])
    plain, got = _plain_value(zipped(bytes(data)))
    if not plain:
        assert got is None
        return
    todo, seen = [got], set()
    while todo:
        item = todo.pop()
        assert isinstance(item, PLAIN_TYPES), type(item)
        if isinstance(item, (list, tuple, dict)) and id(item) not in seen:
            seen.add(id(item))
            todo.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)
