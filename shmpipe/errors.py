"""Every error shmpipe raises.

All of them derive from :class:`ShmpipeError` and from the builtin exception
that matches their meaning, so ``except TypeError`` and ``except TimeoutError``
work as they would anywhere else::

    ShmpipeError
    ├── ShmpipeTypeError(TypeError)
    │   └── BatchTypeError            a batch holds something shmpipe cannot carry
    ├── ShmpipeValueError(ValueError)
    │   ├── BatchTooLargeError        a batch does not fit in a slot
    │   └── CorruptChannelError       what another process wrote breaks the protocol
    ├── SharedMemoryFullError(OSError)  /dev/shm has no room for the ring
    ├── SegmentExistsError(FileExistsError)  a named segment's name is taken already
    ├── DescriptorLimitError(OSError)  ulimit -n leaves too few file descriptors
    ├── TransportUnavailableError(ImportError)  a transport's dependency is missing
    ├── PipelineTimeoutError(TimeoutError)
    ├── PipelineClosedError(RuntimeError)
    ├── WorkerError(RuntimeError)     a producer raised
    │   └── WorkerDiedError           a producer was killed or exited early
    └── GroupError(RuntimeError)      a group of ranks sharing one pipeline failed
        ├── GroupStartError           the ranks did not all join (or disagree)
        │   └── GroupLaunchError      this process is of another launch than the group
        └── RankDiedError             a rank of the group died or left mid-pass

    ShmpipeWarning(UserWarning)       something works, but slower than it should
"""

from __future__ import annotations

import errno as _errno
import numbers as _numbers
import operator as _operator
import signal as _signal
import sys as _sys
import warnings
from typing import Any

__all__ = [
    "ShmpipeError",
    "ShmpipeTypeError",
    "ShmpipeValueError",
    "BatchTypeError",
    "BatchTooLargeError",
    "CorruptChannelError",
    "SharedMemoryFullError",
    "SegmentExistsError",
    "DescriptorLimitError",
    "TransportUnavailableError",
    "PipelineTimeoutError",
    "PipelineClosedError",
    "WorkerError",
    "WorkerDiedError",
    "GroupError",
    "GroupStartError",
    "GroupLaunchError",
    "RankDiedError",
    "Cancelled",
    "Closed",
    "ShmpipeWarning",
]


class ShmpipeError(Exception):
    """Base class of every error shmpipe raises."""


class ShmpipeTypeError(ShmpipeError, TypeError):
    """An argument of the wrong type (an unpicklable source, say)."""


class ShmpipeValueError(ShmpipeError, ValueError):
    """An argument with a value shmpipe cannot use."""


def as_int(value: object) -> int | None:
    """An integer argument as a Python int: an int, a NumPy integer (any
    ``numbers.Integral``), as NumPy's own arguments take them (``np.int64(32)``
    for batch_size); None where `value` is not one, or is a bool (True is
    no count of anything). What an argument holds is that int, never the
    value given (a NumPy scalar in a state, a pickle, a JSON file)."""
    # (Integral first: NumPy 1.26's bool answers operator.index, with a
    # DeprecationWarning; it is no Integral, in any NumPy)
    if isinstance(value, bool) or not isinstance(value, _numbers.Integral):
        return None
    return _operator.index(value)


def is_real(value: object) -> bool:
    """Whether an argument is a real number: an int or a float, NumPy's
    too, never a bool."""
    return isinstance(value, _numbers.Real) and not isinstance(value, bool)


def out_of_range(message: str, value: object, *, number: bool = False) -> ShmpipeError:
    """The error for an argument that `message` says must be an int (with
    `number`: a real number) in some range: a ShmpipeTypeError where `value`
    is not one at all (a str, a float for an int, a bool), as Python and
    NumPy answer a wrong type; a ShmpipeValueError where it is one, out of
    range."""
    right_type = is_real(value) if number else as_int(value) is not None
    return ShmpipeValueError(message) if right_type else ShmpipeTypeError(message)


