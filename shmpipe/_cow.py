"""Private, writable views of batch memory this process maps read-only.

Why: torch has no read-only tensors. ``torch.from_numpy`` of a read-only
array warns and makes a tensor torch believes it may write, and an in-place
op (``x.div_(255)``) writes its pages. Where a batch lies in memory this
process maps read-only (a batch larger than a slot, in its producer's
region; every batch in a rank of a group) that write was a SIGSEGV that
killed the trainer.

So there, the host tensors of ``to_torch()`` are made over a *private*
mapping of the same memory (MAP_PRIVATE, writable, ``_ring.Mapping``):
reading it copies nothing; the first write to a page copies that page for
this process alone, so the producer's memory, the other views of the batch
(NumPy's, TensorFlow's) and every other process never see it. One mapping
per array per batch, made only for host tensors (a copy to a device only
reads, so it uses the batch as it is).

The batch memory a holder says is its own to write (a slot of this
process's own ring, mapped writable) is used as it is: an in-place op there
writes the batch itself, which is the trainer's until it lets the batch go
and which no other process reads meanwhile.

Holders (the base of a batch's arrays) that map their memory read-only
implement ``writable_view(arr)``, with ``view`` below. Lifetime: the private
view keeps `arr` (and so the batch's slot) alive; pages not written yet are
still the shared ones, which the producer writes again only once the batch
is released.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from shmpipe import _ring

__all__ = ["Descriptor", "view", "writable_alias"]

_PAGE = _ring.PAGE_SIZE


class Descriptor:
    """A descriptor kept open for as long as a mapping may still be made of
    it (every holder of a batch in it refers to this object); closed with
    the last reference."""

    __slots__ = ("__weakref__", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        # (os.close bound when the class is made: a batch kept in a module's
        # globals until the interpreter exits is collected after the module
        # `os` of this one's globals may be gone, and __del__ must not raise.)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _close(fd)

    def __del__(self) -> None:
        self.close()


class _Private:
    """The base of a private view: its mapping, and the batch's array (which
    keeps the slot) for as long as the view lives."""

    __slots__ = ("__array_interface__", "mapping", "source")

    def __init__(self, interface: dict[str, Any], mapping: Any, source: np.ndarray) -> None:
        self.__array_interface__ = interface
        self.mapping = mapping
        self.source = source


def _extent(arr: np.ndarray) -> tuple[int, int]:
    """The first and one-past-last byte addresses `arr` spans (strides of
    any sign)."""
    lo = hi = arr.__array_interface__["data"][0]
    for dim, stride in zip(arr.shape, arr.strides, strict=True):
        reach = (dim - 1) * stride
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + arr.itemsize


def _interface(arr: np.ndarray, data: int) -> dict[str, Any]:
    interface = dict(arr.__array_interface__)
    interface["data"] = (data, False)
    interface["strides"] = arr.strides
    interface.pop("mask", None)
    return interface


def view(arr: np.ndarray, fd: int, address: int, offset: int) -> np.ndarray:
    """A writable array with `arr`'s shape, dtype and bytes over a private
    mapping of `fd`, where `arr` lies in a mapping of `fd` that starts at
    `address` and holds the memory from file offset `offset` on. The
    caller vouches that `arr` lies in that mapping (it made the mapping and
    the array)."""
    if arr.size == 0:
        return np.array(arr)  # nothing to map: a fresh (writable) empty array
    lo, hi = _extent(arr)
    first = offset + (lo - address)
    start = first - first % _PAGE
    length = -(-(offset + (hi - address) - start) // _PAGE) * _PAGE
    mapping = _ring.Mapping(fd, length, False, True, start)
    data = mapping.address + (first - start) + (arr.__array_interface__["data"][0] - lo)
    return np.asarray(_Private(_interface(arr, data), mapping, arr))


def writable_alias(arr: np.ndarray) -> np.ndarray:
    """`arr` made writable where its memory already is this process's own to
    write (a private mapping): the same bytes, no mapping made."""
    return np.asarray(_Private(_interface(arr, arr.__array_interface__["data"][0]), None, arr))
