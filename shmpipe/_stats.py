"""What a pipeline measured: PipelineStats, and the wait histogram behind it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = ["PipelineStats", "WaitHistogram"]


class WaitHistogram:
    """Log-linear histogram of durations in nanoseconds.

    32 buckets per power of two, so a quantile is within 1.6% of the true
    value, in constant memory however many batches pass (a list of every
    wait would grow without bound in a long training run).
    """

    SUB = 32
    __slots__ = ("counts", "count", "total_ns", "max_ns")

    def __init__(self) -> None:
        self.counts = [0] * (64 * self.SUB)
        self.count = 0
        self.total_ns = 0
        self.max_ns = 0

    def add(self, ns: int) -> None:
        if ns < 1:
            ns = 1
        m, e = math.frexp(ns)  # ns = m * 2**e, 0.5 <= m < 1
        self.counts[e * self.SUB + int((m - 0.5) * 2 * self.SUB)] += 1
        self.count += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def quantile(self, q: float) -> float:
        """The q-quantile (0 <= q <= 1) in nanoseconds; 0.0 when empty."""
        if self.count == 0:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                e, sub = divmod(i, self.SUB)
                mid = 0.5 + (sub + 0.5) / (2 * self.SUB)  # middle of the bucket
                return min(math.ldexp(mid, e), float(self.max_ns))
        return float(self.max_ns)


@dataclass(frozen=True)
class PipelineStats:
    """A snapshot of a pipeline's counters (all passes so far).

    Times are in seconds. ``wait_*`` is the consumer's wait for its next
    batch (the time spent inside ``next()``); ``stall_fraction`` is the total
    wait over the wall time spent iterating, the share of the training loop
    that waited for input.
    """

    batches: int
    bytes: int
    per_worker_batches: tuple[int, ...]
    wait_total_s: float
    wait_mean_s: float
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float
    time_to_first_batch_s: float | None
    #: per worker; None where the transport cannot tell (Ray)
    producer_blocked_s: tuple[float | None, ...]
    wall_s: float
    stall_fraction: float
    passes: int
    transport: str
    num_workers: int
    capacity: int
    slot_size: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def producer_blocked_total_s(self) -> float | None:
        known = [b for b in self.producer_blocked_s if b is not None]
        return sum(known) if known else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["producer_blocked_total_s"] = self.producer_blocked_total_s
        return d

    def __str__(self) -> str:
        def ms(s: float | None) -> str:
            return "-" if s is None else f"{s * 1e3:.3f} ms"

        gb = self.bytes / 1e9
        rate = f", {gb / self.wall_s:.2f} GB/s" if self.wall_s > 0 else ""
        lines = [
            f"shmpipe pipeline: {self.num_workers} workers, transport {self.transport!r}, "
            f"capacity {self.capacity}"
            + (f", slot {self.slot_size:,} bytes" if self.slot_size else ""),
            f"  delivered      {self.batches:,} batches, {gb:.3f} GB in {self.passes} pass(es)"
            + rate,
            f"  per worker     {list(self.per_worker_batches)}",
            f"  consumer wait  total {self.wait_total_s:.3f} s, mean {ms(self.wait_mean_s)}, "
            f"p50 {ms(self.wait_p50_s)}, p99 {ms(self.wait_p99_s)}, max {ms(self.wait_max_s)}",
            f"  first batch    {ms(self.time_to_first_batch_s)} after start",
            f"  stall fraction {self.stall_fraction:.1%} of {self.wall_s:.3f} s iterating",
        ]
        total = self.producer_blocked_total_s
        if total is None:
            lines.append("  producers blocked on a full channel: not measured by this transport")
        else:
            each = ", ".join("-" if b is None else f"{b:.3f}" for b in self.producer_blocked_s)
            lines.append(f"  producers blocked on a full channel {total:.3f} s ({each})")
        return "\n".join(lines)
