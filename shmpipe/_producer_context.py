"""What a source sees from inside a producer: ``get_worker_info()`` and
``reserve()``, and how whoever runs the source sets them up for a pass.

shmpipe's own producer processes (_worker.py) and transports that run their
producers themselves (Ray actors) both call :func:`enter_pass` before they
run a source for a pass, so a source sees the same thing wherever it runs.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shmpipe._spec import new_arrays
from shmpipe.errors import ShmpipeWarning

__all__ = [
    "PassWork",
    "WorkerInfo",
    "batch_seed",
    "current_work",
    "enter_pass",
    "get_worker_info",
    "reserve",
    "reserving_elsewhere",
    "reserving_into",
    "seed_for",
    "seed_generators",
    "set_reserver",
    "generators_kept",
]


@dataclass(frozen=True)
class WorkerInfo:
    """Who this producer is, as seen from inside a source.

    ``id`` is 0..num_workers-1; ``seed`` is this worker's seed for this pass,
    derived from the pipeline's base seed, the pass (``epoch``) and the id,
    so runs with the same base seed see the same seeds. NumPy's and
    ``random``'s global generators are seeded from it before the source is
    called; from_dataset seeds them again before each batch, from the
    batch's own seed (batch_seed), so that a batch's random draws do not
    depend on which worker fetches it.
    """

    id: int
    num_workers: int
    seed: int
    epoch: int


@dataclass(frozen=True)
class PassWork:
    """What one producer is to do in one pass: sent by the consumer (which
    producers trust) with each pass, and seen by the source that runs it.

    ``pass_no`` is the channel's pass (it counts every pass begun, resumed
    ones included); ``epoch`` is the user's (a resumed run goes on at the
    epoch its state names), and ``seed`` derives from it. ``skip``: this
    worker's first ``skip`` batches of the epoch were delivered before a
    resume, or published by the producer this one replaces; a source of
    iterators makes them again and publishes none (resume by count).
    ``plan``: what a source with a plan does this pass (a dataset's source:
    the indices of each of its batches), or None.
    """

    pass_no: int
    epoch: int
    seed: int
    skip: int = 0
    plan: Any = None
    #: The number of this worker's first batch published this pass: 0, or in
    #: a producer that replaces a dead one, the batch after the last one its
    #: predecessor published (see ProducerEnd.start_pass).
    first_wseq: int = 0


class Reserver(Protocol):
    """Whatever hands out writable arrays in a producer (its channel's end)."""

    def reserve(self, template: Any) -> Any: ...


_info: WorkerInfo | None = None
_work: PassWork | None = None
_reserver: Reserver | None = None


def get_worker_info() -> WorkerInfo | None:
    """This producer's WorkerInfo; None outside a shmpipe producer."""
    return _info


def reserve(template: Any) -> Any:
    """Writable arrays for the next batch, inside a free slot.

    ``template`` has the nesting of a batch; each leaf is an ArraySpec or an
    array (which stands for its shape and dtype; its values are not
    copied) or a scalar (kept as it is). The arrays returned are
    uninitialised, like ``numpy.empty``. Fill them, then yield the structure
    reserve() returned: the batch is published without a copy. Yielding
    anything else copies the arrays out and gives the slot back.

    Once yielded, the batch is the consumer's: the arrays become read-only.
    A NumPy view of them you keep past the yield is made read-only too, at
    the level of memory: a write through it kills the producer (SIGSEGV,
    reported as its death) rather than change a batch the consumer holds.
    (That guard costs system calls only while such a view lives; a buffer
    taken from the arrays by other means, ``memoryview(arr)`` or
    ``torch.from_numpy(arr)``, is not seen: do not write through one after
    the yield.)

    Blocks while every slot is busy. Outside a producer, or with a transport
    that has no slots, it returns ordinary new arrays, and yielding them
    sends them as any batch.
    """
    if _reserver is None:
        return new_arrays(template)
    return _reserver.reserve(template)


def set_reserver(reserver: Reserver | None) -> None:
    """What reserve() asks in this process (a producer sets itself)."""
    global _reserver
    _reserver = reserver


@contextlib.contextmanager
def reserving_into(reserver: Reserver) -> Iterator[None]:
    """While in the block, reserve() asks `reserver` (the trainer making a
    fresh pipeline's first batches: shmpipe/_first_batches.py)."""
    global _reserver
    saved, _reserver = _reserver, reserver
    try:
        yield
    finally:
        _reserver = saved


@contextlib.contextmanager
def reserving_elsewhere() -> Iterator[None]:
    """While in the block, reserve() hands out ordinary new arrays, not slot
    memory: for batches a producer makes but does not publish (a resume by
    count makes the batches delivered before it again, to throw them away)."""
    global _reserver
    saved, _reserver = _reserver, None
    try:
        yield
    finally:
        _reserver = saved


def current_work() -> PassWork | None:
    """The PassWork of the pass this producer runs; None outside one."""
    return _work


def seed_for(base_seed: int, pass_no: int, worker: int, node: int = 0) -> int:
    """A 63-bit seed for one worker in one pass, reproducible from base_seed;
    `node`: the node of a job of several (node 0's seeds are a single
    node's)."""
    key = (pass_no, worker) if node == 0 else (pass_no, worker, node)
    state = np.random.SeedSequence(base_seed, spawn_key=key).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def enter_pass(worker: int, num_workers: int, work: PassWork) -> None:
    """Before a source runs for a pass: what get_worker_info() and
    current_work() return from now on, and the global generators (random,
    NumPy's, and torch's where it is imported) seeded with the work's seed."""
    global _info, _work
    seed = work.seed
    _info = WorkerInfo(worker, num_workers, seed, work.epoch)
    _work = work
    seed_generators(seed)


def batch_seed(base_seed: int, epoch: int, batch: int) -> int:
    """A 63-bit seed for batch `batch` of epoch `epoch` of a map-style
    dataset (from_dataset), reproducible from base_seed alone: the same
    whichever worker, node or process fetches the batch. (Its spawn key is
    four long, so it never equals a worker's, seed_for's, of two or three.)"""
    key = (epoch, batch, 0, 1)
    state = np.random.SeedSequence(base_seed, spawn_key=key).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


#: The last word of NumPy's seed key (seed_generators): any constant that
#: makes its stream differ from random's.
_NUMPY_KEY = 0x6E756D70


def seed_generators(seed: int) -> bool:
    """Seeds the global generators a source may draw from: ``random``,
    NumPy's legacy one, and torch's CPU generator where torch is imported
    (torch.default_generator, not torch.manual_seed, which would seed every
    CUDA device's too: the trainer calls this, see generators_kept).
    Whether torch's was seeded."""
    # random's and NumPy's legacy generator are both MT19937, seeded by the
    # same init_by_array: the same words would make the same stream in both
    # (a dataset drawing from each would draw twice the same numbers), so
    # NumPy's key has a third word.
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, _NUMPY_KEY])
    torch = torch_imported()
    if torch is not None:
        torch.default_generator.manual_seed(seed)
    return torch is not None


