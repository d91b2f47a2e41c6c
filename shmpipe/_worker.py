"""The producer process: runs one source per pass and puts its batches into
the pipeline's channel (through the transport's ProducerEnd).

Control protocol (one duplex pipe per worker; framing and checks in
_control.py):

    consumer -> producer: pickled tuples (from the consumer, which is trusted)
        ("attach", handle)        the channel exists now (the handle's
                                  descriptors ride along)
        ("pass", work)            run the source (again) for work, a
                                  _producer_context.PassWork
        ("stop",)                 exit
    producer -> consumer: JSON arrays, every field checked for its type and
    bounds (the consumer unpickles nothing a producer sends)
        ["need_channel", nbytes]  a first batch is ready (and the channel is
                                  sized from it)
        ["state", pass, wseq, s]  a source whose iterator has state_dict():
                                  its state after batch wseq, sent before
                                  that batch is published
        ["done", pass, produced]  its part of the pass is over (sent before
                                  the channel says so: the consumer checks
                                  the channel against it)
        ["error", type, message, traceback, own]
                                  the source failed; own: null, or [class,
                                  [arguments]] of shmpipe's own error
                                  (BatchTypeError, ...), rebuilt in the
                                  consumer from a closed table of classes

A producer's error texts are clipped to fit a message (_control.error), so
a real error always arrives whole.

Batches and the end of a pass travel through the transport's channel.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any

from shmpipe import _batch, _control, _producer_context, _startup
from shmpipe._process import ProcessWatch, process_ending
from shmpipe._spec import new_arrays
from shmpipe.errors import ShmpipeTypeError, ShmpipeValueError
from shmpipe.transport import Cancelled, Closed, ProducerControl, ProducerEnd, Transport

__all__ = ["producer_main"]


class ConsumerGone(Closed):
    """The producer's control pipe closed under it: the consumer died, or is
    closing without a word (a close sends "stop" first)."""

    def __init__(self) -> None:
        super().__init__("the consumer is gone")


class _Producer(ProducerControl):
    """Runs a source per pass and feeds its batches to the transport's
    ProducerEnd; is the ProducerControl that end checks while it blocks."""

    def __init__(self, worker: int, num_workers: int, conn: Connection, transport: Transport) -> None:
        self.worker = worker
        self.num_workers = num_workers
        self.conn = conn
        self.transport = transport
        # Transports that do not notice a new pass themselves get a look at
        # the control pipe between batches.
        self.check_between = not transport.capabilities.cancels_passes
        # The batch contract holds on every transport: those that do not
        # refuse a bad batch themselves (shm's encoder does, as it plans)
        # get only batches checked here, before anything of them is sent.
        self.check_batches = not transport.capabilities.checks_batches
        self.pending: deque[tuple[Any, ...]] = deque()  # commands read while doing something else
        self.pass_no = 0
        self.first_wseq = 0  # the number of this pass's first batch (nonzero in a replacement)
        self.handle: Any = None
        self.end: ProducerEnd | None = None

    # -- control channel ------------------------------------------------------

    def _recv(self) -> tuple[Any, ...]:
        if self.pending:
            return self.pending.popleft()
        try:
            msg: tuple[Any, ...] = _control.recv(self.conn)
        except (EOFError, OSError):
            raise ConsumerGone() from None
        return msg

    def attach(self, handle: Any) -> None:
        """Joins the channel `handle` names."""
        self.end = self.transport.attach(handle, self.worker, self)
        self.handle = handle

    def orphaned(self) -> None:
        """The consumer died (called by the watchdog just before exiting)."""
        if self.handle is not None:
            self.transport.orphaned(self.handle)

    def check(self) -> None:
        """ProducerControl: raises if the consumer moved on."""
        try:
            while self.conn.poll():
                msg = _control.recv(self.conn)
                if msg[0] == "stop":
                    raise Closed("the pipeline is closing")
                self.pending.append(msg)
                if msg[0] == "pass":
                    raise Cancelled(f"pass {msg[1].pass_no} started")
        except (EOFError, OSError):
            raise ConsumerGone() from None

    def _wait_for_channel(self, nbytes: int) -> ProducerEnd:
        """Asks the consumer for a channel sized for a first batch of nbytes."""
        try:
            _control.tell(self.conn, _control.need_channel(nbytes))
        except OSError:
            raise ConsumerGone() from None
        while self.end is None:
            msg = self._recv()
            if msg[0] == "attach":
                self.attach(msg[1])
            elif msg[0] == "stop":
                raise Closed("the pipeline is closing")
            else:  # a new pass: this one is cancelled; handle it after
                self.pending.append(msg)
                raise Cancelled(f"pass {msg[1].pass_no} started")
        self._start_pass(self.end)
        return self.end

    def _start_pass(self, end: ProducerEnd) -> None:
        if self.first_wseq:  # a replacement (only on a transport that restarts_producers)
            end.start_pass(self.pass_no, self.first_wseq)
        else:
            end.start_pass(self.pass_no)

    # -- what sources call ----------------------------------------------------

    def put(self, batch: Any) -> None:
        if self.check_batches:
            _batch.check(batch)
        end = self.end if self.end is not None else self._wait_for_channel(self.transport.batch_nbytes(batch))
        end.put(batch)

    def reserve(self, template: Any) -> Any:
        end = self.end
        if end is None:
            end = self._wait_for_channel(self.transport.batch_nbytes(new_arrays(template)))
        return end.reserve(template)

    # -- the loop -------------------------------------------------------------

    def run(self, source: Callable[[], Iterable[Any]]) -> None:
        while True:
            msg = self._recv()
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "attach":
                if self.end is None:
                    self.attach(msg[1])
                continue
            work: _producer_context.PassWork = msg[1]
            self.pass_no = work.pass_no
            self.first_wseq = work.first_wseq
            _producer_context.enter_pass(self.worker, self.num_workers, work)
            if self.end is not None:
                self._start_pass(self.end)
            try:
                self._run_pass(source)
            except Cancelled:
                continue

    def _run_pass(self, source: Callable[[], Iterable[Any]]) -> None:
        iterator = iter(source())
        # An iterator with its own state_dict() (torchdata's, say) is resumed
        # from its state, not by count: the consumer keeps the state of each
        # batch (sent before the batch is published, so it is there as soon
        # as the batch is) and hands back the last delivered one's.
        state_of = _state_dict_of(iterator)
        wseq = self.first_wseq
        try:
            for batch in iterator:
                if self.check_between:
                    self.check()
                if state_of is not None:
                    self._tell_state(wseq, state_of())
                self.put(batch)
                wseq += 1
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # runs the generator's finally blocks when we stop early
        # an empty pass before any channel exists still needs one to say so
        end = self.end if self.end is not None else self._wait_for_channel(0)
        try:
            _control.tell(self.conn, _control.pass_done(self.pass_no, wseq))
        except OSError:
            raise ConsumerGone() from None
        end.end_pass()

    def _tell_state(self, wseq: int, state: Any) -> None:
        try:
            message = _control.iterator_state(self.pass_no, wseq, state)
            size = len(_control.encode(message))
        except (TypeError, ValueError) as exc:
            raise ShmpipeTypeError(
                f"the source's iterator's state_dict() is not JSON ({exc}); shmpipe keeps it in the pipeline's "
                "own state_dict(), which must be JSON"
            ) from None
        if size > _control.MAX_MESSAGE:
            raise ShmpipeValueError(
                f"the source's iterator's state_dict() is {size:,} bytes as JSON; at most {_control.MAX_MESSAGE:,} "
                "travel with each batch (keep the position, not the data)"
            )
        try:
            _control.tell(self.conn, message)
        except OSError:
            raise ConsumerGone() from None

    def report(self, exc: BaseException) -> None:
        """Sends the error to the consumer, then waits to be stopped."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        # shmpipe's own errors (a bad batch, a batch too large) travel with
        # their arguments, so the consumer can raise the same type.
        try:
            _control.tell(self.conn, _control.error(exc, tb))
        except (OSError, ValueError):
            return
        try:
            while self._recv()[0] != "stop":
                pass
        except Closed:
            pass


