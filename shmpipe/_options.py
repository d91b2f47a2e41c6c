"""The arguments of ``from_iterators``, checked: PipelineOptions.

Every argument is checked here, before any process starts or any memory is
made, and the result is one small frozen object the pipeline reads.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import sys
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from shmpipe._startup import default_start_method
from shmpipe.errors import ShmpipeTypeError, ShmpipeValueError, as_int, is_real, out_of_range
from shmpipe.registry import resolve_transport
from shmpipe.transport import ChannelSpec, Transport

if TYPE_CHECKING:
    from shmpipe import _startup

__all__ = ["PipelineOptions", "Source", "check_options"]

#: A producer's source: a picklable zero-argument callable returning batches.
Source = Callable[[], Iterable[Any]]


class PipelineOptions(NamedTuple):
    """A pipeline's configuration, every value checked (see check_options).

    (A NamedTuple, which a fresh process defines in a fifth of a frozen
    dataclass's time: docs/design.md, "A fresh pipeline's first batches".)
    """

    sources: tuple[Source, ...]
    transport: Transport
    capacity: int
    ordered: bool
    start_method: str
    timeout: float | None
    slot_size: int | None
    seed: int
    #: Whether the user chose the seed (else it was drawn at random, and a
    #: loaded checkpoint state may bring the saved run's).
    seed_given: bool = True
    #: Producers that die may be replaced this many times in all (the
    #: transport must restarts_producers).
    max_restarts: int = 0
    #: The sources as the check pickled them for producers that do not
    #: import the script (None where none was: fork, a transport's own
    #: producers); the launcher ships these pickles.
    shipments: _startup.Shipments | None = None

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
            hands_again=self.max_restarts > 0,
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
    default_capacity: Callable[[int, bool], int] | None = None,
    max_restarts: int = 0,
    wrap: Callable[[Source], Source] | None = None,
) -> PipelineOptions:
    """PipelineOptions from from_iterators' arguments (see its doc), or the
    ShmpipeTypeError / ShmpipeValueError that says what is wrong.
    `default_capacity(num_workers, ordered)` is the capacity when the user
    gave none (a group needs more than a pipeline of its own). `wrap(source)`:
    what a producer runs for a source (from_iterators' IteratorSource), made
    once per distinct source; the options' sources are those."""
    checked = _check_sources(sources)
    runs = checked
    if wrap is not None:
        made: dict[int, Source] = {}  # by id: [make_batches] * 16 is wrapped, and so pickled, once
        for s in checked:
            if id(s) not in made:
                made[id(s)] = wrap(s)
        runs = [made[id(s)] for s in checked]
    n = len(checked)
    resolved = resolve_transport(transport)
    if (flag := as_bool(ordered)) is None:
        raise ShmpipeTypeError(f"ordered must be True or False, got {ordered!r}")
    ordered = flag
    if capacity is None:
        capacity = 2 * n + 2 if default_capacity is None else default_capacity(n, bool(ordered))
    if (count := as_int(capacity)) is None or count < 1:
        raise out_of_range(f"capacity must be a positive int, got {capacity!r}", capacity)
    capacity = count
    if ordered and capacity < n + 1:
        raise ShmpipeValueError(
            f"ordered=True with {n} workers needs capacity >= {n + 1} (one slot per worker "
            f"plus one for the batch you hold), got {capacity}"
        )
    if capacity < 2 and resolved.capabilities.zero_copy_reads:
        raise ShmpipeValueError(
            f"the {resolved.name!r} transport needs capacity >= 2, got {capacity}: its batches are views of its "
            "slots, each held until you let go of it, and a for loop still holds its batch as it takes the next"
        )
    if timeout is not None and not (is_real(timeout) and timeout > 0):
        raise out_of_range(
            f"timeout must be a positive number of seconds or None, got {timeout!r}", timeout, number=True
        )
    if slot_size is not None:
        if (nbytes := as_int(slot_size)) is None or nbytes <= 0:
            raise out_of_range(f"slot_size must be a positive int (bytes), got {slot_size!r}", slot_size)
        slot_size = nbytes
    seed_given = seed is not None
    if seed is None:
        seed = secrets.randbits(63)
    elif (given := as_int(seed)) is None or not 0 <= given < 1 << 63:  # (what a state holds, as a JSON-safe int64)
        raise out_of_range(f"seed must be an int in [0, 2**63) or None, got {seed!r}", seed)
    else:
        seed = given
    if (restarts := as_int(max_restarts)) is None or restarts < 0:
        raise out_of_range(f"max_restarts must be a non-negative int, got {max_restarts!r}", max_restarts)
    max_restarts = restarts
    if max_restarts and not resolved.capabilities.restarts_producers:
        raise ShmpipeValueError(
            f"the {resolved.name!r} transport cannot replace a producer that dies (max_restarts={max_restarts}); "
            "'shm', 'arrow' and 'ray' can (and any transport whose capabilities say restarts_producers)"
        )
    method = start_method or default_start_method()
    if method not in multiprocessing.get_all_start_methods():
        raise ShmpipeValueError(
            f"unknown start_method {method!r}; this platform has {', '.join(multiprocessing.get_all_start_methods())}"
        )
    shipments = None
    if method != "fork" and not resolved.capabilities.own_producers:
        shipments = _check_picklable(checked, runs, method)
    options = PipelineOptions(
        sources=tuple(runs),
        transport=resolved,
        capacity=capacity,
        ordered=bool(ordered),
        start_method=method,
        timeout=None if timeout is None else float(timeout),
        slot_size=slot_size,
        seed=seed,
        seed_given=seed_given,
        max_restarts=max_restarts,
        shipments=shipments,
    )
    resolved.check_spec(options.channel_spec())  # what only the transport knows it cannot do
    return options


def as_bool(value: object) -> bool | None:
    """A True-or-False argument as Python's bool: a bool, or NumPy's (as
    NumPy takes them); None where `value` is anything else (1, "yes")."""
    return bool(value) if isinstance(value, (bool, np.bool_)) else None


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


def _check_picklable(sources: list[Source], runs: list[Source], method: str) -> _startup.Shipments:
    """Each source can reach a `method` producer: pickled with what the
    script defines in it by value (_startup: the producer never imports the
    script), or else by reference, for a producer that imports the script.
    `runs[i]` is what producer i runs (sources[i], or a wrapper of it): what
    is pickled. Returns the pickles made (the launcher ships them)."""
    from shmpipe import _startup

    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    interactive = main_file is None
    shipments = _startup.Shipments()  # by identity: [make_batches] * 16 is pickled once
    why_not: dict[int, str | None] = {}
    for i, (s, run) in enumerate(zip(sources, runs, strict=True)):
        if id(s) not in why_not:
            shipped = shipments.ship(run)
            why_not[id(s)] = shipped if isinstance(shipped, str) else None
        if why_not[id(s)] is None:
            continue  # travels without the script
        if main_file is not None and not os.path.exists(main_file):
            # multiprocessing re-imports __main__ from its file in such a producer
            raise ShmpipeValueError(
                f"source {i} ({s!r}) needs the main module in its producer ({why_not[id(s)]}), and the main "
                f"module's file {main_file!r} does not exist (a script read from stdin?), so {method!r} "
                "producer processes cannot start; run the script from a file, or pass start_method='fork'"
            )
        module = getattr(s, "__module__", None) or type(s).__module__
        if interactive and module == "__main__":
            # Pickled by reference to __main__, which a fresh producer process
            # cannot import when __main__ is a notebook or an interactive shell.
            raise ShmpipeTypeError(
                f"source {i} ({s!r}) is defined in an interactive session and cannot travel to a "
                f"{method!r} producer process without it ({why_not[id(s)]}); move it to a module (a .py "
                "file) and import it from there, or pass start_method='fork' (not safe "
                "once TensorFlow or CUDA have started threads)."
            )
        name = _startup.bound_only_under_the_guard(s, main_file) if main_file and module == "__main__" else None
        if name is not None:
            raise ShmpipeTypeError(
                f"source {i} ({s!r}) needs the script in its producer ({why_not[id(s)]}), and the script "
                f"{main_file!r} defines {name} only under `if __name__ == \"__main__\":`, which a {method!r} "
                "producer process, importing the script, does not run: define it at the script's top level, "
                "above the guard, or in a module of its own"
            )
        try:
            ForkingPickler.dumps(s)
        except Exception as exc:
            raise ShmpipeTypeError(
                f"source {i} ({s!r}) cannot be pickled, which a {method!r} producer process "
                f"needs: {exc}. Define it at the top level of an importable module (not a "
                "lambda or a nested function), or wrap such a function in functools.partial."
            ) from exc
    return shipments
