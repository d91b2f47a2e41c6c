"""The group's wire: how rank 0 and the ranks talk.

SOCK_SEQPACKET in the abstract namespace (the address is named from the uid
and the group). Each message is one datagram, sent whole by one sendmsg, so
threads (a batch's release runs in whichever thread drops it) send without
a lock and a message never interleaves with another. A message is a JSON
array whose first element names it (never pickle: a peer's bytes choose no
code to run), with descriptors as SCM_RIGHTS beside it. Both ends check
with SO_PEERCRED that the other runs as the same user: the abstract
namespace has no permissions.

Messages (rank -> rank 0): ``["hello", rank, fingerprint, pid, launch]``
(launch: null, or ``{"proof": 64 hex digits, "restart": int or null}``),
``["begin", pass, start]`` (start: where the rank's count of a dataset's
pass begins, DatasetSchedule.start_point, or null), ``["taken", pass]`` (it read the pass's "end", and
its trainer asks past its last batch), ``["release", token]``,
``["bye", pass, had]`` (the pass it is in, and how many batches of it its
trainer had).
(rank 0 -> rank): ``["ready", seed]`` (the pipeline's seed), ``["ring", share]`` + the ring's
descriptor, ``["batch", pass, token, record, worker, nbytes]`` (+ a
descriptor for a batch larger than a slot), ``["end", pass, dropped]``,
``["complete", pass]`` (every rank is past that pass), ``["error", kind, args]``.

Everything read here is untrusted: a malformed message is a GroupError,
never a TypeError from deep inside, and an error message builds only
shmpipe's own exceptions from values of the types they expect. A hello is
checked field by field (types, sizes, nesting) by parse_hello before the
leader looks at any of it.

A launch's id never travels: a hello carries its proof (an HMAC of the
group's name keyed by the id), and a message shows only the proof's tag (a
digest of the proof, 8 hex digits): the tag tells a user whether two
launches differ, and gives a stray that reads it nothing to join with.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import struct
from dataclasses import dataclass
from typing import Any

from shmpipe import _fdpass
from shmpipe._group._options import GroupOptions, Launch
from shmpipe._options import PipelineOptions
from shmpipe.errors import (
    GroupError,
    GroupLaunchError,
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
    "WIRE",
    "Hello",
    "describe_launch",
    "encode",
    "error_from",
    "error_message",
    "expect",
    "fingerprint",
    "fingerprint_differences",
    "hello",
    "is_start",
    "launch_proof",
    "launch_tag",
    "parse_hello",
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
#: The messages' version, in every hello's fingerprint: 2 since a "begin"
#: carries the rank's start point.
WIRE = 2
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


# -- the hello ------------------------------------------------------------------

#: A proof: hex of a SHA-256 HMAC.
_PROOF = re.compile(r"[0-9a-f]{64}")
#: What a fingerprint may hold (it is compared, and shown clipped, so its
#: size and nesting are bounded before either): the arguments are a dict of
#: scalars and one dict of scalars (the schedule's).
_FINGERPRINT_KEYS = 32
_FINGERPRINT_TEXT = 1024  # a sampler's module and qualname, a transport's name
_FINGERPRINT_DEPTH = 2
_PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT
_INT_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Hello:
    """A hello whose every field has the type and size it should (what
    parse_hello returns); whether its values suit the group is the
    leader's to judge."""

    rank: int
    fingerprint: dict[str, Any]
    pid: int
    proof: str | None
    restart: int | None


def launch_proof(group: str, launch: Launch | None) -> str | None:
    """What a rank shows of its launch: an HMAC of the group's name keyed by
    the launch's id. Keyed, so the hello does not carry the id (a user's
    token stays in its process); of the group's name, so a hello heard by
    another group's leader is no proof for any other group."""
    if launch is None:
        return None
    return hmac.new(launch.run_id.encode(), b"shmpipe-group-launch\0" + group.encode(), hashlib.sha256).hexdigest()


