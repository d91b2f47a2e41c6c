"""Several ranks of one node fed by one pipeline: ``from_iterators(group=...)``.

One process per GPU (``torchrun``) calls the same line; rank 0 runs the
pipeline (its producers, one per source, and the channel's only consumer)
and a *leader*: a Unix socket in the abstract namespace named from the uid
and the group, a service thread and a dispatch thread. Every rank, rank 0
included, is a *client* of the leader over that socket. docs/several-ranks.md
is the user's guide; docs/design.md ("Several ranks") the reasons.

Dealing. The dispatch thread takes batches from the pipeline in its usual
order (ordered=True: the deterministic one) as undecoded SharedBatch objects
(the channel was opened ``shared_with_ranks``) and deals them in *rounds* of
``num_ranks``: batch k of a pass goes to rank ``k % num_ranks``, and a round
is sent only once complete. At the end of a pass the incomplete last round
(fewer than num_ranks batches) is released unused and counted as dropped, so
every rank gets the same number of batches in every pass (what DDP needs: a
rank whose epoch ends early leaves the others waiting in an all-reduce).

Zero copy. A batch dealt to a rank travels as a small record (where its
payload is in the ring) plus, for a batch larger than a slot, the descriptor
of its memory; the ring's own descriptor went to each rank once. The rank
maps the ring read-only and decodes the payload there with the transport's
decoder (``Transport.rank_reader``), so its arrays are views of the pages
the producer wrote. Rank 0 keeps the batch's root (which holds the slot)
until the rank says "release" (when the last array of the batch is gone in
that rank), or until the rank's connection ends.

Passes. A client's ``iter()`` says "begin p"; the dispatcher starts pass p
only when every rank has begun it (a barrier), and ends it with "end p" to
every rank.

Faults. A rank's connection ending without "bye" (or its process ending,
seen by a pidfd: a child it forked keeps the socket open), or "bye" in the
middle of a pass, fails the group: rank 0 stops the pipeline, then releases
what that rank held, and sends every other rank a RankDiedError. Rank 0 dying
ends every connection: the others raise RankDiedError, and the producers
exit by their own watchdog (their consumer died). A producer's failure
reaches the dispatcher as the pipeline's error and every rank as the same
error.

Wire. SOCK_SEQPACKET: each message is one datagram, sent whole by one
sendmsg, so threads (a batch's release runs in whichever thread drops it)
send without a lock and a message never interleaves with another. A message
is a JSON array (never pickle: a peer's bytes choose no code to run), with
descriptors as SCM_RIGHTS beside it. Both ends check with SO_PEERCRED that
the other runs as the same user: the abstract namespace has no permissions.

This module is core: it knows the transport contract only.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, cast

from shmpipe import _fdpass
from shmpipe._interrupts import ctrl_c_held_back
from shmpipe._options import PipelineOptions
from shmpipe._process import open_pidfd, process_alive
from shmpipe._stats import Counters, GroupStats, PipelineStats
from shmpipe.errors import (
    GroupError,
    GroupStartError,
    PipelineClosedError,
    PipelineTimeoutError,
    RankDiedError,
    ShmpipeError,
    WorkerDiedError,
    WorkerError,
)
from shmpipe.transport import ChannelSpec, RankReader, SharedBatch

if TYPE_CHECKING:
    import tensorflow as tf

    from shmpipe._pipeline import Pipeline
    from shmpipe._torch import TorchBatches

__all__ = ["RankPipeline", "join_group", "socket_address"]

#: How long a blocking wait lasts before its loop looks at deadlines and
#: whether the group is closing.
POLL_S = 0.1
#: The largest message. Each receive allocates this much, so it stays small
#: (below malloc's mmap threshold). Every message but an error is a few
#: hundred bytes; an error's texts are clipped until its *encoded* form fits
#: (JSON writes a non-ASCII character as up to 12 bytes: clipping characters
#: is not enough).
MAX_MESSAGE = 1 << 16
_MAX_ERROR_BYTES = MAX_MESSAGE // 2
_MAX_TEXT = 12_000
MAX_FDS = 4
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
#: What a malformed message from a peer can raise while it is taken apart
#: (beyond the checks made field by field): turned into a GroupError.
_MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, OverflowError)


def socket_address(group: str) -> str:
    """The abstract-namespace address of `group` for this user."""
    return f"\0shmpipe-group-{os.getuid()}-{group}"


# -- the wire ------------------------------------------------------------------


def _encode(message: list[Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def _send(sock: socket.socket, message: list[Any], fds: list[int] | None = None) -> None:
    _fdpass.send_fds(sock, _encode(message), fds or ())


def _send_quietly(sock: socket.socket, message: list[Any], fds: list[int] | None = None) -> bool:
    """_send to a peer that may be gone (its end is handled where it is read)."""
    try:
        _send(sock, message, fds)
        return True
    except OSError:
        return False


def _recvmsg(sock: socket.socket, flags: int) -> _fdpass.Received:
    """One datagram and the descriptors with it (close-on-exec; `flags`
    honoured: MSG_DONTWAIT does not block)."""
    return _fdpass.recv_fds(sock, MAX_MESSAGE, MAX_FDS, flags)


def _recv(sock: socket.socket, flags: int = 0) -> tuple[list[Any] | None, list[int]]:
    """The next message and its descriptors; (None, []) at the end of the
    connection. A malformed message is a GroupError (descriptors closed).
    With MSG_DONTWAIT, BlockingIOError when there is none."""
    try:
        data, fds, truncated, fds_cut = _recvmsg(sock, flags)
    except ConnectionResetError:
        # The peer closed with messages of ours unread: the kernel reports
        # that (once) before the messages it sent us that are still queued.
        # They count (rank 0 sends "end" and then may close), so read on.
        try:
            data, fds, truncated, fds_cut = _recvmsg(sock, flags)
        except ConnectionResetError:
            return None, []
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        if truncated or fds_cut:
            raise GroupError("a group message was larger than allowed (the peer is broken)")
        try:
            message = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: a deeply nested array
            raise GroupError("a group message is not JSON (the peer is broken)") from None
        if not isinstance(message, list) or not message or not isinstance(message[0], str):
            raise GroupError(f"a malformed group message: {data[:80]!r}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (SO_PEERCRED)."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def _fingerprint(options: PipelineOptions) -> dict[str, Any]:
    """What every rank of a group must agree on (each passes its own
    arguments; a rank with other ones is a mistake to report, not to
    paper over)."""
    return {
        "num_ranks": options.num_ranks,
        "sources": options.num_workers,
        "transport": options.transport.name,
        "ordered": options.ordered,
        "capacity": options.capacity,
    }


def _error_message(exc: BaseException) -> list[Any]:
    """An exception as an "error" message every rank turns back into one.
    Long texts (a deep traceback, a huge message) are clipped until the
    message's encoded form fits in _MAX_ERROR_BYTES: a message too large to
    send would be lost, and the ranks would learn only that the group ended."""
    message = _error_message_unclipped(exc)
    limit = _MAX_TEXT
    while True:
        args = [_clip(a, limit) for a in message[2]]
        clipped = [message[0], message[1], args]
        if len(_encode(clipped)) <= _MAX_ERROR_BYTES:
            return clipped
        if limit == 0:  # not the texts (a bug): say at least what failed
            return ["error", "group", [f"rank 0's pipeline failed: {type(exc).__name__} (its message was too large)"]]
        limit //= 4


def _clip(value: Any, limit: int) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + " [...]"
    return value


def _error_message_unclipped(exc: BaseException) -> list[Any]:
    if isinstance(exc, WorkerDiedError):
        return ["error", "worker_died", list(exc.__reduce__()[1])]
    if isinstance(exc, WorkerError):
        return ["error", "worker", list(exc.__reduce__()[1])]
    if isinstance(exc, RankDiedError):
        return ["error", "rank_died", [str(exc), exc.rank]]
    if isinstance(exc, GroupStartError):
        return ["error", "start", [str(exc)]]
    if isinstance(exc, PipelineTimeoutError):
        return ["error", "timeout", [str(exc)]]
    return ["error", "group", [f"rank 0's pipeline failed: {type(exc).__name__}: {exc}"]]


def _error_from(message: list[Any]) -> ShmpipeError:
    """The exception an "error" message describes: only shmpipe's own
    classes, built from plain values of the types they expect (a malformed
    message is a GroupError that says so)."""
    try:
        _, kind, args = message
        if not isinstance(args, list):
            raise TypeError("arguments are not a list")
        if kind == "worker_died":
            worker, pid, exitcode, reason = args
            _expect(worker, int)
            _expect(pid, int, None)
            _expect(exitcode, int, None)
            _expect(reason, str, None)
            return WorkerDiedError(worker, pid, exitcode, reason)
        if kind == "worker":
            worker, pid, exc_type, text, remote_traceback = args
            _expect(worker, int)
            _expect(pid, int, None)
            _expect(exc_type, str)
            _expect(text, str)
            _expect(remote_traceback, str)
            return WorkerError(worker, pid, exc_type, text, remote_traceback)
        (text, *rest) = args
        _expect(text, str)
        if kind == "rank_died":
            (rank,) = rest
            _expect(rank, int)
            return RankDiedError(text, rank)
        if kind == "start":
            return GroupStartError(text)
        if kind == "timeout":
            return PipelineTimeoutError(text)
        return GroupError(text)
    except _MALFORMED:
        return GroupError(f"rank 0 reported an error in a malformed message: {message!r:.200}")


def _expect(value: Any, *types: type | None) -> None:
    """`value` is exactly of one of `types` (None: is None; bool is not an int)."""
    if not any(value is None if t is None else type(value) is t for t in types):
        raise TypeError(f"{value!r:.40} is not {types}")


# -- rank 0: the leader ----------------------------------------------------------


class _Link:
    """The leader's end of one rank's connection."""

    __slots__ = ("dealt", "held", "pid", "pidfd", "rank", "sock", "state")

    def __init__(self, sock: socket.socket, rank: int, pid: int, pidfd: int | None) -> None:
        self.sock = sock
        self.rank = rank
        self.pid = pid  # from SO_PEERCRED (the kernel's word, not the rank's)
        self.pidfd = pidfd
        #: "live"; "left" (said bye: its connection stays open until the
        #: batches it still holds are gone, so their slots stay pinned);
        #: "closed" (the connection ended: nothing is pinned any more).
        self.state = "live"
        #: token -> the batch dealt to this rank and not yet released: its
        #: root holds the slot, so dropping it frees the slot.
        self.held: dict[int, SharedBatch] = {}
        self.dealt = 0


class _Leader:
    """Rank 0's side of a group: the listening socket, the pipeline, the
    service thread (joins, releases, barriers, deaths) and the dispatch
    thread (dealing rounds). See the module doc.

    Threads. The service thread alone reads sockets, and alone registers,
    unregisters and closes what it polls (a descriptor closed while another
    thread polls it could be reused under it). The dispatch thread and
    fail() only send, and shut a link's sending side down."""

    def __init__(self, options: PipelineOptions, make_pipeline: Callable[[PipelineOptions], Pipeline]) -> None:
        self.options = options
        self.n = options.num_ranks
        self.group = options.group
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            listener.bind(socket_address(cast(str, options.group)))
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                raise GroupStartError(
                    f"group {self.group!r} already has a rank 0 on this node (another run with the "
                    "same group name, or two processes given rank 0)"
                ) from None
            raise
        listener.listen(self.n + 8)
        self.listener = listener
        self.lock = threading.Condition()
        self.links: dict[int, _Link] = {}
        #: Connected, hello not yet read: socket -> (pid, pidfd) from SO_PEERCRED.
        self.pending: dict[socket.socket, tuple[int, int | None]] = {}
        # poll, not select: select fails on a descriptor >= 1024 (FD_SETSIZE),
        # which a trainer with many open files easily has.
        self.poller = select.poll()
        self.watched: dict[int, tuple[str, Any]] = {}  # fd -> (what, its object)
        self._watch(listener.fileno(), "listener", listener)
        self.begun = [-1] * self.n  # the last pass each rank began
        self.ready = False
        self.failure: list[Any] | None = None  # the "error" message sent to every rank
        self.stopping = threading.Event()
        self.in_pass: int | None = None  # the pass being dealt
        self.dropped_per_pass: list[int] = []
        self.tokens = itertools.count()
        self.deadline = time.monotonic() + options.group_timeout
        self.next_alive_check = 0.0
        try:
            # The pipeline waits without a deadline: a rank that trains
            # slowly holds slots, which is backpressure, not a stuck
            # producer. Each rank applies `timeout` to its own waits.
            self.pipe = make_pipeline(dataclasses.replace(options, timeout=None))  # starts the producers
        except BaseException:
            listener.close()
            raise
        self.service = threading.Thread(target=self._serve, name=f"shmpipe-group-{self.group}-service", daemon=True)
        self.dispatch = threading.Thread(
            target=self._dispatch, name=f"shmpipe-group-{self.group}-dispatch", daemon=True
        )
        self.service.start()

    # -- the service thread ------------------------------------------------------

    def _watch(self, fd: int, what: str, obj: Any) -> None:
        self.poller.register(fd, select.POLLIN)
        self.watched[fd] = (what, obj)

    def _unwatch(self, fd: int | None) -> None:
        if fd is not None and self.watched.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def _serve(self) -> None:
        try:
            while not self.stopping.is_set():
                ended: list[_Link] = []
                for fd, _ in self.poller.poll(int(POLL_S * 1000)):
                    if self.stopping.is_set():
                        break
                    what, obj = self.watched.get(fd, ("", None))
                    if what == "listener":
                        self._accept()
                    elif what == "hello":
                        self._hello(obj)
                    elif what == "rank":
                        self._from_rank(obj)
                    elif what == "exit":
                        ended.append(obj)
                ended += self._ended_without_pidfd()
                for link in ended:
                    if link.state != "closed":
                        self._from_rank(link)  # its last words (releases, bye) first
                    if link.state != "closed":  # a child it forked holds its socket open
                        self._connection_ended(link)
                if not self.ready and time.monotonic() > self.deadline and self.failure is None:
                    with self.lock:
                        missing = [r for r in range(self.n) if r not in self.links]
                    self.fail(
                        GroupStartError(
                            f"group {self.group!r}: rank(s) {', '.join(map(str, missing))} of {self.n} did "
                            f"not join within {self.options.group_timeout:g} s (group_timeout)"
                        )
                    )
        except BaseException as exc:  # a bug here must not leave the ranks waiting
            if not self.stopping.is_set():
                self.fail(exc)

    def _ended_without_pidfd(self) -> list[_Link]:
        """Ranks without a pidfd whose process is gone (looked at every POLL_S)."""
        now = time.monotonic()
        if now < self.next_alive_check:
            return []
        self.next_alive_check = now + POLL_S
        with self.lock:
            links = [link for link in self.links.values() if link.pidfd is None and link.state != "closed"]
        return [link for link in links if not process_alive(link.pid)]

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        try:
            pid, uid = _peer(sock)
        except OSError:
            pid, uid = 0, -1
        if uid != os.getuid():
            sock.close()  # only this user's processes may join (the name is no protection)
            return
        self.pending[sock] = (pid, open_pidfd(pid))
        self._watch(sock.fileno(), "hello", sock)

    def _reject(self, sock: socket.socket, pidfd: int | None, message: list[Any] | None) -> None:
        if message is not None:
            _send_quietly(sock, message)
        sock.close()
        if pidfd is not None:
            os.close(pidfd)

    def _hello(self, sock: socket.socket) -> None:
        self._unwatch(sock.fileno())
        pid, pidfd = self.pending.pop(sock)
        try:
            message, fds = _recv(sock, socket.MSG_DONTWAIT)
        except (GroupError, OSError):
            self._reject(sock, pidfd, None)
            return
        for fd in fds:
            os.close(fd)
        if message is None or len(message) != 4 or message[0] != "hello":
            self._reject(sock, pidfd, None)  # not one of ours
            return
        _, rank, fingerprint, _ = message
        if self.failure is not None:  # tell it why the group failed, as the others heard
            self._reject(sock, pidfd, self.failure)
            return
        ours = _fingerprint(self.options)
        problem = None
        if type(rank) is not int or not 0 <= rank < self.n:
            problem = f"a process (pid {pid}) asked to join as rank {rank!r:.20}; the group has ranks 0 to {self.n - 1}"
        elif rank in self.links:
            problem = f"two processes (pids {self.links[rank].pid} and {pid}) joined as rank {rank}"
        elif fingerprint != ours:
            problem = (
                f"rank {rank} (pid {pid}) calls from_iterators with other arguments than rank 0: "
                f"{fingerprint!r:.300} vs {ours}"
            )
        if problem is not None and self.ready:
            # The group runs, in step: a latecomer (a stray process, a rank
            # started twice) is turned away, the group goes on.
            self._reject(sock, pidfd, _error_message(GroupStartError(f"group {self.group!r}: {problem}")))
            return
        if self.ready:
            exc = GroupStartError(f"group {self.group!r}: rank {rank} (pid {pid}) joined a group that already started")
            self._reject(sock, pidfd, _error_message(exc))
            return
        if problem is not None:
            # Before the start, the group itself is misconfigured (ranks
            # disagree): every rank hears it now rather than at the timeout.
            exc = GroupStartError(f"group {self.group!r}: {problem}")
            self._reject(sock, pidfd, _error_message(exc))
            self.fail(exc)
            return
        link = _Link(sock, rank, pid, pidfd)
        self._watch(sock.fileno(), "rank", link)
        if pidfd is not None:
            self._watch(pidfd, "exit", link)
        with self.lock:
            self.links[rank] = link
            if len(self.links) == self.n:
                self.ready = True
        if self.ready:
            for link in self.links.values():
                _send_quietly(link.sock, ["ready"])
            self.dispatch.start()

    def _from_rank(self, link: _Link) -> None:
        """Every message `link`'s rank has sent (releases come in bursts:
        one wake-up of this thread serves them all)."""
        while link.state != "closed":
            try:
                message, fds = _recv(link.sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except (GroupError, OSError):
                message, fds = None, []
            for fd in fds:
                os.close(fd)  # ranks send no descriptors
            if message is None:
                self._connection_ended(link)
            else:
                self._handle_from_rank(link, message)

    def _handle_from_rank(self, link: _Link, message: list[Any]) -> None:
        kind = message[0]
        if kind == "release" and len(message) == 2 and type(message[1]) is int:
            with self.lock:
                batch = link.held.pop(message[1], None)
            del batch  # its root held the slot: the slot is free now
        elif link.state != "live":
            return  # it said bye: only its releases count now
        elif kind == "begin" and len(message) == 2 and type(message[1]) is int:
            with self.lock:
                self.begun[link.rank] = message[1]
                self.lock.notify_all()
        elif kind == "bye":
            with self.lock:
                link.state = "left"
                mid_pass = self.in_pass
                self.lock.notify_all()
            if mid_pass is not None:
                self.fail(
                    RankDiedError(
                        f"rank {link.rank} (pid {link.pid}) of group {self.group!r} closed its pipeline in the "
                        f"middle of pass {mid_pass}; the other ranks cannot stay in step",
                        link.rank,
                    )
                )
        else:
            self.fail(
                RankDiedError(
                    f"rank {link.rank} (pid {link.pid}) of group {self.group!r} sent a malformed message "
                    f"{message!r:.80}",
                    link.rank,
                )
            )
            self._connection_ended(link)

    def _connection_ended(self, link: _Link) -> None:
        """`link`'s connection ended, or its process did: what the rank held
        is released (its slots go back to the producers). Without "bye"
        first, the rank died: the group fails, and fail() stops the
        producers *before* the slots are freed."""
        if link.state == "live":
            self.fail(
                RankDiedError(
                    f"rank {link.rank} (pid {link.pid}) of group {self.group!r} died; the other ranks cannot "
                    "stay in step",
                    link.rank,
                )
            )
        self._unwatch(link.sock.fileno())
        self._unwatch(link.pidfd)
        with self.lock:
            held, link.held = link.held, {}
            link.state = "closed"
            self.lock.notify_all()
        link.sock.close()
        if link.pidfd is not None:
            os.close(link.pidfd)
            link.pidfd = None
        held.clear()

    def fail(self, exc: BaseException) -> None:
        """The group cannot go on: every rank hears why (once), its
        connection's sending side is shut (so a rank whose message was lost
        still sees the group end, never waits for ever), and the pipeline
        stops (producers end, slots free as batches go). Any thread."""
        with self.lock:
            if self.failure is not None:
                return
            self.failure = _error_message(exc)
            links = [link for link in self.links.values() if link.state != "closed"]
            self.lock.notify_all()
        for link in links:
            if link.state == "live" and not _send_quietly(link.sock, self.failure):
                # Too large for this socket's buffer (net.core.wmem_default
                # set low), or the rank is going: a short one, then.
                _send_quietly(link.sock, ["error", "group", [f"group {self.group!r} failed: {type(exc).__name__}"]])
            try:
                link.sock.shutdown(socket.SHUT_WR)  # releases still come in
            except OSError:
                pass
        self.pipe.close()  # wakes the dispatcher if it waits in the pipeline

    # -- the dispatch thread -------------------------------------------------------

    def _dispatch(self) -> None:
        pass_no = 0
        shared = False
        # Batches taken and not yet dealt: each may own a descriptor (a batch
        # larger than a slot), closed here whatever ends the dispatch.
        current: list[tuple[SharedBatch, int, int]] = []
        try:
            while True:
                with self.lock:
                    while not self._all_began(pass_no):
                        if self.failure is not None or self.stopping.is_set():
                            return
                        self.lock.wait(POLL_S)
                    self.in_pass = pass_no
                it = iter(self.pipe)  # the first starts pass 0, the pipeline's first
                for batch in it:
                    channel = self.pipe.channel
                    assert channel is not None
                    current.append((batch, channel.last_worker, channel.last_nbytes))
                    del batch
                    if not shared:
                        self._share_ring()
                        shared = True
                    if len(current) == self.n:
                        self._deal(pass_no, current)
                dropped = len(current)
                for batch, _, _ in current:
                    batch.close_fd()
                current.clear()  # the remainder's slots go back
                with self.lock:
                    self.dropped_per_pass.append(dropped)
                    self.in_pass = None
                    links = [link for link in self.links.values() if link.state == "live"]
                for link in links:
                    _send_quietly(link.sock, ["end", pass_no, dropped])
                pass_no += 1
        except BaseException as exc:
            if not self.stopping.is_set():
                self.fail(exc)
        finally:
            for batch, _, _ in current:
                batch.close_fd()
            current.clear()

    def _all_began(self, pass_no: int) -> bool:
        """Every rank began `pass_no` (a rank that left between passes makes
        the next one impossible: that is a failure, not a wait)."""
        for rank, link in self.links.items():
            if link.state != "live":
                raise RankDiedError(
                    f"rank {rank} (pid {link.pid}) of group {self.group!r} closed its pipeline, so pass "
                    f"{pass_no} cannot start in step",
                    rank,
                )
        return all(b >= pass_no for b in self.begun)

    def _share_ring(self) -> None:
        channel = self.pipe.channel
        assert channel is not None
        share, fds = channel.share_with_ranks()
        try:
            with self.lock:
                links = [link for link in self.links.values() if link.state == "live"]
            for link in links:
                _send_quietly(link.sock, ["ring", share], fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _deal(self, pass_no: int, batches: list[tuple[SharedBatch, int, int]]) -> None:
        """One complete round: batch i to rank i. Each batch's descriptor is
        closed once sent (the rank has its own now); on an error the caller
        closes those of the batches not reached."""
        for rank, (batch, worker, nbytes) in enumerate(batches):
            try:
                link = self.links[rank]
                token = next(self.tokens)
                with self.lock:
                    live = link.state == "live"
                    if live:
                        link.held[token] = batch  # before the send: a release may come at once
                        link.dealt += 1
                if live:
                    # A failed send means the rank is gone: its end is read by
                    # the service thread, which releases what it held.
                    message = ["batch", pass_no, token, list(batch.record), worker, nbytes]
                    _send_quietly(link.sock, message, [batch.fd] if batch.fd is not None else None)
            finally:
                batch.close_fd()
        batches.clear()

    # -- the end --------------------------------------------------------------

    def close(self) -> None:
        self.stopping.set()
        self.pipe.close()  # the producers stop before any slot is freed below
        for thread in (self.service, self.dispatch):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5.0)
        with self.lock:
            links = list(self.links.values())
            for link in links:
                link.held.clear()
                link.state = "closed"
        for link in links:
            link.sock.close()
            if link.pidfd is not None:
                os.close(link.pidfd)
                link.pidfd = None
        for sock, (_, pidfd) in list(self.pending.items()):
            self._reject(sock, pidfd, None)
        self.pending.clear()
        self.listener.close()

    def stats(self) -> GroupStats:
        with self.lock:
            dealt = tuple(self.links[r].dealt if r in self.links else 0 for r in range(self.n))
            dropped = tuple(self.dropped_per_pass)
        return GroupStats(
            group=cast(str, self.group),
            num_ranks=self.n,
            batches_per_rank=dealt,
            dropped_per_pass=dropped,
            dropped_remainder=sum(dropped),
            passes=len(dropped),
            pipeline=self.pipe.stats(),
        )


# -- every rank: the client ------------------------------------------------------


@dataclass(frozen=True)
class _RankSpec:
    """What adapters (to_tf_dataset) ask of ``pipe.spec`` in a rank."""

    consumer_may_hold: int


class _RankPass:
    __slots__ = ("finished", "pass_no", "pipe", "started_ns")

    def __init__(self, pipe: RankPipeline, pass_no: int) -> None:
        self.pipe = pipe
        self.pass_no = pass_no
        self.finished = False
        self.started_ns: int | None = None

    def __iter__(self) -> _RankPass:
        return self

    def __next__(self) -> Any:
        return self.pipe._next(self)


def _connect(address: str, group: str, deadline: float) -> socket.socket:
    """Connects to rank 0 of `group`, trying again until `deadline` (ranks
    start in any order)."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(address)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
        except BaseException:
            sock.close()
            raise
        if time.monotonic() > deadline:
            raise GroupStartError(f"group {group!r}: rank 0 did not start listening within the group_timeout")
        time.sleep(0.02)


class _Connection:
    """A rank's connection to rank 0, shared by the rank and the leases of
    the batches it holds (a batch's last array can go in any thread).

    Lifetime. Rank 0 frees a batch's slot when the rank says "release", or
    when this connection ends. So close() says "bye" but keeps the socket
    open while batches dealt to this rank are alive, and the last release
    closes it: ending it at close() would let the producers overwrite arrays
    the user still holds ("batches still held stay valid"). A rank that
    never lets go of a batch keeps its socket until it exits, as a pipeline
    keeps a slot.

    Sends need no lock (a datagram is written whole, see the module doc);
    the lock only orders the count of batches held against the close, and
    is reentrant because a batch can be freed by the garbage collector in
    this very thread, inside the locked span."""

    __slots__ = ("closing", "held", "leader_pidfd", "lock", "sock")

    def __init__(self, sock: socket.socket, leader_pidfd: int | None) -> None:
        self.sock = sock
        self.leader_pidfd = leader_pidfd
        self.lock = threading.RLock()
        self.held = 0
        self.closing = False

    def send(self, message: list[Any]) -> bool:
        return self.sock.fileno() >= 0 and _send_quietly(self.sock, message)

    def releaser(self, token: int) -> Callable[[], None]:
        """What a batch's lease calls, once, when the batch's last array goes."""
        with self.lock:
            self.held += 1

        def release() -> None:
            self.send(["release", token])  # a no-op once rank 0 is gone: it released everything
            with self.lock:
                self.held -= 1
                if self.closing and self.held == 0:
                    self.sock.close()

        return release

    def close(self) -> None:
        """The rank's end (idempotent): "bye", then the socket goes with
        the last batch held (now, if none is)."""
        with self.lock:
            if self.closing:
                return
            self.closing = True
        self.send(["bye"])
        if self.leader_pidfd is not None:
            os.close(self.leader_pidfd)
            self.leader_pidfd = None
        with self.lock:
            if self.held == 0:
                self.sock.close()


class RankPipeline:
    """One rank's share of a pipeline that a group of ranks of this node
    shares (``from_iterators(group=...)``; docs/several-ranks.md).

    Iterate it for one pass (every rank iterates every pass; a pass starts
    when all have begun it); each batch of the group's pipeline goes to
    exactly one rank, and every rank gets the same number per pass. Arrays
    are read-only views of the shared ring. In rank 0 it also owns the
    producers: close it last, or with the others.
    """

    def __init__(
        self, options: PipelineOptions, make_pipeline: Callable[[PipelineOptions], Pipeline] | None = None
    ) -> None:
        self.options = options
        self.rank = options.rank
        self.num_ranks = options.num_ranks
        self.group = cast(str, options.group)
        self._closed = True
        if options.rank == 0 and make_pipeline is None:
            raise GroupError("rank 0 of a group runs the pipeline: make it with shmpipe.from_iterators")
        self._leader = _Leader(options, make_pipeline) if make_pipeline is not None else None
        try:
            deadline = time.monotonic() + options.group_timeout
            sock = _connect(socket_address(self.group), self.group, deadline)
            leader_pidfd = None
            try:
                self._leader_pid, uid = _peer(sock)
                if uid != os.getuid():
                    raise GroupStartError(
                        f"group {self.group!r}: the process listening as rank 0 (pid {self._leader_pid}) "
                        f"runs as uid {uid}, not as this user: refusing to join"
                    )
                # Rank 0's death is seen by its pidfd too: a child it forked
                # may hold its end of this socket open.
                if self._leader_pid != os.getpid():
                    leader_pidfd = open_pidfd(self._leader_pid)
                # poll, not select: select fails on a descriptor >= 1024.
                self._poller = select.poll()
                self._poller.register(sock.fileno(), select.POLLIN)
                if leader_pidfd is not None:
                    self._poller.register(leader_pidfd, select.POLLIN)
                self._conn = _Connection(sock, leader_pidfd)
                _send(sock, ["hello", self.rank, _fingerprint(options), os.getpid()])
                # Rank 0 reports missing ranks at its deadline; a little
                # later here, so its message (which names them) comes first.
                self._wait_ready(deadline + 5.0)
            except BaseException:
                sock.close()
                if leader_pidfd is not None:
                    os.close(leader_pidfd)
                raise
        except BaseException:
            if self._leader is not None:
                self._leader.close()
            raise
        self._reader: RankReader | None = None
        self._failure: ShmpipeError | None = None
        self._pass_no = -1
        self._counters = Counters(options.num_workers)
        self._dropped: list[int] = []
        self._close_hooks: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, _shut_down, self._close_hooks, self._conn, self._leader, os.getpid())
        self._closed = False

    def _receive(self, events: list[tuple[int, int]]) -> tuple[list[Any] | None, list[int]] | None:
        """The message `events` announce (poll's answer), (None, []) when
        rank 0's end or death was seen, None when nothing came after all."""
        try:
            return _recv(self._conn.sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pidfd = self._conn.leader_pidfd
            if pidfd is not None and any(fd == pidfd for fd, _ in events):
                return None, []  # rank 0 ended; a child of it holds the socket open
            return None

    def _leader_gone_without_pidfd(self) -> bool:
        return self._conn.leader_pidfd is None and not process_alive(self._leader_pid)

    def _wait_ready(self, deadline: float) -> None:
        while True:
            events = self._poller.poll(int(POLL_S * 1000))
            got = self._receive(events) if events else None
            if got is None and self._leader_gone_without_pidfd():
                got = None, []
            if got is not None:
                message, fds = got
                for fd in fds:
                    os.close(fd)
                if message is None:
                    raise RankDiedError(f"group {self.group!r}: rank 0 (pid {self._leader_pid}) ended", 0)
                if message[0] == "ready":
                    return
                if message[0] == "error":
                    raise _error_from(message)
                raise GroupError(f"group {self.group!r}: unexpected message before start: {message!r:.80}")
            if time.monotonic() > deadline:
                raise GroupStartError(f"group {self.group!r}: the ranks did not all join in time")

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._check_usable()
        self._pass_no += 1
        if not self._conn.send(["begin", self._pass_no]):
            self._fail(RankDiedError(f"group {self.group!r}: rank 0 (pid {self._leader_pid}) is gone", 0))
        self._counters.pass_started()
        return _RankPass(self, self._pass_no)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise PipelineClosedError("this pipeline is closed")

    def _fail(self, exc: ShmpipeError) -> NoReturn:
        """The group failed: this rank lets go of the group (the batches it
        holds stay valid) and raises `exc`, now and on any later use."""
        self._failure = exc
        self.close()
        raise exc

    def _next(self, it: _RankPass) -> Any:
        if it.finished:
            raise StopIteration
        self._check_usable()
        if it.pass_no != self._pass_no:
            raise PipelineClosedError(
                "this iterator belongs to an earlier pass; iterating the pipeline again started a new one"
            )
        t0 = time.perf_counter_ns()
        if it.started_ns is None:
            it.started_ns = t0
        timeout = self.options.timeout
        while True:
            events = self._poller.poll(int(POLL_S * 1000))  # a Ctrl-C here is the user's to have
            if self._closed:  # by another thread (or a hook)
                self._check_usable()
            if events:
                # From the receive to the batch (or the descriptors closed):
                # a Ctrl-C in between would leak a descriptor, or a token
                # whose slot rank 0 then pins until this rank exits.
                with ctrl_c_held_back():
                    try:
                        got = self._receive(events)
                    except GroupError as exc:  # not a message of ours
                        self._fail(exc)
                    except OSError as exc:
                        self._check_usable()  # closed by another thread meanwhile
                        self._fail(GroupError(f"group {self.group!r}: reading from rank 0 failed: {exc}"))
                    batch = _NOTHING if got is None else self._handle(*got, it)
                if batch is _END:
                    raise StopIteration
                if batch is not _NOTHING:
                    assert got is not None and got[0] is not None
                    self._counters.delivered(t0, time.perf_counter_ns(), got[0][5], got[0][4])
                    return batch
                continue
            if self._leader_gone_without_pidfd():
                self._fail(RankDiedError(f"rank 0 (pid {self._leader_pid}) of group {self.group!r} died", 0))
            if timeout is not None and time.perf_counter_ns() - t0 >= timeout * 1e9:
                raise PipelineTimeoutError(f"no batch within {timeout:g} s (rank {self.rank} of group {self.group!r})")

    def _handle(self, message: list[Any] | None, fds: list[int], it: _RankPass) -> Any:
        """One message from rank 0 (None: its end): a batch of this pass,
        _END or _NOTHING. Anything wrong fails the group for this rank,
        as a ShmpipeError (a malformed message too: never a TypeError)."""
        failure: ShmpipeError
        try:
            if message is None:
                raise RankDiedError(
                    f"rank 0 (pid {self._leader_pid}) of group {self.group!r} died or closed the group", 0
                )
            return self._handle_message(message, fds, it)
        except ShmpipeError as exc:  # first: some are ValueErrors too
            failure = exc
        except _MALFORMED as exc:
            failure = GroupError(f"group {self.group!r}: a malformed message from rank 0 ({exc}): {message!r:.80}")
            failure.__cause__ = exc
        finally:
            for fd in fds:
                os.close(fd)
            fds.clear()
        self._fail(failure)

    def _handle_message(self, message: list[Any], fds: list[int], it: _RankPass) -> Any:
        kind = message[0]
        if kind == "batch":
            _, pass_no, token, record, worker, nbytes = message
            _expect(pass_no, int)
            _expect(token, int)
            _expect(record, list)
            _expect(nbytes, int)
            release = self._conn.releaser(token)
            if pass_no != it.pass_no:
                release()  # a pass this rank left early: not for it any more
                return _NOTHING
            if self._reader is None:
                release()
                raise GroupError(f"group {self.group!r}: a batch came before the ring")
            if type(worker) is not int or not 0 <= worker < self.options.num_workers:
                release()
                raise GroupError(f"group {self.group!r}: a batch record names worker {worker!r:.20}")
            fd = fds[0] if len(fds) == 1 else None
            if len(fds) > 1:
                release()
                raise GroupError(f"group {self.group!r}: a batch came with {len(fds)} descriptors")
            return self._reader.read(tuple(record), fd, release)  # fd: ours to close (the caller does)
        if kind == "ring" and len(message) == 2 and isinstance(message[1], dict) and self._reader is None:
            taken = fds[:]
            fds.clear()
            self._reader = self.options.transport.rank_reader(message[1], taken)  # closes `taken`
            return _NOTHING
        if kind == "end" and len(message) == 3:
            _, pass_no, dropped = message
            _expect(pass_no, int)
            _expect(dropped, int)
            if pass_no != it.pass_no:
                return _NOTHING
            self._dropped.append(dropped)
            it.finished = True
            assert it.started_ns is not None
            self._counters.pass_finished(it.started_ns)
            return _END
        if kind == "error":
            raise _error_from(message)
        raise GroupError(f"group {self.group!r}: unexpected message from rank 0: {message!r:.80}")

    # -- start and stop ---------------------------------------------------------

    def close(self) -> None:
        """Leaves the group (in rank 0: stops the producers and the group).
        Idempotent, and from any thread (a wait for a batch in another
        thread raises PipelineClosedError). Batches still held stay valid.
        Closing in the middle of a pass fails the group for the other ranks
        (they could not stay in step); close every rank after the same pass."""
        self._closed = True
        if self._reader is not None:
            self._reader.close()
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def call_on_close(self, hook: Callable[[], None]) -> None:
        """See Pipeline.call_on_close."""
        if self._closed:
            raise PipelineClosedError("this pipeline is closed")
        self._close_hooks.append(hook)

    def __enter__(self) -> RankPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what adapters and users read ------------------------------------------------

    @property
    def channel(self) -> RankReader | None:
        """This rank's reader of the shared ring (None before the first batch)."""
        return self._reader

    @property
    def spec(self) -> _RankSpec:
        spec = ChannelSpec(num_workers=self.num_workers, capacity=self.capacity, ordered=self.ordered)
        per_rank = (spec.consumer_may_hold - (self.num_ranks - 1)) // self.num_ranks
        return _RankSpec(consumer_may_hold=max(1, per_rank))

    @property
    def num_workers(self) -> int:
        return self.options.num_workers

    @property
    def capacity(self) -> int:
        return self.options.capacity

    @property
    def ordered(self) -> bool:
        return self.options.ordered

    @property
    def transport(self) -> Any:
        return self.options.transport

    def stats(self) -> PipelineStats:
        """This rank's counters (what it received and waited), with
        ``extra``: rank, num_ranks, group, dropped_remainder (batches of the
        group's passes dealt to no rank: the incomplete last rounds)."""
        snap = self._counters.snapshot(
            producer_blocked_s=[None] * self.num_workers,
            transport=self.options.transport.name,
            capacity=self.capacity,
            slot_size=None,
        )
        extra = {
            "rank": self.rank,
            "num_ranks": self.num_ranks,
            "group": self.group,
            "dropped_remainder": sum(self._dropped),
            "dropped_per_pass": list(self._dropped),
        }
        return PipelineStats(**{**snap.__dict__, "extra": extra})

    def group_stats(self) -> GroupStats:
        """Rank 0 only: batches dealt to each rank, the remainders dropped,
        and the stats of the pipeline that feeds the group."""
        if self._leader is None:
            raise GroupError("group_stats() is rank 0's: the other ranks see their own stats()")
        return self._leader.stats()

    @property
    def pids(self) -> list[int | None]:
        """Rank 0: the producers' process ids; other ranks: []."""
        return self._leader.pipe.pids if self._leader is not None else []

    def to_torch(self, device: Any = None, pin_memory: bool = False, non_blocking: bool = True) -> TorchBatches:
        """See Pipeline.to_torch (``device=f"cuda:{rank}"``, typically)."""
        from shmpipe._torch import TorchBatches

        return TorchBatches(cast("Pipeline", self), device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    def to_tf_dataset(
        self, output_signature: Any = None, *, device: str | None = None, batches_per_pass: int | None = None
    ) -> tf.data.Dataset:
        """See Pipeline.to_tf_dataset."""
        from shmpipe._tf import to_tf_dataset

        return to_tf_dataset(
            cast("Pipeline", self), output_signature, device=device, batches_per_pass=batches_per_pass
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pass {self._pass_no}"
        return f"<shmpipe.RankPipeline rank {self.rank} of {self.num_ranks}, group {self.group!r}, {state}>"


_NOTHING = object()
_END = object()


def _shut_down(
    hooks: list[Callable[[], None]], conn: _Connection, leader: _Leader | None, owner_pid: int
) -> None:
    """A rank's end: its close hooks, "bye", and in rank 0 the group. In a
    process forked from the rank it does nothing: the socket is shared with
    the rank, and a "bye" from the child would take the rank out of the group."""
    if os.getpid() != owner_pid:
        return
    try:
        while hooks:
            hooks.pop()()
    finally:
        conn.close()
        if leader is not None:
            leader.close()


def join_group(options: PipelineOptions, make_pipeline: Callable[[PipelineOptions], Pipeline]) -> RankPipeline:
    """from_iterators(group=...): this process's rank of the group (rank 0
    runs the group's pipeline, made by `make_pipeline`: the Pipeline class,
    passed in so that this module does not import the one that imports it)."""
    return RankPipeline(options, make_pipeline if options.rank == 0 else None)
