"""Fuzzing the payload decoder: bytes in shared memory are untrusted input.

Real payloads (of batches drawn at random) are mutated knowing their layout
(docs/design.md, "A slot's payload"): bytes of the structure flipped, length,
shape and offset fields set to extreme values, dtype names replaced (object
dtypes, module-looking names, other valid names), tags swapped, the header's
sizes rewritten, the payload cut short or extended; plain random bytes too.
Whatever the bytes, _codec.decode() returns a batch whose arrays all lie
inside the payload, or raises CorruptChannelError: no other exception, no
crash, no module imported.

SHMPIPE_FUZZ_EXAMPLES=N sets how many examples each test runs (a long run:
SHMPIPE_FUZZ_EXAMPLES=20000). Hypothesis's example database is off, so a run
leaves no files behind; a failure prints the seed and a blob to reproduce it.
"""

from __future__ import annotations

import os
import struct
import sys

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmpipe import _codec
from shmpipe.errors import CorruptChannelError
from shmpipe.testing.batches import DTYPES, make_array

# 200 examples a test in the suite, 2x Hypothesis's default: the fuzz files
# run in the suite's foreground, one core of two, and took 34 s of its time
# with 400 (2026-12-07; 37 s with 1000 on a faster machine), where the suite
# must stay under CI's 10 minutes. Each run draws new examples (no seed is
# fixed, no database kept), so CI's runs add up; a long run sets more.
# test_arrow_fuzz.py uses this count too.
EXAMPLES = int(os.environ.get("SHMPIPE_FUZZ_EXAMPLES", "200"))

FUZZ = settings(
    max_examples=EXAMPLES,
    database=None,  # CI leaves no .hypothesis directory behind
    deadline=None,  # a shared CI machine is no place for per-example timings
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

PREFIX = 16
ALIGN = 64

# -- batches ------------------------------------------------------------------

SHAPES = [(), (0,), (1,), (5,), (2, 3), (3, 0, 2), (1, 2, 1, 2)]


@st.composite
def arrays(draw):
    dt = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from(SHAPES))
    return make_array(dt, shape, seed=draw(st.integers(0, 2**16)))


@st.composite
def numpy_scalars(draw):
    arr = draw(arrays())
    if arr.size == 0:
        return np.float32(draw(st.floats(width=32)))
    return arr.reshape(-1)[0]


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # big ints too: the 'I' node
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    numpy_scalars(),
)

batches = st.recursive(
    arrays() | scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=4),
    ),
    max_leaves=10,
)

# -- the payload's fields -----------------------------------------------------


def fields(payload: bytes) -> list[tuple[str, int, int]]:
    """(kind, position, size) of every field of a well-formed payload's
    structure, by the layout the decoder reads (docs/design.md)."""
    out: list[tuple[str, int, int]] = []
    pos = PREFIX

    def u(fmt: str, kind: str) -> int:
        nonlocal pos
        size = struct.calcsize(fmt)
        out.append((kind, pos, size))
        (v,) = struct.unpack_from(fmt, payload, pos)
        pos += size
        return v

    def dtype() -> int:
        nonlocal pos
        n = u("<H", "dtype_len")
        out.append(("dtype", pos, n))
        spec = payload[pos : pos + n]
        pos += n
        return _codec.dtype_from_name(spec).itemsize

    def node() -> None:
        nonlocal pos
        out.append(("tag", pos, 1))
        tag = payload[pos : pos + 1]
        pos += 1
        if tag in (b"N", b"T", b"F"):
            return
        if tag in (b"i", b"f"):
            out.append(("value", pos, 8))
            pos += 8
        elif tag in (b"I", b"s", b"b"):
            n = u("<I", "len")
            out.append(("bytes", pos, n))
            pos += n
        elif tag in (b"(", b"["):
            for _ in range(u("<I", "len")):
                node()
        elif tag == b"{":
            for _ in range(u("<I", "len")):
                n = u("<I", "len")
                out.append(("bytes", pos, n))
                pos += n
                node()
        elif tag == b"g":
            n = dtype()
            out.append(("bytes", pos, n))
            pos += n
        elif tag == b"a":
            dtype()
            for _ in range(u("<B", "ndim")):
                u("<Q", "dim")
            u("<Q", "offset")
        else:
            raise AssertionError(f"unknown tag {tag!r}")

    node()
    return out


