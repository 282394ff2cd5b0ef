"""stage -> write -> checksum -> commit, and the verified load that mirrors it.

The staging copy and the background writer live in ``stalwart.staging``, the
manifest and file checks in ``stalwart.verify``; their names are re-exported here.

The commit protocol lives in ``write_and_commit`` and nowhere else, after
``open_save`` created the staging directory and every rank collected its state
(one collective); ``commit_checkpoint`` is its publishing step. Saving runs
either in the caller's thread (sync) or, after a staging copy of the state, in
one background thread (async); both run the same ``write_and_commit``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from stalwart.distributed import Coordinator, RankError
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointSaveError,
    CoordinationError,
    StalwartError,
    StateMismatchError,
)
from stalwart.gc_pause import gc_paused
from stalwart.layout import MANIFEST_NAME
from stalwart.manifest import FileEntry, Manifest, hash_file, open_checkpoint_file
from stalwart.reader import VerifiedFileReader, VerifiedFiles, verified_checkpoint
from stalwart.restore_protocol import Restorable
from stalwart.safe_load import raise_interrupt, safe_load
from stalwart.save_plan import CachingSavePlanner, SavePlanCache
from stalwart.staging import AsyncSaver, StagingArea, stage_state_dict
from stalwart.storage.base import CheckpointStorage
from stalwart.verify import FileProblem, file_problems, read_manifest, verify_checkpoint
from stalwart.writer import ChecksummingWriter, RecordTemplates, record_settings, without_zip_crc

_DCP_DATA_FILE = re.compile(r"__\d+_\d+\.distcp$")
"""A DCP data file (rank r writes ``__{r}_*``): its own rank lists it."""

__all__ = [
    "AsyncSaver",
    "FileProblem",
    "OpenedSave",
    "SaveResult",
    "StagingArea",
    "commit_checkpoint",
    "file_problems",
    "load_checkpoint",
    "open_save",
    "read_manifest",
    "stage_state_dict",
    "verify_checkpoint",
    "write_and_commit",
]

T = TypeVar("T")
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
WRITER_THREADS = 1
"""Writer threads (and files) per rank (``ChecksummingWriter``). Errors of every
thread reach the caller, but on a 2-core host a second thread competes with the
first for the same memory bandwidth and the training thread for its core; see
docs/benchmarks.md for the measurement."""


@dataclasses.dataclass(slots=True, kw_only=True)
class SaveResult:
    """What one committed save did and how long each phase took (seconds)."""

    step: int
    path: Path
    bytes: int
    files: int
    write_s: float
    checksum_s: float
    commit_s: float

    def timings(self) -> dict[str, float]:
        return {
            "write_s": round(self.write_s, 6),
            "checksum_s": round(self.checksum_s, 6),
            "commit_s": round(self.commit_s, 6),
        }


# --------------------------------------------------------------------------- save


def commit_checkpoint(storage: CheckpointStorage, staging: Path, manifest: Manifest) -> Path:
    """Publish ``staging`` as ``manifest.step``: the storage's indivisible commit step.

    MANIFEST.json goes into ``staging`` (fsynced), then the storage publishes
    it: rename into place and fsync of the parent on a POSIX filesystem, the
    manifest object written last on an object store. See ``write_and_commit``
    for the protocol around it.
    """
    assert manifest.files, "a checkpoint without files cannot be committed"
    return storage.commit(staging, manifest.step, manifest.to_json())


@dataclasses.dataclass(slots=True, kw_only=True)
class OpenedSave:
    """A save every rank agreed to write: its staging directory and what each rank collected."""

    step: int
    staging: Path | None
    """The staging directory, on every rank; None when the step exists already (a skip)."""
    state_dict: dict[str, Any]
    """This rank's collected (and, async, staged) state."""
    shared: list[Any]
    """What ``collect`` returned to share, from every rank, in rank order."""
    hosts: list[str]
    """Every rank's hostname, in rank order."""


