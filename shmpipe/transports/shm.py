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
(names, and sweeping the named segments of dead owners); _shm_memory.py
sizes, makes and maps the ring's memory. See docs/design.md.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shmpipe import _codec, _external, _ring, _segments, _tree
from shmpipe._control import PassFd
from shmpipe._interrupts import ctrl_c_held_back
from shmpipe._process import owner_identity
from shmpipe.errors import BatchTooLargeError, CorruptChannelError, ShmpipeValueError
from shmpipe.transport import (
    AGAIN,
    END,
    FAULT,
    Capabilities,
    ChannelSpec,
    ProducerControl,
    ProducerEnd,
    RankReader,
    ServesRanks,
    SharedBatch,
    SharingConsumerEnd,
    Transport,
)
from shmpipe.transports._ranks import ShmRankReader
from shmpipe.transports._shm_memory import (
    NAME_TRIES,
    ShmHandle,
    _create_memory,
    _round_to_pages,
    attach_writer,
    attach_writer_once,
)

__all__ = ["NAME_TRIES", "ShmConsumer", "ShmHandle", "ShmProducer", "ShmTransport", "attach_writer"]

#: A slot sized from a first batch gets this much room to spare, so later
#: batches may be somewhat larger (a longer sequence, a bigger image).
HEADROOM = 1.25

#: How long, and by how many audits in a row at least, the very same
#: difference between a worker's in-flight word and its slots must be seen
#: before it is an error (ShmConsumer.audit): far longer than a producer is
#: descheduled between two instructions on a loaded machine (and more than
#: two audits, which a trainer's slow steps may space a second apart), and
#: well within the seconds in which a word written from outside is found.
UNEVEN_FOR_NS = 1_000_000_000
UNEVEN_SIGHTINGS = 3

BACKINGS = ("memfd", "posix")


