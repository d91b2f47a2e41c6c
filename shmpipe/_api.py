"""The functions that make streams: ``from_iterators`` and ``from_dataset``.

Above both shapes of stream: a Pipeline of this process's own, or this
process's rank of a group (shmpipe/_group). Nothing below imports this
module. Every argument is checked here, before any process starts or any
memory is made.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from shmpipe import _group
from shmpipe._nodes import check_nodes, check_sampler_for_nodes, shard_of
from shmpipe._options import PipelineOptions, Source, as_bool, check_options
from shmpipe._pipeline import Pipeline
from shmpipe._schedule import DatasetSchedule
from shmpipe._sources import DatasetSource, IteratorSource
from shmpipe.errors import (
    ShmpipeTypeError,
    ShmpipeValueError,
    ShmpipeWarning,
    as_int,
    out_of_range,
    users_stacklevel,
)
from shmpipe.registry import resolve_transport
from shmpipe.transport import Transport

if TYPE_CHECKING:
    from shmpipe._group import GroupOptions, RankPipeline

__all__ = ["check_arguments", "from_dataset", "from_iterators"]


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
    max_restarts: int = 0,
    group: None = None,
    rank: None = None,
    num_ranks: None = None,
    group_timeout: float = 60.0,
    run_id: None = None,
    ray_remote_args: dict[str, Any] | None = None,
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
    max_restarts: int = 0,
    group: str,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
    run_id: str | None = None,
    ray_remote_args: dict[str, Any] | None = None,
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
    max_restarts: int = 0,
    group: str | None = None,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
    run_id: str | None = None,
    ray_remote_args: dict[str, Any] | None = None,
) -> Pipeline | RankPipeline:
    """Starts one producer process per source and returns the Pipeline that
    delivers their batches.

    Each source is a picklable zero-argument callable returning an iterable
    of batches (a generator function, typically). A batch is any nesting of
    tuple, list and dict (str keys) whose leaves are NumPy arrays of a
    fixed-size dtype or scalars (int, float, bool, str, bytes, None, NumPy
    scalars).

    An int argument takes a NumPy integer too (as NumPy's own do), never a
    bool; a number of seconds, a NumPy float; True or False, a NumPy bool.
    A wrong type is a ShmpipeTypeError, a value out of range a
    ShmpipeValueError.

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
        timeout: seconds the consumer waits for one batch (or, as a
            producer starts, for shmpipe's fork server to be continued
            where it is stopped) before PipelineTimeoutError; None waits as
            long as producers live.
        slot_size: bytes per slot. Default: the first batch's size plus 25%,
            rounded up to a page, and a larger batch travels in its
            producer's own shared memory (transports that have it: ``shm``).
            Given, it is a limit: a larger batch raises BatchTooLargeError
            naming this option.
        seed: base seed for the producers' seeds (see WorkerInfo); random
            when None.
        max_restarts: a producer that dies (killed, a segfault, os._exit;
            not a source that raises) is replaced by a new process that goes
            on after its last published batch, this many times in all (each
            a ShmpipeWarning; ``stats().restarts`` counts them); then
            WorkerDiedError. Its source is called again and makes the
            batches published before without publishing them (as a resume
            does). Default 0: the first death is the error. Transports
            ``shm``, ``arrow`` and ``ray`` (a dead actor, or one whose
            node left the cluster, replaced by a new one); with ``group``, rank 0's pipeline
            replaces its producers and the ranks see nothing of it.
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
        run_id: this launch's id, the same in every rank of it and in no
            other process (your job's id): rank 0 takes only ranks that
            give its own, so a process left over from another run or
            restart, or a second job given the same group name, cannot take
            a rank's place (it gets GroupLaunchError). Default: torchrun's
            (TORCHELASTIC_RUN_ID with MASTER_ADDR and MASTER_PORT); with
            either, torchrun's TORCHELASTIC_RESTART_COUNT must match too.
            Without both, any process of this user may join. See
            docs/several-ranks.md, "Which processes may join".
        ray_remote_args: with ``transport="ray"``, Ray's options for every
            producer actor (``num_cpus``, ``resources`` such as a node
            label, ``scheduling_strategy`` such as a placement group), over
            the transport's own: where on the cluster the producers run.

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
        max_restarts=max_restarts,
        group=group,
        rank=rank,
        num_ranks=num_ranks,
        group_timeout=group_timeout,
        run_id=run_id,
        ray_remote_args=ray_remote_args,
        # The producers run each source through an IteratorSource, which
        # skips what a resumed pass must (shmpipe/_sources.py); the checks
        # see the user's own objects, and pickle what the producers get.
        wrap=IteratorSource,
    )
    if grouped is not None:
        return _rank_pipeline()(options, grouped)
    return Pipeline(options)


def _rank_pipeline() -> type[RankPipeline]:
    """The class of a rank's stream, imported where a group is asked for:
    a pipeline without one never loads the ranks' client (shmpipe/_group)."""
    from shmpipe._group import RankPipeline

    return RankPipeline


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
    max_restarts: int = 0,
    group: str | None = None,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
    run_id: str | None = None,
    ray_remote_args: dict[str, Any] | None = None,
    wrap: Callable[[Source], Source] | None = None,
) -> tuple[PipelineOptions, GroupOptions | None]:
    """from_iterators' arguments, checked: the pipeline's options and the
    group's (None without a group), or the error that says what is wrong.
    `wrap`: what a producer runs for each source (check_options)."""
    resolved = resolve_transport(transport)
    if ray_remote_args is not None:
        place = getattr(resolved, "with_remote_args", None)
        if place is None:
            raise ShmpipeValueError(
                f"ray_remote_args= places the producers of transport='ray'; the {resolved.name!r} transport "
                "runs them on this node"
            )
        resolved = place(ray_remote_args)
    # The group's arguments' module (_group._options) is loaded only where one
    # is given: its dataclasses are milliseconds of a fresh process's first batch.
    grouped = None
    if any(given is not None for given in (group, rank, num_ranks, run_id)):
        grouped = _group.check_group(group, rank, num_ranks, group_timeout, resolved, run_id)
    options = check_options(
        sources,
        transport=resolved,
        capacity=capacity,
        ordered=ordered,
        start_method=start_method,
        timeout=timeout,
        slot_size=slot_size,
        seed=seed,
        default_capacity=_group.default_capacity(grouped.num_ranks) if grouped is not None else None,
        max_restarts=max_restarts,
        wrap=wrap,
    )
    if grouped is not None:
        _group.check_capacity(options, grouped)
    return options, grouped


