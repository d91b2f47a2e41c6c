"""An example transport: one socket pair per producer, credits for backpressure.

Read shmpipe/transport.py's docstring first: it is the contract this
implements. open() makes the sockets, attach() picks a producer's end,
put() waits for a credit and writes a frame, get() reads frames.

What every transport must get right, and how this one does it:

- *A producer can die at any moment, half way through writing a batch.*
  get() never blocks on a read: the consumer's sockets are non-blocking,
  get() reads whatever bytes have arrived into a buffer per producer and
  hands on whole frames only (the body's length, 8 bytes, then the body).
  A frame cut short by a death stays in its buffer, get() returns AGAIN
  within its ``wait``, and shmpipe, which watches the processes, raises
  ``WorkerDiedError``. (``Connection.recv_bytes`` would wait for the rest of
  the message for ever, past any ``timeout=``.)
- *What arrives is untrusted input*: a process of the user that may trace
  a producer or the consumer can take a copy of its socket (``pidfd_getfd``,
  a debugger) and write into it. A frame is a pickle
  (protocol 5: short code, for an example), loaded by an unpickler that
  makes NumPy arrays, dtypes and scalars and nothing else that names code
  (a pickle names the code its loading runs); any other frame is a
  ``CorruptChannelError``. shmpipe's own transports decode their own
  encoding instead, checking every length.
- *close() from another thread* while get() waits: shmpipe runs ``destroy``
  only once the get() in progress has returned, so no socket is closed
  under a read.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing.connection
import pickle
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmpipe.errors import CorruptChannelError
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

CHECK_S = 0.1  # how long a put() waiting for a credit sleeps before it asks control.check()
FRAME = struct.Struct("!Q")  # a frame: its body's length, then the body
MAX_FRAME = 1 << 40  # a longer frame is someone else's writing, not a batch
READ_BYTES = 1 << 20  # what one recv() takes at most


@dataclass
class PipeHandle:
    socks: list  # the producers' ends, one per worker
    credits: int  # batches a producer may have sent but not yet taken


class PipeTransport(Transport):
    name = "example-pipe"
    capabilities = Capabilities(serializes="pickle (protocol 5, NumPy only) through a socket per producer")

    def open(self, spec: ChannelSpec) -> PipeConsumer:
        return PipeConsumer(spec)

    def attach(self, handle: PipeHandle, worker: int, control: ProducerControl) -> PipeProducer:
        return PipeProducer(handle.socks[worker], handle.credits, control)


class PipeProducer(ProducerEnd):
    def __init__(self, sock: socket.socket, credits: int, control: ProducerControl) -> None:
        self.sock, self.credits, self.control = sock, credits, control
        self.pass_no = 0

    def start_pass(self, pass_no: int, first_wseq: int = 0) -> None:
        self.pass_no = pass_no  # first_wseq is always 0: this transport does not restart producers

    def _collect_credits(self, wait: float) -> None:
        if multiprocessing.connection.wait([self.sock], wait):
            with contextlib.suppress(BlockingIOError):
                self.credits += len(self.sock.recv(4096, socket.MSG_DONTWAIT))  # a byte a credit

    def _send(self, kind: str, payload: Any) -> None:
        self._collect_credits(0)
        while self.credits == 0:  # backpressure: wait for the consumer to take one
            self.control.check()  # raises if a new pass started or we are closing
            self._collect_credits(CHECK_S)
        # Protocol 5 explicitly: protocol 4 gives big-endian arrays back in
        # native byte order (NumPy 2.4).
        body = pickle.dumps((self.pass_no, kind, payload), protocol=5)
        self.sock.sendall(FRAME.pack(len(body)))
        self.sock.sendall(body)  # blocks while the consumer does not read (at close: EPIPE, or shmpipe's SIGTERM)
        self.credits -= 1

    def put(self, batch: Any) -> None:
        self._send("batch", batch)

    def end_pass(self) -> None:
        self._send("end", None)


class _BatchUnpickler(pickle.Unpickler):
    """Makes NumPy arrays, dtypes and scalars, and nothing else that names code."""

    ALLOWED = {
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        # An extension dtype's scalar type (ml_dtypes.bfloat16), from a
        # module this process imported itself: nothing is imported by name.
        found = getattr(sys.modules.get(module), name, None)
        if isinstance(found, type) and issubclass(found, np.generic):
            return found
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no batch is made of")


def _decode(body: bytes) -> tuple[int, str, Any]:
    try:
        pass_no, kind, payload = _BatchUnpickler(io.BytesIO(body)).load()
        if type(pass_no) is not int or kind not in ("batch", "end"):
            raise ValueError("not a (pass, kind, batch) message")
    except Exception as exc:  # noqa: BLE001 - whatever the bytes were, it is not a batch
        raise CorruptChannelError(f"a frame that is not a batch ({type(exc).__name__}: {exc})") from None
    return pass_no, kind, payload


class PipeConsumer(ConsumerEnd):
    def __init__(self, spec: ChannelSpec) -> None:
        pairs = [socket.socketpair() for _ in range(spec.num_workers)]
        self.socks = [ours for ours, _ in pairs]
        for sock in self.socks:
            sock.setblocking(False)
        credits = spec.quota if spec.ordered else max(1, spec.capacity // spec.num_workers)
        self.handle = PipeHandle([theirs for _, theirs in pairs], credits)
        self.buffers = [bytearray() for _ in self.socks]  # bytes of frames not yet whole
        self.closed_by_peer: set[int] = set()  # workers whose socket said EOF
        self.owed = [0] * len(self.socks)  # credits taken, not sent back yet (a full socket: at the next get)
        self.ended: set[int] = set()
        self.pass_no = spec.first_pass
        self.next_first = 0  # rotate which producer is read first, for fairness

    def handle_delivered(self) -> None:
        # Every producer has its end: ours go, so no process that may trace
        # this one can take them from here, and a producer's death is an EOF.
        for sock in self.handle.socks:
            sock.close()

    def begin_pass(self, pass_no: int) -> None:
        if pass_no != self.pass_no:
            self.pass_no, self.ended = pass_no, set()

    def _give_credits(self, w: int) -> None:
        """Worker `w`'s credits back, as many as its socket takes now."""
        if self.owed[w]:
            try:
                self.owed[w] -= self.socks[w].send(b"c" * self.owed[w])
            except BlockingIOError:
                pass  # it reads them later; the next get sends the rest
            except OSError:
                self.owed[w] = 0  # the producer is gone: nobody to tell

    def _read(self, w: int) -> None:
        """What has arrived from worker `w`, into its buffer, without blocking."""
        while True:
            try:
                data = self.socks[w].recv(READ_BYTES)
            except BlockingIOError:
                return
            except ConnectionResetError:  # it died with our credits unread
                data = b""
            if not data:
                self.closed_by_peer.add(w)  # (a frame it cut short stays unfinished: shmpipe sees the death)
                return
            self.buffers[w] += data

    def _frame(self, w: int) -> bytes | None:
        """Worker `w`'s next whole frame's body, taken off its buffer, or None."""
        buf = self.buffers[w]
        if len(buf) < FRAME.size:
            return None
        (n,) = FRAME.unpack_from(buf)
        if n > MAX_FRAME:
            raise CorruptChannelError(f"worker {w} sent a frame of {n} bytes")
        if len(buf) < FRAME.size + n:
            return None
        body = bytes(buf[FRAME.size : FRAME.size + n])
        del buf[: FRAME.size + n]
        return body

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        deadline = time.monotonic() + wait
        n = len(self.socks)
        while True:
            if worker >= 0:
                candidates = [worker]
            else:
                candidates = [w for w in range(n) if w not in self.ended]
                if not candidates:
                    return END
            candidates.sort(key=lambda w: (w - self.next_first) % n)
            for w in candidates:
                self._give_credits(w)
                self._read(w)
                body = self._frame(w)
                if body is None:
                    continue
                self.next_first = (w + 1) % n
                self.owed[w] += 1  # a credit back
                self._give_credits(w)
                p, kind, payload = _decode(body)
                if p != pass_no:
                    break  # a batch of a pass no one reads any more: look again
                if kind == "end":
                    if worker >= 0:
                        return END
                    self.ended.add(w)
                    break
                self.last_worker, self.last_nbytes = w, len(body)
                return payload
            else:  # nothing whole: wait for bytes, within `wait`
                left = deadline - time.monotonic()
                live = [self.socks[w] for w in candidates if w not in self.closed_by_peer]
                if left <= 0:
                    return AGAIN
                if not live:
                    time.sleep(left)  # only dead producers to wait for: shmpipe sees the death
                    return AGAIN
                if not multiprocessing.connection.wait(live, left):
                    return AGAIN

    def close(self) -> None:
        pass  # producers waiting for credits see "stop" through control.check()

    def destroy(self) -> None:
        # (Idempotent.) A producer blocked writing gets EPIPE, where no
        # other process holds our ends: with start_method="fork", its
        # siblings inherited them, and shmpipe's SIGTERM ends it instead.
        for sock in self.socks + self.handle.socks:
            sock.close()
