"""Long runs: how fast a map-style dataset loads, and what resuming it costs.

A map-style dataset of JPEG files (made with Pillow at start, in a
temporary folder: --images files of --side x --side RGB pixels) whose
``__getitem__`` reads and decodes one file in the loader's worker and
returns ``{"image": uint8 (side, side, 3), "label": int, "index": int}``.
The same dataset, the same number of workers, the same batch size and a
shuffled epoch go through each loader, in one run, one after the other:

  shmpipe              shmpipe.from_dataset(dataset, shuffle=True, ...);
                       resumes with load_state_dict() on a new pipeline
  shmpipe (fork)       the same with start_method="fork": its producers
                       forked from the trainer, as the DataLoaders'
                       workers are (shmpipe's default is forkserver)
  StatefulDataLoader   torchdata's StatefulDataLoader; resumes with its
                       load_state_dict() on a new loader
  Grain                grain.python.DataLoader (IndexSampler, Batch,
                       worker_count); resumes with its iterator's
                       set_state() on a new loader's iterator
  DataLoader           torch's DataLoader. It has no resume: a new loader
                       fast-forwards, iterating the batches before the
                       position and throwing them away

A peer that is not installed is reported as such, never measured. Per
loader and round:

- one uninterrupted epoch from a fresh loader: its first batch (from making
  the loader to the first batch in hand), its images/s (from the first
  batch to the last, the checkpoints taken on the way not counted), each
  batch's sample indices, and the loader's checkpoint after 10%, 50% and
  90% of the epoch's batches (--at);
- for each checkpoint, a new loader resumed from it: the time from making
  it to its first batch. In the first round every resumed loader is then
  run to the end of the epoch and checked: its batches against the rest of
  the uninterrupted epoch, and the samples it fetched (the dataset appends
  each fetched index to a log file) against the samples before the
  position.

The table shows the median of --repeat rounds (the JSON has every run).
Each process's one-time costs (importing torch, torchdata and Grain;
starting shmpipe's forkserver) are paid once before the measurements and
reported apart.

Then producer restarts under SIGKILL, shmpipe's alone (no peer replaces a
dead worker): per round, a fault-free epoch, and an epoch of
``from_dataset(..., max_restarts=K)`` in which K random producers are
SIGKILLed after random batches (--kills K, in the first three quarters of
the epoch), each from making the pipeline to its last batch
(shmpipe/bench/_restarts.py says what is checked and counted).

The dataset is shmpipe/bench/_jpegs.py's (bench nodes reads it too).
"""

from __future__ import annotations

import abc
import copy
import importlib
import importlib.util
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import shmpipe
from shmpipe.bench._jpegs import JpegFolder, fetched, make_jpegs
from shmpipe.bench._jpegs import ids as _ids
from shmpipe.bench._report import fmt as _fmt
from shmpipe.bench._report import median as _median
from shmpipe.bench._report import pyplot
from shmpipe.bench._restarts import RestartsResult, restarts_available, restarts_section, restarts_table
from shmpipe.bench._resume_config import ResumeConfig
from shmpipe.errors import ShmpipeValueError, TransportUnavailableError

__all__ = [
    "LOADERS", "JpegFolder", "LoaderResult", "ResumeConfig", "ResumeReport", "fetched",
    "make_jpegs", "plot", "restarts_available", "restarts_section", "restarts_table", "run", "summary", "table",
]


# -- the loaders ------------------------------------------------------------------


@dataclass
class _Open:
    """A loader being iterated: its batches, and how to stop it."""

    batches: Iterator[Any]
    close: Callable[[], None]
    loader: Any = None


