"""Walking a batch: nested tuple/list/dict with arrays and scalars at the leaves."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

__all__ = ["leaves", "nbytes"]


def leaves(batch: Any) -> Iterator[Any]:
    """Every leaf of `batch`, depth first, in order."""
    t = type(batch)
    if t is dict:
        for v in batch.values():
            yield from leaves(v)
    elif t is tuple or t is list:
        for v in batch:
            yield from leaves(v)
    else:
        yield batch


def nbytes(batch: Any) -> int:
    """Bytes of the arrays in `batch` (scalars count for nothing)."""
    return sum(leaf.nbytes for leaf in leaves(batch) if isinstance(leaf, np.ndarray))
