"""The S3 test infrastructure itself: the SeaweedFS server and the fault proxy.

Durability tests trust these two pieces to behave like a real object store and like real
network faults; if the server accepted anonymous writes or the proxy silently forwarded
a "failed" request, those tests would pass for the wrong reasons. These checks pin down
the behaviour the other tests rely on, through obstore, the client stalwart uses.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError, BaseError, PermissionDeniedError
from obstore.store import S3Store

from tests.support.faultproxy import FAIL_MODES, FaultProxy
from tests.support.s3server import S3Server, signed_request

# Short backoff keeps retry tests fast; the default starts at 100 ms and doubles.
FAST_RETRIES: dict[str, Any] = {
    "max_retries": 10,
    "backoff": {
        "init_backoff": timedelta(milliseconds=5),
        "max_backoff": timedelta(milliseconds=100),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=20),
}
NO_RETRIES: dict[str, Any] = {"max_retries": 0}


def make_store(
    server: S3Server,
    bucket: str,
    *,
    endpoint: str | None = None,
    retry_config: dict[str, Any] | None = None,
    **config: Any,
) -> S3Store:
    """An obstore S3Store for ``bucket``, by default on the server itself.

    ``client_options`` must carry ``allow_http``: once client options are given, obstore
    ignores ``AWS_ALLOW_HTTP`` from the environment.
    """
    settings: dict[str, Any] = {
        "endpoint": endpoint or server.endpoint,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "region": server.region,
    }
    settings.update(config)
    return S3Store(
        bucket,
        client_options={"allow_http": True, "connect_timeout": "2s", "timeout": "20s"},
        retry_config=retry_config or FAST_RETRIES,  # type: ignore[arg-type]
        **settings,
    )


def exists(store: S3Store, key: str) -> bool:
    try:
        obstore.head(store, key)
    except FileNotFoundError:
        return False
    return True


# -- the server ---------------------------------------------------------------------------


def test_server_refuses_anonymous_and_wrong_credentials(
    s3_server: S3Server, s3_bucket: str
) -> None:
    good = make_store(s3_server, s3_bucket, retry_config=NO_RETRIES)
    obstore.put(good, "control", b"accepted")

    cases = {
        "AccessDenied": {"skip_signature": True},
        "SignatureDoesNotMatch": {"secret_access_key": "0" * 40},
        "InvalidAccessKeyId": {"access_key_id": "AKIANOSUCHKEY", "secret_access_key": "x" * 40},
    }
    for code, overrides in cases.items():
        store = make_store(s3_server, s3_bucket, retry_config=NO_RETRIES, **overrides)
        with pytest.raises(PermissionDeniedError, match=code) as info:
            obstore.put(store, "intruder", b"should not land")
        assert s3_server.secret_key not in str(info.value)
        with pytest.raises(PermissionDeniedError, match=code):
            obstore.get(store, "control")

    assert not exists(good, "intruder")
    # The same refusals on the wire, without obstore in between.
    assert s3_server.request("GET", "/", sign=False)[0] == 403
    assert s3_server.request("GET", "/", secret_key="0" * 40)[0] == 403


def test_env_fixture_lets_obstore_find_server(s3_env: dict[str, str], s3_bucket: str) -> None:
    assert os.environ["AWS_ENDPOINT_URL"] == s3_env["AWS_ENDPOINT_URL"]
    store = S3Store(s3_bucket)  # everything else from AWS_* variables
    obstore.put(store, "from-env", b"found")
    assert obstore.get(store, "from-env").bytes() == b"found"


def test_conditional_create_refuses_existing_key(s3_server: S3Server, s3_bucket: str) -> None:
    store = make_store(s3_server, s3_bucket, retry_config=NO_RETRIES)
    obstore.put(store, "once", b"first", mode="create")
    with pytest.raises(AlreadyExistsError, match="412 Precondition Failed"):
        obstore.put(store, "once", b"second", mode="create")
    assert obstore.get(store, "once").bytes() == b"first"


def test_buckets_must_exist(s3_server: S3Server) -> None:
    store = make_store(s3_server, "no-such-bucket", retry_config=NO_RETRIES)
    # obstore reports any 404, a missing bucket included, as FileNotFoundError.
    with pytest.raises(FileNotFoundError, match="NoSuchBucket"):
        obstore.put(store, "k", b"v")


def test_two_servers_run_side_by_side(s3_server: S3Server, s3_bucket: str) -> None:
    with S3Server() as other:
        assert not set(other.ports.values()) & set(s3_server.ports.values())
        assert other.endpoint != s3_server.endpoint
        assert other.access_key != s3_server.access_key
        other.create_bucket("other-bucket")
        assert "other-bucket" in other.list_buckets()
        assert "other-bucket" not in s3_server.list_buckets()
        assert s3_bucket in s3_server.list_buckets()
        # Each server knows only its own identity.
        status, _ = other.request(
            "GET", "/", access_key=s3_server.access_key, secret_key=s3_server.secret_key
        )
        assert status == 403
        pid, root = other.pid, other.root
    assert pid is not None and root is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not root.exists()
    assert s3_server.running and s3_server.request("GET", "/")[0] == 200


# -- the proxy ----------------------------------------------------------------------------


def test_proxy_relays_without_faults(
    s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    store = make_store(s3_server, s3_bucket, endpoint=fault_proxy.endpoint, retry_config=NO_RETRIES)
    data = os.urandom(6 * 1024 * 1024)
    obstore.put(store, "big/blob", data)
    obstore.put(store, "big/small", b"tiny")
    assert obstore.get(store, "big/blob").bytes() == data
    assert (
        obstore.get(store, "big/blob", options={"range": (1000, 2000)}).bytes() == data[1000:2000]
    )
    assert obstore.head(store, "big/blob")["size"] == len(data)
    listed = sorted(meta["path"] for batch in obstore.list(store, "big/") for meta in batch)
    assert listed == ["big/blob", "big/small"]
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "big/missing")

    log = fault_proxy.log
    assert [outcome for _, _, outcome in log] == ["ok"] * len(log)
    assert fault_proxy.requests == len(log) >= 7
    assert fault_proxy.failures == {}
    # 6 MiB is above obstore's 5 MiB multipart threshold: the proxy carried a multipart upload.
    blob = f"/{s3_bucket}/big/blob"
    assert ("POST", f"{blob}?uploads=", "ok") in log
    assert sum(1 for m, p, _ in log if m == "PUT" and p.startswith(f"{blob}?partNumber=")) == 2
    assert any(m == "POST" and p.startswith(f"{blob}?uploadId=") for m, p, _ in log)
    # Keep-alive: several requests per connection, not one connection each.
    assert fault_proxy.connections < fault_proxy.requests


@pytest.mark.parametrize("mode", FAIL_MODES)
def test_each_fail_mode_fails_a_request(
    s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy, mode: str
) -> None:
    direct = make_store(s3_server, s3_bucket, retry_config=NO_RETRIES)
    proxied = make_store(
        s3_server, s3_bucket, endpoint=fault_proxy.endpoint, retry_config=NO_RETRIES
    )
    fault_proxy.fail_modes = (mode,)
    fault_proxy.fail_rate = 1.0

    with pytest.raises(BaseError) as info:
        obstore.put(proxied, "victim", os.urandom(256 * 1024))
    message = str(info.value)
    assert fault_proxy.failures[mode] == 1
    assert fault_proxy.log == [("PUT", f"/{s3_bucket}/victim", mode)]
    assert s3_server.secret_key not in message
    if mode == "503":
        assert "503 Service Unavailable" in message and "SlowDown" in message
    elif mode == "500":
        assert "500 Internal Server Error" in message and "InternalError" in message
    # Only reset_response forwards the request: the write happened, the client never heard.
    assert exists(direct, "victim") == (mode == "reset_response")

    obstore.put(direct, "reader", b"payload")
    with pytest.raises(BaseError):
        obstore.get(proxied, "reader").bytes()


def test_builtin_retries_ride_out_random_faults(
    s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    store = make_store(s3_server, s3_bucket, endpoint=fault_proxy.endpoint)
    fault_proxy.fail_rate = 0.3
    for i in range(50):
        obstore.put(store, f"item/{i:02d}", f"value {i}".encode())

    failures = fault_proxy.failures
    assert sum(failures.values()) > 0
    assert set(failures) <= set(FAIL_MODES)
    assert fault_proxy.requests == 50 + sum(failures.values())

    fault_proxy.fail_rate = 0.0
    for i in range(50):
        assert obstore.get(store, f"item/{i:02d}").bytes() == f"value {i}".encode()


def test_outage_fails_requests_until_lifted(
    s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    store = make_store(s3_server, s3_bucket, endpoint=fault_proxy.endpoint, retry_config=NO_RETRIES)
    obstore.put(store, "before", b"1")  # leaves a pooled keep-alive connection

    fault_proxy.down = True
    for attempt in range(3):  # the pooled connection first, then fresh ones
        with pytest.raises(BaseError):
            obstore.put(store, f"during-{attempt}", b"2")
    assert fault_proxy.failures["down"] >= 3

    fault_proxy.down = False
    obstore.put(store, "after", b"3")
    assert obstore.get(store, "after").bytes() == b"3"
    direct = make_store(s3_server, s3_bucket)
    assert not any(exists(direct, f"during-{attempt}") for attempt in range(3))


def test_delay_slows_responses(
    s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    store = make_store(s3_server, s3_bucket, endpoint=fault_proxy.endpoint)
    obstore.put(store, "k", b"v" * 1024)

    def median_get_seconds() -> float:
        times = []
        for _ in range(5):
            began = time.perf_counter()
            obstore.get(store, "k").bytes()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    baseline = median_get_seconds()
    fault_proxy.delay_s = 0.15
    delayed = median_get_seconds()
    fault_proxy.delay_s = 0.0
    assert delayed >= 0.15
    assert delayed / baseline > 5, f"baseline {baseline:.4f} s, delayed {delayed:.4f} s"


def test_fault_sequence_is_reproducible_from_seed(s3_server: S3Server) -> None:
    def outcomes(seed: int) -> list[str]:
        with FaultProxy("127.0.0.1", s3_server.port, seed=seed) as proxy:
            proxy.fail_rate = 0.5
            proxy.fail_modes = ("503", "500")
            for _ in range(20):
                signed_request(
                    "127.0.0.1",
                    proxy.port,
                    "GET",
                    "/",
                    access_key=s3_server.access_key,
                    secret_key=s3_server.secret_key,
                )
            return [outcome for _, _, outcome in proxy.log]

    first = outcomes(7)
    assert first == outcomes(7)
    assert first != outcomes(8)
    assert {"ok", "503", "500"} == set(first)


def test_proxy_settings_are_validated(fault_proxy: FaultProxy) -> None:
    with pytest.raises(ValueError, match="fail_rate"):
        fault_proxy.fail_rate = 1.5
    with pytest.raises(ValueError, match="fail_modes"):
        fault_proxy.fail_modes = ("timeout",)
    with pytest.raises(ValueError, match="delay_s"):
        fault_proxy.delay_s = -1


def test_proxy_stop_closes_open_connections(s3_server: S3Server) -> None:
    proxy = FaultProxy("127.0.0.1", s3_server.port).start()
    port = proxy.port
    idle = socket.create_connection(("127.0.0.1", port))  # open, never sends a request
    deadline = time.monotonic() + 5
    while proxy.connections == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.connections == 1
    began = time.perf_counter()
    proxy.stop()
    assert time.perf_counter() - began < 2
    idle.settimeout(2)
    assert idle.recv(1) == b""  # the proxy closed its end
    idle.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
