"""The object-store clients on their own: create-only puts, credentials, error classes.

obstore against the real S3 server; fsspec on a local path and in memory.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

import stalwart
from stalwart.storage.durable import DurableTier
from stalwart.storage.remote import ObstoreClient, open_client

from .conftest import FAST


@pytest.fixture(params=["obstore-s3", "fsspec-local", "fsspec-memory"])
def client(request, tmp_path: Path):
    if request.param == "obstore-s3":
        env = request.getfixturevalue("s3_env")
        bucket = request.getfixturevalue("s3_bucket")
        assert env["AWS_ENDPOINT_URL"]
        return open_client(f"s3://{bucket}/clients", retry=FAST)
    if request.param == "fsspec-local":
        return open_client((tmp_path / "store").as_uri())
    return open_client(f"memory://stalwart-test-{secrets.token_hex(4)}")


def test_a_create_only_put_refuses_an_existing_key_and_keeps_its_bytes(client) -> None:
    client.put_bytes("step_000000001/MANIFEST.json", b"first", create_only=True)
    with pytest.raises(FileExistsError):
        client.put_bytes("step_000000001/MANIFEST.json", b"second", create_only=True)
    assert client.get_bytes("step_000000001/MANIFEST.json") == b"first"
    client.put_bytes("step_000000001/MANIFEST.json", b"third")  # a plain put overwrites
    assert client.get_bytes("step_000000001/MANIFEST.json") == b"third"


def test_a_mistake_in_the_calling_code_is_raised_at_once_not_retried(client) -> None:
    # Only store failures are classified and retried; a body the client cannot send is
    # our mistake (TypeError from fsspec, ValueError from obstore).
    with pytest.raises((TypeError, ValueError)):
        client.put_bytes("key", object())  # type: ignore[arg-type]


def test_s3_credentials_in_the_url_are_used_and_never_shown(s3_env, s3_bucket, monkeypatch) -> None:
    key, secret = s3_env["AWS_ACCESS_KEY_ID"], s3_env["AWS_SECRET_ACCESS_KEY"]
    # The environment's are wrong: only the URL's can work.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDWRONGWRONG")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-wrong-secret")
    with pytest.raises(stalwart.DurableStoreError):
        DurableTier(f"s3://{s3_bucket}/x", retry=FAST).committed_steps()
    tier = DurableTier(f"s3://{key}:{secret}@{s3_bucket}/x", retry=FAST)
    assert tier.committed_steps() == []
    assert key not in tier.url and secret not in tier.url and secret not in repr(tier)


def test_credentials_in_a_url_of_another_scheme_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"credentials in a gs:// URL are not supported") as e:
        ObstoreClient("gs://user:hunter2hunter2@bucket/prefix")
    assert "hunter2" not in str(e.value)


def test_secrets_in_a_store_error_are_replaced(tmp_path, monkeypatch) -> None:
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)

    def leaky() -> None:
        raise OSError(f"request signed with {secret} was refused")

    fs_client = open_client((tmp_path / "store").as_uri())
    with pytest.raises(stalwart.DurableStoreError) as caught:
        fs_client._call("put x to", leaky)
    assert secret not in str(caught.value) and "***" in str(caught.value)
    s3_client = ObstoreClient("s3://bucket/prefix", options={"endpoint": "http://127.0.0.1:9"})
    error = s3_client._error(OSError(f"denied: {secret}"), "put x to")
    assert secret not in str(error) and "***" in str(error)
