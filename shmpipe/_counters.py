"""The counters a pipeline's consumer keeps as it delivers (Counters), the
wait histogram among them, and the layout of their one tally, which is this
module's alone. What a user reads of them is _stats.PipelineStats, made by
Counters.snapshot (and that module imported only then: its records are
dataclasses, a few milliseconds of a fresh process's first batch)."""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmpipe._stats import PipelineStats

__all__ = ["Counters", "WaitHistogram"]

#: The layout of Counters.tally, one int64 array: these totals, then one
#: count per worker, then the wait histogram's buckets (WaitHistogram).
#: Only this module reads or writes it (and the one compiled step it hands
#: every index to: _tally.ReadyCounter, the fast path's count).
BATCHES, BYTES, FIRST_BATCH_NS, WAIT_COUNT, WAIT_TOTAL_NS, WAIT_MAX_NS = range(6)
TOTALS = 6
#: Histogram resolution: buckets per power of two.
SUB = 32
#: Buckets: one row of SUB per bit length of a duration in ns (1 to 64).
BUCKETS = 65 * SUB


def bucket(ns: int) -> int:
    """The histogram bucket of a duration of `ns` >= 1 nanoseconds: with
    e = ns.bit_length() (ns = m * 2**e, 0.5 <= m < 1), row e, and the
    column that m falls in among SUB equal parts of [0.5, 1). Integer
    arithmetic only, so the C fast path computes the same bucket."""
    e = ns.bit_length()
    return e * SUB + ((ns * 2 * SUB) >> e) - SUB


class WaitHistogram:
    """Log-linear histogram of durations in nanoseconds, over a slice of
    a Counters tally.

    32 buckets per power of two, so a quantile is within 1.6% of the true
    value, in constant memory however many batches pass (a list of every
    wait would grow without bound in a long training run).
    """

    __slots__ = ("tally", "first")

    def __init__(self, tally: array[int], first: int) -> None:
        self.tally = tally
        self.first = first  # index of bucket 0 in tally

    @property
    def count(self) -> int:
        return self.tally[WAIT_COUNT]

    @property
    def total_ns(self) -> int:
        return self.tally[WAIT_TOTAL_NS]

    @property
    def max_ns(self) -> int:
        return self.tally[WAIT_MAX_NS]

    def add(self, ns: int) -> None:
        if ns < 1:
            ns = 1
        t = self.tally
        t[self.first + bucket(ns)] += 1
        t[WAIT_COUNT] += 1
        t[WAIT_TOTAL_NS] += ns
        if ns > t[WAIT_MAX_NS]:
            t[WAIT_MAX_NS] = ns

    def quantile(self, q: float) -> float:
        """The q-quantile (0 <= q <= 1) in nanoseconds; 0.0 when empty."""
        count = self.count
        if count == 0:
            return 0.0
        rank = max(1, math.ceil(q * count))
        seen = 0
        t, first = self.tally, self.first
        for i in range(BUCKETS):
            seen += t[first + i]
            if seen >= rank:
                e, sub = divmod(i, SUB)
                mid = 0.5 + (sub + 0.5) / (2 * SUB)  # middle of the bucket
                return min(math.ldexp(mid, e), float(self.max_ns))
        return float(self.max_ns)


