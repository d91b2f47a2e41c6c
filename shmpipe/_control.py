"""Messages on a pipeline's control connections.

Each producer has one duplex connection to the consumer (a Unix stream
socket pair made by multiprocessing: ``Pipe(duplex=True)``). The two
directions are not alike, because the two ends do not trust each other
alike (the protocol itself is in _worker.py).

**Consumer -> producer** (``attach``, ``pass``, ``stop``): small pickled
tuples. The consumer is the trusted end: it started the producer and
chose the code it runs, so a producer may unpickle what it sends (it is no
more than what the consumer could already make it do). A message may hold
:class:`PassFd` objects, file descriptors the producer needs (a ring's
memory, say): their numbers mean nothing in another process, so the
descriptors themselves travel beside the message, as SCM_RIGHTS ancillary
data (_fdpass), and arrive as new PassFd objects holding the receiver's own
numbers (close-on-exec). Framing: one ``send_bytes`` of ``<u16 count of
descriptors> <pickle>``, then, if the count is not zero, one byte with the
descriptors attached. Connection reads exactly what each message says,
never ahead, so the descriptors are the next thing on the socket when the
message has been read. (:meth:`ProducerLink.send`, :func:`recv`.)

**Producer -> consumer** (``need_channel``, ``state``, ``done``, ``error``): untrusted. A
producer runs a source, and a source must not be able to make the
consumer run code, so nothing a producer sends is unpickled: a message is
a JSON array whose first element names it, in a frame as
``Connection.send_bytes`` writes one (a 4-byte big-endian signed length,
then that many bytes; multiprocessing's wire format, which its Listener and
Client keep stable across Python versions), of at most
:data:`MAX_MESSAGE` bytes, and never with descriptors::

    ["need_channel", nbytes]                   0 <= nbytes <= MAX_NBYTES
    ["state", pass, wseq, state]               the source's iterator's state_dict()
                                               after batch `wseq` of `pass` (any JSON;
                                               kept as data, handed back on resume)
    ["done", pass, produced]                   its part of `pass` is over after
                                               `produced` batches (sent before it
                                               says so in the channel itself)
    ["error", exc_type, message, traceback, own]
        own: null, or [class name, [arguments]] for shmpipe's own errors

:func:`decode` checks every field for its exact type and bounds; ``own``
is rebuilt only from a closed table of shmpipe's exception classes
(:data:`OWN_ERRORS`) and arguments of the types each expects, so a
producer's BatchTypeError is raised as itself in the consumer and a
forged message can name no other class. Anything else is a
CorruptChannelError. The producer clips an error's texts (a long
traceback) until its frame fits (:func:`error`), so a real error always
arrives. (:func:`tell` sends one.)

The consumer reads these with a :class:`ProducerLink` per producer, which never
blocks: it takes what the socket holds (MSG_DONTWAIT), keeps the part of
a frame that has arrived, and hands over whole messages only. A producer
that stops (or dies, leaving a child holding the socket) in the middle of
a message leaves that part in the inbox and nothing else: the consumer's
waits go on honouring ``timeout=``, and a death is seen by the launcher
through the process itself.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import socket
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd
from typing import Any, NamedTuple

from shmpipe import _fdpass
from shmpipe.errors import (
    BatchTooLargeError,
    BatchTypeError,
    CorruptChannelError,
    GroupError,
    GroupStartError,
    PipelineClosedError,
    PipelineTimeoutError,
    RankDiedError,
    SharedMemoryFullError,
    ShmpipeError,
    ShmpipeTypeError,
    ShmpipeValueError,
    TransportUnavailableError,
    WorkerDiedError,
    WorkerError,
    type_name,
)

__all__ = [
    "MAX_MESSAGE",
    "MAX_NBYTES",
    "OWN_ERRORS",
    "ErrorReport",
    "IteratorState",
    "NeedChannel",
    "PassDone",
    "PassFd",
    "ProducerLink",
    "decode",
    "encode",
    "error",
    "iterator_state",
    "need_channel",
    "pass_done",
    "recv",
    "tell",
]

_COUNT = struct.Struct("<H")
#: More than this in one message is a bug (or a hostile peer).
MAX_FDS = 64

#: The largest message a producer may send (its JSON, without the frame's
#: length). A need_channel is a few dozen bytes; an error's texts are
#: clipped until it fits.
MAX_MESSAGE = 1 << 16
#: The largest first batch a producer may ask a channel for (1 TiB, the
#: queue transport's largest frame): beyond any real batch, and small
#: enough that the ring's size stays far from overflowing 64 bits.
MAX_NBYTES = 1 << 40
#: How long an error's texts may be before clipping starts (each keeps its
#: head and its tail: a traceback's last lines say the most).
_MAX_TEXT = 16_000
_LENGTH = struct.Struct("!i")  # Connection's frame header
#: What the inbox takes from a socket at one call (then the socket is
#: looked at again at the next health check: a producer that writes
#: without end cannot keep the consumer reading).
_READ_BUDGET = 4 * MAX_MESSAGE
_INT32 = (-(1 << 31), (1 << 31) - 1)
_SIZE = (0, (1 << 63) - 1)
_PID = (1, (1 << 31) - 1)


class PassFd:
    """A file descriptor to hand to another process with a message.

    The receiving side owns the descriptor it gets: ``take()`` it (and close
    it when done), or ``close()`` it. Besides control messages, a PassFd
    travels in the arguments of a process being started (multiprocessing
    passes the descriptor along); pickled anywhere else, it is an error.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def take(self) -> int:
        """The descriptor, which the caller now owns."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            raise ValueError("this descriptor was already taken or closed")
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def forget(self) -> None:
        """Drops the number without closing it (its owner closed it)."""
        self.fd = -1

    def __repr__(self) -> str:
        return f"PassFd({self.fd})"

    def __reduce__(self) -> Any:
        # Outside a control message: only while multiprocessing starts a
        # process (the arguments of Process), which can pass descriptors
        # along itself (spawn and forkserver do).
        if get_spawning_popen() is None:
            raise TypeError("a PassFd travels in a control message (ProducerLink.send) or a Process's arguments")
        return (_passed_at_start, (DupFd(self.fd),))


def _passed_at_start(dup: Any) -> PassFd:
    return PassFd(dup.detach())


def _socket_of(conn: Connection) -> socket.socket:
    """A socket object over a duplicate of `conn`'s descriptor, blocking
    whatever socket.setdefaulttimeout() says (a timeout would make the
    descriptor, shared with `conn`, non-blocking)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    sock.setblocking(True)
    return sock


