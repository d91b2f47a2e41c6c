"""ArraySpec: the shape and dtype of an array that does not exist yet."""

from __future__ import annotations

from typing import Any

import numpy as np

from shmpipe._tree import map_leaves
from shmpipe.errors import as_int

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
        # As NumPy's own shapes: ints (NumPy's too), never a bool or a float
        # (int() took 2.7 for 2, and True for 1).
        given: Any = shape
        single = as_int(given)
        try:
            dims = (single,) if single is not None else tuple(as_int(d) for d in given)
        except TypeError:  # no int, and not iterable
            dims = (None,)
        ints = tuple(d for d in dims if d is not None)
        if len(ints) != len(dims):
            raise TypeError(f"ArraySpec shape must be an int or a tuple of ints, got {shape!r}")
        if any(d < 0 for d in ints):
            raise ValueError(f"ArraySpec shape must not be negative, got {ints}")
        object.__setattr__(self, "shape", ints)
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
