"""Build and drive ``iofault.c``, the LD_PRELOAD shim that fails real file-system calls.

The parent test builds the shim with ``build`` (gcc is required: a missing
compiler fails the test, it does not skip it) and starts a child process with
``preload_env``. Inside the child, ``Shim`` arms and disarms the shim through
ctypes, so that one process runs many cases: arm on a directory with "fail
call number N with errno E", run the code under test, disarm and read the
count. ``read_log`` parses the log of a recording run (``Shim.arm(log=...)``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["SOURCE", "Op", "Shim", "build", "preload_env", "read_log"]

SOURCE = Path(__file__).with_name("iofault.c")


def build(directory: Path) -> Path:
    """Compile the shim into ``directory`` (once per source version); returns the .so path.

    Raises RuntimeError when gcc is missing or the compile fails: the fault tests
    need the shim, and a machine without a compiler must not pass them silently.
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError(
            "gcc not found: the I/O fault tests compile tests/support/iofault.c into an "
            "LD_PRELOAD shim; install gcc (apt-get install gcc) to run them"
        )
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = directory / f"iofault-{digest}.so"
    if out.exists():
        return out
    tmp = directory / f".iofault-{digest}-{os.getpid()}.so"
    proc = subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(tmp), str(SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE} failed:\n{proc.stderr}")
    os.replace(tmp, out)
    return out


def preload_env(shim: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process that runs with the shim preloaded (not armed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOFAULT_")}
    env["LD_PRELOAD"] = str(shim)
    env.update(extra)
    return env


class Shim:
    """The preloaded shim of this process, controlled through ctypes.

    Raises RuntimeError when the process was not started with it (``preload_env``).
    Not thread-safe to arm from two threads; the calls it counts may come from any thread.
    """

    def __init__(self) -> None:
        lib = ctypes.CDLL(None)
        if not hasattr(lib, "iofault_arm"):
            raise RuntimeError(
                "the iofault shim is not loaded: start this process with preload_env"
            )
        lib.iofault_arm.argtypes = [
            ctypes.c_char_p,
            ctypes.c_long,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        lib.iofault_arm.restype = ctypes.c_int
        lib.iofault_match.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
        lib.iofault_match.restype = ctypes.c_int
        lib.iofault_disarm.restype = ctypes.c_long
        lib.iofault_count.restype = ctypes.c_long
        lib.iofault_failed_op.restype = ctypes.c_char_p
        self._lib = lib

    def arm(
        self,
        directory: Path,
        *,
        fail_at: int = 0,
        errno: int = 0,
        log: Path | None = None,
        persistent: bool = False,
        write_at: tuple[int, int] | None = None,
    ) -> None:
        """Number the calls under ``directory`` from 1; fail call ``fail_at`` (0: none) with
        ``errno``, and every later one too when ``persistent`` (a disk that stays full).

        ``write_at=(offset, size)``: fail the first write of ``size`` bytes at ``offset``
        instead of a numbered call. The numbers of calls made by several threads at once
        change from run to run; the write a recording run logged at an offset does not.
        """
        log_arg = None if log is None else os.fsencode(log)
        code = self._lib.iofault_arm(os.fsencode(directory), fail_at, errno, log_arg, persistent)
        if code != 0:
            raise OSError(f"iofault: cannot open the log {log}")
        if write_at is not None:
            self._lib.iofault_match(*write_at)

    def disarm(self) -> int:
        """Stop counting; returns the number of calls made since ``arm``."""
        return int(self._lib.iofault_disarm())

    def failed_op(self) -> str:
        """``"<op> <path>"`` of the call made to fail, ``""`` if the count never reached it."""
        return bytes(self._lib.iofault_failed_op()).decode(errors="replace")


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One logged call: op is open, write, read, fsync, close, truncate, flush, copy,
    rename, link, unlink, rmdir or mkdir (with a ``!`` suffix when it was made to fail)."""

    seq: int
    op: str
    ino: int
    path: str
    path2: str
    offset: int
    size: int
    result: int


def read_log(path: Path) -> list[Op]:
    ops = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        seq, op, ino, p1, p2, offset, size, result = line.split("\t")
        ops.append(Op(int(seq), op, int(ino), p1, p2, int(offset), int(size), int(result)))
    return ops
