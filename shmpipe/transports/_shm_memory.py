"""The shm ring's memory: how big, made where (after checking there is
room), and reached by a producer.

The consumer makes the memory (_create_memory) and hands a ShmHandle to
each producer, which maps it (attach_writer). shm.py (the transport and
its two ends) builds on this module; this module imports nothing of it.
"""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

from shmpipe import _ring, _segments
from shmpipe._control import PassFd
from shmpipe._process import proc_kib
from shmpipe.errors import CorruptChannelError, SegmentExistsError, SharedMemoryFullError

__all__ = ["NAME_TRIES", "ShmHandle", "attach_writer", "attach_writer_once"]


def _round_to_pages(nbytes: int) -> int:
    page = _ring.PAGE_SIZE
    return -(-nbytes // page) * page


class ShmHandle(NamedTuple):
    """What a producer needs to attach: the ring's descriptor (anonymous
    memory; it travels beside the control message) or its name, and the
    outbox for batches larger than a slot (None where slot_size is a limit
    the user set).

    (A NamedTuple, which a fresh process defines in a fifth of a frozen
    dataclass's time: docs/design.md, "A fresh pipeline's first batches".)
    """

    name: str | None
    fd: PassFd | None
    owner_pid: int
    owner_start: int
    outbox: PassFd | None = None
    #: The id of the first region a producer given this handle makes (a
    #: replacement's: above its predecessor's, see _external.Regions.retire).
    first_rid: int = 0


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _cgroup_memory_free() -> int | None:
    """Bytes this process's cgroup may still charge (v2: memory.max minus
    memory.current; v1: limit_in_bytes minus usage_in_bytes), or None
    where there is no limit or it cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            root, limit_file, usage_file = "/sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit_file, usage_file = "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        # The process's own group; in a container without a cgroup
        # namespace, the mount's root is the container's group.
        for base in (root + path, root):
            try:
                with open(os.path.join(base, limit_file)) as f:
                    limit = f.read().strip()
                with open(os.path.join(base, usage_file)) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
                return None  # no limit
            return max(0, int(limit) - usage)
    return None


def _memory_available() -> tuple[int | None, str]:
    """What can back anonymous shared memory now: the smaller of the
    kernel's MemAvailable and the cgroup's room, and what it is called."""
    free = proc_kib("/proc/meminfo", "MemAvailable")
    room = _cgroup_memory_free()
    if room is not None and (free is None or room < free):
        return room, "the cgroup's memory limit (memory.max)"
    return free, "available memory (MemAvailable)"


def _create_memory(backing: str, total: int) -> _ring.Segment:
    """The ring's memory, after checking that what backs it has room (an
    error that names the bytes, rather than a SIGBUS or the OOM killer)."""
    free: int | None
    if backing == "posix":
        where = _segments.SHM_DIR
        try:
            free = _free_bytes(where)
        except OSError:
            free = None
    else:
        free, where = _memory_available()
    if free is not None and total > free:
        raise SharedMemoryFullError(total, free, where)
    try:
        if backing == "posix":
            return _create_named(total)
        return _ring.Segment.create_anonymous("shmpipe-ring", total)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise SharedMemoryFullError(total, free or 0, where) from exc
        raise


#: Fresh names a named segment is tried under before SegmentExistsError.
#: Each has 96 random bits: one already taken is no accident, and a few
#: more tries only rule out the impossible one.
NAME_TRIES = 3


def _create_named(total: int) -> _ring.Segment:
    """A new named segment of `total` bytes, under a fresh name. A name
    taken already is never opened (shm_open with O_EXCL): the memory there
    is another process's."""
    taken: list[str] = []
    for _ in range(NAME_TRIES):
        name = _segments.new_segment_name()
        try:
            return _ring.Segment.create(name, total)
        except FileExistsError:
            taken.append(name)
    raise SegmentExistsError(taken, _segments.SHM_DIR)


def attach_writer(handle: ShmHandle, worker: int) -> _ring.RingWriter:
    """A producer's writer for worker `worker` of the ring `handle` names."""
    if handle.fd is not None:
        segment = _ring.Segment.attach_fd(handle.fd.fd)
        what = "the ring's memory"
    else:
        assert handle.name is not None
        segment = _ring.Segment.attach(handle.name)
        what = f"segment {handle.name!r}"
    ring = _ring.Ring.attach(segment)
    if (ring.owner_pid, ring.owner_start) != (handle.owner_pid, handle.owner_start):
        raise CorruptChannelError(
            f"{what} belongs to pid {ring.owner_pid}, not to the pipeline owner {handle.owner_pid}"
        )
    return _ring.RingWriter(ring, worker)


def attach_writer_once(handle: ShmHandle, worker: int) -> _ring.RingWriter:
    """attach_writer in a producer, which then closes the descriptor that
    came with the handle (the mapping keeps the memory)."""
    try:
        return attach_writer(handle, worker)
    finally:
        if handle.fd is not None:
            handle.fd.close()
