"""Where this node's share of a job lies: NodeLayout, and its arguments
checked (``from_dataset(num_nodes=..., node_rank=...)``).

A job of K nodes with L ranks each has W = K * L global ranks; global rank
``g = node_rank * L + local_rank``. An epoch's batches still left to hand
out (all of them, or those a loaded state did not mark done) are dealt in
*rounds* of W: batch ``j * W + g`` of that list goes to global rank g. Only
complete rounds are dealt, so every rank of every node gets the same number
of batches (what DDP needs); the incomplete last round is dropped and
counted. A node fetches only its own ranks' batches: no sample is read on
two nodes, and nothing passes between nodes (each node's pipeline draws the
same epoch from the same arguments and seed, and keeps its share).

One node (K = 1) with one rank is a pipeline as it always was: W = 1, every
batch dealt, nothing dropped.

The position this gives a checkpoint is the job's: after every rank took s
batches of an epoch, its first ``s * W`` batches (of those left) are out,
whatever the layout; a layout of another K or L goes on from there in
rounds of its own W (shmpipe/_schedule.py).
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import numpy as np

from shmpipe.errors import ShmpipeValueError, ShmpipeWarning, as_int, out_of_range, users_stacklevel

__all__ = ["ONE_NODE", "NodeLayout", "check_nodes", "check_sampler_for_nodes", "shard_of"]

#: torchrun's name for the node's rank, and the name other launchers use.
_NODE_RANK_VARIABLES = ("GROUP_RANK", "NODE_RANK")


class NodeLayout(NamedTuple):
    """K nodes of L ranks each, and which node this is.

    (A NamedTuple, which a fresh process defines in a fifth of a frozen
    dataclass's time: docs/design.md, "A fresh pipeline's first batches".)
    """

    num_nodes: int = 1
    node_rank: int = 0
    ranks_per_node: int = 1

    @property
    def world(self) -> int:
        """W: the ranks of all nodes, the size of one round."""
        return self.num_nodes * self.ranks_per_node

    def share(self, remaining: np.ndarray) -> tuple[np.ndarray, int]:
        """This node's batches of `remaining` (an epoch's batches left to
        hand out, in the order they are dealt), in the order its ranks take
        them (round by round, local rank by local rank), and how many of
        `remaining` no rank of the job gets (the incomplete last round)."""
        w, rounds = self.world, len(remaining) // self.world
        if not rounds:  # (and no array of W columns: W may be any int, 2**63 too)
            return remaining[:0], len(remaining)
        first = self.node_rank * self.ranks_per_node
        mine = remaining[: rounds * w].reshape(rounds, w)[:, first : first + self.ranks_per_node]
        return mine.reshape(-1), len(remaining) - rounds * w


#: A job of one node with one rank: a pipeline as it always was.
ONE_NODE = NodeLayout()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ShmpipeValueError(f"the environment variable {name}={value!r} is not an int") from None


def _nodes_from_environment() -> tuple[int | None, str]:
    """The number of nodes torchrun's environment gives (WORLD_SIZE //
    LOCAL_WORLD_SIZE), or None where it gives none; and how it says so.
    Read only where from_dataset needs it: a variable of another tool's
    that it cannot read is then the error, naming it."""
    world, local = _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE")
    if world is None or local is None:
        return None, ""
    says = f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}"
    if local < 1 or world < 1:
        raise ShmpipeValueError(f"the environment's {says} must both be positive; pass num_nodes= yourself")
    if world % local:
        raise ShmpipeValueError(
            f"the environment's WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: shmpipe deals "
            "an epoch to nodes of equal size; pass num_nodes= and node_rank= yourself"
        )
    nodes = world // local
    return nodes, f"{says}: {nodes} node{'s' if nodes != 1 else ''}"


def _node_rank_from_environment() -> tuple[int | None, str]:
    for name in _NODE_RANK_VARIABLES:
        value = _env_int(name)
        if value is not None:
            return value, name
    return None, ""


def check_nodes(
    num_nodes: int | None, node_rank: int | None, ranks_per_node: int, grouped: bool, sharded: bool = False
) -> NodeLayout:
    """The layout from from_dataset's node arguments, their defaults from
    torchrun's environment (one node where it sets none), or a
    ShmpipeValueError naming what is wrong. `ranks_per_node`: the group's
    size (1 without a group); `sharded`: the sampler is a shard of the job
    (shard_of).

    ``num_nodes=1`` given explicitly always holds, whatever the launcher
    says: each node then deals its own whole epoch (the layout of a job
    that shards the data itself, with a DistributedSampler). The
    environment is read only for what was not given, and to check a
    ``num_nodes`` or ``node_rank`` given against it."""
    if num_nodes is not None:
        if (nodes := as_int(num_nodes)) is None or nodes < 1:
            raise out_of_range(f"num_nodes must be a positive int, got {num_nodes!r}", num_nodes)
        num_nodes = nodes
    layout_given = num_nodes is not None and node_rank is not None
    if num_nodes == 1:
        return _the_only_node(node_rank, ranks_per_node, "num_nodes=1")
    env_nodes, env_nodes_says = _nodes_from_environment()
    nodes_said = f"num_nodes={num_nodes}"  # what the messages below call it: given, or read
    if num_nodes is None:
        num_nodes = env_nodes if env_nodes is not None else 1
        nodes_said = f"{num_nodes} nodes ({env_nodes_says.partition(':')[0]} in the environment)"
    elif env_nodes is not None and num_nodes != env_nodes:
        raise ShmpipeValueError(
            f"num_nodes={num_nodes} disagrees with the environment ({env_nodes_says}): pass the launcher's "
            "number of nodes, leave num_nodes out, or pass num_nodes=1 to have each node deal its own epoch"
        )
    if num_nodes == 1:
        layout = _the_only_node(node_rank, ranks_per_node, "one node")
        _refuse_a_lone_node_rank(env_nodes_says)  # node_rank=0 given or not
        if not sharded:
            _warn_of_ranks_reading_the_same_epoch(ranks_per_node if grouped else None)
        return layout
    if node_rank is not None:
        if (index := as_int(node_rank)) is None:
            raise out_of_range(f"node_rank must be an int in [0, {num_nodes}), got {node_rank!r}", node_rank)
        node_rank = index
    env_rank, env_rank_name = _node_rank_from_environment()
    if node_rank is None:
        if env_rank is None:
            raise ShmpipeValueError(
                f"{nodes_said} {'need' if nodes_said[0].isdigit() else 'needs'} node_rank= (this node's index, "
                f"0 to {num_nodes - 1}), or GROUP_RANK "
                "or NODE_RANK in the environment (torchrun sets GROUP_RANK; under Slurm, SLURM_NODEID)"
            )
        if not 0 <= env_rank < num_nodes:
            raise ShmpipeValueError(
                f"the environment's {env_rank_name}={env_rank} is not a node of {num_nodes} (0 to {num_nodes - 1})"
            )
        node_rank = env_rank
    elif env_rank is not None and node_rank != env_rank:
        raise ShmpipeValueError(
            f"node_rank={node_rank} disagrees with the environment ({env_rank_name}={env_rank}): pass the "
            "launcher's node rank, or leave node_rank out"
        )
    if not 0 <= node_rank < num_nodes:
        raise ShmpipeValueError(f"node_rank must be an int in [0, {num_nodes}), got {node_rank}")
    _check_ranks_per_node(ranks_per_node, grouped, nodes_said, layout_given)
    return NodeLayout(num_nodes, node_rank, ranks_per_node)


def _check_ranks_per_node(ranks_per_node: int, grouped: bool, nodes_said: str, layout_given: bool) -> None:
    """With the epoch dealt over several nodes, the ranks torchrun runs on
    the node (LOCAL_WORLD_SIZE) are the node's pipeline's: more pipelines
    on the node (a rank each, a group per rank: helper 51) would each read
    its whole share. Refused where the layout is the environment's; where
    num_nodes= and node_rank= both say it, a ShmpipeWarning: the node's
    other ranks may be no data-parallel ranks (tensor or pipeline parallel
    peers, fed by a rank of the node's pipeline), or a script passing the
    launcher's own numbers may not know (helper 54)."""
    local = _env_int("LOCAL_WORLD_SIZE")
    if local is None or local == ranks_per_node:
        return
    if grouped:
        what = f"this node runs {local} ranks (LOCAL_WORLD_SIZE={local}), and the group has {ranks_per_node}"
        fix = f"every data-parallel rank of the node must be a rank of one group (num_ranks={local})"
    else:
        what = f"this node runs {local} ranks (LOCAL_WORLD_SIZE={local}), each calling from_dataset"
        fix = "they must share the node's pipeline (group=...)"
    if not layout_given:
        raise ShmpipeValueError(
            f"{what}: with {nodes_said} {fix}, or each would read the node's whole share; where the node's other "
            "ranks are not data-parallel (tensor or pipeline parallel peers), pass num_nodes= and node_rank= to "
            "say the layout"
        )
    warnings.warn(
        f"{what}: taken as the layout num_nodes= and node_rank= say (the node's other ranks fed by this "
        f"pipeline's, as tensor or pipeline parallel peers); where they are data-parallel ranks too, {fix}, or "
        "each pipeline reads the node's whole share",
        ShmpipeWarning,
        stacklevel=users_stacklevel(),
    )


def _warn_of_ranks_reading_the_same_epoch(group_size: int | None) -> None:
    """One node by default, whose launcher runs several ranks on it
    (LOCAL_WORLD_SIZE > 1), and a pipeline that deals the whole epoch to
    fewer of them than that: a rank without a group (`group_size` None) or
    a group that is not every rank of the node, and no sampler that shards
    the epoch. Where the others are data-parallel ranks, each rank or group
    reads the whole epoch, and the job every sample as many times (helpers
    75, 80). A warning, not a refusal (as on several nodes, where the
    layout decides the shares): ranks that shard the dataset themselves (a
    Subset, a sampler of their own indices), a pipeline of rank 0's alone,
    tensor or pipeline parallel peers are all this too (helper 78);
    num_nodes=1 says so and silences it."""
    local = _env_int("LOCAL_WORLD_SIZE")
    if local is None or local <= 1 or (group_size is not None and group_size >= local):
        return  # (a group larger than the node cannot fill: its start says so)
    if group_size is None:
        what = "this pipeline deals the whole epoch: where each data-parallel rank calls from_dataset like this"
    else:
        what = (
            f"this pipeline's group has {group_size} of them, and deals it the whole epoch: where the node's other "
            "data-parallel ranks read through groups of their own"
        )
    warnings.warn(
        f"this node runs {local} ranks (LOCAL_WORLD_SIZE={local}) and {what}, each reads every sample. Share the "
        f"node's pipeline (every rank of the node in one group: group=..., num_ranks={local}) or give each rank a "
        "shard (sampler=DistributedSampler(...)); where this is meant (the ranks shard the dataset themselves, or "
        "are not data-parallel), pass num_nodes=1",
        ShmpipeWarning,
        stacklevel=users_stacklevel(),
    )


def _the_only_node(node_rank: int | None, ranks_per_node: int, why: str) -> NodeLayout:
    """The layout of one node, where `node_rank` is None or 0 (an int: not
    False, not 0.0)."""
    if node_rank is not None and as_int(node_rank) != 0:
        raise out_of_range(f"node_rank must be 0 with {why}, got {node_rank!r}", node_rank)
    return NodeLayout(1, 0, ranks_per_node)


def _refuse_a_lone_node_rank(env_nodes_says: str) -> None:
    """One node by default, but the launcher numbers this node above 0:
    a node of a job of several, whose number shmpipe cannot tell (or that
    the environment's sizes contradict). Dealt its own whole epoch, every
    node would read every sample."""
    env_rank, name = _node_rank_from_environment()
    if env_rank is None or env_rank == 0:
        return
    if env_rank < 0:
        raise ShmpipeValueError(f"the environment's {name}={env_rank} is not a node's number (0 or more)")
    sizes = env_nodes_says or "WORLD_SIZE and LOCAL_WORLD_SIZE are not both set, so nothing says how many nodes"
    raise ShmpipeValueError(
        f"the environment's {name}={env_rank} says this is node {env_rank} of a job of several, but {sizes}: "
        "pass num_nodes= (the job's number of nodes) and node_rank=, or num_nodes=1 to have each node deal "
        "its own epoch"
    )


def check_sampler_for_nodes(layout: NodeLayout, sampler: object, batch_sampler: object) -> None:
    """Refuses a sampler that is a shard of the job already (torch's
    DistributedSampler, or any with ``num_replicas > 1``) in a job whose
    epoch shmpipe deals over the nodes: sharded twice, most samples would
    never be read."""
    shard = shard_of(sampler, batch_sampler)
    if layout.num_nodes == 1 or shard is None:
        return
    name, candidate, replicas = shard
    raise ShmpipeValueError(
        f"the {name} is a shard of the job already ({type(candidate).__name__} with "
        f"num_replicas={replicas}), and with num_nodes={layout.num_nodes} shmpipe deals the epoch "
        "over the nodes itself: pass the whole order (shuffle=True, or a sampler of every index), or "
        "num_nodes=1 to keep your own sharding (each node then deals its own epoch)"
    )


def shard_of(sampler: object, batch_sampler: object) -> tuple[str, object, int] | None:
    """Where the sampler (or the batch_sampler's) is a shard of the job (a
    DistributedSampler, or any with ``num_replicas > 1``): which argument,
    the sampler, its num_replicas."""
    for name, chosen in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        inner = getattr(chosen, "sampler", None) if name == "batch_sampler" else None
        for candidate in (chosen, inner):
            replicas = as_int(getattr(candidate, "num_replicas", None))  # (a NumPy int too)
            if replicas is not None and replicas > 1:
                return name, candidate, replicas
    return None
