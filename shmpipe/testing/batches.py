"""The dtype x shape x nesting matrix that round-trip tests send.

Producers build it themselves (see sources.Matrix) rather than receiving it
pickled: pickle protocol 4, which multiprocessing uses, turns NumPy 2.4's
big-endian arrays into native ones, so pickled data would not be the data.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

DTYPES = [
    np.dtype(t)
    for t in [
        "?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8",
        "f2", "f4", "f8", "g", "c8", "c16", "G",
        ">i4", ">f8", "<u2",
        "S5", "U3", "V4",
        "M8[ns]", "m8[s]", "M8[D]",
    ]
] + [
    np.dtype([("a", "u1"), ("b", "<f8"), ("c", "i4", (2, 3))]),
    np.dtype({"names": ["x", "y"], "formats": ["u1", "<f4"], "offsets": [0, 8], "itemsize": 16}),
    np.dtype([("outer", [("inner", ">i2"), ("s", "S2")]), ("d", "M8[us]")]),
]

try:  # TensorFlow's bfloat16 and friends, where ml_dtypes is installed
    import ml_dtypes

    DTYPES += [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)]
except ImportError:
    pass

SHAPES = [(), (0,), (1,), (7,), (3, 0, 2), (2, 3, 4), (2, 1, 1, 3)]


def make_array(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """An array whose every byte is pseudo-random (padding included)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = rng.integers(0, 256, size=n, dtype=np.uint8)
    if dtype.kind == "U":  # keep code points valid
        raw = (rng.integers(32, 0x2FF, size=n // 4, dtype=np.uint32)).view(np.uint8)
    return raw.view(dtype).reshape(shape) if n else np.zeros(shape, dtype)


NESTINGS: dict[str, Callable[[np.ndarray], Any]] = {
    "leaf": lambda a: a,
    "dict": lambda a: {"x": a, "label": 3},
    "deep": lambda a: (a, [a, {"k": (a,), "n": None}], "text"),
    "list": lambda a: [[[a]], {}, ()],
}


def matrix() -> Iterator[tuple[str, Any]]:
    """(id, batch) for every dtype x shape x nesting."""
    for (i, dt), shape, (nest, f) in itertools.product(
        enumerate(DTYPES), SHAPES, NESTINGS.items()
    ):
        yield f"{dt}-{shape}-{nest}", f(make_array(dt, shape, seed=i * 100 + len(shape)))


def non_contiguous() -> dict[str, np.ndarray]:
    base = np.arange(240, dtype=np.float64).reshape(6, 8, 5)
    return {
        "strided": base[::2, 1::3, :],
        "fortran": np.asfortranarray(base),
        "transposed": base.T,
        "reversed": base[::-1, :, ::-2],
        "broadcast": np.broadcast_to(np.arange(3, dtype=np.int16), (4, 3)),
        "column": base[:, 0, 0],
        "bigendian_strided": np.arange(20, dtype=">i8")[::3],
    }


SCALARS = {
    "none": None,
    "true": True,
    "false": False,
    "int": -(2**62),
    "bigint": 2**100 + 7,
    "negbig": -(2**90),
    "float": 1.5e-300,
    "nan": float("nan"),
    "inf": float("-inf"),
    "str": "héllo wörld ✓",
    "empty_str": "",
    "bytes": b"\x00\xffraw",
    "np_f32": np.float32(3.25),
    "np_i64": np.int64(-9),
    "np_bool": np.bool_(True),
    "np_dt": np.datetime64("2026-11-30T12:00", "ns"),
    "np_void": np.array([(1, 2.0)], dtype=[("a", "u1"), ("b", "<f8")])[0],
}