class _Loader(abc.ABC):
    """One way of loading the dataset: a fresh epoch, a checkpoint after k
    of its batches, a new loader resumed from that checkpoint."""

    name: ClassVar[str]
    resumes_by: ClassVar[str]
    #: (module, what to install) the loader needs beside torch-free shmpipe
    needs: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: what it imports, in order (_one_time imports them before the timing)
    imports: ClassVar[tuple[str, ...]] = ()
    #: whose version the report gives
    version_of: ClassVar[str | None] = None

    def why_not(self) -> str | None:
        for module, how in (("PIL", "pip install pillow"), *self.needs):
            if importlib.util.find_spec(module) is None:
                return f"not installed: {module} ({how})"
        return None

    def version(self) -> str | None:
        if self.version_of is None:
            return shmpipe.__version__
        try:
            from importlib.metadata import version

            return version(self.version_of)
        except Exception:  # noqa: BLE001 - a version is only informative
            return None

    @abc.abstractmethod
    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> _Open: ...

    @abc.abstractmethod
    def checkpoint(self, opened: _Open, k: int) -> Any:
        """The loader's checkpoint after k batches were handed out."""

    @abc.abstractmethod
    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> _Open:
        """A new loader whose next batch is the first after the checkpoint."""


class _Shmpipe(_Loader):
    name = "shmpipe"
    resumes_by = "position: load_state_dict() on a new pipeline"

    def __init__(self, start_method: str | None = None, name: str | None = None) -> None:
        self.start_method = start_method
        if name is not None:
            self.name = name  # type: ignore[misc]  # a variant's row

    def _pipe(self, ds: JpegFolder, cfg: ResumeConfig) -> Any:
        return shmpipe.from_dataset(
            ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers, seed=cfg.seed,
            timeout=cfg.timeout_s, start_method=self.start_method,
        )

    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> _Open:
        pipe = self._pipe(ds, cfg)
        return _Open(iter(pipe), pipe.close, pipe)

    def checkpoint(self, opened: _Open, k: int) -> Any:
        # Through JSON, as a checkpoint file gives it back.
        return json.loads(json.dumps(opened.loader.state_dict()))

    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> _Open:
        pipe = self._pipe(ds, cfg)
        try:
            pipe.load_state_dict(state)
        except BaseException:
            pipe.close()
            raise
        return _Open(iter(pipe), pipe.close, pipe)


def _peer(module: str) -> Any:
    """A peer's module, imported by name: torchdata and Grain are optional
    and untyped, and a name mypy cannot follow is checked nowhere (an
    import statement would fail the type check where they are missing)."""
    return importlib.import_module(module)


def _torch_generator(seed: int) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


def _close_torch(it: Any) -> Callable[[], None]:
    def close() -> None:
        # The multi-worker iterator stops its workers when collected; this
        # stops them now, so the next loader's timing does not share the
        # cores with them. (_shutdown_workers is private, but it is what
        # the iterator's __del__ calls.)
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    return close


class _DataLoader(_Loader):
    name = "DataLoader"
    resumes_by = "none: a new loader fast-forwards, iterating and discarding the batches before the position"
    needs = (("torch", 'pip install "shmpipe[torch]"'),)
    imports = ("torch", "torch.utils.data")
    version_of = "torch"

    def _loader(self, ds: JpegFolder, cfg: ResumeConfig) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(
            ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
            generator=_torch_generator(cfg.seed), timeout=cfg.timeout_s,
        )

    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> _Open:
        it = iter(self._loader(ds, cfg))
        return _Open(it, _close_torch(it))

    def checkpoint(self, opened: _Open, k: int) -> Any:
        return k  # all a plain DataLoader can go back to: how many batches to skip

    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> _Open:
        it = iter(self._loader(ds, cfg))
        try:
            for _ in range(int(state)):
                next(it)
        except BaseException:
            _close_torch(it)()
            raise
        return _Open(it, _close_torch(it))


