"""JAX arrays from a stream of batches (a Pipeline, a rank's share of a
group's pipeline): aliases of the ring on the CPU backend, one copy,
prefetched from a background thread, to an accelerator.

Each array leaf becomes a ``jax.Array`` placed on ``device`` or split over
``sharding``; NumPy scalars become 0-d arrays; other leaves (Python
numbers, strings) stay as they are, as with ``to_torch()``.

How a leaf gets there. ``jax.device_put`` costs about 40 µs of Python per
array, 15 times what the pipeline spends on a whole batch; the trainer's
CPU per batch would be ten times ``to_torch()``'s. So each leaf goes through
the call ``jax.device_put`` ends in (jaxlib's ``batched_device_put``, 3 µs),
with what ``device_put`` works out first (the abstract value, the devices,
each device's slice) computed once per shape and dtype (``_Plan``, in
_jax_placement.py, with the rest of where a leaf goes). That
call is JAX's, not public: ``_probe`` checks once per process and platform
that it makes exactly what ``jax.device_put`` makes, and where it does not
(or is gone) every leaf goes through ``jax.device_put``, with a warning.
With several processes (``jax.distributed``) each leaf is this process's
share of the global array: ``jax.make_array_from_process_local_data``.

Lifetime rules:

* On the CPU backend ``device_put`` *aliases* a 64-byte aligned, contiguous
  array of a dtype JAX keeps (no copy), on every device of a sharding too
  (each device gets its slice). The jax.Array then holds a reference to the
  array's root (the bottom of its ``base`` chain), and the root holds the
  slot: the slot goes back when the last jax.Array of the batch is freed,
  as with ``torch.from_numpy``. ``_probe`` checks that JAX still holds that
  reference; where it would not, ``Target.put`` holds the array itself
  until the jax.Array is collected (``weakref.finalize``), never shorter.
  XLA never writes an aliased buffer: a donated one is copied, not reused.
* JAX lets go of a host array *lazily*: when a jax.Array dies, jaxlib
  queues the release of the NumPy array it held and does it at its next
  garbage collection (another device_put, a dispatch, Python's gc, through
  a gc callback; jax-ml/jax#14882). Until then the slot stays held: a
  trainer that drops its batches and waits would wait for slots nothing
  gives back. So each wait for a batch, here or on the thread, begins
  with jaxlib's collection (``collector``, 0.2 µs), which runs again each
  POLL_S the wait lasts (``call_while_waiting``: a step dispatched
  asynchronously holds its batch until it has run, after that first
  collection, and a loop whose jitted step compiled again stalled on its
  own slots for good); and the thread collects after it drops a host batch
  whose copy is done.
* Where JAX copies on the host (a 64-bit dtype without ``jax_enable_x64``,
  an unaligned or strided array) it copies during the call, and the
  jax.Array holds no slot. The first batch of a ``to_jax()`` is checked,
  and a copied leaf of COPY_WARN_BYTES or more is a warning naming it.
* To an accelerator, ``device_put`` returns before its copy has read the
  slot. A background thread (``_Feeder``) puts batches ahead and waits for
  each one's copies (``jax.block_until_ready``) before it lets go of the
  host batch, so a slot goes back once its copy is done, never before. The
  trainer then holds device arrays only, and the slots held are at most the
  one batch being copied.
* The thread holds at most ``prefetch`` batches (queued or being put):
  ``prefetch`` permits, one taken before each batch is asked of the
  pipeline, given back when the trainer takes a batch. Where the put arrays
  alias the slots (the thread on the host, which only tests ask for), those
  batches and the one the step holds are all slots the consumer holds, so
  ``prefetch + 1`` must fit ``consumer_may_hold``: refused otherwise, with
  the capacity that would do.
* The batches the thread put ahead are not the trainer's yet: the
  stream's ``state_dict()`` counts those the trainer took (the thread notes
  each batch it takes and the worker it came from, the trainer's side what
  it gets: ``TrainerPosition``), so a checkpoint taken between steps
  resumes with the batches that were ahead, not after them.
* The thread ends at the end of the pass, at an error (which the trainer's
  ``next()`` raises: the pipeline's own exception, the same object), and
  when the pass is abandoned (``break``, an exception in the loop, the
  iterator dropped: ``close``) or the pipeline closes. It never outlives
  what it waits for by more than POLL_S: each wait it makes is a poll of
  the stop flag, and the pipeline's own wait for a batch ends with the
  batch, the pipeline's close, or a new pass begun meanwhile (which the
  pipeline answers, in the old pass's wait, with PipelineClosedError). It
  holds the pipeline's pass but not the to_jax pass object (``_AheadPass``),
  nor the batches the trainer was given, so dropping the iterator stops it.
  Once a later pass began, the old iterator's ``next()`` raises that
  PipelineClosedError itself, as the stream's own iterator would, and drops
  what the thread had put ahead: no batch of the earlier pass comes after.
* The thread is stopped and joined (AT_EXIT_JOIN_S in all) by an atexit
  hook, before the interpreter finalizes: a daemon thread that is still in
  jaxlib's C++ then (a put, a wait for a copy, a collection) is ended by a
  forced unwind through its frames, which the C++ runtime answered with
  "FATAL: exception not rethrown" and SIGABRT (2 in 60 exits with a pass put
  ahead, on a loaded 2-core machine). The pipelines' own teardown at exit
  may come before it or after: a thread whose pipeline closed ends as well.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from shmpipe._jax_placement import Target, Unplanned, collector, warn_about_copies
from shmpipe._stream import POLL_S, BatchStream, Pass, TrainerPosition
from shmpipe._tree import map_leaves, map_leaves_with_paths
from shmpipe.errors import PipelineClosedError, ShmpipeValueError, as_int, out_of_range

if TYPE_CHECKING:
    import jax

__all__ = ["JaxBatches"]


class JaxBatches:
    """An iterable over a stream's batches as ``jax.Array``s; each
    iteration is a new pass (as with the pipeline itself).

    ``ahead`` (for tests): put batches ahead from a background thread even
    on the CPU backend, where the host path has nothing to hide; by default
    only an accelerator does.
    """

    def __init__(
        self,
        pipe: BatchStream,
        sharding: jax.sharding.Sharding | None = None,
        prefetch: int = 2,
        device: jax.Device | str | None = None,
        *,
        ahead: bool | None = None,
    ) -> None:
        import jax

        if (ahead_by := as_int(prefetch)) is None or ahead_by < 1:
            raise out_of_range(
                f"to_jax(prefetch={prefetch!r}): prefetch must be an int >= 1 (batches put ahead)", prefetch
            )
        prefetch = ahead_by
        self.pipe = pipe
        self.prefetch = prefetch
        self.target = Target(jax, sharding, device)
        self.target.sizes_vary, self.target.short_batch = pipe._batch_sizes_vary, pipe._short_batch
        self.ahead = (not self.target.on_host) if ahead is None else bool(ahead)
        if self.ahead and self.target.on_host:
            _check_room(pipe, prefetch)
        self._copies_checked = False
        #: Makes JAX let go now of host arrays whose jax.Arrays died (the module doc):
        #: before each wait for a batch, and while it waits.
        self.collect = collector()
        pipe.call_while_waiting(self.collect)
        #: How the thread ahead waits until a batch's copies have read its
        #: slot. Tests, which have no accelerator, put a slower one here.
        self.wait_for_copies: Callable[[Any], Any] = jax.block_until_ready

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.pipe)
        if self.ahead:
            assert isinstance(it, Pass)  # what a stream's iter() makes (its last_worker is read)
            return _AheadPass(self, it)
        return _HostPass(self, it)

    def _convert(self, batch: Any) -> Any:
        """`batch` with each array leaf (and NumPy scalar) a jax.Array."""
        self.target.follow_x64()
        try:
            try:
                # Without paths: naming each leaf costs more than putting it.
                out = map_leaves(batch, self.target.put)
            except Unplanned:  # a shape or dtype not seen yet: checked, with paths for the errors
                out = map_leaves_with_paths(batch, self.target.plan_and_put)
        except BaseException as exc:  # a batch refused (BatchTypeError): let go of it, and of its slot, now
            del batch
            # The error's frames (and those of the Unplanned it came from)
            # would hold it for as long as the error lives; the leaves put
            # before the refusal, as JAX lets go of them (collect).
            traceback.clear_frames(exc.__traceback__)
            if isinstance(exc.__context__, Unplanned):  # (any other context is the caller's own: left alone)
                traceback.clear_frames(exc.__context__.__traceback__)
            self.collect()
            raise
        if not self._copies_checked:
            self._copies_checked = True
            if self.target.on_host:
                warn_about_copies(batch, out)
        return out



def _check_room(pipe: BatchStream, prefetch: int) -> None:
    """Refuses a prefetch whose aliased batches, with the one the step
    holds, would take slots the producers need (see the module doc)."""
    may_hold = pipe.consumer_may_hold
    if prefetch + 1 <= may_hold:
        return
    if may_hold >= 2:
        fix = f"pass prefetch <= {may_hold - 1}, or raise capacity"
    else:
        fix = "raise capacity"
    raise ShmpipeValueError(
        f"to_jax(prefetch={prefetch}) on the CPU backend holds {prefetch + 1} slots of the ring ({prefetch} "
        f"put ahead, which alias their slots, and the batch the step holds), but this pipeline "
        f"(capacity={pipe.capacity}, {pipe.num_workers} worker{'s' if pipe.num_workers > 1 else ''}"
        f"{', ordered' if pipe.ordered else ''}) lends "
        f"its consumer at most {may_hold} while the batch it waits for is still sure to come; {fix}"
    )


# -- the passes ---------------------------------------------------------------


class _HostPass:
    """One pass on the CPU backend: each batch put on the caller's thread
    (aliasing costs microseconds; there is nothing to hide). An iterator
    object, not a generator: a suspended generator would keep the batch it
    yielded last (and its slot) until the next one."""

    __slots__ = ("batches", "it")

    def __init__(self, batches: JaxBatches, it: Iterator[Any]) -> None:
        self.batches, self.it = batches, it

    def __iter__(self) -> _HostPass:
        return self

    def __next__(self) -> Any:
        batches = self.batches
        batches.collect()  # the slots of arrays the trainer dropped go back before the wait
        return batches._convert(next(self.it))


_END = object()

#: How long the interpreter's exit waits, in all, for the threads of passes
#: put ahead to stop (each is told first; one waiting for a batch stops when
#: the batch comes, or is left to the finalization, outside jaxlib).
AT_EXIT_JOIN_S = 2.0


@atexit.register
def _stop_every_pass_at_exit() -> None:
    # The threads still running, also of passes whose iterator is gone (it
    # stopped them, and one may still be in its last wait).
    threads = [t for t in threading.enumerate() if isinstance(t, _FeederThread)]
    for thread in threads:
        thread.feeder.stop.set()
    deadline = time.monotonic() + AT_EXIT_JOIN_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


class _Raised:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Feeder:
    """What the background thread of one pass runs, and all it shares with
    the trainer's thread (the pass object itself is not shared: dropping it
    stops the thread)."""

    def __init__(
        self,
        it: Pass,
        batches: JaxBatches,
        prefetch: int,
        stream: BatchStream,
        position: TrainerPosition | None,
    ) -> None:
        self.it: Pass | None = it
        self.pass_no = it.pass_no
        self.convert = batches._convert
        self.wait = batches.wait_for_copies
        self.collect = batches.collect
        self.stream = stream
        #: What the stream's state_dict() answers from: the batches the
        #: trainer has had, not those put ahead here.
        self.position = position
        #: (batch,), _END or _Raised, in order
        self.ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.permits = threading.Semaphore(prefetch)
        self.stop = threading.Event()

    def run(self) -> None:
        host = out = None
        try:
            while self._permitted():
                assert self.it is not None
                self.collect()  # what the trainer dropped goes back before the wait
                position = self.position
                try:
                    host = next(self.it) if position is None else self.stream._take_ahead(self.it, position)
                except StopIteration:
                    self.ready.put(_END)
                    return
                if self.stop.is_set():
                    return  # abandoned while it waited: the batch goes back unread
                out = self.convert(host)
                # The copies have read the slot once they are ready: only
                # then may the slot go back (on the host, where the arrays
                # alias the slot, they hold it themselves).
                self.wait(out)
                host = None
                self.collect()  # JAX's own reference to the host batch, kept until the copy was done
                self.ready.put((out,))
                out = None
        except BaseException as exc:
            host = out = None
            # The frames of the traceback would hold the batch (and its
            # slot) for as long as the exception lives.
            traceback.clear_frames(exc.__traceback__)
            self.ready.put(_Raised(exc))
        finally:
            self.it = None  # the pass, and with it the stream
            if self.stop.is_set() or self.superseded():
                # Abandoned, or a later pass began (its wait then raised):
                # what was put ahead goes now, not when the iterator does.
                self.stop.set()
                self.drain()
                self.collect()

    def _permitted(self) -> bool:
        """Waits for a permit; False once the pass is abandoned (by the
        trainer, or by a later pass begun: what was put ahead goes then,
        not when the old iterator is dropped)."""
        while not self.permits.acquire(timeout=POLL_S):
            if self.stop.is_set():
                return False
            if self.stream.closed:
                return True  # next() raises the pipeline's own PipelineClosedError
            if self.superseded():
                self.stop.set()
                return False
        return not self.stop.is_set()

    def superseded(self) -> bool:
        """Whether a later pass of the stream began (this one is over)."""
        return self.stream._pass_no != self.pass_no

    def take(self, thread: threading.Thread) -> Any:
        """The next item the thread made (the trainer's side)."""
        while True:
            try:
                item = self.ready.get(timeout=POLL_S)
            except queue.Empty:
                if not thread.is_alive() and self.ready.empty():
                    self.stream._check_pass(self.pass_no)  # it ended as a later pass began: the stream's error
                    if self.stop.is_set():  # the pass was abandoned as this waited: close() from another thread
                        raise StopIteration from None
                    raise RuntimeError("to_jax's thread ended without a batch, an end or an error") from None
                continue
            self.permits.release()
            return item

    def drain(self, _empty: type[Exception] = queue.Empty) -> None:
        """Drops what was put ahead (on the host, their slots go back).
        (`_empty` is bound here: __del__ may call this while the interpreter
        exits, after the module's globals were set to None.)"""
        while True:
            try:
                self.ready.get_nowait()
            except _empty:
                return


class _FeederThread(threading.Thread):
    """The thread of one pass put ahead (found at exit by _stop_every_pass_at_exit)."""

    def __init__(self, feeder: _Feeder) -> None:
        super().__init__(target=feeder.run, name="shmpipe-to_jax", daemon=True)
        self.feeder = feeder


class _AheadPass:
    """One pass whose batches a background thread puts on the device
    ahead of the step (see the module doc)."""

    __slots__ = ("feeder", "thread", "finished", "__weakref__")

    def __init__(self, batches: JaxBatches, it: Pass) -> None:
        self.finished = False
        # Where the stream can tell its position, the trainer's is kept (of
        # the pass just begun: iter(pipe)). The thread takes at most
        # `prefetch` + 1 batches the trainer has not had: one permit each,
        # given back as next() takes the batch, before it counts it.
        position = batches.pipe._position_for_adapter(ahead=batches.prefetch + 1, sees_asks=True)
        self.feeder = _Feeder(it, batches, batches.prefetch, batches.pipe, position)
        self.thread = _FeederThread(self.feeder)
        self.thread.start()

    def __iter__(self) -> _AheadPass:
        return self

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        feeder = self.feeder
        try:
            # What the thread put ahead is of this pass: once a later one
            # began (iter(pipe) again), none of it may reach the trainer,
            # as the stream's own iterator of an earlier pass gives nothing.
            feeder.stream._check_pass(feeder.pass_no)
        except PipelineClosedError:
            self._stop()  # (not finished: a later next() says the same again)
            raise
        feeder.collect()  # the slots of arrays the trainer dropped go back while it waits
        position = feeder.position  # (its notes are spans of the stream: TrainerPosition)
        if position is not None:
            position.asking()
        item = feeder.take(self.thread)
        if type(item) is tuple:
            if position is not None:
                position.had_one()
            return item[0]
        if item is _END and position is not None:
            position.had_end()
        self.finished = True
        self.thread.join(timeout=POLL_S * 10)  # it has put its last item: it is returning
        if item is _END:
            raise StopIteration
        exc = item.exc
        del item
        raise exc

    def close(self) -> None:
        """Abandons the pass: the thread stops within POLL_S (or, if it
        waits for a batch, when that comes), and what it put ahead goes."""
        self.finished = True
        self._stop()

    def _stop(self) -> None:
        self.feeder.stop.set()
        self.feeder.drain()
        self.feeder.collect()

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # At the interpreter's exit the pipeline's own shutdown frees every
        # slot; the module's globals may be None by then (hence the bound
        # default), so there is nothing to do here.
        if getattr(self, "feeder", None) is not None and not _finalizing():
            self._stop()
