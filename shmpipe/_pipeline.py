"""Pipeline: N producers, one consumer, one channel.

The consumer (this process) iterates passes, asks the channel for the next
batch in the order the user wants, enforces timeouts, and turns a
producer's failure into an error once the batches published before it
are delivered (ordered: those before the first one missing). What every
stream does around that (passes, close, counting, the adapters) is
BatchStream's (_stream.py); starting and watching the producers is the
launcher's job (_launch.py, or the transport's own); moving batches is
the transport's (transport.py).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from shmpipe._frameworks import FrameworkStream
from shmpipe._interrupts import ctrl_c_held_back
from shmpipe._launch import ProcessLauncher
from shmpipe._options import PipelineOptions
from shmpipe._producer_context import PassWork
from shmpipe._schedule import DatasetSchedule, IteratorSchedule, Progress, Schedule
from shmpipe._sources import DatasetSource
from shmpipe._stalls import STALL_WARNING_NS, STARTING, describe_wait, warn_if_held_up_by_consumer
from shmpipe._stream import POLL_S, Had, Pass
from shmpipe._turns import Turns
from shmpipe.errors import (
    CorruptChannelError,
    PipelineClosedError,
    ShmpipeError,
    ShmpipeValueError,
    ShmpipeWarning,
    WorkerDiedError,
    WorkerError,
    type_name,
    users_stacklevel,
)
from shmpipe.transport import AGAIN, END, FAULT, ChannelSpec, ConsumerEnd, Launcher, class_name, reported

if TYPE_CHECKING:  # imported where a pass makes its first batches (it loads the compiled codec)
    from shmpipe._first_batches import FirstBatches

__all__ = ["Pipeline"]

#: While batches keep coming, how often the consumer still checks that every
#: producer is alive.
HEALTH_CHECK_NS = 250_000_000


def _declined(*_: Any) -> None:  # Pipeline._take_ready where there is no fast path: takes nothing
    return None


class _PipelinePass(Pass):
    """A pass over a Pipeline: the general path (Pipeline._next), and before
    it the channel's fast path for a batch that is already there."""

    __slots__ = ("count_ready", "pipe", "turns")

    def __init__(self, pipe: Pipeline, pass_no: int) -> None:
        super().__init__(pipe, pass_no)
        self.pipe = pipe
        self.turns = Turns(pipe.num_workers, pipe._schedule.first_turn) if pipe.ordered else None
        self.count_ready = pipe._counters.delivered_ready

    def __next__(self) -> Any:
        pipe = self.pipe
        # The fast path: one call to the channel takes the batch whose turn
        # it is, if it is already there: once the pass delivered a batch by
        # the general path (which starts its clock) and until it ends, while
        # the pipeline is open, for the current pass (checked under the
        # consumer lock, as _get does). take_ready declines (None, taking
        # nothing) when no batch is ready, the pass ended, a fault was
        # reported or a look at the producers is due; all else is the general
        # path's. Once per batch: no call that is not needed. No local names
        # the channel: a failure's traceback keeps this frame, in a cycle with
        # the stored failure (the ring mapped after close until a collection).
        if pipe._take_ready is not _declined and self.delivered and not self.finished and not pipe._closed:
            turns = self.turns
            if turns is None:
                worker, wseq = -1, 0
            else:
                turn = turns.next()
                if turn is None:
                    return pipe._next(self)
                worker, wseq = turn
            pass_no = self.pass_no
            with pipe._spans:  # a span, as _next's
                with pipe._consumer_lock, pipe._reading:  # as _get: one take at a time, and no new pass meanwhile
                    current = pass_no == pipe._pass_no and not pipe._close_asked  # (closed: _next says so)
                    # Not into a local (above); a close in another thread swaps in _declined.
                    got = pipe._take_ready(pass_no, worker, wseq, pipe._health_due_ns) if current else None
                if got is not None:
                    if turns is not None:
                        turns.took()
                    batch, nbytes, worker, wait_ns = got
                    self.count_ready(wait_ns, nbytes, worker)
                    self.last_worker = worker
                    return batch
        return pipe._next(self)


