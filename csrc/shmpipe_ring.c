/*
 * shmpipe ring: the slot protocol. See shmpipe_ring.h for the API and the
 * byte layout, docs/design.md for the state machine and the ordering proof.
 *
 * Memory ordering, in short:
 *  - A producer writes a payload with plain stores, then stores READY with
 *    release; the consumer loads READY with acquire before it reads anything.
 *  - The consumer stops reading a payload before it stores FREE with release
 *    (shmp_release); a producer claims the slot with an acquire CAS, so the
 *    consumer's reads happen before the producer's next writes.
 *  - Sleeping uses a sequence word per direction (ready_seq for the consumer,
 *    space_seq for producers) and a "someone is waiting" word. The waker
 *    bumps the sequence then reads the waiting word; the sleeper announces
 *    itself then lets the kernel compare the sequence. Both pairs are seq_cst,
 *    so at least one side sees the other: either the sleeper's compare fails
 *    (EAGAIN) or the waker sees it waiting and calls FUTEX_WAKE. The sequence
 *    is read before the sleeper's last look at the slots, so an event between
 *    that look and the sleep changes it.
 *  - The futexes are process-shared (plain FUTEX_WAIT/FUTEX_WAKE, never the
 *    _PRIVATE variants): producers and consumer are different processes.
 *
 * Trust: every process of the user can write the segment, so nothing read
 * from it is trusted. The geometry (shmp_ring, see shmpipe_ring.h) is read
 * once at attach, checked, and kept in private memory; every function here
 * takes that private copy and locates the tables and payloads from it
 * alone. The live shared words are read once each (LOAD_ONCE or an atomic
 * load) and checked before they index anything. What is not atomic: a slot
 * record's worker/pass/wseq/ticket/nbytes are plain words (written by the
 * owning producer while WRITING, published by the release store of READY);
 * a worker's quota check and its inflight increment are two steps (safe
 * because only that worker's process increments); the geometry read at
 * attach is field by field, not one snapshot (checked as a whole).
 */
#define _GNU_SOURCE
#include "shmpipe_ring.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <string.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    /* cache line 0: the geometry. Written once by shmp_ring_init, read once
     * by shmp_ring_attach into the process's private shmp_ring, and never
     * read again: another process may rewrite these bytes at any time. */
    _Atomic uint64_t magic;    /*   0  stored last, with release */
    uint32_t layout_version;   /*   8 */
    uint32_t flags;            /*  12  SHMP_FLAG_* */
    uint64_t header_size;      /*  16  offset of slot 0's payload */
    uint64_t slot_size;        /*  24  bytes per slot payload */
    uint64_t total_size;       /*  32  bytes in the segment */
    uint32_t nslots;           /*  40 */
    uint32_t nworkers;         /*  44 */
    uint32_t quota;            /*  48  max WRITING+READY slots per worker; 0: none */
    int32_t owner_pid;         /*  52  the consumer's pid */
    uint64_t owner_start;      /*  56  the consumer's start time (clock ticks since boot) */
    /* cache line 1: written by the consumer */
    _Atomic uint32_t pass_no;           /*  64 */
    _Atomic uint32_t closed;            /*  68 */
    _Atomic uint32_t space_seq;         /*  72  futex: producers wait for space */
    _Atomic uint32_t producers_waiting; /*  76  producers inside FUTEX_WAIT on space_seq */
    char pad1[48];
    /* cache line 2: written by producers */
    _Atomic uint32_t ready_seq;         /* 128  futex: the consumer waits for batches */
    _Atomic uint32_t consumer_waiting;  /* 132  1 while the consumer is in FUTEX_WAIT */
    _Atomic uint64_t publish_ticket;    /* 136  global publication order */
    _Atomic uint32_t faults;            /* 144  faults reported by producers */
    char pad2[44];
    /* cache line 3: reserved for later layout versions */
    char pad3[64];
} shmp_header;

typedef struct {
    _Atomic uint32_t inflight;   /*  0  slots WRITING or READY (quota accounting) */
    _Atomic uint32_t done_pass;  /*  4  1 + the last pass this worker finished; 0: none */
    _Atomic uint64_t produced;   /*  8  batches published in that pass (set before done_pass) */
    _Atomic uint64_t blocked_ns; /* 16  time spent waiting for a free slot, all passes */
    _Atomic uint64_t published;  /* 24  batches published, all passes */
    char pad[32];
} shmp_worker;

