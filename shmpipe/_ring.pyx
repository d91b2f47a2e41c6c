# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Low-level layer over csrc/shmpipe_ring.c: the segment, the ring and its
two ends. Every C status goes through _raise_status; waits run without the
GIL. The Pythonic layer is shmpipe/transports/shm.py. This engine imports
nothing of the package above it: only the errors it raises and the three
outcomes of a take that are not batches (shmpipe/_outcomes.py).

Lifetime rules (the reason for most of this file):

* A Segment unmaps its memory only in __dealloc__, when nothing refers to it.
  A Ring refers to its Segment, every SlotLease to its Ring, every batch's
  root array to its SlotLease, and every array of a batch to its root. So as
  long as any array of any batch lives, the memory stays mapped: closing a
  pipeline while arrays are alive can never leave a dangling pointer.
* A slot goes back to the ring when its SlotLease is freed, that is when the
  root array is freed, that is when the last array of the batch (or the
  last object that holds one: a TF tensor, a torch tensor, a DLPack capsule)
  is gone. Never earlier.
* A forked child inherits SlotLeases but must not release its parent's
  slots: a lease releases only in the process that created it.
"""

import os
import weakref

import numpy as np

cimport numpy as cnp
from cpython.exc cimport PyErr_CheckSignals
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_REFCNT
from libc.errno cimport ENOENT, errno
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport strerror, memcmp, memcpy

from shmpipe._codec cimport Decoder, Encoder, new_array

from shmpipe._outcomes import AGAIN, END, FAULT
from shmpipe.errors import BatchTooLargeError, Cancelled, Closed, CorruptChannelError, ShmpipeValueError

cnp.import_array()

cdef extern from "shmpipe_ring.h" nogil:
    enum:
        SHMP_OK
        SHMP_AGAIN
        SHMP_INTERRUPTED
        SHMP_END
        SHMP_CANCELLED
        SHMP_CLOSED
        SHMP_FAULT
        SHMP_E_MAGIC
        SHMP_E_VERSION
        SHMP_E_LAYOUT
        SHMP_E_ARG
        SHMP_E_SYS
        SHMP_E_STATE
        SHMP_FREE
        SHMP_WRITING
        SHMP_READY
        SHMP_HELD
        SHMP_FLAG_ORDERED
        SHMP_PAGE
        SHMP_MAX_SLOTS
        SHMP_MAX_WORKERS
        SHMP_LAYOUT_VERSION
    uint64_t shmp_header_size(uint32_t nslots, uint32_t nworkers)
    # The private geometry (see the comment above shmp_ring in the header):
    # read from the shared header once, when the ring is created or
    # attached, then never again. Ring holds it by value.
    ctypedef struct shmp_ring:
        void *base
        uint64_t total_size
        uint64_t header_size
        uint64_t slot_size
        uint32_t nslots
        uint32_t nworkers
        uint32_t quota
        uint32_t flags
        int32_t owner_pid
        uint64_t owner_start
    int shmp_ring_init(shmp_ring *ring, void *base, uint64_t total_size, uint32_t nslots,
                       uint32_t nworkers, uint64_t slot_size, uint32_t quota, uint32_t flags,
                       int32_t owner_pid, uint64_t owner_start, uint32_t first_pass)
    int shmp_ring_attach(shmp_ring *ring, void *base, uint64_t total_size)
    unsigned char *shmp_payload(const shmp_ring *ring, uint32_t slot)
    int shmp_acquire(const shmp_ring *ring, uint32_t worker, uint32_t pass_, int64_t wait_ns,
                     uint32_t *slot)
    int shmp_publish(const shmp_ring *ring, uint32_t slot, uint32_t worker, uint32_t pass_,
                     uint64_t wseq, uint64_t nbytes)
    int shmp_abandon(const shmp_ring *ring, uint32_t slot, uint32_t worker)
    int shmp_finish_pass(const shmp_ring *ring, uint32_t worker, uint32_t pass_, uint64_t produced)
    int shmp_take(const shmp_ring *ring, int32_t worker, uint32_t pass_, uint64_t wseq,
                  int64_t wait_ns, uint32_t *slot, uint32_t *worker_out)
    int shmp_release(const shmp_ring *ring, uint32_t slot)
    uint32_t shmp_begin_pass(const shmp_ring *ring)
    uint32_t shmp_current_pass(const shmp_ring *ring)
    void shmp_close(const shmp_ring *ring)
    int shmp_is_closed(const shmp_ring *ring)
    void shmp_report_fault(const shmp_ring *ring)
    int shmp_reclaim(const shmp_ring *ring, uint32_t worker)
    int shmp_worker_done(const shmp_ring *ring, uint32_t worker, uint32_t pass_)
    uint32_t SHMP_STATE_OF(uint32_t word)
    uint32_t SHMP_WRITING_BY(uint32_t worker)
    int shmp_slot_holds(const shmp_ring *ring, uint32_t slot, uint32_t worker, uint32_t pass_,
                        uint64_t wseq)
    uint32_t shmp_slot_state(const shmp_ring *ring, uint32_t slot)
    uint32_t shmp_slot_worker(const shmp_ring *ring, uint32_t slot)
    uint32_t shmp_slot_pass(const shmp_ring *ring, uint32_t slot)
    uint64_t shmp_slot_wseq(const shmp_ring *ring, uint32_t slot)
    uint64_t shmp_slot_nbytes(const shmp_ring *ring, uint32_t slot)
    uint64_t shmp_worker_blocked_ns(const shmp_ring *ring, uint32_t worker)
    uint64_t shmp_worker_published(const shmp_ring *ring, uint32_t worker)
    uint32_t shmp_worker_inflight(const shmp_ring *ring, uint32_t worker)
    void shmp_set_spin_ns(int64_t ns)
    int64_t shmp_get_spin_ns()

cdef extern from *:
    int __builtin_clzll(unsigned long long x) noexcept nogil

cdef extern from "<sys/mman.h>" nogil:
    int shm_open(const char *name, int oflag, int mode)
    int shm_unlink(const char *name)
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int mprotect(void *addr, size_t length, int prot)
    int PROT_READ, PROT_WRITE, MAP_SHARED, MAP_PRIVATE, MAP_POPULATE
    void *MAP_FAILED

cdef extern from "<fcntl.h>" nogil:
    int O_RDWR, O_CREAT, O_EXCL
    int posix_fallocate(int fd, long offset, long len)

cdef extern from "<unistd.h>" nogil:
    int close(int fd)
    int ftruncate(int fd, long length)
    int getpid()

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_MONOTONIC

# This process's pid, kept by a fork handler: a SlotLease compares it at
# every release, and getpid() is a system call (glibc no longer caches it).
cdef extern from *:
    """
    #include <pthread.h>
    #include <unistd.h>
    static volatile int shmp_cached_pid = 0;
    /* Runs in the child of every fork() that goes through the C library
     * (os.fork, multiprocessing's fork, C extensions), before anything of
     * the child can free a lease. */
    static void shmp_refresh_pid(void) { shmp_cached_pid = (int)getpid(); }
    static int shmp_watch_pid(void) {
        shmp_refresh_pid();
        return pthread_atfork(NULL, NULL, shmp_refresh_pid);
    }
    static inline int shmp_pid(void) { return shmp_cached_pid; }
    """
    int shmp_watch_pid() nogil
    int shmp_pid() noexcept nogil

if shmp_watch_pid() != 0:
    raise ImportError("shmpipe._ring: pthread_atfork failed")

cdef extern from "<sys/stat.h>" nogil:
    struct stat:
        long st_size
    int fstat(int fd, stat *buf)

# Anonymous, sealable memory (Linux 3.17+; glibc declares it with _GNU_SOURCE,
# which Python.h defines).
cdef extern from "<sys/mman.h>" nogil:
    int memfd_create(const char *name, unsigned int flags)
    unsigned int MFD_CLOEXEC, MFD_ALLOW_SEALING

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    int F_ADD_SEALS, F_GET_SEALS, F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW


cdef object _UINT8 = np.dtype(np.uint8)


cdef inline int64_t _now_ns() noexcept nogil:
    # The clock of time.perf_counter_ns() on Linux (CLOCK_MONOTONIC), so
    # times taken here compare with the pipeline's.
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


# Slot states, for observers (tests, diagnostics).
FREE = SHMP_FREE
WRITING = SHMP_WRITING
READY = SHMP_READY
HELD = SHMP_HELD
PAGE_SIZE = SHMP_PAGE
MAX_SLOTS = SHMP_MAX_SLOTS
MAX_WORKERS = SHMP_MAX_WORKERS
LAYOUT_VERSION = SHMP_LAYOUT_VERSION

# take() results that are not batches are shmpipe._outcomes' END, AGAIN
# and FAULT (shmpipe.transport's); a producer's acquire raises Cancelled and
# Closed.


_STATUS_MESSAGES = {
    SHMP_E_MAGIC: "not a shmpipe segment (bad magic)",
    SHMP_E_VERSION: "a shmpipe segment of another layout version",
    SHMP_E_LAYOUT: "a shmpipe segment whose header is inconsistent",
    SHMP_E_STATE: "a shared counter of the ring holds an impossible value (another process wrote into the segment)",
}


cdef int _raise_status(int status, str context) except -1:
    """The one place where a C status becomes an exception."""
    if status == SHMP_OK or status == SHMP_AGAIN or status == SHMP_END or status == SHMP_FAULT:
        return 0
    if status == SHMP_INTERRUPTED:
        PyErr_CheckSignals()
        return 0
    if status == SHMP_CANCELLED:
        raise Cancelled(context)
    if status == SHMP_CLOSED:
        raise Closed(context)
    if status in _STATUS_MESSAGES:
        raise CorruptChannelError(f"{context}: {_STATUS_MESSAGES[status]}")
    if status == SHMP_E_ARG:
        raise ShmpipeValueError(f"{context}: argument out of range (a bug, or a corrupted ring)")
    if status == SHMP_E_SYS:
        raise OSError(errno, f"{context}: {strerror(errno).decode()}")
    raise SystemError(f"{context}: unknown status {status}")


def set_spin_ns(int64_t ns) -> int:
    """Sets how long this process's waits look again (yielding the CPU)
    before they sleep on the futex (see shmpipe_ring.h); returns the old
    value. For benchmarks and experiments: the default suits most machines."""
    cdef int64_t old = shmp_get_spin_ns()
    shmp_set_spin_ns(ns)
    return old


# SHMPIPE_SPIN_NS, read once here, so a pipeline's producers (which inherit
# the environment) spin as long as its consumer.
if os.environ.get("SHMPIPE_SPIN_NS"):
    try:
        shmp_set_spin_ns(int(os.environ["SHMPIPE_SPIN_NS"]))
    except ValueError:
        raise ShmpipeValueError(
            f"SHMPIPE_SPIN_NS must be a whole number of nanoseconds, got {os.environ['SHMPIPE_SPIN_NS']!r}"
        ) from None


def header_size(uint32_t nslots, uint32_t nworkers) -> int:
    """Bytes before slot 0's payload in a ring of this shape."""
    return shmp_header_size(nslots, nworkers)