def open_save(
    storage: CheckpointStorage,
    step: int,
    collect: Callable[[], tuple[dict[str, Any], Any]],
    *,
    exists: Callable[[], bool],
    coordinator: Coordinator,
    remote: Callable[[RankError], BaseException] | None = None,
) -> OpenedSave:
    """Create the staging directory and collect the state on every rank: one collective.

    The leader checks ``exists()`` (a committed checkpoint is never
    overwritten) and creates the staging directory; every rank runs
    ``collect()``, which returns its state dict and a small value to share
    (per-rank digests). If anything failed on any rank, every rank raises (see
    ``Coordinator.agree``; ``remote`` builds the error of the ranks that did not
    fail) and the staging directory is gone.
    """
    coord = coordinator
    state_dict: dict[str, Any] = {}
    created: Path | None = None

    def prepare() -> tuple[str | None, bool, Any, str]:
        nonlocal state_dict, created
        skip = False
        if coord.is_leader:
            skip = exists()
            if not skip:
                try:
                    created = storage.begin(step)
                except OSError as exc:
                    raise CheckpointSaveError(
                        f"saving step {step} failed: cannot create the staging directory: {exc}"
                    ) from exc
        state_dict, shared = collect()
        return None if created is None else created.name, skip, shared, socket.gethostname()

    try:
        reports = coord.agree_all(prepare, catch=(Exception,), remote=remote)
        name, skip, _shared, _host = reports[0]
        return OpenedSave(
            step=step,
            staging=None if skip or name is None else storage.path_of(name),
            state_dict=state_dict,
            shared=[shared for _n, _s, shared, _h in reports],
            hosts=[host for _n, _s, _sh, host in reports],
        )
    except BaseException:
        if created is not None:
            # The leader made the directory before a rank failed (or an interrupt
            # came): nothing will be written.
            storage.abort(created)
        raise


def write_and_commit(
    storage: CheckpointStorage,
    opened: OpenedSave,
    manifest_fields: Mapping[str, Any],
    *,
    coordinator: Coordinator | None = None,
    templates: RecordTemplates | None = None,
    plans: SavePlanCache | None = None,
    pack: bool = False,
) -> SaveResult:
    """THE COMMIT PROTOCOL: write ``opened`` into its staging directory and commit it.

    A checkpoint exists only once this returns. Collective over
    ``coordinator`` (a single process passes None), two collectives:

    1. (``open_save``, before this) the leader created the staging directory.
    2. Every rank writes its own files with DCP, hashing them as written, and fsyncs them.
    3. Every rank reports its files (sizes, xxh3-128) or its error: one gather.
    4. The leader builds the manifest, once, with every rank's files and
       ``manifest_fields``, and commits it (``commit_checkpoint``): MANIFEST.json
       into staging, fsynced, then published.
    5. Every rank learns the outcome: one gather.

    ``templates`` (kept by the caller across saves) lets the writer reuse the
    ``torch.save`` framing of tensor layouts it has written before, and
    ``plans`` (kept likewise) DCP's global plan, ``.metadata`` and small
    values while the state's layout is unchanged (``stalwart.save_plan``).
    ``pack``: a save in the background, of the staging area's buffers, whose
    data files may be packed and whose prepared records are reused
    (``ChecksummingWriter``'s ``pack`` and ``staged``).

    On any failure, on any rank, every rank raises ``CheckpointSaveError``
    (cause chained), the staging directory is removed and nothing is committed;
    earlier checkpoints are never touched. A dead or hung rank makes the others
    fail after the coordinator's timeout instead of waiting forever. A
    checkpoint without a valid manifest does not exist: readers ignore it, and
    ``stalwart gc`` sweeps it.
    """
    coord = coordinator if coordinator is not None else Coordinator(None, timeout=0.0, name="local")
    templates = templates if templates is not None else RecordTemplates()
    plans = plans if plans is not None else SavePlanCache()
    step, staging = opened.step, opened.staging
    assert staging is not None, "a skipped save has nothing to write"
    try:
        # 2. + 3. Write, fsync and checksum this rank's files; every rank reports.
        t0 = time.perf_counter()
        timing: dict[str, float] = {}
        try:
            reports = coord.agree_all(
                lambda: _write_mine(
                    opened.state_dict, staging, coord, step, timing, templates, plans, pack
                ),
                catch=(CheckpointSaveError,),
                remote=lambda rep: CheckpointSaveError(rep.message),
            )
        except BaseException:
            if coord.is_leader:
                storage.abort(staging)
            raise
        t1 = timing.get("written", t0)
        t2 = time.perf_counter()
        files = sorted((e for entries in reports for e in entries), key=lambda e: e.path)

        # 4. + 5. The manifest, built once with its files; the leader commits; all learn.
        def commit() -> str | None:
            if not coord.is_leader:
                return None
            manifest = Manifest(step=step, files=files, **manifest_fields)
            try:
                return commit_checkpoint(storage, staging, manifest).name
            except (OSError, StalwartError, ValueError) as exc:
                storage.abort(staging)
                raise CheckpointSaveError(
                    f"committing step {step} failed: {type(exc).__name__}: {exc}"
                ) from (_find_os_error(exc) or exc)

        final_name = coord.agree_all(
            commit,
            catch=(CheckpointSaveError,),
            remote=lambda rep: CheckpointSaveError(rep.message),
        )[0]
        assert final_name is not None
    except CoordinationError as exc:
        if coord.is_leader:
            # The others may still be writing; a leftover file in a hidden staging
            # directory is harmless (never restored, swept by gc).
            storage.abort(staging)
        raise CheckpointSaveError(f"saving step {step} failed: {exc}") from exc
    return SaveResult(
        step=step,
        path=storage.path_of(final_name),
        bytes=sum(e.size for e in files),
        files=len(files),
        write_s=t1 - t0,
        checksum_s=t2 - t1,
        commit_s=time.perf_counter() - t2,
    )


