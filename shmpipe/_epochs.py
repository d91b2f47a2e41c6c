"""An epoch's batches once drawn: drawn once a pipeline, named by a digest,
and cut into the parts the workers fetch.

A dataset's schedule (shmpipe/_schedule.py) draws each epoch's batches of
indices from its sampler or its shuffle. What is drawn is kept here, for
two reasons. A sampler with a generator of its own (torch's
``RandomSampler(generator=g)``) gives another order at each draw: drawn
again for a load or for a second reader of the same schedule
(a group's rank 0 keeps the rank's position beside the leader's pipeline),
a state would name an order that was never dealt, or the next epochs would
come in another order than in a run that took no state. And the digest
that names an epoch in a state (hashing a million samples' order takes
10-20 ms) is worked out where a state first asks, not before a pass's
first batch.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from shmpipe.errors import ShmpipeTypeError, ShmpipeValueError

__all__ = ["Drawn", "EpochDraws", "digest", "indices_of", "read_whole", "subplan"]

#: An epoch's batches: (indices, bounds), batch b being indices[bounds[b]:bounds[b + 1]].
Plan = tuple[np.ndarray, np.ndarray]


#: An epoch is read whole from its sampler, before its first batch (its
#: order fixes which batch is which). It may hold at most this many indices
#: per sample of the dataset (and at least _MOST_INDICES_FLOOR), or what
#: the sampler's len() says where that is more: past it, the sampler is one
#: that never ends (detectron2's TrainingSampler), whose reading would fill
#: memory. (A len() is not trusted to be exact: some are approximate, or
#: stale until the sampler is iterated.)
_MOST_INDICES_PER_SAMPLE = 16
_MOST_INDICES_FLOOR = 1 << 22


def read_whole(sampler: Iterable[Any], what: str, length: int, batches: bool = False) -> list[Any]:
    """One epoch of `sampler` (its indices, or with `batches` a batch
    sampler's batches, counted by their indices), as a list; a clear error
    where it gives more indices than an epoch may hold."""
    declared = declared_len(sampler)
    most = max(_MOST_INDICES_PER_SAMPLE * length, _MOST_INDICES_FLOOR)
    if declared is not None and not batches:
        most = max(most, declared)
    got: list[Any] = []
    count = 0
    for item in sampler:
        got.append(item)
        count += (declared_len(item) or 1) if batches else 1
        if count > most:
            said = "" if declared is None else f", where its len() says {declared}"
            raise ShmpipeValueError(
                f"the {what} gave more than {most} indices for one epoch of a dataset of {length} samples"
                f"{said}: shmpipe reads each epoch whole before its first batch, so an endless {what} "
                "cannot be used; give one epoch's (and set_epoch for the next), as torch's samplers do"
            )
    return got


def declared_len(obj: Any) -> int | None:
    """len(obj), or None where it has none usable."""
    try:
        return int(len(obj))
    except (TypeError, ValueError, OverflowError, NotImplementedError):  # (an endless sampler has none)
        return None


def indices_of(values: Any, what: str) -> np.ndarray:
    """`values` (a sampler's epoch, or one batch of a batch sampler's) as
    int64 indices; a clear error for anything that is not a sequence of
    ints (an index past int64 too: it is no dataset's)."""
    try:
        array = np.asarray(values)
    except Exception as exc:  # noqa: BLE001 - any failure means "not indices"
        raise ShmpipeTypeError(f"the {what} is not a sequence of ints: {exc}") from None
    if array.ndim == 1 and array.size and array.dtype.kind in "Of":
        # Ints that NumPy could not hold as one integer type (one past
        # uint64, or past int64 beside a negative one) came as objects or
        # floats: name the index, not the type.
        outside = _int_outside_int64(values)
        if outside is not None:
            raise ShmpipeValueError(f"the {what} gave index {outside}, outside any dataset")
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ShmpipeTypeError(f"the {what} must be a sequence of ints, got {array.dtype} of shape {array.shape}")
    if array.size and array.dtype.kind == "u" and array.max() > np.iinfo(np.int64).max:
        raise ShmpipeValueError(f"the {what} gave index {int(array.max())}, outside any dataset")
    return array.astype(np.int64, copy=False)


class Drawn:
    """One epoch's batches as drawn, and their digest once asked for."""

    __slots__ = ("_digest", "plan")

    def __init__(self, plan: Plan, digest_: str | None = None) -> None:
        self.plan = plan
        self._digest = digest_

    @property
    def digest(self) -> str:
        # (two threads may both work it out: the same text, either kept)
        if self._digest is None:
            self._digest = digest(*self.plan)
        return self._digest


class EpochDraws:
    """The epochs drawn for a schedule (and the schedules that share them):
    asked again for the same key, the same draw. The key is the epoch and,
    for a shuffle, its seed (a state's may replace the pipeline's; a
    sampler's order does not depend on it). A draw is kept until every
    schedule sharing it has begun a later epoch: rank 0's count may begin
    epochs ahead (its trainer leaving passes early) while the leader's
    pipeline waits for a slower rank (helpers 52 and 54). A lock: rank 0's
    trainer thread and the leader's dispatch thread both draw."""

    __slots__ = ("_begun", "_kept", "_lock")

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int | None], Drawn] = {}
        #: per schedule sharing the draws (by id): the last epoch it began
        self._begun: dict[int, int] = {}
        self._lock = threading.Lock()

    def share(self, schedule: object) -> None:
        """`schedule` draws from these too: nothing it may ask for is dropped
        before it begins a later epoch."""
        with self._lock:
            self._begun[id(schedule)] = -1

    def get(self, key: tuple[int, int | None], draw: Callable[[], Plan]) -> Drawn:
        with self._lock:
            drawn = self._kept.get(key)
            if drawn is None:
                drawn = self._kept[key] = Drawn(draw())
            return drawn

    def began(self, schedule: object, epoch: int) -> None:
        """`schedule` began `epoch`: the draws of the epochs before the
        oldest one a sharing schedule is in are dropped."""
        with self._lock:
            self._begun[id(schedule)] = epoch
            oldest = min(self._begun.values())
            for key in [key for key in self._kept if key[0] < oldest]:
                del self._kept[key]


def digest(indices: np.ndarray, bounds: np.ndarray) -> str:
    """Names an epoch's batches: a state from another order is refused."""
    h = hashlib.blake2b(digest_size=8)
    # The arrays' own buffers (tobytes() would copy them first): the same bytes.
    h.update(np.ascontiguousarray(indices, "<i8").data)
    h.update(np.ascontiguousarray(bounds, "<i8").data)
    return h.hexdigest()


def subplan(indices: np.ndarray, bounds: np.ndarray, batches: np.ndarray) -> Plan:
    """The plan of some of an epoch's batches, in the order given: their
    indices back to back, and their bounds within that."""
    starts, ends = bounds[batches], bounds[batches + 1]
    lengths = ends - starts
    sub_bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # position j of batch k is starts[k] + (j - sub_bounds[k])
    offsets = np.repeat(starts - sub_bounds[:-1], lengths)
    return indices[np.arange(int(sub_bounds[-1]), dtype=np.int64) + offsets], sub_bounds


def _int_outside_int64(values: Any) -> int | None:
    """The first of `values` outside int64 where every one is an int (not
    a bool); None otherwise."""
    lo, hi = -(1 << 63), (1 << 63) - 1
    outside = None
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            return None
        if outside is None and not lo <= int(v) <= hi:
            outside = int(v)
    return outside
