"""Every rank's side of a group: RankPipeline, a client of rank 0's leader.

A rank connects to the leader (rank 0's, or its own in rank 0), says hello,
waits for the group to be ready, and then in each pass says "begin" and
reads what rank 0 deals it: the ring's memory once, then records of batches
it decodes without a copy (``Transport.rank_reader``). See the package doc.
"""

from __future__ import annotations

import functools
import os
import select
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from shmpipe._counters import Counters
from shmpipe._frameworks import FrameworkStream
from shmpipe._group import _wire
from shmpipe._group._leader import Leader
from shmpipe._group._options import GroupOptions
from shmpipe._interrupts import ctrl_c_held_back
from shmpipe._options import PipelineOptions
from shmpipe._process import ProcessWatch
from shmpipe._schedule import DatasetSchedule, IteratorSchedule, Progress, Schedule
from shmpipe._stats import GroupStats
from shmpipe._stream import POLL_S, Had, Pass, TrainerPosition
from shmpipe.errors import (
    GroupError,
    GroupStartError,
    PipelineClosedError,
    PipelineTimeoutError,
    RankDiedError,
    ShmpipeError,
    ShmpipeValueError,
)
from shmpipe.transport import ChannelSpec, RankReader, ServesRanks

__all__ = ["RankPipeline"]