class _StatefulDataLoader(_Loader):
    name = "StatefulDataLoader"
    resumes_by = "its load_state_dict() on a new loader (the sampler fast-forwarded)"
    needs = (("torch", 'pip install "shmpipe[torch]"'), ("torchdata", "pip install torchdata"))
    imports = ("torch", "torch.utils.data", "torchdata.stateful_dataloader")
    version_of = "torchdata"

    def _loader(self, ds: JpegFolder, cfg: ResumeConfig) -> Any:
        StatefulDataLoader = _peer("torchdata.stateful_dataloader").StatefulDataLoader
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which torch 2.13 says is
            # deprecated, on every loader: the peer's noise, not this run's.
            warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
            return StatefulDataLoader(
                ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
                generator=_torch_generator(cfg.seed), timeout=cfg.timeout_s,
            )

    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> _Open:
        loader = self._loader(ds, cfg)
        it = iter(loader)
        return _Open(it, _close_torch(it), loader)

    def checkpoint(self, opened: _Open, k: int) -> Any:
        return copy.deepcopy(opened.loader.state_dict())

    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> _Open:
        loader = self._loader(ds, cfg)
        loader.load_state_dict(state)
        it = iter(loader)
        return _Open(it, _close_torch(it), loader)


class _Grain(_Loader):
    name = "Grain"
    resumes_by = "its checkpoint: get_state() / set_state() on a new loader's iterator"
    needs = (("grain", "pip install grain"),)
    imports = ("grain.python",)
    version_of = "grain"

    def _loader(self, ds: JpegFolder, cfg: ResumeConfig) -> Any:
        grain = _peer("grain.python")
        sampler = grain.IndexSampler(
            len(ds), shard_options=grain.NoSharding(), shuffle=True, num_epochs=1, seed=cfg.seed
        )
        return grain.DataLoader(
            data_source=ds, sampler=sampler, operations=[grain.Batch(cfg.batch_size, drop_remainder=False)],
            worker_count=cfg.workers,
        )

    @staticmethod
    def _close(it: Any) -> Callable[[], None]:
        def close() -> None:
            # Grain 0.2's DataLoaderIterator has no close(); the dataset
            # iterator it wraps does (it stops the worker processes).
            inner = getattr(it, "_iterator", None)
            if inner is not None and hasattr(inner, "close"):
                inner.close()

        return close

    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> _Open:
        it = iter(self._loader(ds, cfg))
        return _Open(it, self._close(it))

    def checkpoint(self, opened: _Open, k: int) -> Any:
        return opened.batches.get_state()  # type: ignore[attr-defined]  # Grain's iterator

    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> _Open:
        it = iter(self._loader(ds, cfg))
        try:
            it.set_state(state)
        except BaseException:
            self._close(it)()
            raise
        return _Open(it, self._close(it))


#: Loader name -> its implementation (the order is the table's).
LOADERS: dict[str, _Loader] = {
    loader.name: loader
    for loader in (
        _Shmpipe(),
        # The same, its producers forked from this process as the
        # DataLoaders' workers are (shmpipe's default start method is
        # forkserver): how much of its first batch is the producers' start.
        _Shmpipe("fork", "shmpipe (fork)"),
        _StatefulDataLoader(),
        _Grain(),
        _DataLoader(),
    )
}


# -- measuring ----------------------------------------------------------------------


@dataclass
class Check:
    """A resumed loader run to the end of the epoch, against the
    uninterrupted epoch of the same loader."""

    at: str
    batch: int  # the checkpoint was taken after this many batches
    resumed_batches: int = 0
    resumed_equals_rest: bool = False  # its batches are those of the uninterrupted epoch after `batch`, in order
    fetched: int = 0  # samples the resumed loader fetched
    fetched_before_position: int = 0  # of those, samples handed out before the position
    fetched_exactly_rest: bool = False  # it fetched each sample after the position once, and nothing else


