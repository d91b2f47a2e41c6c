"""A group's arguments of ``from_iterators``, checked: GroupOptions.

Apart from the pipeline's own options (_options.py): a group adds its name,
this process's rank, the group's size, how long the ranks wait for each
other and which launch this process is of (Launch), and needs more slots
than a pipeline of its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from shmpipe._options import PipelineOptions
from shmpipe.errors import ShmpipeValueError, as_int, is_real, out_of_range
from shmpipe.transport import ChannelSpec, ServesRanks, Transport

__all__ = ["GroupOptions", "Launch", "check_capacity", "check_group", "default_capacity", "group_capacity"]

#: What a group's name may hold: it names an abstract Unix socket.
_GROUP_NAME = re.compile(r"[A-Za-z0-9._:+-]{1,64}")
#: The longest run_id= taken (a job id, a uuid, a token: far less).
MAX_RUN_ID = 1024
#: What torchrun's agent sets in every worker of one attempt, and in no
#: other process (docs/several-ranks.md, "Which processes may join").
_TORCHRUN_ID = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
_TORCHRUN_RESTART = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class Launch:
    """Which launch (one start of the job's ranks) this process is of:
    every rank of one launch has the same, a process of another launch or
    of an earlier restart of this one another. The leader takes only ranks
    of its own launch (docs/several-ranks.md, "Which processes may join").

    `run_id` never leaves this process: the hello carries a digest of it
    (_wire.launch_proof), errors a digest of that; it is kept out of the
    repr, since a user may give a secret token as run_id."""

    run_id: str = field(repr=False)
    #: torchrun's attempt number (TORCHELASTIC_RESTART_COUNT), or None.
    restart: int | None
    #: Where the id came from, for messages: "run_id=" or torchrun's variables.
    source: str


@dataclass(frozen=True)
class GroupOptions:
    """A group of ranks sharing one pipeline (docs/several-ranks.md): its
    name on this node, this process's rank, how many ranks there are, how
    long they wait for each other to join, and the launch they are of
    (None: no launch id, so any process of the user may join)."""

    name: str
    rank: int
    num_ranks: int
    timeout: float = 60.0
    launch: Launch | None = None


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
            f"{'ordered ' if options.ordered else ''}sources needs capacity >= {need} (an incomplete round "
            f"of up to {group.num_ranks - 1} batches waiting to be dealt, two batches held by each rank while it "
            f"takes the next, and a slot for the batch waited for), got {options.capacity}"
        )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ShmpipeValueError(f"the environment variable {name}={value!r} is not an int") from None


def check_launch(run_id: str | None) -> Launch | None:
    """The launch this process is of: `run_id` if given, else torchrun's
    run id and rendezvous address; with either, torchrun's restart count if
    set. None when there is neither (any process of the user may join).

    Why these. A launcher gives every rank of one launch the same values,
    which no process of another launch has: torchrun's run id is a fresh
    uuid for a single-node launch (``--standalone``, or no
    ``--master-port``), but ``none`` with ``--master-port`` or several
    nodes unless ``--rdzv-id`` is given, and then MASTER_ADDR:MASTER_PORT
    (one per running job: two jobs cannot share its store) tells jobs
    apart; the restart count tells an earlier attempt's leftover from this
    attempt's rank (the run id, and often the group name, stay the same
    across restarts). Nothing else in the environment is used: a variable
    a rank's code may set itself (an mp.spawn script sets MASTER_PORT, maybe
    after from_iterators) could differ between ranks of one launch, and
    refuse a rank that belongs."""
    if run_id is not None:
        if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_RUN_ID:
            raise ShmpipeValueError(
                f"run_id must be a non-empty str of at most {MAX_RUN_ID} characters (the same in every rank "
                f"of this launch, e.g. your job's id), got {type(run_id).__name__}"
                + (f" of {len(run_id)} characters" if isinstance(run_id, str) else "")
            )
        given, source = run_id, "run_id="
    elif os.environ.get(_TORCHRUN_ID[0]) is not None:
        values = "\0".join(os.environ.get(name, "") for name in _TORCHRUN_ID)
        given, source = f"torchrun\0{values}", "torchrun's " + ", ".join(_TORCHRUN_ID)
    else:
        return None  # as before launches were told apart: the limit, documented
    restart = _env_int(_TORCHRUN_RESTART)
    if restart is not None and restart < 0:
        raise ShmpipeValueError(f"the environment variable {_TORCHRUN_RESTART}={restart} is negative")
    return Launch(given, restart, source)


def check_group(
    group: str | None,
    rank: int | None,
    num_ranks: int | None,
    group_timeout: float,
    transport: Transport,
    run_id: str | None = None,
) -> GroupOptions | None:
    """GroupOptions from from_iterators' group arguments, or None without a
    group; a ShmpipeValueError that says what is wrong."""
    if group is None:
        if rank is not None or num_ranks is not None or run_id is not None:
            raise ShmpipeValueError(
                "rank=, num_ranks= and run_id= need group= (the name of the pipeline the ranks share)"
            )
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
    if (ranks := as_int(num_ranks)) is None or ranks < 1:
        raise out_of_range(f"num_ranks must be a positive int, got {num_ranks!r}", num_ranks)
    if (index := as_int(rank)) is None or not 0 <= index < ranks:
        raise out_of_range(f"rank must be an int in [0, {ranks}), got {rank!r}", rank)
    rank, num_ranks = index, ranks
    if not (is_real(group_timeout) and group_timeout > 0):
        raise out_of_range(
            f"group_timeout must be a positive number of seconds, got {group_timeout!r}", group_timeout, number=True
        )
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
    return GroupOptions(group, rank, num_ranks, float(group_timeout), check_launch(run_id))
