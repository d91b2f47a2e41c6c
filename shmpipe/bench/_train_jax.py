"""The JAX recipes of ``shmpipe bench train``: the same JPEG workload
(shmpipe/bench/_train_common.py) into one jitted JAX training step, fed
three ways:

  jax:Grain     grain.python.DataLoader over the map-style dataset
                (IndexSampler in order, worker_count=N, Batch): JAX's own
                loader, its NumPy batches passed to the step
  jax:tf.data   tf.data from_generator, batch, prefetch(AUTOTUNE),
                as_numpy_iterator(): NumPy batches passed to the step
  jax:shmpipe   shmpipe.from_dataset(dataset, num_workers=N), to_jax():
                batches already jax.Arrays, put on the device ahead by
                to_jax's thread

The model is the Keras and torch recipes' CNN (three strided 3x3
convolutions of 16, 32 and 64 channels, a global average pooling, a dense
layer) written in plain jax.lax, trained with optax's Adam. Each step
blocks on its loss (a jitted call returns before it has computed), so the
time in next() is the trainer's wait for input and nothing else; the wait
is measured, as in the torch loop.

train.py lists these recipes (RECIPES, BASELINE, needs) and runs run_recipe
in the recipe's process; nothing here imports JAX, Grain or TensorFlow at
import time.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench._resume_loaders import grain_flags_parsed
from shmpipe.bench._train_common import CLASSES, Images, TrainConfig, cpu_self, reference, summary

__all__ = ["BASELINE", "RECIPES", "needs", "run_recipe"]

#: Recipe name -> what it is (the order is the table's; the baseline first).
RECIPES: dict[str, str] = {
    "jax:Grain": "grain.python DataLoader(worker_count=N), Batch; NumPy batches into the jitted step",
    "jax:tf.data": "tf.data from_generator, batch, prefetch(AUTOTUNE), as_numpy_iterator()",
    "jax:shmpipe": "shmpipe.from_dataset(num_workers=N), to_jax()",
}
#: A JAX user's usual loader.
BASELINE = "jax:Grain"


def needs(name: str) -> list[tuple[str, str]]:
    """The modules the recipe imports, each with how to install it."""
    out = [("jax", 'pip install "shmpipe[jax]"'), ("optax", "pip install optax")]
    if name == "jax:Grain":
        out.append(("grain", "pip install grain"))
    elif name == "jax:tf.data":
        out.append(("tensorflow", 'pip install "shmpipe[tensorflow]"'))
    return out


def _xla_flags(threads: int) -> str:
    """XLA_FLAGS that hold the CPU backend's compute to `threads` threads
    (as the Keras and torch trainers are held), kept beside whatever flags
    the caller set. Read by jax at its import, so set before it."""
    ours = f"--xla_cpu_multi_thread_eigen={'false' if threads == 1 else 'true'} intra_op_parallelism_threads={threads}"
    return " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), ours]))


def _model(cfg: TrainConfig) -> tuple[Any, Any, Callable[..., Any]]:
    """(params, optimizer state, step): step(params, state, x, y) ->
    (params, state, loss), jitted, x NHWC float32, y integer labels."""
    import jax
    import jax.numpy as jnp
    import optax  # type: ignore[import-untyped, unused-ignore]

    keys = jax.random.split(jax.random.key(0), 4)

    def conv(key: Any, c_in: int, c_out: int) -> tuple[Any, Any]:
        # He initialisation, as for a ReLU layer
        return jax.random.normal(key, (3, 3, c_in, c_out)) * np.sqrt(2 / (9 * c_in)), jnp.zeros(c_out)

    params = {
        "conv1": conv(keys[0], 3, 16), "conv2": conv(keys[1], 16, 32), "conv3": conv(keys[2], 32, 64),
        "dense": (jax.random.normal(keys[3], (64, CLASSES)) / 8, jnp.zeros(CLASSES)),
    }

    def logits(p: Any, x: Any) -> Any:
        for layer in ("conv1", "conv2", "conv3"):
            w, b = p[layer]
            x = jax.lax.conv_general_dilated(x, w, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jax.nn.relu(x + b)
        w, b = p["dense"]
        return x.mean(axis=(1, 2)) @ w + b

    optimizer = optax.adam(1e-3)

    def step(p: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        def loss_fn(p: Any) -> Any:
            return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    # donate the old parameters and state: the step updates them in place
    return params, optimizer.init(params), jax.jit(step, donate_argnums=(0, 1))


def _open(name: str, cfg: TrainConfig, images: Images) -> tuple[Iterator[Any], Callable[[], None], Any]:
    """(the recipe's batches, how to stop its loader, shmpipe's pipeline or None)."""
    if name == "jax:shmpipe":
        pipe = shmpipe.from_dataset(images, batch_size=cfg.batch_size, num_workers=cfg.workers, timeout=cfg.timeout_s)
        try:
            return iter(pipe.to_jax()), pipe.close, pipe
        except BaseException:
            pipe.close()
            raise
    if name == "jax:Grain":
        grain = importlib.import_module("grain.python")
        grain_flags_parsed()  # else Grain's iterator fails where jax is installed
        sampler = grain.IndexSampler(len(images), shard_options=grain.NoSharding(), shuffle=False, num_epochs=1, seed=0)
        loader = grain.DataLoader(data_source=images, sampler=sampler, worker_count=cfg.workers,
                                  operations=[grain.Batch(cfg.batch_size, drop_remainder=False)])
        it = iter(loader)
        inner = getattr(it, "_iterator", None)  # Grain 0.2's iterator has no close(); the one it wraps has
        return it, getattr(inner, "close", lambda: None), None
    import tensorflow as tf

    c = cfg.crop
    spec = (tf.TensorSpec((c, c, 3), tf.float32), tf.TensorSpec((), tf.int64))
    ds = tf.data.Dataset.from_generator(lambda: iter(images), output_signature=spec)
    return ds.batch(cfg.batch_size).prefetch(tf.data.AUTOTUNE).as_numpy_iterator(), lambda: None, None


def run_recipe(name: str, cfg: TrainConfig, images: Images, t_start: float) -> tuple[dict[str, Any], float]:
    """Trains on every image once; returns (the recipe's figures, this
    process's CPU seconds outside the run: before it built its input
    pipeline, and the reference steps after it). t_start: the trainer's
    start, before it imports JAX."""
    os.environ["XLA_FLAGS"] = _xla_flags(cfg.threads)
    if name == "jax:tf.data":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(cfg.threads)  # before TensorFlow starts its pools
    import jax

    params, state, step = _model(cfg)
    reference_batch = images.batch(0)  # (made here: its decoding is not the run's CPU)

    cpu0, t0 = cpu_self(), time.perf_counter()
    batches, close, pipe = _open(name, cfg, images)
    ends: list[float] = []
    counts: list[int] = []
    waits: list[float] = []
    try:
        while True:
            t = time.perf_counter()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t)
            params, state, loss = step(params, state, x, y)
            loss.block_until_ready()
            counts.append(int(y.shape[0]))
            del x, y  # shmpipe: let go of the slot before waiting for the next one
            ends.append(time.perf_counter())
        del batches
        # from_dataset's trainer fetches and collates the first batches of a
        # pass itself while its producers start (fetch_while_starting): that
        # time is in its next(), so in the wait; how much, the JSON says.
        made = int(pipe.stats().extra.get("made_by_trainer", 0)) if pipe is not None else 0
    finally:
        close()
    # The reference, after the run (its first step, which compiles, is in the
    # run, as a training script's is): steps on a batch already on the device.
    x0, y0 = jax.device_put(reference_batch)

    def one_step() -> None:
        nonlocal params, state
        params, state, loss = step(params, state, x0, y0)
        loss.block_until_ready()

    reference_step_s, cpu_ref = reference(one_step, cfg.reference_steps)
    out = summary(name, ends, counts, t0, reference_step_s, waits, t_start)
    if pipe is not None and out["window_s"] > 0:
        out["made_by_trainer"] = made
        out["idle_producers"] = sum(waits[max(1, made):]) / out["window_s"]  # waiting for the producers' batches
    return out, cpu0 + cpu_ref
