"""The benchmarks' code paths at a tiny size (never their timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shmpipe.bench import throughput

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_every_path_runs():
    results = throughput.run([4096, 65536], seconds=0.05, min_batches=3, paths=throughput.PATHS)
    assert [(r.path, r.nbytes) for r in results] == [
        (p, n) for n in (4096, 65536) for p in throughput.PATHS
    ]
    for r in results:
        assert r.batches >= 3 and r.seconds > 0 and r.gb_per_s > 0
    text = throughput.table(results)
    assert text.count("\n") == 2 + len(results) - 1
    assert "| 64 KiB | shm reserve |" in text


def test_targets_are_checked_from_results():
    R = throughput.Result
    results = [
        R("memcpy", 48_000_000, 10, 1.0, 0.1),
        R("shm ring", 48_000_000, 4, 1.0, 0.1),  # 0.4x memcpy: not met
        R("shm ring", 65536, 200_000, 1.0, 0.1),
        R("mp.Queue", 65536, 10_000, 1.0, 0.1),
        R("shm reserve", 65536, 100_000, 1.0, 0.1),
        R("shm reserve", 48_000_000, 90_000, 1.0, 0.1),
    ]
    checks = [met for _, met, _ in throughput.targets(results)]
    # ring 48 MB, ring 64 KiB >= 150k, vs mp.Queue, reserve flat, ring 64 KiB >= 300k, reserve <= 5 us
    assert checks == [False, True, True, True, False, False]
    results[2] = R("shm ring", 65536, 300_000, 1.0, 0.1)
    results[4] = R("shm reserve", 65536, 200_000, 1.0, 0.1)
    results[5] = R("shm reserve", 48_000_000, 250_000, 1.0, 0.1)
    assert [met for _, met, _ in throughput.targets(results)] == [False, True, True, True, True, True]


def test_throughput_script_writes_json(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--sizes", "8192",
         "--seconds", "0.05", "--min-batches", "2", "--paths", *throughput.PATHS, "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| 8 KiB | shm ring |" in proc.stdout
    data = json.loads(out.read_text())
    assert {r["path"] for r in data["results"]} == set(throughput.PATHS)


def test_gpu_feed_says_what_it_did_not_measure(tmp_path):
    # No GPU in CI: the script must say so and succeed, measuring nothing.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_feed.py"), "--mib", "1", "--batches", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        assert "not measured" in proc.stdout
    else:
        assert "host-to-device GB/s" in proc.stdout


def test_gpu_feed_slot_safety_check_runs_on_the_host():
    # The GPU check's own code, with host tensors instead of copies (no
    # CUDA here): every stamp must survive, as it must on the GPU.
    torch = pytest.importorskip("torch")
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_feed", ROOT / "benchmarks" / "gpu_feed.py")
    gpu_feed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_feed)
    out = gpu_feed.check_slot_safety(torch, argparse.Namespace(batches=6), gated=True, device="cpu")
    assert out == {"batches": 12, "changed": 0, "waits_for_copy_events": True}
