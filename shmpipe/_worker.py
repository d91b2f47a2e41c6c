"""The producer process: runs one source per pass and puts its batches into
the pipeline's channel. Also get_worker_info() and reserve(), which user code
calls from inside a source.

Control protocol (small pickled tuples on one duplex pipe per worker):

    consumer -> producer   ("attach", handle)       the channel exists now
                           ("pass", pass_no, seed)  run the source (again)
                           ("stop",)                exit
    producer -> consumer   ("need_ring", nbytes)    a first batch is ready (and
                                                    the channel is sized from it)
                           ("error", type, message, traceback, shmpipe error or None)

Batches and the end of a pass travel through the transport's channel.
"""

from __future__ import annotations

import os
import random
import select
import signal
import sys
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmpipe import _ring, _segments
from shmpipe._spec import ArraySpec
from shmpipe.errors import ShmpipeError
from shmpipe.transport import Cancelled, Closed, ProducerControl, ProducerEnd, Transport

__all__ = ["WorkerInfo", "get_worker_info", "reserve", "producer_main"]


@dataclass(frozen=True)
class WorkerInfo:
    """Who this producer is, as seen from inside a source.

    ``id`` is 0..num_workers-1; ``seed`` is this worker's seed for this pass,
    derived from the pipeline's base seed, the pass (``epoch``) and the id,
    so runs with the same base seed see the same seeds. NumPy's and
    ``random``'s global generators are seeded from it before the source is
    called.
    """

    id: int
    num_workers: int
    seed: int
    epoch: int


_info: WorkerInfo | None = None
_producer: Any = None  # the _Producer of this process, if it is one


def get_worker_info() -> WorkerInfo | None:
    """This producer's WorkerInfo; None outside a shmpipe producer."""
    return _info


def reserve(template: Any) -> Any:
    """Writable arrays for the next batch, inside a free slot.

    ``template`` has the nesting of a batch; each leaf is an ArraySpec or an
    array (which stands for its shape and dtype; its values are not
    copied) or a scalar (kept as it is). The arrays returned are
    uninitialised, like ``numpy.empty``. Fill them, then yield the structure
    reserve() returned: the batch is published without a copy. Yielding
    anything else copies the arrays out and gives the slot back.

    Blocks while every slot is busy. Outside a producer, or with a transport
    that has no slots, it returns ordinary new arrays, and yielding them
    sends them as any batch.
    """
    if _producer is None:
        return _plain_arrays(template)
    return _producer.reserve(template)


def _plain_arrays(template: Any) -> Any:
    t = type(template)
    if t is dict:
        return {k: _plain_arrays(v) for k, v in template.items()}
    if t is tuple or t is list:
        return t(_plain_arrays(v) for v in template)
    if t is ArraySpec:
        return np.empty(template.shape, template.dtype)
    if isinstance(template, np.ndarray):
        return np.empty(template.shape, template.dtype)
    return template


def seed_for(base_seed: int, pass_no: int, worker: int) -> int:
    """A 63-bit seed for one worker in one pass, reproducible from base_seed."""
    state = np.random.SeedSequence(base_seed, spawn_key=(pass_no, worker)).generate_state(
        2, np.uint32
    )
    return (int(state[0]) << 31) ^ int(state[1])


