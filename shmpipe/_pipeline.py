"""Pipeline: N producers, one consumer, one channel.

The consumer (this process) iterates passes, asks the channel for the next
batch in the order the user wants, keeps the statistics, enforces timeouts,
and turns a producer's failure into an error once the batches it published
before failing are delivered. Starting and watching the producers is the
launcher's job (_launch.py, or the transport's own); moving batches is the
transport's (transport.py).
"""

from __future__ import annotations

import multiprocessing.process
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, overload

from shmpipe._interrupts import ctrl_c_held_back
from shmpipe._launch import ProcessLauncher
from shmpipe._options import PipelineOptions, Source, check_options
from shmpipe._producer_context import seed_for
from shmpipe._stats import Counters, PipelineStats
from shmpipe.errors import PipelineClosedError, PipelineTimeoutError, ShmpipeWarning, WorkerError
from shmpipe.transport import AGAIN, END, FAULT, ChannelSpec, ConsumerEnd, Launcher, Transport

if TYPE_CHECKING:  # the frameworks stay optional: never imported at run time here
    import tensorflow as tf

    from shmpipe._group import RankPipeline
    from shmpipe._torch import TorchBatches

__all__ = ["Pipeline", "from_iterators"]

#: How long one wait lasts before the consumer looks at its producers'
#: health and its deadline again; also the longest a dead producer can go
#: unnoticed while the consumer waits.
POLL_S = 0.1
#: While batches keep coming, how often the consumer still checks that every
#: producer is alive.
HEALTH_CHECK_NS = 250_000_000
#: After this long without a batch, a consumer that holds too many slots is
#: told so (once per pass): the batch it waits for may never come.
STALL_WARNING_NS = 10_000_000_000


@overload
def from_iterators(
    sources: Sequence[Source],
    *,
    transport: str | Transport | type[Transport] = "shm",
    capacity: int | None = None,
    ordered: bool = False,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    seed: int | None = None,
    group: None = None,
    rank: None = None,
    num_ranks: None = None,
    group_timeout: float = 60.0,
) -> Pipeline: ...


@overload
def from_iterators(
    sources: Sequence[Source],
    *,
    transport: str | Transport | type[Transport] = "shm",
    capacity: int | None = None,
    ordered: bool = False,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    seed: int | None = None,
    group: str,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
) -> RankPipeline: ...


def from_iterators(
    sources: Sequence[Source],
    *,
    transport: str | Transport | type[Transport] = "shm",
    capacity: int | None = None,
    ordered: bool = False,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    seed: int | None = None,
    group: str | None = None,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
) -> Pipeline | RankPipeline:
    """Starts one producer process per source and returns the Pipeline that
    delivers their batches.

    Each source is a picklable zero-argument callable returning an iterable
    of batches (a generator function, typically). A batch is any nesting of
    tuple, list and dict (str keys) whose leaves are NumPy arrays of a
    fixed-size dtype or scalars (int, float, bool, str, bytes, None, NumPy
    scalars).

    Args:
        transport: how batches travel: ``"shm"`` (the shared-memory ring),
            ``"arrow"``, ``"ray"``, ``"queue"``, a plugin's name, or a
            Transport instance (for options: ``RayTransport(address=...)``).
            See ``shmpipe.available_transports()``.
        capacity: slots in the ring, i.e. the most batches in flight,
            including those the consumer still holds. Default ``2 * len(sources) + 2``.
        ordered: False yields whichever batch is ready first; True yields
            round-robin by worker (worker 0's first batch, worker 1's first,
            ...), so deterministic sources give a deterministic stream.
        start_method: multiprocessing start method; default ``"forkserver"``
            (or ``"spawn"`` where there is no forkserver).
        timeout: seconds the consumer waits for one batch before
            PipelineTimeoutError; None waits as long as producers live.
        slot_size: bytes per slot. Default: the first batch's size plus 25%,
            rounded up to a page. A batch larger than a slot raises
            BatchTooLargeError naming this option.
        seed: base seed for the producers' seeds (see WorkerInfo); random
            when None.
        group: several processes of this node (one per GPU) share one
            pipeline: every one calls from_iterators with the same
            arguments and this name; rank 0 starts the producers, each
            batch goes to exactly one rank, every rank gets the same number
            per pass. Returns a RankPipeline. See docs/several-ranks.md.
        rank: this process's rank in the group; default LOCAL_RANK
            (torchrun sets it).
        num_ranks: the group's size; default LOCAL_WORLD_SIZE (torchrun
            sets it).
        group_timeout: seconds the ranks wait for each other to join.

    Every argument is checked before any process starts.
    """
    options = check_options(
        sources,
        transport=transport,
        capacity=capacity,
        ordered=ordered,
        start_method=start_method,
        timeout=timeout,
        slot_size=slot_size,
        seed=seed,
        group=group,
        rank=rank,
        num_ranks=num_ranks,
        group_timeout=group_timeout,
    )
    if options.group is not None:
        from shmpipe._group import join_group

        return join_group(options, Pipeline)
    return Pipeline(options)


