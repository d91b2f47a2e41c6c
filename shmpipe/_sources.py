"""The sources a pipeline ships to its producers, and what they do there.

Every producer runs a *source*: a picklable zero-argument callable that
returns the batches of one pass. The user's own callables (from_iterators)
travel wrapped in an :class:`IteratorSource`, and a map-style dataset
(from_dataset) travels as a :class:`DatasetSource`. Both read the pass's
:class:`~shmpipe._producer_context.PassWork` (the consumer's instructions:
the epoch, the seed, how many batches to skip, the plan), so a producer --
shmpipe's own, or one a transport runs itself -- does nothing but call its
source, and resuming needs nothing of the transport.

This module runs in producers. What decides the work (the sampler, the
position, the checkpoint state) runs in the consumer: shmpipe/_schedule.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from shmpipe._producer_context import (
    PassWork,
    batch_seed,
    current_work,
    reserve,
    reserving_elsewhere,
    seed_generators,
    torch_came_unseeded,
    torch_imported,
)
from shmpipe._spec import ArraySpec
from shmpipe.errors import ShmpipeTypeError

__all__ = ["DatasetPlan", "DatasetSource", "IteratorSource", "collate_into_ring"]


def _work() -> PassWork:
    work = current_work()
    if work is None:  # called outside a producer's pass (a user calling it directly)
        return PassWork(pass_no=0, epoch=0, seed=0)
    return work


class IteratorSource:
    """A user's source (from_iterators), as its producer runs it.

    A resumed pass whose iterator has its own ``state_dict()`` and
    ``load_state_dict()`` is given the state of the last batch delivered
    (the plan ``{"iterator_state": ...}``). Otherwise it skips the worker's
    batches delivered before the resume: they are made again (the source
    cannot be told to start elsewhere) but not published, and the memory they reserve is ordinary memory, not slot
    memory (reserving_elsewhere), so no slot is taken for them. Resume by
    count therefore costs the making of those batches; docs/long-runs.md
    says so.
    """

    __slots__ = ("source",)

    def __init__(self, source: Callable[[], Iterable[Any]]) -> None:
        self.source = source

    def __call__(self) -> Iterator[Any]:
        work = _work()
        skip = work.skip
        iterator = iter(self.source())
        if isinstance(work.plan, dict) and "iterator_state" in work.plan:
            # A resume from the iterator's own state (it has state_dict and
            # load_state_dict): it goes on from there, nothing is made again.
            load = getattr(iterator, "load_state_dict", None)
            if not callable(load):
                raise ShmpipeTypeError(
                    "the state to resume from holds this source's iterator's state_dict(), but its iterator "
                    f"({type(iterator).__name__}) has no load_state_dict()"
                )
            load(work.plan["iterator_state"])
        if skip:
            # A generator runs its code in next(), so the batches skipped here
            # reserve outside the ring; the first batch kept is made after.
            with reserving_elsewhere():
                for _ in itertools.islice(iterator, skip):
                    pass
        return iterator

    def __repr__(self) -> str:
        return repr(self.source)


class DatasetPlan:
    """One producer's batches of one pass of a map-style dataset, chosen by
    the consumer (shmpipe/_schedule.py): batch j is the samples
    ``indices[bounds[j]:bounds[j + 1]]``, and it is batch ``numbers[j]`` of
    the epoch, whose random draws come from ``batch_seed(seed, epoch,
    numbers[j])``. Made once per producer and pass, read only after.

    (A plain class, not a frozen dataclass, which a fresh process takes
    1.4 ms to define: docs/design.md, "A fresh pipeline's first batches".
    Nor a NamedTuple: its len() is its batches'.)"""

    __slots__ = ("bounds", "epoch", "indices", "numbers", "seed")

    def __init__(self, indices: np.ndarray, bounds: np.ndarray, numbers: np.ndarray, seed: int, epoch: int) -> None:
        self.indices = indices
        self.bounds = bounds
        self.numbers = numbers
        self.seed = seed
        self.epoch = epoch

    def __repr__(self) -> str:
        return f"DatasetPlan({len(self)} batches of epoch {self.epoch})"

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def samples(self, j: int) -> list[int]:
        return self.indices[self.bounds[j] : self.bounds[j + 1]].tolist()

    def seed_of(self, j: int) -> int:
        return batch_seed(self.seed, self.epoch, int(self.numbers[j]))


class DatasetSource:
    """A map-style dataset's producer side (from_dataset): for each batch
    of its plan (the consumer chose the indices), seed the global
    generators from the batch's own seed, fetch the samples and collate
    them, by default straight into slot memory (collate_into_ring). The
    trainer makes a fresh pipeline's first batches the same way (batch(),
    shmpipe/_first_batches.py)."""

    __slots__ = ("collate_fn", "dataset")

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self) -> Iterator[Any]:
        plan = _work().plan
        if plan is None:
            return iter(())
        return (self.batch(plan, j) for j in range(len(plan)))

    def batch(self, plan: DatasetPlan, j: int) -> Any:
        """Batch j of `plan`: its samples fetched and collated, after the
        global generators were seeded with its seed (so a dataset's random
        augmentations are the same wherever the batch is made: on any
        worker, after a resume or a restart, in the trainer)."""
        torch_seeded = seed_generators(plan.seed_of(j))
        dataset = self.dataset
        samples = [dataset[i] for i in plan.samples(j)]
        batch = self.collate_fn(samples) if self.collate_fn is not None else collate_into_ring(samples)
        if not torch_seeded and torch_imported() is not None:
            torch_came_unseeded(plan.epoch, int(plan.numbers[j]), type(dataset).__qualname__)
        return batch