typedef struct {
    _Atomic uint32_t state; /*  0  SHMP_FREE/WRITING/READY/HELD */
    /* The fields below are written by the producer that owns the slot while
     * it is WRITING and read by the consumer after it loaded READY with
     * acquire; nobody writes them while the slot is READY or HELD, so they
     * need no atomics of their own. */
    uint32_t worker;        /*  4 */
    uint32_t pass;          /*  8 */
    uint32_t reserved;      /* 12 */
    uint64_t wseq;          /* 16  the batch's number within its worker's pass */
    uint64_t ticket;        /* 24  publication order across workers */
    uint64_t nbytes;        /* 32  payload bytes used */
    char pad[24];
} shmp_slot;

_Static_assert(sizeof(shmp_header) == SHMP_HEADER_BYTES, "header layout");
_Static_assert(sizeof(shmp_worker) == SHMP_WORKER_BYTES, "worker layout");
_Static_assert(sizeof(shmp_slot) == SHMP_SLOT_BYTES, "slot layout");
_Static_assert(offsetof(shmp_header, pass_no) == 64, "header layout");
_Static_assert(offsetof(shmp_header, ready_seq) == 128, "header layout");
/* The futex syscall reads the words as plain u32: they must have no lock. */
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "lock-free 32-bit atomics");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "lock-free 64-bit atomics");

#define HDR(ring) ((shmp_header *)(ring)->base)

/* The tables, located from the private geometry only. */
static inline shmp_worker *workers_of(const shmp_ring *r) {
    return (shmp_worker *)((char *)r->base + SHMP_HEADER_BYTES);
}
static inline shmp_slot *slots_of(const shmp_ring *r) {
    return (shmp_slot *)((char *)r->base + SHMP_HEADER_BYTES +
                         (size_t)r->nworkers * SHMP_WORKER_BYTES);
}

/* One read of a plain (non-_Atomic) shared field. Relaxed atomic loads, so
 * the compiler reads the word exactly once: a value checked against the
 * private geometry is the value used, even if another process rewrites the
 * word between the check and the use (a plain load could be repeated). */
#define LOAD_ONCE(field) __atomic_load_n(&(field), __ATOMIC_RELAXED)

static inline uint64_t round_up(uint64_t n, uint64_t to) {
    return (n + to - 1) / to * to;
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Sleeps while *word == expected, at most wait_ns. SHMP_OK: woken or the
 * word had already changed (the caller looks again either way). */
static int futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t wait_ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(wait_ns / 1000000000);
    ts.tv_nsec = (long)(wait_ns % 1000000000);
    long r = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
    if (r == 0) return SHMP_OK;
    switch (errno) {
    case EAGAIN: return SHMP_OK;
    case ETIMEDOUT: return SHMP_AGAIN;
    case EINTR: return SHMP_INTERRUPTED;
    default: return SHMP_E_SYS;
    }
}

static inline void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* How long a waiter looks again (yielding the CPU between looks) before it
 * sleeps on the futex. A handoff that comes within this time costs neither
 * side a system call or a context switch: the waker sees nobody waiting
 * (no FUTEX_WAKE) and the waiter never slept. Bounded, so an idle ring
 * costs at most this much CPU per wait before everyone sleeps. */
static _Atomic int64_t spin_ns = SHMP_SPIN_NS_DEFAULT;

/* Relaxed: a setting, not a synchronisation; a waiter in another thread may
 * use the old value for the wait it is in. */
void shmp_set_spin_ns(int64_t ns) { atomic_store_explicit(&spin_ns, ns < 0 ? 0 : ns, memory_order_relaxed); }
int64_t shmp_get_spin_ns(void) { return atomic_load_explicit(&spin_ns, memory_order_relaxed); }

/* One more look before sleeping, for a wait that began at `t0`? While the
 * spin lasts, yields the CPU first: on a machine with fewer cores than
 * processes, the one this waiter waits for may need it. Reading the clock
 * is a vDSO call, not a system call. */
static inline int keep_spinning(int64_t t0) {
    const int64_t budget = atomic_load_explicit(&spin_ns, memory_order_relaxed);
    if (budget <= 0 || now_ns() - t0 >= budget) return 0;
    sched_yield();
    return 1;
}

