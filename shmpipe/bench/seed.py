"""The article's experiment: how long does a training loop wait for its next batch?

A data generator simulates fetching (a sleep) and computing (a busy loop,
then drawing the arrays), and yields (sample, target) batches, by default
float32 arrays of shape (4, 1000000, 3) (48 MB) and (4, 1). The consumer
simulates a training step with a sleep and measures how long it waits for
each batch. Recipes:

  generator          the plain generator, in the training process
  tf.data            tf.data.Dataset.from_generator(...).prefetch(AUTOTUNE)
  mp.Queue           cpu_count() processes putting batches on a
                     multiprocessing.Queue(cpu_count() * 2), as the article writes it
  ray.util.iter      ray.util.iter.from_iterators([gen] * n).gather_async()
  shmpipe:<name>     shmpipe.from_iterators([gen] * n, transport=<name>), every
                     available transport
  shmpipe:shm+reserve  shmpipe producers that draw the arrays straight into a slot

Each recipe runs in this process, one after the other, so they compare on
the same machine in the same minute.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench._report import process_context, pyplot

__all__ = ["SeedConfig", "RecipeResult", "available_recipes", "run", "table", "plot"]

#: A batch: (sample, target).
Batch = tuple[np.ndarray, np.ndarray]
#: Called after each batch the consumer took (run() counts them).
OnBatch = Callable[[], None]
#: run()'s progress callback: (recipe, None) when it is skipped, (recipe, 0)
#: when it starts, (recipe, 1) after each batch.
OnProgress = Callable[[str, int | None], None]


@dataclass(frozen=True)
class SeedConfig:
    workers: int = field(default_factory=lambda: multiprocessing.cpu_count())
    batches: int = 10  # per producer (the plain generator and tf.data make this many)
    shape: tuple[int, ...] = (4, 1000000, 3)
    target_shape: tuple[int, ...] = (4, 1)
    fetch_s: float = 0.5
    compute_s: float = 0.0  # busy loop, beside drawing the random arrays
    train_s: float = 0.1


@dataclass
class RecipeResult:
    recipe: str
    producers: int
    waits_s: list[float]
    first_batch_s: float
    total_s: float
    skipped: str | None = None

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
        d.update(mean_s=self.mean_s, median_s=self.median_s, p99_s=self.p99_s, stall_fraction=self.stall_fraction)
        return d


#: A recipe: runs the experiment with a config, calling on_batch after each batch.
Recipe = Callable[[SeedConfig, OnBatch | None], RecipeResult]


# -- the data generator (top level: producer processes unpickle it) -----------


class DataGenerator:
    """The article's data_generator, with its costs as parameters."""

    def __init__(self, cfg: SeedConfig, reserve: bool = False) -> None:
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
                yield batch
            else:
                yield (
                    rng.random(cfg.shape, dtype=np.float32),
                    rng.random(cfg.target_shape, dtype=np.float32),
                )


def _article_producer(q: multiprocessing.Queue[Batch | str], cfg: SeedConfig) -> None:
    for batch in DataGenerator(cfg)():
        q.put(batch)
    q.put("DONE")


# -- the recipes ----------------------------------------------------------------


def _measure(
    name: str, producers: int, cfg: SeedConfig, make_iter: Callable[[], Iterator[Any]], on_batch: OnBatch | None = None
) -> RecipeResult:
    """Times the consumer's wait for each batch of iterator make_iter()."""
    t_start = time.perf_counter()
    it = make_iter()
    waits: list[float] = []
    first: float | None = None
    st = time.perf_counter()
    for batch in it:
        en = time.perf_counter()
        waits.append(en - st)
        if first is None:
            first = en - t_start
        float(np.asarray(batch[0]).flat[0])  # look at the batch
        del batch
        if on_batch:
            on_batch()
        time.sleep(cfg.train_s)  # the training step
        st = time.perf_counter()
    total = time.perf_counter() - t_start
    return RecipeResult(name, producers, waits, first or 0.0, total)


