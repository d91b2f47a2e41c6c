"""A group's arguments of ``from_iterators``, checked: GroupOptions.

Apart from the pipeline's own options (_options.py): a group adds its name,
this process's rank, the group's size and how long the ranks wait for each
other, and needs more slots than a pipeline of its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from shmpipe._options import PipelineOptions, is_int
from shmpipe.errors import ShmpipeValueError
from shmpipe.transport import ChannelSpec, ServesRanks, Transport

__all__ = ["GroupOptions", "check_capacity", "check_group", "default_capacity", "group_capacity"]

#: What a group's name may hold: it names an abstract Unix socket.
_GROUP_NAME = re.compile(r"[A-Za-z0-9._:+-]{1,64}")


@dataclass(frozen=True)
class GroupOptions:
    """A group of ranks sharing one pipeline (docs/several-ranks.md): its
    name on this node, this process's rank, how many ranks there are, and
    how long they wait for each other to join."""

    name: str
    rank: int
    num_ranks: int
    timeout: float = 60.0


def group_capacity(num_workers: int, num_ranks: int, ordered: bool) -> int:
    """The fewest slots a group of `num_ranks` ranks needs so that the
    batches the consumer side may hold (an incomplete round: num_ranks - 1,
    and two per rank: the one it uses and the one it takes next) never keep
    the producers from delivering the batch the dispatcher waits for (see
    ChannelSpec.consumer_may_hold)."""
    need = 3 * num_ranks - 1
    capacity = need + 1
    while True:
        spec = ChannelSpec(num_workers=num_workers, capacity=capacity, ordered=ordered)
        if spec.consumer_may_hold >= need:
            return capacity
        capacity += 1


def default_capacity(num_ranks: int) -> Callable[[int, bool], int]:
    """The capacity of a group's pipeline when the user gave none: what the
    group needs to make progress, plus two slots per rank for records on
    their way to it (a release takes a round trip). Still fewer slots than
    a pipeline per rank would take in all."""

    def capacity(num_workers: int, ordered: bool) -> int:
        return max(2 * num_workers + 2, group_capacity(num_workers, num_ranks, ordered)) + 2 * num_ranks

    return capacity


def check_capacity(options: PipelineOptions, group: GroupOptions) -> None:
    """The ShmpipeValueError a capacity too small for the group deserves."""
    need = group_capacity(options.num_workers, group.num_ranks, options.ordered)
    if options.capacity < need:
        raise ShmpipeValueError(
            f"a group of {group.num_ranks} ranks fed by {options.num_workers} "
            f"{'ordered ' if options.ordered else ''}sources needs capacity >= {need} (a round of one "
            f"batch per rank being dealt, and two batches held by each rank while it takes the next), "
            f"got {options.capacity}"
        )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ShmpipeValueError(f"the environment variable {name}={value!r} is not an int") from None


def check_group(
    group: str | None, rank: int | None, num_ranks: int | None, group_timeout: float, transport: Transport
) -> GroupOptions | None:
    """GroupOptions from from_iterators' group arguments, or None without a
    group; a ShmpipeValueError that says what is wrong."""
    if group is None:
        if rank is not None or num_ranks is not None:
            raise ShmpipeValueError("rank= and num_ranks= need group= (the name of the pipeline the ranks share)")
        return None
    if not isinstance(group, str) or not _GROUP_NAME.fullmatch(group):
        raise ShmpipeValueError(
            f"group must be a name of 1 to 64 letters, digits and ._:+- (it names a socket), got {group!r}"
        )
    if rank is None:
        rank = _env_int("LOCAL_RANK")
    if num_ranks is None:
        num_ranks = _env_int("LOCAL_WORLD_SIZE")
    if rank is None or num_ranks is None:
        raise ShmpipeValueError(
            "group= needs rank= and num_ranks=, or LOCAL_RANK and LOCAL_WORLD_SIZE in the "
            "environment (torchrun sets them)"
        )
    if not is_int(num_ranks) or num_ranks < 1:
        raise ShmpipeValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if not is_int(rank) or not 0 <= rank < num_ranks:
        raise ShmpipeValueError(f"rank must be an int in [0, {num_ranks}), got {rank!r}")
    if not (isinstance(group_timeout, (int, float)) and group_timeout > 0):
        raise ShmpipeValueError(f"group_timeout must be a positive number of seconds, got {group_timeout!r}")
    if not transport.capabilities.serves_ranks:
        raise ShmpipeValueError(
            f"the {transport.name!r} transport cannot feed several ranks from one pipeline "
            "(capability serves_ranks); use 'shm' or 'arrow', or one pipeline per rank"
        )
    if not isinstance(transport, ServesRanks):
        raise ShmpipeValueError(
            f"the {transport.name!r} transport claims serves_ranks but does not implement the protocol "
            "(shmpipe.transport.ServesRanks: rank_reader, and a SharingConsumerEnd)"
        )
    return GroupOptions(group, rank, num_ranks, float(group_timeout))
