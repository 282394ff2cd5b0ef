"""A restore's reads of checked tensor data onto a CUDA device, through pinned memory.

A CPU target is read straight into (``StreamedFile.read_many``). A GPU target
cannot be: its bytes go through host memory. Read into a fresh pageable tensor
and copied with ``copy_``, they cost the new pages' faults, a copy from
pageable memory (staged again by the driver) and a wait for each tensor's copy
before the next is read. Here instead two pinned host buffers take turns: the
reader threads fill one while the device copies the other, each copy
``non_blocking`` on the target's current stream, and the function returns once
every copy is complete. Extra host memory is the two buffers (``BOUNCE`` bytes
each, or the largest target's size if smaller), not a checkpoint's size.
"""

from __future__ import annotations

import torch

from stalwart.streamed import StreamedFile

__all__ = ["BOUNCE", "read_to_device"]

BOUNCE = 32 * 1024 * 1024
"""Bytes per pinned buffer: large enough that a copy's fixed cost is small,
small enough that pinning the two stays cheap."""


def _buffers(nbytes: int) -> list[torch.Tensor]:
    try:
        return [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    except RuntimeError:
        # Pinning refused (a locked-memory limit): pageable buffers, the same reads.
        return [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]


def read_to_device(checked: StreamedFile, reads: list[tuple[torch.Tensor, int]]) -> None:
    """Fill each ``(target, offset)``, a contiguous CUDA tensor, with ``checked``'s raw
    bytes from ``offset``; every copy has completed when this returns, or raised."""
    if not reads:
        return
    size = max(1, min(BOUNCE, max(target.nbytes for target, _ in reads)))
    buffers = _buffers(size)
    views = [buf.numpy().data for buf in buffers]
    events: list[torch.cuda.Event | None] = [None, None]
    turn = 0
    try:
        for target, offset in reads:
            flat = target.reshape(-1).view(torch.uint8)
            stream = torch.cuda.current_stream(target.device)
            for done in range(0, flat.numel(), size):
                n = min(size, flat.numel() - done)
                k = turn % 2
                turn += 1
                last = events[k]
                if last is not None:
                    last.synchronize()  # that buffer's last copy has left it
                checked.read_many([(views[k][:n], offset + done)])
                with torch.cuda.stream(stream):
                    flat[done : done + n].copy_(buffers[k][:n], non_blocking=True)
                    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    copied.record(stream)
                events[k] = copied
    finally:
        # Also on an error: no copy may still read a buffer that is given back.
        for left in events:
            if left is not None:
                left.synchronize()
