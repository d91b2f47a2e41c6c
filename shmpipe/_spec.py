"""ArraySpec: the shape and dtype of an array that does not exist yet."""

from __future__ import annotations

from typing import Any

import numpy as np

from shmpipe._tree import map_leaves

__all__ = ["ArraySpec", "new_arrays"]


class ArraySpec:
    """Shape and dtype of an array to be made by :func:`shmpipe.reserve`.

    >>> ArraySpec((4, 3), "float32")
    ArraySpec(shape=(4, 3), dtype=dtype('float32'))
    """

    __slots__ = ("shape", "dtype")

    shape: tuple[int, ...]
    dtype: np.dtype

    def __init__(self, shape: int | tuple[int, ...], dtype: Any = np.float64) -> None:
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        try:
            shape = tuple(int(d) for d in shape)
        except TypeError:
            raise TypeError(f"ArraySpec shape must be an int or a tuple of ints, got {shape!r}") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"ArraySpec shape must not be negative, got {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", np.dtype(dtype))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ArraySpec is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArraySpec):
            return NotImplemented
        return self.shape == other.shape and self.dtype == other.dtype

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"ArraySpec(shape={self.shape}, dtype={self.dtype!r})"

    def __reduce__(self) -> tuple[type[ArraySpec], tuple[tuple[int, ...], np.dtype]]:
        return (ArraySpec, (self.shape, self.dtype))


def new_arrays(template: Any) -> Any:
    """`template` with a new uninitialised array (like ``numpy.empty``) for
    each ArraySpec or array leaf; other leaves are kept as they are. What
    ``reserve`` gives where the transport has no slots to lend."""

    def allocate(leaf: Any) -> Any:
        if type(leaf) is ArraySpec or isinstance(leaf, np.ndarray):
            return np.empty(leaf.shape, leaf.dtype)
        return leaf

    return map_leaves(template, allocate)
