"""Pipeline: N producer processes, one consumer, one data channel.

The consumer (this process) starts the producers, tells them when a pass
begins, takes their batches from the channel, watches for their errors and
deaths, and stops them on close. Batches themselves never touch the control
pipes; see _worker.py for the control protocol and _shm.py for the channel.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from shmpipe import _ring, _segments
from shmpipe._shm import ShmConsumer, check_slot_size, slot_size_for
from shmpipe._stats import PipelineStats, WaitHistogram
from shmpipe._worker import producer_main, seed_for
from shmpipe.errors import (
    PipelineClosedError,
    PipelineTimeoutError,
    ShmpipeTypeError,
    ShmpipeValueError,
    WorkerDiedError,
    WorkerError,
)

__all__ = ["Pipeline", "from_iterators"]

Source = Callable[[], Iterable[Any]]

#: How long one wait lasts before the consumer looks at its producers'
#: health and its deadline again; also the longest a dead producer can go
#: unnoticed while the consumer waits.
POLL_S = 0.1
#: While batches keep coming, how often the consumer still checks that every
#: producer is alive.
HEALTH_CHECK_NS = 250_000_000
#: close(): how long producers get to exit on their own before SIGTERM, and
#: again before SIGKILL.
GRACE_S = 1.0

TRANSPORTS = ("shm",)


def default_start_method() -> str:
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


def from_iterators(
    sources: Sequence[Source],
    *,
    transport: str = "shm",
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
        transport: the data channel; ``"shm"``, the shared-memory ring.
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


class _Resources:
    """Everything a pipeline must release, apart from the Pipeline object so
    a weakref.finalize can release it without keeping the Pipeline alive."""

    __slots__ = ("processes", "conns", "channel")

    def __init__(self) -> None:
        self.processes: list = []
        self.conns: list = []
        self.channel: ShmConsumer | None = None


def _shutdown(res: _Resources) -> None:
    channel = res.channel
    if channel is not None:
        channel.close()  # producers waiting for a slot return at once
    for conn in res.conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    if channel is not None:
        try:
            channel.destroy()  # the name goes now; live arrays keep their memory
        except OSError:
            pass
    _reap(res.processes)
    for conn in res.conns:
        conn.close()
    res.channel = None


def _reap(processes: list) -> None:
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for sig_method in ("terminate", "kill"):
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            break
        for p in alive:
            getattr(p, sig_method)()
        deadline = time.monotonic() + GRACE_S
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))


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
        transport: str = "shm",
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
        if transport not in TRANSPORTS:
            raise ShmpipeValueError(
                f"unknown transport {transport!r}; known transports: {', '.join(TRANSPORTS)}"
            )
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
        if method != "fork":
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
        self._need_ring = 0  # largest first batch a producer asked for
        self._failure: BaseException | None = None  # raised once published batches are out
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _shutdown, self._res)

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
        self._blocked_s = [0.0] * n

        _segments.sweep()  # segments of pipelines whose process died
        try:
            if slot_size is not None:
                self._make_channel(slot_size)
            self._start(sources, method)
        except BaseException:
            self._finalizer()
            raise
        self._closed = False

    # -- start and stop -------------------------------------------------------

    def _make_channel(self, slot_size: int) -> None:
        self._res.channel = ShmConsumer(
            num_workers=self.num_workers,
            capacity=self.capacity,
            slot_size=slot_size,
            ordered=self.ordered,
            first_pass=self._pass_no,
        )
        self._slot_size = slot_size
        self._reader_take = self._res.channel.take
        self._reader = self._res.channel.reader

    def _start(self, sources: list, method: str) -> None:
        ctx = multiprocessing.get_context(method)
        owner_pid, owner_start = _segments.owner_identity()
        handle = self._res.channel.handle if self._res.channel is not None else None
        # A spawned child inherits an ignored SIGINT from birth, so a Ctrl-C
        # during its start-up prints nothing; producer_main keeps it ignored.
        # (A forkserver child is forked from the server: its window is tiny.)
        ignore = method == "spawn" and threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
        try:
            for worker, source in enumerate(sources):
                parent_end, child_end = ctx.Pipe(duplex=True)
                self._res.conns.append(parent_end)
                p = ctx.Process(
                    target=producer_main,
                    args=(worker, self.num_workers, source, child_end, owner_pid, owner_start, handle),
                    name=f"shmpipe-producer-{worker}",
                    daemon=True,
                )
                p.start()
                self._res.processes.append(p)
                child_end.close()
        finally:
            if ignore:
                signal.signal(signal.SIGINT, old)
        self._send_pass(0)

    def _send_pass(self, pass_no: int) -> None:
        for worker, conn in enumerate(self._res.conns):
            conn.send(("pass", pass_no, seed_for(self.seed, pass_no, worker)))

    def close(self) -> None:
        """Stops the producers, joins them and destroys the shared memory.

        Idempotent. Batches you still hold stay valid (their memory is freed
        when the last array goes); the pipeline cannot be iterated again.
        """
        if not self._closed:
            self._blocked_s = self._producer_blocked()
        self._closed = True
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, exc: BaseException) -> None:
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
        if self._res.channel is None:
            self._fail(exc)  # nothing was published: nothing to deliver first
        self._res.channel.ring.report_fault()

    def _on_fault(self) -> None:
        """The channel has delivered everything published before a failure."""
        self._check_health(time.perf_counter_ns())
        if self._failure is None:  # the producer's message is still on its way
            multiprocessing.connection.wait(self._res.conns, GRACE_S)
            self._check_health(time.perf_counter_ns())
        self._fail(
            self._failure
            or WorkerError(-1, None, "unknown", "a producer reported a failure but sent no details", "")
        )

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise PipelineClosedError("this pipeline is closed")
        if self._first_iter:
            self._first_iter = False
        else:
            self._pass_no += 1
            if self._res.channel is not None:
                started = self._res.channel.begin_pass()
                assert started == self._pass_no, (started, self._pass_no)
            self._send_pass(self._pass_no)
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
        t1 = time.perf_counter_ns()
        self._waits.add(t1 - t0)
        self._batches += 1
        self._bytes += self._reader.last_nbytes
        self._per_worker[self._reader.last_worker] += 1
        if self._first_batch_ns is None:
            self._first_batch_ns = t1
        return batch

    def _take_any(self, it: _PassIterator, t0: int) -> Any:
        if self._res.channel is None:
            self._await_channel(t0)
        take = self._reader_take
        while True:
            r = take(-1, 0, it.pass_no, POLL_S)
            if r is _ring.AGAIN:
                self._waited(t0)
            elif r is _ring.FAULT:
                self._on_fault()
            elif r is _ring.END:
                raise StopIteration
            else:
                return r

    def _take_ordered(self, it: _PassIterator, t0: int) -> Any:
        if self._res.channel is None:
            self._await_channel(t0)
        take = self._reader_take
        while it.order:
            worker = it.order[it.turn]
            r = take(worker, it.wseq[worker], it.pass_no, POLL_S)
            if r is _ring.AGAIN:
                self._waited(t0)
            elif r is _ring.FAULT:
                self._on_fault()
            elif r is _ring.END:
                del it.order[it.turn]  # this worker's part of the pass is over
                if it.turn == len(it.order):
                    it.turn = 0
            else:
                it.wseq[worker] += 1
                it.turn = (it.turn + 1) % len(it.order)
                return r
        raise StopIteration

    def _waited(self, t0: int) -> None:
        """Nothing came within one POLL_S: look at the producers and the clock."""
        if self._closed:  # close() from another thread while this one waited
            raise PipelineClosedError("the pipeline was closed while waiting for a batch")
        now = time.perf_counter_ns()
        self._check_health(now)
        if self.timeout is not None and now - t0 >= self.timeout * 1e9:
            why = (
                self._res.channel.describe_wait()
                if self._res.channel is not None
                else "no producer has delivered a first batch yet"
            )
            raise PipelineTimeoutError(f"no batch within {self.timeout:g} s: {why}")

    def _await_channel(self, t0: int) -> None:
        """No ring yet: wait for a producer's first batch to size it."""
        while self._res.channel is None:
            multiprocessing.connection.wait(self._res.conns, POLL_S)
            self._waited(t0)
            if self._need_ring:
                self._make_channel(slot_size_for(self._need_ring))
                for conn in self._res.conns:
                    conn.send(("attach", self._res.channel.handle))

    def _check_health(self, now: int) -> None:
        """Reads producers' messages; notes a producer that failed or died."""
        self._last_health_ns = now
        for worker, conn in enumerate(self._res.conns):
            try:
                while conn.poll():
                    self._on_message(worker, conn.recv())
            except (EOFError, OSError):
                pass  # it died; the exit code below says how
        if self._failure is None:
            for worker, p in enumerate(self._res.processes):
                if p.exitcode is not None:
                    self._set_failure(WorkerDiedError(worker, p.pid, p.exitcode))
                    break

    def _on_message(self, worker: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "need_ring":
            self._need_ring = max(self._need_ring, msg[1])
        elif kind == "error":
            _, exc_type, message, tb, own = msg
            error = WorkerError(worker, self._res.processes[worker].pid, exc_type, message, tb)
            if own is not None:
                # shmpipe's own error in the producer (BatchTypeError, ...):
                # raise its type, so `except TypeError` works, chained to the
                # WorkerError that says which worker and where.
                own.__cause__ = error
                error = own
            self._set_failure(error)

    # -- observation ----------------------------------------------------------

    def _producer_blocked(self) -> list[float]:
        channel = self._res.channel
        if channel is None:
            return list(self._blocked_s)
        return [channel.blocked_s(w) for w in range(self.num_workers)]

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
            producer_blocked_s=tuple(self._producer_blocked() if not self._closed else self._blocked_s),
            wall_s=wall,
            stall_fraction=(w.total_ns / 1e9 / wall) if wall > 0 else 0.0,
            passes=self._passes,
            transport=self.transport,
            num_workers=self.num_workers,
            capacity=self.capacity,
            slot_size=self._slot_size,
        )

    @property
    def pids(self) -> list[int]:
        """The producer processes' pids."""
        return [p.pid for p in self._res.processes]

    @property
    def slot_size(self) -> int | None:
        """Bytes per slot; None until the first batch sized the ring."""
        return self._slot_size

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pass {self._pass_no}"
        return (
            f"<shmpipe.Pipeline {self.num_workers} workers, transport={self.transport!r}, "
            f"capacity={self.capacity}, ordered={self.ordered}, {state}>"
        )


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
    interactive = getattr(main, "__file__", None) is None
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
