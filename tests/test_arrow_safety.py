"""The arrow transport's decoder and bytes another process writes (issue 20,
point 10): metadata rewritten while it is decoded, malformed headers, text
read once, and a cap on what a header may describe.

A payload is decoded from a uint8 array: here a writable copy stands for the
slot, in memory shared with a process that rewrites it (MAP_SHARED, forked),
as a producer could. Tests that may crash the decoder run it in a
subprocess, so a crash fails the test, not pytest.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import textwrap
import time
import tracemalloc

import numpy as np
import pytest
from conftest import Command, SharedRuns

from shmpipe import _codec, _tree
from shmpipe.errors import BatchTypeError, CorruptChannelError
from shmpipe.transports import arrow

ALIGN = 64


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def header_of(payload: np.ndarray) -> tuple[dict, int]:
    """(the header, where the tensor messages start) of a payload."""
    (hlen,) = struct.unpack_from("<I", payload, 4)
    return json.loads(bytes(payload[8 : 8 + hlen])), _round_up(8 + hlen)


def rebuilt(batch, change, room: int = 1 << 16) -> np.ndarray:
    """The payload of `batch` with its header replaced by ``change(header)``
    (a JSON-able object, or bytes: the header's text). The tensor messages
    move to `room` (or past a longer header), the header's spans with them."""
    payload = arrow.encode(batch)
    header, start = header_of(payload)
    data = payload[start:]
    header["tensors"] = [[o - start + room, n] for o, n in header["tensors"]]
    new = change(header)
    text = new if isinstance(new, bytes) else json.dumps(new).encode()
    room = max(room, _round_up(8 + len(text)))
    buf = _codec.aligned_empty(room + len(data))
    buf[:] = 0
    buf[:8] = np.frombuffer(struct.pack("<II", arrow.MAGIC, len(text)), np.uint8)
    buf[8 : 8 + len(text)] = np.frombuffer(text, np.uint8)
    buf[room:] = data
    return buf


def decode_or_corrupt(payload: np.ndarray):
    try:
        return arrow.decode(payload)
    except CorruptChannelError as exc:
        assert str(exc)
        return exc


BATCH = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "be": np.arange(5, dtype=">i8"), "s": "text", "n": 7}


def test_a_rebuilt_payload_decodes_as_the_batch():
    # (The helper the tests below start from.)
    out = arrow.decode(rebuilt(BATCH, lambda h: h))
    assert out["s"] == "text" and out["n"] == 7
    np.testing.assert_array_equal(out["x"], BATCH["x"])
    np.testing.assert_array_equal(out["be"], BATCH["be"])
    assert out["be"].dtype == BATCH["be"].dtype


def test_a_payload_is_the_same_bytes_whatever_was_in_the_slot():
    # Every byte defined: the padding is zeroed (it kept a slot's old bytes).
    batch = {**BATCH, "g": np.int8(1), "e": np.zeros((0, 2), ">f4")}
    payload = arrow.encode(batch)
    slot = _codec.aligned_empty(payload.nbytes)
    slot[:] = 0xAB
    arrow._Plan(batch).write(slot)
    assert slot.tobytes() == payload.tobytes()


def test_a_str_leaf_that_is_the_leaf_marker():
    # ("*" marks a leaf in the tree; read back from JSON the str "*" was
    # taken for "no more leaves".)
    assert arrow.decode(arrow.encode(["*", {"k": "*"}, np.arange(2)]))[:2] == ["*", {"k": "*"}]


# -- (1) metadata rewritten while it is decoded ---------------------------------

