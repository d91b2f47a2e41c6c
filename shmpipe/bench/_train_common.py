"""What every recipe of ``shmpipe bench train`` shares: its settings, the
JPEG workload (at the top level of a module that imports no framework:
producer and worker processes unpickle it) and what a recipe's process
measures. shmpipe/bench/train.py runs the recipes; the JAX recipes are in
shmpipe/bench/_train_jax.py, which imports this module and not train.py
(train.py imports it to list its recipes)."""

from __future__ import annotations

import io
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import shmpipe
from shmpipe.errors import ShmpipeValueError

__all__ = [
    "CLASSES", "BatchSource", "Images", "TrainConfig", "augment_into", "cpu_self", "make_jpegs", "reference", "summary",
]

_MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
_STD = np.array([0.229, 0.224, 0.225], np.float32) * 255
CLASSES = 10


@dataclass(frozen=True)
class TrainConfig:
    images: int = 4800  # per recipe: the trainer sees exactly this many
    batch_size: int = 32
    workers: int = 2  # shmpipe producers, DataLoader workers
    crop: int = 64  # random crop, crop x crop pixels
    min_side: int = 96  # image sides drawn from [min_side, max_side]
    max_side: int = 224
    distinct: int = 256  # distinct JPEGs made at start (the stream cycles through them)
    reference_steps: int = 20  # steps on a batch in memory, after the run, for the Keras idle estimate
    trainer_threads: int = 0  # the trainer's compute threads; 0: the cores the producers leave, at least 1
    timeout_s: float = 900.0  # per recipe, then it is killed

    def check(self) -> None:
        if self.images < 2 * self.batch_size:
            raise ShmpipeValueError(f"images ({self.images}) must be at least two batches ({2 * self.batch_size})")
        if min(self.batch_size, self.workers, self.distinct, self.reference_steps) < 1:
            raise ShmpipeValueError("batch_size, workers, distinct and reference_steps must be at least 1")
        if not 8 <= self.crop <= self.min_side <= self.max_side:
            raise ShmpipeValueError(f"need 8 <= crop ({self.crop}) <= min_side ({self.min_side}) <= max_side")

    @property
    def threads(self) -> int:
        return self.trainer_threads or max(1, (os.cpu_count() or 1) - self.workers)

    @property
    def batches(self) -> int:
        return -(-self.images // self.batch_size)



# -- the input pipeline (top level: producer processes unpickle it) ------------


def make_jpegs(cfg: TrainConfig, seed: int = 0) -> list[bytes]:
    """cfg.distinct JPEGs of random sizes: smooth colour fields with a
    little noise (compressing like photographs, not like pure noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(cfg.distinct):
        h, w = (int(s) for s in rng.integers(cfg.min_side, cfg.max_side + 1, size=2))
        coarse = rng.integers(0, 256, size=(h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
        img = np.clip(img + rng.integers(-12, 13, size=img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def augment_into(jpeg: bytes, k: int, crop: int, out: np.ndarray) -> None:
    """Decodes one JPEG, crops a random crop x crop window, flips it at
    random and writes it normalised (float32) into out. Image k of the
    stream draws the same crop and flip in every recipe."""
    from PIL import Image

    rng = np.random.default_rng(k)
    with Image.open(io.BytesIO(jpeg)) as im:
        pixels = np.asarray(im.convert("RGB"))
    h, w = pixels.shape[:2]
    y, x = int(rng.integers(0, h - crop + 1)), int(rng.integers(0, w - crop + 1))
    window = pixels[y : y + crop, x : x + crop]
    if rng.random() < 0.5:
        window = window[:, ::-1]
    np.subtract(window, _MEAN, out=out, dtype=np.float32)
    out /= _STD


class Images:
    """The stream of (image, label) samples: image k is JPEG k % distinct."""

    def __init__(self, jpegs: list[bytes], cfg: TrainConfig) -> None:
        self.jpegs, self.cfg = jpegs, cfg

    def __len__(self) -> int:
        return self.cfg.images

    def __getitem__(self, k: int) -> tuple[np.ndarray, int]:
        if not 0 <= k < self.cfg.images:
            raise IndexError(k)
        image = np.empty((self.cfg.crop, self.cfg.crop, 3), np.float32)
        augment_into(self.jpegs[k % len(self.jpegs)], k, self.cfg.crop, image)
        return image, k % CLASSES

    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        return (self[k] for k in range(len(self)))

    def batch(self, b: int, reserve: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Batch b: images [b * batch_size, ...) stacked, and their labels;
        with reserve, written straight into a free slot of the ring."""
        cfg = self.cfg
        ks = range(b * cfg.batch_size, min((b + 1) * cfg.batch_size, cfg.images))
        shape = (len(ks), cfg.crop, cfg.crop, 3)
        if reserve:
            spec = (shmpipe.ArraySpec(shape, np.float32), shmpipe.ArraySpec((len(ks),), np.int64))
            images, labels = shmpipe.reserve(spec)
        else:
            images, labels = np.empty(shape, np.float32), np.empty(len(ks), np.int64)
        for i, k in enumerate(ks):
            augment_into(self.jpegs[k % len(self.jpegs)], k, cfg.crop, images[i])
            labels[i] = k % CLASSES
        return images, labels


class BatchSource:
    """A shmpipe source: worker i of n makes batches i, i + n, i + 2n, ..."""

    def __init__(self, images: Images, reserve: bool) -> None:
        self.images, self.reserve = images, reserve

    def __call__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        info = shmpipe.get_worker_info()
        assert info is not None  # called in a producer
        for b in range(info.id, self.images.cfg.batches, info.num_workers):
            yield self.images.batch(b, self.reserve)



# -- what a recipe's process measures ----------------------------------------------


def cpu_self() -> float:
    """CPU seconds of this process so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def reference(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """The reference step, timed after the recipe's run (so that its first
    step meets the model as a training script's does, compiling or
    tracing): `steps` + 1 steps on a batch already in memory, the first
    not timed. Returns (the median step, the CPU seconds the reference
    took: the recipe's CPU leaves them out)."""
    cpu = cpu_self()
    ends = []
    for _ in range(steps + 1):
        step()
        ends.append(time.perf_counter())
    return float(np.median(np.diff(ends))), cpu_self() - cpu


def summary(
    name: str, step_ends: list[float], counts: list[int], t0: float, reference_step_s: float,
    waits: list[float] | None, t_start: float,
) -> dict[str, Any]:
    """A recipe's figures from its steps' end times and image counts (see
    train.py's doc): t0, when it began building its input pipeline;
    t_start, when its trainer began (before it imported its framework);
    waits, the time each next() took, where the loop can measure it."""
    window = step_ends[-1] - step_ends[0]
    steps = len(step_ends)
    estimated = min(1.0, max(0.0, 1.0 - reference_step_s * (steps - 1) / window)) if window > 0 else float("nan")
    measured = sum(waits[1:]) / window if waits is not None and window > 0 else None
    return {
        "recipe": name,
        "images": sum(counts),
        "steps": steps,
        "images_per_s": (sum(counts) - counts[0]) / window if window > 0 else float("nan"),
        "idle_measured": measured,
        "idle_estimated": estimated,
        "idle_fraction": measured if measured is not None else estimated,
        "idle_method": "measured" if measured is not None else "estimated",
        "reference_step_s": reference_step_s,
        "first_step_s": step_ends[0] - t0,
        "from_start_s": step_ends[0] - t_start,
        "window_s": window,
    }
