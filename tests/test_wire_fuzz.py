"""Hypothesis fuzz of two more channels another process writes: the queue
transport's frames (a producer's pipe, or a process that opened it through
/proc) and the group's messages (rank 0 to a rank, a rank to rank 0, and a
hello from anyone of the user). Whatever the bytes, the reader gives whole
frames or messages, or the one error of its kind (CorruptChannelError, a
GroupError): never another exception, never a wrong frame.

(The ring's payloads, the arrow metadata and the control messages have
their fuzzers in test_codec_fuzz.py, test_arrow_fuzz.py and
test_control_fuzz.py.)"""

from __future__ import annotations

import collections
import json
import os
import socket
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmpipe import _codec
from shmpipe._group import _wire
from shmpipe.errors import CorruptChannelError, GroupError, ShmpipeError
from shmpipe.transports.queue import HEADER, KIND_BATCH, KIND_END, MAGIC, _Inbound, _Pieces

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- the queue transport's frames ----------------------------------------------------


def _feed(chunks: list[bytes]) -> tuple[list[Any], BaseException | None]:
    """Writes `chunks` one by one into a pipe, reading after each as the
    consumer does; returns the frames read and the error that ended it."""
    r, w = os.pipe2(os.O_NONBLOCK)
    box = _Inbound(r, 2)
    arrived: collections.deque[Any] = collections.deque()
    try:
        for chunk in chunks:
            if chunk:
                os.write(w, chunk)
            try:
                box.read(arrived)
            except CorruptChannelError as exc:
                # Corrupt once, corrupt for good: the next read says so again.
                with pytest.raises(CorruptChannelError):
                    box.read(arrived)
                return list(arrived), exc
        return list(arrived), None
    finally:
        os.close(r)
        os.close(w)


def _cut(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    bounds = [0, *points, len(stream)]
    return [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _body(frame: Any) -> bytes | None:
    payload = frame[3]
    if payload is None:
        return None
    if isinstance(payload, _Pieces):
        payload = payload.whole()
    return bytes(payload)


_batches = st.lists(
    st.one_of(
        st.binary(max_size=2048).map(lambda b: np.frombuffer(b, np.uint8).copy()),
        st.integers(0, 300).map(lambda n: {"x": np.arange(n, dtype=np.float32), "n": n}),
    ),
    max_size=6,
)


@FUZZ
@given(
    batches=_batches,
    passes=st.lists(st.integers(0, 5), min_size=6, max_size=6),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=12),
)
def test_queue_real_frames_however_cut_arrive_whole_and_exact(batches, passes, cuts):
    frames = []
    stream = b""
    for batch, pass_no in zip(batches, passes, strict=False):
        body = bytes(_codec.encode(batch))
        frames.append((KIND_BATCH, pass_no, body))
        stream += HEADER.pack(MAGIC, KIND_BATCH, pass_no, len(body)) + body
    frames.append((KIND_END, passes[-1], None))
    stream += HEADER.pack(MAGIC, KIND_END, passes[-1], 0)
    got, error = _feed(_cut(stream, cuts))
    assert error is None
    assert [(f[1], f[2], _body(f)) for f in got] == frames
    for (kind, _, body), frame in zip(frames, got, strict=True):
        if kind == KIND_BATCH:
            decoded = _codec.decode(_aligned(body))
            again = _codec.decode(_aligned(_body(frame)))
            assert _codec.encode(decoded).tobytes() == _codec.encode(again).tobytes()


def _aligned(data: bytes) -> np.ndarray:
    buf = _codec.aligned_empty(len(data))
    buf[:] = np.frombuffer(data, np.uint8)
    return buf


@FUZZ
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 1 << 13), max_size=8), prefix=st.booleans())
def test_queue_any_byte_stream_is_frames_or_one_clear_error(data, cuts, prefix):
    """Random bytes (after one real frame, half the time): whole frames with a
    valid header, or CorruptChannelError; each batch frame's body then
    decodes to a batch or a CorruptChannelError."""
    head = HEADER.pack(MAGIC, KIND_END, 1, 0) if prefix else b""
    got, _error = _feed(_cut(head + data, cuts))
    for worker, kind, pass_no, _payload in got:
        assert worker == 2 and kind in (KIND_BATCH, KIND_END) and pass_no >= 0
    for frame in got:
        body = _body(frame)
        if body is None:
            continue
        try:
            _codec.decode(_aligned(body))
        except CorruptChannelError:
            pass


