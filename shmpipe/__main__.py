"""The shmpipe command line.

    shmpipe bench seed         the article's experiment, every recipe side by side
    shmpipe bench throughput   transport-bound GB/s and batches/s, every transport
    shmpipe bench serialize    every serialization path, in one process
    shmpipe bench ranks        N ranks fed by one shared pool vs one pipeline or DataLoader each
    shmpipe clean              remove segments left by processes that died
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from shmpipe import clean as do_clean
from shmpipe.bench import ranks, seed, serialize, throughput
from shmpipe.bench._report import Progress, environment, human_size, parse_size
from shmpipe.errors import ShmpipeError

_N = TypeVar("_N", int, float)


def _sizes(values: list[str]) -> list[int]:
    sizes = [parse_size(v) for v in values]
    for s in sizes:
        if not 4 << 10 <= s <= 256_000_000:
            raise SystemExit(f"shmpipe bench: batch sizes go from 4KiB to 256MB, not {s:,} bytes")
    return sizes


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (say 4,1000000,3)") from None
    if not shape or any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (say 4,1000000,3)")
    return shape


def _positive(kind: Callable[[str], _N]) -> Callable[[str], _N]:
    def parse(text: str) -> _N:
        v = kind(text)
        if v < 0:
            raise argparse.ArgumentTypeError(f"must not be negative: {text}")
        return v

    return parse


def _write_json(path: str | None, kind: str, payload: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"benchmark": kind, "environment": environment(), **payload}, f, indent=2)
        print(f"wrote {path}")


def _bench_seed(args: argparse.Namespace) -> int:
    cfg = seed.SeedConfig(
        workers=args.workers or multiprocessing.cpu_count(),
        batches=args.batches,
        shape=args.shape,
        fetch_s=args.fetch,
        compute_s=args.compute,
        train_s=args.train,
    )
    recipes = args.recipes or list(seed.available_recipes())
    single = sum(1 for r in recipes if r in ("generator", "tf.data"))
    total = single * cfg.batches + (len(recipes) - single) * cfg.batches * cfg.workers
    progress = Progress(total, "bench seed")
    with progress.running():
        results = seed.run(cfg, recipes, progress=lambda name, n: progress.step(name, n or 0))
    print(
        f"shmpipe bench seed: {cfg.workers} producers, {cfg.batches} batches each of {cfg.shape} float32 "
        f"(+{cfg.target_shape}), fetch {cfg.fetch_s} s, compute {cfg.compute_s} s, train step {cfg.train_s} s"
    )
    print(seed.table(results))
    _write_json(args.json, "seed", {"config": cfg.__dict__, "results": [r.as_dict() for r in results]})
    if args.plot:
        seed.plot(results, args.plot, f"Wait for the next batch ({cfg.workers} producers, {cfg.shape} float32)")
        print(f"wrote {args.plot}")
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    sizes = _sizes(args.sizes)
    paths = args.paths or throughput.default_paths()
    progress = Progress(len(sizes) * len(paths), "bench throughput")
    with progress.running():
        results = throughput.run(
            sizes, seconds=args.seconds, min_batches=args.min_batches, workers=args.workers, paths=paths,
            progress=lambda path, nbytes: progress.step(f"{path} {human_size(nbytes)}"),
        )
    print(f"shmpipe bench throughput: {args.workers} producers, fresh float32 batches, {args.seconds} s per row")
    print(throughput.table(results))
    checks = throughput.targets(results)
    if checks:
        print()
        for name, met, measured in checks:
            print(f"{'met    ' if met else 'NOT MET'}  {name}: {measured}")
    _write_json(
        args.json, "throughput",
        {"workers": args.workers, "results": [r.as_dict() for r in results],
         "targets": [{"target": n, "met": m, "measured": v} for n, m, v in checks]},
    )
    if args.plot:
        throughput.plot(results, args.plot, f"Throughput, {args.workers} producers")
        print(f"wrote {args.plot}")
    return 0


def _bench_serialize(args: argparse.Namespace) -> int:
    sizes = _sizes(args.sizes)
    paths = args.paths or list(serialize.PATHS)
    progress = Progress(len(sizes) * len(paths), "bench serialize")
    with progress.running():
        results = serialize.run(sizes, paths, seconds=args.seconds, progress=progress.step)
    print("shmpipe bench serialize: one process; batch = {x: float32 array, y: int64 (64,), i: int}")
    print(serialize.table(results))
    _write_json(args.json, "serialize", {"results": [r.as_dict() for r in results]})
    if args.plot:
        serialize.plot(results, args.plot, "Serialization: encode + decode per batch")
        print(f"wrote {args.plot}")
    return 0


def _bench_ranks(args: argparse.Namespace) -> int:
    cfg = ranks.RanksConfig(
        ranks=args.ranks, producers=args.producers, batches=args.batches, nbytes=parse_size(args.size),
        work_ms=args.work_ms, passes=args.passes, capacity=args.capacity, pool_producers=args.pool_producers,
    )
    setups = args.setups or list(ranks.SETUPS)
    progress = Progress(len(setups), "bench ranks")
    with progress.running():
        results = ranks.run(cfg, setups, progress=progress.step)
    print(ranks.describe(cfg))
    print(ranks.table(results))
    _write_json(args.json, "ranks", {"config": cfg.__dict__, "results": [r.as_dict() for r in results]})
    if args.plot:
        ranks.plot(results, args.plot, f"{cfg.ranks} ranks, {human_size(cfg.nbytes)} batches")
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shmpipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    clean = sub.add_parser(
        "clean",
        help="remove shared-memory segments left by shmpipe processes that died",
        description="Removes this user's shmpipe segments in /dev/shm whose owning process "
        "has died. A segment whose owner is alive is never touched.",
    )
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")

    bench = sub.add_parser("bench", help="benchmarks: seed, throughput, serialize, ranks")
    kinds = bench.add_subparsers(dest="kind", required=True)

    s = kinds.add_parser("seed", help="the article's experiment, every recipe side by side",
                         description=seed.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--workers", type=int, default=0, help="producer processes (default: cpu_count(), as the article)")
    s.add_argument("--batches", type=_positive(int), default=10, help="batches per producer (default 10)")
    s.add_argument("--shape", type=_shape, default=(4, 1000000, 3), help="sample shape (default 4,1000000,3: 48 MB)")
    s.add_argument("--fetch", type=_positive(float), default=0.5, help="simulated fetch, seconds (default 0.5)")
    s.add_argument("--compute", type=_positive(float), default=0.0, help="simulated compute (busy loop), seconds")
    s.add_argument("--train", type=_positive(float), default=0.1, help="simulated training step, seconds (default 0.1)")
    s.add_argument("--recipes", nargs="+", metavar="RECIPE",
                   help="recipes to run (default: all): generator tf.data mp.Queue ray.util.iter "
                        "shmpipe:<transport> shmpipe:shm+reserve")
    s.add_argument("--json", metavar="FILE", help="write the results as JSON")
    s.add_argument("--plot", metavar="FILE.png", help="draw the wait per recipe")

    t = kinds.add_parser("throughput", help="transport-bound throughput, every transport",
                         description=throughput.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--sizes", nargs="+", default=["64KiB", "1MiB", "48MB"], help="batch sizes, 4KiB to 256MB")
    t.add_argument("--seconds", type=_positive(float), default=1.5, help="timed seconds per path and size")
    t.add_argument("--min-batches", type=_positive(int), default=20, help="at least this many batches per row")
    t.add_argument("--workers", type=int, default=2, help="producer processes (default 2)")
    t.add_argument("--paths", nargs="+", metavar="PATH",
                   help="memcpy, mp.Queue, 'shm ring', 'shm reserve', 'shm varying', transport:<name> (default: all)")
    t.add_argument("--json", metavar="FILE")
    t.add_argument("--plot", metavar="FILE.png", help="draw GB/s against batch size")

    z = kinds.add_parser("serialize", help="serialization paths in one process",
                         description=serialize.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    z.add_argument("--sizes", nargs="+", default=["64KiB", "1MiB", "48MB"], help="batch sizes, 4KiB to 256MB")
    z.add_argument("--paths", nargs="+", metavar="PATH", help="which paths (default: all)")
    z.add_argument("--seconds", type=_positive(float), default=0.3, help="timed seconds per path and size")
    z.add_argument("--json", metavar="FILE")
    z.add_argument("--plot", metavar="FILE.png", help="draw time per batch against batch size")

    r = kinds.add_parser("ranks", help="N ranks: one shared pool of producers vs one pipeline or DataLoader each",
                         description=ranks.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    r.add_argument("--producers", type=int, default=2,
                   help="producer processes of each rank's own pipeline or DataLoader (default 2)")
    r.add_argument("--pool-producers", type=int, default=None,
                   help="producer processes of the shared pool, for all ranks (default: --producers)")
    r.add_argument("--batches", type=_positive(int), default=200, help="batches per rank per pass (default 200)")
    r.add_argument("--size", default="1MiB", help="batch size (default 1MiB)")
    r.add_argument("--work-ms", type=_positive(float), default=1.0, help="producer work per batch, ms (default 1)")
    r.add_argument("--passes", type=_positive(int), default=1, help="passes (default 1)")
    r.add_argument("--capacity", type=_positive(int), default=None,
                   help="slots of each shmpipe ring (default: shmpipe's default for the setup)")
    r.add_argument("--setups", nargs="+", metavar="SETUP",
                   help="'shared pool', 'pipeline per rank', 'DataLoader per rank' (default: all)")
    r.add_argument("--json", metavar="FILE")
    r.add_argument("--plot", metavar="FILE.png", help="draw batches/s, CPU per batch and memory per setup")

    args = parser.parse_args(argv)
    if args.command == "clean":
        removed = do_clean(dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        for name in removed:
            print(f"{verb} {name}")
        print(f"{verb} {len(removed)} segment(s)")
        return 0
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "seed": _bench_seed, "throughput": _bench_throughput, "serialize": _bench_serialize,
        "ranks": _bench_ranks,
    }
    try:
        return commands[args.kind](args)
    except ShmpipeError as exc:
        print(f"shmpipe bench {args.kind}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
