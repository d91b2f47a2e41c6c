"""How long does a training loop wait for its next batch, fed every way side by side?

The experiment this project starts from: producers that take 0.5 s to fetch
each 48 MB batch, and a 0.1 s training step.

A data generator simulates fetching (a sleep) and computing (a busy loop,
then drawing the arrays), and yields (sample, target) batches, by default
float32 arrays of shape (4, 1000000, 3) (48 MB) and (4, 1). The consumer
simulates a training step with a sleep and measures how long it waits for
each batch. Recipes:

  generator          the plain generator, in the training process
  tf.data            tf.data.Dataset.from_generator(...).prefetch(AUTOTUNE)
  mp.Queue           cpu_count() processes putting batches on a
                     multiprocessing.Queue(cpu_count() * 2), the plain multiprocessing recipe
  ray.util.iter      ray.util.iter.from_iterators([gen] * n).gather_async()
  shmpipe:<name>     shmpipe.from_iterators([gen] * n, transport=<name>), every
                     available transport
  shmpipe:shm+reserve  shmpipe producers that draw the arrays straight into a slot
  shmpipe:shm@FRAMEWORK, torch.DataLoader@FRAMEWORK
                     start-up: a training script of its own, with
                     `import FRAMEWORK` (tensorflow, torch; numpy: the baseline) at its top and the
                     source defined in it, fed by shmpipe or by torch's
                     DataLoader (fork, the same number of workers). Their
                     first batch and producers' PSS say what the script's
                     imports cost a producer
  shmpipe:shm+prestart@FRAMEWORK
                     the same script calling shmpipe.prestart() before its
                     `import FRAMEWORK`: shmpipe's fork server starts while
                     the script imports, not in the first batch

Each recipe runs in this process (the start-up ones in a script started
from it), one after the other, so they compare on the same machine in the
same minute.

Per recipe it reports the wait per batch in the steady state (once every
producer has delivered a batch: until then the waits carry the start-up,
shown apart), the floor
that the producers allow (with N producers taking FETCH + COMPUTE seconds per
batch and a TRAIN-second step, no transport can wait less on average; see
wait_floor)
and the wait above that floor (what the transport and the machine cost),
the CPU time the trainer's process spends per batch, and the producers'
memory: the PSS of the producer processes (/proc/PID/smaps_rollup: pages
shared with other processes split among them), read once every producer
has delivered a batch. With cpu_count()
producers on a small machine every parallel recipe waits for its producers
(the floor); a second, short run with enough producers to outpace the
training step shows what the transport costs (transport_bound).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench import _warm

# Nothing of shmpipe beyond the package itself is imported at the top
# (_process and _report, which imports shmpipe._startup, where they are
# used): the start-up recipes' training script imports this module before
# its clock starts, and what of shmpipe a pipeline needs is a cost of the
# first batch a user pays, inside the clock.

__all__ = [
    "FeedConfig", "RecipeResult", "available_recipes", "run", "table", "plot", "summary", "transport_bound",
    "wait_floor", "one_ray", "STARTUP_FRAMEWORKS", "run_in_script",
]

#: The frameworks of the start-up recipes: a training script imports one at its top.
STARTUP_FRAMEWORKS = ("tensorflow", "torch", "numpy")
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


def transport_bound(cfg: FeedConfig, batches: int = 4) -> FeedConfig:
    """`cfg` with enough producers that they make batches 1.5 times as fast as
    the loop takes them (8 at the default 0.5 s fetch and 0.1 s step):
    every millisecond of wait above the floor is then the transport's."""
    workers = math.ceil(1.5 * cfg.produce_s / cfg.train_s) if cfg.train_s > 0 else 2 * cfg.workers
    return dataclasses.replace(cfg, workers=max(workers, cfg.workers, 2), batches=batches)


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


def _queue_producer(q: multiprocessing.Queue[Batch | str], cfg: FeedConfig) -> None:
    for batch in DataGenerator(cfg)():
        q.put(batch)
    q.put("DONE")


# -- the recipes ----------------------------------------------------------------


def _measure(
    name: str, producers: int, cfg: FeedConfig, make_iter: Callable[[], Iterator[Any]], on_batch: OnBatch | None = None
) -> RecipeResult:
    """Times the consumer's wait for each batch of iterator make_iter(), and
    the CPU time this process spends from the first batch on. `producers`
    is how many make batches in parallel with the loop (0: the loop itself)."""
    warm = _warm_start(name)
    t_start = time.perf_counter()
    it = make_iter()
    waits: list[float] = []
    first: float | None = None
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
        producers_pss_mib=pss, warm_start=warm,
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


