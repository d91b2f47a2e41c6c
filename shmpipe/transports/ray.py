"""The "ray" transport: producers are Ray actors, batches travel through Ray's
object store. The way past one machine.

Each producer is an actor running its source as a *streaming generator*
(``num_returns="streaming"``): every batch it yields becomes an object in the
store, owned by the consumer (the caller), and the consumer gets it with
``ray.get``, which on the same node returns read-only NumPy views of the
store -- zero-copy for batches of 100 KiB and more (Ray copies smaller
objects inline into its messages); arrays of 2 KiB and more start on 64-byte
boundaries, smaller ones on 8-byte boundaries.
``_generator_backpressure_num_objects``
bounds how far each actor runs ahead of the consumer, which is what keeps at
most ``capacity`` batches in flight.

On one machine, with no Ray running, the pipeline starts a local Ray (its
object store sized for the pipeline when ``slot_size`` is given) and stops
it on close. With Ray already running (``ray.init(address=...)`` before the
pipeline, or ``RayTransport(address=...)``) it uses that cluster, and
``actor_options`` (``num_cpus``, ``resources``, ``scheduling_strategy``, ...)
place the producers, on other nodes if you ask.

Costs: one copy into the store per batch (Ray's pickle 5 with out-of-band
buffers), an actor call per batch, and Ray itself. Sources may be anything
Ray can pickle (cloudpickle: lambdas too); shmpipe must be installed where
the actors run.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from shmpipe import _tree
from shmpipe._interrupts import WaitEndedByCtrlC, ctrl_c_pending
from shmpipe.errors import PipelineClosedError, ShmpipeError, ShmpipeValueError, WorkerDiedError, WorkerError
from shmpipe.transport import (
    AGAIN,
    END,
    Capabilities,
    ChannelSpec,
    ConsumerEnd,
    Launcher,
    PassWork,
    Transport,
    check_batch,
    enter_pass,
    require,
)

ray = require("ray", transport="ray", extra="ray")

__all__ = ["RayTransport"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its tracebacks

#: What a stream's next batch can fail with when its actor's process or
#: node is gone: the actor's death, or the loss of an object it made (a
#: batch of 100 KiB or more lives in the object store of the actor's node,
#: and an actor's streaming output is not reconstructed: Ray raises
#: ObjectReconstructionFailedError, an ObjectLostError, for a batch made
#: before the node left). Either is the producer's death, for the pipeline
#: to replace (max_restarts: the replacement makes again every batch not
#: taken, the lost one included) or to fail with.
_LOST_WITH_ITS_ACTOR = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) + tuple(
    # and its process or node ended under it (Ray's memory monitor, a crash)
    getattr(ray.exceptions, name) for name in ("OutOfMemoryError", "WorkerCrashedError", "NodeDiedError")
    if isinstance(getattr(ray.exceptions, name, None), type)
)

#: How long producers may take to be placed and started before the pipeline
#: gives up (a cluster without room for them would otherwise wait forever).
START_TIMEOUT_S = 120.0
#: How often that wait looks for a Ctrl-C held back meanwhile (ctrl_c_pending),
#: and for a shutdown; how long a shutdown waits for it to see that.
_START_POLL_S = 0.1
PLACING_LEAVES_S = 5.0


class _OurRay:
    """The local Ray that shmpipe started for its pipelines, and how many
    launchers use it: the last of them to shut down stops it. One launcher
    stopped it under the others before, whose next call into Ray started a
    new Ray and then aborted the process in Ray's C++ (helper 94). A Ray
    the program started, or started again after ours (told apart by the
    job id of this driver's connection), is never stopped here."""

    lock = threading.Lock()
    job: str | None = None  # this driver's job in the Ray we started, while it runs
    users = 0

    @classmethod
    def attach(cls, start: Callable[[], None]) -> bool:
        """Starts Ray where none runs; whether the caller now uses ours
        (False: the program's Ray)."""
        with cls.lock:
            if not ray.is_initialized():
                start()
                cls.job, cls.users = _job(), 0
            if cls.job is None or _job() != cls.job:
                return False
            cls.users += 1
            return True

    @classmethod
    def detach(cls, job: str | None) -> None:
        """One user of ours (`job`: its _job() as it attached) less: the last
        stops it, if it still runs. A user of one the program stopped
        since counts for none."""
        with cls.lock:
            if job != cls.job:
                return
            cls.users -= 1
            if cls.users > 0:
                return
            if _job() == job:
                ray.shutdown()
            cls.job = None


def _job() -> str | None:
    """This driver's connection to the Ray it is connected to: its node and
    job (a Ray started again numbers its jobs from 1 again; its node is
    new), None where there is none."""
    if not ray.is_initialized():
        return None
    try:
        context = ray.get_runtime_context()
        return f"{context.get_node_id()}/{context.get_job_id()}"
    except Exception:  # noqa: BLE001 - a Ray being shut down meanwhile (another thread): none
        return None


class RayTransport(Transport):
    """Producers as Ray actors; batches through Ray's object store.

    Args:
        address: a Ray cluster to connect to (as ``ray.init(address=...)``)
            when Ray is not initialised yet; None starts a local Ray then.
        actor_options: passed to ``.options()`` of every producer actor:
            ``num_cpus``, ``resources``, ``scheduling_strategy``, ...
            Default ``{"num_cpus": 1}``.
        object_store_memory: bytes for a local Ray that shmpipe starts;
            default: room for the pipeline when ``slot_size`` is known, else
            Ray's own default.
        init_options: more keyword arguments for that ``ray.init``.
    """

    name = "ray"
    capabilities = Capabilities(
        zero_copy_reads=True,
        # Ray lays out buffers of 2 KiB and more on 64-byte boundaries and
        # smaller ones on 8-byte boundaries; 8 is what holds for every array.
        alignment=8,
        # Ray puts objects below max_direct_call_object_size (100 KiB by
        # default) inline in its messages: copied, not aligned.
        zero_copy_min_bytes=100 << 10,
        cross_host=True,
        serializes="pickle 5, arrays out of band into Ray's object store",
        own_producers=True,
        checks_batches=True,  # the actors do (_Producer.run_pass)
        # A dead actor (its process, or its node, gone) is replaced by a new
        # one, placed by Ray, which goes on after the last batch the
        # consumer took (RayLauncher.restart, RayConsumer.reclaim).
        restarts_producers=True,
    )

    def __init__(
        self,
        *,
        address: str | None = None,
        actor_options: dict | None = None,
        object_store_memory: int | None = None,
        init_options: dict | None = None,
    ) -> None:
        self.address = address
        self.actor_options = _checked_actor_options(dict(actor_options or {"num_cpus": 1}), "actor_options")
        self.object_store_memory = object_store_memory
        self.init_options = dict(init_options or {})

    def with_remote_args(self, remote_args: dict[str, Any]) -> RayTransport:
        """This transport with `remote_args` (``from_dataset(...,
        ray_remote_args=...)``) over its actor options: Ray's
        ``.options()`` of every producer actor."""
        if not isinstance(remote_args, dict) or not all(isinstance(k, str) for k in remote_args):
            raise ShmpipeValueError(
                f"ray_remote_args must be a dict of Ray's actor options (num_cpus, resources, "
                f"scheduling_strategy, ...), got {type(remote_args).__name__}"
            )
        return RayTransport(
            address=self.address,
            actor_options=_checked_actor_options(self.actor_options | remote_args, "ray_remote_args"),
            object_store_memory=self.object_store_memory,
            init_options=self.init_options,
        )

    def open(self, spec: ChannelSpec) -> ConsumerEnd:
        raise ShmpipeValueError("the ray transport runs its own producers: use launch()")

    def launch(
        self, sources: Sequence[Callable[[], Iterable[Any]]], spec: ChannelSpec, seed: int
    ) -> RayLauncher:
        return RayLauncher(self, sources, spec)


#: Actor options shmpipe sets itself: each actor's name (unique, to find
#: what is left after close) and its concurrency (a pass's stream, and the
#: next pass's call or a cancel beside it: _Producer).
_OWN_ACTOR_OPTIONS = ("name", "max_concurrency")


def _checked_actor_options(options: dict[str, Any], what: str) -> dict[str, Any]:
    """`options` for every producer actor, checked as Ray's ``.options()``
    checks them (without starting anything), so a bad one is an error of
    the arguments, before any actor or Ray starts."""
    own = sorted(set(options) & set(_OWN_ACTOR_OPTIONS))
    if own:
        raise ShmpipeValueError(f"{what} may not set {', '.join(own)}: shmpipe sets it for each producer actor")
    try:
        _ProducerActor.options(name="shmpipe-check", max_concurrency=2, **options)
    except (TypeError, ValueError, OverflowError) as exc:  # (num_cpus=inf: an OverflowError)
        raise ShmpipeValueError(f"{what} holds an option Ray refuses: {exc}") from None
    # What .options() lets through and Ray refuses only at an actor's start,
    # after the pipeline started Ray (an AttributeError, a ValueError, an
    # AssertionError of its own): checked here, before anything starts.
    refused = f"{what} holds an option Ray refuses:"
    resources = options.get("resources")
    if isinstance(resources, dict) and not all(isinstance(k, str) for k in resources):
        raise ShmpipeValueError(f"{refused} resources are named by strings, not {sorted(map(repr, resources))}")
    strategy = options.get("scheduling_strategy")
    if isinstance(strategy, str) and strategy not in ("DEFAULT", "SPREAD"):
        raise ShmpipeValueError(
            f"{refused} scheduling_strategy {strategy!r} is none of Ray's: 'DEFAULT', 'SPREAD' or a strategy "
            "object of ray.util.scheduling_strategies"
        )
    group = options.get("placement_group", "default")
    if group not in (None, "default") and type(group).__name__ != "PlacementGroup":
        raise ShmpipeValueError(f"{refused} placement_group is a PlacementGroup (or None), not {group!r}")
    return options


#: How often a pass's call, waiting for the pass before it to stop, looks
#: whether a newer pass has overtaken it.
_PASS_LOCK_POLL_S = 0.05


class _Producer:
    """One producer: runs its source once per pass as a streaming generator.

    The actor has two threads (max_concurrency=2), so a new pass's call can
    run while the old pass's generator is still in its source: a source
    reads the pass's work and draws from the global generators, both the
    process's (enter_pass), so one pass's source runs at a time. A new pass
    marks every older one cancelled, then waits for the pass lock: the old
    generator stops at its next batch and lets go of it, and only then is
    the new pass entered (its work set, the generators seeded). A call that
    Ray runs after a newer one (the two threads take calls in no set order)
    finds itself cancelled and yields nothing.
    """

    def __init__(self, worker: int, num_workers: int, source: Callable) -> None:
        self.worker = worker
        self.num_workers = num_workers
        self.source = source
        self.cancelled_below = 0  # passes below this number stop at their next batch
        self._cancelling = threading.Lock()  # (max() then a store is not atomic between two threads)
        #: Held by the pass whose source runs, across its yields (a
        #: generator runs in one thread of Ray's from start to end).
        self._pass_lock = threading.Lock()

    def pid(self) -> int:
        return os.getpid()

    def cancel(self, below: int) -> None:
        with self._cancelling:
            self.cancelled_below = max(self.cancelled_below, below)

    def run_pass(self, work: PassWork) -> Iterator[Any]:
        pass_no = work.pass_no
        self.cancel(pass_no)
        # Polled, not waited on: a call that a newer one overtook must not
        # hold this thread through the newer pass (the actor's other calls,
        # a cancel or the pass after, would find no thread to run on).
        while not self._pass_lock.acquire(timeout=_PASS_LOCK_POLL_S):
            if pass_no < self.cancelled_below:
                return
        try:
            if pass_no < self.cancelled_below:
                return  # a newer pass came first
            enter_pass(self.worker, self.num_workers, work)
            iterator = iter(self.source())
            try:
                for batch in iterator:
                    if pass_no < self.cancelled_below:
                        return
                    check_batch(batch)  # the contract of every transport (shmpipe runs no producer here)
                    yield batch
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        finally:
            self._pass_lock.release()


# A Ray actor class (a class decorator would hide what it makes from type checkers).
_ProducerActor = ray.remote(_Producer)


class RayLauncher(Launcher):
    def __init__(self, transport: RayTransport, sources: Sequence, spec: ChannelSpec) -> None:
        self.transport = transport
        self.spec = spec
        self._ours = False  # whether it uses the Ray shmpipe started (_OurRay), until it gives it back
        self._job: str | None = None
        #: Placements under way (_started), which shutdown waits for
        self._placing = 0
        self._placing_changed = threading.Condition()
        self.actors: list = []
        self.gens: list = []
        self._down = False
        #: Held while an actor is added (restart) or a pass sent to one
        #: (send_pass), and by shutdown as it stops: a close() from another
        #: thread in the middle of a replacement finds the new actor in
        #: `actors` and kills it with the rest, and a replacement after it
        #: is refused (PipelineClosedError), never an actor left running.
        self._adding = threading.Lock()
        #: Deaths seen in the streams and not yet handed to the pipeline
        #: (first_failure): it replaces the producer or fails.
        self.deaths: list[WorkerDiedError] = []
        self._replacements = 0  # actor names stay unique
        self._ours = _OurRay.attach(lambda: self._start_ray(spec))
        #: The Ray this pipeline's actors live in: a call into another (the
        #: program stopped it, and perhaps started a new one) fails, never
        #: starts one (ray_up)
        self._job = _job()
        self.prefix = f"shmpipe-{secrets.token_hex(6)}"
        self.backpressure = spec.quota if spec.ordered else max(1, spec.capacity // spec.num_workers)
        self.sources = list(sources)
        try:
            self.actors = [self._actor(w, f"{self.prefix}-{w}") for w in range(len(sources))]
            try:
                self._pids = self._started(self.actors)
            except ray.exceptions.RayActorError as exc:
                if _shadowing_checkout():
                    raise ShmpipeValueError(
                        "Ray's workers import shmpipe from ./shmpipe, a source checkout without "
                        "its compiled extensions, because Ray puts the directory ray.init() ran "
                        "in on their sys.path; call ray.init() from another directory (or let "
                        "the pipeline start Ray)"
                    ) from exc
                raise
        except BaseException:
            self.shutdown()
            raise
        self.consumer = RayConsumer(self)
        self.channel = self.consumer

    def _actor(self, worker: int, name: str) -> Any:
        return _ProducerActor.options(name=name, max_concurrency=2, **self.transport.actor_options).remote(
            worker, self.spec.num_workers, self.sources[worker]
        )

    def _started(self, actors: list, workers: Sequence[int] | None = None) -> list[int]:
        """The pids of `actors` (those of `workers`, every worker's by
        default) once Ray placed and started them all. An actor that died
        as it started (its source could not be rebuilt in its process: a
        module missing on its node) is that worker's death, said as soon as
        it is known. The wait polls, and ends for a Ctrl-C held back
        meanwhile (the constructor's span raises it) or a shutdown (a
        close() from another thread during a replacement: no call into Ray
        after it stopped Ray, which would start a new one); shutdown waits
        for it to leave (_placing) before it stops Ray."""
        workers = list(workers) if workers is not None else list(range(len(actors)))
        with self._placing_changed:
            self._placing += 1
        try:
            refs = [a.pid.remote() for a in actors]
            pids: dict[int, int] = {}
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(pids) < len(refs):
                if self._down:
                    raise PipelineClosedError("the pipeline was closed while Ray placed its producer actors")
                self.check_ray_up()
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_START_POLL_S)
                for k in (k for k, ref in enumerate(refs) if ref in ready and k not in pids):
                    pids[k] = self._pid_of(refs[k], workers[k])
                if len(pids) == len(refs):
                    break
                if ctrl_c_pending():
                    raise WaitEndedByCtrlC("Ctrl-C was pressed while Ray placed the producer actors")
                if time.monotonic() > deadline:
                    raise ShmpipeValueError(
                        f"Ray could not start {len(refs) - len(pids)} of {len(refs)} producer actors "
                        f"within {START_TIMEOUT_S:g} s; does the cluster have room for "
                        f"{self.transport.actor_options} each?"
                    )
            return [pids[k] for k in range(len(refs))]
        finally:
            with self._placing_changed:
                self._placing -= 1
                self._placing_changed.notify_all()

    @staticmethod
    def _pid_of(ref: Any, worker: int) -> int:
        """The pid a started actor reported, or its death as it started."""
        try:
            return int(ray.get(ref))
        except ray.exceptions.RayError as exc:  # its death, or what kept Ray from running it (a runtime_env)
            said = _ANSI.sub("", str(exc))
            # ./shmpipe in the worker's traceback: it imported that checkout (the constructor says so)
            if isinstance(exc, ray.exceptions.RayActorError) and _shadowing_checkout() and _checkout_prefix() in said:
                raise
            raise WorkerDiedError(worker, None, None, reason=f"its Ray actor died as it started: {said}") from exc

    def _start_ray(self, spec: ChannelSpec) -> None:
        with _away_from_a_checkout():
            self._init_ray(spec)

    def _init_ray(self, spec: ChannelSpec) -> None:
        t = self.transport
        options: dict[str, Any] = {"include_dashboard": False}
        if t.address is not None:
            options["address"] = t.address
        else:
            options["num_cpus"] = max(os.cpu_count() or 1, spec.num_workers + 1)
            memory = t.object_store_memory
            if memory is None and spec.slot_size is not None:
                # every batch in flight, those the consumer holds, and slack
                memory = max(256 << 20, 3 * spec.capacity * spec.slot_size)
            if memory is not None:
                options["object_store_memory"] = memory
        options.update(t.init_options)
        ray.init(**options)

    @property
    def pids(self) -> list[int | None]:
        return list(self._pids)

    def open_channel(self, wait: float) -> ConsumerEnd:
        return self.consumer

    def begin_pass(self, pass_no: int, work: Sequence[PassWork]) -> None:
        with self._adding:
            if self._down:
                raise PipelineClosedError("the pipeline was closed: the pass is not sent to the producers")
            self.check_ray_up()
            if self.gens:
                # Stop the old pass: its generators stop at their next batch,
                # and dropping them releases their backpressure.
                for a in self.actors:
                    a.cancel.remote(pass_no)
            self.gens = [self._stream(a, w) for a, w in zip(self.actors, work, strict=True)]
        self.consumer.begin_pass(pass_no)

    def _stream(self, actor: Any, work: PassWork) -> Any:
        return actor.run_pass.options(
            num_returns="streaming", _generator_backpressure_num_objects=self.backpressure
        ).remote(work)

    def first_failure(self) -> BaseException | None:
        # A source's error comes out of its stream, in stream order (the
        # consumer raises it); a death is handed over here, once, so that
        # the pipeline replaces the producer (max_restarts) or fails.
        return self.deaths.pop(0) if self.deaths else None

    # -- max_restarts ---------------------------------------------------------

    can_restart = True

    def restart(self, worker: int) -> int:
        """A new actor for `worker`, placed by Ray (on another node if its
        node is gone); the dead one is killed for good first (a
        ``max_restarts`` of Ray's own would bring it back running nothing)."""
        closed = f"the pipeline was closed: producer {worker} is not replaced"
        with self._adding:
            if self._down:
                raise PipelineClosedError(closed)
            self.check_ray_up()
            with contextlib.suppress(Exception):
                ray.kill(self.actors[worker], no_restart=True)
            self._replacements += 1
            actor = self._actor(worker, f"{self.prefix}-{worker}-r{self._replacements}")
            self.actors[worker] = actor  # (a shutdown from now on kills it)
        try:
            # Outside the lock: placing it may take up to START_TIMEOUT_S,
            # which a close() cuts short (it kills the actor).
            (pid,) = self._started([actor], [worker])
        except Exception as exc:
            if self._down:
                # A close() meanwhile: it killed the actor, and _started left
                # its wait (shutdown stops Ray only after that).
                raise PipelineClosedError(closed) from exc
            # It died as it started, or there was no room for it (that
            # ShmpipeValueError says so): the death is the pipeline's
            # failure, which says that no replacement started, and why.
            if isinstance(exc, WorkerDiedError):
                raise ShmpipeError(f"its Ray actor died as it started ({type(exc.__cause__).__name__})") from exc
            raise
        if self._down:
            raise PipelineClosedError(closed)  # started as the close came: killed with the rest
        self._pids[worker] = pid
        return pid

    def send_pass(self, worker: int, work: PassWork) -> None:
        with self._adding:
            if self._down:
                raise PipelineClosedError(f"the pipeline was closed: producer {worker} is not sent its pass")
            self.check_ray_up()
            self.gens[worker] = self._stream(self.actors[worker], work)
        self.consumer.revived(worker)

    def halt(self) -> None:
        if self._down or not self.ray_up():
            return  # (the actors are killed, and Ray may be stopped: by the program too, see shutdown)
        for a in self.actors:
            a.cancel.remote(1 << 62)

    def shutdown(self) -> None:
        with self._adding:  # after an actor being added: it is killed with the rest
            first, self._down = not self._down, True
            self.gens = []
            # A program that stopped Ray itself (ray.shutdown()) took the actors with
            # it; a call into Ray after that ends the process (its core worker is gone).
            actors = list(self.actors) if first and self.ray_up() else []
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        # A replacement's placement in another thread sees the shutdown within
        # a poll and leaves, before Ray may be stopped under it.
        with self._placing_changed:
            self._placing_changed.wait_for(lambda: self._placing == 0, timeout=PLACING_LEAVES_S)
        with self._adding:  # (a shutdown cut short and run again still gives its Ray back: once)
            ours, self._ours = self._ours, False
        if ours:
            _OurRay.detach(self._job)

    def ray_up(self) -> bool:
        """Whether the Ray of this pipeline's actors still runs for it."""
        return ray.is_initialized() and _job() == self._job

    def check_ray_up(self) -> None:
        """Raises where the program stopped the Ray of this pipeline's
        actors: a call into Ray then would start a new one (ray.init's
        auto-start), whose first wait on an old stream aborts the process."""
        if not self.ray_up():
            raise PipelineClosedError(
                "Ray was shut down under this pipeline (ray.shutdown() before its close()): its producer "
                "actors are gone with it"
            )

    def leftovers(self) -> list[str]:
        if not self.ray_up():
            return []
        deadline = time.monotonic() + 10  # ray.kill is asynchronous
        while True:
            alive = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(self.prefix)
            ]
            if not alive or time.monotonic() > deadline:
                return [f"Ray actor {name}" for name in alive]
            time.sleep(0.1)