RACE = r"""
import ctypes, json, mmap, os, struct, sys, time
import numpy as np
from shmpipe.errors import CorruptChannelError
from shmpipe.transports import arrow

WHAT, SECONDS = sys.argv[1], float(sys.argv[2])
batch = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "y": np.arange(5, dtype=np.int64),
         "s": "aaaaaaaaaaaaaaaa", "b": b"AAAAAAAAAAAA"}
payload = arrow.encode(batch)
if WHAT == "names":  # tensors whose dimensions have names: text Arrow read in place
    import pyarrow as pa
    header = json.loads(bytes(payload[8 : 8 + struct.unpack_from("<I", payload, 4)[0]]))
    named = [pa.Tensor.from_numpy(batch["x"], dim_names=["rows", "cols"]),
             pa.Tensor.from_numpy(batch["y"], dim_names=["items"])]
    sizes = [pa.ipc.get_tensor_size(t) for t in named]
    room = 1024
    offs = [room, -(-(room + sizes[0]) // 64) * 64]
    header["tensors"] = [[o, n] for o, n in zip(offs, sizes)]
    text = json.dumps(header).encode()
    payload = np.zeros(offs[1] + sizes[1], np.uint8)
    payload[:8] = np.frombuffer(struct.pack("<II", arrow.MAGIC, len(text)), np.uint8)
    payload[8 : 8 + len(text)] = np.frombuffer(text, np.uint8)
    for t, o, n in zip(named, offs, sizes):
        pa.ipc.write_tensor(t, pa.FixedSizeBufferWriter(pa.py_buffer(payload.data[o : o + n])))
    assert arrow.decode(payload)["x"].shape == (3, 4)

hlen = struct.unpack_from("<I", payload, 4)[0]
header = json.loads(bytes(payload[8 : 8 + hlen]))
words, flips = [], []  # (position, values the writer puts there in turn)
if WHAT in ("metadata", "names"):
    for off, n in header["tensors"]:
        (mlen,) = struct.unpack_from("<i", payload, off + 4)
        meta = bytes(payload[off + 8 : off + 8 + mlen])
        if WHAT == "metadata":  # every word of the prefix and the flatbuffer
            words += [off + k for k in range(0, 8 + mlen, 4)]
        else:  # the length of each dimension's name
            for name in (b"rows", b"cols", b"items"):
                at = meta.find(name)
                if at >= 4:
                    words.append(off + 8 + at - 4)
else:  # "text": the characters of a str leaf and of a bytes leaf's base64, a valid and a non-ASCII byte
    text = bytes(payload[8 : 8 + hlen])
    for needle in (b"aaaaaaaaaaaaaaaa", b"QUFBQUFBQUFBQUFB"):
        at = 8 + text.index(needle)
        flips += [(at + k, payload[at + k]) for k in range(len(needle))]

shared = mmap.mmap(-1, payload.nbytes)  # the slot: shared with the writer below
root = np.frombuffer(shared, np.uint8)
root[:] = payload
orig = payload.copy()
parent = os.getpid()
pid = os.fork()
if pid == 0:  # the writer: rewrites until its parent is gone
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL when the parent dies
    rng = np.random.default_rng(0)
    extremes = [0x7FFFFFFF, 0xFFFFFFF0, 0x80000000, 0x10000, 0xFFFF, 0x40, 0, 1]
    packed = [np.frombuffer(struct.pack("<I", v), np.uint8) for v in extremes]
    while os.getppid() == parent:
        if words:
            for at in rng.choice(words, 64):
                root[at : at + 4] = packed[rng.integers(len(packed))]
                root[at : at + 4] = orig[at : at + 4]
        else:
            for at, good in flips:
                root[at] = 0xFF
                root[at] = good
    os._exit(0)
counts = {"batch": 0, "corrupt": 0}
deadline = time.monotonic() + SECONDS
try:
    while time.monotonic() < deadline:
        try:
            out = arrow.decode(root)
        except CorruptChannelError:
            counts["corrupt"] += 1
            continue
        except Exception as exc:
            key = type(exc).__name__
            counts[key] = counts.get(key, 0) + 1
            continue
        counts["batch"] += 1
        if WHAT == "text":  # only the text that was there: never a byte the writer flipped in
            assert out["s"] == "a" * 16 and out["b"] == b"A" * 12, (out["s"], out["b"])
        else:
            assert out["x"].shape == (3, 4) and out["y"].shape == (5,)
finally:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps(counts))
"""


