"""Transport-bound throughput: how fast batches can move, side by side.

Two producer processes hand out ready-made batches (one float32 array of the
given size) as fast as the transport takes them. Each batch is fresh data:
the producer changes an element before sending it, so nothing can cache a
previous batch. The consumer touches one element of each batch and lets it
go. Every path runs in the same process, one after the other, and with
repeat > 1 several times in rounds (the median run is kept), so the ratios
hold on a noisy machine; absolute numbers do not travel between machines.

Paths:
  memcpy        one in-process copy of the batch (np.copyto): the floor of one copy
  mp.Queue      multiprocessing.Queue: pickle through a pipe (the plain multiprocessing recipe)
  shm ring      shmpipe.from_iterators, producers yield arrays (one copy into a slot)
  shm reserve   shmpipe producers fill slots in place with shmpipe.reserve (no copy)
  shm varying   the shm ring with batches of 1/2, 1/2, 1 and 2 times the size in turn
                (the size on average), each the start of one array of the largest
                size: the slots are sized from the first (1/2), so half the
                batches travel in memory of their own (regions, reused)
  shm mixed in slots
                the batches of "shm varying" in slots sized for the largest, so
                none needs memory of its own: what the mix of sizes costs the
                ring itself (the reference of "shm varying" at its own traffic)
  X varying     the same over transport X, for every transport that takes batches
                of any size (sized by its first batch: arrow)
  transport:X   the same pipeline as "shm ring" over transport X (arrow, queue, ray)
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.synchronize
import queue as queue_mod
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench import _warm
from shmpipe.bench._report import KiB, MiB, human_size, line_plot, process_context

__all__ = ["Result", "run", "DEFAULT_SIZES", "default_paths", "table", "targets", "plot"]

DEFAULT_SIZES = (64 * KiB, 1 * MiB, 48_000_000)


@dataclass
class Result:
    path: str
    nbytes: int
    batches: int
    seconds: float
    consumer_cpu_s: float
    #: Start-up: from making the pipeline (starting the queue's processes)
    #: to its first batch; None for memcpy.
    first_batch_s: float | None = None
    #: Whether the start of what made that first batch (shmpipe's fork server,
    #: multiprocessing's) ran already: every run after the first in this process
    warm_start: bool | None = None
    #: batches/s of each run, where the path ran several times (run(repeat=)):
    #: this Result is the median run
    runs_per_s: list[float] = field(default_factory=list)

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.batches * self.nbytes / self.seconds / 1e9

    @property
    def cpu_us_per_batch(self) -> float:
        return self.consumer_cpu_s / self.batches * 1e6

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(batches_per_s=self.batches_per_s, gb_per_s=self.gb_per_s, cpu_us_per_batch=self.cpu_us_per_batch)
        return d


# -- producers (top level: spawned processes unpickle them) -------------------


class FreshArrays:
    """Yields the same float32 array again and again, changed each time."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self) -> Iterator[np.ndarray]:
        a = np.ones(max(1, self.nbytes // 4), dtype=np.float32)
        i = 0
        while True:
            a[0] = i
            yield a
            i += 1


class ReservedArrays:
    """Fills a slot in place: reserve, change an element, yield."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self) -> Iterator[np.ndarray]:
        spec = shmpipe.ArraySpec((max(1, self.nbytes // 4),), np.float32)
        i = 0
        while True:
            a = shmpipe.reserve(spec)
            a[0] = i
            yield a
            i += 1


class VaryingArrays:
    """Yields float32 arrays of 1/2, 1/2, 1 and 2 times `nbytes` in turn,
    changed each time: the mean is `nbytes`, the first sizes the slots.

    Each is the start of one array of the largest size, as a producer that
    fills a buffer of its largest batch has it: the producer reads 2 x
    `nbytes` of source memory again and again, where "shm ring"'s reads
    `nbytes`. With an array of its own for each size (4 x `nbytes`), at
    8 MiB the two producers' sources (64 MiB) no longer fitted this
    machine's 32 MiB cache where the ring's (16 MiB) did, and the ratio of
    the two paths measured the cache: the same mix with slots big enough for
    every batch, so no regions at all, ran at 0.74x the ring."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    @staticmethod
    def largest(nbytes: int) -> int:
        """The bytes of the largest batch."""
        return 2 * max(2, nbytes // 4) * 4

    def __call__(self) -> Iterator[np.ndarray]:
        n = max(2, self.nbytes // 4)
        largest = np.ones(2 * n, dtype=np.float32)
        sizes = (n // 2, n // 2, n, 2 * n)
        i = 0
        while True:
            a = largest[: sizes[i % 4]]
            a[0] = i
            yield a
            i += 1


def _pages(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def _queue_producer(
    q: multiprocessing.Queue[np.ndarray], nbytes: int, stop: multiprocessing.synchronize.Event
) -> None:
    a = np.ones(max(1, nbytes // 4), dtype=np.float32)
    i = 0
    while not stop.is_set():
        a[0] = i
        try:
            q.put(a, timeout=0.1)
        except queue_mod.Full:
            continue
        i += 1


# -- the measurements -----------------------------------------------------------


def _timed(
    next_batch: Callable[[], np.ndarray], seconds: float, min_batches: int, warmup: int
) -> tuple[int, float, float]:
    """Takes batches until `seconds` passed and at least `min_batches`
    arrived, after `warmup` untimed ones. Returns (count, wall, cpu)."""
    for _ in range(warmup):
        b = next_batch()
        float(b[0])
        del b
    count = 0
    c0, t0 = time.process_time(), time.perf_counter()
    deadline = t0 + seconds
    while True:
        b = next_batch()
        float(b[0])  # touch it
        del b
        count += 1
        if count >= min_batches and time.perf_counter() >= deadline:
            break
    return count, time.perf_counter() - t0, time.process_time() - c0


def bench_memcpy(nbytes: int, seconds: float, min_batches: int) -> Result:
    src = np.ones(max(1, nbytes // 4), dtype=np.float32)
    dst = np.empty_like(src)
    i = 0

    def step() -> np.ndarray:
        nonlocal i
        src[0] = i
        i += 1
        np.copyto(dst, src)
        return dst

    n, wall, cpu = _timed(step, seconds, min_batches, warmup=3)
    return Result("memcpy", nbytes, n, wall, cpu)


def bench_queue(nbytes: int, seconds: float, min_batches: int, workers: int, capacity: int) -> Result:
    ctx = process_context()
    warm = _warm.multiprocessing_fork_server_running(ctx)
    t0 = time.perf_counter()
    q: multiprocessing.Queue[np.ndarray] = ctx.Queue(capacity)
    stop = ctx.Event()
    procs = [ctx.Process(target=_queue_producer, args=(q, nbytes, stop), daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    try:
        q.get(timeout=60)
        first_s = time.perf_counter() - t0
        n, wall, cpu = _timed(lambda: q.get(timeout=60), seconds, min_batches, warmup=workers)
    finally:
        stop.set()
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            try:
                q.get(timeout=0.05)  # producers blocked in put() need room to see `stop`
            except queue_mod.Empty:
                pass
        for p in procs:
            p.join(1)
            if p.is_alive():
                p.kill()
                p.join(1)
        q.close()
        q.join_thread()
    return Result("mp.Queue", nbytes, n, wall, cpu, first_s, warm)


def bench_pipeline(
    path: str, nbytes: int, seconds: float, min_batches: int, workers: int, capacity: int
) -> Result:
    """A shmpipe pipeline: "shm ring", "shm reserve", "<transport> varying"
    or "transport:<name>"."""
    transport = path.split(":", 1)[1] if path.startswith("transport:") else "shm"
    source: Callable[[], Iterator[np.ndarray]]
    slot_size = None
    if path == "shm reserve":
        source = ReservedArrays(nbytes)
    elif path == MIXED_IN_SLOTS:
        source = VaryingArrays(nbytes)
        slot_size = _pages(VaryingArrays.largest(nbytes) * 5 // 4)  # the default's rule (+25%), for the largest
    elif path.endswith(VARYING):
        transport = path[: -len(VARYING)]
        source = VaryingArrays(nbytes)
    else:
        source = FreshArrays(nbytes)
    # what its producers start from: Ray's runtime, or shmpipe's fork server
    warm = _warm.ray_running() if transport == "ray" else _warm.shmpipe_fork_server_running()
    t0 = time.perf_counter()
    with shmpipe.from_iterators(
        [source] * workers, capacity=capacity, transport=transport, timeout=120, slot_size=slot_size
    ) as pipe:
        it = iter(pipe)
        next(it)
        first_s = time.perf_counter() - t0
        n, wall, cpu = _timed(lambda: next(it), seconds, min_batches, warmup=capacity)
    return Result(path, nbytes, n, wall, cpu, first_s, warm)


MIXED_IN_SLOTS = "shm mixed in slots"
PATHS = ("memcpy", "mp.Queue", "shm ring", "shm reserve", "shm varying", MIXED_IN_SLOTS)
VARYING = " varying"


def varying_transports() -> list[str]:
    """The transports installed here that take batches of any size (their
    channel is sized by the first batch, and larger ones still travel):
    each gets a varying path."""
    names = []
    for name in shmpipe.available_transports():
        try:
            if shmpipe.get_transport(name).capabilities.sized_by_first_batch:
                names.append(name)
        except shmpipe.ShmpipeError:
            continue  # a transport whose package is missing here
    return names


def default_paths() -> list[str]:
    """The floors, the ring (copying and in place), and every other
    transport installed here (plugins included), with a varying path for
    each that takes batches of any size."""
    others = [t for t in shmpipe.available_transports() if t != "shm"]
    varying = [f"{t}{VARYING}" for t in varying_transports() if t != "shm"]
    return list(PATHS) + varying + [f"transport:{t}" for t in others]


def plot(results: list[Result], path: str, title: str) -> None:
    """GB/s against batch size, one line per path (log-log)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        series.setdefault(r.path, []).append((r.nbytes, r.gb_per_s))
    line_plot(path, title, "GB/s (reserve: bytes handed over, not moved)", series,
              styles={"memcpy": "k--", "mp.Queue": "k:"})


def run(
    sizes: Iterable[int] = DEFAULT_SIZES,
    *,
    seconds: float = 1.5,
    min_batches: int = 20,
    workers: int = 2,
    capacity: int | None = None,
    paths: Iterable[str] | None = None,
    repeat: int = 1,
    progress: Callable[[str, int], None] | None = None,
) -> list[Result]:
    """Measures every path at every size, in this process, one after the other;
    progress(path, nbytes), if given, is called before each run.

    With `repeat` > 1, each size's paths run `repeat` times in rounds (every
    path once, then every path again), and each path's Result is its median
    run, with every run's batches/s in runs_per_s: a shared machine's slow
    spell of a few seconds then lands on one run of each path rather than
    on all the runs of one path, which the ratios between paths would carry."""
    capacity = capacity or 2 * workers + 2
    todo = default_paths() if paths is None else list(paths)
    results = []
    for nbytes in sizes:
        runs: dict[str, list[Result]] = {path: [] for path in todo}
        for _ in range(repeat):
            for path in todo:
                runs[path].append(_run_once(path, nbytes, seconds, min_batches, workers, capacity, progress))
        for path in todo:
            ordered = sorted(runs[path], key=lambda r: r.batches_per_s)
            median = ordered[(len(ordered) - 1) // 2]
            if repeat > 1:
                median.runs_per_s = [r.batches_per_s for r in runs[path]]
            results.append(median)
    return results


def _run_once(
    path: str,
    nbytes: int,
    seconds: float,
    min_batches: int,
    workers: int,
    capacity: int,
    progress: Callable[[str, int], None] | None,
) -> Result:
    if progress:
        progress(path, nbytes)
    if path == "memcpy":
        return bench_memcpy(nbytes, seconds, min_batches)
    if path == "mp.Queue":
        return bench_queue(nbytes, seconds, min_batches, workers, capacity)
    if path in ("shm ring", "shm reserve", MIXED_IN_SLOTS) or path.endswith(VARYING) or path.startswith("transport:"):
        return bench_pipeline(path, nbytes, seconds, min_batches, workers, capacity)
    raise shmpipe.ShmpipeValueError(f"unknown path {path!r}; known: {', '.join(default_paths())}")


def table(results: list[Result]) -> str:
    """A Markdown table: one row per path and size (the median run, and the
    runs' range where there were several), with the ratio to memcpy."""
    floor = {r.nbytes: r for r in results if r.path == "memcpy"}
    lines = [
        "| batch | path | GB/s | batches/s | runs (batches/s) | vs memcpy | consumer CPU per batch | first batch |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        ratio = f"{r.gb_per_s / floor[r.nbytes].gb_per_s:.2f}x" if r.nbytes in floor else "-"
        first = "-" if r.first_batch_s is None else f"{r.first_batch_s * 1e3:.0f} ms"
        if r.warm_start:
            first += " (warm)"
        spread = f"{min(r.runs_per_s):,.0f} to {max(r.runs_per_s):,.0f}" if r.runs_per_s else "-"
        lines.append(
            f"| {human_size(r.nbytes)} | {r.path} | {r.gb_per_s:.2f} | {r.batches_per_s:,.0f} | {spread} | {ratio} | "
            f"{r.cpu_us_per_batch:.1f} us | {first} |"
        )
    return "\n".join(lines)


def _times(x: float, up: bool = False) -> str:
    """A ratio to two decimals, rounded away from its target's side (down for
    an "at least", up for an "at most"), so that a missed target never reads
    as its threshold: 0.796 is "0.79x" against 0.8, not "0.80x"."""
    hundredths = round(x * 100, 6)  # 0.29 * 100 is 28.999999999999996
    scaled = math.ceil(hundredths) if up else math.floor(hundredths)
    return f"{scaled / 100:.2f}x"


def targets(results: list[Result]) -> list[tuple[str, bool, str]]:
    """The ring's performance targets, then the hot path's stricter ones,
    checked on these results: (target, met, measured)."""
    by = {(r.path, r.nbytes): r for r in results}
    out: list[tuple[str, bool, str]] = []
    big, small = 48_000_000, 64 * KiB
    if ("shm ring", big) in by and ("memcpy", big) in by:
        ratio = by["shm ring", big].gb_per_s / by["memcpy", big].gb_per_s
        out.append(("48 MB: shm ring >= 0.5 x memcpy", ratio >= 0.5, _times(ratio)))
    if ("shm ring", small) in by:
        r = by["shm ring", small].batches_per_s
        out.append(("64 KiB: shm ring >= 150,000 batches/s", r >= 150_000, f"{r:,.0f}/s"))
        if ("mp.Queue", small) in by:
            x = r / by["mp.Queue", small].batches_per_s
            out.append(("64 KiB: shm ring vs mp.Queue (about 9x asked)", x >= 9, f"{x:.1f}x"))
    reserve = sorted((r for r in results if r.path == "shm reserve"), key=lambda r: r.nbytes)
    if len(reserve) >= 2:
        lo, hi = reserve[0], reserve[-1]
        growth = (1 / hi.batches_per_s) / (1 / lo.batches_per_s)
        out.append(
            (
                f"reserve: per-batch cost flat from {human_size(lo.nbytes)} to {human_size(hi.nbytes)} (< 2x)",
                growth < 2.0,
                f"{1e6 / lo.batches_per_s:.1f} us -> {1e6 / hi.batches_per_s:.1f} us",
            )
        )
    # The hot path's targets (a ready batch taken in one compiled call, a brief
    # spin before the futex sleep), for a 2-core machine with 2 producers.
    if ("shm ring", small) in by:
        r = by["shm ring", small].batches_per_s
        out.append(("64 KiB: shm ring >= 300,000 batches/s (2 cores)", r >= 300_000, f"{r:,.0f}/s"))
    if reserve:
        worst = min(reserve, key=lambda r: r.batches_per_s)
        us = 1e6 / worst.batches_per_s
        at = human_size(worst.nbytes)
        out.append(("reserve: <= 5 us per batch at every size", us <= 5.0, f"{us:.1f} us at {at}"))
    # Batches of any size at ring speed: each varying path against
    # the ring at the same size, in throughput and in the trainer's CPU.
    # (X varying against X's own fixed-size path: "shm ring", "transport:X".)
    for v in sorted((v for v in results if v.path.endswith(VARYING)), key=lambda v: (v.path, v.nbytes)):
        transport = v.path[: -len(VARYING)]
        fixed = "shm ring" if transport == "shm" else f"transport:{transport}"
        ring = by.get((fixed, v.nbytes))
        if ring is None:
            continue
        at = human_size(v.nbytes)
        x = v.batches_per_s / ring.batches_per_s
        out.append((f"{at}: {v.path} >= 0.8 x {fixed}", x >= 0.8, _times(x)))
        cpu = v.cpu_us_per_batch / ring.cpu_us_per_batch
        out.append((f"{at}: {v.path} trainer CPU per batch <= 2 x {fixed}'s", cpu <= 2.0, _times(cpu, up=True)))
        same = by.get((MIXED_IN_SLOTS, v.nbytes)) if transport == "shm" else None
        if same is not None:  # the same batches, none in a region: what regions themselves cost
            x = v.batches_per_s / same.batches_per_s
            out.append((f"{at}: {v.path} >= 0.8 x {MIXED_IN_SLOTS} (the same batches)", x >= 0.8, _times(x)))
    return out
