/*
 * shmpipe ring: N producer processes, one consumer, fixed-size slots in one
 * shared-memory segment.
 *
 * This file is the C core. It works on memory the caller provides (the
 * mapping of the segment), never allocates, never raises: every function
 * returns a status code (SHMP_*) and the Cython layer turns the codes into
 * exceptions in one place (shmpipe/_ring.pyx: _raise_status). Blocking
 * functions wait at most `wait_ns` in one call, so the caller, holding no
 * GIL meanwhile, can come back to check signals, deadlines and the liveness
 * of the other side between waits.
 *
 * Byte layout of a segment (all integers little-endian, native on every
 * platform we build for; offsets in bytes). docs/design.md explains the slot
 * state machine and the memory-ordering argument in full.
 *
 *   0                      shmp_header (256 bytes: 4 cache lines)
 *   256                    shmp_worker[nworkers]   (64 bytes each)
 *   256 + 64*nworkers      shmp_slot[nslots]       (64 bytes each)
 *   header_size            slot 0 payload  (header_size is a multiple of 4096)
 *   header_size + k*slot_size  slot k payload  (slot_size is a multiple of 4096)
 *   total_size = header_size + nslots*slot_size
 *
 * The geometry fields of the header (flags, header_size, slot_size,
 * total_size, nslots, nworkers, quota, owner) are written once by the
 * consumer and read once by each process when it attaches: see shmp_ring
 * below for why every other function uses a private copy of them.
 */
#ifndef SHMPIPE_RING_H
#define SHMPIPE_RING_H

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHMP_MAGIC 0x3145504950504d53ULL /* "SMPPIPE1" read as little-endian bytes */
#define SHMP_LAYOUT_VERSION 2u
#define SHMP_PAGE 4096u
#define SHMP_MAX_SLOTS 4096u
#define SHMP_MAX_WORKERS 1024u

/* Status codes. >= 0: a normal outcome; < 0: an error. */
enum {
    SHMP_OK = 0,
    SHMP_AGAIN = 1,       /* nothing yet and this call's wait has elapsed */
    SHMP_INTERRUPTED = 2, /* a signal interrupted the wait (EINTR): run the handlers */
    SHMP_END = 3,         /* consumer: the pass is exhausted (for one worker, or all) */
    SHMP_CANCELLED = 4,   /* producer: the consumer started another pass */
    SHMP_CLOSED = 5,      /* the consumer closed the ring */
    SHMP_FAULT = 6,       /* consumer: a fault was reported (shmp_report_fault) */
    SHMP_E_MAGIC = -1,    /* not a shmpipe segment */
    SHMP_E_VERSION = -2,  /* a shmpipe segment of another layout version */
    SHMP_E_LAYOUT = -3,   /* header fields inconsistent with each other or the size */
    SHMP_E_ARG = -4,      /* an argument out of range */
    SHMP_E_SYS = -5,      /* a system call failed; errno says why */
    SHMP_E_STATE = -6     /* a live shared word holds a value no valid ring can
                           * have (another process wrote it) */
};

/* Slot states. Who may move a slot out of each state is part of the protocol:
 *   FREE    -> WRITING  a producer, by compare-and-swap (several compete)
 *   WRITING -> READY    the producer that owns it (publish)
 *   WRITING -> FREE     the producer that owns it (abandon), or the consumer
 *                       once that producer's process is gone (reclaim)
 *   READY   -> HELD     the consumer (take)
 *   READY   -> FREE     the consumer (a batch of a pass that was cancelled)
 *   HELD    -> FREE     the consumer process, from whichever thread drops the
 *                       last reference to the batch (release)
 */
enum { SHMP_FREE = 0, SHMP_WRITING = 1, SHMP_READY = 2, SHMP_HELD = 3 };

/* A WRITING slot's state word also names its producer: SHMP_WRITING in the
 * low byte, the worker above it, set by the one compare-and-swap that claims
 * the slot. So a slot is never WRITING without an owner, even for a moment,
 * and the consumer can take back what a dead producer held unpublished
 * (shmp_reclaim) without guessing whose it was. */
#define SHMP_STATE_OF(word) ((word) & 0xffu)
#define SHMP_WRITING_BY(worker) (SHMP_WRITING | ((uint32_t)(worker) << 8))

/* Header flags. */
#define SHMP_FLAG_ORDERED 1u

/* Sizes of the three tables; fixed by the layout version. */
#define SHMP_HEADER_BYTES 256u
#define SHMP_WORKER_BYTES 64u
#define SHMP_SLOT_BYTES 64u

/* Bytes from the start of the segment to slot 0's payload. */
uint64_t shmp_header_size(uint32_t nslots, uint32_t nworkers);

/* ---- the private geometry -------------------------------------------- */

