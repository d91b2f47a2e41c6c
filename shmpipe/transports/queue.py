"""The "queue" transport: batches through a pipe per producer, the baseline.

Every batch is encoded by its producer, written into a pipe, read and
decoded by the consumer: copies and the CPU of both sides, at a size that
grows with the batch. It is here as the reference: it needs nothing beyond
the standard library and NumPy, runs anywhere, and is what shmpipe's
benchmarks compare against (the plain multiprocessing recipe of a pipe per
producer).

What travels is shmpipe's own encoding of a batch (``shmpipe._codec``, the
payload the ring carries: the structure, then the arrays' raw bytes, every
array 64-byte aligned), not a pickle. Bytes from another process are
untrusted input, and a pipe's bytes can come from more processes than its
producer: any process of the same user can open ``/proc/<pid>/fd/<n>`` of a
process that holds a write end and write a frame of its own. Unpickling
that frame would run whatever code it names, in the trainer. The decoder
chooses no code to run: it checks every length and offset against the
frame and makes only the values of the batch contract (NumPy arrays of
dtypes from a closed table, and plain scalars, strings and containers), so
the worst a forged frame can do is a batch of wrong data, or a
CorruptChannelError.

Why not keep pickle and let nothing else reach the pipes? That cannot be
done: a producer's write end stays reachable through the producer's own
``/proc/<pid>/fd``, and a producer is another process too, whose code must
not run in the trainer either. So no channel carries pickles. The consumer
still closes its copies of the pipes' write ends once the producers have
theirs (``handle_delivered``): a process that reads the trainer's
``/proc/<pid>/fd`` finds nothing there to write into. (Frames of pickles
were what this transport sent before; the encoding is bit-exact for
big-endian arrays as protocol 5 was, and ``shmpipe bench throughput``
measured it faster at every size, 1.2x at 64 KiB to 2.5x at 48 MB.)

It is built from plain pipes rather than ``multiprocessing.Queue``, whose
consumer can hang for good on a producer killed while it writes: once a
message has begun, ``Queue.get(timeout=...)`` blocks until the rest of it
arrives, which never happens (tests/test_fault_suite.py reproduces it: a
producer SIGKILLed half way through putting a 4 MiB batch), and a producer
killed while it holds the queue's shared writer lock blocks every other
producer. Here:

* Each worker writes into a pipe of its own, so a dead writer can only
  leave half a message in its own pipe, and holds no lock anyone else needs.
* A message is a frame: a fixed header (magic, kind, pass number, length),
  then the batch's payload. The consumer reads every pipe without ever
  blocking (the descriptors are non-blocking, ``poll`` waits with the
  caller's deadline), keeps the part of a frame that has arrived, and hands
  over only whole frames. Half a frame from a producer that died is never
  delivered; the pipeline learns of the death from the process itself
  (``_launch``), as ``get`` returns AGAIN within its ``wait``. A frame whose
  header or payload is malformed is a CorruptChannelError, and so is every
  ``get`` after it: the rest of that pipe's stream is never read.
* Room is a pool of tokens, one byte each in a token pipe: a producer takes
  one (a one-byte read: atomic, however many producers read) before it
  writes a batch, and the consumer gives it back when ``get`` has returned
  that batch, or dropped it as a batch of an old pass. Unordered pipelines
  share one pool of ``capacity`` tokens; ordered ones give each worker its
  own pool of ``spec.quota``, so one worker cannot take every place while
  the consumer waits for another. The end of a pass takes no token (one a
  pass per worker, a header only). A token held by a producer that dies is
  lost with it; a death ends the pipeline anyway.
* Nothing is named: no semaphore, no file. Pipes go with the last process
  holding them, whichever dies, so nothing is left for the resource
  tracker to warn about.
"""

from __future__ import annotations

import collections
import math
import os
import select
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmpipe import _codec, _spans
from shmpipe._control import PassFd
from shmpipe.errors import CorruptChannelError
from shmpipe.transport import (
    AGAIN,
    END,
    Cancelled,
    Capabilities,
    ChannelSpec,
    Closed,
    ConsumerEnd,
    ProducerControl,
    ProducerEnd,
    Transport,
)

__all__ = ["QueueTransport"]

#: How long a blocked put() waits before it looks at the control pipe again.
CHECK_S = 0.1

