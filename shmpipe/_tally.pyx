# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The one compiled step of counting: a batch the consumer's fast path
delivered, added to a Counters tally (shmpipe/_counters.py) in one call.

_counters.py owns the tally's layout and hands every index to ReadyCounter
when it makes one; this module knows no index of its own and imports
nothing of the package. (Counting the same batch in Python costs about
0.4 us, a third of the fast path's whole cost per batch.)
"""

from libc.stdint cimport int64_t, uint64_t


cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil


cdef class ReadyCounter:
    """Adds one ready batch to `tally` (an int64 buffer, held for this
    object's life so it cannot be resized under it): +1 batch, +nbytes,
    +1 for its worker, its wait in the histogram (the bucket arithmetic of
    _counters.bucket, in integers), the wait's count, total and max."""

    cdef int64_t[::1] tally
    cdef Py_ssize_t batches, nbytes, workers, nworkers, hist, sub, wait_count, wait_total, wait_max

    def __cinit__(self, int64_t[::1] tally, Py_ssize_t batches, Py_ssize_t nbytes, Py_ssize_t workers,
                  Py_ssize_t nworkers, Py_ssize_t hist, Py_ssize_t buckets, Py_ssize_t sub,
                  Py_ssize_t wait_count, Py_ssize_t wait_total, Py_ssize_t wait_max):
        cdef Py_ssize_t n = tally.shape[0]
        for i in (batches, nbytes, wait_count, wait_total, wait_max):
            if not 0 <= i < n:
                raise ValueError(f"index {i} is outside a tally of {n}")
        if nworkers < 1 or workers < 0 or workers + nworkers > n or hist < 0 or hist + buckets > n:
            raise ValueError(f"the workers' counts or the histogram do not fit a tally of {n}")
        if sub < 1 or buckets < 65 * sub:
            raise ValueError("the histogram needs a row of `sub` buckets per bit length of a 64-bit duration")
        self.tally = tally
        self.batches, self.nbytes, self.workers, self.nworkers = batches, nbytes, workers, nworkers
        self.hist, self.sub = hist, sub
        self.wait_count, self.wait_total, self.wait_max = wait_count, wait_total, wait_max

    def count(self, int64_t wait_ns, int64_t nbytes, Py_ssize_t worker):
        cdef int64_t *t = &self.tally[0]
        cdef uint64_t v
        cdef int e
        if not 0 <= worker < self.nworkers:
            raise ValueError(f"worker {worker} is not one of {self.nworkers}")
        if wait_ns < 1:
            wait_ns = 1
        v = <uint64_t>wait_ns
        if v > (<uint64_t>1 << 57):  # longer than 4.5 years: the last row used
            v = <uint64_t>1 << 57
        e = 64 - __builtin_clzll(v)
        t[self.batches] += 1
        t[self.nbytes] += nbytes
        t[self.workers + worker] += 1
        t[self.hist + e * self.sub + <Py_ssize_t>((v * 2 * <uint64_t>self.sub) >> e) - self.sub] += 1
        t[self.wait_count] += 1
        t[self.wait_total] += wait_ns
        if wait_ns > t[self.wait_max]:
            t[self.wait_max] = wait_ns
