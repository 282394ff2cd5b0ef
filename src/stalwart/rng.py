"""Capture and restore every global random number generator a training process uses.

A bit-exact resume needs the generators to continue where they stopped: python's
``random``, numpy's global ``np.random`` (when numpy is installed), torch's CPU
generator and the generator of every CUDA device this process has initialised.

The captured state is plain data (``int``, ``float``, ``str``, ``None``, lists,
dicts with ``str`` keys) plus CPU ``torch.Tensor`` values, so it goes through
``torch.distributed.checkpoint`` and comes back with ``torch.load(weights_only=True)``
unchanged. Format (version 1)::

    {
        "version": 1,
        "python": {"version": 3, "internal": [625 ints], "gauss_next": float | None},
        "numpy": {"bit_generator": "MT19937", "key": [624 ints], "pos": int,
                  "has_gauss": int, "cached_gaussian": float},   # only with numpy
        "torch": ByteTensor,                                      # CPU generator
        "cuda": [ByteTensor, ...],                                # one per device, may be empty
    }

A checkpoint stores version 2 (:func:`packed_rng_state`): the same dict with
``internal`` and ``key`` as int64 tensors, because ``torch.save`` pickles a
list of 1,249 ints one object at a time, about half a millisecond of every
save's CPU time, and writes a tensor as raw bytes. :func:`restore_rng_state`
reads both versions.

The state is per process (per rank): a checkpoint stores one such dict per rank.

This module also holds the small helpers that run a function under a fixed seed
without disturbing the caller's streams (:func:`isolated_cpu_rng`), used by the
per-sample seeding of :mod:`stalwart.sampler`.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "capture_rng_state",
    "derive_seed",
    "isolated_cpu_rng",
    "packed_rng_state",
    "restore_rng_state",
]

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1
_PACKED_VERSION = 2
_READABLE_VERSIONS = (_FORMAT_VERSION, _PACKED_VERSION)
_MASK32 = 0xFFFF_FFFF
_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


@functools.cache
def numpy_module() -> ModuleType | None:
    """numpy when it is installed, imported on first use only (it is an optional dependency)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def cuda_in_use() -> bool:
    """True when this process has CUDA available and has already initialised it."""
    # `is_initialized` keeps capture from creating a CUDA context in a process that
    # never used CUDA (a DataLoader worker, a CPU-only run on a GPU host).
    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
    return torch.cuda.is_available() and initialized


def capture_rng_state() -> dict[str, Any]:
    """Return the state of every global generator of this process, as plain data and CPU tensors.

    Captures python ``random``, numpy's global generator (only when numpy is
    installed), torch's CPU generator and, when CUDA is available and initialised
    in this process, every CUDA device's generator (``torch.cuda.get_rng_state_all``).

    Call it from the training thread of each rank; it reads process-global state
    and is not atomic with respect to other threads drawing random numbers. It does
    not advance any generator.
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "version": _FORMAT_VERSION,
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if cuda_in_use() else [],
    }
    np = numpy_module()
    if np is not None:
        name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        state["numpy"] = {
            "bit_generator": str(name),
            "key": [int(k) for k in key.tolist()],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    return state


def packed_rng_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (from :func:`capture_rng_state`) as a checkpoint stores it: version 2.

    Python's and numpy's generator words become one int64 tensor each, which
    ``torch.save`` writes as raw bytes; :func:`restore_rng_state` takes either.
    """
    packed = dict(state, version=_PACKED_VERSION)
    py = state["python"]
    packed["python"] = dict(py, internal=torch.tensor(list(py["internal"]), dtype=torch.int64))
    if "numpy" in state:
        section = state["numpy"]
        packed["numpy"] = dict(section, key=torch.tensor(list(section["key"]), dtype=torch.int64))
    return packed


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set every global generator of this process from a dict made by :func:`capture_rng_state`.

    The draws that follow are the draws that followed the capture. Accepts the
    dict as read back by ``torch.load(weights_only=True)``.

    Tolerated differences, each logged as a warning on ``stalwart.rng``:

    - CUDA device count: a state captured with N devices restored where there are
      M restores devices ``0 .. min(N, M) - 1``; the others keep their current state
      (a resume at another world size or on another machine type is not bit-exact
      on the GPU side anyway).
    - numpy: a state without a numpy section leaves numpy's generator alone; a
      numpy section where numpy is not installed is ignored.

    Raises ``ValueError`` when the dict is not such a state (missing sections,
    another format version). Call it from the training thread of each rank,
    before the first random draw of the resumed run.
    """
    version = state.get("version")
    if version not in _READABLE_VERSIONS:
        raise ValueError(
            f"unsupported RNG state version {version!r} (this stalwart reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))}); "
            "pass a dict made by stalwart.rng.capture_rng_state"
        )
    missing = [key for key in ("python", "torch", "cuda") if key not in state]
    if missing:
        raise ValueError(
            f"RNG state lacks the section(s) {missing} (has {sorted(state)}); "
            "pass a dict made by stalwart.rng.capture_rng_state"
        )

    py = state["python"]
    words = _ints(py["internal"], "python")
    numpy_section = state.get("numpy")
    if numpy_section is not None:
        _ints(numpy_section["key"], "numpy")  # checked before any generator is set
    random.setstate((int(py["version"]), words, py["gauss_next"]))
    torch.set_rng_state(state["torch"])
    _restore_numpy(state.get("numpy"))
    _restore_cuda(list(state["cuda"]))


def _ints(values: Any, section: str) -> tuple[int, ...]:
    """A generator's words: an int64 tensor (version 2) or a list of ints (version 1)."""
    if isinstance(values, torch.Tensor):
        if values.dtype != torch.int64 or values.dim() != 1:
            raise ValueError(
                f"RNG state's {section} words are a {values.dtype} tensor of shape "
                f"{tuple(values.shape)}, not a 1-d int64 one; pass a dict made by "
                "stalwart.rng.capture_rng_state"
            )
        words = tuple(values.tolist())
    else:
        words = tuple(int(x) for x in values)
    if any(not 0 <= w <= _MASK32 for w in words):
        raise ValueError(
            f"RNG state's {section} words hold a value outside 0..2**32-1 (a generator word "
            "is 32 bits); pass a dict made by stalwart.rng.capture_rng_state"
        )
    return words


