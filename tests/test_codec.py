"""The batch codec in one process: bit-exact round trips, alignment, and the
errors a bad batch or a corrupted payload gives."""

from __future__ import annotations

import collections
import re
import struct
import sys
import types

import numpy as np
import pytest
from conftest import assert_same

import shmpipe
from shmpipe import _codec
from shmpipe.errors import BatchTypeError, CorruptChannelError
from shmpipe.testing.batches import SCALARS, matrix, non_contiguous

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

MATRIX = list(matrix())


@pytest.mark.parametrize("batch", [b for _, b in MATRIX], ids=[i for i, _ in MATRIX])
def test_round_trip_matrix(batch):
    payload = _codec.encode(batch)
    assert len(payload) == _codec.encoded_size(batch)
    assert_same(_codec.decode(payload), batch)


def test_arrays_are_64_byte_aligned_read_only_views():
    batch = {"a": np.ones(3, np.uint8), "b": np.ones((5, 7), np.float64), "c": [np.zeros(1, np.int16)] * 3}
    payload = _codec.encode(batch)
    out = _codec.decode(payload)
    for arr in (out["a"], out["b"], *out["c"]):
        assert arr.ctypes.data % 64 == 0
        assert np.shares_memory(arr, payload)
        assert not arr.flags.writeable


@pytest.mark.parametrize("offset", [0, 1, 15])
def test_big_arrays_streamed_into_the_payload_are_bit_exact(offset):
    # Arrays of 4 MiB or more are copied with streaming stores
    # (csrc/shmpipe_copy.h), in 64-byte steps and a tail: sizes around the
    # switch, tails of every kind, sources at unaligned addresses.
    rng = np.random.default_rng(offset)
    switch = 4 << 20
    for n in (switch - 1, switch, switch + 1, switch + 63, switch + 64, 5 * switch + 17):
        raw = rng.integers(0, 256, n + offset, dtype=np.uint8)
        src = raw[offset:]
        batch = {"x": src, "y": np.arange(3)}
        out = _codec.decode(_codec.encode(batch))
        assert out["x"].ctypes.data % 64 == 0
        np.testing.assert_array_equal(out["x"], src)
        np.testing.assert_array_equal(out["y"], np.arange(3))


def test_non_contiguous_inputs_are_stored_c_contiguous():
    batch = non_contiguous()
    out = _codec.decode(_codec.encode(batch))
    assert_same(out, batch)
    for arr in out.values():
        assert arr.flags.c_contiguous


@pytest.mark.parametrize("name", list(SCALARS))
def test_scalars_round_trip(name):
    batch = {"v": SCALARS[name], "in_list": [SCALARS[name]]}
    assert_same(_codec.decode(_codec.encode(batch)), batch)


def test_memmap_and_other_subclasses_travel_as_ndarray(tmp_path):
    mm = np.memmap(tmp_path / "m.bin", dtype=np.int32, mode="w+", shape=(10,))
    mm[:] = np.arange(10)
    out = _codec.decode(_codec.encode({"m": mm}))
    assert type(out["m"]) is np.ndarray
    np.testing.assert_array_equal(out["m"], np.arange(10))
    del mm


@pytest.mark.parametrize(
    "batch, path, words",
    [
        ({"x": np.array([1, None], dtype=object)}, "batch['x']", "dtype"),
        ({"x": [1, 2, object()]}, "batch['x'][2]", "unsupported type"),
        ({"x": {3: np.zeros(2)}}, "batch['x'][3]", "keys must be str"),
        ((np.zeros(1), {"y": [np.ma.masked_array([1, 2], mask=[0, 1])]}), "batch[1]['y'][0]", "masked"),
        ({"s": {1, 2}}, "batch['s']", "unsupported type builtins.set"),
        ({"od": collections.OrderedDict(a=1)}, "batch['od']", "subclass of dict"),
        ({"nt": collections.namedtuple("P", "x y")(1, 2)}, "batch['nt']", "subclass of tuple"),
        ({"t": np.array(["a"], dtype=np.dtypes.StringDType())}, "batch['t']", "dtype"),
        ({"m": memoryview(b"ab")}, "batch['m']", "unsupported type"),
    ],
)
def test_bad_batches_name_the_path(batch, path, words):
    with pytest.raises(BatchTypeError) as info:
        _codec.encode(batch)
    assert isinstance(info.value, TypeError) and isinstance(info.value, shmpipe.ShmpipeError)
    assert info.value.path == path
    assert str(info.value).startswith(path + ":")
    assert words in str(info.value)


