"""A 50-trial slice of ``make torture``: SIGKILL at random instants, every resume exact.

Sync saves, async saves, async saves with an upload thread to a ``file://``
durable tier, and a real 2-process gloo group (one rank or both killed). Each
trial kills a job that saves continuously a state whose every value is a known
function of the step; the next job restores, and must load exactly the state of
the newest committed step, find torn steps unrestorable, and save again. Every
committed checkpoint, local or durable, must verify after every kill. See
``tests/faults/torture.py`` for the harness and the phase estimate.
"""

from __future__ import annotations

from pathlib import Path

from .torture import run_torture

TRIALS = 50
MIX = {"sync": 15, "async": 15, "durable": 14, "2-rank": 6}


def test_random_sigkills_never_restore_anything_but_the_newest_committed_state(
    tmp_path: Path,
) -> None:
    result = run_torture(TRIALS, tmp_path, mix=MIX, seed=20261130, series=25)

    assert not result.failures, "\n".join(
        f"{t.scenario} #{t.series}.{t.index} ({t.phase}): {'; '.join(t.problems)}"
        for t in result.failures
    )
    assert len(result.trials) == TRIALS
    by_scenario = {s: [t for t in result.trials if t.scenario == s] for s in MIX}
    assert {s: len(ts) for s, ts in by_scenario.items()} == MIX
    restored = [t for t in result.trials if t.restored is not None]
    assert len(restored) >= TRIALS // 2, "too few trials got as far as a committed save"
    # The kills must land inside saves, or nothing was tested: a save torn by the kill
    # leaves a staging directory behind, and the resume falls back past it.
    torn = [t for t in result.trials if t.torn]
    assert len(torn) >= 5, f"only {len(torn)} kills tore a save"
    assert any(t.outcome == "fell-back-older" for t in by_scenario["2-rank"])
    phases = {t.phase for t in result.trials}
    assert "writing" in phases and len(phases) >= 3, f"kills landed only in {phases}"
