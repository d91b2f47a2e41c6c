"""The functions that make streams: ``from_iterators``.

Above both shapes of stream: a Pipeline of this process's own, or this
process's rank of a group (shmpipe/_group). Nothing below imports this
module. Every argument is checked here, before any process starts or any
memory is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from shmpipe._group import GroupOptions, RankPipeline, check_capacity, check_group, default_capacity
from shmpipe._options import PipelineOptions, Source, check_options
from shmpipe._pipeline import Pipeline
from shmpipe.registry import resolve_transport
from shmpipe.transport import Transport

__all__ = ["check_arguments", "from_iterators"]


@overload
def from_iterators(
    sources: Sequence[Source],
    *,
    transport: str | Transport | type[Transport] = "shm",
    capacity: int | None = None,
    ordered: bool = False,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    seed: int | None = None,
    group: None = None,
    rank: None = None,
    num_ranks: None = None,
    group_timeout: float = 60.0,
) -> Pipeline: ...


@overload
def from_iterators(
    sources: Sequence[Source],
    *,
    transport: str | Transport | type[Transport] = "shm",
    capacity: int | None = None,
    ordered: bool = False,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    seed: int | None = None,
    group: str,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
) -> RankPipeline: ...


def from_iterators(
    sources: Sequence[Source],
    *,
    transport: str | Transport | type[Transport] = "shm",
    capacity: int | None = None,
    ordered: bool = False,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    seed: int | None = None,
    group: str | None = None,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
) -> Pipeline | RankPipeline:
    """Starts one producer process per source and returns the Pipeline that
    delivers their batches.

    Each source is a picklable zero-argument callable returning an iterable
    of batches (a generator function, typically). A batch is any nesting of
    tuple, list and dict (str keys) whose leaves are NumPy arrays of a
    fixed-size dtype or scalars (int, float, bool, str, bytes, None, NumPy
    scalars).

    Args:
        transport: how batches travel: ``"shm"`` (the shared-memory ring),
            ``"arrow"``, ``"ray"``, ``"queue"``, a plugin's name, or a
            Transport instance (for options: ``RayTransport(address=...)``).
            See ``shmpipe.available_transports()``.
        capacity: slots in the ring, i.e. the most batches in flight,
            including those the consumer still holds. Default ``2 * len(sources) + 2``.
        ordered: False yields whichever batch is ready first; True yields
            round-robin by worker (worker 0's first batch, worker 1's first,
            ...), so deterministic sources give a deterministic stream.
        start_method: multiprocessing start method; default ``"forkserver"``
            (or ``"spawn"`` where there is no forkserver).
        timeout: seconds the consumer waits for one batch before
            PipelineTimeoutError; None waits as long as producers live.
        slot_size: bytes per slot. Default: the first batch's size plus 25%,
            rounded up to a page. A batch larger than a slot raises
            BatchTooLargeError naming this option.
        seed: base seed for the producers' seeds (see WorkerInfo); random
            when None.
        group: several processes of this node (one per GPU) share one
            pipeline: every one calls from_iterators with the same
            arguments and this name; rank 0 starts the producers, each
            batch goes to exactly one rank, every rank gets the same number
            per pass. Returns a RankPipeline. See docs/several-ranks.md.
        rank: this process's rank in the group; default LOCAL_RANK
            (torchrun sets it).
        num_ranks: the group's size; default LOCAL_WORLD_SIZE (torchrun
            sets it).
        group_timeout: seconds the ranks wait for each other to join.

    Every argument is checked before any process starts.
    """
    options, grouped = check_arguments(
        sources,
        transport=transport,
        capacity=capacity,
        ordered=ordered,
        start_method=start_method,
        timeout=timeout,
        slot_size=slot_size,
        seed=seed,
        group=group,
        rank=rank,
        num_ranks=num_ranks,
        group_timeout=group_timeout,
    )
    if grouped is not None:
        return RankPipeline(options, grouped)
    return Pipeline(options)


def check_arguments(
    sources: Sequence[Source],
    *,
    transport: str | Transport | type[Transport] = "shm",
    capacity: int | None = None,
    ordered: bool = False,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    seed: int | None = None,
    group: str | None = None,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
) -> tuple[PipelineOptions, GroupOptions | None]:
    """from_iterators' arguments, checked: the pipeline's options and the
    group's (None without a group), or the error that says what is wrong."""
    resolved = resolve_transport(transport)
    grouped = check_group(group, rank, num_ranks, group_timeout, resolved)
    options = check_options(
        sources,
        transport=resolved,
        capacity=capacity,
        ordered=ordered,
        start_method=start_method,
        timeout=timeout,
        slot_size=slot_size,
        seed=seed,
        default_capacity=default_capacity(grouped.num_ranks) if grouped is not None else None,
    )
    if grouped is not None:
        check_capacity(options, grouped)
    return options, grouped