class _PassIterator:
    """The iterator of one pass over a Pipeline (what ``iter(pipe)`` returns)."""

    __slots__ = ("finished", "order", "ordered", "pass_no", "pipe", "started_ns", "turn", "wseq")

    def __init__(self, pipe: Pipeline, pass_no: int, num_workers: int) -> None:
        self.pipe = pipe
        self.pass_no = pass_no
        self.ordered = pipe.options.ordered
        self.finished = False
        self.started_ns: int | None = None
        # ordered mode: the workers not yet exhausted, whose turn it is, and
        # the number of the next batch expected from each
        self.order = list(range(num_workers))
        self.turn = 0
        self.wseq = [0] * num_workers

    def __iter__(self) -> _PassIterator:
        return self

    def __next__(self) -> Any:
        pipe = self.pipe
        take_ready = pipe._take_ready
        # The fast path, for a batch that is already there: one call to the
        # channel takes, decodes and counts it. Only once the pass has
        # delivered a batch by the general path (which starts its clock)
        # and until it ends, while the pipeline is open, for the current
        # pass (checked under the consumer lock, as _get does). take_ready
        # itself declines (None, having taken nothing) when no batch is
        # ready, the pass ended, a fault was reported or a look at the
        # producers is due. Everything else (waiting, ends, failures,
        # timeouts) is the general path's, below.
        if take_ready is not None and self.started_ns is not None and not self.finished and not pipe._closed:
            with pipe._consumer_lock:  # as _get: one take at a time, and no new pass meanwhile
                if self.pass_no != pipe._pass_no:
                    batch = None
                elif not self.ordered:
                    batch = take_ready(self.pass_no, pipe._health_due_ns, pipe._counters)
                elif self.order:
                    # The batch whose turn it is, as _take_ordered asks for it.
                    worker = self.order[self.turn]
                    batch = take_ready(self.pass_no, pipe._health_due_ns, pipe._counters, worker, self.wseq[worker])
                    if batch is not None:
                        self.wseq[worker] += 1
                        self.turn = (self.turn + 1) % len(self.order)
                else:
                    batch = None
            if batch is not None:
                return batch
        return pipe._next(self)


