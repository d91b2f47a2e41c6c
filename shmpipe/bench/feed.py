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
                     imports cost a producer; the summary gives their first
                     batch from the script's first line too (every import
                     inside: what a user waits for from `python train.py`)
  shmpipe:shm+prestart@FRAMEWORK
                     the same script calling shmpipe.prestart() before its
                     `import FRAMEWORK`: shmpipe's fork server starts while
                     the script imports, so the table's first batch (from
                     the loader's making) is warm; from the script's start,
                     it shows what that overlap saves

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
import math
import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import shmpipe
from shmpipe.bench._feed_measure import (
    _STARTS,
    RAY_RECIPES,
    Batch,
    DataGenerator,
    FeedConfig,
    OnBatch,
    OnProgress,
    Recipe,
    RecipeResult,
    _measure,
    _started_by,
    wait_floor,
)
from shmpipe.bench._feed_startup import STARTUP_FRAMEWORKS, recipe_script, run_in_script

__all__ = [
    "FeedConfig", "RecipeResult", "available_recipes", "run", "table", "plot", "summary", "transport_bound",
    "wait_floor", "one_ray", "STARTUP_FRAMEWORKS", "RAY_RECIPES", "run_in_script",
]


def transport_bound(cfg: FeedConfig, batches: int = 4) -> FeedConfig:
    """`cfg` with enough producers that they make batches 1.5 times as fast as
    the loop takes them (8 at the default 0.5 s fetch and 0.1 s step):
    every millisecond of wait above the floor is then the transport's."""
    workers = math.ceil(1.5 * cfg.produce_s / cfg.train_s) if cfg.train_s > 0 else 2 * cfg.workers
    return dataclasses.replace(cfg, workers=max(workers, cfg.workers, 2), batches=batches)


def _queue_producer(q: multiprocessing.Queue[Batch | str], cfg: FeedConfig) -> None:
    for batch in DataGenerator(cfg)():
        q.put(batch)
    q.put("DONE")


# -- the recipes ----------------------------------------------------------------


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
                f"{_fmt_s(ours.first_batch_s)}, {_since_start(ours)}, with {_mib(ours.producers_pss_mib)} of "
                "producers' memory (PSS)"
                + (f" ({_fmt_s(early.first_batch_s)}, {_since_start(early)}, with shmpipe.prestart() before the "
                   "import)" if early else "")
                + f"; the DataLoader's in {_fmt_s(theirs.first_batch_s)}, {_since_start(theirs)}, with "
                f"{_mib(theirs.producers_pss_mib)}."
            )
    return lines


def _since_start(r: RecipeResult) -> str:
    """A start-up recipe's first batch from its script's first line."""
    return "-" if r.from_start_s is None else f"{_fmt_s(r.from_start_s)} from the script's start"


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