@FUZZ
@given(
    magic=st.sampled_from([MAGIC, b"SPQ1", b"\x00" * 4]),
    kind=st.integers(0, 255),
    pass_no=st.integers(-(1 << 63), (1 << 63) - 1),
    nbytes=st.integers(0, (1 << 64) - 1),
)
def test_queue_any_header_is_taken_only_when_it_is_sound(magic, kind, pass_no, nbytes):
    got, error = _feed([HEADER.pack(magic, kind, pass_no, nbytes)])
    sound = magic == MAGIC and kind in (KIND_BATCH, KIND_END) and (kind == KIND_BATCH or nbytes == 0)
    if not sound:
        assert isinstance(error, CorruptChannelError) and got == []
    elif kind == KIND_END:
        assert error is None and got == [(2, KIND_END, pass_no, None)]


# -- the group's messages ---------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)

_real_hellos = st.builds(
    lambda rank, fp, pid, proof, restart: [
        "hello",
        rank,
        fp,
        pid,
        None if proof is None else {"proof": proof, "restart": restart},
    ],
    st.integers(-2, 1 << 32),
    st.dictionaries(st.text(max_size=12), st.none() | st.integers() | st.text(max_size=12) | st.booleans(), max_size=6),
    st.integers(-2, 1 << 23),
    st.none() | st.text(alphabet="0123456789abcdef", min_size=60, max_size=66),
    st.none() | st.integers(-2, 1 << 32),
)


@FUZZ
@given(message=st.one_of(_real_hellos, st.lists(_json, min_size=1, max_size=7).map(lambda m: ["hello", *m[1:]])))
def test_a_hello_is_a_hello_or_a_group_error(message):
    try:
        hello = _wire.parse_hello(message)
    except GroupError as exc:
        assert len(str(exc)) < 300  # it says which field, briefly
        return
    assert type(hello.rank) is int and 0 <= hello.rank and type(hello.pid) is int and hello.pid > 0
    assert type(hello.fingerprint) is dict
    assert hello.proof is None or (type(hello.proof) is str and len(hello.proof) == 64)


_real_errors = st.one_of(
    st.tuples(
        st.just("worker_died"),
        st.tuples(
            st.integers(), st.none() | st.integers(), st.none() | st.integers(), st.none() | st.text(),
            st.none() | st.text(),
        ),
    ),
    st.tuples(st.just("worker"), st.tuples(st.integers(), st.none() | st.integers(), st.text(), st.text(), st.text())),
    st.tuples(
        st.sampled_from(["rank_died", "launch", "start", "timeout", "other"]), st.tuples(st.text(), st.integers())
    ),
).map(lambda kv: ["error", kv[0], list(kv[1])])


@FUZZ
@given(message=st.one_of(_real_errors, st.lists(_json, max_size=4).map(lambda m: ["error", *m])))
def test_an_error_message_is_always_a_shmpipe_error_never_a_crash(message):
    exc = _wire.error_from(message)
    assert isinstance(exc, ShmpipeError)
    str(exc)


def _open_ends_of(pipes: set[str]) -> list[int]:
    """This process's descriptors that refer to one of `pipes` (readlink
    names, "pipe:[inode]"). Only these: other threads of the session open
    and close descriptors of their own at any time (a background script's
    output files), so a count of every descriptor is no test."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") in pipes:
                found.append(int(name))
        except FileNotFoundError:  # closed by another thread since the listing
            pass
    return found


@FUZZ
@given(data=st.one_of(st.binary(max_size=512), _json.map(lambda v: json.dumps(v).encode())),
       n_fds=st.integers(0, _wire.MAX_FDS + 2))
def test_a_datagram_is_a_message_or_a_group_error(data, n_fds):
    """What recv gives: a non-empty list whose first item is a str, the end
    of the connection (None), or a GroupError; the descriptors a datagram
    carries are handed over with a message, or closed, never left open
    (more than MAX_FDS of them is a GroupError)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        ends = [end for _ in range(n_fds) for end in os.pipe()]
        sent = ends[0::2]
        try:
            pipes = {os.readlink(f"/proc/self/fd/{fd}") for fd in sent}
            socket.send_fds(a, [data], sent)
        finally:
            for fd in ends:
                os.close(fd)
        got: list[int] = []
        try:
            message, got = _wire.recv(b)
        except GroupError:
            pass
        except BlockingIOError:
            assert not data
        else:
            if message is None:
                assert got == [] and not data
            else:
                assert type(message) is list and message and type(message[0]) is str
                assert len(got) == n_fds <= _wire.MAX_FDS
        handed = set(got)
        try:
            assert set(_open_ends_of(pipes)) == handed  # every other one was closed by recv
        finally:
            for fd in got:
                os.close(fd)
