"""Save and retention policies."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.policy import RetentionPolicy, SavePolicy


def test_every_steps_saves_on_multiples_only():
    p = SavePolicy(every_steps=5)
    assert [s for s in range(1, 21) if p.due(s, seconds_since_last=0.0)] == [5, 10, 15, 20]


def test_every_seconds_saves_after_the_interval():
    p = SavePolicy(every_seconds=30)
    assert not p.due(7, seconds_since_last=29.9)
    assert p.due(7, seconds_since_last=30.0)


def test_no_policy_saves_every_call():
    assert SavePolicy().due(3, seconds_since_last=0.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"every_steps": 0}, "every_steps"),
        ({"every_steps": 1.5}, "every_steps"),
        ({"every_seconds": -1}, "every_seconds"),
    ],
)
def test_bad_save_policy_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SavePolicy(**kwargs)


@pytest.mark.parametrize("value", [0, -2, True])
def test_bad_keep_last_is_refused(value):
    with pytest.raises(ValueError, match="keep_last"):
        RetentionPolicy(keep_last=value)


def test_keep_last_and_keep_every():
    p = RetentionPolicy(keep_last=2, keep_every=100)
    steps = [50, 100, 150, 200, 250, 300]
    assert p.to_delete(steps) == [50, 150]


@given(
    steps=st.sets(st.integers(0, 10_000), max_size=40),
    keep_last=st.integers(1, 6),
    keep_every=st.none() | st.integers(1, 500),
)
def test_retention_never_deletes_the_newest_and_keeps_keep_last(steps, keep_last, keep_every):
    doomed = RetentionPolicy(keep_last=keep_last, keep_every=keep_every).to_delete(sorted(steps))
    kept = sorted(set(steps) - set(doomed))
    if steps:
        assert max(steps) in kept
        assert kept[-min(keep_last, len(steps)) :] == sorted(steps)[-min(keep_last, len(steps)) :]
    if keep_every:
        assert all(s % keep_every != 0 for s in doomed)
    assert set(doomed) <= set(steps)


@given(
    st.one_of(st.none(), st.integers(1, 5)),
    st.one_of(st.none(), st.integers(1, 50)),
    st.sets(st.integers(0, 300), max_size=40),
)
def test_a_policy_that_keeps_all_lets_nothing_go(keep_last, keep_every, steps) -> None:
    # Retention skips listing the run when keeps_all says so: it must never be wrong.
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
    assert policy.keeps_all == (keep_last is None)
    if policy.keeps_all:
        assert policy.to_delete(sorted(steps)) == []
