"""What ``shmpipe bench feed`` measures, and how: its configuration, the
batches its producers make (DataGenerator), a recipe's result, and the
timing of the consumer's loop (_measure), which every recipe runs, in
this process or in a training script of its own (_feed_startup).

Nothing of shmpipe beyond the package itself is imported at the top
(_process and _report, which imports shmpipe._startup, where they are
used): the start-up recipes' training script imports this module, and what
of shmpipe a pipeline needs is a cost of the first batch a user pays.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench import _warm

#: The recipes whose producers run on Ray (its runtime started once, before their clocks: one_ray).
RAY_RECIPES = ("ray.util.iter", "shmpipe:ray")

#: A batch: (sample, target).
Batch = tuple[np.ndarray, np.ndarray]
#: Called after each batch the consumer took (run() counts them).
OnBatch = Callable[[], None]
#: run()'s progress callback: (recipe, None) when it is skipped, (recipe, 0)
#: when it starts, (recipe, 1) after each batch.
OnProgress = Callable[[str, int | None], None]


@dataclass(frozen=True)
class FeedConfig:
    workers: int = field(default_factory=lambda: multiprocessing.cpu_count())
    batches: int = 10  # per producer (the plain generator and tf.data make this many)
    shape: tuple[int, ...] = (4, 1000000, 3)
    target_shape: tuple[int, ...] = (4, 1)
    fetch_s: float = 0.5
    compute_s: float = 0.0  # busy loop, beside drawing the random arrays
    train_s: float = 0.1

    @property
    def produce_s(self) -> float:
        """What one batch costs a producer, drawing the arrays aside."""
        return self.fetch_s + self.compute_s

    @property
    def producer_bound(self) -> bool:
        """Whether the producers, not the transport, set the pace: together
        they make a batch no faster than (80% of) a training step."""
        return self.produce_s / max(self.workers, 1) > 0.8 * self.train_s


def wait_floor(producers: int, produce_s: float, train_s: float) -> float:
    """The least mean wait per batch in the steady state, if moving a batch
    cost nothing: `producers` working in parallel make a batch every
    produce_s / producers seconds at best, and the loop spends train_s of
    that in its step, so it waits the rest. producers == 0: the loop makes
    each batch itself and waits all of produce_s. A long-run average: over a
    few batches a recipe may come in slightly under it."""
    if producers == 0:
        return produce_s
    return max(0.0, produce_s / producers - train_s)


@dataclass
class RecipeResult:
    recipe: str
    #: producers working in parallel with the loop (0: the loop makes its
    #: batches itself; tf.data's prefetching thread counts as 1)
    producers: int
    waits_s: list[float]
    first_batch_s: float
    total_s: float
    skipped: str | None = None
    #: CPU time of the trainer's process (all its threads: tf.data's
    #: generator runs there) from the first batch to the end
    cpu_s: float = 0.0
    #: wait_floor() for this recipe and setting
    floor_s: float = 0.0
    #: batches delivered until every producer had delivered one (1 for the
    #: generator and tf.data). Producers start one after the other, seconds
    #: apart on a busy machine; until each has made its first batch, the
    #: waits say how fast processes start, not how fast batches move.
    warm_up_batches: int = 1
    #: PSS of the producer processes, MiB, once every producer had
    #: delivered a batch (None: no producer process apart from the loop's,
    #: or /proc unreadable)
    producers_pss_mib: float | None = None
    #: shmpipe's recipes: whether its fork server was running in the
    #: measuring process when the clock started (an earlier recipe of the
    #: same process started it, or shmpipe.prestart()): then the first batch
    #: is warm, without the server's start that a new job pays. None: not
    #: a recipe of shmpipe's.
    warm_start: bool | None = None
    #: The start-up recipes: the first batch from the training script's
    #: first line, its imports (the framework's, and shmpipe.prestart()'s
    #: start of the fork server where it calls that) included: what a user
    #: waits for from `python train.py`. None: a recipe of this process.
    from_start_s: float | None = None

    @property
    def steady_waits_s(self) -> list[float]:
        """The waits after the start-up (see first_batch_s for that)."""
        return self.waits_s[self.warm_up_batches :]

    @property
    def wait_s(self) -> float:
        """Mean wait per batch in the steady state (once every producer has delivered a batch)."""
        w = self.steady_waits_s
        return statistics.fmean(w) if w else float("nan")

    @property
    def above_floor_s(self) -> float:
        return self.wait_s - self.floor_s

    @property
    def cpu_per_batch_s(self) -> float:
        n = len(self.waits_s) - 1  # cpu_s counts from the first batch on
        return self.cpu_s / n if n > 0 else float("nan")

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.waits_s) if self.waits_s else float("nan")

    @property
    def median_s(self) -> float:
        return statistics.median(self.waits_s) if self.waits_s else float("nan")

    @property
    def p99_s(self) -> float:
        if not self.waits_s:
            return float("nan")
        w = sorted(self.waits_s)
        return w[min(len(w) - 1, int(0.99 * len(w)))]

    @property
    def stall_fraction(self) -> float:
        return sum(self.waits_s) / self.total_s if self.total_s > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            mean_s=self.mean_s, median_s=self.median_s, p99_s=self.p99_s, stall_fraction=self.stall_fraction,
            wait_s=self.wait_s, above_floor_s=self.above_floor_s,
            cpu_per_batch_s=self.cpu_per_batch_s,
        )
        return d


#: A recipe: runs the experiment with a config, calling on_batch after each batch.
Recipe = Callable[[FeedConfig, OnBatch | None], RecipeResult]


# -- the data generator (top level: producer processes unpickle it) -----------


class DataGenerator:
    """The experiment's data generator (a sleep to fetch, a busy loop to
    compute, then random arrays), with its costs as parameters. The
    target's first element carries the producing process's pid (exact in
    float32: pids stay below 2**24), so the loop can tell when every
    producer has delivered its first batch."""

    def __init__(self, cfg: FeedConfig, reserve: bool = False) -> None:
        self.cfg, self.reserve = cfg, reserve

    def __call__(self) -> Iterator[Batch]:
        cfg = self.cfg
        rng = np.random.default_rng()
        for _ in range(cfg.batches):
            time.sleep(cfg.fetch_s)  # fetch from disk or network
            deadline = time.perf_counter() + cfg.compute_s
            while time.perf_counter() < deadline:  # compute
                pass
            if self.reserve:
                sample, target = batch = shmpipe.reserve(
                    (shmpipe.ArraySpec(cfg.shape, np.float32), shmpipe.ArraySpec(cfg.target_shape, np.float32))
                )
                rng.random(out=sample, dtype=np.float32)  # drawn straight into the slot
                rng.random(out=target, dtype=np.float32)
                _sign(target)
                yield batch
            else:
                target = rng.random(cfg.target_shape, dtype=np.float32)
                _sign(target)
                yield rng.random(cfg.shape, dtype=np.float32), target


def _sign(target: np.ndarray) -> None:
    if target.size:
        target.flat[0] = os.getpid()


def _producer_of(batch: Any) -> int | None:
    target = np.asarray(batch[1])
    return int(target.flat[0]) if target.size else None


def _measure(
    name: str, producers: int, cfg: FeedConfig, make_iter: Callable[[], Iterator[Any]], on_batch: OnBatch | None = None,
    started: float | None = None,
) -> RecipeResult:
    """Times the consumer's wait for each batch of iterator make_iter(), and
    the CPU time this process spends from the first batch on. `producers`
    is how many make batches in parallel with the loop (0: the loop itself).
    `started`: where the process's own clock began (a start-up recipe's
    script, at its first line: time.perf_counter()), for from_start_s."""
    warm = _warm_start(name)
    t_start = time.perf_counter()
    it = make_iter()
    waits: list[float] = []
    first: float | None = None
    from_start: float | None = None
    cpu_start = 0.0
    seen: set[int | None] = set()
    warm_up = 1
    pss: float | None = None
    pss_at_first: dict[int, int | None] = {}  # producer -> its PSS at its first batch (kB lines, bytes)
    st = time.perf_counter()
    for batch in it:
        en = time.perf_counter()
        waits.append(en - st)
        if first is None:
            first = en - t_start
            from_start = en - started if started is not None else None
            cpu_start = time.process_time()
        float(np.asarray(batch[0]).flat[0])  # look at the batch
        producer = _producer_of(batch)
        if producer not in seen:
            seen.add(producer)
            warm_up = len(waits)
            if producers and producer is not None and producer != os.getpid():
                pss_at_first[producer] = _pss(producer)
            if producers and len(seen) == producers:
                pss = producers_pss_mib(seen, pss_at_first)
        del batch
        if on_batch:
            on_batch()
        time.sleep(cfg.train_s)  # the training step
        st = time.perf_counter()
    total = time.perf_counter() - t_start
    cpu = time.process_time() - cpu_start if first is not None else 0.0
    floor = wait_floor(producers, cfg.produce_s, cfg.train_s)
    return RecipeResult(
        name, producers, waits, first or 0.0, total, cpu_s=cpu, floor_s=floor, warm_up_batches=warm_up,
        producers_pss_mib=pss, warm_start=warm, from_start_s=from_start,
    )


#: What a recipe may start once per process (_started_by), as the summary names it where it ran already.
_STARTS = {
    "shmpipe": "shmpipe's fork server, started and its modules imported by an earlier recipe of this process",
    "multiprocessing": "multiprocessing's fork server, started by an earlier recipe",
    "ray": "Ray's runtime, started before their clocks (its start: below)",
}


def _started_by(name: str) -> str | None:
    if name in RAY_RECIPES:
        return "ray"
    return "shmpipe" if name.startswith("shmpipe") else "multiprocessing" if name == "mp.Queue" else None


def _warm_start(name: str) -> bool | None:
    """Whether what recipe `name` starts once per process runs already (its
    first batch is then warm; None: it starts nothing of the kind)."""
    kind = _started_by(name)
    if kind == "multiprocessing":
        from shmpipe.bench._report import process_context  # (none for shmpipe's: the start-up scripts' clock)

        return _warm.multiprocessing_fork_server_running(process_context())
    return _warm.ray_running() if kind == "ray" else _warm.shmpipe_fork_server_running() if kind else None


def producers_pss_mib(pids: set[int | None], earlier: dict[int, int | None] | None = None) -> float | None:
    """The PSS of these processes together now, MiB (this process not
    counted: the loop's own thread is no producer process); a process
    already gone counts with its PSS in `earlier` (a DataLoader worker
    ends as soon as its iterator does). None if none is another process or
    one cannot be read either way."""
    others = [pid for pid in pids if pid is not None and pid != os.getpid()]
    sizes = [_pss(pid) or (earlier or {}).get(pid) for pid in others]
    if not others or any(size is None for size in sizes):
        return None
    return sum(size for size in sizes if size is not None) / (1 << 20)


def _pss(pid: int) -> int | None:
    """Process `pid`'s PSS, bytes (None: gone, or /proc unreadable)."""
    from shmpipe._process import proc_kib

    return proc_kib(f"/proc/{pid}/smaps_rollup", "Pss")