/* The waker's half of the protocol described at the top of the file. */
static inline void notify(_Atomic uint32_t *seq, _Atomic uint32_t *waiting) {
    atomic_fetch_add_explicit(seq, 1, memory_order_seq_cst);
    if (atomic_load_explicit(waiting, memory_order_seq_cst) != 0) futex_wake_all(seq);
}

static inline void notify_consumer(shmp_header *h) {
    notify(&h->ready_seq, &h->consumer_waiting);
}
static inline void notify_producers(shmp_header *h) {
    notify(&h->space_seq, &h->producers_waiting);
}

/* inflight - 1, but never below 0: the word is shared, and a process that
 * rewrote it (to 0, say) must not make it wrap to 2^32 - 1, which would
 * hold the worker at its quota for good. Returns the value before. The
 * compare-and-swap loop costs what a fetch_sub costs when nobody competes;
 * the only competitor is the worker's own acquire (an increment). */
static inline uint32_t inflight_dec(_Atomic uint32_t *inflight) {
    uint32_t v = atomic_load_explicit(inflight, memory_order_relaxed);
    while (v != 0 && !atomic_compare_exchange_weak_explicit(inflight, &v, v - 1,
                                                            memory_order_relaxed,
                                                            memory_order_relaxed)) {
    }
    return v;
}

uint64_t shmp_header_size(uint32_t nslots, uint32_t nworkers) {
    return round_up((uint64_t)SHMP_HEADER_BYTES + (uint64_t)nworkers * SHMP_WORKER_BYTES +
                        (uint64_t)nslots * SHMP_SLOT_BYTES,
                    SHMP_PAGE);
}

/* The checks every geometry must pass, wherever it comes from: counts in
 * range, page-sized slots, a header of exactly the size the counts need,
 * and a total that is the mapping's length. Overflow-safe. */
static int check_geometry(uint64_t total_size, uint64_t header_size, uint64_t slot_size,
                          uint64_t claimed_total, uint32_t nslots, uint32_t nworkers,
                          uint32_t quota, uint32_t flags) {
    if (nslots == 0 || nslots > SHMP_MAX_SLOTS || nworkers == 0 ||
        nworkers > SHMP_MAX_WORKERS || slot_size == 0 || slot_size % SHMP_PAGE != 0 ||
        quota > nslots || (flags & ~SHMP_FLAG_ORDERED) != 0)
        return SHMP_E_LAYOUT;
    const uint64_t need = shmp_header_size(nslots, nworkers);
    if (header_size != need) return SHMP_E_LAYOUT;
    if (slot_size > (UINT64_MAX - need) / nslots) return SHMP_E_LAYOUT;
    if (claimed_total != need + (uint64_t)nslots * slot_size || claimed_total != total_size)
        return SHMP_E_LAYOUT;
    return SHMP_OK;
}

/* The process's private copy of a ring's geometry (from checked values only). */
static void keep_geometry(shmp_ring *ring, void *base, uint64_t total_size, uint64_t header_size,
                          uint64_t slot_size, uint32_t nslots, uint32_t nworkers, uint32_t quota,
                          uint32_t flags, int32_t owner_pid, uint64_t owner_start) {
    ring->base = base;
    ring->total_size = total_size;
    ring->header_size = header_size;
    ring->slot_size = slot_size;
    ring->nslots = nslots;
    ring->nworkers = nworkers;
    ring->quota = quota;
    ring->flags = flags;
    ring->owner_pid = owner_pid;
    ring->owner_start = owner_start;
}

