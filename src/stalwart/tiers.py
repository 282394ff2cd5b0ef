"""The durable tier beside the primary one: its settings, and keeping the two in step.

``DurableConfig`` is every setting of the durable tier in one object
(``CheckpointManager(..., durable=DurableConfig(url=..., ...))``, or just the
URL). ``TierSync`` runs on the committing rank and does what crosses the two
tiers: probing the store when the manager opens, queueing committed steps for
upload (``upload.Uploader``), protecting steps not yet durable from local
retention, and downloading a durable step into the primary tier (staged and
committed through ``CheckpointStorage`` like any save).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from stalwart.errors import DurableStoreError
from stalwart.events import EventLog
from stalwart.manifest import MANIFEST_NAME, Manifest
from stalwart.policy import RetentionPolicy
from stalwart.progress import progress_bar
from stalwart.redact import redact_url
from stalwart.storage.base import CheckpointStorage, DurableMirror
from stalwart.storage.local import step_dir_name
from stalwart.storage.remote import RetryPolicy, is_url
from stalwart.upload import Uploader

__all__ = ["DurableConfig", "TierSync", "local_cache_dir", "open_durable"]

_PROBE = RetryPolicy(deadline=10.0, initial_backoff=0.2, max_backoff=2.0, request_timeout=10.0)
"""A short deadline for listing the store when the manager opens: an outage only warns."""


def _count_ok(value: Any, *, none: bool = False, local: bool = False) -> bool:
    """Whether ``value`` is a positive integer (or None / ``"local"`` where allowed)."""
    if value is None:
        return none
    if isinstance(value, str):
        return local and value == "local"
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DurableConfig:
    """Settings of the durable tier (an object store that keeps copies of committed checkpoints).

    ``CheckpointManager(..., durable="s3://bucket/prefix")`` is the same as
    ``durable=DurableConfig(url="s3://bucket/prefix")``; build one to change
    anything else.
    """

    url: str
    """The object-store URL (``s3://bucket/prefix``, ``gs://…``, ``az://…``, or any fsspec URL)."""
    every: int = 1
    """Upload every n-th committed checkpoint (emergency checkpoints and the last one
    before ``close`` always)."""
    keep_last: int | Literal["local"] | None = "local"
    """Checkpoints kept in the durable tier (None: all; ``"local"``: the manager's ``keep_last``)."""
    keep_every: int | Literal["local"] | None = "local"
    """Milestones kept in the durable tier (None: none; ``"local"``: the manager's ``keep_every``)."""
    options: Mapping[str, Any] | None = None
    """Options of the store client (obstore config keys such as ``endpoint`` or
    ``region``; fsspec storage options), for settings the environment does not give.
    Credentials are best left to the environment; values given here never appear in
    logs or errors."""
    max_pending: int = 2
    """Checkpoints that may wait for upload while the store is slow or down; local
    retention keeps them."""
    retry: RetryPolicy | None = None
    """Timeouts and backoff of store requests (None: ``RetryPolicy()``: 120 s per
    request, 15 minutes of retries with exponential backoff and jitter per upload
    before it is reported as ``upload_failed`` and tried again later)."""
    close_timeout: float | None = 600.0
    """Seconds ``close`` waits for uploads in progress (None: as long as it takes);
    steps still pending are uploaded by the next run that opens the same directory."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not is_url(self.url):
            raise ValueError(
                "durable must be an object-store URL such as 's3://bucket/prefix', "
                f"got {redact_url(str(self.url))!r} (DurableConfig.url)"
            )
        if not _count_ok(self.every):
            raise ValueError(
                f"DurableConfig.every must be a positive integer (upload every n-th "
                f"checkpoint), got {self.every!r}"
            )
        for name in ("keep_last", "keep_every"):
            if not _count_ok(getattr(self, name), none=True, local=True):
                raise ValueError(
                    f"DurableConfig.{name} must be a positive integer, None or 'local', "
                    f"got {getattr(self, name)!r}"
                )
        if not _count_ok(self.max_pending):
            raise ValueError(
                f"DurableConfig.max_pending must be a positive integer, got {self.max_pending!r}"
            )
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise TypeError(
                f"DurableConfig.retry must be a stalwart.RetryPolicy, got {type(self.retry).__name__}"
            )
        if self.close_timeout is not None and not (
            isinstance(self.close_timeout, (int, float)) and self.close_timeout >= 0
        ):
            raise ValueError(
                "DurableConfig.close_timeout must be a number of seconds >= 0 or None, "
                f"got {self.close_timeout!r}"
            )

    @classmethod
    def of(cls, durable: str | DurableConfig | None) -> DurableConfig | None:
        """``durable`` as given to the manager (a URL, a config or None) as a config."""
        if durable is None or isinstance(durable, DurableConfig):
            return durable
        if not isinstance(durable, str):
            raise TypeError(
                f"durable must be an object-store URL or a stalwart.DurableConfig, "
                f"got {type(durable).__name__}"
            )
        return cls(url=durable)

    def retention(self, keep_last: int | None, keep_every: int | None) -> RetentionPolicy:
        """The durable tier's retention, given the local tier's."""
        return RetentionPolicy(
            keep_last=keep_last if self.keep_last == "local" else self.keep_last,
            keep_every=keep_every if self.keep_every == "local" else self.keep_every,
        )


def local_cache_dir(url: str) -> Path:
    """The node-local directory that stages checkpoints for ``directory=<URL>``.

    Stable per URL (and user), so a restarted job on the same node finds the
    checkpoints it already has instead of downloading them again.
    """
    base = Path(os.environ.get("STALWART_LOCAL_DIR") or tempfile.gettempdir())
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    tail = "".join(c if c.isalnum() or c in "-_." else "_" for c in url.split("://", 1)[1])
    return base / f"stalwart-{os.getuid()}" / f"{tail[-48:]}-{digest}"


def resolve_directory(
    directory: str | os.PathLike[str],
    durable: str | DurableConfig | None,
    keep_last: int | None,
    keep_every: int | None,
) -> tuple[Path, DurableConfig | None, int | None, int | None]:
    """The local directory, durable config and local retention for the manager's arguments.

    ``directory`` may be an object-store URL: checkpoints are then staged in a
    node-local directory (keeping one) and the URL becomes the durable tier,
    which keeps the history (``keep_last``/``keep_every``).
    """
    config = DurableConfig.of(durable)
    if is_url(directory) and not str(directory).startswith("file://"):
        url = str(directory)
        if config is not None and config.url != url:
            raise ValueError(
                f"directory is the URL {redact_url(url)!r} and durable is "
                f"{redact_url(config.url)!r}: give one URL (directory=URL alone), or a "
                "local directory plus durable=URL"
            )
        config = config or DurableConfig(url=url)
        # The local copy only stages uploads; the durable tier keeps the history.
        config = dataclasses.replace(
            config,
            keep_last=keep_last if config.keep_last == "local" else config.keep_last,
            keep_every=keep_every if config.keep_every == "local" else config.keep_every,
        )
        return local_cache_dir(redact_url(url)), config, 1, None
    if is_url(directory):
        directory = str(directory)[len("file://") :]
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    return Path(directory), config, keep_last, keep_every


def open_durable(config: DurableConfig) -> tuple[DurableMirror, list[int] | None, str | None]:
    """Open the tier and list it once, briefly: ``(tier, committed steps, outage)``.

    A refusal (bad bucket, credentials, permissions) raises ``DurableStoreError``
    now; an outage returns its message instead of the steps, and the run trains
    anyway. Call on the committing rank only.
    """
    from stalwart.storage.durable import DurableTier

    tier = DurableTier(config.url, options=config.options, retry=config.retry or RetryPolicy())
    try:
        return tier, tier.committed_steps(retry=_PROBE), None
    except DurableStoreError as exc:
        if not exc.transient:
            raise DurableStoreError(
                f"the durable tier {tier.url} refuses this run: {exc}; check the bucket, "
                "the credentials and the permissions",
                transient=False,
            ) from None
        return tier, None, str(exc)


class TierSync:
    """The committing rank's link between the primary tier and the durable one.

    Starts the upload thread and queues what an earlier run left behind. Used
    from the training thread; the upload thread calls ``on_durable`` after each
    upload (the manager applies local retention there).
    """

    def __init__(
        self,
        tier: DurableMirror,
        storage: CheckpointStorage,
        events: EventLog,
        config: DurableConfig,
        *,
        retention: RetentionPolicy,
        durable_steps: list[int] | None,
        down: str | None,
        on_durable: Callable[[], None],
    ) -> None:
        self.tier = tier
        self.storage = storage
        self.events = events
        self.config = config
        self._commits = 0
        if down is not None:
            # Down for now: train anyway, uploads catch up when it returns.
            events.emit("durable_unreachable", logging.WARNING, error=down)
        self.uploader = Uploader(
            tier,
            storage,
            events,
            retention=retention,
            max_pending=config.max_pending,
            on_durable=on_durable,
        )
        local = storage.committed_steps()
        if durable_steps:
            self.uploader.last_durable_step = durable_steps[-1]
            behind = [s for s in local if s > durable_steps[-1]]
        else:
            behind = local[-1:]
        for step in behind:
            self.uploader.enqueue(step)

    def committed(self, step: int, *, emergency: bool) -> None:
        """A step was committed locally: queue it when it is an ``every``-th one or an emergency."""
        self._commits += 1
        if emergency or self._commits % self.config.every == 0:
            self.uploader.enqueue(step)

    def committed_steps(self) -> list[int]:
        """Steps committed in the durable tier; [] (with a warning event) while it is unreachable."""
        try:
            return self.tier.committed_steps()
        except DurableStoreError as exc:
            self.events.emit("durable_unreachable", logging.WARNING, error=str(exc))
            return []

    def download(self, step: int) -> None:
        """Fetch durable ``step`` into the primary tier: staged, verified, then committed."""
        tier = self.tier
        t0 = time.perf_counter()
        manifest_bytes = tier.manifest_bytes(step)
        source = f"{tier.url}/{step_dir_name(step)}/{MANIFEST_NAME}"
        manifest = Manifest.from_json(manifest_bytes, source=source)
        staging = self.storage.begin(step)
        try:
            with progress_bar(
                manifest.total_bytes, f"stalwart: downloading step {step}", min_bytes=64 * 2**20
            ) as advance:
                tier.download(step, staging, advance=advance, manifest_bytes=manifest_bytes)
            self.storage.commit(staging, step, manifest_bytes.decode("utf-8"))
        except BaseException:
            self.storage.abort(staging)
            raise
        seconds = time.perf_counter() - t0
        self.events.emit(
            "download",
            step=step,
            url=tier.url,
            bytes=manifest.total_bytes,
            seconds=round(seconds, 6),
            throughput_MBps=round(manifest.total_bytes / 1e6 / max(seconds, 1e-9), 1),
        )

    def roll_back(self, to: int, local: list[int], *, uploaded: set[int]) -> list[int]:
        """The durable side of a rollback to ``to``: its steps after ``to`` leave the tier.

        ``uploaded`` is what the run's events say the tier holds: a step among them
        that the tier does not list stops the rollback before anything changes.

        Waits for the uploads in flight, downloads every step after ``to`` that
        only the tier holds into the primary tier (``local`` lists its committed
        steps), so that the rollback keeps it aside with the others, then
        deletes them from the tier, newest first, each a ``durable_delete``
        event. Returns the steps deleted. Raises ``DurableStoreError`` (the tier
        unreachable, or uploads still pending after ``close_timeout``) or what a
        download raises; a rollback cut short here has
        moved nothing in the primary tier, and a rerun finishes it.
        """
        if not self.uploader.wait(self.config.close_timeout):
            raise DurableStoreError(
                f"uploads to {redact_url(self.config.url).rstrip('/')} still pending after "
                f"DurableConfig.close_timeout={self.config.close_timeout} s (is the store "
                "reachable?)",
                transient=True,
            )
        remote = self.tier.committed_steps()
        missing = sorted(s for s in uploaded if s > to and s not in remote)
        if missing:
            # A store that cannot list (a wrong root, an outage answered with an empty
            # page) looks empty: deleting nothing there would leave those steps to a
            # later restore. Stop before anything changes.
            raise DurableStoreError(
                f"{redact_url(self.config.url).rstrip('/')} does not list steps "
                f"{', '.join(map(str, missing[:10]))}, which this run's events say were "
                "uploaded and never deleted: is the store reachable, with the URL it had? "
                "(Steps removed from the store by hand must be rolled back by hand.)",
                transient=True,
            )
        newer = sorted((s for s in remote if s > to), reverse=True)
        for step in sorted(set(newer) - set(local)):
            self.download(step)
        for step in newer:
            self.tier.delete(step)
            self.events.emit("durable_delete", step=step, reason=f"rollback to step {to}")
        self.uploader.forget_after(to, max((s for s in remote if s <= to), default=None))
        return newer

    @contextlib.contextmanager
    def holding(self) -> Iterator[set[int]]:
        """Steps local retention must keep (queued or uploading), held steady for the block."""
        with self.uploader.holding() as protected:
            yield protected

    def close(self, newest: int | None, directory: Path) -> None:
        """Make the run's last checkpoint durable, wait up to ``close_timeout``, stop the thread."""
        uploader = self.uploader
        if newest is not None and (
            uploader.last_durable_step is None or newest > uploader.last_durable_step
        ):
            uploader.enqueue(newest)  # the run's last checkpoint is always made durable
        left = uploader.close(self.config.close_timeout)
        if left:
            self.events.emit(
                "durable_behind",
                logging.WARNING,
                steps=left,
                reason=(
                    f"not yet uploaded to {redact_url(self.config.url).rstrip('/')} when closing; the next run that "
                    f"opens {directory} uploads them"
                ),
            )
