"""PyTorch tensors from a stream of batches (a Pipeline, a rank's share of a
group's pipeline): views on the host, one copy to a GPU.

On the host, ``torch.from_numpy`` makes a tensor that *is* the array (no
copy), and the tensor keeps the array -- so the slot -- alive until it is
freed.

For a CUDA device each array is copied once, host to device. Two lifetime
rules make that copy safe and cheap:

* A copy with ``non_blocking=True`` may still be reading the slot when
  ``.to()`` returns (from page-locked memory it is a DMA the GPU runs in
  stream order). So the batch's host tensors -- and its slot -- are kept,
  with a CUDA event recorded after the copies, until that event has
  completed (``_CopiesInFlight``). Before the next batch is taken at most
  one batch stays in flight: the pipeline's capacity rules count one batch
  held by the consumer, and a copy in flight is such a batch.
* ``pin_memory=True`` page-locks the stream's memory with
  ``cudaHostRegister`` once (``_Registration``), and unregisters it when the
  pipeline closes: after every copy from it has finished, and before the
  memory is unmapped. CUDA keeps a registered range's pages past munmap; a
  later mapping at the same address would be refused, or read through the
  old pages. Only streams that own their memory are registered
  (``BatchStream.owns_memory``): page-locking Ray's object store would pin
  all of it.
"""

from __future__ import annotations

import collections
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shmpipe._stream import BatchStream
from shmpipe._tree import map_leaves, map_leaves_with_paths
from shmpipe.errors import BatchTypeError, ShmpipeValueError, ShmpipeWarning

__all__ = ["TorchBatches"]

#: Batches whose copies may still run when the next batch is taken.
MAX_IN_FLIGHT = 1
#: cudaHostRegisterPortable, from cuda_runtime_api.h.
CUDA_HOST_REGISTER_PORTABLE = 1


class TorchBatches:
    """An iterable over a stream's batches as torch tensors; each
    iteration is a new pass (as with the pipeline itself)."""

    def __init__(
        self, pipe: BatchStream, device: Any = None, pin_memory: bool = False, non_blocking: bool = True
    ) -> None:
        import torch

        self.pipe = pipe
        self.device = _checked_device(torch, device)
        self.to_device = self.device is not None and self.device.type != "cpu"
        self.non_blocking = bool(non_blocking)
        self.pin_memory = bool(pin_memory)
        if self.pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True has no effect: CUDA is not available", ShmpipeWarning, stacklevel=3)
            self.pin_memory = False
        elif self.pin_memory and (self.device is None or self.device.type != "cuda"):
            # Handing out page-locked host tensors would let a caller's own
            # non_blocking copy outlive the tensor, and so the slot.
            warnings.warn(
                f"pin_memory=True has no effect with device={device!r}: it page-locks the ring "
                "for the copy to a CUDA device that shmpipe makes; pass device='cuda'",
                ShmpipeWarning,
                stacklevel=3,
            )
            self.pin_memory = False
        # How a copy's completion is known: a function that records an
        # event on the stream that copies to the device, right after the
        # copies (None where the device has no events: its copies are done
        # when .to() returns). Tests, which have no CUDA, put a stand-in here.
        self.record_event: Callable[[], Any] | None = None
        if self.to_device and self.non_blocking:
            self.record_event = _event_recorder(torch, self.device)
        self._quiet = False

    def __iter__(self) -> _TorchIterator:
        return _TorchIterator(self, iter(self.pipe))

    def _host(self, batch: Any) -> Any:
        if self._quiet:
            return _host_tensors(batch, not self.to_device)
        # torch warns once that the arrays are read-only (NumPy's flag: the
        # batch's arrays are; their tensors may be written all the same,
        # _host_tensors and docs/gpu.md); say nothing.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            host = _host_tensors(batch, not self.to_device)
        self._quiet = True
        return host

    def _to_device(self, host: Any) -> Any:
        if self.pin_memory:
            _Registration.of(self.pipe).register(self.pipe)
        device, non_blocking = self.device, self.non_blocking
        return _to_each_tensor(host, lambda t: t.to(device, non_blocking=non_blocking))

    @property
    def copies_may_outlive_the_call(self) -> bool:
        """Whether ``.to()`` may return before its copy has read the slot."""
        return self.to_device and self.non_blocking and self.record_event is not None


def _checked_device(torch: Any, device: Any) -> Any:
    """torch.device(device), refused now if torch cannot put a tensor there
    (rather than at the first batch, which would then be lost)."""
    if device is None:
        return None
    try:
        checked = torch.device(device)
        torch.empty(0, device=checked)
    except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
        built = ""
        if torch.version.cuda is None and "cuda" in str(device):
            built = f" (this torch, {torch.__version__}, has no CUDA)"
        raise ShmpipeValueError(f"to_torch(device={device!r}): torch cannot put tensors there{built}: {exc}") from None
    return checked


def _event_recorder(torch: Any, device: Any) -> Callable[[], Any] | None:
    if device.type == "cuda":

        def record() -> Any:
            # On the current stream *of the target device*: .to("cuda:1")
            # copies on cuda:1's stream, whatever the current device is.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return event

        return record
    try:
        torch.Event(device).record()  # "meta" makes the event, refuses to record it
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return None  # a backend without events ("meta") copies synchronously

    def record_other() -> Any:
        event = torch.Event(device)
        event.record()
        return event

    return record_other