int shmp_ring_init(shmp_ring *ring, void *base, uint64_t total_size, uint32_t nslots,
                   uint32_t nworkers, uint64_t slot_size, uint32_t quota, uint32_t flags,
                   int32_t owner_pid, uint64_t owner_start, uint32_t first_pass) {
    if (ring == NULL) return SHMP_E_ARG;
    memset(ring, 0, sizeof *ring);
    if (base == NULL) return SHMP_E_ARG;
    /* 64-bit arithmetic: no overflow for any 32-bit counts. */
    const uint64_t header_size = shmp_header_size(nslots, nworkers);
    if (check_geometry(total_size, header_size, slot_size, total_size, nslots, nworkers, quota,
                       flags) != SHMP_OK)
        return SHMP_E_ARG;
    /* The segment is fresh (zero-filled); zero the tables again anyway so a
     * reused mapping starts clean. Nobody else has the name yet. */
    memset(base, 0, (size_t)header_size);
    shmp_header *h = (shmp_header *)base;
    h->layout_version = SHMP_LAYOUT_VERSION;
    h->flags = flags;
    h->header_size = header_size;
    h->slot_size = slot_size;
    h->total_size = total_size;
    h->nslots = nslots;
    h->nworkers = nworkers;
    h->quota = quota;
    h->owner_pid = owner_pid;
    h->owner_start = owner_start;
    atomic_store_explicit(&h->pass_no, first_pass, memory_order_relaxed);
    atomic_store_explicit(&h->magic, SHMP_MAGIC, memory_order_release);
    /* The private copy comes from the arguments, not from the header. */
    keep_geometry(ring, base, total_size, header_size, slot_size, nslots, nworkers, quota, flags, owner_pid,
                  owner_start);
    return SHMP_OK;
}

int shmp_ring_attach(shmp_ring *ring, void *base, uint64_t total_size) {
    if (ring == NULL) return SHMP_E_ARG;
    memset(ring, 0, sizeof *ring);
    if (base == NULL || total_size < SHMP_HEADER_BYTES) return SHMP_E_LAYOUT;
    shmp_header *h = (shmp_header *)base;
    if (atomic_load_explicit(&h->magic, memory_order_acquire) != SHMP_MAGIC) return SHMP_E_MAGIC;
    if (LOAD_ONCE(h->layout_version) != SHMP_LAYOUT_VERSION) return SHMP_E_VERSION;
    /* Each field is read exactly once into a local; the locals are checked
     * and then copied, so a field rewritten while we look can at worst make
     * the check fail, never make us keep a value we did not check. The
     * reads are not one atomic snapshot: a header rewritten meanwhile may
     * give a mix of old and new fields, which is kept only if the mix, as a
     * whole, passes every check against this mapping's length (so it still
     * locates nothing outside the mapping). */
    const uint32_t flags = LOAD_ONCE(h->flags);
    const uint64_t header_size = LOAD_ONCE(h->header_size);
    const uint64_t slot_size = LOAD_ONCE(h->slot_size);
    const uint64_t claimed_total = LOAD_ONCE(h->total_size);
    const uint32_t nslots = LOAD_ONCE(h->nslots);
    const uint32_t nworkers = LOAD_ONCE(h->nworkers);
    const uint32_t quota = LOAD_ONCE(h->quota);
    const int32_t owner_pid = LOAD_ONCE(h->owner_pid);
    const uint64_t owner_start = LOAD_ONCE(h->owner_start);
    int rc = check_geometry(total_size, header_size, slot_size, claimed_total, nslots, nworkers,
                            quota, flags);
    if (rc != SHMP_OK) return rc;
    keep_geometry(ring, base, total_size, header_size, slot_size, nslots, nworkers, quota, flags, owner_pid,
                  owner_start);
    return SHMP_OK;
}

/* ---- producer side ---------------------------------------------------- */

/* One look for a FREE slot: SHMP_OK with *slot_out claimed (WRITING),
 * SHMP_AGAIN with *seq_out the space_seq read before the look (what a
 * sleeper compares), or SHMP_CLOSED / SHMP_CANCELLED / SHMP_E_STATE. */
static inline int acquire_look(const shmp_ring *r, shmp_header *h, uint32_t worker, uint32_t start,
                               uint32_t pass, uint32_t *slot_out, uint32_t *seq_out) {
    shmp_worker *w = &workers_of(r)[worker];
    const uint32_t n = r->nslots, quota = r->quota;
    shmp_slot *s = slots_of(r);
    /* After a fault nothing more is produced: the consumer delivers what
     * is already READY, then raises the error. */
    if (atomic_load_explicit(&h->closed, memory_order_acquire) ||
        atomic_load_explicit(&h->faults, memory_order_acquire))
        return SHMP_CLOSED;
    if (atomic_load_explicit(&h->pass_no, memory_order_acquire) != pass)
        return SHMP_CANCELLED;
    /* Read before looking, so a release after the look changes it. */
    *seq_out = atomic_load_explicit(&h->space_seq, memory_order_seq_cst);
    /* Only this worker's process raises inflight, so checking then
     * claiming cannot overshoot the quota. The check and the increment
     * below are two operations, not one atomic step: that is safe only
     * because no other process increments this word. inflight counts
     * distinct slots, so more than nslots means someone else wrote it. */
    if (quota != 0) {
        const uint32_t inflight = atomic_load_explicit(&w->inflight, memory_order_relaxed);
        if (inflight > n) return SHMP_E_STATE;
        if (inflight >= quota) return SHMP_AGAIN;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k = start + i;
        if (k >= n) k -= n;
        uint32_t expected = SHMP_FREE;
        if (atomic_load_explicit(&s[k].state, memory_order_relaxed) == SHMP_FREE &&
            atomic_compare_exchange_strong_explicit(&s[k].state, &expected, SHMP_WRITING_BY(worker),
                                                    memory_order_acquire, memory_order_relaxed)) {
            atomic_fetch_add_explicit(&w->inflight, 1, memory_order_relaxed);
            *slot_out = k;
            return SHMP_OK;
        }
    }
    return SHMP_AGAIN;
}