def _write_mine(
    state_dict: dict[str, Any],
    staging: Path,
    coord: Coordinator,
    step: int,
    timing: dict[str, float],
    templates: RecordTemplates,
    plans: SavePlanCache,
    pack: bool,
) -> list[FileEntry]:
    """Write this rank's part with DCP through ``ChecksummingWriter``: its files, fsynced, with checksums.

    Any failure is raised as ``CheckpointSaveError`` naming the step (and the
    rank, distributed), its OS-level cause chained.
    """
    try:
        try:
            writer = ChecksummingWriter(
                staging,
                threads=WRITER_THREADS,
                templates=templates,
                plans=plans,
                pack=pack,
                staged=pack,  # a save in the background writes the staging area's buffers
            )
            try:
                with warnings.catch_warnings(), without_zip_crc():
                    # DCP warns that it runs without a process group; here that is the intent.
                    warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
                    dcp_save(
                        state_dict,
                        storage_writer=writer,
                        planner=CachingSavePlanner(plans, settings=record_settings()),
                        process_group=coord.group,
                        no_dist=not coord.distributed,
                    )
                writer.sync()
            finally:
                writer.close()
        except CheckpointException as exc:
            raise_interrupt(exc)
            raise CheckpointSaveError(_first_failure(exc)) from (_find_os_error(exc) or exc)
        timing["written"] = time.perf_counter()
        # Each file was hashed while it was written and is fsynced: nothing is read back.
        entries = list(writer.written)
        if coord.is_leader:
            entries += _foreign_files(staging, {e.path for e in entries})
        return sorted(entries, key=lambda e: e.path)
    except (OSError, StalwartError, ValueError, TypeError, RuntimeError) as exc:
        where = f" on rank {coord.rank}" if coord.distributed else ""
        raise CheckpointSaveError(
            f"saving step {step} failed{where}: {type(exc).__name__}: {exc}"
        ) from (_find_os_error(exc) or exc)


def _foreign_files(directory: Path, known: set[str]) -> list[FileEntry]:
    """Hash and fsync the files in ``directory`` that DCP did not write (a framework
    adapter's own files, written and fsynced by their ranks before this save): the
    leader lists them in the manifest so they are committed and verified like the rest.

    Each is opened as restore opens it (``open_checkpoint_file``): a symbolic link
    (to a file or a folder) raises ``OSError`` (ELOOP) and a FIFO or device
    ``CheckpointCorruptError``, so nothing outside the staging directory is
    committed and the save never waits on a FIFO."""
    entries = []
    for root, dirs, names in os.walk(directory):
        # os.walk does not descend into a link to a folder: open it to refuse it by name.
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        for name in [*names, *links]:
            rel = (Path(root) / name).relative_to(directory).as_posix()
            if rel in known or _DCP_DATA_FILE.match(rel):
                continue
            if rel in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
                # The commit writes this name: the manifest would list itself, then be replaced.
                raise CheckpointSaveError(
                    f"{Path(root) / name}: {rel} is written by the commit; a framework's "
                    "files in the staging directory must use other names"
                )
            size, digest = hash_file(rel, within=directory)
            with open_checkpoint_file(directory, rel) as stream:
                os.fsync(stream.fileno())
            entries.append(FileEntry(path=rel, size=size, xxh3_128=digest))
    return entries


def _first_failure(exc: CheckpointException) -> str:
    for rank, (inner, _trace) in sorted(exc.failures.items()):
        os_error = _find_os_error(inner)
        # torch's zip writer turns ENOSPC/EFBIG into "unexpected pos"; name the real cause.
        detail = (
            f" (caused by {type(os_error).__name__}: {os_error})" if os_error is not None else ""
        )
        return f"rank {rank}: {type(inner).__name__}: {inner}{detail}"
    return str(exc)