def torch_imported() -> Any:
    """torch, where it is imported whole; else None. (A module another
    thread is still importing is in sys.modules already, without the
    functions seeding uses: helper 52 saw an AttributeError there.)"""
    torch = sys.modules.get("torch")
    if torch is None or not all(hasattr(torch, n) for n in ("default_generator", "get_rng_state", "set_rng_state")):
        return None
    return torch


_torch_came_unseeded_said = False


def torch_came_unseeded(epoch: int, batch: int, dataset: str) -> None:
    """torch was imported while batch `batch` of epoch `epoch` was made:
    seed_generators could not seed its generator before that batch, whose
    draws from it, if any, are then this process's first (they differ with
    the number of workers, and on a resume). Said once per process (each
    producer, the trainer); the batches after it are seeded."""
    global _torch_came_unseeded_said
    if _torch_came_unseeded_said:
        return
    _torch_came_unseeded_said = True
    warnings.warn(
        f"torch was imported while batch {batch} of epoch {epoch} was made (by {dataset}'s __getitem__ or the "
        "collate_fn, or by another thread): any draws from torch's generator in that batch were not seeded "
        "(shmpipe seeds it before each batch where torch is imported), so they change with the number of "
        "workers and on a resume; import torch at the top of the dataset's module",
        ShmpipeWarning,
        stacklevel=3,
    )


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """The global generators (those seed_generators seeds) as they were
    before the block, whatever it drew or seeded: a batch the trainer
    fetches itself draws from its own seed and leaves the user's
    generators alone. (torch imported inside the block, or still being
    imported by another thread as it began, is not restored: there was no
    state of it to keep, and once whole it may be seeded in the block.)"""
    torch = torch_imported()
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state() if torch is not None else None)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        if torch is not None:
            torch.set_rng_state(saved[2])
