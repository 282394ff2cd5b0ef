"""A save through stalwart's writer and planner with a run's caches, as the manager makes one."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.storage import WriteResult

from stalwart.manifest import FileEntry
from stalwart.records import record_settings
from stalwart.save_plan import CachingSavePlanner, SavePlanCache
from stalwart.writer import ChecksummingWriter, RecordTemplates, without_zip_crc


def save_cached(
    sd: dict[str, object],
    path: Path,
    plans: SavePlanCache,
    templates: RecordTemplates,
    *,
    staged: bool = False,
) -> tuple[list[FileEntry], dict[str, WriteResult]]:
    """``dcp.save`` of ``sd`` into ``path`` reusing ``plans`` and ``templates`` (one writer
    thread, one data file): the files written, and that file's write results by name.
    ``staged``: ``sd``'s tensors stand for an async save's staging buffers."""
    writer = ChecksummingWriter(path, templates=templates, plans=plans, staged=staged)
    try:
        with warnings.catch_warnings(), without_zip_crc():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                sd,
                storage_writer=writer,
                planner=CachingSavePlanner(plans, settings=record_settings()),
                no_dist=True,
            )
        writer.sync()
    finally:
        writer.close()
    key = next(e.path for e in writer.written if e.path.endswith(".distcp"))
    return list(writer.written), {r.index.fqn: r for r in plans.file_results(key)}
