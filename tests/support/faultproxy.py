"""A fault-injecting HTTP/1.1 proxy that sits between an S3 client and a real server.

Checkpoint storage code has to survive what object stores really do: throttling (503
SlowDown), internal errors (500), connections dropped while a request is being sent, and
connections dropped after the server has acted on a request but before the client heard
the answer. A real server never does these on demand, and a mock cannot show how a real
client library reacts, so tests put :class:`FaultProxy` in front of a real server and let
the client talk to the proxy instead.

The proxy understands HTTP/1.1 framing (request and response heads, ``Content-Length``
and chunked bodies, keep-alive connections carrying many requests, ``Expect:
100-continue``, bodiless HEAD/1xx/204/304 responses), so it decides per request, not per
connection. It relays bytes unchanged; in particular the ``Host`` header is left as the
client wrote it, because S3 SigV4 signatures cover it. Each client connection gets its
own upstream connection and its own thread.

Settings (``fail_rate``, ``fail_modes``, ``delay_s``, ``down``) can be changed from the
test thread at any time; they apply from the next request. Fault decisions come from a
seeded :class:`random.Random`, so the same sequence of requests meets the same faults.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

__all__ = ["FAIL_MODES", "FaultProxy"]

FAIL_MODES: tuple[str, ...] = ("503", "500", "reset_request", "reset_response")
"""Ways a request can be made to fail.

* ``"503"``: read the whole request, answer ``503 Service Unavailable`` with an S3
  ``SlowDown`` error body and ``Connection: close``; nothing is forwarded.
* ``"500"``: the same with ``500 Internal Server Error`` / ``InternalError``.
* ``"reset_request"``: read part of the request, then reset the client connection
  (RST via ``SO_LINGER`` 0); nothing is forwarded.
* ``"reset_response"``: forward the request (the server acts on it), relay the response
  head and part of the body, then reset: the client cannot tell whether it happened.
"""

_ERROR_BODIES = {
    "503": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "500": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error. Please try again.",
    ),
}
_MAX_HEAD = 64 * 1024
_CHUNK = 64 * 1024


class _PeerClosedError(Exception):
    """The peer closed the connection (cleanly or not) where more bytes were expected."""


class _ResetNowError(Exception):
    """This connection is to be reset now (a fault or an outage)."""


class _Reader:
    """Buffered reads from a socket: whole heads, exact byte counts, lines."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(_CHUNK)
        except OSError:
            data = b""
        if not data:
            return False
        self.buf += data
        return True

    def read_head(self) -> bytes | None:
        """The next message head (through the blank line); None on EOF before any byte."""
        while True:
            while self.buf.startswith(b"\r\n"):  # stray CRLFs between messages are allowed
                del self.buf[:2]
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self.buf[: end + 4])
                del self.buf[: end + 4]
                return head
            if len(self.buf) > _MAX_HEAD:
                raise _PeerClosedError("message head too large")
            if not self._fill():
                if self.buf:
                    raise _PeerClosedError("connection closed inside a message head")
                return None

    def read_line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[: end + 2])
                del self.buf[: end + 2]
                return line
            if len(self.buf) > _MAX_HEAD or not self._fill():
                raise _PeerClosedError("connection closed inside a chunk header")

    def read_some(self, limit: int) -> bytes:
        """Up to ``limit`` bytes (at least one); raises _PeerClosedError at EOF."""
        if not self.buf and not self._fill():
            raise _PeerClosedError("connection closed inside a body")
        data = bytes(self.buf[:limit])
        del self.buf[:limit]
        return data

    def read_until_eof(self) -> bytes:
        """Whatever is available next; b"" at EOF (for bodies delimited by close)."""
        if not self.buf and not self._fill():
            return b""
        data = bytes(self.buf)
        self.buf.clear()
        return data


@dataclass
class _Head:
    raw: bytes
    start_line: str
    headers: list[tuple[str, str]]

    @classmethod
    def parse(cls, raw: bytes) -> _Head:
        lines = raw[:-4].decode("latin-1").split("\r\n")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise _PeerClosedError(f"malformed header line {line!r}")
            headers.append((name.strip().lower(), value.strip()))
        return cls(raw, lines[0], headers)

    def get(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def tokens(self, name: str) -> set[str]:
        values = [v for k, v in self.headers if k == name]
        return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}

    def framing(self) -> tuple[str, int]:
        """("chunked", 0), ("length", n) or ("none", 0) for a request-style body."""
        if "chunked" in self.tokens("transfer-encoding"):
            return "chunked", 0
        length = self.get("content-length")
        if length is not None:
            return "length", int(length)
        return "none", 0