cdef class Segment:
    """Shared memory mapped into this process: anonymous (memfd_create, the
    default) or a named POSIX segment (shm_open).

    Anonymous memory is in no file system: /dev/shm's size does not limit
    it, nothing can open it by name, and it is freed when the last
    descriptor and mapping of it are gone, however its processes end. It is
    sealed against shrinking and growing before anyone else sees it, so no
    process can truncate it under a reader (which would be a SIGBUS). Its
    descriptor travels to producers over the control connection.

    unlink() makes the memory unreachable for new attachers (removes the
    name, or closes this process's descriptor); the mapping itself goes away
    when this object is freed, that is when nothing refers to it (see the
    module docstring).
    """
    cdef readonly str name   # the POSIX name; "" for anonymous memory
    cdef unsigned char *addr
    cdef readonly Py_ssize_t size
    cdef int _fd             # anonymous memory: our descriptor until unlink()

    def __cinit__(self):
        self.addr = NULL
        self._fd = -1
        self.name = ""

    def __dealloc__(self):
        if self.addr != NULL:
            munmap(self.addr, self.size)
            self.addr = NULL
        if self._fd >= 0:
            close(self._fd)
            self._fd = -1

    @staticmethod
    def create_anonymous(str label, Py_ssize_t size):
        """New anonymous memory of `size` bytes (memfd_create), reserved,
        sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
        and mapped (its pages touched when first used: _map). `label`
        shows in /proc/*/maps."""
        cdef bytes blabel = label.encode()
        cdef const char *clabel = blabel
        cdef int fd, rc
        cdef Segment seg = Segment.__new__(Segment)
        if size <= 0:
            raise ValueError("segment size must be positive")
        with nogil:
            fd = memfd_create(clabel, MFD_CLOEXEC | MFD_ALLOW_SEALING)
        if fd < 0:
            raise OSError(errno, f"memfd_create({label!r}): {strerror(errno).decode()}")
        try:
            with nogil:
                rc = ftruncate(fd, size)
            if rc != 0:
                raise OSError(errno, f"ftruncate(memfd, {size}): {strerror(errno).decode()}")
            # Reserve the memory now: no room is an error here, not a SIGBUS
            # at the first write to an unbacked page.
            with nogil:
                rc = posix_fallocate(fd, 0, size)
            if rc != 0:
                raise OSError(rc, f"posix_fallocate(memfd, {size}): {strerror(rc).decode()}")
            # Sealed before any other process can have it: its size is fixed
            # for good, and the seals themselves cannot be undone.
            if fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0:
                raise OSError(errno, f"sealing the ring's memory: {strerror(errno).decode()}")
            seg._map(fd, size, "")
        except BaseException:
            close(fd)
            raise
        seg._fd = fd
        return seg

    @staticmethod
    def attach_fd(int fd):
        """Maps the anonymous memory `fd` refers to (its whole size), after
        checking it cannot be resized. The caller keeps `fd` (and closes it:
        the mapping does not need it)."""
        cdef stat st
        cdef int seals
        cdef Segment seg = Segment.__new__(Segment)
        seals = fcntl(fd, F_GET_SEALS)
        if seals < 0:
            raise CorruptChannelError(f"the ring's descriptor is not sealable memory: {strerror(errno).decode()}")
        if (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW):
            raise CorruptChannelError("the ring's memory is not sealed against resizing; refusing to map it")
        if fstat(fd, &st) != 0:
            raise OSError(errno, f"fstat(memfd): {strerror(errno).decode()}")
        if st.st_size <= 0:
            raise CorruptChannelError("the ring's memory is empty")
        seg._map(fd, st.st_size, "")
        return seg

    @staticmethod
    def create(str name, Py_ssize_t size):
        """Creates the named POSIX segment `name` exclusively (mode 0600),
        reserves `size` bytes of memory for it and maps it (its pages touched
        when first used: _map). Any process of this user can open it by name (and resize
        it: anonymous memory is the default for that reason)."""
        cdef bytes bname = name.encode()
        cdef const char *cname = bname
        cdef int fd, rc
        cdef Segment seg = Segment.__new__(Segment)
        if size <= 0:
            raise ValueError("segment size must be positive")
        with nogil:
            fd = shm_open(cname, O_CREAT | O_EXCL | O_RDWR, 0o600)
        if fd < 0:
            raise OSError(errno, f"shm_open({name!r}): {strerror(errno).decode()}")
        try:
            with nogil:
                rc = ftruncate(fd, size)
            if rc != 0:
                raise OSError(errno, f"ftruncate({name!r}, {size}): {strerror(errno).decode()}")
            # Reserve the memory now: a full /dev/shm is then an error here,
            # not a SIGBUS at the first write to an unbacked page.
            with nogil:
                rc = posix_fallocate(fd, 0, size)
            if rc != 0:
                raise OSError(rc, f"posix_fallocate({name!r}, {size}): {strerror(rc).decode()}")
            seg._map(fd, size, name)
        except BaseException:
            shm_unlink(cname)
            raise
        finally:
            close(fd)
        return seg

    @staticmethod
    def attach(str name):
        """Maps the existing named segment `name` (its whole size)."""
        cdef bytes bname = name.encode()
        cdef const char *cname = bname
        cdef int fd
        cdef stat st
        cdef Segment seg = Segment.__new__(Segment)
        with nogil:
            fd = shm_open(cname, O_RDWR, 0)
        if fd < 0:
            raise OSError(errno, f"shm_open({name!r}): {strerror(errno).decode()}")
        try:
            if fstat(fd, &st) != 0:
                raise OSError(errno, f"fstat({name!r}): {strerror(errno).decode()}")
            if st.st_size <= 0:
                raise CorruptChannelError(f"segment {name!r} is empty")
            seg._map(fd, st.st_size, name)
        finally:
            close(fd)
        return seg

    cdef int _map(self, int fd, Py_ssize_t size, str name) except -1:
        cdef void *addr
        with nogil:
            # Not populated: each page is zeroed and mapped where it is
            # first touched (a slot's first batch), not all of them here.
            # The ring is made once the first batch is known (it is sized by
            # it), so every page touched here was waited for by that batch:
            # 17 ms for 6 slots of 6 MiB, and a producer that populated its
            # own mapping of them too paid 5 ms more. Nothing is at risk:
            # posix_fallocate reserved every page already, so a first touch
            # finds its page and needs no room (no SIGBUS on a full /dev/shm).
            addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            raise OSError(errno, f"mmap({name or 'memfd'!r}, {size}): {strerror(errno).decode()}")
        self.addr = <unsigned char *>addr
        self.size = size
        self.name = name
        return 0

    @property
    def anonymous(self) -> bool:
        return not self.name

    @property
    def fd(self) -> int:
        """This process's descriptor of anonymous memory it created; -1
        after unlink() (and for named or attached segments)."""
        return self._fd

    def unlink(self):
        """No one can attach any more: removes the name (named), or closes
        this process's descriptor (anonymous). Idempotent; the mapping
        stays."""
        if self.name:
            unlink_segment(self.name)
        elif self._fd >= 0:
            close(self._fd)
            self._fd = -1

    @property
    def address(self) -> int:
        return <size_t>self.addr

    def array(self):
        """The whole segment as a read-only uint8 array (keeps it mapped)."""
        return _root_array(self.addr, self.size, self, False)

    def __repr__(self):
        what = repr(self.name) if self.name else "anonymous"
        return f"<shmpipe Segment {what} {self.size} bytes>"


