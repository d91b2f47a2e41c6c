"""The "shm" transport: the shared-memory ring as a pipeline's channel. The
consumer owns the segment (creates, sizes, destroys it); each producer
attaches to it by name. See docs/design.md.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from typing import Any

from shmpipe import _ring, _segments
from shmpipe.errors import CorruptSegmentError, SharedMemoryFullError, ShmpipeValueError
from shmpipe.transport import (
    Capabilities,
    ChannelSpec,
    ConsumerEnd,
    ProducerControl,
    ProducerEnd,
    Transport,
)

__all__ = ["ShmTransport", "ShmHandle", "ShmConsumer", "ShmProducer", "attach_producer", "slot_size_for"]

#: A slot sized from a first batch gets this much room to spare, so later
#: batches may be somewhat larger (a longer sequence, a bigger image).
HEADROOM = 1.25


def slot_size_for(nbytes: int) -> int:
    """The slot size for batches like one of `nbytes` bytes."""
    page = _ring.PAGE_SIZE
    want = max(int(nbytes * HEADROOM), nbytes + page)
    return -(-want // page) * page


def check_slot_size(slot_size: int) -> int:
    if not isinstance(slot_size, int) or isinstance(slot_size, bool) or slot_size <= 0:
        raise ShmpipeValueError(f"slot_size must be a positive int (bytes), got {slot_size!r}")
    page = _ring.PAGE_SIZE
    return -(-slot_size // page) * page


@dataclass(frozen=True)
class ShmHandle:
    """What a producer needs to attach: small and picklable."""

    name: str
    owner_pid: int
    owner_start: int


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class ShmTransport(Transport):
    """Batches in a ring of fixed-size slots in one shared-memory segment:
    one copy into a slot (none with reserve), read back as views."""

    name = "shm"
    capabilities = Capabilities(
        zero_copy_reads=True,
        in_place_writes=True,
        alignment=64,
        serializes="none (shmpipe's layout: structure plus raw array bytes)",
        sized_by_first_batch=True,
        cancels_passes=True,
    )

    #: The ConsumerEnd class open() makes (a ring transport with another
    #: payload encoding, like "arrow", substitutes its own).
    consumer_class: Any = None  # ShmConsumer, set below

    def open(self, spec: ChannelSpec) -> "ShmConsumer":
        if spec.slot_size is None:
            raise ShmpipeValueError(f"the {self.name} transport needs a slot size")
        return self.consumer_class(
            num_workers=spec.num_workers,
            capacity=spec.capacity,
            slot_size=spec.slot_size,
            ordered=spec.ordered,
            first_pass=spec.first_pass,
        )

    def attach(self, handle: "ShmHandle", worker: int, control: ProducerControl) -> "ShmProducer":
        return ShmProducer(attach_producer(handle, worker))


class ShmProducer(ProducerEnd):
    """A producer's end of the ring (RingWriter does the work)."""

    def __init__(self, writer: _ring.RingWriter) -> None:
        self.writer = writer
        # Straight to the Cython methods: put() is on the hot path.
        self.put = writer.put
        self.reserve = writer.reserve
        self.start_pass = writer.start_pass
        self.end_pass = writer.finish_pass

    def put(self, batch: Any) -> None:  # replaced per instance in __init__
        self.writer.put(batch)

    def end_pass(self) -> None:  # replaced per instance in __init__
        self.writer.finish_pass()


class ShmConsumer(ConsumerEnd):
    """The consumer's side: creates the segment and reads batches from it."""

    def __init__(
        self, *, num_workers: int, capacity: int, slot_size: int, ordered: bool, first_pass: int
    ) -> None:
        if capacity > _ring.MAX_SLOTS:
            raise ShmpipeValueError(f"capacity must be at most {_ring.MAX_SLOTS}, got {capacity}")
        name = _segments.new_segment_name()
        pid, start = _segments.owner_identity()
        total = _ring.header_size(capacity, num_workers) + capacity * slot_size
        try:
            free = _free_bytes(_segments.SHM_DIR)
        except OSError:
            free = None
        if free is not None and total > free:
            raise SharedMemoryFullError(total, free, _segments.SHM_DIR)
        try:
            segment = _ring.Segment.create(name, total)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise SharedMemoryFullError(total, free or 0, _segments.SHM_DIR) from exc
            raise
        try:
            # In ordered mode one worker may not fill the ring while the
            # consumer waits for another: each gets a quota, keeping one slot
            # for the batch the consumer holds (see docs/design.md).
            quota = max(1, (capacity - 1) // num_workers) if ordered and num_workers > 1 else 0
            self.ring = _ring.Ring.create(
                segment, capacity, num_workers, slot_size, quota, ordered, pid, start, first_pass
            )
        except BaseException:
            segment.unlink()
            raise
        self.segment = segment
        self.handle = ShmHandle(name, pid, start)
        self.reader = _ring.RingReader(self.ring)
        # Straight to the Cython method: get() is on the hot path.
        self.get = self.reader.take
        self.slot_size = slot_size
        self.capacity = capacity

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:  # replaced in __init__
        return self.reader.take(pass_no, worker, wseq, wait)

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
        """Removes the segment's name. Arrays still alive keep their memory."""
        self.segment.unlink()

    def held(self) -> int:
        return self.ring.held_count()

    def producer_blocked_s(self, worker: int) -> float:
        return self.ring.worker_blocked_ns(worker) / 1e9

    def memory_ranges(self) -> list[tuple[int, int]]:
        return [(self.segment.address, self.segment.size)]

    owns_memory = True  # the segment is this pipeline's alone

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


ShmTransport.consumer_class = ShmConsumer


def attach_producer(handle: ShmHandle, worker: int) -> _ring.RingWriter:
    """A producer's writer for worker `worker` of the ring `handle` names."""
    segment = _ring.Segment.attach(handle.name)
    ring = _ring.Ring.attach(segment)
    if (ring.owner_pid, ring.owner_start) != (handle.owner_pid, handle.owner_start):
        raise CorruptSegmentError(
            f"segment {handle.name!r} belongs to pid {ring.owner_pid}, not to the pipeline "
            f"owner {handle.owner_pid}"
        )
    return _ring.RingWriter(ring, worker)
