"""Several ranks of one node: one shared pool of producers against one per rank.

N rank processes (as torchrun starts them) each take B batches per pass of
the same kind (float32 arrays of a given size, each costing its producer a
busy loop of --work-ms plus filling the array). The same total producer
work (N x B batches) is done three ways:

  shared pool       one pipeline for the group (from_iterators(group=...)):
                    P producers in all (--pool-producers, default P), started
                    by rank 0; each batch goes to one rank
  pipeline per rank each rank its own from_iterators with P producers (what
                    a DDP script does without groups: N x P producers)
  DataLoader per rank  each rank its own torch DataLoader (IterableDataset,
                    num_workers=P, batch_size=None): N x P workers

Measured per setup: batches/s per rank (each rank's batches over the time
from its first batch to its last), CPU seconds of every process of the
setup (ranks and producers: RUSAGE_SELF + RUSAGE_CHILDREN of each rank,
producers started with the "fork" method so that their rank reaps them),
processes started, and memory (the sum of the proportional set size, PSS, of
every rank and producer at the end of the pass, so shared memory counts
once). The ranks of a setup run at the same time; the setups one after the
other.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench._report import human_size, pyplot

__all__ = ["SETUPS", "RanksConfig", "SetupResult", "plot", "run", "table"]

SETUPS = ("shared pool", "pipeline per rank", "DataLoader per rank")


@dataclass(frozen=True)
class RanksConfig:
    ranks: int = 2
    producers: int = 2  # each rank's own in the per-rank setups
    pool_producers: int | None = None  # the shared pool's (default: producers)
    batches: int = 200  # per rank per pass
    nbytes: int = 1 << 20
    work_ms: float = 1.0
    passes: int = 1
    capacity: int | None = None  # the shmpipe setups' (default: shmpipe's)


@dataclass
class SetupResult:
    setup: str
    ranks: int
    producer_processes: int
    processes_started: int
    batches_per_rank: list[int]
    batches_per_s_per_rank: list[float]
    cpu_s: float
    pss_bytes: int
    wall_s: float
    skipped: str | None = None

    @property
    def cpu_ms_per_batch(self) -> float:
        n = sum(self.batches_per_rank)
        return self.cpu_s / n * 1e3 if n else float("nan")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_ms_per_batch"] = self.cpu_ms_per_batch
        return d


# -- the producer (top level: producer processes unpickle it) ---------------------


class Work:
    """`n` batches {"x": float32 array of `nbytes`, "i": int}, each after a
    busy loop of `work_ms` (the decoding and augmenting a real one does)."""

    def __init__(self, n: int, nbytes: int, work_ms: float) -> None:
        self.n, self.nbytes, self.work_ms = n, nbytes, work_ms

    def __call__(self) -> Iterator[dict[str, Any]]:
        return self.batches(0, self.n)

    def batches(self, start: int, stop: int) -> Iterator[dict[str, Any]]:
        for i in range(start, stop):
            deadline = time.perf_counter() + self.work_ms / 1e3
            while time.perf_counter() < deadline:
                pass
            x = np.empty(self.nbytes // 4, np.float32)
            x.fill(i)
            yield {"x": x, "i": i}


def _split(total: int, parts: int) -> list[int]:
    """`total` batches over `parts` producers, as evenly as can be."""
    return [total // parts + (1 if p < total % parts else 0) for p in range(parts)]


# -- one rank (a process of its own) ------------------------------------------------


def _pss_of_tree() -> int:
    """PSS of this process and its live children, in bytes."""
    pids = [os.getpid()]
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        pids.append(int(entry))
            except OSError:
                continue
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def _children() -> int:
    import multiprocessing

    return len(multiprocessing.active_children())


def _rank(setup: str, cfg: RanksConfig, rank: int, group: str) -> dict[str, Any]:
    """Runs one rank of `setup`; returns what it measured."""
    n = cfg.ranks
    t0 = time.perf_counter()
    first: float | None = None
    got = 0
    pss = 0
    started = 0
    if setup == "DataLoader per rank":
        import torch
        from torch.utils.data import DataLoader, IterableDataset

        work = Work(cfg.batches, cfg.nbytes, cfg.work_ms)

        class Dataset(IterableDataset):
            def __iter__(self) -> Iterator[dict[str, Any]]:
                info = torch.utils.data.get_worker_info()
                share = _split(cfg.batches, info.num_workers if info else 1)
                w = info.id if info else 0
                start = sum(share[:w])
                return work.batches(start, start + share[w])

        loader = DataLoader(Dataset(), num_workers=cfg.producers, batch_size=None, multiprocessing_context="fork")
        for _ in range(cfg.passes):
            for batch in loader:
                if first is None:
                    first = time.perf_counter()
                float(batch["x"][0])
                got += 1
                del batch
        last = time.perf_counter()
        started = cfg.producers * cfg.passes  # a DataLoader starts its workers again every pass
        pss = _pss_of_tree()
        del loader
    else:
        if setup == "shared pool":
            counts = _split(n * cfg.batches, cfg.pool_producers or cfg.producers)
            pipe: Any = shmpipe.from_iterators(
                [Work(c, cfg.nbytes, cfg.work_ms) for c in counts],
                start_method="fork", group=group, rank=rank, num_ranks=n, timeout=600, capacity=cfg.capacity,
            )
        else:
            counts = _split(cfg.batches, cfg.producers)
            pipe = shmpipe.from_iterators(
                [Work(c, cfg.nbytes, cfg.work_ms) for c in counts], start_method="fork", timeout=600,
                capacity=cfg.capacity,
            )
        with pipe:
            started = len([p for p in pipe.pids if p is not None])
            for _ in range(cfg.passes):
                for batch in pipe:
                    if first is None:
                        first = time.perf_counter()
                    float(batch["x"][0])
                    got += 1
                    del batch
            last = time.perf_counter()
            pss = _pss_of_tree()
    # The producers are joined (by close, or by the DataLoader): their CPU
    # time is in RUSAGE_CHILDREN now.
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(u.ru_utime + u.ru_stime for u in usage)
    span = last - (first if first is not None else last)
    return {
        "rank": rank,
        "batches": got,
        "batches_per_s": (got - 1) / span if got > 1 and span > 0 else 0.0,
        "cpu_s": cpu,
        "pss": pss,
        "started": started,
        "wall_s": time.perf_counter() - t0,
    }


# -- the setups ---------------------------------------------------------------------------


def _run_setup(setup: str, cfg: RanksConfig) -> SetupResult:
    group = f"bench-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    argv = [sys.executable, "-m", "shmpipe.bench.ranks"]
    procs = [
        subprocess.Popen(
            [*argv, json.dumps({"setup": setup, "cfg": asdict(cfg), "rank": r, "group": group})],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(cfg.ranks)
    ]
    t0 = time.perf_counter()
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            for other in procs:
                other.kill()
            raise RuntimeError(f"a rank of {setup!r} failed (exit code {proc.returncode})")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - t0
    producers = (cfg.pool_producers or cfg.producers) if setup == "shared pool" else cfg.producers * cfg.ranks
    return SetupResult(
        setup=setup,
        ranks=cfg.ranks,
        producer_processes=producers,
        processes_started=cfg.ranks + sum(r["started"] for r in reports),
        batches_per_rank=[r["batches"] for r in reports],
        batches_per_s_per_rank=[r["batches_per_s"] for r in reports],
        cpu_s=sum(r["cpu_s"] for r in reports),
        pss_bytes=sum(r["pss"] for r in reports),
        wall_s=wall,
    )


def run(
    cfg: RanksConfig, setups: list[str] | None = None, progress: Callable[[str], None] | None = None
) -> list[SetupResult]:
    """Runs each setup (default: all; the DataLoader one where torch is
    installed), one after the other."""
    results = []
    for setup in setups or list(SETUPS):
        if setup not in SETUPS:
            raise shmpipe.ShmpipeValueError(f"unknown setup {setup!r}; the setups are {', '.join(SETUPS)}")
        if progress:
            progress(setup)
        if setup == "DataLoader per rank":
            try:
                import torch  # noqa: F401
            except ImportError:
                skipped = SetupResult(setup, cfg.ranks, 0, 0, [], [], 0.0, 0, 0.0, skipped="torch is not installed")
                results.append(skipped)
                continue
        results.append(_run_setup(setup, cfg))
    return results


def table(results: list[SetupResult]) -> str:
    """A Markdown table, one row per setup."""
    lines = [
        "| setup | producer processes | processes started | batches per rank | batches/s per rank (min-max) "
        "| CPU s (all processes) | CPU ms per batch | memory (PSS) | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.setup} | skipped: {r.skipped} | | | | | | | |")
            continue
        rates = r.batches_per_s_per_rank
        lines.append(
            f"| {r.setup} | {r.producer_processes} | {r.processes_started} | {min(r.batches_per_rank)} | "
            f"{min(rates):,.0f}-{max(rates):,.0f} | {r.cpu_s:.2f} | {r.cpu_ms_per_batch:.2f} | "
            f"{r.pss_bytes / 2**20:,.0f} MiB | {r.wall_s:.1f} |"
        )
    return "\n".join(lines)


def plot(results: list[SetupResult], path: str, title: str) -> None:
    """Bars: batches/s per rank, CPU ms per batch, memory, per setup."""
    plt = pyplot()
    done = [r for r in results if not r.skipped]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    names = [r.setup.replace(" per ", "\nper ") for r in done]
    panels: list[tuple[str, list[float]]] = [
        ("batches/s per rank (mean)", [sum(r.batches_per_s_per_rank) / len(r.batches_per_s_per_rank) for r in done]),
        ("CPU ms per batch (all processes)", [r.cpu_ms_per_batch for r in done]),
        ("memory, PSS MiB (all processes)", [r.pss_bytes / 2**20 for r in done]),
    ]
    for ax, (label, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=["tab:blue", "tab:orange", "tab:gray"][: len(values)])
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(cfg: RanksConfig) -> str:
    return (
        f"shmpipe bench ranks: {cfg.ranks} ranks, {cfg.batches} batches of {human_size(cfg.nbytes)} per rank per "
        f"pass, {cfg.passes} pass(es), {cfg.work_ms} ms of producer work per batch; "
        f"{cfg.pool_producers or cfg.producers} producers in the shared pool, {cfg.producers} per rank otherwise"
    )


def _main() -> None:
    job = json.loads(sys.argv[1])
    cfg = RanksConfig(**job["cfg"])
    print(json.dumps(_rank(job["setup"], cfg, job["rank"], job["group"])), flush=True)


if __name__ == "__main__":
    _main()
