"""Committed checkpoints in an object store: the durable tier.

Layout under the tier's URL prefix::

    step_000000200/MANIFEST.json                     the commit marker, written last
    step_000000200/data-<16 hex>/__0_0.distcp        data objects
    step_000000200/data-<16 hex>/.metadata

The object-store commit protocol (rename is not atomic there):

1. Every data object is uploaded under ``data-<h>/``, where ``<h>`` is the
   xxh3-64 of the exact MANIFEST.json bytes. Each file's bytes are hashed while
   they are sent and must match the manifest, or nothing is committed; on S3
   the store also verifies a SHA-256 of every request body.
2. MANIFEST.json is written last with a create-only put (``If-None-Match: *``).
   Of two writers committing the same step, exactly one succeeds; the other
   gets ``CommitConflictError``. Because each writer's data lives under its own
   manifest's hash, the loser never overwrote the winner's objects.
3. A step without MANIFEST.json does not exist. Objects that no manifest refers
   to (an upload cut short, the loser of a race) are orphans; ``gc`` deletes
   those older than a grace period.

Deletion is the reverse: the manifest first (the step stops existing), then
its data.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import xxhash

from stalwart.errors import CheckpointCorruptError, CommitConflictError, DurableStoreError
from stalwart.layout import parse_step_key, step_dir_name
from stalwart.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    hash_file,
    open_checkpoint_file,
)
from stalwart.storage.local import fsync_file
from stalwart.storage.remote import (
    CHUNK,
    RetryPolicy,
    open_client,
    with_retries,
)

__all__ = ["DurableTier", "RemoteStep", "TransferResult", "data_dir_name"]

RANGE = 32 * 2**20
"""Bytes per ranged GET when downloading; ranges of one file download in parallel."""


def data_dir_name(manifest_bytes: bytes) -> str:
    """Where the data objects of the checkpoint with this exact manifest live."""
    return "data-" + xxhash.xxh3_64_hexdigest(manifest_bytes)


def size_mismatches(
    sizes: Mapping[str, int], data: str, manifest: Manifest
) -> list[tuple[FileEntry, int | None]]:
    """Each file of ``manifest`` whose object ``<data>/<path>`` is missing (None) or has
    another size (that size); ``sizes`` maps object keys to sizes."""
    found = ((entry, sizes.get(f"{data}/{entry.path}")) for entry in manifest.files)
    return [(entry, size) for entry, size in found if size != entry.size]


@dataclasses.dataclass(frozen=True, slots=True)
class TransferResult:
    """What one upload or download moved."""

    step: int
    bytes: int
    seconds: float
    retries: int
    already: bool = False
    """True when the upload found this exact checkpoint committed already."""

    @property
    def mbps(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


@dataclasses.dataclass(slots=True)
class RemoteStep:
    """Everything stored under one ``step_…/`` prefix."""

    step: int
    committed: bool
    objects: list[Any] = dataclasses.field(default_factory=list)
    """``ObjectInfo`` of every object under the prefix (manifest included)."""

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def modified(self) -> float:
        return max((o.modified for o in self.objects), default=0.0)


@dataclasses.dataclass(slots=True)
class OrphanGroup:
    """The objects of one upload attempt that no committed manifest refers to."""

    step: int
    committed: bool
    """True when the step has a committed manifest (and these are not its data)."""
    name: str
    """``step_N/data-<h>/`` for a data directory, else the key of a loose object."""
    objects: list[Any]

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def modified(self) -> float:
        return float(max(o.modified for o in self.objects))


class DurableTier:
    """A durable copy of a run's committed checkpoints under one object-store URL prefix.

    Thread-safe for different steps; the manager uploads from one background
    thread and downloads from the training thread.
    """

    def __init__(
        self,
        url: str,
        *,
        options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        backend: str | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self.client = open_client(url, options=options, retry=self.retry, backend=backend)
        self.url = self.client.url
        self._stop = threading.Event()
        self._transfers: set[threading.Event] = set()  # each running _parallel's stop
        self._transfers_lock = threading.Lock()

    def stop(self) -> None:
        """Make every retry loop give up at its next wait (the manager is closing)."""
        self._stop.set()
        with self._transfers_lock:
            for stop in self._transfers:
                stop.set()

    def __repr__(self) -> str:
        return f"DurableTier({self.url!r})"

    # -------------------------------------------------------------- listing

    def scan(self, *, retry: RetryPolicy | None = None) -> list[RemoteStep]:
        """Every step prefix, committed or not, oldest first (one listing).

        ``retry`` overrides the tier's policy (a short deadline to probe the store).
        """
        steps: dict[int, RemoteStep] = {}
        listing = self._retrying(self.client.list_objects, f"list {self.url}", policy=retry)
        for info in listing:
            parsed = parse_step_key(info.key)
            if parsed is None:
                continue  # not ours: leave it alone
            step, rest = parsed
            entry = steps.setdefault(step, RemoteStep(step=step, committed=False))
            entry.objects.append(info)
            if rest == MANIFEST_NAME:
                entry.committed = True
        return [steps[s] for s in sorted(steps)]

    def committed_steps(self, *, retry: RetryPolicy | None = None) -> list[int]:
        """Steps whose manifest exists, oldest first (not verified)."""
        return [s.step for s in self.scan(retry=retry) if s.committed]

    def manifest_bytes(self, step: int) -> bytes:
        """The exact MANIFEST.json of ``step``; FileNotFoundError when it is not committed."""
        key = f"{step_dir_name(step)}/{MANIFEST_NAME}"
        return self._retrying(  # type: ignore[no-any-return]
            lambda: self.client.get_bytes(key, limit=MAX_MANIFEST_BYTES), f"read {self.url}/{key}"
        )

    def read_manifest(self, step: int) -> Manifest:
        """The validated manifest of committed ``step``; it must record that step.

        Raises ``CheckpointCorruptError`` for a damaged manifest or one that
        another step's (copied or renamed to this prefix), ``UnsupportedFormatError``
        for a newer format, ``FileNotFoundError`` when ``step`` is not committed.
        """
        return self._identified(step, self.manifest_bytes(step))

    def _identified(self, step: int, manifest_bytes: bytes) -> Manifest:
        source = f"{self.url}/{step_dir_name(step)}/{MANIFEST_NAME}"
        manifest = Manifest.from_json(manifest_bytes, source=source)
        if manifest.step != step:
            raise CheckpointCorruptError(
                f"{source}: says step {manifest.step}, but it is stored as step {step}; "
                "a checkpoint copied to another step's prefix is not that step",
                path=source,
            )
        return manifest

    # --------------------------------------------------------------- upload

    def upload(
        self,
        checkpoint: Path,
        *,
        on_retry: Callable[[str, int, float, DurableStoreError], None] | None = None,
    ) -> TransferResult:
        """Copy the committed local checkpoint directory ``checkpoint`` to the tier and commit it.

        Idempotent: a step already committed with this exact manifest returns at
        once (``already=True``). Raises ``CommitConflictError`` when another
        writer committed a different checkpoint of the same step,
        ``CheckpointCorruptError`` when a local file no longer matches its
        manifest (nothing is committed), ``DurableStoreError`` when the store
        keeps failing past the retry deadline or refuses the request.
        """
        t0 = time.perf_counter()
        retried: list[str] = []  # one entry per retry of any request of this upload

        def noted(what: str, attempt: int, delay: float, error: DurableStoreError) -> None:
            retried.append(what)
            if on_retry is not None:
                on_retry(what, attempt, delay, error)

        manifest_bytes = b"".join(_local_chunks(checkpoint, MANIFEST_NAME, MAX_MANIFEST_BYTES))
        manifest = Manifest.from_json(manifest_bytes, source=str(checkpoint / MANIFEST_NAME))
        step = manifest.step
        prefix = step_dir_name(step)
        manifest_key = f"{prefix}/{MANIFEST_NAME}"
        if self._committed_as(step, manifest_bytes, noted):
            return TransferResult(step, 0, time.perf_counter() - t0, 0, already=True)
        data = f"{prefix}/{data_dir_name(manifest_bytes)}"

        def put_file(entry: Any) -> None:
            key = f"{data}/{entry.path}"

            def attempt() -> None:
                h = xxhash.xxh3_128()
                size = 0
                if entry.size <= CHUNK:
                    # One PUT: a streamed body would cost a 3-request multipart upload.
                    blob = b"".join(_local_chunks(checkpoint, entry.path, entry.size))
                    h.update(blob)
                    size = len(blob)
                    self.client.put_bytes(key, blob)
                else:

                    def chunks() -> Iterator[bytes]:
                        nonlocal size
                        for chunk in _local_chunks(checkpoint, entry.path, entry.size):
                            h.update(chunk)
                            size += len(chunk)
                            yield chunk

                    self.client.put_chunks(key, chunks())
                if size != entry.size or h.hexdigest() != entry.xxh3_128:
                    raise CheckpointCorruptError(
                        f"{checkpoint / entry.path}: the local file no longer matches its "
                        f"manifest (size {size}, manifest {entry.size}); not uploading step {step}",
                        path=str(checkpoint / entry.path),
                    )

            self._retrying(attempt, f"upload {key} to {self.url}", on_retry=noted)

        try:
            self._parallel(put_file, manifest.files)
            self._retrying(
                lambda: self._check_data(data, manifest),
                f"check {data} in {self.url}",
                on_retry=noted,
            )
            self._retrying(
                lambda: self.client.put_bytes(manifest_key, manifest_bytes, create_only=True),
                f"commit {manifest_key} to {self.url}",
                on_retry=noted,
            )
        except FileExistsError:
            # Created between our first look and now: ours (a retried request whose
            # first try did succeed) or another writer's.
            if not self._committed_as(step, manifest_bytes, noted):
                raise  # pragma: no cover - _committed_as raised the conflict already
        except CheckpointCorruptError:
            self._forget(data)
            raise
        return TransferResult(
            step,
            manifest.total_bytes + len(manifest_bytes),
            time.perf_counter() - t0,
            len(retried),
        )

    def _check_data(self, data: str, manifest: Manifest) -> None:
        """Every data object is there with its size, just before the manifest makes it visible.

        An upload that ran longer than gc's grace period could have lost objects
        to a gc that took them for an abandoned attempt; committing then would
        publish a checkpoint with holes. Raises a transient error so the upload
        is redone.
        """
        sizes = {o.key: o.size for o in self.client.list_objects(data + "/")}
        for entry, found in size_mismatches(sizes, data, manifest)[:1]:
            raise DurableStoreError(
                f"{self.url}/{data}/{entry.path} is missing or has the wrong size just before "
                f"the commit (found {found}, expected {entry.size}); uploading again",
                transient=True,
            )

    def _committed_as(
        self,
        step: int,
        manifest_bytes: bytes,
        on_retry: Callable[[str, int, float, DurableStoreError], None],
    ) -> bool:
        """True if ``step`` is committed with exactly these manifest bytes; raise if with others."""
        key = f"{step_dir_name(step)}/{MANIFEST_NAME}"
        try:
            existing = self._retrying(
                lambda: self.client.get_bytes(key, limit=MAX_MANIFEST_BYTES),
                f"read {key} from {self.url}",
                on_retry=on_retry,
            )
        except FileNotFoundError:
            return False
        if existing == manifest_bytes:
            return True
        try:
            theirs = Manifest.from_json(existing, source=f"{self.url}/{key}")
            who = f"written on {theirs.hostname or 'an unknown host'} at {theirs.created}"
        except (CheckpointCorruptError, ValueError):
            who = "unreadable"
        raise CommitConflictError(
            f"step {step} is already committed in {self.url} by another writer ({who}); "
            "two runs share this durable prefix. Give each run its own prefix; the "
            "checkpoint already there is untouched"
        )

    def _forget(self, data_prefix: str) -> None:
        """Best-effort removal of data objects that will never be committed (gc catches misses)."""
        try:
            keys = [o.key for o in self.client.list_objects(data_prefix + "/")]
            self.client.delete(keys)
        except (DurableStoreError, FileNotFoundError):
            pass

    # ------------------------------------------------------------- download

    def download(
        self,
        step: int,
        destination: Path,
        *,
        advance: Callable[[int], None] | None = None,
        manifest_bytes: bytes | None = None,
    ) -> bytes:
        """Fetch committed ``step`` into the empty directory ``destination``; return the manifest bytes.

        Ranges of each file download in parallel; every file is fsynced and
        checked against the manifest (size, xxh3-128) before this returns, so a
        damaged or incomplete remote copy raises ``CheckpointCorruptError`` and
        never reaches a reader. MANIFEST.json is not written into
        ``destination``: the caller commits the directory with it. A caller that
        read the manifest already passes its bytes (one request fewer).
        """
        if manifest_bytes is None:
            manifest_bytes = self.manifest_bytes(step)
        source = f"{self.url}/{step_dir_name(step)}"
        manifest = self._identified(step, manifest_bytes)
        data = f"{step_dir_name(step)}/{data_dir_name(manifest_bytes)}"
        jobs: list[tuple[Any, int, int]] = []
        for entry in manifest.files:
            target = destination / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                f.truncate(entry.size)
            jobs += [(entry, s, min(s + RANGE, entry.size)) for s in range(0, entry.size, RANGE)]

        def fetch(job: tuple[Any, int, int]) -> None:
            entry, start, end = job
            key = f"{data}/{entry.path}"
            try:
                blob = self._retrying(
                    lambda: self.client.get_range(key, start, end),
                    f"download {key} from {self.url}",
                )
            except FileNotFoundError as exc:
                raise CheckpointCorruptError(
                    f"{source}: data object {entry.path} is missing", path=f"{source}/{entry.path}"
                ) from exc
            if len(blob) != end - start:
                raise CheckpointCorruptError(
                    f"{source}/{entry.path}: short object ({start + len(blob)} of {entry.size} bytes)",
                    path=f"{source}/{entry.path}",
                )
            fd = os.open(destination / entry.path, os.O_WRONLY)
            try:
                os.pwrite(fd, blob, start)
            finally:
                os.close(fd)
            if advance is not None:
                advance(len(blob))

        self._parallel(fetch, jobs)
        for entry in manifest.files:
            path = destination / entry.path
            fsync_file(path)
            size, digest = hash_file(path)
            if size != entry.size or digest != entry.xxh3_128:
                raise CheckpointCorruptError(
                    f"{source}/{entry.path}: downloaded copy does not match the manifest "
                    f"(xxh3-128 {digest}, manifest says {entry.xxh3_128}); the durable copy is damaged",
                    path=f"{source}/{entry.path}",
                )
        return manifest_bytes

    # ------------------------------------------------------------- deletion

    def delete(self, step: int) -> None:
        """Remove committed ``step``: the manifest first (it stops existing), then its data."""
        prefix = step_dir_name(step)
        self._retrying(
            lambda: self.client.delete([f"{prefix}/{MANIFEST_NAME}"]),
            f"delete {prefix}/{MANIFEST_NAME} from {self.url}",
        )
        try:
            keys = [o.key for o in self.client.list_objects(prefix + "/")]
            self.client.delete(keys)
        except DurableStoreError:
            pass  # the step no longer exists; its data is an orphan for gc

    def orphan_groups(self, steps: list[RemoteStep] | None = None) -> list[OrphanGroup]:
        """Objects no committed manifest refers to, one group per upload attempt.

        A step prefix without a manifest is an upload in progress or cut short;
        beside a committed manifest, every object that manifest does not name is
        a lost race, a failed attempt or a crashed write's temporary file. An
        attempt is a data directory (``step_N/data-<h>/``) or a loose object.
        ``steps`` is a ``scan()`` already made.
        """
        groups: list[OrphanGroup] = []
        for entry in self.scan() if steps is None else steps:
            prefix = step_dir_name(entry.step)
            live = self._live_keys(entry) if entry.committed else set()
            attempts: dict[str, list[Any]] = {}
            for obj in entry.objects:
                if obj.key in live:
                    continue
                head, sep, _rest = obj.key[len(prefix) + 1 :].partition("/")
                attempts.setdefault(f"{prefix}/{head}{sep}", []).append(obj)
            groups += [
                OrphanGroup(entry.step, entry.committed, name, objs)
                for name, objs in sorted(attempts.items())
            ]
        return groups

    def orphans(self, *, older_than: float, now: float | None = None) -> list[Any]:
        """The objects of ``orphan_groups`` whose newest object is more than ``older_than`` s old.

        One attempt's objects go together, judged by its newest: an upload in
        progress whose first objects are old is not partly removed.
        """
        now = time.time() if now is None else now
        return [
            obj
            for group in self.orphan_groups()
            if now - group.modified >= older_than
            for obj in group.objects
        ]

    def _live_keys(self, entry: RemoteStep) -> set[str]:
        """The keys committed ``entry``'s manifest names, the manifest included."""
        prefix = step_dir_name(entry.step)
        manifest_key = f"{prefix}/{MANIFEST_NAME}"
        try:
            manifest_bytes = self.manifest_bytes(entry.step)
        except FileNotFoundError:
            return {manifest_key}  # deleted since the listing: the rest is orphaned
        data = f"{prefix}/{data_dir_name(manifest_bytes)}"
        try:
            files = Manifest.from_json(manifest_bytes, source=manifest_key).files
        except (CheckpointCorruptError, ValueError):
            # Unreadable: keep its whole data directory rather than guess.
            return {manifest_key} | {o.key for o in entry.objects if o.key.startswith(data + "/")}
        return {manifest_key} | {f"{data}/{f.path}" for f in files}

    def remove(self, keys: list[str]) -> None:
        """Delete objects by key (for gc), in batches."""
        for i in range(0, len(keys), 500):
            batch = keys[i : i + 500]
            self._retrying(
                lambda batch=batch: self.client.delete(batch),  # type: ignore[misc]
                f"delete from {self.url}",
            )

    # -------------------------------------------------------------- helpers

    def _retrying(
        self,
        operation: Callable[[], Any],
        what: str,
        *,
        on_retry: Callable[[str, int, float, DurableStoreError], None] | None = None,
        policy: RetryPolicy | None = None,
    ) -> Any:
        def note(attempt: int, delay: float, error: DurableStoreError) -> None:
            if on_retry is not None:
                on_retry(what, attempt, delay, error)

        stop = getattr(_transfer, "stop", None) or self._stop
        return with_retries(
            operation,
            policy or self.retry,
            what=what,
            on_retry=note,
            should_stop=stop.is_set,
            sleep=stop.wait,
        )

    def _parallel(self, fn: Callable[[Any], None], items: list[Any]) -> None:
        """``fn`` over ``items`` on up to 8 threads; the first error (in item order) is raised
        once the running calls end, and the calls not yet started are dropped.

        An error, or one raised into the calling thread (Ctrl-C), makes the running
        calls' retries give up at once: without that, Ctrl-C during a download from a
        store that is down waited for every request's retry deadline (15 minutes by
        default) before it came out.
        """
        if len(items) <= 1:
            for item in items:
                fn(item)
            return
        stop = threading.Event()
        with self._transfers_lock:
            self._transfers.add(stop)
        if self._stop.is_set():
            stop.set()

        def run(item: Any) -> None:
            _transfer.stop = stop
            try:
                fn(item)
            finally:
                _transfer.stop = None

        try:
            with concurrent.futures.ThreadPoolExecutor(
                max_workers=min(8, len(items)), thread_name_prefix="stalwart-transfer"
            ) as pool:
                try:
                    for _ in pool.map(run, items):
                        pass
                except BaseException:
                    stop.set()
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        finally:
            with self._transfers_lock:
                self._transfers.discard(stop)


_transfer = threading.local()
"""``stop``: the stop event of the ``_parallel`` transfer this thread works for."""


def _local_chunks(checkpoint: Path, relative: str, expected: int) -> Iterator[bytes]:
    """A local checkpoint file, ``CHUNK`` at a time, at most one byte past ``expected``.

    Read without following links and only from a regular file (a link to
    ``/dev/zero`` would otherwise upload forever); one byte too many is enough
    for the caller's size check to fail. A link or an unreadable file is a
    ``CheckpointCorruptError`` naming it.
    """
    where = checkpoint / relative
    try:
        with open_checkpoint_file(checkpoint, relative) as f:
            left = expected + 1
            while left > 0 and (data := f.read(min(CHUNK, left))):
                left -= len(data)
                yield data
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{where}: cannot read ({exc.strerror or exc}); not uploading it", path=str(where)
        ) from exc
