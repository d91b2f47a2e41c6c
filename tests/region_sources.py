"""The sources of tests/test_regions.py, in a module of their own: a producer
imports its source's module (where the fork server has not), and this one
imports numpy and shmpipe only, the test module pytest and Hypothesis too."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import shmpipe
from shmpipe import ArraySpec, _external

SMALL, BIG = 2_000, 60_000  # float32 elements: the first (small) batch sizes the slots; BIG never fits


class RandomSizes:
    """`count` batches {"worker", "seq", "x"} per worker, small or big at
    random (seeded per worker), each filled with a pattern of (worker,
    seq): the consumer can tell any byte that changed or came from another
    batch. The first is small (it sizes the slots)."""

    def __init__(self, count: int, seed: int = 0, delay: float = 0.0) -> None:
        self.count, self.seed, self.delay = count, seed, delay

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = shmpipe.get_worker_info().id
        rng = random.Random(self.seed * 1000 + worker)
        for seq in range(self.count):
            n = SMALL if seq == 0 else rng.choice((SMALL, SMALL // 2, BIG, BIG * 2, BIG + 7))
            if self.delay:
                time.sleep(self.delay)
            yield {"worker": worker, "seq": seq, "x": pattern(worker, seq, n)}


def pattern(worker: int, seq: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) + np.float32(worker * 100_000 + seq)) % np.float32(1 << 20)


class Cycle:
    """Sizes 1/2, 1/2, 1, 2 times BIG in turn (the benchmark's 'varying'):
    the first sizes the slots, half the batches do not fit."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = shmpipe.get_worker_info().id
        for seq in range(self.count):
            n = (BIG // 2, BIG // 2, BIG, 2 * BIG)[seq % 4]
            yield {"worker": worker, "seq": seq, "x": pattern(worker, seq, n)}


class GrowThenShrink:
    """Big batches, then small ones for more than a region's idle time."""

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = shmpipe.get_worker_info().id
        sizes = [SMALL] + [BIG * 2, BIG, BIG * 2] * 10 + [SMALL] * (_external.IDLE_PUTS + 50)
        t_end = None
        for seq, n in enumerate(sizes):
            if n == SMALL and seq > 0 and t_end is None:
                t_end = time.monotonic() + _external.IDLE_NS / 1e9 * 1.5
            if t_end is not None and seq == len(sizes) - 1:
                time.sleep(max(0.0, t_end - time.monotonic()))  # idle for long enough, then one more batch
                for _ in range(_external.SWEEP_EVERY):  # a sweep is due within these
                    yield {"worker": worker, "seq": seq, "x": pattern(worker, seq, SMALL)}
                    seq += 1
                return
            yield {"worker": worker, "seq": seq, "x": pattern(worker, seq, n)}


class ReserveThenYieldBigger:
    """Reserves each batch in a slot and fills it; every other one is
    yielded, instead, inside a structure larger than a slot: the record of
    that batch goes into the reservation's slot (claiming another could
    wait forever on an ordered pipeline's quota), the reserved bytes copied
    into a region before the record is written over them."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = shmpipe.get_worker_info().id
        yield {"worker": worker, "seq": 0, "x": pattern(worker, 0, SMALL)}  # sizes the slots
        for seq in range(1, self.count):
            r = shmpipe.reserve({"worker": worker, "seq": seq, "x": ArraySpec((SMALL,), np.float32)})
            r["x"][:] = pattern(worker, seq, SMALL)
            if seq % 2:
                yield r  # as reserved: published in place
            else:
                yield {"worker": worker, "seq": seq, "x": r["x"], "big": pattern(worker, seq, BIG)}
