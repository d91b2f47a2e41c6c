"""Rank 0's side of a group: the leader.

It runs the group's pipeline (a DealingPipeline: its batches come
undecoded), lets the ranks in (its door, _door.py, reads their hellos; the
leader judges them), and has two threads: the service thread (joins,
releases, barriers, deaths: it alone reads sockets) and the dispatch thread
(dealing rounds of batches). See the package doc."""

from __future__ import annotations

import enum
import itertools
import os
import select
import socket
import threading
import time
import warnings
from typing import Any

from shmpipe._group import _wire
from shmpipe._group._door import Door
from shmpipe._group._options import GroupOptions
from shmpipe._options import PipelineOptions
from shmpipe._pipeline import Pipeline
from shmpipe._process import ProcessWatch
from shmpipe._schedule import DatasetSchedule, Schedule, start_problem
from shmpipe._stats import GroupStats
from shmpipe._stream import POLL_S
from shmpipe.errors import (
    GroupError,
    GroupLaunchError,
    GroupStartError,
    PipelineClosedError,
    RankDiedError,
    ShmpipeWarning,
    users_stacklevel,
)
from shmpipe.transport import ConsumerEnd, SharedBatch, SharingConsumerEnd

__all__ = ["DealingPipeline", "Leader"]

#: How long rank 0's close waits, at most, for the other ranks to end a
#: pass (less if group_timeout is less): a rank that stopped at its share
#: and waits in a collective for rank 0 would otherwise hold it for ever.
CLOSE_WAIT_S = 60.0
#: How long rank 0's close waits for the end of a pass still being dealt
#: (it comes with the producers' last batches: rank 0 at its share before
#: it is no close in the middle of the pass).
DEAL_END_WAIT_S = 1.0


class DealingPipeline(Pipeline):
    """Rank 0's pipeline of a group: the channel's batches come undecoded
    (SharedBatch objects: each rank decodes its own in its own mapping), so
    it takes them with ``take_shared`` and never by the fast path."""

    _offers_fast_path = False
    _hands_channel_on = True  # the ring's memory goes to the ranks with the first batch
    _makes_first_batches = False  # its batches are the ranks', taken from the ring

    def _take_from(self, channel: ConsumerEnd, pass_no: int, worker: int, wseq: int) -> Any:
        if not isinstance(channel, SharingConsumerEnd):
            raise GroupError(
                f"the {self.transport.name!r} transport claims serves_ranks, but its consumer end "
                f"{type(channel).__name__} is not a SharingConsumerEnd"
            )
        return channel.take_shared(pass_no, worker, wseq, POLL_S)


class LinkState(enum.Enum):
    #: In the group.
    LIVE = "live"
    #: Said bye: its connection stays open until the batches it still holds
    #: are gone, so their slots stay pinned; only its releases count.
    LEFT = "left"
    #: The connection ended: nothing is pinned any more.
    CLOSED = "closed"


class _Watched(enum.Enum):
    """What a descriptor the service thread polls is."""

    DOOR = "door"  # the listener, or a connection whose hello has not been read (_door)
    RANK = "rank"  # a rank's connection
    EXIT = "exit"  # a rank's process watch (its pidfd)


class _Link:
    """The leader's end of one rank's connection."""

    __slots__ = ("dealt", "dealt_in_pass", "held", "pid", "rank", "sock", "state", "watch")

    def __init__(self, sock: socket.socket, rank: int, pid: int, watch: ProcessWatch) -> None:
        self.sock = sock
        self.rank = rank
        self.pid = pid  # from SO_PEERCRED (the kernel's word, not the rank's)
        #: Its process's end: a socket's end is not enough (a child it
        #: forked keeps the socket open).
        self.watch = watch
        self.state = LinkState.LIVE
        #: token -> the batch dealt to this rank and not yet released: its
        #: root holds the slot, so dropping it frees the slot.
        self.held: dict[int, SharedBatch] = {}
        self.dealt = 0
        #: (pass, batches of it dealt to this rank): of the pass dealt last
        self.dealt_in_pass = (-1, 0)