@dataclass
class LoaderResult:
    loader: str
    resumes_by: str = ""
    version: str | None = None
    images: int = 0  # in the uninterrupted epoch
    images_per_s: float = float("nan")  # median of the rounds
    runs_images_per_s: list[float] = field(default_factory=list)
    first_batch_s: dict[str, float] = field(default_factory=dict)  # "fresh" and each position: median
    runs_first_batch_s: dict[str, list[float]] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)  # label -> batches before the checkpoint
    checks: list[Check] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ResumeReport:
    config: ResumeConfig
    one_time_s: dict[str, float]  # imports and shmpipe's forkserver, before the measurements
    results: list[LoaderResult]
    restarts: RestartsResult
    make_jpegs_s: float = 0.0
    jpeg_bytes: int = 0
    pillow: str | None = None  # the decoder's version

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": {**asdict(self.config), "batches": self.config.batches},
            "pillow": self.pillow,
            "make_jpegs_s": self.make_jpegs_s,
            "jpeg_bytes": self.jpeg_bytes,
            "one_time_s": self.one_time_s,
            "results": [r.as_dict() for r in self.results],
            "restarts": self.restarts.as_dict(),
        }


@dataclass
class _Epoch:
    first_batch_s: float
    images_per_s: float
    batches: list[list[int]]
    states: dict[int, Any]


def _epoch(loader: _Loader, ds: JpegFolder, cfg: ResumeConfig, at: set[int]) -> _Epoch:
    """One uninterrupted epoch from a fresh loader, its checkpoints taken
    after each k in `at` batches (their time left out of the rate)."""
    t0 = time.perf_counter()
    opened = loader.fresh(ds, cfg)
    batches: list[list[int]] = []
    states: dict[int, Any] = {}
    paused = 0.0
    t_first = float("nan")
    try:
        for batch in opened.batches:
            batches.append(_ids(batch))
            del batch  # shmpipe: the slot goes back before the next batch is taken
            if len(batches) == 1:
                t_first = time.perf_counter()
            if len(batches) in at:
                t = time.perf_counter()
                states[len(batches)] = loader.checkpoint(opened, len(batches))
                paused += time.perf_counter() - t
        t_end = time.perf_counter()
    finally:
        opened.close()
    after_first = sum(len(b) for b in batches[1:])
    window = t_end - t_first - paused
    return _Epoch(t_first - t0, after_first / window if window > 0 else float("nan"), batches, states)


def _resumed(
    loader: _Loader, ds: JpegFolder, cfg: ResumeConfig, state: Any, to_the_end: bool
) -> tuple[float, list[list[int]]]:
    """A new loader resumed from `state`: the time from making it to its
    first batch, and its batches (the first only, or all to the end of the
    epoch)."""
    t0 = time.perf_counter()
    opened = loader.resume(ds, cfg, state)
    try:
        first = next(opened.batches)
        first_s = time.perf_counter() - t0
        batches = [_ids(first)]
        del first
        if to_the_end:
            for batch in opened.batches:
                batches.append(_ids(batch))
                del batch
    finally:
        opened.close()
    return first_s, batches


def _one_time(
    loaders: list[_Loader], ds: JpegFolder, cfg: ResumeConfig, results: dict[str, LoaderResult]
) -> dict[str, float]:
    """Each process's one-time costs, paid here so that no loader's first
    batch carries them: importing torch, torchdata and Grain, and starting
    shmpipe's forkserver (a pipeline of one producer to its first batch).
    A loader whose modules are there but do not import (a package installed
    without its dependencies) is skipped, saying why."""
    out: dict[str, float] = {}
    for loader in loaders:
        for module in loader.imports:
            if f"import {module}" in out:
                continue
            t = time.perf_counter()
            try:
                importlib.import_module(module)
            except ImportError as exc:
                results[loader.name].skipped = f"not installed: {module} does not import ({exc})"
                break
            out[f"import {module}"] = time.perf_counter() - t
    if any(isinstance(loader, _Shmpipe) and loader.start_method is None for loader in loaders):
        t = time.perf_counter()
        with shmpipe.from_dataset(ds, batch_size=1, num_workers=1, timeout=cfg.timeout_s) as pipe:
            next(iter(pipe))
        out["shmpipe: forkserver and a first pipeline"] = time.perf_counter() - t
    return out


