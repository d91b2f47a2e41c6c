"""Assertions for tests of batches and transports."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["assert_same"]


def assert_same(got: Any, want: Any, path: str = "batch") -> None:
    """Bit-exact equality of two batches: same nesting, container types,
    dtypes, shapes and bytes."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got)} is not an ndarray"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{path}: bytes differ"
        return
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, float) and want != want:
        assert got != got, f"{path}: {got!r} is not NaN"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
