"""One rank of tests/test_group_launch.py: run as a script (or under
torchrun), with its config (JSON) as argv[1]; it takes one pass and prints
what it got, or its error, as one JSON line. (A module of its own: a rank
imports no more than it needs.)"""

from __future__ import annotations

import json
import sys
from typing import Any

import shmpipe


def _rank_main(cfg: dict[str, Any]) -> None:
    from shmpipe.testing.sources import Counter

    result: dict[str, Any] = {"rank": cfg.get("rank"), "error": None, "batches": 0}
    kwargs = {"run_id": cfg["run_id"]} if cfg.get("run_id") is not None else {}
    try:
        with shmpipe.from_iterators(
            [Counter(cfg["per_source"])] * 2,
            timeout=60,
            group=cfg["group"],
            rank=cfg.get("rank"),
            num_ranks=cfg.get("num_ranks"),
            group_timeout=cfg["group_timeout"],
            **kwargs,
        ) as pipe:
            result["rank"] = pipe.rank
            result["batches"] = sum(1 for _ in pipe)
    except shmpipe.ShmpipeError as exc:
        result["error"] = [type(exc).__name__, str(exc)]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