int shmp_acquire(const shmp_ring *r, uint32_t worker, uint32_t pass, int64_t wait_ns,
                 uint32_t *slot_out) {
    shmp_header *h = HDR(r);
    if (worker >= r->nworkers) return SHMP_E_ARG;
    shmp_worker *w = &workers_of(r)[worker];
    /* Workers start their search at different slots so they rarely compete
     * for the same CAS. */
    const uint32_t start = (uint32_t)(((uint64_t)worker * r->nslots) / r->nworkers);
    /* The wait (spinning, then sleeping) starts at the first miss; all of
     * it is added to the worker's blocked_ns, however the call ends. */
    int64_t wait_t0 = 0;
    int rc;
    for (int slept = 0;;) {
        uint32_t seq = 0;
        rc = acquire_look(r, h, worker, start, pass, slot_out, &seq);
        if (rc != SHMP_AGAIN || slept || wait_ns <= 0) break;
        if (wait_t0 == 0) wait_t0 = now_ns();
        /* Spinning repeats the whole look (checks, seq, scan), so the look
         * before the sleep below is still the one made after reading `seq`:
         * the sleep protocol is unchanged. */
        if (keep_spinning(wait_t0)) continue;
        atomic_fetch_add_explicit(&h->producers_waiting, 1, memory_order_seq_cst);
        const int frc = futex_wait(&h->space_seq, seq, wait_ns);
        atomic_fetch_sub_explicit(&h->producers_waiting, 1, memory_order_seq_cst);
        if (frc == SHMP_INTERRUPTED || frc < 0) {
            rc = frc;
            break;
        }
        slept = 1; /* woken or timed out: look once more, then return to the caller */
    }
    if (wait_t0 != 0)
        atomic_fetch_add_explicit(&w->blocked_ns, (uint64_t)(now_ns() - wait_t0), memory_order_relaxed);
    return rc;
}

int shmp_publish(const shmp_ring *r, uint32_t slot, uint32_t worker, uint32_t pass,
                 uint64_t wseq, uint64_t nbytes) {
    shmp_header *h = HDR(r);
    if (slot >= r->nslots || worker >= r->nworkers || nbytes > r->slot_size) return SHMP_E_ARG;
    shmp_slot *s = &slots_of(r)[slot];
    if (atomic_load_explicit(&s->state, memory_order_relaxed) != SHMP_WRITING_BY(worker)) return SHMP_E_ARG;
    s->worker = worker;
    s->pass = pass;
    s->wseq = wseq;
    s->nbytes = nbytes;
    s->ticket = atomic_fetch_add_explicit(&h->publish_ticket, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&workers_of(r)[worker].published, 1, memory_order_relaxed);
    /* Release: the payload and the fields above are visible to whoever
     * loads READY with acquire. */
    atomic_store_explicit(&s->state, SHMP_READY, memory_order_release);
    notify_consumer(h);
    return SHMP_OK;
}

int shmp_abandon(const shmp_ring *r, uint32_t slot, uint32_t worker) {
    if (slot >= r->nslots || worker >= r->nworkers) return SHMP_E_ARG;
    shmp_slot *s = &slots_of(r)[slot];
    uint32_t expected = SHMP_WRITING_BY(worker);
    if (!atomic_compare_exchange_strong_explicit(&s->state, &expected, SHMP_FREE,
                                                 memory_order_release, memory_order_relaxed))
        return SHMP_E_ARG;
    inflight_dec(&workers_of(r)[worker].inflight);
    notify_producers(HDR(r));
    return SHMP_OK;
}