class Counters:
    """What the consumer counts as it delivers, and the arithmetic that
    turns it into PipelineStats. One thread updates it at a time (the one
    iterating); a snapshot may be read from any thread.

    The per-batch counts live in `tally`, one int64 array (layout above):
    a few item updates per batch, which the consumer's fast path
    (`delivered_ready`) keeps to. The fast path never takes a pass's first
    batch, so `delivered` still sees every pass begin.

    The wall time counts the pass in progress too, up to the moment of the
    snapshot: a training loop over endless sources never finishes a pass,
    and its stats must still say how much of its time it waited."""

    __slots__ = (
        "created_ns",
        "current_started_ns",
        "delivered_ready",
        "made_here",
        "num_workers",
        "passes",
        "restarts",
        "tally",
        "waits",
        "wall_ns",
    )

    def __init__(self, num_workers: int) -> None:
        self.created_ns = time.perf_counter_ns()
        self.num_workers = num_workers
        self.tally = array("q", bytes(8 * (TOTALS + num_workers + BUCKETS)))
        self.tally[FIRST_BATCH_NS] = -1  # none yet
        self.waits = WaitHistogram(self.tally, TOTALS + num_workers)
        self.restarts = [0] * num_workers  # per worker: producers replaced
        self.made_here = 0  # batches the consumer made itself (worker -1)
        #: delivered_ready(wait_ns, nbytes, worker): a batch that was ready
        #: when asked for (the fast path: never a pass's first, so the
        #: pass's clock and the first batch's time are already set), after
        #: `wait_ns` of taking it. Compiled (_tally.pyx says why), with
        #: this module's layout.
        # (Imported here: `import shmpipe` loads no compiled module. A
        # Ctrl-C is held back over it: Cython's init of the module calls
        # Python code, ABCMeta.register, inside a bare `except: pass`,
        # which swallowed a press landing there: 1 in 600 presses during a
        # start, helper 33.)
        from shmpipe._interrupts import ctrl_c_held_back

        with ctrl_c_held_back():
            from shmpipe._tally import ReadyCounter

        self.delivered_ready: Callable[[int, int, int], None] = ReadyCounter(
            self.tally,
            BATCHES,
            BYTES,
            TOTALS,
            num_workers,
            TOTALS + num_workers,
            BUCKETS,
            SUB,
            WAIT_COUNT,
            WAIT_TOTAL_NS,
            WAIT_MAX_NS,
        ).count
        self.wall_ns = 0  # of passes that ended
        # when the pass in progress first asked for a batch (None: no pass
        # in progress, or it has not asked yet)
        self.current_started_ns: int | None = None
        self.passes = 0

    @property
    def batches(self) -> int:
        return self.tally[BATCHES]

    @property
    def bytes(self) -> int:
        return self.tally[BYTES]

    @property
    def first_batch_ns(self) -> int | None:
        ns = self.tally[FIRST_BATCH_NS]
        return None if ns < 0 else ns

    @property
    def per_worker(self) -> list[int]:
        return self.tally[TOTALS : TOTALS + self.num_workers].tolist()

    def pass_started(self) -> None:
        # A pass left unfinished (the loop broke out, then iterated again)
        # counts up to now: its last training step was time spent iterating.
        self._end_current(time.perf_counter_ns())
        self.passes += 1

    def pass_finished(self, started_ns: int) -> None:
        now = time.perf_counter_ns()
        if self.current_started_ns is None:  # a pass that ended at its first request
            self.current_started_ns = started_ns
        self._end_current(now)

    def _end_current(self, now_ns: int) -> None:
        started = self.current_started_ns
        if started is not None:
            self.wall_ns += now_ns - started
            self.current_started_ns = None

    def wall_now_ns(self) -> int:
        """Time spent iterating: the ended passes, plus the one in progress
        up to now. Read from any thread: `current_started_ns` is read once
        (one attribute load, atomic under the GIL), so the sum is at worst
        a moment stale, never torn."""
        started = self.current_started_ns
        return self.wall_ns + (time.perf_counter_ns() - started if started is not None else 0)

    def delivered(self, asked_ns: int, got_ns: int, nbytes: int, worker: int) -> None:
        """A batch asked for at `asked_ns` came at `got_ns`, from `worker`
        (-1: made by the consumer itself)."""
        if self.current_started_ns is None:
            self.current_started_ns = asked_ns  # the pass's first request
        self.waits.add(got_ns - asked_ns)
        t = self.tally
        t[BATCHES] += 1
        t[BYTES] += nbytes
        if worker >= 0:
            t[TOTALS + worker] += 1
        else:  # made by the consumer itself (shmpipe/_first_batches.py)
            self.made_here += 1
        if t[FIRST_BATCH_NS] < 0:
            t[FIRST_BATCH_NS] = got_ns

    def snapshot(
        self,
        *,
        producer_blocked_s: Sequence[float | None],
        transport: str,
        capacity: int,
        slot_size: int | None,
        extra: dict[str, Any] | None = None,
    ) -> PipelineStats:
        w = self.waits
        n = w.count
        first = None if self.first_batch_ns is None else (self.first_batch_ns - self.created_ns) / 1e9
        wall = self.wall_now_ns() / 1e9
        from shmpipe._stats import PipelineStats

        return PipelineStats(
            batches=self.batches,
            bytes=self.bytes,
            per_worker_batches=tuple(self.per_worker),
            wait_total_s=w.total_ns / 1e9,
            wait_mean_s=(w.total_ns / n / 1e9) if n else 0.0,
            wait_p50_s=w.quantile(0.5) / 1e9,
            wait_p99_s=w.quantile(0.99) / 1e9,
            wait_max_s=w.max_ns / 1e9,
            time_to_first_batch_s=first,
            producer_blocked_s=tuple(producer_blocked_s),
            wall_s=wall,
            stall_fraction=(w.total_ns / 1e9 / wall) if wall > 0 else 0.0,
            passes=self.passes,
            transport=transport,
            num_workers=len(self.per_worker),
            capacity=capacity,
            slot_size=slot_size,
            extra=dict(extra) if extra else {},
            restarts=tuple(self.restarts),
        )