#: A frame's header: magic, kind, pass number, length of the payload after it.
HEADER = struct.Struct("<4sBxxxqQ")
#: SPQ1 was a frame of a pickle; SPQ2 one of a codec payload.
MAGIC = b"SPQ2"
KIND_BATCH = 1
KIND_END = 2
#: A length beyond this in a header means the stream is broken, not a batch.
#: A producer encodes a batch into one buffer of its own memory before it
#: writes it, and the consumer holds it whole too: a real frame is at most
#: what one process of this machine can hold (a pipe does not leave it).
#: 1 TiB is beyond the memory of nearly every machine, and would take many
#: minutes through a pipe, while a batch of many GiB is legitimate.
#: It is no bound on memory (frames grow with the bytes that arrive: PIECE):
#: it turns a length no producer can have written into an error at once.
MAX_FRAME = 1 << 40
#: A frame's body is read into pieces, each made when the one before is
#: full: the first of FIRST_PIECE bytes, then each as large as all before
#: it together, up to PIECE. A header's length is another process's word:
#: the memory of a frame grows with the bytes that do arrive (at most twice
#: them, and at most PIECE beyond them), never ahead of them with what a
#: header claims; and a big frame still takes few allocations (24 for a
#: GiB). The first piece is 64-byte aligned: a frame of one piece is decoded
#: where it is (its arrays are views of it); a frame of more is copied into
#: one aligned buffer once it is whole, each piece let go as it is copied
#: (_Pieces): the one copy out of the pipe's bytes that unpickling made too.
FIRST_PIECE = 1 << 20
PIECE = 64 << 20
#: The most one _Inbound.read takes from its pipe before it returns: bytes,
#: and readv calls (a stream of small frames takes two a frame). Without a
#: bound, a writer as fast as the consumer keeps the pipe from ever being
#: empty, and get() reads on far past its deadline and a close(). A few
#: milliseconds of reading: the poll and the checks between two calls cost
#: a few microseconds.
READ_BYTES = 4 << 20
READ_CALLS = 256

_TOKEN = b"t"
#: What _take returns when no frame is there for the get(): not None, which
#: is a batch of its own (the batch contract allows a bare None).
_NOTHING = object()
#: How long destroy() waits for a get() in another thread to let go of the
#: descriptors before it leaves them open rather than close them under it.
DESTROY_WAIT_S = 5.0


def _new_pipe() -> tuple[int, int]:
    """A non-blocking pipe, (read end, write end), close-on-exec (children
    get their ends passed explicitly)."""
    return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)


def _wait_for(fd: int, events: int, timeout: float) -> bool:
    """Whether `fd` is ready for `events` within `timeout` seconds (poll,
    not select: descriptors above 1023 are fine)."""
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(math.ceil(timeout * 1000)))


@dataclass
class QueueHandle:
    """What producers attach with (it travels in their Process arguments)."""

    pipes: list[PassFd]  # each worker's data pipe, write end
    tokens: list[tuple[PassFd, PassFd]]  # token pools (read end, write end): one, or one per worker (ordered)
    blocked: Any  # RawArray('d'): seconds each worker spent waiting for room


class QueueTransport(Transport):
    """Batches through a pipe per producer, in shmpipe's encoding."""

    name = "queue"
    # The encoder refuses a batch outside the contract as it plans, with
    # check_batch's error, before a token is taken or a byte written; every
    # array of a decoded batch starts on a multiple of 64 of a buffer that
    # is itself aligned.
    capabilities = Capabilities(
        serializes="shmpipe's encoding (structure plus raw array bytes), through a pipe",
        checks_batches=True,
        alignment=64,
    )
    consumer_fds_per_producer = 1  # the read end of its pipe

    def open(self, spec: ChannelSpec) -> QueueConsumer:
        return QueueConsumer(spec)

    def attach(self, handle: QueueHandle, worker: int, control: ProducerControl) -> QueueProducer:
        return QueueProducer(handle, worker, control)


