"""Ctrl-C held back over spans that must not be cut in the middle,
producers born with SIGINT blocked, and writes to a pipe whose reader is
gone that raise instead of delivering SIGPIPE.

Python raises KeyboardInterrupt between bytecodes of the main thread, so a
span that receives or starts something and then records it where clean-up
finds it can be cut between the two, and the thing leaks. (Any other
signal's handler runs there too: a close() from one, put off to the end of
the span it interrupted, is _spans'.)
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from shmpipe.errors import PipelineClosedError

__all__ = [
    "WaitEndedByCtrlC", "born_with_ctrl_c_blocked", "ctrl_c_held_back", "ctrl_c_pending", "no_sigpipe",
    "resource_tracker_running",
]

#: Each ctrl_c_held_back open in the main thread, outermost first: the
#: presses it noted, the handler it put aside, and its own (ctrl_c_pending
#: reads them).
_HELD: list[tuple[list[int], Any, Any]] = []


class WaitEndedByCtrlC(PipelineClosedError):
    """A wait inside a ctrl_c_held_back span that gave up for the press the
    span holds back (ctrl_c_pending). The span's end raises that press, a
    KeyboardInterrupt that stands for this error too: it is printed alone,
    without this one as its context (one traceback for one press)."""


@contextlib.contextmanager
def ctrl_c_held_back() -> Iterator[None]:
    """Holds a Ctrl-C back for the span of the block, and raises it after.

    For spans that must not be cut in the middle, where a KeyboardInterrupt
    (raised by Python between any two bytecodes) would leave something that
    nobody owns:
    - the making of a pipeline: a started process that nothing has recorded
      yet (so nothing stops it); and code called there can swallow a
      KeyboardInterrupt outright (the Cython init of numpy.random, imported
      lazily for the first seeds, did: about 4 presses in 100 were lost);
    - a descriptor just received (a batch larger than a slot) and not yet
      stored where close() finds it, or taken and not yet inside the
      try/finally that closes it.
    So for the span a handler only notes a press, and at the end the old
    handler is put back and a noted press raised again, so it acts as it
    would have: a KeyboardInterrupt by default, out of this block, where the
    caller's clean-up sees it. It costs two signal.signal calls (about a
    microsecond): fine where a batch costs a fresh mapping, not on the ring's
    hot path.

    Handlers can only be set from the main thread; elsewhere this does
    nothing (a Ctrl-C goes to the main thread anyway). A handler set from C
    (getsignal gives None) could not be put back, so it is left alone too.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    pressed: list[int] = []

    def note(signum: int, frame: Any) -> None:
        pressed.append(signum)

    held = (pressed, signal.getsignal(signal.SIGINT), note)
    ended_by_the_press = False
    try:
        # Inside the try: another signal's handler that raises at the check
        # after either call would otherwise leave `note` in place for good
        # (every later Ctrl-C only noted).
        _HELD.append(held)
        signal.signal(signal.SIGINT, note)
        yield
    except WaitEndedByCtrlC:
        ended_by_the_press = True
        raise
    finally:
        # The handler first: another signal's exception in what follows
        # must not leave `note` in place.
        # Code run in the block may have set a handler of its own: then it
        # stays, and decides what the noted press does.
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, held[1])
        for i, entry in enumerate(_HELD):
            if entry is held:  # (remove() compares the tuples' items)
                del _HELD[i]
                break
        if pressed:
            try:
                signal.raise_signal(signal.SIGINT)
            except BaseException as interrupt:
                # Raised here, the press has the block's error as its
                # context; where that error is only the press ending a wait,
                # the two would be one traceback about the same Ctrl-C twice.
                if ended_by_the_press:
                    interrupt.__suppress_context__ = True
                raise


def ctrl_c_pending() -> bool:
    """In the main thread: whether a Ctrl-C waits that will be a
    KeyboardInterrupt, held back by ctrl_c_held_back or blocked: a span that
    holds it back, or blocks SIGINT, and then waits may end early for it (the
    press is raised after). Not where SIGINT is ignored, or handled by the
    program's own handler (it decides what a press does, after the span, as
    before); nor outside the main thread, which takes every press."""
    if threading.current_thread() is not threading.main_thread():
        return False
    # Where a press ends up: each span's note hands it to the handler that
    # span put aside, until one that is not a span's (code run in a span
    # may have set its own, which then keeps the press).
    handler = signal.getsignal(signal.SIGINT)
    for _, put_aside, note in reversed(_HELD):
        if handler is not note:
            break
        handler = put_aside
    if handler is not signal.default_int_handler:
        return False
    return any(pressed for pressed, _, _ in _HELD) or signal.SIGINT in signal.sigpending()


