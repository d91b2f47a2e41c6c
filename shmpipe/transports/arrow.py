"""The "arrow" transport: the shared-memory ring with Arrow IPC payloads.

Each slot of the ring (the same slots, protocol and clean-up as "shm") holds
one batch encoded with Arrow's IPC format instead of shmpipe's own layout, so
any Arrow reader can make sense of the bytes. No pickle anywhere.

Slot payload::

    0   u32 magic "SPAR"
    4   u32 header_nbytes
    8   header: UTF-8 JSON {"tree": <node>, "tensors": [[offset, nbytes], ...]}
    D   one Arrow IPC tensor message per array, each at a multiple of 64
        (D = round_up(8 + header_nbytes, 64))

The tree keeps the batch's nesting: ``{"d": [[key, node], ...]}`` (dict),
``{"l": [...]}``, ``{"t": [...]}`` (list, tuple), ``{"a": i}`` (array: tensor
``i``), ``{"g": i}`` (NumPy scalar: a 0-d tensor), ``{"v": value}`` (int,
float, bool, str, None), ``{"y": base64}`` (bytes). Arrays of a dtype Arrow
tensors cannot hold as they are (big-endian, complex, datetime, strings,
structured, ...) travel as a uint8 tensor of their bytes, with ``"dtype"``
and ``"shape"`` in their node, and are viewed back as that dtype: still
zero-copy, still bit-exact.

Arrow tensors put their body on a 64-byte boundary, so the arrays read back
are 64-byte aligned: TensorFlow can alias them. (Arrow *record batches* in
IPC are only 8-byte aligned; that is why this transport uses tensors.)
"""

from __future__ import annotations

import base64
import dataclasses
import json
import sys
from typing import Any

import numpy as np
import pyarrow as pa

from shmpipe import _ring
from shmpipe._codec import _dtype_from_spec, _dtype_spec
from shmpipe._shm import ShmConsumer, ShmTransport, attach_producer
from shmpipe.errors import BatchTooLargeError, BatchTypeError, CorruptSegmentError
from shmpipe.transport import AGAIN, END, FAULT, ProducerControl, ProducerEnd

__all__ = ["ArrowTransport", "encode", "decode", "encoded_size"]

MAGIC = 0x52415053  # b"SPAR"
ALIGN = 64


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


#: dtypes an Arrow tensor holds as themselves (in native byte order); bool
#: is not one (it comes back as uint8)
_ARROW_NATIVE = {
    np.dtype(t)
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64, np.float16, np.float32, np.float64)
}


class _Plan:
    """A batch laid out for Arrow: its JSON header and its tensors."""

    __slots__ = ("header", "tensors", "offsets", "nbytes")

    def __init__(self, batch: Any) -> None:
        self.tensors: list[pa.Tensor] = []
        tree = self._node(batch, "batch", 0)
        sizes = [pa.ipc.get_tensor_size(t) for t in self.tensors]
        # Offsets depend on the header's length, which depends on them: lay
        # out with a header size that has room for the offsets, then fix it.
        header = json.dumps({"tree": tree, "tensors": [[0, s] for s in sizes]}).encode()
        room = len(header) + 24 * len(sizes) + 16
        start = _round_up(8 + room)
        offsets, pos = [], start
        for s in sizes:
            offsets.append(pos)
            pos = _round_up(pos + s)
        self.header = json.dumps({"tree": tree, "tensors": [[o, s] for o, s in zip(offsets, sizes)]}).encode()
        if 8 + len(self.header) > start:
            raise AssertionError("arrow header outgrew its room")
        self.offsets = offsets
        self.nbytes = pos if sizes else 8 + len(self.header)

    def _tensor(self, arr: np.ndarray, path: str) -> dict:
        if not arr.flags.c_contiguous:  # (ascontiguousarray would make 0-d arrays 1-d)
            arr = np.ascontiguousarray(arr)  # a copy, for non-contiguous input only
        i = len(self.tensors)
        dt = arr.dtype
        node = {"a": i, "shape": list(arr.shape)}
        if dt in _ARROW_NATIVE and dt.isnative:
            self.tensors.append(pa.Tensor.from_numpy(arr))
            return node
        spec = _dtype_spec(dt)  # the same dtype names as shmpipe's own layout
        if spec is None:
            raise BatchTypeError(
                f"dtype {dt!r} cannot be carried: shmpipe carries fixed-size dtypes without "
                "Python objects",
                path,
            )
        raw = arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, np.uint8)
        self.tensors.append(pa.Tensor.from_numpy(raw))
        node["dtype"] = spec.decode()
        return node

    def _node(self, obj: Any, path: str, depth: int) -> Any:
        if depth > 64:
            raise BatchTypeError("nested more than 64 levels deep (does it contain itself?)", path)
        t = type(obj)
        if isinstance(obj, np.ndarray):
            ma = sys.modules.get("numpy.ma")
            if ma is not None and isinstance(obj, ma.MaskedArray):
                raise BatchTypeError("masked arrays cannot be carried", path)
            return self._tensor(obj, path)
        if t is dict:
            items = []
            for k, v in obj.items():
                if type(k) is not str:
                    raise BatchTypeError(f"dict keys must be str, not {type(k).__name__}", f"{path}[{k!r}]")
                items.append([k, self._node(v, f"{path}[{k!r}]", depth + 1)])
            return {"d": items}
        if t is list or t is tuple:
            return {"l" if t is list else "t": [self._node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]}
        if obj is None or t in (bool, int, float, str):
            return {"v": obj}
        if t is bytes:
            return {"y": base64.b64encode(obj).decode()}
        if isinstance(obj, np.generic):
            node = self._tensor(np.asarray(obj), path)
            node["g"] = node.pop("a")
            return node
        raise BatchTypeError(
            f"unsupported type {t.__module__}.{t.__qualname__}; a batch holds NumPy arrays, "
            "int, float, bool, str, bytes and None in tuples, lists and dicts with str keys",
            path,
        )

    def write(self, buf: np.ndarray) -> int:
        """Writes the payload into `buf` (a writable uint8 array); returns its size."""
        head = np.array([MAGIC, len(self.header)], dtype="<u4").view(np.uint8)
        buf[:8] = head
        buf[8 : 8 + len(self.header)] = np.frombuffer(self.header, np.uint8)
        mv = memoryview(buf)
        for t, off in zip(self.tensors, self.offsets):
            n = pa.ipc.get_tensor_size(t)
            pa.ipc.write_tensor(t, pa.FixedSizeBufferWriter(pa.py_buffer(mv[off : off + n])))
        return self.nbytes


