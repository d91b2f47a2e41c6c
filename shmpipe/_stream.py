"""What every stream of batches shares: BatchStream.

A *stream* is what a user iterates: a :class:`~shmpipe.Pipeline` (N producer
processes feeding this one) or a :class:`~shmpipe.RankPipeline` (this
process's share of a pipeline that a group of ranks shares). Both iterate
in passes, close the same way (hooks, a finalizer, nothing left behind),
count what they deliver, time out the same way, and feed the framework
adapters (shmpipe/_torch.py, shmpipe/_tf.py), which are typed against this
base and read only what it declares. Where the next batch comes from is
each subclass's ``_take``; everything around it is here.

Below this module: the options, the counters, the errors and _interrupts
(a close() from a signal handler put off to the end of a take). Above it: the
two shapes of stream, the adapters (which import this module, never the
shapes), and shmpipe/_api.py, which makes streams.
"""

from __future__ import annotations

import abc
import multiprocessing.process
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from shmpipe import _spans
from shmpipe._counters import Counters
from shmpipe._options import PipelineOptions
from shmpipe.errors import PipelineClosedError, PipelineTimeoutError, ShmpipeError, ShmpipeValueError
from shmpipe.transport import Transport

if TYPE_CHECKING:
    from shmpipe._stats import PipelineStats

__all__ = ["POLL_S", "BatchStream", "Had", "Pass", "TrainerPosition"]

#: How long one wait for a batch lasts before the stream looks again at
#: what may end it (a producer's or a rank's death, a close from another
#: thread, the deadline): also the longest a death can go unnoticed.
POLL_S = 0.1
#: How long a close() waits for a take in progress in another thread to end
#: before it shuts the channel down under it (see BatchStream._own): a read
#: of the channel waits POLL_S at most.
TAKES_END_WITHIN_S = 5.0


_Stream = TypeVar("_Stream", bound="BatchStream")


class Pass:
    """The iterator of one pass over a stream (what ``iter(stream)`` returns)."""

    __slots__ = ("delivered", "finished", "last_worker", "pass_no", "started_ns", "stream")

    def __init__(self, stream: BatchStream, pass_no: int) -> None:
        self.stream = stream
        self.pass_no = pass_no
        self.finished = False
        #: Whether _next delivered a batch of this pass (and counted it).
        self.delivered = False
        #: When the pass first asked for a batch (its clock starts there).
        self.started_ns: int | None = None
        #: The worker the batch delivered last came from (-1: the trainer).
        self.last_worker = -1

    def __iter__(self) -> Pass:
        return self

    def __next__(self) -> Any:
        return self.stream._next(self)


class Had:
    """What the trainer has had of the pass in progress (TrainerPosition):
    the count a stream's state is made from in place of its own."""

    __slots__ = ("delivered", "finished", "made_here", "next_turn", "pass_no")

    def __init__(
        self, pass_no: int, made_here: int, delivered: dict[int, int], next_turn: int | None, finished: bool
    ) -> None:
        #: the pass counted: a state of another pass (one begun since, in
        #: the trainer's thread, while another thread made a state) is the
        #: stream's own count, not this (Had.of_pass)
        self.pass_no = pass_no
        #: batches made in the trainer itself (worker -1) it has had
        self.made_here = made_here
        #: per worker, the batches of it the trainer has had
        self.delivered = delivered
        #: an ordered pass: the worker whose batch the trainer gets next,
        #: where one was taken ahead of it; None: the stream's own turn
        self.next_turn = next_turn
        #: the trainer had the pass's end
        self.finished = finished

    def of(self, worker: int) -> int:
        return self.delivered.get(worker, 0)

    def total(self) -> int:
        return self.made_here + sum(self.delivered.values())

    @staticmethod
    def of_pass(had: Had | None, pass_no: int) -> Had | None:
        """`had` if it counts pass `pass_no`, else None. Read where the pass
        cannot change meanwhile (under the lock the stream begins passes
        under): nothing of a pass was taken ahead before its own position
        was made, so its own count is the trainer's until then."""
        return had if had is not None and had.pass_no == pass_no else None