# -- consumer -> producer: pickles from the trusted end ----------------------------


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is PassFd:
            self.fds.append(obj.fd)
            return len(self.fds) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, fds: list[int]) -> None:
        super().__init__(file)
        self.fds = fds

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not int or not 0 <= pid < len(self.fds):
            raise OSError("a control message names a descriptor it did not carry")
        return PassFd(self.fds[pid])


def _for_producer(message: Any) -> tuple[bytes, list[int]]:
    """Consumer side: `message` as one frame's bytes (``<u16 count of
    descriptors> <pickle>``, after the frame's length) and the descriptors
    of its PassFds, which go beside it (ProducerLink.send)."""
    buf = io.BytesIO()
    buf.write(_COUNT.pack(0))
    pickler = _Pickler(buf)
    pickler.dump(message)
    fds = pickler.fds
    if len(fds) > MAX_FDS:
        raise ValueError(f"a control message may carry at most {MAX_FDS} descriptors")
    data = buf.getbuffer()
    data[: _COUNT.size] = _COUNT.pack(len(fds))
    return bytes(data), fds


def recv(conn: Connection) -> Any:
    """Producer side: the consumer's next message (it blocks: the consumer
    is trusted to send whole messages); its PassFds hold descriptors of this
    process. Never used by the consumer, which reads with a ProducerLink."""
    data = conn.recv_bytes()
    (count,) = _COUNT.unpack_from(data)
    fds: list[int] = []
    if count:
        if count > MAX_FDS:
            raise OSError(f"a control message claims {count} descriptors (the peer is broken)")
        with _socket_of(conn) as sock:
            fds = _fdpass.recv_fds(sock, 1, count).fds  # close-on-exec, as every descriptor Python makes
        if len(fds) != count:  # fewer: cut by the kernel (no room for them), or the stream ended
            _fdpass.close_all(fds)
            raise OSError(f"a control message said {count} descriptors and {len(fds)} came")
    try:
        return _Unpickler(io.BytesIO(data[_COUNT.size :]), fds).load()
    except BaseException:
        _fdpass.close_all(fds)
        raise


# -- producer -> consumer: JSON, checked field by field ----------------------------


