"""An example transport: one pipe per producer, credits for backpressure.

Read shmpipe/transport.py's docstring first: it is the contract this
implements. About a hundred lines: open() makes the pipes, attach() picks a
producer's end, put() waits for a credit, get() waits on the pipes.

What the brevity costs: get() reads a message with ``recv_bytes``, which
blocks until the whole message is there, so a producer killed half way
through writing one leaves the consumer waiting for the rest, past any
``timeout=``. shmpipe's own "queue" transport (shmpipe/transports/queue.py)
shows the robust way: frames read from non-blocking descriptors, whole
frames only handed on, and ``get`` always back within its ``wait``.
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import time
from dataclasses import dataclass
from typing import Any

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

__all__ = ["PipeTransport"]

CHECK_S = 0.1  # how long a waiting put() sleeps before it asks control.check()


@dataclass
class PipeHandle:
    conns: list  # the producers' ends, one per worker
    credits: int  # batches a producer may have sent but not yet taken


class PipeTransport(Transport):
    name = "example-pipe"
    capabilities = Capabilities(serializes="pickle (protocol 5) through a pipe per producer")

    def open(self, spec: ChannelSpec) -> PipeConsumer:
        return PipeConsumer(spec)

    def attach(self, handle: PipeHandle, worker: int, control: ProducerControl) -> PipeProducer:
        return PipeProducer(handle.conns[worker], handle.credits, control)


class PipeProducer(ProducerEnd):
    def __init__(self, conn, credits: int, control: ProducerControl) -> None:
        self.conn, self.credits, self.control = conn, credits, control
        self.pass_no = 0

    def start_pass(self, pass_no: int, first_wseq: int = 0) -> None:
        self.pass_no = pass_no  # first_wseq is always 0: this transport does not restart producers

    def _send(self, kind: str, payload: Any) -> None:
        while self.credits == 0:  # backpressure: wait for the consumer to take one
            self.control.check()  # raises if a new pass started or we are closing
            if self.conn.poll(CHECK_S):
                self.conn.recv_bytes()
                self.credits += 1
        while self.conn.poll():  # collect credits that came back meanwhile
            self.conn.recv_bytes()
            self.credits += 1
        # Protocol 5 explicitly: Connection.send() would use protocol 4, which
        # NumPy 2.4 answers with native byte order for big-endian arrays.
        self.conn.send_bytes(pickle.dumps((self.pass_no, kind, payload), protocol=5))
        self.credits -= 1

    def put(self, batch: Any) -> None:
        self._send("batch", batch)

    def end_pass(self) -> None:
        self._send("end", None)


class PipeConsumer(ConsumerEnd):
    def __init__(self, spec: ChannelSpec) -> None:
        pairs = [spec.mp_context.Pipe(duplex=True) for _ in range(spec.num_workers)]
        self.conns = [ours for ours, _ in pairs]
        credits = spec.quota if spec.ordered else max(1, spec.capacity // spec.num_workers)
        self.handle = PipeHandle([theirs for _, theirs in pairs], credits)
        self.ended: set[int] = set()
        self.pass_no = spec.first_pass
        self.next_first = 0  # rotate which pipe is read first, for fairness

    def begin_pass(self, pass_no: int) -> None:
        if pass_no != self.pass_no:
            self.pass_no, self.ended = pass_no, set()

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        deadline = time.monotonic() + wait
        while True:
            if worker >= 0:
                candidates = [worker]
            else:
                candidates = [w for w in range(len(self.conns)) if w not in self.ended]
                if not candidates:
                    return END
            conns = [self.conns[w] for w in candidates]
            ready = multiprocessing.connection.wait(conns, max(0.0, deadline - time.monotonic()))
            if not ready:
                return AGAIN
            ready.sort(key=lambda c: (self.conns.index(c) - self.next_first) % len(self.conns))
            conn = ready[0]
            w = self.conns.index(conn)
            self.next_first = (w + 1) % len(self.conns)
            p, kind, payload = pickle.loads(conn.recv_bytes())
            conn.send_bytes(b"")  # a credit back to the producer
            if p != pass_no:
                continue  # a batch of a pass no one reads any more
            if kind == "end":
                if worker >= 0:
                    return END
                self.ended.add(w)
                continue
            self.last_worker, self.last_nbytes = w, 0
            return payload

    def close(self) -> None:
        pass  # producers waiting for credits see "stop" through control.check()

    def destroy(self) -> None:
        for conn in self.conns + self.handle.conns:
            conn.close()
