"""What every stream of batches shares: BatchStream.

A *stream* is what a user iterates: a :class:`~shmpipe.Pipeline` (N producer
processes feeding this one) or a :class:`~shmpipe.RankPipeline` (this
process's share of a pipeline that a group of ranks shares). Both iterate
in passes, close the same way (hooks, a finalizer, nothing left behind),
count what they deliver, time out the same way, and feed the framework
adapters (shmpipe/_torch.py, shmpipe/_tf.py), which are typed against this
base and read only what it declares. Where the next batch comes from is
each subclass's ``_take``; everything around it is here.

Below this module: the options, the counters and the errors. Above it: the
two shapes of stream, the adapters (which import this module, never the
shapes), and shmpipe/_api.py, which makes streams.
"""

from __future__ import annotations

import abc
import copy
import multiprocessing.process
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from shmpipe._options import PipelineOptions
from shmpipe._stats import Counters, PipelineStats
from shmpipe.errors import PipelineClosedError, PipelineTimeoutError, ShmpipeValueError
from shmpipe.transport import Transport

__all__ = ["POLL_S", "BatchStream", "Pass", "TrainerPosition"]

#: How long one wait for a batch lasts before the stream looks again at
#: what may end it (a producer's or a rank's death, a close from another
#: thread, the deadline): also the longest a death can go unnoticed.
POLL_S = 0.1


_Stream = TypeVar("_Stream", bound="BatchStream")


class Pass:
    """The iterator of one pass over a stream (what ``iter(stream)`` returns)."""

    __slots__ = ("delivered", "finished", "pass_no", "started_ns", "stream")

    def __init__(self, stream: BatchStream, pass_no: int) -> None:
        self.stream = stream
        self.pass_no = pass_no
        self.finished = False
        #: Whether _next delivered a batch of this pass (and counted it).
        self.delivered = False
        #: When the pass first asked for a batch (its clock starts there).
        self.started_ns: int | None = None

    def __iter__(self) -> Pass:
        return self

    def __next__(self) -> Any:
        return self.stream._next(self)