/* One process's view of a ring: where its mapping is and the ring's shape.
 *
 * Why private: the segment is writable by every process of the same user,
 * so its bytes are untrusted input. The header keeps the geometry fields
 * (nslots, nworkers, slot_size, header_size, total_size, quota, flags,
 * owner) so that a process can check them when it attaches, but they are
 * read exactly once, by shmp_ring_init (which writes them) or
 * shmp_ring_attach (which checks them against the mapping's real length),
 * and copied here. From then on nothing reads them from shared memory again:
 * every offset, count and bound below comes from this struct, which lives in
 * the process's own memory, where no other process can change it. Rewriting
 * the shared header of a live ring changes nothing for processes already
 * attached; a process attaching afterwards refuses it or, if the new values
 * are consistent with each other and the mapping, works inside its own
 * mapping with them.
 *
 * What stays shared and live: the words that must change while the ring runs
 * (slot states, pass, closed, faults, the futex and waiting words, tickets,
 * the worker records' counters and the slot records' worker/pass/wseq/
 * ticket/nbytes). Any of them that could index or size memory is checked
 * against this struct before use (a slot's worker against nworkers, its
 * nbytes against slot_size, a worker's inflight against nslots) and is read
 * once into a local, so a value changed between the check and the use is
 * never seen.
 *
 * Filled by shmp_ring_init or shmp_ring_attach; plain data (the caller owns
 * it, e.g. by value inside a Python object); never written afterwards, so
 * any thread may use it without locks. */
typedef struct {
    void *base;           /* start of this process's mapping */
    uint64_t total_size;  /* bytes mapped (= the header's total_size at attach) */
    uint64_t header_size; /* offset of slot 0's payload */
    uint64_t slot_size;   /* bytes per slot payload */
    uint32_t nslots;
    uint32_t nworkers;
    uint32_t quota;       /* max WRITING+READY slots per worker; 0: none */
    uint32_t flags;       /* SHMP_FLAG_* */
    int32_t owner_pid;    /* the consumer that created the ring */
    uint32_t reserved;
    uint64_t owner_start;
} shmp_ring;

/* Consumer, once, before the segment's name is given to anyone: writes the
 * header (magic last, with release ordering) and fills *ring. `quota` is the
 * most slots one worker may have WRITING or READY at once (0: no limit);
 * ordered pipelines need it so that one worker cannot fill the ring while
 * the consumer waits for another. */
int shmp_ring_init(shmp_ring *ring, void *base, uint64_t total_size, uint32_t nslots,
                   uint32_t nworkers, uint64_t slot_size, uint32_t quota,
                   uint32_t flags, int32_t owner_pid, uint64_t owner_start,
                   uint32_t first_pass);

/* Anyone else, once, before trusting a segment: reads the header's geometry
 * once, checks magic, version, flags and that every size and offset agrees
 * with the others and with `total_size` (the mapping's real length), and
 * copies it into *ring. On an error *ring is zeroed (base NULL). */
int shmp_ring_attach(shmp_ring *ring, void *base, uint64_t total_size);

/* Where slot `slot`'s payload starts, from the private geometry only. The
 * caller passes a slot index it got from shmp_acquire/shmp_take (or checked
 * against ring->nslots): then the payload lies inside the mapping, because
 * attach checked header_size + nslots * slot_size == total_size. */
static inline unsigned char *shmp_payload(const shmp_ring *ring, uint32_t slot) {
    return (unsigned char *)ring->base + ring->header_size + (uint64_t)slot * ring->slot_size;
}

/* ---- producer side ---------------------------------------------------- */

/* Claims a FREE slot for `worker` working on `pass`. Returns SHMP_OK with
 * *slot set, SHMP_AGAIN after waiting up to wait_ns, SHMP_INTERRUPTED,
 * SHMP_CANCELLED if `pass` is no longer current, SHMP_CLOSED (also once a
 * fault was reported: production stops at a fault), SHMP_E_STATE if the
 * worker's shared in-flight count is impossible (another process wrote it).
 * Time spent waiting is added to the worker's blocked_ns. */
int shmp_acquire(const shmp_ring *ring, uint32_t worker, uint32_t pass, int64_t wait_ns,
                 uint32_t *slot);

/* Makes a WRITING slot READY. The payload must be complete before the call:
 * the state is stored with release ordering. */
int shmp_publish(const shmp_ring *ring, uint32_t slot, uint32_t worker, uint32_t pass,
                 uint64_t wseq, uint64_t nbytes);

/* Gives a WRITING slot back without publishing it. */
int shmp_abandon(const shmp_ring *ring, uint32_t slot, uint32_t worker);

/* Marks `worker`'s part of `pass` complete after `produced` batches. Every
 * publish of the pass must come before this call. */