# -- the default collate --------------------------------------------------------
#
# torch's default_collate stacks samples into new tensors, and the loader then
# copies them again into pinned memory or a queue. Here the stacked arrays
# are the batch: one reserve() for the whole nesting, and each sample is
# copied once, into its row of slot memory.

_SCALARS = (bool, int, float, complex, np.generic)


def collate_into_ring(samples: list[Any]) -> Any:
    """The samples of one batch as one batch: arrays (and numbers) of equal
    shape stacked along a new first axis, in slot memory where the producer
    has a ring; dicts, tuples and lists kept (collated key by key, place by
    place); strings, bytes and None gathered into a list. Array-likes (a
    torch CPU tensor, anything with ``__array__``) count as arrays."""
    if not samples:
        raise ShmpipeTypeError("a batch needs at least one sample")
    template = _template(samples, "sample")
    out = reserve(template)
    _fill(out, samples)
    return out


def _template(samples: list[Any], where: str) -> Any:
    """The reserve() template of these samples, their structure checked:
    an ArraySpec for each stacked leaf, the gathered lists as they are (so
    the structure reserve() returns is the batch, and is published as it
    is)."""
    first = samples[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping) or list(s) != keys:
                raise ShmpipeTypeError(
                    f"{where} {i} has keys {_keys(s)}, sample 0 has {keys}: the default collate needs "
                    "samples of one structure (pass collate_fn= for others)"
                )
        return {k: _template([s[k] for s in samples], f"{where}[{k!r}]") for k in keys}
    if isinstance(first, (tuple, list)):
        for i, s in enumerate(samples):
            if type(s) is not type(first) or len(s) != len(first):
                raise ShmpipeTypeError(
                    f"{where} {i} is a {type(s).__name__} of {_len(s)}, sample 0 a {type(first).__name__} of "
                    f"{len(first)}: the default collate needs samples of one structure (pass collate_fn= for others)"
                )
        return type(first)(_template([s[j] for s in samples], f"{where}[{j}]") for j in range(len(first)))
    if isinstance(first, (str, bytes)) or first is None:
        for i, s in enumerate(samples):
            if not (isinstance(s, (str, bytes)) or s is None):
                raise ShmpipeTypeError(f"{where} {i} is a {type(s).__name__}, sample 0 a {type(first).__name__}")
        return list(samples)  # gathered, not stacked
    array = _as_array(first, where)
    for i, s in enumerate(samples):
        a = _as_array(s, where)
        if a.shape != array.shape:
            raise ShmpipeTypeError(
                f"{where} {i} has shape {a.shape}, sample 0 has {array.shape}: the default collate stacks "
                "arrays of one shape (pad them in the dataset, or pass collate_fn=)"
            )
        if not np.can_cast(a.dtype, array.dtype, "same_kind"):
            raise ShmpipeTypeError(f"{where} {i} has dtype {a.dtype}, sample 0 has {array.dtype}")
    return ArraySpec((len(samples), *array.shape), array.dtype)


def _fill(out: Any, samples: list[Any]) -> None:
    """Copies each sample into its row of `out` (what reserve() made of
    _template's result, whose checks the samples passed)."""
    first = samples[0]
    if isinstance(out, np.ndarray):
        for i, s in enumerate(samples):
            out[i] = s
    elif isinstance(first, Mapping):
        for k, v in out.items():
            _fill(v, [s[k] for s in samples])
    elif isinstance(first, (tuple, list)):
        for j, v in enumerate(out):
            _fill(v, [s[j] for s in samples])
    # else: strings, bytes or None, gathered into the template already


def _as_array(value: Any, where: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, _SCALARS) or hasattr(value, "__array__"):
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise ShmpipeTypeError(f"{where} is an array of Python objects; the default collate stacks numbers")
        return array
    raise ShmpipeTypeError(
        f"{where} is a {type(value).__name__}; the default collate stacks arrays and numbers, keeps dicts, "
        "tuples and lists, and gathers strings (pass collate_fn= for others)"
    )


def _keys(value: Any) -> Any:
    return list(value) if isinstance(value, Mapping) else type(value).__name__


def _len(value: Any) -> Any:
    try:
        return len(value)
    except TypeError:
        return "no length"
