"""The public read API (``stalwart.catalog``) and the run layout (``stalwart.layout``) on real runs."""

from __future__ import annotations

import ast
import os
import shutil
import time
from pathlib import Path

import pytest

import stalwart
from stalwart import catalog
from stalwart.events import EventLog
from stalwart.layout import (
    EVENTS_NAME,
    MANIFEST_NAME,
    CheckpointName,
    hidden_name,
    parse_checkpoint_name,
    parse_step_key,
    step_dir_name,
    step_of_dir_name,
)
from stalwart.storage.durable import DurableTier
from stalwart.storage.remote import RetryPolicy

from .conftest import flip_byte, make_parts, train_steps

FAST = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=20.0, request_timeout=10.0)
STAGING = ".step_000000004.tmp-abc123"
QUARANTINED = ".step_000000002.corrupt-0123456789ab"


def save_steps(run: Path, steps: range, **manager_kwargs: object) -> None:
    parts = make_parts()
    with stalwart.CheckpointManager(
        run, keep_last=None, handle_signals=False, **manager_kwargs
    ) as ckpt:
        for step in steps:
            train_steps(parts, 1)
            ckpt.save(step, parts.state, metrics={"loss": 1.0 / step})


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("catalog") / "run"
    save_steps(run, range(1, 4))
    return run


@pytest.fixture
def run(pristine_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine_run, tmp_path / "run", symlinks=True))


def data_file(checkpoint: Path) -> Path:
    return next(checkpoint.glob("*.distcp"))


# ----------------------------------------------------------------------------- layout


def test_layout_names_round_trip_and_other_names_are_not_checkpoints():
    assert step_dir_name(200) == "step_000000200"
    assert step_of_dir_name("step_000000200") == 200
    for kind in ("tmp", "del", "corrupt"):
        name = hidden_name(7, kind)
        assert name.startswith(".step_000000007.") and name != hidden_name(7, kind)
        assert parse_checkpoint_name(name) == CheckpointName(step=7, kind=kind)
        assert step_of_dir_name(name) is None
    assert parse_checkpoint_name("step_000000200") == CheckpointName(step=200, kind="step")
    for other in ("step_12", ".step_000000001.tmp-XYZ", "step_000000001.tmp-abc", "notes", ".lock"):
        assert parse_checkpoint_name(other) is None, other
    assert parse_step_key(f"step_000000005/data-ab/{MANIFEST_NAME}") == (
        5,
        f"data-ab/{MANIFEST_NAME}",
    )
    assert parse_step_key("elsewhere/step_000000005/x") is None


# ----------------------------------------------------------------------------- a run


def test_list_run_tells_committed_incomplete_and_quarantined_steps_apart(run):
    (run / STAGING).mkdir()
    (run / STAGING / "__0_0.distcp").write_bytes(b"x" * 10)
    shutil.copytree(run / step_dir_name(2), run / QUARANTINED)
    shutil.rmtree(run / step_dir_name(2))

    infos = {i.name: i for i in catalog.list_run(run, skip_reasons={2: "checksum mismatch"})}
    assert set(infos) == {step_dir_name(1), step_dir_name(3), STAGING, QUARANTINED}
    committed = infos[step_dir_name(3)]
    assert committed.status == "committed" and committed.step == 3
    assert committed.manifest is not None and committed.manifest.step == 3
    assert committed.bytes == committed.manifest.total_bytes and committed.checked is None
    staging = infos[STAGING]
    assert staging.status == "incomplete" and staging.step == 4
    assert (staging.bytes, staging.files) == (10, 1) and staging.manifest is None
    assert "a save in progress or abandoned" in str(staging.problems[0])
    aside = infos[QUARANTINED]
    assert aside.status == "corrupt" and aside.manifest is not None  # its manifest still reads
    assert str(aside.problems[0]) == "moved aside by restore: checksum mismatch"


def test_check_step_finds_a_flipped_byte_only_with_checksums(run):
    flip_byte(data_file(run / step_dir_name(2)))
    sizes = {i.step: catalog.check_step(i, checksums=False) for i in catalog.list_run(run)}
    assert [i.status for i in sizes.values()] == ["committed"] * 3
    assert {i.checked for i in sizes.values()} == {"size"}

    sums = {i.step: catalog.check_step(i, checksums=True) for i in catalog.list_run(run)}
    bad = sums[2]
    assert bad.status == "corrupt" and bad.checked == "checksum"
    assert [p.file for p in bad.problems] == [data_file(run / step_dir_name(2)).name]
    assert "checksum" in bad.problems[0].reason
    assert sums[1].status == sums[3].status == "committed"


def test_an_older_step_copied_to_a_newer_name_is_corrupt(run):
    shutil.copytree(run / step_dir_name(1), run / step_dir_name(9))
    info = next(i for i in catalog.list_run(run) if i.step == 9)
    assert info.status == "corrupt" and info.problems[0].file == MANIFEST_NAME
    assert info.checked == "size"  # the manifest check is done while listing


def test_a_truncated_file_is_a_size_problem_and_a_link_is_never_listed(run, tmp_path):
    victim = data_file(run / step_dir_name(3))
    os.truncate(victim, victim.stat().st_size - 1)
    os.symlink(run / step_dir_name(1), run / step_dir_name(8))
    infos = [catalog.check_step(i, checksums=False) for i in catalog.list_run(run)]
    assert [i.step for i in infos] == [1, 2, 3]
    assert infos[2].status == "corrupt" and "size" in infos[2].problems[0].reason