def _state_dict_of(iterator: Any) -> Callable[[], Any] | None:
    """The iterator's own state_dict, where it has both halves of the
    protocol (state_dict and load_state_dict); else None."""
    state_dict = getattr(iterator, "state_dict", None)
    if callable(state_dict) and callable(getattr(iterator, "load_state_dict", None)):
        return state_dict
    return None


class _Watchdog:
    """Ends this producer when the consumer process is gone (even while user
    code blocks), after `on_orphan` has removed what the consumer would have
    (so nothing stays in /dev/shm)."""

    def __init__(self, owner_pid: int, owner_start: int, on_orphan: Callable[[], None]) -> None:
        self.owner_pid = owner_pid
        self.owner_start = owner_start
        self.on_orphan = on_orphan

    def start(self) -> None:
        threading.Thread(target=self._watch, name="shmpipe-watchdog", daemon=True).start()

    def _watch(self) -> None:
        # By pidfd where there is one (a pipe's end would not do: the
        # consumer's children may hold it), else by its start time in turn.
        # Returns at once if the owner (pid, start) is gone already. Never
        # closed: this process ends right after.
        ProcessWatch(self.owner_pid, self.owner_start).wait()
        try:
            self.on_orphan()
        except Exception:
            pass  # exiting matters more than cleaning up
        os._exit(0)


