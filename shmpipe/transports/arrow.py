"""The "arrow" transport: the shared-memory ring with Arrow IPC payloads.

Each slot of the ring (the same slots, protocol and clean-up as "shm": this
transport is the ring with another payload encoding) holds one batch encoded
with Arrow's IPC format instead of shmpipe's own layout, so any Arrow reader
can make sense of the bytes. No pickle anywhere.

Slot payload::

    0   u32 magic "SPAR"
    4   u32 header_nbytes
    8   header: JSON in ASCII (non-ASCII text escaped)
            {"tree": <structure>, "leaves": [<leaf>, ...], "tensors": [[offset, nbytes], ...]}
    D   one Arrow IPC tensor message per array, each at a multiple of 64,
        in order, none over another (D = round_up(8 + header_nbytes, 64))

``tree`` is the batch's nesting as ``shmpipe._tree.flatten`` writes it, and
``leaves`` its leaves in order: ``{"a": i, "shape": [...]}`` (array: tensor
``i``), ``{"g": i, "shape": []}`` (NumPy scalar: a 0-d tensor),
``{"v": value}`` (int, float, bool, str, None), ``{"y": base64}`` (bytes).
Tensors are used in order, each by one leaf. Arrays of a dtype Arrow
tensors cannot hold as they are (big-endian, complex, datetime, strings,
structured, bool, ...) travel as a uint8 tensor of their bytes, with
``"dtype"`` (named as in shmpipe's own layout) in their leaf, and are viewed
back as that dtype: still zero-copy, still bit-exact.

A batch is checked by the codec of the "shm" transport before it is laid
out, so both transports accept the same batches and refuse the others with
the same messages; beyond that, this transport refuses a batch of more
structure than its header may hold (MAX_HEADER_VALUES, a BatchTypeError:
put such data in arrays). Every byte of a payload is defined (padding
zeroed).

Arrow tensors put their body on a 64-byte boundary, so the arrays read back
are 64-byte aligned: TensorFlow can alias them. (Arrow *record batches* in
IPC are only 8-byte aligned; that is why this transport uses tensors.)

Decoding: the payload is in shared memory, which a producer (or any process
of the user) may rewrite while decode() reads it, so decode() treats it as
untrusted and reads what describes memory once, into private copies:

* the header is copied out (bytes), counted before it is parsed (in C,
  ``_codec.json_census``: ASCII, at most MAX_HEADER_VALUES values, nesting
  no deeper than the tree's limit _tree.MAX_DEPTH allows, no number longer
  than Python's default limit of digits), then parsed and checked: exact
  keys, each leaf one of the forms above, every index, shape, span and
  dtype name checked (dtype names looked up by the codec's closed table).
  Text and bytes leaves come from this copy: nothing is decoded in place.
* each tensor message's prefix and metadata (the flatbuffer Message with
  its Tensor) are copied out, and read from the copy by
  ``transports/_arrow_tensor.py``, not by Arrow: pyarrow's reader takes a
  message from one buffer, checks its flatbuffer there and then reads it
  there again, so a rewrite in between made it follow an offset it never
  checked (a crash, not an error); and it cannot be given the metadata and
  the body apart. Its type, shape, strides and data buffer are checked
  against the leaf, the message's span and the payload.
* only the tensors' bodies stay in shared memory: each array is a read-only
  view of the payload at the body's place (64-byte aligned, inside its
  message's span). A rewrite of a body changes the data delivered, and
  nothing else.

Anything malformed is a CorruptChannelError that says what was wrong; no
other exception, and a payload of a few MiB cannot make more objects than
its header's cap (``tests/test_arrow_safety.py``,
``tests/test_arrow_fuzz.py``).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import struct
from typing import Any

import numpy as np

from shmpipe import _codec, _external, _ring, _tree
from shmpipe._spec import new_arrays
from shmpipe.errors import BatchTypeError, CorruptChannelError
from shmpipe.transport import AGAIN, END, FAULT, ChannelSpec, require
from shmpipe.transports import _arrow_tensor
from shmpipe.transports.shm import ShmConsumer, ShmProducer, ShmTransport

pa = require("pyarrow", transport="arrow", extra="arrow")

__all__ = ["ArrowTransport", "decode", "encode", "encoded_size"]

MAGIC = 0x52415053  # b"SPAR"
ALIGN = 64

#: Most values (JSON's: each list, object, key, string, number) a header may
#: hold: the batch's containers and leaves, each leaf's fields, each tensor's
#: span. Checked before the header is parsed, on the encoder's side too (a
#: batch over it is a BatchTypeError there): a payload of a few MiB cannot
#: make more objects than this. (A header also holds at most one value per
#: two of its bytes, a value and its separator.)
MAX_HEADER_VALUES = 1 << 18
# Deepest bracket nesting of a header: the tree nests two a level (a node,
# then its list of children) from the header's own object down to
# _tree.MAX_DEPTH, deeper than any leaf's fields.
_MAX_JSON_DEPTH = 2 * _tree.MAX_DEPTH + 3
# Longest number in a header: an int of Python's default limit of digits,
# and its sign (json.loads parses digits in quadratic time, and a process
# may lift the limit).
_MAX_NUMBER = 4301
_MAX_DIM = 2**63 - 1
_MAX_DTYPE_NAME = 0xFFFF  # as the codec's (a u16 length there)
_HEAD = struct.Struct("<II")
_UINT8 = np.dtype(np.uint8)
# A \u escape of a surrogate: only then can json.loads make a str that is not text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


#: dtypes an Arrow tensor holds as themselves (in native byte order); bool
#: is not one (it comes back as uint8)
_ARROW_NATIVE = {
    np.dtype(t)
    for t in (
        np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64,
    )
}


class _Plan:
    """A batch laid out for Arrow: its JSON header and its tensors."""

    __slots__ = ("header", "nbytes", "offsets", "sizes", "tensors")

    def __init__(self, batch: Any) -> None:
        _codec.encoded_size(batch)  # the codec's checks: a bad batch is a BatchTypeError here
        tree, leaves = _tree.flatten(batch)
        self.tensors: list[Any] = []
        described = [self._leaf(leaf) for leaf in leaves]
        sizes = [pa.ipc.get_tensor_size(t) for t in self.tensors]
        # Offsets depend on the header's length, which depends on them: lay
        # out with a header size that has room for the offsets, then fix it.
        try:
            header = json.dumps({"tree": tree, "leaves": described, "tensors": [[0, n] for n in sizes]}).encode()
        except ValueError as exc:  # an int of more digits than Python writes
            raise BatchTypeError(f"cannot go into the arrow transport's JSON header: {exc}") from None
        room = len(header) + 24 * len(sizes) + 16
        start = _round_up(8 + room)
        offsets, pos = [], start
        for n in sizes:
            offsets.append(pos)
            pos = _round_up(pos + n)
        spans = [[o, n] for o, n in zip(offsets, sizes, strict=True)]
        self.header = json.dumps({"tree": tree, "leaves": described, "tensors": spans}).encode()
        if 8 + len(self.header) > start:
            raise AssertionError("arrow header outgrew its room")
        try:  # what the decoder will check first
            _codec.json_census(self.header, MAX_HEADER_VALUES, _MAX_JSON_DEPTH, _MAX_NUMBER)
        except CorruptChannelError as exc:
            raise BatchTypeError(f"too much structure for the arrow transport ({exc}): put it in arrays") from None
        self.offsets = offsets
        self.sizes = sizes
        self.nbytes = pos if sizes else 8 + len(self.header)

    def _tensor(self, arr: np.ndarray) -> dict[str, Any]:
        if not arr.flags.c_contiguous:  # (ascontiguousarray would make 0-d arrays 1-d)
            arr = np.ascontiguousarray(arr)  # a copy, for non-contiguous input only
        node: dict[str, Any] = {"a": len(self.tensors), "shape": list(arr.shape)}
        dt = arr.dtype
        if dt in _ARROW_NATIVE and dt.isnative:
            self.tensors.append(pa.Tensor.from_numpy(arr))
            return node
        raw = arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, np.uint8)
        self.tensors.append(pa.Tensor.from_numpy(raw))
        name = _codec.dtype_name(dt)  # not None: the codec accepted the batch
        assert name is not None
        node["dtype"] = name.decode()
        return node

    def _leaf(self, leaf: Any) -> dict[str, Any]:
        if isinstance(leaf, np.ndarray):
            return self._tensor(leaf)
        if isinstance(leaf, np.generic):
            node = self._tensor(np.asarray(leaf))
            node["g"] = node.pop("a")
            return node
        if type(leaf) is bytes:
            return {"y": base64.b64encode(leaf).decode()}
        return {"v": leaf}  # None, bool, int, float or str: the codec let nothing else through

    def write(self, buf: np.ndarray) -> int:
        """Writes the payload into `buf` (a writable uint8 array); returns its size."""
        head = np.array([MAGIC, len(self.header)], dtype="<u4").view(np.uint8)
        buf[:8] = head
        end = 8 + len(self.header)
        buf[8:end] = np.frombuffer(self.header, np.uint8)
        # The padding zeroed too: every byte of a payload is defined.
        buf[end : self.offsets[0] if self.offsets else self.nbytes] = 0
        mv = buf.data  # a memoryview of the slot
        for t, off, n in zip(self.tensors, self.offsets, self.sizes, strict=True):
            end = off + n
            pa.ipc.write_tensor(t, pa.FixedSizeBufferWriter(pa.py_buffer(mv[off:end])))
            pad = -end % ALIGN  # (a memoryview's copy: a quarter of the time of a NumPy fill)
            mv[end : end + pad] = _ZEROS[:pad]
        return self.nbytes


_ZEROS = memoryview(bytes(ALIGN))


def encoded_size(batch: Any) -> int:
    return _Plan(batch).nbytes


def encode(batch: Any) -> np.ndarray:
    """The payload of `batch` in a new 64-byte aligned buffer (tests)."""
    plan = _Plan(batch)
    buf = _codec.aligned_empty(plan.nbytes)
    plan.write(buf)
    return buf


def decode(root: np.ndarray) -> Any:
    """The batch in `root` (a uint8 array holding a payload), as read-only
    views of it; every array keeps `root` alive. Anything malformed is a
    CorruptChannelError (see the module doc: what is copied, what is not)."""
    n = root.nbytes
    if n < 8:
        raise CorruptChannelError("an arrow payload is too short")
    magic, hlen = _HEAD.unpack(bytes(root[:8]))
    if magic != MAGIC or hlen > n - 8:
        raise CorruptChannelError("not an arrow payload of shmpipe")
    tree, described, spans = _header(bytes(root[8 : 8 + hlen]))  # the header, copied once
    tensors = _Tensors(root, spans, _round_up(8 + hlen))
    leaves = [_leaf(node, tensors) for node in described]
    if tensors.used != len(spans):
        raise CorruptChannelError(f"an arrow payload has {len(spans)} tensors, and its leaves use {tensors.used}")
    try:
        return _tree.unflatten(tree, leaves)
    except ValueError as exc:
        raise CorruptChannelError(f"an arrow payload's tree is malformed: {exc}") from None


def _header(text: bytes) -> tuple[Any, list[Any], list[Any]]:
    """(tree, leaves, tensors) of the header `text` (a private copy)."""
    # Counted before json.loads makes a single object of it.
    _codec.json_census(text, MAX_HEADER_VALUES, _MAX_JSON_DEPTH, _MAX_NUMBER)
    try:
        header = json.loads(text.decode("ascii"))
        if _SURROGATE_ESCAPE.search(text) is not None:  # a str of lone surrogates is no text
            json.dumps(header, ensure_ascii=False).encode()
    except ValueError as exc:  # JSONDecodeError, an int of too many digits, not UTF-8
        raise CorruptChannelError(f"an arrow payload's header cannot be read: {exc}") from None
    if type(header) is not dict or header.keys() != _HEADER_KEYS:
        raise CorruptChannelError("an arrow payload's header is not {tree, leaves, tensors}")
    described, spans = header["leaves"], header["tensors"]
    if type(described) is not list or type(spans) is not list:
        raise CorruptChannelError("an arrow payload's header has no lists of leaves and tensors")
    return header["tree"], described, spans


class _Tensors:
    """The payload's tensor messages, read in order: each message's
    metadata from a private copy, its body left in shared memory."""

    __slots__ = ("next_at", "root", "spans", "used")

    def __init__(self, root: np.ndarray, spans: list[Any], start: int) -> None:
        self.root = root
        self.spans = spans
        self.used = 0
        self.next_at = start  # messages follow the header and each other, in order

    def take(self, index: Any) -> tuple[_arrow_tensor.TensorMeta, int]:
        """The metadata of tensor `index` (the next one), and where in the
        payload its bytes start."""
        if type(index) is not int or index != self.used or index >= len(self.spans):
            raise CorruptChannelError(f"an arrow payload's leaf names tensor {index!r:.20}, not the next one")
        span = self.spans[index]
        self.used += 1
        n = self.root.nbytes
        if type(span) is not list or len(span) != 2:
            raise CorruptChannelError("an arrow payload's tensor span is not [offset, nbytes]")
        off, size = span
        if not (
            type(off) is int and type(size) is int and off % ALIGN == 0
            and self.next_at <= off and _arrow_tensor.PREFIX <= size <= n - off
        ):  # fmt: skip
            raise CorruptChannelError("an arrow payload's tensor lies outside it, or over another")
        self.next_at = off + size
        root = self.root
        mlen = _arrow_tensor.read_prefix(bytes(root[off : off + 8]))
        if mlen > size - 8:
            raise CorruptChannelError("an arrow payload's tensor metadata runs past its message")
        meta = _metadata(bytes(root[off + 8 : off + 8 + mlen]))  # copied once, then read
        body = off + 8 + mlen
        if meta.body_length > size - 8 - mlen:
            raise CorruptChannelError("an arrow payload's tensor body runs past its message")
        return meta, body + meta.data_offset


#: Metadata already read (a private copy maps to what it says: batch after
#: batch usually repeats it); bounded.
_parsed: dict[bytes, _arrow_tensor.TensorMeta] = {}


def _metadata(meta: bytes) -> _arrow_tensor.TensorMeta:
    got = _parsed.get(meta)
    if got is None:
        got = _arrow_tensor.read_metadata(meta)
        if len(meta) <= 4096:
            if len(_parsed) >= 256:
                _parsed.clear()
            _parsed[meta] = got
    return got


_HEADER_KEYS = {"tree", "leaves", "tensors"}
# leaf kind -> (the key naming its tensor, whether a dtype name travels, a NumPy scalar)
_FORMS: dict[frozenset[str], tuple[str, bool, bool]] = {
    frozenset({"a", "shape"}): ("a", False, False),
    frozenset({"a", "shape", "dtype"}): ("a", True, False),
    frozenset({"g", "shape"}): ("g", False, True),
    frozenset({"g", "shape", "dtype"}): ("g", True, True),
}
_VALUE_TYPES = (type(None), bool, int, float, str)


def _leaf(node: Any, tensors: _Tensors) -> Any:
    if type(node) is not dict:
        raise CorruptChannelError("an arrow payload's leaf is not an object")
    if len(node) == 1:
        if "v" in node and type(node["v"]) in _VALUE_TYPES:
            return node["v"]
        if "y" in node and type(node["y"]) is str:
            try:
                return base64.b64decode(node["y"], validate=True)
            except ValueError:
                raise CorruptChannelError("an arrow payload's bytes leaf is not base64") from None
    form = _FORMS.get(frozenset(node))
    if form is None:
        raise CorruptChannelError(f"an arrow payload's leaf is malformed (keys {sorted(node)!r:.80})")
    key, raw, scalar = form
    shape = _shape(node["shape"])
    if scalar and shape:
        raise CorruptChannelError("an arrow payload's NumPy scalar has a shape")
    meta, at = tensors.take(node[key])
    if raw:  # a uint8 tensor of the bytes of an array of this dtype
        dt = _dtype_named(node["dtype"])
        nbytes = math.prod(shape) * dt.itemsize
        if meta.dtype != _UINT8 or meta.shape != (nbytes,):
            raise CorruptChannelError("an arrow payload's raw tensor does not match its leaf")
    else:
        dt = meta.dtype
        nbytes = math.prod(shape) * dt.itemsize
        if meta.shape != shape and not (shape == () and meta.shape == (1,)):  # (a 0-d tensor, as Arrow may give it)
            raise CorruptChannelError("an arrow payload's tensor does not have its leaf's shape")
    if nbytes > meta.data_length:
        raise CorruptChannelError("an arrow payload's tensor holds fewer bytes than its shape needs")
    arr = _array(tensors.root, at, nbytes, dt, shape, meta)
    return arr[()] if scalar else arr


def _array(root: np.ndarray, at: int, nbytes: int, dt: np.dtype, shape: tuple[int, ...], meta: Any) -> np.ndarray:
    """The array of `nbytes` at `at`: a read-only view of `root` itself.
    (Arrow's own to_numpy() array has a pyarrow buffer for base, through
    which NumPy lets anyone make it writable again: a write would change the
    slot under the producers.)"""
    if nbytes == 0:  # nothing to view (a zero dim, or items of no bytes)
        try:
            arr = np.empty(shape, dt)
        except ValueError as exc:  # "array is too big"
            raise CorruptChannelError(f"an arrow payload's array cannot be made: {exc}") from None
        arr.flags.writeable = False
        return arr
    if at % ALIGN:
        raise CorruptChannelError(f"an arrow payload's tensor is not {ALIGN}-byte aligned")
    if meta.strides:  # row-major, as written (a dim of one may have any stride)
        step = meta.dtype.itemsize
        if len(meta.strides) != len(meta.shape):
            raise CorruptChannelError("an arrow payload's tensor has strides for other dimensions")
        for dim, stride in zip(reversed(meta.shape), reversed(meta.strides), strict=True):
            if dim > 1 and stride != step:
                raise CorruptChannelError("an arrow payload's tensor is not row-major")
            step *= dim
    arr = root[at : at + nbytes].view(dt).reshape(shape)
    arr.flags.writeable = False  # (root is read-only and owns no buffer NumPy could make writable: nor can this be)
    return arr


def _shape(shape: Any) -> tuple[int, ...]:
    if type(shape) is not list or len(shape) > _arrow_tensor.MAX_NDIM:
        raise CorruptChannelError("an arrow payload's leaf has no shape")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= _MAX_DIM:
            raise CorruptChannelError(f"an arrow payload's leaf has a dimension of {dim!r:.30}")
    return tuple(shape)


def _dtype_named(name: Any) -> np.dtype:
    if type(name) is not str or len(name) > _MAX_DTYPE_NAME:
        raise CorruptChannelError("an arrow payload's leaf names its dtype with no text")
    try:
        return _codec.dtype_from_name(name.encode())
    except CorruptChannelError:
        raise
    except Exception as exc:  # (as the codec: the name is someone else's text)
        raise CorruptChannelError(f"an arrow payload names a dtype that cannot be read: {exc}") from None


class ArrowTransport(ShmTransport):
    """The shared-memory ring carrying Arrow IPC tensors (no pickle)."""

    name = "arrow"
    # The ring's guarantees, except filling slots in place.
    capabilities = dataclasses.replace(
        ShmTransport.capabilities,
        in_place_writes=False,
        serializes="arrow ipc (tensor messages)",
        takes_ready=False,  # payloads are decoded in Python (decode()): no compiled one-call take
    )

    def _consumer(self, spec: ChannelSpec) -> ShmConsumer:
        return ArrowConsumer(spec, backing=self.backing)

    def _producer(self, writer: _ring.RingWriter, outbox: _external.Outbox | None) -> ShmProducer:
        return ArrowProducer(writer, outbox)

    def batch_nbytes(self, batch: Any) -> int:
        return encoded_size(batch)

    @staticmethod
    def _decode_payload(root: np.ndarray) -> Any:
        return decode(root)


class ArrowConsumer(ShmConsumer):
    """The ring's consumer end, decoding Arrow payloads."""

    engine_decodes = False

    def _take(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        root = self.reader.take_raw(pass_no, worker, wseq, wait)
        if root is AGAIN or root is END or root is FAULT:
            return root
        return decode(root)


class ArrowProducer(ShmProducer):
    """A producer's end of the ring, writing Arrow payloads into claimed
    slots, or into memory of their own when larger than a slot."""

    def put(self, batch: Any) -> None:
        plan = _Plan(batch)  # refuses a bad batch before a slot is taken
        self.put_payload(plan.nbytes, plan.write)

    def reserve(self, template: Any) -> Any:
        return new_arrays(template)  # Arrow payloads are not filled in place
