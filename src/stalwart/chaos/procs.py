"""Finding a training command's ranks among its processes, through Linux's ``/proc``.

psutil is not a dependency: ``/proc/<pid>/stat`` gives each process's parent
and ``/proc/<pid>/environ`` its environment, where torchrun sets ``RANK`` for
every worker. Only processes of the same user can be read (the command is the
harness's own child, so its descendants are). On a system without ``/proc``
every lookup finds nothing and faults go to the command's own process.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["descendants", "rank_pids", "target_pid"]

PROC = Path("/proc")


def _parent_of(pid: int) -> int | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')':
    # the fields after the last ')' are fixed ("state ppid ...").
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def descendants(root: int) -> list[int]:
    """Process ids of ``root`` and everything it started (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return [root]
    for pid in entries:
        parent = _parent_of(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        environ = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(b"RANK="):
            try:
                return int(item[5:])
            except ValueError:
                return None
    return None


def rank_pids(root: int) -> dict[int, int]:
    """``{rank: pid}`` of the training ranks under ``root``: the topmost process with
    ``RANK=r`` in its environment (its DataLoader workers inherit the variable too)."""
    ranks: dict[int, int] = {}
    for pid in descendants(root):
        rank = _rank_of(pid)
        if rank is None:
            continue
        parent = _parent_of(pid)
        # A rank's own children (DataLoader or async-save workers) inherit its RANK.
        if pid != root and parent is not None and _rank_of(parent) == rank:
            continue
        ranks.setdefault(rank, pid)
    return ranks


def target_pid(root: int, rank: int | None) -> tuple[int, int | None]:
    """The process a rank fault hits, and its rank: the process with ``RANK=rank``
    under ``root`` (``rank=None``: the highest rank found); ``root`` itself, rank
    None, when no process under it has ``RANK`` set (a single-process command).

    Raises ``ValueError`` when ranks are found but not ``rank``.
    """
    ranks = rank_pids(root)
    if not ranks:
        return root, None
    chosen = max(ranks) if rank is None else rank
    if chosen not in ranks:
        raise ValueError(
            f"no process with RANK={chosen} under pid {root} (ranks found: {sorted(ranks)}); "
            "pick one of them with --target-rank"
        )
    return ranks[chosen], chosen