def producer_main(
    worker: int,
    num_workers: int,
    source: Callable[[], Iterable[Any]],
    conn: Connection,
    owner_pid: int,
    owner_start: int,
    transport: Transport,
    handle: Any,
) -> None:
    """Entry point of a producer process."""
    # Whatever this process holds now it inherited (fork: the trainer's
    # heap, torch's too; forkserver: the server's preloaded modules) or made
    # to boot (spawn), and keeps to its end. Frozen, CPython's cyclic
    # collector never walks it here: a full collection would write to every
    # inherited object's header, copying each page the fork shares, and the
    # first one was often owed already (a process that just imported torch
    # is a few thousand allocations from one; measured with start method
    # fork: 0.2 s to the first batch, 0.13 s with this). Only cyclic garbage
    # already made is never collected. (gc.freeze is O(1) on CPython's
    # default build: it splices lists; a free-threaded build walks them.)
    gc.freeze()
    # Ctrl-C reaches the whole process group; the consumer decides what
    # happens (it stops us), so producers ignore it and print nothing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # We were born with SIGINT blocked (_launch._ctrl_c_deferred); ignoring
    # it above discarded a press still pending, and what this process starts
    # should not inherit the block.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    producer = _Producer(worker, num_workers, conn, transport)
    _Watchdog(owner_pid, owner_start, producer.orphaned).start()
    try:
        if handle is not None:  # the channel was opened before this process started
            producer.attach(handle)
        _producer_context.set_reserver(producer)
        # A source shipped without the script (_startup) is loaded here, so
        # that what it imports, or fails to, is reported as its error.
        producer.run(_startup.unpack(source))
    except ConsumerGone:
        # Where the consumer died, it cannot remove what it owned (a named
        # segment): the watchdog does that as the consumer's pidfd says it
        # ended, but a dying process closes its descriptors first, so this
        # thread, reading the end of the pipe, would end the process before
        # the watchdog woke (a group's producers wait here between passes;
        # seen by helper 41: 9 of 10 segments left). Dying, not only dead, is
        # enough: it removes nothing any more.
        if process_ending(owner_pid, owner_start):
            producer.orphaned()
    except Closed:
        pass
    except Exception as exc:  # the source (or attaching) failed: tell the consumer
        producer.report(exc)
    finally:
        _producer_context.set_reserver(None)
        if producer.end is not None:
            producer.end.close()
        conn.close()
