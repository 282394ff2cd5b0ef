"""DeepSpeed: ``engine.save_checkpoint`` / ``load_checkpoint`` with stalwart's guarantees.

DeepSpeed writes a checkpoint as ``torch.save`` pickles (model states, one
ZeRO optimizer shard per rank, the client state) through its
``CheckpointEngine`` seam, fsyncs nothing, and has rank 0 write ``latest``
whether or not the other ranks' shards exist yet. ``DeepSpeedCheckpointer``
replaces the engine's checkpoint engine with ``StalwartCheckpointEngine``::

    ckpt = DeepSpeedCheckpointer(engine, "runs/ds", keep_last=3, data=loader)
    engine.load_checkpoint("runs/ds")               # unchanged: newest checkpoint that verifies
    ...
    engine.save_checkpoint("runs/ds", client_state={...})   # unchanged

A save, on every rank (each step collective over the ranks):

1. ``create``: rank 0 makes the step's staging directory
   (``.step_N.tmp-…``, never restored, swept by ``stalwart gc``); every rank
   learns its name.
2. ``save``: DeepSpeed's files go into it, each written and fsynced by the rank
   that made it.
3. ``commit``: once every rank is there, ``CheckpointManager.save`` writes the
   stalwart state beside them (RNG of every rank, data position, the tag) and
   runs THE COMMIT PROTOCOL (``pipeline.write_and_commit``) over the directory:
   every file checksummed into one manifest, committed by rank 0 with a rename.
   Only then does DeepSpeed write ``latest``, so it never names an uncommitted tag;
   ``load`` does not read it anyway (the catalog of committed steps decides).

A load (``engine.load_checkpoint``, which the checkpointer replaces with its
own ``load_checkpoint``, or ``DeepSpeedCheckpointer.load``) restores the newest
committed step whose files match the manifest (falling back over damaged ones,
moved aside as ``.step_N.corrupt-…``), checks that every DeepSpeed file decodes
with ``torch.load(weights_only=True)`` (a few DeepSpeed classes allowlisted,
see ``SAFE_GLOBALS``), and only then lets DeepSpeed's own ``load_checkpoint``
read them, each file's bytes checked against the manifest again just before
decoding.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "stalwart.integrations.deepspeed needs DeepSpeed: pip install 'stalwart[deepspeed]'"
    ) from exc

from stalwart.distributed import Coordinator
from stalwart.errors import CheckpointCorruptError, CheckpointSaveError, UnsafeCheckpointError
from stalwart.manager import CheckpointManager
from stalwart.manifest import Manifest
from stalwart.pipeline import read_manifest
from stalwart.reader import VerifiedFiles
from stalwart.safe_load import weights_only_detail
from stalwart.state import TrainState
from stalwart.state.plain import check_plain
from stalwart.storage.local import LocalStorage

__all__ = [
    "SAFE_GLOBALS",
    "DeepSpeedCheckpointer",
    "StalwartCheckpointEngine",
    "safe_globals",
    "step_of_tag",
]

logger = logging.getLogger("stalwart")

_TAG_STEP = re.compile(r"(?:global_step)?([0-9]+)")


def step_of_tag(tag: str) -> int:
    """The step a DeepSpeed tag names: ``global_step200`` (DeepSpeed's default) or ``200``.

    A stalwart checkpoint is identified by its step; other tags are refused
    with ``ValueError`` rather than mapped to a guess.
    """
    m = _TAG_STEP.fullmatch(str(tag))
    if m is None:
        raise ValueError(
            f"DeepSpeed tag {tag!r} names no step: stalwart keeps one checkpoint per step, so "
            "use the default tag (save_checkpoint(dir) names it global_step<N>) or tag=<N>"
        )
    return int(m.group(1))


def safe_globals() -> list[Any]:
    """The DeepSpeed classes its checkpoints hold that ``torch.load(weights_only=True)`` must build.

    Plain data holders (a loss scaler's numbers, an enum of the ZeRO stage);
    nothing here runs code of the checkpoint's choosing. Imported lazily: each
    exists only in some DeepSpeed versions.
    """
    found: list[Any] = []
    for module, names in (
        ("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
        ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
        ("deepspeed.utils.tensor_fragment", ("fragment_address",)),
        ("deepspeed.runtime.zero.offload_config", ("OffloadDeviceEnum",)),
    ):
        try:
            mod = __import__(module, fromlist=list(names))
        except ImportError:  # pragma: no cover - another DeepSpeed version
            continue
        found.extend(getattr(mod, name) for name in names if hasattr(mod, name))
    return found


SAFE_GLOBALS = safe_globals()


class _StagingStorage(LocalStorage):
    """``LocalStorage`` whose ``begin`` hands out the staging directory DeepSpeed already filled.

    ``create`` makes the staging directory before DeepSpeed writes (DeepSpeed's
    files must land in it), the manager asks for one when it saves: this storage
    returns the prepared one for that step, so everything is committed together.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self.prepared: dict[int, Path] = {}

    def begin(self, step: int) -> Path:
        prepared = self.prepared.pop(step, None)
        return prepared if prepared is not None else super().begin(step)


class StalwartCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # DeepSpeed is untyped
    """DeepSpeed's ``CheckpointEngine`` seam, writing into stalwart's staging and committing there.

    Installed by ``DeepSpeedCheckpointer``; DeepSpeed calls it on every rank:
    ``create`` and ``commit`` are collective, ``save`` and ``load`` are per rank.
    """

    def __init__(self, owner: DeepSpeedCheckpointer) -> None:
        super().__init__(None)
        self.name = "StalwartCheckpointEngine"
        self.owner = owner

    def create(self, info: CheckpointCommitInfo) -> None:
        self.owner.begin_save(str(info.tag), Path(info.save_dir))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self.owner.staged_path(Path(path)) is None:
            os.makedirs(path, exist_ok=exist_ok)  # the run directory itself

    def save(self, state_dict: Any, path: str) -> None:
        target = self.owner.staged_path(Path(path))
        if target is None:
            raise ValueError(
                f"DeepSpeed saves {path}, outside the checkpoint being saved in "
                f"{self.owner.directory}: only engine.save_checkpoint goes through stalwart "
                "(save_16bit_model is not supported while a DeepSpeedCheckpointer is installed)"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, path: str, map_location: Any = None) -> Any:
        return self.owner.read_file(Path(path), map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        self.owner.commit_save(str(info.tag))
        return True


class DeepSpeedCheckpointer:
    """Stalwart checkpoints for a DeepSpeed engine: commit, verify, fall back, keep, upload.

    Construct it on every rank after ``deepspeed.initialize`` (the constructor
    is collective, like ``CheckpointManager``'s); it replaces
    ``engine.checkpoint_engine`` and ``engine.load_checkpoint``. Then
    ``engine.save_checkpoint(directory)`` saves through stalwart and
    ``engine.load_checkpoint(directory)`` (or ``load()``) restores. ``data`` (a
    ``ResumableDataLoader``) and the RNG of every generator (``rng=True``) are
    saved with each checkpoint, since DeepSpeed saves neither. ``keep_last``,
    ``keep_every``, ``durable``, ``metadata``, ``config`` and ``save_timeout``
    are ``CheckpointManager``'s.
    """

    def __init__(
        self,
        engine: Any,
        directory: str | os.PathLike[str],
        *,
        data: Any = None,
        rng: bool = True,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        durable: Any = None,
        metadata: Mapping[str, Any] | None = None,
        config: Any = None,
        save_timeout: float = 600.0,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)) or "://" in os.fspath(directory):
            raise ValueError(
                f"directory must be a local directory DeepSpeed can write, got {directory!r}; "
                "give an object store as durable= instead"
            )
        self.engine = engine
        self.directory = Path(directory)
        self.storage = _StagingStorage(self.directory)
        self.manager = CheckpointManager(
            self.directory,
            keep_last=keep_last,
            keep_every=keep_every,
            durable=durable,
            metadata=metadata,
            config=config,
            handle_signals=False,
            save_timeout=save_timeout,
            storage=self.storage,
        )
        self.coord = Coordinator.create(None, timeout=save_timeout, name="deepspeed")
        self.extra: dict[str, Any] = {"deepspeed_tag": ""}
        self.state = TrainState(data=data, rng=rng, extra=self.extra)
        self.saving: tuple[str, int, Path] | None = None
        """The save in progress: DeepSpeed's tag, its step, the staging directory."""
        self.loading: tuple[str, Path, Manifest] | None = None
        """The load in progress: the tag given to DeepSpeed, the step directory, its manifest."""
        self.client_state: dict[str, Any] | None = None
        """What ``engine.load_checkpoint`` returned as client state in the last ``load()``."""
        self.deepspeed_load = engine.load_checkpoint
        """DeepSpeed's own ``load_checkpoint``, which ``load`` calls once the files are verified."""
        self.deepspeed_save = engine.save_checkpoint
        """DeepSpeed's own ``save_checkpoint``, which ``save_checkpoint`` calls once checked."""
        engine.checkpoint_engine = StalwartCheckpointEngine(self)
        # The instance attributes shadow the class's methods: the user's unchanged
        # engine.load_checkpoint(directory) now verifies and falls back, and
        # engine.save_checkpoint refuses a client state a load would refuse.
        engine.load_checkpoint = self.load_checkpoint
        engine.save_checkpoint = self.save_checkpoint

    # ------------------------------------------------------------------ save

    def save_checkpoint(
        self, save_dir: str | os.PathLike[str], tag: Any = None, client_state: Any = None,
        **save_kwargs: Any,
    ) -> Any:  # fmt: skip
        """``engine.save_checkpoint`` once installed: DeepSpeed's, after checking ``client_state``.

        DeepSpeed pickles the client state into its model-states file; a load
        decodes that file with ``torch.load(weights_only=True)``, which refuses
        any object but tensors and plain data. Saved, such a value would make
        every checkpoint after it be skipped as unsafe at the next resume, so it
        is refused here, before anything is written (``TypeError`` naming its key).
        """
        if client_state is None:
            client_state = {}
        check_plain({"client_state": client_state}, "")
        return self.deepspeed_save(save_dir, tag=tag, client_state=client_state, **save_kwargs)

    def begin_save(self, tag: str, save_dir: Path) -> None:
        """``create``: rank 0 makes the staging directory of ``tag``'s step; collective."""
        step = step_of_tag(tag)
        if save_dir.resolve() != self.directory.resolve():
            raise ValueError(
                f"engine.save_checkpoint({str(save_dir)!r}) but this engine checkpoints into "
                f"{str(self.directory)!r}; pass that directory"
            )

        def make() -> str | None:
            if not self.coord.is_leader:
                return None
            if step in self.storage.committed_steps():
                raise CheckpointSaveError(
                    f"step {step} (tag {tag!r}) is already committed in {self.directory}; "
                    "a committed checkpoint is never overwritten: save under another tag"
                )
            try:
                return self.storage.begin(step).name
            except OSError as exc:
                raise CheckpointSaveError(
                    f"saving step {step} failed: cannot create the staging directory: {exc}"
                ) from exc

        name = self.coord.agree_all(make, catch=(CheckpointSaveError,))[0]
        assert name is not None
        staging = self.storage.path_of(name)
        self.saving = (tag, step, staging)
        if self.coord.is_leader:
            self.storage.prepared[step] = staging

    def staged_path(self, path: Path) -> Path | None:
        """Where DeepSpeed's ``save_dir/tag/...`` goes in the staging directory (None: elsewhere)."""
        if self.saving is None:
            return None
        tag, _step, staging = self.saving
        try:
            relative = path.resolve().relative_to((self.directory / tag).resolve())
        except ValueError:
            return None
        return staging / relative

    def commit_save(self, tag: str) -> None:
        """``commit``: after every rank wrote its files, commit them with the stalwart state."""
        assert self.saving is not None and self.saving[0] == tag, "commit without create"
        _tag, step, staging = self.saving
        self.saving = None
        self.extra["deepspeed_tag"] = tag
        try:
            # Every rank's DeepSpeed files are written and fsynced once all ranks are here.
            self.coord.agree(lambda: None)
            self.manager.save(step, self.state, force=True)
        finally:
            self.storage.prepared.pop(step, None)
            if self.coord.is_leader and staging.exists():
                # Committed saves were renamed away; what is left here failed.
                shutil.rmtree(staging, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def load(self, *, step: int | None = None, **load_kwargs: Any) -> int | None:
        """Restore the newest committed checkpoint that verifies (or ``step``); return its step.

        Collective. Returns None when the run has no committed checkpoint.
        Falls back over checkpoints whose files do not match their manifest or
        do not decode safely (each moved aside, logged); with ``step``, such a
        checkpoint raises ``CheckpointCorruptError`` instead (a missing one
        ``CheckpointNotFoundError``). A file that cannot be read at all raises
        ``CheckpointCorruptError`` (``transient``) and keeps the checkpoint.
        Restores the RNG and data position saved with it, then DeepSpeed's own
        state through its ``load_checkpoint`` (``load_kwargs`` are passed on).
        The client state DeepSpeed returns is in ``client_state`` afterwards.
        """
        self.client_state = None
        target, below = step, None
        while True:
            try:
                restored = self.manager.restore(self.state, step=target)
            except CheckpointCorruptError as exc:
                if exc.transient or step is not None or target is None:
                    raise
                restored = None  # an older step picked below, bad in every copy: skipped, logged
            else:
                if restored is None:
                    return None
                path = self.storage.step_path(restored)
                try:
                    manifest = self.coord.agree(functools.partial(self._decodes, path))
                except CheckpointCorruptError as exc:
                    if exc.transient or step is not None:
                        raise
                    logger.warning("step %d skipped: %s", restored, exc)
                    if self.coord.is_leader:
                        self.storage.quarantine(restored)
                else:
                    self.loading = (path.name, path, manifest)
                    try:
                        _path, self.client_state = self.deepspeed_load(
                            str(self.directory), tag=path.name, **load_kwargs
                        )
                    finally:
                        self.loading = None
                    return restored
            # A step whose files do not decode is not tried again from another tier
            # (the restore would hand back its durable copy forever): only older ones.
            below = restored if restored is not None else target
            older = [s for s in self._committed_everywhere() if below is None or s < below]
            if not older:
                return None
            target = older[-1]

    def _committed_everywhere(self) -> list[int]:
        """Steps committed locally or in the durable tier, as rank 0 lists them; oldest first."""
        local = self.storage.committed_steps()
        tiers = self.manager.tiers  # rank 0's link to the durable tier (None elsewhere)
        remote = tiers.committed_steps() if tiers is not None else []
        return self.coord.broadcast(sorted(set(local) | set(remote)))

    def load_checkpoint(
        self, load_dir: str | os.PathLike[str], tag: str | None = None, **load_kwargs: Any
    ) -> tuple[str | None, dict[str, Any] | None]:
        """``engine.load_checkpoint`` once installed: ``load`` with DeepSpeed's signature.

        ``tag=None`` restores the newest checkpoint that verifies (``latest`` is
        not read), a tag its step. Returns ``(checkpoint path, client state)``,
        or ``(None, None)`` when there is no checkpoint, as DeepSpeed does.
        """
        if Path(load_dir).resolve() != self.directory.resolve():
            raise ValueError(
                f"engine.load_checkpoint({os.fspath(load_dir)!r}) but this engine checkpoints "
                f"into {str(self.directory)!r}; pass that directory"
            )
        step = None if tag is None else step_of_tag(tag)
        restored = self.load(step=step, **load_kwargs)
        if restored is None:
            return None, None
        return str(self.storage.step_path(restored)), self.client_state

    def _decodes(self, path: Path) -> Manifest:
        """Check that this rank's share of DeepSpeed's files decode safely; the manifest."""
        manifest = read_manifest(path)
        names = [e.path for e in manifest.files if e.path.endswith(".pt")]
        for i, name in enumerate(sorted(names)):
            if i % self.coord.world_size == self.coord.rank:
                _decode(path, manifest, name, torch.device("cpu"))
        return manifest

    def read_file(self, path: Path, map_location: Any) -> Any:
        """``load``: one of DeepSpeed's files of the checkpoint being loaded, verified, decoded."""
        if self.loading is None:
            raise ValueError(
                f"DeepSpeed reads {path} outside a load of this checkpointer: load with "
                "engine.load_checkpoint, so the checkpoint is verified before it is read"
            )
        tag, step_path, manifest = self.loading
        try:
            relative = path.relative_to(self.directory / tag).as_posix()
        except ValueError:
            raise ValueError(
                f"DeepSpeed reads {path}, outside the checkpoint {step_path}"
            ) from None
        return _decode(step_path, manifest, relative, map_location)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for uploads, release the run; collective. The engine saves no more through it."""
        self.manager.close()
        self.coord.destroy()

    def __enter__(self) -> DeepSpeedCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode(step_path: Path, manifest: Manifest, relative: str, map_location: Any) -> Any:
    """Read ``relative`` of a committed step, check it against ``manifest``, decode it safely.

    ``VerifiedFiles`` reads it once into memory and checks size and xxh3-128
    there: the bytes that are checked are the bytes decoded, so a file changed
    after verification cannot slip in. Raises ``CheckpointCorruptError`` for a
    file the manifest does not list, another size or checksum (``transient``
    when it cannot be read), or content ``torch.load(weights_only=True)`` refuses
    (``UnsafeCheckpointError``); any other error of the decode is ``transient``:
    the bytes matched their checksum, so it is no proof of damage.
    """
    files = VerifiedFiles(step_path, manifest)
    try:
        data = io.BytesIO(files.held(relative).view)
    finally:
        files.close()  # the checked bytes live on in ``data`` only, while they are decoded
    where = step_path / relative
    try:
        with _allowlisted():
            return torch.load(data, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's weights-only unpickler raises this for every global or opcode it refuses.
        raise UnsafeCheckpointError(
            f"{where}: refused by torch.load(weights_only=True): {weights_only_detail(exc)}",
            path=str(where),
        ) from exc
    except Exception as exc:
        # Its bytes matched their checksum: anything else that fails here (an error
        # raised into this thread, DataLoader's handler's) is no proof of damage.
        raise CheckpointCorruptError(
            f"{where}: unreadable after its checksum matched ({type(exc).__name__}: {exc}); "
            "not taken as damage, the checkpoint is kept: restart the job",
            path=str(where),
            transient=True,
        ) from exc


@contextmanager
def _allowlisted() -> Iterator[None]:
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        yield
