"""The exact-resume certificate: a fingerprint of every step, and a verdict after a restore.

A restore that loads every byte it saved is still not an exact resume when the
training loop holds something across the save that the checkpoint does not:
nanoGPT's ``get_batch`` draws the next batch from the global RNG *before* the
save, so the saved RNG is past a batch the checkpoint does not hold, and the
resumed run trains on other data. Nothing fails; only the numbers differ.

So stalwart checks instead of assuming. Every ``CheckpointManager.save`` call
(made every step, saving or not) records a fingerprint of the step that just
ended, on every rank:

- the losses the user reports (``metrics`` keys that contain ``loss``; other
  metrics such as timings legitimately differ between runs),
- a digest of the sample indices and of the batch content the loop consumed
  since the previous call, when the data comes through
  ``ResumableDataLoader`` (or the position of a ``ResumableSampler``),
- a digest of every global RNG state at the step's end (python, numpy,
  torch CPU, each CUDA device in use): a few microseconds.

Fingerprints go to an append-only log per rank and per attempt (one process
start), ``<run>/fingerprints/rank-00001/<attempt>.jsonl``: one ``os.write`` of
one line per step, no fsync (a killed process loses nothing the kernel has; a
power loss only loses the certificate, never a checkpoint). Each log is bounded
(:data:`MAX_RECORDS` lines, then it starts over in a second segment, keeping
one previous segment), and only the newest :data:`KEEP_ATTEMPTS` attempts of
a rank are kept.

After a restore at step ``s``, the steps after ``s`` that the lost attempt
recorded are trained again. Each rank compares their fingerprints with the
lost attempt's as they come; the ranks agree on the verdict through the one
small all-reduce the manager already runs in every ``save`` (and one gather of
the details, only on a divergence). The verdict is ``resume verified exact
through step k`` or ``resume diverged at step k on rank r: loss a vs b; batch
same/different/unknown; RNG same/different`` with the likely cause.

Plain data and files; no torch.distributed (the manager runs the collective).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import math
import os
import random
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from stalwart.layout import FINGERPRINT_DIR
from stalwart.loader import ResumableDataLoader
from stalwart.rng import cuda_in_use, numpy_module
from stalwart.sampler import ResumableSampler

__all__ = [
    "FINGERPRINT_DIR",
    "Certificate",
    "Divergence",
    "Fingerprint",
    "Verdict",
    "rng_digest",
]

logger = logging.getLogger("stalwart")

MAX_RECORDS = 20_000
"""Lines in one segment of an attempt's log before it starts over (bounds its size)."""
KEEP_ATTEMPTS = 8
"""Attempt logs kept per rank; older ones are deleted when a new attempt starts."""
_FORMAT = 1
_MT_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos
_MAX_LOG_BYTES = MAX_RECORDS * 4096
"""A segment larger than this was not written here (a record is about 200 bytes)."""


def rng_digest() -> str:
    """A 64-bit digest (hex) of every global RNG state of this process; does not advance any.

    Covers python ``random``, numpy's global generator (when numpy is
    installed), torch's CPU generator and each CUDA device's generator when
    CUDA is initialised here (reading those synchronises nothing: the states
    live on the host).
    """
    h = xxhash.xxh3_64()
    h.update(torch.get_rng_state().numpy().tobytes())
    # hash() of a tuple of ints is the same in every process (ints are not hash-randomised;
    # None is, before python 3.12, so gauss_next goes in as text).
    _, internal, gauss_next = random.getstate()
    h.update(hash(internal).to_bytes(8, "little", signed=True))
    h.update(repr(gauss_next).encode())
    np = numpy_module()
    if np is not None:
        h.update(_numpy_state_bytes(np))
    if cuda_in_use():
        for state in torch.cuda.get_rng_state_all():
            h.update(state.numpy().tobytes())
    return h.hexdigest()


def _numpy_state_bytes(np: Any) -> bytes:
    """The raw state of numpy's global MT19937 (624 key words and the position).

    Read through the bit generator's ctypes view of its C struct, in about a
    microsecond; ``np.random.get_state()`` builds Python objects and takes a
    hundred times longer. Falls back to it for another global bit generator. The
    legacy cached gaussian is left out: it cannot differ while the stream's
    position is the same, short of an odd count of legacy gaussian draws.
    """
    bit_generator = np.random.mtrand._rand._bit_generator
    if type(bit_generator).__name__ == "MT19937":
        return ctypes.string_at(bit_generator.ctypes.state_address, _MT_STATE_BYTES)
    return repr(np.random.get_state(legacy=False)).encode()


