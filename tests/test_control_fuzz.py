"""Fuzzing the control-message decoder: what a producer sends is untrusted.

Plain random bytes, arbitrary JSON values, and messages shaped like real
ones (the right names, fields of random types and values, any name for an
error's class) go through _control.decode(); byte streams (random, and real
frames with random ones among them) go through a ProducerLink in random pieces.
Whatever comes in, the decoder returns a well-formed message -- every
field of its type and within its bounds, an error only of shmpipe's own
classes -- or raises CorruptChannelError; no other exception. The inbox
never blocks (each read returns at once), reassembles real messages
however they are cut, and reports a broken stream as CorruptChannelError.

SHMPIPE_FUZZ_EXAMPLES=N sets how many examples each test runs, as for
test_codec_fuzz.py; Hypothesis's example database is off.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from multiprocessing.connection import Connection
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmpipe
from shmpipe import _control
from shmpipe.errors import CorruptChannelError

# 200 examples a test in the suite, 2x Hypothesis's default (the suite must
# stay under CI's 10 minutes; see test_codec_fuzz.py); a long run sets more.
EXAMPLES = int(os.environ.get("SHMPIPE_FUZZ_EXAMPLES", "200"))

FUZZ = settings(
    max_examples=EXAMPLES,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: An inbox read must return at once; this is generous for a loaded machine.
READ_S = 1.0

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
#: Values a field might be given: of every JSON type, and the edges of the bounds.
fields = st.one_of(
    json_values,
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, -(2**31), 2**40, 2**40 + 1, 2**63 - 1, 2**63, True, False]),
)
class_names = st.one_of(
    st.sampled_from(sorted(_control.OWN_ERRORS)),
    st.sampled_from(["Cancelled", "Closed", "ShmpipeWarning", "os.system", "builtins.eval", "__import__", ""]),
    st.text(max_size=12),
)


#: Values near and at the edges of each kind of field, of the field's type or not.
_near = {
    str: st.text(max_size=30),
    int: st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63]) | st.integers(),
    type(None): st.none(),
}


@st.composite
def own_args(draw, name: str) -> list[Any]:
    """Arguments for an error of class `name`: mostly one of each of its
    fields' types (at the edges of their bounds), sometimes anything."""
    entry = _control.OWN_ERRORS.get(name)
    if entry is None or draw(st.integers(0, 4)) == 0:
        return draw(st.lists(fields, max_size=6))
    args = [draw(st.one_of(*[_near[t if t is not None else type(None)] for t in types])) for types, _ in entry[1]]
    if draw(st.integers(0, 4)) == 0:  # one too many, or too few
        args = args[:-1] if draw(st.booleans()) else [*args, draw(fields)]
    return args


@st.composite
def shaped_messages(draw) -> Any:
    """Messages with the right names and shapes, and field values of the
    right types (at their edges) or not."""
    kind = draw(st.sampled_from(["need_channel", "error", "error", "error"]))
    if kind == "need_channel":
        size = draw(st.sampled_from([0, 1, _control.MAX_NBYTES, _control.MAX_NBYTES + 1, -1, 2**63]) | fields)
        return ["need_channel", *draw(st.sampled_from([[size], [size], [], [size, size]]))]
    texts = [draw(st.text(max_size=30) if draw(st.integers(0, 9)) else fields) for _ in range(3)]
    own = None
    if draw(st.integers(0, 3)):
        name = draw(class_names)
        own = draw(st.sampled_from([[name, draw(own_args(name))]] * 4 + [[name], draw(fields)]))
    tail = draw(st.sampled_from([[own]] * 8 + [[], [own, own]]))
    return ["error", *texts, *tail]


def check(message: Any) -> None:
    """A decoded message is well-formed, field by field."""
    if isinstance(message, _control.NeedChannel):
        assert type(message.nbytes) is int and 0 <= message.nbytes <= _control.MAX_NBYTES
        return
    assert isinstance(message, _control.ErrorReport)
    assert all(type(v) is str for v in (message.exc_type, message.message, message.traceback))
    if message.own is not None:
        cls = _control.OWN_ERRORS[type(message.own).__name__][0]
        assert type(message.own) is cls and isinstance(message.own, shmpipe.ShmpipeError)
        str(message.own)


def decode_or_corrupt(data: bytes) -> Any:
    try:
        message = _control.decode(data)
    except CorruptChannelError as exc:
        assert "malformed control message" in str(exc)
        return None
    check(message)
    return message


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data):
    decode_or_corrupt(data)


@FUZZ
@given(json_values)
def test_any_json_value(value):
    decode_or_corrupt(json.dumps(value).encode())


@FUZZ
@given(shaped_messages())
def test_messages_shaped_like_real_ones(message):
    decode_or_corrupt(json.dumps(message).encode())