def _find_os_error(exc: BaseException | None) -> OSError | None:
    """The first OSError in the cause/context chain of ``exc`` (DCP failures included)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc] if exc is not None else []
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            stack.extend(inner for inner, _trace in e.failures.values())
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


# --------------------------------------------------------------------------- load


def _agree(coord: Coordinator, what: Callable[[], T]) -> T:
    """Run ``what`` on every rank; if it raised a stalwart error on any rank, raise it on all."""
    return coord.agree(what)


def load_checkpoint(
    path: Path, state: Restorable, *, strict: bool = True, coordinator: Coordinator | None = None
) -> Manifest:
    """Verify, then load the checkpoint at ``path`` into ``state`` without running checkpoint code.

    ``state`` is a ``TrainState`` or any other ``Restorable``; it is asked for
    one ``RestorePlan``, driven here through files -> metadata -> staged read
    -> check -> in-place read -> apply (see ``stalwart.restore_protocol``).
    Each file is read once and checked in memory before any of it is
    deserialized; both reads are served from those bytes (``stalwart.reader``).
    Collective over ``coordinator``: ranks share the checksumming, and an error
    found by any rank (corruption, unsafe content, mismatched keys) is raised on
    every rank, before anything live is modified; only a file written to
    after its check (``stalwart.streamed``) can be found while tensors are read
    into place, and that error has ``live_modified`` set. An error while the loaded
    values are put into the live objects (a component's ``load_state_dict``
    raising on one rank) is raised on every rank too, as ``StateMismatchError``:
    no rank goes on training while another stopped.
    """
    with gc_paused():
        return _load_checkpoint(path, state, strict=strict, coordinator=coordinator)


def _load_checkpoint(
    path: Path, state: Restorable, *, strict: bool, coordinator: Coordinator | None
) -> Manifest:
    coord = coordinator if coordinator is not None else Coordinator(None, timeout=0.0, name="local")

    # Each file is read once: checked in memory here (or when first needed),
    # then DCP reads from those bytes (stalwart.reader). The data files are
    # still being checked when this returns: see gate() below.
    opened: list[VerifiedFiles] = []

    def verify() -> tuple[VerifiedFiles, Metadata]:
        found = verified_checkpoint(path, part=(coord.rank, coord.world_size), wait=False)
        opened.append(found[0])
        return found

    group = coord.group if coord.distributed else None

    def read(target: dict[str, Any]) -> None:
        if target:
            reader = VerifiedFileReader(path, files=files, metadata=metadata)
            _agree(
                coord,
                lambda: safe_load(
                    target, path, process_group=group, metadata=metadata, reader=reader
                ),
            )

    def gate() -> None:
        # The plan's work that needs only the metadata runs while the data files
        # are checked (hashing and reading release the GIL). A damaged file is
        # still the reason given first, before anything the plan found. Measured
        # alternately against waiting for the checks first (median of the pairs'
        # time ratios): a restart's restore of 256 MiB (a fresh model and
        # optimizer, whose state the plan builds from the metadata) 0.85 cold
        # (16 pairs), 0.98 warm; into live objects and at 64 MiB 0.97-1.01.
        prepare = getattr(plan, "prepare", None)
        try:
            if prepare is not None:
                prepare()
        except Exception:
            files.wait_streamed()
            raise
        # (An interrupt is not replaced by what the checks found: it stops the restore.)
        files.wait_streamed()

    try:
        files, metadata = _agree(coord, verify)
        plan = state.plan_restore(metadata, strict=strict)
    except BaseException:
        # Another rank's failure, or an interrupt after this rank's files were
        # opened: their checks run on, each holding its file, until closed.
        for found in opened:
            found.close()
        raise
    manifest = files.manifest
    try:
        _agree(coord, gate)
        staged = plan.staged()
        read(staged)
        _agree(coord, lambda: plan.check(staged))
        in_place = plan.in_place()
        try:
            read(in_place)
        except CheckpointCorruptError as exc:
            # Found while reading into the live tensors (a file written to or cut
            # short after its check, an I/O error): some may hold this checkpoint's
            # values already. The caller must not take the state as untouched.
            exc.live_modified = True
            raise
    except BaseException:
        # Another rank's failure reaches this one here too: its plan, which
        # passed its own check, undoes what it did to the live objects.
        plan.discard()
        raise
    finally:
        files.close()

    def apply() -> None:
        try:
            plan.apply({**staged, **in_place})
        except StalwartError:
            raise
        except Exception as exc:
            raise StateMismatchError(
                f"loading {path} into the state failed: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}; the live state may be partly "
                "restored, so every rank stops here. Build the state as it was when saved"
            ) from exc

    # A component's load_state_dict can fail on one rank only (a shape error in
    # its own per-rank values, a user object that raises): every rank must stop
    # here together, never leave the others training out of step.
    _agree(coord, apply)
    return manifest