def encoded_size(batch: Any) -> int:
    return _Plan(batch).nbytes


def encode(batch: Any) -> np.ndarray:
    """The payload of `batch` in a new 64-byte aligned buffer (tests)."""
    from shmpipe._codec import _aligned_empty

    plan = _Plan(batch)
    buf = _aligned_empty(plan.nbytes)
    plan.write(buf)
    return buf


def decode(root: np.ndarray) -> Any:
    """The batch in `root` (a uint8 array holding a payload), as read-only
    views of it; every array keeps `root` alive."""
    n = root.nbytes
    if n < 8:
        raise CorruptSegmentError("an arrow payload is too short")
    magic, hlen = np.frombuffer(root[:8], "<u4")
    if magic != MAGIC or 8 + hlen > n:
        raise CorruptSegmentError("not an arrow payload of shmpipe")
    try:
        header = json.loads(bytes(root[8 : 8 + hlen]))
        spans = header["tensors"]
        tree = header["tree"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptSegmentError(f"an arrow payload's header cannot be read: {exc}") from None
    buf = pa.foreign_buffer(root.ctypes.data, n, base=root)
    arrays = []
    for off, size in spans:
        if not (0 <= off and off % ALIGN == 0 and off + size <= n):
            raise CorruptSegmentError("an arrow payload's tensor lies outside it")
        arr = pa.ipc.read_tensor(pa.BufferReader(buf.slice(off, size))).to_numpy()
        arr.flags.writeable = False
        arrays.append(arr)
    return _build(tree, arrays)


def _build(node: dict, arrays: list) -> Any:
    if "a" in node or "g" in node:
        arr = arrays[node.get("a", node.get("g"))]
        shape = tuple(node["shape"])
        if "dtype" in node:
            dt = _dtype_from_spec(node["dtype"].encode())
            arr = arr.view(dt) if arr.size else np.zeros(0, dt)
        if arr.shape != shape:  # raw bytes, or a 0-d tensor (Arrow gives shape (1,))
            arr = arr.reshape(shape)
        arr.flags.writeable = False
        return arr[()] if "g" in node else arr
    if "d" in node:
        return {k: _build(v, arrays) for k, v in node["d"]}
    if "l" in node:
        return [_build(v, arrays) for v in node["l"]]
    if "t" in node:
        return tuple(_build(v, arrays) for v in node["t"])
    if "y" in node:
        return base64.b64decode(node["y"])
    return node["v"]


class ArrowTransport(ShmTransport):
    """The shared-memory ring carrying Arrow IPC tensors (no pickle)."""

    name = "arrow"
    # The ring's guarantees, except filling slots in place.
    capabilities = dataclasses.replace(
        ShmTransport.capabilities, in_place_writes=False, serializes="arrow ipc (tensor messages)"
    )
    requires = ("pyarrow",)
    extra = "arrow"
    consumer_class = None  # set below: ArrowConsumer

    def attach(self, handle, worker: int, control: ProducerControl) -> "ArrowProducer":
        return ArrowProducer(attach_producer(handle, worker))

    def batch_nbytes(self, batch: Any) -> int:
        return encoded_size(batch)


class ArrowConsumer(ShmConsumer):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.get = self._get_arrow  # instead of the ring's own decoder
        self._take_raw = self.reader.take_raw

    def _get_arrow(self, pass_no: int, worker: int, wseq: int, wait: float) -> Any:
        root = self._take_raw(pass_no, worker, wseq, wait)
        if root is AGAIN or root is END or root is FAULT:
            return root
        return decode(root)


ArrowTransport.consumer_class = ArrowConsumer


class ArrowProducer(ProducerEnd):
    def __init__(self, writer: _ring.RingWriter) -> None:
        self.writer = writer
        self.start_pass = writer.start_pass
        self.end_pass = writer.finish_pass

    def put(self, batch: Any) -> None:
        plan = _Plan(batch)
        if plan.nbytes > self.writer.ring.slot_size:
            raise BatchTooLargeError(plan.nbytes, self.writer.ring.slot_size)
        slot, buf = self.writer.claim()
        try:
            nbytes = plan.write(buf)
        except BaseException:
            self.writer.abandon(slot)
            raise
        self.writer.publish_claimed(slot, nbytes)

    def end_pass(self) -> None:  # replaced per instance in __init__
        self.writer.finish_pass()