class ShmTransport(Transport, ServesRanks):
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
        checks_batches=True,  # the codec's plan refuses a bad batch before a slot is taken
        serves_ranks=True,
        takes_ready=True,  # the compiled reader takes, decodes and times a ready batch in one call
        restarts_producers=True,  # slots name their writer (reclaim); the handle stays ours to give again
    )

    def __init__(self, *, backing: str = "memfd") -> None:
        if backing not in BACKINGS:
            raise ShmpipeValueError(f"backing must be one of {', '.join(map(repr, BACKINGS))}, got {backing!r}")
        self.backing = backing

    def check_spec(self, spec: ChannelSpec) -> None:
        if spec.capacity > _ring.MAX_SLOTS:
            raise ShmpipeValueError(
                f"capacity must be at most {_ring.MAX_SLOTS} with the {self.name!r} transport, got {spec.capacity}"
            )
        if spec.num_workers > _ring.MAX_WORKERS:
            raise ShmpipeValueError(
                f"the {self.name!r} transport takes at most {_ring.MAX_WORKERS} sources, got {spec.num_workers}"
            )

    def open(self, spec: ChannelSpec) -> ShmConsumer:
        _segments.sweep()  # named segments of pipelines whose process died
        consumer = self._consumer(spec)
        if consumer.engine_decodes != self.capabilities.takes_ready:
            # The capability announces the fast path; only a consumer whose
            # payloads the compiled reader decodes has one.
            consumer.close()
            consumer.destroy()
            raise ShmpipeValueError(
                f"the {self.name!r} transport's capability takes_ready={self.capabilities.takes_ready} "
                f"disagrees with its consumer {type(consumer).__name__} (engine_decodes={consumer.engine_decodes})"
            )
        return consumer

    def _consumer(self, spec: ChannelSpec) -> ShmConsumer:
        """The ConsumerEnd open() makes (a ring transport with another
        payload encoding, like "arrow", makes its own)."""
        return ShmConsumer(spec, backing=self.backing)

    def _producer(self, writer: _ring.RingWriter, outbox: _external.Outbox | None) -> ShmProducer:
        """The ProducerEnd attach() makes (arrow makes its own)."""
        return ShmProducer(writer, outbox)

    def attach(self, handle: ShmHandle, worker: int, control: ProducerControl) -> ProducerEnd:
        outbox = outbox_of(handle)
        try:
            return self._producer(attach_writer_once(handle, worker), outbox)
        except BaseException:
            if outbox is not None:
                outbox.close()  # this producer will not send a batch larger than a slot
            raise

    def batch_nbytes(self, batch: Any) -> int:
        return _codec.encoded_size(batch)

    def rank_reader(self, share: dict[str, Any], fds: list[int]) -> RankReader:
        return ShmRankReader(share, fds, self._decode_payload, backing=self.backing)

    @staticmethod
    def _decode_payload(root: np.ndarray) -> Any:
        """A slot's payload, decoded (in a rank of a group)."""
        return _codec.decode(root)

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
    """A producer's end of the ring: RingWriter does the work for batches
    that fit in a slot; larger ones go to regions of memory of its own
    (_external: made once, reused while their sizes fit), announced
    through a slot, where the pipeline allows them."""

    def __init__(self, writer: _ring.RingWriter, outbox: _external.Outbox | None = None) -> None:
        self.writer = writer
        #: This producer's regions for batches larger than a slot (None
        #: where the user's slot_size is a limit).
        self.regions = None if outbox is None else _external.RegionPool(writer, outbox)
        self._reserved: _ExternalReservation | None = None

    def start_pass(self, pass_no: int, first_wseq: int = 0) -> None:
        self._drop_external_reservation()
        self.writer.start_pass(pass_no, first_wseq)

    def put(self, batch: Any) -> None:
        reserved = self._reserved
        if reserved is not None:
            if batch is reserved.batch and reserved.unchanged():
                self._publish_external_reservation(reserved)
                self._tick()
                return
            # Something else was yielded: it is copied below, and may hold
            # the reservation's arrays, so their region stays busy until
            # the copy is done (else the copy could go into that very
            # region, over the bytes it copies).
            self._drop_external_reservation()
            reserved.region.reserved = True
            try:
                self._put(batch)
            finally:
                reserved.region.reserved = False
            return
        self._put(batch)

    def _put(self, batch: Any) -> None:
        writer = self.writer
        nbytes = writer.put_fitting(batch)  # 0: it went into a slot
        if nbytes:
            if self.regions is None:
                raise BatchTooLargeError(nbytes, writer.ring.slot_size)  # the user's slot_size is a limit
            # Planned once, written into a region by the writer's own
            # encoder; a pending reservation yielded as something else
            # gives its slot to the record (compiled, one call).
            self.regions.put_planned(nbytes)
        self._tick()

    def _tick(self) -> None:
        # Every batch counts towards the regions' idleness, those in slots
        # too: when sizes shrink, the regions go (_external.RegionPool).
        regions = self.regions
        if regions is not None:
            regions.tick()

    def reserve(self, template: Any) -> Any:
        if self._reserved is not None:
            raise ShmpipeValueError(
                "reserve() was called again before the structure it returned last time "
                "was yielded; yield each reservation before making the next"
            )
        try:
            return self.writer.reserve(template)
        except BatchTooLargeError:
            if self.regions is None:
                raise
            return self._reserve_external(template)

    def end_pass(self) -> None:
        self._drop_external_reservation()
        self.writer.finish_pass()

    def close(self) -> None:
        self._drop_external_reservation()
        if self.regions is not None:
            self.regions.close()

    # -- payloads of other encodings --------------------------------------------

    def put_payload(self, nbytes: int, write: Callable[[np.ndarray], int]) -> None:
        """Publishes a payload of `nbytes` that `write(buffer)` writes
        (returning the bytes it used): in a slot where it fits, else in
        a region of its own (where the pipeline allows it). For transports
        with their own encoding (arrow); shm's own batches are encoded by
        the compiled writer."""
        if nbytes > self.writer.ring.slot_size:
            if self.regions is None:
                raise BatchTooLargeError(nbytes, self.writer.ring.slot_size)
            self.put_external(nbytes, write)
        else:
            self._publish(write)
        self._tick()

    def _publish(self, write: Callable[[np.ndarray], int], claimed: tuple[int, np.ndarray] | None = None) -> None:
        """Claims a slot (or takes `claimed`), fills it with `write(slot's
        buffer)` (the bytes used) and publishes it; the slot goes back to
        the ring if anything fails before."""
        writer = self.writer
        slot, buf = claimed if claimed is not None else writer.claim()
        try:
            size = write(buf)
        except BaseException:
            writer.abandon(slot)
            raise
        writer.publish_claimed(slot, size)

    # -- batches larger than a slot (see _external.py) -------------------------

    def put_external(self, nbytes: int, write: Callable[[np.ndarray], Any]) -> None:
        """Publishes a payload of `nbytes` that `write(buffer)` writes, in a
        free region of this producer's, announced by a record in a slot
        (the ring's capacity bounds these batches too). The slot is claimed
        first: then a region is always free (_external's lifetime rules).
        Compiled, one call per batch: _ring.RegionPoolCore.put_external."""
        regions = self.regions
        assert regions is not None
        regions.put_external(nbytes, write)

    def _reserve_external(self, template: Any) -> Any:
        regions = self.regions
        assert regions is not None
        nbytes = _codec.template_size(template)
        slot = self.writer.claim_slot()
        try:
            region = regions.take(nbytes)
            # A root of this reservation's own: the base of its arrays and of
            # every NumPy view of them (_ExternalReservation.seal_arrays).
            root = region.new_root()
            batch = _codec.reserve_into(template, root)
        except BaseException:
            self.writer.abandon(slot)
            raise
        region.reserved = True  # being filled: no other batch may take it
        self._reserved = _ExternalReservation(slot, region, nbytes, batch, root)
        return batch

    def _publish_external_reservation(self, reserved: _ExternalReservation) -> None:
        writer = self.writer
        regions = self.regions
        assert regions is not None
        self._reserved = None
        # Sealed before it is published: the arrays handed out become
        # read-only, as a slot's (their bytes are the region's: rewritten
        # once the consumer lets the batch go, as a slot's are), and a view
        # of them that lives on taints the region (guarded by published()).
        reserved.seal_arrays()
        regions.published(reserved.region, reserved.slot)
        writer.publish_record(reserved.slot, reserved.nbytes, reserved.region.index, reserved.region.rid)

    def _drop_external_reservation(self) -> None:
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            assert self.regions is not None
            reserved.give_back(self.writer, self.regions)


