"""Names of shmpipe's shared-memory segments, their owners, and sweeping.

A segment's name says who owns it::

    /shmpipe-<owner pid>-<owner start time>-<24 hex digits: 96 random bits>

The start time (field 22 of /proc/<pid>/stat, clock ticks since boot) tells
a live owner from a new process that reuses a dead owner's pid. A segment
whose owner is gone can be removed by anyone of the same user: the next
pipeline does it, and so does ``shmpipe clean``. A segment whose owner lives
is never touched.
"""

from __future__ import annotations

import os
import re
import secrets

__all__ = ["SHM_DIR", "owner_identity", "new_segment_name", "parse_name", "owner_alive", "sweep"]

SHM_DIR = "/dev/shm"
PREFIX = "shmpipe-"
_NAME = re.compile(r"^shmpipe-(\d+)-(\d+)-[0-9a-f]{24}$")


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


def new_segment_name() -> str:
    pid, start = owner_identity()
    return f"/{PREFIX}{pid}-{start}-{secrets.token_hex(12)}"


def parse_name(name: str) -> tuple[int, int] | None:
    """(owner pid, owner start time) from a segment name, or None if it is
    not one of ours."""
    m = _NAME.match(name.lstrip("/"))
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))


def owner_alive(pid: int, start: int) -> bool:
    return process_start_time(pid) == start


def sweep(dry_run: bool = False) -> list[str]:
    """Removes this user's segments whose owner has died; returns their names."""
    from shmpipe._ring import unlink_segment

    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    uid = os.getuid()
    for entry in entries:
        owner = parse_name(entry)
        if owner is None:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, entry)).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        if owner_alive(*owner):
            continue
        if dry_run or unlink_segment("/" + entry):
            removed.append("/" + entry)
    return removed