def run(
    cfg: ResumeConfig,
    loaders: list[str] | None = None,
    progress: Callable[[str], None] | None = None,
    folder: str | None = None,
) -> ResumeReport:
    """Makes the JPEGs (in `folder`, or a temporary folder removed after),
    then measures each loader in rounds (a change of load hits all alike).
    A loader that cannot run here comes back with `skipped`, one that
    failed with `error`."""
    cfg.check()
    if importlib.util.find_spec("PIL") is None:
        raise TransportUnavailableError("bench resume decodes JPEGs with Pillow: pip install pillow")
    names = list(LOADERS) if loaders is None else loaders
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        raise ShmpipeValueError(f"unknown loaders {unknown}; known: {', '.join(LOADERS)}")
    results = {n: LoaderResult(n, LOADERS[n].resumes_by, LOADERS[n].version()) for n in names}
    for name, r in results.items():
        r.skipped = LOADERS[name].why_not()
    running = [LOADERS[n] for n in names if results[n].skipped is None]
    positions = cfg.positions()
    with tempfile.TemporaryDirectory(prefix="shmpipe-bench-resume-") as tmp:
        images_dir = folder or os.path.join(tmp, "images")
        os.makedirs(images_dir, exist_ok=True)
        if progress:
            progress("making the JPEGs")
        t = time.perf_counter()
        make_jpegs(images_dir, cfg.images, cfg.side, cfg.seed, cfg.quality)
        made_s = time.perf_counter() - t
        jpeg_bytes = sum(os.path.getsize(os.path.join(images_dir, f)) for f in os.listdir(images_dir))
        base = JpegFolder(images_dir, cfg.images)
        one_time = _one_time(running, base, cfg, results) if running else {}
        running = [loader for loader in running if results[loader.name].skipped is None]
        logs = iter(range(1 << 62))

        def with_log() -> tuple[JpegFolder, str]:
            log = os.path.join(tmp, f"fetched-{next(logs)}")
            return base.logged(log), log

        for round_no in range(cfg.repeat):
            for loader in running:
                r = results[loader.name]
                if r.error:
                    continue
                tag = "" if cfg.repeat == 1 else f" ({round_no + 1}/{cfg.repeat})"
                try:
                    if progress:
                        progress(f"{loader.name}: an epoch{tag}")
                    ds, _ = with_log()
                    epoch = _epoch(loader, ds, cfg, {k for _, k in positions})
                    r.images = sum(len(b) for b in epoch.batches)
                    r.runs_images_per_s.append(epoch.images_per_s)
                    r.runs_first_batch_s.setdefault("fresh", []).append(epoch.first_batch_s)
                    for label, k in positions:
                        if progress:
                            progress(f"{loader.name}: resumed at {label}{tag}")
                        r.positions[label] = k
                        check = round_no == 0  # every resumed loader of the first round runs to the end
                        ds, log = with_log()
                        first_s, rest = _resumed(loader, ds, cfg, epoch.states[k], to_the_end=check)
                        r.runs_first_batch_s.setdefault(label, []).append(first_s)
                        if check:
                            r.checks.append(_check(label, k, epoch.batches, rest, fetched(log)))
                except Exception as exc:  # noqa: BLE001 - reported in the table, the others go on
                    r.error = f"{type(exc).__name__}: {exc}"
        if "shmpipe" in names:
            restarts = restarts_section(base, cfg, progress, lambda: with_log()[1])
        else:
            restarts = RestartsResult(why="not run: shmpipe is not among the loaders", kills=cfg.kills)
    for r in results.values():
        r.images_per_s = _median(r.runs_images_per_s)
        r.first_batch_s = {k: _median(v) for k, v in r.runs_first_batch_s.items()}
    import PIL

    return ResumeReport(
        cfg, one_time, list(results.values()), restarts, made_s, jpeg_bytes, PIL.__version__
    )


def _check(label: str, k: int, epoch: list[list[int]], rest: list[list[int]], got: list[int]) -> Check:
    before = {i for b in epoch[:k] for i in b}
    want = sorted(i for b in epoch[k:] for i in b)
    return Check(
        at=label,
        batch=k,
        resumed_batches=len(rest),
        resumed_equals_rest=rest == epoch[k:],
        fetched=len(got),
        fetched_before_position=sum(1 for i in got if i in before),
        fetched_exactly_rest=sorted(got) == want,
    )


