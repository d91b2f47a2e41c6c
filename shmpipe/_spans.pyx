# cython: language_level=3
"""Spans of an object's work that its teardown must not run inside, and
the teardown owed to the end of the span that a signal handler interrupted.

Python runs a signal handler in the main thread between two bytecodes, so
a handler that closes a pipeline can run while that very thread is in a
span that holds one of the pipeline's locks and is adding to it. Torn down
there, the teardown waits for that thread's own lock (a plain Lock: for
ever), or takes apart what the span goes on to use and then records (a
producer it is starting, a channel it is opening), which outlives the
close. So in a span, ``defer(teardown)`` owes the teardown to this
thread's outermost span, run as that ends, returning or raising (a handler
that raises SystemExit unwinds through it): a close() from a handler
returns at once and is done a moment later, what the span made torn down
with the rest. Other threads are not spans of this one: a teardown in
another thread waits for the lock, as before.

Only the main thread counts its spans: signal handlers run there and
nowhere else, so a span of another thread is never interrupted by one (and
a close() from another thread is not put off: it waits for the lock).

Why compiled: the depth must be raised and lowered where no signal can cut
in. Python raises a handler's exception (a KeyboardInterrupt) where it
checks for signals: as a Python function's code begins, after each call of
a builtin, at backward jumps. Written in Python, a span's ``__exit__`` (or
the ``leave()`` of a ``finally``) can be cut as it begins, before it lowers
the depth, and a span's start (a generator's context manager: its
``__enter__`` calls next() and checks after) can be cut after it raised the
depth and took the lock, outside the ``with`` that would undo both; the
depth then stays raised and every later close() is put off for good (the
producers run until the process exits). Here ``__enter__`` and
``__exit__`` are C: each runs whole (holding the GIL), and a check after
it finds the span not begun, begun inside the ``with`` (whose ``__exit__``
ends it) or ended. A with statement calls ``__enter__`` and enters the
block with no check between, so ``with spans, lock:`` counts the depth from
before the lock is asked for (a handler may run while this thread waits
for it), and no bytecode of the span has the lock held and the depth not.

What this rests on, and where it does not hold: the bytecode of a ``with``
statement in CPython 3.10 to 3.13 (3.10's SETUP_WITH, 3.11's to 3.13's
BEFORE_WITH call ``__enter__`` and begin the protected range in the same
instruction); a version that calls ``__enter__`` with a CALL of its own
and protects the block only after it would open the window again at that
CALL's check (tests/test_interrupts.py puts an interrupt at each check and
fails there). A trace or profile function written in Python (pdb, the
``profile`` module) runs code at events between the block and ``__exit__``,
where an interrupt can land: under a debugger this is not guaranteed.

Not atomic: the owed teardown is Python code, called as the outermost span
ends; an interrupt that lands as it begins leaves it not done (the
interrupted program's own close(), outside any span, does it).

call_holding is the teardown's side of the same rule: a lock it takes with
a timeout (no ``with`` can) and the ``try`` that releases it, with no check
between.
"""

cimport cython

import os
import threading

from cpython.pythread cimport PyThread_get_thread_ident


# The thread signal handlers run in: the main thread (threading's: the
# thread that imported it first, the main one but where a program started
# threads with _thread before), and in a forked child the thread that
# forked (the child's only thread, which CPython makes the main thread
# there). A child starts with no spans: one its parent was in goes on in
# the parent, not here (_forks tells an object that it was forked).
cdef unsigned long _main_thread = threading.main_thread().ident
cdef unsigned long _forks = 0


def _after_fork_in_child():
    global _main_thread, _forks
    _main_thread = PyThread_get_thread_ident()
    _forks += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


@cython.auto_pickle(False)  # (a copy would carry a depth that no span of the copy's owes)
cdef class TeardownAfterSpans:
    """Spans of one object's work, each a ``with`` block of this object:
    how deep the main thread is in them, and the teardown owed to the
    outermost one's end. Another thread's spans are not counted: no signal
    handler interrupts them."""

    cdef long _depth  # the main thread's
    cdef object _owed  # a callable, or None
    cdef unsigned long _forks_seen  # _forks when _depth was last right

    cdef inline bint _in_main_thread(self):
        if self._forks_seen != _forks:  # forked: what the parent was in is not this process's
            self._forks_seen = _forks
            self._depth = 0
            self._owed = None
        return PyThread_get_thread_ident() == _main_thread

    def __enter__(self):
        if self._in_main_thread():
            self._depth += 1

    def __exit__(self, exc_type, exc, tb):
        if not self._in_main_thread() or self._depth <= 0:  # (a span begun before a fork: not counted here)
            return
        self._depth -= 1
        if self._depth == 0 and self._owed is not None:
            owed, self._owed = self._owed, None
            owed()

    def inside(self):
        """Whether the main thread is in a span and this is it (in a signal
        handler: whether it interrupted one)."""
        return self._in_main_thread() and self._depth > 0

    def defer(self, teardown):
        """Whether this is the main thread in a span (a handler interrupted
        it): then `teardown` is owed to the span's end. False: tear down
        now."""
        if not self.inside():
            return False
        self._owed = teardown
        return True


def call_holding(lock, double timeout, fn):
    """``fn(took)``, with `lock` held where it could be taken within
    `timeout` seconds (`took` says whether it was: a teardown must not wait
    for ever on a lock another thread keeps, and decides what to do
    without it), released whatever ends ``fn``. Compiled for the same
    reason as the spans: written in Python, a signal handler's exception
    raised as ``acquire()`` returned (Python checks after each call of a
    builtin) came before the ``try`` that releases it, and the lock stayed
    held, every other thread waiting on it for good. Here no Python code
    runs between the acquire and the try: a handler runs inside
    ``acquire()`` (which then raises without the lock) or inside ``fn``.
    This rests on `lock` being one of the threading module's C locks
    (Lock, RLock): a lock whose acquire() is Python code has the check
    inside it, after the lock is taken."""
    took = lock.acquire(True, timeout)
    try:
        return fn(took)
    finally:
        if took:
            lock.release()
