"""The ring shared by a group of ranks: the shm (and arrow) transport's part
of ``from_iterators(group=...)`` (capability ``serves_ranks``).

Rank 0's ShmConsumer stays the ring's only consumer. Its ``take_shared``
(the SharingConsumerEnd protocol) returns, instead of a decoded batch, a
:class:`~shmpipe.transport.SharedBatch`: the payload's root (whose lease
holds the slot, as for any batch) and a record saying where the payload is:

* ``("slot", offset, nbytes)``: in the ring, `offset` bytes from the start
  of the ring's memory;
* ``("big", nbytes, write_sealed)``: a batch larger than a slot, in sealed
  memory of its own, whose descriptor goes with the record
  (``SharedBatch.fd``); `write_sealed` says it is sealed against writing
  too (a put() batch, not a reserve()d one), which the rank checks again.

The group (shmpipe/_group) sends the record to the rank the batch is dealt
to. That rank maps the ring's memory itself, read-only
(:class:`ShmRankReader`, from ``ShmConsumer.share_with_ranks``), checks the
record against the geometry it was given once (never against bytes in
shared memory), and decodes the payload with the transport's own decoder,
so the arrays are read-only views of the same pages the producers wrote: no
copy in any rank. When the last array goes, the rank says "release" and
rank 0 drops the root, which frees the slot.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from shmpipe import _cow, _external, _ring
from shmpipe.errors import CorruptChannelError
from shmpipe.transport import RankReader

__all__ = ["ShmRankReader"]

_GEOMETRY = ("total", "header", "slot_size", "nslots")


class _SlotView:
    """The payload of one slot in a rank's read-only mapping of the ring:
    the base of the batch's root array (through ``__array_interface__``).
    When the last array of the batch is gone, this object goes, and tells
    rank 0 to release the slot. Not a buffer exporter, and the pages are
    mapped read-only, so no array of the batch can be made writeable; its
    torch tensors are private views (writable_view, _cow.py)."""

    __slots__ = ("__weakref__", "_desc", "_interface", "_mapping", "_release")

    def __init__(
        self, mapping: np.ndarray, desc: _cow.Descriptor, offset: int, nbytes: int, release: Callable[[], None]
    ) -> None:
        self._mapping = mapping  # keeps the ring mapped while the batch lives
        self._desc = desc  # and its descriptor open
        self._release = release
        self._interface = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (int(mapping.ctypes.data) + offset, True),
            "version": 3,
        }

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._interface

    def writable_view(self, arr: np.ndarray) -> np.ndarray:
        """`arr` (an array of this batch) as a writable array whose writes
        stay in this process (_cow.py)."""
        return _cow.view(arr, self._desc.fd, int(self._mapping.ctypes.data), 0)

    def __del__(self) -> None:
        self._release()


class _ReleaseOnFree:
    """The lease of a batch larger than a slot in a rank: kept by its
    ExternalMemory, so freed with the batch's last array."""

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release

    def __del__(self) -> None:
        self._release()


