"""Serialization paths, side by side, in one process.

For each way to turn a nested batch into bytes another process could read,
and back into arrays: microseconds per batch (encode, decode, total), GB/s,
and how many times the array bytes are copied. The batch is
{"x": float32 array of the given size, "y": int64 labels (64,), "i": int}.

  pickle 4              pickle.dumps(protocol=4) / loads
  pickle 5              pickle.dumps(protocol=5), in band / loads
  pickle 5 oob          protocol 5 with out-of-band buffers (the arrays are not
                        copied; moving the buffers elsewhere is a transport's job)
  numpy save            np.savez into memory / np.load
  arrow tensor          pyarrow.ipc.write_tensor per array / read_tensor (a view)
  arrow record batch    arrays as columns of a RecordBatch, IPC stream / to_numpy (a view)
  ray put/get           ray.put into the object store / ray.get (a view)
  shmpipe               shmpipe's layout written into a slot / decoded into views

"copies" counts copies of the array bytes: on encode, and on decode
(measured: 0 when the decoded array shares memory with the encoded bytes).

The per-batch figures are the steady state: the mean over repeated round
trips after the first. The first round trip of each path at each size is
timed apart ("first"), in the same process: after the path's module is
imported (and Ray started) but before anything else of that path at that
size, so it carries what a first call pays (what the library loads lazily
at its first call, at the first size measured; buffers of a new size
faulted in; caches filled).
"""

from __future__ import annotations

import io
import pickle
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shmpipe.bench._report import human_size, line_plot
from shmpipe.errors import ShmpipeValueError

__all__ = ["SerializeResult", "PATHS", "available_paths", "run", "table", "plot"]

PATHS = (
    "pickle 4", "pickle 5", "pickle 5 oob", "numpy save", "arrow tensor",
    "arrow record batch", "ray put/get", "shmpipe",
)
#: copies of the array bytes when encoding, per path (decode copies are measured)
ENCODE_COPIES = {
    "pickle 4": 1, "pickle 5": 1, "pickle 5 oob": 0, "numpy save": 1, "arrow tensor": 1,
    "arrow record batch": 1, "ray put/get": 1, "shmpipe": 1,
}


@dataclass
class SerializeResult:
    path: str
    nbytes: int
    encode_us: float
    decode_us: float
    encode_copies: int
    decode_copies: int
    repeats: int
    skipped: str | None = None
    first_us: float = float("nan")  # the first encode + decode of the path at this size (see the module doc)

    @property
    def total_us(self) -> float:
        return self.encode_us + self.decode_us

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / (self.total_us * 1e-6) / 1e9 if self.total_us > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(total_us=self.total_us, gb_per_s=self.gb_per_s)
        return d


