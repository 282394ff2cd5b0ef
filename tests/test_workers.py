"""``stalwart.workers``: kept threads that survive a fork, the interpreter's exit and errors."""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.hashed_file import Task
from stalwart.workers import Workers, _in_own_thread, refused_new_work

from .conftest import assert_same
from .support.interrupts import KILLED, raised_into


def test_a_pool_keeps_its_threads_between_tasks() -> None:
    """Thread objects, kept alive here: a fresh thread per task would be a new object
    each time (a thread id, unlike the object, is reused once its thread ended)."""
    pool = Workers("test-keep", 2)
    ran = [pool.submit(threading.current_thread).result() for _ in range(21)]
    assert len({id(t) for t in ran}) <= 2
    assert threading.current_thread() not in ran


def test_a_task_error_is_raised_where_its_result_is_taken() -> None:
    def fail() -> None:
        raise OSError(28, "No space left on device")

    task = Task(fail)
    with pytest.raises(OSError, match="No space left"):
        task.result()
    assert Task(sum, [1, 2]).result() == 3  # the pool still works after an error


def test_a_pool_rejects_no_threads() -> None:
    with pytest.raises(ValueError, match="size=0"):
        Workers("test-none", 0)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_forked_child_gets_fresh_threads() -> None:
    """The parent's threads do not exist in a child: reusing its pool would hang forever."""
    done = run_python(
        """
        import os, threading
        from stalwart.workers import Workers
        pool = Workers("test-fork", 1)
        parent = pool.submit(threading.get_ident).result()
        pid = os.fork()
        if pid == 0:
            child = pool.submit(lambda: 7 * 6).result(timeout=20)
            os._exit(0 if child == 42 else 3)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        print("parent again", pool.submit(threading.get_ident).result(timeout=20) == parent)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "child exit 0" in done.stdout and "parent again True" in done.stdout


def test_a_task_submitted_while_the_interpreter_exits_still_runs() -> None:
    """After threading's shutdown, executors refuse work: the task runs anyway."""
    done = run_python(
        """
        import atexit
        from stalwart.hashed_file import Task
        from stalwart.workers import Workers

        def at_exit():
            print("task", Task(lambda: "ran").result())
            print("pool", Workers("test-exit", 1).submit(lambda: "ran").result())

        atexit.register(at_exit)
        Task(lambda: None).result()  # the writer pool exists and is shut down at exit
        """
    )
    assert done.returncode == 0, done.stderr
    assert "task ran" in done.stdout and "pool ran" in done.stdout


@pytest.mark.parametrize("error", [KILLED, KeyboardInterrupt()], ids=["handler", "ctrl-c"])
def test_an_error_raised_into_submit_after_queueing_is_raised_and_the_task_runs_once(
    error: BaseException,
) -> None:
    """Before: ``submit`` took any RuntimeError for the interpreter's exit and ran the
    task again in a thread of its own. A file's fsync task ran twice (the second on a
    closed descriptor) and the signal handler's error was lost."""
    pool = Workers("test-signal", 1)
    pool.submit(lambda: None).result()  # its thread waits for work, as in a save
    ran: list[int] = []
    done = threading.Event()

    def task() -> None:
        ran.append(1)
        done.set()

    submit = concurrent.futures.ThreadPoolExecutor.submit.__code__
    raised_into(submit, "_adjust_thread_count", error, lambda: pool.submit(task))
    assert done.wait(10)  # queued before the error: the pool's thread runs it
    time.sleep(0.2)
    assert ran == [1]


def test_the_refusals_recognised_are_the_ones_python_raises() -> None:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.shutdown()
    with pytest.raises(RuntimeError) as refused:
        pool.submit(print)
    assert refused_new_work(refused.value)
    assert not refused_new_work(KILLED)


def test_an_error_raised_into_a_started_thread_is_raised_and_the_task_runs_once() -> None:
    """The fallback's own thread start: an error raised once the thread runs is not a
    refusal to start one, so the task is not run a second time inline."""
    ran: list[int] = []
    started = threading.Thread.start.__code__
    pending: list[concurrent.futures.Future[None]] = []

    def start() -> None:
        pending.append(_in_own_thread(lambda: ran.append(1), (), "test-signal-own"))

    raised_into(started, "self._started.wait()", KILLED, start)
    time.sleep(0.2)
    assert ran == [1]


def test_restores_in_several_threads_at_once_are_each_exact(tmp_path: Path) -> None:
    """Every restore shares the kept check, hash and read threads: none waits on another."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    with stalwart.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        mgr.save(1, stalwart.TrainState(model=model, optimizer=opt, rng=False), force=True)
    for n in range(4):  # a run directory has one manager at a time
        shutil.copytree(tmp_path / "run", tmp_path / f"copy{n}", symlinks=True)
    results: list[BaseException | None] = [None] * 4

    def restore(n: int) -> None:
        try:
            m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
            o = torch.optim.AdamW(m.parameters())
            with stalwart.CheckpointManager(tmp_path / f"copy{n}", handle_signals=False) as mgr:
                assert mgr.restore(stalwart.TrainState(model=m, optimizer=o, rng=False)) == 1
            assert_same(m.state_dict(), model.state_dict())
            assert_same(o.state_dict(), opt.state_dict())
        except BaseException as exc:
            results[n] = exc

    threads = [threading.Thread(target=restore, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a restore hung"
    assert results == [None] * 4
