"""A direct (O_DIRECT) write that the kernel refuses: EINVAL falls back, ENOSPC fails the save.

The child process runs with the LD_PRELOAD shim (``tests/support/iofault.c``).
For each source of data (page-aligned staging buffers and live tensors,
64-byte aligned, both written from where they are; and a packed file, every
small record copied end to end into the bounce buffers), a
first save is recorded to find the calls that are direct writes (the writer's
own record of them, matched to the log); then saves fail the first or the last of them with
EINVAL, what a filesystem without direct I/O answers, and one the first with
ENOSPC, a full disk. The EINVAL saves must still write files that check and
read back exactly (the rest of the data buffered); the ENOSPC one must fail
with the error naming the file, as a buffered write's failure does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart import hashed_file
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
live = {
    "big": torch.randn(1024, 700),
    "odd": torch.randn(3, 100_003),
    "huge": torch.randn(2_400_003),  # 9.2 MiB: more than one bounce buffer
    "small": torch.randn(10),
}
# Packed: the small record first, so that packing starts at once (_PACK_AFTER = 0).
packed = {"small": live["small"]} | {k: v for k, v in live.items() if k != "small"}
staged = StagingArea().stage(live)
# "background": the staged state saved as a save in the background writes it (pack
# allowed, but no small record before the large ones): its gathered direct writes
# are made by the saving thread itself, not by a thread of their own.
sources = {"staged": staged, "live": live, "packed": packed, "background": staged}
in_background = ("packed", "background")

# Which calls are direct writes: the log cannot tell a pwrite on the O_DIRECT
# descriptor from a buffered write of the same size and offset, the writer can.
from stalwart import hashed_file
from stalwart import writer as writer_module
direct_calls = set()
_write_direct = hashed_file.HashedFile._write_direct


def recording_write_direct(self, fd, view, offset):
    direct_calls.add((offset, view.nbytes))
    return _write_direct(self, fd, view, offset)


_write_direct_many = hashed_file.HashedFile._write_direct_many


def recording_write_direct_many(self, fd, pieces, offset):
    direct_calls.add((offset, sum(p.nbytes for p in pieces)))
    return _write_direct_many(self, fd, pieces, offset)


framing = {}
_finish = hashed_file.HashedFile.finish


def recording_finish(self):
    entry = _finish(self)
    if self.path.suffix == ".distcp":
        framing["bytes"] = self.framing_bytes
    return entry


hashed_file.HashedFile._write_direct = recording_write_direct
hashed_file.HashedFile._write_direct_many = recording_write_direct_many
hashed_file.HashedFile.finish = recording_finish


def exact(path, written):
    checks = all((e.size, e.xxh3_128) == hash_file(path / e.path) for e in written)
    back = {k: torch.zeros_like(v) for k, v in live.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.load(back, storage_reader=FileSystemReader(path), no_dist=True)
    return checks and all(torch.equal(back[k], v) for k, v in live.items())


shim = Shim()
out = {}
for source, sd in sources.items():
    res = out[source] = {}
    # "staged" and "live" one record at a time; "packed": every record through the bounce buffers.
    writer_module._PACK_AFTER = 0 if source == "packed" else 2**62
    rec = root / source / "rec"
    rec.mkdir(parents=True)
    direct_calls.clear()
    shim.arm(rec, log=root / source / "log.tsv")
    written = save(sd, rec / "ckpt", pack=source in in_background)
    shim.disarm()
    ops = read_log(root / source / "log.tsv")
    direct = [op for op in ops if op.op == "write" and (op.offset, op.size) in direct_calls]
    res["direct"] = [[op.seq, op.offset, op.size] for op in direct]
    # Bytes before each tensor's first page boundary in memory: they go buffered.
    res["skip"] = {k: -v.data_ptr() % 4096 for k, v in sd.items() if isinstance(v, torch.Tensor)}
    res["recorded_exact"] = exact(rec / "ckpt", written)
    res["framing"] = framing["bytes"]
    res["size"] = (rec / "ckpt" / "__0_0.distcp").stat().st_size
    for name, code, which in (
        ("einval", errno.EINVAL, 0),
        ("einval_last", errno.EINVAL, -1),
        ("enospc", errno.ENOSPC, 0),
        ("enospc_last", errno.ENOSPC, -1),
    ):
        where = root / source / name
        where.mkdir()
        # The very direct write, by offset and size: the gathered writes run on a
        # thread of their own, so call numbers differ from the recording run's.
        shim.arm(where, errno=code, write_at=(direct[which].offset, direct[which].size))
        case = {}
        try:
            written = save(sd, where / "ckpt", pack=source in in_background)
            case["failed_op"] = shim.failed_op()
            shim.disarm()
            case["exact"] = exact(where / "ckpt", written)
        except CheckpointException as exc:
            case["failed_op"] = shim.failed_op()
            shim.disarm()
            (error, _trace), = exc.failures.values()
            case["error"] = [type(error).__name__, getattr(error, "errno", None), getattr(error, "filename", None)]
        except OSError as error:  # the last direct write's, raised by the fsync's wait for it
            case["failed_op"] = shim.failed_op()
            shim.disarm()
            case["error"] = [type(error).__name__, error.errno, error.filename]
        res[name] = case
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict:
    shim = build(tmp_path_factory.mktemp("iofault"))
    root = tmp_path_factory.mktemp("direct")
    return run_child(CHILD, str(root), env=preload_env(shim, OMP_NUM_THREADS="1"))


SOURCES = ["staged", "live", "packed", "background"]


def test_a_packed_file_goes_to_the_disk_in_bounce_buffers_but_its_last_partial_page(
    outcome: dict,
) -> None:
    """Every record copied end to end into the bounce buffers, but the whole pages of
    one of a bounce buffer's size or more ("huge"), written from where they are:
    all but the file's last partial page is direct."""
    case = outcome["packed"]
    sizes = [size for _seq, _offset, size in case["direct"]]
    assert all(size % 4096 == 0 for size in sizes), case["direct"]
    assert sum(sizes) == case["size"] - case["size"] % 4096, (sizes, case["size"])
    huge = (2_400_003 * 4 - case["skip"]["huge"]) // 4096 * 4096
    assert huge in sizes, sizes
    bounced = list(sizes)
    bounced.remove(huge)
    assert bounced and all(s <= hashed_file.BOUNCE_BYTES for s in bounced), sizes
    assert case["recorded_exact"]


