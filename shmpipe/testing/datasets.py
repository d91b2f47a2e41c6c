"""Picklable map-style datasets and samplers for tests and benchmarks of
``from_dataset`` (classes at module level, so producer processes started
with spawn or forkserver can import them)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "Augmented", "EpochSampler", "FailsAtEpoch", "FetchLog", "Numbered", "OnRayNode", "ShapeByIndex", "log_fetch",
]


class Numbered:
    """Sample i: ``{"x": an array of `shape` filled with i, "i": i, "name":
    "s<i>", "pair": (i, -i)}``, so each delivered row says which sample it
    is. With `log`, each fetch appends its index to that file (one line,
    O_APPEND: lines from several producers do not interleave), which a test
    reads to see what was fetched."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3,), log: str | None = None) -> None:
        self.n = n
        self.shape = shape
        self.log = log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.log is not None:
            log_fetch(self.log, i)
        return {"x": np.full(self.shape, i, np.int64), "i": i, "name": f"s{i}", "pair": (i, -i)}


class OnRayNode(Numbered):
    """For producers on a Ray cluster: Numbered's sample i, with "node": the
    Ray node it was fetched on, each fetch taking `delay` seconds; with
    `payload`, "pixels" too: that many bytes, each i % 251 (batches of
    100 KiB and more live in the object store of the producer's node, not
    inline in Ray's messages)."""

    def __init__(self, n: int, delay: float = 0.0, payload: int = 0) -> None:
        super().__init__(n)
        self.delay = delay
        self.payload = payload

    def __getitem__(self, i: int) -> dict[str, Any]:
        import time

        import ray

        time.sleep(self.delay)
        sample = super().__getitem__(i) | {"node": ray.get_runtime_context().get_node_id()}
        if self.payload:
            sample["pixels"] = np.full(self.payload, i % 251, np.uint8)
        return sample


class Augmented(Numbered):
    """Numbered's sample i with "draws": one draw each from ``random`` and
    NumPy's global generator, as a dataset's random augmentations draw
    (not torch's: whether torch is imported differs between the trainer
    and the producers, and so would the draws); and "pid": the process
    that fetched it. Each fetch in process `slow_in` (the trainer, say)
    takes `delay` seconds more; there, where `fail_at` is i, it fails with
    a LookupError, and the first fetch of `interrupt_at` raises
    KeyboardInterrupt (a Ctrl-C inside the dataset's code)."""

    def __init__(
        self, n: int, slow_in: int = -1, delay: float = 0.0, fail_at: int = -1, interrupt_at: int = -1
    ) -> None:
        super().__init__(n)
        self.slow_in, self.delay, self.fail_at, self.interrupt_at = slow_in, delay, fail_at, interrupt_at

    def __getitem__(self, i: int) -> dict[str, Any]:
        import random
        import time

        here = os.getpid() == self.slow_in
        if here and i == self.fail_at:
            raise LookupError(f"sample {i} cannot be read here")
        if here and i == self.interrupt_at:
            self.interrupt_at = -1
            raise KeyboardInterrupt
        if here and self.delay:
            time.sleep(self.delay)
        draws = np.array([random.random(), np.random.random()])
        return super().__getitem__(i) | {"draws": draws, "pid": os.getpid()}


def log_fetch(path: str, index: int) -> None:
    """Appends `index` to the fetch log at `path`: one line, one O_APPEND
    write, so the lines of several processes never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{index}\n".encode())
    finally:
        os.close(fd)


class FetchLog:
    """Reads what a Numbered dataset with `log` fetched."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fetched(self) -> list[int]:
        try:
            with open(self.path) as f:
                return [int(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []


class ShapeByIndex:
    """Sample i is an array of shape (1 + i % 3,): stacking it fails unless
    a collate_fn pads."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(1 + i % 3, i, np.int32)


class FailsAtEpoch:
    """The indices 0..n-1 in order, each epoch (told by set_epoch); while
    `fail` is set, drawing epoch `epoch` raises RuntimeError (a sampler
    that cannot draw that epoch yet)."""

    def __init__(self, n: int, epoch: int = 1, fail: bool = False) -> None:
        self.n, self.failing_epoch, self.fail, self.epoch = n, epoch, fail, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if self.fail and self.epoch == self.failing_epoch:
            raise RuntimeError(f"the sampler failed at epoch {self.epoch}")
        return iter(range(self.n))


class EpochSampler:
    """A sampler with set_epoch, in the manner of torch's
    DistributedSampler: each epoch's order is a permutation drawn from
    (seed, epoch), and only set_epoch changes it."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        return iter(rng.permutation(self.n).tolist())