class NeedChannel(NamedTuple):
    """``need_channel``: a producer's first batch needs `nbytes`."""

    nbytes: int


class ErrorReport(NamedTuple):
    """``error``: the producer raised; `own` is shmpipe's own error it
    raised, rebuilt (None for any other exception)."""

    exc_type: str
    message: str
    traceback: str
    own: ShmpipeError | None


class IteratorState(NamedTuple):
    """``state``: the source's iterator's own state after batch `wseq` of
    pass `pass_no` (sent before the batch is published). Data the consumer
    keeps and hands back to a producer on resume, never interprets."""

    pass_no: int
    wseq: int
    state: Any


class PassDone(NamedTuple):
    """``done``: the producer's part of pass `pass_no` is over after
    `produced` batches (its numbers 0 to produced - 1). Sent on this
    connection, which no other process can reach, before the channel is
    told: the consumer checks what the channel says against it."""

    pass_no: int
    produced: int


Message = NeedChannel | ErrorReport | IteratorState | PassDone

#: The types a field may have, and for ints their bounds (inclusive).
_Field = tuple[tuple[type | None, ...], tuple[int, int] | None]
_TEXT: _Field = ((str,), None)
_SIZE_FIELD: _Field = ((int,), _SIZE)
_WORKER: _Field = ((int,), (0, _INT32[1]))
_MAYBE_PID: _Field = ((int, None), _PID)
_MAYBE_CODE: _Field = ((int, None), _INT32)
_MAYBE_TEXT: _Field = ((str, None), None)
_RANK: _Field = ((int,), _INT32)

#: shmpipe's own errors that travel as themselves: the class, the types of
#: its constructor's arguments, and how to read them back off an instance
#: (None: the message, ``str(exc)``, its one argument). Exact classes only:
#: a subclass defined elsewhere travels as a WorkerError alone.
OWN_ERRORS: dict[str, tuple[type[ShmpipeError], tuple[_Field, ...], Callable[[Any], tuple[Any, ...]] | None]] = {
    cls.__name__: (cls, fields, args)
    for cls, fields, args in [
        (ShmpipeError, (_TEXT,), None),
        (ShmpipeTypeError, (_TEXT,), None),
        (ShmpipeValueError, (_TEXT,), None),
        (CorruptChannelError, (_TEXT,), None),
        (TransportUnavailableError, (_TEXT,), None),
        (PipelineTimeoutError, (_TEXT,), None),
        (PipelineClosedError, (_TEXT,), None),
        (GroupError, (_TEXT,), None),
        (GroupStartError, (_TEXT,), None),
        (BatchTypeError, (_TEXT, _TEXT), lambda e: (e.message, e.path)),
        (BatchTooLargeError, (_SIZE_FIELD, _SIZE_FIELD), lambda e: (e.nbytes, e.slot_size)),
        (SharedMemoryFullError, (_SIZE_FIELD, _SIZE_FIELD, _TEXT), lambda e: (e.needed, e.available, e.where)),
        (WorkerError, (_WORKER, _MAYBE_PID, _TEXT, _TEXT, _TEXT),
         lambda e: (e.worker_id, e.pid, e.exc_type, e.message, e.remote_traceback)),
        (WorkerDiedError, (_WORKER, _MAYBE_PID, _MAYBE_CODE, _MAYBE_TEXT, _MAYBE_TEXT),
         lambda e: (*e.__reduce__()[1][:4], e.note)),
        (RankDiedError, (_TEXT, _RANK), lambda e: (str(e), e.rank)),
    ]
}


def _fits(value: Any, field: _Field) -> bool:
    """`value` is exactly of one of the field's types (bool is not an int;
    None: is None), within its bounds."""
    types, bounds = field
    if value is None:
        return None in types
    if type(value) not in types:
        return False
    return bounds is None or type(value) is not int or bounds[0] <= value <= bounds[1]


def encode(message: list[Any]) -> bytes:
    """A producer's message as it travels (ASCII JSON)."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode()


def need_channel(nbytes: int) -> list[Any]:
    """The message that asks for a channel sized for a first batch of `nbytes`."""
    return ["need_channel", int(nbytes)]


def pass_done(pass_no: int, produced: int) -> list[Any]:
    """The message that says this producer's part of a pass is over."""
    return ["done", int(pass_no), int(produced)]