def data_digests(data: Any) -> tuple[str | None, str | None]:
    """(indices digest, content digest) of what the loop consumed since the last call, or Nones.

    Known only when the data comes through stalwart: a ``ResumableDataLoader``
    (the batches its iterator returned) or a ``ResumableSampler`` (its position).
    """
    if isinstance(data, ResumableDataLoader):
        return data.take_fingerprint()
    if isinstance(data, ResumableSampler):
        return data.position_digest(), None
    return None, None


def _losses(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The reported metrics a resume must reproduce: numeric ones whose name contains ``loss``."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if (
            "loss" in key.lower()
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        ):
            out[key] = float(value)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    """What one step on one rank looked like at its end."""

    step: int
    losses: dict[str, float]
    rng: str
    batch: str | None = None
    content: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "losses": self.losses,
            "rng": self.rng,
            "batch": self.batch,
            "content": self.content,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fingerprint:
        step, losses, rng = data["step"], data["losses"], data["rng"]
        if not (isinstance(step, int) and isinstance(losses, dict) and isinstance(rng, str)):
            raise ValueError(f"not a fingerprint: {data!r}")
        batch, content = data.get("batch"), data.get("content")
        return cls(
            step=step,
            losses={str(k): float(v) for k, v in losses.items()},
            rng=rng,
            batch=batch if isinstance(batch, str) else None,
            content=content if isinstance(content, str) else None,
        )


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    """The first redone step whose fingerprint differs from the lost attempt's, on one rank."""

    step: int
    rank: int
    metric: str | None
    before: float | None
    after: float | None
    batch: str  # "same", "different" or "unknown"
    rng: str  # "same" or "different"

    @property
    def cause(self) -> str:
        """The likely reason, from which parts of the fingerprint differ."""
        if self.batch == "different":
            return (
                "the loop consumed other data than the lost attempt at this step: the data "
                "position was not restored, or a batch prefetched before the save is not in "
                "the checkpoint (see docs/porting.md)"
            )
        if self.rng == "different":
            return (
                "something drew from the RNG that the checkpoint does not hold, e.g. a batch "
                "drawn before the save (nanoGPT's get_batch prefetch) or an RNG not in the "
                "TrainState; draw the batch after the save (see docs/porting.md)"
            )
        return (
            "same data and RNG, different loss: state the checkpoint does not hold (a value "
            "kept across the save, per-rank state, EMA weights) or nondeterministic kernels "
            "(see docs/porting.md)"
        )

    def line(self) -> str:
        if self.metric is None:
            loss = "loss same"
        else:
            loss = f"{self.metric} {self.before!r} vs {self.after!r}"
        return (
            f"resume diverged at step {self.step} on rank {self.rank}: {loss}; batch "
            f"{self.batch}; RNG {self.rng}: {self.cause}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "metric": self.metric,
            "before": self.before,
            "after": self.after,
            "batch": self.batch,
            "rng": self.rng,
            "cause": self.cause,
        }