class BatchTypeError(ShmpipeTypeError):
    """A batch holds a value shmpipe cannot carry.

    ``path`` says where, as Python source (``batch["x"][2]``).
    """

    def __init__(self, message: str, path: str = "batch") -> None:
        super().__init__(f"{path}: {message}")
        self.message = message
        self.path = path

    def __reduce__(self) -> tuple[type[Any], tuple[Any, ...]]:
        return (type(self), (self.message, self.path))


class BatchTooLargeError(ShmpipeValueError):
    """A batch needs more bytes than a slot has."""

    def __init__(self, nbytes: int, slot_size: int) -> None:
        super().__init__(
            f"a batch of {nbytes:,} bytes (arrays plus their layout) does not fit in a slot "
            f"of {slot_size:,} bytes; pass slot_size={_round_mib(nbytes)} (or more) to "
            "shmpipe.from_iterators to raise the limit"
        )
        self.nbytes = nbytes
        self.slot_size = slot_size

    def __reduce__(self) -> tuple[type[Any], tuple[Any, ...]]:
        return (type(self), (self.nbytes, self.slot_size))


def _round_mib(nbytes: int) -> str:
    mib = -(-nbytes // (1 << 20))
    return f"{mib} << 20" if mib > 1 else "1 << 20"


class CorruptChannelError(ShmpipeValueError):
    """What another process wrote into a channel breaks its protocol: the
    ring's memory (a header, a slot's record, a payload), a queue's pipe
    frame, a batch's descriptor or its count, a record dealt to a rank, a
    producer's control message.
    Never anything but this error (or a clear one of its kin): bytes from
    another process are untrusted. Formerly CorruptSegmentError, which
    stays as a deprecated alias."""


def users_stacklevel() -> int:
    """warnings.warn's stacklevel, in its caller, of the first frame that is
    not shmpipe's: the user's line (that made the pipeline, or asked for
    the batch), however many of shmpipe's calls lie between."""
    frame = _sys._getframe(1)
    level = 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "shmpipe":
        frame = frame.f_back
        level += 1
    return level


_DEPRECATED = {"CorruptSegmentError": ("CorruptChannelError", CorruptChannelError)}


def deprecated(name: str, module: str, stacklevel: int = 2) -> Any:
    """The value of the deprecated `name`, after a DeprecationWarning that
    gives the new one (at the user's line: `stacklevel` above the caller's
    __getattr__). AttributeError for a name that is not deprecated."""
    if name not in _DEPRECATED:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new, value = _DEPRECATED[name]
    warnings.warn(f"shmpipe.{name} is deprecated: use shmpipe.{new}", DeprecationWarning, stacklevel=stacklevel + 1)
    return value


def __getattr__(name: str) -> Any:
    """The deprecated names, with a DeprecationWarning that gives the new one."""
    return deprecated(name, __name__)


class SharedMemoryFullError(ShmpipeError, OSError):
    """There is no room for the ring: in /dev/shm (named segments), or in
    the memory that backs anonymous shared memory (RAM and the cgroup's
    limit); or for a batch larger than a slot (its memory, or the address
    space to map it). The message names the bytes needed and free, and what
    to change."""

    def __init__(
        self, needed: int, available: int, where: str = "/dev/shm", what: str | None = None, fix: str | None = None
    ) -> None:
        # `what` needs the memory (the ring by default) and `fix` is what to
        # change (by default: the ring's settings, and what backs it).
        if fix is not None:
            advice = fix
        elif where == "/dev/shm" or where.startswith("/"):
            advice = "lower capacity or slot_size, free space there, or enlarge it (docker run --shm-size=...)"
        else:
            advice = (
                "lower capacity or slot_size, or give the process more memory "
                "(its cgroup's memory.max, docker run --memory=...)"
            )
        OSError.__init__(
            self,
            _errno.ENOSPC,
            f"{what or 'the ring'} needs {needed:,} bytes of shared memory but {where} has {available:,} "
            f"bytes free; {advice}",
        )
        self.needed = needed
        self.available = available
        self.where = where
        self.what = what
        self.fix = fix

    def __reduce__(self) -> tuple[type[Any], tuple[Any, ...]]:
        return (type(self), (self.needed, self.available, self.where, self.what, self.fix))


class DescriptorLimitError(ShmpipeError, OSError):
    """The pipeline needs more file descriptors than this process's limit
    (``ulimit -n``, RLIMIT_NOFILE) leaves: raised before any producer
    starts, naming the limit, what the pipeline needs and how to raise it."""

    def __init__(self, needed: int, limit: int, hard: int, in_use: int, producers: int) -> None:
        raise_to = max(needed, 1024)
        how = (
            f"raise it with `ulimit -n {raise_to}` in the shell that starts the job, or "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({raise_to}, {hard if hard >= raise_to else raise_to})) "
            "at the top of the script"
            + ("" if hard >= raise_to else f" (the hard limit is {hard}: raising it needs root or the container's "
               "--ulimit nofile=...)")
            + ", or start fewer producers"
        )
        OSError.__init__(
            self,
            _errno.EMFILE,
            f"this pipeline of {producers} producers needs about {needed} file descriptors in this process "
            f"({in_use} open already), but its limit (ulimit -n) is {limit}; {how}",
        )
        self.needed = needed
        self.limit = limit
        self.hard = hard
        self.in_use = in_use
        self.producers = producers

    def __reduce__(self) -> tuple[type[Any], tuple[Any, ...]]:
        return (type(self), (self.needed, self.limit, self.hard, self.in_use, self.producers))