class TrainerPosition:
    """Where the trainer stands in a pass whose batches an adapter takes
    ahead of it (to_jax's thread, to an accelerator), so that the stream's
    ``state_dict()`` counts the batches the trainer has had and not those
    in the adapter's buffer, which a run resumed from it would otherwise
    never deliver.

    The adapter's thread notes each batch it takes (``taking`` before it
    asks, with whose turn it is; ``took`` with the worker it came from;
    ``not_taken`` where the pass ended or failed instead), in order; the
    trainer's side counts, per worker, what it gets (``had_one``,
    ``had_end``). The stream makes its state from ``had()`` under this
    lock, and the thread notes a take under it before it asks the stream
    for the batch: so a state is never made while a batch is taken and not
    yet noted, and an ordered pass's next turn is that of the oldest batch
    taken ahead, or else the stream's own, which then has nothing beyond
    the trainer's. Cheap on purpose: a few list operations per batch, no
    state made on the thread (which would cost O(epoch) per batch, and at
    an epoch's end draw the next epoch's sampler). Lock order: this lock,
    then the stream's own.

    The lock is taken in a span of the stream (`spans`, its
    TeardownAfterSpans) wherever it is taken: a signal handler run there
    by the main thread (the trainer's side, to_tf_dataset's peek) that asks
    for a state then gets the stream's error, not a wait for ever for its
    own thread's lock. (Another thread's spans count for nothing: no
    handler interrupts it.)
    """

    __slots__ = (
        "_ahead", "_asking", "_delivered", "_finished", "_had", "_made_here", "lock", "pass_no", "sees_asks", "spans",
    )

    def __init__(self, pass_no: int, spans: _spans.TeardownAfterSpans, sees_asks: bool = False) -> None:
        self.lock = threading.Lock()
        self.spans = spans
        #: The pass it counts: once another began, it counts nothing of it.
        self.pass_no = pass_no
        #: Whether the trainer's side says when it asks (``asking``: to_jax's
        #: pass does); where it does not (tf.data), a batch is had as the
        #: trainer's side takes it.
        self.sees_asks = sees_asks
        #: Batches the trainer has had (the total of the two counts below,
        #: kept for the reads without the lock)
        self._had = 0
        self._made_here = 0
        self._delivered: dict[int, int] = {}
        self._finished = False
        #: The batches taken ahead, oldest first: [whose turn it was before
        #: the take, the worker it came from (None while being taken)].
        self._ahead: deque[list[int | None]] = deque()
        #: The trainer asked for a batch it has not been given yet.
        self._asking = False

    # -- the adapter's thread -------------------------------------------------

    def taking(self, turn: int | None) -> list[int | None]:
        """About to ask the stream for a batch; `turn`: the stream's next
        turn now (``_next_turn``, read under this lock)."""
        entry: list[int | None] = [turn, None]
        self._ahead.append(entry)
        return entry

    def took(self, entry: list[int | None], worker: int) -> None:
        with self.spans, self.lock:
            entry[1] = worker

    def not_taken(self, entry: list[int | None]) -> None:
        """The ask gave no batch (the pass's end, an error)."""
        with self.spans, self.lock:
            if self._ahead and self._ahead[-1] is entry:
                self._ahead.pop()

    # -- the trainer's side ---------------------------------------------------

    def asking(self) -> None:
        """The trainer asks for its next batch (or the pass's end)."""
        with self.spans, self.lock:
            self._asking = True

    def had_one(self) -> None:
        """The trainer was given the oldest batch taken ahead."""
        with self.spans, self.lock:
            self._asking = False
            self._had += 1
            worker = self._ahead.popleft()[1]
            assert worker is not None  # noted (took) before it was queued for the trainer
            if worker < 0:
                self._made_here += 1
            else:
                self._delivered[worker] = self._delivered.get(worker, 0) + 1

    def had_end(self) -> None:
        """The trainer was given the pass's end."""
        with self.spans, self.lock:
            self._finished = True

    # -- reads without the lock (a group's rank makes them under its own
    # consumer lock, which a state_dict() takes inside this one) ------------

    def had_count(self) -> int:
        """Batches the trainer has had (one int read: no lock needed)."""
        return self._had

    def waits_past_its_batches(self) -> bool:
        """The trainer has had every batch taken ahead and asks for more:
        the stream's end of the pass is now the trainer's too (a group's
        rank says so to rank 0). Made in the adapter's thread, the only one
        that adds to the batches taken ahead, without the lock: first the
        batches still ahead (a snapshot: list() of a deque is one step under
        the GIL), then whether the trainer asks. Both only fall on the
        trainer's side, and had_one clears the ask as it takes a batch, so an
        ask seen after an empty snapshot is an ask past the last batch."""
        if not self.sees_asks:
            return True
        if any(worker is not None for _, worker in list(self._ahead)):
            return False
        return self._asking

    def had(self) -> Had:
        """What the trainer has had; call under ``lock``."""
        turn = self._ahead[0][0] if self._ahead else None
        return Had(self.pass_no, self._made_here, dict(self._delivered), turn, self._finished)