def test_objects_with___array___get_a_hint():
    class Tensorish:
        def __array__(self, dtype=None, copy=None):
            return np.zeros(2)

    with pytest.raises(BatchTypeError, match="numpy.asarray"):
        _codec.encode([Tensorish()])


def test_a_cycle_is_an_error_not_a_crash():
    loop = []
    loop.append(loop)
    with pytest.raises(BatchTypeError, match="does it contain itself"):
        _codec.encode({"loop": loop})


def test_reserve_template_outside_a_producer_gives_plain_arrays():
    out = shmpipe.reserve({"a": shmpipe.ArraySpec((2, 3), "f4"), "b": np.zeros(4, np.int8), "k": 1})
    assert out["a"].shape == (2, 3) and out["a"].dtype == np.float32 and out["a"].flags.writeable
    assert out["b"].shape == (4,) and out["b"].dtype == np.int8
    assert out["k"] == 1


def test_an_array_spec_takes_the_shapes_numpy_takes():
    assert shmpipe.ArraySpec(np.int64(5)).shape == (5,) and shmpipe.ArraySpec((np.uint8(2), 3)).shape == (2, 3)
    assert all(type(d) is int for d in shmpipe.ArraySpec((np.int32(2), 3)).shape)
    for bad in [(2.7,), 2.0, True, (True, 2), "3", None]:  # int() took 2.7 for 2 and True for 1
        with pytest.raises(TypeError, match="shape must be an int or a tuple of ints"):
            shmpipe.ArraySpec(bad)
        if not isinstance(bad, bool) and bad != (True, 2):  # (NumPy before 2 took a bool, with a warning)
            with pytest.raises(TypeError):
                np.empty(bad)  # as NumPy answers them
    with pytest.raises(ValueError, match="must not be negative"):
        shmpipe.ArraySpec((2, -1))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: p.__setitem__(slice(0, 4), 0),  # magic
        lambda p: p.__setitem__(slice(4, 8), 255),  # meta length
        lambda p: p.__setitem__(slice(8, 16), 7),  # total size
        lambda p: p.__setitem__(16, ord("?")),  # unknown tag
        lambda p: p.__setitem__(slice(21, 23), 255),  # key length
    ],
)
def test_corrupted_payload_raises_not_crashes(corrupt):
    payload = _codec.encode({"x": np.arange(10), "y": "text"})
    corrupt(payload)
    with pytest.raises(CorruptChannelError):
        _codec.decode(payload)


def test_corrupted_array_header_raises():
    payload = _codec.encode(np.arange(4, dtype=np.int64))
    # layout: prefix(16) 'a' u16 len, "<i8", u8 ndim, u64 dim, u64 offset
    dim_at = 16 + 1 + 2 + 3 + 1
    payload[dim_at : dim_at + 8] = np.frombuffer(np.uint64(1 << 40).tobytes(), np.uint8)
    with pytest.raises(CorruptChannelError, match="outside its payload"):
        _codec.decode(payload)
    payload[dim_at : dim_at + 8] = 0xFF
    with pytest.raises(CorruptChannelError):
        _codec.decode(payload)


# -- what a hostile payload may not do (another process can write the ring) --


def _replace(payload, old: bytes, new: bytes) -> None:
    """Rewrites `old` (found once in the payload's structure) to `new`, same length."""
    assert len(old) == len(new)
    raw = payload.tobytes()
    at = raw.index(old)
    assert raw.find(old, at + 1) == -1
    payload[at : at + len(new)] = np.frombuffer(new, np.uint8)


@pytest.mark.parametrize(
    "batch, old, new",
    [
        ({"x": np.arange(4, dtype="<u8")}, b"<u8", b"|O8"),  # an array
        ({"x": np.arange(4, dtype="<u8")}, b"<u8", b"<O8"),
        ({"x": np.uint64(7)}, b"<u8", b"|O8"),  # a NumPy scalar
        # a structured dtype with an object field
        ({"x": np.zeros(2, [("a", "<u8"), ("b", "u1")])}, b"'<u8'", b"'|O8'"),
    ],
)
def test_object_dtype_is_never_made_from_a_payload(batch, old, new):
    # An object array over shared memory is an array of pointers another
    # process chose: decoding one used to hand the consumer an object array
    # whose first read crashed it.
    payload = _codec.encode(batch)
    _replace(payload, old, new)
    with pytest.raises(CorruptChannelError, match="holds Python objects"):
        _codec.decode(payload)


