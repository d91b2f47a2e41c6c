"""The start-up recipes of ``shmpipe bench feed`` (``shmpipe:shm@FRAMEWORK``,
``shmpipe:shm+prestart@FRAMEWORK``, ``torch.DataLoader@FRAMEWORK``): each
a training script of its own, run as a new process, that imports a
framework at its top and feeds its loop with shmpipe or torch's
DataLoader; its first batch is timed from the script's first line too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import shmpipe
from shmpipe.bench._feed_measure import Batch, FeedConfig, OnBatch, Recipe, RecipeResult, _measure

#: The frameworks of the start-up recipes: a training script imports one at its top.
STARTUP_FRAMEWORKS = ("tensorflow", "torch", "numpy")


#: The training script of the start-up recipes: FRAMEWORK imported at its
#: top (after shmpipe.prestart() where PRESTART says so), the source defined
#: in it (using its global CFG), the loop under the main guard. It prints the
#: RecipeResult as JSON. Two clocks: the first batch from the loader's
#: making (first_batch_s, as the in-process recipes have it; before it, the
#: script has imported shmpipe's package and the two bench modules, and a
#: pipeline's own imports and its fork server's start are inside, but where
#: the script called shmpipe.prestart(): then the server started during the
#: imports, and that first batch is warm), and from the script's first line
#: (from_start_s: every import and shmpipe.prestart() inside, what a user
#: waits for from `python train.py` but the interpreter's own start;
#: prestart()'s gain is the server's start overlapping the import, less
#: what it slows the import).
_SCRIPT = textwrap.dedent(
    """
    import time
    STARTED = time.perf_counter()  # the script's first line: from_start_s's clock
    PRESTART
    import FRAMEWORK
    import json
    import sys

    from shmpipe.bench import _feed_measure, _feed_startup

    CFG = _feed_measure.FeedConfig(**json.loads(sys.argv[2]))


    def make_batches():
        yield from _feed_measure.DataGenerator(CFG)()


    if __name__ == "__main__":
        result = _feed_startup.run_in_script(sys.argv[1], sys.argv[3], CFG, make_batches, STARTED)
        print(json.dumps(result.as_dict()))
    """
)


def recipe_script(loader: str, framework: str, prestart: bool = False) -> Recipe:
    """A start-up recipe: the training script (_SCRIPT) importing
    `framework`, fed by `loader` ("shmpipe" or "DataLoader"), run as a
    process of its own (its __main__ is that script, as a user's is).
    `prestart`: the script calls shmpipe.prestart() first."""

    def run_recipe(cfg: FeedConfig, on_batch: OnBatch | None = None) -> RecipeResult:
        name = ("shmpipe:shm" if loader == "shmpipe" else "torch.DataLoader") + ("+prestart" if prestart else "")
        name += f"@{framework}"
        first = "import shmpipe\nshmpipe.prestart()" if prestart else ""
        with tempfile.TemporaryDirectory(prefix="shmpipe-bench-") as folder:
            script = os.path.join(folder, "train.py")
            with open(script, "w") as f:
                f.write(_SCRIPT.replace("PRESTART", first).replace("FRAMEWORK", framework))
            config = json.dumps(dataclasses.asdict(cfg))
            # The script finds this very shmpipe (a checkout too); started
            # in its own folder, it is what `python train.py` runs.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            out = subprocess.run(
                [sys.executable, script, loader, config, name], stdout=subprocess.PIPE, text=True, cwd=folder,
                env=env, timeout=600 + 10 * cfg.batches * cfg.workers * (cfg.produce_s + cfg.train_s),
            )
        if out.returncode != 0:
            raise RuntimeError(f"{name}: the training script failed (exit status {out.returncode}; its "
                               "output is in the log)")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        fields = {f.name for f in dataclasses.fields(RecipeResult)}
        result = RecipeResult(**{k: v for k, v in got.items() if k in fields})
        for _ in result.waits_s:
            if on_batch:
                on_batch()
        return result

    return run_recipe


def run_in_script(loader: str, name: str, cfg: FeedConfig, source: Callable[[], Iterator[Batch]],
                  started: float | None = None) -> RecipeResult:
    """In the start-up recipes' training script: the loop fed by `loader`
    with cfg.workers producers of `source` (a function of the script).
    `started`: time.perf_counter() at the script's first line."""
    n = cfg.workers
    if loader == "shmpipe":
        pipes: list[shmpipe.Pipeline] = []

        def make() -> Iterator[Any]:  # starting the producers counts towards the first batch
            pipes.append(shmpipe.from_iterators([source] * n, timeout=600))
            return iter(pipes[0])

        try:
            return _measure(name, n, cfg, make, started=started)
        finally:
            for pipe in pipes:
                pipe.close()
    import torch.utils.data

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[Batch]:
            return iter(source())

    # batch_size=None: each worker yields its own batches whole, as a
    # producer does; fork, the DataLoader's default here
    loader_ = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=n)
    return _measure(name, n, cfg, lambda: iter(loader_), started=started)
