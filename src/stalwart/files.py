"""What an entry of a run directory is, when it is not the regular file stalwart expects.

Plain data, no torch. A run directory is input from outside: a symbolic link,
FIFO or device where a checkpoint file, ``.lock`` or ``events.jsonl`` belongs is
refused by every reader and writer, and they all name it the same way.
"""

from __future__ import annotations

import os
import stat

__all__ = ["not_regular"]


def not_regular(info: os.stat_result, *, writing: bool = False) -> str | None:
    """What the entry ``info`` describes (``"a symbolic link"``, ``"a FIFO"``, ...),
    or None when it is a regular file stalwart may use.

    With ``writing``, a regular file with more than one name is refused too: a
    hard link to a file elsewhere would be written or truncated like a link.
    """
    mode = info.st_mode
    if stat.S_ISREG(mode):
        if writing and info.st_nlink > 1:
            return f"a hard link ({info.st_nlink} names for one file)"
        return None
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"not a regular file (mode {mode:o})"
