"""The transport contract: how batches travel from producers to the consumer.

A *transport* moves batches from N producers to one consumer for a Pipeline.
shmpipe ships four (``"shm"``, ``"arrow"``, ``"ray"``, ``"queue"``); anyone can
add one. This docstring is the contract a transport implements; the test
suite in ``shmpipe.testing.conformance`` checks it, and every transport,
built in or not, must pass it.

What shmpipe does, so a transport does not have to
---------------------------------------------------

shmpipe starts the producer processes, runs each source once per pass, seeds
them, tells them when a pass starts, notices when one raises or dies, stops
them, keeps the statistics, enforces timeouts, and turns the order of
delivery (``ordered=``) into calls of :meth:`ConsumerEnd.get` for a given
worker. A transport only moves batches, bounded, and says when a worker's
part of a pass is over.

The three objects
-----------------

``Transport``
    Configuration and a factory, made in the consumer (``Transport(**options)``)
    and pickled to every producer process, so it must be small and
    picklable. Class attributes: ``name`` and ``capabilities`` (below). A
    transport that needs packages beyond NumPy says so once: either its
    module calls :func:`require` for each at import time (what the built-in
    ones do), or the class lists them in ``requires`` (with ``install``,
    what pip installs them from) and imports them lazily. Either way a
    missing package is a :class:`~shmpipe.TransportUnavailableError` that
    gives the install command.

``ConsumerEnd`` = ``Transport.open(spec)``, in the consumer
    Creates whatever the channel needs (memory, queues) for a
    :class:`ChannelSpec`. Its ``handle`` (small, picklable) is what producers
    attach with. ``get(pass_no, worker, wseq, wait)`` returns the next batch
    of pass ``pass_no`` -- from any worker if ``worker == -1``, else the
    batch number ``wseq`` of that worker -- or one of the sentinels
    :data:`END` (the pass, or that worker's part of it, is over), :data:`AGAIN`
    (nothing within ``wait`` seconds; shmpipe calls again), :data:`FAULT`
    (after :meth:`ConsumerEnd.halt`, nothing more will come). After returning
    a batch it sets ``last_worker`` and ``last_nbytes``. Batches of other
    passes must never be returned: drop them. shmpipe calls ``get`` and
    ``begin_pass`` from one thread at a time, and ``get`` only for the
    current pass (so "other passes" are always older ones), even when the
    user's threads (tf.data's) iterate several passes. ``close()`` wakes and stops
    producers waiting in ``put``; ``destroy()`` frees what ``open`` made and
    must be idempotent. Batches already delivered must stay valid after both.
    ``slot_size`` says how many bytes one batch may take, where the channel
    has such a limit (None otherwise).

``ProducerEnd`` = ``Transport.attach(handle, worker, control)``, in a producer
    ``start_pass(n)`` before each pass, ``put(batch)`` for each batch
    (blocking while the channel is full: that is the backpressure),
    ``end_pass()`` when the source is exhausted (the consumer's ``get`` then
    returns END for this worker once its batches are delivered), ``close()``.
    ``reserve(template)`` may hand out arrays inside the transport's memory
    (capability ``in_place_writes``); the default returns new arrays.
    While blocked, ``put`` must call ``control.check()`` every few tenths of
    a second: it raises :class:`Cancelled` when the consumer started another
    pass and :class:`Closed` when it is shutting down; let both propagate.
    If the consumer process dies, shmpipe calls ``Transport.orphaned(handle)``
    in each producer before it exits: the place to remove what the consumer
    can no longer remove (a named shared-memory segment, say).

Channels sized by their first batch
-----------------------------------

A transport whose channel needs to know how large a batch is before it
exists sets ``capabilities.sized_by_first_batch``. When the user gave no
``slot_size``, shmpipe then starts the producers first; the first producer
with a batch measures it with ``Transport.batch_nbytes(batch)`` (in the
producer), and the consumer opens the channel with
``spec.slot_size = Transport.slot_size_for(nbytes)``, its policy for room to
spare. A ``slot_size`` the user gave goes to ``open`` as it is; ``open``
may round it (``ConsumerEnd.slot_size`` says what it made).

Bounds, order and ownership
---------------------------

* At most ``spec.capacity`` batches may be in flight: put but not yet
  returned by ``get``. With ``spec.ordered`` a single worker must not be able
  to take every place while the consumer waits for another worker's batch
  (give each worker ``spec.quota`` places, for instance).
* ``get(..., worker=w, wseq=k)`` returns worker ``w``'s batches in the order
  it put them. With ``worker=-1``, any order is allowed; publication order
  is best.
* The arrays ``get`` returns may be read-only; they must not change for as
  long as the consumer holds them, and memory behind them may only be reused
  once the consumer lets go of them.

Capabilities
------------

Callers and tests ask for capabilities, never for names: see
:class:`Capabilities`. A transport cannot opt out of a conformance test
except by what its capabilities say.

Who checks a batch
------------------

Every transport carries the same batches (the batch contract: nested
tuple, list and dict with str keys; NumPy arrays of fixed-size dtypes
without Python objects, NumPy scalars, int, float, bool, str, bytes, None)
and refuses the same ones, with a :class:`~shmpipe.BatchTypeError` that
names the path (``batch['x'][2]``). shmpipe's producer checks each batch
with :func:`check_batch` before ``put`` (and before ``batch_nbytes``), so a
transport need not, unless it sets ``capabilities.checks_batches``: then
its ``put`` and ``batch_nbytes`` refuse every batch ``check_batch`` refuses
(they may refuse more), with the same error, before anything is sent. The
error reaches the consumer as any producer's error does, after the batches
the producer put before it: raised as itself, chained to the WorkerError
that names the worker.

The consumer's fast path (optional)
-----------------------------------

A transport whose consumer can hand out a batch that is already there in
one cheap call sets ``capabilities.takes_ready`` and implements
:meth:`ConsumerEnd.take_ready`: the batch ``get`` would return, taken, with
what shmpipe counts of it, or None having taken nothing. shmpipe asks it
first while a pass runs, and falls back to ``get`` (which waits, ends
passes and reports faults) whenever it declines.

Several ranks (optional)
------------------------

A transport whose channel can feed several trainer processes of a node
(``from_iterators(group=...)``) sets ``capabilities.serves_ranks`` and
implements the protocol gathered at the end of this module: its Transport
is also a :class:`ServesRanks` (``rank_reader``), and its ConsumerEnd a
:class:`SharingConsumerEnd` (``take_shared``, ``share_with_ranks``). Rank 0
takes undecoded :class:`SharedBatch` objects with ``take_shared`` instead
of ``get``; each rank maps the channel's memory with a :class:`RankReader`.

Producers a transport runs itself
---------------------------------

A transport whose producers must run elsewhere (Ray actors on a cluster) sets
``capabilities.own_producers`` and implements ``launch(sources, spec,
seed)`` returning a :class:`Launcher`; ``attach`` is then unused. Before it
runs a source for a pass, its producer calls :func:`enter_pass` with the
:class:`PassWork` its ``Launcher.begin_pass`` was given for it (so
``shmpipe.get_worker_info()``, the seeds and a resumed pass's skipping are
what they are in shmpipe's own producers), and before it sends a batch, :func:`check_batch` (and sets
``capabilities.checks_batches``); a BatchTypeError (any ShmpipeError) the
producer raised reaches the consumer as itself, chained to a WorkerError.
"""