int shmp_finish_pass(const shmp_ring *r, uint32_t worker, uint32_t pass, uint64_t produced) {
    if (worker >= r->nworkers) return SHMP_E_ARG;
    shmp_worker *w = &workers_of(r)[worker];
    atomic_store_explicit(&w->produced, produced, memory_order_relaxed);
    /* Release: every publish of the pass (and `produced`) is visible to a
     * consumer that loads done_pass with acquire. */
    atomic_store_explicit(&w->done_pass, pass + 1, memory_order_release);
    notify_consumer(HDR(r));
    return SHMP_OK;
}

/* ---- consumer side ---------------------------------------------------- */

/* READY -> FREE for a batch of a pass the consumer no longer reads. The
 * slot's worker is a shared word: read once, used only if it names one of
 * our workers. */
static void discard(const shmp_ring *r, shmp_slot *s) {
    const uint32_t worker = LOAD_ONCE(s->worker);
    atomic_store_explicit(&s->state, SHMP_FREE, memory_order_release);
    if (worker < r->nworkers) inflight_dec(&workers_of(r)[worker].inflight);
    notify_producers(HDR(r));
}

int shmp_take(const shmp_ring *r, int32_t worker, uint32_t pass, uint64_t wseq, int64_t wait_ns,
              uint32_t *slot_out, uint32_t *worker_out) {
    shmp_header *h = HDR(r);
    const uint32_t n = r->nslots, nw = r->nworkers, quota = r->quota;
    if (worker >= (int32_t)nw) return SHMP_E_ARG;
    shmp_worker *w = workers_of(r);
    shmp_slot *s = slots_of(r);
    int64_t wait_t0 = 0; /* the first miss, where spinning starts */

    for (int waited = 0;;) {
        const uint32_t seq = atomic_load_explicit(&h->ready_seq, memory_order_seq_cst);
        /* A fault is reported only once nothing READY is left to deliver. */
        const int fault = atomic_load_explicit(&h->faults, memory_order_acquire) != 0;
        /* Load the done marks before scanning: a mark seen here makes every
         * publish of that worker's pass visible to the scan below. */
        int done = 1;
        if (worker >= 0) {
            done = atomic_load_explicit(&w[worker].done_pass, memory_order_acquire) == pass + 1;
        } else {
            for (uint32_t i = 0; i < nw && done; i++)
                done = atomic_load_explicit(&w[i].done_pass, memory_order_acquire) == pass + 1;
        }
        /* The slot records' pass/worker/wseq/ticket are shared words, used
         * here only in comparisons (never as an index or a size). */
        int64_t best = -1;
        uint64_t best_ticket = UINT64_MAX;
        /* Whose batch `best` is: the value the match was made on, read
         * once. The slot's worker word is not read again (another process
         * may rewrite it between two reads). */
        uint32_t best_worker = (uint32_t)worker;
        for (uint32_t k = 0; k < n; k++) {
            if (atomic_load_explicit(&s[k].state, memory_order_acquire) != SHMP_READY) continue;
            if (LOAD_ONCE(s[k].pass) != pass) {
                discard(r, &s[k]);
                continue;
            }
            if (worker >= 0) {
                if (LOAD_ONCE(s[k].worker) == (uint32_t)worker && LOAD_ONCE(s[k].wseq) == wseq) {
                    best = k;
                    break;
                }
            } else {
                const uint64_t ticket = LOAD_ONCE(s[k].ticket);
                /* best < 0: the first READY slot is a candidate whatever its
                 * ticket (a shared word: one rewritten to UINT64_MAX must not
                 * make its batch untakeable). */
                if (best < 0 || ticket < best_ticket) {
                    best = k;
                    best_ticket = ticket;
                }
            }
        }
        if (best >= 0 && worker < 0) {
            /* Each worker's batches in the order it published them. The
             * scan reads the slots one after another, so a batch published
             * after its slot was read can be seen without the one its
             * worker published just before it (in a slot read earlier). A
             * worker publishes its batches one at a time, and `best` was
             * loaded READY with acquire: every earlier batch of its worker
             * is visible now, READY or already taken. So the earliest READY
             * one of that worker is taken instead. (The tickets, being
             * shared words, cannot reorder a worker's batches either.) */
            const uint32_t bw = LOAD_ONCE(s[best].worker);
            uint64_t bq = LOAD_ONCE(s[best].wseq);
            best_worker = bw;
            for (uint32_t k = 0; k < n; k++) {
                if (atomic_load_explicit(&s[k].state, memory_order_acquire) != SHMP_READY) continue;
                if (LOAD_ONCE(s[k].pass) != pass || LOAD_ONCE(s[k].worker) != bw) continue;
                const uint64_t q = LOAD_ONCE(s[k].wseq);
                if (q < bq) {
                    best = k;
                    bq = q;
                }
            }
        }
        if (best >= 0) {
            shmp_slot *b = &s[best];
            /* Only the consumer leaves READY. Release (a plain store on
             * x86 and arm64 alike, as relaxed): a producer that reads HELD
             * of another batch in shmp_slot_holds learns that its own batch
             * once in this slot was released, and must see the reads made
             * before that release (the chain: the consumer's release CAS,
             * the next claimer's acquire CAS and release publish, the
             * acquire load READY here, this store). */
            atomic_store_explicit(&b->state, SHMP_HELD, memory_order_release);
            /* best_worker indexes the worker table only if it is one of
             * ours (the caller reports a bad one). */
            if (best_worker < nw && inflight_dec(&w[best_worker].inflight) == quota && quota != 0)
                notify_producers(h); /* that worker may be waiting on its quota */
            *slot_out = (uint32_t)best;
            *worker_out = best_worker;
            return SHMP_OK;
        }
        if (fault) return SHMP_FAULT;
        if (done) return SHMP_END;
        if (waited || wait_ns <= 0) return SHMP_AGAIN;
        /* Spinning repeats the whole look (seq, fault, done marks, scan), so
         * the look before the sleep is still the one made after reading
         * `seq`: the sleep protocol is unchanged. */
        if (wait_t0 == 0) wait_t0 = now_ns();
        if (keep_spinning(wait_t0)) continue;
        atomic_store_explicit(&h->consumer_waiting, 1, memory_order_seq_cst);
        int rc = futex_wait(&h->ready_seq, seq, wait_ns);
        atomic_store_explicit(&h->consumer_waiting, 0, memory_order_relaxed);
        if (rc == SHMP_INTERRUPTED || rc < 0) return rc;
        waited = 1; /* woken or timed out: look once more, then return to the caller */
    }
}

