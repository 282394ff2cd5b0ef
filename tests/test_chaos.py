"""``stalwart chaos`` end to end: real processes killed, stopped and preempted, real events.

The demo's model (``examples/charlm.py``, made smaller) trains under a short
schedule; the numbers the harness reports must agree with each other and with
what the run directory holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.chaos.procs import rank_pids, target_pid
from stalwart.events import read_events

from .conftest import assert_one_line_error, cli

REPO = Path(__file__).resolve().parent.parent
CHARLM = REPO / "examples" / "charlm.py"
EVERY = 10


def charlm(run: Path) -> list[str]:
    return [
        sys.executable, str(CHARLM), "--run-dir", str(run), "--steps", "100000",
        "--every", str(EVERY), "--log-every", "1", "--d-model", "32", "--layers", "1",
    ]  # fmt: skip


def test_a_short_schedule_is_measured_consistently(tmp_path, capsys):
    run = tmp_path / "run"
    code, out, err = cli(
        capsys, "chaos", "--run-dir", run, "--duration", "40",
        "--schedule", "kill@6,stop@7:1,term@9:grace=20", "--", *charlm(run),
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((run / "chaos" / "chaos.json").read_text())
    m, p, record = result["measured"], result["predicted"], result["record"]
    assert (run / "chaos" / "chaos.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Every fault was injected into a real process, and every kill and term restarted it.
    assert m["counts"]["faults"] == {"kill": 1, "stop": 1, "term": 1}, err
    assert m["counts"]["unplanned"] == 0
    assert m["counts"]["restarts"] == 2
    kill, term = m["failures"]
    assert record["attempts"][0]["returncode"] == -9  # SIGKILL
    assert record["attempts"][1]["returncode"] == 143  # charlm's exit after its emergency save
    # A kill loses at most the steps since the last checkpoint; a preemption saves first.
    assert 0 <= kill["lost_steps"] < EVERY
    assert kill["restored_step"] % EVERY == 0
    assert term["lost_steps"] == 0 and not term["escalated"]
    # The restores events.jsonl holds: the fresh start's, then one per restart.
    restores = [e for e in read_events(run) if e["event"] in ("restore", "restore_none")]
    steps = [e.get("step", 0) if e["event"] == "restore" else 0 for e in restores]
    assert steps[:3] == [0, kill["restored_step"], term["restored_step"]]
    assert kill["restore_s"] == pytest.approx(restores[1].get("seconds", 0.0))
    parts = ("detection_s", "restart_s", "restore_s", "first_step_s")
    assert sum(kill[k] for k in parts) == pytest.approx(kill["recovery_s"], abs=1e-6)
    (stop,) = m["stops"]
    assert 1.0 <= stop["seconds"] < 2.0

    # Goodput is below the fault-free rate, and the window's time is accounted for.
    assert 0 < m["goodput_steps_per_s"] < m["ideal_steps_per_s"]
    assert 0 < m["goodput_fraction"] < 1
    assert m["steps"]["last"] >= kill["step_reached"]
    b = m["breakdown_s"]
    assert abs(b["other"]) < 0.2 * m["window"]["seconds"], b
    assert 0 < p["goodput_fraction"] < 1
    assert p["mtbf_s"] == pytest.approx(m["window"]["seconds"] / 2)
    assert "Young/Daly predicts" in out


@pytest.mark.slow
def test_under_torchrun_one_rank_is_killed_and_the_whole_job_restarted(tmp_path, capsys):
    """--nproc 2: the kill hits rank 1 (found through /proc), torchrun ends the job, the
    supervisor starts it again and both ranks resume from the newest checkpoint.

    The kill comes with the first progress line, and the restarted job trains to its
    last step and exits 0: the run ends there, not at the deadline."""
    run = tmp_path / "run"
    script = [*charlm(run)[1:], "--batch-size", "16", "--steps", str(6 * EVERY)]
    code, _out, err = cli(
        capsys, "chaos", "--run-dir", run, "--duration", "60", "--nproc", "2",
        "--schedule", "kill@0", "--", *script,
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((run / "chaos" / "chaos.json").read_text())
    m, record = result["measured"], result["record"]
    assert m["completed"] and m["steps"]["last"] == 6 * EVERY
    (fault,) = record["faults"]
    torchrun_pid = record["attempts"][0]["pid"]
    assert fault["rank"] == 1 and fault["pid"] != torchrun_pid
    assert "exitcode  : -9" in Path(record["attempts"][0]["log"]).read_text()
    assert record["attempts"][0]["returncode"] not in (0, None)
    assert m["counts"]["restarts"] == 1
    (kill,) = m["failures"]
    assert 0 <= kill["lost_steps"] < EVERY
    assert kill["recovery_s"] is not None
    assert m["steps"]["last"] > kill["step_reached"]  # the restarted job trained on
    assert 0 < m["goodput_fraction"] < 1


def test_ranks_are_found_through_proc_as_the_topmost_process_with_their_rank(tmp_path):
    """A rank's own child (a DataLoader worker) carries its RANK too, and is not the rank."""
    child = (
        "import os, subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    )
    env = {**os.environ, "RANK": "3"}
    proc = subprocess.Popen([sys.executable, "-c", child], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(_children(proc.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank_pids(proc.pid) == {3: proc.pid}
        assert target_pid(proc.pid, None) == (proc.pid, 3)
        with pytest.raises(ValueError, match=r"no process with RANK=0 .*ranks found: \[3\]"):
            target_pid(proc.pid, 0)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def _children(pid: int) -> list[str]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--schedule", "kill@1", "--mtbf", "5", "--", "true"], "not both"),
        (["--schedule", "boom@1", "--", "true"], "boom@1"),
        (["--mtbf", "5", "--faults", "kill,melt", "--", "true"], "--faults"),
        ([], "no training command"),
        (["--", "torchrun", "--max-restarts", "3", "train.py"], "give --max-restarts=0"),
        (["--schedule", "kill@nan", "--", "true"], "finite and >= 0"),
        (["--schedule", "stop@1:inf", "--", "true"], "finite and >= 0"),
        (["--schedule", "kill@1e999", "--", "true"], "finite and >= 0"),
        (["--mtbf", "1e-9", "--", "true"], "more than 10000"),
        (["--nproc", "0", "--", "train.py"], "--nproc must be at least 1"),
        (
            ["--", "python", "-m", "torch.distributed.run", "--max_restarts=1", "t.py"],
            "--max_restarts=1",
        ),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(tmp_path, capsys, args, fragment):
    code, _out, err = cli(capsys, "chaos", "--run-dir", tmp_path, "--duration", "1", *args)
    assert code == 2
    assert_one_line_error(err, fragment)


def test_a_command_that_never_makes_progress_is_reported_not_restarted_forever(tmp_path, capsys):
    code, _out, err = cli(
        capsys, "chaos", "--run-dir", tmp_path, "--duration", "30", "--quiet",
        "--", sys.executable, "-c", "raise SystemExit(3)",
    )  # fmt: skip
    assert code == 1
    assert_one_line_error(err, "failed 2 times in a row", "last exit 3")


def test_a_fault_aimed_at_a_missing_rank_is_a_usage_error_and_leaves_nothing_running(
    tmp_path, capsys
):
    """The command (RANK=0 in its environment, like a torchrun worker) has no rank 5."""
    marker = tmp_path / "alive"
    script = (
        "import os, sys, time\n"
        f"open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
        "for s in range(1, 10**6):\n"
        "    print(f'step {s}', flush=True); time.sleep(0.05)\n"
    )
    code, _out, err = cli(
        capsys, "chaos", "--run-dir", tmp_path, "--duration", "30", "--quiet",
        "--target-rank", "5", "--schedule", "kill@0.5",
        "--", "env", "RANK=0", sys.executable, "-c", script,
    )  # fmt: skip
    assert code == 2
    assert_one_line_error(err, "kill@0.5", "no process with RANK=5", "ranks found: [0]")
    pid = int(marker.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()


def test_the_help_documents_the_faults_and_exit_statuses(capsys):
    code, out, _err = cli(capsys, "chaos", "--help")
    assert code == 0
    assert all(f"  {n}  " in out for n in (0, 1, 2))
    assert all(kind in out for kind in ("kill@T", "stop@T:S", "term@T:grace=G"))


def _gone(pid: int, wait: float = 2.0) -> bool:
    deadline = time.monotonic() + wait
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not Path(f"/proc/{pid}").exists()


_FORKS = (
    "import os, signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
    "open(sys.argv[1], 'a').write(f'{os.getpid()} {child.pid} ')\n"
    "for s in range(1, int(sys.argv[2])):\n"
    "    print(f'step {s}', flush=True); time.sleep(0.05)\n"
)


def test_a_command_that_ignores_sigterm_is_killed_with_its_children_at_the_deadline(
    tmp_path, capsys
):
    pids = tmp_path / "pids"
    began = time.monotonic()
    code, _out, err = cli(
        capsys, "chaos", "--run-dir", tmp_path, "--duration", "1.5", "--stop-grace", "0.5",
        "--quiet", "--", sys.executable, "-c", _FORKS, pids, "1000000",
    )  # fmt: skip
    assert code == 0, err
    assert time.monotonic() - began < 10
    assert all(_gone(int(p)) for p in pids.read_text().split())


def test_a_command_that_exits_leaves_no_orphan_and_is_not_waited_for(tmp_path, capsys):
    """It finishes (exit 0) with a child still holding its output open: the child is
    killed with the command's process group, and the run ends at once."""
    pids = tmp_path / "pids"
    began = time.monotonic()
    code, out, err = cli(
        capsys, "chaos", "--run-dir", tmp_path, "--duration", "60", "--json",
        "--", sys.executable, "-c", _FORKS, pids, "5",
    )  # fmt: skip
    assert code == 0, err
    record = json.loads(out)["record"]
    assert record["completed"]
    assert all(_gone(int(p)) for p in pids.read_text().split())
    assert time.monotonic() - began < 4


_STEPS = "for s in range(1, 30): print(f'step {s}', flush=True)"


def test_an_events_log_that_is_a_link_is_a_warning_and_the_run_is_still_measured(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text('{"time": 1, "event": "save", "step": 1, "stall_s": 99}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").symlink_to(elsewhere)
    code, _out, err = cli(
        capsys, "chaos", "--run-dir", run, "--duration", "30", "--quiet",
        "--", sys.executable, "-c", _STEPS,
    )  # fmt: skip
    assert code == 0, err
    assert "warning: cannot read" in err and "Traceback" not in err
    result = json.loads((run / "chaos" / "chaos.json").read_text())
    assert result["measured"]["checkpoint"]["saves"] == 0
    assert result["measured"]["steps"]["last"] == 29


def test_credentials_in_the_command_are_not_written_out(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret123")
    command = [
        sys.executable, "-c", _STEPS, "s3://AKIDKEY:urlsecret99@bucket/run",
        "--api-token", "tokensecret1", "--password=pwsecret77", "x-envsecret123",
    ]  # fmt: skip
    code, out, err = cli(
        capsys, "chaos", "--run-dir", tmp_path, "--duration", "30", "--json", "--", *command,
    )  # fmt: skip
    assert code == 0, err
    written = (tmp_path / "chaos" / "chaos.json").read_text()
    for secret in ("urlsecret99", "AKIDKEY", "tokensecret1", "pwsecret77", "envsecret123"):
        assert secret not in written and secret not in out and secret not in err, secret
    assert json.loads(written)["record"]["command"][:3] == command[:3]


def test_out_inside_a_file_is_a_one_line_error_before_the_command_runs(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    marker = tmp_path / "ran"
    code, _out, err = cli(
        capsys, "chaos", "--run-dir", tmp_path, "--duration", "30", "--out", tmp_path / "file" / "o",
        "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')",
    )  # fmt: skip
    assert code != 0
    assert_one_line_error(err, "file")
    assert not marker.exists()


def test_a_progress_line_whose_step_is_not_a_number_is_not_counted(tmp_path, capsys):
    """A --step-pattern whose group can match a word: such lines are output, not steps,
    and reading goes on (a reader that stopped would block the command on a full pipe)."""
    script = (
        "import sys\n"
        "for s in range(1, 3000):\n"
        "    print(f'step {s}' if s % 2 else 'step none ' + 'x' * 100, flush=True)\n"
        "print('step ' + '9' * 5000, flush=True)\n"
    )
    code, out, err = cli(
        capsys, "chaos", "--run-dir", tmp_path, "--duration", "30", "--json", "--quiet",
        "--step-pattern", r"^step (\w+)", "--", sys.executable, "-c", script,
    )  # fmt: skip
    assert code == 0, err
    assert "Traceback" not in err
    record = json.loads(out)["record"]
    assert record["completed"]
    assert [s for _t, s in record["attempts"][0]["steps"]] == list(range(1, 3000, 2))


def test_links_left_in_the_results_folder_are_replaced_or_refused_never_written_through(
    tmp_path, capsys
):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "chaos.json").symlink_to(victim)
    (out / "chaos.png").symlink_to(victim)
    command = ["--", sys.executable, "-c", _STEPS]
    args = ["chaos", "--run-dir", tmp_path, "--out", out, "--duration", "30", "--quiet"]
    code, _out, err = cli(capsys, *args, *command)
    assert code == 0, err
    assert victim.read_text() == "keep"
    assert not (out / "chaos.json").is_symlink() and json.loads((out / "chaos.json").read_text())
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []

    (out / "logs" / "attempt-0.log").unlink()
    (out / "logs" / "attempt-0.log").symlink_to(victim)
    code, _out, err = cli(capsys, *args, *command)
    assert code == 1
    assert_one_line_error(err, "attempt-0.log", "link")
    assert victim.read_text() == "keep"

    (out / "logs" / "attempt-0.log").unlink()
    (out / "logs").rmdir()
    (out / "logs").symlink_to(tmp_path)
    code, _out, err = cli(capsys, *args, *command)
    assert code == 2
    assert_one_line_error(err, "logs", "is a link or a file")


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_a_duration_that_is_not_a_positive_number_is_refused_before_anything_runs(
    tmp_path, capsys, value
):
    code, _out, err = cli(capsys, "chaos", "--run-dir", tmp_path, "--duration", value, "--", "true")
    assert code == 2
    assert "--duration" in err and "Traceback" not in err
    assert not (tmp_path / "chaos").exists()


def test_a_preemption_the_command_ignores_is_escalated_to_sigkill_of_the_whole_group(
    tmp_path, capsys
):
    pids = tmp_path / "pids"
    code, out, err = cli(
        capsys, "chaos", "--run-dir", tmp_path, "--duration", "4", "--stop-grace", "0.3",
        "--schedule", "term@0.2:grace=0.5", "--json", "--quiet",
        "--", sys.executable, "-c", _FORKS, pids, "1000000",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    (term,) = result["record"]["faults"]
    assert term["escalated"]
    first = result["record"]["attempts"][0]
    assert first["returncode"] == -9
    assert 0.5 <= first["ended"] - term["time"] < 2.0
    assert result["measured"]["failures"][0]["escalated"]
    assert all(_gone(int(p)) for p in pids.read_text().split())