from __future__ import annotations

import abc
import importlib
import operator
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

from shmpipe import _tree
from shmpipe._batch import check as check_batch
from shmpipe._outcomes import AGAIN, END, FAULT
from shmpipe._producer_context import PassWork, enter_pass
from shmpipe._spec import new_arrays
from shmpipe.errors import Cancelled, Closed, CorruptChannelError, TransportUnavailableError

__all__ = [
    "AGAIN",
    "END",
    "FAULT",
    "Cancelled",
    "Capabilities",
    "ChannelSpec",
    "Closed",
    "ConsumerEnd",
    "Launcher",
    "PassWork",
    "ProducerControl",
    "ProducerEnd",
    "RankReader",
    "ServesRanks",
    "SharedBatch",
    "SharingConsumerEnd",
    "Transport",
    "check_batch",
    "enter_pass",
    "not_installed",
    "require",
]


@dataclass(frozen=True)
class Capabilities:
    """What a transport guarantees. The conformance suite tests each claim.

    zero_copy_reads: the arrays ``get`` returns are views of the transport's
        memory (no copy on the consumer's side); ``ConsumerEnd.memory_ranges``
        says where that memory is.
    in_place_writes: ``reserve`` returns arrays inside the transport's memory,
        and putting them publishes without a copy.
    alignment: every array of a delivered batch starts on a multiple of this
        many bytes (0: no promise). TensorFlow aliases arrays aligned to 64.
    zero_copy_min_bytes: zero_copy_reads and alignment hold for batches whose
        arrays make at least this many bytes (Ray copies smaller objects
        inline into its messages); 0: for every batch.
    cross_host: producers may run on other machines.
    serializes: what a batch goes through on the way ("none", "shmpipe",
        "arrow", "pickle", ...). Informational.
    sized_by_first_batch: ``open`` needs ``spec.slot_size``; when the user
        gave none, shmpipe opens the channel once a producer has a first
        batch, with a size derived from it (see "Channels sized by their
        first batch" in the module doc).
    cancels_passes: ``put`` raises Cancelled by itself when a new pass
        starts; otherwise shmpipe checks between batches.
    checks_batches: the transport refuses a batch that breaks the batch
        contract by itself, with the BatchTypeError :func:`check_batch`
        raises (same type, same path): ``put`` raises it before anything of
        the batch is sent (shm and arrow: their encoder checks as it plans).
        Otherwise shmpipe's producer calls ``check_batch`` before ``put``.
        A transport with ``own_producers`` runs no shmpipe producer: it
        checks in its own and sets this too (see "Who checks a batch").
    own_producers: the transport runs producers itself (see ``launch``).
    serves_ranks: one channel can feed several trainer processes of a node
        (``from_iterators(group=...)``, docs/several-ranks.md): the
        transport is a :class:`ServesRanks` and its ConsumerEnd a
        :class:`SharingConsumerEnd` (see "Several ranks" in the module doc).
    takes_ready: ``ConsumerEnd.take_ready`` hands out a batch that is
        already there in one call (the consumer's fast path).
    restarts_producers: a producer whose process died can be replaced
        (``max_restarts``): ``ConsumerEnd.reclaim`` takes back what it held
        unpublished and says where it stopped, the channel's ``handle``
        can be given to a new producer at any time, and
        ``ProducerEnd.start_pass`` takes the number of the replacement's
        first batch. A transport with ``own_producers`` says so with its
        launcher's ``can_restart``, ``restart`` and ``send_pass``, and
        hands each death over through ``first_failure``.
    """

    zero_copy_reads: bool = False
    in_place_writes: bool = False
    alignment: int = 0
    zero_copy_min_bytes: int = 0
    cross_host: bool = False
    serializes: str = "pickle"
    sized_by_first_batch: bool = False
    cancels_passes: bool = False
    checks_batches: bool = False
    own_producers: bool = False
    serves_ranks: bool = False
    takes_ready: bool = False
    restarts_producers: bool = False