int shmp_release(const shmp_ring *r, uint32_t slot) {
    if (slot >= r->nslots) return SHMP_E_ARG;
    uint32_t expected = SHMP_HELD;
    /* Release: our reads of the payload happen before the next producer's
     * writes (it claims the slot with an acquire CAS). */
    if (!atomic_compare_exchange_strong_explicit(&slots_of(r)[slot].state, &expected, SHMP_FREE,
                                                 memory_order_release, memory_order_relaxed))
        return SHMP_E_ARG;
    notify_producers(HDR(r));
    return SHMP_OK;
}

int shmp_reclaim(const shmp_ring *r, uint32_t worker) {
    if (worker >= r->nworkers) return SHMP_E_ARG;
    shmp_slot *s = slots_of(r);
    int reclaimed = 0;
    uint32_t ready = 0;
    for (uint32_t k = 0; k < r->nslots; k++) {
        uint32_t expected = SHMP_WRITING_BY(worker);
        /* Release: whatever the consumer did with the slot before is done
         * before a producer claims it (acquire CAS). The dead producer's
         * half-written payload is simply overwritten by the next owner. */
        if (atomic_compare_exchange_strong_explicit(&s[k].state, &expected, SHMP_FREE,
                                                    memory_order_release, memory_order_relaxed)) {
            reclaimed++;
        } else if (expected == SHMP_READY && LOAD_ONCE(s[k].worker) == worker) {
            ready++;
        }
    }
    /* Recounted, not decremented: the producer may have died between its
     * claim and its increment of inflight (two steps), so the word may be
     * one low or one high. The slots it has READY are exactly what the
     * consumer's takes will still decrement it for. Only the consumer's
     * thread changes this word now (the producer is gone, none replaces it
     * yet, and takes run on this thread). */
    atomic_store_explicit(&workers_of(r)[worker].inflight, ready, memory_order_relaxed);
    if (reclaimed) notify_producers(HDR(r));
    return reclaimed;
}

