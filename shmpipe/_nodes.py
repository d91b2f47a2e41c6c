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
from dataclasses import dataclass

import numpy as np

from shmpipe._options import is_int
from shmpipe.errors import ShmpipeValueError

__all__ = ["ONE_NODE", "NodeLayout", "check_nodes"]

#: torchrun's name for the node's rank, and the name other launchers use.
_NODE_RANK_VARIABLES = ("GROUP_RANK", "NODE_RANK")


@dataclass(frozen=True)
class NodeLayout:
    """K nodes of L ranks each, and which node this is."""

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
    LOCAL_WORLD_SIZE), or None where it gives none; and how it says so."""
    world, local = _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE")
    if world is None or local is None:
        return None, ""
    if local < 1 or world < local or world % local:
        raise ShmpipeValueError(
            f"the environment's WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: shmpipe deals "
            "an epoch to nodes of equal size"
        )
    return world // local, f"WORLD_SIZE={world} // LOCAL_WORLD_SIZE={local}"


def _node_rank_from_environment() -> tuple[int | None, str]:
    for name in _NODE_RANK_VARIABLES:
        value = _env_int(name)
        if value is not None:
            return value, f"{name}={value}"
    return None, ""


def check_nodes(num_nodes: int | None, node_rank: int | None, ranks_per_node: int, grouped: bool) -> NodeLayout:
    """The layout from from_dataset's node arguments, their defaults from
    torchrun's environment (one node where it sets none), or a
    ShmpipeValueError naming what is wrong. `ranks_per_node`: the group's
    size (1 without a group)."""
    env_nodes, env_nodes_says = _nodes_from_environment()
    env_rank, env_rank_says = _node_rank_from_environment()
    if num_nodes is None:
        num_nodes = env_nodes if env_nodes is not None else 1
    elif not is_int(num_nodes) or num_nodes < 1:
        raise ShmpipeValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
    elif env_nodes is not None and num_nodes != env_nodes:
        raise ShmpipeValueError(
            f"num_nodes={num_nodes} disagrees with the environment ({env_nodes_says} = {env_nodes} nodes): "
            "pass the launcher's number of nodes, or leave num_nodes out"
        )
    if node_rank is None:
        node_rank = env_rank if env_rank is not None and num_nodes > 1 else 0
    elif not is_int(node_rank):
        raise ShmpipeValueError(f"node_rank must be an int in [0, {num_nodes}), got {node_rank!r}")
    elif env_rank is not None and num_nodes > 1 and node_rank != env_rank:
        raise ShmpipeValueError(
            f"node_rank={node_rank} disagrees with the environment ({env_rank_says}): pass the launcher's "
            "node rank, or leave node_rank out"
        )
    if not 0 <= node_rank < num_nodes:
        raise ShmpipeValueError(f"node_rank must be an int in [0, {num_nodes}), got {node_rank}")
    if num_nodes > 1 and not grouped:
        local = _env_int("LOCAL_WORLD_SIZE")
        if local is not None and local > 1:
            raise ShmpipeValueError(
                f"this node runs {local} ranks (LOCAL_WORLD_SIZE={local}), each calling from_dataset: with "
                f"num_nodes={num_nodes} they must share the node's pipeline (group=...), or each would read "
                "the node's whole share"
            )
    return NodeLayout(num_nodes, node_rank, ranks_per_node)