def unlink_segment(str name) -> bool:
    """shm_unlink(name); False if it did not exist."""
    cdef bytes bname = name.encode()
    if shm_unlink(bname) == 0:
        return True
    if errno == ENOENT:
        return False
    raise OSError(errno, f"shm_unlink({name!r}): {strerror(errno).decode()}")


cdef class Ring:
    """The slot protocol over a Segment (see csrc/shmpipe_ring.h).

    The ring's geometry (slot count and size, worker count, quota, flags,
    offsets) lives in `r`, this process's private copy, read from the shared
    header once by create() or attach() and never again: the segment is
    writable by other processes, so everything that sizes or locates memory
    comes from here. Only the changing words (slot states, pass, closed,
    counters) are read from shared memory, by the C functions."""
    cdef readonly Segment segment
    cdef shmp_ring r  # the private geometry; &r goes to every C call
    cdef int pid  # leases release slots only in this process
    # Slots this process holds for live batches (leases not yet freed), in
    # private memory: what the shared HELD states must add up to (audit).
    # Changed and read with the GIL held, so a take or a release and an
    # audit never interleave.
    cdef readonly Py_ssize_t leases

    @staticmethod
    def create(Segment segment, uint32_t nslots, uint32_t nworkers, uint64_t slot_size,
               uint32_t quota, bint ordered, int32_t owner_pid, uint64_t owner_start,
               uint32_t first_pass=0):
        cdef Ring ring = Ring.__new__(Ring)
        cdef int rc = shmp_ring_init(&ring.r, segment.addr, segment.size, nslots, nworkers,
                                     slot_size, quota, SHMP_FLAG_ORDERED if ordered else 0,
                                     owner_pid, owner_start, first_pass)
        _raise_status(rc, f"initialising ring in {segment.name!r}")
        ring._bind(segment)
        return ring

    @staticmethod
    def attach(Segment segment):
        cdef Ring ring = Ring.__new__(Ring)
        cdef int rc = shmp_ring_attach(&ring.r, segment.addr, segment.size)
        _raise_status(rc, f"attaching to {segment.name!r}")
        ring._bind(segment)
        return ring

    cdef _bind(self, Segment segment):
        # The segment keeps the mapping that r.base points into alive.
        self.segment = segment
        self.pid = shmp_pid()

    cdef inline unsigned char *payload(self, uint32_t slot) noexcept nogil:
        # slot comes from shmp_acquire/shmp_take or is checked by the caller.
        return shmp_payload(&self.r, slot)

    @property
    def nslots(self) -> int:
        return self.r.nslots

    @property
    def nworkers(self) -> int:
        return self.r.nworkers

    @property
    def slot_size(self) -> int:
        return self.r.slot_size

    @property
    def quota(self) -> int:
        return self.r.quota

    @property
    def ordered(self) -> bool:
        return (self.r.flags & SHMP_FLAG_ORDERED) != 0

    @property
    def owner_pid(self) -> int:
        return self.r.owner_pid

    @property
    def owner_start(self) -> int:
        return self.r.owner_start

    @property
    def closed(self) -> bool:
        return shmp_is_closed(&self.r) != 0

    @property
    def current_pass(self) -> int:
        return shmp_current_pass(&self.r)

    def begin_pass(self) -> int:
        return shmp_begin_pass(&self.r)

    def close(self) -> None:
        """Tells every producer to stop and wakes every waiter."""
        shmp_close(&self.r)

    def report_fault(self) -> None:
        """Producer side: make the consumer look at the control channel now."""
        shmp_report_fault(&self.r)

    def reclaim(self, uint32_t worker) -> int:
        """Consumer side, once producer `worker`'s process is gone: its
        slots still WRITING become FREE, its quota count is recounted.
        Returns how many slots came back."""
        cdef int rc = shmp_reclaim(&self.r, worker)
        _raise_status(rc if rc < 0 else SHMP_OK, "taking back a dead producer's slots")
        return rc

    def worker_done(self, uint32_t worker, uint32_t pass_no) -> bool:
        """Whether `worker` marked its part of pass `pass_no` complete."""
        return shmp_worker_done(&self.r, worker, pass_no) != 0

    def ready_wseqs(self, uint32_t worker, uint32_t pass_no) -> list:
        """The numbers of `worker`'s batches of pass `pass_no` that are READY
        (published, not taken), read without ordering: shared words, for the
        caller to check."""
        cdef uint32_t i
        return [shmp_slot_wseq(&self.r, i) for i in range(self.r.nslots)
                if SHMP_STATE_OF(shmp_slot_state(&self.r, i)) == SHMP_READY
                and shmp_slot_worker(&self.r, i) == worker and shmp_slot_pass(&self.r, i) == pass_no]

    def audit(self, uint32_t pass_no) -> tuple:
        """The consumer's look at the shared words it can check against what
        it knows (pass_no: the pass it read last began): (problem, or None
        where none is certain; per worker, (its in-flight word, what the
        slots say) where they differ, which a claim or a take in progress
        may make true for a moment). Consumer only, between takes."""
        cdef uint32_t i, w, word, state, held = 0
        cdef uint32_t current = shmp_current_pass(&self.r)
        if current != pass_no:
            return (f"the ring's pass number is {current}, but pass {pass_no} is the one being read", [])
        for i in range(self.r.nslots):
            state = shmp_slot_state(&self.r, i)
            # A word no step of the protocol writes (see the states in
            # shmpipe_ring.h): no claim, take, release or reclaim matches
            # it, so its slot would be lost for good, and with it, once
            # every slot is, the pipeline (a wait for ever where there is no
            # quota for the check below to see it).
            if not (state == SHMP_FREE or state == SHMP_READY or state == SHMP_HELD
                    or (SHMP_STATE_OF(state) == SHMP_WRITING and (state >> 8) < self.r.nworkers)):
                return (f"slot {i}'s state word is {state:#x}, which no step of the ring writes", [])
            held += state == SHMP_HELD
        if held > self.leases:
            return (f"{held} slots are marked as held by this process's batches, which hold {self.leases}", [])
        if self.r.quota == 0:
            return (None, [])
        counts = [0] * self.r.nworkers
        for i in range(self.r.nslots):
            state = shmp_slot_state(&self.r, i)
            if SHMP_STATE_OF(state) == SHMP_WRITING:
                w = state >> 8
            elif state == SHMP_READY:
                w = shmp_slot_worker(&self.r, i)
            else:
                continue
            if w < self.r.nworkers:
                counts[w] += 1
        uneven = []
        for w in range(self.r.nworkers):
            word = shmp_worker_inflight(&self.r, w)
            if word != counts[w]:
                uneven.append((w, word, counts[w]))
        return (None, uneven)

    def held_count(self) -> int:
        """Slots HELD: delivered batches still referenced somewhere."""
        cdef uint32_t i, n = 0
        for i in range(self.r.nslots):
            n += shmp_slot_state(&self.r, i) == SHMP_HELD
        return n

    def slot_states(self) -> list:
        """Each slot's state (FREE/WRITING/READY/HELD), read without ordering."""
        cdef uint32_t i
        return [SHMP_STATE_OF(shmp_slot_state(&self.r, i)) for i in range(self.r.nslots)]

    def slot_info(self, uint32_t slot) -> tuple:
        """(state, worker, pass, wseq, nbytes) of a slot, read without ordering."""
        if slot >= self.r.nslots:
            raise IndexError(slot)
        return (SHMP_STATE_OF(shmp_slot_state(&self.r, slot)), shmp_slot_worker(&self.r, slot),
                shmp_slot_pass(&self.r, slot), shmp_slot_wseq(&self.r, slot),
                shmp_slot_nbytes(&self.r, slot))

    def payload_address(self, uint32_t slot) -> int:
        if slot >= self.r.nslots:
            raise IndexError(slot)
        return <size_t>self.payload(slot)

    def worker_blocked_ns(self, uint32_t worker) -> int:
        if worker >= self.r.nworkers:
            raise IndexError(worker)
        return shmp_worker_blocked_ns(&self.r, worker)

    def worker_published(self, uint32_t worker) -> int:
        if worker >= self.r.nworkers:
            raise IndexError(worker)
        return shmp_worker_published(&self.r, worker)