class SegmentExistsError(ShmpipeError, FileExistsError):
    """A named segment (``backing="posix"``) could not be created: each
    fresh name shmpipe drew for it was taken in /dev/shm already. Names
    carry 96 random bits, so this is no accident of chance: another process
    of this user made segments under shmpipe's names. shmpipe fails closed:
    it never opens, truncates or removes a segment it did not create.
    ``names`` are the names that were taken."""

    def __init__(self, names: list[str], where: str = "/dev/shm") -> None:
        FileExistsError.__init__(
            self,
            _errno.EEXIST,
            f"cannot create the ring's shared-memory segment: {where}{names[-1]} already exists "
            f"({len(names)} fresh random name{'s' if len(names) > 1 else ''} tried, each one taken: "
            "another process of this user is making segments under shmpipe's names); it was left "
            "untouched. The default backing, anonymous memory, has no name to take",
        )
        self.names = list(names)
        self.where = where

    def __reduce__(self) -> tuple[type[Any], tuple[Any, ...]]:
        return (type(self), (self.names, self.where))


class TransportUnavailableError(ShmpipeError, ImportError):
    """A transport cannot be used here; the message says what to install."""


class PipelineTimeoutError(ShmpipeError, TimeoutError):
    """No batch (or no free slot) arrived within the timeout."""


class PipelineClosedError(ShmpipeError, RuntimeError):
    """The pipeline was closed, or stopped after an error."""


