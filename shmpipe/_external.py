"""Batches larger than a slot: each in sealed anonymous memory of its own.

Part of the ring engine. A ring's slots have one size (the first batch's
plus 25%, or what the user asked for). A batch that does not fit travels
beside the ring instead of failing, still without a copy on the consumer's
side:

1. The producer claims a slot as for any batch (so the ring's capacity
   bounds these batches too: no more than ``capacity`` are ever in flight
   or held, whatever their size).
2. It writes the batch into new anonymous memory of the batch's size
   (memfd_create), unmaps it, and seals it against resizing and writing
   (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL: nobody, the
   producer included, can change or truncate it any more).
3. It sends the descriptor to the consumer on the ring's *outbox*, a
   SOCK_SEQPACKET socket every producer of the pipeline shares, as one
   datagram tagged (pass, worker, wseq), and only then publishes the slot
   with a 32-byte *record* in place of a payload::

       0   u32 magic "SPX1"
       4   u32 pass
       8   u64 nbytes   (the payload's size in the external memory)
       16  u32 worker
       20  u32 flags    (bit 0, WRITE_SEALED: the memory is sealed against
                         writing; no other bit may be set)
       24  u64 wseq

   The datagram is in the consumer's socket queue before the slot can be
   seen READY (sendmsg returns after queueing; the publish comes after it).
4. The consumer, taking a slot whose payload is a record, receives the
   descriptor with that tag (datagrams of other batches wait in a stash),
   checks the seals (against resizing always; against writing too where
   the record says WRITE_SEALED) and that the memory holds `nbytes`, maps
   exactly `nbytes` of it (the kernel rounds up to a page: never the
   file's own size, which could be far larger) read-only and decodes the
   batch from it. The batch's root holds the mapping *and* the slot: the
   slot goes back, and the memory is unmapped (and freed: no one else holds
   it), when the last array of the batch is gone.

A reservation (``reserve`` of a template larger than a slot) is made the
same way, except that the producer keeps its mapping while the arrays it
handed out live, so the memory is sealed against resizing but not writing,
and its record says so (no WRITE_SEALED). Its guarantee is a slot's: the
consumer maps it read-only and it can never shrink under a reader (no
SIGBUS), but the producer's process -- and so another process of the user
that reaches its memory -- could still write it, as it could a slot (the
arrays handed out are made read-only when the batch is published, as a
slot's are). Only a put() batch's memory is immutable, and the consumer
verifies that (F_GET_SEALS) for every record that claims it.

What the consumer accepts from the outbox (every producer shares it, and
its datagrams are untrusted input like the ring's bytes):

- A datagram is exactly one 16-byte tag with exactly one descriptor; a
  longer one (MSG_TRUNC), one with more descriptors (MSG_CTRUNC with some
  installed) or anything else is a CorruptChannelError, every descriptor
  that came with it closed. (MSG_CTRUNC with none installed: this process
  ran out of descriptors, a ShmpipeError that says so.)
- Tags of passes before the current one are of cancelled passes: closed.
  A tag of a later pass cannot be sent legitimately (the consumer begins a
  pass before any producer hears of it): a CorruptChannelError.
- *One descriptor per tag.* The first datagram with a tag does not win: a
  second one with a tag already stashed, or with the tag of a batch of
  that worker already taken (or older: the ring gives each worker's
  batches in the order it published them, ordered or not -- shmp_take,
  docs/design.md "Choosing a batch"), is a CorruptChannelError; so is one
  still waiting for an older batch of a worker whose later one is taken
  (its slot never announced it). Why this is
  enough: a producer sends its batch's datagram *before* it publishes the
  slot, and the consumer drains the socket after taking the slot and
  before it looks the tag up. So if a datagram is sent early for a batch
  (by its own producer, or by another sharing the outbox) and the real one
  comes later, both are in the consumer's hands by the time the batch is
  taken, whichever order they came in: the outcome is this error, never
  a silently different batch. The only datagram that can be delivered
  unchallenged is one its worker's producer sent for a batch it then
  published without sending another, which is that producer's batch
  (a source may send any batch it likes).
- *No more than the ring can announce.* Each live datagram of the current
  pass belongs to a claimed slot not yet taken, so there are never more
  than ``capacity``: one more is stale or hostile, a CorruptChannelError
  (closing it). Independently, the stash never holds more than a quarter
  of the open-file limit (``RLIMIT_NOFILE``'s soft limit; at most
  STASH_LIMIT), so that however the producers behave the trainer keeps
  three quarters of its descriptors: one more is a ShmpipeError naming
  ``ulimit -n`` and capacity. Only a ring whose capacity is above that
  quarter can reach it, with that many big batches waiting at once (an
  ordered ring whose workers run ahead of a slow one can have nearly
  ``capacity`` waiting): such a ring of big batches needs ``ulimit -n`` of
  four times its capacity.

Memory bound: the ring, plus at most ``capacity`` external batches (each
the size its producer made it) -- those in flight and those the consumer
holds. Each is given back as soon as its batch is released. Datagrams of
batches the consumer will never take (a pass that was cancelled) are
closed when the next pass begins, as they arrive after it, and when the
pipeline closes.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import socket
import struct
from typing import Any

import numpy as np

from shmpipe import _fdpass
from shmpipe._interrupts import ctrl_c_held_back
from shmpipe._process import proc_kib
from shmpipe.errors import CorruptChannelError, PipelineClosedError, SharedMemoryFullError, ShmpipeError

__all__ = [
    "RECORD",
    "WRITE_SEALED",
    "ExternalMemory",
    "Inbox",
    "Outbox",
    "map_external",
    "new_external",
    "outbox_pair",
    "read_record",
    "stash_limit",
    "write_record",
]

MAGIC = b"SPX1"
RECORD = struct.Struct("<4sIQIIQ")  # magic, pass, nbytes, worker, flags, wseq
#: A record's flag: the memory is sealed against writing (put(), not reserve()).
WRITE_SEALED = 1
_TAG = struct.Struct("<IIQ")  # pass, worker, wseq
_RESIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
#: The most datagrams of batches not yet taken the consumer ever keeps,
#: whatever the open-file limit (see stash_limit).
STASH_LIMIT = 8192


def stash_limit() -> int:
    """How many received descriptors the consumer may keep waiting: a
    quarter of this process's open-file limit (the rest is the trainer's),
    at most STASH_LIMIT."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return STASH_LIMIT
    return max(1, min(STASH_LIMIT, soft // 4))


def write_record(slot: np.ndarray, pass_no: int, worker: int, wseq: int, nbytes: int, *, write_sealed: bool) -> int:
    """Writes the record of an external batch into a claimed slot (saying
    whether its memory is sealed against writing); returns its size (what
    the slot is published with)."""
    RECORD.pack_into(slot.data, 0, MAGIC, pass_no, nbytes, worker, WRITE_SEALED if write_sealed else 0, wseq)
    return RECORD.size


def read_record(payload: np.ndarray) -> tuple[int, int, int, int, bool]:
    """(pass, worker, wseq, nbytes, write_sealed) of a record, read once
    from the slot; CorruptChannelError if it is not one."""
    if payload.nbytes != RECORD.size:
        raise CorruptChannelError(f"an external batch's record has {payload.nbytes} bytes, not {RECORD.size}")
    magic, pass_no, nbytes, worker, flags, wseq = RECORD.unpack(payload.data)
    if magic != MAGIC or flags & ~WRITE_SEALED:
        raise CorruptChannelError("a slot holds neither a batch nor an external batch's record")
    return pass_no, worker, wseq, nbytes, bool(flags & WRITE_SEALED)


class ExternalMemory:
    """A mapping of one external batch's memory, for as long as its arrays
    live: the base of the batch's root array (through
    ``__array_interface__``), which keeps this object, so the mapping and
    the slot (`lease`, the record's root) alive."""

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


def new_external(nbytes: int) -> tuple[int, mmap.mmap]:
    """New anonymous memory for a payload of `nbytes`: (descriptor, writable
    mapping). Reserved up front, so no room is an error here, not a SIGBUS."""
    fd = os.memfd_create("shmpipe-batch", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise SharedMemoryFullError(nbytes, 0, "memory for a batch larger than a slot") from exc
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def seal(fd: int, *, writes: bool) -> None:
    """No resizing from now on (nor writing, with `writes`), for anyone."""
    seals = _RESIZE_SEALS | fcntl.F_SEAL_SEAL | (fcntl.F_SEAL_WRITE if writes else 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)


def outbox_pair() -> tuple[socket.socket, socket.socket]:
    """(consumer's end, producers' end) of a pipeline's outbox."""
    inbox, outbox = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    inbox.setblocking(False)
    return inbox, outbox


class Outbox:
    """A producer's end: sends an external batch's descriptor, tagged."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, fd: int, pass_no: int, worker: int, wseq: int) -> None:
        _fdpass.send_fds(self.sock, _TAG.pack(pass_no, worker, wseq), [fd])

    def close(self) -> None:
        self.sock.close()


class Inbox:
    """The consumer's end: the descriptor of the external batch asked for,
    from the datagrams received so far (and those waiting in the socket).
    What it accepts is in the module doc: one descriptor per tag, none for
    a batch already taken, no more than the ring's `capacity` waiting."""

    def __init__(self, sock: socket.socket, capacity: int, first_pass: int = 0) -> None:
        self.sock = sock
        self.stash: dict[tuple[int, int, int], int] = {}
        self.capacity = capacity
        self.limit = stash_limit()
        self.pass_no = first_pass
        #: worker -> the wseq of its batch taken last in this pass.
        self.taken: dict[int, int] = {}
        self.closed = False

    def pump(self) -> None:
        """Takes every descriptor waiting on the socket into the stash (the
        consumer calls this while it waits, so producers never block
        sending one). Does nothing once the pipeline closed, which another
        thread may do at any moment (the socket is then gone)."""
        try:
            self._receive_all()
        except OSError:
            if not self.closed:
                raise

    def _receive_all(self) -> None:
        # A Ctrl-C between receiving a descriptor and stashing it would leak
        # it (close() only knows the stash): held back to the end.
        with ctrl_c_held_back():
            self._receive_all_now()

    def _receive_all_now(self) -> None:
        while True:
            try:
                # Close-on-exec: a batch's memory must not live on in a
                # program this process (or another thread) starts.
                msg, fds, truncated, fds_cut = _fdpass.recv_fds(self.sock, _TAG.size, 4)
            except (BlockingIOError, InterruptedError):
                return
            if fds_cut and not fds:
                # The kernel dropped the descriptor it could not install here.
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                raise ShmpipeError(
                    f"this process ran out of file descriptors (ulimit -n is {soft}) while receiving a batch larger "
                    f"than a slot ({len(self.stash)} are waiting to be taken); raise the limit (ulimit -n), "
                    "lower capacity, or give slot_size= so batches fit in slots"
                )
            if not msg and not fds and not truncated:
                return  # every producer's end is closed
            if truncated or fds_cut or len(msg) != _TAG.size or len(fds) != 1:
                # A longer datagram (MSG_TRUNC: read as its first bytes, it
                # would pass for a tag) or more than one descriptor.
                _fdpass.close_all(fds)
                raise CorruptChannelError(
                    "a malformed message on the external batches' socket: "
                    + ("longer than a tag" if truncated else f"{len(msg)} bytes")
                    + (", more than one descriptor" if fds_cut else f", {len(fds)} descriptors")
                    + f" (a tag is {_TAG.size} bytes with one descriptor)"
                )
            self._stash(_TAG.unpack(msg), fds[0])

    def _stash(self, tag: tuple[int, int, int], fd: int) -> None:
        """Keeps `fd` for batch `tag`, or closes it (a cancelled pass's) or
        closes it and raises (see the module doc)."""
        pass_no, worker, wseq = tag
        if pass_no < self.pass_no:
            os.close(fd)  # a batch of a pass no one reads any more
            return
        problem = None
        if pass_no > self.pass_no:
            problem = f"is tagged for pass {pass_no}, which has not begun (this is pass {self.pass_no})"
        elif tag in self.stash:
            problem = "came twice (a producer sent a second descriptor for one batch)"
        elif wseq <= self.taken.get(worker, -1):
            problem = (
                f"came after batch {self.taken[worker]} of that worker was taken "
                "(a descriptor for a batch already delivered, or sent out of order)"
            )
        elif len(self.stash) >= self.capacity:
            problem = (
                f"is one more than the ring can announce: {len(self.stash)} are waiting and the ring has "
                f"{self.capacity} slots (a producer sent descriptors for batches it never announced)"
            )
        if problem is not None:
            os.close(fd)
            raise CorruptChannelError(
                f"the memory of batch {wseq} of worker {worker} (pass {pass_no}) {problem}; refusing it"
            )
        if len(self.stash) >= self.limit:
            self.limit = stash_limit()  # the limit may have been raised since
            if len(self.stash) >= self.limit:
                os.close(fd)
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                raise ShmpipeError(
                    f"{len(self.stash)} batches larger than a slot are waiting to be taken, a quarter of this "
                    f"process's open-file limit (ulimit -n is {soft}); raise the limit (ulimit -n), lower "
                    f"capacity (now {self.capacity}), or give slot_size= so batches fit in slots"
                )
        self.stash[tag] = fd

    def take(self, pass_no: int, worker: int, wseq: int) -> int:
        """The descriptor of that batch, which the caller now owns. Its slot
        was just taken: the socket is drained first, so a second descriptor
        its producer sent before publishing is seen now, not later."""
        key = (pass_no, worker, wseq)
        if pass_no != self.pass_no:
            raise CorruptChannelError(
                f"a slot of pass {self.pass_no} holds the record of batch {wseq} of worker {worker} of pass {pass_no}"
            )
        last = self.taken.get(worker, -1)
        if wseq <= last:
            raise CorruptChannelError(
                f"a slot holds the record of batch {wseq} of worker {worker}, after its batch {last} was taken"
            )
        try:
            self._receive_all()
        except OSError:
            if not self.closed:
                raise
            raise PipelineClosedError("the pipeline was closed while a batch larger than a slot arrived") from None
        fd = self.stash.pop(key, None)
        if fd is None:
            raise CorruptChannelError(
                f"the memory of batch {wseq} of worker {worker} (pass {pass_no}) never came, "
                "though its slot says it was sent"
            )
        self.taken[worker] = wseq
        # The worker's earlier batches are all taken: a descriptor still
        # waiting for one of them was never announced.
        stale = [k for k in self.stash if k[1] == worker and k[2] < wseq]
        if stale:
            os.close(fd)
            raise CorruptChannelError(
                f"the memory of batch {stale[0][2]} of worker {worker} (pass {pass_no}) came, but its slot "
                f"never announced it (batch {wseq} of that worker is being taken)"
            )
        return fd

    def forget(self, worker: int, pass_no: int, from_wseq: int) -> None:
        """Producer `worker` is gone, having published its batches of pass
        `pass_no` up to `from_wseq`: the memory it sent for later ones
        (never announced) is closed, and its replacement's is taken
        instead. Everything it sent is in the socket by now (it is dead)."""
        self._receive_all()
        for key in [k for k in self.stash if k[0] == pass_no and k[1] == worker and k[2] >= from_wseq]:
            os.close(self.stash.pop(key))

    def begin_pass(self, pass_no: int) -> None:
        """Closes what older passes sent (no one will take it)."""
        self.pass_no = pass_no
        self.taken.clear()
        self._receive_all()
        for key in [k for k in self.stash if k[0] < pass_no]:
            os.close(self.stash.pop(key))

    def close(self) -> None:
        self.closed = True  # first: a thread still receiving knows the socket's end is no error
        for fd in self.stash.values():
            os.close(fd)
        self.stash.clear()
        self.sock.close()


def _address_space_left() -> tuple[int, str]:
    """Roughly how much address space this process may still map, and what
    limits it (RLIMIT_AS where set, else the 128 TiB of a user's space)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    used = proc_kib("/proc/self/status", "VmSize") or 0
    if soft != resource.RLIM_INFINITY:
        return max(0, soft - used), f"this process's address space (ulimit -v: {soft:,} bytes)"
    return max(0, (1 << 47) - used), "this process's address space (or vm.max_map_count)"


def map_external(fd: int, nbytes: int, lease: Any, *, write_sealed: bool) -> np.ndarray:
    """Maps exactly `nbytes` of the external batch `fd` read-only (whole
    pages: the last one rounded up; never the file's own size) after
    checking it cannot be resized (nor written, with `write_sealed`: what
    its record claims) and holds `nbytes`; returns its root array (which
    keeps the mapping and `lease`). The caller keeps (and closes) `fd`.
    Every failure is a ShmpipeError naming the sizes."""
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
    try:
        # Python's mmap may raise ValueError or OverflowError for sizes it
        # refuses itself; nbytes <= size rules those out, but not ENOMEM.
        mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    except OSError as exc:
        mapped = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
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
    return ExternalMemory(mm, nbytes, False, lease).root()
