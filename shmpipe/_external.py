"""Batches larger than a slot: in regions of memory of their own, reused.

Part of the ring engine. A ring's slots have one size (the first batch's
plus 25%, or what the user asked for). A batch that does not fit travels
beside the ring instead of failing, still without a copy on the consumer's
side, and -- once its producer's regions fit the sizes it makes -- without
a system call on either side:

1. The producer claims a slot as for any batch (so the ring's capacity
   bounds these batches too: no more than ``capacity`` are ever in flight
   or held, whatever their size).
2. It picks a *region* of its pool that is free (below) and large enough,
   writes the batch there through its own writable mapping, and publishes
   the slot with a 32-byte *record* in place of a payload (written and read
   by _ring.pyx, RingWriter.publish_record and read_record: the layout's
   one home)::

       0   u32 magic "SPX1"
       4   u32 worker
       8   u64 nbytes   (the payload's size, at offset 0 of the region)
       16  u64 rid      (the region's id: its worker never uses one twice)
       24  u32 region   (its index in the worker's table: <= the ring's slots)
       28  u32 zero

3. A region is a memfd the producer made once: sized (its first batch's
   size plus 25%, whole pages), reserved (posix_fallocate), mapped
   writable in the producer, then sealed against resizing and against
   *future* writes (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE |
   F_SEAL_SEAL): the producer's own mapping is the only way anyone can ever
   write it. Its descriptor goes to the consumer once, on the ring's
   *outbox* (a SOCK_SEQPACKET socket every producer of the pipeline
   shares), as a datagram NEW (worker, region, rid) with one descriptor,
   before the first record that names it is published (sendmsg returns
   after queueing: the datagram is in the consumer's socket before that
   slot can be seen READY). The producer then closes its descriptor.
4. The consumer, taking a slot whose payload is a record, finds (worker,
   region) in its table, checks the rid and that `nbytes` lies inside the
   region, maps the region read-only the first time (and caches the
   mapping), and decodes the batch from it. The batch's root holds the
   mapping *and* the record, so the slot, until the last array of the
   batch is gone.

What runs for every such batch is compiled, next to the ring's own slot
handling (_ring.pyx: RegionPoolCore, the producer's pick of a free region
and the record's publication; RegionTable, the reader's lookup of a region
it mapped already): a batch in a region costs no more Python calls than
one in a slot. Everything that runs once per region -- making, announcing,
mapping, dropping one, and every check of the outbox -- is here.

**Lifetimes** (every rule the reuse rests on):

- *A region is busy while the slot that announced its last batch still
  holds that batch* (READY or HELD with that worker, pass and wseq:
  RingWriter.holds, one acquire load). That slot is released only when the
  last array of the batch is gone in the consumer (or a rank it was dealt
  to), or discarded unread (a cancelled pass). So the producer never
  writes a region while an array of a batch in it lives in the consumer,
  and "a kept view never changes" holds as it does for a slot; the
  acquire load orders the consumer's reads before the producer's next
  writes, as a slot's claim does.
- *A producer never needs more regions than slots, plus one*: every busy
  region is held by a distinct slot with one of its batches, and it holds
  one more slot (the one it just claimed), so with a pool of ``nslots``
  regions one is always free; the one more is for a reservation's region,
  kept busy while a batch yielded instead of it (which may hold its
  arrays) is copied into another. The producer prefers the smallest free
  region that fits; else it replaces a free one that is too small by a
  larger one (a new rid at the same index: the NEW says so, and the
  consumer drops the old one); else it makes one at a new index.
- *Sizes shrink: memory is given back.* A free region its producer has not
  used for its last ``IDLE_PUTS`` batches (of any size, in a slot or not)
  is dropped: the producer unmaps it and sends DROP (worker, region, rid),
  no descriptor; the consumer closes its descriptor and forgets its
  mapping. The memory is freed when the last batch still mapping it in
  the consumer is gone (its mapping is refcounted, never closed under a
  live array). The consumer reads the outbox when it waits, at the first
  use of a region, and at least every PUMP_EVERY_NS while batches flow
  (ShmConsumer.get), so a DROP takes effect within that.
- *The consumer keeps a region's descriptor* while the region is in its
  table: a group's rank is dealt a batch by a duplicate of it. Sealed
  against future writes, the descriptor lets no other process write the
  region (a process of the user that opens it through /proc can only
  read it).
- A producer that dies leaves its regions in the consumer's table until
  the pipeline closes (its WorkerDiedError closes it); then every
  descriptor is closed, and each mapping goes with the last batch in it.

**What is not atomic:** the record is written with plain stores before
the slot's publish (release), as a payload is; a region's bytes are plain
stores covered by the same release/acquire pair. The producer's pool and
the consumer's table are each one process's own (the consumer's is only
touched under its consumer lock, and by close(), which marks it closed
first). Nothing here is shared between threads of a producer.

What the consumer accepts from the outbox (every producer shares it, and
its datagrams are untrusted input like the ring's bytes): everything that
sizes or locates memory is read once into its own memory and checked
before use, and anything wrong is a CorruptChannelError (closing every
descriptor that came with it):

- A datagram is exactly one tag: NEW with exactly one descriptor, DROP
  with none. A longer one (MSG_TRUNC), one with more descriptors
  (MSG_CTRUNC with some installed) or anything else is refused. (MSG_CTRUNC
  with none installed: this process ran out of descriptors, a ShmpipeError
  that says so.)
- Its worker is one of the ring's, its region index at most the ring's
  slot count (so the table is bounded: workers x (slots + 1), and never more than a
  quarter of ``ulimit -n`` descriptors, a ShmpipeError beyond).
- *Each worker's rids only grow.* A NEW whose rid is not above every rid
  that worker announced before is refused: one producer sends its NEWs in
  order on one socket, so a second announcement of a region, or one sent
  early by another process, is this error, and since the consumer reads
  the outbox before the *first* use of a region (its NEW was sent before
  the record was published), an early impostor and the real announcement
  are both in hand by then: the outcome is this error, never a different
  batch. Later ones fail when they arrive.
- A NEW's memory must be sealed against resizing and against writing
  (future writes, or all): checked with F_GET_SEALS; its size (fstat) is
  read once, must be whole pages, and is kept. A DROP must name the rid
  the table holds at that index.
- A record must name a region its worker announced (that index, that rid),
  a size inside it; the region is mapped read-only at the first use, at
  most twice the record's size (whole pages; never beyond the region),
  and mapped again, larger, only when a later record needs more: a sparse
  region of 32 TiB maps what the records in it claim, not its file's size.

Memory bound: the ring, plus each producer's regions: the busy ones (at
most ``capacity`` over all producers, one per slot) and the free ones it
used within its last ``IDLE_PUTS`` batches, each at most its first batch's
size plus 25%. The consumer maps no more than its table holds, plus the
regions dropped or replaced whose batches it still holds.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import socket
import struct
import time
from typing import Any

import numpy as np

from shmpipe import _cow, _fdpass, _ring
from shmpipe._interrupts import ctrl_c_held_back
from shmpipe._process import proc_kib
from shmpipe.errors import CorruptChannelError, PipelineClosedError, SharedMemoryFullError, ShmpipeError

__all__ = [
    "ExternalMemory",
    "Outbox",
    "Region",
    "RegionPool",
    "Regions",
    "map_external",
    "outbox_pair",
    "region_size_for",
    "stash_limit",
]

#: A datagram on the outbox: kind, worker, region, rid.
TAG = struct.Struct("<IIIQ")
#: Kinds of datagram: a region announced (one descriptor), a region dropped (none).
NEW, DROP = 1, 2
#: A region is made this much larger than the batch that needs it first,
#: so that batches of sizes that vary a little share it.
HEADROOM = 1.25
#: A free region its producer did not use for this many of its batches is
#: dropped (at least; sixteen times the ring's slots where that is more: a
#: region may serve only the bursts, when more batches are in flight), and
#: only once it has not been used for IDLE_NS either (a producer of a few
#: hundred batches a second keeps its regions through the gaps between
#: bursts: making one again costs as much as all its batches since).
IDLE_PUTS = 256
IDLE_NS = 1_000_000_000
#: How often (in batches) a producer looks for idle regions.
SWEEP_EVERY = 16
#: The consumer reads the outbox at least this often while batches flow.
PUMP_EVERY_NS = 100_000_000
_RESIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# Not in Python 3.11's fcntl; Linux 5.1 and later.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_PAGE = mmap.PAGESIZE
#: The most region descriptors the consumer ever keeps, whatever the
#: open-file limit (see stash_limit).
STASH_LIMIT = 8192


def stash_limit() -> int:
    """How many region descriptors the consumer may keep: a quarter of this
    process's open-file limit (the rest is the trainer's), at most
    STASH_LIMIT."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return STASH_LIMIT
    return max(1, min(STASH_LIMIT, soft // 4))


def region_size_for(nbytes: int) -> int:
    """The size of a region made for a payload of `nbytes`: 25% more, whole pages."""
    return max(_PAGE, -(-int(nbytes * HEADROOM) // _PAGE) * _PAGE)


_future_write: bool | None = None


def future_write_sealable() -> bool:
    """Whether this kernel has F_SEAL_FUTURE_WRITE (Linux 5.1): asked once,
    of a memfd made for the question. Where it has not, regions are sealed
    against resizing only, and the consumer asks no more (both ends run on
    the same kernel)."""
    global _future_write
    if _future_write is None:
        fd = os.memfd_create("shmpipe-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
            _future_write = True
        except OSError:
            _future_write = False
        finally:
            os.close(fd)
    return _future_write


# -- the producer's side ----------------------------------------------------------


#: One region of a producer's pool (compiled: the pool picks one per batch).
Region = _ring.Region


class Outbox:
    """A producer's end of the outbox: announces and drops its regions.
    `first_rid`: the id its first region takes (0, or for a producer that
    replaces a dead one, above every id its predecessor announced)."""

    def __init__(self, sock: socket.socket, first_rid: int = 0) -> None:
        self.sock = sock
        self.first_rid = first_rid

    def announce(self, fd: int, worker: int, index: int, rid: int) -> None:
        _fdpass.send_fds(self.sock, TAG.pack(NEW, worker, index, rid), [fd])

    def drop(self, worker: int, index: int, rid: int) -> None:
        _fdpass.send_fds(self.sock, TAG.pack(DROP, worker, index, rid), [])

    def close(self) -> None:
        self.sock.close()


class RegionPool(_ring.RegionPoolCore):
    """A producer's regions (see the module doc for the rules). What runs
    for every batch is compiled (_ring.RegionPoolCore): put_external() picks
    the smallest free region that fits and publishes the batch's record,
    and tick() counts every batch the producer sends (in a slot or not:
    idle regions are dropped by the count). Here: making a region when none
    fits (take, _make), and dropping idle ones (sweep)."""

    def __init__(self, writer: _ring.RingWriter, outbox: Outbox) -> None:
        # One region per slot is all a producer can keep busy, plus the one
        # it fills (module doc), plus one: a reservation's, kept busy while
        # what was yielded instead is copied (it may hold its arrays). The
        # bound the consumer checks too.
        limit = writer.ring.nslots + 1
        super().__init__(writer, limit, max(IDLE_PUTS, 16 * limit), SWEEP_EVERY)
        self.outbox = outbox
        self.next_rid = outbox.first_rid
        #: Regions made (memfds created) since the pool began: a statistic.
        self.created = 0

    def take(self, nbytes: int) -> Region:
        """A free region with room for `nbytes` (announced to the consumer
        if it is new), taken. Call with the batch's slot claimed."""
        region = self.pick(nbytes)
        return self._make(nbytes) if region is None else region

    def _make(self, nbytes: int) -> Region:
        """A region for `nbytes` where none that is free fits (pick() said
        so, and noted the peak): in place of the smallest free one, too
        small (a new rid at its index: the consumer drops the old one when
        the NEW comes), else at a new index. Taken."""
        small = min((r for r in self.regions if self.free(r)), key=lambda r: r.size, default=None)
        if small is not None:
            # Too small for what comes now: replaced at its index (the
            # consumer drops the old one when the NEW comes).
            self.regions.remove(small)
            index = small.index
        else:
            used = {r.index for r in self.regions}
            index = next((i for i in range(self.limit) if i not in used), -1)
            if index < 0:
                raise AssertionError(
                    f"all {self.limit} regions of worker {self.writer.worker} are busy while it holds a "
                    "claimed slot: more batches in flight than slots"
                )
        # Made for the peak (the largest batch that needed a region lately),
        # not only for this batch: sizes that vary share regions rather
        # than replace them by larger ones over and over.
        region = self._new(index, max(nbytes, self.peak))
        self.use(region)
        return region

    def _new(self, index: int, nbytes: int) -> Region:
        size = region_size_for(nbytes)
        rid = self.next_rid
        self.next_rid += 1  # never used again, whatever happens below
        fd = os.memfd_create("shmpipe-batch", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)  # every page now: no room is an error here, not a SIGBUS
            except OSError as exc:
                raise SharedMemoryFullError(size, 0, "memory for a batch larger than a slot") from exc
            mapping = _ring.Mapping(fd, size, True)  # writable, every page touched once now
            # Our mapping stays writable; nobody may write it any other way
            # from now on (a mapping or write() through any descriptor).
            seals = _RESIZE_SEALS | fcntl.F_SEAL_SEAL | (F_SEAL_FUTURE_WRITE if future_write_sealable() else 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            self.outbox.announce(fd, self.writer.worker, index, rid)
        finally:
            os.close(fd)  # our mapping keeps the memory; the consumer has its own descriptor
        region = Region(index, rid, mapping)
        self.regions.append(region)
        self.created += 1
        return region

    def sweep(self) -> None:
        self.next_sweep = self.puts + SWEEP_EVERY
        if not self.regions:
            return
        old = time.monotonic_ns() - IDLE_NS
        idle = [r for r in self.regions if self.puts - r.last_used > self.idle_puts and r.used_ns < old]
        for region in [r for r in idle if self.free(r)]:
            self.regions.remove(region)
            # Told before our mapping goes (which frees nothing while the
            # consumer maps it); a producer's arrays still viewing it (a
            # reservation it kept) keep our mapping until they go.
            self.outbox.drop(self.writer.worker, region.index, region.rid)

    def held_bytes(self) -> int:
        return sum(r.size for r in self.regions)

    def close(self) -> None:
        self.regions.clear()  # the mappings go with the last array over them
        self.outbox.close()


# -- the consumer's side ----------------------------------------------------------


def outbox_pair() -> tuple[socket.socket, socket.socket]:
    """(consumer's end, producers' end) of a pipeline's outbox."""
    inbox, outbox = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    inbox.setblocking(False)
    return inbox, outbox


#: A region the consumer was told of (compiled: the reader looks it up per batch).
_Known = _ring.RegionEntry


class _Held(_ring.RegionHold):
    """The base of a batch's root in a region (_ring.RegionHold: the
    mapping, the record, the region's descriptor), and the way to a
    private, writable view of its arrays for torch (_cow.py)."""

    __slots__ = ()

    def writable_view(self, arr: np.ndarray) -> np.ndarray:
        """`arr` (an array of this batch) as a writable array whose writes
        stay in this process (_cow.py)."""
        if self.desc is None:
            return _cow.writable_alias(arr)
        fd: int = self.desc.fd
        return _cow.view(arr, fd, self.view.address, 0)


class Regions:
    """The consumer's end of the outbox and its table of regions: (worker,
    index) -> the region announced there last. What it accepts is in the
    module doc."""

    def __init__(self, sock: socket.socket, nworkers: int, nslots: int) -> None:
        self.sock = sock
        self.nworkers = nworkers
        self.nslots = nslots
        #: (worker, index) -> the region announced there last; the reader
        #: finds a batch's region here itself once it is mapped.
        self.table = _ring.RegionTable(nworkers, nslots + 1, _Held)
        #: worker -> the highest rid it announced.
        self.last_rid: dict[int, int] = {}
        #: (worker, rid) -> a region of a producer that died and was
        #: replaced: batches it published in them may still be taken, this
        #: pass (retire); closed when the next pass begins.
        self.retired: dict[tuple[int, int], tuple[int, _Known]] = {}
        self.limit = stash_limit()
        self.closed = False
        #: Statistics: descriptors received (NEW), regions dropped (DROP or
        #: replaced), mappings made.
        self.received = 0
        self.dropped = 0
        self.maps = 0
        self.next_pump_ns = 0

    def stats(self) -> dict[str, int]:
        """What this consumer holds for batches larger than a slot, and how
        often it had to be told of or map a region."""
        return {
            "received": self.received,
            "dropped": self.dropped,
            "maps": self.maps,
            "regions": len(self.table),
            "region_bytes": sum(k.size for k in self.table.values()),
            "mapped_bytes": sum(k.mapped for k in self.table.values()),
        }

    def pump(self) -> None:
        """Takes every datagram waiting on the socket (the consumer calls
        this while it waits, so producers never block sending one). Does
        nothing once the pipeline closed, which another thread may do at
        any moment (the socket is then gone)."""
        self.next_pump_ns = time.monotonic_ns() + PUMP_EVERY_NS
        try:
            self._receive_all()
        except OSError:
            if not self.closed:
                raise

    def pump_if_due(self) -> None:
        """pump() when PUMP_EVERY_NS passed since the last (a DROP waits no
        longer than that while batches flow; no system call otherwise)."""
        if time.monotonic_ns() >= self.next_pump_ns:
            self.pump()

    def _receive_all(self) -> None:
        # A Ctrl-C between receiving a descriptor and keeping it would leak
        # it (close() only knows the table): held back to the end.
        with ctrl_c_held_back():
            self._receive_all_now()

    def _receive_all_now(self) -> None:
        while True:
            try:
                # Close-on-exec: a batch's memory must not live on in a
                # program this process (or another thread) starts.
                msg, fds, truncated, fds_cut = _fdpass.recv_fds(self.sock, TAG.size, 4)
            except (BlockingIOError, InterruptedError):
                return
            if fds_cut and not fds:
                # The kernel dropped the descriptor it could not install here.
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                raise ShmpipeError(
                    f"this process ran out of file descriptors (ulimit -n is {soft}) while receiving the memory "
                    f"of batches larger than a slot ({len(self.table)} regions are held); raise the limit "
                    "(ulimit -n), lower capacity, or give slot_size= so batches fit in slots"
                )
            if not msg and not fds and not truncated:
                return  # every producer's end is closed
            try:
                self._accept(msg, fds, truncated, fds_cut)
            except BaseException:
                _fdpass.close_all(fd for fd in fds if fd >= 0)
                raise

    def _accept(self, msg: bytes, fds: list[int], truncated: bool, fds_cut: bool) -> None:
        """Applies one datagram (see the module doc); a descriptor it keeps
        is set to -1 in `fds` (the caller closes the others on error)."""
        kind = TAG.unpack(msg)[0] if len(msg) == TAG.size and not truncated else 0
        if kind not in (NEW, DROP) or fds_cut or len(fds) != (1 if kind == NEW else 0):
            # A longer datagram (MSG_TRUNC: read as its first bytes, it
            # would pass for a tag), an unknown kind, or the wrong number
            # of descriptors.
            _fdpass.close_all(fds)
            fds.clear()
            raise CorruptChannelError(
                "a malformed message on the external batches' socket: "
                + ("longer than a tag" if truncated else f"{len(msg)} bytes, kind {kind}")
                + (", more descriptors than sent" if fds_cut else f", {len(fds)} descriptors")
                + f" (a tag is {TAG.size} bytes, NEW with one descriptor, DROP with none)"
            )
        _, worker, index, rid = TAG.unpack(msg)
        what = f"region {index} (id {rid}) of worker {worker}"
        if worker >= self.nworkers or index > self.nslots:
            raise CorruptChannelError(
                f"{what} is outside the ring: it has {self.nworkers} workers, and a worker at most "
                f"{self.nslots + 1} regions (one per slot, and one)"
            )
        known = self.table.get(worker, index)
        if kind == DROP:
            if known is None or known.rid != rid:
                raise CorruptChannelError(f"{what} is dropped, but it is not the region held there")
            self._forget(worker, index)
            return
        if rid <= self.last_rid.get(worker, -1):
            raise CorruptChannelError(
                f"{what} is announced after that worker's region id {self.last_rid[worker]} (a region "
                "announced twice, or by another process first); refusing it"
            )
        fd = fds[0]
        size = _region_size(fd, what)
        if known is None and len(self.table) >= self.limit:
            self.limit = stash_limit()  # the limit may have been raised since
            if len(self.table) >= self.limit:
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                raise ShmpipeError(
                    f"{len(self.table)} regions for batches larger than a slot are held, a quarter of this "
                    f"process's open-file limit (ulimit -n is {soft}); raise the limit (ulimit -n), lower "
                    f"capacity (now {self.nslots}), or give slot_size= so batches fit in slots"
                )
        if known is not None:
            self._forget(worker, index)  # replaced: its batches still alive keep its mapping
        self.last_rid[worker] = rid
        desc = _cow.Descriptor(fd)
        fds[0] = -1  # ours now (closed with the last reference to `desc`)
        self.table.put(worker, index, _Known(rid, size, desc))
        self.received += 1

    def retire(self, worker: int) -> int:
        """Producer `worker` is gone (reaped), to be replaced: its regions
        leave the table (the replacement announces its own, at any index)
        but stay known by id while batches it published in them may be
        taken this pass. Returns the id the replacement's first region
        takes: above every id the dead one announced (everything it sent is
        on the socket now), so "ids only grow" holds across the two."""
        self._drain_before_use()
        for (of, index), known in self.table.items():
            if of == worker:
                self.table.pop(worker, index)
                self.retired[(worker, known.rid)] = (index, known)
        return self.last_rid.get(worker, -1) + 1

    def begin_pass(self) -> None:
        """A new pass: batches of the old one are never taken, so the
        retired regions go (their mappings stay while batches in them live)."""
        for _index, known in self.retired.values():
            known.forget()  # closed, and unmapped, once no batch in it lives
        self.retired.clear()

    def _forget(self, worker: int, index: int) -> None:
        self.table.pop(worker, index).forget()  # the descriptor and the mapping go with the last batch in it
        self.dropped += 1

    def root(self, worker: int, index: int, rid: int, nbytes: int, record: Any) -> np.ndarray:
        """The root (read-only, holding `record`: the slot) of the batch of
        `nbytes` that a record of `worker` (read once and checked by the
        reader: RingReader.on_external) says is in its region `index`, id
        `rid`. Each of those values is checked here against the table,
        which holds only what this process read and checked itself. (The
        reader finds a region it mapped already itself: RegionTable.root,
        the same checks; here are the first use of a region, a larger
        mapping, a replaced producer's regions and every error.)"""
        root = self.table.root(worker, index, rid, nbytes, record)
        if root is not None:
            return root
        known = self._lookup(worker, index, rid)
        if known is None or not known.mapped:
            # The first use of a region: its NEW was sent before this record
            # was published, so whatever else announced it is in hand now.
            self._drain_before_use()
            known = self._lookup(worker, index, rid)
            if known is None:
                raise CorruptChannelError(
                    f"a record names region {index} (id {rid}) of worker {worker}, which it never "
                    "announced (or dropped or replaced)"
                )
        if nbytes > known.mapped or known.view is None:
            if nbytes > known.size:
                raise CorruptChannelError(
                    f"a record claims {nbytes:,} bytes in region {index} of worker {worker}, of {known.size:,}"
                )
            self._map(known, nbytes)
        view, desc = known.view, known.desc
        assert view is not None and desc is not None
        return _ring.region_root(_Held(view, record, desc), view.address, nbytes)

    def _lookup(self, worker: int, index: int, rid: int) -> _Known | None:
        """The region that index and id name: in the table, or among those
        of a producer since replaced (retire)."""
        known = self.table.get(worker, index)
        if known is not None and known.rid == rid:
            return known
        retired = self.retired.get((worker, rid))
        return retired[1] if retired is not None and retired[0] == index else None

    def _drain_before_use(self) -> None:
        try:
            self._receive_all()
        except OSError:
            if not self.closed:
                raise
            raise PipelineClosedError("the pipeline was closed while a batch larger than a slot arrived") from None

    def _map(self, known: _Known, nbytes: int) -> None:
        """Maps (again, larger) `known` read-only: twice `nbytes` in whole
        pages, at most the region. The old mapping stays while batches in
        it live."""
        length = min(known.size, max(-(-2 * nbytes // _PAGE) * _PAGE, _PAGE))
        assert known.desc is not None
        known.set_view(_map_readonly(known.desc.fd, length, nbytes, known.size))
        self.maps += 1

    def fd_of(self, worker: int, index: int) -> int:
        """The descriptor of a region in the table (for a rank of a group)."""
        known = self.table.get(worker, index)
        if known is None or known.desc is None:
            raise KeyError((worker, index))
        fd: int = known.desc.fd
        return fd

    def close(self) -> None:
        self.closed = True  # first: a thread still receiving knows the socket's end is no error
        for (worker, index), _known in self.table.items():
            self._forget(worker, index)
        self.begin_pass()  # the retired ones
        self.sock.close()


def _region_size(fd: int, what: str) -> int:
    """The size of a region's memory (read once), after checking it can be
    neither resized nor written but through its producer's own mapping."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise CorruptChannelError(f"{what}: its descriptor is not sealable memory: {exc}") from None
    if seals & _RESIZE_SEALS != _RESIZE_SEALS:
        raise CorruptChannelError(f"{what} is not sealed against resizing; refusing it")
    if future_write_sealable() and not seals & (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_WRITE):
        raise CorruptChannelError(f"{what} is not sealed against writing; refusing it")
    try:
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise CorruptChannelError(f"{what}: its descriptor cannot be examined: {exc}") from None
    if size <= 0 or size % _PAGE:
        raise CorruptChannelError(f"{what} has {size:,} bytes, not a whole number of pages")
    return size


# -- a rank's side (a big batch dealt with its own descriptor) ---------------------


class ExternalMemory:
    """A mapping of one external batch's memory, for as long as its arrays
    live: the base of the batch's root array (through
    ``__array_interface__``), which keeps this object, so the mapping and
    the slot (`lease`) alive."""

    __slots__ = ("_interface", "lease", "mm")

    def __init__(self, mm: mmap.mmap, nbytes: int, writeable: bool, lease: Any) -> None:
        self.mm = mm
        self.lease = lease
        probe = np.frombuffer(mm, np.uint8, count=nbytes) if nbytes else np.zeros(0, np.uint8)
        address = probe.ctypes.data
        del probe  # no buffer export may outlive this call: the mapping closes with us
        self._interface = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, not writeable),
            "version": 3,
        }

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._interface

    def root(self) -> np.ndarray:
        """The payload as a uint8 array whose base is this object."""
        return np.asarray(self)


def _address_space_left() -> tuple[int, str]:
    """Roughly how much address space this process may still map, and what
    limits it (RLIMIT_AS where set, else the 128 TiB of a user's space)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    used = proc_kib("/proc/self/status", "VmSize") or 0
    if soft != resource.RLIM_INFINITY:
        return max(0, soft - used), f"this process's address space (ulimit -v: {soft:,} bytes)"
    return max(0, (1 << 47) - used), "this process's address space (or vm.max_map_count)"


def _map_readonly(fd: int, length: int, nbytes: int, size: int, *, private: bool = False) -> _ring.Mapping:
    """`length` bytes of `fd` mapped read-only (or `private`: copy-on-write,
    _cow.py), for a batch of `nbytes` in memory of `size`; every failure is
    a ShmpipeError naming the sizes."""
    try:
        return _ring.Mapping(fd, length, False, private)
    except OSError as exc:
        mapped = -(-length // _PAGE) * _PAGE
        if exc.errno == errno.ENOMEM:
            left, where = _address_space_left()
            raise SharedMemoryFullError(
                mapped,
                left,
                where,
                what=f"mapping a batch larger than a slot ({nbytes:,} bytes in memory of {size:,})",
                fix="hold fewer batches at once, raise the limit, or make batches smaller",
            ) from None
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            raise ShmpipeError(
                f"this process ran out of file descriptors (ulimit -n is {soft}) while mapping a batch larger "
                f"than a slot ({nbytes:,} bytes); raise the limit (ulimit -n) or hold fewer batches at once"
            ) from None
        raise CorruptChannelError(
            f"an external batch's memory ({nbytes:,} of {size:,} bytes) cannot be mapped: {exc}"
        ) from None


def map_external(fd: int, nbytes: int, lease: Any, *, write_sealed: bool) -> np.ndarray:
    """Maps exactly `nbytes` of the external batch `fd` privately, copy-on-write (whole
    pages: the last one rounded up; never the file's own size) after
    checking it cannot be resized (nor written, with `write_sealed`: what
    its record claims) and holds `nbytes`; returns its root array (which
    keeps the mapping and `lease`). The caller keeps (and closes) `fd`.
    What a rank of a group does with a big batch it is dealt (a duplicate
    of the region's descriptor: the batch lies at its start). Every failure
    is a ShmpipeError naming the sizes."""
    if type(nbytes) is not int or nbytes < 0:
        raise CorruptChannelError(f"an external batch's size is {nbytes!r:.40}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise CorruptChannelError(f"an external batch's descriptor is not sealable memory: {exc}") from None
    if seals & _RESIZE_SEALS != _RESIZE_SEALS:
        raise CorruptChannelError("an external batch's memory is not sealed against resizing; refusing to map it")
    if write_sealed and not seals & fcntl.F_SEAL_WRITE:
        raise CorruptChannelError(
            "an external batch's record says its memory is sealed against writing, but it is not; refusing to map it"
        )
    try:
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise CorruptChannelError(f"an external batch's descriptor cannot be examined: {exc}") from None
    if nbytes > size:
        raise CorruptChannelError(f"an external batch claims {nbytes:,} bytes in memory of {size:,}")
    if nbytes == 0:
        return ExternalMemory(mmap.mmap(-1, 1), 0, False, lease).root()
    # Private (copy-on-write): this batch's own mapping, so its torch tensors
    # can be written in place without touching the memory (_cow.py); its
    # arrays are read-only all the same.
    mapping = _map_readonly(fd, nbytes, nbytes, size, private=True)
    return _ring.region_root(_Held(mapping, lease, None), mapping.address, nbytes)