def type_name(exc: BaseException) -> str:
    """What WorkerError.exc_type says of `exc`: its type's module and
    qualified name (``builtins.ValueError``), whichever process raised it."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


class WorkerError(ShmpipeError, RuntimeError):
    """A producer raised an exception.

    ``worker_id`` is the producer's index (-1: this process itself, which
    fetches a fresh from_dataset pipeline's first batches while its
    producers start; the exception is then the ``__cause__``), ``pid`` its process id,
    ``exc_type`` the qualified name of the exception it raised and
    ``remote_traceback`` the formatted traceback from the producer process.
    """

    def __init__(
        self,
        worker_id: int,
        pid: int | None,
        exc_type: str,
        message: str,
        remote_traceback: str,
    ) -> None:
        if worker_id >= 0:
            who = f"worker {worker_id} (pid {pid})"
        elif pid is not None:
            who = f"the trainer (pid {pid}), fetching a first batch itself while the producers started,"
        else:
            who = "a producer"
        text = f"{who} raised {exc_type}: {message}"
        if remote_traceback:
            text += "\n\nRemote traceback:\n" + remote_traceback.rstrip()
        super().__init__(text)
        self.worker_id = worker_id
        self.pid = pid
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[type[Any], tuple[Any, ...]]:
        return (
            type(self),
            (self.worker_id, self.pid, self.exc_type, self.message, self.remote_traceback),
        )


class WorkerDiedError(WorkerError):
    """A producer ended without being asked to.

    ``exitcode`` is its exit status when it exited, ``signal`` the signal
    number when a signal killed it; both are None when the transport only
    knows that it died (a Ray actor), and ``reason`` says what it knows.
    ``note`` is what the pipeline adds (the producers replaced before it
    under ``max_restarts``, or why its replacement did not start), also at
    the end of the message; None where it adds nothing.
    """

    def __init__(
        self, worker_id: int, pid: int | None, exitcode: int | None, reason: str | None = None,
        note: str | None = None,
    ) -> None:
        sig: int | None = None
        code: int | None = None
        if reason is not None:
            how = f"died: {reason}"
        elif exitcode is not None and exitcode < 0:
            sig = -exitcode
            try:
                how = f"was killed by signal {_signal.Signals(sig).name}"
            except ValueError:
                how = f"was killed by signal {sig}"
            if sig == _signal.SIGSEGV:
                how += (
                    " (a crash in native code, or a write through a view of a reserve()d array kept past "
                    "its batch's yield: the batch was the consumer's by then, and its memory read-only "
                    "in the producer)"
                )
        else:
            code = exitcode
            how = f"exited early with exit code {exitcode}"
        ShmpipeError.__init__(self, f"worker {worker_id} (pid {pid}) {how}" + (f"; {note}" if note else ""))
        self.worker_id = worker_id
        self.pid = pid
        self.exc_type = "WorkerDied"
        self.message = str(self)
        self.remote_traceback = ""
        self.exitcode = code
        self.signal = sig
        self.reason = reason
        self.note = note

    def add_pipeline_note(self, note: str) -> None:
        """Ends the message with `note`, what the pipeline adds to the death
        (the producers replaced before it, a replacement that did not
        start), kept where the error is pickled or sent to a group's ranks.
        (Python 3.10 has no add_note, and a note would not travel.)"""
        self.note = f"{self.note}; {note}" if self.note else note
        self.args = (f"{self.args[0]}; {note}",)
        self.message = str(self)

    def __reduce__(self) -> tuple[type[Any], tuple[Any, ...]]:
        exitcode = -self.signal if self.signal else self.exitcode
        args = (self.worker_id, self.pid, exitcode, self.reason)
        # The note only where there is one: such a pickle loads in versions before notes too.
        return (type(self), args if self.note is None else (*args, self.note))


class GroupError(ShmpipeError, RuntimeError):
    """A group of ranks sharing one pipeline (``from_iterators(group=...)``)
    cannot go on; every rank of the group gets one."""


class GroupStartError(GroupError):
    """The ranks of a group did not all join within the start-up timeout
    (the message names the missing ones), or they disagree on the group."""


class GroupLaunchError(GroupStartError):
    """The group this process tried to join is of another launch: its rank
    0 runs under another torchrun run id, rendezvous address or restart
    count, or another ``run_id=``, than this process (one left over from an
    earlier run or restart, or a second job given the same group name). The
    message shows each launch's tag, a digest that reveals no id. The group
    goes on without this process. See docs/several-ranks.md, "Which
    processes may join"."""


class RankDiedError(GroupError):
    """A rank of the group died (or closed its pipeline mid-pass): the other
    ranks cannot stay in step, so none goes on. ``rank`` is the rank."""

    def __init__(self, message: str, rank: int = -1) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[type[Any], tuple[Any, ...]]:
        return (type(self), (str(self), self.rank))


class Cancelled(ShmpipeError):
    """Producer side: the consumer started another pass; abandon this one.
    (Re-exported by shmpipe.transport, whose contract it belongs to.)"""


class Closed(ShmpipeError):
    """Producer side: the pipeline is shutting down; stop. (Re-exported by
    shmpipe.transport.)"""


class ShmpipeWarning(UserWarning):
    """Something works, but not as well as it could (a copy where there
    should be none, an option without effect)."""