int shmp_finish_pass(const shmp_ring *ring, uint32_t worker, uint32_t pass,
                     uint64_t produced);

/* ---- consumer side ---------------------------------------------------- */

/* Takes the next READY slot of `pass`: with worker < 0 the oldest published
 * by any worker; with worker >= 0 the one `worker` published as number
 * `wseq` of the pass. READY slots of other passes met on the way are freed.
 * Returns SHMP_OK with *slot set (the slot is HELD), SHMP_END when the pass
 * (or that worker's part of it) has no more batches, SHMP_FAULT when a fault
 * was reported and no batch it looks for is READY (so everything published
 * before a fault is delivered first), SHMP_AGAIN after waiting up to wait_ns,
 * or SHMP_INTERRUPTED. *worker is the worker whose batch it is, as the take
 * matched it (the slot's worker word is a shared word, read once: the
 * caller uses this value, never the word again, and checks it against the
 * private geometry, as it does the slot's nbytes, read once with
 * shmp_slot_nbytes). */
int shmp_take(const shmp_ring *ring, int32_t worker, uint32_t pass, uint64_t wseq,
              int64_t wait_ns, uint32_t *slot, uint32_t *worker_out);

/* Gives a HELD slot back to the producers. Thread-safe; never blocks. */
int shmp_release(const shmp_ring *ring, uint32_t slot);

/* Producer `worker`'s process is gone (the caller knows: it was reaped):
 * its WRITING slots become FREE, and its in-flight count is set to the
 * slots it still has READY (what the consumer will take). A producer that
 * replaces it may then claim slots as the worker. Consumer only, from the
 * thread that takes (no take runs meanwhile). Returns the number of slots
 * taken back, or SHMP_E_ARG. */
int shmp_reclaim(const shmp_ring *ring, uint32_t worker);

/* Whether `worker` marked its part of `pass` complete (shmp_finish_pass). */
int shmp_worker_done(const shmp_ring *ring, uint32_t worker, uint32_t pass);

/* Starts a new pass and returns its number; producers still working on the
 * old one see SHMP_CANCELLED. */
uint32_t shmp_begin_pass(const shmp_ring *ring);
uint32_t shmp_current_pass(const shmp_ring *ring);

/* Producers see SHMP_CLOSED from now on; every waiter is woken. */
void shmp_close(const shmp_ring *ring);
int shmp_is_closed(const shmp_ring *ring);

/* A producer failed (it has sent the details through another channel) or the
 * consumer saw one die: producers stop claiming slots (SHMP_CLOSED), and
 * shmp_take returns SHMP_FAULT once what is READY has been taken. */
void shmp_report_fault(const shmp_ring *ring);

/* ---- waiting ----------------------------------------------------------- */

/* Before sleeping on a futex, shmp_acquire and shmp_take look again for up to
 * this many nanoseconds, yielding the CPU between looks, so a handoff that
 * comes soon costs neither side a system call or a context switch. Bounded:
 * an idle waiter sleeps after it. Per process; 0 turns spinning off. */
#define SHMP_SPIN_NS_DEFAULT 20000
void shmp_set_spin_ns(int64_t ns);
int64_t shmp_get_spin_ns(void);

/* ---- a producer's question about its own published batch ------------- */
/* 1 while `slot` still holds batch (worker, pass, wseq): READY or HELD with
 * that record. 0 once the consumer released or discarded it, with acquire
 * ordering: the consumer's reads of anything that batch referred to (a
 * region of memory of its own, _external.py) happen before the caller's
 * next writes there. Only the batch's producer may ask (no one else
 * publishes a batch with its worker, pass and wseq). */
int shmp_slot_holds(const shmp_ring *ring, uint32_t slot, uint32_t worker, uint32_t pass, uint64_t wseq);

/* ---- observation (relaxed reads, for stats and diagnostics) ----------- */
/* Each reads one shared word once. An index out of the private geometry's
 * range reads nothing and gives 0 (UINT32_MAX for a slot's worker, which no
 * valid worker has). */
uint32_t shmp_slot_state(const shmp_ring *ring, uint32_t slot);
uint32_t shmp_slot_worker(const shmp_ring *ring, uint32_t slot);
uint32_t shmp_slot_pass(const shmp_ring *ring, uint32_t slot);
uint64_t shmp_slot_wseq(const shmp_ring *ring, uint32_t slot);
uint64_t shmp_slot_nbytes(const shmp_ring *ring, uint32_t slot);
uint64_t shmp_worker_blocked_ns(const shmp_ring *ring, uint32_t worker);
uint64_t shmp_worker_published(const shmp_ring *ring, uint32_t worker);
uint32_t shmp_worker_inflight(const shmp_ring *ring, uint32_t worker);

#ifdef __cplusplus
}
#endif
#endif /* SHMPIPE_RING_H */