def make_batch(nbytes: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"x": rng.random(max(1, nbytes // 4), dtype=np.float32), "y": np.arange(64, dtype=np.int64), "i": 7}


# Each path: (encode(batch) -> payload, decode(payload) -> batch). A payload
# must hold what another process would need to rebuild the batch.
Encode = Callable[[dict[str, Any]], Any]
Decode = Callable[[Any], Any]


def _pickle(protocol: int) -> tuple[Encode, Decode]:
    return (lambda b: pickle.dumps(b, protocol=protocol)), pickle.loads


def _pickle_oob() -> tuple[Encode, Decode]:
    def enc(b: dict[str, Any]) -> tuple[bytes, list[pickle.PickleBuffer]]:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
        return data, buffers

    def dec(payload: tuple[bytes, list[pickle.PickleBuffer]]) -> Any:
        data, buffers = payload
        return pickle.loads(data, buffers=buffers)

    return enc, dec


def _numpy_save() -> tuple[Encode, Decode]:
    def enc(b: dict[str, Any]) -> memoryview:
        f = io.BytesIO()
        np.savez(f, x=b["x"], y=b["y"], i=np.int64(b["i"]))
        return f.getbuffer()

    def dec(payload: memoryview) -> dict[str, Any]:
        z = np.load(io.BytesIO(payload))
        return {"x": z["x"], "y": z["y"], "i": int(z["i"])}

    return enc, dec


def _arrow_tensor() -> tuple[Encode, Decode]:
    import pyarrow as pa

    def enc(b: dict[str, Any]) -> tuple[list[Any], int]:
        out = []
        for key in ("x", "y"):
            sink = pa.BufferOutputStream()
            pa.ipc.write_tensor(pa.Tensor.from_numpy(b[key]), sink)
            out.append(sink.getvalue())
        return out, b["i"]

    def dec(payload: tuple[list[Any], int]) -> dict[str, Any]:
        (x, y), i = payload
        return {"x": pa.ipc.read_tensor(pa.BufferReader(x)).to_numpy(),
                "y": pa.ipc.read_tensor(pa.BufferReader(y)).to_numpy(), "i": i}

    return enc, dec


def _arrow_record_batch() -> tuple[Encode, Decode]:
    import pyarrow as pa

    def enc(b: dict[str, Any]) -> tuple[Any, Any, int]:
        # one row per batch; the arrays as list columns would copy, so each
        # array is a column of its own length: two record batches
        sink = pa.BufferOutputStream()
        rb = pa.record_batch([pa.array(b["x"])], names=["x"])
        with pa.ipc.new_stream(sink, rb.schema) as w:
            w.write_batch(rb)
        sink2 = pa.BufferOutputStream()
        rb2 = pa.record_batch([pa.array(b["y"])], names=["y"])
        with pa.ipc.new_stream(sink2, rb2.schema) as w:
            w.write_batch(rb2)
        return sink.getvalue(), sink2.getvalue(), b["i"]

    def dec(payload: tuple[Any, Any, int]) -> dict[str, Any]:
        x, y, i = payload
        cx = pa.ipc.open_stream(x).read_next_batch().column(0)
        cy = pa.ipc.open_stream(y).read_next_batch().column(0)
        return {"x": cx.to_numpy(zero_copy_only=True), "y": cy.to_numpy(zero_copy_only=True), "i": i}

    return enc, dec


def _ray() -> tuple[Encode, Decode]:
    import ray

    return ray.put, ray.get


def _shmpipe(nbytes: int) -> tuple[Encode, Decode]:
    from shmpipe import _codec

    slot = _codec.aligned_empty(_codec.encoded_size(make_batch(nbytes)))
    slot[:] = 0  # touched once, as a ring's slots are

    def enc(b: dict[str, Any]) -> np.ndarray:
        n = _codec.encode_into(b, slot)
        return slot[:n]

    return enc, _codec.decode


def available_paths() -> dict[str, str | None]:
    """Every path, with None or the reason it cannot run here."""
    import importlib.util

    out: dict[str, str | None] = {}
    for p in PATHS:
        if p.startswith("arrow") and importlib.util.find_spec("pyarrow") is None:
            out[p] = 'pyarrow is not installed (pip install "shmpipe[arrow]")'
        elif p.startswith("ray") and importlib.util.find_spec("ray") is None:
            out[p] = 'Ray is not installed (pip install "shmpipe[ray]")'
        else:
            out[p] = None
    return out


def _codecs(path: str, nbytes: int) -> tuple[Encode, Decode]:
    makers: dict[str, Callable[[], tuple[Encode, Decode]]] = {
        "pickle 4": lambda: _pickle(4),
        "pickle 5": lambda: _pickle(5),
        "pickle 5 oob": _pickle_oob,
        "numpy save": _numpy_save,
        "arrow tensor": _arrow_tensor,
        "arrow record batch": _arrow_record_batch,
        "ray put/get": _ray,
        "shmpipe": lambda: _shmpipe(nbytes),
    }
    return makers[path]()


def _payload_arrays(payload: Any) -> list[np.ndarray]:
    """The byte buffers a payload consists of, as NumPy views (for the
    decode-copy check)."""
    out: list[np.ndarray] = []

    def visit(p: Any) -> None:
        if isinstance(p, (tuple, list)):
            for q in p:
                visit(q)
        elif isinstance(p, (bytes, bytearray, memoryview, np.ndarray)):
            out.append(np.frombuffer(p, np.uint8) if not isinstance(p, np.ndarray) else p)
        elif hasattr(p, "address") and hasattr(p, "size"):  # a pyarrow Buffer
            out.append(np.frombuffer(p, np.uint8))

    visit(payload)
    return out


def measure(path: str, nbytes: int, seconds: float = 0.3, min_repeats: int = 3) -> SerializeResult:
    enc, dec = _codecs(path, nbytes)
    batch = make_batch(nbytes)
    t0 = time.perf_counter()  # the first round trip: timed apart, and checked
    payload = enc(batch)
    out = dec(payload)
    float(out["x"][0])
    first_us = (time.perf_counter() - t0) * 1e6
    if not (np.array_equal(out["x"], batch["x"]) and np.array_equal(out["y"], batch["y"]) and out["i"] == 7):
        raise AssertionError(f"{path} did not round-trip the batch")
    buffers = _payload_arrays(payload)
    if path == "ray put/get":
        from shmpipe.transports.ray import object_store_ranges

        ranges = object_store_ranges()
        lo = out["x"].ctypes.data
        shared = any(a <= lo < a + n for a, n in ranges)
    elif path == "pickle 5 oob":
        shared = np.shares_memory(out["x"], batch["x"])
    else:
        shared = any(np.shares_memory(out["x"], b) for b in buffers)
    del out, payload
    enc_t = dec_t = 0.0
    n = 0
    deadline = time.perf_counter() + seconds
    while n < min_repeats or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        payload = enc(batch)
        t1 = time.perf_counter()
        out = dec(payload)
        float(out["x"][0])
        t2 = time.perf_counter()
        del out, payload
        enc_t += t1 - t0
        dec_t += t2 - t1
        n += 1
    return SerializeResult(
        path, nbytes, enc_t / n * 1e6, dec_t / n * 1e6, ENCODE_COPIES[path], 0 if shared else 1, n, first_us=first_us
    )


def run(
    sizes: Iterable[int],
    paths: Iterable[str] | None = None,
    *,
    seconds: float = 0.3,
    min_repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[SerializeResult]:
    """Measures every path at every size; progress(label), if given, is
    called before each."""
    sizes = list(sizes)
    avail = available_paths()
    todo = list(PATHS) if paths is None else list(paths)
    unknown = [p for p in todo if p not in avail]
    if unknown:
        raise ShmpipeValueError(f"unknown paths {unknown}; known: {', '.join(PATHS)}")
    started_ray = False
    if "ray put/get" in todo and avail["ray put/get"] is None:
        import ray

        if not ray.is_initialized():
            from shmpipe.transports.ray import _away_from_a_checkout

            store = max(256 << 20, 4 * max(sizes))
            with _away_from_a_checkout():
                ray.init(num_cpus=1, object_store_memory=store, include_dashboard=False, log_to_driver=False)
            started_ray = True
    results = []
    try:
        for nbytes in sizes:
            for path in todo:
                if progress:
                    progress(f"{path} {human_size(nbytes)}")
                why = avail[path]
                if why is not None:
                    results.append(SerializeResult(path, nbytes, float("nan"), float("nan"), 0, 0, 0, skipped=why))
                    continue
                results.append(measure(path, nbytes, seconds, min_repeats))
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return results


def table(results: list[SerializeResult]) -> str:
    lines = [
        "| batch | path | encode | decode | total | GB/s | copies (encode + decode) | first |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in results:
        if r.skipped:
            lines.append(f"| {human_size(r.nbytes)} | {r.path} | skipped: {r.skipped} | | | | | |")
            continue
        lines.append(
            f"| {human_size(r.nbytes)} | {r.path} | {r.encode_us:,.1f} us | {r.decode_us:,.1f} us | "
            f"{r.total_us:,.1f} us | {r.gb_per_s:.2f} | {r.encode_copies} + {r.decode_copies} | "
            f"{r.first_us:,.1f} us |"
        )
    return "\n".join(lines)


def plot(results: list[SerializeResult], path: str, title: str) -> None:
    """Microseconds per batch (encode + decode) against batch size."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        if not r.skipped:
            series.setdefault(r.path, []).append((r.nbytes, r.total_us))
    line_plot(path, title, "encode + decode, us per batch", series)
