"""A direct (O_DIRECT) write that the kernel refuses: EINVAL falls back, ENOSPC fails the save.

The child process runs with the LD_PRELOAD shim (``tests/support/iofault.c``).
A first save is recorded to find the calls that are direct writes (page-sized
and page-aligned, from the page-aligned staging buffers); then one save fails
the first of them with EINVAL, what a filesystem without direct I/O answers,
and another with ENOSPC, a full disk. The first must still write a file that
checks and reads back exactly; the second must fail with the error naming the
file, as a buffered write's failure does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.iofault import build, preload_env

from .test_io_errors import run_child

CHILD = r"""
import errno, json, sys, warnings
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from stalwart.manifest import hash_file
from stalwart.staging import StagingArea
from tests.support.iofault import Shim, read_log
from tests.test_writer_direct import save

root = Path(sys.argv[1])
torch.manual_seed(0)
live = {"big": torch.randn(1024, 700), "odd": torch.randn(3, 100_003), "small": torch.randn(10)}
staged = StagingArea().stage(live)



def exact(path, written):
    checks = all((e.size, e.xxh3_128) == hash_file(path / e.path) for e in written)
    back = {k: torch.zeros_like(v) for k, v in live.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.load(back, storage_reader=FileSystemReader(path), no_dist=True)
    return checks and all(torch.equal(back[k], v) for k, v in live.items())


shim = Shim()
out = {}
(root / "rec").mkdir()
shim.arm(root / "rec", log=root / "log.tsv")
written = save(staged, root / "rec" / "ckpt")
shim.disarm()
ops = read_log(root / "log.tsv")
direct = [op for op in ops if op.op == "write" and op.size >= 2**20 and op.offset % 4096 == 0]
out["direct"] = [[op.seq, op.offset, op.size] for op in direct]
out["recorded_exact"] = exact(root / "rec" / "ckpt", written)

for name, code in (("einval", errno.EINVAL), ("enospc", errno.ENOSPC)):
    (root / name).mkdir()
    shim.arm(root / name, fail_at=direct[0].seq, errno=code)
    case = {}
    try:
        written = save(staged, root / name / "ckpt")
        case["failed_op"] = shim.failed_op()
        shim.disarm()
        case["exact"] = exact(root / name / "ckpt", written)
    except CheckpointException as exc:
        case["failed_op"] = shim.failed_op()
        shim.disarm()
        (error, _trace), = exc.failures.values()
        case["error"] = [type(error).__name__, getattr(error, "errno", None), getattr(error, "filename", None)]
    out[name] = case
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict:
    shim = build(tmp_path_factory.mktemp("iofault"))
    root = tmp_path_factory.mktemp("direct")
    return run_child(CHILD, str(root), env=preload_env(shim, OMP_NUM_THREADS="1"))


def test_the_staged_state_is_written_with_direct_writes(outcome: dict) -> None:
    # "big" in whole pages, and the whole pages of "odd" (its last partial page is buffered).
    sizes = [size for _seq, _offset, size in outcome["direct"]]
    assert len(sizes) == 2 and all(size % 4096 == 0 for size in sizes), outcome["direct"]
    assert outcome["recorded_exact"]


def test_a_filesystem_that_refuses_direct_io_gets_the_same_file_buffered(outcome: dict) -> None:
    case = outcome["einval"]
    assert case["failed_op"].startswith("write "), case  # the direct write was the one refused
    assert "error" not in case and case["exact"], case


def test_a_full_disk_on_a_direct_write_fails_the_save_naming_the_file(outcome: dict) -> None:
    case = outcome["enospc"]
    assert case["failed_op"].startswith("write "), case
    kind, err, filename = case["error"]
    assert (kind, err) == ("OSError", 28), case  # ENOSPC, as the kernel said it
    assert Path(filename).name == "__0_0.distcp"
