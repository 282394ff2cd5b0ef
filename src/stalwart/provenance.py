"""Where a checkpoint came from: the manifest fields that describe the run, not the bytes.

Versions, the git commit of the training code, user metadata and config (with
its hash), the hosts of the ranks and how the state is laid out across them.
The manager computes these fields in the training thread at ``save`` time (the
layout reads the live modules); the pipeline builds the manifest once, from
these fields and the files, when the files are known.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Mapping
from typing import Any

import torch

from stalwart._version import __version__
from stalwart.manifest import git_info, stable_hash, to_json_data
from stalwart.state import TrainState

__all__ = ["Provenance", "module_layouts", "parallelism"]


def _layout(module: torch.nn.Module, world_size: int) -> str:
    """How one module is laid out across ranks: ddp, fsdp2, replicated or plain."""
    if any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in module.modules()):
        return "ddp"  # also a container (nn.ModuleDict) of DDP-wrapped modules
    if any(type(p).__name__ == "DTensor" for p in module.parameters()):
        return "fsdp2"
    # An unwrapped module: every rank holds all of it (an EMA copy, a frozen teacher).
    return "replicated" if world_size > 1 else "plain"


def module_layouts(state: TrainState, world_size: int) -> dict[str, str]:
    """The layout of every module of ``state`` by its section (``model``, ``model.G``, ``ema``)."""
    return {name: _layout(module, world_size) for name, module in state.modules.items()}


def parallelism(state: TrainState, world_size: int = 1) -> str:
    """The layout of the trained model (``model=``), for the manifest: one word, or ``mixed``."""
    return _main_layout(module_layouts(state, world_size))


def _main_layout(layouts: Mapping[str, str]) -> str:
    main = {v for k, v in layouts.items() if k == "model" or k.startswith("model.")}
    kinds = main or set(layouts.values())
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


class Provenance:
    """The run-level manifest fields, fixed when the manager opens (metadata, config, code).

    ``metadata`` and ``config`` are converted to JSON data here, so a value that
    cannot be recorded is refused when the manager is built, not at the first save.
    """

    def __init__(self, *, metadata: Mapping[str, Any] | None, config: Any) -> None:
        self.metadata = to_json_data(dict(metadata or {}), what="metadata")
        self.config = None if config is None else to_json_data(config, what="config")
        self.config_hash = None if config is None else stable_hash(self.config)
        self.code = git_info(sys.argv[0] if sys.argv and sys.argv[0] else os.getcwd())

    def fields(
        self,
        state: TrainState,
        *,
        world_size: int,
        hosts: list[str],
        metrics: dict[str, Any],
    ) -> dict[str, Any]:
        """Every manifest field but ``step`` and ``files``, for a save of ``state`` now.

        Called in the training thread: it reads the live modules' layout and
        ``state.epoch``. ``hosts`` is every rank's hostname, in rank order.
        """
        layouts = module_layouts(state, world_size)  # walks every module: once per save
        return {
            "world_size": world_size,
            "epoch": state.epoch,
            "metadata": self.metadata,
            "config": self.config,
            "config_hash": self.config_hash,
            "code": self.code,
            "versions": {
                "stalwart": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "hostname": socket.gethostname(),
            "metrics": metrics,
            "topology": {
                "world_size": world_size,
                "parallelism": _main_layout(layouts),
                "modules": layouts,
                "hosts": {str(r): h for r, h in enumerate(hosts)},
            },
        }