cdef class SlotLease:
    """Owns one slot on behalf of the arrays of one batch (their root's base).

    Freed when the root array is freed; then, in the process that took the
    slot, gives the slot back. Not a buffer exporter, so NumPy cannot make
    the arrays writeable again.
    """
    cdef Ring ring
    cdef uint32_t slot
    cdef bint release_on_free

    def __dealloc__(self):
        # Runs in whichever thread drops the last reference (a TF thread,
        # say), with the GIL: shmp_release is a CAS and maybe a FUTEX_WAKE.
        if self.release_on_free and self.ring is not None and shmp_pid() == self.ring.pid:
            shmp_release(&self.ring.r, self.slot)
            self.ring.leases -= 1

    @property
    def slot(self) -> int:
        return self.slot


cdef SlotLease _lease(Ring ring, uint32_t slot, bint release_on_free):
    cdef SlotLease lease = SlotLease.__new__(SlotLease)
    lease.ring = ring
    lease.slot = slot
    lease.release_on_free = release_on_free
    if release_on_free:
        ring.leases += 1
    return lease


cdef object _root_array(unsigned char *data, Py_ssize_t nbytes, object base, bint writeable):
    """The batch's root: a uint8 array over its payload, based on `base`."""
    cdef cnp.npy_intp n = nbytes
    return new_array(_UINT8, 1, &n, data, writeable, base)


# The record of a batch larger than a slot (shmpipe/_external.py): a slot's
# whole payload, in place of a batch. Native little-endian, 32 bytes:
#   0 magic "SPX1", 4 u32 worker, 8 u64 nbytes (the payload's, at the start
#   of its region), 16 u64 rid (the region's id), 24 u32 region (its index
#   in the worker's table), 28 u32 zero.
# Written by RingWriter.publish_record, read by _read_record: both here, so
# the layout has one home.
cdef struct ext_record:
    char magic[4]
    uint32_t worker
    uint64_t nbytes
    uint64_t rid
    uint32_t region
    uint32_t zero

cdef enum:
    EXTERNAL_RECORD_BYTES = 32
cdef const char *EXTERNAL_MAGIC = b"SPX1"


cdef int _read_record(object root, ext_record *out) except -1:
    """Copies a slot's record out (read once: only the copy is used after)
    and checks its form; CorruptChannelError if it is not one."""
    cdef cnp.ndarray r = <cnp.ndarray?>root
    if cnp.PyArray_DIM(r, 0) != EXTERNAL_RECORD_BYTES:
        raise CorruptChannelError(
            f"an external batch's record has {cnp.PyArray_DIM(r, 0)} bytes, not {EXTERNAL_RECORD_BYTES}")
    memcpy(out, cnp.PyArray_DATA(r), EXTERNAL_RECORD_BYTES)
    if memcmp(out.magic, EXTERNAL_MAGIC, 4) != 0 or out.zero != 0:
        raise CorruptChannelError("a slot holds neither a batch nor an external batch's record")
    return 0


def read_record(object root):
    """(worker, region, rid, nbytes) of the record `root` (a slot's payload),
    read once; CorruptChannelError if it is not one."""
    cdef ext_record rec
    _read_record(root, &rec)
    return rec.worker, rec.region, rec.rid, rec.nbytes