def recipe_generator(cfg: FeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
    return _measure("generator", 0, cfg, lambda: iter(DataGenerator(cfg)()), on_batch)


def recipe_tf_data(cfg: FeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
    import tensorflow as tf

    def make() -> Iterator[Any]:
        ds = tf.data.Dataset.from_generator(
            DataGenerator(cfg),
            output_signature=(tf.TensorSpec(cfg.shape, tf.float32), tf.TensorSpec(cfg.target_shape, tf.float32)),
        ).prefetch(tf.data.experimental.AUTOTUNE)
        return iter(ds)

    return _measure("tf.data", 1, cfg, make, on_batch)  # one thread prefetches


def recipe_mp_queue(cfg: FeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
    """The plain multiprocessing recipe: cpu_count() processes put batches on
    one multiprocessing.Queue (without the queue.join() it is often written
    with, which multiprocessing.Queue does not have)."""
    from shmpipe.bench._report import process_context

    n = cfg.workers
    ctx = process_context()
    procs: list[multiprocessing.process.BaseProcess] = []

    def make() -> Iterator[Batch]:
        q: multiprocessing.Queue[Batch | str] = ctx.Queue(n * 2)
        for _ in range(n):
            p = ctx.Process(target=_queue_producer, args=(q, cfg), daemon=True)
            p.start()
            procs.append(p)

        def gen() -> Iterator[Batch]:
            done = 0
            while done < n:
                msg = q.get(timeout=300)
                if isinstance(msg, str):  # "DONE", the only string a producer puts
                    done += 1
                else:
                    yield msg

        return gen()

    try:
        return _measure("mp.Queue", n, cfg, make, on_batch)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def ray_util_iter_available() -> str | None:
    """None if ray.util.iter can be used; else why not."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return 'Ray is not installed (pip install "shmpipe[ray]")'
    try:
        import ray.util.iter  # noqa: F401
    except ImportError:
        import ray

        return f"this Ray ({ray.__version__}) no longer ships ray.util.iter"
    return None


def recipe_ray_util_iter(cfg: FeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
    import ray
    import ray.util.iter

    from shmpipe.transports.ray import _away_from_a_checkout

    n = cfg.workers
    started = not ray.is_initialized()

    def make() -> Iterator[Any]:  # Ray's start-up counts towards the first batch: ray.init() is part of the recipe
        if started:
            with _away_from_a_checkout():
                ray.init(address="local", num_cpus=max(n, os.cpu_count() or 1), include_dashboard=False,
                         log_to_driver=False)
        return iter(ray.util.iter.from_iterators([DataGenerator(cfg)] * n).gather_async())

    try:
        return _measure("ray.util.iter", n, cfg, make, on_batch)
    finally:
        if started:
            ray.shutdown()


def recipe_shmpipe(transport: str, reserve: bool = False) -> Recipe:
    def run_recipe(cfg: FeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
        n = cfg.workers
        pipes: list[shmpipe.Pipeline] = []

        def make() -> Iterator[Any]:  # starting the producers counts towards the first batch
            pipes.append(
                shmpipe.from_iterators([DataGenerator(cfg, reserve=reserve)] * n, transport=transport, timeout=600)
            )
            return iter(pipes[0])

        name = f"shmpipe:{transport}" + ("+reserve" if reserve else "")
        try:
            return _measure(name, n, cfg, make, on_batch)
        finally:
            for pipe in pipes:
                pipe.close()

    return run_recipe


#: The training script of the start-up recipes: FRAMEWORK imported at its
#: top (after shmpipe.prestart() where PRESTART says so), the source defined
#: in it (using its global CFG), the loop under the main guard. It prints the
#: RecipeResult as JSON. Before the clock (in run_in_script) it has of
#: shmpipe the package itself, as a user's `import shmpipe` at the top, and
#: this module: what a pipeline imports of shmpipe, and its fork server's
#: start, are inside (tests/test_benchmarks.py checks it).
_SCRIPT = textwrap.dedent(
    """
    PRESTART
    import FRAMEWORK
    import json
    import sys

    from shmpipe.bench import feed

    CFG = feed.FeedConfig(**json.loads(sys.argv[2]))


    def make_batches():
        yield from feed.DataGenerator(CFG)()


    if __name__ == "__main__":
        result = feed.run_in_script(sys.argv[1], sys.argv[3], CFG, make_batches)
        print(json.dumps(result.as_dict()))
    """
)


def recipe_script(loader: str, framework: str, prestart: bool = False) -> Recipe:
    """A start-up recipe: the training script (_SCRIPT) importing
    `framework`, fed by `loader` ("shmpipe" or "DataLoader"), run as a
    process of its own (its __main__ is that script, as a user's is).
    `prestart`: the script calls shmpipe.prestart() first."""

    def run_recipe(cfg: FeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
        name = ("shmpipe:shm" if loader == "shmpipe" else "torch.DataLoader") + ("+prestart" if prestart else "")
        name += f"@{framework}"
        first = "import shmpipe\nshmpipe.prestart()" if prestart else ""
        with tempfile.TemporaryDirectory(prefix="shmpipe-bench-") as folder:
            script = os.path.join(folder, "train.py")
            with open(script, "w") as f:
                f.write(_SCRIPT.replace("PRESTART", first).replace("FRAMEWORK", framework))
            config = json.dumps(dataclasses.asdict(cfg))
            # The script finds this very shmpipe (a checkout too); started
            # in its own folder, it is what `python train.py` runs.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            out = subprocess.run(
                [sys.executable, script, loader, config, name], stdout=subprocess.PIPE, text=True, cwd=folder,
                env=env, timeout=600 + 10 * cfg.batches * cfg.workers * (cfg.produce_s + cfg.train_s),
            )
        if out.returncode != 0:
            raise RuntimeError(f"{name}: the training script failed (exit status {out.returncode}; its "
                               "output is in the log)")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        fields = {f.name for f in dataclasses.fields(RecipeResult)}
        result = RecipeResult(**{k: v for k, v in got.items() if k in fields})
        for _ in result.waits_s:
            if on_batch:
                on_batch()
        return result

    return run_recipe


def run_in_script(loader: str, name: str, cfg: FeedConfig, source: Callable[[], Iterator[Batch]]) -> RecipeResult:
    """In the start-up recipes' training script: the loop fed by `loader`
    with cfg.workers producers of `source` (a function of the script)."""
    n = cfg.workers
    if loader == "shmpipe":
        pipes: list[shmpipe.Pipeline] = []

        def make() -> Iterator[Any]:  # starting the producers counts towards the first batch
            pipes.append(shmpipe.from_iterators([source] * n, timeout=600))
            return iter(pipes[0])

        try:
            return _measure(name, n, cfg, make)
        finally:
            for pipe in pipes:
                pipe.close()
    import torch.utils.data

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[Batch]:
            return iter(source())

    # batch_size=None: each worker yields its own batches whole, as a
    # producer does; fork, the DataLoader's default here
    loader_ = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=n)
    return _measure(name, n, cfg, lambda: iter(loader_))


def available_recipes() -> dict[str, Recipe]:
    recipes: dict[str, Recipe] = {
        "generator": recipe_generator,
        "tf.data": recipe_tf_data,
        "mp.Queue": recipe_mp_queue,
        "ray.util.iter": recipe_ray_util_iter,
    }
    for name in shmpipe.available_transports():
        recipes[f"shmpipe:{name}"] = recipe_shmpipe(name)
    recipes["shmpipe:shm+reserve"] = recipe_shmpipe("shm", reserve=True)
    for framework in STARTUP_FRAMEWORKS:
        recipes[f"shmpipe:shm@{framework}"] = recipe_script("shmpipe", framework)
        recipes[f"shmpipe:shm+prestart@{framework}"] = recipe_script("shmpipe", framework, prestart=True)
        recipes[f"torch.DataLoader@{framework}"] = recipe_script("DataLoader", framework)
    return recipes


def _why_not(name: str) -> str | None:
    if "@" in name:  # a start-up recipe: its framework, and torch for the DataLoader
        needs = {name.split("@", 1)[1]} | ({"torch"} if name.startswith("torch.") else set())
        for module in sorted(needs):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        name = name.split("@", 1)[0]
        if name.startswith("torch."):
            return None
    if name == "tf.data":
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            return 'TensorFlow is not installed (pip install "shmpipe[tensorflow]")'
    if name == "ray.util.iter":
        return ray_util_iter_available()
    if name.startswith("shmpipe:"):
        transport = name.split(":", 1)[1].split("+")[0]
        try:
            shmpipe.get_transport(transport)
        except shmpipe.ShmpipeError as exc:
            return str(exc)
    return None


def run(cfg: FeedConfig, recipes: list[str] | None = None, progress: OnProgress | None = None) -> list[RecipeResult]:
    """Runs the recipes one after the other; returns their results (a
    recipe that cannot run here comes back with `skipped` saying why)."""
    known = available_recipes()
    names = list(known) if recipes is None else recipes
    unknown = [n for n in names if n not in known]
    if unknown:
        raise shmpipe.ShmpipeValueError(f"unknown recipes {unknown}; known: {', '.join(known)}")
    results: list[RecipeResult] = []
    for name in names:
        why = _why_not(name)
        if why is not None:
            results.append(RecipeResult(name, 0, [], 0.0, 0.0, skipped=why))
            if progress:
                progress(name, None)
            continue
        if progress:
            progress(name, 0)
        on_batch = functools.partial(progress, name, 1) if progress else None
        results.append(known[name](cfg, on_batch))
    return results


def _fmt_s(s: float) -> str:
    if s != s:  # nan
        return "-"
    if abs(s) < 0.0005:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e3:.1f} ms" if abs(s) < 1 else f"{s:.2f} s"


def table(results: list[RecipeResult]) -> str:
    """Markdown: per recipe the steady-state wait per batch, the producers'
    floor and the wait above it, the median, the first batch, the trainer's
    CPU per batch, the producers' memory (where measured) and (where tf.data
    ran) the speed-up over the tf.data recipe."""
    base = next((r for r in results if r.recipe == "tf.data" and r.waits_s), None)
    memory = any(r.producers_pss_mib is not None for r in results)
    head = ["recipe", "producers", "wait per batch", "floor", "above floor", "median wait", "first batch",
            "trainer CPU per batch"]
    head += (["producers' PSS"] if memory else []) + (["speed-up vs tf.data"] if base else [])
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.recipe} | - | skipped: {r.skipped} |" + " |" * (len(head) - 3))
            continue
        producers = str(r.producers)
        if r.recipe == "generator":
            producers = "- (the loop)"
        elif r.recipe == "tf.data":
            producers = "1 (a thread)"
        first = _fmt_s(r.first_batch_s) + (" (warm)" if r.warm_start else "")
        cells = [r.recipe, producers, _fmt_s(r.wait_s), _fmt_s(r.floor_s), _fmt_s(r.above_floor_s),
                 _fmt_s(r.median_s), first, _fmt_s(r.cpu_per_batch_s)]
        if memory:
            cells.append(_mib(r.producers_pss_mib))
        if base:
            cells.append(f"{base.wait_s / r.wait_s:.1f}x" if r.wait_s > 0 else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: list[RecipeResult], bound: list[RecipeResult] | None) -> list[str]:
    """A few sentences: what shmpipe buys on this machine, from the results."""

    def find(results: list[RecipeResult] | None, name: str) -> RecipeResult | None:
        return next((r for r in results or [] if r.recipe == name and r.waits_s), None)

    lines: list[str] = []
    parallel = [r for r in results if r.waits_s and r.recipe not in ("generator", "tf.data")]
    if parallel and parallel[0].floor_s > 0:
        waits = sorted(r.wait_s for r in parallel)
        lines.append(
            f"With {parallel[0].producers} producers the producers set the pace: no recipe can wait less than "
            f"the floor, {_fmt_s(parallel[0].floor_s)} per batch (the parallel recipes wait {_fmt_s(waits[0])} "
            f"to {_fmt_s(waits[-1])}); more producers lower it."
        )
    source = bound if bound else results
    shm = find(source, "shmpipe:shm")
    if shm is not None:
        others = [r for r in (find(source, "mp.Queue"), find(source, "ray.util.iter")) if r]
        lines.append(
            f"With {shm.producers} producers{' (enough to outpace the training step)' if bound else ''}, shmpipe "
            f"waits {_fmt_s(max(shm.above_floor_s, 0.0))} per batch above the floor (median wait "
            f"{_fmt_s(shm.median_s)}) and takes {_fmt_s(shm.cpu_per_batch_s)} of the trainer's CPU per batch"
            + "".join(
                f"; {r.recipe} {_fmt_s(max(r.above_floor_s, 0.0))} (median {_fmt_s(r.median_s)}) and "
                f"{_fmt_s(r.cpu_per_batch_s)}" for r in others
            )
            + "."
        )
    warm = [r.recipe for r in results if r.warm_start and "+prestart" not in r.recipe]
    for kind, what in _STARTS.items():
        if names := [n for n in warm if _started_by(n) == kind]:
            lines.append(f"First batches marked (warm): {', '.join(names)} ran on {what}, which a new job starts "
                         "in its first batch (the start-up recipes, @FRAMEWORK, each a script, measure shmpipe's).")
    for framework in STARTUP_FRAMEWORKS:
        ours, theirs = find(results, f"shmpipe:shm@{framework}"), find(results, f"torch.DataLoader@{framework}")
        early = find(results, f"shmpipe:shm+prestart@{framework}")
        if ours is not None and theirs is not None:
            lines.append(
                f"With `import {framework}` at the top of the training script, shmpipe's first batch came in "
                f"{_fmt_s(ours.first_batch_s)} with {_mib(ours.producers_pss_mib)} of producers' memory (PSS)"
                + (f" ({_fmt_s(early.first_batch_s)} with shmpipe.prestart() before the import)" if early else "")
                + f"; the DataLoader's in {_fmt_s(theirs.first_batch_s)} with {_mib(theirs.producers_pss_mib)}."
            )
    return lines


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} MiB"


@contextmanager
def one_ray(num_cpus: int, needed: bool) -> Iterator[float | None]:
    """One local Ray for every Ray recipe of the block (starting Ray takes
    seconds, ten or more on a busy machine: once, not once per recipe).
    Yields how long it took to start, or None where it was not started (not
    needed, not installed, or already running)."""
    if not needed or ray_util_iter_available() is not None and _why_not("shmpipe:ray") is not None:
        yield None
        return
    import ray

    from shmpipe.transports.ray import _away_from_a_checkout

    if ray.is_initialized():
        yield None
        return
    t0 = time.perf_counter()
    with _away_from_a_checkout():
        # address="local": a Ray of our own, even where another local one
        # runs (ray.init() would join it, and refuse num_cpus)
        ray.init(
            address="local", num_cpus=max(num_cpus, os.cpu_count() or 1), include_dashboard=False,
            log_to_driver=False,
        )
    try:
        yield time.perf_counter() - t0
    finally:
        ray.shutdown()


def plot(results: list[RecipeResult], path: str, title: str, bound: list[RecipeResult] | None = None,
         bound_title: str = "") -> None:
    """Bars of the steady-state wait per batch per recipe (log scale), the
    producers' floor as a black tick; a second panel for the transport-bound
    run when there is one."""
    from shmpipe.bench._report import pyplot

    plt = pyplot()
    panels = [(results, title)] + ([(bound, bound_title)] if bound else [])
    rows = sum(len([r for r in res if not r.skipped]) for res, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.45 * rows + 1.8 * len(panels)), squeeze=False)
    # One log scale for every panel, from 0.05 ms: bars of different runs
    # compare by length, and a bar's length means the same in each.
    longest = max((r.wait_s for res, _ in panels for r in res if r.waits_s and r.wait_s == r.wait_s), default=1.0)
    for ax, (res, name) in zip(axes[:, 0], panels, strict=True):
        done = [r for r in res if not r.skipped and r.waits_s]
        names = [r.recipe for r in done][::-1]
        waits = [max(r.wait_s, 1e-5) * 1e3 for r in done][::-1]
        floors = [r.floor_s * 1e3 for r in done][::-1]
        colors = ["#4C72B0" if n.startswith("shmpipe") else "#999999" for n in names]
        ax.barh(names, waits, color=colors)
        shown = [(f, n) for f, n in zip(floors, names, strict=True) if f > 0]
        if shown:
            ax.errorbar([f for f, _ in shown], [n for _, n in shown], fmt="|", color="black", markersize=14,
                        label="floor the producers allow")
            ax.legend(loc="best", fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(0.05, longest * 1e3 * 4)
        ax.set_xlabel("mean wait per batch once every producer has delivered, ms (log scale)")
        ax.set_title(name, fontsize=10)
        for y, m in enumerate(waits):
            ax.text(m, y, " " + _fmt_s(m / 1e3), va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
