"""Fuzzing the arrow transport's decoder: bytes in shared memory are untrusted.

As tests/test_codec_fuzz.py does for the shm payload: real payloads (of
batches drawn at random) mutated knowing their layout (the JSON header's
values replaced, its text's bytes flipped, words of the tensor messages'
metadata set to extremes, spans moved, the payload cut or extended), random
JSON headers in front of real tensor messages, and plain random bytes.
Whatever the bytes, arrow.decode() returns a batch whose arrays lie inside
the payload, or raises CorruptChannelError: no other exception, no crash,
no module imported, in bounded time and memory.

SHMPIPE_FUZZ_EXAMPLES=N sets how many examples each test runs.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import tracemalloc

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from test_codec_fuzz import DTYPE_NAMES, EXTREMES, FUZZ, batches

from shmpipe import _codec, _tree
from shmpipe.errors import CorruptChannelError
from shmpipe.testing.assertions import assert_same
from shmpipe.transports import arrow

ALIGN = 64


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split(payload: bytes) -> tuple[dict, bytes]:
    """(header, the bytes from where the tensor messages start) of a well-formed payload."""
    (hlen,) = struct.unpack_from("<I", payload, 4)
    return json.loads(payload[8 : 8 + hlen]), payload[_round_up(8 + hlen) :]


def join(text: bytes, data: bytes, start: int | None = None) -> bytes:
    """A payload of header `text` and, from `start` (or the first multiple of
    64 past the header), `data`."""
    head = struct.pack("<II", arrow.MAGIC, len(text)) + text
    start = _round_up(len(head)) if start is None else max(start, len(head))
    return head + bytes(start - len(head)) + data


def with_header(payload: bytes, header) -> bytes:
    """`payload` with another header; its tensor messages, and the spans
    that can be moved, move with the start of the data region."""
    old, data = split(payload)
    old_start = len(payload) - len(data)
    text = json.dumps(header).encode()
    start = _round_up(8 + len(text))
    spans = header.get("tensors") if type(header) is dict else None
    if type(spans) is list:
        for span in spans:
            if type(span) is list and len(span) == 2 and type(span[0]) is int:
                span[0] += start - old_start
        text = json.dumps(header).encode()  # the same length or longer: room for it below
    return join(text, data, max(start, _round_up(8 + len(text))))


# -- JSON ----------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from(EXTREMES + [-1, -(2**63), 2**200]),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from([name.decode("latin-1") for name in DTYPE_NAMES]),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=3), children, max_size=4),
    max_leaves=12,
)

LEAF_KEYS = ["a", "g", "shape", "dtype", "v", "y", "zz"]


FORMS = [("a", "shape"), ("a", "shape", "dtype"), ("g", "shape"), ("g", "shape", "dtype"), ("v",), ("y",)]


# The strategies leaves() draws from, made once (not at every draw).
_LEAF_KEYSETS = st.one_of(
    *[st.sampled_from(FORMS)] * 6,  # mostly a form the encoder writes
    st.lists(st.sampled_from(LEAF_KEYS), min_size=1, max_size=4, unique=True),  # odd keys
)
_LEAF_VALUES = {
    "a": st.integers(0, 3) | st.integers(-1, 4) | json_scalars,
    "shape": st.lists(st.integers(0, 7) | st.sampled_from(EXTREMES), max_size=4) | json_values,
    "dtype": st.sampled_from([n.decode("latin-1") for n in DTYPE_NAMES]) | json_values,
    "y": st.sampled_from(["", "QQ==", "QUJD", "!!", "QQ"]) | json_values,
}
_LEAF_VALUES["g"] = _LEAF_VALUES["a"]
_OTHER_LEAF_VALUE = st.one_of(json_scalars, json_scalars, json_values)


@st.composite
def leaves(draw):
    keys = draw(_LEAF_KEYSETS)
    return {key: draw(_LEAF_VALUES.get(key, _OTHER_LEAF_VALUE)) for key in keys}


trees = st.recursive(
    st.just("*") | json_scalars,
    lambda children: st.one_of(
        st.tuples(st.sampled_from(["l", "t"]), st.lists(children, max_size=4)).map(list),
        st.lists(children, max_size=4).flatmap(
            lambda kids: st.tuples(
                st.just("d"), st.lists(st.text(max_size=2), min_size=len(kids), max_size=len(kids)), st.just(kids)
            ).map(list)
        ),
        st.lists(children, max_size=3),
    ),
    max_leaves=10,
)

# Real tensor messages for random headers to point at.
SAMPLE = arrow.encode(
    {
        "x": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.arange(4, dtype=">i2"),
        "g": np.int8(3),
        "e": np.zeros((0, 2)),
    }
).tobytes()
SAMPLE_HEADER, SAMPLE_DATA = split(SAMPLE)


@st.composite
def random_headers(draw) -> bytes:
    """A header of the right shape with random contents, in front of real
    tensor messages (its spans drawn from theirs and from anywhere)."""
    room = 4096
    real = [[o - len(SAMPLE) + len(SAMPLE_DATA) + room, n] for o, n in SAMPLE_HEADER["tensors"]]
    span = (
        st.sampled_from(real)
        | st.lists(st.integers(0, 8192) | st.sampled_from(EXTREMES), min_size=2, max_size=2)
        | json_values
    )
    described = draw(st.lists(leaves(), max_size=6))
    tree = draw(trees | st.just(["l", ["*"] * len(described)]))  # (one that uses every leaf, now and then)
    header = {"tree": tree, "leaves": described, "tensors": draw(st.lists(span, max_size=5))}
    text = json.dumps(draw(st.just(header) | st.just(header) | json_values)).encode()  # or not even the right shape
    return join(text[: room - 8], SAMPLE_DATA, room)


# -- mutations of real payloads ----------------------------------------------------


def _json_paths(value, path=()):
    yield path
    if type(value) is list:
        for i, v in enumerate(value):
            yield from _json_paths(v, (*path, i))
    elif type(value) is dict:
        for k, v in value.items():
            yield from _json_paths(v, (*path, k))


def _replaced(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if type(value) is list:
        return [_replaced(v, rest, new) if i == head else v for i, v in enumerate(value)]
    return {k: (_replaced(v, rest, new) if k == head else v) for k, v in value.items()}


def _messages(payload: bytes) -> list[tuple[int, int]]:
    """(start, end) of each tensor message's prefix and metadata, where the payload is well formed."""
    try:
        header, _ = split(payload)
        out = []
        for off, _ in header["tensors"]:
            (mlen,) = struct.unpack_from("<i", payload, off + 4)
            end = min(off + 8 + mlen, len(payload))
            if end > off:  # an earlier mutation may have made the length negative
                out.append((off, end))
        return out
    except Exception:
        return []


