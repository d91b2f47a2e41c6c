"""The "shm" transport, shmpipe's default: the shared-memory ring as a
pipeline's channel.

The consumer owns the segment (creates, sizes, destroys it); each producer
attaches to it by name. The ring engine below does the work: _ring.pyx (the
segment, the slot protocol, the two ends), _codec.pyx (the payload layout)
and _segments.py (names, and sweeping the segments of dead owners). See
docs/design.md.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any

from shmpipe import _codec, _ring, _segments
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

    def open(self, spec: ChannelSpec) -> ShmConsumer:
        _segments.sweep()  # segments of pipelines whose process died
        return self._consumer(spec)

    def _consumer(self, spec: ChannelSpec) -> ShmConsumer:
        """The ConsumerEnd open() makes (a ring transport with another
        payload encoding, like "arrow", makes its own)."""
        return ShmConsumer(spec)

    def attach(self, handle: ShmHandle, worker: int, control: ProducerControl) -> ProducerEnd:
        return ShmProducer(attach_writer(handle, worker))

    def batch_nbytes(self, batch: Any) -> int:
        return _codec.encoded_size(batch)

    def slot_size_for(self, nbytes: int) -> int:
        return _round_to_pages(max(int(nbytes * HEADROOM), nbytes + _ring.PAGE_SIZE))

    def orphaned(self, handle: ShmHandle) -> None:
        # The consumer died: it cannot unlink the segment's name any more,
        # and every producer tries (whoever comes first removes it).
        try:
            _ring.unlink_segment(handle.name)
        except OSError:
            pass


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

    def __init__(self, spec: ChannelSpec) -> None:
        if spec.slot_size is None:
            raise ShmpipeValueError("the ring needs a slot size")
        if spec.capacity > _ring.MAX_SLOTS:
            raise ShmpipeValueError(f"capacity must be at most {_ring.MAX_SLOTS}, got {spec.capacity}")
        slot_size = _round_to_pages(spec.slot_size)
        name = _segments.new_segment_name()
        pid, start = owner_identity()
        total = _ring.header_size(spec.capacity, spec.num_workers) + spec.capacity * slot_size
        free: int | None
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
        self.handle = ShmHandle(name, pid, start)
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
        """Removes the segment's name. Arrays still alive keep their memory."""
        self.segment.unlink()

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


def attach_writer(handle: ShmHandle, worker: int) -> _ring.RingWriter:
    """A producer's writer for worker `worker` of the ring `handle` names."""
    segment = _ring.Segment.attach(handle.name)
    ring = _ring.Ring.attach(segment)
    if (ring.owner_pid, ring.owner_start) != (handle.owner_pid, handle.owner_start):
        raise CorruptSegmentError(
            f"segment {handle.name!r} belongs to pid {ring.owner_pid}, not to the pipeline owner {handle.owner_pid}"
        )
    return _ring.RingWriter(ring, worker)