class Pipeline:
    """Batches from N producer processes, delivered to this process.

    Made by :func:`from_iterators`. Iterate it for one pass over the
    sources; iterate again for another (each source is called again; the
    producer processes stay). Use it as a context manager, or call close(),
    to stop the producers and destroy the shared memory. Arrays in the
    batches are read-only views of shared memory; each batch's slot is
    reused only once every array of it is gone.
    """

    def __init__(self, options: PipelineOptions) -> None:
        self._closed = True  # until the producers exist
        self.options = options
        self._spec = options.channel_spec()
        self._pass_no = 0
        self._first_iter = True  # pass 0 starts with the producers
        self._stall_warned = -1  # the pass the consumer was last told it holds too much
        # A channel has one consumer. Threads may still meet here: a tf.data
        # iterator's thread waiting for a batch of one pass while another
        # iterator starts the next. So channel.get and begin_pass run one at
        # a time, and a get is only made for the current pass: a get for an
        # old pass would take, or throw away, batches of the new one.
        self._consumer_lock = threading.Lock()
        self._failure: BaseException | None = None  # raised once published batches are out
        self._counters = Counters(options.num_workers)
        self._last_health_ns = self._counters.created_ns
        self._health_due_ns = self._last_health_ns + HEALTH_CHECK_NS  # the fast path's limit
        self._blocked_s: list[float | None] = [0.0] * options.num_workers
        self._take_ready: Callable[..., Any] | None = None  # see _fast_path
        transport = options.transport
        self._launcher: Launcher
        # A Ctrl-C while the pipeline is made is held back to the end of it
        # (ctrl_c_held_back says why), and then shuts down what was started.
        launcher: Launcher | None = None
        try:
            with ctrl_c_held_back():
                if transport.capabilities.own_producers:
                    launcher = transport.launch(options.sources, self._spec, options.seed)
                else:
                    launcher = ProcessLauncher(transport, options.sources, self._spec)
                self._launcher = launcher
                self._finish_making()
        except BaseException:  # nothing started may outlive the call
            if launcher is not None:
                launcher.shutdown()
            raise
        self._closed = False

    def _finish_making(self) -> None:
        # Called, last first, before the channel goes: what adapters did
        # to its memory is undone there (to_torch's CUDA registration).
        self._close_hooks: list[Callable[[], None]] = []
        # The launcher, not this object, owns the processes and the
        # channel, so a forgotten pipeline is shut down when collected.
        self._owner_pid = os.getpid()
        self._finalizer = weakref.finalize(self, _shut_down, self._close_hooks, self._launcher, self._owner_pid)
        self._forked_from: int | None = None  # set in a child forked from this process
        _live.add(self)
        self._channel = self._launcher.channel  # None while it waits for a first batch
        self._take_ready = self._fast_path(self._channel)
        self._launcher.begin_pass(0, self._seeds(0))

    # -- configuration --------------------------------------------------------

    @property
    def spec(self) -> ChannelSpec:
        """What this pipeline asks of its channel: workers, capacity, order,
        and the quotas that follow (see ChannelSpec)."""
        return self._spec

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

    def _seeds(self, pass_no: int) -> list[int]:
        return [seed_for(self.options.seed, pass_no, w) for w in range(self.num_workers)]

    # -- start and stop -------------------------------------------------------

    def close(self) -> None:
        """Stops the producers, joins them and destroys the shared memory.

        Idempotent. Batches you still hold stay valid (their memory is freed
        when the last array goes); the pipeline cannot be iterated again.
        """
        if self._forked_from is not None:
            return  # a forked child's copy: the pipeline is its parent's to close
        if not self._closed:
            self._blocked_s = self._producer_blocked()
        self._closed = True
        if hasattr(self, "_finalizer"):
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def call_on_close(self, hook: Callable[[], None]) -> None:
        """Runs `hook` when the pipeline closes (or is collected unclosed),
        while its channel's memory still exists; hooks run last registered
        first. For adapters that must undo what they did to that memory
        (to_torch unregisters it from CUDA). The hook must not refer to
        the pipeline, or a forgotten pipeline would never be collected."""
        if self._closed:
            raise PipelineClosedError("this pipeline is closed")
        self._close_hooks.append(hook)

    def leftovers(self) -> list[str]:
        """After close(): whatever of this pipeline still runs (processes,
        actors), described; empty when close() left nothing behind."""
        return self._launcher.leftovers()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            self._raise_closed()
        with self._consumer_lock:  # waits for a get() of the old pass in another thread
            if self._first_iter:
                self._first_iter = False
            else:
                self._pass_no += 1
                self._launcher.begin_pass(self._pass_no, self._seeds(self._pass_no))
        self._counters.pass_started()
        return _PassIterator(self, self._pass_no, self.num_workers)

    def _next(self, it: _PassIterator) -> Any:
        if it.finished:
            raise StopIteration
        if self._closed:
            self._raise_closed()
        if it.pass_no != self._pass_no:
            raise PipelineClosedError(
                "this iterator belongs to an earlier pass; iterating the pipeline again started a new one"
            )
        t0 = time.perf_counter_ns()
        if it.started_ns is None:
            it.started_ns = t0
        if t0 - self._last_health_ns > HEALTH_CHECK_NS:
            self._poll_producers(t0)
        try:
            batch = self._take_ordered(it, t0) if self.options.ordered else self._take_any(it, t0)
        except StopIteration:
            it.finished = True
            self._counters.pass_finished(it.started_ns)
            raise
        except WorkerError as exc:  # a transport that reports failures in stream order (Ray)
            if not self._closed:
                self._close_and_raise(exc)
            raise
        channel = self._channel
        assert channel is not None  # a batch came through it
        self._counters.delivered(t0, time.perf_counter_ns(), channel.last_nbytes, channel.last_worker)
        return batch

    def _get(self, it: _PassIterator, worker: int, wseq: int) -> Any:
        """One channel.get, under the consumer lock, for a pass still current."""
        with self._consumer_lock:
            if it.pass_no != self._pass_no:
                raise PipelineClosedError(
                    "this iterator belongs to an earlier pass; iterating the pipeline again "
                    "started a new one (while this one waited for a batch)"
                )
            assert self._channel is not None  # opened before the first get
            return self._channel.get(it.pass_no, worker, wseq, POLL_S)

    def _take_any(self, it: _PassIterator, t0: int) -> Any:
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
                raise StopIteration
            else:
                return r

    def _take_ordered(self, it: _PassIterator, t0: int) -> Any:
        if self._channel is None:
            self._wait_for_channel(t0)
        while it.order:
            worker = it.order[it.turn]
            r = self._get(it, worker, it.wseq[worker])
            if r is AGAIN and self._failure is None:
                self._keep_waiting(t0)
            elif r is AGAIN or r is FAULT or r is END:
                if r is FAULT:
                    self._learn_why_production_stopped()
                # This worker's part is over: it ended, or production stopped
                # after a failure and it has nothing more. The others go on,
                # so what they published before the failure is delivered too.
                del it.order[it.turn]
                if it.turn == len(it.order):
                    it.turn = 0
            else:
                it.wseq[worker] += 1
                it.turn = (it.turn + 1) % len(it.order)
                return r
        self._raise_failure_if_any()
        raise StopIteration

    def _fast_path(self, channel: ConsumerEnd | None) -> Callable[..., Any] | None:
        """The channel's take_ready, where it has one (see
        _PassIterator.__next__): take_ready(pass_no, due_ns, counters[,
        worker, wseq]) returns the batch get() would return if it is already
        there, taken and counted, or None having done nothing."""
        if channel is None:
            return None
        take_ready: Callable[..., Any] | None = getattr(channel, "take_ready", None)
        return take_ready

    def _wait_for_channel(self, t0: int) -> ConsumerEnd:
        """No channel yet: wait until the launcher can open it (a transport
        sized by its first batch waits for a producer to have one)."""
        while self._channel is None:
            with self._consumer_lock:  # one thread opens it
                if self._channel is None:
                    self._channel = self._launcher.open_channel(POLL_S)
                    self._take_ready = self._fast_path(self._channel)
            if self._channel is None:
                self._keep_waiting(t0)
        return self._channel

    # -- failures, closing, timeouts: what decides whether to go on waiting ---
    #
    # A producer's failure stops production at once, but the batches it and
    # the others published before it are still delivered; the failure is
    # raised when nothing more is in flight. A close from another thread, a
    # timeout, and a consumer that holds every slot end a wait too.

    def _poll_producers(self, now: int) -> None:
        """Asks the launcher whether a producer failed or died; notes it."""
        self._last_health_ns = now
        self._health_due_ns = now + HEALTH_CHECK_NS
        failure = self._launcher.first_failure()
        if failure is not None:
            self._production_failed(failure)

    def _production_failed(self, exc: BaseException) -> None:
        """A producer failed: production stops now; `exc` is raised once
        what was published before is delivered (_raise_failure_if_any).
        Nothing a producer yielded before failing is lost."""
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
        now = time.perf_counter_ns()
        self._poll_producers(now)  # a failure is raised once all is delivered
        if now - t0 >= STALL_WARNING_NS and self._stall_warned != self._pass_no:
            self._warn_if_held_up_by_consumer(now - t0)
        timeout = self.options.timeout
        if timeout is not None and now - t0 >= timeout * 1e9:
            why = (
                self._channel.describe_wait()
                if self._channel is not None
                else "no producer has delivered a first batch yet"
            )
            raise PipelineTimeoutError(f"no batch within {timeout:g} s" + (f": {why}" if why else ""))

    def _warn_if_held_up_by_consumer(self, waited_ns: int) -> None:
        """This process holds so many slots that the batch it waits for may
        never come: say so once per pass (without a timeout it would wait
        forever, silently, unless another thread lets go of batches)."""
        channel = self._channel
        if channel is None:
            return
        held = channel.held()
        limit = self._spec.consumer_may_hold
        if held is None or held <= limit:
            return
        self._stall_warned = self._pass_no
        warnings.warn(
            f"no batch for {waited_ns / 1e9:.0f} s, and this process holds {held} of the "
            f"{self.capacity} slots (at most {limit} leave the producers room to deliver what "
            f"it waits for): {channel.describe_wait()}. Unless another thread lets go of "
            "batches this waits forever; pass timeout= to get an error instead.",
            ShmpipeWarning,
            stacklevel=6,  # the caller's next() or for loop
        )

    def _raise_closed(self) -> NoReturn:
        if self._forked_from is not None:
            raise PipelineClosedError(
                f"this pipeline belongs to process {self._forked_from}; a process forked from it cannot use "
                "it (its batches and slots are the parent's): make a pipeline of its own in the child"
            )
        raise PipelineClosedError("this pipeline is closed")

    def _close_and_raise(self, exc: BaseException) -> NoReturn:
        """Stop everything, then raise."""
        self.close()
        raise exc

    # -- frameworks -------------------------------------------------------------

    def to_tf_dataset(
        self, output_signature: Any = None, *, device: str | None = None, batches_per_pass: int | None = None
    ) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of this pipeline's batches, without a copy.

        Each iteration of the dataset (each epoch of ``model.fit``) is a new
        pass of the sources. Elements keep the batches' nesting (lists become
        tuples: tf.data has none). ``element_spec`` comes from
        ``output_signature`` or from the first batches of a pass (one per
        worker, up to four), with None for dimensions that differ between
        them; those batches are the dataset's first elements. Tensors alias
        the shared memory where the transport's arrays are 64-byte aligned;
        a slot goes back when TensorFlow drops the tensor. With ``device``
        ("/gpu:0"), the last step copies elements to that device in the
        background (``tf.data.experimental.prefetch_to_device``). If you
        know how many batches a pass has, say so with ``batches_per_pass``:
        the dataset then has a known length (Keras 3 warns at the end of
        every epoch of a dataset of unknown length). See docs/tensorflow.md.
        """
        from shmpipe._tf import to_tf_dataset

        return to_tf_dataset(self, output_signature, device=device, batches_per_pass=batches_per_pass)

    def to_torch(self, device: Any = None, pin_memory: bool = False, non_blocking: bool = True) -> TorchBatches:
        """This pipeline's batches with torch tensors at the array leaves.

        On the host (``device=None`` or "cpu") the tensors are
        ``torch.from_numpy`` views of the shared memory: no copy, read-only
        by contract (do not write into them). With a CUDA ``device`` each
        array is copied once, and with ``non_blocking`` a batch's slot is
        kept until the CUDA event recorded after its copy has completed.
        ``pin_memory=True`` registers the ring with ``cudaHostRegister`` once
        so that copy is a direct DMA, and unregisters it when the pipeline
        closes (where there is no CUDA, or no CUDA ``device``, it does
        nothing and warns once). Returns an iterable; each iteration is a
        new pass. See docs/gpu.md.
        """
        from shmpipe._torch import TorchBatches

        return TorchBatches(self, device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    # -- observation ----------------------------------------------------------

    def _producer_blocked(self) -> list[float | None]:
        channel = self._channel
        if channel is None or self._closed:
            return list(self._blocked_s)
        return [channel.producer_blocked_s(w) for w in range(self.num_workers)]

    def stats(self) -> PipelineStats:
        """Counters of everything delivered so far (see PipelineStats)."""
        return self._counters.snapshot(
            producer_blocked_s=self._producer_blocked(),
            transport=self.transport.name,
            capacity=self.capacity,
            slot_size=self.slot_size,
        )

    @property
    def pids(self) -> list[int | None]:
        """The producers' process ids (None where the transport runs
        producers on other machines)."""
        return self._launcher.pids

    @property
    def channel(self) -> ConsumerEnd | None:
        """The transport's ConsumerEnd (None until the first batch for
        transports sized by it). For diagnostics, adapters and tests."""
        return self._channel

    @property
    def slot_size(self) -> int | None:
        """Bytes per slot, where the transport has slots; None until the
        first batch sized the ring."""
        made = self._channel.slot_size if self._channel is not None else None
        return made if made is not None else self.options.slot_size

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pass {self._pass_no}"
        return (
            f"<shmpipe.Pipeline {self.num_workers} workers, transport={self.transport.name!r}, "
            f"capacity={self.capacity}, ordered={self.ordered}, {state}>"
        )


def _shut_down(close_hooks: list[Callable[[], None]], launcher: Launcher, owner_pid: int) -> None:
    """A pipeline's end: its close hooks, then its producers and channel.
    A function, not a method: the finalizer must not keep the pipeline
    alive. In a process forked from the owner (where finalizers run at exit
    too) it does nothing: the producers and the memory are the parent's."""
    if os.getpid() != owner_pid:
        return
    try:
        while close_hooks:
            close_hooks.pop()()
    finally:
        launcher.shutdown()


#: Every pipeline of this process, for the fork handler below.
_live: weakref.WeakSet[Pipeline] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a child forked (os.fork) from a process with pipelines: each one
    becomes unusable here and is never stopped from here. multiprocessing
    would otherwise, at the child's exit, SIGTERM the parent's daemon
    producers it still lists as children (its own children reset that list
    themselves; a bare os.fork does not), so they are taken off it."""
    # The set multiprocessing's exit handler walks (not in its stubs).
    children: set[Any] = getattr(multiprocessing.process, "_children", set())
    for pipe in list(_live):
        pipe._forked_from = pipe._owner_pid
        pipe._closed = True
        for process in getattr(pipe._launcher, "processes", ()):
            children.discard(process)


os.register_at_fork(after_in_child=_after_fork_in_child)