class _TorchIterator:
    """One pass. An iterator object, not a generator: a suspended generator
    would keep the batch it yielded last (and its slot) until the next one."""

    __slots__ = ("batches", "it", "in_flight")

    def __init__(self, batches: TorchBatches, it: Iterator[Any]) -> None:
        self.batches, self.it = batches, it
        record = batches.record_event
        self.in_flight = _CopiesInFlight(record) if record is not None and batches.copies_may_outlive_the_call else None

    def __iter__(self) -> _TorchIterator:
        return self

    def __next__(self) -> Any:
        in_flight = self.in_flight
        if in_flight is not None:
            in_flight.make_room(MAX_IN_FLIGHT)
        try:
            batch = next(self.it)
        except BaseException:
            # The pass is over, or failed (this frame, kept by the error,
            # would keep them): every slot goes back once its copies are done.
            if in_flight is not None:
                in_flight.wait_all()
            raise
        try:
            host = self.batches._host(batch)
        except BaseException as exc:  # a batch refused (BatchTypeError): let go of it, and of its slot, now
            batch = None
            # The error's frames would hold it for as long as the error lives.
            traceback.clear_frames(exc.__traceback__)
            raise
        del batch
        if not self.batches.to_device:
            return host
        # (A copy that fails keeps `host` in this frame, held by the error:
        # copies issued before it may still read the slot.)
        out = self.batches._to_device(host)
        if in_flight is not None:
            in_flight.add(host)
        return out

    def __del__(self) -> None:
        # Abandoned mid-pass: the slots must not go back while a copy reads them.
        in_flight = getattr(self, "in_flight", None)
        if in_flight:
            try:
                in_flight.wait_all()
            except Exception:  # CUDA already torn down at interpreter exit
                pass


class _CopiesInFlight:
    """Host batches whose copies to the device may still run, oldest first,
    each with the event recorded (on the stream that copied it) after its
    copies. Holding a batch's host tensors holds its slot."""

    __slots__ = ("record_event", "queue")

    def __init__(self, record_event: Callable[[], Any]) -> None:
        self.record_event = record_event
        self.queue: collections.deque[tuple[Any, Any]] = collections.deque()

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, host: Any) -> None:
        self.queue.append((self.record_event(), host))

    def make_room(self, limit: int) -> None:
        """Lets finished batches go; then waits for the oldest until at
        most `limit` are left."""
        queue = self.queue
        while queue and queue[0][0].query():
            queue.popleft()
        while len(queue) > limit:
            queue[0][0].synchronize()
            queue.popleft()

    def wait_all(self) -> None:
        self.make_room(0)


class _Registration:
    """A stream's memory, page-locked for CUDA: registered once,
    unregistered by the pipeline's close (see the module doc)."""

    def __init__(self) -> None:
        self.tried = False
        self.ranges: list[tuple[int, int]] = []

    @classmethod
    def of(cls, pipe: BatchStream) -> _Registration:
        """The registration of `pipe`'s memory (one per stream,
        whatever the number of to_torch() iterables over it)."""
        reg = _registrations.get(pipe)
        if reg is None:
            reg = _registrations[pipe] = cls()
            # The hook holds the registration, not the pipeline.
            pipe.call_on_close(reg.unregister)
        return reg

    def register(self, stream: BatchStream) -> None:
        """Page-locks `stream`'s memory, once (called when a batch has come,
        so the memory exists)."""
        if self.tried:
            return
        self.tried = True
        if not stream.owns_memory():
            warnings.warn(
                f"pin_memory=True has no effect on the {stream.transport.name!r} transport: its memory is not the "
                "pipeline's own (page-locking it would pin memory others use); copies to the GPU "
                "go from pageable memory",
                ShmpipeWarning,
                stacklevel=4,
            )
            return
        import torch

        cudart = torch.cuda.cudart()
        for address, size in stream.memory_ranges():
            # Portable: page-locked for every device's context, not only the
            # current one (copies to "cuda:1" are DMA too).
            err = cudart.cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE)
            if int(err) != 0:
                warnings.warn(
                    f"cudaHostRegister of {size:,} bytes failed ({cudart.cudaGetErrorString(err)}); "
                    "copies to the GPU go from pageable memory",
                    ShmpipeWarning,
                    stacklevel=4,
                )
            else:
                self.ranges.append((address, size))

    def unregister(self) -> None:
        if not self.ranges:
            return
        import torch

        # Every copy from the ranges has finished before they become
        # pageable again (the pipeline may unmap them next).
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)
        cudart = torch.cuda.cudart()
        while self.ranges:
            cudart.cudaHostUnregister(self.ranges.pop()[0])


#: Each pipeline's registration, for as long as the pipeline lives.
_registrations: weakref.WeakKeyDictionary[BatchStream, _Registration] = weakref.WeakKeyDictionary()


def _to_each_tensor(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """`batch` with fn(t) for each torch tensor t; other leaves as they are."""
    import torch

    return map_leaves(batch, lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf)


def _host_tensors(batch: Any, handed_out: bool) -> Any:
    """`batch` with each array (and NumPy scalar) as a torch tensor viewing
    it. Where the tensors are `handed_out` (not only copied to a device),
    an array whose memory this process maps read-only is viewed through a
    private, writable mapping of it: torch would write it in place (_cow.py)."""
    import torch

    def to_tensor(leaf: Any, path: str) -> Any:
        if not isinstance(leaf, (np.ndarray, np.generic)):
            return leaf
        if not isinstance(leaf, np.ndarray):
            leaf = np.asarray(leaf)  # a fresh 0-d array of the scalar
        elif handed_out:
            # Below the batch's root array is the holder of its memory; one
            # that maps it read-only makes the private view.
            holder = leaf.base
            while type(holder) is np.ndarray:
                holder = holder.base
            writable_view = getattr(type(holder), "writable_view", None)
            if writable_view is not None:
                leaf = writable_view(holder, leaf)
        try:
            return torch.from_numpy(leaf)
        except TypeError:
            raise BatchTypeError(f"PyTorch has no dtype for {leaf.dtype!r}", path) from None

    return map_leaves_with_paths(batch, to_tensor)
