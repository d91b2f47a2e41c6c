"""Several ranks of one node fed by one pipeline: ``from_iterators(group=...)``.

The package, by job: _options.py (the group's arguments), _wire.py (the
messages and how they travel), _door.py (rank 0's listening socket and the
hellos it reads), _leader.py (rank 0's leader and the pipeline it deals
from), _rank.py (every rank's client: RankPipeline).

One process per GPU (``torchrun``) calls the same line; rank 0 runs the
pipeline (its producers, one per source, and the channel's only consumer)
and a *leader*: a Unix socket in the abstract namespace named from the uid
and the group, a service thread and a dispatch thread. Every rank, rank 0
included, is a *client* of the leader over that socket. docs/several-ranks.md
is the user's guide; docs/design.md ("Several ranks") the reasons.

Joining. Each rank's hello carries its rank, its arguments and a proof of
its launch (``run_id=``, else torchrun's run id, rendezvous address and
restart count: _options.check_launch; the proof: _wire.launch_proof). Rank
0 checks every field of it, turns away a malformed hello or one of another
launch (GroupLaunchError) without harm to the group, and fails the group
only when ranks of its own launch disagree.

Dealing. The dispatch thread takes batches from the pipeline in its usual
order (ordered=True: the deterministic one) as undecoded SharedBatch objects
(``SharingConsumerEnd.take_shared``) and deals them in *rounds* of
``num_ranks``: batch k of a pass goes to rank ``k % num_ranks``, and a round
is sent only once complete. At the end of a pass the incomplete last round
(fewer than num_ranks batches) is released unused and counted as dropped, so
every rank gets the same number of batches in every pass (what DDP needs: a
rank whose epoch ends early leaves the others waiting in an all-reduce).

Zero copy. A batch dealt to a rank travels as a small record (where its
payload is in the ring) plus, for a batch larger than a slot, the descriptor
of its memory; the ring's own descriptor went to each rank once. The rank
maps the ring read-only and decodes the payload there with the transport's
decoder (``Transport.rank_reader``), so its arrays are views of the pages
the producer wrote. Rank 0 keeps the batch's root (which holds the slot)
until the rank says "release" (when the last array of the batch is gone in
that rank), or until the rank's connection ends.

Passes. A client's ``iter()`` says "begin p"; the dispatcher starts pass p
only when every rank has begun it (a barrier), and ends its deal with "end
p" to every rank. A rank that read "end p", its trainer asking past its
last batch, says "taken p"; its pass ends (StopIteration) only on rank 0's
"complete p", sent once every rank took the pass whole, began a later one,
or closed having had all it was dealt of it: so a rank that dies or leaves
with batches of the pass fails the others, in the last pass too. Rank 0's
close waits for the others to end a pass dealt whole (up to group_timeout):
no one else can tell them it is complete.

Faults. A rank's connection ending without "bye" (or its process ending,
seen by a pidfd: a child it forked keeps the socket open), or "bye" in the
middle of a pass (with batches of it not had, or a batch dealt to it
after), fails the group: rank 0 stops the pipeline, then releases
what that rank held, and sends every other rank a RankDiedError. Rank 0 dying
ends every connection: the others raise RankDiedError, and the producers
exit by their own watchdog (their consumer died). A producer's failure
reaches the dispatcher as the pipeline's error and every rank as the same
error.

Wire: JSON arrays in SOCK_SEQPACKET datagrams, never pickle (_wire.py).

The group sits above the pipeline: it knows the Pipeline, the transport
contract (its optional protocol for several ranks) and nothing below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers and IDEs
    from shmpipe._group._options import (
        GroupOptions,
        check_capacity,
        check_group,
        default_capacity,
        group_capacity,
    )
    from shmpipe._group._rank import RankPipeline
    from shmpipe._group._wire import socket_address

#: Where each name lives, its module imported at the name's first use (PEP
#: 562, as the package's face does). Every from_dataset and from_iterators
#: checks its group arguments (_options), most with no group: they never
#: load the ranks' client, the leader and the wire. Those three are about
#: 600 objects a fresh process allocates on its way to the first batch, and
#: the allocations are what brings CPython's first full collection after
#: `import torch` (0.07 to 0.09 s) into it: docs/design.md, "A fresh
#: pipeline's first batches".
_WHERE = {
    **dict.fromkeys(
        ("GroupOptions", "check_capacity", "check_group", "default_capacity", "group_capacity"),
        "shmpipe._group._options",
    ),
    "RankPipeline": "shmpipe._group._rank",
    "socket_address": "shmpipe._group._wire",
}

__all__ = [
    "GroupOptions",
    "RankPipeline",
    "check_capacity",
    "check_group",
    "default_capacity",
    "group_capacity",
    "socket_address",
]


def __getattr__(name: str) -> Any:
    """A name of the package, its module imported at its first use (and the
    name kept here). A submodule imported by name (``from shmpipe._group
    import _wire``) is found by the import system, not here."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from shmpipe._interrupts import ctrl_c_held_back

    with ctrl_c_held_back():  # as the package's face: an import cut short by Ctrl-C is left undone
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
