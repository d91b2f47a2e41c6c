"""Pipeline: N producers, one consumer, one channel.

The consumer (this process) iterates passes, asks the channel for the next
batch in the order the user wants, keeps the statistics, enforces timeouts,
and turns a producer's failure into an error once the batches it published
before failing are delivered. Starting and watching the producers is the
launcher's job (_launch.py, or the transport's own); moving batches is the
transport's (transport.py).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import secrets
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

from shmpipe import _segments
from shmpipe._launch import ProcessLauncher
from shmpipe._shm import check_slot_size
from shmpipe._stats import PipelineStats, WaitHistogram
from shmpipe._worker import seed_for
from shmpipe.errors import (
    PipelineClosedError,
    PipelineTimeoutError,
    ShmpipeTypeError,
    ShmpipeValueError,
    ShmpipeWarning,
    WorkerError,
)
from shmpipe.registry import resolve_transport
from shmpipe.transport import AGAIN, END, FAULT, ChannelSpec, ConsumerEnd, Transport

if TYPE_CHECKING:  # the frameworks stay optional: never imported at run time here
    import tensorflow as tf

    from shmpipe._torch import TorchBatches

__all__ = ["Pipeline", "from_iterators"]

Source = Callable[[], Iterable[Any]]

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


def default_start_method() -> str:
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


def from_iterators(
    sources: Sequence[Source],
    *,
    transport: str | Transport = "shm",
    capacity: int | None = None,
    ordered: bool = False,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    seed: int | None = None,
) -> "Pipeline":
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
    """
    return Pipeline(
        sources,
        transport=transport,
        capacity=capacity,
        ordered=ordered,
        start_method=start_method,
        timeout=timeout,
        slot_size=slot_size,
        seed=seed,
    )


class _PassIterator:
    """The iterator of one pass over a Pipeline (what ``iter(pipe)`` returns)."""

    __slots__ = ("pipe", "pass_no", "finished", "started_ns", "order", "turn", "wseq")

    def __init__(self, pipe: "Pipeline", pass_no: int, num_workers: int) -> None:
        self.pipe = pipe
        self.pass_no = pass_no
        self.finished = False
        self.started_ns: int | None = None
        # ordered mode: the workers not yet exhausted, whose turn it is, and
        # the number of the next batch expected from each
        self.order = list(range(num_workers))
        self.turn = 0
        self.wseq = [0] * num_workers

    def __iter__(self) -> "_PassIterator":
        return self

    def __next__(self) -> Any:
        return self.pipe._next(self)


