"""The trainer's CPU per batch for ``to_jax()`` against ``to_torch()`` on the
same batches, on the CPU backend, in one run (the target: to_jax at
most 2x to_torch, no hidden copy).

    python benchmarks/jax_cpu_cost.py                  # 64 images of 64x64x3 + labels
    python benchmarks/jax_cpu_cost.py --image 224 --batch 32 --json out.json

Each round runs one pass of each of: the plain pipeline (NumPy batches),
``to_torch()`` and ``to_jax()``, in turn, on one pipeline whose producers
fill batches in place (``shmpipe.reserve``), so the trainer only takes
batches and converts them. What is measured is the trainer process's CPU
time (``time.process_time``: every thread of it, JAX's included) per
batch, and the wall time; the report gives each one's median over the
rounds, the ratio to_jax / to_torch, and what each adapter adds to the
plain pipeline. ``measure()`` is the same, for another script to call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

import shmpipe

KINDS = ("numpy", "torch", "jax")


class ImageBatches:
    """n batches {"image": uint8 (batch, size, size, 3), "label": int32
    (batch,)} made in the slot (shmpipe.reserve): the producers cost little,
    so the trainer's side is what the run measures."""

    def __init__(self, n: int, batch: int, size: int) -> None:
        self.n, self.batch, self.size = n, batch, size

    def __call__(self) -> Iterator[dict[str, Any]]:
        spec = {
            "image": shmpipe.ArraySpec((self.batch, self.size, self.size, 3), np.uint8),
            "label": shmpipe.ArraySpec((self.batch,), np.int32),
        }
        for i in range(self.n):
            b = shmpipe.reserve(spec)
            b["image"][0, 0, 0, 0] = i % 251
            b["label"][:] = i
            yield b


def _one_pass(pipe: Any, kind: str, jax_batches: Any, torch_batches: Any) -> tuple[int, float, float]:
    """(batches, CPU seconds, wall seconds) of one pass of `kind`."""
    source: Any = {"numpy": pipe, "torch": torch_batches, "jax": jax_batches}[kind]
    n = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for batch in source:
        n += 1
        del batch
    return n, time.process_time() - c0, time.perf_counter() - t0


def measure(
    batches: int = 400, batch: int = 64, size: int = 64, workers: int = 2, rounds: int = 5
) -> dict[str, Any]:
    """Runs the rounds; returns the settings, each kind's median µs per batch
    (CPU and wall) and the ratios (see the module doc)."""
    import jax
    import torch

    per_worker = max(1, batches // workers)
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    wall: dict[str, list[float]] = {k: [] for k in KINDS}
    with warnings.catch_warnings():
        # torch's one-time note that the batches' arrays are read-only
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        with shmpipe.from_iterators([ImageBatches(per_worker, batch, size)] * workers, timeout=120) as pipe:
            jax_batches, torch_batches = pipe.to_jax(), pipe.to_torch()
            for kind in KINDS:  # a first pass of each: the ring's pages, JAX's and torch's first calls
                _one_pass(pipe, kind, jax_batches, torch_batches)
            for _ in range(rounds):
                for kind in KINDS:
                    n, c, w = _one_pass(pipe, kind, jax_batches, torch_batches)
                    cpu[kind].append(c / n * 1e6)
                    wall[kind].append(w / n * 1e6)
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    return {
        "settings": {
            "batches_per_pass": per_worker * workers, "batch": batch, "image": size, "workers": workers,
            "rounds": rounds, "batch_bytes": batch * size * size * 3 + batch * 4,
            "jax": jax.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "cpus": os.cpu_count(),
        },
        "cpu_us_per_batch": med_cpu,
        "wall_us_per_batch": med_wall,
        "cpu_us_per_batch_rounds": cpu,
        "ratio_jax_to_torch": med_cpu["jax"] / med_cpu["torch"],
        "added_us": {"torch": med_cpu["torch"] - med_cpu["numpy"], "jax": med_cpu["jax"] - med_cpu["numpy"]},
    }


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"{s['batches_per_pass']} batches a pass of {s['batch']} images {s['image']}x{s['image']}x3 uint8 + int32 "
        f"labels ({s['batch_bytes']:,} bytes), {s['workers']} producers, {s['rounds']} rounds; jax {s['jax']}, "
        f"torch {s['torch']}, {s['cpus']} CPUs",
        f"{'':<10}{'CPU µs/batch':>14}{'wall µs/batch':>15}{'added to numpy':>16}",
    ]
    for kind in KINDS:
        added = "" if kind == "numpy" else f"{result['added_us'][kind]:.1f}"
        lines.append(
            f"{kind:<10}{result['cpu_us_per_batch'][kind]:>14.1f}{result['wall_us_per_batch'][kind]:>15.1f}{added:>16}"
        )
    lines.append(f"to_jax / to_torch, CPU per batch: {result['ratio_jax_to_torch']:.2f}x (target <= 2x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=400, help="batches a pass")
    parser.add_argument("--batch", type=int, default=64, help="images a batch")
    parser.add_argument("--image", type=int, default=64, help="image side, pixels")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args.batches, args.batch, args.image, args.workers, args.rounds)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