def launch_tag(proof: str | None) -> str:
    """A proof as a message shows it: 8 hex digits of a digest of it (equal
    tags: the same launch), which cannot be turned back into the proof."""
    if proof is None:
        return "none"
    return hashlib.sha256(b"shmpipe-launch-tag\0" + proof.encode()).hexdigest()[:8]


def is_start(value: Any) -> bool:
    """A "begin"'s start point: null, or a short text (only compared with
    rank 0's, and shown clipped)."""
    return value is None or (type(value) is str and len(value) <= 256)


def hello(rank: int, fingerprint: dict[str, Any], group: GroupOptions) -> list[Any]:
    """A rank's hello: its rank, its arguments, its pid and its launch."""
    proof = launch_proof(group.name, group.launch)
    launch = None if proof is None else {"proof": proof, "restart": group.launch.restart if group.launch else None}
    return ["hello", rank, fingerprint, os.getpid(), launch]


def parse_hello(message: list[Any]) -> Hello:
    """`message` (a "hello" from anyone of this user) as a Hello, each field
    checked for its exact type and size before anything else is done with
    it; a GroupError that says which field is wrong otherwise."""
    if len(message) != 5:
        raise GroupError(
            f"a hello of {len(message)} fields, not 5 (a process of another shmpipe version, or not a rank)"
        )
    _, rank, fingerprint_, pid, launch = message
    if type(rank) is not int or not 0 <= rank <= _INT_MAX:
        raise GroupError(f"a hello whose rank is {_shown(rank)}")
    _check_fingerprint(fingerprint_, _FINGERPRINT_DEPTH)
    if type(pid) is not int or not 0 < pid <= _PID_MAX:
        raise GroupError(f"a hello whose pid is {_shown(pid)}")
    proof: str | None = None
    restart: int | None = None
    if launch is not None:
        if type(launch) is not dict or set(launch) != {"proof", "restart"}:
            raise GroupError(f"a hello whose launch is {_shown(launch)}")
        proof, restart = launch["proof"], launch["restart"]
        if type(proof) is not str or not _PROOF.fullmatch(proof):
            raise GroupError(f"a hello whose launch proof is {_shown(proof)}")
        if restart is not None and (type(restart) is not int or not 0 <= restart <= _INT_MAX):
            raise GroupError(f"a hello whose restart count is {_shown(restart)}")
    return Hello(rank, fingerprint_, pid, proof, restart)


def _shown(value: Any) -> str:
    """An untrusted value in a message: a scalar's repr, clipped; of anything
    else its type only (the repr of a deeply nested list can raise
    RecursionError, and a long one is of no use)."""
    if value is None or type(value) in (int, float, bool, str):
        text = repr(value)
        return text if len(text) <= 40 else text[:40] + "..."
    return f"a {type(value).__name__}"


def _check_fingerprint(value: Any, depth: int) -> None:
    """A dict of at most _FINGERPRINT_KEYS str keys whose values are
    scalars (texts of bounded size) or, `depth` levels down, such dicts."""
    if type(value) is not dict or len(value) > _FINGERPRINT_KEYS:
        raise GroupError(f"a hello whose arguments are not a dict of at most {_FINGERPRINT_KEYS} entries")
    for key, item in value.items():
        if len(key) > _FINGERPRINT_TEXT:
            raise GroupError("a hello whose arguments have a key too long")
        if type(item) is dict and depth > 1:
            _check_fingerprint(item, depth - 1)
        elif type(item) is str:
            if len(item) > _FINGERPRINT_TEXT:
                raise GroupError(f"a hello whose argument {key!r:.40} is too long")
        elif item is not None and type(item) not in (int, float, bool):
            raise GroupError(f"a hello whose argument {key!r:.40} is a {type(item).__name__}")


