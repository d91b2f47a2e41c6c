"""Where a pipeline's shared memory and descriptors show, for tests that
check nothing is left behind: this process's descriptors and mappings of
anonymous ring memory, the named segments in /dev/shm, and the descriptors
a transport may open (channel_descriptors)."""

from __future__ import annotations

import os
from collections.abc import Collection

from shmpipe import _segments

__all__ = ["channel_descriptors", "named_segments", "ring_descriptors", "ring_mappings", "segments_of"]


def _descriptors() -> dict[int, str]:
    """This process's open descriptors: {fd: what /proc says it refers to}."""
    found = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            found[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, say)
    return found


def channel_descriptors() -> dict[int, str]:
    """This process's descriptors of the kinds a transport opens: sockets,
    pipes, memory (memfd, /dev/shm) and other anonymous inodes (eventfd,
    epoll). Left out: regular files and pidfds, which a test harness opens
    and closes in threads of its own (a runner's output files, its waits on
    processes) while a test runs, so they would show as leaks that are not."""
    return {
        fd: target
        for fd, target in _descriptors().items()
        if target.startswith(("socket:", "pipe:", "/memfd:", "/dev/shm/"))
        or (target.startswith("anon_inode:") and "pidfd" not in target)
    }


def ring_descriptors() -> dict[int, str]:
    """This process's open descriptors of shmpipe's anonymous memory (the
    ring, and batches larger than a slot): {fd: what it refers to}."""
    return {fd: target for fd, target in _descriptors().items() if target.startswith("/memfd:shmpipe")}


def named_segments(prefixes: tuple[str, ...] = (_segments.PREFIX,)) -> set[str]:
    """Names of the entries in /dev/shm (anyone's) that begin with one of
    `prefixes`: shmpipe's segments by default."""
    if not prefixes:
        return set()
    try:
        return {e for e in os.listdir(_segments.SHM_DIR) if e.startswith(prefixes)}
    except FileNotFoundError:
        return set()


def segments_of(pids: Collection[int]) -> set[str]:
    """Names of shmpipe's segments in /dev/shm whose owner is one of `pids`
    (the processes a test started): what they left, not what other programs
    make in /dev/shm meanwhile. Look as soon as they have ended: any
    pipeline that opens a ring removes the segments of dead owners."""
    found = set()
    for name in named_segments():
        owner = _segments.parse_name(name)
        if owner is not None and owner[0] in pids:
            found.add(name)
    return found


def ring_mappings() -> list[str]:
    """This process's mappings of anonymous ring memory (the default
    backing), as the address ranges /proc/self/maps gives."""
    with open("/proc/self/maps") as f:
        return [line.split()[0] for line in f if "memfd:shmpipe-ring" in line]