def _restore_numpy(section: Mapping[str, Any] | None) -> None:
    np = numpy_module()
    if section is None:
        if np is not None:
            logger.warning(
                "RNG state has no numpy section although numpy is installed; numpy's global "
                "generator is left as it is (the checkpoint was made without numpy)"
            )
        return
    if np is None:
        logger.warning(
            "RNG state has a numpy section but numpy is not installed; it is ignored "
            "(install numpy to restore it)"
        )
        return
    np.random.set_state(
        (
            section["bit_generator"],
            np.asarray(_ints(section["key"], "numpy"), dtype=np.uint32),
            int(section["pos"]),
            int(section["has_gauss"]),
            float(section["cached_gaussian"]),
        )
    )


def _restore_cuda(saved: list[torch.Tensor]) -> None:
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not saved and not cuda_in_use():
        return  # neither side used CUDA
    if len(saved) != here:
        logger.warning(
            "RNG state holds %d CUDA generator(s) but this process sees %d CUDA device(s); "
            "restoring devices 0..%d only, any other device keeps its current state",
            len(saved),
            here,
            min(len(saved), here) - 1,
        )
    for device, device_state in enumerate(saved[:here]):
        torch.cuda.set_rng_state(device_state, device)


# --- fixed-seed sections (per-sample seeding) --------------------------------------------


def _splitmix64(x: int) -> int:
    x = (x + 0x9E37_79B9_7F4A_7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 64-bit seed that is a fixed function of the integers ``parts`` (order matters).

    Pure python (splitmix64 chained over the parts, each taken modulo 2**64), so it
    is the same on every platform, process and version of torch or numpy.
    """
    h = 0x243F_6A88_85A3_08D3
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h


# Python's `random.seed(int)` and numpy's `seed([lo, hi])` both feed the same words to
# MT19937's init_by_array: one seed for both would make them draw identical numbers.
_NUMPY_TAG = 0x6E756D7079  # "numpy"
_TORCH_TAG = 0x746F726368  # "torch"

_CpuRngState = tuple[tuple[Any, ...], Any, torch.Tensor]


def _save_cpu_rng() -> _CpuRngState:
    np = numpy_module()
    return (
        random.getstate(),
        np.random.get_state(legacy=True) if np is not None else None,
        torch.default_generator.get_state(),
    )


def _seed_cpu_rng(seed: int) -> None:
    random.seed(seed & _MASK64)
    np = numpy_module()
    if np is not None:
        np_seed = derive_seed(_NUMPY_TAG, seed)
        np.random.seed([np_seed & _MASK32, np_seed >> 32])
    # Not torch.manual_seed: that also reseeds every CUDA device, which would disturb
    # the training process's GPU stream when the dataset runs in it (num_workers=0).
    torch.default_generator.manual_seed(derive_seed(_TORCH_TAG, seed))


def _restore_cpu_rng(saved: _CpuRngState) -> None:
    py, nps, th = saved
    random.setstate(py)
    np = numpy_module()
    if np is not None and nps is not None:
        np.random.set_state(nps)
    torch.default_generator.set_state(th)


@contextmanager
def isolated_cpu_rng() -> Iterator[Callable[[int], None]]:
    """Run a block that may reseed python ``random``, numpy's global and torch's CPU generators.

    Saves the three generators on entry and restores them on exit (also on error),
    so the caller's streams are exactly as if the block had not run. The yielded
    ``reseed(seed)`` seeds all three from one 64-bit ``seed`` (python from ``seed``,
    numpy and torch from seeds derived from it, so the three streams differ). CUDA
    generators are never touched.

    Not thread-safe: the generators are process-global. Used by
    :class:`stalwart.sampler.SeededDataset` in DataLoader workers and, with
    ``num_workers=0``, in the training process.
    """
    saved = _save_cpu_rng()
    try:
        yield _seed_cpu_rng
    finally:
        _restore_cpu_rng(saved)
