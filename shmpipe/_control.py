"""Messages on a pipeline's control connections, with file descriptors.

Each producer has one duplex connection to the consumer (a Unix socket pair
made by multiprocessing: ``Pipe(duplex=True)``). Messages are small pickled
tuples (the protocol is in _worker.py). A message may hold :class:`PassFd`
objects, file descriptors the other process needs (a ring's memory, say):
their numbers mean nothing in another process, so the descriptors
themselves travel beside the message, as SCM_RIGHTS ancillary data
(_fdpass), and arrive as new PassFd objects holding the receiver's own
numbers (close-on-exec).

Framing: one ``send_bytes`` of ``<u16 count of descriptors> <pickle>``, then,
if the count is not zero, one byte with the descriptors attached. Connection
reads exactly what each message says, never ahead, so the descriptors are
the next thing on the socket when the message has been read.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import struct
from multiprocessing.connection import Connection
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd
from typing import Any

from shmpipe import _fdpass

__all__ = ["PassFd", "recv", "send"]

_COUNT = struct.Struct("<H")
#: More than this in one message is a bug (or a hostile peer).
MAX_FDS = 64


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
            raise TypeError("a PassFd travels in a control message (shmpipe._control.send) or a Process's arguments")
        return (_passed_at_start, (DupFd(self.fd),))


def _passed_at_start(dup: Any) -> PassFd:
    return PassFd(dup.detach())


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


def send(conn: Connection, message: Any) -> None:
    """Sends `message` (and the descriptors of the PassFds in it)."""
    buf = io.BytesIO()
    buf.write(_COUNT.pack(0))
    pickler = _Pickler(buf)
    pickler.dump(message)
    fds = pickler.fds
    if len(fds) > MAX_FDS:
        raise ValueError(f"a control message may carry at most {MAX_FDS} descriptors")
    data = buf.getbuffer()
    data[: _COUNT.size] = _COUNT.pack(len(fds))
    conn.send_bytes(data)
    if fds:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            _fdpass.send_fds(sock, b"F", fds)


def recv(conn: Connection) -> Any:
    """The next message; its PassFds hold descriptors of this process."""
    data = conn.recv_bytes()
    (count,) = _COUNT.unpack_from(data)
    fds: list[int] = []
    if count:
        if count > MAX_FDS:
            raise OSError(f"a control message claims {count} descriptors (the peer is broken)")
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            fds = _fdpass.recv_fds(sock, 1, count).fds  # close-on-exec, as every descriptor Python makes
        if len(fds) != count:  # fewer: cut by the kernel (no room for them), or the stream ended
            _fdpass.close_all(fds)
            raise OSError(f"a control message said {count} descriptors and {len(fds)} came")
    try:
        return _Unpickler(io.BytesIO(data[_COUNT.size :]), fds).load()
    except BaseException:
        _fdpass.close_all(fds)
        raise
