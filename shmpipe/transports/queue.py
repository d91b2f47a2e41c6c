"""The "queue" transport: multiprocessing.Queue, the article's recipe.

Every batch is pickled into a pipe by a feeder thread in the producer and
unpickled in the consumer: copies and the CPU of both sides, at a size that
grows with the batch. shmpipe pickles each batch itself with protocol 5
before queueing it, because multiprocessing pickles with protocol 4, and
NumPy 2.4 turns a big-endian array pickled that way into a native one (the
same values, other bytes): with protocol 5 every batch arrives bit-exact,
at the price of one more copy of the pickle on each side. It is here as the reference: it needs nothing
beyond the standard library, runs anywhere, and is what shmpipe's
benchmarks compare against.

Unordered pipelines share one queue of ``capacity`` batches; ordered ones
give each worker its own queue of ``spec.quota``, so one worker cannot fill
the room while the consumer waits for another.
"""

from __future__ import annotations

import pickle
import queue as queue_mod
import time
from dataclasses import dataclass
from typing import Any

from shmpipe import _tree
from shmpipe.transport import (
    AGAIN,
    END,
    Capabilities,
    ChannelSpec,
    ConsumerEnd,
    ProducerControl,
    ProducerEnd,
    Transport,
)

__all__ = ["QueueTransport"]

#: How long a blocked put() waits before it looks at the control pipe again.
CHECK_S = 0.1


@dataclass
class QueueHandle:
    queues: list  # one (unordered) or one per worker (ordered)
    blocked: Any  # RawArray('d'): seconds each worker spent waiting for room


class QueueTransport(Transport):
    """Batches pickled through multiprocessing.Queue."""

    name = "queue"
    capabilities = Capabilities(serializes="pickle (through a pipe)")

    def open(self, spec: ChannelSpec) -> QueueConsumer:
        return QueueConsumer(spec)

    def attach(self, handle: QueueHandle, worker: int, control: ProducerControl) -> QueueProducer:
        return QueueProducer(handle, worker, control)


class QueueProducer(ProducerEnd):
    def __init__(self, handle: QueueHandle, worker: int, control: ProducerControl) -> None:
        self.queue = handle.queues[worker if len(handle.queues) > 1 else 0]
        self.blocked = handle.blocked
        self.worker = worker
        self.control = control
        self.pass_no = 0

    def start_pass(self, pass_no: int) -> None:
        self.pass_no = pass_no

    def _put(self, payload: Any) -> None:
        item = (self.pass_no, self.worker, pickle.dumps(payload, protocol=5))
        try:
            self.queue.put(item, block=False)
            return
        except queue_mod.Full:
            pass
        t0 = time.perf_counter()
        try:
            while True:
                self.control.check()  # a new pass or a shutdown ends the wait
                try:
                    self.queue.put(item, timeout=CHECK_S)
                    return
                except queue_mod.Full:
                    continue
        finally:
            self.blocked[self.worker] += time.perf_counter() - t0

    def put(self, batch: Any) -> None:
        self._put(batch)

    def end_pass(self) -> None:
        self._put(END)

    def close(self) -> None:
        # Do not wait at exit for the feeder thread to flush into a pipe that
        # nobody may read any more.
        self.queue.cancel_join_thread()


class QueueConsumer(ConsumerEnd):
    def __init__(self, spec: ChannelSpec) -> None:
        ctx = spec.mp_context
        n = spec.num_workers
        if spec.ordered:
            queues = [ctx.Queue(spec.quota) for _ in range(n)]
        else:
            queues = [ctx.Queue(spec.capacity)]
        self.handle = QueueHandle(queues, ctx.RawArray("d", n))
        self.num_workers = n
        self.ended: set[int] = set()  # workers whose current pass is over (unordered)
        self.pass_no = spec.first_pass

    def begin_pass(self, pass_no: int) -> None:
        if pass_no != self.pass_no:
            self.pass_no = pass_no
            self.ended = set()

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        q = self.handle.queues[worker if worker >= 0 and len(self.handle.queues) > 1 else 0]
        deadline = time.monotonic() + wait
        while True:
            try:
                p, w, payload = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue_mod.Empty:
                return AGAIN
            if p != pass_no:
                continue  # a batch of a pass no one reads any more
            payload = pickle.loads(payload)
            if payload is END:
                if worker >= 0:
                    return END
                self.ended.add(w)
                if len(self.ended) == self.num_workers:
                    return END
                continue
            self.last_worker = w
            self.last_nbytes = _tree.nbytes(payload)
            return payload

    def producer_blocked_s(self, worker: int) -> float:
        return self.handle.blocked[worker]

    def describe_wait(self) -> str:
        try:
            queued = sum(q.qsize() for q in self.handle.queues)
        except NotImplementedError:  # macOS
            return ""
        return f"{queued} batches are queued for other workers" if queued else "the queue is empty"

    def close(self) -> None:
        pass  # producers blocked in put() see "stop" through their control pipe

    def destroy(self) -> None:
        for q in self.handle.queues:
            q.close()
            q.cancel_join_thread()