class QueueProducer(ProducerEnd):
    def __init__(self, handle: QueueHandle, worker: int, control: ProducerControl) -> None:
        self.pipe = handle.pipes[worker]
        token_r, token_w = handle.tokens[worker if len(handle.tokens) > 1 else 0]
        self.token_r, self.token_w = token_r, token_w
        self.blocked = handle.blocked
        self.worker = worker
        self.control = control
        self.pass_no = 0
        self.held = 0  # tokens taken and not used yet (a put cancelled before it wrote)

    def start_pass(self, pass_no: int, first_wseq: int = 0) -> None:
        self.pass_no = pass_no  # first_wseq is always 0: this transport does not restart producers

    def _put(self, payload: Any) -> None:
        if payload is END:
            self._write(HEADER.pack(MAGIC, KIND_END, self.pass_no, 0), None, token=False)
            return
        body = _codec.encode(payload)  # BatchTypeError for a batch outside the contract: nothing sent
        self._take_token()
        self._write(HEADER.pack(MAGIC, KIND_BATCH, self.pass_no, len(body)), body, token=True)

    def put(self, batch: Any) -> None:
        self._put(batch)

    def end_pass(self) -> None:
        self._give_back_held()  # room this producer will not use this pass is for the others
        self._put(END)

    # -- room ------------------------------------------------------------------

    def _try_token(self) -> bool:
        if self.held:
            self.held -= 1
            return True
        try:
            return os.read(self.token_r.fd, 1) == _TOKEN
        except BlockingIOError:  # none left (or another producer was quicker)
            return False

    def _take_token(self) -> None:
        """Takes a place for one batch, waiting (the backpressure) while
        there is none; a new pass or a shutdown ends the wait."""
        if self._try_token():
            return
        t0 = time.perf_counter()
        try:
            while True:
                self.control.check()
                if _wait_for(self.token_r.fd, select.POLLIN, CHECK_S) and self._try_token():
                    return
        finally:
            self.blocked[self.worker] += time.perf_counter() - t0

    def _give_back_held(self) -> None:
        while self.held:
            try:
                os.write(self.token_w.fd, _TOKEN)
            except BlockingIOError:
                return  # the pool is full up: there is room enough; keep it
            self.held -= 1

    # -- the pipe --------------------------------------------------------------

    def _write(self, header: bytes, body: np.ndarray | None, token: bool) -> None:
        """Writes one whole frame. A new pass while the pipe is full cancels
        the put only if nothing of the frame was written yet: the consumer
        can only skip whole frames, so one begun is finished (the consumer
        reads on, and drops it as a batch of an old pass)."""
        views = [memoryview(header)] if body is None else [memoryview(header), body.data]
        written = 0
        cancelled: Cancelled | None = None
        t0: float | None = None
        try:
            while views:
                n = self._writev(views)
                written += n
                _advance(views, n)
                if not views:
                    break
                if t0 is None:
                    t0 = time.perf_counter()
                if _wait_for(self.pipe.fd, select.POLLOUT, CHECK_S):
                    continue
                try:
                    self.control.check()
                except Cancelled as exc:
                    if written:
                        cancelled = exc  # the frame is finished first
                        continue
                    if token:
                        self.held += 1
                    raise
        finally:
            if t0 is not None:
                self.blocked[self.worker] += time.perf_counter() - t0
        if cancelled is not None:
            raise cancelled

    def _writev(self, views: list[memoryview]) -> int:
        """What one writev to the pipe took of `views` (0 while it is full)."""
        try:
            return os.writev(self.pipe.fd, views)
        except BlockingIOError:
            return 0
        except BrokenPipeError:
            raise Closed("the consumer is gone") from None

    def close(self) -> None:
        self._give_back_held()
        for fd in (self.pipe, self.token_r, self.token_w):
            fd.close()