#: The races of these tests: what is rewritten, for how long.
RACES = {
    "test_rewriting_tensor_metadata_while_it_is_decoded_never_crashes": ("metadata", 5.0),
    "test_text_and_bytes_leaves_are_read_once_from_a_private_copy": ("text", 3.0),
    "test_dimension_names_rewritten_while_decoded_are_not_read": ("names", 4.0),
}


def _race_command(key, folder):
    what, seconds = key
    # The test process's sys.path (the installed package in a clean clone),
    # run outside the repository: `python -c` puts the working directory
    # first, and the source tree there has no built extensions.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return Command([sys.executable, "-c", textwrap.dedent(RACE), what, str(seconds)], cwd=folder, env=env,
                   timeout=seconds + 60)


#: The three races are independent processes (a decoder and its writer
#: each): the first of their tests runs all three at once. A decoder is then
#: also preempted in the middle of a decode, its writer running meanwhile,
#: as on a loaded machine.
RACE_RUNS = SharedRuns(set(RACES), keys=lambda item: [RACES[item.originalname]], command=_race_command, jobs=3)


def race(request) -> dict:
    """Decodes a payload for a few seconds while another process rewrites a
    part of it (RACES), in a subprocess; the counts of outcomes (a crash
    fails here)."""
    proc, _ = RACE_RUNS.get(request, RACES[request.node.originalname])
    assert proc.returncode == 0, f"the decoder died (exit status {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)  # the first of RACE_RUNS waits for all three
def test_rewriting_tensor_metadata_while_it_is_decoded_never_crashes(request):
    # Arrow's reader checked a tensor message's flatbuffer in the slot, then
    # read it there again: rewritten in between, it followed an offset it had
    # not checked (SIGSEGV within a second or two, every run). Now the
    # metadata is copied once, then read: a batch or a CorruptChannelError.
    counts = race(request)
    assert set(counts) == {"batch", "corrupt"}, counts
    assert counts["batch"] > 100 and counts["corrupt"] > 100, counts  # the writer did get in


