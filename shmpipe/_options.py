"""The arguments of ``from_iterators``, checked: PipelineOptions.

Every argument is checked here, before any process starts or any memory is
made, and the result is one small frozen object the pipeline reads.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from shmpipe.errors import ShmpipeTypeError, ShmpipeValueError
from shmpipe.registry import resolve_transport
from shmpipe.transport import ChannelSpec, Transport

__all__ = ["PipelineOptions", "Source", "check_options", "default_start_method"]

#: A producer's source: a picklable zero-argument callable returning batches.
Source = Callable[[], Iterable[Any]]


def default_start_method() -> str:
    """forkserver where the platform has it (producers start from a clean
    server process, not a copy of a trainer's threads), else spawn."""
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


@dataclass(frozen=True)
class PipelineOptions:
    """A pipeline's configuration, every value checked (see check_options)."""

    sources: tuple[Source, ...]
    transport: Transport
    capacity: int
    ordered: bool
    start_method: str
    timeout: float | None
    slot_size: int | None
    seed: int
    #: A group of ranks sharing this pipeline (docs/several-ranks.md):
    #: its name on this node, this process's rank, how many there are, and
    #: how long they wait for each other to join.
    group: str | None = None
    rank: int = 0
    num_ranks: int = 1
    group_timeout: float = 60.0

    @property
    def num_workers(self) -> int:
        return len(self.sources)

    def channel_spec(self) -> ChannelSpec:
        """What the pipeline asks of its channel (at pass 0)."""
        return ChannelSpec(
            num_workers=self.num_workers,
            capacity=self.capacity,
            ordered=self.ordered,
            first_pass=0,
            slot_size=self.slot_size,
            slot_size_is_limit=self.slot_size is not None,
            mp_context=multiprocessing.get_context(self.start_method),
            shared_with_ranks=self.group is not None,
        )


def check_options(
    sources: Sequence[Source],
    *,
    transport: str | Transport | type[Transport],
    capacity: int | None,
    ordered: bool,
    start_method: str | None,
    timeout: float | None,
    slot_size: int | None,
    seed: int | None,
    group: str | None = None,
    rank: int | None = None,
    num_ranks: int | None = None,
    group_timeout: float = 60.0,
) -> PipelineOptions:
    """PipelineOptions from from_iterators' arguments (see its doc), or the
    ShmpipeTypeError / ShmpipeValueError that says what is wrong."""
    checked = _check_sources(sources)
    n = len(checked)
    resolved = resolve_transport(transport)
    if not isinstance(ordered, (bool, np.bool_)):
        raise ShmpipeTypeError(f"ordered must be True or False, got {ordered!r}")
    grouped = _check_group(group, rank, num_ranks, group_timeout, resolved)
    if capacity is None:
        capacity = 2 * n + 2
        if grouped is not None:
            # What the group needs to make progress, plus two slots per rank
            # for records on their way to it (a release takes a round trip).
            # Still fewer slots than a pipeline per rank would take in all.
            capacity = max(capacity, group_capacity(n, grouped[2], bool(ordered))) + 2 * grouped[2]
    if not _is_int(capacity) or capacity < 1:
        raise ShmpipeValueError(f"capacity must be a positive int, got {capacity!r}")
    if ordered and capacity < n + 1:
        raise ShmpipeValueError(
            f"ordered=True with {n} workers needs capacity >= {n + 1} (one slot per worker "
            f"plus one for the batch you hold), got {capacity}"
        )
    if grouped is not None and capacity < group_capacity(n, grouped[2], bool(ordered)):
        raise ShmpipeValueError(
            f"a group of {grouped[2]} ranks fed by {n} {'ordered ' if ordered else ''}sources needs "
            f"capacity >= {group_capacity(n, grouped[2], bool(ordered))} (a round of one batch per rank "
            f"being dealt, and two batches held by each rank while it takes the next), got {capacity}"
        )
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ShmpipeValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if slot_size is not None and (not _is_int(slot_size) or slot_size <= 0):
        raise ShmpipeValueError(f"slot_size must be a positive int (bytes), got {slot_size!r}")
    if seed is None:
        seed = secrets.randbits(63)
    elif not _is_int(seed) or seed < 0:
        raise ShmpipeValueError(f"seed must be a non-negative int or None, got {seed!r}")
    method = start_method or default_start_method()
    if method not in multiprocessing.get_all_start_methods():
        raise ShmpipeValueError(
            f"unknown start_method {method!r}; this platform has {', '.join(multiprocessing.get_all_start_methods())}"
        )
    if method != "fork" and not resolved.capabilities.own_producers:
        _check_picklable(checked, method)
    options = PipelineOptions(
        sources=tuple(checked),
        transport=resolved,
        capacity=capacity,
        ordered=bool(ordered),
        start_method=method,
        timeout=None if timeout is None else float(timeout),
        slot_size=slot_size,
        seed=seed,
    )
    if grouped is not None:
        options = dataclasses.replace(
            options, group=grouped[0], rank=grouped[1], num_ranks=grouped[2], group_timeout=grouped[3]
        )
    resolved.check_spec(options.channel_spec())  # what only the transport knows it cannot do
    return options


#: What a group's name may hold: it names an abstract Unix socket.
_GROUP_NAME = re.compile(r"[A-Za-z0-9._:+-]{1,64}")


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


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ShmpipeValueError(f"the environment variable {name}={value!r} is not an int") from None


def _check_group(
    group: str | None, rank: int | None, num_ranks: int | None, group_timeout: float, transport: Transport
) -> tuple[str, int, int, float] | None:
    """(group, rank, num_ranks, timeout), checked, or None without a group."""
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
    if not _is_int(num_ranks) or num_ranks < 1:
        raise ShmpipeValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if not _is_int(rank) or not 0 <= rank < num_ranks:
        raise ShmpipeValueError(f"rank must be an int in [0, {num_ranks}), got {rank!r}")
    if not (isinstance(group_timeout, (int, float)) and group_timeout > 0):
        raise ShmpipeValueError(f"group_timeout must be a positive number of seconds, got {group_timeout!r}")
    if not transport.capabilities.serves_ranks:
        raise ShmpipeValueError(
            f"the {transport.name!r} transport cannot feed several ranks from one pipeline "
            "(capability serves_ranks); use 'shm' or 'arrow', or one pipeline per rank"
        )
    return group, rank, num_ranks, float(group_timeout)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sources(sources: Any) -> list[Source]:
    if callable(sources) or isinstance(sources, (str, bytes)):
        raise ShmpipeTypeError("sources must be a sequence of callables, one per producer, e.g. [make_batches] * 4")
    try:
        listed = list(sources)
    except TypeError:
        raise ShmpipeTypeError(f"sources must be a sequence of callables, got {type(sources).__name__}") from None
    if not listed:
        raise ShmpipeValueError("sources is empty: give at least one callable")
    for i, s in enumerate(listed):
        if not callable(s):
            raise ShmpipeTypeError(
                f"source {i} is a {type(s).__name__}, not a callable; pass the generator "
                "function itself (make_batches), not its result (make_batches())"
            )
    return listed


def _check_picklable(sources: list[Source], method: str) -> None:
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file is not None and not os.path.exists(main_file):
        # multiprocessing re-imports __main__ from its file in every child
        raise ShmpipeValueError(
            f"the main module's file {main_file!r} does not exist (a script read from stdin?), "
            f"so {method!r} producer processes cannot start; run the script from a file, or "
            "pass start_method='fork'"
        )
    interactive = main_file is None
    for i, s in enumerate(sources):
        module = getattr(s, "__module__", None) or type(s).__module__
        if interactive and module == "__main__":
            # Pickled by reference to __main__, which a fresh producer process
            # cannot import when __main__ is a notebook or an interactive shell.
            raise ShmpipeTypeError(
                f"source {i} ({s!r}) is defined in an interactive session, where a "
                f"{method!r} producer process cannot import it; move it to a module (a .py "
                "file) and import it from there, or pass start_method='fork' (not safe "
                "once TensorFlow or CUDA have started threads)."
            )
        try:
            ForkingPickler.dumps(s)
        except Exception as exc:
            raise ShmpipeTypeError(
                f"source {i} ({s!r}) cannot be pickled, which a {method!r} producer process "
                f"needs: {exc}. Define it at the top level of an importable module (not a "
                "lambda or a nested function), or wrap such a function in functools.partial."
            ) from exc
