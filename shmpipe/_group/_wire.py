"""The group's wire: how rank 0 and the ranks talk.

SOCK_SEQPACKET in the abstract namespace (the address is named from the uid
and the group). Each message is one datagram, sent whole by one sendmsg, so
threads (a batch's release runs in whichever thread drops it) send without
a lock and a message never interleaves with another. A message is a JSON
array whose first element names it (never pickle: a peer's bytes choose no
code to run), with descriptors as SCM_RIGHTS beside it. Both ends check
with SO_PEERCRED that the other runs as the same user: the abstract
namespace has no permissions.

Messages (rank -> rank 0): ``["hello", rank, fingerprint, pid]``,
``["begin", pass]``, ``["release", token]``, ``["bye"]``.
(rank 0 -> rank): ``["ready", seed]`` (the pipeline's seed), ``["ring", share]`` + the ring's
descriptor, ``["batch", pass, token, record, worker, nbytes]`` (+ a
descriptor for a batch larger than a slot), ``["end", pass, dropped]``,
``["error", kind, args]``.

Everything read here is untrusted: a malformed message is a GroupError,
never a TypeError from deep inside, and an error message builds only
shmpipe's own exceptions from values of the types they expect.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

from shmpipe import _fdpass
from shmpipe._group._options import GroupOptions
from shmpipe._options import PipelineOptions
from shmpipe.errors import (
    GroupError,
    GroupStartError,
    PipelineTimeoutError,
    RankDiedError,
    ShmpipeError,
    WorkerDiedError,
    WorkerError,
)

__all__ = [
    "MALFORMED",
    "MAX_ERROR_BYTES",
    "encode",
    "error_from",
    "error_message",
    "expect",
    "fingerprint",
    "peer",
    "recv",
    "send",
    "send_quietly",
    "socket_address",
]

#: The largest message. Each receive allocates this much, so it stays small
#: (below malloc's mmap threshold). Every message but an error is a few
#: hundred bytes; an error's texts are clipped until its *encoded* form fits
#: (JSON writes a non-ASCII character as up to 12 bytes: clipping characters
#: is not enough).
MAX_MESSAGE = 1 << 16
MAX_ERROR_BYTES = MAX_MESSAGE // 2
_MAX_TEXT = 12_000
MAX_FDS = 4
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
#: What a malformed message from a peer can raise while it is taken apart
#: (beyond the checks made field by field): turned into a GroupError.
MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, OverflowError)


def socket_address(group: str) -> str:
    """The abstract-namespace address of `group` for this user."""
    return f"\0shmpipe-group-{os.getuid()}-{group}"


def encode(message: list[Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def send(sock: socket.socket, message: list[Any], fds: list[int] | None = None) -> None:
    _fdpass.send_fds(sock, encode(message), fds or ())


def send_quietly(sock: socket.socket, message: list[Any], fds: list[int] | None = None) -> bool:
    """send to a peer that may be gone (its end is handled where it is read)."""
    try:
        send(sock, message, fds)
        return True
    except OSError:
        return False


def recv(sock: socket.socket) -> tuple[list[Any] | None, list[int]]:
    """The next message and its descriptors, without waiting; (None, []) at
    the end of the connection; BlockingIOError when there is none. A
    malformed message is a GroupError (its descriptors closed)."""
    flags = socket.MSG_DONTWAIT
    try:
        data, fds, truncated, fds_cut = _fdpass.recv_fds(sock, MAX_MESSAGE, MAX_FDS, flags)
    except ConnectionResetError:
        # The peer closed with messages of ours unread: the kernel reports
        # that (once) before the messages it sent us that are still queued.
        # They count (rank 0 sends "end" and then may close), so read on.
        try:
            data, fds, truncated, fds_cut = _fdpass.recv_fds(sock, MAX_MESSAGE, MAX_FDS, flags)
        except ConnectionResetError:
            return None, []
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        if truncated or fds_cut:
            raise GroupError("a group message was larger than allowed (the peer is broken)")
        try:
            message = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: a deeply nested array
            raise GroupError("a group message is not JSON (the peer is broken)") from None
        if not isinstance(message, list) or not message or not isinstance(message[0], str):
            raise GroupError(f"a malformed group message: {data[:80]!r}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (SO_PEERCRED)."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def fingerprint(options: PipelineOptions, group: GroupOptions, batches: dict[str, Any]) -> dict[str, Any]:
    """What every rank of a group must agree on (each passes its own
    arguments; a rank with other ones is a mistake to report, not to
    paper over). `batches`: the schedule's part (Schedule.fingerprint)."""
    return {
        "num_ranks": group.num_ranks,
        "sources": options.num_workers,
        "transport": options.transport.name,
        "ordered": options.ordered,
        "capacity": options.capacity,
        "batches": batches,
    }