class BatchStream(abc.ABC):
    """A stream of batches in passes: the skeleton every shape shares.

    Subclasses implement ``_begin_pass`` (start pass n wherever batches come
    from), ``_take`` (the next batch of a pass, with what is counted of it)
    and what the adapters read (``consumer_may_hold``, ``held``). They call
    ``_own`` with the function that shuts down what they own as soon as
    they own something, and set ``_closed`` to False once they are made.
    """

    def __init__(self, options: PipelineOptions) -> None:
        self.options = options
        self._closed = True  # until the subclass is made
        self._close_asked = False  # whether close() was called (it may be put off: _spans)
        self._pass_no = -1  # the pass in progress; -1: none began
        self._finished_pass = -1  # the pass delivered to its end last
        self._counters = Counters(options.num_workers)
        # Called, last first, before what the stream owns goes: what
        # adapters did to its memory is undone there (to_torch's CUDA
        # registration).
        self._close_hooks: list[Callable[[], None]] = []
        #: Run each POLL_S a take waits (call_while_waiting).
        self._waiting_hooks: list[Callable[[], object]] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._owner_pid = os.getpid()
        self._forked_from: int | None = None  # set in a child forked from the owner
        #: What a failure's close stopped the stream at ("Type: first line"),
        #: for what a use after it says: words, not the exception, whose
        #: traceback's frames hold the channel.
        self._stopped_by: str | None = None
        #: What adapters made of the stream keep alive while it lives
        #: (to_tf_dataset's owners: _tf._Owner says why); each is told when
        #: a pass begins (``pass_began(pass_no)``), to let go of the batches
        #: of an earlier pass it holds (they hold slots).
        self._adapters_keep: list[Any] = []
        #: The pass's batches that the trainer has had, where an adapter
        #: takes them ahead of it (_position_for_adapter); None: all it took.
        self._trainer_position: TrainerPosition | None = None
        #: Held while the position is replaced and while a state is made.
        self._position_lock = threading.Lock()
        #: Whether the pipeline knows its batches may differ in size along
        #: their first axis (from_dataset's partial last batch): to_tf_dataset
        #: then leaves that axis unknown instead of inferring it.
        self._batch_sizes_vary = False
        #: ... and the rows of an epoch's short batch where it knows them (to_jax refuses a sharding that
        #: cannot split them at the first batch, not an epoch later): Schedule.short_batch.
        self._short_batch: int | None = None
        #: A pass's start and each take are spans: a close() from a signal
        #: handler that interrupts one (in the consumer's thread) marks the
        #: stream closed at once, and what it owns goes as the span ends,
        #: not from under the code it interrupted (that went on to read
        #: producers' links and pidfds already closed, and raised a false
        #: CorruptChannelError, ValueError or IndexError)
        self._spans = _spans.TeardownAfterSpans()

    def _own(self, shutdown: Callable[[], None], takes: threading.RLock | None = None) -> None:
        """From now on close() (or the stream's collection, if it is
        forgotten) runs the close hooks, then `shutdown`, once. `shutdown`
        must not refer to the stream, or the stream would never be
        collected. `takes`: the lock a take holds while it reads the
        channel; `shutdown` runs under it, so a close() from another thread
        never destroys a channel under a get() in progress (a transport's
        get reading a descriptor its destroy closed, whose number the
        system may have given to another file meanwhile). A read holds it
        for POLL_S at most; the close waits TAKES_END_WITHIN_S at most, then
        shuts down all the same. Reentrant: a signal handler's close() in
        the thread that holds it runs at once, as it did without it (where
        _spans does not put it off)."""
        self._teardown = (self._close_hooks, shutdown, self._owner_pid, takes)
        self._finalizer = weakref.finalize(self, _shut_down, *self._teardown)
        _live.add(self)

    # -- configuration --------------------------------------------------------

    @property
    def transport(self) -> Transport:
        return self.options.transport

    @property
    def num_workers(self) -> int:
        return self.options.num_workers

    @property
    def capacity(self) -> int:
        """Places for batches between the producers and this process (the
        ring's slots): what producers may have made ahead, and what the
        batches you hold take up (``consumer_may_hold`` of them at most)."""
        return self.options.capacity

    @property
    def ordered(self) -> bool:
        return self.options.ordered

    @property
    def start_method(self) -> str:
        return self.options.start_method

    @property
    def timeout(self) -> float | None:
        return self.options.timeout

    @property
    def seed(self) -> int:
        return self.options.seed

    # -- start and stop -------------------------------------------------------

    def close(self) -> None:
        """Stops what this stream owns. Idempotent, from any thread (a wait
        for a batch in another thread raises PipelineClosedError). Batches
        you still hold stay valid; the stream cannot be iterated again."""
        if self._forked_from is not None:
            return  # a forked child's copy: the stream is its parent's to close
        first = not self._closed
        # Asked before _before_close: a rank's closes its reader, and a take
        # in another thread that then fails must find the close
        # (PipelineClosedError), not report the reader's end as a fault.
        self._close_asked = True
        if first:
            self._before_close()
        self._closed = True
        if self._finalizer is not None and not self._spans.defer(self._shut_down_now):
            self._shut_down_now()

    def _shut_down_now(self) -> None:
        try:
            self._finalize()
        finally:
            self._after_shutdown()

    def _finalize(self) -> None:
        """Runs what _own registered, now. A finalizer is spent as its call
        begins (weakref.finalize takes it off its registry, then calls), so
        a teardown cut by an exception (a Ctrl-C, a signal handler's
        sys.exit, as it began or anywhere in it) would never run again, from
        this close() or a later one, nor at exit: the producers would run
        and a ring's name stay. Cut, it is owed again, to the next close()
        or the stream's collection; its parts are idempotent (what was done
        is not redone). Not at the interpreter's exit: a cut that left a
        lock of the standard library held (threading.Event's, a Condition's:
        their __enter__ is Python) would make the exit wait on it for ever,
        and at exit the producers end on their own (their consumer is gone),
        a memfd ring with them. Not covered: a second interrupt that lands
        in this except clause."""
        assert self._finalizer is not None
        try:
            self._finalizer()
        except BaseException:
            owed = weakref.finalize(self, _shut_down, *self._teardown)
            owed.atexit = False
            self._finalizer = owed
            raise

    def _before_close(self) -> None:
        """What the subclass notes while it is still open (once)."""

    def _after_shutdown(self) -> None:
        """What the subclass lets go of once close() shut it down (each
        close: idempotent; a close put off by _spans: at the span's end)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def call_on_close(self, hook: Callable[[], None]) -> None:
        """Runs `hook` when the stream closes (or is collected unclosed),
        while the memory its batches live in still exists; hooks run last
        registered first. For adapters that must undo what they did to that
        memory (to_torch unregisters it from CUDA). The hook must not refer
        to the stream, or a forgotten stream would never be collected."""
        if self._closed:
            raise PipelineClosedError("this pipeline is closed")
        self._close_hooks.append(hook)

    def call_while_waiting(self, hook: Callable[[], object]) -> None:
        """Runs `hook` in the thread that waits for a batch, each time it has
        waited POLL_S for one (once per hook, however often it is given).
        For adapters whose dropped batches let go of their slots only when
        something runs: jaxlib lets go of the host array of a jax.Array that
        died at its next collection, and a trainer waiting for its next batch
        runs none, while the slots it waits for are those (the wait lasted
        for ever). The hook must be cheap and must not refer to the stream."""
        if hook not in self._waiting_hooks:
            self._waiting_hooks.append(hook)

    def _waited(self) -> None:
        """A take has waited POLL_S (call_while_waiting)."""
        for hook in self._waiting_hooks:
            hook()

    def __enter__(self: _Stream) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget_children(self, children: set[Any]) -> None:
        """In a forked child: take the processes this stream started off
        multiprocessing's list of children (see _after_fork_in_child)."""

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        with self._spans:
            self._check_usable()
            pass_no = self._begin_pass()
            with self._position_lock:
                self._trainer_position = None  # the new pass's batches are taken by whoever iterates it
            for kept in self._adapters_keep:
                kept.pass_began(pass_no)  # what they hold of an earlier pass can never be delivered now
            self._counters.pass_started()
            return self._new_pass(pass_no)

    @abc.abstractmethod
    def _begin_pass(self) -> int:
        """Starts the next pass; returns its number (and sets _pass_no)."""

    def _new_pass(self, pass_no: int) -> Pass:
        return Pass(self, pass_no)

    def _next(self, it: Pass) -> Any:
        """The next batch of pass `it`: the checks, the clock and the
        counting around the subclass's _take; a span (_spans)."""
        with self._spans:
            return self._next_in_span(it)

    def _next_in_span(self, it: Pass) -> Any:
        if it.finished:
            raise StopIteration
        self._check_usable()
        self._check_pass(it.pass_no)
        t0 = time.perf_counter_ns()
        if it.started_ns is None:
            it.started_ns = t0
        try:
            batch, nbytes, worker = self._take(it, t0)
        except StopIteration:
            it.finished = True
            self._finished_pass = it.pass_no
            self._counters.pass_finished(it.started_ns)
            raise
        self._counters.delivered(t0, time.perf_counter_ns(), nbytes, worker)
        it.delivered = True
        it.last_worker = worker
        return batch

    @abc.abstractmethod
    def _take(self, it: Pass, t0: int) -> tuple[Any, int, int]:
        """(batch, its payload's bytes, its worker) of pass `it`, asked for
        at `t0`; StopIteration at the end of the pass."""

    # -- checkpoints ----------------------------------------------------------

    def _state(self, had: Had | None = None) -> dict[str, Any]:
        """Where the stream stands (a subclass's state): from what it has
        handed out, or, given `had`, from what the trainer has had of the
        pass in progress (_state_of_the_trainer)."""
        raise ShmpipeValueError(f"a {type(self).__name__} cannot save its position")

    def _next_turn(self) -> int | None:
        """An ordered pass's worker whose batch comes next (None: no turns)."""
        return None

    def _state_of_the_trainer(self) -> dict[str, Any]:
        """What ``state_dict()`` returns: the stream's state as of the
        batches the trainer has had."""
        if self._spans.inside():
            # A signal handler's, run by this thread in its own take, pass
            # start or state: the lock a state is made under may be this
            # thread's own (a wait for ever), and the take's count half-made.
            raise ShmpipeError(
                "state_dict() was called from a signal handler that interrupted this pipeline's own next(), "
                "iter() or state_dict() in the same thread; note the request in the handler and take the state "
                "in the loop, between steps (docs/long-runs.md, 'Preempted: SIGTERM')"
            )
        with self._spans:
            with self._position_lock:
                position = self._trainer_position
                if position is None:
                    return self._state()
                with position.lock:
                    return self._state(position.had())

    def _position_for_adapter(self, ahead: int, sees_asks: bool = False) -> TrainerPosition:
        """For an adapter that takes the batches of the pass just begun
        ahead of the trainer (to_jax's thread), at most `ahead` of them
        before the trainer has them: the position it keeps, which
        ``state_dict()`` answers from until the next pass begins. Made
        before the adapter takes any batch, under the lock a state is made
        under: a state made from another thread meanwhile is the pass's
        start, never a count of batches the trainer has not had.
        `sees_asks`: the adapter tells when the trainer asks (asking())."""
        self._states_needed_behind(ahead)
        position = TrainerPosition(self._pass_no, self._spans, sees_asks)
        with self._spans, self._position_lock:  # (a span: see TrainerPosition)
            self._trainer_position = position
        return position

    def _adapter_caught_up(self, position: TrainerPosition) -> None:
        """The trainer has had every batch an adapter took ahead of it with
        `position`, and the adapter takes no more ahead (to_tf_dataset's
        peek, once tf.data has taken the peeked batches): the stream's own
        count is the trainer's again."""
        with self._spans, self._position_lock:  # (a span: see TrainerPosition)
            if self._trainer_position is position:
                self._trainer_position = None

    def _states_needed_behind(self, ahead: int) -> None:
        """A state may now be made `ahead` batches behind those taken: what
        the stream keeps to make one must reach that far back."""

    def _note_taking(self, position: TrainerPosition) -> list[int | None]:
        """The adapter's thread, about to ask for a batch of the pass."""
        with self._spans, position.lock:  # (a span: see TrainerPosition)
            return position.taking(self._next_turn())

    def _take_ahead(self, it: Pass, position: TrainerPosition) -> Any:
        """The next batch of pass `it`, taken by an adapter ahead of the
        trainer and noted in `position` (StopIteration at the pass's end)."""
        noted = self._note_taking(position)
        try:
            batch = next(it)
        except BaseException:
            position.not_taken(noted)
            raise
        position.took(noted, it.last_worker)
        return batch

    def _check_usable(self) -> None:
        if self._closed:
            self._raise_closed()

    def _check_pass(self, pass_no: int) -> None:
        """Raises unless pass `pass_no` is the one in progress: an iterator
        of an earlier pass (the stream's own, or an adapter's that took
        batches ahead of the trainer) gives nothing more."""
        if pass_no != self._pass_no:
            raise PipelineClosedError(
                "this iterator belongs to an earlier pass; iterating the pipeline again started a new one"
            )

    def _close_and_raise(self, exc: BaseException) -> NoReturn:
        """Stops everything, then raises `exc` (a use after it says what
        stopped the stream); PipelineClosedError where a close() came first
        (a signal handler's, inside the very take that found `exc`)."""
        if self._close_asked:
            raise PipelineClosedError("the pipeline was closed") from exc
        first_line = str(exc).partition("\n")[0]
        self._stopped_by = f"{type(exc).__name__}: {first_line}"
        self.close()
        raise exc

    def _raise_closed(self) -> NoReturn:
        if self._forked_from is not None:
            raise PipelineClosedError(
                f"this pipeline belongs to process {self._forked_from}; a process forked from it cannot use "
                "it (its batches and slots are the parent's): make a pipeline of its own in the child"
            )
        if self._stopped_by is not None:
            raise PipelineClosedError(f"this pipeline is closed: it stopped at {self._stopped_by}")
        raise PipelineClosedError("this pipeline is closed")

    def _raise_if_timed_out(self, t0: int, now: int, why: Callable[[], str]) -> None:
        """PipelineTimeoutError once a wait begun at `t0` has lasted
        ``timeout`` seconds; `why()` ends its message (what the wait is
        stuck on, punctuation included)."""
        timeout = self.options.timeout
        if timeout is not None and now - t0 >= timeout * 1e9:
            raise PipelineTimeoutError(f"no batch within {timeout:g} s{why()}")

    # -- what the adapters read -------------------------------------------------

    @property
    @abc.abstractmethod
    def consumer_may_hold(self) -> int:
        """The most batches this process may hold while the batch it waits
        for is still sure to come (see ChannelSpec.consumer_may_hold)."""

    def held(self) -> int | None:
        """Delivered batches that still hold a place (a slot), where
        batches hold places at all; None otherwise."""
        return None

    def owns_memory(self) -> bool:
        """Whether memory_ranges() is this stream's own memory, mapped until
        it closes and shared with nothing else: only then may to_torch
        page-lock it for CUDA."""
        return False

    def memory_ranges(self) -> list[tuple[int, int]]:
        """(address, size) of the memory delivered arrays live in, in this
        process; empty where the transport does not say."""
        return []

    @property
    def slot_size(self) -> int | None:
        """Bytes per slot, where the transport has slots (None otherwise,
        or until the first batch sized the ring)."""
        return None

    # -- observation ----------------------------------------------------------

    def _producer_blocked(self) -> list[float | None]:
        return [None] * self.num_workers

    def _stats_extra(self) -> dict[str, Any]:
        return {}

    def stats(self) -> PipelineStats:
        """Counters of everything delivered so far (see PipelineStats)."""
        return self._counters.snapshot(
            producer_blocked_s=self._producer_blocked(),
            transport=self.transport.name,
            capacity=self.capacity,
            slot_size=self.slot_size,
            extra=self._stats_extra(),
        )