def iterator_state(pass_no: int, wseq: int, state: Any) -> list[Any]:
    """The message that carries a source's iterator's state after batch
    `wseq` of pass `pass_no`."""
    return ["state", int(pass_no), int(wseq), state]


def error(exc: BaseException, traceback: str) -> list[Any]:
    """The message that reports `exc` (formatted as `traceback`). Its texts
    are clipped until it fits in MAX_MESSAGE: an error too large to send
    would be lost, and the consumer would learn only that the producer
    ended. shmpipe's own error (of OWN_ERRORS) goes with its arguments, so
    the consumer raises the same type."""
    exc_type = type_name(exc)
    message = ["error", exc_type, _str(exc), traceback, _own(exc)]
    limit = _MAX_TEXT
    while True:
        clipped = _clip_all(message, limit)
        if len(encode(clipped)) <= MAX_MESSAGE:
            return clipped
        if limit == 0:  # not the texts (a bug): say at least what failed
            return ["error", _clip(exc_type, 200), "(its message was too large to send)", "", None]
        limit //= 4


def _str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # an exception whose __str__ raises, as traceback prints it
        return f"<exception str() failed: {type(exc).__name__}>"


def _own(exc: BaseException) -> list[Any] | None:
    """[class name, arguments] of shmpipe's own error, or None."""
    entry = OWN_ERRORS.get(type(exc).__name__)
    if entry is None or type(exc) is not entry[0]:
        return None
    _, fields, read = entry
    try:
        args = list(read(exc)) if read is not None else [str(exc)]
    except Exception:
        return None
    if len(args) != len(fields) or not all(_fits(a, f) for a, f in zip(args, fields, strict=True)):
        return None  # made by hand with other values: it travels as a WorkerError alone
    return [type(exc).__name__, args]


def _clip_all(value: Any, limit: int) -> Any:
    if isinstance(value, list):
        return [_clip_all(v, limit) for v in value]
    return _clip(value, limit)