def _array_payload(spec: bytes, shape=(3,), offset=0):
    """A payload by hand: one array leaf whose dtype is named `spec`."""
    meta = b"a" + struct.pack("<H", len(spec)) + spec + struct.pack("<B", len(shape))
    meta += b"".join(struct.pack("<Q", d) for d in shape) + struct.pack("<Q", offset)
    data_at = -(-(16 + len(meta)) // 64) * 64
    total = data_at + 256
    payload = _codec.aligned_empty(total)
    payload[:] = 0
    payload[:16] = np.frombuffer(b"SPB1" + struct.pack("<IQ", len(meta), total), np.uint8)
    payload[16 : 16 + len(meta)] = np.frombuffer(meta, np.uint8)
    return payload


def test_a_payload_never_imports_a_module(monkeypatch, capsys):
    # "@this:s" used to make the consumer import `this` (which prints the Zen
    # of Python): a payload chose code for the consumer to run.
    monkeypatch.delitem(sys.modules, "this", raising=False)
    with pytest.raises(CorruptChannelError, match="has not imported"):
        _codec.decode(_array_payload(b"@this:s"))
    assert "this" not in sys.modules
    assert capsys.readouterr().out == ""


def test_a_payload_never_gets_an_attribute_by_name(monkeypatch):
    # A module already imported is no license to look names up in it: a
    # module's __getattr__ (PEP 562) is code, and so is a property.
    asked = []
    mod = types.ModuleType("shmpipe_test_lazy")
    mod.__getattr__ = lambda name: asked.append(name) or np.float64
    mod.real = np.float32
    monkeypatch.setitem(sys.modules, "shmpipe_test_lazy", mod)
    for spec in (
        b"@shmpipe_test_lazy:anything",
        b"@shmpipe_test_lazy:real",
        b"@shmpipe_test_lazy:__getattr__",
        b"@numpy:testing",
    ):
        with pytest.raises(CorruptChannelError, match="defines no NumPy extension dtype"):
            _codec.decode(_array_payload(spec))
    assert asked == []


@pytest.mark.parametrize(
    "spec, words",
    [
        (b"float32", "not a NumPy dtype shmpipe carries"),  # NumPy would accept it
        (b"|O", "holds Python objects"),
        (b"object", "holds Python objects"),
        (b"|f4", "not spelled as shmpipe spells it"),  # non-canonical
        (b"<u3", "item size"),
        (b"<M8[xx]", "time unit"),
        (b"|T16", "kind 'T'"),
        (b"\xff\xfe", "not a NumPy dtype"),
        (b"", "not a NumPy dtype"),  # an empty name once matched a fresh decoder's empty dtype cache: SIGSEGV
        (b"#[('a', '<f8', (1 << 40,))]", "not a dtype description"),  # an expression
        (b"#[('a', '<f8', (1 2,))]", "cannot be read"),  # not even Python
        (b"#[('a', '<f8', (99999999, 99999999))]", "item size"),
        (b"#" + b"[('a', " * 40 + b"'<f4'" + b")]" * 40, "nested"),
        (b"#__import__('os')", "not a dtype description"),
        (b"#('<f4', (2,))", "not a structured dtype"),
    ],
)
def test_dtype_names_come_from_a_closed_table(spec, words):
    with pytest.raises(CorruptChannelError, match=re.escape(words)):
        _codec.decode(_array_payload(spec))


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_extension_dtypes_only_from_modules_the_consumer_imported(monkeypatch):
    batch = {"x": np.arange(3).astype(ml_dtypes.bfloat16), "y": ml_dtypes.float8_e4m3fn(2)}
    payload = _codec.encode(batch)
    assert b"@ml_dtypes:bfloat16" in payload.tobytes()
    assert_same(_codec.decode(payload), batch)
    monkeypatch.delitem(sys.modules, "ml_dtypes")
    with pytest.raises(CorruptChannelError, match="'ml_dtypes', which this process has not imported"):
        _codec.decode(payload)


def _set_u64(payload, at: int, value: int) -> None:
    payload[at : at + 8] = np.frombuffer(struct.pack("<Q", value), np.uint8)


# An array leaf at the top: prefix(16) 'a' u16 len "<f8" u8 ndim, then the dims.
_DIMS_AT = 16 + 1 + 2 + 3 + 1


@pytest.mark.parametrize(
    "batch, corrupt, words",
    [
        # Bytes that are not UTF-8 where text is: a plain UnicodeDecodeError before.
        ({"x": "text"}, lambda p: _replace(p, b"text", b"\xfftex"), "str that is not UTF-8"),
        ({"key": 1}, lambda p: _replace(p, b"key", b"k\xc3y"), "dict key that is not UTF-8"),
        # A zero dim beside a huge one: an empty array by our count, but NumPy
        # refuses it ("array is too big", a ValueError) before.
        (np.zeros((0, 3)), lambda p: _set_u64(p, _DIMS_AT + 8, 1 << 62), "impossible size"),
        (np.zeros((3, 0)), lambda p: _set_u64(p, _DIMS_AT, 1 << 61), "impossible size"),
        # Keys repeated: a dict of one key came out before.
        (
            {"a": 1, "b": 2},
            lambda p: _replace(p, b"\x01\x00\x00\x00b", b"\x01\x00\x00\x00a"),
            "repeats the dict key 'a'",
        ),
        # A count no payload has room for.
        ({"a": 1}, lambda p: p.__setitem__(slice(17, 21), 255), "dict of 4294967295 entries"),
        ([1, 2], lambda p: p.__setitem__(slice(17, 21), 255), "list of 4294967295 items"),
        # Array outside the data region; a misaligned offset.
        (np.zeros(3), lambda p: _set_u64(p, _DIMS_AT + 8, 1 << 63), "outside its payload"),
        (np.zeros(3), lambda p: _set_u64(p, _DIMS_AT + 8, 8), "outside its payload"),
        (np.zeros(3), lambda p: p.__setitem__(_DIMS_AT - 1, 65), "65 dimensions"),
    ],
)
def test_malformed_payloads_say_what_is_wrong(batch, corrupt, words):
    payload = _codec.encode(batch)
    corrupt(payload)
    with pytest.raises(CorruptChannelError, match=re.escape(words)):
        _codec.decode(payload)


@pytest.mark.parametrize("n", [0, 1, 15])
def test_a_short_buffer_is_corrupt_not_unaligned(n):
    # An empty buffer has no meaningful address: it used to be refused as
    # "not 64-byte aligned", a ValueError, depending on where NumPy put it.
    buf = _codec.aligned_empty(64)[1 : 1 + n]
    with pytest.raises(CorruptChannelError, match="too short"):
        _codec.decode(buf)


def test_deep_nesting_is_corrupt_not_a_recursion_error():
    meta = b"[\x01\x00\x00\x00" * 10_000 + b"N"
    payload = _codec.aligned_empty(-(-(16 + len(meta)) // 64) * 64)
    payload[:] = 0
    payload[:16] = np.frombuffer(b"SPB1" + struct.pack("<IQ", len(meta), len(payload)), np.uint8)
    payload[16 : 16 + len(meta)] = np.frombuffer(meta, np.uint8)
    with pytest.raises(CorruptChannelError, match="nested too deep"):
        _codec.decode(payload)


@pytest.mark.parametrize("value", [np.bytes_(b""), np.str_(""), np.void(b"")])
def test_empty_numpy_scalars_round_trip(value):
    # Their dtypes have an item size of 0 ("|S0"): np.frombuffer refused to
    # decode what the encoder wrote (a ValueError).
    out = _codec.decode(_codec.encode({"v": value}))
    assert type(out["v"]) is type(value) and out["v"] == value


# -- every byte written is defined (no stale bytes of a slot in the padding) --

_PADDED = np.dtype({"names": ["x", "y"], "formats": ["u1", "<f4"], "offsets": [0, 8], "itemsize": 16})


def _padded_batch():
    """Gaps everywhere: structure to data, between arrays of odd sizes, after
    trailing empty arrays, and a strided structured array with padding."""
    rng = np.random.default_rng(5)
    padded = np.frombuffer(rng.integers(0, 256, 16 * 14, dtype=np.uint8).tobytes(), _PADDED)
    return {
        "odd": np.arange(3, dtype=np.uint8),
        "s": "x",
        "f": np.arange(5, dtype=np.float32),
        "strided_struct": padded[::2],
        "scalar": np.float64(2.5),
        "c": np.ones((3, 7), np.int16),
        "empty_last": [np.zeros(0), np.zeros((2, 0))],
    }


def _padding_ranges(payload) -> list[tuple[int, int]]:
    """The byte ranges of `payload` that belong to no field and no array."""
    raw = payload.tobytes()
    meta_len = struct.unpack_from("<I", raw, 4)[0]
    taken = [(0, 16 + meta_len)]
    stack = [_codec.decode(payload)]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, np.ndarray) and x.nbytes:
            at = x.ctypes.data - payload.ctypes.data
            taken.append((at, at + x.nbytes))
    gaps, pos = [], 0
    for lo, hi in sorted(taken):
        if lo > pos:
            gaps.append((pos, lo))
        pos = max(pos, hi)
    if pos < len(raw):
        gaps.append((pos, len(raw)))
    return gaps


def _assert_padding_zero(payload):
    gaps = _padding_ranges(payload)
    assert gaps, "the batch was meant to have padding"
    raw = payload.tobytes()
    for lo, hi in gaps:
        assert raw[lo:hi] == bytes(hi - lo), f"bytes {lo}:{hi} of the payload are not zero"


def test_encode_into_defines_every_byte():
    # Whatever the destination held before (a slot's last batch, a
    # producer's scratch) must not reach the payload: the same batch gives
    # the same bytes, run after run.
    batch = _padded_batch()
    n = _codec.encoded_size(batch)
    outs = []
    for fill in (0xAA, 0x55):
        buf = _codec.aligned_empty(n + 256)
        buf[:] = fill
        assert _codec.encode_into(batch, buf) == n
        outs.append(buf[:n])
        assert buf[n:].tobytes() == bytes([fill]) * 256, "wrote past the payload"
    assert outs[0].tobytes() == outs[1].tobytes()
    _assert_padding_zero(outs[0])
    # The strided structured array's padding bytes are zero too (NumPy copies
    # it field by field); a contiguous one keeps the user's bytes as they are.
    st = outs[0].tobytes()
    at = _codec.decode(outs[0])["strided_struct"].ctypes.data - outs[0].ctypes.data
    for i in range(7):
        assert st[at + 16 * i + 1 : at + 16 * i + 8] == bytes(7)
    contiguous = {"c": np.frombuffer(bytes(range(32)), _PADDED)}
    out = _codec.encode(contiguous)
    assert_same(_codec.decode(out), contiguous)
    arr = _codec.decode(out)["c"]
    assert arr.view(np.uint8).tobytes() == bytes(range(32))


def _dirty_ring(rings):
    """A ring whose slots all held 0xAA-filled batches before."""
    from shmpipe.transport import ChannelSpec
    from shmpipe.transports.shm import ShmConsumer, attach_writer

    c = ShmConsumer(ChannelSpec(num_workers=1, capacity=2, slot_size=1 << 14, ordered=False, first_pass=0))
    rings.append(c)
    w = attach_writer(c.handle, 0)
    w.start_pass(0)
    dirty = {"x": np.full((1 << 14) - 256, 0xAA, np.uint8)}
    w.put(dirty)
    w.put(dirty)
    for _ in range(2):
        root = c.reader.take_raw(0, -1, 0, 2.0)
        assert root.tobytes().count(b"\xaa") > 16000
        del root
    return c, w


@pytest.fixture
def rings():
    made = []
    yield made
    for c in made:
        c.close()
        c.destroy()


def test_ring_put_defines_every_byte(rings):
    c, w = _dirty_ring(rings)
    batch = _padded_batch()
    w.put(batch)
    payload = c.reader.take_raw(0, -1, 0, 2.0)
    assert payload.tobytes() == _codec.encode(batch).tobytes()
    _assert_padding_zero(payload)


def test_ring_reserve_defines_every_byte_but_the_arrays(rings):
    from shmpipe._spec import ArraySpec

    c, w = _dirty_ring(rings)
    template = {"a": ArraySpec((3,), "u1"), "t": "tag", "b": ArraySpec((5, 3), "<f4"), "z": ArraySpec((0,), "f8")}
    r = w.reserve(template)
    # The arrays are uninitialised (like numpy.empty): here, the old batch's bytes.
    assert r["b"].view(np.uint8).tobytes() == b"\xaa" * 60
    r["a"][:] = 1
    r["b"][:] = 2
    w.put(r)
    payload = c.reader.take_raw(0, -1, 0, 2.0)
    _assert_padding_zero(payload)
    assert (
        payload.tobytes()
        == _codec.encode(
            {"a": np.ones(3, "u1"), "t": "tag", "b": np.full((5, 3), 2, "<f4"), "z": np.zeros(0)}
        ).tobytes()
    )