class ShmRankReader(RankReader):
    """A rank's read-only mapping of the group's ring, and the decoder of the
    payloads it is dealt (see the module doc)."""

    def __init__(
        self, share: dict[str, Any], fds: list[int], decode: Callable[[np.ndarray], Any], *, backing: str
    ) -> None:
        self._decode = decode
        self._lock = threading.Lock()
        self._held = 0
        try:
            if len(fds) != 1:
                raise CorruptChannelError(f"a ring is shared with one descriptor, {len(fds)} came")
            geometry = [share.get(k) for k in _GEOMETRY]
            if not all(type(v) is int and v > 0 for v in geometry):
                raise CorruptChannelError(f"a shared ring's geometry is malformed: {share!r}")
            total, header, slot_size, nslots = (int(v) for v in geometry)  # type: ignore[arg-type]
            page = _ring.PAGE_SIZE
            if (
                header % page
                or slot_size % page
                or nslots > _ring.MAX_SLOTS
                or total != header + nslots * slot_size
            ):
                raise CorruptChannelError(f"a shared ring's geometry is inconsistent: {share!r}")
            fd = fds[0]
            # What backs the ring is this rank's own transport's setting (every
            # rank passes the same transport), never the peer's word: a
            # "backing" field saying "posix" must not skip the seal check.
            if share.get("backing") != backing:
                raise CorruptChannelError(
                    f"rank 0 shares a ring backed by {share.get('backing')!r:.20}, this rank's transport "
                    f"uses backing={backing!r}: pass the same transport in every rank"
                )
            if backing == "memfd":
                # Sealed against shrinking, or a read past a truncation would be
                # a SIGBUS. (A named segment cannot be sealed: as in a pipeline
                # with backing="posix", any process of the user could truncate it.)
                try:
                    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                except OSError:
                    seals = 0  # not memory that can be sealed at all
                if not seals & fcntl.F_SEAL_SHRINK:
                    raise CorruptChannelError("the shared ring's memory is not sealed against shrinking")
            size = os.fstat(fd).st_size
            if size < total:
                raise CorruptChannelError(f"the shared ring's memory has {size:,} bytes, its geometry says {total:,}")
            mm = mmap.mmap(fd, total, prot=mmap.PROT_READ)
            # Kept for private views of batches (_cow.py), closed with the
            # last batch after close().
            self._desc: _cow.Descriptor | None = _cow.Descriptor(os.dup(fd))
        finally:
            for fd in fds:
                os.close(fd)
        self._total, self._header, self._slot_size, self._nslots = total, header, slot_size, nslots
        # One read-only array over the whole mapping: every batch's root is
        # based on it (through a _SlotView), so the mapping stays while any
        # batch lives and goes with the last one after close().
        self._mapping: np.ndarray | None = np.frombuffer(mm, np.uint8)
        self._address = int(self._mapping.ctypes.data)

    def _releaser(self, release: Callable[[], None]) -> Callable[[], None]:
        def released() -> None:
            with self._lock:
                self._held -= 1
            release()

        return released

    def read(self, record: tuple[Any, ...], fd: int | None, release: Callable[[], None]) -> Any:
        with self._lock:
            self._held += 1
        released = self._releaser(release)
        kind = record[0] if record else None
        if kind == "slot" and len(record) == 3 and fd is None:
            mapping = self._mapping
            if mapping is None:
                released()
                raise CorruptChannelError("a batch came after the ring was closed in this rank")
            _, offset, nbytes = record
            if type(offset) is not int or type(nbytes) is not int:
                released()
                raise CorruptChannelError(f"a malformed batch record: {record!r}")
            slot, rest = divmod(offset - self._header, self._slot_size)
            if rest or not 0 <= slot < self._nslots or not 0 <= nbytes <= self._slot_size:
                released()
                raise CorruptChannelError(
                    f"a batch record points outside the ring's slots: offset {offset}, {nbytes} bytes"
                )
            assert self._desc is not None
            root = np.asarray(_SlotView(mapping, self._desc, offset, nbytes, released))
        elif (
            kind == "big"
            and len(record) == 3
            and fd is not None
            and type(record[1]) is int
            and type(record[2]) is bool
        ):
            lease = _ReleaseOnFree(released)  # released when the mapping goes, or now on error
            root = _external.map_external(fd, record[1], lease, write_sealed=record[2])
            del lease
        else:
            released()
            raise CorruptChannelError(f"a malformed batch record: {record!r}")
        return self._decode(root)  # on error the root goes, and the slot with it

    def held(self) -> int:
        return self._held

    def memory_ranges(self) -> list[tuple[int, int]]:
        return [(self._address, self._total)] if self._mapping is not None else []

    def close(self) -> None:
        # The batches still alive keep the mapping and the descriptor (their
        # _SlotViews refer to them).
        self._mapping = None
        self._desc = None
