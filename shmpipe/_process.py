"""Who a process is: its pid and start time, and whether it still lives.

A pid alone is not an identity: the kernel reuses pids. The pair (pid, start
time) is, where the start time is field 22 of /proc/<pid>/stat (clock ticks
since boot). Producers watch their consumer by it, and segment names carry
their owner's, so a dead owner's memory can be told from a live one's.
"""

from __future__ import annotations

import os

__all__ = ["owner_alive", "owner_identity", "process_start_time"]


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot; None if it is gone
    or a zombie (it has exited; only its exit status remains)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or
    # parentheses itself: split after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # state: zombie or dead
        return None
    return int(fields[19])  # field 22 of the whole line


def owner_identity() -> tuple[int, int]:
    """(pid, start time) of this process."""
    pid = os.getpid()
    start = process_start_time(pid)
    return pid, start if start is not None else 0


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process (pid, start) still runs."""
    return process_start_time(pid) == start
