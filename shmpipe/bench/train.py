"""End to end: how much faster does my training run?

A realistic Python input pipeline feeds a small CNN, and each way of running
that pipeline in parallel is timed where it matters: in the training loop.
The data are JPEG images of varying sizes (made with Pillow at start, kept
as bytes); each image is decoded with Pillow, randomly cropped, randomly
flipped and normalised in NumPy, and the images are batched. The trainer is
a small Keras model (model.fit), a small torch model (a plain training
loop) or the same model in JAX (a jitted step with optax; its recipes in
_train_jax.py). Recipes:

  keras:tf.data-generator   tf.data.Dataset.from_generator over the images,
                            .batch(), .prefetch(AUTOTUNE)
  keras:tf.data-py_function tf.data range().map(tf.py_function(...),
                            num_parallel_calls=AUTOTUNE), .batch(), .prefetch()
  keras:shmpipe             N shmpipe producers make batches; to_tf_dataset()
  keras:shmpipe+reserve     the same, decoding straight into a slot (reserve)
  torch:DataLoader          torch.utils.data.DataLoader(num_workers=N,
                            pin_memory where CUDA is)
  torch:shmpipe             N shmpipe producers; to_torch()
  torch:shmpipe+reserve     the same, decoding straight into a slot (reserve)
  jax:Grain                 grain.python.DataLoader(worker_count=N), Batch
  jax:tf.data               tf.data from_generator, .batch(), .prefetch(),
                            .as_numpy_iterator()
  jax:shmpipe               shmpipe.from_dataset(num_workers=N): N producers
                            fetch and collate the samples; to_jax()

Each recipe runs in a child process of its own, under a supervisor that
adds up the CPU time of every process of the recipe (the trainer, its
producers or workers, the forkserver) and samples their memory. Per recipe:
images/s (steady state: from the end of the first training step to the end
of the last), the share of that time the trainer was idle waiting for input,
CPU seconds per image (every process of the recipe, from building the input
pipeline to its exit: the producers' start-up and the model's first step
included, the trainer's imports and the reference steps after the run not),
peak memory (the sum of the proportional set sizes of all its processes,
sampled every 0.2 s, so shared memory counts once; and the trainer's own
peak RSS), and the first step as a training script meets it: the model is
not warmed up before the run, so the first step traces or compiles, while
the input pipeline starts; its end is timed from building the input
pipeline and from the trainer's start (its framework's import, the model,
the pipeline; the benchmark's JPEGs are made before that clock).

The idle fraction of a torch or JAX loop is measured: the time spent in
next() over the time of the steps (a JAX step blocks on its loss, so the
step's compute is not left to the next call). model.fit does not say how long it waited, so
for Keras it is estimated: 1 - (steps x one step on a batch already in
memory) / elapsed, clipped to [0, 1], with that reference step timed in the
same process just after the run. The estimate counts, beside the wait, any time the
trainer computed slower than it did alone (producers on the same cores,
other load): it is an upper bound on the wait. The JSON has both figures
for torch and JAX, which shows how far apart they are on the machine at hand.

The trainer computes with the cores the producers leave (--trainer-threads,
at least 1): on 2 cores with 2 producers, torch's default of one thread per
core made every torch step about ten times slower, whatever fed it.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench import _train_jax
from shmpipe.bench._report import fmt as _fmt
from shmpipe.bench._report import pyplot
from shmpipe.bench._train_common import (
    CLASSES,
    BatchSource,
    Images,
    TrainConfig,
    cpu_self,
    make_jpegs,
    reference,
    summary,
)
from shmpipe.errors import ShmpipeValueError

__all__ = ["TrainConfig", "RecipeResult", "RECIPES", "BASELINES", "Images", "make_jpegs", "run", "table", "plot"]

#: Recipe name -> what it is (the order is the table's).
RECIPES: dict[str, str] = {
    "keras:tf.data-generator": "tf.data from_generator, batch, prefetch(AUTOTUNE)",
    "keras:tf.data-py_function": "tf.data map(tf.py_function, num_parallel_calls=AUTOTUNE), batch, prefetch",
    "keras:shmpipe": "shmpipe producers, to_tf_dataset()",
    "keras:shmpipe+reserve": "shmpipe producers decoding into the slot (reserve), to_tf_dataset()",
    "torch:DataLoader": "torch DataLoader(num_workers=N)",
    "torch:shmpipe": "shmpipe producers, to_torch()",
    "torch:shmpipe+reserve": "shmpipe producers decoding into the slot (reserve), to_torch()",
    **_train_jax.RECIPES,
}
#: The baseline each recipe's speed-up is against: its trainer's usual input pipeline.
BASELINES = {"keras": "keras:tf.data-generator", "torch": "torch:DataLoader", "jax": _train_jax.BASELINE}

_SAMPLE_EVERY_S = 0.2


@dataclass
class RecipeResult:
    recipe: str
    images: int = 0  # counted by the trainer
    steps: int = 0
    images_per_s: float = float("nan")  # steady state (after the first step)
    idle_fraction: float = float("nan")
    idle_method: str = ""  # "measured" (time in next()) or "estimated" (see the module's doc)
    idle_measured: float | None = None
    idle_estimated: float = float("nan")
    reference_step_s: float = float("nan")
    first_step_s: float = float("nan")  # from building the input pipeline to the end of the first step
    from_start_s: float = float("nan")  # the first step's end from the trainer's start (its framework's import)
    window_s: float = float("nan")
    cpu_s: float = float("nan")  # every process of the recipe, from building the pipeline to exit, less reference steps
    cpu_s_per_image: float = float("nan")
    peak_pss_bytes: int = 0  # sum over the recipe's processes, sampled
    trainer_peak_rss_bytes: int = 0
    processes: int = 0  # the most seen at once
    made_by_trainer: int | None = None  # jax:shmpipe: batches from_dataset's trainer made while its producers started
    idle_producers: float | None = None  # jax:shmpipe: the idle fraction without those (waiting for producers only)
    runs_images_per_s: list[float] = field(default_factory=list)  # every run's, with repeat
    runs_idle_fraction: list[float] = field(default_factory=list)  # every run's, in the same order
    runs_made_by_trainer: list[int | None] = field(default_factory=list)  # jax:shmpipe: every run's
    skipped: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the recipes, run in the recipe's own process -------------------------------


def _keras_recipe(name: str, cfg: TrainConfig, images: Images, t_start: float) -> tuple[dict[str, Any], float]:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(cfg.threads)  # before TensorFlow starts its pools
    import keras  # type: ignore[import-untyped]

    keras.utils.set_random_seed(0)

    class ImageCount(keras.metrics.Metric):
        """How many images the trainer was given (a metric sees every batch)."""

        def __init__(self, name: str = "images", **kwargs: Any) -> None:
            super().__init__(name=name, **kwargs)
            self.count = self.add_variable(shape=(), initializer="zeros", dtype="int64", name="count")

        def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
            self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "int64"))

        def result(self) -> Any:
            return self.count

    class StepEnds(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.ends: list[float] = []
            self.counts: list[int] = []

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            self.ends.append(time.perf_counter())
            total = int((logs or {})["images"])
            self.counts.append(total - sum(self.counts))

    c = cfg.crop
    model = keras.Sequential([
        keras.Input((c, c, 3)),
        keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
        keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(CLASSES),
    ])
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=[ImageCount()]
    )
    x, y = images.batch(0)  # the reference's batch (made here: its decoding is not the run's CPU)
    cpu0, t0 = cpu_self(), time.perf_counter()
    image_spec = tf.TensorSpec((c, c, 3), tf.float32)
    pipe = None
    if name == "keras:tf.data-generator":
        ds = tf.data.Dataset.from_generator(
            lambda: iter(images), output_signature=(image_spec, tf.TensorSpec((), tf.int64))
        ).batch(cfg.batch_size).apply(tf.data.experimental.assert_cardinality(cfg.batches))
        ds = ds.prefetch(tf.data.AUTOTUNE)
    elif name == "keras:tf.data-py_function":

        def load(k: Any) -> tuple[np.ndarray, np.int64]:
            image, label = images[int(k)]
            return image, np.int64(label)

        def load_tf(k: Any) -> tuple[Any, Any]:
            image, label = tf.py_function(load, [k], [tf.float32, tf.int64])
            image.set_shape((c, c, 3))
            label.set_shape(())
            return image, label

        ds = tf.data.Dataset.range(cfg.images).map(load_tf, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.batch(cfg.batch_size).prefetch(tf.data.AUTOTUNE)
    else:
        reserve = name.endswith("+reserve")
        pipe = shmpipe.from_iterators([BatchSource(images, reserve)] * cfg.workers, timeout=cfg.timeout_s)
        ds = pipe.to_tf_dataset(batches_per_pass=cfg.batches)
    steps = StepEnds()
    try:
        model.fit(ds, epochs=1, verbose=0, callbacks=[steps])
    finally:
        if pipe is not None:
            pipe.close()
    # The reference, after the run: steps on one batch already in memory (a
    # new fit, so the count starts again; its first step, which may trace
    # again, is not timed).
    cpu_ref = cpu_self()
    ref = StepEnds()
    in_memory = tf.data.Dataset.from_tensors((x, y)).repeat(cfg.reference_steps + 1)
    model.fit(in_memory, epochs=1, verbose=0, callbacks=[ref])
    reference_step_s = float(np.median(np.diff(ref.ends)))
    return summary(name, steps.ends, steps.counts, t0, reference_step_s, None, t_start), cpu0 + cpu_self() - cpu_ref


def _torch_recipe(name: str, cfg: TrainConfig, images: Images, t_start: float) -> tuple[dict[str, Any], float]:
    import torch

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(
                torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(),
                torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
                torch.nn.Conv2d(32, 64, 3, stride=2), torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, CLASSES),
            )

        def forward(self, x: Any) -> Any:
            return self.layers(x.permute(0, 3, 1, 2))  # the batches are NHWC, as Keras's

    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    reference_batch = images.batch(0)  # (made here: its decoding is not the run's CPU)
    cpu0, t0 = cpu_self(), time.perf_counter()
    pipe = None
    loader: Any
    if name == "torch:DataLoader":
        loader = torch.utils.data.DataLoader(
            images, batch_size=cfg.batch_size, num_workers=cfg.workers, pin_memory=cuda
        )
    else:
        reserve = name.endswith("+reserve")
        pipe = shmpipe.from_iterators([BatchSource(images, reserve)] * cfg.workers, timeout=cfg.timeout_s)
        loader = pipe.to_torch(device=device if cuda else None, pin_memory=cuda)
    ends: list[float] = []
    counts: list[int] = []
    waits: list[float] = []
    try:
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t)
            step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            counts.append(len(y))
            del x, y  # let go of the slot before waiting for the next one
            ends.append(time.perf_counter())
        del it
    finally:
        if pipe is not None:
            pipe.close()
    x0, y0 = (torch.from_numpy(a).to(device) for a in reference_batch)
    reference_step_s, cpu_ref = reference(lambda: step(x0, y0), cfg.reference_steps)
    return summary(name, ends, counts, t0, reference_step_s, waits, t_start), cpu0 + cpu_ref


def _recipe_main() -> None:
    """The recipe's process: argv = [recipe, config JSON, result path]."""
    name, cfg = sys.argv[1], TrainConfig(**json.loads(sys.argv[2]))
    images = Images(make_jpegs(cfg), cfg)
    trainer = {"keras": _keras_recipe, "torch": _torch_recipe, "jax": _train_jax.run_recipe}[name.split(":")[0]]
    # The training script's start, as far as the recipe is one: the data in
    # memory (the benchmark's, made above), its framework not yet imported.
    summary, cpu_outside = trainer(name, cfg, images, time.perf_counter())
    summary["cpu_outside_s"] = cpu_outside
    summary["trainer_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(sys.argv[3]).write_text(json.dumps(summary))


# -- the supervisor: CPU and memory of every process of the recipe ---------------


def _children(pid: int) -> list[int]:
    if not _HAS_CHILDREN_FILES:  # a kernel without CONFIG_PROC_CHILDREN: every process's parent
        return [p for p, parent in _parents().items() if parent == pid]
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


_HAS_CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state
            except (OSError, IndexError, ValueError):
                pass
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(_children(p))
    return found


def _pss_bytes(pid: int) -> int:
    """The process's proportional set size (shared pages divided among
    the processes that map them); its RSS where smaps_rollup is missing."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _reap_all(deadline: float) -> None:
    """Waits for every descendant that was handed to this (subreaper)
    process, killing what is left at the deadline."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > deadline:
                for p in _descendants(os.getpid()):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                deadline = float("inf")
            time.sleep(0.05)


def _supervise_main() -> None:
    """argv = [recipe, config JSON, result path]. Runs the recipe's process,
    becomes the reaper of everything it leaves behind, and adds up their CPU
    (RUSAGE_CHILDREN counts every descendant once it is reaped)."""
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    name, config, out = sys.argv[1:4]
    timeout = float(json.loads(config)["timeout_s"])
    inner = out + ".recipe"
    with tempfile.TemporaryFile("w+") as log:
        code = "from shmpipe.bench.train import _recipe_main; _recipe_main()"
        proc = subprocess.Popen([sys.executable, "-c", code, name, config, inner], stdout=log, stderr=subprocess.STDOUT)
        peak, most = 0, 0
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            pids = _descendants(os.getpid())
            peak = max(peak, sum(_pss_bytes(p) for p in pids))
            most = max(most, len(pids))
            if time.monotonic() > deadline:
                proc.kill()
            time.sleep(_SAMPLE_EVERY_S)
        _reap_all(time.monotonic() + 60)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        result: dict[str, Any] = {"recipe": name, "peak_pss_bytes": peak, "processes": most}
        if proc.returncode == 0 and os.path.exists(inner):
            result.update(json.loads(Path(inner).read_text()))
            result["cpu_s"] = usage.ru_utime + usage.ru_stime - result.pop("cpu_outside_s")
            result["cpu_s_per_image"] = result["cpu_s"] / max(1, result["images"])
        else:
            log.seek(0)
            tail = log.read()[-3000:]
            why = "timed out" if time.monotonic() > deadline else f"exit status {proc.returncode}"
            result["error"] = f"{why}: {tail}"
    if os.path.exists(inner):
        os.unlink(inner)
    Path(out).write_text(json.dumps(result))


# -- the runner -------------------------------------------------------------------


def why_not(name: str) -> str | None:
    """None if the recipe can run here; else why not."""
    import importlib.util

    trainer = name.split(":")[0]
    need = {
        "keras": [("tensorflow", 'pip install "shmpipe[tensorflow]"')],
        "torch": [("torch", 'pip install "shmpipe[torch]"')],
    }
    modules = _train_jax.needs(name) if trainer == "jax" else need[trainer]
    for m, h in (*modules, ("PIL", "pip install pillow")):
        if importlib.util.find_spec(m) is None:
            return f"{m} is not installed ({h})"
    return None


def _environ() -> dict[str, str]:
    env = dict(os.environ)
    # TensorFlow's C++ start-up banner says nothing about this benchmark.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # The recipe imports this very shmpipe, wherever it was imported from.
    root = str(Path(shmpipe.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run_one(name: str, cfg: TrainConfig, out: str) -> RecipeResult:
    code = "from shmpipe.bench.train import _supervise_main; _supervise_main()"
    # A session of its own: the recipe's processes can be killed as a group
    # whatever happens here (a timeout, a Ctrl-C), and the terminal's Ctrl-C
    # reaches this process, not the middle of a measurement.
    sup = subprocess.Popen(
        [sys.executable, "-c", code, name, json.dumps(asdict(cfg)), out], env=_environ(), start_new_session=True
    )
    try:
        sup.wait(cfg.timeout_s + 120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(30)
    if not os.path.exists(out):
        return RecipeResult(name, error=f"its supervisor ended with status {sup.returncode}")
    data = json.loads(Path(out).read_text())
    known = set(RecipeResult.__dataclass_fields__)
    return RecipeResult(**{k: v for k, v in data.items() if k in known})


def run(
    cfg: TrainConfig,
    recipes: list[str] | None = None,
    progress: Callable[[str], None] | None = None,
    repeat: int = 1,
) -> list[RecipeResult]:
    """Runs each recipe in a process of its own, one after the other, and
    the whole round `repeat` times; returns per recipe the run with the
    median images/s (`runs_images_per_s` lists them all). A recipe that
    cannot run comes back with `skipped`, one that failed with `error`."""
    cfg.check()
    if repeat < 1:
        raise ShmpipeValueError(f"repeat must be at least 1, not {repeat}")
    names = list(RECIPES) if recipes is None else recipes
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise ShmpipeValueError(f"unknown recipes {unknown}; known: {', '.join(RECIPES)}")
    runs: dict[str, list[RecipeResult]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="shmpipe-bench-train-") as tmp:
        for round_no in range(repeat):  # rounds, not a recipe's runs in a row: a change of load hits all alike
            for i, name in enumerate(names):
                if progress:
                    progress(name if repeat == 1 else f"{name} ({round_no + 1}/{repeat})")
                why = why_not(name)
                if why is not None:
                    runs[name].append(RecipeResult(name, skipped=why))
                    continue
                runs[name].append(_run_one(name, cfg, os.path.join(tmp, f"{round_no}-{i}.json")))
    results = []
    for name in names:
        failed = [r for r in runs[name] if r.error or r.skipped]
        if failed:
            results.append(failed[0])
            continue
        ranked = sorted(runs[name], key=lambda r: r.images_per_s)
        median = ranked[(len(ranked) - 1) // 2]
        median.runs_images_per_s = [r.images_per_s for r in runs[name]]
        median.runs_idle_fraction = [r.idle_fraction for r in runs[name]]
        median.runs_made_by_trainer = [r.made_by_trainer for r in runs[name]]
        results.append(median)
    return results


# -- the report ---------------------------------------------------------------------


def table(results: list[RecipeResult]) -> str:
    """Markdown: per recipe images/s, the speed-up over its trainer's usual
    input pipeline, the trainer's idle fraction, CPU per image and memory."""
    by_name = {r.recipe: r for r in results}
    lines = [
        "| trainer | input pipeline | images/s | speed-up | trainer idle | CPU ms/image | peak memory, all processes "
        "| trainer peak RSS | first step: from the input pipeline | from the start |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        trainer, loader = r.recipe.split(":", 1)
        if r.skipped or r.error:
            what = f"skipped: {r.skipped}" if r.skipped else f"failed: {(r.error or '').splitlines()[0]}"
            lines.append(f"| {trainer} | {loader} | {what} | | | | | | | |")
            continue
        base = by_name.get(BASELINES[trainer])
        ok = base is not None and not base.error and not base.skipped and base.images_per_s > 0
        speedup = f"{r.images_per_s / base.images_per_s:.2f}x" if ok and base else "-"
        idle = _fmt(r.idle_fraction, ".0%") + ("" if r.idle_method == "measured" else " (est.)")
        lines.append(
            f"| {trainer} | {loader} | {_fmt(r.images_per_s, ',.0f')} | {speedup} | {idle} | "
            f"{_fmt(r.cpu_s_per_image * 1e3, '.2f')} | {r.peak_pss_bytes / 2**20:,.0f} MiB | "
            f"{r.trainer_peak_rss_bytes / 2**20:,.0f} MiB | {_fmt(r.first_step_s, '.2f')} s | "
            f"{_fmt(r.from_start_s, '.2f')} s |"
        )
    return "\n".join(lines)


def plot(results: list[RecipeResult], path: str, title: str) -> None:
    """Bars of images/s per recipe, each labelled with the trainer's idle fraction."""
    plt = pyplot()
    done = [r for r in results if not r.skipped and not r.error]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(done) + 1.6))
    names = [r.recipe for r in done][::-1]
    rates = [r.images_per_s for r in done][::-1]
    colors = ["#4C72B0" if "shmpipe" in n else "#999999" for n in names]
    ax.barh(names, rates, color=colors)
    spread = [(r.images_per_s - min(r.runs_images_per_s), max(r.runs_images_per_s) - r.images_per_s)
              if len(r.runs_images_per_s) > 1 else (0.0, 0.0) for r in done][::-1]
    if any(lo or hi for lo, hi in spread):  # with repeat: the slowest and fastest run
        ax.errorbar(rates, names, xerr=list(zip(*spread, strict=True)), fmt="none", ecolor="black", capsize=3)
    for y, r in enumerate(done[::-1]):
        est = "" if r.idle_method == "measured" else " est."
        label = f" {r.images_per_s:,.0f}/s, idle {r.idle_fraction:.0%}{est}"
        ax.text(max(r.runs_images_per_s or [r.images_per_s]), y, label, va="center", fontsize=8)
    ax.set_xlabel("images/s into the trainer (steady state; bar: median run, whisker: slowest and fastest)")
    ax.set_xlim(0, max((max(r.runs_images_per_s or [r.images_per_s]) for r in done), default=1) * 1.35)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

