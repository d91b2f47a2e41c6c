"""The shmpipe command line.

    shmpipe bench seed         the article's experiment, every recipe side by side
    shmpipe bench throughput   transport-bound GB/s and batches/s, every transport
    shmpipe bench serialize    every serialization path, in one process
    shmpipe bench train        end to end: a JPEG pipeline into Keras and torch training, every loader
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
from shmpipe.bench import seed, serialize, throughput, train
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


def _bench_train(args: argparse.Namespace) -> int:
    cfg = train.TrainConfig(
        images=args.images, batch_size=args.batch_size, workers=args.workers, crop=args.crop,
        min_side=args.sides[0], max_side=args.sides[1], distinct=args.distinct,
        reference_steps=args.reference_steps, trainer_threads=args.trainer_threads, timeout_s=args.timeout,
    )
    recipes = args.recipes or list(train.RECIPES)
    progress = Progress(len(recipes) * args.repeat, "bench train")
    with progress.running():
        results = train.run(cfg, recipes, progress=progress.step, repeat=args.repeat)
    print(
        f"shmpipe bench train: {cfg.images} images per recipe ({cfg.distinct} distinct JPEGs, sides "
        f"{cfg.min_side} to {cfg.max_side} px), random {cfg.crop}x{cfg.crop} crop, batches of {cfg.batch_size}, "
        f"{cfg.workers} producers or workers, {cfg.threads} trainer thread(s)"
        + (f"; median of {args.repeat} runs" if args.repeat > 1 else "")
    )
    print(train.table(results))
    for r in results:
        if r.error:
            print(f"\n{r.recipe} failed: {r.error}", file=sys.stderr)
    _write_json(args.json, "train", {"config": {**cfg.__dict__, "trainer_threads": cfg.threads},
                                     "results": [r.as_dict() for r in results]})
    if args.plot:
        train.plot(results, args.plot, f"Images/s into the trainer ({cfg.workers} producers or workers)")
        print(f"wrote {args.plot}")
    return 1 if any(r.error for r in results) else 0


def _sides(text: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not MIN,MAX: {text!r} (say 96,224)") from None
    return low, high


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

    bench = sub.add_parser("bench", help="benchmarks: seed, throughput, serialize")
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

    td = train.TrainConfig()  # the defaults, said once
    d = kinds.add_parser("train", help="end to end: a JPEG pipeline into Keras and torch training, every loader",
                         description=train.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--images", type=_positive(int), default=td.images,
                   help=f"images per recipe, all of which the trainer sees (default {td.images})")
    d.add_argument("--batch-size", type=_positive(int), default=td.batch_size,
                   help=f"images per batch (default {td.batch_size})")
    d.add_argument("--workers", type=_positive(int), default=td.workers,
                   help=f"shmpipe producers and DataLoader workers (default {td.workers})")
    d.add_argument("--crop", type=_positive(int), default=td.crop,
                   help=f"side of the random crop, pixels (default {td.crop})")
    d.add_argument("--sides", type=_sides, default=(td.min_side, td.max_side), metavar="MIN,MAX",
                   help=f"the JPEGs' sides are drawn from MIN..MAX pixels (default {td.min_side},{td.max_side})")
    d.add_argument("--distinct", type=_positive(int), default=td.distinct,
                   help=f"distinct JPEGs made at start; the stream cycles through them (default {td.distinct})")
    d.add_argument("--reference-steps", type=_positive(int), default=td.reference_steps,
                   help=f"steps on a batch in memory, timed for the idle estimate (default {td.reference_steps})")
    d.add_argument("--trainer-threads", type=_positive(int), default=0,
                   help="the trainer's compute threads (default 0: the cores the producers leave, at least 1)")
    d.add_argument("--timeout", type=_positive(float), default=td.timeout_s,
                   help=f"seconds a recipe may run before it is killed (default {td.timeout_s:g})")
    d.add_argument("--repeat", type=_positive(int), default=1,
                   help="run every recipe this many times, in rounds, and report the median run (default 1)")
    d.add_argument("--recipes", nargs="+", metavar="RECIPE", choices=list(train.RECIPES),
                   help="recipes to run (default: all): " + " ".join(train.RECIPES))
    d.add_argument("--json", metavar="FILE", help="write the results as JSON")
    d.add_argument("--plot", metavar="FILE.png", help="draw images/s per recipe")

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
        "train": _bench_train,
    }
    try:
        return commands[args.kind](args)
    except ShmpipeError as exc:
        print(f"shmpipe bench {args.kind}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
