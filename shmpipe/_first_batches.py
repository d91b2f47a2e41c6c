"""A fresh from_dataset pipeline's first batches, made by the trainer while
its producers start.

A pipeline's producers start from shmpipe's fork server, and in a fresh
process that server is not running yet: it boots an interpreter and imports
the dataset's modules first (0.15-0.2 s on a 2-core machine, measured),
where torch's DataLoader forks its workers in milliseconds. So the launcher
starts the producers in a thread (ProcessLauncher.starting), and a pass of
a map-style dataset begun meanwhile is not given to them yet: the trainer
fetches and collates the first batches of the pass itself, one per
``next()``, as a DataLoader with ``num_workers=0`` would, until the
producers are up. Then the rest of the pass is dealt to them (hand-over),
round-robin from worker 0, so the batches and the order the trainer takes
them in are exactly those of a pipeline that never made one itself: the
schedule fixes which batch is which (DatasetSchedule.hand_over), and each
batch's random draws come from its own seed, whoever makes it
(DatasetSource.batch). The state counts the batches made here
(Progress.made_here); stats().extra["made_by_trainer"] says how many.

The hand-over leads by one batch: once the producers are up, they are
given the pass from the batch after the one the trainer makes then, so
they fetch while it does.

A batch made here is laid out by the codec as a producer's is in a slot
(the default collate writes each sample once, into a buffer of its own; a
collate_fn's batch is copied in once), and delivered as the same
read-only, 64-byte-aligned views of it, with the same nesting.

Not atomic with respect to the start: the trainer looks at ``starting``
before each batch, and a start that ends while it fetches one is seen at
the next ``next()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmpipe import _codec
from shmpipe._producer_context import generators_kept, reserving_into
from shmpipe._schedule import DatasetSchedule
from shmpipe._sources import DatasetSource

__all__ = ["FirstBatches"]


class FirstBatches:
    """The trainer's part of pass `pass_no`, begun while the producers were
    starting: the first `made` batches of the node's share, made here."""

    __slots__ = ("dealt_from", "made", "pass_no", "schedule", "source")

    def __init__(self, source: DatasetSource, schedule: DatasetSchedule, pass_no: int) -> None:
        self.source = source
        self.schedule = schedule
        self.pass_no = pass_no
        #: batches made here and delivered
        self.made = 0
        #: once handed over: the producers' part begins at this batch of the
        #: share, and the trainer owes those before it not made yet
        self.dealt_from: int | None = None

    @property
    def left(self) -> int:
        """Batches of the node's share that the trainer has not made."""
        return self.schedule.share - self.made

    def make(self) -> tuple[Any, int]:
        """The next batch of the share, made here: (batch, its bytes)."""
        plan = self.schedule.plan_of(self.made)
        # The user's generators are left as they were (the batch draws from
        # its own seed), and reserve() lays the batch out in memory of its
        # own, as it would in a slot (even where this process is itself a
        # producer of another pipeline).
        reserver = _PrivateReserver()
        with generators_kept(), reserving_into(reserver):
            batch = self.source.batch(plan, 0)
        if reserver.buf is not None and batch is reserver.reserved:
            buf = reserver.buf  # the default collate filled it: no copy
        else:  # a collate_fn's own batch: copied once, as a producer copies it into a slot
            buf = _codec.encode(batch)
        self.made += 1
        return _codec.decode(buf), buf.nbytes


class _PrivateReserver:
    """reserve() in the trainer: the batch laid out as in a slot (the
    codec's layout), in a new 64-byte-aligned buffer of its own."""

    __slots__ = ("buf", "reserved")

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.reserved: Any = None

    def reserve(self, template: Any) -> Any:
        self.buf = _codec.aligned_empty(_codec.template_size(template))
        self.reserved = _codec.reserve_into(template, self.buf)
        return self.reserved
