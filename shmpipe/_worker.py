"""The producer process: runs one source per pass and puts its batches into
the pipeline's channel. Also get_worker_info() and reserve(), which user code
calls from inside a source.

Control protocol (small pickled tuples on one duplex pipe per worker):

    consumer -> producer   ("attach", ShmHandle)   the ring exists now
                           ("pass", pass_no, seed)  run the source (again)
                           ("stop",)                exit
    producer -> consumer   ("need_ring", nbytes)    a first batch is ready
                           ("error", type, message, traceback, shmpipe error or None)

End of pass, batches and faults travel through the ring itself.
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
from shmpipe._shm import ShmHandle, attach_producer
from shmpipe.errors import ShmpipeError

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
_producer: "_Producer | None" = None


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


class _Stop(Exception):
    """The consumer asked this producer to exit, or is gone."""


class _Producer:
    def __init__(self, worker: int, num_workers: int, conn, handle: ShmHandle | None) -> None:
        self.worker = worker
        self.num_workers = num_workers
        self.conn = conn
        self.pending: deque = deque()  # commands read while waiting for something else
        self.writer: _ring.RingWriter | None = None
        if handle is not None:
            self._attach(handle)

    # -- control channel ------------------------------------------------------

    def _recv(self):
        if self.pending:
            return self.pending.popleft()
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise _Stop() from None

    def _attach(self, handle: ShmHandle) -> None:
        self.writer = attach_producer(handle, self.worker)
        _Watchdog.segment_name = handle.name

    def _wait_for_ring(self, nbytes: int) -> None:
        """Asks the consumer for a ring sized for a first batch of nbytes."""
        self.conn.send(("need_ring", nbytes))
        while self.writer is None:
            msg = self._recv()
            if msg[0] == "attach":
                self._attach(msg[1])
            elif msg[0] == "stop":
                raise _Stop()
            else:  # a new pass: this one is cancelled; handle it after
                self.pending.append(msg)
                raise _ring.PassCancelled()

    # -- what sources call ----------------------------------------------------

    def put(self, batch: Any) -> None:
        if self.writer is None:
            from shmpipe._codec import encoded_size

            self._wait_for_ring(encoded_size(batch))
            self.writer.start_pass(self.pass_no)
        self.writer.put(batch)

    def reserve(self, template: Any) -> Any:
        if self.writer is None:
            self._wait_for_ring(_template_size(template))
            self.writer.start_pass(self.pass_no)
        return self.writer.reserve(template)

    # -- the loop -------------------------------------------------------------

    def run(self, source) -> None:
        global _info
        while True:
            msg = self._recv()
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "attach":
                self._attach(msg[1])
                continue
            _, self.pass_no, seed = msg
            _info = WorkerInfo(self.worker, self.num_workers, seed, self.pass_no)
            _seed_generators(seed)
            if self.writer is not None:
                self.writer.start_pass(self.pass_no)
            try:
                self._run_pass(source)
            except _ring.PassCancelled:
                continue
            except (_ring.RingClosed, _Stop):
                return

    def _run_pass(self, source) -> None:
        iterable = source()
        iterator = iter(iterable)
        try:
            for batch in iterator:
                self.put(batch)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # runs the generator's finally blocks when we stop early
        if self.writer is None:  # an empty pass before any ring exists
            self._wait_for_ring(_ring.PAGE_SIZE)
            self.writer.start_pass(self.pass_no)
        self.writer.finish_pass()

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
        if self.writer is not None:
            self.writer.ring.report_fault()
        try:
            while self._recv()[0] != "stop":
                pass
        except _Stop:
            pass


def _template_size(template: Any) -> int:
    from shmpipe._codec import encoded_size

    return encoded_size(_plain_arrays(template))


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
    handle: ShmHandle | None,
) -> None:
    """Entry point of a producer process."""
    global _producer
    # Ctrl-C reaches the whole process group; the consumer decides what
    # happens (it stops us), so producers ignore it and print nothing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _Watchdog.start(owner_pid, owner_start)
    producer = None
    try:
        producer = _Producer(worker, num_workers, conn, handle)
        _producer = producer
        producer.run(source)
    except _Stop:
        pass
    except Exception as exc:  # the source (or attaching) failed: tell the consumer
        if producer is None:
            producer = _Producer.__new__(_Producer)
            producer.conn, producer.writer, producer.pending = conn, None, deque()
        producer.report(exc)
    finally:
        _producer = None
        conn.close()
