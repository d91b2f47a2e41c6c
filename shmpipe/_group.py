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

Faults. A rank's connection ending without "bye", or with "bye" in the
middle of a pass, fails the group: rank 0 releases what that rank held and
sends every other rank a RankDiedError (at once: the end of a connection is
seen as soon as the kernel closes the dead process's socket). Rank 0 dying
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

import array
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

from shmpipe._options import PipelineOptions
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
#: (below malloc's mmap threshold): errors' texts are clipped to fit.
MAX_MESSAGE = 1 << 16
_MAX_TEXT = 12_000
MAX_FDS = 4
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_FD = array.array("i")


def socket_address(group: str) -> str:
    """The abstract-namespace address of `group` for this user."""
    return f"\0shmpipe-group-{os.getuid()}-{group}"


# -- the wire ------------------------------------------------------------------


def _send(sock: socket.socket, message: list[Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _send_quietly(sock: socket.socket, message: list[Any], fds: list[int] | None = None) -> bool:
    """_send to a peer that may be gone (its end is handled where it is read)."""
    try:
        _send(sock, message, fds)
        return True
    except OSError:
        return False


def _recvmsg(sock: socket.socket, flags: int) -> tuple[bytes, list[int], int]:
    """One datagram and the descriptors with it (socket.recv_fds would
    drop `flags`: MSG_DONTWAIT would block). Descriptors arrive close-on-exec."""
    data, ancdata, got, _ = sock.recvmsg(
        MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * _FD.itemsize), flags | socket.MSG_CMSG_CLOEXEC
    )
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), got


def _recv(sock: socket.socket, flags: int = 0) -> tuple[list[Any] | None, list[int]]:
    """The next message and its descriptors; (None, []) at the end of the
    connection. A malformed message is a GroupError (descriptors closed).
    With MSG_DONTWAIT, BlockingIOError when there is none."""
    try:
        data, fds, got = _recvmsg(sock, flags)
    except ConnectionResetError:
        # The peer closed with messages of ours unread: the kernel reports
        # that (once) before the messages it sent us that are still queued.
        # They count (rank 0 sends "end" and then may close), so read on.
        try:
            data, fds, got = _recvmsg(sock, flags)
        except ConnectionResetError:
            return None, []
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        if got & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise GroupError("a group message was larger than allowed (the peer is broken)")
        try:
            message = json.loads(data)
        except ValueError:
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
    """An exception as an "error" message every rank turns back into one
    (long texts, a deep traceback, clipped to fit a message)."""
    message = _error_message_unclipped(exc)
    message[2] = [a[:_MAX_TEXT] + " [...]" if isinstance(a, str) and len(a) > _MAX_TEXT else a for a in message[2]]
    return message


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
    """The exception an "error" message describes (only shmpipe's own
    classes, built from plain values)."""
    try:
        _, kind, args = message
        if kind == "worker_died":
            return WorkerDiedError(*args)
        if kind == "worker":
            return WorkerError(*args)
        if kind == "rank_died":
            return RankDiedError(str(args[0]), int(args[1]))
        if kind == "start":
            return GroupStartError(str(args[0]))
        if kind == "timeout":
            return PipelineTimeoutError(str(args[0]))
        return GroupError(str(args[0]))
    except (TypeError, ValueError, IndexError):
        return GroupError(f"rank 0 reported an error in a malformed message: {message!r:.200}")


# -- rank 0: the leader ----------------------------------------------------------


class _Link:
    """The leader's end of one rank's connection."""

    __slots__ = ("dealt", "held", "pid", "rank", "sock", "state")

    def __init__(self, sock: socket.socket, rank: int, pid: int) -> None:
        self.sock = sock
        self.rank = rank
        self.pid = pid
        self.state = "live"  # then "left" (said bye between passes) or "gone"
        #: token -> the batch dealt to this rank and not yet released: its
        #: root holds the slot, so dropping it frees the slot.
        self.held: dict[int, SharedBatch] = {}
        self.dealt = 0


class _Leader:
    """Rank 0's side of a group: the listening socket, the pipeline, the
    service thread (joins, releases, barriers, deaths) and the dispatch
    thread (dealing rounds). See the module doc."""

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
        self.pending: list[socket.socket] = []  # connected, hello not yet read
        self.begun = [-1] * self.n  # the last pass each rank began
        self.ready = False
        self.failure: list[Any] | None = None  # the "error" message sent to every rank
        self.stopping = threading.Event()
        self.in_pass: int | None = None  # the pass being dealt
        self.dropped_per_pass: list[int] = []
        self.tokens = itertools.count()
        self.deadline = time.monotonic() + options.group_timeout
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

    def _serve(self) -> None:
        try:
            while not self.stopping.is_set():
                with self.lock:
                    links = [link for link in self.links.values() if link.state == "live"]  # others are closed
                socks: list[socket.socket] = [self.listener, *self.pending, *(link.sock for link in links)]
                readable, _, _ = select.select(socks, [], [], POLL_S)
                for sock in readable:
                    if self.stopping.is_set():
                        break
                    if sock is self.listener:
                        self._accept()
                    elif sock in self.pending:
                        self._hello(sock)
                    else:
                        self._from_rank(next(link for link in links if link.sock is sock))
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

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        try:
            _, uid = _peer(sock)
        except OSError:
            uid = -1
        if uid != os.getuid():
            sock.close()  # only this user's processes may join (the name is no protection)
            return
        self.pending.append(sock)

    def _hello(self, sock: socket.socket) -> None:
        self.pending.remove(sock)
        try:
            message, fds = _recv(sock)
        except (GroupError, OSError):
            sock.close()
            return
        for fd in fds:
            os.close(fd)
        if message is None:
            sock.close()
            return
        try:
            _, rank, fingerprint, pid = message
        except ValueError:
            sock.close()
            return
        if type(pid) is not int:
            sock.close()  # not one of ours
            return
        if self.failure is not None:  # tell it why the group failed, as the others heard
            _send_quietly(sock, self.failure)
            sock.close()
            return
        ours = _fingerprint(self.options)
        problem = None
        if type(rank) is not int or not 0 <= rank < self.n:
            problem = f"a process (pid {pid}) asked to join as rank {rank!r}; the group has ranks 0 to {self.n - 1}"
        elif rank in self.links:
            problem = f"two processes (pids {self.links[rank].pid} and {pid}) joined as rank {rank}"
        elif fingerprint != ours:
            problem = (
                f"rank {rank} (pid {pid}) calls from_iterators with other arguments than rank 0: "
                f"{fingerprint} vs {ours}"
            )
        elif self.ready:
            problem = f"rank {rank} (pid {pid}) joined a group that already started"
        if problem is not None:
            exc = GroupStartError(f"group {self.group!r}: {problem}")
            _send_quietly(sock, _error_message(exc))
            sock.close()
            self.fail(exc)
            return
        with self.lock:
            self.links[rank] = _Link(sock, rank, pid)
            if len(self.links) == self.n:
                self.ready = True
        if self.ready:
            for link in self.links.values():
                _send_quietly(link.sock, ["ready"])
            self.dispatch.start()

    def _from_rank(self, link: _Link) -> None:
        """Every message `link`'s rank has sent (releases come in bursts:
        one wake-up of this thread serves them all)."""
        first = True
        while link.state == "live":
            try:
                message, fds = _recv(link.sock, 0 if first else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except (GroupError, OSError):
                message, fds = None, []
            first = False
            self._handle_from_rank(link, message, fds)

    def _handle_from_rank(self, link: _Link, message: list[Any] | None, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)  # ranks send no descriptors
        if message is None:
            self._rank_gone(link, f"rank {link.rank} (pid {link.pid}) of group {self.group!r} died")
            return
        kind = message[0]
        if kind == "release" and len(message) == 2 and type(message[1]) is int:
            with self.lock:
                batch = link.held.pop(message[1], None)
            del batch  # its root held the slot: the slot is free now
        elif kind == "begin" and len(message) == 2 and type(message[1]) is int:
            with self.lock:
                self.begun[link.rank] = message[1]
                self.lock.notify_all()
        elif kind == "bye":
            with self.lock:
                mid_pass = self.in_pass is not None
            if mid_pass:
                self._rank_gone(
                    link,
                    f"rank {link.rank} (pid {link.pid}) of group {self.group!r} closed its pipeline in the "
                    f"middle of pass {self.in_pass}",
                )
            else:
                self._rank_gone(link, None)
        else:
            self._rank_gone(link, f"rank {link.rank} (pid {link.pid}) sent a malformed message {message!r:.80}")

    def _rank_gone(self, link: _Link, why: str | None) -> None:
        """`link`'s rank is gone: what it held is released (the slots go
        back to the producers); with `why`, the group fails."""
        with self.lock:
            held, link.held = link.held, {}
            link.state = "gone" if why is not None else "left"
            self.lock.notify_all()
        link.sock.close()
        held.clear()
        if why is not None:
            self.fail(RankDiedError(why + "; the other ranks cannot stay in step", link.rank))

    def fail(self, exc: BaseException) -> None:
        """The group cannot go on: every rank hears why (once), and the
        pipeline stops (producers end, slots free as batches go)."""
        with self.lock:
            if self.failure is not None:
                return
            self.failure = _error_message(exc)
            links = [link for link in self.links.values() if link.state == "live"]
            self.lock.notify_all()
        for sock in self.pending:
            _send_quietly(sock, self.failure)
        for link in links:
            _send_quietly(link.sock, self.failure)
        self.pipe.close()  # wakes the dispatcher if it waits in the pipeline

    # -- the dispatch thread -------------------------------------------------------

    def _dispatch(self) -> None:
        pass_no = 0
        shared = False
        try:
            while True:
                with self.lock:
                    while not self._all_began(pass_no):
                        if self.failure is not None or self.stopping.is_set():
                            return
                        self.lock.wait(POLL_S)
                    self.in_pass = pass_no
                it = iter(self.pipe)  # the first starts pass 0, the pipeline's first
                current: list[tuple[SharedBatch, int, int]] = []
                for batch in it:
                    if not shared:
                        self._share_ring()
                        shared = True
                    channel = self.pipe.channel
                    assert channel is not None
                    current.append((batch, channel.last_worker, channel.last_nbytes))
                    if len(current) == self.n:
                        self._deal(pass_no, current)
                        current = []
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

    def _all_began(self, pass_no: int) -> bool:
        """Every rank began `pass_no` (a rank that left between passes makes
        the next one impossible: that is a failure, not a wait)."""
        for rank, link in self.links.items():
            if link.state == "left":
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
        """One complete round: batch i to rank i."""
        for rank, (batch, worker, nbytes) in enumerate(batches):
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
            batch.close_fd()  # the rank has its own descriptor now
        batches.clear()

    # -- the end --------------------------------------------------------------

    def close(self) -> None:
        self.stopping.set()
        self.pipe.close()
        for thread in (self.service, self.dispatch):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5.0)
        with self.lock:
            links = list(self.links.values())
            for link in links:
                link.held.clear()
        for link in links:
            link.sock.close()
        for sock in self.pending:
            sock.close()
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
            self._sock = _connect(socket_address(self.group), self.group, deadline)
            try:
                self._leader_pid, uid = _peer(self._sock)
                if uid != os.getuid():
                    raise GroupStartError(
                        f"group {self.group!r}: the process listening as rank 0 (pid {self._leader_pid}) "
                        f"runs as uid {uid}, not as this user: refusing to join"
                    )
                _send(self._sock, ["hello", self.rank, _fingerprint(options), os.getpid()])
                # Rank 0 reports missing ranks at its deadline; a little
                # later here, so its message (which names them) comes first.
                self._wait_ready(deadline + 5.0)
            except BaseException:
                self._sock.close()
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
        self._finalizer = weakref.finalize(
            self, _shut_down, self._close_hooks, self._sock, self._leader, os.getpid()
        )
        self._closed = False

    def _wait_ready(self, deadline: float) -> None:
        while True:
            ready, _, _ = select.select([self._sock], [], [], POLL_S)
            if ready:
                message, fds = _recv(self._sock)
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
        if not _send_quietly(self._sock, ["begin", self._pass_no]):
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
            readable, _, _ = select.select([self._sock], [], [], POLL_S)
            if not readable:
                if self._closed:
                    raise PipelineClosedError("the pipeline was closed while waiting for a batch")
                if timeout is not None and time.perf_counter_ns() - t0 >= timeout * 1e9:
                    raise PipelineTimeoutError(
                        f"no batch within {timeout:g} s (rank {self.rank} of group {self.group!r})"
                    )
                continue
            try:
                message, fds = _recv(self._sock)
            except GroupError as exc:
                self._fail(exc)
            except OSError as exc:
                self._fail(GroupError(f"group {self.group!r}: reading from rank 0 failed: {exc}"))
            if message is None:
                self._fail(
                    RankDiedError(
                        f"rank 0 (pid {self._leader_pid}) of group {self.group!r} died or closed the group", 0
                    )
                )
            batch = self._handle(message, fds, it)
            if batch is not _NOTHING:
                self._counters.delivered(t0, time.perf_counter_ns(), message[5], message[4])
                return batch

    def _handle(self, message: list[Any], fds: list[int], it: _RankPass) -> Any:
        """One message from rank 0: a batch of this pass, or _NOTHING."""
        kind = message[0]
        try:
            if kind == "batch" and len(message) == 6:
                _, pass_no, token, record, worker, nbytes = message
                if not (type(token) is int and isinstance(record, list) and type(nbytes) is int):
                    self._fail(GroupError(f"group {self.group!r}: a malformed batch message: {message!r:.80}"))
                release = _releaser(self._sock, token)
                if pass_no != it.pass_no or self._reader is None:
                    release()  # a pass this rank left early: not for it any more
                    if self._reader is None:
                        self._fail(GroupError(f"group {self.group!r}: a batch came before the ring"))
                    return _NOTHING
                if type(worker) is not int or not 0 <= worker < self.options.num_workers:
                    release()
                    self._fail(GroupError(f"group {self.group!r}: a batch record names worker {worker!r}"))
                return self._reader.read(tuple(record), fds[0] if fds else None, release)
            if kind == "ring" and len(message) == 2 and self._reader is None:
                taken, fds = fds, []
                self._reader = self.options.transport.rank_reader(message[1], taken)
                return _NOTHING
            if kind == "end" and len(message) == 3:
                if message[1] == it.pass_no:
                    self._dropped.append(int(message[2]))
                    it.finished = True
                    assert it.started_ns is not None
                    self._counters.pass_finished(it.started_ns)
                    raise StopIteration
                return _NOTHING
            if kind == "error":
                self._fail(_error_from(message))
            self._fail(GroupError(f"group {self.group!r}: unexpected message from rank 0: {message!r:.80}"))
        finally:
            for fd in fds:
                os.close(fd)

    # -- start and stop ---------------------------------------------------------

    def close(self) -> None:
        """Leaves the group (in rank 0: stops the producers and the group).
        Idempotent; batches still held stay valid. Closing in the middle of
        a pass fails the group for the other ranks (they could not stay in
        step); close every rank after the same pass."""
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


def _releaser(sock: socket.socket, token: int) -> Callable[[], None]:
    """What a batch's lease calls when the batch's last array goes (in any
    thread; a datagram needs no lock). After close, or when rank 0 is gone,
    it does nothing: rank 0 released everything of this rank already."""

    def release() -> None:
        if sock.fileno() >= 0:
            _send_quietly(sock, ["release", token])

    return release


def _shut_down(
    hooks: list[Callable[[], None]], sock: socket.socket, leader: _Leader | None, owner_pid: int
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
        _send_quietly(sock, ["bye"])
        sock.close()
        if leader is not None:
            leader.close()


def join_group(options: PipelineOptions, make_pipeline: Callable[[PipelineOptions], Pipeline]) -> RankPipeline:
    """from_iterators(group=...): this process's rank of the group (rank 0
    runs the group's pipeline, made by `make_pipeline`: the Pipeline class,
    passed in so that this module does not import the one that imports it)."""
    return RankPipeline(options, make_pipeline if options.rank == 0 else None)
