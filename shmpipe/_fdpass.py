"""Passing file descriptors over Unix sockets (SCM_RIGHTS): the one place
shmpipe sends and receives them, as CPython's multiprocessing/reduction.py
has sendfds/recvfds.

Three protocols carry descriptors, each with its own framing and its own
idea of what a bad message is: control messages (_control: a ring's memory
to a producer), external batches (_external: a batch's sealed memory to the
consumer) and a group's messages (_group: a ring and batches to each rank).
What they share is here, once, so each gets the same guarantees:

- one ``sendmsg``/``recvmsg`` per message (on a SOCK_SEQPACKET socket a
  message is one datagram, sent and taken whole: threads share a socket
  without a lock, and a message's descriptors cannot travel with another);
- descriptors arrive close-on-exec (MSG_CMSG_CLOEXEC: set by the kernel as
  it installs them, so no other thread's fork+exec can inherit one in
  between, as every descriptor Python makes is);
- the receive flags are honoured (``socket.recv_fds`` drops them, so
  MSG_DONTWAIT would block);
- truncation is reported, not decided: what a cut message means (a broken
  peer, a process out of descriptors) is the caller's to say.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = ["Received", "close_all", "recv_fds", "send_fds"]

_INT_SIZE = array.array("i").itemsize


class Received(NamedTuple):
    """One message taken from a socket, and the descriptors beside it (which
    the caller now owns: it keeps or closes every one, whatever else it
    makes of the message)."""

    #: The message's bytes; b"" at the end of a stream (or a datagram of none).
    data: bytes
    #: The descriptors that came with it, close-on-exec.
    fds: list[int]
    #: MSG_TRUNC: the message was longer than `bufsize` (on SOCK_SEQPACKET,
    #: the rest of it is lost).
    truncated: bool
    #: MSG_CTRUNC: descriptors were sent that did not arrive, because there
    #: were more than `maxfds` or because this process had no room for them
    #: (RLIMIT_NOFILE). The kernel closed them.
    fds_cut: bool


def send_fds(sock: socket.socket, data: bytes | memoryview, fds: Sequence[int]) -> None:
    """Sends `data` with the descriptors `fds` (duplicates of them arrive in
    the receiving process; ours stay open) in one ``sendmsg``; with no
    descriptors, no ancillary data at all.

    On a SOCK_SEQPACKET socket the message goes whole or not at all. On a
    stream socket it may in principle go in part (a signal in the middle of
    a large write): the descriptors then travel with the first part, and an
    OSError says so, since a receiver would read the rest as another
    message. Callers on stream sockets send small messages (one byte)."""
    size = memoryview(data).nbytes
    if size == 0:
        # Descriptors without a byte are not delivered on a stream socket,
        # and an empty datagram reads as the peer's end of the connection.
        raise ValueError("a message needs at least one byte")
    # MSG_NOSIGNAL: a peer gone is an error here (BrokenPipeError), never a
    # SIGPIPE, which kills a program that restored its default action.
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary, socket.MSG_NOSIGNAL)
    if sent != size:
        raise OSError(f"sendmsg sent {sent} of the {size} bytes of a message with descriptors")


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int, flags: int = 0) -> Received:
    """Takes one message of at most `bufsize` bytes and at most `maxfds`
    descriptors, with one ``recvmsg(..., flags | MSG_CMSG_CLOEXEC)``.

    `flags` are honoured (MSG_DONTWAIT: BlockingIOError when nothing is
    waiting; but on a socket with a timeout, settimeout(), Python first
    waits for it to be readable). Descriptors arrive close-on-exec. More than `maxfds` is
    ``fds_cut`` (the kernel closes the rest), never more descriptors than
    asked for. A partial trailing int in the ancillary data (a control
    buffer the kernel had to cut mid-descriptor) is ignored."""
    # CMSG_LEN, not CMSG_SPACE: the kernel installs as many descriptors as
    # fit in the buffer, and CMSG_SPACE's padding can hold one more than
    # maxfds (CMSG_SPACE(4) has room for two).
    data, ancdata, msg_flags, _ = sock.recvmsg(
        bufsize, socket.CMSG_LEN(maxfds * _INT_SIZE), flags | socket.MSG_CMSG_CLOEXEC
    )
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _INT_SIZE])
    return Received(data, fds.tolist(), bool(msg_flags & socket.MSG_TRUNC), bool(msg_flags & socket.MSG_CTRUNC))


def close_all(fds: Iterable[int]) -> None:
    """Closes every descriptor of `fds` (received ones that are not wanted),
    each even if closing another failed; then raises the first failure."""
    first: OSError | None = None
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            first = first or exc
    if first is not None:
        raise first
