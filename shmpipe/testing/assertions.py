"""Assertions for tests of batches and transports."""

from __future__ import annotations

from typing import Any

import numpy as np

from shmpipe import _tree

__all__ = ["assert_same"]


def assert_same(got: Any, want: Any, path: str = "batch") -> None:
    """Bit-exact equality of two batches: same nesting, container types,
    dict keys in the same order, dtypes, shapes and bytes."""
    got_nesting, got_leaves = _tree.flatten(got)
    want_nesting, _ = _tree.flatten(want)
    assert got_nesting == want_nesting, f"{path}: nesting {got_nesting} != {want_nesting}"
    for (leaf_path, w), g in zip(_tree.leaves_with_paths(want, path), got_leaves, strict=True):
        _assert_same_leaf(g, w, leaf_path)


def _assert_same_leaf(got: Any, want: Any, path: str) -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got)} is not an ndarray"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{path}: bytes differ"
        return
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, float) and want != want:
        assert got != got, f"{path}: {got!r} is not NaN"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