# -- errors ---------------------------------------------------------------------


def error_message(exc: BaseException) -> list[Any]:
    """An exception as an "error" message every rank turns back into one.
    Long texts (a deep traceback, a huge message) are clipped until the
    message's encoded form fits in MAX_ERROR_BYTES: a message too large to
    send would be lost, and the ranks would learn only that the group ended."""
    message = _error_message_unclipped(exc)
    limit = _MAX_TEXT
    while True:
        args = [_clip(a, limit) for a in message[2]]
        clipped = [message[0], message[1], args]
        if len(encode(clipped)) <= MAX_ERROR_BYTES:
            return clipped
        if limit == 0:  # not the texts (a bug): say at least what failed
            return ["error", "group", [f"rank 0's pipeline failed: {type(exc).__name__} (its message was too large)"]]
        limit //= 4


def _clip(value: Any, limit: int) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + " [...]"
    return value


def _error_message_unclipped(exc: BaseException) -> list[Any]:
    if isinstance(exc, WorkerDiedError):
        return ["error", "worker_died", list(exc.__reduce__()[1])]
    if isinstance(exc, WorkerError):
        return ["error", "worker", list(exc.__reduce__()[1])]
    if isinstance(exc, RankDiedError):
        return ["error", "rank_died", [str(exc), exc.rank]]
    if isinstance(exc, GroupStartError):
        return ["error", "start", [str(exc)]]
    if isinstance(exc, PipelineTimeoutError):
        return ["error", "timeout", [str(exc)]]
    return ["error", "group", [f"rank 0's pipeline failed: {type(exc).__name__}: {exc}"]]


def error_from(message: list[Any]) -> ShmpipeError:
    """The exception an "error" message describes: only shmpipe's own
    classes, built from plain values of the types they expect (a malformed
    message is a GroupError that says so)."""
    try:
        _, kind, args = message
        if not isinstance(args, list):
            raise TypeError("arguments are not a list")
        if kind == "worker_died":
            worker, pid, exitcode, reason = args
            expect(worker, int)
            expect(pid, int, None)
            expect(exitcode, int, None)
            expect(reason, str, None)
            return WorkerDiedError(worker, pid, exitcode, reason)
        if kind == "worker":
            worker, pid, exc_type, text, remote_traceback = args
            expect(worker, int)
            expect(pid, int, None)
            expect(exc_type, str)
            expect(text, str)
            expect(remote_traceback, str)
            return WorkerError(worker, pid, exc_type, text, remote_traceback)
        (text, *rest) = args
        expect(text, str)
        if kind == "rank_died":
            (rank,) = rest
            expect(rank, int)
            return RankDiedError(text, rank)
        if kind == "start":
            return GroupStartError(text)
        if kind == "timeout":
            return PipelineTimeoutError(text)
        return GroupError(text)
    except MALFORMED:
        return GroupError(f"rank 0 reported an error in a malformed message: {message!r:.200}")


def expect(value: Any, *types: type | None) -> None:
    """`value` is exactly of one of `types` (None: is None; bool is not an int)."""
    if not any(value is None if t is None else type(value) is t for t in types):
        raise TypeError(f"{value!r:.40} is not {types}")