class TrainerPosition:
    """Where the trainer stands in a pass whose batches an adapter takes
    ahead of it (to_jax's thread, to an accelerator): ``state_dict()`` then
    counts the batches the trainer has had, not those in the adapter's
    buffer, which a resumed run would otherwise never deliver.

    The adapter's thread keeps the stream's state *before* each batch it
    asks for (``before_take``); the trainer's side counts what it gets
    (``had``, ``ended``). Before, not after: a state kept after a take
    leaves a moment (the batch taken, its state not kept yet) when neither
    the stream's state nor a kept one is the trainer's. Kept before, under
    the lock that ``state`` holds too, the stream's own state is the
    trainer's whenever none is kept for its count: the thread has not
    asked for a batch beyond it, and cannot while ``state`` runs. Lock
    order: this lock, then the stream's own (in the stream's ``_state``).
    """

    __slots__ = ("_ended", "_first", "_had", "_kept", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._had = 0  # batches of the pass the trainer has had
        #: the stream's states after _first, _first + 1, ... batches taken
        self._kept: deque[dict[str, Any]] = deque()
        self._first = 0
        self._ended = False  # the trainer had the pass's end: the stream's own state is its

    def before_take(self, own: Callable[[], dict[str, Any]]) -> None:
        """The adapter's thread, before it asks the stream for a batch;
        `own`: the stream's ``_state``."""
        with self._lock:
            self._kept.append(own())

    def had(self) -> None:
        """The trainer was given a batch."""
        with self._lock:
            self._had += 1
            while self._first < self._had and self._kept:
                self._kept.popleft()
                self._first += 1

    def ended(self) -> None:
        """The trainer was given the pass's end."""
        with self._lock:
            self._ended = True
            self._kept.clear()

    def state(self, own: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The state as of the batches the trainer has had."""
        with self._lock:
            i = self._had - self._first
            if not self._ended and 0 <= i < len(self._kept):
                return copy.deepcopy(self._kept[i])  # the caller's to change
            return own()


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
        self._pass_no = -1  # the pass in progress; -1: none began
        self._finished_pass = -1  # the pass delivered to its end last
        self._counters = Counters(options.num_workers)
        # Called, last first, before what the stream owns goes: what
        # adapters did to its memory is undone there (to_torch's CUDA
        # registration).
        self._close_hooks: list[Callable[[], None]] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._owner_pid = os.getpid()
        self._forked_from: int | None = None  # set in a child forked from the owner
        #: The pass's batches that the trainer has had, where an adapter
        #: takes them ahead of it (_position_for_adapter); None: all it took.
        self._trainer_position: TrainerPosition | None = None

    def _own(self, shutdown: Callable[[], None]) -> None:
        """From now on close() (or the stream's collection, if it is
        forgotten) runs the close hooks, then `shutdown`, once. `shutdown`
        must not refer to the stream, or the stream would never be
        collected."""
        self._finalizer = weakref.finalize(self, _shut_down, self._close_hooks, shutdown, self._owner_pid)
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
        if not self._closed:
            self._before_close()
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def _before_close(self) -> None:
        """What the subclass notes while it is still open (once)."""

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

    def __enter__(self: _Stream) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget_children(self, children: set[Any]) -> None:
        """In a forked child: take the processes this stream started off
        multiprocessing's list of children (see _after_fork_in_child)."""

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._check_usable()
        pass_no = self._begin_pass()
        self._trainer_position = None  # the new pass's batches are taken by whoever iterates it
        self._counters.pass_started()
        return self._new_pass(pass_no)

    @abc.abstractmethod
    def _begin_pass(self) -> int:
        """Starts the next pass; returns its number (and sets _pass_no)."""

    def _new_pass(self, pass_no: int) -> Pass:
        return Pass(self, pass_no)

    def _next(self, it: Pass) -> Any:
        """The next batch of pass `it`: the checks, the clock and the
        counting around the subclass's _take."""
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
        try:
            batch, nbytes, worker = self._take(it, t0)
        except StopIteration:
            it.finished = True
            self._finished_pass = it.pass_no
            self._counters.pass_finished(it.started_ns)
            raise
        self._counters.delivered(t0, time.perf_counter_ns(), nbytes, worker)
        it.delivered = True
        return batch

    @abc.abstractmethod
    def _take(self, it: Pass, t0: int) -> tuple[Any, int, int]:
        """(batch, its payload's bytes, its worker) of pass `it`, asked for
        at `t0`; StopIteration at the end of the pass."""

    # -- checkpoints ----------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """Where the stream stands: what it has handed out (a subclass's
        state). ``state_dict()`` is this, less what an adapter holds ahead
        of the trainer (_state_of_the_trainer)."""
        raise ShmpipeValueError(f"a {type(self).__name__} cannot save its position")

    def _state_of_the_trainer(self) -> dict[str, Any]:
        """What ``state_dict()`` returns: the stream's state as of the
        batches the trainer has had."""
        position = self._trainer_position
        return self._state() if position is None else position.state(self._state)

    def _position_for_adapter(self) -> TrainerPosition | None:
        """For an adapter that takes the batches of the pass just begun
        ahead of the trainer (to_jax's thread): the position it keeps, which
        ``state_dict()`` then answers from until the next pass begins; None
        where this stream cannot save its position (nothing to keep)."""
        try:
            self._state()
        except ShmpipeValueError:
            return None
        position = TrainerPosition()
        self._trainer_position = position
        return position

    def _check_usable(self) -> None:
        if self._closed:
            self._raise_closed()

    def _raise_closed(self) -> NoReturn:
        if self._forked_from is not None:
            raise PipelineClosedError(
                f"this pipeline belongs to process {self._forked_from}; a process forked from it cannot use "
                "it (its batches and slots are the parent's): make a pipeline of its own in the child"
            )
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


def _shut_down(close_hooks: list[Callable[[], None]], shutdown: Callable[[], None], owner_pid: int) -> None:
    """A stream's end: its close hooks, then what it owns. A function, not a
    method: the finalizer must not keep the stream alive. In a process
    forked from the owner (where finalizers run at exit too) it does
    nothing: the producers, the memory and the sockets are the parent's."""
    if os.getpid() != owner_pid:
        return
    try:
        while close_hooks:
            close_hooks.pop()()
    finally:
        shutdown()


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
