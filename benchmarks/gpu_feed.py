"""Feeding a GPU from the ring: checks, host-to-device GB/s and the share of
each training step spent waiting for input.

    python benchmarks/gpu_feed.py                      # needs an NVIDIA GPU and torch with CUDA
    python benchmarks/gpu_feed.py --mib 64 --batches 60 --json gpu.json

What it checks (exit status 1 if one fails), then measures, in one run:

1. Host pointer identity: torch.from_numpy of a delivered array points into
   the shared-memory segment (no copy on the host).
2. pin_memory=True registers the ring: memory inside the segment is
   page-locked (``Tensor.is_pinned``) once the first batch went to the GPU,
   and no longer once the pipeline closed (unregistered before unmapping).
3. Slot safety: batches stamped by their producers are copied to the GPU
   while the stream is kept busy, so each non-blocking copy waits in the
   stream behind compute; every batch on the device must still hold its
   stamp (a slot released before its copy ran would have been refilled).
   The same run without the wait for the copy's event is the control: it
   shows whether this machine would have caught a release too early.
4. Host-to-device copy rate, for batches whose arrays live in ring slots
   (producers fill them in place with shmpipe.reserve, so the producers are
   not the bottleneck): pageable (the ring as it is) and registered
   (pin_memory=True), beside two references in one process: a pinned torch
   tensor and a pageable NumPy array.
5. The share of training time spent waiting for input, with a simulated
   training step (a matmul loop of a fixed time on the GPU) fed through
   pipe.to_torch(device="cuda", pin_memory=True).
6. If TensorFlow sees a GPU: the same step fed through
   pipe.to_tf_dataset(device="/gpu:0") (prefetch to device).

Without CUDA it says so and measures nothing (exit status 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

import shmpipe
from shmpipe.testing.sources import StampedInPlace
from shmpipe.transport import ConsumerEnd


class Filled:
    """Producers that fill a slot in place: `n` float32 arrays of `nbytes`."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n, self.nbytes = n, nbytes

    def __call__(self) -> Iterator[np.ndarray]:
        spec = shmpipe.ArraySpec((self.nbytes // 4,), np.float32)
        for i in range(self.n):
            a = shmpipe.reserve(spec)
            a[:: 1 << 10] = i  # touch it: fresh data
            yield a


def channel_of(pipe: shmpipe.Pipeline) -> ConsumerEnd:
    """The pipeline's channel, open once a batch came through it."""
    channel = pipe.channel
    assert channel is not None, "no batch has opened the channel yet"
    return channel


def pinned_inside(torch: Any, address: int) -> bool:
    """Whether the page at `address` is page-locked for CUDA."""
    import ctypes

    page = (ctypes.c_uint8 * 4096).from_address(address)
    return torch.frombuffer(page, dtype=torch.uint8).is_pinned()


def check_registration(torch: Any, mib: int) -> dict[str, Any]:
    from shmpipe._torch import _Registration

    with shmpipe.from_iterators([Filled(4, mib << 20)], timeout=60) as pipe:
        batches = pipe.to_torch(device="cuda", pin_memory=True)
        it = iter(pipe)
        next(it)  # the ring exists now; time its registration alone
        t0 = time.perf_counter()
        registration = _Registration.of(pipe)
        registration.register(pipe)
        register_s = time.perf_counter() - t0
        gb = sum(size for _, size in channel_of(pipe).memory_ranges()) / 1e9
        it = iter(batches)  # a new pass, to the GPU (registered already)
        next(it)
        lo, size = channel_of(pipe).memory_ranges()[0]
        during = pinned_inside(torch, lo + size // 2)
        for _ in it:
            pass
        ranges = list(registration.ranges)
    after = registration.ranges
    return {
        "pinned_while_open": during,
        "registered_ranges": len(ranges),
        "unregistered_on_close": after == [],
        "ring_gb": gb,
        "register_s": register_s,
    }


def check_slot_safety(torch: Any, args: argparse.Namespace, gated: bool, device: str = "cuda") -> dict[str, Any]:
    """Copies wait behind matmuls in the stream; count the batches whose
    device copy lost its stamp. (device="cpu" runs the same code without a
    copy: the test suite's smoke test of this function.)"""
    a = torch.randn(4096 if device == "cuda" else 64, 4096 if device == "cuda" else 64, device=device)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    n = 0
    with shmpipe.from_iterators([StampedInPlace(args.batches, 4 << 20)] * 2, capacity=3, timeout=120) as pipe:
        batches = pipe.to_torch(device=device, pin_memory=device == "cuda", non_blocking=True)
        if not gated:
            batches.record_event = None  # the control: slots go back when .to() returns
        it = iter(batches)
        while True:
            for _ in range(4):
                a = (a @ a) * 1e-4  # keep the stream busy: the next copy queues behind this
            try:
                b = next(it)
            except StopIteration:
                break
            bad += (b["data"] != b["stamp"]).any().to(torch.int64)  # on the device: no sync
            n += 1
            del b
        if device == "cuda":
            torch.cuda.synchronize()
    return {"batches": n, "changed": int(bad.item()), "waits_for_copy_events": gated}


def h2d_rate(torch: Any, arrays_or_tensors: Iterable[Any], device: str, non_blocking: bool = True) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    nbytes = 0
    for x in arrays_or_tensors:
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(x)
        t.to(device, non_blocking=non_blocking)
        nbytes += t.numel() * t.element_size()
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - t0) / 1e9


def ring_rate(torch: Any, args: argparse.Namespace, pin: bool) -> float:
    with shmpipe.from_iterators([Filled(args.batches, args.mib << 20)] * 2, capacity=6, timeout=120) as pipe:
        batches = pipe.to_torch(device="cuda", pin_memory=pin, non_blocking=True)
        it = iter(batches)
        next(it)  # the ring exists (and is registered) from the first batch on
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 0
        for t in it:
            n += t.numel() * t.element_size()
        torch.cuda.synchronize()
        rate = n / (time.perf_counter() - t0) / 1e9
    return rate  # the pipeline's close unregistered the ring


def step_wait_share(torch: Any, args: argparse.Namespace) -> dict[str, Any]:
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 0
    while time.perf_counter() - t0 < 0.2:
        a @ a
        reps += 1
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / reps
    matmuls = max(1, int(args.step_ms / 1e3 / per))

    with shmpipe.from_iterators([Filled(args.batches, args.mib << 20)] * 2, capacity=6, timeout=120) as pipe:
        for x in pipe.to_torch(device="cuda", pin_memory=True):
            for _ in range(matmuls):
                a @ a  # the "training step"
            torch.cuda.synchronize()
            del x
        s = pipe.stats()
    return {"step_ms": args.step_ms, "stall_fraction": s.stall_fraction, "wait_p50_ms": s.wait_p50_s * 1e3,
            "wait_p99_ms": s.wait_p99_s * 1e3, "batches": s.batches}


def tf_step_wait_share(args: argparse.Namespace) -> dict[str, Any] | None:
    try:
        import tensorflow as tf
    except ImportError:
        return None
    if not tf.config.list_physical_devices("GPU"):
        return None
    a = tf.random.normal((2048, 2048))
    with shmpipe.from_iterators([Filled(args.batches, args.mib << 20)] * 2, capacity=8, timeout=120) as pipe:
        for x in pipe.to_tf_dataset(device="/gpu:0"):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.step_ms / 1e3:
                a = tf.linalg.matmul(a, a) * 1e-3
            _ = a.numpy()  # wait for the GPU
            del x
        s = pipe.stats()
    return {"step_ms": args.step_ms, "stall_fraction": s.stall_fraction, "batches": s.batches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="batch size in MiB")
    parser.add_argument("--batches", type=int, default=40, help="batches per producer (2 producers)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated training step")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)

    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("No CUDA device here (or no torch with CUDA): the GPU figures are not measured. "
              "Run this on a machine with an NVIDIA GPU and a CUDA build of torch.")
        return 0

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "numpy": np.__version__},
        "batch_mib": args.mib,
    }
    failed = []
    # 1. pointer identity on the host
    with shmpipe.from_iterators([Filled(2, 1 << 20)], timeout=60) as pipe:
        t = next(iter(pipe.to_torch()))
        lo, size = channel_of(pipe).memory_ranges()[0]
        results["host_tensor_in_segment"] = lo <= t.data_ptr() < lo + size
        del t
    if not results["host_tensor_in_segment"]:
        failed.append("the host tensor is a copy")
    # 2. registration and unregistration
    reg = results["registration"] = check_registration(torch, args.mib)
    print(f"registration: {reg}")
    if not (reg["pinned_while_open"] and reg["unregistered_on_close"]):
        failed.append("pin_memory=True did not register the ring, or close did not unregister it")
    # 3. slot safety under non-blocking copies, and its control
    safety = results["slot_safety"] = check_slot_safety(torch, args, gated=True)
    control = results["slot_safety_control"] = check_slot_safety(torch, args, gated=False)
    print(f"slot safety: {safety}; control without the event wait: {control}")
    if safety["changed"]:
        failed.append(f"{safety['changed']} batches changed before their copy ran")
    # 4. host-to-device rates
    n = args.mib << 20
    pinned = [torch.empty(n // 4, dtype=torch.float32, pin_memory=True) for _ in range(4)]
    pageable = [np.ones(n // 4, np.float32) for _ in range(4)]
    results["h2d_gbs"] = {
        "torch pinned tensor (reference)": h2d_rate(torch, pinned * 10, "cuda"),
        "numpy pageable (reference)": h2d_rate(torch, pageable * 10, "cuda"),
        "ring, pageable": ring_rate(torch, args, pin=False),
        "ring, registered (pin_memory=True)": ring_rate(torch, args, pin=True),
    }
    # 5. share of each step spent waiting
    results["torch_step"] = step_wait_share(torch, args)
    # 6. the same through tf.data, if TensorFlow sees the GPU
    results["tf_step"] = tf_step_wait_share(args)

    print(f"device: {results['device']}; batches of {args.mib} MiB")
    print(f"host tensor is the slot (no host copy): {results['host_tensor_in_segment']}")
    print("| path | host-to-device GB/s |\n| --- | ---: |")
    for k, v in results["h2d_gbs"].items():
        print(f"| {k} | {v:.1f} |")
    st = results["torch_step"]
    print(f"training step {st['step_ms']} ms fed by to_torch(device='cuda', pin_memory=True): "
          f"stall fraction {st['stall_fraction']:.1%}, wait p50 {st['wait_p50_ms']:.2f} ms, "
          f"p99 {st['wait_p99_ms']:.2f} ms")
    if results["tf_step"] is not None:
        st = results["tf_step"]
        print(f"training step {st['step_ms']} ms fed by to_tf_dataset(device='/gpu:0'): "
              f"stall fraction {st['stall_fraction']:.1%}")
    else:
        print("TensorFlow sees no GPU here: the tf.data path was not measured")
    results["failed_checks"] = failed
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    for what in failed:
        print(f"CHECK FAILED: {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
