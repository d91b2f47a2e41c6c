"""The file descriptors a pipeline needs, against ``ulimit -n``: counted
before any producer starts (ProcessLauncher), so that a pipeline that
cannot fit is a DescriptorLimitError saying how to raise the limit, not
EMFILE in the middle of a start; and how many producers the limit allows
(``shmpipe doctor``)."""

from __future__ import annotations

import os

from shmpipe.errors import DescriptorLimitError
from shmpipe.transport import Transport

__all__ = [
    "FDS_PER_PRODUCER",
    "FDS_TO_START",
    "check_descriptor_room",
    "descriptor_limit",
    "descriptors_per_producer",
    "open_descriptors",
]

#: What the consumer holds for each producer it starts: the end of its
#: control connection (ProducerLink), the pipe that reports its pid and exit
#: status (multiprocessing's sentinel) and its pidfd (ProcessWatch); a
#: forked producer also the pipe multiprocessing keeps for the child's
#: parent_process().
FDS_PER_PRODUCER = 3
#: Beyond them: a start's passing descriptors (the fork server's connection,
#: its two pipes), the channel's memory and sockets, the fork server's own
#: (16 producers on shm under ulimit -n 64: 5 open before, 58 after the
#: start, 61 counted).
FDS_TO_START = 8


def descriptor_limit() -> tuple[int, int]:
    """This process's (soft, hard) limit of open files (ulimit -n)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def open_descriptors() -> int:
    """How many file descriptors this process has open."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return 0


def descriptors_per_producer(transport: Transport, start_method: str) -> int:
    return FDS_PER_PRODUCER + (start_method == "fork") + transport.consumer_fds_per_producer


def check_descriptor_room(transport: Transport, start_method: str, producers: int) -> None:
    """Refuses, with a DescriptorLimitError that says how to raise the limit,
    a pipeline whose producers would not fit under ``ulimit -n``: found
    before any producer starts, not as EMFILE in the middle of a start."""
    soft, hard = descriptor_limit()
    if soft < 0:  # RLIM_INFINITY
        return
    in_use = open_descriptors()
    needed = in_use + producers * descriptors_per_producer(transport, start_method) + FDS_TO_START
    if needed > soft:
        raise DescriptorLimitError(needed, soft, hard, in_use, producers)