cdef class RingWriter:
    """A producer's end of the ring: encodes batches into slots.

    One per producer process and worker id. put() copies a batch in (one
    memcpy per array); reserve() hands out writable arrays inside a slot so
    a batch can be built in place and put() publishes it without a copy.
    """
    cdef readonly Ring ring
    cdef readonly uint32_t worker
    cdef readonly uint32_t pass_no
    cdef readonly uint64_t wseq
    cdef Encoder enc
    cdef Decoder dec
    # The pending reservation: its slot, the arrays handed out in it, and
    # their root (every array's base, and every NumPy view's of them:
    # _taint_if_viewed).
    cdef bint has_reserved
    cdef uint32_t reserved_slot
    cdef list reserved_arrays
    cdef object reserved_root
    # slot -> a weak reference to the root of a reservation of that slot
    # that was yielded (or given back) while views of it lived: each time a
    # batch is published there while that root lives, the slot's pages are
    # made read-only in this process until the slot is claimed again
    # (_guard), so a view kept past its yield cannot change a batch the
    # consumer holds. Empty, and no system call, when no view outlives its
    # batch.
    cdef dict tainted
    cdef set protected
    cdef readonly uint64_t guards
    cdef int64_t wait_ns

    def __cinit__(self, Ring ring, uint32_t worker):
        if worker >= ring.r.nworkers:
            raise ValueError(f"worker {worker} out of range for a ring of {ring.r.nworkers}")
        self.ring = ring
        self.worker = worker
        self.enc = Encoder()
        self.dec = Decoder()
        self.reserved_arrays = []
        self.tainted = {}
        self.protected = set()
        self.wait_ns = 200_000_000

    def start_pass(self, uint32_t pass_no, uint64_t first_wseq=0):
        """Batches from now on are of pass `pass_no`, numbered from
        `first_wseq` (a producer that replaces a dead one goes on after its
        last published batch)."""
        self._drop_reservation()
        self.pass_no = pass_no
        self.wseq = first_wseq

    def finish_pass(self):
        """Every batch of this pass is published: tell the consumer."""
        self._drop_reservation()
        _raise_status(shmp_finish_pass(&self.ring.r, self.worker, self.pass_no, self.wseq),
                      "finishing a pass")

    cdef uint32_t _acquire(self) except? 0xFFFFFFFF:
        cdef uint32_t slot = 0
        cdef int rc
        while True:
            with nogil:
                rc = shmp_acquire(&self.ring.r, self.worker, self.pass_no, self.wait_ns, &slot)
            if rc == SHMP_OK:
                if self.protected:
                    self._unguard(slot)
                return slot
            if rc != SHMP_AGAIN:
                _raise_status(rc, "waiting for a free slot")
            # Between waits: a signal's handler runs here (a timeout, say),
            # as the C core's bounded waits are there for.
            PyErr_CheckSignals()

    cdef int _check_size(self, Py_ssize_t nbytes) except -1:
        if <uint64_t>nbytes > self.ring.r.slot_size:
            raise BatchTooLargeError(nbytes, self.ring.r.slot_size)
        return 0

    def put(self, batch):
        """Publishes `batch`: in place if it is the pending reservation,
        else copied into a free slot (waiting for one)."""
        cdef Py_ssize_t nbytes = self._put_fitting(batch)
        if nbytes:
            raise BatchTooLargeError(nbytes, self.ring.r.slot_size)

    def put_fitting(self, batch):
        """put(batch) where it fits in a slot (or is the pending reservation,
        yielded as it is): returns 0. Else nothing is claimed or published
        (a pending reservation stays) and it returns the size of the batch's
        payload, planned: write_planned() writes it into other memory (a
        region, _external.py). One plan of the batch either way."""
        return self._put_fitting(batch)

    def write_planned(self, object buf):
        """Writes the payload put_fitting() planned last and did not publish
        into `buf` (a writable, contiguous, 64-byte aligned uint8 array with
        room for it); returns its size."""
        cdef cnp.ndarray arr = <cnp.ndarray?>buf
        cdef Py_ssize_t nbytes = self.enc.nbytes
        if (cnp.PyArray_TYPE(arr) != cnp.NPY_UINT8 or cnp.PyArray_NDIM(arr) != 1
                or not cnp.PyArray_ISCARRAY(arr) or (<size_t>cnp.PyArray_DATA(arr)) % 64
                or cnp.PyArray_DIM(arr, 0) < nbytes):
            raise ValueError(f"write_planned() needs a writable, aligned uint8 array of {nbytes} bytes")
        self.enc.write(<unsigned char *>cnp.PyArray_DATA(arr), cnp.PyArray_DIM(arr, 0))
        return nbytes

    cdef Py_ssize_t _put_fitting(self, object batch) except -1:
        cdef Py_ssize_t nbytes = self.enc.plan(batch, False)
        cdef uint32_t slot
        cdef unsigned char *payload
        if self.has_reserved:
            payload = self.ring.payload(self.reserved_slot)
            if self.enc.same_meta(payload) and self.enc.in_place(payload):
                # Sealed before it is published: a view of the arrays that
                # lives on must be guarded before the consumer may take it.
                slot = self.reserved_slot
                self._seal_reservation()
                try:
                    self._publish(slot, nbytes)
                except BaseException:
                    shmp_abandon(&self.ring.r, slot, self.worker)
                    raise
                return 0
        if <uint64_t>nbytes > self.ring.r.slot_size:
            return nbytes
        slot = self._acquire()
        try:
            self.enc.write(self.ring.payload(slot), <Py_ssize_t>self.ring.r.slot_size)
        except BaseException:
            shmp_abandon(&self.ring.r, slot, self.worker)
            raise
        self._publish(slot, nbytes)
        # A reservation that was not yielded as is has now been copied out.
        self._drop_reservation()
        return 0

    cdef int _publish(self, uint32_t slot, Py_ssize_t nbytes) except -1:
        if self.tainted:
            self._guard_if_tainted(slot)
        _raise_status(shmp_publish(&self.ring.r, slot, self.worker, self.pass_no, self.wseq,
                                   nbytes), "publishing a batch")
        self.wseq += 1
        return 0

    # -- views kept past their batch's yield --------------------------------------
    # The arrays reserve() hands out become read-only when their batch is
    # published, but a NumPy view made of them before (v = arr[::2]) keeps
    # its own flag. Every such view is based on the reservation's root
    # (NumPy collapses views onto the first base that is not a view), so
    # the root's reference count tells whether any lives. Only then are
    # system calls made: the slot's pages are made read-only here (a write
    # through the view is a SIGSEGV of this producer, reported as its death,
    # instead of a batch changing under the consumer) until the slot is
    # claimed again. What is not caught: a buffer exported from the arrays
    # themselves (memoryview(arr), torch.from_numpy(arr)) before the yield.

    cdef int _taint_if_viewed(self, uint32_t slot) except -1:
        cdef object root = self.reserved_root
        # One reference per array handed out (each based on the root, and
        # kept by reserved_arrays), the attribute's and `root`'s here: any
        # more is a view.
        if root is not None and Py_REFCNT(root) - 2 > len(self.reserved_arrays):
            self.tainted[slot] = weakref.ref(root)
        return 0

    cdef int _guard_if_tainted(self, uint32_t slot) except -1:
        taint = self.tainted.get(slot)
        if taint is None:
            return 0
        if taint() is None:  # every view of it is gone
            del self.tainted[slot]
            return 0
        protect(<size_t>self.ring.payload(slot), <size_t>self.ring.r.slot_size, False)
        self.protected.add(slot)
        self.guards += 1
        return 0

    cdef int _unguard(self, uint32_t slot) except -1:
        if slot in self.protected:
            protect(<size_t>self.ring.payload(slot), <size_t>self.ring.r.slot_size, True)
            self.protected.discard(slot)
        return 0

    def claim(self):
        """Claims a free slot (waiting for one) for a payload written by
        other means (the Arrow transport): (slot, writable uint8 array over
        the whole slot). Then publish_claimed() or abandon()."""
        cdef uint32_t slot = self._acquire()
        cdef unsigned char *payload = self.ring.payload(slot)
        return slot, _root_array(payload, <Py_ssize_t>self.ring.r.slot_size,
                                 _lease(self.ring, slot, False), True)

    def publish_claimed(self, uint32_t slot, uint64_t nbytes):
        """Publishes a claimed slot whose first `nbytes` bytes are written."""
        if nbytes > self.ring.r.slot_size:
            raise BatchTooLargeError(nbytes, self.ring.r.slot_size)
        self._publish(slot, nbytes)

    def claim_slot(self):
        """Claims a free slot (waiting for one) for a record: its number.
        Then publish_record() or abandon()."""
        return self._acquire()

    def publish_record(self, uint32_t slot, uint64_t nbytes, uint32_t region, uint64_t rid):
        """Writes the record of this worker's batch of `nbytes` at the start
        of its region (`region`, id `rid`) into the claimed `slot`, and
        publishes it."""
        if slot >= self.ring.r.nslots or shmp_slot_state(&self.ring.r, slot) != SHMP_WRITING_BY(self.worker):
            raise ValueError(f"slot {slot} is not claimed")
        self._publish_record(slot, nbytes, region, rid)

    cdef int _publish_record(self, uint32_t slot, uint64_t nbytes, uint32_t region, uint64_t rid) except -1:
        # `slot` is claimed by this writer: the caller claimed it (or checked).
        cdef ext_record rec
        memcpy(rec.magic, EXTERNAL_MAGIC, 4)
        rec.worker = self.worker
        rec.nbytes = nbytes
        rec.rid = rid
        rec.region = region
        rec.zero = 0
        memcpy(self.ring.payload(slot), &rec, EXTERNAL_RECORD_BYTES)
        self._publish(slot, EXTERNAL_RECORD_BYTES)
        return 0

    def abandon(self, uint32_t slot):
        """Gives a claimed slot back unpublished."""
        _raise_status(shmp_abandon(&self.ring.r, slot, self.worker), "abandoning a slot")

    def holds(self, uint32_t slot, uint32_t pass_no, uint64_t wseq):
        """Whether `slot` still holds this worker's batch (`pass_no`,
        `wseq`) published there: READY or HELD. False once the consumer
        released or discarded it, with acquire ordering (shmp_slot_holds):
        memory of its own that batch used may be written again. One atomic
        load and three plain ones, no system call."""
        return shmp_slot_holds(&self.ring.r, slot, self.worker, pass_no, wseq) != 0

    def reserve(self, template):
        """Claims a slot and returns `template`'s structure with writable
        arrays that live in it (ArraySpec or array leaves give shape and
        dtype; scalars are kept as they are)."""
        cdef Py_ssize_t nbytes
        cdef uint32_t slot
        cdef unsigned char *payload
        if self.has_reserved:
            raise ShmpipeValueError(
                "reserve() was called again before the structure it returned last time "
                "was yielded; yield each reservation before making the next"
            )
        nbytes = self.enc.plan(template, True)
        self._check_size(nbytes)
        slot = self._acquire()
        payload = self.ring.payload(slot)
        try:
            self.enc.write(payload, <Py_ssize_t>self.ring.r.slot_size)
            arrays = []
            root = _root_array(payload, nbytes, _lease(self.ring, slot, False), True)
            batch = self.dec.decode(payload, nbytes, root, True, arrays)
        except BaseException:
            shmp_abandon(&self.ring.r, slot, self.worker)
            raise
        self.has_reserved = True
        self.reserved_slot = slot
        self.reserved_arrays = arrays
        self.reserved_root = root
        return batch

    def drop_reservation(self):
        """Gives the pending reservation's slot back, unpublished (its
        arrays become read-only): the batch yielded instead was sent
        another way."""
        self._drop_reservation()

    cdef _seal_reservation(self):
        # The slot now belongs to the consumer: writes through the arrays we
        # handed out would change a published batch, so make them read-only
        # (and the slot too, where a view of them lives: _taint_if_viewed).
        for arr in self.reserved_arrays:
            cnp.PyArray_CLEARFLAGS(<cnp.ndarray>arr, cnp.NPY_ARRAY_WRITEABLE)
        self._taint_if_viewed(self.reserved_slot)
        self.has_reserved = False
        self.reserved_arrays = []
        self.reserved_root = None

    cdef _drop_reservation(self):
        if self.has_reserved:
            # Unpublished: the slot goes back; the arrays may still be read
            # by whoever holds them, so they become read-only too (and the
            # slot, while free, where a view of them lives).
            slot = self.reserved_slot
            self._seal_reservation()
            if self.tainted:
                self._guard_if_tainted(slot)
            shmp_abandon(&self.ring.r, slot, self.worker)