def compare(before: Fingerprint, after: Fingerprint, *, rank: int) -> Divergence | None:
    """None when ``after`` (the redone step) matches ``before`` (the lost attempt's), else why not."""
    metric = None
    for key in sorted(before.losses.keys() & after.losses.keys()):
        if not _same_float(before.losses[key], after.losses[key]):
            metric = key
            break
    pairs = [(before.batch, after.batch), (before.content, after.content)]
    known = [(a, b) for a, b in pairs if a is not None and b is not None]
    batch = "unknown" if not known else ("same" if all(a == b for a, b in known) else "different")
    rng = "same" if before.rng == after.rng else "different"
    if metric is None and batch != "different" and rng == "same":
        return None
    return Divergence(
        step=after.step,
        rank=rank,
        metric=metric,
        before=None if metric is None else before.losses[metric],
        after=None if metric is None else after.losses[metric],
        batch=batch,
        rng=rng,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What the ranks agreed on after a restore at ``restored``."""

    event: str  # "resume_verified", "resume_diverged" or "resume_unverified"
    restored: int
    world_size: int
    through: int | None = None
    divergence: Divergence | None = None
    reason: str | None = None

    def line(self) -> str:
        if self.divergence is not None:
            return self.divergence.line()
        if self.event == "resume_verified":
            ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
            return f"resume verified exact through step {self.through} on {ranks}"
        return f"resume from step {self.restored} not verified: {self.reason}"

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"restored_step": self.restored, "world_size": self.world_size}
        if self.through is not None:
            out["through"] = self.through
        if self.divergence is not None:
            out.update(self.divergence.to_json())
            del out["cause"]  # the message says it, once
        if self.reason is not None:
            out["reason"] = self.reason
        out["message"] = self.line()
        return out


class _AttemptLog:
    """One rank's append-only fingerprint log for this attempt, in bounded segments."""

    def __init__(self, folder: Path, name: str, header: dict[str, Any]) -> None:
        self.folder = folder
        self.path = folder / f"{name}.jsonl"
        self.header = header
        self._fd: int | None = None
        self._lines = 0
        self._broken = False

    def append(self, record: Mapping[str, Any]) -> None:
        if self._broken:
            return
        try:
            if self._fd is None or self._lines >= MAX_RECORDS:
                self._open_segment()
            assert self._fd is not None
            os.write(self._fd, (json.dumps(record, allow_nan=True) + "\n").encode())
            self._lines += 1
        except OSError as exc:
            # The certificate is a diagnostic: a full disk must fail the save that needs
            # the space, never the training step around it.
            self._broken = True
            logger.warning("fingerprint log %s disabled: %s", self.path, exc)

    def _open_segment(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            # One previous segment is kept: a restore compares only the steps after the
            # newest checkpoint, which are far fewer than MAX_RECORDS.
            os.replace(self.path, self.path.with_suffix(".prev.jsonl"))
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o644)
        os.write(self._fd, (json.dumps(self.header) + "\n").encode())
        self._lines = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_log(path: Path) -> tuple[dict[str, Any] | None, list[Fingerprint]]:
    """Header and fingerprints of one segment; torn or garbled lines are skipped."""
    header: dict[str, Any] | None = None
    out: list[Fingerprint] = []
    try:
        # The run directory is input from outside: no symlink, no FIFO to block on,
        # no file larger than a log this module can have written.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_LOG_BYTES:
            os.close(fd)
            logger.warning("ignoring %s: not a fingerprint log this run wrote", path)
            return None, []
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    data = json.loads(line)
                    if "format" in data:
                        header = data
                    else:
                        out.append(Fingerprint.from_json(data))
                except (ValueError, TypeError, KeyError):
                    continue
    except OSError as exc:
        logger.debug("cannot read fingerprint log %s: %s", path, exc)
    return header, out


def read_attempt(folder: Path, name: str) -> tuple[dict[str, Any] | None, list[Fingerprint]]:
    """An attempt's header and fingerprints (previous segment first), as written."""
    header, prev = _read_log(folder / f"{name}.prev.jsonl")
    head2, cur = _read_log(folder / f"{name}.jsonl")
    return head2 or header, prev + cur


def _attempt_names(folder: Path) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted({n.split(".", 1)[0] for n in names if n.endswith(".jsonl")})


class Certificate:
    """One rank's fingerprints of this attempt and, after a restore, the comparison.

    Owned by ``CheckpointManager``; used from the training thread only. The
    manager calls :meth:`record` in every ``save``, passes :meth:`flags` into
    the all-reduce it runs there anyway, then :meth:`settle` with the reduced
    values on every rank.
    """

    def __init__(self, directory: Path, *, rank: int, world_size: int) -> None:
        self.folder = directory / FINGERPRINT_DIR / f"rank-{rank:05d}"
        self.rank = rank
        self.world_size = world_size
        self._begin()

    def _begin(self) -> None:
        """Start an attempt: a new log, nothing to compare yet."""
        # Sortable by start time: the newest earlier attempt is the one a restore lost.
        self.attempt = f"{time.time_ns():020d}-{os.getpid()}"
        self._log = _AttemptLog(
            self.folder,
            self.attempt,
            {
                "format": _FORMAT,
                "attempt": self.attempt,
                "rank": self.rank,
                "world_size": self.world_size,
            },
        )
        self._expected: dict[int, Fingerprint] = {}
        self._last_expected = -1
        self._restored: int | None = None
        self._through = -1
        self._seen = -1
        self._divergence: Divergence | None = None
        self._skip_reason: str | None = None
        self.verdict: Verdict | None = None
        """The agreed verdict of the last restore, once known (None before)."""
        self._pruned = False
        self._last_recorded = -1

    def _prune(self) -> None:
        names = [n for n in _attempt_names(self.folder) if n != self.attempt]
        for old in names[: max(len(names) - (KEEP_ATTEMPTS - 1), 0)]:
            for suffix in (".jsonl", ".prev.jsonl"):
                try:
                    (self.folder / f"{old}{suffix}").unlink(missing_ok=True)
                except OSError as exc:
                    logger.debug("cannot delete old fingerprint log %s: %s", old, exc)

    # --- after a restore -------------------------------------------------------------

    def expect(self, restored: int) -> None:
        """Start verifying the steps after ``restored`` against the newest earlier attempt that ran them.

        A restore within this attempt after it restored once, or after it
        recorded ``restored`` or a later step, is a deliberate rollback
        (``stalwart.Guard``), not a resume: the steps after it are trained on
        other data by design. Then only the steps up to ``restored`` still count
        for a comparison in progress, and no new one starts.
        """
        if self._restored is not None or self._last_recorded >= restored:
            self._expected = {s: fp for s, fp in self._expected.items() if s <= restored}
            self._last_expected = min(self._last_expected, restored)
            self._skip_reason = (
                f"a rollback to step {restored} within this attempt came before any redone "
                "step was compared"
            )
            return
        self._expected, self._last_expected = {}, -1
        self._through, self._seen, self._divergence, self._skip_reason = -1, -1, None, None
        self._restored, self.verdict = restored, None
        for name in reversed(_attempt_names(self.folder)):
            if name >= self.attempt:
                continue
            header, records = read_attempt(self.folder, name)
            later = {fp.step: fp for fp in records if fp.step > restored}
            if not later:
                continue
            saved_world = header.get("world_size") if header else None
            if saved_world != self.world_size:
                self._skip_reason = (
                    f"the lost attempt ran on {saved_world} ranks, this one on "
                    f"{self.world_size}: per-rank steps are not comparable"
                )
                return
            self._expected = later
            self._last_expected = max(later)
            return
        self._skip_reason = f"no earlier attempt recorded a step after step {restored}"

    @property
    def active(self) -> bool:
        """True from a restore until the ranks agreed on its verdict."""
        return self._restored is not None and self.verdict is None

    # --- every step ------------------------------------------------------------------

    def record(self, step: int, data: Any, metrics: Mapping[str, Any]) -> None:
        """Fingerprint the step that just ended (``step``), log it, and compare it when redone."""
        batch, content = data_digests(data)
        fp = Fingerprint(
            step=step, losses=_losses(metrics), rng=rng_digest(), batch=batch, content=content
        )
        if not self._pruned:
            # Only an attempt that logs makes room: one that only restores (restore-test,
            # a notebook) leaves the history as it is.
            self._pruned = True
            self._prune()
        self._log.append(fp.to_json())
        self._last_recorded = max(self._last_recorded, step)
        if not self.active or self._divergence is not None:
            return
        self._seen = max(self._seen, step)
        before = self._expected.get(step)
        if before is None:
            return
        self._divergence = compare(before, fp, rank=self.rank)
        if self._divergence is None:
            self._through = max(self._through, step)

    def flags(self) -> tuple[int, int, int]:
        """(diverged, pending, verified-through step) of this rank, for the manager's all-reduce."""
        if not self.active:
            return 0, 0, -1
        diverged = self._divergence is not None
        # Done once the run is past the lost attempt's last step, compared or not (a loop
        # may call save at other steps than the lost attempt did).
        pending = not diverged and self._seen < self._last_expected
        return int(diverged), int(pending), self._through

    def settle(
        self,
        diverged: int,
        pending: int,
        through: int,
        gather: Callable[[Any], list[Any]],
    ) -> Verdict | None:
        """Turn the all-reduced flags into the verdict, identically on every rank.

        ``gather`` is the manager's all-gather; it is called (on every rank
        together) only when some rank diverged, to learn where. Returns the
        verdict when it is new, else None.
        """
        if not self.active:
            return None
        restored = self._restored
        assert restored is not None
        if diverged:
            reports = gather(None if self._divergence is None else self._divergence.to_json())
            found = [r for r in reports if r is not None]
            first = min(found, key=lambda r: (r["step"], r["rank"]))
            first.pop("cause", None)
            self.verdict = Verdict(
                "resume_diverged", restored, self.world_size, divergence=Divergence(**first)
            )
        elif pending:
            return None
        elif through >= 0:
            self.verdict = Verdict("resume_verified", restored, self.world_size, through=through)
        else:
            self.verdict = Verdict(
                "resume_unverified",
                restored,
                self.world_size,
                reason=self._skip_reason or "no redone step was recorded",
            )
        return self.verdict

    def finish(self) -> Verdict | None:
        """At close, a verdict still pending: verified through the last step redone so far, if any.

        Local (no collective): the run stopped before it redid every step the lost
        attempt ran, so this rank's own comparisons are all there is.
        """
        if not self.active or self._divergence is not None or self._through < 0:
            return None
        assert self._restored is not None
        self.verdict = Verdict(
            "resume_verified",
            self._restored,
            self.world_size,
            through=self._through,
            reason=f"the run stopped before redoing step {self._last_expected}",
        )
        return self.verdict

    def close(self) -> None:
        self._log.close()

    def restart(self) -> None:
        """Close this attempt's log and begin a new attempt with nothing to compare: after
        a rollback moved the logs aside with the steps it abandoned (``stalwart.rollback``)."""
        self._log.close()
        self._begin()
