"""Names of shmpipe's shared-memory segments, their owners, and sweeping.

A segment's name says who owns it::

    /shmpipe-<owner pid>-<owner start time>-<24 hex digits: 96 random bits>

The start time (see _process.py) tells a live owner from a new process that
reuses a dead owner's pid. A segment whose owner is gone can be removed by
anyone of the same user: the "shm" transport does it whenever it opens a
ring, and so does ``shmpipe clean``. A segment whose owner lives is never
touched.
"""

from __future__ import annotations

import os
import re
import secrets

from shmpipe._process import owner_alive, owner_identity
from shmpipe._ring import unlink_segment

__all__ = ["PREFIX", "SHM_DIR", "new_segment_name", "parse_name", "sweep"]

SHM_DIR = "/dev/shm"
PREFIX = "shmpipe-"
_NAME = re.compile(r"^shmpipe-(\d+)-(\d+)-[0-9a-f]{24}$")


def new_segment_name() -> str:
    """A fresh name for a segment owned by this process."""
    pid, start = owner_identity()
    return f"/{PREFIX}{pid}-{start}-{secrets.token_hex(12)}"


def parse_name(name: str) -> tuple[int, int] | None:
    """(owner pid, owner start time) from a segment name, or None if it is
    not one of ours."""
    m = _NAME.match(name.lstrip("/"))
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))


def sweep(dry_run: bool = False) -> list[str]:
    """Removes this user's segments whose owner has died; returns their names."""
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