class _ExternalReservation:
    """A reserve() larger than a slot, until its structure is yielded."""

    __slots__ = ("batch", "layouts", "leaves", "nbytes", "region", "root", "slot", "structure")

    def __init__(self, slot: int, region: _external.Region, nbytes: int, batch: Any, root: np.ndarray) -> None:
        self.slot, self.region, self.nbytes, self.batch = slot, region, nbytes, batch
        self.structure, self.leaves = _tree.flatten(batch)
        self.layouts = [_layout(leaf) for leaf in self.leaves]
        self.root: np.ndarray | None = root

    def unchanged(self) -> bool:
        """Whether the structure yielded is still the one handed out: same
        nesting, the very same arrays with the same shape and dtype (an
        array's shape can be changed in place), the same other leaves."""
        structure, leaves = _tree.flatten(self.batch)
        return structure == self.structure and all(
            (a is b and _layout(a) == layout) or (not isinstance(a, np.ndarray) and type(a) is type(b) and a == b)
            for a, b, layout in zip(leaves, self.leaves, self.layouts, strict=True)
        )

    def seal_arrays(self) -> None:
        # Published: writes through the arrays would change a delivered
        # batch. A NumPy view made of them keeps its own flag: where one
        # lives (the root has more references than one per array handed
        # out, each based on it, which self.leaves keeps), the region is
        # tainted (RingWriter's _taint_if_viewed has the slots' side).
        arrays = 0
        for leaf in self.leaves:
            if isinstance(leaf, np.ndarray):
                leaf.flags.writeable = False
                arrays += 1
        root, self.root = self.root, None
        # (less `root` here and getrefcount's argument)
        if root is not None and sys.getrefcount(root) - 2 > arrays:
            self.region.taint(root)

    def give_back(self, writer: _ring.RingWriter, regions: _external.RegionPool) -> None:
        self.seal_arrays()
        self.region.reserved = False  # unpublished: free again
        regions.guard_if_tainted(self.region)  # while free, as a slot's
        writer.abandon(self.slot)


