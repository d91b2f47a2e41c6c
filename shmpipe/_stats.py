"""What a user reads of a pipeline's counters: the snapshot of one
pipeline (PipelineStats, made by _counters.Counters.snapshot) and of a
group of ranks (GroupStats)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["GroupStats", "PipelineStats"]


@dataclass(frozen=True)
class PipelineStats:
    """A snapshot of a pipeline's counters (all passes so far, the one in
    progress included: read it at any moment of a training loop).

    Times are in seconds. ``wait_*`` is the consumer's wait for its next
    batch (the time spent inside ``next()``); ``wall_s`` is the time spent
    iterating, from each pass's first request for a batch to its end (or, for
    the pass in progress, to the snapshot); ``stall_fraction`` is the total
    wait over that wall time, the share of the training loop that waited for
    input.
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
    extra: dict[str, Any] = field(default_factory=dict)
    #: per worker, how often its producer died and was replaced (max_restarts)
    restarts: tuple[int, ...] = ()

    @property
    def producer_blocked_total_s(self) -> float | None:
        known = [b for b in self.producer_blocked_s if b is not None]
        return sum(known) if known else None

    def as_dict(self) -> dict[str, Any]:
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
            f"  per worker     {list(self.per_worker_batches)}"
            + (f", {made} made by the trainer itself" if (made := self.extra.get("made_by_trainer")) else ""),
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
        if any(self.restarts):
            lines.append(f"  restarts       {list(self.restarts)} (producers that died and were replaced)")
        return "\n".join(lines)


@dataclass(frozen=True)
class GroupStats:
    """A group of ranks fed by one pipeline (``from_iterators(group=...)``),
    as rank 0 sees it: batches dealt to each rank, the incomplete last
    rounds of each pass dropped (released unused so that every rank gets
    the same number), and the stats of the pipeline that feeds the group.
    Each rank's own (what it received, how long it waited) is its
    ``stats()``."""

    group: str
    num_ranks: int
    batches_per_rank: tuple[int, ...]
    dropped_per_pass: tuple[int, ...]
    dropped_remainder: int
    passes: int
    pipeline: PipelineStats

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pipeline"] = self.pipeline.as_dict()
        return d