# ----------------------------------------------------------------------------- a gc plan


def test_plan_gc_plans_only_old_leftovers_and_touches_nothing(run):
    old, young = ".step_000000005.tmp-aaaaaaaaaaaa", ".step_000000006.del-bbbbbbbbbbbb"
    for name in (old, young, QUARANTINED):
        (run / name).mkdir()
        (run / name / "f").write_bytes(b"y" * 7)
    hour_ago = time.time() - 3600
    for path in (run / old, run / old / "f", run / QUARANTINED, run / QUARANTINED / "f"):
        os.utime(path, (hour_ago, hour_ago))
    before = sorted(os.listdir(run))

    plan = {i.name: i for i in catalog.plan_gc(run, grace=600, corrupt=False)}
    assert sorted(os.listdir(run)) == before
    assert [n for n, i in plan.items() if i.remove] == [old]
    assert plan[old].bytes == 7 and plan[old].age_s is not None and plan[old].age_s >= 3600
    assert "younger than the grace period" in (plan[young].reason or "")
    assert "kept for inspection" in (plan[QUARANTINED].reason or "")
    for step in (1, 2, 3):
        item = plan[step_dir_name(step)]
        assert item.kind == "committed" and not item.remove

    with_corrupt = catalog.plan_gc(run, grace=600, corrupt=True)
    assert sorted(i.name for i in with_corrupt if i.remove) == sorted([old, QUARANTINED])


# ----------------------------------------------------------------------------- a store


def test_list_store_and_plan_store_gc_on_a_file_url(tmp_path):
    url = (tmp_path / "store").as_uri()
    save_steps(tmp_path / "run", range(1, 3), durable=stalwart.DurableConfig(url=url, retry=FAST))
    tier = DurableTier(url, retry=FAST)
    incomplete = "step_000000009/data-00000000000000aa/__0_0.distcp"
    tier.client.put_bytes(incomplete, b"z" * 100)

    infos = {i.step: i for i in catalog.list_store(tier)}
    assert [infos[s].status for s in (1, 2, 9)] == ["committed", "committed", "incomplete"]
    manifest = tier.read_manifest(2)
    assert infos[2].manifest == manifest and infos[2].bytes == manifest.total_bytes
    assert infos[2].path == f"{url}/{step_dir_name(2)}" and infos[2].checked == "size"
    assert infos[9].bytes == 100 and infos[9].objects == 1

    by_url = catalog.list_steps(url, retry=FAST)  # the same listing, from the URL alone
    assert [(i.step, i.status, i.bytes) for i in by_url] == [
        (i.step, i.status, i.bytes) for i in infos.values()
    ]
    by_dir = catalog.list_steps(tmp_path / "run")
    assert [(i.step, i.status) for i in by_dir] == [(1, "committed"), (2, "committed")]

    victim = next(
        o.key for s in tier.scan() if s.step == 1 for o in s.objects if ".distcp" in o.key
    )
    tier.remove([victim])
    assert next(i for i in catalog.list_store(tier) if i.step == 1).status == "corrupt"

    young, steps = catalog.plan_store_gc(tier, grace=3600)
    assert [i.remove for i in young] == [False] and young[0].keys == [incomplete]
    assert sorted(s.step for s in steps) == [1, 2, 9]
    later, _ = catalog.plan_store_gc(tier, grace=3600, now=time.time() + 7200)
    assert [i.remove for i in later] == [True]
    assert tier.committed_steps() == [1, 2]  # planning removed nothing


# ----------------------------------------------------------------------------- events


def test_resume_verdicts_keep_the_verdict_of_each_step_s_last_restore(tmp_path):
    log = EventLog(tmp_path / EVENTS_NAME)
    log.emit("restore", step=10)
    log.emit("resume_diverged", restored_step=10, step=12, rank=1)
    log.emit("restore", step=10)
    log.emit("resume_verified", restored_step=10, through=14)
    log.emit("restore", step=20)
    verdicts = catalog.resume_verdicts(tmp_path)
    assert set(verdicts) == {10, 20}
    assert catalog.verdict_mark(verdicts[10]) == "exact to 14"
    assert verdicts[20] is None and catalog.verdict_mark(verdicts[20]) == "unchecked"


# ----------------------------------------------------------------------------- layering

SRC = Path(stalwart.__file__).parent


def stalwart_imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from stalwart... import name`` (name "" for ``import m``)."""
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stalwart"):
            found += [(node.module or "", alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.startswith("stalwart")]
    return found


def test_the_layout_module_stands_on_nothing_of_stalwart():
    assert stalwart_imports(SRC / "layout.py") == []


def test_cli_commands_import_no_other_command_and_no_private_name():
    for path in sorted((SRC / "cli").glob("*.py")):
        for module, name in stalwart_imports(path):
            if path.name != "main.py":  # main wires the commands together
                assert not (module == "stalwart.cli" and name.startswith("cmd_")), path.name
                assert not module.startswith("stalwart.cli.cmd_"), (path.name, module)
            private = name.startswith("_") and not name.startswith("__")  # not __version__
            assert not private, (path.name, module, name)


def test_nothing_below_the_cli_imports_it():
    for path in sorted(SRC.rglob("*.py")):
        if "cli" in path.relative_to(SRC).parts or path.name == "__main__.py":
            continue  # ``python -m stalwart`` is the CLI's entry point
        for module, _name in stalwart_imports(path):
            assert not module.startswith("stalwart.cli"), (path, module)
