"""Rank 0's door: the group's listening socket, and the connections that
have not said hello yet.

Anyone of this user can connect to the group's name and send anything. The
door lets through only a well-formed hello, from a process of this user,
within HELLO_TIMEOUT_S of its connect, and keeps at most MAX_PENDING such
connections waiting; everything else it closes (a refusal it can word, it
sends first). What a hello *says* (its launch, its arguments, the group's
state) the leader judges (_leader.Leader._admit), and turns away through
reject() here.

While it runs, the service thread alone uses the door: it polls what the
door asks it to watch and hands each readable one back to knocked(). (The
leader makes the door before that thread starts, and closes it after the
thread ended or its join timed out.)"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from shmpipe._group import _wire
from shmpipe._process import ProcessWatch
from shmpipe._stream import POLL_S
from shmpipe.errors import GroupError, GroupStartError

__all__ = ["Door", "Knock"]

#: How long a connection may take to say hello: a rank sends it at once, so
#: this is generous; a connection that says nothing is closed after it (it
#: would hold two descriptors for ever).
HELLO_TIMEOUT_S = 5.0
#: Connections waiting to say hello, at most (beyond the ranks to come): a
#: new one beyond it closes the oldest.
MAX_PENDING = 16

#: A connection that said a well-formed hello: (its socket, its pid from
#: SO_PEERCRED, the watch of that process, the hello).
Knock = tuple[socket.socket, int, ProcessWatch, _wire.Hello]


class Door:
    """The listening socket of group `group` (a backlog of `backlog`) and
    its connections waiting to say hello. `watch(fd, obj)`: the service
    thread is to poll `fd` and hand `obj` to knocked() when it is readable;
    `unwatch(fd)`: no longer."""

    def __init__(self, group: str, backlog: int, watch: Callable[[int, Any], None],
                 unwatch: Callable[[int | None], None]) -> None:
        self.group = group
        self._watch, self._unwatch = watch, unwatch
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            listener.bind(_wire.socket_address(group))
            listener.listen(backlog)
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                raise GroupStartError(
                    f"group {group!r} already has a rank 0 on this node (another run with the "
                    "same group name, or two processes given rank 0)"
                ) from None
            raise
        self.listener = listener
        #: Connected, hello not yet read: socket -> (pid from SO_PEERCRED, its
        #: watch, the monotonic time by which it must have said hello);
        #: oldest first.
        self.pending: dict[socket.socket, tuple[int, ProcessWatch, float]] = {}
        #: When accept() failed (out of descriptors), the listener is not
        #: polled until then: it stays readable, and polling it would spin.
        self.listener_resumes: float | None = None
        watch(listener.fileno(), listener)

    def knocked(self, obj: Any) -> Knock | None:
        """`obj` (the listener, or a pending connection) is readable: a
        connection accepted, or its hello read. A well-formed hello comes
        back for the leader to judge; None otherwise (nothing to judge yet,
        or the connection was closed)."""
        if obj is self.listener:
            self._accept()
            return None
        return self._hello(obj)

    def tick(self) -> None:
        """Closes the connections that did not say hello in time, and polls
        the listener again once its pause is over (each poll of the service
        thread)."""
        now = time.monotonic()
        for sock, (_, watch, deadline) in list(self.pending.items()):
            if now > deadline:
                self._unwatch(sock.fileno())
                del self.pending[sock]
                self.reject(sock, watch, None)
        if self.listener_resumes is not None and now >= self.listener_resumes:
            self.listener_resumes = None
            self._watch(self.listener.fileno(), self.listener)

    def reject(self, sock: socket.socket, watch: ProcessWatch, message: list[Any] | None) -> None:
        """Turns a connection away (with `message` first, where there is one)."""
        if message is not None:
            _wire.send_quietly(sock, message)
        sock.close()
        watch.close()

    def close(self) -> None:
        for sock, (_, watch, _) in list(self.pending.items()):
            self.reject(sock, watch, None)
        self.pending.clear()
        self.listener.close()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            # Out of descriptors (EMFILE, ENFILE) or a connection gone at
            # once: the listener stays readable. Look at it again in a
            # moment, not at once (that would spin this thread).
            self._unwatch(self.listener.fileno())
            self.listener_resumes = time.monotonic() + POLL_S
            return
        try:
            pid, uid = _wire.peer(sock)
        except OSError:
            pid, uid = 0, -1
        if uid != os.getuid():
            sock.close()  # only this user's processes may join (the name is no protection)
            return
        if len(self.pending) >= MAX_PENDING:  # the oldest goes: a rank says hello at once
            oldest = next(iter(self.pending))
            _, watch, _ = self.pending.pop(oldest)
            self._unwatch(oldest.fileno())
            self.reject(oldest, watch, None)
        self.pending[sock] = (pid, ProcessWatch(pid), time.monotonic() + HELLO_TIMEOUT_S)
        self._watch(sock.fileno(), sock)

    def _hello(self, sock: socket.socket) -> Knock | None:
        self._unwatch(sock.fileno())
        pid, watch, deadline = self.pending.pop(sock)
        try:
            message, fds = _wire.recv(sock)
        except BlockingIOError:  # woken for a descriptor number now another's: not yet
            self.pending[sock] = (pid, watch, deadline)
            self._watch(sock.fileno(), sock)
            return None
        except (GroupError, OSError):
            self.reject(sock, watch, None)
            return None
        for fd in fds:
            os.close(fd)
        if message is None or message[0] != "hello":
            self.reject(sock, watch, None)  # not one of ours
            return None
        # From here on, whatever a hello holds turns that connection away at
        # worst, never the group: anyone of this user can connect and say
        # anything, and only a rank of this launch is one of the group's.
        try:
            hello = _wire.parse_hello(message)
        except (GroupError, *_wire.MALFORMED) as malformed:  # MALFORMED: a check missed something
            refusal = GroupStartError(f"group {self.group!r} refused a process (pid {pid}): {malformed}")
            self.reject(sock, watch, _wire.error_message(refusal))
            return None
        return sock, pid, watch, hello