def _checkout_prefix() -> str:
    """./shmpipe/ as it appears in a worker's traceback."""
    return os.path.join(os.getcwd(), "shmpipe") + os.sep


def _shadowing_checkout() -> bool:
    """Whether ./shmpipe is a directory other than the shmpipe imported here:
    a source checkout that Ray's workers would import instead."""
    here = os.path.realpath(os.path.join(os.getcwd(), "shmpipe"))
    installed = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # shmpipe/transports/ray.py
    return os.path.isdir(here) and here != installed


@contextlib.contextmanager
def _away_from_a_checkout() -> Iterator[None]:
    """ray.init() puts its current directory on every worker's sys.path (so
    actors can import the user's modules). Started inside a shmpipe source
    checkout, that would make workers import the checkout instead of the
    installed package; only then is Ray started from the temp directory."""
    if not _shadowing_checkout():
        yield
        return
    old = os.getcwd()
    os.chdir(tempfile.gettempdir())
    try:
        yield
    finally:
        os.chdir(old)


class RayConsumer(ConsumerEnd):
    """Batches from the actors' streams. A death (RayActorError, or a batch
    lost with the actor's node: _LOST_WITH_ITS_ACTOR) is not raised here:
    it goes to the launcher (first_failure) and the stream's worker counts
    as dead, giving AGAIN, until the pipeline replaced it (revived) or
    failed."""

    def __init__(self, launcher: RayLauncher) -> None:
        self.launcher = launcher
        self.ended: set[int] = set()
        self.dead: set[int] = set()
        self.pass_no: int | None = None

    def begin_pass(self, pass_no: int) -> None:
        if pass_no != self.pass_no:
            self.pass_no = pass_no
            self.ended = set()

    def revived(self, worker: int) -> None:
        self.dead.discard(worker)
        self.ended.discard(worker)

    def reclaim(self, worker: int, pass_no: int, delivered: int) -> tuple[int, bool]:
        # What the dead actor made and the consumer had not taken went with
        # its stream: the replacement makes it again, from the first batch
        # not taken.
        return delivered, False

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        gens = self.launcher.gens
        if not gens:
            # Shut down by a close() from another thread: nothing more comes
            # (the pipeline's wait says it was closed).
            time.sleep(min(wait, 0.01))
            return AGAIN
        self.launcher.check_ray_up()
        if worker >= 0:
            if worker in self.dead:
                return AGAIN
            g = gens[worker]
            ready, _ = ray.wait([g], num_returns=1, timeout=wait)
            if not ready:
                return AGAIN
            try:
                ref = next(g)
            except StopIteration:
                return END
            except _LOST_WITH_ITS_ACTOR as exc:
                return self._died(worker, exc)
            return self._fetch(ref, worker)
        while True:
            active = [g for w, g in enumerate(gens) if w not in self.ended and w not in self.dead]
            if not active:
                return AGAIN if self.dead else END
            ready, _ = ray.wait(active, num_returns=1, timeout=wait)
            if not ready:
                return AGAIN
            w = next(i for i, g in enumerate(gens) if g is ready[0])
            try:
                ref = next(ready[0])
            except StopIteration:
                self.ended.add(w)
                continue
            except _LOST_WITH_ITS_ACTOR as exc:
                return self._died(w, exc)
            return self._fetch(ref, w)

    def _died(self, worker: int, exc: BaseException) -> Any:
        """Worker's actor died (its process or its node), or a batch it made
        was lost with its node: the launcher hands the death to the
        pipeline; its stream gives nothing meanwhile."""
        name = type(exc).__name__
        if isinstance(exc, ray.exceptions.ObjectLostError):
            reason = f"a batch it made was lost ({name}: its node's object store left or cannot be reached)"
        else:
            reason = f"its Ray actor died ({name})"
        death = WorkerDiedError(worker, self.launcher.pids[worker], None, reason=reason)
        death.__cause__ = exc
        self.dead.add(worker)
        self.launcher.deaths.append(death)
        return AGAIN

    def _fetch(self, ref: Any, worker: int) -> Any:
        pid = self.launcher.pids[worker]
        try:
            batch = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            tb = getattr(exc, "traceback_str", "") or str(exc)
            error = WorkerError(
                worker,
                pid,
                f"{type(cause).__module__}.{type(cause).__qualname__}",
                str(cause),
                _ANSI.sub("", tb),
            )
            if isinstance(cause, ShmpipeError):
                # shmpipe's own error in the producer (BatchTypeError, ...):
                # raised as itself, chained to the WorkerError that says
                # which worker and where, as shmpipe's own producers report it.
                error.__cause__ = exc
                raise cause from error
            raise error from exc
        except _LOST_WITH_ITS_ACTOR as exc:
            return self._died(worker, exc)
        except ray.exceptions.RayError as exc:
            # Ray's own word that it could not hand over what the producer
            # made or raised (an exception it cannot unpickle: its __init__
            # takes other arguments than its args; a batch it cannot
            # deserialize): that producer's error all the same.
            what = f"{type(exc).__module__}.{type(exc).__qualname__}"
            raise WorkerError(worker, pid, what, _ANSI.sub("", str(exc)), "") from exc
        self.last_worker = worker
        self.last_nbytes = _tree.nbytes(batch)
        return batch

    def close(self) -> None:
        pass

    def destroy(self) -> None:
        pass  # objects go when their last reference does

    def memory_ranges(self) -> list[tuple[int, int]]:
        return object_store_ranges()


def object_store_ranges() -> list[tuple[int, int]]:
    """(address, size) of Ray's object store mappings in this process."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "plasma" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi - lo))
    return ranges