#: What _handle_message returns for a message that is not a batch.
_NOTHING = object()
_END = object()


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

    Sends need no lock (a datagram is written whole, see _wire.py); the
    lock orders the count of batches held against the close (and the bye
    against the socket's close: see close()), and is reentrant because a
    batch can be freed by the garbage collector in this very thread, inside
    the locked span."""

    __slots__ = ("closing", "held", "leader", "lock", "progress", "said_bye", "sock")

    def __init__(self, sock: socket.socket, leader: ProcessWatch | None, progress: _Progress) -> None:
        self.sock = sock
        self.progress = progress
        #: Rank 0's process (None in rank 0 itself): its end is seen by its
        #: pidfd too, since a child it forked may hold its socket open.
        self.leader = leader
        self.lock = threading.RLock()
        self.held = 0
        self.closing = False
        self.said_bye = False

    def send(self, message: list[Any], _finalizing: Callable[[], bool] = sys.is_finalizing) -> bool:
        # A batch's last array, and with it its release, may go while the
        # interpreter exits, after the modules' globals were set to None
        # (hence `_finalizing` bound here): nothing is sent then; rank 0
        # frees what this rank held as its connection ends.
        if _finalizing():
            return False
        return self.sock.fileno() >= 0 and _wire.send_quietly(self.sock, message)

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
        the last batch held (now, if none is). The bye goes before the
        connection counts as closing: from then on the last release closes
        the socket, in any thread, and a bye sent after that is lost (rank
        0 would take the rank for dead). It is sent under the lock, under
        which alone the socket is closed, so no close lands in the middle
        of the send; and noted after it, so a close cut by a signal
        handler's exception before the note, and run again, sends it again
        (rank 0 takes a second bye as nothing: once a rank said bye, only
        its releases count)."""
        with self.lock:
            if not self.said_bye:
                self.send(self.progress.farewell())
                self.said_bye = True
        if self.leader is not None:
            self.leader.close()
        with self.lock:
            self.closing = True
            if self.held == 0:
                self.sock.close()


class _Progress:
    """How far this rank's trainer is in its pass: what its "bye" tells rank
    0 (shared by the rank and its connection, whose bye the pipeline's
    finaliser may send after the rank object is gone), and whether the
    trainer is at the pass's end (when it says "taken").

    The trainer's count is the stream's own, or where an adapter takes
    batches ahead of the trainer (to_jax's thread) that adapter's
    TrainerPosition: a batch waiting in its buffer was not had. Batches
    tf.data has taken count as had, as they do in a state_dict()."""

    __slots__ = ("counters", "pass_no", "position", "taken_before")

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.pass_no = -1
        self.taken_before = 0  # batches the stream delivered before the pass in progress
        self.position: TrainerPosition | None = None

    def began(self, pass_no: int) -> None:
        self.pass_no = pass_no
        self.taken_before = self.counters.batches
        self.position = None

    # Neither read below takes the position's lock: both are made under the
    # rank's consumer lock (a failure's close sends the farewell there),
    # which a state_dict() takes inside the position's lock.

    def trainer_had(self) -> int:
        """Batches of the pass in progress the trainer has had."""
        position = self.position
        if position is not None and position.pass_no == self.pass_no:
            return position.had_count()
        return self.counters.batches - self.taken_before

    def trainer_at_end(self) -> bool:
        """The trainer asks past the last batch it was given: the stream's
        end of the pass is the trainer's."""
        position = self.position
        return position is None or position.pass_no != self.pass_no or position.waits_past_its_batches()

    def farewell(self) -> list[Any]:
        """The rank's "bye": its pass and the batches of it its trainer had
        (rank 0 compares them with those it dealt the rank)."""
        return ["bye", self.pass_no, self.trainer_had()]


@dataclass(frozen=True)
class _RankSpec:
    """What the deprecated ``RankPipeline.spec`` returns (what adapters
    read of a spec): the rank's consumer_may_hold."""

    consumer_may_hold: int


def _leave(conn: _Connection, leader: Leader | None) -> None:
    """What a rank's close shuts down: its connection ("bye"), and in rank 0
    the group."""
    try:
        conn.close()
    finally:
        if leader is not None:
            leader.close()


class RankPipeline(FrameworkStream):
    """One rank's share of a pipeline that a group of ranks of this node
    shares (``from_iterators(group=...)``; docs/several-ranks.md).

    Iterate it for one pass (every rank iterates every pass; a pass starts
    when all have begun it); each batch of the group's pipeline goes to
    exactly one rank, and every rank gets the same number per pass. Arrays
    are read-only views of the shared ring. In rank 0 it also owns the
    producers: close it last, or with the others.
    """

    def __init__(self, options: PipelineOptions, group: GroupOptions, schedule: Schedule | None = None) -> None:
        super().__init__(options)
        self.group_options = group
        self.rank = group.rank
        self.num_ranks = group.num_ranks
        self.group = group.name
        self._reader: RankReader | None = None
        self._failure: ShmpipeError | None = None
        self._dropped: list[int] = []
        #: The last pass whose "end" this rank read, and the last it said
        #: "taken" of (the trainer at its end too): it waits for "complete".
        self._end_read = -1
        self._taken_said = -1
        self._taken_at_ns = 0  # when it said "taken" last (the wait for "complete" begins)
        self._progress = _Progress(self._counters)
        # The pipeline's schedule (rank 0's leader runs it), and what this
        # rank keeps to know where the group stands from its own count (a
        # dataset's batches as one sequence; None: from_iterators, whose
        # position a rank cannot tell alone).
        if schedule is None:
            schedule = IteratorSchedule(options.num_workers, options.seed, options.seed_given)
        self._batches = schedule.fingerprint()
        self._batch_sizes_vary = schedule.batch_sizes_vary(self.rank)
        self._short_batch = schedule.short_batch(self.rank)
        self._position = (
            schedule.one_reader(share_draws=group.rank == 0) if isinstance(schedule, DatasetSchedule) else None
        )
        # One reader of rank 0's socket at a time (a poll object refuses two
        # threads), and no new pass while a take of the old one runs: the
        # thread of to_jax's pass left at a break may still be in _take when
        # the next pass begins. Held for one poll (POLL_S) at a time; the
        # lock is not fair, so a state_dict() while another thread waits for
        # a batch may wait out two or three polls (measured: 0.1-0.2 s).
        self._consumer_lock = threading.Lock()
        # What is made is recorded where the clean-up finds it with Ctrl-C
        # held back (raised after, inside the try): the leader's producers
        # and threads, and the connection until the finalizer owns them.
        self._leader: Leader | None = None
        conn: _Connection | None = None
        try:
            if group.rank == 0:
                with ctrl_c_held_back():
                    self._leader = Leader(options, group, schedule)
            conn = self._conn = self._join(options, group)
            with ctrl_c_held_back():
                self._own(functools.partial(_leave, conn, self._leader))
        except BaseException:
            if self._finalizer is not None:
                self._finalize()
            elif conn is not None:
                _leave(conn, self._leader)
            elif self._leader is not None:
                self._leader.close()
            raise
        self._closed = False

    def _join(self, options: PipelineOptions, group: GroupOptions) -> _Connection:
        """Connects to rank 0, says hello and waits until every rank has."""
        deadline = time.monotonic() + group.timeout
        sock = _connect(_wire.socket_address(self.group), self.group, deadline)
        leader: ProcessWatch | None = None
        try:
            self._leader_pid, uid = _wire.peer(sock)
            if uid != os.getuid():
                raise GroupStartError(
                    f"group {self.group!r}: the process listening as rank 0 (pid {self._leader_pid}) "
                    f"runs as uid {uid}, not as this user: refusing to join"
                )
            # Rank 0's death is seen by its pidfd too: a child it forked
            # may hold its end of this socket open.
            if self._leader_pid != os.getpid():
                leader = ProcessWatch(self._leader_pid)
            # poll, not select: select fails on a descriptor >= 1024.
            self._poller = select.poll()
            self._poller.register(sock.fileno(), select.POLLIN)
            leader_fd = leader.fileno() if leader is not None else None
            if leader_fd is not None:
                self._poller.register(leader_fd, select.POLLIN)
            conn = _Connection(sock, leader, self._progress)
            try:
                _wire.send(sock, _wire.hello(self.rank, _wire.fingerprint(options, group, self._batches), group))
            except OSError as exc:  # ECONNRESET, EPIPE: not a ShmpipeError of ours to let through raw
                raise GroupStartError(
                    f"group {self.group!r}: the process listening as rank 0 (pid {self._leader_pid}) closed the "
                    f"connection as this rank said hello ({exc.strerror or exc}): a group of the same name "
                    "ending (an earlier run's), or rank 0 failing"
                ) from None
            # Rank 0 reports missing ranks at its deadline; a little later
            # here, so its message (which names them) comes first.
            self._wait_ready(conn, deadline + 5.0)
            return conn
        except BaseException:
            sock.close()
            if leader is not None:
                leader.close()
            raise

    def _receive(self, conn: _Connection, events: list[tuple[int, int]]) -> tuple[list[Any] | None, list[int]] | None:
        """The message `events` announce (poll's answer), (None, []) when
        rank 0's end or death was seen, None when nothing came after all."""
        try:
            return _wire.recv(conn.sock)
        except BlockingIOError:
            pidfd = conn.leader.fileno() if conn.leader is not None else None
            if pidfd is not None and any(fd == pidfd for fd, _ in events):
                return None, []  # rank 0 ended; a child of it holds the socket open
            return None

    def _leader_gone_unpolled(self, conn: _Connection) -> bool:
        """Rank 0's process ended, where its watch has no pidfd to poll."""
        leader = conn.leader
        return leader is not None and leader.fileno() is None and not leader.alive()

    def _wait_ready(self, conn: _Connection, deadline: float) -> None:
        while True:
            events = self._poller.poll(int(POLL_S * 1000))
            got = self._receive(conn, events) if events else None
            if got is None and self._leader_gone_unpolled(conn):
                got = None, []
            if got is not None:
                message, fds = got
                for fd in fds:
                    os.close(fd)
                if message is None:
                    raise RankDiedError(f"group {self.group!r}: rank 0 (pid {self._leader_pid}) ended", 0)
                if message[0] == "ready":
                    seed = message[1] if len(message) == 2 else None
                    if type(seed) is not int or not 0 <= seed < 1 << 63:
                        raise GroupError(f"group {self.group!r}: a malformed 'ready' from rank 0: {message!r:.80}")
                    if self._position is not None:
                        self._position.adopt_seed(seed)
                    return
                if message[0] == "error":
                    raise _wire.error_from(message)
                raise GroupError(f"group {self.group!r}: unexpected message before start: {message!r:.80}")
            if time.monotonic() > deadline:
                raise GroupStartError(f"group {self.group!r}: the ranks did not all join in time")

    # -- checkpoints ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the job stands, from this rank's count: after this rank
        took s batches of an epoch, the job's first s * W batches of it are
        out (W: the ranks of every node; every rank gets the same number, in
        rounds). Any rank's state at the same step, on any node, is the
        job's; a group of another size or another number of nodes resumes
        from it. A dataset's ordered group only
        (from_dataset(group=..., ordered=True)): an unordered or
        from_iterators group cannot tell its position from one rank.
        Counts the batches the trainer has had, as ``Pipeline.state_dict``."""
        return self._state_of_the_trainer()

    def _state(self, had: Had | None = None) -> dict[str, Any]:
        with self._consumer_lock:  # not while a pass begins in another thread
            return self._state_locked(had)

    def _state_locked(self, had: Had | None) -> dict[str, Any]:
        position = self._position_or_refuse()
        if self._pass_no < 0:
            return position.state(None)
        had = Had.of_pass(had, self._pass_no)
        finished = self._finished_pass == self._pass_no if had is None else had.finished
        if finished:
            return position.state(Progress([0], None, finished=True))
        taken = self._counters.batches - self._progress.taken_before if had is None else had.total()
        return position.state_after_rounds(taken)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the group's next pass begin where `state` says; every rank
        loads the same state before the first pass (rank 0's pipeline goes
        on from it; the others count from it)."""
        position = self._position_or_refuse()
        self._check_usable()
        if self._pass_no >= 0:
            raise ShmpipeValueError("load_state_dict() must come before the first pass: make a new pipeline to resume")
        saved = position.saved()
        position.load(state)
        if self._leader is not None:
            try:
                self._leader.pipe.load_state_dict(state)
            except BaseException:  # refused there (or the pipeline failed): this rank's count is as it was
                position.restore(saved)
                raise

    def _position_or_refuse(self) -> DatasetSchedule:
        if self._position is None or not self.ordered:
            raise ShmpipeValueError(
                "a group's position can be saved for from_dataset(group=..., ordered=True) only: one rank "
                "cannot tell where an unordered or from_iterators group stands (docs/long-runs.md)"
            )
        return self._position

    # -- iteration ------------------------------------------------------------

    def _begin_pass(self) -> int:
        with self._consumer_lock:  # waits for a take of the old pass in another thread
            # which may have failed the group (or another thread closed the
            # pipeline) meanwhile: that failure is the one to raise
            self._check_usable()
            start = None
            if self._position is not None:
                self._position.begin(self._pass_no + 1)  # where it raises (the sampler), no pass was begun
                start = self._position.start_point()  # rank 0's leader checks it against its own
            self._pass_no += 1
            self._progress.began(self._pass_no)
            sent = self._conn.send(["begin", self._pass_no, start])
        if not sent:
            self._fail(RankDiedError(f"group {self.group!r}: rank 0 (pid {self._leader_pid}) is gone", 0))
        return self._pass_no

    def _position_for_adapter(self, ahead: int, sees_asks: bool = False) -> TrainerPosition:
        position = super()._position_for_adapter(ahead, sees_asks)
        self._progress.position = position  # what "taken" and "bye" count from
        return position

    def _adapter_caught_up(self, position: TrainerPosition) -> None:
        super()._adapter_caught_up(position)
        if self._progress.position is position:
            self._progress.position = None

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        super()._check_usable()

    def _fail(self, exc: ShmpipeError) -> NoReturn:
        """The group failed: this rank lets go of the group (the batches it
        holds stay valid) and raises `exc`, now and on any later use. Where
        close() came first (a signal handler's, inside this very take, which
        closed the reader under it: _before_close), the take ends in the
        PipelineClosedError that close() promises, and nothing failed."""
        if not self._close_asked:
            self._failure = exc
        self._close_and_raise(exc)

    def _take(self, it: Pass, t0: int) -> tuple[Any, int, int]:
        while True:
            with self._consumer_lock:
                if it.pass_no != self._pass_no:
                    raise PipelineClosedError(
                        "this iterator belongs to an earlier pass; iterating the pipeline again "
                        "started a new one (while this one waited for a batch)"
                    )
                self._say_taken_at_the_end(it.pass_no)
                events = self._poller.poll(int(POLL_S * 1000))  # a Ctrl-C here is the user's to have
                if self._closed:  # by another thread (or a hook)
                    self._check_usable()
                got: Any = self._take_message(events, it) if events else _NOTHING
            if got is _END:
                raise StopIteration
            if got is not _NOTHING:
                return got
            if events:
                continue
            self._waited()  # what lets go of the slots the trainer dropped (to_jax)
            if self._leader_gone_unpolled(self._conn):
                self._fail(RankDiedError(f"rank 0 (pid {self._leader_pid}) of group {self.group!r} died", 0))
            self._raise_if_timed_out(t0, time.perf_counter_ns(), lambda: f" (rank {self.rank} of group {self.group!r})")

    def _say_taken_at_the_end(self, pass_no: int) -> None:
        """Says "taken" once the pass's end was read and the trainer is at
        it too (at once, unless an adapter's thread read the end ahead of
        the trainer: then when the trainer has had every batch before it,
        within a poll). Under the consumer lock."""
        if self._end_read == pass_no != self._taken_said and self._progress.trainer_at_end():
            self._taken_said = pass_no
            self._taken_at_ns = time.perf_counter_ns()
            self._conn.send(["taken", pass_no])  # if rank 0 is gone, its end is read next

    def _raise_if_timed_out(self, t0: int, now: int, why: Callable[[], str]) -> None:
        if self._end_read != self._pass_no:
            super()._raise_if_timed_out(t0, now, why)
            return
        # At the pass's end: the wait for the other ranks begins with
        # "taken" (before it, an adapter's thread waits for its own trainer
        # to have the batches it read ahead, which is no stall).
        timeout = self.options.timeout
        if self._taken_said != self._pass_no or timeout is None or now - max(t0, self._taken_at_ns) < timeout * 1e9:
            return
        raise PipelineTimeoutError(
            f"the end of pass {self._pass_no} did not come within {timeout:g} s: rank {self.rank} of group "
            f"{self.group!r} has had its batches of the pass and waits for every other rank to end it too "
            "(leave its loop over the pass, begin the next pass, or close); one of them is slow or stuck"
        )

    def _take_message(self, events: list[tuple[int, int]], it: Pass) -> Any:
        """The message poll announced, handled: (batch, nbytes, worker),
        _END or _NOTHING. From the receive to the batch (or the descriptors
        closed), a Ctrl-C would leak a descriptor, or a token whose slot
        rank 0 then pins until this rank exits: held back to the end."""
        with ctrl_c_held_back():
            try:
                got = self._receive(self._conn, events)
            except GroupError as exc:  # not a message of ours
                self._fail(exc)
            except OSError as exc:
                self._check_usable()  # closed by another thread meanwhile
                self._fail(GroupError(f"group {self.group!r}: reading from rank 0 failed: {exc}"))
            return _NOTHING if got is None else self._handle(*got, it)

    def _handle(self, message: list[Any] | None, fds: list[int], it: Pass) -> Any:
        """One message from rank 0 (None: its end): (batch, nbytes, worker)
        of this pass, _END or _NOTHING. Anything wrong fails the group for
        this rank, as a ShmpipeError (a malformed message too: never a
        TypeError)."""
        failure: ShmpipeError
        try:
            if message is None:
                raise RankDiedError(
                    f"rank 0 (pid {self._leader_pid}) of group {self.group!r} died or closed the group", 0
                )
            return self._handle_message(message, fds, it)
        except ShmpipeError as exc:  # first: some are ValueErrors too
            failure = exc
        except _wire.MALFORMED as exc:
            failure = GroupError(f"group {self.group!r}: a malformed message from rank 0 ({exc}): {message!r:.80}")
            failure.__cause__ = exc
        finally:
            for fd in fds:
                os.close(fd)
            fds.clear()
        self._fail(failure)

    def _handle_message(self, message: list[Any], fds: list[int], it: Pass) -> Any:
        kind = message[0]
        if kind == "batch":
            return self._read_batch(message, fds, it)
        if kind == "ring" and len(message) == 2 and isinstance(message[1], dict) and self._reader is None:
            transport = self.options.transport
            if not isinstance(transport, ServesRanks):  # checked with the options; a clear error all the same
                raise GroupError(f"the {transport.name!r} transport cannot read a shared ring (ServesRanks)")
            taken = fds[:]
            fds.clear()
            self._reader = transport.rank_reader(message[1], taken)  # closes `taken`
            return _NOTHING
        if kind == "end" and len(message) == 3:
            # Every batch of the pass dealt to this rank was read: it says
            # "taken" once its trainer is at the end too, and the pass ends
            # when rank 0 says every rank is past it ("complete"), so that a
            # rank dying with batches of this pass is this rank's error, not
            # a quiet loss (_leader._complete_passes).
            _, pass_no, dropped = message
            _wire.expect(pass_no, int)
            _wire.expect(dropped, int)
            if pass_no != it.pass_no or self._end_read == pass_no:
                return _NOTHING
            self._dropped.append(dropped)
            self._end_read = pass_no
            self._say_taken_at_the_end(pass_no)
            return _NOTHING
        if kind == "complete" and len(message) == 2:
            _wire.expect(message[1], int)
            # a later pass's word covers this one; an earlier one is stale
            return _END if self._taken_said == it.pass_no <= message[1] else _NOTHING
        if kind == "error":
            raise _wire.error_from(message)
        raise GroupError(f"group {self.group!r}: unexpected message from rank 0: {message!r:.80}")

    def _read_batch(self, message: list[Any], fds: list[int], it: Pass) -> Any:
        _, pass_no, token, record, worker, nbytes = message
        _wire.expect(pass_no, int)
        _wire.expect(token, int)
        _wire.expect(record, list)
        _wire.expect(nbytes, int)
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
        if len(fds) > 1:
            release()
            raise GroupError(f"group {self.group!r}: a batch came with {len(fds)} descriptors")
        fd = fds[0] if fds else None
        batch = self._reader.read(tuple(record), fd, release)  # fd: ours to close (the caller does)
        return batch, nbytes, worker

    # -- start and stop ---------------------------------------------------------

    def close(self) -> None:
        """Leaves the group (in rank 0: stops the producers and the group).
        Idempotent, and from any thread (a wait for a batch in another
        thread raises PipelineClosedError). Batches still held stay valid.
        Closing in the middle of a pass fails the group for the other ranks
        (they could not stay in step); close every rank after the same pass."""
        super().close()

    def _before_close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    # -- what adapters and users read ------------------------------------------------

    @property
    def reader(self) -> RankReader | None:
        """This rank's reader of the shared ring (None before the first batch)."""
        return self._reader

    @property
    def channel(self) -> RankReader | None:
        """Deprecated: this rank's ``reader`` (a RankReader, not a channel)."""
        warnings.warn("RankPipeline.channel is deprecated: use RankPipeline.reader", DeprecationWarning, stacklevel=2)
        return self._reader

    @property
    def spec(self) -> _RankSpec:
        """Deprecated: use ``consumer_may_hold``, the one thing it held."""
        warnings.warn(
            "RankPipeline.spec is deprecated: use RankPipeline.consumer_may_hold", DeprecationWarning, stacklevel=2
        )
        return _RankSpec(self.consumer_may_hold)

    @property
    def consumer_may_hold(self) -> int:
        spec = ChannelSpec(num_workers=self.num_workers, capacity=self.capacity, ordered=self.ordered)
        per_rank = (spec.consumer_may_hold - (self.num_ranks - 1)) // self.num_ranks
        return max(1, per_rank)

    def held(self) -> int | None:
        return self._reader.held() if self._reader is not None else None

    def owns_memory(self) -> bool:
        return self._reader is not None and self._reader.owns_memory

    def memory_ranges(self) -> list[tuple[int, int]]:
        return self._reader.memory_ranges() if self._reader is not None else []

    def _stats_extra(self) -> dict[str, Any]:
        """``stats().extra`` in a rank: rank, num_ranks, group,
        dropped_remainder (batches of the group's passes dealt to no rank:
        the incomplete last rounds) and dropped_per_pass; in a job of
        several nodes, num_nodes and node_rank too."""
        extra = {
            "rank": self.rank,
            "num_ranks": self.num_ranks,
            "group": self.group,
            "dropped_remainder": sum(self._dropped),
            "dropped_per_pass": list(self._dropped),
        }
        layout = self._position.layout if self._position is not None else None
        if layout is not None and layout.num_nodes > 1:
            extra |= {"num_nodes": layout.num_nodes, "node_rank": layout.node_rank}
        return extra

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

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pass {max(self._pass_no, 0)}"
        return f"<shmpipe.RankPipeline rank {self.rank} of {self.num_ranks}, group {self.group!r}, {state}>"