cdef class Mapping:
    """`size` bytes of the memory `fd` refers to, from `offset` (a whole
    number of pages): shared and read-only; shared, writable and populated
    (every page touched once now); or `private` (MAP_PRIVATE, writable: a
    page written is copied for this process alone, the memory and every
    other mapping of it never see the write; _cow.py). A region of a batch
    larger than a slot (_external.py), in the producer (writable) or the
    consumer (read-only), or a private view of a batch (_cow.py). Unmapped
    when this object is freed, so whatever views the memory must keep it
    (array(), region_root()). Unlike Python's mmap it keeps no duplicate of
    the descriptor (one descriptor per mapping would count against ulimit
    -n) and exports no buffer (NumPy cannot make a read-only view of it
    writable)."""
    cdef readonly size_t address
    cdef readonly Py_ssize_t size
    cdef bint writable

    def __cinit__(self, int fd, Py_ssize_t size, bint writable, bint private=False, Py_ssize_t offset=0):
        cdef void *addr
        cdef int prot = PROT_READ | (PROT_WRITE if writable or private else 0)
        cdef int flags
        if private:
            flags = MAP_PRIVATE
        else:
            flags = MAP_SHARED | (MAP_POPULATE if writable else 0)
        if size <= 0:
            raise ValueError(f"a mapping of {size} bytes")
        if offset < 0 or offset % SHMP_PAGE:
            raise ValueError(f"a mapping from offset {offset}, not a whole number of pages")
        with nogil:
            addr = mmap(NULL, <size_t>size, prot, flags, fd, <long>offset)
        if addr == MAP_FAILED:
            raise OSError(errno, f"mmap({size}): {strerror(errno).decode()}")
        self.address = <size_t>addr
        self.size = size
        self.writable = writable or private

    def __dealloc__(self):
        if self.address:
            munmap(<void *>self.address, <size_t>self.size)

    def array(self):
        """All of it as a uint8 array (writable where the mapping is),
        whose base is this object."""
        return _root_array(<unsigned char *>self.address, self.size, self, self.writable)


def protect(size_t address, size_t length, bint writable):
    """Makes the whole pages of [address, address + length) of a mapping of
    this process read-only, or writable again (mprotect). A producer's
    guard on a published batch that a view it kept could still write
    (shm.py, _guard). The caller vouches the pages are its own mapping's."""
    cdef size_t start = address & ~(<size_t>SHMP_PAGE - 1)
    cdef size_t end = (address + length + SHMP_PAGE - 1) & ~(<size_t>SHMP_PAGE - 1)
    cdef int rc
    if end <= start:
        return
    with nogil:
        rc = mprotect(<void *>start, end - start, PROT_READ | (PROT_WRITE if writable else 0))
    if rc != 0:
        raise OSError(errno, f"mprotect({end - start}): {strerror(errno).decode()}")


def region_root(object owner, size_t address, Py_ssize_t nbytes):
    """A read-only uint8 array of `nbytes` at `address`, whose base is
    `owner`: the consumer's root of a batch in a region of memory of its own
    (_external.py). The caller vouches that `owner` keeps those bytes mapped
    for as long as it lives, and that they lie inside the mapping (checked
    against the mapping's private size there). `owner` exports no buffer,
    so NumPy cannot make the array or any view of it writable."""
    if nbytes < 0:
        raise ValueError("a region root of negative size")
    return _root_array(<unsigned char *>address, nbytes, owner, False)


def is_external_record(object root):
    """Whether a slot's payload (a uint8 root array) is the record of a
    batch larger than a slot (shmpipe/_external.py) rather than a batch."""
    cdef cnp.ndarray r = <cnp.ndarray?>root
    return cnp.PyArray_DIM(r, 0) == EXTERNAL_RECORD_BYTES and memcmp(cnp.PyArray_DATA(r), EXTERNAL_MAGIC, 4) == 0


# -- batches larger than a slot: what each end does per batch -----------------
# The rules are _external.py's (its module doc), and so is everything that
# runs once per region: making, announcing, dropping, mapping one, and
# every check of what the outbox brings. Here is only what runs for every
# batch in a region, compiled so that such a batch costs no more Python
# calls than one in a slot: the producer's pick of a free region and the
# record's publication (RegionPoolCore), the consumer's lookup of a region
# it mapped already and the batch's root (RegionTable).


cdef class Region:
    """One region of a producer's pool: its writable `mapping` (`buf`, a
    uint8 array over all of it, based on the mapping), its `index` in the
    worker's table, its id (`rid`) and `size` (the mapping's), and the batch
    it last carried (`slot`, `pass_no`, `wseq`; slot -1: none since it was
    made, or seen released since). Busy while that slot holds that batch
    (_external's lifetime rules); `reserved` while a reservation's arrays
    are being filled in it (not yet published). `tainted`: a weak reference
    to the root of a reservation yielded while a NumPy view of its arrays
    lived; while that root lives, the region is made read-only in this
    process whenever it carries a batch, until it is taken again
    (RegionPoolCore.published, pick: a view kept past its yield cannot
    change a batch the consumer holds). `protected`: it is read-only now.
    `last_used`, `used_ns`: the pool's batch count and the monotonic clock
    when it was last taken (idle regions are dropped by both)."""
    cdef readonly Mapping mapping
    cdef readonly object buf
    cdef readonly uint32_t index
    cdef readonly uint64_t rid
    cdef readonly Py_ssize_t size
    cdef readonly int64_t slot
    cdef readonly uint32_t pass_no
    cdef readonly uint64_t wseq
    cdef public bint reserved
    cdef readonly uint64_t last_used
    cdef readonly int64_t used_ns
    cdef public object tainted
    cdef readonly bint protected

    def __cinit__(self, uint32_t index, uint64_t rid, Mapping mapping):
        if not mapping.writable:
            raise ValueError("a producer's region is its writable mapping")
        self.mapping = mapping
        self.buf = mapping.array()
        self.index = index
        self.rid = rid
        self.size = mapping.size
        self.slot = -1

    def new_root(self):
        """A writable uint8 array over all of the region, of its own (its
        base is the mapping): the root of one reservation's arrays."""
        return self.mapping.array()

    def taint(self, root):
        self.tainted = weakref.ref(root)

    def set_protected(self, bint protected):
        protect(self.mapping.address, <size_t>self.size, not protected)
        self.protected = protected


