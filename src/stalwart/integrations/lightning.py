"""Lightning integration: stalwart's commit protocol behind Lightning's ``CheckpointIO``.

Two pieces, each a few lines in a Lightning script::

    trainer = Trainer(plugins=[StalwartCheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath="ckpt", every_n_train_steps=10,
                                                 save_last=True), ExactResume()])
    trainer.fit(model, loader, ckpt_path="last")

``StalwartCheckpointIO`` maps each path Lightning names (``ckpt/last.ckpt``,
``ckpt/epoch=0-step=20.ckpt``) to a stalwart run directory of that name: a save
commits a new step inside it (written, fsynced, checksummed, MANIFEST.json
last, renamed into place), then drops the older steps of that path, so
overwriting ``last.ckpt`` is never a window without a checkpoint. A load
verifies sizes and checksums before reading a byte and reads tensors and plain
data only (no unpickler that can run code); a damaged, crafted or foreign
entry is skipped with a ``restore_skipped`` event and the newest older
checkpoint of the directory that verifies is loaded instead.

``ExactResume`` is a callback that adds every rank's RNG state to the
checkpoint and puts it back at the first resumed batch, so that a run killed
mid-epoch and resumed with ``fit(ckpt_path="last")`` is bit-identical when its
data loader is stateful (``stalwart.ResumableDataLoader`` or torchdata's
``StatefulDataLoader``, whose position Lightning itself saves).

Lightning saves on global rank 0 only (``Strategy.save_checkpoint``), so the
save here is a single-process one (a coordinator without a group); every rank
loads for itself, and all reach the same verdict on the same files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from stalwart._version import __version__
from stalwart.distributed import Coordinator, get_rank
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StalwartError,
)
from stalwart.events import EventLog
from stalwart.integrations._lightning_resume import ExactResume
from stalwart.layout import EVENTS_NAME
from stalwart.pipeline import (
    AsyncSaver,
    OpenedSave,
    StagingArea,
    load_checkpoint,
    open_save,
    read_manifest,
    write_and_commit,
)
from stalwart.state import TrainState
from stalwart.storage.local import LocalStorage

__all__ = ["ExactResume", "StalwartCheckpointIO"]

_LAST = re.compile(r"^last(-v?\d+)?$")
"""Names ModelCheckpoint gives its last checkpoint (``last``, ``last-v1``), without ``.ckpt``."""
_NAMED_STEP = re.compile(r"(?:^|[-_])step=([0-9]+)(?:$|[-_])")
"""The global step in a ModelCheckpoint file name (``epoch=0-step=20``), without ``.ckpt``."""

logger = logging.getLogger("stalwart")


class _Holder:
    """Lightning's checkpoint dict as a stateful object: saved as one blob, loaded back whole."""

    def __init__(self, value: dict[str, Any] | None = None) -> None:
        self.value = value if value is not None else {}

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.value = dict(state_dict)


def _state_of(holder: _Holder) -> TrainState:
    # rng=False: Lightning's dict is the whole state; ExactResume adds the RNG
    # of every rank to it, which a TrainState on rank 0 alone could not see.
    return TrainState(rng=False, lightning=holder)


def _global_step(checkpoint: Mapping[str, Any]) -> int:
    step = checkpoint.get("global_step", 0)
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0


class StalwartCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` with stalwart's commit, checksums, verified load and fallback.

    Pass it with ``Trainer(plugins=[StalwartCheckpointIO()])`` (or
    ``Fabric(plugins=...)``). Each checkpoint path becomes a directory holding
    committed stalwart steps (see the module docstring); ``stalwart ls``,
    ``verify`` and ``inspect`` read it like any run.

    ``async_save=True`` returns from ``save_checkpoint`` after a copy of the
    tensors into reused CPU buffers; one background thread writes and commits
    (at most one save in flight; a failure is raised by the next call).
    ``durable`` is an object-store URL (``s3://``, ``gs://``, ``file://``...):
    every committed checkpoint is also uploaded to ``<durable>/<path name>``
    before the save counts as done. ``keep_versions`` is how many committed
    steps one path keeps (1: ``last.ckpt`` holds only the newest).

    Called by Lightning from the training thread; ``save_checkpoint`` and
    ``remove_checkpoint`` on global rank 0 only, ``load_checkpoint`` on every rank.
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        durable: str | None = None,
        keep_versions: int = 1,
    ) -> None:
        if (
            not isinstance(keep_versions, int)
            or isinstance(keep_versions, bool)
            or keep_versions < 1
        ):
            raise ValueError(
                f"keep_versions must be an integer >= 1 (steps kept per checkpoint path), "
                f"got {keep_versions!r}"
            )
        if durable is not None and (not isinstance(durable, str) or "://" not in durable):
            raise ValueError(
                f"durable must be an object-store URL such as 's3://bucket/run' or "
                f"'file:///mnt/backup/run', got {durable!r}"
            )
        self.async_save = async_save
        self.durable = durable.rstrip("/") if durable is not None else None
        self.keep_versions = keep_versions
        self._background = AsyncSaver() if async_save else None
        self._staging = StagingArea()
        self.last_stall_s: float | None = None
        """Seconds the last ``save_checkpoint`` blocked the training thread."""

    # ------------------------------------------------------------------ save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Commit ``checkpoint`` as a new step of the run directory ``path`` (rank 0 only).

        Raises ``TypeError`` naming the key of a value that is neither a tensor
        nor plain data (loading it back would need an unpickler that runs code),
        ``CheckpointSaveError`` when writing or committing fails (nothing is
        committed then, older checkpoints are untouched).
        """
        if storage_options is not None:
            raise TypeError(
                "StalwartCheckpointIO takes no storage_options (got "
                f"{storage_options!r}); pass durable= to the plugin for an object-store copy"
            )
        if self._background is not None:
            self._background.wait()  # at most one save in flight, and its error shows here
        t0 = _now()
        root = Path(path)
        _make_run_dir(root)
        storage = LocalStorage(root)
        committed = storage.committed_steps()
        gstep = _global_step(checkpoint)
        # Steps of one path only grow: a second save of the same global step
        # (a re-run, an exception checkpoint) is a new step, never an overwrite.
        step = max(gstep, committed[-1] + 1) if committed else gstep
        state = _state_of(_Holder(checkpoint))
        staging = self._staging if self._background is not None else None

        def collect() -> tuple[dict[str, Any], Any]:
            sd = state.state_dict()
            if staging is not None:
                sd = staging.stage(sd)
            return sd, state.rank_digests(sd)

        opened = open_save(storage, step, collect, exists=lambda: False, coordinator=_local())
        opened.state_dict = state.with_rank_values(opened.state_dict, opened.shared)
        fields = _manifest_fields(checkpoint, root)
        if self._background is None:
            self._commit(storage, opened, fields, root)
            self.last_stall_s = _now() - t0
        else:
            self.last_stall_s = _now() - t0  # the staging copy: the rest runs in the background
            self._background.submit(lambda: self._commit(storage, opened, fields, root))

    def _commit(
        self, storage: LocalStorage, opened: OpenedSave, fields: dict[str, Any], root: Path
    ) -> None:
        """Write and commit one opened save, then upload it and drop older steps (any thread)."""
        events = EventLog(root / EVENTS_NAME)
        t0 = _now()
        result = write_and_commit(storage, opened, fields)
        events.emit(
            "save",
            step=result.step,
            path=str(result.path),
            bytes=result.bytes,
            files=result.files,
            global_step=fields["metrics"]["global_step"],
            async_save=self.async_save,
            seconds=round(_now() - t0, 6),
        )
        if self.durable is not None:
            # Before older steps go: the durable copy of the newest is in place first.
            tier = self._tier(root.name)
            try:
                done = tier.upload(result.path)
                events.emit("upload", step=result.step, url=tier.url, bytes=done.bytes)
                for old in tier.committed_steps()[: -self.keep_versions]:
                    tier.delete(old)
            finally:
                tier.stop()
        for old in storage.committed_steps()[: -self.keep_versions]:
            storage.delete(old)

    # ------------------------------------------------------------------ load

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's checkpoint dict from ``path``, verified first; every rank calls it.

        ``path`` is tried first (its newest step, then older ones); when it is
        damaged, crafted, incomplete or not a stalwart checkpoint at all, the
        newest checkpoint of the same directory that verifies and is not newer
        than ``path`` is loaded instead, with a ``restore_skipped`` event per
        candidate passed over. Nothing is unpickled: tensors and plain data
        only, so ``weights_only`` holds whatever is passed. ``map_location`` is
        a device (or its name) the tensors are moved to; CPU by default.
        Raises ``CheckpointNotFoundError`` when ``path`` does not exist and
        ``CheckpointCorruptError`` when no candidate verifies.
        """
        requested = Path(path)
        if not os.path.lexists(requested):
            raise CheckpointNotFoundError(
                f"checkpoint {requested} does not exist; pass an existing path or "
                "ckpt_path='last' to resume from the newest checkpoint that verifies"
            )
        device = _device_of(map_location)
        skipped: list[str] = []
        for candidate in self._with_durable(requested, _candidates(requested, skipped), skipped):
            holder = _Holder()
            try:
                # strict=False: the live holder is empty, its keys come from the checkpoint.
                load_checkpoint(candidate, _state_of(holder), strict=False, coordinator=_local())
            except StalwartError as exc:
                _skip(skipped, candidate, str(exc))
                continue
            if not holder.value:
                _skip(
                    skipped, candidate, "it holds no Lightning checkpoint (no 'lightning' section)"
                )
                continue
            if skipped:
                _note_fallback(requested, candidate, skipped)
            loaded: dict[str, Any] = _to_device(holder.value, device)
            return loaded
        raise CheckpointCorruptError(
            f"no checkpoint at or before {requested} verifies ({len(skipped)} tried: "
            + "; ".join(skipped[:4])
            + "); nothing was loaded. Start without ckpt_path, or restore a copy "
            "(`stalwart ls` lists what is left)",
            path=str(requested),
        )

    def _with_durable(
        self, requested: Path, local: Iterator[Path], skipped: list[str]
    ) -> Iterator[Path]:
        """The local candidates, then (with ``durable``) the durable copies of ``requested``.

        Only when no local checkpoint loaded: durable steps newest first are
        downloaded (staged, every file checked against its manifest, then
        committed) into a hidden directory of this process, so ranks never
        collide, and removed once read; a wiped local disk still resumes.
        """
        yield from local
        if self.durable is None:
            return
        tier = self._tier(requested.name)
        scratch = requested.with_name(f".{requested.name}.download-{uuid.uuid4().hex[:8]}")
        storage = LocalStorage(scratch)
        try:
            steps = tier.committed_steps()
            scratch.mkdir(parents=True)
            for step in reversed(steps):
                staging = storage.begin(step)
                try:
                    manifest = tier.download(step, staging)
                    storage.commit(staging, step, manifest.decode("utf-8"))
                except (StalwartError, OSError) as exc:
                    storage.abort(staging)
                    _skip(skipped, requested, f"durable copy of step {step}: {exc}")
                    continue
                yield storage.step_path(step)
        except StalwartError as exc:
            _skip(skipped, requested, f"the durable tier {tier.url} cannot be listed: {exc}")
        finally:
            tier.stop()
            shutil.rmtree(scratch, ignore_errors=True)

    def _tier(self, name: str) -> Any:
        """The durable tier of one checkpoint path (``<durable>/<name>``); call ``stop()`` after."""
        from stalwart.storage.durable import DurableTier

        assert self.durable is not None
        return DurableTier(f"{self.durable}/{name}")

    # ---------------------------------------------------------------- remove

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (rank 0; ``ModelCheckpoint`` decides which).

        Waits for a save in flight first, so a ``save_top_k`` rotation never
        removes the previous checkpoint before the new one is committed. The
        directory is renamed to a hidden name before it is deleted: a crash in
        between leaves no half-deleted checkpoint that could look valid.
        """
        self.wait()
        target = Path(path)
        if self.durable is not None:
            # The durable copies go with the path: ModelCheckpoint's rotation holds there too.
            tier = self._tier(target.name)
            try:
                for step in tier.committed_steps():
                    tier.delete(step)
            finally:
                tier.stop()
        if not os.path.lexists(target):
            return
        if target.is_symlink() or not target.is_dir():
            target.unlink()  # Lightning's own save_last="link" links, or a foreign file
            return
        doomed = target.with_name(f".{target.name}.del-{uuid.uuid4().hex[:8]}")
        os.rename(target, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (async mode) is committed; raise its error."""
        if self._background is not None:
            self._background.wait()

    def teardown(self) -> None:
        """Finish the save in flight and stop the background thread (Lightning calls it at the end)."""
        if self._background is not None:
            background, self._background = self._background, None
            background.close()
            self._background = AsyncSaver()


# ---------------------------------------------------------------------- helpers


def _now() -> float:
    return time.perf_counter()


def _local() -> Coordinator:
    # Lightning saves on rank 0 alone and every rank loads alone: no collective may run.
    return Coordinator(None, timeout=0.0, name="lightning")


def _make_run_dir(root: Path) -> None:
    """Make ``root`` a run directory; a foreign file or link there is moved aside, never read."""
    if os.path.lexists(root) and (root.is_symlink() or not root.is_dir()):
        aside = root.with_name(f".{root.name}.foreign-{uuid.uuid4().hex[:8]}")
        os.rename(root, aside)
        logger.warning("%s is not a stalwart checkpoint; moved aside to %s", root, aside.name)
    root.mkdir(parents=True, exist_ok=True)


def _manifest_fields(checkpoint: Mapping[str, Any], root: Path) -> dict[str, Any]:
    epoch = checkpoint.get("epoch")
    return {
        "world_size": 1,
        "epoch": epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        "metadata": {"lightning_path": root.name},
        "versions": {
            "stalwart": __version__,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
        },
        "hostname": socket.gethostname(),
        "metrics": {"global_step": _global_step(checkpoint)},
    }


def _committed(root: Path) -> list[Path]:
    """Committed step directories of ``root``, newest first; [] when it is not a run directory."""
    if root.is_symlink() or not root.is_dir():
        return []
    storage = LocalStorage(root)
    return [storage.step_path(s) for s in reversed(storage.committed_steps())]


def _order_key(step_dir: Path) -> tuple[int, float] | None:
    """(global step, creation time) of a committed step, None when its manifest is unreadable."""
    try:
        manifest = read_manifest(step_dir)
    except StalwartError:
        return None
    gstep = manifest.metrics.get("global_step")
    return (gstep if isinstance(gstep, int) else manifest.step, manifest.created_unix)


def _candidates(requested: Path, skipped: list[str]) -> Iterator[Path]:
    """Step directories to try for ``requested``: its own steps, then siblings, newest first.

    For an explicit path the siblings are those not newer than it (a fallback
    goes back, never forward): than its manifest's global step or, when no
    manifest of it can be read, than the ``step=N`` in its name (without
    either, every sibling qualifies). ``last.ckpt`` / ``last-vN.ckpt`` stand
    for "the newest", and a crafted one may claim any step, so for them every
    sibling qualifies.
    """
    own = _committed(requested)
    if not own:
        _skip(skipped, requested, "not a committed stalwart checkpoint (no step with a manifest)")
    yield from own
    newest: int | None = None
    if not _LAST.match(requested.stem):
        # Its own manifest says which global step it holds; when none can be read
        # (damaged, or a foreign file), the step=N ModelCheckpoint put in its name.
        newest = next((k[0] for k in map(_order_key, own) if k is not None), None)
        if newest is None and (named := _NAMED_STEP.search(requested.stem)) is not None:
            newest = int(named.group(1))
    siblings: list[tuple[tuple[int, float], Path]] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(requested.parent):
            sibling = Path(entry.path)
            if entry.name.startswith(".") or sibling == requested:
                continue
            for step_dir in _committed(sibling):
                key = _order_key(step_dir)
                if key is None:
                    _skip(skipped, step_dir, "its manifest cannot be read")
                elif newest is None or key[0] <= newest:
                    siblings.append((key, step_dir))
    siblings.sort(key=lambda item: item[0], reverse=True)
    yield from (step_dir for _key, step_dir in siblings)


def _skip(skipped: list[str], where: Path, reason: str) -> None:
    skipped.append(f"{where}: {reason}")
    EventLog(None, rank=get_rank()).emit(
        "restore_skipped", logging.WARNING, path=str(where), reason=reason
    )


def _note_fallback(requested: Path, loaded: Path, skipped: list[str]) -> None:
    """Record, on rank 0, in the run directory that was loaded, what was passed over and why.

    A durable copy is loaded from a hidden scratch directory that is removed
    afterwards: its event goes to the requested path's directory instead.
    """
    home = requested if loaded.parent.name.startswith(".") else loaded.parent
    where = (
        home / EVENTS_NAME if get_rank() == 0 and home.is_dir() and not home.is_symlink() else None
    )
    events = EventLog(where, rank=get_rank())
    events.emit(
        "restore_fallback",
        logging.WARNING,
        requested=str(requested),
        path=str(loaded),
        skipped=skipped,
    )


def _device_of(map_location: Any) -> torch.device:
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise TypeError(
        f"StalwartCheckpointIO.load_checkpoint takes map_location as a device or its name, got "
        f"{type(map_location).__name__}; move tensors after loading for a mapping or a function"
    )


def _to_device(value: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value
