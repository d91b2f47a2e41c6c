"""The "shm" transport, shmpipe's default: the shared-memory ring as a
pipeline's channel.

The consumer owns the ring's memory (creates, sizes, destroys it). By
default that memory is anonymous (memfd_create): sealed against resizing,
in no file system (so Docker's 64 MB /dev/shm does not limit it), handed to
each producer as a file descriptor over its control connection, and freed
by the kernel when the last process holding it ends, however it ends. With
``ShmTransport(backing="posix")`` it is a named segment in /dev/shm instead,
which other processes of the user can open by name (``pipe.channel.name``).

The ring engine below does the work: _ring.pyx (the memory, the slot
protocol, the two ends), _codec.pyx (the payload layout) and _segments.py
(names, and sweeping the named segments of dead owners). See
docs/design.md.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any

from shmpipe import _codec, _ring, _segments
from shmpipe._control import PassFd
from shmpipe._process import owner_identity
from shmpipe.errors import CorruptSegmentError, SharedMemoryFullError, ShmpipeValueError
from shmpipe.transport import (
    Capabilities,
    ChannelSpec,
    ConsumerEnd,
    ProducerControl,
    ProducerEnd,
    Transport,
)

__all__ = ["ShmConsumer", "ShmHandle", "ShmProducer", "ShmTransport", "attach_writer"]

#: A slot sized from a first batch gets this much room to spare, so later
#: batches may be somewhat larger (a longer sequence, a bigger image).
HEADROOM = 1.25


def _round_to_pages(nbytes: int) -> int:
    page = _ring.PAGE_SIZE
    return -(-nbytes // page) * page


BACKINGS = ("memfd", "posix")


@dataclass(frozen=True)
class ShmHandle:
    """What a producer needs to attach: the ring's descriptor (anonymous
    memory; it travels beside the control message) or its name."""

    name: str | None
    fd: PassFd | None
    owner_pid: int
    owner_start: int


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
    free: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    room = _cgroup_memory_free()
    if room is not None and (free is None or room < free):
        return room, "the cgroup's memory limit (memory.max)"
    return free, "available memory (MemAvailable)"


class ShmTransport(Transport):
    """Batches in a ring of fixed-size slots in shared memory: one copy into
    a slot (none with reserve), read back as views.

    Args:
        backing: ``"memfd"`` (default): anonymous memory, sealed, passed to
            producers as a descriptor, freed when the last process holding
            it ends. ``"posix"``: a named segment in /dev/shm (mode 0600,
            random name) that other processes of this user can open by name.
    """

    name = "shm"
    capabilities = Capabilities(
        zero_copy_reads=True,
        in_place_writes=True,
        alignment=64,
        serializes="none (shmpipe's layout: structure plus raw array bytes)",
        sized_by_first_batch=True,
        cancels_passes=True,
    )

    def __init__(self, *, backing: str = "memfd") -> None:
        if backing not in BACKINGS:
            raise ShmpipeValueError(f"backing must be one of {', '.join(map(repr, BACKINGS))}, got {backing!r}")
        self.backing = backing

    def open(self, spec: ChannelSpec) -> ShmConsumer:
        _segments.sweep()  # named segments of pipelines whose process died
        return self._consumer(spec)

    def _consumer(self, spec: ChannelSpec) -> ShmConsumer:
        """The ConsumerEnd open() makes (a ring transport with another
        payload encoding, like "arrow", makes its own)."""
        return ShmConsumer(spec, backing=self.backing)

    def attach(self, handle: ShmHandle, worker: int, control: ProducerControl) -> ProducerEnd:
        return ShmProducer(attach_writer_once(handle, worker))

    def batch_nbytes(self, batch: Any) -> int:
        return _codec.encoded_size(batch)

    def slot_size_for(self, nbytes: int) -> int:
        return _round_to_pages(max(int(nbytes * HEADROOM), nbytes + _ring.PAGE_SIZE))

    def orphaned(self, handle: ShmHandle) -> None:
        # The consumer died: it cannot unlink a named segment any more, and
        # every producer tries (whoever comes first removes it). Anonymous
        # memory needs nothing: it goes with the last process holding it.
        if handle.name is None:
            return
        try:
            _ring.unlink_segment(handle.name)
        except OSError:
            pass

    def __repr__(self) -> str:
        return f"<shmpipe transport {self.name!r} backing={self.backing!r}>"


class ShmProducer(ProducerEnd):
    """A producer's end of the ring (RingWriter does the work)."""

    def __init__(self, writer: _ring.RingWriter) -> None:
        self.writer = writer

    def start_pass(self, pass_no: int) -> None:
        self.writer.start_pass(pass_no)

    def put(self, batch: Any) -> None:
        self.writer.put(batch)

    def reserve(self, template: Any) -> Any:
        return self.writer.reserve(template)

    def end_pass(self) -> None:
        self.writer.finish_pass()