cdef class RegionPoolCore:
    """A producer's regions as each batch uses them: the base of
    _external.RegionPool, which makes, announces and drops them (`_make`,
    `sweep`). `regions`: the pool (at most `limit`); `puts`: the batches
    this producer sent (in a slot or not: tick()); `peak`: the largest batch
    that needed a region lately (within `idle_puts` batches; since batch
    `peak_at`); `guards`: times a region was made read-only
    (guard_if_tainted)."""
    cdef readonly RingWriter writer
    cdef readonly list regions
    cdef readonly uint32_t limit
    cdef readonly uint64_t idle_puts
    cdef readonly uint64_t puts
    cdef public uint64_t next_sweep
    cdef readonly uint64_t peak
    cdef readonly uint64_t peak_at
    cdef readonly uint64_t guards

    def __init__(self, RingWriter writer, uint32_t limit, uint64_t idle_puts, uint64_t next_sweep):
        self.writer = writer
        self.regions = []
        self.limit = limit
        self.idle_puts = idle_puts
        self.next_sweep = next_sweep

    cdef bint _free(self, Region region) noexcept:
        if region.reserved:
            return False
        if region.slot < 0:
            return True
        if shmp_slot_holds(&self.writer.ring.r, <uint32_t>region.slot, self.writer.worker,
                           region.pass_no, region.wseq):
            return False
        region.slot = -1  # released for good: the next look needs no load
        return True

    def free(self, Region region):
        """Whether no array of the batch `region` last carried can live in
        the consumer any more (then it may be written again): one acquire
        load (RingWriter.holds) while it may."""
        return self._free(region)

    cdef Region _pick(self, uint64_t nbytes):
        cdef Region region, best = None
        if nbytes >= self.peak or self.puts - self.peak_at > self.idle_puts:
            self.peak = nbytes
            self.peak_at = self.puts
        for obj in self.regions:
            region = <Region>obj
            if <uint64_t>region.size >= nbytes and (best is None or region.size < best.size) and self._free(region):
                best = region
        if best is not None:
            self._use(best)
        return best

    def pick(self, uint64_t nbytes):
        """The smallest free region with room for `nbytes`, taken (see
        use()); None where there is none (take() makes one). Notes `nbytes`
        towards the peak either way. Call with the batch's slot claimed."""
        return self._pick(nbytes)

    cdef int _use(self, Region region) except -1:
        region.last_used = self.puts
        region.used_ns = _now_ns()
        if region.protected:
            region.set_protected(False)  # ours to write again (see Region)
        return 0

    def use(self, Region region):
        """`region` is taken now (for its idleness), and writable here again."""
        self._use(region)

    def guard_if_tainted(self, Region region):
        """Makes `region` read-only here if a view of a reservation in it
        may still write it (see Region); forgets a taint whose views are
        gone."""
        tainted = region.tainted
        if tainted is None:
            return
        if tainted() is None:
            region.tainted = None
        elif not region.protected:
            region.set_protected(True)
            self.guards += 1

    def published(self, Region region, uint32_t slot):
        """`region` carries the batch about to be published in `slot` (the
        writer's current pass and wseq): busy until the consumer lets it go."""
        self._published(region, slot)

    cdef int _published(self, Region region, uint32_t slot) except -1:
        region.slot = slot
        region.pass_no = self.writer.pass_no
        region.wseq = self.writer.wseq
        region.reserved = False
        if region.tainted is not None:
            self.guard_if_tainted(region)
        return 0

    def put_external(self, uint64_t nbytes, object write not None):
        """Publishes a payload of `nbytes` that `write(buf)` writes into a
        region's array, in a free region, announced by a record in a slot
        claimed first (the ring's capacity bounds these batches too, and
        then a region is always free)."""
        self._put_in_region(self.writer._acquire(), nbytes, write)

    def put_planned(self, uint64_t nbytes):
        """put_external() of the batch the writer's put_fitting() planned
        last (`nbytes`, larger than a slot), written by the writer's own
        encoder. Its record goes into the slot of the writer's pending
        reservation, if there is one (yielded as something else: the batch
        may hold its arrays, copied out before the record is written over
        their start; and claiming a second slot could wait forever on an
        ordered pipeline's quota), else into a slot claimed now."""
        cdef RingWriter writer = self.writer
        cdef uint32_t slot
        if writer.enc.nbytes != <Py_ssize_t>nbytes:
            raise ValueError(f"put_planned() of {nbytes} bytes, but {writer.enc.nbytes} are planned")
        if writer.has_reserved:
            slot = writer.reserved_slot
            writer._seal_reservation()  # its arrays read-only (a view of them taints the slot)
        else:
            slot = writer._acquire()
        self._put_in_region(slot, nbytes, None)

    cdef int _put_in_region(self, uint32_t slot, uint64_t nbytes, object write) except -1:
        # The batch of `nbytes` in `slot` (claimed): written by write(buf),
        # or (None) by the writer's encoder, which planned that many bytes.
        cdef RingWriter writer = self.writer
        cdef Region region
        try:
            region = self._pick(nbytes)
            if region is None:
                region = self._make(nbytes)  # a new region, or a larger one (_external.RegionPool)
                if region.size < <Py_ssize_t>nbytes:
                    raise ValueError(f"a region of {region.size} bytes for a payload of {nbytes}")
            if write is None:
                writer.enc.write(<unsigned char *>region.mapping.address, region.size)
            else:
                write(region.buf)
        except BaseException:
            shmp_abandon(&writer.ring.r, slot, writer.worker)  # the region was not marked busy: free again
            raise
        self._published(region, slot)
        writer._publish_record(slot, nbytes, region.index, region.rid)
        return 0

    def tick(self):
        """One batch sent (in a slot or not); every so often, idle regions
        are dropped (sweep())."""
        self.puts += 1
        if self.puts >= self.next_sweep:
            self.sweep()

    # The policy, _external.RegionPool's:

    def _make(self, uint64_t nbytes):
        """A region for `nbytes` where pick() found none that is free and
        fits: made (and announced), taken."""
        raise NotImplementedError

    def sweep(self):
        """Drops the regions idle for long enough; sets next_sweep."""
        raise NotImplementedError


cdef class RegionHold:
    """The base of a batch's root in a region: keeps the mapping (`view`)
    and the record (and so the slot, its lease) alive until the batch's
    last array goes. Exports no buffer (NumPy cannot make views writable).
    `desc`: the region's descriptor, where `view` is a read-only mapping of
    it from its start; None where `view` is a private mapping of the batch
    (a rank's big batch). _external._Held adds writable_view (_cow.py)."""
    cdef readonly Mapping view
    cdef readonly object record
    cdef readonly object desc

    def __init__(self, Mapping view not None, object record, object desc):
        self.view = view
        self.record = record
        self.desc = desc


cdef RegionHold _new_hold(type held_type, Mapping view, object record, object desc):
    """A RegionHold of type `held_type` (a subclass without an __init__ of
    its own: RegionTable checks), made without a Python call."""
    cdef RegionHold hold = <RegionHold>(<PyTypeObject *>held_type).tp_new(held_type, <PyObject *>_NO_ARGS, NULL)
    hold.view = view
    hold.record = record
    hold.desc = desc
    return hold


cdef tuple _NO_ARGS = ()


cdef class RegionEntry:
    """A region the consumer was told of (_external.Regions): its id and
    size (read once, checked there, never changed), its descriptor (`desc`:
    dropped once the region is, the last batch in it closing it, as a
    batch's tensors may still need a private mapping of it, _cow.py), and
    its read-only mapping once used (`view`: `mapped` bytes from its start,
    never more than `size`; unmapped only when no batch's root refers to it
    any more)."""
    cdef readonly uint64_t rid
    cdef readonly Py_ssize_t size
    cdef public object desc
    cdef readonly Mapping view

    def __init__(self, uint64_t rid, Py_ssize_t size, object desc):
        self.rid = rid
        self.size = size
        self.desc = desc

    def set_view(self, Mapping view not None):
        """Maps the region from now on through `view` (read-only, of at most
        `size` bytes); the old mapping stays while batches in it live."""
        if view.writable or view.size > self.size:
            raise ValueError(f"a view of {view.size} bytes of a region of {self.size}, writable={view.writable}")
        self.view = view

    def forget(self):
        """Dropped or replaced: the descriptor and the mapping go with the
        last batch in it."""
        self.desc = None
        self.view = None

    @property
    def mapped(self) -> int:
        return 0 if self.view is None else self.view.size

    @property
    def address(self) -> int:
        return 0 if self.view is None else self.view.address