def relayout(payload: bytes, meta: bytes) -> bytes:
    """`payload` with its structure replaced by `meta`: the prefix's sizes and
    the data region's start follow, the data region is kept."""
    (meta_len,) = struct.unpack_from("<I", payload, 4)
    old_start = -(-(PREFIX + meta_len) // ALIGN) * ALIGN
    data = payload[old_start:]
    start = -(-(PREFIX + len(meta)) // ALIGN) * ALIGN
    total = start + len(data)
    head = payload[:4] + struct.pack("<IQ", len(meta), total) + meta
    return head + bytes(start - len(head)) + data


EXTREMES = [
    0,
    1,
    2,
    3,
    7,
    8,
    63,
    64,
    65,
    255,
    256,
    2**15,
    2**16 - 1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 64,
    2**64 - 1,
]

DTYPE_NAMES = [
    # references: never made from shared memory
    b"|O8",
    b"<O8",
    b"|O",
    b"O",
    b"object",
    b"#[('a', '|O8')]",
    b"#[('a', '<f8'), ('b', '|O')]",
    b"#[('a', [('b', '|O8')])]",
    # module-looking names: never imported, never looked up by attribute
    b"@this:s",
    b"@os:system",
    b"@subprocess:Popen",
    b"@numpy:testing",
    b"@builtins:object",
    b"@numpy.ma:masked",
    b"@ml_dtypes:bfloat16",
    b"@ml_dtypes:__getattr__",
    b"@sys:modules",
    b"@:",
    b"@",
    b"@ml_dtypes",
    b"#__import__('os').system('true')",
    b"#" + b"[" * 300,
    b"#[('a', '<f8', (2**62, 2**62))]",
    b"#[('a', '<f8', (9999999, 9999999))]",
    b"#[('a', '<f8', (-1,))]",
    b"#[('a', 'f4'), ('a', 'f4')]",
    b"#[]",
    b"#[('', '|V0')]",
    # NumPy's spellings shmpipe does not write, and odd sizes
    b"float64",
    b"f8",
    b"|f4",
    b"=f4",
    b"<u3",
    b"<f1",
    b"<c24",
    b"<M8[xx]",
    b"<M8[2**64s]",
    b"|S99999999999",
    b"<U999999999",
    b"|V2147483647",
    b"|V2147483648",
    b"|S0",
    b"|V0",
    b"<U0",
    b"|T16",
    b"<i16",
    b"\xff\xfe",
    b"",
    # valid names of other sizes than the data was written with
    b"|b1",
    b"|u1",
    b"<i8",
    b"<f16",
    b"<c32",
    b">i4",
    b"|S5",
    b"<U3",
    b"|V4",
    b"<M8[ns]",
    b"<m8[as]",
    b"#[('x', '|u1'), ('', '|V7'), ('y', '<f4'), ('', '|V4')]",
]

TAGS = b"NFTiIfsb([{ag?\x00\xff"


@st.composite
def mutated_payloads(draw) -> bytes:
    batch = draw(batches)
    payload = _codec.encode(batch).tobytes()
    layout = fields(payload)
    (meta_len,) = struct.unpack_from("<I", payload, 4)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(
            st.sampled_from(["flip", "field", "shape", "dtype", "tag", "header", "truncate", "extend", "splice"])
        )
        if how == "flip" and meta_len:  # bytes of the structure
            raw = bytearray(payload)
            for _ in range(draw(st.integers(1, 4))):
                at = draw(st.integers(PREFIX, PREFIX + meta_len - 1))
                raw[at] ^= 1 << draw(st.integers(0, 7))
            payload = bytes(raw)
        elif how == "field":  # a length, ndim, dim or offset set to an extreme
            numeric = [f for f in layout if f[0] in ("len", "dtype_len", "ndim", "dim", "offset")]
            if numeric:
                kind, at, size = draw(st.sampled_from(numeric))
                v = draw(st.sampled_from(EXTREMES) | st.integers(0, 2 ** (8 * size) - 1))
                v %= 2 ** (8 * size)
                payload = payload[:at] + v.to_bytes(size, "little") + payload[at + size :]
        elif how == "shape":  # every dim of one array at once (a 0 beside a huge one)
            shapes, run = [], []
            for kind, at, _ in layout:
                if kind == "dim":
                    run.append(at)
                elif run:
                    shapes.append(run)
                    run = []
            if shapes:
                raw = bytearray(payload)
                for at in draw(st.sampled_from(shapes)):
                    v = draw(st.sampled_from([0, 1, 3, 2**31, 2**32, 2**62, 2**63 - 1, 2**63]))
                    raw[at : at + 8] = v.to_bytes(8, "little")
                payload = bytes(raw)
        elif how == "dtype":  # another name, its length and the layout following
            names = [f for f in layout if f[0] == "dtype"]
            if names:
                _, at, size = draw(st.sampled_from(names))
                new = draw(st.sampled_from(DTYPE_NAMES) | st.binary(max_size=12) | st.text(max_size=12).map(str.encode))
                meta = payload[PREFIX : at - 2] + struct.pack("<H", len(new)) + new
                meta += payload[at + size : PREFIX + meta_len]
                payload = relayout(payload, meta)
        elif how == "tag":
            tags = [f for f in layout if f[0] == "tag"]
            if tags:
                _, at, _ = draw(st.sampled_from(tags))
                payload = payload[:at] + bytes([draw(st.sampled_from(TAGS))]) + payload[at + 1 :]
        elif how == "header":  # magic, meta_nbytes or payload_nbytes
            at, size = draw(st.sampled_from([(0, 4), (4, 4), (8, 8)]))
            v = draw(st.sampled_from(EXTREMES) | st.integers(0, 2 ** (8 * size) - 1))
            v %= 2 ** (8 * size)
            payload = payload[:at] + v.to_bytes(size, "little") + payload[at + size :]
        elif how == "truncate":
            cut = draw(st.integers(0, len(payload)))
            payload = payload[:cut]
            if draw(st.booleans()) and len(payload) >= PREFIX:  # header agrees with the cut
                payload = payload[:8] + struct.pack("<Q", len(payload)) + payload[16:]
        elif how == "extend":
            payload += draw(st.binary(min_size=1, max_size=200))
            if draw(st.booleans()):
                payload = payload[:8] + struct.pack("<Q", len(payload)) + payload[16:]
        elif how == "splice" and meta_len:  # bytes inserted into or cut from the structure
            at = draw(st.integers(PREFIX, PREFIX + meta_len))
            meta = payload[PREFIX:at] + draw(st.binary(max_size=16))
            meta += payload[at + draw(st.integers(0, 16)) : PREFIX + meta_len]
            payload = relayout(payload, meta)
        (meta_len,) = struct.unpack_from("<I", payload, 4) if len(payload) >= 8 else (0,)
        meta_len = min(meta_len, max(0, len(payload) - PREFIX))
        try:
            layout = fields(payload)
        except Exception:
            layout = []  # no longer well formed: later mutations act on bytes
    return payload


@st.composite
def framed_random(draw) -> bytes:
    """Random structure behind a valid prefix, so the decoder reads it."""
    meta = draw(st.binary(max_size=300))
    data = draw(st.binary(max_size=300))
    start = -(-(PREFIX + len(meta)) // ALIGN) * ALIGN
    head = b"SPB1" + struct.pack("<IQ", len(meta), start + len(data)) + meta
    return head + bytes(start - len(head)) + data


# -- the property ---------------------------------------------------------------


def check_decode(payload: bytes) -> None:
    buf = _codec.aligned_empty(len(payload))
    buf[:] = np.frombuffer(payload, np.uint8)
    modules = set(sys.modules)
    try:
        out = _codec.decode(buf)
    except CorruptChannelError as exc:
        assert str(exc), "a CorruptChannelError must say what was wrong"
        out = None
    new = set(sys.modules) - modules
    assert not new, f"decoding imported {sorted(new)}"
    if out is not None:
        check_batch(out, buf)


def check_batch(obj, buf: np.ndarray) -> None:
    """Every array of a decoded batch lies inside the payload and is read
    whole (a view past the payload would read out of bounds)."""
    lo = buf.ctypes.data
    hi = lo + buf.nbytes
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            assert all(type(k) is str for k in x)
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, np.ndarray):
            assert not x.dtype.hasobject, f"decoded an array of dtype {x.dtype}"
            assert not x.flags.writeable
            if x.nbytes:
                assert lo <= x.ctypes.data and x.ctypes.data + x.nbytes <= hi
                x.tobytes()
        elif isinstance(x, np.generic):
            assert not x.dtype.hasobject, f"decoded a scalar of dtype {x.dtype}"
        else:
            assert x is None or type(x) in (bool, int, float, str, bytes), type(x)


@FUZZ
@given(mutated_payloads())
def test_mutated_payloads(payload):
    check_decode(payload)


@FUZZ
@given(framed_random())
def test_random_structure_behind_a_valid_prefix(payload):
    check_decode(payload)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(payload):
    check_decode(payload)


@FUZZ
@given(batches)
def test_real_payloads_round_trip(batch):
    # The mutations start from these: each must decode as it was encoded.
    payload = _codec.encode(batch)
    out = _codec.decode(payload)
    check_batch(out, payload)
    assert _codec.encode(out).tobytes() == payload.tobytes()