class Pipeline(FrameworkStream):
    """Batches from N producer processes, delivered to this process.

    Made by :func:`from_iterators`. Iterate it for one pass over the
    sources; iterate again for another (each source is called again; the
    producer processes stay). Use it as a context manager, or call close(),
    to stop the producers and destroy the shared memory. Arrays in the
    batches are read-only views of shared memory; each batch's slot is
    reused only once every array of it is gone.
    """

    #: Whether the channel's fast path (takes_ready) may serve: no, in a variant that takes batches another way.
    _offers_fast_path = True
    #: Whether a variant hands the channel's memory on after the producers have it (a group's, to its ranks).
    _hands_channel_on = False
    #: Whether a from_dataset pipeline may make a pass's first batches itself while its
    #: producers start (_first_batches.py): a variant whose batches go elsewhere says no.
    _makes_first_batches = True

    def __init__(
        self, options: PipelineOptions, schedule: Schedule | None = None, *, fetch_while_starting: bool = False
    ) -> None:
        super().__init__(options)
        self._fetch_while_starting = fetch_while_starting
        self._spec = options.channel_spec()
        if self._hands_channel_on:
            self._spec = dataclasses.replace(self._spec, hands_again=True)
        # What each pass does, and the checkpoint (shmpipe/_schedule.py).
        self._schedule = schedule or IteratorSchedule(options.num_workers, options.seed, options.seed_given)
        self._batch_sizes_vary, self._short_batch = self._schedule.batch_sizes_vary(), self._schedule.short_batch()
        self._begun = -1  # the channel's pass begun last (iterated or ahead)
        self._ahead: int | None = None  # a pass begun before it is iterated (prefetching)
        self._turns: Turns | None = None  # the ordered pass in progress's
        self._delivered_before: list[int] = [0] * options.num_workers  # per worker, before that pass
        self._restarts: list[str] = []  # each producer death that was replaced (max_restarts)
        self._stall_warned = -1  # the pass the consumer was last told it holds too much
        self._dropped: list[int] = []  # per pass iterated: batches the schedule dealt to no rank
        # The trainer's part of the pass begun last, while the producers start (None once they have their
        # part, or where it makes none), and how many batches of the pass in progress it made and delivered.
        self._first: FirstBatches | None = None
        self._made_here = 0
        self._abandoned: list[int] = []  # passes begun while the producers started, never handed over
        # A channel has one consumer. Threads may still meet here: a tf.data iterator's thread
        # waiting for a batch of one pass while another iterator starts the next. So channel.get
        # and begin_pass run one at a time, and a get is only made for the current pass: a get
        # for an old pass would take, or throw away, batches of the new one.
        self._consumer_lock = threading.Lock()
        # Held while a take reads the channel, and only then (a close() never waits for a
        # replacement's start): a close() from another thread shuts the channel down once the
        # read in progress returned (BatchStream._own); the next take sees the close.
        self._reading = threading.RLock()
        self._failure: BaseException | None = None  # raised once published batches are out
        self._last_health_ns = self._counters.created_ns
        self._health_due_ns = self._last_health_ns + HEALTH_CHECK_NS  # the fast path's limit
        self._blocked_s: list[float | None] = [0.0] * options.num_workers
        self._channel: ConsumerEnd | None = None  # None before a first batch, and once closed
        self._take_ready: Callable[..., Any] = _declined  # the channel's fast path, where offered
        self._slot_size_at_close: int | None = None
        transport = options.transport
        self._launcher: Launcher
        # A Ctrl-C while it is made is held back to its end (ctrl_c_held_back says why), then ends what started.
        launcher: Launcher | None = None
        try:
            with ctrl_c_held_back():
                if transport.capabilities.own_producers:
                    launcher = transport.launch(options.sources, self._spec, options.seed)
                else:
                    launcher = ProcessLauncher(
                        transport, options.sources, self._spec, options.shipments,
                        may_start_in_background=self._may_make_first_batches, timeout=options.timeout,
                    )
                self._launcher = launcher
                # The launcher, not this object, owns the processes and the
                # channel, so a forgotten pipeline is shut down when collected.
                self._own(launcher.shutdown, takes=self._reading)
                self._set_channel(launcher.channel)
                if self._schedule.begins_early:
                    self._begin_ahead()  # the first pass starts with the producers
        except BaseException:  # nothing started may outlive the call
            if self._finalizer is not None:
                self._finalize()
            elif launcher is not None:
                launcher.shutdown()
            raise
        self._closed = False

    # -- configuration --------------------------------------------------------

    @property
    def spec(self) -> ChannelSpec:
        """What this pipeline asks of its channel: workers, capacity, order, and the quotas that follow."""
        return self._spec

    @property
    def consumer_may_hold(self) -> int:
        return self._spec.consumer_may_hold

    @property
    def seed(self) -> int:
        return self._schedule.seed  # a state loaded with seed=None brings its own

    # -- start and stop -------------------------------------------------------

    def _before_close(self) -> None:
        self._blocked_s = self._producer_blocked()
        self._launcher.closing()  # (its shutdown may be put off: _spans)

    def _after_shutdown(self) -> None:
        # The launcher let go of the channel; so does this object: the ring is unmapped once no
        # batch holds it (a Segment unmaps as it is freed), not when this pipeline is collected.
        if self._channel is not None:
            self._slot_size_at_close = self._channel.slot_size
            self._set_channel(None)

    def leftovers(self) -> list[str]:
        """After close(): whatever of this pipeline still runs (processes,
        actors), described; empty when close() left nothing behind."""
        return self._launcher.leftovers()

    def _stats_extra(self) -> dict[str, Any]:
        """``stats().extra`` of a from_dataset pipeline: made_by_trainer (batches the trainer made
        itself while the producers started, _first_batches.py); and of one node's pipeline in a job
        of several (from_dataset(num_nodes=...)): num_nodes, node_rank, dropped_remainder (batches
        of the passes that no rank of the job got: the incomplete last rounds) and dropped_per_pass."""
        if not isinstance(self._schedule, DatasetSchedule):
            return {}
        made = {"made_by_trainer": self._counters.made_here} if self._makes_first_batches else {}
        layout = self._schedule.layout
        if layout.num_nodes == 1:
            return made
        return made | {
            "num_nodes": layout.num_nodes,
            "node_rank": layout.node_rank,
            "dropped_remainder": sum(self._dropped),
            "dropped_per_pass": list(self._dropped),
        }

    def _forget_children(self, children: set[Any]) -> None:
        for process in self._launcher.children():
            children.discard(process)

    # -- iteration ------------------------------------------------------------

    @property
    def _may_make_first_batches(self) -> bool:
        return self._fetch_while_starting and self._makes_first_batches and isinstance(self._schedule, DatasetSchedule)

    def _begin_ahead(self) -> None:
        """Begins the next pass now, before it is iterated, so the producers make its first batches
        meanwhile (a pass begun ahead earlier, and not iterated, is cancelled). While the producers
        are still being started, a dataset's pass is theirs only from the hand-over (_first_batches)."""
        work = self._schedule.begin(self._begun + 1)  # where it raises, no pass was begun
        first = self._first
        if first is not None and first.dealt_from is None:
            self._abandoned.append(first.pass_no)  # never handed over: sent, empty, before the next
        self._first = None
        self._begun += 1
        self._ahead = self._begun
        if self._launcher.starting and self._may_make_first_batches:
            from shmpipe._first_batches import FirstBatches

            source = self.options.sources[0]
            assert isinstance(source, DatasetSource) and isinstance(self._schedule, DatasetSchedule)
            self._first = FirstBatches(source, self._schedule, self._begun)
            # No fast path until the hand-over: the channel is not the
            # producers' yet (ConsumerEnd.handle_delivered comes first).
            self._take_ready = _declined
            return
        try:
            self._send_abandoned()
            self._launcher.begin_pass(self._begun, work)
        except WorkerDiedError as death:  # gone since the last look (every other one was told)
            if not self._replaced(death):
                raise
        except WorkerError:
            raise
        except Exception as exc:  # noqa: BLE001 - the producers' start (in the background) failed: nothing comes
            self._close_and_raise(exc)

    def _begin_pass(self) -> int:
        with self._consumer_lock:  # waits for a get() of the old pass in another thread
            try:
                if self._ahead is None:
                    self._begin_ahead()
                assert self._ahead is not None
                self._pass_no, self._ahead = self._ahead, None
                self._delivered_before = self._counters.per_worker
                self._made_here = 0
                self._dropped.append(self._schedule.dropped)
                return self._pass_no
            except WorkerError as exc:  # a producer gone between passes (WorkerDiedError)
                failure = exc
        self._close_and_raise(failure)

    def _new_pass(self, pass_no: int) -> Pass:
        it = _PipelinePass(self, pass_no)
        self._turns = it.turns
        return it

    # -- checkpoints ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this pipeline stands, as a small JSON-serialisable dict:
        give it to ``load_state_dict`` of a new pipeline made with the same
        arguments to go on with the batches not yet handed out, in the same
        order where the pipeline is ordered, and the same later epochs.

        Counts the batches the trainer has had: those ``to_jax()``'s thread
        put ahead on an accelerator are not counted until the trainer takes
        them; those tf.data's own ``prefetch`` took are (see
        docs/long-runs.md)."""
        return self._state_of_the_trainer()

    def _state(self, had: Had | None = None) -> dict[str, Any]:
        with self._consumer_lock:
            return self._schedule.state(self._progress(had))

    def _states_needed_behind(self, ahead: int) -> None:
        self._launcher.keep_iterator_states(ahead)

    def _next_turn(self) -> int | None:
        turn = self._turns.next() if self._turns is not None else None
        return None if turn is None else turn[0]

    def _progress(self, had: Had | None) -> Progress | None:
        """The pass in progress's count: of what it handed out, or (`had`)
        of what the trainer has had of it."""
        none = [None] * self.num_workers
        if self._ahead is not None:  # begun, not iterated yet: nothing of it delivered
            return Progress([0] * self.num_workers, self._schedule.first_turn, finished=False, iterator_states=none)
        if self._pass_no < 0:
            return None
        had = Had.of_pass(had, self._pass_no)  # (under the consumer lock, which _begin_pass holds)
        if had is None:
            now = self._counters.per_worker
            made_here = self._made_here
            delivered = [n - b for n, b in zip(now, self._delivered_before, strict=True)]
            turn = self._next_turn()
            finished = self._finished_pass == self._pass_no
        else:
            made_here = had.made_here
            delivered = [had.of(w) for w in range(self.num_workers)]
            turn = self._next_turn() if had.next_turn is None else had.next_turn
            finished = had.finished
        return Progress(
            made_here=made_here,
            delivered=delivered,
            next_turn=turn,
            finished=finished,
            # The state its iterator had after the last batch taken (batch d - 1 of the pass).
            iterator_states=[
                self._launcher.iterator_state(w, self._pass_no, d - 1)[1] if d else None
                for w, d in enumerate(delivered)
            ],
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next pass begin where `state` (from ``state_dict()``)
        says: call it before the first pass. A state that does not fit this
        pipeline (another dataset, batch size, seed, number of sources) is
        refused with a ShmpipeValueError naming the field."""
        self._check_usable()
        with self._consumer_lock:
            if self._pass_no >= 0:
                raise ShmpipeValueError(
                    "load_state_dict() must come before the first pass: make a new pipeline to resume"
                )
            saved, begun = self._schedule.saved(), self._begun
            self._schedule.load(state)
            try:
                self._begin_ahead()  # the resumed pass's first batches are made meanwhile
            except WorkerError as exc:
                failure = exc
            except BaseException:
                if self._begun == begun:  # its draw failed (an epoch alone is drawn here): refused, as it was
                    self._schedule.restore(saved)
                raise
            else:
                return
        self._close_and_raise(failure)

    def _take(self, it: Pass, t0: int) -> tuple[Any, int, int]:
        assert isinstance(it, _PipelinePass)
        if self._first is not None:
            made = self._take_first(it, t0)
            if made is not None:
                return made
        if t0 - self._last_health_ns > HEALTH_CHECK_NS:
            self._poll_producers(t0)
        try:
            batch = self._take_ordered(it, t0) if self.options.ordered else self._take_any(it, t0)
        except WorkerError as exc:  # a transport that reports failures in stream order (Ray)
            if not self._closed:
                self._close_and_raise(exc)
            raise
        if (channel := self._channel) is None:  # a close() from another thread let go of it since
            raise PipelineClosedError("the pipeline was closed while waiting for a batch")
        try:
            return (batch, *reported(channel, self.num_workers))
        except CorruptChannelError as exc:  # a transport's own ConsumerEnd broke the contract
            self._close_and_raise(exc)

    def _take_first(self, it: _PipelinePass, t0: int) -> tuple[Any, int, int] | None:
        """The next batch of a pass begun while the producers started, made
        here (worker -1), or None once the trainer owes no more (the
        producers' take over; a pass no longer current is _get's to refuse).
        From the main thread only (the generators seeded around a batch are
        the process's); handed over once the producers are up, off the main
        thread or at the share's end, the batch made then owed (made even if
        a Ctrl-C cuts it); under the consumer lock, so a pass begun by another
        thread finds the old one's count and hand-over complete (reasons:
        docs/design.md, "A fresh pipeline's first batches")."""
        first = self._first
        assert first is not None
        here = threading.current_thread() is threading.main_thread()
        if first.dealt_from is None and not (here and first.left and self._launcher.starting):
            self._wait_for_start(t0)  # (outside the lock: close() and state_dict() go on meanwhile)
        with self._consumer_lock:
            if self._first is not first or first.pass_no != it.pass_no or it.pass_no != self._pass_no:
                return None
            if first.dealt_from is None and not (here and first.left and self._launcher.starting):
                self._hand_over(first, first.made + (1 if here and first.left else 0))
            if first.dealt_from is not None and first.made >= first.dealt_from:
                self._first = None  # nothing owed: the producers' from here on
                return None
            try:
                batch, nbytes = first.make()
            except ShmpipeError as exc:  # shmpipe's own (the default collate's BatchTypeError): as from a producer
                failure: BaseException = exc
            except Exception as exc:  # noqa: BLE001 - the dataset's error, raised as a producer's would be
                failure = WorkerError(-1, os.getpid(), type_name(exc), str(exc), "")
                failure.__cause__ = exc
            else:
                self._made_here = first.made
                return batch, nbytes, -1
        self._close_and_raise(failure)

    def _wait_for_start(self, t0: int) -> None:
        """Waits for the producers' start in the background to end, while the
        pipeline is open, within its timeout (from `t0`, the batch's ask)."""
        while self._launcher.starting:
            self._launcher.wait_for_start(POLL_S)
            if self._closed:
                raise PipelineClosedError("the pipeline was closed while waiting for a batch")
            self._raise_if_timed_out(t0, time.perf_counter_ns(), lambda: STARTING + self._launcher.describe_stall())

    def _hand_over(self, first: FirstBatches, dealt_from: int) -> None:
        """The producers get the pass, less its first `dealt_from` batches
        (the trainer's, made or owed); passes abandoned before their own
        hand-over go first, empty. Under the consumer lock; with Ctrl-C
        held back, so a pass is never sent without being recorded as sent."""
        assert isinstance(self._schedule, DatasetSchedule)
        works = self._schedule.hand_over(first.pass_no, dealt_from)
        failure: BaseException | None = None
        with ctrl_c_held_back():
            try:
                self._send_abandoned()
                self._launcher.begin_pass(first.pass_no, works)
            except WorkerDiedError as death:  # gone already: replaced, as at any pass's start (max_restarts)
                if not self._replaced(death):
                    failure = death
            except BaseException as exc:  # noqa: BLE001 - the start failed: nothing will come
                failure = exc
            first.dealt_from = dealt_from
            self._set_channel(self._launcher.channel)  # the fast path, withheld while the trainer made batches
        if failure is not None:
            self._close_and_raise(failure)

    def _send_abandoned(self) -> None:
        """Passes begun while the producers started and left before their
        hand-over (a loop broken out of, iterated again): every pass must
        reach the channel and the producers, in order, so each goes now,
        with nothing to make."""
        while self._abandoned:
            pass_no = self._abandoned[0]
            self._launcher.begin_pass(pass_no, [PassWork(pass_no, 0, 0)] * self.num_workers)
            del self._abandoned[0]

    def _take_from(self, channel: ConsumerEnd, pass_no: int, worker: int, wseq: int) -> Any:
        """One take from the channel: a batch or a sentinel (see
        ConsumerEnd.get). A variant that takes batches another way
        overrides this."""
        return channel.get(pass_no, worker, wseq, POLL_S)

    def _get(self, it: Pass, worker: int, wseq: int) -> Any:
        """One take, under the consumer lock, for a pass still current."""
        with self._consumer_lock:
            if it.pass_no != self._pass_no:
                raise PipelineClosedError(
                    "this iterator belongs to an earlier pass; iterating the pipeline again "
                    "started a new one (while this one waited for a batch)"
                )
            assert self._channel is not None  # opened before the first get
            with self._reading:
                if self._close_asked:  # from another thread: the channel may be gone
                    raise PipelineClosedError("the pipeline was closed while waiting for a batch")
                return self._take_from(self._channel, it.pass_no, worker, wseq)

    def _take_any(self, it: _PipelinePass, t0: int) -> Any:
        if self._channel is None:
            self._wait_for_channel(t0)
        while True:
            r = self._get(it, -1, 0)
            if r is AGAIN:
                self._raise_failure_if_any()  # after a failure, nothing arriving means all is out
                self._keep_waiting(t0)
            elif r is FAULT:
                self._learn_why_production_stopped()
                self._raise_failure_if_any()
            elif r is END:
                self._raise_failure_if_any()
                self._check_end(it.pass_no, range(self.num_workers))
                raise StopIteration
            else:
                return r

    def _take_ordered(self, it: _PipelinePass, t0: int) -> Any:
        if self._channel is None:
            self._wait_for_channel(t0)
        turns = it.turns
        assert turns is not None  # an ordered pass has turns
        while (turn := turns.next()) is not None:
            r = self._get(it, *turn)
            if r is AGAIN and self._failure is None:
                self._keep_waiting(t0)
            elif r is END:
                if self._failure is None:
                    self._check_end(it.pass_no, [turn[0]])
                turns.retire()  # this worker's part is over, all of it delivered
            elif r is AGAIN or r is FAULT:
                # Production stopped after a failure, and the batch whose turn
                # it is was not published: the pass ends here, before it. So
                # an ordered pass delivers a prefix of its sequence, even when
                # it fails, and a resume from its state delivers the rest in
                # the order an uninterrupted run would (what other workers
                # published after the gap is made again then, never lost).
                # Unless the worker's part ended before (all of it delivered):
                # a channel may say FAULT for it once production stopped (shm
                # checks the fault before the end), and its turns are over.
                if r is FAULT:
                    self._learn_why_production_stopped()  # which failure (it sets one)
                if self._part_delivered(it.pass_no, turn[0]):
                    turns.retire()
                    continue
                assert self._failure is not None
                self._close_and_raise(self._failure)
            else:
                turns.took()
                return r
        self._raise_failure_if_any()
        raise StopIteration

    def _part_delivered(self, pass_no: int, worker: int) -> bool:
        """Whether `worker` said its part of pass `pass_no` ended, after as
        many batches as were delivered (False where the launcher cannot tell)."""
        launcher = self._launcher
        return launcher.reports_ends and launcher.reported_end(worker, pass_no) == self._delivered_in_pass(worker)

    def _delivered_in_pass(self, worker: int) -> int:
        """Batches of `worker` delivered in the pass in progress."""
        return self._counters.per_worker[worker] - self._delivered_before[worker]

    def _check_end(self, pass_no: int, workers: Iterable[int]) -> None:
        """The channel says these workers' parts of pass `pass_no` are over: each must have said so
        on its control connection (which no other process can reach), after as many batches as were
        delivered. Words written from outside (an end marked early, a batch set free or moved to
        another pass) are an error, never a pass that quietly lacks batches."""
        launcher = self._launcher
        if not launcher.reports_ends:
            return
        for worker in workers:
            delivered = self._delivered_in_pass(worker)
            said = launcher.reported_end(worker, pass_no)
            if said != delivered:
                told = "has not said its part is over" if said is None else f"says it published {said} batches"
                self._close_and_raise(
                    CorruptChannelError(
                        f"the channel says worker {worker}'s part of pass {pass_no} is over after {delivered} "
                        f"batches, but its producer {told}: the channel lost or repeated batches (its memory "
                        f"written from outside, or a defect of {class_name(self._channel)})"
                    )
                )

    def _set_channel(self, channel: ConsumerEnd | None) -> None:
        """The channel is open (or not yet, for None): offer its fast path
        where the transport has one (capability takes_ready)."""
        self._channel = channel
        fast = channel is not None and self._offers_fast_path and self.transport.capabilities.takes_ready
        self._take_ready = channel.take_ready if fast and channel is not None else _declined

    def _wait_for_channel(self, t0: int) -> ConsumerEnd:
        """No channel yet: until the launcher opens it (sized by a first batch)."""
        while self._channel is None:
            with self._consumer_lock:  # one thread opens it
                if self._channel is None:
                    self._set_channel(self._open_channel())
            if self._channel is None:
                self._keep_waiting(t0)
        return self._channel

    def _open_channel(self) -> ConsumerEnd | None:
        """The launcher's channel once open (a producer gone by then: replaced). Under the consumer lock."""
        if self._close_asked:  # (None is also a closed pipeline's channel: _after_shutdown)
            raise PipelineClosedError("the pipeline was closed while waiting for a batch")
        try:
            return self._launcher.open_channel(POLL_S)
        except WorkerDiedError as death:
            if not self._replaced(death):
                raise
            return self._launcher.channel

    # -- failures, closing, timeouts: what decides whether to go on waiting ---
    #
    # A producer's failure stops production at once, but the batches it and
    # the others published before it are still delivered (an ordered pass:
    # up to the first batch that is missing, _take_ordered); the failure is
    # raised when nothing more is in flight. A close from another thread, a
    # timeout, and a consumer that holds every slot end a wait too.

    def _poll_producers(self, now: int) -> None:
        """Asks the launcher whether a producer failed or died; replaces one
        that died while restarts are left (max_restarts), notes any other."""
        self._last_health_ns = now
        self._health_due_ns = now + HEALTH_CHECK_NS
        failure = self._launcher.first_failure()
        while isinstance(failure, WorkerDiedError) and self.options.max_restarts:
            with self._consumer_lock:  # no take meanwhile, in any thread
                if not self._replaced(failure):
                    break
            failure = self._launcher.first_failure()
        if failure is not None:
            self._production_failed(failure)
        # After the deaths are dealt with: a dead producer may have left a
        # slot claimed and not yet counted, which its reclaim puts right.
        self._audit()

    def _audit(self) -> None:
        """The channel's audit, its error the pipeline's. Not in _poll_producers: frames a stored failure
        reaches (callers' too) must name no channel, or the ring stays mapped until a collection."""
        channel = self._channel
        if channel is not None and not self._closed and self._failure is None:
            try:
                with self._consumer_lock:  # between takes
                    channel.audit(self._begun)
            except CorruptChannelError as exc:
                del channel
                traceback.clear_frames(exc.__traceback__)  # the channel's own frames
                self._close_and_raise(exc)

    def _replaced(self, death: WorkerDiedError) -> bool:
        """Replaces the producer `death` names, if restarts are left: its slots being written come back,
        what it published is still delivered, and a new process goes on after its last published batch,
        so the run (an ordered run's sequence too) is what a run without the death delivers. False when
        no restart is left, the ring cannot say where it stopped or the replacement did not start:
        `death` is then the pipeline's failure, saying so. PipelineClosedError once the pipeline is
        closed. Under the consumer lock."""
        # close() from another thread since the death was found: what a wait
        # sees of a close(). (Not _closed: a pipeline counts as closed until
        # it is made, and its constructor begins the first pass.)
        if self._close_asked:
            raise PipelineClosedError("the pipeline was closed: the producer that died is not replaced")
        if self._failure is not None or not self._launcher.can_restart:
            return False
        if len(self._restarts) >= self.options.max_restarts:
            if self._restarts:
                history = "; ".join(self._restarts)
                death.add_pipeline_note(f"{len(self._restarts)} producer(s) died and were replaced before: {history}")
            return False
        worker = death.worker_id
        pass_no = self._begun
        channel = self._launcher.channel
        # Its batches of that pass taken so far (a pass begun ahead: none).
        delivered = 0
        if self._ahead is None and pass_no == self._pass_no:
            delivered = self._counters.per_worker[worker] - self._delivered_before[worker]
        try:
            next_wseq, finished = (0, False) if channel is None else channel.reclaim(worker, pass_no, delivered)
        except CorruptChannelError as exc:  # the ring cannot say where it stopped: the death stands
            traceback.clear_frames(exc.__traceback__)  # (the channel's frames: the ring mapped while it lives)
            death.add_pipeline_note(f"it was not replaced: {exc}")
            death.__cause__ = exc
            return False
        finally:
            del channel  # (as this frame: kept by a failure's traceback)
        try:
            pid = self._launcher.restart(worker)
        except PipelineClosedError:
            raise  # closed from another thread since the look above: what a wait sees of a close()
        except Exception as exc:  # noqa: BLE001 - no replacement (a stopped fork server): the death stands
            death.add_pipeline_note(f"its replacement did not start: {exc}")
            death.__cause__ = exc
            return False
        self._restarts.append(str(death))
        self._counters.restarts[worker] += 1
        where = f"after its batch {next_wseq - 1}" if next_wseq else "from its first batch"
        warnings.warn(
            f"{death}; replaced by pid {pid}, which goes on {where} of this pass "
            f"(restart {len(self._restarts)} of max_restarts={self.options.max_restarts})",
            ShmpipeWarning,
            stacklevel=users_stacklevel(),
        )
        if pass_no >= 0 and not finished:
            self._launcher.send_pass(worker, self._schedule.resumed(worker, next_wseq))
        return True

    def _production_failed(self, exc: BaseException) -> None:
        """A producer failed: production stops now; `exc` is raised once
        what was published before is delivered (_raise_failure_if_any;
        ordered, up to the first batch missing: _take_ordered)."""
        if self._failure is not None:
            return  # the first failure is the one to report
        self._failure = exc
        if self._channel is None:
            self._close_and_raise(exc)  # nothing was published: nothing to deliver first
        self._channel.halt()
        self._launcher.halt()

    def _learn_why_production_stopped(self) -> None:
        """The channel says a failure stopped production: make sure we know
        which (the producer's message may still be on its way)."""
        self._poll_producers(time.perf_counter_ns())
        if self._failure is None:
            self._launcher.wait_for_event(1.0)
            self._poll_producers(time.perf_counter_ns())
        if self._failure is None:
            self._failure = WorkerError(-1, None, "unknown", "a producer reported a failure but sent no details", "")

    def _raise_failure_if_any(self) -> None:
        """Nothing more is in flight: if a producer failed, close and raise."""
        if self._failure is not None:
            self._close_and_raise(self._failure)

    def _keep_waiting(self, t0: int) -> None:
        """Nothing came within one POLL_S since the wait began at `t0`:
        raises if the pipeline was closed meanwhile or the timeout passed,
        notes a producer's failure, warns once per pass if the consumer
        itself holds the slots the producers need."""
        if self._closed:  # close() from another thread while this one waited
            raise PipelineClosedError("the pipeline was closed while waiting for a batch")
        self._waited()  # what lets go of the slots the trainer dropped (to_jax)
        now = time.perf_counter_ns()
        self._poll_producers(now)  # a failure is raised once all is delivered
        if now - t0 >= STALL_WARNING_NS and self._stall_warned != self._pass_no:  # once per pass
            if warn_if_held_up_by_consumer(self._channel, self._spec.consumer_may_hold, self.capacity, now - t0):
                self._stall_warned = self._pass_no
        self._raise_if_timed_out(t0, now, lambda: describe_wait(self._channel, self._launcher, self._restarts))

    # -- what the adapters read ---------------------------------------------------

    def held(self) -> int | None:
        channel = self._channel
        return channel.held() if channel is not None else None

    def owns_memory(self) -> bool:
        channel = self._channel
        return channel is not None and channel.owns_memory

    def memory_ranges(self) -> list[tuple[int, int]]:
        channel = self._channel
        return channel.memory_ranges() if channel is not None else []

    # -- observation ----------------------------------------------------------

    def _producer_blocked(self) -> list[float | None]:
        channel = self._channel
        if channel is None or self._closed:
            return list(self._blocked_s)
        return [channel.producer_blocked_s(w) for w in range(self.num_workers)]

    @property
    def pids(self) -> list[int | None]:
        """The producers' process ids (None: on other machines). One that died stays until the next look
        replaces or reports it, though reaped at once by the fork server: its pid may be reused meanwhile."""
        return self._launcher.pids

    @property
    def channel(self) -> ConsumerEnd | None:
        """The transport's ConsumerEnd (None before a channel sized by the first batch is open, and once closed)."""
        return self._channel

    @property
    def slot_size(self) -> int | None:
        made = self._channel.slot_size if self._channel is not None else self._slot_size_at_close
        return made if made is not None else self.options.slot_size

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pass {max(self._pass_no, 0)}"
        return (
            f"<shmpipe.Pipeline {self.num_workers} workers, transport={self.transport.name!r}, "
            f"capacity={self.capacity}, ordered={self.ordered}, {state}>"
        )
