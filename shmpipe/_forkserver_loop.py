"""The fork server's own process (Python < 3.12): the standard library's
loop (multiprocessing.forkserver.main), reading what comes on its socket as
input from another process. _forkserver.py starts the process (its command
line calls serve) and talks to it; this module is what runs inside it, and
imports nothing of shmpipe's but _fdpass.

A request is one byte and a start's descriptors (connect_to_new_process:
the child's data pipe's read end, the write ends of its status pipe, of the
server's "alive" pipe and of the resource tracker's pipe, then the child's
own), then the child's data on its pipe. The standard library's loop ends
the server, with a traceback, on a request cut short (a trainer ended
between its connect and its send: a signal handler's sys.exit as it
started a producer, or SIGKILL) or malformed, and waits for ever on one
that never comes; a child whose data was cut short (its trainer ended, or
gave up the start, as it wrote) prints its unpickling error. Here such a
request is dropped, its descriptors closed, and the server serves the next;
such a child ends with exit code 1 and prints nothing: nobody waits for it.
And a server whose trainer was killed removes its socket, and the
trainer's temporary folder it was in, as it ends.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pickle
import signal
import socket
import stat
from collections.abc import Sequence
from multiprocessing import forkserver, reduction, spawn
from typing import Any

from shmpipe import _fdpass

__all__ = ["REQUEST_WAIT_S", "serve"]

#: How long the fork server gives a client that has connected to send its
#: request (one sendmsg, right after its connect): one that has sent nothing
#: by then is dropped, so that a client stuck there (stopped, or not a
#: trainer at all) cannot hold up every later start.
REQUEST_WAIT_S = 5.0


def serve(
    listener_fd: int,
    alive_r: int,
    data: dict[str, Any],
    folder_is_the_trainers: bool = False,
    *,
    preload: Sequence[str] = (),
    booted_fd: int | None = None,
) -> None:
    """The fork server's process, from its command line: imports `preload`,
    says so on `booted_fd` (the "booted" pipe), then runs the fork server's
    loop (the module's docstring says what changes); `folder_is_the_trainers`:
    the folder of the server's socket is one the trainer made
    (_forkserver._temp_dir_made_here), which the server may remove after a
    trainer killed. Two functions the standard library's loop calls are
    replaced to that end, in this process only: a child gets the standard
    library's back as it starts. (Python 3.12 and later run the standard
    library's own command line and loop, without this: _forkserver._ForkServer.)"""
    _preload(preload)
    if booted_fd is not None:
        # A byte, not only the close: a process the preload started may hold
        # a copy of the write end. A trainer gone already: the loop sees it.
        with contextlib.suppress(OSError):
            os.write(booted_fd, b"b")
        os.close(booted_fd)
    stdlib_recvfds, stdlib_serve_one = reduction.recvfds, forkserver._serve_one  # type: ignore[attr-defined]

    def request(sock: socket.socket, size: int) -> list[int]:
        # forkserver.main takes an OSError with errno ECONNABORTED as a
        # request that ended before it was accepted: it closes the
        # connection and serves the next.
        sock.settimeout(REQUEST_WAIT_S)
        try:
            got = _fdpass.recv_fds(sock, 1, size)
        except OSError as exc:  # reset, or nothing within REQUEST_WAIT_S
            raise OSError(errno.ECONNABORTED, f"a start's request did not come: {exc!r}") from exc
        if (
            got.data != bytes([len(got.fds) % 256]) or got.fds_cut or not 4 <= len(got.fds) < size
            or not _start_pipes(got.fds[:4])
        ):
            _fdpass.close_all(got.fds)
            raise OSError(errno.ECONNABORTED, f"a start's request was cut short or malformed: {got.data!r}, "
                                              f"{len(got.fds)} descriptors")
        return got.fds

    def child(child_r: int, fds: list[int], unused_fds: list[int], handlers: dict[Any, Any]) -> int:
        reduction.recvfds, forkserver._serve_one = stdlib_recvfds, stdlib_serve_one  # type: ignore[attr-defined]
        try:
            code: int = stdlib_serve_one(child_r, fds, unused_fds, handlers)
        except (EOFError, pickle.UnpicklingError) as exc:
            if not _raised_by_the_read(exc):
                raise  # by code the unpickling ran (a class's __setstate__): the user's to see
            return 1  # its data cut short: the start was abandoned
        return code

    reduction.recvfds, forkserver._serve_one = request, child  # type: ignore[attr-defined]
    # A server started inside the trainer's _interrupts.no_sigpipe (where the
    # one it asked died that moment) is born with SIGPIPE blocked; its
    # producers, forked from it, must not be.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGPIPE})
    address = _listener_address(listener_fd)
    try:
        forkserver.main(listener_fd, alive_r, [], **data)
    except SystemExit:
        # The standard library's loop raises it at the end of its "alive"
        # pipe, once every process that held the write end has ended: the
        # trainer, and each producer forked from here. A trainer's
        # descriptors close after its exit handlers ran, and those remove its
        # temporary folder, with this socket in it; a trainer killed
        # (SIGKILL, the OOM killer, a preemption) left both, one pymp-*
        # folder in /tmp per trainer. (Python 3.12 and later run the
        # standard library's loop, which leaves them as it is.)
        if address is not None:
            _remove_listener(address, folder_is_the_trainers)
        raise


def _preload(modules: Sequence[str]) -> None:
    """Imports `modules` (one that cannot be imported is left out, as the
    standard library's server does). NumPy's OpenBLAS starts its threads as
    it is imported, and each spins on a core for 2**28 cycles (about 0.1 s)
    before it sleeps, taking it from the trainer and the server itself while
    the first pipeline waits for the server: on 2 cores, the server's preload
    took 283 ms (281 ms of CPU) with the spin, 225 ms (217 ms) without
    (median of 15). So the preload runs with OPENBLAS_THREAD_TIMEOUT=4 (2**4
    cycles), unless the trainer's environment sets it; it is removed before
    the server forks anyone, so the producers' environment is the trainer's
    (their BLAS threads sleep sooner when idle: a wake-up of microseconds
    per call)."""
    quiet = "OPENBLAS_THREAD_TIMEOUT" not in os.environ
    if quiet:
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = "4"
    try:
        for name in modules:
            with contextlib.suppress(ImportError):
                __import__(name)
    finally:
        if quiet:
            del os.environ["OPENBLAS_THREAD_TIMEOUT"]


def _listener_address(listener_fd: int) -> str | None:
    """The path the server's socket is bound to; None where it has none
    (an abstract address) or cannot say."""
    try:
        with socket.socket(fileno=os.dup(listener_fd)) as listener:
            address = listener.getsockname()
    except OSError:
        return None
    return address if isinstance(address, str) and address.startswith("/") else None


def _remove_listener(address: str, with_folder: bool) -> None:
    """Removes the server's socket file; `with_folder`: and its folder, the
    trainer's pymp-*, where now empty (a retired server's socket may still
    be in it: the last of them to end removes it)."""
    with contextlib.suppress(OSError):
        os.unlink(address)  # (gone with its folder where the trainer's exit removed it)
    folder = os.path.dirname(address)
    if with_folder and os.path.basename(folder).startswith("pymp-"):
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # not empty: another server's socket in it still


def _start_pipes(fds: list[int]) -> bool:
    """Whether a request's first four descriptors are what a start sends:
    pipes, the child's data read end, then the write ends of its status
    pipe, of the server's "alive" pipe and of the resource tracker's. The
    server writes the child's pid and exit status on the second: on
    anything else the standard library's loop ends with its OSError."""
    for fd, mode in zip(fds, (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY, os.O_WRONLY), strict=True):
        try:
            is_pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
            access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        except OSError:
            return False
        if not is_pipe or access != mode:
            return False
    return True


#: What the C unpickler says of a stream that ends before the pickle does:
#: nothing at all, or part of one (checked on 3.10 and 3.11 at every cut).
_CUT_SHORT = {(EOFError, "Ran out of input"), (pickle.UnpicklingError, "pickle data was truncated")}


def _raised_by_the_read(exc: BaseException) -> bool:
    """Whether `exc`, an EOFError or an UnpicklingError of a child's start,
    is its data pipe's end before the pickle's (the unpickler's own read, in
    spawn._main: the data was cut short) rather than an error of code the
    unpickling ran (a class's own __setstate__) or of the pickle itself
    ("state is not a dictionary"), which the user must see."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    in_main = tb is not None and tb.tb_frame.f_code is spawn._main.__code__
    return in_main and (type(exc), str(exc)) in _CUT_SHORT
