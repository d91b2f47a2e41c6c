"""The shmpipe command line.

    shmpipe bench feed         how long a training loop waits for its next batch, every way of feeding it
    shmpipe bench throughput   transport-bound GB/s and batches/s, every transport
    shmpipe bench serialize    every serialization path, in one process
    shmpipe bench train        end to end: a JPEG pipeline into Keras, torch and JAX training, every loader
    shmpipe bench ranks        N ranks fed by one shared pool vs one pipeline or DataLoader each
    shmpipe bench resume       a JPEG dataset: images/s and the first batch after resuming, shmpipe and its peers
    shmpipe bench nodes        K simulated nodes x L ranks, each rank a fresh process: shmpipe vs DistributedSampler
    shmpipe doctor             check this machine for what breaks pipelines
    shmpipe clean              remove segments left by processes that died
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from shmpipe import _doctor
from shmpipe import clean as do_clean
from shmpipe.bench import feed, nodes, ranks, resume, serialize, throughput, train
from shmpipe.bench._report import Progress, environment, human_size, parse_size
from shmpipe.bench._report import output_captured as _output_captured
from shmpipe.errors import ShmpipeError, TransportUnavailableError

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


def _write_json(path: str | None, kind: str, payload: dict[str, Any], quiet: bool = False) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"benchmark": kind, "environment": environment(), **payload}, f, indent=2)
        if not quiet:
            print(f"wrote {path}")


def _bench_feed(args: argparse.Namespace) -> int:
    cfg = feed.FeedConfig(
        workers=args.workers or multiprocessing.cpu_count(),
        batches=args.batches,
        shape=args.shape,
        fetch_s=args.fetch,
        compute_s=args.compute,
        train_s=args.train,
    )
    recipes = args.recipes or list(feed.available_recipes())
    # The second run: only where the first is producer-bound, and only for
    # the recipes with producer processes (the plain generator and tf.data
    # have one producer whatever the setting).
    bound_cfg: feed.FeedConfig | None = None
    bound_recipes = [r for r in recipes if r not in ("generator", "tf.data")]
    if not args.recipes:  # the comparison that matters; `bench throughput` has every transport
        bound_recipes = [r for r in bound_recipes if r in ("mp.Queue", "ray.util.iter", "shmpipe:shm",
                                                           "shmpipe:shm+reserve")]
    if args.transport_bound_workers != 0 and cfg.producer_bound and bound_recipes:
        bound_cfg = feed.transport_bound(cfg, args.transport_bound_batches)
        if args.transport_bound_workers:
            bound_cfg = dataclasses.replace(bound_cfg, workers=args.transport_bound_workers)
    out_dir = args.out or time.strftime("shmpipe-bench-feed-%Y%m%d-%H%M%S")
    os.makedirs(out_dir, exist_ok=True)
    log_path = None if args.verbose else os.path.join(out_dir, "output.log")

    def batches(c: feed.FeedConfig, names: list[str]) -> int:
        single = sum(1 for r in names if r in ("generator", "tf.data"))
        return single * c.batches + (len(names) - single) * c.batches * c.workers

    total = batches(cfg, recipes) + (batches(bound_cfg, bound_recipes) if bound_cfg else 0)
    print(
        f"shmpipe bench feed: how long a training loop waits for its next batch, fed every way side by side "
        f"(a batch: {cfg.shape} float32, {_mb(cfg.shape)} MB, and {cfg.target_shape}; a producer takes "
        f"fetch {cfg.fetch_s} s + compute {cfg.compute_s} s per batch; train step {cfg.train_s} s)",
        flush=True,
    )
    bound: list[feed.RecipeResult] | None = None
    ray_recipes = set(feed.RAY_RECIPES) & set(recipes + bound_recipes)
    try:
        with _output_captured(log_path) as terminal:
            progress = Progress(total, "bench feed", file=terminal)
            workers = max(cfg.workers, bound_cfg.workers if bound_cfg else 0)
            with progress.running(), feed.one_ray(workers + 1, bool(ray_recipes)) as ray_start_s:
                results = feed.run(cfg, recipes, progress=lambda name, n: progress.step(name, n or 0))
                if bound_cfg is not None:
                    tag = f" ({bound_cfg.workers} producers)"
                    bound = feed.run(
                        bound_cfg, bound_recipes, progress=lambda name, n: progress.step(name + tag, n or 0)
                    )
    except BaseException:
        if log_path:
            print(f"(other libraries' output is in {log_path})", file=sys.stderr)
        raise

    workers_from = "cpu_count()" if not args.workers else "--workers"
    print(f"\n{cfg.workers} producers ({workers_from}), {cfg.batches} batches each"
          + (": producer-bound, the floor sets the pace" if cfg.producer_bound else ""))
    print(feed.table(results))
    if bound_cfg is not None and bound is not None:
        print(f"\nTransport-bound: {bound_cfg.workers} producers, {bound_cfg.batches} batches each "
              f"(together they outpace the {cfg.train_s} s step: the wait above the floor is the transport's)")
        print(feed.table(bound))
    print()
    for line in feed.summary(results, bound):
        print(line)
    if ray_start_s is not None:
        print(f"Ray started once, in {ray_start_s:.1f} s, for {' and '.join(sorted(ray_recipes))} "
              "(not in their first batch).")
    print(
        "\nwait per batch: the mean wait once every producer has delivered a batch (until then the waits carry "
        "the start-up: see first batch); "
        "floor: the least wait the producers allow, if moving a batch cost nothing; "
        "trainer CPU per batch: CPU time of the training process (all its threads) per batch."
    )

    payload: dict[str, Any] = {"config": cfg.__dict__, "results": [r.as_dict() for r in results]}
    if bound_cfg is not None and bound is not None:
        payload["transport_bound"] = {"config": bound_cfg.__dict__, "results": [r.as_dict() for r in bound]}
    json_path = args.json or os.path.join(out_dir, "feed.json")
    _write_json(json_path, "feed", payload, quiet=True)
    saved = [json_path]
    plot_path = args.plot or os.path.join(out_dir, "feed.png")
    try:
        feed.plot(
            results, plot_path, f"Wait per batch, {cfg.workers} producers", bound=bound,
            bound_title=f"Transport-bound: {bound_cfg.workers} producers" if bound_cfg else "",
        )
        saved.append(plot_path)
    except TransportUnavailableError as exc:  # no matplotlib
        print(f"no plot: {exc}")
    print("\nResults: " + ", ".join(saved))
    if log_path:
        print(f"Other libraries' output (TensorFlow, Ray, the producers): {log_path} (--verbose shows it)")
    return 0


def _mb(shape: tuple[int, ...]) -> str:
    n = 4
    for d in shape:
        n *= d
    return f"{n / 1e6:g}"


def _bench_throughput(args: argparse.Namespace) -> int:
    sizes = _sizes(args.sizes)
    paths = args.paths or throughput.default_paths()
    progress = Progress(len(sizes) * len(paths) * args.repeat, "bench throughput")
    with progress.running():
        results = throughput.run(
            sizes, seconds=args.seconds, min_batches=args.min_batches, workers=args.workers, paths=paths,
            repeat=args.repeat, progress=lambda path, nbytes: progress.step(f"{path} {human_size(nbytes)}"),
        )
    print(f"shmpipe bench throughput: {args.workers} producers, each batch a new float32 array, {args.seconds} s per "
          f"run, {args.repeat} run(s) of each path in rounds: the median run. Steady state: each run's first batches "
          "(as many as the ring holds; one per producer for mp.Queue; 3 for memcpy) are not timed. First batch: from "
          "making the pipeline (starting the processes), in this one process; (warm): the fork server (or Ray) it "
          "starts from ran already, started by an earlier run, which a new job pays in its first batch")
    print(throughput.table(results))
    _write_json(args.json, "throughput", {"workers": args.workers, "results": [r.as_dict() for r in results]})
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


def _bench_resume(args: argparse.Namespace) -> int:
    cfg = resume.ResumeConfig(
        images=args.images, side=args.side, batch_size=args.batch_size, workers=args.workers, at=tuple(args.at),
        repeat=args.repeat, seed=args.seed, timeout_s=args.timeout, kills=args.kills,
    )
    cfg.check()  # before the JPEGs are made
    loaders = args.loaders or list(resume.LOADERS)
    steps = 2 + (len(loaders) * (2 + len(cfg.at)) + 1) * cfg.repeat  # fresh, each position, warm; restarts
    progress = Progress(steps, "bench resume")
    with progress.running():
        report = resume.run(cfg, loaders, progress=progress.step)
    print(resume.describe(report))
    print(resume.table(report.results))
    print()
    for line in resume.summary(report.results):
        print(line)
    if report.one_time_s:
        print("Paid once in the bench's process before the warm column (each new process pays its own in its "
              "first batch): "
              + ", ".join(f"{what} {s:.2f} s" for what, s in report.one_time_s.items()) + ".")
    print()
    print(resume.restarts_table(report.restarts, cfg))
    for r in report.results:
        if r.error:
            print(f"\n{r.loader} failed: {r.error}", file=sys.stderr)
    _write_json(args.json, "resume", report.as_dict())
    if args.plot:
        resume.plot(report.results, args.plot,
                    f"{cfg.images} JPEGs {cfg.side}x{cfg.side}, batches of {cfg.batch_size}, {cfg.workers} workers")
        print(f"wrote {args.plot}")
    return 1 if any(r.error for r in report.results) or report.restarts.error else 0


def _bench_nodes(args: argparse.Namespace) -> int:
    if [v.lower() for v in args.resume] == ["none"]:
        resume_from_to = None
    elif len(args.resume) == 2:
        resume_from_to = (nodes.parse_layout(args.resume[0]), nodes.parse_layout(args.resume[1]))
    else:
        raise SystemExit(f"shmpipe bench nodes: --resume takes two layouts (FROM TO) or 'none', not {args.resume}")
    cfg = nodes.NodesConfig(
        layouts=tuple(args.layouts), images=args.images, side=args.side, batch_size=args.batch_size,
        workers=args.workers, repeat=args.repeat, seed=args.seed, timeout_s=args.timeout, resume=resume_from_to,
        resume_at=args.resume_at,
    )
    cfg.check()  # before the JPEGs are made
    loaders = args.loaders or list(nodes.LOADERS)
    running = [name for name in loaders if nodes.why_not(name) is None]
    jobs = len(cfg.layouts) * len(running) + (1 if cfg.resume and "shmpipe" in running else 0)
    progress = Progress(1 + jobs * cfg.repeat, "bench nodes")
    with progress.running():
        report = nodes.run(cfg, loaders, progress=progress.step)
    print(nodes.describe(report))
    print(nodes.table(report.results))
    print()
    print(nodes.resume_table(report.resume))
    if not report.passed:
        print("\nshmpipe bench nodes: A CHECK FAILED (see the table's checks column)", file=sys.stderr)
    _write_json(args.json, "nodes", report.as_dict())
    if args.plot:
        nodes.plot(report, args.plot, f"{cfg.images} JPEGs {cfg.side}x{cfg.side}, batches of {cfg.batch_size}, "
                                      f"{cfg.workers} workers per node")
        print(f"wrote {args.plot}")
    return 0 if report.passed else 1


def _layout(text: str) -> tuple[int, int]:
    try:
        return nodes.parse_layout(text)
    except ShmpipeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction: {text!r} (say 0.9 or 90%)") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"a position in an epoch is strictly between 0 and 1 (0% and 100%): {text}")
    return value


def _sides(text: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not MIN,MAX: {text!r} (say 96,224)") from None
    return low, high


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default
    (an option without one says in its help what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or any(
            action.default is none for none in (None, False, argparse.SUPPRESS)
        ):
            return text
        default = action.default
        if isinstance(default, (list, tuple)):
            default = " ".join(str(v) for v in default) if isinstance(default, list) else ",".join(map(str, default))
        return f"{text} (default: {str(default).replace('%', '%%')})"


def build_parser() -> argparse.ArgumentParser:
    """The command line (its own function so that tests can read every option)."""
    parser = argparse.ArgumentParser(prog="shmpipe", description=__doc__, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    clean = sub.add_parser(
        "clean",
        help="remove shared-memory segments left by shmpipe processes that died",
        description="Removes this user's shmpipe segments in /dev/shm whose owning process "
        "has died. A segment whose owner is alive is never touched.",
        formatter_class=_HelpFormatter,
    )
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")

    doctor = sub.add_parser(
        "doctor",
        help="check this machine for what breaks pipelines (shared memory, limits, packages)",
        description=_doctor.__doc__,
        formatter_class=_HelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON instead of text")

    bench = sub.add_parser(
        "bench", help="benchmarks: feed, train, throughput, serialize, ranks, resume, nodes",
        formatter_class=_HelpFormatter
    )
    kinds = bench.add_subparsers(dest="kind", required=True)

    # "seed": the benchmark's old name, deprecated (main() says so and runs "feed")
    f = kinds.add_parser("feed", aliases=["seed"],
                         help="how long a training loop waits for its next batch, every way of feeding it "
                              "side by side (seed: its old name, deprecated)",
                         description=feed.__doc__, formatter_class=_HelpFormatter)
    f.add_argument("--workers", type=int, default=None,
                   help=f"producer processes (default: cpu_count(), {multiprocessing.cpu_count()} here)")
    f.add_argument("--batches", type=_positive(int), default=10, help="batches per producer")
    f.add_argument("--shape", type=_shape, default=(4, 1000000, 3), help="sample shape, float32 (4,1000000,3 is 48 MB)")
    f.add_argument("--fetch", type=_positive(float), default=0.5, help="simulated fetch per batch (a sleep), seconds")
    f.add_argument("--compute", type=_positive(float), default=0.0,
                   help="simulated compute per batch (a busy loop), seconds")
    f.add_argument("--train", type=_positive(float), default=0.1, help="simulated training step (a sleep), seconds")
    f.add_argument("--transport-bound-workers", type=_positive(int), default=None, metavar="N",
                   help="producers of the second, transport-bound run; it runs where the first is producer-bound "
                        "(default: enough to make batches 1.5x as fast as the loop takes them: 8 at the defaults; "
                        "0: no second run)")
    f.add_argument("--transport-bound-batches", type=_positive(int), default=4, metavar="N",
                   help="batches per producer in the transport-bound run")
    f.add_argument("--recipes", nargs="+", metavar="RECIPE",
                   help="recipes to run (default: all): generator tf.data mp.Queue ray.util.iter "
                        "shmpipe:<transport> shmpipe:shm+reserve")
    f.add_argument("--out", metavar="DIR",
                   help="folder for the results: feed.json, feed.png and output.log "
                        "(default: ./shmpipe-bench-feed-<date>-<time>)")
    f.add_argument("--json", metavar="FILE", help="write the results as JSON here instead (default: DIR/feed.json)")
    f.add_argument("--plot", metavar="FILE.png", help="draw the waits here instead (default: DIR/feed.png)")
    f.add_argument("-v", "--verbose", action="store_true",
                   help="show other libraries' output (TensorFlow, Ray, the producers) instead of saving it "
                        "to DIR/output.log")

    t = kinds.add_parser("throughput", help="transport-bound throughput, every transport",
                         description=throughput.__doc__, formatter_class=_HelpFormatter)
    t.add_argument("--sizes", nargs="+", default=["64KiB", "1MiB", "48MB"], help="batch sizes, 4KiB to 256MB")
    t.add_argument("--seconds", type=_positive(float), default=0.5, help="timed seconds of each run")
    t.add_argument("--repeat", type=_positive(int), default=3,
                   help="runs of every path at each size, in rounds; the table shows the median run (default 3)")
    t.add_argument("--min-batches", type=_positive(int), default=20, help="at least this many batches per row")
    t.add_argument("--workers", type=int, default=2, help="producer processes")
    t.add_argument("--paths", nargs="+", metavar="PATH",
                   help="memcpy, mp.Queue, 'shm ring', 'shm reserve', 'shm varying', 'shm mixed in slots', "
                        "'<transport> varying', transport:<name> (default: all)")
    t.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (default: no file)")
    t.add_argument("--plot", metavar="FILE.png", help="draw GB/s against batch size into FILE.png (default: no plot)")

    z = kinds.add_parser("serialize", help="serialization paths in one process",
                         description=serialize.__doc__, formatter_class=_HelpFormatter)
    z.add_argument("--sizes", nargs="+", default=["64KiB", "1MiB", "48MB"], help="batch sizes, 4KiB to 256MB")
    z.add_argument("--paths", nargs="+", metavar="PATH", help="which paths (default: all)")
    z.add_argument("--seconds", type=_positive(float), default=0.3, help="timed seconds per path and size")
    z.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (default: no file)")
    z.add_argument("--plot", metavar="FILE.png",
                   help="draw time per batch against batch size into FILE.png (default: no plot)")
    td = train.TrainConfig()  # the defaults, said once
    d = kinds.add_parser("train", help="end to end: a JPEG pipeline into Keras, torch and JAX training, every loader",
                         description=train.__doc__,
                         formatter_class=_HelpFormatter)
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
                   help="steps on a batch in memory after the run, timed for the idle estimate "
                   f"(default {td.reference_steps})")
    d.add_argument("--trainer-threads", type=_positive(int), default=0,
                   help="the trainer's compute threads (default 0: the cores the producers leave, at least 1)")
    d.add_argument("--timeout", type=_positive(float), default=td.timeout_s,
                   help=f"seconds a recipe may run before it is killed (default {td.timeout_s:g})")
    d.add_argument("--repeat", type=_positive(int), default=1,
                   help="run every recipe this many times, in rounds, and report the median run (default 1)")
    d.add_argument("--recipes", nargs="+", metavar="RECIPE", choices=list(train.RECIPES),
                   help="recipes to run (default: all): " + " ".join(train.RECIPES))
    d.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (default: no file)")
    d.add_argument("--plot", metavar="FILE.png", help="draw images/s per recipe into FILE.png (default: no plot)")
    r = kinds.add_parser("ranks", help="N ranks: one shared pool of producers vs one pipeline or DataLoader each",
                         description=ranks.__doc__,
                         formatter_class=_HelpFormatter)
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
    r.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (default: no file)")
    r.add_argument("--plot", metavar="FILE.png",
                   help="draw batches/s, CPU per batch and memory per setup into FILE.png (default: no plot)")
    rd = resume.ResumeConfig()  # the defaults, said once
    e = kinds.add_parser("resume", help="a JPEG dataset: images/s and the first batch after resuming, shmpipe and "
                                        "its peers (StatefulDataLoader, Grain, DataLoader)",
                         description=resume.__doc__, formatter_class=_HelpFormatter)
    e.add_argument("--images", type=_positive(int), default=rd.images,
                   help=f"JPEG files, made at start in a temporary folder: the epoch (default {rd.images})")
    e.add_argument("--side", type=_positive(int), default=rd.side,
                   help=f"each JPEG is SIDE x SIDE RGB pixels (default {rd.side})")
    e.add_argument("--batch-size", type=_positive(int), default=rd.batch_size,
                   help=f"images per batch (default {rd.batch_size})")
    e.add_argument("--workers", type=_positive(int), default=rd.workers,
                   help=f"each loader's worker processes (default {rd.workers})")
    e.add_argument("--at", type=_fraction, nargs="+", default=list(rd.at), metavar="FRACTION",
                   help="checkpoints after these fractions of the epoch (default "
                        + " ".join(f"{f:g}" for f in rd.at) + ")")
    e.add_argument("--repeat", type=_positive(int), default=rd.repeat,
                   help=f"rounds of every loader; the table shows the median (default {rd.repeat})")
    e.add_argument("--seed", type=_positive(int), default=rd.seed,
                   help=f"the JPEGs' pixels and every loader's shuffle (default {rd.seed})")
    e.add_argument("--timeout", type=_positive(float), default=rd.timeout_s,
                   help=f"the most seconds one batch may take (default {rd.timeout_s:g})")
    e.add_argument("--kills", type=_positive(int), default=rd.kills,
                   help=f"SIGKILLs of shmpipe's producers per epoch in the restarts section, with max_restarts=KILLS "
                        f"(default {rd.kills}; 0: no restarts section)")
    e.add_argument("--loaders", nargs="+", metavar="LOADER", choices=list(resume.LOADERS),
                   help="loaders to run (default: all; one not installed is reported so): "
                        + " ".join(repr(n) if " " in n else n for n in resume.LOADERS))
    e.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (default: no file)")
    e.add_argument("--plot", metavar="FILE.png",
                   help="draw images/s and the first batches per loader into FILE.png (default: no plot)")
    nd = nodes.NodesConfig()  # the defaults, said once
    n = kinds.add_parser("nodes", help="K simulated nodes x L ranks, each rank a fresh process: the job's images/s, "
                                       "the first batch, a resume onto another layout; shmpipe vs the DataLoader "
                                       "with DistributedSampler (and Grain)",
                         description=nodes.__doc__, formatter_class=_HelpFormatter)
    n.add_argument("--layouts", type=_layout, nargs="+", default=list(nd.layouts), metavar="KxL",
                   help="nodes x ranks per node, each a job of its own (default "
                        + " ".join(nodes.layout_name(x) for x in nd.layouts) + ")")
    n.add_argument("--images", type=_positive(int), default=nd.images,
                   help=f"JPEG files, made at start in a temporary folder: the epoch (default {nd.images})")
    n.add_argument("--side", type=_positive(int), default=nd.side,
                   help=f"each JPEG is SIDE x SIDE RGB pixels (default {nd.side})")
    n.add_argument("--batch-size", type=_positive(int), default=nd.batch_size,
                   help=f"images per batch (default {nd.batch_size})")
    n.add_argument("--workers", type=_positive(int), default=nd.workers,
                   help=f"worker processes per node: shmpipe's producers; the DataLoader's and Grain's are "
                        f"WORKERS // L per rank, at least 1 (default {nd.workers})")
    n.add_argument("--repeat", type=_positive(int), default=nd.repeat,
                   help=f"rounds of every layout and loader; the table shows the median (default {nd.repeat})")
    n.add_argument("--seed", type=_positive(int), default=nd.seed,
                   help=f"the JPEGs' pixels and every loader's shuffle (default {nd.seed})")
    n.add_argument("--timeout", type=_positive(float), default=nd.timeout_s,
                   help=f"the most seconds one job (all its ranks) may take (default {nd.timeout_s:g})")
    assert nd.resume is not None
    n.add_argument("--resume", nargs="+", default=[nodes.layout_name(x) for x in nd.resume], metavar="LAYOUT",
                   help="FROM TO: shmpipe's state at a share of an epoch of FROM (RESUME_AT), resumed by a job of "
                        "TO, against a fresh job of TO; 'none': no resume section (default "
                        + " ".join(nodes.layout_name(x) for x in nd.resume) + ")")
    n.add_argument("--resume-at", type=_fraction, default=nd.resume_at, metavar="FRACTION",
                   help=f"where in the epoch FROM's state is taken (default {nd.resume_at:g})")
    n.add_argument("--loaders", nargs="+", metavar="LOADER", choices=list(nodes.LOADERS),
                   help="loaders to run (default: all; one not installed is reported so): " + " ".join(nodes.LOADERS))
    n.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (default: no file)")
    n.add_argument("--plot", metavar="FILE.png",
                   help="draw the job's images/s, the first batches and the resume into FILE.png (default: no plot)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "clean":
        removed = do_clean(dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        for name in removed:
            print(f"{verb} {name}")
        print(f"{verb} {len(removed)} segment(s)")
        return 0
    if args.command == "doctor":
        return _doctor.main(as_json=args.json)
    if args.kind == "seed":  # the old name of `bench feed`
        print("shmpipe bench seed is deprecated: use `shmpipe bench feed` (the same benchmark)", file=sys.stderr)
        args.kind = "feed"
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "feed": _bench_feed, "throughput": _bench_throughput, "serialize": _bench_serialize,
        "train": _bench_train, "ranks": _bench_ranks, "resume": _bench_resume, "nodes": _bench_nodes,
    }
    try:
        return commands[args.kind](args)
    except ShmpipeError as exc:
        print(f"shmpipe bench {args.kind}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