class ShmConsumer(ConsumerEnd):
    """The consumer's side: creates the segment and reads batches from it."""

    owns_memory = True  # the segment is this pipeline's alone

    def __init__(self, spec: ChannelSpec, *, backing: str = "memfd") -> None:
        if spec.slot_size is None:
            raise ShmpipeValueError("the ring needs a slot size")
        if spec.capacity > _ring.MAX_SLOTS:
            raise ShmpipeValueError(f"capacity must be at most {_ring.MAX_SLOTS}, got {spec.capacity}")
        slot_size = _round_to_pages(spec.slot_size)
        pid, start = owner_identity()
        total = _ring.header_size(spec.capacity, spec.num_workers) + spec.capacity * slot_size
        segment = _create_memory(backing, total)
        try:
            # In ordered mode one worker may not fill the ring while the
            # consumer waits for another: each gets the spec's quota (one
            # ordered worker's quota is the whole ring, the same as none).
            quota = spec.quota if spec.ordered else 0
            self.ring = _ring.Ring.create(
                segment, spec.capacity, spec.num_workers, slot_size, quota, spec.ordered, pid, start, spec.first_pass
            )
        except BaseException:
            segment.unlink()
            raise
        self.segment = segment
        self.handle = ShmHandle(
            segment.name or None, None if segment.name else PassFd(segment.fd), pid, start
        )
        self.reader = _ring.RingReader(self.ring)
        self.slot_size = slot_size
        self.capacity = spec.capacity

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        return self.reader.take(pass_no, worker, wseq, wait)

    # Properties where the contract has plain attributes: read from the
    # reader only when asked, so get() copies nothing.
    @property
    def last_worker(self) -> int:  # type: ignore[override]
        return self.reader.last_worker

    @property
    def last_nbytes(self) -> int:  # type: ignore[override]
        return self.reader.last_nbytes

    def begin_pass(self, pass_no: int) -> None:
        if pass_no == self.ring.current_pass:
            return  # the pass the ring was created at
        started = self.ring.begin_pass()
        if started != pass_no:
            raise AssertionError(f"ring started pass {started}, the pipeline is at {pass_no}")

    def halt(self) -> None:
        self.ring.report_fault()

    def close(self) -> None:
        """Stops producers' waits; the memory stays while batches live."""
        self.ring.close()

    def destroy(self) -> None:
        """No one can attach any more (the name is removed, or our descriptor
        closed). Arrays still alive keep their memory."""
        self.segment.unlink()
        if self.handle.fd is not None:
            self.handle.fd.forget()  # that number may soon be another file's

    @property
    def name(self) -> str | None:
        """The ring's name in /dev/shm (``backing="posix"``), else None."""
        return self.segment.name or None

    def held(self) -> int:
        return self.ring.held_count()

    def producer_blocked_s(self, worker: int) -> float:
        return self.ring.worker_blocked_ns(worker) / 1e9

    def memory_ranges(self) -> list[tuple[int, int]]:
        return [(self.segment.address, self.segment.size)]

    def describe_wait(self) -> str:
        """Why nothing came: the slots' states, for a timeout's message."""
        states = self.ring.slot_states()
        held = states.count(_ring.HELD)
        ready = states.count(_ring.READY)
        writing = states.count(_ring.WRITING)
        if held == len(states):
            return (
                f"all {held} slots are held by batches the consumer still references, so "
                "the producers cannot write; drop references to old batches (or copy what "
                "you keep), or raise capacity"
            )
        return (
            f"of {len(states)} slots {held} are held by batches the consumer still "
            f"references, {ready} are ready for other workers, {writing} are being written"
        )


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
            return _ring.Segment.create(_segments.new_segment_name(), total)
        return _ring.Segment.create_anonymous("shmpipe-ring", total)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise SharedMemoryFullError(total, free or 0, where) from exc
        raise


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
        raise CorruptSegmentError(
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
