"""What JAX's CPU backend aliases and what it copies, and what each costs:
the facts behind docs/jax.md's table, measured on this machine.

    python benchmarks/jax_aliasing.py            # 4 forced host devices, 8 MiB arrays

Each case puts one read-only array, in an anonymous shared mapping as the
ring's slots are, through to_jax's own path (shmpipe._jax_placement.Target) and
through ``jax.device_put``, and says whether the result's buffers lie in
the array's memory (aliased) and the median µs per call.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from typing import Any

if __name__ == "__main__":  # before jax is imported
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np


def _view(memory: np.ndarray, nbytes: int, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
    start = (-memory.ctypes.data) % 64 + offset
    arr = memory[start : start + nbytes].view(dtype).reshape(shape)
    arr.flags.writeable = False
    return arr


def _median_us(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=8, help="array size")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shmpipe._jax_placement import Target, _on_memory_of

    memory = np.frombuffer(mmap.mmap(-1, (args.mib + 1) << 20), np.uint8)
    n = args.mib << 20
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",))
    rows = 512
    cases: list[tuple[str, np.ndarray, Any]] = [
        ("float32, aligned", _view(memory, n, np.float32, (rows, n // rows // 4)), None),
        ("uint8, aligned", _view(memory, n, np.uint8, (rows, n // rows)), None),
        ("bfloat16, aligned", _view(memory, n, jax.numpy.bfloat16, (rows, n // rows // 2)), None),
        ("int64 (kept as int32)", _view(memory, n, np.int64, (rows, n // rows // 8)), None),
        ("float64 (kept as float32)", _view(memory, n, np.float64, (rows, n // rows // 8)), None),
        ("float32, 16 bytes off 64", _view(memory, n, np.float32, (rows, n // rows // 4), 16), None),
        ("float32, every other column", _view(memory, n, np.float32, (rows, n // rows // 4))[:, ::2], None),
        (f"float32 over {len(devices)} devices, P('data')",
         _view(memory, n, np.float32, (rows, n // rows // 4)), NamedSharding(mesh, P("data"))),
        (f"float32 over {len(devices)} devices, replicated",
         _view(memory, n, np.float32, (rows, n // rows // 4)), NamedSharding(mesh, P())),
        (f"float32 over {len(devices)} devices, slices not 64-byte aligned",
         _view(memory, 4 * len(devices) * 3 * 4, np.float32, (4 * len(devices), 3)),  # 48-byte slices
         NamedSharding(mesh, P("data"))),
    ]
    print(f"jax {jax.__version__}, NumPy {np.__version__}, {len(devices)} host devices, {os.cpu_count()} CPUs; "
          f"arrays of {args.mib} MiB unless the shape says otherwise")
    print(f"{'case':<52}{'aliased':>9}{'to_jax µs':>11}{'device_put µs':>15}")
    for name, arr, sharding in cases:
        target = Target(jax, sharding, None)
        ours = target.plan_and_put(arr, "batch")
        public = jax.device_put(arr, sharding)
        ours_us = _median_us(lambda a=arr, t=target: t.put(a).block_until_ready(), args.reps)
        public_us = _median_us(lambda a=arr, s=sharding: jax.device_put(a, s).block_until_ready(), args.reps)
        aliased = _on_memory_of(ours, arr)
        assert aliased == _on_memory_of(public, arr), name
        print(f"{name + f' {arr.shape}':<52}{'yes' if aliased else 'COPY':>9}{ours_us:>11.1f}{public_us:>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