def default_num_workers() -> int:
    """Producers for from_dataset when the user says nothing: the CPUs this
    process may use, less one for the trainer, at most 8 and at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus - 1))


def from_dataset(
    dataset: Any,
    *,
    batch_size: int = 1,
    shuffle: bool = False,
    sampler: Iterable[int] | None = None,
    batch_sampler: Iterable[Sequence[int]] | None = None,
    drop_last: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int | None = None,
    seed: int | None = None,
    max_restarts: int = 0,
    transport: str | Transport | type[Transport] = "shm",
    capacity: int | None = None,
    ordered: bool = True,
    start_method: str | None = None,
    timeout: float | None = None,
    slot_size: int | None = None,
    group: str | None = None,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
    run_id: str | None = None,
    num_nodes: int | None = None,
    node_rank: int | None = None,
    ray_remote_args: dict[str, Any] | None = None,
    fetch_while_starting: bool = True,
) -> Pipeline | RankPipeline:
    """Batches of a map-style dataset, fetched and collated by
    ``num_workers`` producer processes: the DataLoader's arguments, on
    shmpipe's transports.

    ``dataset`` is any picklable object with ``__len__`` and
    ``__getitem__(int)`` (a torch ``Dataset``, a Hugging Face
    ``datasets.Dataset``, a list of dicts of arrays); torch is not needed.
    This process draws each epoch's batches of indices (``shuffle``, or
    ``sampler``, then ``batch_size`` and ``drop_last``; or
    ``batch_sampler``) and deals them round-robin to the producers, which
    fetch the samples and collate them. So the batches, and with
    ``ordered=True`` (the default) their order, depend only on the dataset's
    length, the sampling arguments, ``seed`` and the epoch: never on
    ``num_workers``, the transport or timing. Each pass is an epoch, with
    its own shuffle. ``ordered=False`` delivers the same batches of each
    epoch as they are ready.

    The default collate stacks equal-shape arrays (and numbers; torch CPU
    tensors count as arrays) along a new first axis, straight into the
    ring's slot memory, and keeps the nesting of dicts, tuples and lists;
    strings are gathered into lists. ``collate_fn(samples)`` replaces it
    (its batch is copied into the ring).

    A sampler that has ``set_epoch`` (torch's ``DistributedSampler``) is
    told the epoch before each is drawn. A sampler of your own must give
    the same indices for the same epoch to resume exactly (a resume checks
    it and refuses otherwise).

    ``state_dict()`` / ``load_state_dict()`` resume by position: nothing
    before it is fetched again, and the number of workers may differ.

    Int and True-or-False arguments take NumPy's too, as for
    :func:`from_iterators`.

    Args:
        num_workers: producer processes; default: the CPUs this process may
            use less one, at most 8.
        seed: the shuffle's and the producers' seeds; random when None (a
            loaded state brings the saved run's).
        max_restarts: as for :func:`from_iterators`; a replacement fetches
            only the samples of the batches its predecessor had not
            published.
        fetch_while_starting: while the producers start (a fresh process's
            first pipeline waits 0.15-0.3 s for shmpipe's fork server to
            boot), this process fetches and collates the first batches
            itself, one per ``next()``, as a DataLoader with
            ``num_workers=0`` would, and hands the rest of the epoch to the
            producers once they are up: the same batches in the same order
            (each batch's random draws come from its own seed, wherever it
            is made; the global generators of this process are left as
            they were). Those batches are not in shared memory, and
            ``get_worker_info()`` is None while they are fetched.
            ``stats().extra["made_by_trainer"]`` counts them. False: the
            dataset is only ever read in the producers. (Not in a group.)

    ``transport``, ``capacity``, ``start_method``, ``timeout``,
    ``slot_size``, ``ray_remote_args`` and the group's arguments (``group``, ``rank``,
    ``num_ranks``, ``group_timeout``, ``run_id``) are as for :func:`from_iterators`.
    With ``group``, the epoch's batches are dealt to the ranks in rounds
    (rank r gets batches r, r + num_ranks, ...; the incomplete last round
    is dropped), and any rank's ``state_dict()`` at the same step is the
    group's position, which a group of another size may resume from.

    Several nodes (docs/several-nodes.md): ``num_nodes`` nodes of
    ``num_ranks`` ranks each (one without ``group``) share each epoch.
    Global rank ``g = node_rank * num_ranks + rank`` gets batches ``g,
    g + W, g + 2 * W, ...`` of the epoch (``W``: the ranks of all nodes;
    the incomplete last round is dropped), and each node's producers fetch
    only its ranks' batches. Every node must pass the same ``seed``. Any
    rank's ``state_dict()`` at step ``s`` is the job's position (``s * W``
    batches out), which any other number of nodes or ranks per node
    resumes from.

    Args (several nodes):
        num_nodes: the job's nodes; default ``WORLD_SIZE // LOCAL_WORLD_SIZE``
            (torchrun sets both), else 1. ``num_nodes=1`` always holds:
            each node deals its own whole epoch (a job that shards the
            data itself, with a ``DistributedSampler``).
        node_rank: this node's index in ``[0, num_nodes)``; default
            ``GROUP_RANK`` (torchrun's) or ``NODE_RANK``; required with
            ``num_nodes > 1`` where neither is set.
    """
    if isinstance(dataset, type):  # (a class has the methods, as functions of its instances)
        raise ShmpipeTypeError(
            f"dataset must be a dataset object, got the class {dataset.__qualname__} itself: make one, "
            f"{dataset.__qualname__}(...), and pass that"
        )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ShmpipeTypeError(
            f"dataset must have __len__ and __getitem__ (a map-style dataset), got {type(dataset).__name__}; "
            "for an iterable of batches use from_iterators"
        )
    length = len(dataset)
    if num_workers is None:
        num_workers = default_num_workers()
    if (workers := as_int(num_workers)) is None or workers < 1:
        raise out_of_range(
            f"num_workers must be a positive int (producer processes), got {num_workers!r}; shmpipe has no "
            "in-process mode (num_workers=0): iterate the dataset directly for that",
            num_workers,
        )
    num_workers = workers
    batch_size, shuffle, drop_last = _check_sampling(batch_size, shuffle, sampler, batch_sampler, drop_last)
    if collate_fn is not None and not callable(collate_fn):
        raise ShmpipeTypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")
    sources = [DatasetSource(dataset, collate_fn)] * num_workers
    options, grouped = check_arguments(
        sources,
        transport=transport,
        capacity=capacity,
        ordered=ordered,
        start_method=start_method,
        timeout=timeout,
        slot_size=slot_size,
        seed=seed,
        max_restarts=max_restarts,
        group=group,
        rank=rank,
        num_ranks=num_ranks,
        group_timeout=group_timeout,
        run_id=run_id,
        ray_remote_args=ray_remote_args,
    )
    ranks = grouped.num_ranks if grouped is not None else 1
    layout = check_nodes(num_nodes, node_rank, ranks, grouped is not None, shard_of(sampler, batch_sampler) is not None)
    check_sampler_for_nodes(layout, sampler, batch_sampler)
    if layout.num_nodes > 1 and not options.seed_given:
        raise ShmpipeValueError(
            f"a job of {layout.num_nodes} nodes needs seed= (the same on every node): each node draws the "
            + ("epoch's shuffle itself, and nodes that drew different ones would read some samples twice and "
               "others never" if shuffle else
               "producers' seeds from it, and every rank's state_dict() at the same step must be the job's one "
               "position (nodes that each drew a seed would hold different ones)")
        )
    if sampler is None and batch_sampler is None and (length == 0 or (drop_last and length < batch_size)):
        # Each epoch's loop would end at once, every epoch, silently (helper 75). (Said once the
        # arguments are known good: under warnings as errors, a bad one's error comes first.)
        why = "the dataset is empty" if length == 0 else f"its {length} samples make no whole batch of {batch_size}"
        warnings.warn(f"every epoch of this pipeline has no batches: {why}", ShmpipeWarning,
                      stacklevel=users_stacklevel())
    schedule = DatasetSchedule(
        num_workers,
        options.seed,
        options.seed_given,
        length=length,
        batch_size=None if batch_sampler is not None else batch_size,
        shuffle=bool(shuffle),
        drop_last=bool(drop_last),
        sampler=sampler,
        batch_sampler=batch_sampler,
        layout=layout,
        ordered=options.ordered,
        default_collate=collate_fn is None,
    )
    if (fetch := as_bool(fetch_while_starting)) is None:
        raise ShmpipeTypeError(f"fetch_while_starting must be True or False, got {fetch_while_starting!r}")
    fetch_while_starting = fetch
    if grouped is not None:
        return _rank_pipeline()(options, grouped, schedule)
    return Pipeline(options, schedule, fetch_while_starting=fetch_while_starting)


def _check_sampling(
    batch_size: Any, shuffle: Any, sampler: Any, batch_sampler: Any, drop_last: Any
) -> tuple[int, bool, bool]:
    """The DataLoader's rules for its sampling arguments, with its messages'
    meaning; batch_size, shuffle and drop_last as Python's int and bools."""
    flags = []
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
        if (flag := as_bool(value)) is None:
            raise ShmpipeTypeError(f"{name} must be True or False, got {value!r}")
        flags.append(flag)
    shuffle, drop_last = flags
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ShmpipeValueError(
                "batch_sampler gives whole batches: it excludes batch_size, shuffle, sampler and drop_last"
            )
        _check_iterable(batch_sampler, "batch_sampler")
        return 1, shuffle, drop_last
    if (size := as_int(batch_size)) is None or size < 1:
        raise out_of_range(f"batch_size must be a positive int, got {batch_size!r}", batch_size)
    if sampler is not None:
        if shuffle:
            raise ShmpipeValueError("sampler gives the order: it excludes shuffle=True")
        _check_iterable(sampler, "sampler")
    return size, shuffle, drop_last


def _check_iterable(obj: Any, name: str) -> None:
    if not hasattr(obj, "__iter__"):
        raise ShmpipeTypeError(f"{name} must be iterable (a new iteration each epoch), got {type(obj).__name__}")
    if isinstance(obj, Iterator):  # (not iter(obj) is obj: a sampler's __iter__ may draw from an RNG)
        raise ShmpipeTypeError(
            f"{name} is an iterator, which runs out after one epoch; give an iterable (a sampler, a list)"
        )
