"""An Arrow IPC tensor message's metadata, read without Arrow.

The arrow transport's decoder reads a tensor message in two parts: its
metadata (the prefix and the flatbuffer that describes the tensor), copied
out of shared memory once and read here from that private copy, and its
body (the tensor's bytes), which stays in shared memory and becomes the
array. Arrow's own reader (``pyarrow.ipc.read_tensor``) cannot be given
the two apart: it reads the message from one buffer, checks the
flatbuffer's offsets (its verifier), then reads the flatbuffer again in
place; over a slot that another process can rewrite, the second read may
follow an offset the first never saw (a crash, not an error).

An encapsulated IPC message (Arrow's columnar format, "Encapsulated message
format")::

    0   u32 0xFFFFFFFF (continuation)
    4   i32 metadata_size (the flatbuffer and its padding)
    8   flatbuffer Message {version, header: Tensor, bodyLength}
    8 + metadata_size   body (bodyLength bytes)

and the Tensor (format/Tensor.fbs): ``type`` (a union of Type: only the
Int and FloatingPoint types that shmpipe writes are read), ``shape`` (a
vector of TensorDim tables, each a ``size``; their names are not read),
``strides`` (a vector of int64, optional) and ``data`` (a Buffer struct:
offset and length of the tensor's bytes in the body).

Every read is checked against the copy's length: a table's vtable, each
field inside its table, each offset's target, each vector's length. The
structure is fixed (Message, then Tensor, then its type and dims): nothing
here recurses or loops over more than MAX_NDIM items, whatever the bytes.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from shmpipe.errors import CorruptChannelError

__all__ = ["MAX_METADATA", "MAX_NDIM", "PREFIX", "TensorMeta", "read_prefix", "read_metadata"]

#: The message's prefix: continuation marker and metadata size.
PREFIX = 8
CONTINUATION = 0xFFFFFFFF
#: Most bytes a tensor's metadata may take (what Arrow writes for 64
#: dimensions is under 4 KiB, padding included).
MAX_METADATA = 1 << 16
#: Most dimensions a tensor may have (NumPy's limit).
MAX_NDIM = 64

# flatbuffers enums (format/Message.fbs, Schema.fbs)
_METADATA_V4, _METADATA_V5 = 3, 4
_HEADER_TENSOR = 4
_TYPE_INT, _TYPE_FLOAT = 2, 3

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_I16 = struct.Struct("<h")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_VTABLE = struct.Struct("<HH")
_BUFFER = struct.Struct("<qq")
_PREFIX = struct.Struct("<Ii")

_INTS: dict[tuple[int, bool], np.dtype] = {
    (8, True): np.dtype(np.int8),
    (16, True): np.dtype(np.int16),
    (32, True): np.dtype(np.int32),
    (64, True): np.dtype(np.int64),
    (8, False): np.dtype(np.uint8),
    (16, False): np.dtype(np.uint16),
    (32, False): np.dtype(np.uint32),
    (64, False): np.dtype(np.uint64),
}
_FLOATS: dict[int, np.dtype] = {0: np.dtype(np.float16), 1: np.dtype(np.float32), 2: np.dtype(np.float64)}


class TensorMeta(NamedTuple):
    """What a tensor message's metadata says."""

    dtype: np.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # () where the message has none
    body_length: int  # bytes of the body, after the metadata
    data_offset: int  # the tensor's bytes: where in the body, and how many
    data_length: int


def _bad(what: str) -> CorruptChannelError:
    return CorruptChannelError(f"an arrow payload's tensor message is malformed: {what}")


def read_prefix(prefix: bytes) -> int:
    """The metadata size in a message's 8-byte prefix (a private copy)."""
    marker, size = _PREFIX.unpack(prefix)
    if marker != CONTINUATION:
        raise _bad("no continuation marker")
    if not 0 < size <= MAX_METADATA:
        raise _bad(f"metadata of {size} bytes (at most {MAX_METADATA})")
    return size