cdef class RegionTable:
    """The consumer's regions by (worker, index): the one each index holds
    now (_external.Regions keeps it; what it holds was read and checked
    there). Bounded by the ring: `nworkers` x `per_worker` entries. Its
    root() is the reader's way to a batch in a region it mapped already:
    no Python call, the record's values checked against the entry."""
    cdef list entries
    cdef readonly uint32_t nworkers
    cdef readonly uint32_t per_worker
    cdef Py_ssize_t count
    cdef type held_type

    def __init__(self, uint32_t nworkers, uint32_t per_worker, type held_type not None):
        if not issubclass(held_type, RegionHold) or held_type.__init__ is not RegionHold.__init__:
            raise TypeError(f"{held_type!r} is not a RegionHold (with RegionHold's __init__)")
        self.entries = [None] * (<Py_ssize_t>nworkers * per_worker)
        self.nworkers = nworkers
        self.per_worker = per_worker
        self.held_type = held_type
        self.count = 0

    cdef inline Py_ssize_t _at(self, uint64_t worker, uint64_t index) noexcept:
        if worker >= self.nworkers or index >= self.per_worker:
            return -1
        return <Py_ssize_t>(worker * self.per_worker + index)

    def get(self, uint64_t worker, uint64_t index):
        """The region at (worker, index), or None (also out of range)."""
        cdef Py_ssize_t i = self._at(worker, index)
        return None if i < 0 else self.entries[i]

    def put(self, uint64_t worker, uint64_t index, RegionEntry entry not None):
        cdef Py_ssize_t i = self._at(worker, index)
        if i < 0:
            raise IndexError(f"region {index} of worker {worker} is outside the table")
        if self.entries[i] is None:
            self.count += 1
        self.entries[i] = entry

    def pop(self, uint64_t worker, uint64_t index):
        cdef Py_ssize_t i = self._at(worker, index)
        entry = None if i < 0 else self.entries[i]
        if entry is None:
            raise KeyError((worker, index))
        self.entries[i] = None
        self.count -= 1
        return entry

    def items(self):
        """[((worker, index), entry)] of every region held."""
        cdef Py_ssize_t i
        return [((i // self.per_worker, i % self.per_worker), e)
                for i, e in enumerate(self.entries) if e is not None]

    def values(self):
        return [e for e in self.entries if e is not None]

    def __len__(self):
        return self.count

    cdef object _root(self, uint64_t worker, uint64_t index, uint64_t rid, uint64_t nbytes, object record):
        cdef Py_ssize_t i = self._at(worker, index)
        cdef RegionEntry entry
        cdef Mapping view
        if i < 0:
            return None
        entry = self.entries[i]
        if entry is None or entry.rid != rid:
            return None
        view = entry.view
        if view is None or entry.desc is None or nbytes > <uint64_t>view.size:
            return None
        return _root_array(<unsigned char *>view.address, <Py_ssize_t>nbytes,
                           _new_hold(self.held_type, view, record, entry.desc), False)

    def root(self, uint64_t worker, uint64_t index, uint64_t rid, uint64_t nbytes, object record):
        """The root (read-only, holding `record`: the slot) of the batch of
        `nbytes` in region `index` (id `rid`) of `worker`, if the table holds
        that region, mapped with `nbytes` in the mapping; else None (then
        _external.Regions.root: the first use of a region, a larger
        mapping, a replaced producer's region, or an error)."""
        return self._root(worker, index, rid, nbytes, record)


cdef class RingReader:
    """The consumer's end of the ring: takes slots and decodes them into
    read-only views whose root owns the slot (see the module docstring).

    A slot holding an external batch's record is read (once, checked: its
    worker must be the slot's) and its batch found in `regions` (a region
    mapped already: RegionTable.root) or else handed, with its lease, to
    `on_external(worker, region, rid, nbytes, record)`; either returns the
    payload's root (read-only, holding the record and so the slot): the
    reader decodes it as it decodes a slot."""
    cdef readonly Ring ring
    cdef Decoder dec
    cdef readonly int last_worker
    # Set by the consumer too, for a batch it resolves itself (a group's
    # big batch: take_slot returns its record, the consumer maps it).
    cdef public uint64_t last_nbytes
    cdef public object on_external
    cdef public RegionTable regions

    def __cinit__(self, Ring ring):
        self.ring = ring
        self.dec = Decoder()

    def take(self, uint32_t pass_no, int worker, uint64_t wseq, double wait):
        """The next batch of `pass_no` (from `worker`, number `wseq`, if
        worker >= 0); END when there is none; FAULT when a fault was
        reported and nothing is left to deliver; AGAIN after waiting up to
        `wait` seconds. Runs the signal handlers (so KeyboardInterrupt comes
        out) if a signal interrupts the wait."""
        root = self._take_raw(pass_no, worker, wseq, wait)
        if root is END or root is AGAIN or root is FAULT:
            return root
        return self._decode(root)

    cdef object _decode(self, object root):
        cdef cnp.ndarray r = <cnp.ndarray>root
        cdef Py_ssize_t n = cnp.PyArray_DIM(r, 0)
        cdef unsigned char *data = <unsigned char *>cnp.PyArray_DATA(r)
        if n == EXTERNAL_RECORD_BYTES and memcmp(data, EXTERNAL_MAGIC, 4) == 0:
            return self._external(root, True)
        return self.dec.decode(data, n, root, False)

    def take_ready(self, uint32_t pass_no, int worker, uint64_t wseq, int64_t due_ns):
        """The consumer's fast path (ConsumerEnd.take_ready): the batch of
        `pass_no` that take() would return (the oldest, or with worker >= 0
        that worker's number `wseq`) if it is READY right now, taken and
        decoded, as (batch, payload bytes, worker, ns the call took). None,
        having taken nothing, when no batch is READY, when the pass ended
        or a fault was reported, or when the clock (CLOCK_MONOTONIC, that
        of time.perf_counter_ns) has reached `due_ns`: the caller then
        takes its general path, which waits, ends passes, raises failures.
        Never waits, never releases the GIL. Same checks as take(): a
        corrupt slot raises CorruptChannelError."""
        cdef int64_t t0 = _now_ns(), t1
        cdef uint32_t slot = 0, from_worker = 0
        cdef int rc
        if t0 >= due_ns:
            return None
        # wait 0: one look, no spin, no sleep, no system call.
        rc = shmp_take(&self.ring.r, worker, pass_no, wseq, 0, &slot, &from_worker)
        if rc != SHMP_OK:
            if rc < 0 or rc == SHMP_INTERRUPTED:
                _raise_status(rc, "taking a batch")
            return None
        batch = self._decode(self._lease_root(slot, from_worker))
        t1 = _now_ns()
        return batch, self.last_nbytes, self.last_worker, (t1 - t0 if t1 > t0 else 1)

    cdef object _external(self, object record, bint decode):
        cdef cnp.ndarray r
        cdef ext_record rec
        if self.on_external is None:
            raise CorruptChannelError("a slot holds the record of a batch larger than a slot, which this ring cannot take")
        _read_record(record, &rec)
        if rec.worker != <uint32_t>self.last_worker:
            raise CorruptChannelError(f"a slot of worker {self.last_worker} holds a record of worker {rec.worker}")
        root = None if self.regions is None else self.regions._root(rec.worker, rec.region, rec.rid, rec.nbytes, record)
        if root is None:
            root = self.on_external(self.last_worker, rec.region, rec.rid, rec.nbytes, record)
        del record  # the root holds it (and the slot) for as long as the batch lives
        self.last_nbytes = rec.nbytes
        if not decode:
            return root
        r = <cnp.ndarray?>root
        return self.dec.decode(<unsigned char *>cnp.PyArray_DATA(r), cnp.PyArray_DIM(r, 0), root, False)

    def take_raw(self, uint32_t pass_no, int worker, uint64_t wseq, double wait):
        """Like take(), but returns the payload itself: a read-only uint8
        array whose lifetime holds the slot (the Arrow transport decodes it)."""
        root = self._take_raw(pass_no, worker, wseq, wait)
        if root is END or root is AGAIN or root is FAULT:
            return root
        if is_external_record(root):
            return self._external(root, False)
        return root

    def take_slot(self, uint32_t pass_no, int worker, uint64_t wseq, double wait):
        """Like take_raw(), but a slot that holds the record of a batch
        larger than a slot is returned as it is (is_external_record says
        so): the caller maps that batch itself (a group hands its
        descriptor to a rank)."""
        return self._take_raw(pass_no, worker, wseq, wait)

    cdef object _lease_root(self, uint32_t slot, uint32_t from_worker):
        """The root array of a slot shmp_take just made HELD for us, with
        `from_worker` the worker shmp_take matched it on."""
        cdef uint64_t nbytes
        cdef Ring ring = self.ring
        # The slot record's worker and nbytes are shared words another
        # process may have written: each is read once into a local (the
        # worker by shmp_take, where it matched the slot on it), checked
        # against the private geometry, and only the local is used.
        nbytes = shmp_slot_nbytes(&ring.r, slot)
        # The lease exists from here on, so whatever happens the slot is
        # released: on error, the root is dropped and the lease with it.
        lease = _lease(ring, slot, True)
        if nbytes > ring.r.slot_size:
            raise CorruptChannelError(
                f"slot {slot} claims {nbytes} bytes, more than a slot holds ({ring.r.slot_size})")
        if from_worker >= ring.r.nworkers:
            raise CorruptChannelError(
                f"slot {slot} names worker {from_worker}, but the ring has {ring.r.nworkers} workers")
        self.last_worker = <int>from_worker
        self.last_nbytes = nbytes
        return _root_array(ring.payload(slot), <Py_ssize_t>nbytes, lease, False)

    cdef object _take_raw(self, uint32_t pass_no, int worker, uint64_t wseq, double wait):
        cdef uint32_t slot = 0, from_worker = 0
        cdef int rc
        cdef int64_t wait_ns = <int64_t>(wait * 1e9) if wait > 0 else 0
        cdef Ring ring = self.ring
        with nogil:
            rc = shmp_take(&ring.r, worker, pass_no, wseq, wait_ns, &slot, &from_worker)
        if rc == SHMP_OK:
            return self._lease_root(slot, from_worker)
        if rc == SHMP_END:
            return END
        if rc == SHMP_FAULT:
            return FAULT
        _raise_status(rc, "waiting for a batch")
        return AGAIN