def _clip(value: Any, limit: int) -> Any:
    if not isinstance(value, str) or len(value) <= limit:
        return value
    head = value[: limit // 2]
    tail = value[len(value) - limit // 2 :] if limit >= 2 else ""
    return f"{head}\n[...] ({len(value) - len(head) - len(tail):,} characters clipped)\n{tail}"


def tell(conn: Connection, message: list[Any]) -> None:
    """Producer side: sends `message` (need_channel or error) to the consumer."""
    data = encode(message)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"a control message of {len(data):,} bytes (at most {MAX_MESSAGE:,})")
    conn.send_bytes(data)


def decode(data: bytes) -> Message:
    """A producer's message from its bytes (a frame's body). Anything but a
    well-formed message is a CorruptChannelError that says what is wrong:
    the bytes choose no code to run, and no class but shmpipe's own errors."""
    try:
        message = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: deep nesting
        raise _malformed(data, "not JSON") from None
    if type(message) is not list or not message or type(message[0]) is not str:
        raise _malformed(data, "not an array that begins with its name")
    kind = message[0]
    if kind == "need_channel":
        if len(message) != 2 or not _fits(message[1], ((int,), (0, MAX_NBYTES))):
            raise _malformed(data, f"need_channel wants one size of 0 to {MAX_NBYTES:,} bytes")
        return NeedChannel(message[1])
    if kind == "done":
        if len(message) != 3 or not _fits(message[1], ((int,), (0, 2**32 - 1))) or not _fits(
            message[2], ((int,), (0, 2**63 - 1))
        ):
            raise _malformed(data, "done wants a pass number and a count of batches")
        return PassDone(message[1], message[2])
    if kind == "state":
        if len(message) != 4 or not _fits(message[1], ((int,), (0, 2**32 - 1))) or not _fits(
            message[2], ((int,), (0, 2**63 - 1))
        ):
            raise _malformed(data, "state wants a pass number, a batch number and the state")
        return IteratorState(message[1], message[2], message[3])
    if kind == "error":
        if len(message) != 5 or not all(type(v) is str for v in message[1:4]):
            raise _malformed(data, "error wants a type, a message and a traceback (texts) and an error or null")
        _, exc_type, text, tb, own = message
        return ErrorReport(exc_type, text, tb, None if own is None else _rebuild(own, data))
    raise _malformed(data, f"unknown kind {kind!r:.40}")


def _rebuild(own: Any, data: bytes) -> ShmpipeError:
    """shmpipe's own error from [class name, arguments]: a class of the
    closed table, with arguments of its types."""
    if type(own) is not list or len(own) != 2 or type(own[0]) is not str or type(own[1]) is not list:
        raise _malformed(data, "an error's own exception wants [class name, [arguments]]")
    name, args = own
    entry = OWN_ERRORS.get(name)
    if entry is None:
        raise _malformed(data, f"{name!r:.60} is not one of shmpipe's errors")
    cls, fields, _ = entry
    if len(args) != len(fields) or not all(_fits(a, f) for a, f in zip(args, fields, strict=True)):
        raise _malformed(data, f"the arguments of {name} are not of its types")
    try:
        return cls(*args)
    except (TypeError, ValueError, OverflowError) as exc:  # a bug of the table: still only this error
        raise _malformed(data, f"{name} could not be made ({exc})") from None


def _malformed(data: bytes, why: str) -> CorruptChannelError:
    return CorruptChannelError(f"a malformed control message ({why}): {bytes(data[:80])!r}")


class ProducerLink:
    """The consumer's end of one producer's control connection, on one
    descriptor: the consumer keeps no Connection beside it (a descriptor
    per producer counts against ``ulimit -n``).

    ``send()`` writes one message to the producer, in the frame its
    ``Connection.recv_bytes`` reads (send_bytes' own), descriptors after it.
    ``read()`` never blocks: it takes what the socket holds (MSG_DONTWAIT,
    at most _READ_BUDGET bytes a call), keeps the part of a frame that has
    arrived, and returns the whole messages, decoded. Not thread-safe: the
    caller reads one link from one thread at a time (a send may come from
    another: the socket is not shared with anything else). The link takes
    over `conn` (closed here) and owns its descriptor: close() it."""

    def __init__(self, conn: Connection, who: str) -> None:
        #: Who sends (``worker 0 (pid 123)``), for the errors.
        self.who = who
        try:
            self._sock = _socket_of(conn)
        finally:
            conn.close()
        self._buf = bytearray()
        #: The producer closed its end (or reset it): no more will come.
        self.eof = False
        #: Why the stream is corrupt, once it is: it cannot be framed any
        #: more, so every later read raises this again.
        self.broken: str | None = None

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, message: Any) -> None:
        """Sends `message` (and the descriptors of its PassFds) to the
        producer. Pickled: only ever read by a producer, which trusts the
        consumer (never the other way: see :func:`tell`)."""
        data, fds = _for_producer(message)
        # (MSG_NOSIGNAL: a producer gone is a BrokenPipeError, never a SIGPIPE: see _fdpass.send_fds.)
        self._sock.sendall(_LENGTH.pack(len(data)) + data, socket.MSG_NOSIGNAL)  # a pickled tuple: far below 2 GiB
        if fds:
            _fdpass.send_fds(self._sock, b"F", fds)

    def pending(self) -> int:
        """Bytes of a message begun and not whole yet."""
        return len(self._buf)

    def read(self) -> list[Message]:
        """The messages that arrived whole since the last read. A malformed
        one (or a frame larger than MAX_MESSAGE) is a CorruptChannelError
        that names the producer: raised at once if no message came before
        it, else at the next read."""
        messages: list[Message] = []
        budget = _READ_BUDGET
        while self.broken is None and not self.eof and budget > 0:
            try:
                chunk = self._sock.recv(min(budget, MAX_MESSAGE), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # ECONNRESET: the producer went with messages of ours unread
                self.eof = True
                break
            if not chunk:
                self.eof = True
                break
            budget -= len(chunk)
            self._buf += chunk
            self._take(messages)
        if self.broken is not None and not messages:
            raise CorruptChannelError(self.broken)
        return messages

    def _take(self, into: list[Message]) -> None:
        buf = self._buf
        while self.broken is None and len(buf) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf)
            if not 0 < size <= MAX_MESSAGE:
                self.broken = (
                    f"{self.who} sent a malformed control message (a frame of {size:,} bytes; "
                    f"one holds 1 to {MAX_MESSAGE:,}): {bytes(buf[:80])!r}"
                )
                return
            end = _LENGTH.size + size
            if len(buf) < end:
                return
            data = bytes(buf[_LENGTH.size : end])
            del buf[:end]
            try:
                into.append(decode(data))
            except CorruptChannelError as exc:
                self.broken = f"{self.who} sent {exc}"

    def close(self) -> None:
        self._sock.close()