class _Flatbuffer:
    """Reads of a flatbuffer in a bytes object, each checked against its length."""

    __slots__ = ("buf", "n")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.n = len(buf)

    def _at(self, pos: int, size: int, what: str) -> int:
        if pos < 0 or pos > self.n - size:
            raise _bad(f"{what} lies outside the metadata")
        return pos

    def ref(self, at: int, what: str) -> int:
        """The position the offset (u32) at `at` points to."""
        (off,) = _U32.unpack_from(self.buf, self._at(at, 4, what))
        return self._at(at + off, 4, what)

    def table(self, pos: int, what: str) -> tuple[int, int, int, int]:
        """(position, vtable position, vtable size, table size) of the table at `pos`."""
        (back,) = _I32.unpack_from(self.buf, self._at(pos, 4, what))
        vt = self._at(pos - back, 4, f"{what}'s vtable")
        vsize, tsize = _VTABLE.unpack_from(self.buf, vt)
        if vsize < 4 or vsize % 2 or vt + vsize > self.n or tsize < 4 or pos + tsize > self.n:
            raise _bad(f"{what}'s vtable is malformed")
        return pos, vt, vsize, tsize

    def field(self, table: tuple[int, int, int, int], index: int, size: int) -> int | None:
        """The position of field `index` (`size` bytes inline), None if absent."""
        pos, vt, vsize, tsize = table
        slot = 4 + 2 * index
        if slot + 2 > vsize:
            return None
        (off,) = _U16.unpack_from(self.buf, vt + slot)
        if not off:
            return None
        if off + size > tsize:
            raise _bad(f"field {index} lies outside its table")
        return pos + off

    def scalar(self, fmt: struct.Struct, table: tuple[int, int, int, int], index: int, default: int) -> int:
        at = self.field(table, index, fmt.size)
        return default if at is None else int(fmt.unpack_from(self.buf, at)[0])

    def vector(self, at: int, item: int, limit: int, what: str) -> tuple[int, int]:
        """(position of the first item, number of items) of the vector that
        the offset at `at` points to; at most `limit` items."""
        start = self.ref(at, what)
        (count,) = _U32.unpack_from(self.buf, start)
        if count > limit or start + 4 + count * item > self.n:
            raise _bad(f"{what} claims {count} items")
        return start + 4, count


def read_metadata(meta: bytes) -> TensorMeta:
    """The tensor that the flatbuffer Message in `meta` (a private copy)
    describes; CorruptChannelError if it is malformed or not a tensor of a
    type this transport writes."""
    fb = _Flatbuffer(meta)
    msg = fb.table(fb.ref(0, "the root"), "the message")
    version = fb.scalar(_I16, msg, 0, 0)
    if version not in (_METADATA_V4, _METADATA_V5):
        raise _bad(f"metadata version {version}")
    if fb.scalar(_U8, msg, 1, 0) != _HEADER_TENSOR:
        raise _bad("not a tensor")
    at = fb.field(msg, 2, 4)
    if at is None:
        raise _bad("no header")
    tensor = fb.table(fb.ref(at, "the tensor"), "the tensor")
    body_length = fb.scalar(_I64, msg, 3, 0)
    dtype = _dtype(fb, tensor)

    at = fb.field(tensor, 2, 4)
    if at is None:
        raise _bad("no shape")
    first, ndim = fb.vector(at, 4, MAX_NDIM, "the shape")
    shape = []
    for k in range(ndim):
        dim = fb.table(fb.ref(first + 4 * k, "a dimension"), "a dimension")
        size = fb.scalar(_I64, dim, 0, 0)
        if size < 0:
            raise _bad(f"dimension {k} is {size}")
        shape.append(size)

    strides: tuple[int, ...] = ()
    at = fb.field(tensor, 3, 4)
    if at is not None:
        first, count = fb.vector(at, 8, MAX_NDIM, "the strides")
        strides = struct.unpack_from(f"<{count}q", meta, first)

    at = fb.field(tensor, 4, _BUFFER.size)
    if at is None:
        raise _bad("no data buffer")
    offset, length = _BUFFER.unpack_from(meta, at)
    if not (0 <= offset and 0 <= length and 0 <= body_length and offset + length <= body_length):
        raise _bad(f"its data ({length} bytes at {offset}) lies outside its body of {body_length}")
    return TensorMeta(dtype, tuple(shape), strides, body_length, offset, length)


def _dtype(fb: _Flatbuffer, tensor: tuple[int, int, int, int]) -> np.dtype:
    kind = fb.scalar(_U8, tensor, 0, 0)
    at = fb.field(tensor, 1, 4)
    if at is None:
        raise _bad("no type")
    typ = fb.table(fb.ref(at, "the type"), "the type")
    dt: np.dtype | None
    if kind == _TYPE_INT:
        dt = _INTS.get((fb.scalar(_I32, typ, 0, 0), bool(fb.scalar(_U8, typ, 1, 0))))
    elif kind == _TYPE_FLOAT:
        dt = _FLOATS.get(fb.scalar(_I16, typ, 0, 0))
    else:
        dt = None
    if dt is None:
        raise _bad("a type this transport does not write")
    return dt