class _Body:
    """Relays one message body between two sockets, byte for byte, with an optional cap."""

    def __init__(self, reader: _Reader, kind: str, length: int = 0) -> None:
        self.reader = reader
        self.kind = kind
        self.remaining = length
        self.done = kind == "none" or (kind == "length" and length == 0)
        self._chunk_left = 0
        self._state = "size"  # chunked: size -> data -> crlf -> size ... -> trailers

    def pieces(self) -> Iterable[bytes]:
        """Raw body bytes in pieces, as they arrive, until the body ends."""
        if self.kind == "length":
            while self.remaining > 0:
                data = self.reader.read_some(min(self.remaining, _CHUNK))
                self.remaining -= len(data)
                yield data
        elif self.kind == "chunked":
            yield from self._chunked()
        elif self.kind == "close":
            while True:
                data = self.reader.read_until_eof()
                if not data:
                    break
                yield data
        self.done = True

    def _chunked(self) -> Iterable[bytes]:
        while True:
            line = self.reader.read_line()
            yield line
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the final blank line
                    trailer = self.reader.read_line()
                    yield trailer
                    if trailer == b"\r\n":
                        return
            left = size + 2  # data and its CRLF
            while left > 0:
                data = self.reader.read_some(min(left, _CHUNK))
                left -= len(data)
                yield data