int shmp_worker_done(const shmp_ring *r, uint32_t worker, uint32_t pass) {
    if (worker >= r->nworkers) return 0;
    return atomic_load_explicit(&workers_of(r)[worker].done_pass, memory_order_acquire) == pass + 1;
}

uint32_t shmp_begin_pass(const shmp_ring *r) {
    shmp_header *h = HDR(r);
    uint32_t pass = atomic_fetch_add_explicit(&h->pass_no, 1, memory_order_acq_rel) + 1;
    notify_producers(h);
    return pass;
}

uint32_t shmp_current_pass(const shmp_ring *r) {
    return atomic_load_explicit(&HDR(r)->pass_no, memory_order_acquire);
}

void shmp_close(const shmp_ring *r) {
    shmp_header *h = HDR(r);
    atomic_store_explicit(&h->closed, 1, memory_order_release);
    atomic_fetch_add_explicit(&h->space_seq, 1, memory_order_seq_cst);
    futex_wake_all(&h->space_seq);
    atomic_fetch_add_explicit(&h->ready_seq, 1, memory_order_seq_cst);
    futex_wake_all(&h->ready_seq);
}

int shmp_is_closed(const shmp_ring *r) {
    return (int)atomic_load_explicit(&HDR(r)->closed, memory_order_acquire);
}

void shmp_report_fault(const shmp_ring *r) {
    shmp_header *h = HDR(r);
    atomic_fetch_add_explicit(&h->faults, 1, memory_order_release);
    notify_consumer(h);
}

/* ---- observation ------------------------------------------------------ */

uint32_t shmp_slot_state(const shmp_ring *r, uint32_t slot) {
    if (slot >= r->nslots) return 0;
    return atomic_load_explicit(&slots_of(r)[slot].state, memory_order_relaxed);
}
int shmp_slot_holds(const shmp_ring *r, uint32_t slot, uint32_t worker, uint32_t pass, uint64_t wseq) {
    if (slot >= r->nslots) return 0;
    const shmp_slot *s = &slots_of(r)[slot];
    /* Acquire: when the answer is "no", the batch was released (HELD ->
     * FREE, release) or discarded (READY -> FREE, release) before whatever
     * state is read here, and every read the consumer made of the batch's
     * memory happens before the caller's next write of it. */
    const uint32_t state = atomic_load_explicit(&s->state, memory_order_acquire);
    if (state != SHMP_READY && state != SHMP_HELD) return 0;
    /* Fields another claimer may be rewriting (it then owns the slot: the
     * batch asked about is gone, and any mismatch says so). */
    return LOAD_ONCE(s->worker) == worker && LOAD_ONCE(s->pass) == pass && LOAD_ONCE(s->wseq) == wseq;
}
uint32_t shmp_slot_worker(const shmp_ring *r, uint32_t slot) {
    return slot < r->nslots ? LOAD_ONCE(slots_of(r)[slot].worker) : UINT32_MAX;
}
uint32_t shmp_slot_pass(const shmp_ring *r, uint32_t slot) {
    return slot < r->nslots ? LOAD_ONCE(slots_of(r)[slot].pass) : 0;
}
uint64_t shmp_slot_wseq(const shmp_ring *r, uint32_t slot) {
    return slot < r->nslots ? LOAD_ONCE(slots_of(r)[slot].wseq) : 0;
}
uint64_t shmp_slot_nbytes(const shmp_ring *r, uint32_t slot) {
    return slot < r->nslots ? LOAD_ONCE(slots_of(r)[slot].nbytes) : 0;
}
uint64_t shmp_worker_blocked_ns(const shmp_ring *r, uint32_t worker) {
    if (worker >= r->nworkers) return 0;
    return atomic_load_explicit(&workers_of(r)[worker].blocked_ns, memory_order_relaxed);
}
uint32_t shmp_worker_inflight(const shmp_ring *r, uint32_t worker) {
    if (worker >= r->nworkers) return 0;
    return atomic_load_explicit(&workers_of(r)[worker].inflight, memory_order_relaxed);
}
uint64_t shmp_worker_published(const shmp_ring *r, uint32_t worker) {
    if (worker >= r->nworkers) return 0;
    return atomic_load_explicit(&workers_of(r)[worker].published, memory_order_relaxed);
}