@FUZZ
@given(shaped_messages(), st.data())
def test_real_messages_mutated(message, data):
    raw = bytearray(json.dumps(message).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        if not raw:
            break
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    decode_or_corrupt(bytes(raw))


# -- a producer's real messages round-trip --------------------------------------

texts = st.text(max_size=200)
own_errors = st.one_of(
    st.builds(shmpipe.BatchTypeError, texts, texts),
    st.builds(shmpipe.BatchTooLargeError, st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1)),
    st.builds(shmpipe.SharedMemoryFullError, st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1), texts),
    st.builds(shmpipe.CorruptChannelError, texts),
    st.builds(shmpipe.WorkerDiedError, st.integers(0, 2**31 - 1), st.none() | st.integers(1, 2**31 - 1),
              st.none() | st.integers(-(2**31), 2**31 - 1), st.none() | texts),
    st.builds(shmpipe.RankDiedError, texts, st.integers(-(2**31), 2**31 - 1)),
)


@FUZZ
@given(own_errors, st.text(max_size=2000), st.integers(0, 200_000))
def test_a_producers_error_arrives_as_itself(exc, traceback, padding):
    message = _control.error(exc, traceback + "\U0001f600" * padding)  # up to 12 bytes a character in JSON
    data = _control.encode(message)
    assert len(data) <= _control.MAX_MESSAGE
    report = _control.decode(data)
    check(report)
    assert isinstance(report, _control.ErrorReport)
    assert type(report.own) is type(exc) and report.own.__reduce__()[1] == exc.__reduce__()[1]


# -- the inbox: pieces, never blocking ---------------------------------------------


def frame(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


def read_all(chunks: list[bytes]) -> tuple[list[Any], CorruptChannelError | None, int]:
    """Feeds `chunks` through a socket pair into a ProducerLink, reading after
    each; (messages, the error if the stream broke, bytes left pending)."""
    a, b = socket.socketpair()
    conn = Connection(b.detach())
    inbox = _control.ProducerLink(conn, "worker 0 (pid 1)")
    got: list[Any] = []
    try:
        for chunk in [*chunks, b""]:
            if chunk:
                a.sendall(chunk)
            for _ in range(3):  # a broken stream raises again; whole messages come once
                t0 = time.monotonic()
                try:
                    got += inbox.read()
                except CorruptChannelError as exc:
                    assert "worker 0 (pid 1) sent a malformed control message" in str(exc)
                    return got, exc, inbox.pending()
                finally:
                    assert time.monotonic() - t0 < READ_S, "an inbox read blocked"
        return got, None, inbox.pending()
    finally:
        inbox.close()
        conn.close()
        a.close()


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[i:j] for i, j in zip(edges, edges[1:]) if j > i]


@FUZZ
@given(st.binary(max_size=400), st.lists(st.integers(0, 10_000), max_size=6))
def test_inbox_random_streams(data, cuts):
    got, _, pending = read_all(cut(data, cuts))
    for message in got:
        check(message)
    assert pending <= 4 + _control.MAX_MESSAGE


@FUZZ
@given(
    st.lists(st.one_of(st.builds(_control.need_channel, st.integers(0, _control.MAX_NBYTES)),
                       own_errors.map(lambda e: _control.error(e, "Traceback ..."))), max_size=5),
    st.lists(st.integers(0, 100_000), max_size=8),
    st.none() | st.binary(min_size=1, max_size=40),
)
def test_inbox_reassembles_real_messages_however_cut(messages, cuts, garbage):
    stream = b"".join(frame(_control.encode(m)) for m in messages)
    if garbage is not None:
        stream += frame(garbage)  # a frame of anything after them
    got, error, _ = read_all(cut(stream, cuts))
    assert _same(got, messages)
    if garbage is None:
        assert error is None and len(got) == len(messages)


def _same(got: list[Any], messages: list[list[Any]]) -> bool:
    """Errors compare by identity: compare what they say."""
    want = [_control.decode(_control.encode(m)) for m in messages]
    if len(got) < len(want):
        return False
    for g, w in zip(got, want):
        if type(g) is not type(w):
            return False
        if isinstance(g, _control.ErrorReport):
            if g[:3] != w[:3] or type(g.own) is not type(w.own) or str(g.own) != str(w.own):
                return False
        elif g != w:
            return False
    return True


def test_inbox_a_frame_larger_than_a_message_is_refused_at_its_header():
    got, error, _ = read_all([struct.pack("!i", _control.MAX_MESSAGE + 1)])
    assert got == [] and error is not None and "a frame of 65,537 bytes" in str(error)
    got, error, _ = read_all([struct.pack("!i", -1) + struct.pack("!Q", 10)])  # Connection's long form
    assert error is not None
