"""PyTorch tensors from a Pipeline: views on the host, one copy to a GPU.

On the host, ``torch.from_numpy`` makes a tensor that *is* the array (no
copy), and the tensor keeps the array -- so the slot -- alive until it is
freed. For a CUDA device each array is copied once, host to device; with
``pin_memory=True`` the ring is registered once with ``cudaHostRegister``,
so that copy is a DMA straight from the slot, asynchronous with
``non_blocking=True``, and the batch's host arrays (its slot) are kept until
the copy's CUDA event has completed.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import numpy as np

from shmpipe.errors import BatchTypeError, ShmpipeWarning

__all__ = ["TorchBatches"]


class TorchBatches:
    """An iterable over a Pipeline's batches as torch tensors; each
    iteration is a new pass (as with the pipeline itself)."""

    def __init__(self, pipe, device=None, pin_memory: bool = False, non_blocking: bool = True) -> None:
        import torch

        self.pipe = pipe
        self.device = torch.device(device) if device is not None else None
        self.to_cuda = self.device is not None and self.device.type == "cuda"
        self.non_blocking = non_blocking
        self.pin_memory = pin_memory
        self.registered: list[int] = []  # host addresses registered with CUDA
        self.pending: collections.deque = collections.deque()  # (event, host batch)
        self._quiet = False
        if pin_memory and not torch.cuda.is_available():
            warnings.warn(
                "pin_memory=True has no effect: CUDA is not available", ShmpipeWarning, stacklevel=3
            )
            self.pin_memory = False

    def __iter__(self) -> "_TorchIterator":
        return _TorchIterator(self, iter(self.pipe))

    def _register(self) -> None:
        """Page-locks the channel's memory once, so host-to-device copies
        from it are DMA (about 0.1 s per GB, once, never per batch)."""
        import torch

        channel = self.pipe.channel
        for address, size in channel.memory_ranges() if channel is not None else []:
            if address in self.registered:
                continue
            err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
            if int(err) != 0:
                warnings.warn(
                    f"cudaHostRegister of {size:,} bytes failed ({err}); copies stay pageable",
                    ShmpipeWarning,
                    stacklevel=3,
                )
            else:
                self.registered.append(address)

    def unregister(self) -> None:
        import torch

        while self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.registered.pop())

    def _convert(self, batch: Any) -> Any:
        import torch

        if not self._quiet:
            # torch warns once that the arrays are read-only (they are: views
            # of shared memory); say nothing, the docs say so.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                host = _host_tensors(batch, "batch")
            self._quiet = True
        else:
            host = _host_tensors(batch, "batch")
        if not self.to_cuda:
            return host if self.device is None else _map(host, lambda t: t.to(self.device))
        if self.pin_memory and not self.registered:
            self._register()
        out = _map(host, lambda t: t.to(self.device, non_blocking=self.non_blocking))
        if self.non_blocking and self.pin_memory:
            # The copies may still run: keep the host tensors (the slot)
            # until they are done, and let finished ones go.
            event = torch.cuda.Event()
            event.record()
            self.pending.append((event, host))
            while self.pending and self.pending[0][0].query():
                self.pending.popleft()
        return out


class _TorchIterator:
    """One pass. An iterator object, not a generator: a suspended generator
    would keep the batch it yielded last (and its slot) until the next one."""

    __slots__ = ("batches", "it")

    def __init__(self, batches: TorchBatches, it) -> None:
        self.batches, self.it = batches, it

    def __iter__(self) -> "_TorchIterator":
        return self

    def __next__(self) -> Any:
        return self.batches._convert(next(self.it))


def _map(batch: Any, fn) -> Any:
    import torch

    t = type(batch)
    if t is dict:
        return {k: _map(v, fn) for k, v in batch.items()}
    if t is tuple or t is list:
        return t(_map(v, fn) for v in batch)
    return fn(batch) if isinstance(batch, torch.Tensor) else batch


def _host_tensors(batch: Any, path: str) -> Any:
    import torch

    t = type(batch)
    if t is dict:
        return {k: _host_tensors(v, f"{path}[{k!r}]") for k, v in batch.items()}
    if t is tuple or t is list:
        return t(_host_tensors(v, f"{path}[{i}]") for i, v in enumerate(batch))
    if isinstance(batch, np.ndarray):
        try:
            return torch.from_numpy(batch)
        except TypeError:
            raise BatchTypeError(f"PyTorch has no dtype for {batch.dtype!r}", path) from None
    if isinstance(batch, np.generic):
        try:
            return torch.from_numpy(np.asarray(batch))
        except TypeError:
            raise BatchTypeError(f"PyTorch has no dtype for {batch.dtype!r}", path) from None
    return batch
