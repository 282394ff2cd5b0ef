"""Object stores (S3, GCS, Azure, any fsspec filesystem) as a few whole-object operations.

Two clients implement the same small surface (``ObjectClient``):

- ``ObstoreClient`` for ``s3://``, ``gs://`` and ``az://`` (also ``abfs://``,
  ``azure://``): obstore, the Python binding of Rust's ``object_store``. It
  releases the GIL for network I/O, uploads large objects in parallel
  multipart, retries each request itself, sends integrity checksums on S3 and
  supports create-only puts (``If-None-Match: *``), which is what makes the
  manifest a safe commit marker.
- ``FsspecClient`` for every other fsspec URL (``file://``, ``memory://``,
  ``hf://``, ...). Create-only writes use an exclusive create where the
  filesystem has one (``O_EXCL``/``link`` on local paths, mode ``"xb"``
  elsewhere).

Credentials come from each cloud's usual environment variables and config files
(``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``AZURE_STORAGE_ACCOUNT_KEY``, ...) or from ``options``. No message this module
produces contains them: every error text passes through ``stalwart.redact.redact_text`` (the
one redaction of the library and the CLI: user parts of URLs, with or without a
scheme, and secret query parameters) with the secret values the client knows of.

Every operation raises ``DurableStoreError`` (``transient`` says whether a retry
may help), ``FileNotFoundError`` for a missing object, or ``FileExistsError``
for a create-only put onto an existing key; ``with_retries`` repeats transient
failures with exponential backoff and full jitter until a deadline.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import os
import random
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

from stalwart.errors import DurableStoreError
from stalwart.redact import known_secrets, redact_text, redact_url
from stalwart.storage.local import fsync_dir

__all__ = [
    "FsspecClient",
    "ObjectClient",
    "ObjectInfo",
    "ObstoreClient",
    "RetryPolicy",
    "open_client",
    "with_retries",
]

T = TypeVar("T")

CHUNK = 8 * 2**20
"""Bytes read from a local file per upload chunk (and per multipart part)."""

OBSTORE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure"})

_STATUS = re.compile(r"status code: (\d{3})")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How hard to try one object operation before giving up on it for now.

    Each request has ``request_timeout`` seconds (``connect_timeout`` to
    connect); the client library retries single requests a few times itself.
    Around that, a failed whole-object operation is repeated after
    ``initial_backoff * 2**n`` seconds (capped at ``max_backoff``, full jitter)
    until ``deadline`` seconds have passed since its first try.
    """

    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    deadline: float = 900.0
    request_timeout: float = 120.0
    connect_timeout: float = 10.0
    request_retries: int = 3

    def __post_init__(self) -> None:
        for name in ("initial_backoff", "max_backoff", "deadline", "request_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"RetryPolicy.{name} must be a positive number, got {value!r}")

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Full-jitter exponential backoff before retry number ``attempt`` (0-based)."""
        cap = min(self.max_backoff, self.initial_backoff * 2.0**attempt)
        return rng.uniform(0.0, cap)


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object under the client's prefix."""

    key: str
    """Key relative to the client's prefix, with ``/`` separators."""
    size: int
    modified: float
    """Last modification, seconds since the epoch."""


class ObjectClient(Protocol):
    """Whole-object operations on keys relative to one URL prefix."""

    url: str
    """The prefix URL, without any credentials (for messages)."""

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> None: ...

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> None: ...

    def get_bytes(self, key: str, *, limit: int | None = None) -> bytes: ...

    def get_range(self, key: str, start: int, end: int) -> bytes | memoryview: ...

    def list_objects(self, prefix: str = "") -> list[ObjectInfo]: ...

    def delete(self, keys: list[str]) -> None: ...

    def redact(self, text: str) -> str: ...


_BUGS = (TypeError, ValueError, AttributeError, NameError, AssertionError)
"""Exceptions that are mistakes in code or arguments, not store failures: raised as they are,
never classified or retried (obstore raises ValueError for a body it cannot send)."""


def _join(prefix: str, key: str) -> str:
    return f"{prefix.rstrip('/')}/{key.lstrip('/')}" if prefix else key.lstrip("/")


def _short(exc: BaseException) -> str:
    """The first line of an error message, without a trailing XML body.

    Client libraries append multi-line debug dumps and the start of the store's
    XML error document; the S3 error code is kept.
    """
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    head, sep, _xml = line.partition("<?xml")
    if sep:
        code = re.search(r"<Code>([^<]+)</Code>", str(exc))
        line = head.rstrip(": ") + (f" ({code.group(1)})" if code else "")
    return line


def with_retries(
    operation: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    on_retry: Callable[[int, float, DurableStoreError], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """Run ``operation``, repeating it after transient ``DurableStoreError``s until the deadline.

    ``on_retry(attempt, delay, error)`` is told of each retry. Permanent errors,
    ``FileNotFoundError`` and ``FileExistsError`` pass through at once; after the
    deadline the last transient error is raised. ``should_stop()`` returning
    True ends the waiting early (the manager is closing); ``sleep`` waits between
    tries (an ``Event.wait`` makes the wait itself interruptible).
    """
    rng = random.Random()
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return operation()
        except DurableStoreError as exc:
            if not exc.transient:
                raise
            elapsed = time.monotonic() - start
            delay = policy.backoff(attempt, rng)
            if elapsed + delay > policy.deadline or (should_stop is not None and should_stop()):
                raise DurableStoreError(
                    f"{what}: still failing after {attempt + 1} attempts over {elapsed:.0f} s: {exc}",
                    transient=True,
                ) from exc
            if on_retry is not None:
                on_retry(attempt, delay, exc)
            sleep(delay)
            attempt += 1


# ------------------------------------------------------------------- obstore


class ObstoreClient:
    """``s3://``, ``gs://`` and ``az://`` through obstore (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        try:
            import obstore
            from obstore.store import from_url
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"durable={redact_url(url)!r} needs obstore: pip install 'stalwart[durable]'"
            ) from exc
        self._obstore = obstore
        open_store: Any = from_url
        self.url = redact_url(url).rstrip("/")
        options = dict(options or {})
        retry = retry or RetryPolicy()
        self._secrets = known_secrets(url, options)
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if parts.username is not None or parts.password is not None:
            # obstore would drop them silently and use the environment's instead.
            if scheme not in ("s3", "s3a"):
                raise ValueError(
                    f"{self.url}: credentials in a {scheme}:// URL are not supported; pass "
                    "them in DurableConfig.options or the environment"
                )
            options.setdefault("access_key_id", unquote(parts.username or ""))
            options.setdefault("secret_access_key", unquote(parts.password or ""))
            url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        client_options = {
            "timeout": f"{retry.request_timeout:g}s",
            "connect_timeout": f"{retry.connect_timeout:g}s",
            **dict(options.pop("client_options", None) or {}),
        }
        endpoint = options.get("endpoint") or options.get("aws_endpoint") or ""
        if not endpoint and scheme in ("s3", "s3a"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or ""
        # Passing client options makes obstore ignore AWS_ALLOW_HTTP: carry it over.
        allow_env = os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes")
        if str(endpoint).startswith("http://") or allow_env:
            client_options.setdefault("allow_http", True)
        if scheme in ("s3", "s3a"):
            # The store verifies a SHA-256 of every request body and refuses a
            # mismatch (BadDigest): bytes damaged in transit are never stored.
            options.setdefault("checksum_algorithm", "sha256")
        retry_config = {
            "max_retries": retry.request_retries,
            "retry_timeout": datetime.timedelta(seconds=retry.request_timeout),
            "backoff": {
                "init_backoff": datetime.timedelta(seconds=min(0.1, retry.initial_backoff)),
                "max_backoff": datetime.timedelta(seconds=retry.max_backoff),
                "base": 2.0,
            },
        }
        try:
            self._store = open_store(
                url if scheme != "s3a" else "s3" + url[3:],
                config=options or None,
                client_options=client_options,
                retry_config=retry_config,
            )
        except Exception as exc:
            raise DurableStoreError(
                f"cannot open {self.url}: {self.redact(_short(exc))}; check the URL and the "
                "store options",
                transient=False,
            ) from None

    def redact(self, text: str) -> str:
        return redact_text(text, self._secrets)

    def _error(self, exc: Exception, what: str) -> Exception:
        from obstore import exceptions as oe

        message = f"{what} {self.url}: {self.redact(_short(exc))}"
        if isinstance(exc, oe.AlreadyExistsError | oe.PreconditionError):
            return FileExistsError(message)
        if isinstance(exc, FileNotFoundError | oe.NotFoundError):
            return FileNotFoundError(message)
        permanent = (
            oe.PermissionDeniedError,
            oe.UnauthenticatedError,
            oe.InvalidPathError,
            oe.NotSupportedError,
            oe.UnknownConfigurationKeyError,
        )
        if isinstance(exc, permanent):
            return DurableStoreError(message, transient=False)
        low = message.lower()
        if "baddigest" in low:
            # The bytes changed in transit: re-reading and re-sending fixes it.
            return DurableStoreError(message, transient=True)
        status = _STATUS.search(str(exc))
        if status is not None:
            code = int(status.group(1))
            # 4xx (a missing bucket, denied access, a bad signature) does not pass by
            # retrying; 408 (timeout) and 429 (slow down) do, like every 5xx.
            return DurableStoreError(message, transient=code >= 500 or code in (408, 429))
        return DurableStoreError(message, transient=True)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except _BUGS:
            raise  # a mistake in the calling code: retrying it for minutes would only hide it
        except Exception as exc:
            raise self._error(exc, what) from None

    def _put(self, what: str, fn: Callable[[], object]) -> None:
        try:
            self._call(what, fn)
        except FileNotFoundError as exc:
            # A put is never legitimately "not found": a multipart upload whose
            # completion was retried after a lost response (NoSuchUpload). Try again.
            raise DurableStoreError(str(exc), transient=True) from None

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        mode = "create" if create_only else "overwrite"
        self._put(f"put {key} to", lambda: self._obstore.put(self._store, key, data, mode=mode))

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> None:
        self._put(
            f"upload {key} to",
            lambda: self._obstore.put(
                self._store, key, iter(chunks), chunk_size=CHUNK, max_concurrency=8
            ),
        )

    def get_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        """The object's bytes; with ``limit``, at most ``limit + 1`` of them (a caller
        that gets more than ``limit`` knows the object is too large)."""

        def run() -> bytes:
            result = self._obstore.get(self._store, key)
            size = int(result.meta["size"])
            if limit is None or size <= limit:
                return bytes(result.bytes())
            return bytes(self._obstore.get_range(self._store, key, start=0, end=limit + 1))

        return self._call(f"get {key} from", run)

    def get_range(self, key: str, start: int, end: int) -> bytes | memoryview:
        # obstore's buffer, not a copy of it: the caller writes it straight to disk.
        return self._call(
            f"get {key} [{start}:{end}] from",
            lambda: memoryview(self._obstore.get_range(self._store, key, start=start, end=end)),
        )

    def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        def run() -> list[ObjectInfo]:
            out = []
            for batch in self._obstore.list(self._store, prefix or None):
                for meta in batch:
                    out.append(
                        ObjectInfo(
                            key=str(meta["path"]),
                            size=int(meta["size"]),
                            modified=meta["last_modified"].timestamp(),
                        )
                    )
            return out

        return self._call("list", run)

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._call("delete from", lambda: self._obstore.delete(self._store, keys))


# -------------------------------------------------------------------- fsspec


class FsspecClient:
    """Any other fsspec URL (see the module docstring)."""

    def __init__(self, url: str, *, options: Mapping[str, Any] | None = None) -> None:
        try:
            import fsspec
            from fsspec.implementations.local import LocalFileSystem
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"durable={redact_url(url)!r} needs fsspec: pip install 'stalwart[durable]'"
            ) from exc
        self.url = redact_url(url).rstrip("/")
        options = dict(options or {})
        self._secrets = known_secrets(url, options)
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as exc:
            raise DurableStoreError(
                f"cannot open {self.url}: {self.redact(_short(exc))}", transient=False
            ) from None
        self._fs = fs
        self._root = str(root).rstrip("/")
        self._local = isinstance(fs, LocalFileSystem)
        self._mkdir_lock = threading.Lock()

    def redact(self, text: str) -> str:
        return redact_text(text, self._secrets)

    def _path(self, key: str) -> str:
        return _join(self._root, key)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{what} {self.url}: {self.redact(_short(exc))}") from None
        except FileExistsError as exc:
            raise FileExistsError(f"{what} {self.url}: {self.redact(_short(exc))}") from None
        except PermissionError as exc:
            raise DurableStoreError(
                f"{what} {self.url}: {self.redact(_short(exc))}", transient=False
            ) from None
        except _BUGS:
            raise
        except Exception as exc:
            raise DurableStoreError(
                f"{what} {self.url}: {self.redact(_short(exc))}", transient=True
            ) from None

    def _mkdirs(self, path: str) -> None:
        parent = path.rsplit("/", 1)[0]
        if parent:
            # One thread at a time: the parallel uploads of one step would otherwise
            # race to create the same parents, and which mkdir(2) calls happen would
            # depend on timing.
            with self._mkdir_lock:
                self._fs.makedirs(parent, exist_ok=True)

    def _write_local(self, path: str, chunks: Iterable[bytes], *, create_only: bool) -> None:
        # Write a private file, fsync it, then publish it with link(2) (create-only,
        # atomic) or rename(2): a reader never sees a partial object.
        self._mkdirs(path)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if create_only:
                os.link(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        fsync_dir(Path(os.path.dirname(path) or "."))

    def _write(self, path: str, chunks: Iterable[bytes], *, create_only: bool) -> None:
        if self._local:
            self._write_local(path, chunks, create_only=create_only)
            return
        self._mkdirs(path)
        if create_only and self._fs.exists(path):
            raise FileExistsError(f"{path} exists")
        with self._fs.open(path, "xb" if create_only else "wb") as f:
            for chunk in chunks:
                f.write(chunk)

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        path = self._path(key)
        self._call(f"put {key} to", lambda: self._write(path, [data], create_only=create_only))

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> None:
        path = self._path(key)
        self._call(f"upload {key} to", lambda: self._write(path, chunks, create_only=False))

    def get_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        """The object's bytes; with ``limit``, at most ``limit + 1`` of them.

        Read through an open file rather than the listed size: on a local or
        mounted filesystem the object may be a link to ``/dev/zero`` or a FIFO.
        """

        def run() -> bytes:
            if self._local:
                return _read_local_object(self._path(key), limit)
            with self._fs.open(self._path(key), "rb") as f:
                return bytes(f.read() if limit is None else f.read(limit + 1))

        return self._call(f"get {key} from", run)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._call(
            f"get {key} [{start}:{end}] from",
            lambda: bytes(self._fs.cat_file(self._path(key), start=start, end=end)),
        )

    def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        base = self._path(prefix) if prefix else self._root

        def run() -> list[ObjectInfo]:
            try:
                found = self._fs.find(base, detail=True)
            except FileNotFoundError:
                return []
            out = []
            root = self._fs._strip_protocol(self._root).rstrip("/")
            for name, info in found.items():
                if info.get("type") not in (None, "file"):
                    continue
                rel = str(name)[len(root) :].lstrip("/") if root else str(name)
                out.append(
                    ObjectInfo(key=rel, size=int(info.get("size", 0)), modified=_mtime(info))
                )
            return out

        return self._call("list", run)

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._call("delete from", lambda: self._fs.rm([self._path(k) for k in keys]))


def _mtime(info: Mapping[str, Any]) -> float:
    for field in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return time.time()


def _read_local_object(path: str, limit: int | None) -> bytes:
    """A local store's object, read without following a link and only if it is a
    regular file: a link to ``/dev/zero`` or a FIFO in the store never hangs the
    reader. Anything else is a ``PermissionError`` (refused, not retried)."""
    refused = "not a regular file; stalwart never reads links, FIFOs or devices in a store"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise PermissionError(errno.EPERM, refused, path) from None
        raise
    with os.fdopen(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PermissionError(errno.EPERM, refused, path)
        os.set_blocking(fd, True)
        return f.read() if limit is None else f.read(limit + 1)


def is_url(value: object) -> bool:
    """Whether ``value`` names an object-store or fsspec location (``s3://…``) rather than a path."""
    return isinstance(value, str) and "://" in value


def open_client(
    url: str,
    *,
    options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    backend: str | None = None,
) -> ObjectClient:
    """The client for ``url``: obstore for s3/gs/az, fsspec for everything else.

    ``backend="fsspec"`` forces fsspec (for example s3fs for ``s3://``), and
    ``backend="obstore"`` forces obstore.
    """
    if not is_url(url):
        raise ValueError(
            f"durable must be a URL such as 's3://bucket/prefix', 'gs://bucket/prefix' or "
            f"'file:///mnt/backup/run1', got {url!r}"
        )
    scheme = urlsplit(url).scheme.lower()
    if backend not in (None, "obstore", "fsspec"):
        raise ValueError(f"backend must be 'obstore', 'fsspec' or None, got {backend!r}")
    if backend == "obstore" or (backend is None and scheme in OBSTORE_SCHEMES):
        return ObstoreClient(url, options=options, retry=retry)
    return FsspecClient(url, options=options)


def read_chunks(path: Path, *, chunk: int = CHUNK) -> Iterator[bytes]:
    """The bytes of a local file, ``chunk`` at a time."""
    with open(path, "rb") as f:
        while data := f.read(chunk):
            yield data