class Pipeline:
    """Batches from N producer processes, delivered to this process.

    Iterate it for one pass over the sources; iterate again for another
    (each source is called again; the producer processes stay). Use it as a
    context manager, or call close(), to stop the producers and destroy the
    shared memory. Arrays in the batches are read-only views of shared
    memory; each batch's slot is reused only once every array of it is gone.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        transport: str | Transport = "shm",
        capacity: int | None = None,
        ordered: bool = False,
        start_method: str | None = None,
        timeout: float | None = None,
        slot_size: int | None = None,
        seed: int | None = None,
    ) -> None:
        self._closed = True  # until the producers exist
        sources = _check_sources(sources)
        n = len(sources)
        transport = resolve_transport(transport)
        caps = transport.capabilities
        if capacity is None:
            capacity = 2 * n + 2
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ShmpipeValueError(f"capacity must be a positive int, got {capacity!r}")
        if ordered and capacity < n + 1:
            raise ShmpipeValueError(
                f"ordered=True with {n} workers needs capacity >= {n + 1} (one slot per worker "
                f"plus one for the batch you hold), got {capacity}"
            )
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ShmpipeValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if slot_size is not None:
            slot_size = check_slot_size(slot_size)
        if seed is None:
            seed = secrets.randbits(63)
        elif not isinstance(seed, int) or seed < 0:
            raise ShmpipeValueError(f"seed must be a non-negative int or None, got {seed!r}")
        method = start_method or default_start_method()
        if method not in multiprocessing.get_all_start_methods():
            raise ShmpipeValueError(
                f"unknown start_method {method!r}; this platform has "
                f"{', '.join(multiprocessing.get_all_start_methods())}"
            )
        if method != "fork" and not caps.own_producers:
            _check_picklable(sources, method)

        self.transport = transport
        self.num_workers = n
        self.capacity = capacity
        self.ordered = bool(ordered)
        self.start_method = method
        self.timeout = None if timeout is None else float(timeout)
        self.seed = seed
        self._slot_size = slot_size
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
        self._channel = None  # the launcher's, once open

        # counters behind stats()
        self._created_ns = time.perf_counter_ns()
        self._first_batch_ns: int | None = None
        self._waits = WaitHistogram()
        self._batches = 0
        self._bytes = 0
        self._per_worker = [0] * n
        self._wall_ns = 0
        self._passes = 0
        self._last_health_ns = self._created_ns
        self._blocked_s: list[float | None] = [0.0] * n

        _segments.sweep()  # segments of pipelines whose process died
        spec = self._spec = ChannelSpec(
            num_workers=n,
            capacity=capacity,
            ordered=self.ordered,
            first_pass=0,
            slot_size=slot_size,
            mp_context=multiprocessing.get_context(method),
        )
        if caps.own_producers:
            self._launcher = transport.launch(sources, spec, seed)
        else:
            self._launcher = ProcessLauncher(transport, sources, spec)
        # Called, last first, before the channel goes: what adapters did to
        # its memory is undone there (to_torch's CUDA registration).
        self._on_close: list[Callable[[], None]] = []
        # The launcher, not this object, owns the processes and the channel,
        # so a forgotten pipeline is shut down when it is collected.
        self._finalizer = weakref.finalize(self, _shut_down, self._on_close, self._launcher)
        self._channel = self._launcher.channel  # None while it waits for a first batch
        self._launcher.begin_pass(0, self._seeds(0))
        self._closed = False

    # -- start and stop -------------------------------------------------------

    def _seeds(self, pass_no: int) -> list[int]:
        return [seed_for(self.seed, pass_no, w) for w in range(self.num_workers)]

    def close(self) -> None:
        """Stops the producers, joins them and destroys the shared memory.

        Idempotent. Batches you still hold stay valid (their memory is freed
        when the last array goes); the pipeline cannot be iterated again.
        """
        if not self._closed:
            self._blocked_s = self._producer_blocked()
        self._closed = True
        if hasattr(self, "_finalizer"):
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, exc: BaseException) -> NoReturn:
        """Stop everything, then raise."""
        self.close()
        raise exc

    def _set_failure(self, exc: BaseException) -> None:
        """A producer failed. Production stops now; the batches already
        published are still delivered, then `exc` is raised (by _on_fault).
        Nothing a producer yielded before failing is lost."""
        if self._failure is not None:
            return  # the first failure is the one to report
        self._failure = exc
        if self._channel is None:
            self._fail(exc)  # nothing was published: nothing to deliver first
        self._channel.halt()
        self._launcher.halt()

    def _note_fault(self) -> None:
        """The channel says a failure stopped production: make sure we know
        which (the producer's message may still be on its way)."""
        self._check_health(time.perf_counter_ns())
        if self._failure is None:
            self._launcher.wait_for_event(1.0)
            self._check_health(time.perf_counter_ns())
        if self._failure is None:
            self._failure = WorkerError(-1, None, "unknown", "a producer reported a failure but sent no details", "")

    def _drained(self) -> None:
        """Nothing more is in flight; if a producer failed, raise now."""
        if self._failure is not None:
            self._fail(self._failure)

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise PipelineClosedError("this pipeline is closed")
        with self._consumer_lock:  # waits for a get() of the old pass in another thread
            if self._first_iter:
                self._first_iter = False
            else:
                self._pass_no += 1
                self._launcher.begin_pass(self._pass_no, self._seeds(self._pass_no))
        self._passes += 1
        return _PassIterator(self, self._pass_no, self.num_workers)

    def _next(self, it: _PassIterator) -> Any:
        if it.finished:
            raise StopIteration
        if self._closed:
            raise PipelineClosedError("this pipeline is closed")
        if it.pass_no != self._pass_no:
            raise PipelineClosedError(
                "this iterator belongs to an earlier pass; iterating the pipeline again "
                "started a new one"
            )
        t0 = time.perf_counter_ns()
        if it.started_ns is None:
            it.started_ns = t0
        if t0 - self._last_health_ns > HEALTH_CHECK_NS:
            self._check_health(t0)
        try:
            batch = self._take_ordered(it, t0) if self.ordered else self._take_any(it, t0)
        except StopIteration:
            it.finished = True
            self._wall_ns += time.perf_counter_ns() - it.started_ns
            raise
        except WorkerError as exc:  # a transport that reports failures in stream order (Ray)
            if not self._closed:
                self._fail(exc)
            raise
        t1 = time.perf_counter_ns()
        self._waits.add(t1 - t0)
        self._batches += 1
        channel = cast(ConsumerEnd, self._channel)  # a batch came through it
        self._bytes += channel.last_nbytes
        self._per_worker[channel.last_worker] += 1
        if self._first_batch_ns is None:
            self._first_batch_ns = t1
        return batch

    def _get(self, it: _PassIterator, worker: int, wseq: int) -> Any:
        """One channel.get, under the consumer lock, for a pass still current."""
        with self._consumer_lock:
            if it.pass_no != self._pass_no:
                raise PipelineClosedError(
                    "this iterator belongs to an earlier pass; iterating the pipeline again "
                    "started a new one (while this one waited for a batch)"
                )
            return cast(ConsumerEnd, self._channel).get(it.pass_no, worker, wseq, POLL_S)

    def _take_any(self, it: _PassIterator, t0: int) -> Any:
        if self._channel is None:
            self._await_channel(t0)
        while True:
            r = self._get(it, -1, 0)
            if r is AGAIN:
                self._drained()  # after a failure, nothing arriving means all is out
                self._waited(t0)
            elif r is FAULT:
                self._note_fault()
                self._drained()
            elif r is END:
                self._drained()
                raise StopIteration
            else:
                return r

    def _take_ordered(self, it: _PassIterator, t0: int) -> Any:
        if self._channel is None:
            self._await_channel(t0)
        while it.order:
            worker = it.order[it.turn]
            r = self._get(it, worker, it.wseq[worker])
            if r is AGAIN and self._failure is None:
                self._waited(t0)
            elif r is AGAIN or r is FAULT or r is END:
                if r is FAULT:
                    self._note_fault()
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
        self._drained()
        raise StopIteration

    def _waited(self, t0: int) -> None:
        """Nothing came within one POLL_S: look at the producers and the clock."""
        if self._closed:  # close() from another thread while this one waited
            raise PipelineClosedError("the pipeline was closed while waiting for a batch")
        now = time.perf_counter_ns()
        self._check_health(now)  # notes a failure; it is raised once all is delivered
        if now - t0 >= STALL_WARNING_NS and self._stall_warned != self._pass_no:
            self._warn_if_held_up_by_consumer(now - t0)
        if self.timeout is not None and now - t0 >= self.timeout * 1e9:
            why = (
                self._channel.describe_wait()
                if self._channel is not None
                else "no producer has delivered a first batch yet"
            )
            raise PipelineTimeoutError(f"no batch within {self.timeout:g} s" + (f": {why}" if why else ""))

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

    def _await_channel(self, t0: int):
        """No channel yet: wait until the launcher can open it (a transport
        sized by its first batch waits for a producer to have one)."""
        while self._channel is None:
            with self._consumer_lock:  # one thread opens it
                if self._channel is None:
                    self._channel = self._launcher.open_channel(POLL_S)
            if self._channel is None:
                self._waited(t0)
        self._slot_size = getattr(self._channel, "slot_size", self._slot_size)
        return self._channel

    def _check_health(self, now: int) -> None:
        """Notes a producer that failed or died (see _set_failure)."""
        self._last_health_ns = now
        failure = self._launcher.check()
        if failure is not None:
            self._set_failure(failure)

    # -- frameworks -------------------------------------------------------------

    def to_tf_dataset(
        self, output_signature: Any = None, *, device: str | None = None, batches_per_pass: int | None = None
    ) -> "tf.data.Dataset":
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

    def to_torch(self, device: Any = None, pin_memory: bool = False, non_blocking: bool = True) -> "TorchBatches":
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
        w = self._waits
        n = w.count
        first = None if self._first_batch_ns is None else (self._first_batch_ns - self._created_ns) / 1e9
        wall = self._wall_ns / 1e9
        return PipelineStats(
            batches=self._batches,
            bytes=self._bytes,
            per_worker_batches=tuple(self._per_worker),
            wait_total_s=w.total_ns / 1e9,
            wait_mean_s=(w.total_ns / n / 1e9) if n else 0.0,
            wait_p50_s=w.quantile(0.5) / 1e9,
            wait_p99_s=w.quantile(0.99) / 1e9,
            wait_max_s=w.max_ns / 1e9,
            time_to_first_batch_s=first,
            producer_blocked_s=tuple(self._producer_blocked()),
            wall_s=wall,
            stall_fraction=(w.total_ns / 1e9 / wall) if wall > 0 else 0.0,
            passes=self._passes,
            transport=self.transport.name,
            num_workers=self.num_workers,
            capacity=self.capacity,
            slot_size=self._slot_size,
        )

    @property
    def pids(self) -> list[int | None]:
        """The producers' process ids (None where the transport runs
        producers on other machines)."""
        return self._launcher.pids

    @property
    def channel(self):
        """The transport's ConsumerEnd (None until the first batch for
        transports sized by it). For diagnostics and tests."""
        return self._channel

    @property
    def slot_size(self) -> int | None:
        """Bytes per slot; None until the first batch sized the ring."""
        return self._slot_size

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pass {self._pass_no}"
        return (
            f"<shmpipe.Pipeline {self.num_workers} workers, transport={self.transport.name!r}, "
            f"capacity={self.capacity}, ordered={self.ordered}, {state}>"
        )


def _shut_down(on_close: list[Callable[[], None]], launcher: Any) -> None:
    """A pipeline's end: its close hooks, then its producers and channel.
    A function, not a method: the finalizer must not keep the pipeline
    alive."""
    try:
        while on_close:
            on_close.pop()()
    finally:
        launcher.shutdown()


def _check_sources(sources: Any) -> list:
    if callable(sources) or isinstance(sources, (str, bytes)):
        raise ShmpipeTypeError(
            "sources must be a sequence of callables, one per producer, e.g. "
            "[make_batches] * 4"
        )
    try:
        sources = list(sources)
    except TypeError:
        raise ShmpipeTypeError(
            f"sources must be a sequence of callables, got {type(sources).__name__}"
        ) from None
    if not sources:
        raise ShmpipeValueError("sources is empty: give at least one callable")
    for i, s in enumerate(sources):
        if not callable(s):
            raise ShmpipeTypeError(
                f"source {i} is a {type(s).__name__}, not a callable; pass the generator "
                "function itself (make_batches), not its result (make_batches())"
            )
    return sources


def _check_picklable(sources: list, method: str) -> None:
    from multiprocessing.reduction import ForkingPickler

    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file is not None and not os.path.exists(main_file):
        # multiprocessing re-imports __main__ from its file in every child
        raise ShmpipeValueError(
            f"the main module's file {main_file!r} does not exist (a script read from stdin?), "
            f"so {method!r} producer processes cannot start; run the script from a file, or "
            "pass start_method='fork'"
        )
    interactive = main_file is None
    for i, s in enumerate(sources):
        module = getattr(s, "__module__", None) or type(s).__module__
        if interactive and module == "__main__":
            # Pickled by reference to __main__, which a fresh producer process
            # cannot import when __main__ is a notebook or an interactive shell.
            raise ShmpipeTypeError(
                f"source {i} ({s!r}) is defined in an interactive session, where a "
                f"{method!r} producer process cannot import it; move it to a module (a .py "
                "file) and import it from there, or pass start_method='fork' (not safe "
                "once TensorFlow or CUDA have started threads)."
            )
        try:
            ForkingPickler.dumps(s)
        except Exception as exc:
            raise ShmpipeTypeError(
                f"source {i} ({s!r}) cannot be pickled, which a {method!r} producer process "
                f"needs: {exc}. Define it at the top level of an importable module (not a "
                "lambda or a nested function), or wrap such a function in functools.partial."
            ) from exc
