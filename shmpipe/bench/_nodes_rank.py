"""One rank of ``shmpipe bench nodes``: a fresh process that makes its
loader (shmpipe's node pipeline, torch's DataLoader with a
DistributedSampler, or Grain's), takes its share of one epoch and says
what it got and when.

Started by shmpipe/bench/nodes.py as ``python -c`` with a bootstrap that
reads the clock before it imports this module: every import and start-up
of the loader is in the rank's first batch, torch's in every rank (where
it is installed) whatever the loader, as a training job imports it. The job is a JSON file (its
path the one argument); the report is one JSON line on stdout. Times are
CLOCK_MONOTONIC, one clock for every process of the machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench._jpegs import JpegFolder
from shmpipe.bench._resume_loaders import grain_flags_parsed

__all__ = ["main"]


def _ids(batch: Any) -> list[int]:
    """The sample indices of a batch, whoever collated it."""
    return [int(i) for i in np.asarray(batch["index"]).tolist()]


def _open(job: dict[str, Any], ds: JpegFolder) -> tuple[Any, Callable[[], None], Any]:
    """(the loader's batches, how to stop it, shmpipe's pipeline or None)."""
    nodes, ranks, node, rank = job["nodes"], job["ranks"], job["node"], job["rank"]
    world, g = nodes * ranks, node * ranks + rank
    if job["loader"] == "shmpipe":
        group = dict(group=job["group"], rank=rank, num_ranks=ranks) if ranks > 1 else {}
        pipe = shmpipe.from_dataset(
            ds, batch_size=job["batch_size"], shuffle=True, seed=job["seed"], num_workers=job["workers"],
            num_nodes=nodes, node_rank=node, timeout=job["timeout"], **group,
        )
        try:
            if job["state"] is not None:
                pipe.load_state_dict(job["state"])
        except BaseException:
            pipe.close()
            raise
        return iter(pipe), pipe.close, pipe
    per_rank = max(1, job["workers"] // ranks)
    if job["loader"] == "DataLoader":
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(ds, num_replicas=world, rank=g, shuffle=True, seed=job["seed"], drop_last=True)
        sampler.set_epoch(0)
        it = iter(DataLoader(ds, batch_size=job["batch_size"], sampler=sampler, num_workers=per_rank,
                             timeout=job["timeout"]))
        # The multi-worker iterator's own shutdown (what its __del__ calls).
        return it, getattr(it, "_shutdown_workers", lambda: None), None
    grain = importlib.import_module("grain.python")
    grain_flags_parsed()
    sampler = grain.IndexSampler(
        len(ds), shard_options=grain.ShardOptions(shard_index=g, shard_count=world, drop_remainder=True),
        shuffle=True, num_epochs=1, seed=job["seed"],
    )
    it = iter(grain.DataLoader(data_source=ds, sampler=sampler, worker_count=per_rank,
                               operations=[grain.Batch(job["batch_size"], drop_remainder=False)]))
    inner = getattr(it, "_iterator", None)  # Grain 0.2's iterator has no close(); the one it wraps has
    return it, getattr(inner, "close", lambda: None), None


def _barrier(folder: str, name: str, world: int, timeout: float) -> None:
    """Waits until every rank of the job got here: no node's rank 0 closes
    its group's producers while a rank of it still takes batches or its
    state."""
    open(os.path.join(folder, name), "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(folder)) < world and time.monotonic() < deadline:
        time.sleep(0.005)


def _rank(t_start: float, job: dict[str, Any]) -> dict[str, Any]:
    """Runs one rank; returns what it measured (times on CLOCK_MONOTONIC)."""
    g = job["node"] * job["ranks"] + job["rank"]
    # torch where it is installed, whatever the loader: a training job
    # imports it (the DataLoader's ranks must), so the first batch from the
    # process's start compares like with like. In the clock, as every
    # import here; the loader's own import after it.
    if importlib.util.find_spec("torch") is not None:
        import torch.utils.data  # noqa: F401
    if job["loader"] == "Grain":
        importlib.import_module("grain.python")
    ds = JpegFolder(job["folder"], job["count"], job["log"])
    out: dict[str, Any] = {"global_rank": g, "pid": os.getpid(), "t_start": t_start, "batches": [], "state": None}
    out["torch_imported"] = "torch" in sys.modules  # before the loader is made, every loader alike
    out["t_construct"] = time.monotonic()
    it, close, pipe = _open(job, ds)
    try:
        out["t_made"] = time.monotonic()
        for batch in it:
            ids = _ids(batch)
            del batch  # shmpipe: the slot goes back before the next batch is taken
            out["t_last"] = time.monotonic()
            if not out["batches"]:
                out["t_first"] = out["t_last"]
            out["batches"].append(ids)
            if len(out["batches"]) == job["stop"]:
                break
        if pipe is not None and job["stop"] is not None:
            out["state"] = pipe.state_dict()
        _barrier(job["barrier"], str(g), job["nodes"] * job["ranks"], job["timeout"])
    finally:
        close()
    return out


def main(t_start: float, spec_path: str) -> None:
    with open(spec_path) as f:
        job = json.load(f)
    print(json.dumps(_rank(t_start, job)), flush=True)