def _reset(sock: socket.socket) -> None:
    """Abort a connection with a TCP RST, as a crashed server or load balancer would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def _close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """Relay HTTP/1.1 from 127.0.0.1:<free port> to ``target_host:target_port``, injecting faults.

    Counters, readable from any thread:

    * ``connections``: client connections accepted (fewer than ``requests`` when clients
      reuse keep-alive connections).
    * ``requests``: request heads read, faulted ones included.
    * ``failures``: a Counter by fail mode, plus ``"down"`` (connections and requests
      refused during an outage) and ``"relay_error"`` (a forwarded exchange that broke
      off because a peer closed or the server was unreachable; not injected).
    * ``log``: ``(method, path, outcome)`` per request, where outcome is ``"ok"``, a fail
      mode, ``"down"`` or ``"relay_error"``; connections reset on arrival during an outage
      appear as ``("-", "-", "down")``.
    """

    def __init__(self, target_host: str, target_port: int, *, seed: int = 0) -> None:
        self.target = (target_host, target_port)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._fail_rate = 0.0
        self._fail_modes: tuple[str, ...] = FAIL_MODES
        self._delay_s = 0.0
        self._down = False
        self._connections = 0
        self._requests = 0
        self._failures: Counter[str] = Counter()
        self._log: list[tuple[str, str, str]] = []
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._threads: set[threading.Thread] = set()
        self._sockets: set[socket.socket] = set()
        self.port = 0

    # -- settings (thread-safe) ---------------------------------------------------------

    @property
    def fail_rate(self) -> float:
        with self._lock:
            return self._fail_rate

    @fail_rate.setter
    def fail_rate(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"fail_rate must be within [0, 1], got {value}")
        with self._lock:
            self._fail_rate = float(value)

    @property
    def fail_modes(self) -> tuple[str, ...]:
        with self._lock:
            return self._fail_modes

    @fail_modes.setter
    def fail_modes(self, value: Iterable[str]) -> None:
        modes = tuple(value)
        unknown = [m for m in modes if m not in FAIL_MODES]
        if unknown or not modes:
            raise ValueError(
                f"fail_modes must be a non-empty selection of {FAIL_MODES}, got {modes}"
            )
        with self._lock:
            self._fail_modes = modes

    @property
    def delay_s(self) -> float:
        with self._lock:
            return self._delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"delay_s must be >= 0, got {value}")
        with self._lock:
            self._delay_s = float(value)

    @property
    def down(self) -> bool:
        with self._lock:
            return self._down

    @down.setter
    def down(self, value: bool) -> None:
        with self._lock:
            self._down = bool(value)

    # -- counters -----------------------------------------------------------------------

    @property
    def connections(self) -> int:
        with self._lock:
            return self._connections

    @property
    def requests(self) -> int:
        with self._lock:
            return self._requests

    @property
    def failures(self) -> Counter[str]:
        """A copy of the failure counts by mode."""
        with self._lock:
            return Counter(self._failures)

    @property
    def log(self) -> list[tuple[str, str, str]]:
        """A copy of the per-request log: (method, path, outcome)."""
        with self._lock:
            return list(self._log)

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self._listener is None:
            raise RuntimeError("FaultProxy is not started; call start() or use it as a context")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        if self._listener is not None:
            raise RuntimeError("FaultProxy.start() called on a proxy that is already started")
        self._stopping.clear()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.settimeout(0.1)  # lets the accept loop notice stop()
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"faultproxy-{self.port}-accept", daemon=True
        )
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        """Close every socket and join every thread. Safe to call more than once."""
        if self._listener is None:
            return
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        _close(self._listener)
        self._listener = None
        with self._lock:
            sockets = list(self._sockets)
            threads = list(self._threads)
        for sock in sockets:
            _close(sock)
        for thread in threads:
            thread.join(timeout=5)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"FaultProxy threads did not stop: {alive}")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"FaultProxy(127.0.0.1:{self.port} -> {self.target[0]}:{self.target[1]}, "
            f"fail_rate={self.fail_rate}, modes={self.fail_modes}, delay_s={self.delay_s}, "
            f"down={self.down})"
        )

    # -- internals ----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        listener = self._listener
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._lock:
                self._connections += 1
                down = self._down
                if down:
                    self._failures["down"] += 1
                    self._log.append(("-", "-", "down"))
            if down:
                _reset(client)
                continue
            thread = threading.Thread(
                target=self._serve, args=(client,), name=f"faultproxy-{self.port}-conn"
            )
            thread.daemon = True
            with self._lock:
                self._sockets.add(client)
                self._threads.add(thread)
            thread.start()

    def _track(self, sock: socket.socket | None, add: bool) -> None:
        if sock is None:
            return
        with self._lock:
            if add:
                self._sockets.add(sock)
            else:
                self._sockets.discard(sock)

    def _decide(self, method: str, path: str) -> tuple[str, int]:
        """Pick this request's fate; return it and the request's index in the log."""
        with self._lock:
            self._requests += 1
            roll = self._rng.random()
            if self._down:
                outcome = "down"
            elif roll < self._fail_rate:
                outcome = self._rng.choice(self._fail_modes)
            else:
                outcome = "ok"
            if outcome != "ok":
                self._failures[outcome] += 1
            self._log.append((method, path, outcome))
            return outcome, len(self._log) - 1

    def _note_relay_error(self, index: int) -> None:
        """Record that relaying request ``index`` broke off (not an injected fault)."""
        with self._lock:
            if index < len(self._log):
                method, path, _ = self._log[index]
                self._log[index] = (method, path, "relay_error")
            self._failures["relay_error"] += 1

    def _connect_upstream(self) -> socket.socket:
        sock = socket.create_connection(self.target, timeout=10)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._track(sock, True)
        if self._stopping.is_set():  # stop() may have closed the tracked sockets already
            self._track(sock, False)
            _close(sock)
            raise OSError("FaultProxy is stopping")
        return sock

    @staticmethod
    def _upstream_usable(sock: socket.socket) -> bool:
        """False when the server closed an idle keep-alive connection."""
        try:
            sock.setblocking(False)
            try:
                data = sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return True
            return bool(data)
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                sock.setblocking(True)

    def _serve(self, client: socket.socket) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = _Reader(client)
        upstream: socket.socket | None = None
        up_reader: _Reader | None = None
        reset = False
        try:
            while not self._stopping.is_set():
                raw = reader.read_head()
                if raw is None:
                    return
                head = _Head.parse(raw)
                method, _, rest = head.start_line.partition(" ")
                path = rest.rpartition(" ")[0] or rest
                outcome, index = self._decide(method, path)
                if outcome == "down" or outcome == "reset_request":
                    if outcome == "reset_request":
                        self._read_part_of_body(reader, head)
                    reset = True
                    return
                if outcome in _ERROR_BODIES:
                    self._answer_error(client, reader, head, outcome)
                    return
                if upstream is not None and not self._upstream_usable(upstream):
                    self._track(upstream, False)
                    _close(upstream)
                    upstream = None
                if upstream is None:
                    try:
                        upstream = self._connect_upstream()
                    except OSError:
                        self._note_relay_error(index)
                        self._send_simple(client, 502, "Bad Gateway", "upstream unreachable")
                        return
                    up_reader = _Reader(upstream)
                assert up_reader is not None
                try:
                    keep_alive = self._forward(
                        client, reader, upstream, up_reader, head, method, outcome
                    )
                except _ResetNowError:
                    reset = True
                    return
                except (_PeerClosedError, OSError):
                    self._note_relay_error(index)
                    reset = True
                    return
                if not keep_alive:
                    return
        except (_PeerClosedError, OSError, ValueError):
            return
        finally:
            self._track(upstream, False)
            _close(upstream)
            self._track(client, False)
            if reset:
                _reset(client)
            else:
                _close(client)
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _read_part_of_body(self, reader: _Reader, head: _Head) -> None:
        """Consume about half of the request body (none if it has none or awaits 100)."""
        if "100-continue" in head.tokens("expect"):
            return
        kind, length = head.framing()
        if kind == "none" or (kind == "length" and length == 0):
            return
        goal = length // 2 if kind == "length" else _CHUNK
        body = _Body(reader, kind, length)
        taken = 0
        for piece in body.pieces():
            taken += len(piece)
            if taken >= goal:
                return

    def _answer_error(self, client: socket.socket, reader: _Reader, head: _Head, mode: str) -> None:
        # With Expect: 100-continue the client has not sent its body and waits for a verdict;
        # a final status now is the correct answer. Otherwise drain the body first so the
        # client sees an orderly reply rather than a write error.
        if "100-continue" not in head.tokens("expect"):
            kind, length = head.framing()
            for _ in _Body(reader, kind, length).pieces():
                pass
        status, reason, code, message = _ERROR_BODIES[mode]
        method, _, rest = head.start_line.partition(" ")
        resource = rest.rpartition(" ")[0] or rest
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{resource}</Resource><RequestId>faultproxy</RequestId></Error>"
        ).encode()
        self._send_simple(
            client,
            status,
            reason,
            body,
            content_type="application/xml",
            head_only=method == "HEAD",
        )

    @staticmethod
    def _send_simple(
        client: socket.socket,
        status: int,
        reason: str,
        body: bytes | str,
        *,
        content_type: str = "text/plain",
        head_only: bool = False,
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        head = (
            f"HTTP/1.1 {status} {reason}\r\n"
            f"Content-Type: {content_type}\r\n"
            f"Content-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(OSError):
            client.sendall(head if head_only else head + data)

    def _forward(
        self,
        client: socket.socket,
        reader: _Reader,
        upstream: socket.socket,
        up_reader: _Reader,
        head: _Head,
        method: str,
        outcome: str,
    ) -> bool:
        """Relay one request and its response; return whether both sides keep the connection."""
        upstream.sendall(head.raw)
        kind, length = head.framing()
        expects_continue = "100-continue" in head.tokens("expect") and kind != "none"
        body_sent = not expects_continue
        if body_sent:
            for piece in _Body(reader, kind, length).pieces():
                upstream.sendall(piece)

        while True:
            raw = up_reader.read_head()
            if raw is None:
                raise _PeerClosedError("server closed the connection before answering")
            response = _Head.parse(raw)
            status = int(response.start_line.split(" ", 2)[1])
            if 100 <= status < 200 and status != 101:
                client.sendall(response.raw)
                if status == 100 and not body_sent:
                    body_sent = True
                    for piece in _Body(reader, kind, length).pieces():
                        upstream.sendall(piece)
                continue
            break

        delay = self.delay_s
        if delay > 0 and self._stopping.wait(delay):
            raise _ResetNowError()

        if method == "HEAD" or status in (204, 304):
            res_kind, res_length = "none", 0
        elif "chunked" in response.tokens("transfer-encoding"):
            res_kind, res_length = "chunked", 0
        elif response.get("content-length") is not None:
            res_kind, res_length = "length", int(response.get("content-length") or 0)
        else:
            res_kind, res_length = "close", 0
        body = _Body(up_reader, res_kind, res_length)

        if outcome == "reset_response":
            if body.done:
                # No body to cut short: cut the head instead, so the client cannot
                # mistake the reply for a complete one.
                client.sendall(response.raw[: len(response.raw) // 2])
            else:
                client.sendall(response.raw)
                goal = max(1, res_length // 2) if res_kind == "length" else 1
                sent = 0
                for piece in body.pieces():
                    take = piece[: goal - sent]
                    client.sendall(take)
                    sent += len(take)
                    if sent >= goal:
                        break
            raise _ResetNowError()

        client.sendall(response.raw)
        for piece in body.pieces():
            client.sendall(piece)

        if not body_sent:
            return False  # the server answered without reading the body: framing is lost
        closing = "close" in head.tokens("connection") or "close" in response.tokens("connection")
        http10 = head.start_line.endswith("HTTP/1.0") or response.start_line.startswith("HTTP/1.0")
        return not (closing or http10 or res_kind == "close")