@contextlib.contextmanager
def born_with_ctrl_c_blocked(start_method: str, *, tracker: bool | None = None) -> Iterator[Callable[[], None]]:
    """Processes started in the block are born with SIGINT blocked.

    Ctrl-C reaches every process of the terminal's process group, and a
    producer that takes it while it boots prints a KeyboardInterrupt
    traceback. A child is forked (or forked and exec'd, for spawn and the
    forkserver) with the forking thread's signal mask, and exec keeps the
    mask, so a producer -- and a forkserver started now, and so its children
    later -- born with SIGINT blocked keeps a press pending until
    producer_main ignores SIGINT (which discards a pending one) and unblocks
    it. Meanwhile this thread holds presses pending too (or another thread
    takes them: NumPy's BLAS threads block nothing); at the end of the block
    the mask comes back and a pending press is handled as usual (under
    ctrl_c_held_back: noted, and raised at the end of that).

    multiprocessing's resource tracker unblocks SIGINT in this thread each
    time it starts itself. It is started first where the block's starts
    need it (`tracker`; by default a spawn's or a fork server's start of a
    producer), and the caller calls what this yields after each start,
    which blocks SIGINT again.

    shmpipe's own fork server is started only in such a block
    (_forkserver.launch_server).
    Left open: multiprocessing's forkserver, which starts a producer that
    imports the script (_startup's fallback), when other code started it
    earlier with SIGINT unblocked, forks producers that can take a press in
    the moment between their birth and producer_main.
    """
    if tracker if tracker is not None else start_method in ("spawn", "forkserver"):
        resource_tracker_running()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())  # (what to put back; changes nothing)

    def block_again() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    try:
        # Inside the try: a handler's exception at the check after the
        # call would otherwise leave SIGINT blocked in this thread.
        block_again()
        yield block_again
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


@contextlib.contextmanager
def no_sigpipe() -> Iterator[None]:
    """In the block, a write of this thread to a pipe whose reader is gone
    raises BrokenPipeError and delivers no SIGPIPE.

    Python ignores SIGPIPE from its start, but a program may restore the
    default action (``signal.signal(SIGPIPE, SIG_DFL)``, common in tools
    whose output is piped into ``head``), which kills the process at such a
    write: the trainer, for a peer of shmpipe's that died. Sockets say so
    per call (MSG_NOSIGNAL: _fdpass.send_fds, ProducerLink.send); a pipe,
    or a socket written by code that is not shmpipe's (multiprocessing's),
    cannot, so the block keeps SIGPIPE blocked in this thread (the kernel
    makes the signal of a write pending for the writing thread), and at its
    end takes a pending one away before the mask comes back. Nothing to do
    where SIGPIPE is ignored (a signal ignored is discarded), or blocked
    already (then a pending one is not this block's to take).

    Not for a block that starts a process: a child is born with the mask
    of the thread that forks it (see born_with_ctrl_c_blocked). A SIGPIPE
    sent by another process while the block runs, to this process, goes to
    another thread if one does not block it; to this one, it is taken away
    with the write's. The disposition is read from Python's table: one set
    from C behind Python's back is not seen."""
    if signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN:
        yield
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())  # (what to put back; changes nothing)
    if signal.SIGPIPE in old_mask:
        yield
        return
    try:
        # Inside the try: a handler's exception at the check after the
        # call would otherwise leave SIGPIPE blocked in this thread.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        yield
    finally:
        try:
            signal.sigtimedwait({signal.SIGPIPE}, 0)  # a write's, if one failed; returns at once either way
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def resource_tracker_running() -> None:
    """multiprocessing's resource tracker, started where it is not running.

    Its ensure_running() asks a tracker it started whether it still runs by
    writing to the tracker's pipe: a tracker killed meanwhile would be a
    SIGPIPE (no_sigpipe). So it is asked inside no_sigpipe, against that
    function's rule: a tracker it then starts again is born with SIGPIPE
    blocked, which for a Python process that ignores SIGPIPE, reads its pipe
    and starts nothing, changes nothing."""
    from multiprocessing import resource_tracker  # (here: `import shmpipe` starts nothing of multiprocessing)

    with no_sigpipe():
        resource_tracker.ensure_running()