def _advance(views: list[memoryview], n: int) -> None:
    """Drops the first `n` bytes of `views` (what a writev took)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if views:
        views[0] = views[0][n:]


class _Pieces:
    """A frame's body that came in several pieces. ``whole()`` copies them
    into one 64-byte aligned buffer, what the decoder needs, letting go of
    each piece once copied (the memory of the frame stays about one body
    and one piece). A frame dropped unread (a batch of an old pass) is never
    joined."""

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: list[np.ndarray], nbytes: int) -> None:
        self.pieces = collections.deque(pieces)
        self.nbytes = nbytes

    def whole(self) -> np.ndarray:
        buf = _codec.aligned_empty(self.nbytes)
        into = buf.data
        at = 0
        while self.pieces:
            piece = self.pieces.popleft()
            into[at : at + len(piece)] = piece.data
            at += len(piece)
            del piece  # let go of its memory now
        return buf


#: A whole frame: (worker, kind, pass number, payload; None for an END).
_Frame = tuple[int, int, int, np.ndarray | _Pieces | None]


class _Inbound:
    """One worker's pipe, consumer side: reads what has arrived without
    blocking, and yields whole frames only."""

    __slots__ = ("body", "broken", "done", "eof", "fd", "got", "head", "kind", "nbytes", "pass_no", "pieces", "worker")

    def __init__(self, fd: int, worker: int) -> None:
        self.fd = fd
        self.worker = worker
        self.head = bytearray(HEADER.size)
        self.got = 0  # bytes of the header, then of the body's current piece, read so far
        self.body: np.ndarray | None = None  # the piece being read into (the first: 64-byte aligned)
        self.pieces: list[np.ndarray] = []  # the body's pieces before it, full
        self.done = 0  # their bytes
        self.nbytes = 0  # the body's length
        self.kind = 0
        self.pass_no = 0
        self.eof = False
        #: Why the stream is corrupt, once it is: the rest of it cannot be
        #: framed any more, so every later read raises this again (rather
        #: than read on from the middle of a frame, or see no more bytes
        #: and look like a pipe whose writer is gone).
        self.broken: str | None = None

    def partial(self) -> tuple[int, int] | None:
        """(bytes arrived, bytes of the frame) of a frame begun, or None."""
        if self.body is not None:
            return HEADER.size + self.done + self.got, HEADER.size + self.nbytes
        if self.got:
            return self.got, -1
        return None

    def read(self, arrived: collections.deque[_Frame]) -> None:
        """Reads until the pipe is empty, or READ_BYTES or READ_CALLS are
        spent (the caller polls again: the pipe is still ready); whole
        frames go to `arrived` as (worker, kind, pass number, payload).
        CorruptChannelError if the stream is not one of frames, now and on
        every call after."""
        if self.broken is not None:
            raise CorruptChannelError(self.broken)
        budget, calls = READ_BYTES, READ_CALLS
        while budget > 0 and calls > 0:
            # `into` is never empty: a whole header, piece or body is dealt
            # with as soon as it is whole, below. So 0 bytes read is the end
            # of the stream, never the answer to a request for none.
            if self.body is None:
                into = memoryview(self.head)[self.got :]
            else:
                into = self.body.data[self.got :]
            try:
                n = os.readv(self.fd, [into])
            except BlockingIOError:
                return
            if n == 0:
                self.eof = True  # every writer is gone: what is half here stays half
                return
            budget -= n
            calls -= 1
            self.got += n
            if self.body is None:
                if self.got < HEADER.size:
                    continue
                magic, kind, pass_no, nbytes = HEADER.unpack(self.head)
                why = _malformed(magic, kind, nbytes)
                if why:
                    self.broken = (
                        f"worker {self.worker}'s pipe holds a malformed frame header {bytes(self.head)!r} ({why})"
                    )
                    raise CorruptChannelError(self.broken)
                self.kind, self.pass_no, self.nbytes, self.got = kind, pass_no, nbytes, 0
                self.body = _codec.aligned_empty(min(nbytes, FIRST_PIECE))
            if self.got < len(self.body):
                continue
            if self.done + self.got < self.nbytes:  # a piece is full: the next one
                self.pieces.append(self.body)
                self.done += self.got
                self.body, self.got = np.empty(min(self.nbytes - self.done, self.done, PIECE), np.uint8), 0
                continue
            body: np.ndarray | _Pieces | None = None
            if self.kind == KIND_BATCH:
                body = _Pieces([*self.pieces, self.body], self.nbytes) if self.pieces else self.body
            arrived.append((self.worker, self.kind, self.pass_no, body))
            self.body, self.got, self.pieces, self.done = None, 0, [], 0


def _malformed(magic: bytes, kind: int, nbytes: int) -> str:
    """What is wrong with a frame header, or "" if nothing is."""
    if magic != MAGIC:
        return "not a frame"
    if kind == KIND_END:
        return f"an end of a pass with {nbytes:,} bytes after it" if nbytes else ""
    if kind != KIND_BATCH:
        return f"kind {kind}"
    if nbytes == 0:
        return "an empty batch"  # a payload is never empty
    if nbytes > MAX_FRAME:
        return f"a batch of {nbytes:,} bytes: more than any producer can send"
    return ""


class QueueConsumer(ConsumerEnd):
    def __init__(self, spec: ChannelSpec) -> None:
        n = spec.num_workers
        self.num_workers = n
        self.ordered = spec.ordered and n > 1
        made: list[int] = []
        try:  # a Ctrl-C too: the descriptors made so far are closed before it propagates
            data = []
            for _ in range(n):
                r, w = _new_pipe()
                made += (r, w)
                data.append((r, w))
            pools = []
            for _ in range(n if self.ordered else 1):
                r, w = _new_pipe()
                made += (r, w)
                pools.append((r, w))
            self._wake_r, self._wake_w = _new_pipe()  # destroy() from another thread wakes a waiting get()
            made += (self._wake_r, self._wake_w)
            self.handle = QueueHandle(
                pipes=[PassFd(w) for _, w in data],
                tokens=[(PassFd(r), PassFd(w)) for r, w in pools],
                blocked=spec.mp_context.RawArray("d", n),
            )
            # Every place starts in its pool, as a token.
            per_pool = spec.quota if self.ordered else spec.capacity
            self._backlog = [per_pool] * len(pools)  # tokens owed to a pool whose pipe was full
            for pool in range(len(pools)):
                self._flush_tokens(pool)
        except BaseException:
            for fd in made:
                os.close(fd)
            raise
        self._inbound = [_Inbound(r, w) for w, (r, _) in enumerate(data)]
        self._by_fd = {box.fd: box for box in self._inbound}
        self._poller = select.poll()
        for box in self._inbound:
            self._poller.register(box.fd, select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        # Whole frames not yet returned: in arrival order (unordered), or per
        # worker (ordered): (worker, kind, pass number, payload).
        self._arrived: list[collections.deque[_Frame]] = [
            collections.deque() for _ in range(n if self.ordered else 1)
        ]
        self.ended: set[int] = set()  # workers whose current pass is over (unordered)
        self._broken: str | None = None  # why a pipe's stream is corrupt: get() raises it (see _read_ready)
        self.pass_no = spec.first_pass
        # get() and begin_pass() run in the consumer's thread; destroy() may
        # come from any thread (a close() while another thread waits): it
        # closes the descriptors only once no get() uses them, so a number
        # is never read after it was closed (and perhaps reused).
        self._io = threading.RLock()
        self._closed = False
        self._destroyed = False  # its descriptors closed (or being closed): none is written or closed again

    def handle_delivered(self) -> None:
        # Every producer has its own write end of its pipe now: the
        # consumer's copies go. Only producers can then write into the
        # pipes (a process that opens this one's /proc/<pid>/fd finds no
        # write end), and a pipe whose writers are all gone reads as ended.
        # The token pipes stay: the consumer gives places back through them.
        for passed in self.handle.pipes:
            passed.close()

    # -- room ------------------------------------------------------------------

    def _flush_tokens(self, pool: int) -> None:
        while self._backlog[pool]:
            try:
                n = os.write(self.handle.tokens[pool][1].fd, _TOKEN * min(self._backlog[pool], 4096))
            except BlockingIOError:
                return  # the pool's pipe is full: owed until some are taken
            self._backlog[pool] -= n

    def _give_token(self, worker: int) -> None:
        """The batch of `worker` is off the channel: its place is free."""
        pool = worker if self.ordered else 0
        self._backlog[pool] += 1
        self._flush_tokens(pool)

    # -- frames ------------------------------------------------------------------

    def _read_ready(self, timeout: float) -> None:
        """Waits up to `timeout` for any pipe to have bytes, then reads every
        pipe that has some."""
        for fd, _ in self._poller.poll(max(0, math.ceil(timeout * 1000))):
            box = self._by_fd.get(fd)
            if box is None:  # the wake pipe: close() or destroy(); _closed says which
                try:
                    os.read(self._wake_r, 64)
                except OSError:
                    pass
                continue
            if self._closed:
                return
            try:
                box.read(self._arrived[box.worker if self.ordered else 0])
            except CorruptChannelError as exc:
                # Not raised from here: the whole frames that came before
                # the corruption are delivered first, then get() raises it,
                # and goes on raising it (the pipe may never be ready again,
                # so it cannot wait for the box to say it once more).
                self._corrupt(box, str(exc))
                continue
            if box.eof:
                self._poller.unregister(fd)

    def _corrupt(self, box: _Inbound, why: str) -> None:
        """Worker `box.worker`'s stream is corrupt: get() raises `why`, now
        and on every call once no whole frame from before it is left. The
        pipe is polled no more (its bytes will never be read), and frames
        of it that arrived after the corruption are never delivered."""
        box.broken = box.broken or why
        if self._broken is None:
            self._broken = box.broken
        try:
            self._poller.unregister(box.fd)
        except KeyError:
            pass  # already: at its end, or corrupt before

    def _drop_frames_of(self, worker: int) -> None:
        """Drops every whole frame of `worker` not returned yet (giving
        their places back)."""
        for arrived in self._arrived:
            keep = [f for f in arrived if f[0] != worker]
            for w, kind, _, _ in arrived:
                if w == worker and kind == KIND_BATCH:
                    self._give_token(w)
            arrived.clear()
            arrived.extend(keep)

    def _take(self, pass_no: int, worker: int) -> Any:
        """The next whole frame for this get(), as what get() returns, or
        _NOTHING. Frames of other passes are dropped (their place given back)."""
        arrived = self._arrived[worker if self.ordered else 0]
        while arrived:
            w, kind, p, body = arrived.popleft()
            if kind == KIND_BATCH:
                self._give_token(w)
            if p != pass_no:
                continue  # a frame of a pass no one reads any more
            if kind == KIND_END:
                if worker >= 0:
                    return END
                self.ended.add(w)
                if len(self.ended) == self.num_workers:
                    return END
                continue
            assert body is not None
            buf = body if isinstance(body, np.ndarray) else body.whole()
            try:
                # Another process's bytes: decoded, never run. The buffer is
                # this batch's alone, so its arrays may be written.
                payload = _codec.decode(buf, writeable=True)
            except CorruptChannelError as exc:
                self._corrupt(self._inbound[w], f"worker {w}'s pipe holds a malformed batch: {exc}")
                self._drop_frames_of(w)  # they came after it: nothing more of that pipe is delivered
                raise CorruptChannelError(self._inbound[w].broken) from exc
            self.last_worker = w
            self.last_nbytes = len(buf)
            return payload
        if worker < 0 and len(self.ended) == self.num_workers:
            return END
        return _NOTHING

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        deadline = time.monotonic() + wait
        with self._io:
            polled = False
            while not self._closed:
                found = self._take(pass_no, worker)
                if found is not _NOTHING:
                    return found
                if self._broken is not None:
                    raise CorruptChannelError(self._broken)
                left = deadline - time.monotonic()
                if polled and left <= 0:
                    break
                polled = True
                try:
                    self._read_ready(left)
                except OSError:
                    if not self._closed:
                        raise
            return AGAIN

    def begin_pass(self, pass_no: int) -> None:
        if pass_no == self.pass_no or self._closed:
            return
        with self._io:
            self.pass_no = pass_no
            self.ended = set()
            # Frames of the old pass go now, so their producers get the room
            # back at once.
            for arrived in self._arrived:
                keep = [f for f in arrived if f[2] == pass_no]
                for w, kind, p, _ in arrived:
                    if kind == KIND_BATCH and p != pass_no:
                        self._give_token(w)
                arrived.clear()
                arrived.extend(keep)

    def producer_blocked_s(self, worker: int) -> float:
        return self.handle.blocked[worker]

    def describe_wait(self) -> str:
        queued = sum(len(a) for a in self._arrived)
        parts = [f"{queued} batches are queued for other workers"] if queued else []
        for box in self._inbound:
            if box.broken is not None:
                parts.append(f"worker {box.worker}'s pipe is corrupt")
                continue
            part = box.partial()
            if part is not None:
                got, total = part
                of = f" of {total:,}" if total >= 0 else ""
                parts.append(f"worker {box.worker}'s next batch is arriving ({got:,}{of} bytes so far)")
        return "; ".join(parts) if parts else "the queue is empty"

    def close(self) -> None:
        # Producers blocked in put() see "stop" through their control pipe; a
        # get() waiting in another thread returns now.
        self._wake()

    def _wake(self) -> None:
        if self._destroyed:  # (a close after destroy: the numbers may be another file's now)
            return
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass  # full (it is awake already) or closed

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._closed = True
        self._wake()
        # (the acquire and its release's try with no check between: a signal
        # handler's exception there left the lock held, every get() waiting)
        _spans.call_holding(self._io, DESTROY_WAIT_S, self._destroy_holding_io)

    def _destroy_holding_io(self, took: bool) -> None:
        if not took:
            return  # a get() stuck elsewhere: leave the descriptors rather than close them under it
        # Marked first: a destroy cut in the loop (a signal handler's
        # exception) and run again leaves the rest open, never closes a
        # number twice.
        self._destroyed = True
        for fd in [box.fd for box in self._inbound] + [self._wake_r, self._wake_w]:
            os.close(fd)
        for passed in self.handle.pipes + [end for pool in self.handle.tokens for end in pool]:
            passed.close()
        for arrived in self._arrived:
            arrived.clear()
