"""Where a pipeline's shared memory shows, for tests that check nothing is
left behind: this process's descriptors and mappings of anonymous ring
memory, and the named segments in /dev/shm."""

from __future__ import annotations

import os

from shmpipe import _segments

__all__ = ["named_segments", "ring_descriptors", "ring_mappings"]


def ring_descriptors() -> dict[int, str]:
    """This process's open descriptors of shmpipe's anonymous memory (the
    ring, and batches larger than a slot): {fd: what it refers to}."""
    found = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, say)
        if target.startswith("/memfd:shmpipe"):
            found[int(entry)] = target
    return found


def named_segments() -> set[str]:
    """Names of shmpipe's segments in /dev/shm (anyone's)."""
    try:
        return {e for e in os.listdir(_segments.SHM_DIR) if e.startswith(_segments.PREFIX)}
    except FileNotFoundError:
        return set()


def ring_mappings() -> list[str]:
    """This process's mappings of anonymous ring memory (the default
    backing), as the address ranges /proc/self/maps gives."""
    with open("/proc/self/maps") as f:
        return [line.split()[0] for line in f if "memfd:shmpipe-ring" in line]