class Leader:
    """Rank 0's side of a group: its door (the listening socket), the
    pipeline, the service thread and the dispatch thread. See the package
    doc.

    Threads. The service thread alone reads sockets, and alone registers,
    unregisters and closes what it polls (a descriptor closed while another
    thread polls it could be reused under it). The dispatch thread and
    fail() only send, and shut a link's sending side down."""

    def __init__(self, options: PipelineOptions, group: GroupOptions, schedule: Schedule) -> None:
        self.options = options
        self.schedule = schedule
        self.group_options = group
        self.n = group.num_ranks
        self.group = group.name
        #: This launch's proof and restart count: a hello must show both.
        self.proof = _wire.launch_proof(group.name, group.launch)
        self.restart = group.launch.restart if group.launch is not None else None
        # poll, not select: select fails on a descriptor >= 1024 (FD_SETSIZE), which a trainer with many open files has.
        self.poller = select.poll()
        self.watched: dict[int, tuple[_Watched | None, Any]] = {}  # fd -> (what, its object)
        self.door = Door(group.name, self.n + 8, lambda fd, obj: self._watch(fd, _Watched.DOOR, obj), self._unwatch)
        # Taken as `with self.mutex:`, a C lock's __enter__ that a signal handler's exception cannot cut from
        # its block (Condition.__enter__ is Python code); waited on and notified through the condition.
        self.mutex = threading.RLock()
        self.lock = threading.Condition(self.mutex)
        self.links: dict[int, _Link] = {}
        self.begun = [-1] * self.n  # the last pass each rank began
        self.told_orders: set[int] = set()  # ranks whose sampler drew another order: said once
        #: each rank's last "begin": (pass, DatasetSchedule.start_point), checked as it is dealt
        self.starts: dict[int, tuple[int, str | None]] = {}
        #: The last pass each rank took whole (it read the pass's "end"), and
        #: the last pass every rank is past ("complete" sent): a rank's pass
        #: ends only then, so a rank that dies holding batches of the pass
        #: fails the others even when it was the group's last pass.
        self.taken = [-1] * self.n
        self.completed = -1
        self.ready = False
        self.failure: list[Any] | None = None  # the "error" message sent to every rank
        #: Set once by close, read by the threads: a plain flag, not an Event
        #: (Event.set takes a lock in Python code, where a signal handler's
        #: exception can leave it held, and the next close then waits on it).
        self.stopping = False
        self.in_pass: int | None = None  # the pass being dealt
        self.dropped_per_pass: list[int] = []
        self.tokens = itertools.count()
        self.deadline = time.monotonic() + group.timeout
        self.next_alive_check = 0.0
        self.ring_shared = False  # the ring's memory went to the ranks (with the first batch)
        named = f"shmpipe-group-{self.group}"
        self.service = threading.Thread(target=self._serve, name=f"{named}-service", daemon=True)
        self.dispatch = threading.Thread(target=self._dispatch, name=f"{named}-dispatch", daemon=True)
        try:
            # The pipeline (it starts the producers) waits without a deadline: a rank that trains
            # slowly holds slots, which is backpressure, not a stuck producer. Each rank applies
            # `timeout` to its own waits.
            self.pipe = DealingPipeline(options._replace(timeout=None), schedule)
            self.service.start()
        except BaseException:  # a Ctrl-C too: nothing of a half-made leader outlives the call
            if "pipe" in vars(self):
                self._close()  # the producers, the service thread if it began, the door
            else:
                self.door.close()
            raise

    # -- the service thread ------------------------------------------------------

    def _watch(self, fd: int, what: _Watched, obj: Any) -> None:
        self.poller.register(fd, select.POLLIN)
        self.watched[fd] = (what, obj)

    def _unwatch(self, fd: int | None) -> None:
        if fd is not None and self.watched.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def _serve(self) -> None:
        try:
            while not self.stopping:
                self._serve_once()
        except BaseException as exc:  # a bug here must not leave the ranks waiting
            if not self.stopping:
                self.fail(exc)

    def _serve_once(self) -> None:
        """One poll: what arrived, the ranks that ended, the start deadline."""
        ended: list[_Link] = []
        for fd, _ in self.poller.poll(int(POLL_S * 1000)):
            if self.stopping:
                return
            what, obj = self.watched.get(fd, (None, None))  # obj: what `what` says it is
            if what is _Watched.DOOR:
                knock = self.door.knocked(obj)
                if knock is not None:
                    self._admit(*knock)
            elif what is _Watched.RANK:
                self._from_rank(obj)
            elif what is _Watched.EXIT:
                ended.append(obj)
        for link in ended + self._ended_unpolled():
            if link.state is not LinkState.CLOSED:
                self._from_rank(link)  # its last words (releases, bye) first
            if link.state is not LinkState.CLOSED:  # a child it forked holds its socket open
                self._connection_ended(link)
        self.door.tick()
        if not self.ready and time.monotonic() > self.deadline and self.failure is None:
            with self.mutex:
                missing = [r for r in range(self.n) if r not in self.links]
            self.fail(
                GroupStartError(
                    f"group {self.group!r}: rank(s) {', '.join(map(str, missing))} of {self.n} did "
                    f"not join within {self.group_options.timeout:g} s (group_timeout)"
                )
            )

    def _ended_unpolled(self) -> list[_Link]:
        """Ranks whose watch has no pidfd to poll and whose process is gone
        (looked at every POLL_S)."""
        now = time.monotonic()
        if now < self.next_alive_check:
            return []
        self.next_alive_check = now + POLL_S
        with self.mutex:
            unpolled = [link for link in self.links.values() if link.watch.fileno() is None]
            links = [link for link in unpolled if link.state is not LinkState.CLOSED]
        return [link for link in links if not link.watch.alive()]

    def _admit(self, sock: socket.socket, pid: int, watch: ProcessWatch, hello: _wire.Hello) -> None:
        """A well-formed hello from `pid` (the door's): the rank joins, or
        is turned away (a foreign launch, a group failed or started), or,
        before the start, its disagreement with the group fails the group."""
        reject = self.door.reject
        foreign = _wire.other_launch(hello, pid, self.group, self.proof, self.restart, self.group_options.launch)
        if foreign is not None:
            # A leftover of another run or restart, a second job with this
            # name: not the group's to judge (its arguments may well differ)
            # nor to fail; the real rank may still come.
            reject(sock, watch, _wire.error_message(GroupLaunchError(foreign)))
            return
        if self.failure is not None:  # tell it why the group failed, as the others heard
            reject(sock, watch, self.failure)
            return
        problem = self._problem_with(hello, pid)
        if self.ready:
            # The group runs, in step: a latecomer (a stray process, a rank
            # started twice) is turned away, the group goes on.
            problem = problem or f"rank {hello.rank} (pid {pid}) joined a group that already started"
            reject(sock, watch, _wire.error_message(GroupStartError(f"group {self.group!r}: {problem}")))
            return
        if problem is not None:
            # Before the start, the group itself is misconfigured (ranks of
            # one launch disagree): every rank hears it now rather than at
            # the timeout.
            exc = GroupStartError(f"group {self.group!r}: {problem}")
            reject(sock, watch, _wire.error_message(exc))
            self.fail(exc)
            return
        self._join(_Link(sock, hello.rank, pid, watch))

    def _problem_with(self, hello: _wire.Hello, pid: int) -> str | None:
        """What is wrong with a well-formed hello from `pid` of this
        launch (None: nothing)."""
        ours = _wire.fingerprint(self.options, self.group_options, self.schedule.fingerprint())
        rank = hello.rank
        if not 0 <= rank < self.n:
            return f"a process (pid {pid}) asked to join as rank {rank}; the group has ranks 0 to {self.n - 1}"
        if rank in self.links:
            return f"two processes (pids {self.links[rank].pid} and {pid}) joined as rank {rank}"
        if hello.fingerprint != ours:
            what = "from_dataset" if ours["batches"].get("kind") == "from_dataset" else "from_iterators"
            return (
                f"rank {rank} (pid {pid}) calls {what} with other arguments than rank 0: "
                f"{_wire.fingerprint_differences(hello.fingerprint, ours)}"
            )
        return None

    def _join(self, link: _Link) -> None:
        """`link`'s rank joined; the last one to join starts the group."""
        self._watch(link.sock.fileno(), _Watched.RANK, link)
        pidfd = link.watch.fileno()
        if pidfd is not None:
            self._watch(pidfd, _Watched.EXIT, link)
        with self.mutex:
            self.links[link.rank] = link
            if len(self.links) == self.n:
                self.ready = True
        if self.ready:
            for joined in self.links.values():
                _wire.send_quietly(joined.sock, ["ready", self.pipe.seed])
            self.dispatch.start()

    def _from_rank(self, link: _Link) -> None:
        """Every message `link`'s rank has sent (releases come in bursts:
        one wake-up of this thread serves them all)."""
        while link.state is not LinkState.CLOSED:
            try:
                message, fds = _wire.recv(link.sock)
            except BlockingIOError:
                return
            except GroupError as exc:  # not JSON, too long, not an array: the rank lives, and said so
                self._malformed(link, f": {exc}")
                return
            except OSError:
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
            with self.mutex:
                batch = link.held.pop(message[1], None)
            del batch  # its root held the slot: the slot is free now
        elif link.state is not LinkState.LIVE:
            return  # it said bye: only its releases count now
        elif kind == "begin" and len(message) == 3 and self._begins(link.rank, message[1], message[2]):
            with self.mutex:
                self.begun[link.rank] = message[1]
                self.starts[link.rank] = (message[1], message[2])
                self.lock.notify_all()
            self._complete_passes()  # a rank that left a pass early for the next is past it
        elif kind == "taken" and len(message) == 2 and self._takes(link.rank, message[1]):
            self._complete_passes()
        elif kind == "bye" and len(message) == 3 and self._may_say_bye(link, message[1], message[2]):
            self._said_bye(link, message[1], message[2])
            self._complete_passes()  # a rank that left having had its batches waits for nothing
        else:
            self._malformed(link, f" {message!r:.80}")

    def _malformed(self, link: _Link, what: str) -> None:
        self.fail(
            RankDiedError(f"rank {link.rank} (pid {link.pid}) of group {self.group!r} sent a malformed message{what}",
                          link.rank)
        )
        self._connection_ended(link)

    def _begins(self, rank: int, pass_no: Any, start: Any) -> bool:
        """A rank's "begin": of a pass after the one it began last (False: malformed). Usually
        the next; a later one leaves the passes between, as a break leaves the rest of a pass (a
        begin its program's signal handler cut before it was sent: _rank's _begin_pass)."""
        with self.mutex:
            return type(pass_no) is int and pass_no > self.begun[rank] and _wire.is_start(start)

    def _may_say_bye(self, link: _Link, pass_no: Any, had: Any) -> bool:
        """A rank's "bye": of the pass it began last or a later one (its close before that
        pass's begin was sent), having had no more batches of it than were dealt to it (False:
        malformed; more would hide a rank that left with batches not taken)."""
        if type(pass_no) is not int or type(had) is not int:
            return False
        with self.mutex:
            dealt_pass, dealt = link.dealt_in_pass
            began = self.begun[link.rank]
        return pass_no >= began and 0 <= had <= (dealt if dealt_pass == pass_no else 0)

    def _takes(self, rank: int, pass_no: Any) -> bool:
        """A rank's "taken": of the pass it began, once that was dealt whole
        (False: a malformed message, which fails the group: a "taken" of a
        later pass would end passes whose batches the rank never read)."""
        with self.mutex:
            if type(pass_no) is not int or pass_no != self.begun[rank] or pass_no >= len(self.dropped_per_pass):
                return False
            self.taken[rank] = pass_no
        return True

    def _said_bye(self, link: _Link, pass_no: int, had: int) -> None:
        """The rank closed its pipeline in pass `pass_no`, its trainer having
        had `had` batches of it. Leaving in the middle of a pass fails the
        group (the others could not stay in step): with batches dealt to it
        its trainer never had (a break, an exception out of the loop), or
        while the pass is still dealt, once another batch is dealt to it
        (_deal_one). A rank that had all it was dealt, at its share (islice)
        before the deal's end came from the producers, fails nobody."""
        with self.mutex:
            link.state = LinkState.LEFT
            dealt_pass, dealt = link.dealt_in_pass
            begun = self.begun[link.rank]
            missed = dealt - had if dealt_pass == begun == pass_no and self.taken[link.rank] < pass_no else 0
            self.lock.notify_all()
        # (a bye whose pass is not the one begun: a close from another thread
        # racing the begin of the next pass, which then cannot start in step)
        if missed > 0:
            self._left_mid_pass(link, pass_no, f", {missed} of the {dealt} batches dealt to it not taken")

    def _left_mid_pass(self, link: _Link, pass_no: int, detail: str) -> None:
        self.fail(
            RankDiedError(
                f"rank {link.rank} (pid {link.pid}) of group {self.group!r} closed its pipeline in the middle of "
                f"pass {pass_no}{detail}; the other ranks cannot stay in step",
                link.rank,
            )
        )

    def _connection_ended(self, link: _Link) -> None:
        """`link`'s connection ended, or its process did: what the rank held
        is released (its slots go back to the producers). Without "bye"
        first, the rank died: the group fails, and fail() stops the
        producers *before* the slots are freed."""
        if link.state is LinkState.LIVE:
            self.fail(
                RankDiedError(
                    f"rank {link.rank} (pid {link.pid}) of group {self.group!r} died; the other ranks cannot "
                    "stay in step",
                    link.rank,
                )
            )
        self._unwatch(link.sock.fileno())
        self._unwatch(link.watch.fileno())
        with self.mutex:
            held, link.held = link.held, {}
            link.state = LinkState.CLOSED
            self.lock.notify_all()
        link.sock.close()
        link.watch.close()
        held.clear()

    def fail(self, exc: BaseException) -> None:
        """The group cannot go on: every rank hears why (once), its
        connection's sending side is shut (so a rank whose message was lost
        still sees the group end, never waits for ever), and the pipeline
        stops (producers end, slots free as batches go). Any thread."""
        with self.mutex:
            if self.failure is not None:
                return
            self.failure = _wire.error_message(exc)
            links = [link for link in self.links.values() if link.state is not LinkState.CLOSED]
            self.lock.notify_all()
        for link in links:
            if link.state is LinkState.LIVE and not _wire.send_quietly(link.sock, self.failure):
                # Too large for this socket's buffer (net.core.wmem_default
                # set low), or the rank is going: a short one, then.
                short = ["error", "group", [f"group {self.group!r} failed: {type(exc).__name__}"]]
                _wire.send_quietly(link.sock, short)
            try:
                link.sock.shutdown(socket.SHUT_WR)  # releases still come in
            except OSError:
                pass
        self.pipe.close()  # wakes the dispatcher if it waits in the pipeline

    # -- the dispatch thread -------------------------------------------------------

    def _dispatch(self) -> None:
        # Batches taken and not yet dealt: each may own a descriptor (a batch
        # larger than a slot), closed here whatever ends the dispatch.
        current: list[tuple[SharedBatch, int, int]] = []
        try:
            for pass_no in itertools.count():
                if not self._wait_until_all_began(pass_no):
                    return
                self._deal_pass(pass_no, current)
        except BaseException as exc:
            if not self.stopping:
                self.fail(exc)
        finally:
            while current:  # (no loop variable: a failure's traceback keeps this frame)
                current.pop()[0].close_fd()

    def _wait_until_all_began(self, pass_no: int) -> bool:
        """Waits until every rank began `pass_no` (then it is being dealt);
        False if the group failed or stops meanwhile."""
        with self.mutex:
            while not self._all_began(pass_no):
                if self.failure is not None or self.stopping:
                    return False
                self.lock.wait(POLL_S)
            self.in_pass = pass_no
        return True

    def _deal_pass(self, pass_no: int, current: list[tuple[SharedBatch, int, int]]) -> None:
        """Deals pass `pass_no` in complete rounds; the incomplete last
        round is dropped (its slots go back) and counted, with the batches
        the schedule dropped before any was fetched (a dataset's: the
        incomplete last round of the job's, see shmpipe/_nodes.py). A pass
        every rank left for a later one ends there."""
        batches = iter(self.pipe)  # begins the pipeline's pass: the first, pass 0, then the next
        self._check_starts(pass_no)
        left = False
        for batch in batches:
            left = self._left_by_every_rank(pass_no)
            if left:
                # Each rank left this pass for a later one (a break): the rest
                # of it is no one's, and the next pass begins now, as it does
                # for one pipeline, not once the producers made the rest.
                batch.close_fd()
                del batch
                break
            self._hold(batch, current)
            del batch
            if len(current) == self.n:
                self._deal(pass_no, current)
        # The schedule's pass begun last is this one: the next begins only when the pipeline is iterated again.
        # A pass every rank left has no last round: it counts none dropped (the
        # round it was making when it saw that is a matter of timing).
        dropped = 0 if left else len(current) + self.schedule.dropped
        while current:
            current.pop()[0].close_fd()
        with self.mutex:
            self.dropped_per_pass.append(dropped)
            self.in_pass = None
            links = [link for link in self.links.values() if link.state is LinkState.LIVE]
        for link in links:
            _wire.send_quietly(link.sock, ["end", pass_no, dropped])
        self._complete_passes()  # every rank may have left it early for the next

    def _left_by_every_rank(self, pass_no: int) -> bool:
        """Every rank began a pass after `pass_no` (a rank that left the group began none)."""
        with self.mutex:
            return all(began > pass_no for began in self.begun)

    def _hold(self, batch: SharedBatch, current: list[tuple[SharedBatch, int, int]]) -> None:
        """The batch just taken, to the round being made (not in _deal_pass: a local there naming
        the channel kept the ring mapped until a collection, its frame in a failure's traceback)."""
        channel = self.pipe.channel
        if channel is None:  # closed from another thread since the take (Pipeline._after_shutdown)
            raise PipelineClosedError("the pipeline was closed")
        current.append((batch, channel.last_worker, channel.last_nbytes))
        if not self.ring_shared:
            self._share_ring(channel)

    def _check_starts(self, pass_no: int) -> None:
        """Every rank's count of a dataset's pass begins where rank 0's
        pipeline does (each loaded the same state, or none), in the same
        order (start_problem). One in the next pass already is not compared."""
        if isinstance(self.schedule, DatasetSchedule):
            ours = self.schedule.start_point()
            with self.mutex:
                theirs = sorted((rank, start) for rank, (p, start) in self.starts.items() if p == pass_no)
            for rank, start in theirs:
                problem = start_problem(start, ours)
                if problem is not None and problem[0]:
                    raise GroupError(f"group {self.group!r}, pass {pass_no}: rank {rank} {problem[1]}")
                if problem is not None and rank not in self.told_orders:  # said once a rank
                    self.told_orders.add(rank)
                    warnings.warn(f"group {self.group!r}: rank {rank} {problem[1]}", ShmpipeWarning, stacklevel=1)

    def _complete_passes(self) -> None:
        """Tells every rank the passes every rank is now past: a rank's
        pass ends (StopIteration) only on this word, so the batches a rank
        dies with are never lost in silence, in the group's last pass too
        (the next pass's barrier would catch a death in any other). A rank
        is past pass p once it took the whole pass (it read "end p"), began
        a later one, or left the group after p was dealt (said bye: its
        choice; a death fails the group instead). Service and dispatch
        threads."""
        with self.mutex:
            dealt = len(self.dropped_per_pass)  # passes dealt whole ("end" sent)
            pass_no = self.completed
            while pass_no + 1 < dealt and self.failure is None and self._all_past(pass_no + 1):
                pass_no += 1
            if pass_no == self.completed:
                return
            self.completed = pass_no
            self.lock.notify_all()  # a close waiting for it (_let_the_ranks_end_the_pass)
            links = [link for link in self.links.values() if link.state is LinkState.LIVE]
        for link in links:
            _wire.send_quietly(link.sock, ["complete", pass_no])

    def _all_past(self, pass_no: int) -> bool:
        """Every rank is past `pass_no` (see _complete_passes); the lock held."""
        return all(
            link.state is not LinkState.LIVE or self.taken[rank] >= pass_no or self.begun[rank] > pass_no
            for rank, link in self.links.items()
        )

    def _all_began(self, pass_no: int) -> bool:
        """Every rank began `pass_no`. A rank that left between passes makes
        the next one impossible: a failure, once a rank begins it (until
        then the others may still be ending the pass before, which rank 0
        leaving at its share does not fail: _let_the_ranks_end_the_pass)."""
        if any(link.state is LinkState.LIVE and self.begun[rank] >= pass_no for rank, link in self.links.items()):
            for rank, link in self.links.items():
                if link.state is not LinkState.LIVE:
                    raise RankDiedError(
                        f"rank {rank} (pid {link.pid}) of group {self.group!r} closed its pipeline, so pass "
                        f"{pass_no} cannot start in step",
                        rank,
                    )
        return all(b >= pass_no for b in self.begun)

    def _share_ring(self, channel: ConsumerEnd) -> None:
        """Sends every rank the ring's geometry and a descriptor of its
        memory (once, after the first batch is recorded: the ring of a
        transport sized by its first batch exists only then)."""
        self.ring_shared = True
        assert isinstance(channel, SharingConsumerEnd)
        share, fds = channel.share_with_ranks()
        try:
            with self.mutex:
                links = [link for link in self.links.values() if link.state is LinkState.LIVE]
            for link in links:
                _wire.send_quietly(link.sock, ["ring", share], fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _deal(self, pass_no: int, batches: list[tuple[SharedBatch, int, int]]) -> None:
        """One complete round: batch i to rank i. Each batch's descriptor is
        closed once sent (the rank has its own now); on an error the caller
        closes those of the batches not reached."""
        for rank, (batch, worker, nbytes) in enumerate(batches):
            try:
                self._deal_one(self.links[rank], pass_no, batch, worker, nbytes)
            finally:
                batch.close_fd()
        batches.clear()

    def _deal_one(self, link: _Link, pass_no: int, batch: SharedBatch, worker: int, nbytes: int) -> None:
        token = next(self.tokens)
        with self.mutex:
            left = link.state is not LinkState.LIVE
            if not left:
                link.held[token] = batch  # before the send: a release may come at once
                link.dealt += 1
                last_pass, in_pass = link.dealt_in_pass
                link.dealt_in_pass = (pass_no, in_pass + 1 if last_pass == pass_no else 1)
        if left:
            # It closed in this pass (a death has failed the group already):
            # this batch, and its place in the round, cannot be had.
            self._left_mid_pass(link, pass_no, ": a batch of it was dealt to it after it closed")
            return
        # A failed send means the rank is gone: the service thread reads its end and releases what it held.
        message = ["batch", pass_no, token, list(batch.record), worker, nbytes]
        _wire.send_quietly(link.sock, message, [batch.fd] if batch.fd is not None else None)

    # -- the end --------------------------------------------------------------

    def close(self) -> None:
        try:
            self._let_the_ranks_end_the_pass()
        finally:
            self._close()

    def _let_the_ranks_end_the_pass(self) -> None:
        """Rank 0 closing after it had its share of a pass: the others may
        still be taking theirs, and only this leader can tell them the pass
        is complete. It waits for them (up to group_timeout, at most
        CLOSE_WAIT_S, then warns), so a rank 0 that stops at its share
        (islice) and closes first fails nobody. Where the deal's end has not
        come from the producers yet, it waits DEAL_END_WAIT_S for it (it
        comes with their last batches), then fails the group: rank 0 closed
        in the middle of the pass (a close from another thread, producers
        that stall). A failure ends the wait; a close from the leader's own
        threads does not wait (the service thread reads the ranks' words)."""
        if threading.current_thread() in (self.service, self.dispatch):
            return
        now = time.monotonic()
        waited = min(self.group_options.timeout, CLOSE_WAIT_S)
        deadline, deal_deadline = now + waited, now + DEAL_END_WAIT_S
        with self.mutex:
            while self.failure is None and (
                self.in_pass is not None or self.completed < len(self.dropped_per_pass) - 1
            ):
                now = time.monotonic()
                if self.in_pass is not None and now >= deal_deadline:
                    mid_pass = self.in_pass
                    break
                if now >= deadline:
                    self._warn_closing_before(self.completed + 1, waited)
                    return
                self.lock.wait(POLL_S)
            else:
                return
        self.fail(
            RankDiedError(
                f"rank 0 (pid {os.getpid()}) of group {self.group!r} closed its pipeline in the middle of pass "
                f"{mid_pass}; the other ranks cannot stay in step",
                0,
            )
        )

    def _warn_closing_before(self, pass_no: int, waited: float) -> None:
        """Rank 0 closes though ranks have not ended `pass_no` (the lock held)."""
        live = [rank for rank, link in self.links.items() if link.state is LinkState.LIVE]
        behind = [rank for rank in live if self.taken[rank] < pass_no and self.begun[rank] <= pass_no]
        warnings.warn(
            f"rank 0 of group {self.group!r} closed after waiting {waited:g} s for rank(s) "
            f"{', '.join(map(str, behind))} to end pass {pass_no}: they get RankDiedError (close rank 0 last, "
            "after every rank has ended the pass; a rank that stops at its share and then waits for rank 0 "
            "should close first)",
            ShmpipeWarning,
            stacklevel=users_stacklevel(),
        )

    def _close(self) -> None:
        self.stopping = True
        self.pipe.close()  # the producers stop before any slot is freed below
        for thread in (self.service, self.dispatch):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5.0)
        with self.mutex:
            links = list(self.links.values())
            for link in links:
                link.held.clear()
                link.state = LinkState.CLOSED
        for link in links:
            link.sock.close()
            link.watch.close()
        self.door.close()

    def stats(self) -> GroupStats:
        with self.mutex:
            dealt = tuple(self.links[r].dealt if r in self.links else 0 for r in range(self.n))
            dropped = tuple(self.dropped_per_pass)
        return GroupStats(
            group=self.group, num_ranks=self.n, batches_per_rank=dealt, dropped_per_pass=dropped,
            dropped_remainder=sum(dropped), passes=len(dropped), pipeline=self.pipe.stats(),
        )