@st.composite
def mutated_payloads(draw) -> bytes:
    payload = arrow.encode(draw(batches)).tobytes()
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["json", "text", "word", "flip", "span", "prefix", "truncate", "extend"]))
        try:
            header, _ = split(payload)
        except Exception:
            header = None
        messages = _messages(payload)
        if how == "json" and header is not None:  # a value anywhere in the header replaced
            paths = list(_json_paths(header))
            path = draw(st.sampled_from(paths))
            payload = with_header(payload, _replaced(header, path, draw(json_values | leaves())))
        elif how == "text" and len(payload) > 8:  # bytes of the header's text flipped
            (hlen,) = struct.unpack_from("<I", payload, 4)
            hlen = min(hlen, len(payload) - 8)
            if hlen:
                raw = bytearray(payload)
                for _ in range(draw(st.integers(1, 4))):
                    raw[8 + draw(st.integers(0, hlen - 1))] = draw(st.integers(0, 255))
                payload = bytes(raw)
        elif how == "word" and messages:  # a u32 of a message's metadata set to an extreme
            start, end = draw(st.sampled_from(messages))
            if end - start >= 4:
                at = start + 4 * draw(st.integers(0, (end - start) // 4 - 1))
                v = draw(st.sampled_from(EXTREMES) | st.integers(0, 2**32 - 1)) % 2**32
                payload = payload[:at] + struct.pack("<I", v) + payload[at + 4 :]
        elif how == "flip" and messages:  # bits of a message's metadata
            start, end = draw(st.sampled_from(messages))
            raw = bytearray(payload)
            for _ in range(draw(st.integers(1, 4))):
                raw[draw(st.integers(start, end - 1))] ^= 1 << draw(st.integers(0, 7))
            payload = bytes(raw)
        elif how == "span" and type(header) is dict and type(header.get("tensors")) is list and header["tensors"]:
            span = draw(st.sampled_from(header["tensors"]))
            if type(span) is list and len(span) == 2:  # its offset or size to an extreme
                span[draw(st.integers(0, 1))] = draw(st.sampled_from(EXTREMES) | st.integers(-64, 4096))
                payload = with_header(payload, header)
        elif how == "prefix" and len(payload) >= 8:  # magic or the header's length
            at = draw(st.sampled_from([0, 4]))
            v = draw(st.sampled_from(EXTREMES) | st.integers(0, 2**32 - 1)) % 2**32
            payload = payload[:at] + struct.pack("<I", v) + payload[at + 4 :]
        elif how == "truncate":
            payload = payload[: draw(st.integers(0, len(payload)))]
        elif how == "extend":
            payload += draw(st.binary(min_size=1, max_size=200))
    return payload


# -- the property ---------------------------------------------------------------


def check_decode(payload: bytes) -> None:
    buf = _codec.aligned_empty(len(payload))
    buf[:] = np.frombuffer(payload, np.uint8)
    buf.flags.writeable = False
    modules = set(sys.modules)
    tracemalloc.start()
    t = time.perf_counter()
    try:
        out = arrow.decode(buf)
    except CorruptChannelError as exc:
        assert str(exc), "a CorruptChannelError must say what was wrong"
        out = None
    finally:
        took = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    new = set(sys.modules) - modules
    assert not new, f"decoding imported {sorted(new)}"
    assert took < 2.0, f"decoding {len(payload)} bytes took {took:.1f} s"
    assert peak < (4 << 20) + 64 * len(payload), f"decoding {len(payload)} bytes took {peak:,} bytes"
    if out is not None:
        check_batch(out, buf)


def check_batch(obj, buf: np.ndarray) -> None:
    """Every array of a decoded batch lies inside the payload, 64-byte
    aligned, read-only, and is read whole; every other leaf is a value the
    encoder writes."""
    lo = buf.ctypes.data
    hi = lo + buf.nbytes
    stack = [obj]
    nodes = 0
    while stack:
        x = stack.pop()
        nodes += 1
        if type(x) is dict:
            assert all(type(k) is str for k in x)
            stack.extend(x.values())
        elif type(x) in (list, tuple):
            stack.extend(x)
        elif isinstance(x, np.ndarray):
            assert not x.dtype.hasobject, f"decoded an array of dtype {x.dtype}"
            assert not x.flags.writeable
            if x.nbytes:
                assert lo <= x.ctypes.data and x.ctypes.data + x.nbytes <= hi
                assert (x.ctypes.data - lo) % ALIGN == 0
                x.tobytes()
        elif isinstance(x, np.generic):
            assert not x.dtype.hasobject, f"decoded a scalar of dtype {x.dtype}"
        else:
            assert x is None or type(x) in (bool, int, float, str, bytes), type(x)
            if type(x) is str:
                x.encode()  # text: no lone surrogates
    assert nodes <= arrow.MAX_HEADER_VALUES


@FUZZ
@given(mutated_payloads())
def test_mutated_payloads(payload):
    check_decode(payload)


@FUZZ
@given(random_headers())
def test_random_headers_in_front_of_real_tensors(payload):
    check_decode(payload)


@FUZZ
@given(st.binary(max_size=512) | st.binary(max_size=512).map(lambda b: struct.pack("<II", arrow.MAGIC, len(b)) + b))
def test_random_bytes(payload):
    check_decode(payload)


_PADDED = {np.dtype(np.longdouble), np.dtype(np.clongdouble)}


def _without_padding(leaf):
    """A long double scalar as its value (its padding bytes, 6 of 16 on
    x86-64, are whatever a new scalar's memory held); anything else as is."""
    if isinstance(leaf, np.generic) and leaf.dtype in _PADDED:
        parts = [leaf.real, leaf.imag] if leaf.dtype.kind == "c" else [leaf]
        return tuple(
            ("nan" if np.isnan(x) else float(x) if np.isinf(x) else repr(x), bool(np.signbit(x))) for x in parts
        )
    return leaf


@FUZZ
@given(batches)
def test_real_payloads_round_trip_bit_exact(batch):
    # The mutations start from these: each decodes to what was encoded, the
    # arrays bit for bit (they are views of the payload).
    payload = arrow.encode(batch)
    out = arrow.decode(payload)
    check_batch(out, payload)
    assert_same(_tree.map_leaves(out, _without_padding), _tree.map_leaves(batch, _without_padding))