@pytest.mark.parametrize("source", ["staged", "live", "background"])
def test_the_state_is_written_with_direct_writes(outcome: dict, source: str) -> None:
    # The whole pages of each tensor of 1 MiB or more from its first page boundary
    # in memory on (a staged one's data starts on one; a live one's 64 bytes or
    # so after one, torch's allocator), written from where they are; consecutive
    # ones in one write with the framing pages between them (the last partial
    # page, the trailer, the next header and the bytes it skips).
    case = outcome[source]
    sizes = [size for _seq, _offset, size in case["direct"]]
    assert all(size % 4096 == 0 for size in sizes), case["direct"]
    nbytes = {"big": 1024 * 700 * 4, "odd": 3 * 100_003 * 4, "huge": 2_400_003 * 4}
    skip = case["skip"]
    pages = sum((n - skip[k]) // 4096 * 4096 for k, n in nbytes.items())
    assert source == "live" or not any(skip[k] for k in nbytes)
    assert sum(sizes) == pages + case["framing"], (sizes, case)
    # Three tensors, one after another: gathered, at most three pages between two.
    assert 0 < case["framing"] <= 3 * 4096 * (len(nbytes) - 1), case
    assert len(sizes) <= 2, case
    assert case["recorded_exact"]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("which", ["einval", "einval_last"])
def test_a_filesystem_that_refuses_direct_io_gets_the_same_file_buffered(
    outcome: dict, source: str, which: str
) -> None:
    case = outcome[source][which]
    assert case["failed_op"].startswith("write "), case  # the direct write was the one refused
    assert "error" not in case and case["exact"], case


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("which", ["enospc", "enospc_last"])
def test_a_full_disk_on_a_direct_write_fails_the_save_naming_the_file(
    outcome: dict, source: str, which: str
) -> None:
    # The last direct write of a file may still be in flight when DCP goes on to
    # write .metadata: its error comes from the file's fsync, which waits for it.
    case = outcome[source][which]
    assert case["failed_op"].startswith("write "), case
    kind, err, filename = case["error"]
    assert (kind, err) == ("OSError", 28), case  # ENOSPC, as the kernel said it
    assert Path(filename).name == "__0_0.distcp"