def _layout(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
        return (leaf.shape, leaf.strides, leaf.dtype, leaf.__array_interface__["data"][0])
    return None


def outbox_of(handle: ShmHandle) -> _external.Outbox | None:
    if handle.outbox is None:
        return None
    return _external.Outbox(socket.socket(fileno=handle.outbox.take()), handle.first_rid)


class ShmConsumer(SharingConsumerEnd):
    """The consumer's side of a ring: creates the memory and takes batches
    from it. The template of every ring transport's consumer: taking a
    slot, keeping the inbox of big batches moving while it waits, passing
    sentinels on, and handing undecoded batches to a group are here; a
    transport with its own payload encoding (arrow) overrides ``_take``."""

    owns_memory = True  # the segment is this pipeline's alone
    #: Whether the compiled reader decodes this consumer's payloads (shm's
    #: own encoding): then it is the fast path too. A subclass with another
    #: encoding says False (and its transport has no takes_ready).
    engine_decodes = True

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
        # Batches larger than a slot travel in regions of memory of their
        # own, unless the user's slot_size is a limit (_external.py).
        self.regions: _external.Regions | None = None
        self._outbox: socket.socket | None = None
        if not spec.slot_size_is_limit:
            inbox, self._outbox = _external.outbox_pair()
            self.regions = _external.Regions(inbox, spec.num_workers, spec.capacity)
        self.handle = ShmHandle(
            segment.name or None,
            None if segment.name else PassFd(segment.fd),
            pid,
            start,
            None if self._outbox is None else PassFd(self._outbox.fileno()),
        )
        self.reader = _ring.RingReader(self.ring)
        # A slot holding a record: its batch's root, found by the reader in
        # the region table itself where the region is mapped already (no
        # Python call), else from the table's keeper (a first use, a larger
        # mapping, an error).
        self.reader.on_external = self._no_external if self.regions is None else self.regions.root
        self.reader.regions = None if self.regions is None else self.regions.table
        if self.engine_decodes:
            # The fast path (capability takes_ready), bound to the compiled
            # reader itself: a method of this class in between would cost a
            # Python call per batch.
            self.take_ready = self.reader.take_ready  # type: ignore[method-assign]
        self.slot_size = slot_size
        self.capacity = spec.capacity
        self.hands_again = spec.hands_again
        #: What the last audit found uneven, (worker, word - slots), since
        #: when (time.monotonic_ns) audits have seen it, and how many times
        self._uneven: dict[tuple[int, int], tuple[int, int]] = {}
        self._first_rid: dict[int, int] = {}  # worker -> its replacement's first region id

    def handle_delivered(self) -> None:
        """Every producer has the ring's descriptor now (a memfd's was
        duplicated into each). Unless it may be handed again (a replaced
        producer, a group's ranks), this process's copy goes, and with it
        the way in for other processes of the user through /proc/<pid>/fd.
        The mapping stays. (A POSIX name stays until destroy(): a producer
        opens it by name, maybe after this call.)"""
        if not self.hands_again and self.segment.anonymous:
            self.segment.unlink()
            if self.handle.fd is not None:
                self.handle.fd.forget()  # that number may soon be another file's

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        batch = self._take(pass_no, worker, wseq, wait)
        regions = self.regions  # (destroy() may drop it from another thread)
        if regions is not None:
            if batch is AGAIN or batch is END:
                regions.pump()
            else:
                # While batches flow: the producers' DROPs (regions given
                # back as sizes shrink) take effect within PUMP_EVERY_NS.
                # The general path runs at least that often (the pipeline's
                # periodic look at its producers leaves the fast path).
                regions.pump_if_due()
        return batch

    def _take(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        """The next batch, decoded, or a sentinel. The hook of a transport
        with another payload encoding: shm's compiled reader decodes."""
        return self.reader.take(pass_no, worker, wseq, wait)

    def take_ready(self, pass_no: int, worker: int, wseq: int, due_ns: int) -> tuple[Any, int, int, int] | None:
        # Where engine_decodes, replaced in __init__ by the reader's own
        # (the same signature); otherwise there is no fast path.
        if not self.engine_decodes:
            return super().take_ready(pass_no, worker, wseq, due_ns)
        return self.reader.take_ready(pass_no, worker, wseq, due_ns)

    def _pump(self) -> None:
        """Waiting (for one worker, in ordered mode) while others may fill
        the outbox: take their datagrams off it so no producer blocks
        sending one while it holds the slot waited for."""
        regions = self.regions  # (destroy() may drop it from another thread)
        if regions is not None:
            regions.pump()

    def external_stats(self) -> dict[str, int]:
        """What this consumer holds for batches larger than a slot (regions,
        their bytes, what is mapped) and how often it was told of a region
        or mapped one (_external.Regions.stats); empty where slot_size is a
        limit."""
        regions = self.regions
        return {} if regions is None else regions.stats()

    # Properties where the contract has plain attributes: read from the
    # reader only when asked, so get() copies nothing.
    @property
    def last_worker(self) -> int:  # type: ignore[override]
        return self.reader.last_worker

    @property
    def last_nbytes(self) -> int:  # type: ignore[override]
        return self.reader.last_nbytes

    @staticmethod
    def _no_external(worker: int, index: int, rid: int, nbytes: int, record: np.ndarray) -> np.ndarray:
        raise CorruptChannelError("a slot announces a batch larger than a slot, which this pipeline forbids")

    def _share_external(self, record: np.ndarray, worker: int) -> SharedBatch:
        """A SharedBatch of the batch larger than a slot that `record` (in a
        slot of `worker`) announces: its root (read-only, in its region's
        cached mapping; it holds the record's slot too) and a duplicate of
        its region's descriptor (the batch lies at the region's start: a
        rank maps it there)."""
        from_worker, index, rid, nbytes = _ring.read_record(record)  # once, checked
        if from_worker != worker:
            raise CorruptChannelError(f"a slot of worker {worker} holds a record of worker {from_worker}")
        regions = self.regions
        if regions is None:
            self._no_external(worker, index, rid, nbytes, record)  # raises
        assert regions is not None
        root = regions.root(worker, index, rid, nbytes, record)
        self.reader.last_nbytes = nbytes  # the payload's size, not the record's (as get() counts it)
        # From the dup until the SharedBatch owns it, a Ctrl-C would leak
        # the descriptor: held back over the span.
        with ctrl_c_held_back():
            fd = os.dup(regions.fd_of(worker, index))
            try:
                # The region is sealed against future writes, not writes:
                # what the rank is told, and checks (map_external).
                return SharedBatch(root, ("big", nbytes, False), fd)
            except BaseException:
                os.close(fd)
                raise

    # -- several ranks (SharingConsumerEnd; transports/_ranks.py) ---------------

    def take_shared(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        root = self.reader.take_slot(pass_no, worker, wseq, wait)
        if root is AGAIN:
            self._pump()
            return root
        if root is END or root is FAULT:
            return root
        if _ring.is_external_record(root):
            return self._share_external(root, self.reader.last_worker)
        return SharedBatch(root, ("slot", int(root.ctypes.data) - self.segment.address, int(root.nbytes)))

    def share_with_ranks(self) -> tuple[dict[str, Any], list[int]]:
        """The ring's geometry and a new descriptor of its memory, for a rank."""
        segment = self.segment
        share = {
            "backing": "posix" if segment.name else "memfd",
            "total": segment.size,
            "header": self.ring.payload_address(0) - segment.address,
            "slot_size": self.ring.slot_size,
            "nslots": self.ring.nslots,
        }
        if segment.name:
            fd = os.open(os.path.join(_segments.SHM_DIR, segment.name.lstrip("/")), os.O_RDONLY | os.O_CLOEXEC)
        else:
            if segment.fd < 0:
                raise CorruptChannelError("the ring's memory can no longer be shared (the pipeline is closing)")
            fd = os.dup(segment.fd)
        return share, [fd]

    def begin_pass(self, pass_no: int) -> None:
        # Regions outlive passes (a producer keeps its pool from one to the
        # next); those of producers since replaced go.
        if self.regions is not None:
            self.regions.begin_pass()
        if pass_no == self.ring.current_pass:
            return  # the pass the ring was created at
        started = self.ring.begin_pass()
        if started != pass_no:
            raise CorruptChannelError(
                f"the ring began pass {started} where the pipeline begins pass {pass_no}: its pass number was "
                "written from outside"
            )

    def halt(self) -> None:
        self.ring.report_fault()

    def audit(self, pass_no: int) -> None:
        # The pass number and the HELD slots are exact (this process alone
        # changes them, and takes do not run meanwhile). A worker's in-flight
        # word is not: a producer between the two steps of its claim (the
        # slot's CAS, then the word's increment; of its abandon, the other
        # way round) shows a difference for as long as it is descheduled
        # there, and audits may come milliseconds apart (every wait of the
        # consumer that ends without a batch looks at the producers). So a
        # difference is an error only once the very same one has been seen
        # for UNEVEN_FOR_NS, by every audit in between and at least
        # UNEVEN_SIGHTINGS of them: two audits in a row were not enough (a
        # loaded machine failed healthy pipelines so). The same difference,
        # not the same words: a word set off by a constant stays off by it
        # while its producer claims and the consumer takes.
        problem, uneven = self.ring.audit(pass_no)
        if problem is not None:
            raise CorruptChannelError(f"the ring is inconsistent: {problem} (written from outside?)")
        now, seen = time.monotonic_ns(), self._uneven
        self._uneven = {}
        for worker, word, slots in uneven:
            since, sightings = seen.get((worker, word - slots), (now, 0))
            self._uneven[worker, word - slots] = (since, sightings + 1)
            if now - since < UNEVEN_FOR_NS or sightings + 1 < UNEVEN_SIGHTINGS:
                continue
            raise CorruptChannelError(
                f"the ring is inconsistent: worker {worker}'s in-flight count is {word} but it has {slots} slots "
                "being written or ready (written from outside?); its quota would hold it for good"
            )

    def reclaim(self, worker: int, pass_no: int, delivered: int) -> tuple[int, bool]:
        # The slots it was writing come back; what it published stays READY
        # and is delivered. Those are shared words: their numbers must go on
        # from what was taken without a gap, or the ring was written by
        # someone else.
        self.ring.reclaim(worker)
        ready = sorted(self.ring.ready_wseqs(worker, pass_no))
        if ready != list(range(delivered, delivered + len(ready))):
            raise CorruptChannelError(
                f"worker {worker}'s batches of pass {pass_no} waiting in the ring are numbered {ready[:8]}, "
                f"not from {delivered} on (the {delivered} before were taken): refusing to guess where it stopped"
            )
        next_wseq = delivered + len(ready)
        if self.regions is not None:
            # Its regions stay known for the batches it published in them;
            # the replacement announces its own, with ids above its.
            self._first_rid[worker] = self.regions.retire(worker)
        return next_wseq, self.ring.worker_done(worker, pass_no)

    def replacement_handle(self, worker: int) -> ShmHandle:
        return self.handle._replace(first_rid=self._first_rid.get(worker, 0))

    def close(self) -> None:
        """Stops producers' waits; the memory stays while batches live."""
        self.ring.close()

    def destroy(self) -> None:
        """No one can attach any more (the name is removed, or our descriptor
        closed). Arrays still alive keep their memory."""
        self.segment.unlink()
        if self.handle.fd is not None:
            self.handle.fd.forget()  # that number may soon be another file's
        if self.regions is not None:
            self.regions.close()
            self.regions = None
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None
            if self.handle.outbox is not None:
                self.handle.outbox.forget()

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
