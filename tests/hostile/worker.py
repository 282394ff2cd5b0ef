"""Runs restore and verify on hostile run directories, one case per line of stdin.

Started by ``harness.Worker`` as ``python -m tests.hostile.worker LIMIT_BYTES``.
Its address space is capped at LIMIT_BYTES (RLIMIT_AS), so a reader that tries
to allocate what a crafted checkpoint declares fails here instead of taking the
machine. Each input line is a JSON case, each answer one ``@@ {json}`` line on
stdout (anything else on stdout is the library's or torch's own output):

- ``{"op": "restore", "run": DIR}``: ``CheckpointManager(DIR).restore`` into a
  fresh state; answers the step restored (or None) and a digest of the weights,
  or the exception that escaped.
- ``{"op": "cli", "argv": [...]}``: the ``stalwart`` CLI (``verify DIR``,
  ``inspect DIR``, ``ls RUN``); answers its exit code and output.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import resource
import sys
import traceback
from typing import Any

import torch

import stalwart
from stalwart.cli.main import main as cli_main

from ..conftest import make_parts

MARK = "@@ "


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the model's tensors: which step's weights a restore brought back."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def restore(run: str) -> dict[str, Any]:
    torch.manual_seed(12345)  # a restarted process starts from other weights
    parts = make_parts()
    with stalwart.CheckpointManager(run, keep_last=None, handle_signals=False) as ckpt:
        step = ckpt.restore(parts.state)
    return {"outcome": "restored", "step": step, "digest": weights_digest(parts.model)}


def cli(argv: list[str]) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    return {"outcome": "exited", "code": code, "out": out.getvalue(), "err": err.getvalue()}


def peak_bytes() -> int:
    """Peak virtual memory of this process so far (VmPeak), what RLIMIT_AS caps."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) * 1024
    return -1


def answer(case: dict[str, Any]) -> dict[str, Any]:
    try:
        result = restore(case["run"]) if case["op"] == "restore" else cli(case["argv"])
    except BaseException as exc:  # everything that escapes is the finding
        result = {
            "outcome": "raised",
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc)[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    result["peak_bytes"] = peak_bytes()
    return result


def serve() -> None:
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(MARK + json.dumps(answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    serve()