def _shut_down(
    close_hooks: list[Callable[[], None]],
    shutdown: Callable[[], None],
    owner_pid: int,
    takes: threading.RLock | None,
) -> None:
    """A stream's end: its close hooks, then what it owns, once no take is
    in progress (see _own). A function, not a method: the finalizer must
    not keep the stream alive. In a process forked from the owner (where
    finalizers run at exit too) it does nothing: the producers, the memory
    and the sockets are the parent's."""
    if os.getpid() != owner_pid:
        return
    try:
        while close_hooks:
            close_hooks.pop()()
    finally:
        if takes is None:
            shutdown()
        else:  # (takes's acquire and its release's try, where no signal cuts between)
            _spans.call_holding(takes, TAKES_END_WITHIN_S, lambda took: shutdown())  # (without it: all the same)


#: Every open stream of this process, for the fork handler below.
_live: weakref.WeakSet[BatchStream] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a child forked (os.fork) from a process with streams: each one
    becomes unusable here and is never stopped from here. multiprocessing
    would otherwise, at the child's exit, SIGTERM the parent's daemon
    producers it still lists as children (its own children reset that list
    themselves; a bare os.fork does not), so they are taken off it."""
    # The set multiprocessing's exit handler walks (not in its stubs).
    children: set[Any] = getattr(multiprocessing.process, "_children", set())
    for stream in list(_live):
        stream._forked_from = stream._owner_pid
        stream._closed = True
        stream._forget_children(children)


os.register_at_fork(after_in_child=_after_fork_in_child)