# -- the report ---------------------------------------------------------------------


def _labels(results: list[LoaderResult]) -> list[str]:
    for r in results:
        if r.positions:
            return list(r.positions)
    return []


def _ok(r: LoaderResult) -> bool:
    return not r.skipped and not r.error


def table(results: list[LoaderResult]) -> str:
    """Markdown: per loader images/s (the median round, and the slowest and
    fastest), the first batch fresh and resumed at each position (medians),
    and what the check of the resumed runs found."""
    labels = _labels(results)
    head = ["loader", "resumes by", "images/s", "first batch: fresh",
            *(f"resumed at {lab}" for lab in labels), "resumed = rest of epoch", "fetched before position"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | " + " | ".join(["---:"] * (len(head) - 2)) + " |"]
    for r in results:
        if not _ok(r):
            what = r.skipped if r.skipped else f"failed: {(r.error or '').splitlines()[0]}"
            lines.append(f"| {r.loader} | {r.resumes_by} | {what} |" + " |" * (len(head) - 3))
            continue
        times = [_fmt(r.first_batch_s.get("fresh"), ".3f") + " s"]
        times += [_fmt(r.first_batch_s.get(lab), ".3f") + " s" for lab in labels]
        if r.checks:
            equal = "yes" if all(c.resumed_equals_rest for c in r.checks) else "NO: " + ", ".join(
                c.at for c in r.checks if not c.resumed_equals_rest)
            before = ", ".join(f"{c.fetched_before_position:,}" for c in r.checks)
        else:
            equal, before = "-", "-"
        rate = _fmt(r.images_per_s, ",.0f")
        if len(r.runs_images_per_s) > 1:
            lo, hi = _spread(r.runs_images_per_s)
            rate += f" ({lo:,.0f}-{hi:,.0f})"
        lines.append(
            f"| {r.loader} | {r.resumes_by} | {rate} | " + " | ".join(times)
            + f" | {equal} | {before} |"
        )
    return "\n".join(lines)


def _spread(values: list[float]) -> tuple[float, float]:
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def summary(results: list[LoaderResult]) -> list[str]:
    """Plain sentences: per peer, where it beat shmpipe (median of the
    rounds, and whether the rounds overlap); what the fork variant says of
    the producers' start; what the checks found."""
    by = {r.loader: r for r in results}
    mine = by.get("shmpipe")
    if mine is None or not _ok(mine):
        return ["shmpipe was not measured: no comparison."]
    out: list[str] = []
    for other in results:
        if other is mine or not _ok(other):
            continue
        wins = _wins(other, mine, results)
        if other.loader.startswith("shmpipe"):
            if wins:
                out.append(f"{other.loader}, against shmpipe's default start method: " + "; ".join(wins) + ".")
        elif wins:
            out.append(f"Where {other.loader} wins: " + "; ".join(wins) + ".")
        else:
            out.append(f"{other.loader} beat shmpipe on no column (medians).")
    for r in results:
        if not _ok(r) or not r.checks:
            continue
        exact = all(c.resumed_equals_rest for c in r.checks)
        refetched = sum(c.fetched_before_position for c in r.checks)
        out.append(
            f"{r.loader}: resumed batches {'equal' if exact else 'DO NOT equal'} the rest of the uninterrupted "
            f"epoch; {refetched:,} samples before the positions fetched again"
            + (" (no resume: the fast-forward reads them)" if r.loader == "DataLoader" else "")
            + "."
        )
    skipped = [f"{r.loader} ({r.skipped})" for r in results if r.skipped]
    if skipped:
        out.append("Not measured: " + "; ".join(skipped) + ".")
    return out


def _wins(other: LoaderResult, mine: LoaderResult, results: list[LoaderResult]) -> list[str]:
    """The columns where `other` did better than `mine`, each with both
    medians and, where the rounds overlap, a word of caution."""
    metrics: list[tuple[str, Callable[[LoaderResult], list[float]], bool]] = [
        ("images/s", lambda r: r.runs_images_per_s, True),
        *((f"first batch {'fresh' if lab == 'fresh' else 'resumed at ' + lab}",
           (lambda r, lab=lab: r.runs_first_batch_s.get(lab, [])), False)
          for lab in ["fresh", *_labels(results)]),
    ]
    wins = []
    for what, runs, higher_better in metrics:
        theirs, ours = runs(other), runs(mine)
        if not theirs or not ours:
            continue
        t, o = _median(theirs), _median(ours)
        if not ((t > o) if higher_better else (t < o)):
            continue
        (tlo, thi), (olo, ohi) = _spread(theirs), _spread(ours)
        apart = (tlo > ohi) if higher_better else (thi < olo)
        fmt, unit = (",.0f", "") if higher_better else (".3f", " s")
        wins.append(f"{what} {t:{fmt}}{unit} against {o:{fmt}}{unit}"
                    + ("" if apart or len(theirs) == 1 else " (the rounds overlap)"))
    return wins


def plot(results: list[LoaderResult], path: str, title: str) -> None:
    """Two panels: images/s per loader, and the first batch fresh and
    resumed at each position (log scale)."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    done = [r for r in results if _ok(r)]
    labels = ["fresh", *_labels(done)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.9 * max(2, len(done))))
    names = [r.loader for r in done][::-1]
    rates = [r.images_per_s for r in done][::-1]
    colors = ["#4C72B0" if n == "shmpipe" else "#9DB4D8" if n.startswith("shmpipe") else "#999999" for n in names]
    left.barh(names, rates, color=colors)
    spread = [_spread(r.runs_images_per_s) for r in done][::-1]
    if any(len(r.runs_images_per_s) > 1 for r in done):  # whiskers: the slowest and the fastest round
        left.errorbar(rates, names, xerr=[[v - lo for v, (lo, _) in zip(rates, spread, strict=True)],
                                          [hi - v for v, (_, hi) in zip(rates, spread, strict=True)]],
                      fmt="none", ecolor="black", capsize=3)
    for y, (v, (_, hi)) in enumerate(zip(rates, spread, strict=True)):
        left.text(max(v, hi), y, f" {v:,.0f}/s", va="center", fontsize=8)
    left.set_xlim(0, max((hi for _, hi in spread), default=1) * 1.3)
    left.set_xlabel("images/s, one epoch (bar: median of the rounds; whiskers: slowest and fastest)")
    left.set_title("Throughput")
    shades = ["#222222", "#5b5b5b", "#8c8c8c", "#bdbdbd", "#dedede"]
    height = 0.8 / len(labels)
    for j, lab in enumerate(labels):
        ys = [y + 0.4 - height * (j + 0.5) for y in range(len(done))]
        vals = [r.first_batch_s.get(lab, float("nan")) for r in done][::-1]
        right.barh(ys, vals, height=height, color=shades[j % len(shades)], label=lab)
    right.set_yticks(range(len(done)), names)
    right.set_xscale("log")
    right.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    right.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} s"))
    right.xaxis.set_minor_formatter(NullFormatter())
    right.set_xlabel("from making the loader to its first batch (median; log scale)")
    right.set_title("First batch: fresh, and resumed at")
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(report: ResumeReport) -> str:
    cfg = report.config
    return (
        f"shmpipe bench resume: {cfg.images} JPEGs of {cfg.side}x{cfg.side} RGB "
        f"({report.jpeg_bytes / 1e6:.1f} MB, made in {report.make_jpegs_s:.1f} s), decoded with Pillow in the "
        f"workers; shuffled epochs of {cfg.batches} batches of {cfg.batch_size}; {cfg.workers} workers per loader; "
        f"checkpoints after {', '.join(f'{lab} ({k} batches)' for lab, k in cfg.positions())}; "
        f"median of {cfg.repeat} round(s)"
    )
