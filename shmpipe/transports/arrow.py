"""The "arrow" transport: the shared-memory ring with Arrow IPC payloads.

Each slot of the ring (the same slots, protocol and clean-up as "shm": this
transport is the ring with another payload encoding) holds one batch encoded
with Arrow's IPC format instead of shmpipe's own layout, so any Arrow reader
can make sense of the bytes. No pickle anywhere.

Slot payload::

    0   u32 magic "SPAR"
    4   u32 header_nbytes
    8   header: UTF-8 JSON {"tree": <structure>, "leaves": [<leaf>, ...],
                            "tensors": [[offset, nbytes], ...]}
    D   one Arrow IPC tensor message per array, each at a multiple of 64
        (D = round_up(8 + header_nbytes, 64))

``tree`` is the batch's nesting as ``shmpipe._tree.flatten`` writes it, and
``leaves`` its leaves in order: ``{"a": i, "shape": [...]}`` (array: tensor
``i``), ``{"g": i, "shape": []}`` (NumPy scalar: a 0-d tensor),
``{"v": value}`` (int, float, bool, str, None), ``{"y": base64}`` (bytes).
Arrays of a dtype Arrow tensors cannot hold as they are (big-endian,
complex, datetime, strings, structured, ...) travel as a uint8 tensor of
their bytes, with ``"dtype"`` (named as in shmpipe's own layout) in their
leaf, and are viewed back as that dtype: still zero-copy, still bit-exact.

A batch is checked by the codec of the "shm" transport before it is laid
out, so both transports accept the same batches and refuse the others with
the same messages.

Arrow tensors put their body on a 64-byte boundary, so the arrays read back
are 64-byte aligned: TensorFlow can alias them. (Arrow *record batches* in
IPC are only 8-byte aligned; that is why this transport uses tensors.) The
header is read from shared memory, so decode() treats it as untrusted: every
offset, index, shape and dtype is checked, and anything malformed is a
CorruptChannelError.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import numpy as np

from shmpipe import _codec, _external, _ring, _tree
from shmpipe._spec import new_arrays
from shmpipe.errors import CorruptChannelError
from shmpipe.transport import AGAIN, END, FAULT, ChannelSpec, require
from shmpipe.transports.shm import ShmConsumer, ShmProducer, ShmTransport

pa = require("pyarrow", transport="arrow", extra="arrow")

__all__ = ["ArrowTransport", "decode", "encode", "encoded_size"]

MAGIC = 0x52415053  # b"SPAR"
ALIGN = 64


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

    __slots__ = ("header", "nbytes", "offsets", "tensors")

    def __init__(self, batch: Any) -> None:
        _codec.encoded_size(batch)  # the codec's checks: a bad batch is a BatchTypeError here
        tree, leaves = _tree.flatten(batch)
        self.tensors: list[Any] = []
        described = [self._leaf(leaf) for leaf in leaves]
        sizes = [pa.ipc.get_tensor_size(t) for t in self.tensors]
        # Offsets depend on the header's length, which depends on them: lay
        # out with a header size that has room for the offsets, then fix it.
        header = json.dumps({"tree": tree, "leaves": described, "tensors": [[0, n] for n in sizes]}).encode()
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
        self.offsets = offsets
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
        mv = buf.data  # a memoryview of the slot
        for t, off in zip(self.tensors, self.offsets, strict=True):
            buf[end:off] = 0  # the padding: every byte of a payload is defined
            end = off + pa.ipc.get_tensor_size(t)
            pa.ipc.write_tensor(t, pa.FixedSizeBufferWriter(pa.py_buffer(mv[off:end])))
        buf[end : self.nbytes] = 0
        return self.nbytes


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
    views of it; every array keeps `root` alive."""
    n = root.nbytes
    if n < 8:
        raise CorruptChannelError("an arrow payload is too short")
    magic, hlen = (int(x) for x in np.frombuffer(root[:8], "<u4"))
    if magic != MAGIC or 8 + hlen > n:
        raise CorruptChannelError("not an arrow payload of shmpipe")
    try:
        header = json.loads(bytes(root[8 : 8 + hlen]))
        tree, described, spans = header["tree"], header["leaves"], header["tensors"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptChannelError(f"an arrow payload's header cannot be read: {exc}") from None
    buf = pa.foreign_buffer(root.ctypes.data, n, base=root)
    try:
        arrays = [_read_tensor(root, buf, span) for span in spans]
        leaves = [_leaf(node, arrays) for node in described]
        return _tree.unflatten(tree, leaves)
    except (ValueError, TypeError, KeyError, IndexError, pa.ArrowException) as exc:
        raise CorruptChannelError(f"an arrow payload's header is malformed: {exc}") from None


def _read_tensor(root: np.ndarray, buf: Any, span: Any) -> np.ndarray:
    """The tensor at `span` as a read-only view of `root` itself. (Arrow's
    own to_numpy() array has a pyarrow buffer for base, through which NumPy
    lets anyone make it writable again: a write would change the slot under
    the producers.)"""
    n = root.nbytes
    off, size = span
    if not (type(off) is int and type(size) is int and 0 <= off and off % ALIGN == 0 and 0 <= size <= n - off):
        raise CorruptChannelError("an arrow payload's tensor lies outside it")
    parsed = pa.ipc.read_tensor(pa.BufferReader(buf.slice(off, size))).to_numpy()
    if parsed.nbytes == 0:
        empty = np.empty(parsed.shape, parsed.dtype)
        empty.flags.writeable = False
        return empty
    start = parsed.ctypes.data - root.ctypes.data
    if not (parsed.flags.c_contiguous and off <= start and start + parsed.nbytes <= off + size):
        raise CorruptChannelError("an arrow payload's tensor body is not where its message says")
    view = root[start : start + parsed.nbytes].view(parsed.dtype).reshape(parsed.shape)
    return view  # root is read-only and owns no buffer NumPy could make writable: nor can this be


def _leaf(node: Any, arrays: list[np.ndarray]) -> Any:
    if "a" in node or "g" in node:
        arr = arrays[node["a"] if "a" in node else node["g"]]
        shape = tuple(node["shape"])
        if "dtype" in node:
            dt = _codec.dtype_from_name(node["dtype"].encode())
            arr = arr.view(dt) if arr.size else np.zeros(0, dt)
        if arr.shape != shape:  # raw bytes, or a 0-d tensor (Arrow gives shape (1,))
            arr = arr.reshape(shape)
        arr.flags.writeable = False
        return arr[()] if "g" in node else arr
    if "y" in node:
        return base64.b64decode(node["y"])
    return node["v"]


class ArrowTransport(ShmTransport):
    """The shared-memory ring carrying Arrow IPC tensors (no pickle)."""

    name = "arrow"
    # The ring's guarantees, except filling slots in place.
    capabilities = dataclasses.replace(
        ShmTransport.capabilities,
        in_place_writes=False,
        serializes="arrow ipc (tensor messages)",
        takes_ready=False,  # payloads are decoded by Arrow in Python: no compiled one-call take
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
