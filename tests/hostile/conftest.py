"""Fixtures of the hostile suite: one pristine run and one worker for the whole session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Pristine, Summary, Worker, build_pristine


@pytest.fixture(scope="session")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    return build_pristine(tmp_path_factory.mktemp("hostile-pristine") / "run")


@pytest.fixture(scope="session")
def summary() -> Summary:
    return Summary()


@pytest.fixture(scope="session")
def worker(tmp_path_factory: pytest.TempPathFactory, summary: Summary) -> Iterator[Worker]:
    log = tmp_path_factory.mktemp("hostile-worker") / "worker.log"
    w = Worker(log)
    try:
        yield w
    finally:
        w.stop()
        if summary.counts:
            text = summary.text(w.restarts)
            report = os.environ.get("STALWART_FUZZ_REPORT")
            if report:
                Path(report).write_text(text + "\n")
            print("\n" + text, file=sys.stderr)
