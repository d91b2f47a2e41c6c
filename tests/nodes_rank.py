"""One rank of a simulated node of tests/test_nodes.py: run as a script,
with its config (JSON) as argv[1] (or by torchrun, its layout from the
environment); it prints its report as one JSON line. A module of its own,
not the test file run as a script: a rank (and its fork server, which
imports the script's modules) imports no more than it needs, not pytest
and the suite's conftest (0.17 s of CPU each, for 60 ranks)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from typing import Any

import shmpipe
from shmpipe.testing.datasets import Numbered

N, BATCH, SEED = 121, 2, 7  # 61 batches an epoch (the last one short)


def arguments(**kw: Any) -> dict[str, Any]:
    return dict(batch_size=BATCH, shuffle=True, seed=SEED, timeout=60.0) | kw


def torchrun_main(cfg: dict[str, Any]) -> None:
    """A rank under torchrun: the layout comes from its environment."""
    node = int(os.environ["GROUP_RANK"])
    with shmpipe.from_dataset(Numbered(N), group=f"t{node}-{cfg['torchrun']}", **arguments(num_workers=2)) as pipe:
        batches = [b["i"].tolist() for b in pipe]
        extra = pipe.stats().extra  # the layout the environment gave
        report = {"global_rank": int(os.environ["RANK"]), "batches": batches,
                  "layout": [extra["num_nodes"], extra["node_rank"], extra["num_ranks"]]}
        # Every rank writes its report before any node's rank 0 closes its group.
        os.makedirs(cfg["barrier"], exist_ok=True)
        with open(os.path.join(cfg["barrier"], f"report-{report['global_rank']}"), "w") as f:
            json.dump(report, f)
        deadline = time.monotonic() + 60
        while len(os.listdir(cfg["barrier"])) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)


def main(cfg: dict[str, Any]) -> None:
    if "torchrun" in cfg:
        return torchrun_main(cfg)
    report: dict[str, Any] = {"batches": [], "dropped": [], "restarts": 0, "states": []}
    group = dict(group=cfg["group"], rank=cfg["rank"], num_ranks=cfg["num_ranks"]) if cfg["group"] else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pipe = shmpipe.from_dataset(
                Numbered(cfg.get("length", N)), num_nodes=cfg["num_nodes"], node_rank=cfg["node_rank"],
                max_restarts=1, transport=cfg["transport"], **arguments(num_workers=2), **group,
            )
        except shmpipe.ShmpipeError as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
            return
        with pipe:
            if cfg["state"] is not None:
                pipe.load_state_dict(cfg["state"])
            for _ in range(cfg["epochs"]):
                for b in pipe:
                    report["batches"].append(b["i"].tolist())
                    if cfg["kill"] and len(report["batches"]) == 1:
                        os.kill(pipe.pids[1], signal.SIGKILL)
                    if len(report["batches"]) in cfg["states_at"]:
                        report["states"].append(pipe.state_dict())
            report["dropped"] = pipe.stats().extra.get("dropped_per_pass")
            # Every rank is done before any node's rank 0 closes its group
            # (which ends it for the node's other ranks).
            os.makedirs(cfg["barrier"], exist_ok=True)
            open(os.path.join(cfg["barrier"], f"{cfg['node_rank']}-{cfg['rank']}"), "w").close()
            deadline = time.monotonic() + 60
            while len(os.listdir(cfg["barrier"])) < cfg["world"] and time.monotonic() < deadline:
                time.sleep(0.01)
    report["restarts"] = sum(
        issubclass(w.category, shmpipe.ShmpipeWarning) and "replaced" in str(w.message) for w in caught
    )
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
