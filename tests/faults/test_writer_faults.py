"""A write that fails in a writer thread of ``ChecksummingWriter`` fails the save, in the caller's thread.

torch 2.13's own ``FileSystemWriter`` loses an exception raised in any of its
threads but the caller's and returns over a short file; these tests make the
kernel refuse a write (RLIMIT_FSIZE: EFBIG) in the second writer thread only.
"""

from __future__ import annotations

from pathlib import Path

from .test_io_errors import run_child

CHILD = r"""
import errno, json, resource, signal, sys, warnings
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from stalwart.writer import ChecksummingWriter, RecordTemplates, without_zip_crc

KiB = 1024
path, limit = Path(sys.argv[1]), int(sys.argv[2])
# Greedy split by size over two files: the caller's thread gets "a" (200 KiB),
# the second thread "b" and "c" (300 KiB): only the second crosses the limit.
sd = {
    "a": torch.ones(200 * KiB // 4),
    "b": torch.ones(150 * KiB // 4),
    "c": torch.ones(150 * KiB // 4),
}
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
writer = ChecksummingWriter(path, threads=2, templates=RecordTemplates())
out = {"raised": False}
try:
    with warnings.catch_warnings(), without_zip_crc():
        warnings.filterwarnings("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)
    writer.sync()
except CheckpointException as exc:
    out["raised"] = True
    (error, _trace), = exc.failures.values()
    out["error"] = [type(error).__name__, getattr(error, "errno", None), getattr(error, "filename", None)]
finally:
    writer.close()
out["files"] = sorted(p.name for p in path.iterdir())
out["sizes"] = {p.name: p.stat().st_size for p in path.iterdir()}
print("RESULT " + json.dumps(out))
"""


def test_a_full_file_in_the_second_writer_thread_fails_the_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    out = run_child(CHILD, str(path), str(256 * 1024))
    assert out["raised"], out
    kind, err, filename = out["error"]
    assert (kind, err) == ("OSError", 27), out  # EFBIG, as the kernel said it
    assert Path(filename).name == "__0_1.distcp"
    assert ".metadata" not in out["files"]  # nothing that could pass for a checkpoint
    assert out["sizes"]["__0_0.distcp"] < 256 * 1024  # the caller's own file was fine