def test_arrays_are_read_only_aligned_views_of_the_payload():
    # Zero-copy still: each array lies in the payload, at a multiple of 64,
    # and cannot be made writable (the slot's root is read-only).
    encoded = arrow.encode({**BATCH, "raw": np.arange(6, dtype=">f4").reshape(2, 3), "g": np.float16(2)})
    payload = np.frombuffer(encoded.tobytes(), np.uint8)  # read-only, as a slot's root: no way to make it writable
    out = arrow.decode(payload)
    lo = payload.ctypes.data
    for key in ("x", "be", "raw"):
        arr = out[key]
        assert lo <= arr.ctypes.data and arr.ctypes.data + arr.nbytes <= lo + payload.nbytes
        assert (arr.ctypes.data - lo) % ALIGN == 0  # (in a slot, itself aligned)
        with pytest.raises(ValueError):
            arr.flags.writeable = True
    assert out["raw"].dtype == np.dtype(">f4") and out["raw"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["g"] == np.float16(2) and type(out["g"]) is np.float16


# -- (2) malformed headers ------------------------------------------------------


def _leaf(i: int):
    """A change that applies `fn` to leaf `i` of the header."""

    def at(fn):
        def change(h):
            h["leaves"][i] = fn(h["leaves"][i])
            return h

        return change

    return at


def _deep(n: int) -> bytes:
    return b'{"tree": ' + b"[" * n + b"]" * n + b', "leaves": [], "tensors": []}'


MALFORMED = {
    # what the old decoder did instead, where it did not raise CorruptChannelError
    "dtype not a str": _leaf(1)(lambda leaf: {**leaf, "dtype": 5}),  # (AttributeError)
    "dtype a list": _leaf(1)(lambda leaf: {**leaf, "dtype": [">i8"]}),  # (AttributeError)
    "nested 100,000 deep": lambda h: _deep(100_000),  # (RecursionError)
    "nested past the tree's limit": lambda h: _deep(2 * _tree.MAX_DEPTH + 8),
    "dimension past int64": _leaf(0)(lambda leaf: {**leaf, "shape": [2**64, 0]}),
    "dimension of 2**200": _leaf(0)(lambda leaf: {**leaf, "shape": [2**200]}),
    "a number of 10,000 digits": lambda h: (
        json.dumps(h).encode().replace(b'{"v": 7}', b'{"v": ' + b"9" * 10_000 + b"}")
    ),
    "tensor span cutting its body": lambda h: {
        **h,
        "tensors": [[h["tensors"][0][0], h["tensors"][0][1] - 4], h["tensors"][1]],
    },  # (OSError)
    "tensor span cutting its metadata": lambda h: {**h, "tensors": [[h["tensors"][0][0], 100], h["tensors"][1]]},
    "tensor span of one byte": lambda h: {**h, "tensors": [[h["tensors"][0][0], 1], h["tensors"][1]]},
    "an unknown key in the header": lambda h: {**h, "extra": 1},  # (decoded)
    "an unknown key in a leaf": _leaf(0)(lambda leaf: {**leaf, "zz": 1}),  # (decoded)
    "a value leaf holding a list": _leaf(2)(lambda leaf: {"v": [1, 2, 3]}),  # (decoded: a list for a leaf)
    "a value leaf holding an object": _leaf(3)(lambda leaf: {"v": {"a": 1}}),  # (decoded)
    "two kinds of leaf in one": _leaf(2)(lambda leaf: {"v": 1, "y": "QQ=="}),  # (decoded)
    "a tensor index of -1": _leaf(0)(lambda leaf: {**leaf, "a": -1}),
    "a tensor index of true": _leaf(0)(lambda leaf: {**leaf, "a": True}),
    "a tensor used twice": _leaf(1)(lambda leaf: {**leaf, "a": 0}),
    "a tensor no leaf uses": lambda h: {**h, "tensors": h["tensors"] + [h["tensors"][1]]},  # (decoded)
    "a dtype name of a lone surrogate": _leaf(1)(lambda leaf: {**leaf, "dtype": "\ud800"}),
    "a str leaf of a lone surrogate": _leaf(2)(lambda leaf: {"v": "\udc00x"}),  # (decoded: no text)
    "bytes leaf not base64": _leaf(2)(lambda leaf: {"y": "!!!!QUFB"}),  # (decoded: the ! skipped)
    "bytes leaf not a str": _leaf(2)(lambda leaf: {"y": 5}),
    "a dict repeating a key": lambda h: {**h, "tree": ["d", ["x", "x", "s", "n"], h["tree"][2]]},  # (decoded)
    "header a list": lambda h: [h["tree"], h["leaves"], h["tensors"]],
    "header a str": lambda h: "tree",
    "leaves an object": lambda h: {**h, "leaves": {"0": h["leaves"][0]}},
    "a leaf a number": _leaf(2)(lambda leaf: 5),
    "shape of floats": _leaf(0)(lambda leaf: {**leaf, "shape": [3.0, 4.0]}),  # (decoded: (3, 4) == (3.0, 4.0))
    "shape a str": _leaf(0)(lambda leaf: {**leaf, "shape": "34"}),
    "shape of 65 dims": _leaf(0)(lambda leaf: {**leaf, "shape": [1] * 65}),
    "shape not the tensor's": _leaf(0)(lambda leaf: {**leaf, "shape": [4, 3]}),  # (decoded, reshaped)
    "a raw dtype of another size": _leaf(1)(lambda leaf: {**leaf, "dtype": ">i4"}),
    "a scalar with a shape": _leaf(0)(lambda leaf: {"g": 0, "shape": [3, 4]}),  # (decoded: an array)
    "span offsets overlapping": lambda h: {**h, "tensors": [h["tensors"][0], h["tensors"][0]]},
    "span offset unaligned": lambda h: {**h, "tensors": [[h["tensors"][0][0] + 8, 64], h["tensors"][1]]},
    "span offset in the header": lambda h: {**h, "tensors": [[0, 512], h["tensors"][1]]},
    "span offset 2**70": lambda h: {**h, "tensors": [[2**70, 512], h["tensors"][1]]},
    "span not a pair": lambda h: {**h, "tensors": [[h["tensors"][0][0]], h["tensors"][1]]},
    "a span an object": lambda h: {**h, "tensors": [{"0": 1}, h["tensors"][1]]},
    "not JSON": lambda h: b'{"tree": [',
    "not ASCII": lambda h: json.dumps(h).encode().replace(b'"s"', b'"\xc3\xa9"'),  # (decoded: the encoder writes ASCII)
    "NUL bytes (JSON as UTF-32)": lambda h: b"[\x00\x00\x00]\x00\x00\x00",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_header_is_a_corrupt_channel_error(case):
    payload = rebuilt(BATCH, MALFORMED[case])
    with pytest.raises(CorruptChannelError) as info:
        arrow.decode(payload)
    assert str(info.value)


def _word(at_in_message: int, value: int):
    """A change of the u32 at `at_in_message` in the first tensor message."""

    def change(payload: np.ndarray) -> np.ndarray:
        header, _ = header_of(payload)
        at = header["tensors"][0][0] + at_in_message
        payload[at : at + 4] = np.frombuffer(struct.pack("<I", value), np.uint8)
        return payload

    return change


BAD_MESSAGES = {
    "negative metadata size": _word(4, 0xFFFFFFF0),  # (OSError)
    "metadata size past the message": _word(4, 0x7FFF0000),
    "no continuation marker": _word(0, 0x12345678),
    "the flatbuffer's root outside it": _word(8, 0x10000),
    "the flatbuffer's root at its end": _word(8, 0xFFFFFFFC),
}


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
def test_a_malformed_tensor_message_is_a_corrupt_channel_error(case):
    payload = BAD_MESSAGES[case](arrow.encode(BATCH))
    with pytest.raises(CorruptChannelError):
        arrow.decode(payload)


def test_every_word_of_a_tensor_message_set_to_extremes():
    # Each u32 of both messages' prefix and flatbuffer, set in turn to values
    # that stand for offsets, lengths and counts: a batch or a CorruptChannelError.
    payload = arrow.encode(BATCH)
    header, _ = header_of(payload)
    seen = set()
    for off, _ in header["tensors"]:
        (mlen,) = struct.unpack_from("<i", payload, off + 4)
        for at in range(off, off + 8 + mlen, 4):
            for value in (0, 1, 4, 0x40, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFF0, 0xFFFFFFFF):
                bad = payload.copy()
                bad[at : at + 4] = np.frombuffer(struct.pack("<I", value), np.uint8)
                out = decode_or_corrupt(bad)
                seen.add(type(out).__name__)
    assert seen == {"dict", "CorruptChannelError"}


def test_the_deepest_batch_the_encoder_accepts_round_trips():
    # The header's limit on nesting lets through every batch the codec
    # accepts (lists and dicts nest as deep in JSON).
    batch = np.arange(3)
    while True:
        deeper = [batch] if isinstance(batch, dict) else {"k": batch}
        try:
            arrow.encode(deeper)
        except BatchTypeError:
            break
        batch = deeper
    out = arrow.decode(arrow.encode(batch))
    depth = 0
    while type(out) is not np.ndarray:
        out = out[0] if type(out) is list else out["k"]
        depth += 1
    assert depth == _tree.MAX_DEPTH and out.tolist() == [0, 1, 2]


# -- (3) text read once ---------------------------------------------------------


@pytest.mark.timeout(300)  # the first of RACE_RUNS waits for all three
def test_text_and_bytes_leaves_are_read_once_from_a_private_copy(request):
    # A writer flips the characters of a str leaf and of a bytes leaf's
    # base64 between themselves and a byte that is not ASCII: a decode that
    # checked the text in the slot and read it there again would deliver the
    # flipped byte. (The old decoder passed this too: its header was copied
    # with bytes() before json.loads.)
    counts = race(request)
    assert set(counts) == {"batch", "corrupt"}, counts
    assert counts["batch"] > 10 and counts["corrupt"] > 10, counts


@pytest.mark.timeout(300)  # the first of RACE_RUNS waits for all three
def test_dimension_names_rewritten_while_decoded_are_not_read(request):
    # Text in the tensor messages: Arrow's reader checked a dimension's name
    # in the slot, then copied it from there (its length read again). The
    # names are now never read: any batch, or a CorruptChannelError.
    counts = race(request)
    assert set(counts) <= {"batch", "corrupt"} and counts["batch"] > 100, counts


# -- (4) a cap on what a header describes ---------------------------------------


@pytest.mark.parametrize(
    "text, values",
    [
        (b"", 1),
        (b"7", 1),
        (b"[]", 2),
        (b'{"a": [1, [2, "x,[{\\" :"], {}]}', 9),  # 8 values: the ones in the string do not count
        (b'["\\\\", [1]]', 4),  # an escaped backslash ends its escape: the string ends at the next quote
    ],
)
def test_json_census_bounds_the_values_json_makes(text, values):
    assert _codec.json_census(text, 100, 10, 10) == values
    json.loads(text or b"0")


@pytest.mark.parametrize(
    "text, words",
    [
        (b"[" * 11 + b"]" * 11, "nests more than 10"),
        (b"[" + b"1," * 100 + b"1]", "more than 100 values"),
        (b"12345678901", "a number longer than 10"),
        (b'["\xc3\xa9"]', "not ASCII"),
        (b'["\\', None),  # (an escape past the end: the text ends there)
    ],
)
def test_json_census_refuses_what_is_over_its_limits(text, words):
    if words is None:
        _codec.json_census(text, 100, 10, 10)
        return
    with pytest.raises(CorruptChannelError, match=words):
        _codec.json_census(text, 100, 10, 10)


def _empty_lists(n: int) -> np.ndarray:
    """A payload of a batch of `n` empty lists, as the encoder spells it."""
    text = json.dumps({"tree": ["l", [["l", []]] * n], "leaves": [], "tensors": []}).encode()
    buf = _codec.aligned_empty(8 + len(text))
    buf[:8] = np.frombuffer(struct.pack("<II", arrow.MAGIC, len(text)), np.uint8)
    buf[8:] = np.frombuffer(text, np.uint8)
    return buf


def test_a_small_payload_cannot_decode_into_a_huge_object_graph():
    # 9.9 MB of empty lists: the old decoder made 900,000 lists of them (58 MB
    # held by the batch, 195 MB at its peak while decoding, 4.4 s; tracemalloc).
    # The header is now counted before it is parsed: refused in a millisecond,
    # with nothing allocated but its private copy.
    payload = _empty_lists(900_000)
    assert payload.nbytes > 9_000_000
    tracemalloc.start()
    try:
        t = time.perf_counter()
        with pytest.raises(CorruptChannelError, match="values"):
            arrow.decode(payload)
        took = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12_000_000, f"decoding took {peak / 1e6:.0f} MB at its peak"  # (the header's private copy: 10 MB)
    assert took < 1.0


def test_the_cap_on_values_is_checked_by_the_encoder_too():
    cap = arrow.MAX_HEADER_VALUES
    # Under it: an empty list counts four (its node's brackets, its children's,
    # the commas after "l" and after it).
    fits = [[]] * (cap // 4 - 10)
    out = arrow.decode(arrow.encode(fits))
    assert out == fits
    with pytest.raises(BatchTypeError, match="too much structure for the arrow transport"):
        arrow.encode([[]] * (cap // 4 + 10))
    # Decoding as many as fit stays within a few tens of MB.
    payload = _empty_lists(cap // 4 - 10)
    tracemalloc.start()
    try:
        arrow.decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40_000_000, f"decoding took {peak / 1e6:.0f} MB at its peak"


def test_an_int_too_long_for_the_header_is_a_batch_type_error():
    # (Python writes at most 4,300 digits; it was a ValueError from json.)
    assert arrow.decode(arrow.encode({"v": -(10**4299)}))["v"] == -(10**4299)
    with pytest.raises(BatchTypeError, match="arrow transport's JSON header"):
        arrow.encode({"v": 10**4300})
    if hasattr(sys, "set_int_max_str_digits"):  # a process that lifted the limit: the header's own
        old = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)
        try:
            with pytest.raises(BatchTypeError, match="a number longer than"):
                arrow.encode({"v": 10**5000})
        finally:
            sys.set_int_max_str_digits(old)