class _Producer(ProducerControl):
    """Runs a source per pass and feeds its batches to the transport's
    ProducerEnd; is the ProducerControl that end checks while it blocks."""

    def __init__(self, worker: int, num_workers: int, conn, transport: Transport, handle: Any) -> None:
        self.worker = worker
        self.num_workers = num_workers
        self.conn = conn
        self.transport = transport
        # Transports that do not notice a new pass themselves get a look at
        # the control pipe between batches.
        self.check_between = not transport.capabilities.cancels_passes
        self.pending: deque = deque()  # commands read while doing something else
        self.pass_no = 0
        self.end: ProducerEnd | None = None
        if handle is not None:
            self._attach(handle)

    # -- control channel ------------------------------------------------------

    def _recv(self):
        if self.pending:
            return self.pending.popleft()
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise Closed("the consumer is gone") from None

    def _attach(self, handle: Any) -> None:
        self.end = self.transport.attach(handle, self.worker, self)
        name = getattr(handle, "name", None)  # a shared-memory segment to remove if orphaned
        if isinstance(name, str):
            _Watchdog.segment_name = name

    def check(self) -> None:
        """ProducerControl: raises if the consumer moved on."""
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if msg[0] == "stop":
                    raise Closed("the pipeline is closing")
                self.pending.append(msg)
                if msg[0] == "pass":
                    raise Cancelled(f"pass {msg[1]} started")
        except (EOFError, OSError):
            raise Closed("the consumer is gone") from None

    def _wait_for_channel(self, nbytes: int) -> ProducerEnd:
        """Asks the consumer for a channel sized for a first batch of nbytes."""
        self.conn.send(("need_ring", nbytes))
        while self.end is None:
            msg = self._recv()
            if msg[0] == "attach":
                self._attach(msg[1])
            elif msg[0] == "stop":
                raise Closed("the pipeline is closing")
            else:  # a new pass: this one is cancelled; handle it after
                self.pending.append(msg)
                raise Cancelled(f"pass {msg[1]} started")
        self.end.start_pass(self.pass_no)
        return self.end

    # -- what sources call ----------------------------------------------------

    def put(self, batch: Any) -> None:
        end = self.end if self.end is not None else self._wait_for_channel(self.transport.batch_nbytes(batch))
        end.put(batch)

    def reserve(self, template: Any) -> Any:
        end = self.end
        if end is None:
            end = self._wait_for_channel(self.transport.batch_nbytes(_plain_arrays(template)))
        return end.reserve(template)

    # -- the loop -------------------------------------------------------------

    def run(self, source) -> None:
        global _info
        while True:
            msg = self._recv()
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "attach":
                if self.end is None:
                    self._attach(msg[1])
                continue
            _, self.pass_no, seed = msg
            _info = WorkerInfo(self.worker, self.num_workers, seed, self.pass_no)
            _seed_generators(seed)
            if self.end is not None:
                self.end.start_pass(self.pass_no)
            try:
                self._run_pass(source)
            except Cancelled:
                continue

    def _run_pass(self, source) -> None:
        iterator = iter(source())
        try:
            for batch in iterator:
                if self.check_between:
                    self.check()
                self.put(batch)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # runs the generator's finally blocks when we stop early
        # an empty pass before any channel exists still needs one to say so
        end = self.end if self.end is not None else self._wait_for_channel(_ring.PAGE_SIZE)
        end.end_pass()

    def report(self, exc: BaseException) -> None:
        """Sends the error to the consumer, then waits to be stopped."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
        # shmpipe's own errors (a bad batch, a batch too large) travel as
        # themselves, so the consumer can raise the same type.
        own = exc if isinstance(exc, ShmpipeError) else None
        try:
            self.conn.send(("error", exc_type, str(exc), tb, own))
        except Exception:
            try:
                self.conn.send(("error", exc_type, str(exc), tb, None))
            except (OSError, ValueError):
                return
        try:
            while self._recv()[0] != "stop":
                pass
        except Closed:
            pass


def _seed_generators(seed: int) -> None:
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


class _Watchdog:
    """Ends this producer when the consumer process is gone (even while user
    code blocks), removing the segment first so nothing stays in /dev/shm."""

    segment_name: str | None = None

    @classmethod
    def start(cls, owner_pid: int, owner_start: int) -> None:
        t = threading.Thread(
            target=cls._watch, args=(owner_pid, owner_start), name="shmpipe-watchdog", daemon=True
        )
        t.start()

    @classmethod
    def _watch(cls, owner_pid: int, owner_start: int) -> None:
        try:
            fd = os.pidfd_open(owner_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None and _segments.process_start_time(owner_pid) == owner_start:
            select.select([fd], [], [])  # readable once the owner has exited
        else:
            while _segments.owner_alive(owner_pid, owner_start):
                threading.Event().wait(0.25)
        if cls.segment_name is not None:
            try:
                _ring.unlink_segment(cls.segment_name)
            except OSError:
                pass
        os._exit(0)


def producer_main(
    worker: int,
    num_workers: int,
    source,
    conn,
    owner_pid: int,
    owner_start: int,
    transport: Transport,
    handle: Any,
) -> None:
    """Entry point of a producer process."""
    global _producer
    # Ctrl-C reaches the whole process group; the consumer decides what
    # happens (it stops us), so producers ignore it and print nothing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _Watchdog.start(owner_pid, owner_start)
    producer = _Producer.__new__(_Producer)
    producer.conn, producer.end, producer.pending = conn, None, deque()
    try:
        producer.__init__(worker, num_workers, conn, transport, handle)
        _producer = producer
        producer.run(source)
    except Closed:
        pass
    except Exception as exc:  # the source (or attaching) failed: tell the consumer
        producer.report(exc)
    finally:
        _producer = None
        if producer.end is not None:
            producer.end.close()
        conn.close()
