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
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from shmpipe import _tree
from shmpipe.errors import ShmpipeError, ShmpipeValueError, WorkerDiedError, WorkerError
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

#: How long producers may take to be placed and started before the pipeline
#: gives up (a cluster without room for them would otherwise wait forever).
START_TIMEOUT_S = 120.0


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
        self.actor_options = dict(actor_options or {"num_cpus": 1})
        self.object_store_memory = object_store_memory
        self.init_options = dict(init_options or {})

    def open(self, spec: ChannelSpec) -> ConsumerEnd:
        raise ShmpipeValueError("the ray transport runs its own producers: use launch()")

    def launch(
        self, sources: Sequence[Callable[[], Iterable[Any]]], spec: ChannelSpec, seed: int
    ) -> RayLauncher:
        return RayLauncher(self, sources, spec)


class _Producer:
    """One producer: runs its source once per pass as a streaming generator."""

    def __init__(self, worker: int, num_workers: int, source: Callable) -> None:
        self.worker = worker
        self.num_workers = num_workers
        self.source = source
        self.cancelled_below = 0  # passes below this number stop at their next batch

    def pid(self) -> int:
        return os.getpid()

    def cancel(self, below: int) -> None:
        self.cancelled_below = max(self.cancelled_below, below)

    def run_pass(self, work: PassWork) -> Iterator[Any]:
        pass_no = work.pass_no
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


# A Ray actor class (a class decorator would hide what it makes from type checkers).
_ProducerActor = ray.remote(_Producer)


class RayLauncher(Launcher):
    def __init__(self, transport: RayTransport, sources: Sequence, spec: ChannelSpec) -> None:
        self.transport = transport
        self.spec = spec
        self.started_ray = False
        self.actors: list = []
        self.gens: list = []
        self._down = False
        if not ray.is_initialized():
            self._start_ray(spec)
        self.prefix = f"shmpipe-{secrets.token_hex(6)}"
        self.backpressure = spec.quota if spec.ordered else max(1, spec.capacity // spec.num_workers)
        try:
            self.actors = [
                _ProducerActor.options(
                    name=f"{self.prefix}-{w}", max_concurrency=2, **transport.actor_options
                ).remote(w, spec.num_workers, source)
                for w, source in enumerate(sources)
            ]
            refs = [a.pid.remote() for a in self.actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT_S)
            if len(ready) < len(refs):
                raise ShmpipeValueError(
                    f"Ray could not start {len(refs) - len(ready)} of {len(refs)} producer actors "
                    f"within {START_TIMEOUT_S:g} s; does the cluster have room for "
                    f"{transport.actor_options} each?"
                )
            try:
                self._pids = ray.get(refs)
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
        self.started_ray = True

    @property
    def pids(self) -> list[int | None]:
        return list(self._pids)

    def open_channel(self, wait: float) -> ConsumerEnd:
        return self.consumer

    def begin_pass(self, pass_no: int, work: Sequence[PassWork]) -> None:
        if self.gens:
            # Stop the old pass: its generators stop at their next batch, and
            # dropping them releases their backpressure.
            for a in self.actors:
                a.cancel.remote(pass_no)
        self.gens = [
            a.run_pass.options(
                num_returns="streaming", _generator_backpressure_num_objects=self.backpressure
            ).remote(w)
            for a, w in zip(self.actors, work, strict=True)
        ]
        self.consumer.begin_pass(pass_no)

    def first_failure(self) -> BaseException | None:
        return None  # errors and deaths come out of the generators, in stream order

    def halt(self) -> None:
        for a in self.actors:
            a.cancel.remote(1 << 62)

    def shutdown(self) -> None:
        if self._down:
            return
        self._down = True
        self.gens = []
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self.started_ray and ray.is_initialized():
            ray.shutdown()

    def leftovers(self) -> list[str]:
        if not ray.is_initialized():
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
    def __init__(self, launcher: RayLauncher) -> None:
        self.launcher = launcher
        self.ended: set[int] = set()
        self.pass_no: int | None = None

    def begin_pass(self, pass_no: int) -> None:
        if pass_no != self.pass_no:
            self.pass_no = pass_no
            self.ended = set()

    def get(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        gens = self.launcher.gens
        if worker >= 0:
            g = gens[worker]
            ready, _ = ray.wait([g], num_returns=1, timeout=wait)
            if not ready:
                return AGAIN
            try:
                ref = next(g)
            except StopIteration:
                return END
            return self._fetch(ref, worker)
        while True:
            active = [g for w, g in enumerate(gens) if w not in self.ended]
            if not active:
                return END
            ready, _ = ray.wait(active, num_returns=1, timeout=wait)
            if not ready:
                return AGAIN
            w = next(i for i, g in enumerate(gens) if g is ready[0])
            try:
                ref = next(ready[0])
            except StopIteration:
                self.ended.add(w)
                continue
            return self._fetch(ref, w)

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
        except ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(worker, pid, None, reason=f"its Ray actor died ({type(exc).__name__})") from exc
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