def fingerprint(options: PipelineOptions, group: GroupOptions, batches: dict[str, Any]) -> dict[str, Any]:
    """What every rank of a group must agree on (each passes its own
    arguments; a rank with other ones is a mistake to report, not to
    paper over). `batches`: the schedule's part (Schedule.fingerprint)."""
    return {
        # Every rank speaks the same messages: a rank of another shmpipe
        # shows here ("shmpipe_wire: None vs 2"), not as a malformed message.
        "shmpipe_wire": WIRE,
        "num_ranks": group.num_ranks,
        "sources": options.num_workers,
        "transport": options.transport.name,
        "ordered": options.ordered,
        "capacity": options.capacity,
        "batches": batches,
    }


def describe_launch(proof: str | None, restart: int | None) -> str:
    """A launch as a message shows it: its tag, never its proof or id."""
    if proof is None:
        text = "no launch id (neither run_id= nor torchrun's environment)"
    else:
        text = f"launch {launch_tag(proof)}"
    return text if restart is None else f"{text}, restart {restart}"


def other_launch(
    hello: Hello, pid: int, group: str, proof: str | None, restart: int | None, launch: Launch | None
) -> str | None:
    """Why `hello` is of another launch than group `group`'s (its `proof`
    and `restart`, from `launch`), or None: it is of this one. Shows tags
    only: the group's proof would let the reader join
    (docs/several-ranks.md, "Which processes may join")."""
    same_proof = (hello.proof is None) == (proof is None) and (
        hello.proof is None or hmac.compare_digest(hello.proof, proof or "")
    )
    if same_proof and hello.restart == restart:
        return None
    return (
        f"group {group!r} is of another launch than this process (rank {hello.rank}, pid {pid}): "
        f"it presented {describe_launch(hello.proof, hello.restart)}, the group's is "
        f"{describe_launch(proof, restart)}"
        + (f" (from {launch.source})" if launch is not None else "")
        + ". A rank left over from another run or an earlier restart, or a second job given the same "
        "group name? The group goes on without it; give each job its own group name, or the same "
        "run_id= to every rank of one launch."
    )


def fingerprint_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """The fields of two fingerprints that differ, as "name: theirs vs
    ours" (a schedule's part, "batches", field by field); clipped, since
    a rank's hello is another process's text. Another wire's version is
    another shmpipe's, not an argument: said so, alone."""
    if theirs.get("shmpipe_wire") != ours.get("shmpipe_wire"):
        return (
            f"it runs another shmpipe (wire {theirs.get('shmpipe_wire')!r:.20} vs {ours.get('shmpipe_wire')!r}): "
            "run the same shmpipe on every rank"
        )
    pairs = []
    for key in sorted(set(theirs) | set(ours), key=str):
        a, b = theirs.get(key), ours.get(key)
        if a == b:
            continue
        if key == "batches" and isinstance(a, dict) and isinstance(b, dict):
            pairs += [
                f"{k}: {a.get(k)!r:.60} vs {b.get(k)!r:.60}"
                for k in sorted(set(a) | set(b), key=str)
                if a.get(k) != b.get(k)
            ]
        else:
            pairs.append(f"{key!s:.40}: {a!r:.60} vs {b!r:.60}")
    return "; ".join(pairs[:8]) + (f"; and {len(pairs) - 8} more" if len(pairs) > 8 else "")


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
    if isinstance(exc, GroupLaunchError):  # before its base class
        return ["error", "launch", [str(exc)]]
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
            worker, pid, exitcode, reason, *noted = args  # (no note: four, as before notes)
            note = noted.pop() if len(noted) == 1 else None
            if noted:
                raise TypeError("more than five arguments")
            expect(worker, int)
            expect(pid, int, None)
            expect(exitcode, int, None)
            expect(reason, str, None)
            expect(note, str, None)
            return WorkerDiedError(worker, pid, exitcode, reason, note)
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
        if kind == "launch":
            return GroupLaunchError(text)
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