@dataclass(frozen=True)
class ChannelSpec:
    """What a pipeline asks of its channel."""

    num_workers: int
    capacity: int
    ordered: bool
    first_pass: int = 0
    slot_size: int | None = None
    #: Whether the user set ``slot_size`` (a limit a batch may not exceed)
    #: rather than shmpipe (a starting size: larger batches still travel).
    slot_size_is_limit: bool = False
    #: The multiprocessing context producers start with: queues and locks
    #: meant for them must come from it.
    mp_context: Any = field(default=None, compare=False)
    #: Whether the channel's handle may be given again after
    #: ``handle_delivered`` (a producer replaced under ``max_restarts``) or
    #: its memory to ranks (a group). Where not, what only producers needed
    #: may go at ``handle_delivered``: then no other process of the user can
    #: reach it through this one's ``/proc/<pid>/fd`` (or ``/dev/shm``).
    hands_again: bool = False

    @property
    def quota(self) -> int:
        """Places one worker may take in ordered mode (one is kept for the
        batch the consumer holds): ``(capacity - 1) // num_workers``."""
        if not self.ordered or self.num_workers == 1:
            return self.capacity
        return max(1, (self.capacity - 1) // self.num_workers)

    @property
    def consumer_may_hold(self) -> int:
        """The most places delivered batches may hold while the producers
        are still sure to deliver the batch the consumer waits for.

        Unordered, any worker's batch will do: one free place is enough.
        Ordered, the consumer waits for one worker while each other worker
        may fill its quota with batches whose turn has not come, and the
        worker it waits for needs a place beyond those."""
        if not self.ordered or self.num_workers == 1:
            return self.capacity - 1
        return max(1, self.capacity - 1 - (self.num_workers - 1) * self.quota)


class ProducerControl(abc.ABC):
    """Given to a ProducerEnd by shmpipe: lets a blocked put() notice that
    the consumer moved on."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raises Cancelled or Closed if the producer must stop what it does."""


class ConsumerEnd(abc.ABC):
    """The consumer's side of one pipeline's channel (see the module doc)."""

    #: Picklable; what ``Transport.attach`` gets in each producer.
    handle: Any = None
    #: The worker and payload size of the batch ``get`` returned last.
    last_worker: int = 0
    last_nbytes: int = 0
    #: Bytes one batch may take, where the channel has such a limit.
    slot_size: int | None = None

    @abc.abstractmethod
    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        """A batch, END, AGAIN or FAULT (see the module doc)."""

    def take_ready(self, pass_no: int, worker: int, wseq: int, due_ns: int) -> tuple[Any, int, int, int] | None:
        """Capability ``takes_ready``: the batch ``get(pass_no, worker, wseq,
        0)`` would return if it is there right now, taken, as (batch, its
        payload's bytes, its worker, the nanoseconds taking it took). None,
        having taken nothing, when no batch is there, when the pass ended
        or a fault was reported, or once ``time.perf_counter_ns()`` (or the
        same clock: CLOCK_MONOTONIC) reaches `due_ns` (shmpipe's next look
        at its producers). Never waits."""
        raise NotImplementedError(f"{type(self).__name__} has no fast path (capability takes_ready)")

    def handle_delivered(self) -> None:
        """Every producer has the channel's ``handle`` now: shmpipe's
        launcher started them with it, or sent it to them (a channel sized
        by its first batch), and will not send it again. The place to close
        what only producers need, such as the write ends of their pipes:
        then no other process can reach those through this one's
        ``/proc/<pid>/fd``. Called once, from the consumer's thread, before
        the first ``get``; not by a transport that runs its own producers.
        Default: nothing."""

    def begin_pass(self, pass_no: int) -> None:
        """Pass `pass_no` starts (called before producers hear of it, for
        every pass; the channel was opened at ``spec.first_pass``, so a call
        for the pass it is at must change nothing)."""

    def halt(self) -> None:
        """A producer failed: stop taking batches; get() returns what is
        already in flight, then FAULT."""

    def replacement_handle(self, worker: int) -> Any:
        """Capability ``restarts_producers``: the handle a producer that
        replaces `worker`'s (after ``reclaim``) attaches with. Default:
        ``handle``, as the first producers got."""
        return self.handle

    def audit(self, pass_no: int) -> None:
        """Checks the channel's shared state against what this process
        knows (pass `pass_no` is the one read); raises CorruptChannelError
        for a state no run of the protocol can reach (words written from
        outside), including one that would hang the pipeline. Called at
        each look at the producers (a few times a second while batches are
        awaited), between takes. Default: nothing to check."""

    def reclaim(self, worker: int, pass_no: int, delivered: int) -> tuple[int, bool]:
        """Capability ``restarts_producers``: producer `worker`'s process is
        gone (reaped), and `delivered` of its batches of pass `pass_no` were
        taken. Takes back what it held unpublished, and returns (the number
        of its first batch not published, whether it had marked its part of
        the pass complete): a replacement goes on from there. What it
        published and was not taken yet is still delivered. Called from the
        consumer's thread, between takes."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace a producer (capability restarts_producers)")

    @abc.abstractmethod
    def close(self) -> None:
        """Wake and stop producers blocked in put()."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Free what open() made. Idempotent; delivered batches stay valid.
        Never called while a get() or take_ready() runs: a close() from
        another thread waits for the one in progress to return (each
        returns within its ``wait``), so nothing is closed under a read."""

    def held(self) -> int | None:
        """How many delivered batches still hold a place of the channel (a
        slot), where delivered batches hold places at all; None otherwise.
        Adapters that buffer batches (tf.data) use it not to hold them all."""
        return None

    def producer_blocked_s(self, worker: int) -> float | None:
        """Seconds `worker` spent waiting for room, if the transport knows."""
        return None

    def describe_wait(self) -> str:
        """Why nothing arrives (for a timeout's message)."""
        return ""

    def memory_ranges(self) -> list[tuple[int, int]]:
        """(address, size) of the memory delivered arrays live in, in this
        process (zero_copy_reads transports)."""
        return []

    #: True when memory_ranges() is this channel's own memory, mapped until
    #: the pipeline closes and shared with nothing else. Only then may
    #: ``to_torch(pin_memory=True)`` page-lock it for CUDA (it is registered
    #: once and unregistered when the pipeline closes). Ray's object store,
    #: for one, is not: pinning it would pin the whole store.
    owns_memory: bool = False


class ProducerEnd(abc.ABC):
    """A producer's side of the channel (see the module doc)."""

    def start_pass(self, pass_no: int, first_wseq: int = 0) -> None:
        """Called before the source of pass `pass_no` runs. `first_wseq` is
        the number of this producer's first batch of the pass: 0, except in
        a producer that replaces a dead one (capability
        ``restarts_producers`` only), which goes on after the last batch
        its predecessor published."""

    @abc.abstractmethod
    def put(self, batch: Any) -> None:
        """Send one batch; block while the channel is full."""

    def reserve(self, template: Any) -> Any:
        """Writable arrays for the next batch (default: new arrays)."""
        return new_arrays(template)

    @abc.abstractmethod
    def end_pass(self) -> None:
        """This producer's part of the current pass is complete."""

    def close(self) -> None:
        """The producer is exiting."""


class Launcher(abc.ABC):
    """Runs a pipeline's producers and owns its channel (consumer side).

    shmpipe's own launcher starts processes; a transport with
    ``own_producers`` returns its own from ``Transport.launch``.
    """

    #: The channel, once open (a launcher may open it lazily).
    channel: ConsumerEnd | None = None

    @property
    def starting(self) -> bool:
        """Whether the producers are still being started in the background
        (shmpipe's launcher, when a start waits for a new interpreter): a
        pass begun meanwhile is given to them later, and a from_dataset
        pipeline makes its first batches itself until then."""
        return False

    def wait_for_start(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for a start in the background to
        end (see starting)."""

    @property
    @abc.abstractmethod
    def pids(self) -> list[int | None]:
        """Process ids of the producers (None where not meaningful)."""

    @abc.abstractmethod
    def open_channel(self, wait: float) -> ConsumerEnd | None:
        """The channel, opening it if it is not open yet; None if it cannot
        be opened within `wait` seconds (no first batch yet). A producer
        found gone as it opens is raised (WorkerDiedError) once the others
        are told, with the channel open: the pipeline may replace it
        (restart, send_pass) and go on with ``channel``."""

    @abc.abstractmethod
    def begin_pass(self, pass_no: int, work: Sequence[PassWork]) -> None:
        """Starts pass `pass_no` in every producer: producer w runs its
        source for ``work[w]`` (after ``enter_pass(w, num_workers, work[w])``)."""

    @abc.abstractmethod
    def first_failure(self) -> BaseException | None:
        """The first failure of a producer (an error it raised, or its
        death) as the exception to raise, or None. Never raises it."""

    def halt(self) -> None:
        """A producer failed: the others should stop producing (what is in
        flight is still delivered, then the error raised)."""

    def closing(self) -> None:
        """The pipeline is closing and shutdown() comes later (a signal
        handler's close() put off to the end of the take it interrupted):
        a start waiting meanwhile (for a new process) gives up now."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the producers, joins them and destroys the channel.
        Idempotent; must work from a finalizer."""

    def wait_for_event(self, timeout: float) -> None:
        """Blocks until a producer may have something to say, or timeout."""
        time.sleep(timeout)

    def leftovers(self) -> list[str]:
        """After shutdown: whatever still runs (processes, actors), described;
        the conformance suite asserts it is empty."""
        return []

    def describe_stall(self) -> str:
        """What the producers' side knows of a wait that found nothing, for
        its timeout's message ("; " first), or "". Default: nothing."""
        return ""

    #: Whether reported_end() knows what producers said when their part of
    #: a pass ended (shmpipe's own launcher: from their control connections).
    reports_ends: bool = False

    def reported_end(self, worker: int, pass_no: int) -> int | None:
        """(reports_ends) How many batches producer `worker` said it
        published in pass `pass_no` when its part ended; None if it has
        not said so. The pipeline checks the channel's END against it."""
        return None

    def iterator_state(self, worker: int, pass_no: int, wseq: int) -> tuple[bool, Any]:
        """(True, the state producer `worker`'s source's iterator reported
        after its batch `wseq` of pass `pass_no`), where its iterator has
        ``state_dict()`` and the producer sent it; (False, None) otherwise
        (then a resume goes by count). Default: never."""
        return False, None

    def keep_iterator_states(self, behind: int) -> None:
        """From now on a state may be asked for `behind` batches behind
        those the consumer took (an adapter takes them ahead of the
        trainer): a launcher that keeps only its producers' last few states
        keeps that many more. Default: nothing to do."""

    #: Whether restart() and send_pass() replace a dead producer (shmpipe's
    #: own launcher, over a channel that ``restarts_producers``); the
    #: pipeline asks only such a launcher, and only with max_restarts.
    can_restart: bool = False

    def restart(self, worker: int) -> int:
        """(can_restart) Replaces producer `worker`, whose process has ended,
        by a new one attached to the channel; returns its pid. It runs
        nothing until send_pass()."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart a producer")

    def send_pass(self, worker: int, work: PassWork) -> None:
        """(can_restart) Pass `work.pass_no`, already begun, for producer
        `worker` alone (a replacement, which goes on where its predecessor
        stopped)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart a producer")

    def children(self) -> list[Any]:
        """The multiprocessing processes this launcher started from this
        process. A launcher that starts local processes must list them: a
        process the user forks from the trainer takes them off its own list
        of children, or its exit would stop them."""
        return []


class Transport(abc.ABC):
    """A way to move batches; see the module doc for the contract."""

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Modules this transport imports lazily (checked before it is used); a
    #: transport whose module imports them at the top calls require() there
    #: instead.
    requires: ClassVar[tuple[str, ...]] = ()
    #: What installs them: ``install``, a requirement of your own package
    #: (pip install "mypkg[gpu]"), else ``extra``, one of shmpipe's extras
    #: (pip install "shmpipe[<extra>]"), else pip install <module>.
    install: ClassVar[str | None] = None
    extra: ClassVar[str | None] = None
    #: File descriptors the consumer's channel holds per producer (a pipe's
    #: end each, say), beside the launcher's own: a pipeline that would not
    #: fit under ``ulimit -n`` is refused before it starts (DescriptorLimitError).
    consumer_fds_per_producer: ClassVar[int] = 0

    @abc.abstractmethod
    def open(self, spec: ChannelSpec) -> ConsumerEnd:
        """Consumer side: create the channel."""

    def check_spec(self, spec: ChannelSpec) -> None:
        """Consumer side, before any process starts or any memory is made:
        raise ShmpipeValueError for a ChannelSpec this transport cannot
        serve (more slots or workers than it has room for, say). Default:
        every spec is fine."""

    def attach(self, handle: Any, worker: int, control: ProducerControl) -> ProducerEnd:
        """Producer side: join the channel `handle` names as `worker`."""
        raise NotImplementedError(f"{type(self).__name__} does not attach producers")

    def launch(
        self, sources: Sequence[Callable[[], Iterable[Any]]], spec: ChannelSpec, seed: int
    ) -> Launcher:
        """Only for ``own_producers`` transports: start the producers."""
        raise NotImplementedError(f"{type(self).__name__} does not run its own producers")

    def batch_nbytes(self, batch: Any) -> int:
        """Producer side, ``sized_by_first_batch`` only: bytes `batch` needs
        in this transport's channel. Default: the bytes of its arrays."""
        return _tree.nbytes(batch)

    def slot_size_for(self, nbytes: int) -> int:
        """Consumer side, ``sized_by_first_batch`` only: the slot size to
        open the channel with when the first batch needs `nbytes` (0 when a
        pass ended before any batch). Default: `nbytes`, at least 1."""
        return max(1, nbytes)

    def orphaned(self, handle: Any) -> None:
        """Producer side: the consumer process died, and this producer is
        about to exit. Remove what only the consumer would have removed
        (named memory). Runs in a watchdog thread; must not block."""

    def __repr__(self) -> str:
        return f"<shmpipe transport {self.name!r}>"


# -- several ranks: the optional protocol of capability serves_ranks -------------


@dataclass
class SharedBatch:
    """What ``SharingConsumerEnd.take_shared`` returns: one batch, not
    decoded, for the rank it is dealt to.

    ``root`` holds the batch's place in the channel (its slot) until it is
    dropped; ``record`` (ints and strs only) tells a :class:`RankReader`
    where the payload is; ``fd`` is a descriptor of memory of its own the
    rank must map too (a batch larger than a slot), owned by this object
    until ``close_fd``."""

    root: Any
    record: tuple[Any, ...]
    fd: int | None = None

    def close_fd(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class RankReader(abc.ABC):
    """A rank's view of a channel shared by a group (``Transport.rank_reader``):
    maps the channel's memory read-only and turns each record a rank is
    dealt into the batch, as views of that memory."""

    #: Whether memory_ranges() is this reader's own mapping (see ConsumerEnd).
    owns_memory: bool = False

    @abc.abstractmethod
    def read(self, record: tuple[Any, ...], fd: int | None, release: Callable[[], None]) -> Any:
        """The batch `record` names (with `fd`, memory of its own, which
        the caller keeps and closes). `release` must be called exactly once,
        when the last array of the batch is gone (or at once on error)."""

    def held(self) -> int | None:
        """Batches read and not yet released."""
        return None

    def memory_ranges(self) -> list[tuple[int, int]]:
        return []

    def close(self) -> None:
        """No more reads; mappings stay while batches live."""


class SharingConsumerEnd(ConsumerEnd):
    """The consumer end of a channel that feeds several ranks: rank 0's
    group takes its batches undecoded and deals them to the ranks."""

    @abc.abstractmethod
    def take_shared(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        """As ``get``, but a batch comes as a :class:`SharedBatch` (not
        decoded: each rank decodes it in its own mapping)."""

    @abc.abstractmethod
    def share_with_ranks(self) -> tuple[dict[str, Any], list[int]]:
        """What another process of this user needs to map the channel's
        memory: (a dict of ints and strs, new descriptors the caller sends
        and closes)."""


class ServesRanks(abc.ABC):
    """The transport's side of capability ``serves_ranks``: a Transport
    that implements it subclasses this too, and its ``open`` returns a
    :class:`SharingConsumerEnd`."""

    @abc.abstractmethod
    def rank_reader(self, share: dict[str, Any], fds: list[int]) -> RankReader:
        """In a rank of a group: a reader of the channel `share` (from
        ``share_with_ranks``) describes; takes `fds`."""


def class_name(obj: object) -> str:
    """The module and qualified name of `obj`'s class: which transport's
    ConsumerEnd an error is about."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def reported(channel: ConsumerEnd, num_workers: int) -> tuple[int, int]:
    """(last_nbytes, last_worker) of the batch `channel`'s get returned,
    checked: they index and add up the pipeline's counters, and a
    transport's own ConsumerEnd may set anything there. A
    CorruptChannelError naming its class where they break the contract."""
    nbytes, worker = _an_int(channel.last_nbytes), _an_int(channel.last_worker)
    if worker is None or not 0 <= worker < num_workers or nbytes is None or not 0 <= nbytes < 1 << 48:
        raise CorruptChannelError(
            f"{class_name(channel)} reported the batch as worker {channel.last_worker!r:.40}'s, of "
            f"{channel.last_nbytes!r:.40} bytes: last_worker must be an int in [0, {num_workers}) and "
            "last_nbytes an int in [0, 2**48)"
        )
    return nbytes, worker


def _an_int(value: object) -> int | None:
    """`value` as an int where it is one (a NumPy integer too), never a bool."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def require(module: str, *, transport: str, extra: str | None = None, install: str | None = None) -> ModuleType:
    """Imports `module` for the transport named `transport`, or raises
    TransportUnavailableError with the command that installs it: ``pip
    install "<install>"`` (a plugin's own package and extra, such as
    ``"mypkg[gpu]"``), else ``pip install "shmpipe[<extra>]"`` (shmpipe's
    own extras: what the built-in transports name), else ``pip install
    <module>``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise  # the package is there but fails to import: say that, as it is
        raise not_installed(module, transport, extra, install) from exc


def not_installed(
    module: str, transport: str, extra: str | None = None, install: str | None = None
) -> TransportUnavailableError:
    """The error for `module` missing, with the command that installs it (see require)."""
    if install:
        hint = f'pip install "{install}"'
    else:
        hint = f'pip install "shmpipe[{extra}]"' if extra else f"pip install {module}"
    return TransportUnavailableError(f"the {transport!r} transport needs {module}, which is not installed: {hint}")