def recipe_generator(cfg: SeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
    return _measure("generator", 0, cfg, lambda: iter(DataGenerator(cfg)()), on_batch)


def recipe_tf_data(cfg: SeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
    import tensorflow as tf

    def make() -> Iterator[Any]:
        ds = tf.data.Dataset.from_generator(
            DataGenerator(cfg),
            output_signature=(tf.TensorSpec(cfg.shape, tf.float32), tf.TensorSpec(cfg.target_shape, tf.float32)),
        ).prefetch(tf.data.experimental.AUTOTUNE)
        return iter(ds)

    return _measure("tf.data", 0, cfg, make, on_batch)


def recipe_mp_queue(cfg: SeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
    """The article's multiprocessing recipe (its queue.join() aside, which
    multiprocessing.Queue does not have)."""
    n = cfg.workers
    ctx = process_context()
    procs: list[multiprocessing.process.BaseProcess] = []

    def make() -> Iterator[Batch]:
        q: multiprocessing.Queue[Batch | str] = ctx.Queue(n * 2)
        for _ in range(n):
            p = ctx.Process(target=_article_producer, args=(q, cfg), daemon=True)
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


def recipe_ray_util_iter(cfg: SeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
    import ray
    import ray.util.iter

    from shmpipe.transports.ray import _away_from_a_checkout

    n = cfg.workers
    started = not ray.is_initialized()

    def make() -> Iterator[Any]:  # Ray's start-up counts towards the first batch, as the article's
        if started:
            with _away_from_a_checkout():
                ray.init(num_cpus=max(n, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
        return iter(ray.util.iter.from_iterators([DataGenerator(cfg)] * n).gather_async())

    try:
        return _measure("ray.util.iter", n, cfg, make, on_batch)
    finally:
        if started:
            ray.shutdown()


def recipe_shmpipe(transport: str, reserve: bool = False) -> Recipe:
    def run_recipe(cfg: SeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
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
    return recipes


def _why_not(name: str) -> str | None:
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


def run(cfg: SeedConfig, recipes: list[str] | None = None, progress: OnProgress | None = None) -> list[RecipeResult]:
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
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def table(results: list[RecipeResult]) -> str:
    """Markdown: per recipe the waits, time to first batch, stall fraction
    and speed-up over the article's tf.data recipe."""
    base = next((r for r in results if r.recipe == "tf.data" and r.waits_s), None)
    lines = [
        "| recipe | producers | mean wait | median wait | p99 wait | first batch | stall fraction "
        "| speed-up vs tf.data |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.recipe} | - | skipped: {r.skipped} | | | | | |")
            continue
        speedup = f"{base.mean_s / r.mean_s:.1f}x" if base and r.mean_s > 0 else "-"
        lines.append(
            f"| {r.recipe} | {r.producers or '-'} | {_fmt_s(r.mean_s)} | {_fmt_s(r.median_s)} | {_fmt_s(r.p99_s)} | "
            f"{_fmt_s(r.first_batch_s)} | {r.stall_fraction:.0%} | {speedup} |"
        )
    return "\n".join(lines)


def plot(results: list[RecipeResult], path: str, title: str) -> None:
    """A bar chart of the mean wait per recipe (log scale), p99 as a whisker."""
    plt = pyplot()
    done = [r for r in results if not r.skipped]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(done) + 1.6))
    names = [r.recipe for r in done][::-1]
    means = [max(r.mean_s, 1e-6) * 1e3 for r in done][::-1]
    p99 = [max(r.p99_s, 1e-6) * 1e3 for r in done][::-1]
    colors = ["#4C72B0" if n.startswith("shmpipe") else "#999999" for n in names]
    ax.barh(names, means, color=colors)
    ax.errorbar(p99, names, fmt="|", color="black", markersize=12, label="p99")
    ax.set_xscale("log")
    ax.set_xlabel("wait for the next batch, ms (bar: mean; tick: p99; log scale)")
    ax.set_title(title)
    for y, m in enumerate(means):
        ax.text(m, y, f" {m:.2f} ms", va="center", fontsize=8)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
