"""Fixtures for tests against a real S3 server (SeaweedFS), optionally behind a fault proxy.

One server per test session keeps start-up cost (about a second) out of each test; each
test gets its own bucket, so tests do not see each other's objects.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.events import read_events
from stalwart.manifest import MANIFEST_NAME
from stalwart.pipeline import verify_checkpoint
from stalwart.storage.durable import DurableTier
from stalwart.storage.remote import RetryPolicy
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server

FAST = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=20.0, request_timeout=10.0)
"""Retries for tests: short backoff, a deadline of seconds rather than minutes."""


def use_endpoint(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Point the S3 clients that read the environment at ``endpoint`` (the server or a proxy)."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.setenv(name, endpoint)


def run_events(run: Path) -> list[dict]:
    """Every event a run recorded in its events.jsonl."""
    return list(read_events(run))


def verify_durable(tier: DurableTier, step: int, tmp: Path) -> None:
    """Download ``step`` into a fresh directory under ``tmp`` and verify every file there."""
    target = Path(tempfile.mkdtemp(prefix=f"verify-{step}-", dir=tmp))
    (target / MANIFEST_NAME).write_bytes(tier.download(step, target))
    assert verify_checkpoint(target).step == step


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A SeaweedFS S3 server for the whole session, stopped (and its data deleted) at the end."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the session server, unique to this test."""
    name = f"test-{secrets.token_hex(6)}"
    s3_server.create_bucket(name)
    return name


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The server's endpoint and credentials as ``AWS_*`` environment variables.

    Clients that read the environment (obstore, boto3, s3fs) then reach the test server
    without extra arguments; monkeypatch restores the previous environment afterwards.
    """
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def fault_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the session server; no faults until a test sets some."""
    with FaultProxy("127.0.0.1", s3_server.port) as proxy:
        yield proxy
