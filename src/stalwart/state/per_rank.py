"""Values that may differ between ranks: their digests, and each rank's own copy back.

Values that may differ between ranks (module buffers such as BatchNorm
statistics, all of a plain module, each key of ``extra``, each stateful object)
are digested at save time; a value that differs is also written by each rank as
``per_rank.rank_<r>``, which a restore puts back in place of the shared copy
(rank 0's at a world size that lacks this rank, with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from stalwart import distributed
from stalwart.state.plain import unblob
from stalwart.state.units import get_at

__all__ = ["EXTRA_KEYS", "PER_RANK", "digest", "value_at", "with_own_blobs", "with_own_values"]

logger = logging.getLogger("stalwart")

PER_RANK = "per_rank"
"""Section of values that differ between ranks: ``per_rank.rank_<r>`` is rank r's own copy."""
EXTRA_KEYS = "keys:extra"
"""Digest key of the list of ``extra``'s keys (a rank with keys of its own saves all of it)."""


def value_at(sd: Mapping[str, Any], path: tuple[str | int, ...]) -> Any:
    """The value at ``path``; a blob section is looked into (its 1-tuple skipped)."""
    head = str(path[0])
    return get_at({head: unblob(sd.get(head))}, path)


def digest(value: Any) -> str:
    """xxh3-128 of a value's exact content (tensor bytes, dtype and shape; plain data)."""
    h = xxhash.xxh3_128()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach()
            t = t.cpu() if t.device.type != "cpu" else t
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(v, Mapping):
            h.update(b"{")
            for k, x in v.items():
                feed(k)
                feed(x)
            h.update(b"}")
        elif isinstance(v, (list, tuple)):
            h.update(b"[" if isinstance(v, list) else b"(")
            for x in v:
                feed(x)
            h.update(b"]")
        else:
            h.update(repr((type(v).__name__, v)).encode())

    feed(value)
    return h.hexdigest()


def _own_rank_entry(sd: Mapping[str, Any], *, warn: bool) -> dict[str, Any] | None:
    ranks = sd.get(PER_RANK)
    if not ranks:
        return None
    key = f"rank_{distributed.get_rank()}"
    if key not in ranks:
        if warn:
            logger.warning(
                "the checkpoint has no per-rank values for %s (saved by %d ranks); this rank "
                "takes rank 0's buffers and per-rank extra/state values, so the run is not "
                "bit-exact",
                key,
                len(ranks),
            )
        key = "rank_0"
    entry = unblob(ranks.get(key))
    return entry if isinstance(entry, dict) else None


def with_own_blobs(sd: Mapping[str, Any], *, warn: bool = False) -> dict[str, Any]:
    """``sd`` with this rank's per-rank ``extra`` values and sections in place of the shared ones."""
    own = _own_rank_entry(sd, warn=warn)
    out = dict(sd)
    if own is None:
        return out
    if own.get("extra") and "extra" in out:
        out["extra"] = ({**unblob(out["extra"]), **own["extra"]},)
    for name, value in own.get("sections", {}).items():
        if name in out:
            out[name] = (value,)
    return out


def with_own_values(sd: Mapping[str, Any]) -> dict[str, Any]:
    """``with_own_blobs`` plus this rank's own copies of module and optimizer tensors."""
    out = with_own_blobs(sd, warn=True)
    own = _own_rank_entry(sd, warn=False)
    for path, value in (own or {}).get("tensors", []):
        parent = get_at(out, tuple(path[:-1]))
        if isinstance(parent, dict) and isinstance(parent.get(path[-1]), torch.Tensor):
            parent[path[-1]] = value  # only where the state has it (strict=False may not)
    return out
