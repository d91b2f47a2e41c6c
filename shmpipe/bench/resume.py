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

A peer that is not installed is reported as such, never measured.

A job resumed after preemption is a new process, and so is every
measurement of a first batch here, for every loader alike (the clock as a
restarted job meets it; shmpipe/bench/_resume_fresh.py): a ``python``
process that has imported torch, Pillow, NumPy, the dataset's module and
the peer's own modules (torchdata's, Grain's) and read the checkpoint
before its clock starts. Nothing of shmpipe runs there before the clock:
``import shmpipe`` is the first thing inside it (a user's job pays it; it
is cheap: the package imports its modules where they are first used), then
the loader is made (``from_dataset(...)`` and ``load_state_dict()``, or
``DataLoader(...)`` and its fast-forward ...) up to its first batch in
hand, shmpipe's fork server and producers starting inside. Per loader and
round, in new processes:

- one uninterrupted epoch from a fresh loader: its first batch ("new
  process: fresh"), its images/s (from the first batch to the last, the
  checkpoints taken on the way not counted), each batch's sample indices,
  and the loader's checkpoint after 10%, 50% and 90% of the epoch's
  batches (--at);
- for each checkpoint, a new loader resumed from it in a process of its
  own: its first batch ("resumed at"). In the first round every resumed
  loader is then run to the end of the epoch and checked: its batches
  against the rest of the uninterrupted epoch, and the samples it fetched
  (the dataset appends each fetched index to a log file) against the
  samples before the position;
- apart, labelled warm: a fresh loader in the bench's own process, whose
  imports are done and whose shmpipe fork server was started before the
  measurements (its one-time costs, reported apart): what a second pipeline
  of a running job, or a job that called ``shmpipe.prestart()`` early, waits.

Each round measures the loaders in turn, in the other order every other
round. The table shows the medians of --repeat rounds (the JSON has every
run, and each new process's pid and what it had before its clock).

Then producer restarts under SIGKILL, shmpipe's alone (no peer replaces a
dead worker): per round, a fault-free epoch, and an epoch of
``from_dataset(..., max_restarts=K)`` in which K random producers are
SIGKILLed after random batches (--kills K, in the first three quarters of
the epoch), each from making the pipeline to its last batch
(shmpipe/bench/_restarts.py says what is checked and counted).

The dataset is shmpipe/bench/_jpegs.py's (bench nodes reads it too).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import shmpipe
from shmpipe.bench import _resume_fresh
from shmpipe.bench._jpegs import JpegFolder, fetched, make_jpegs
from shmpipe.bench._jpegs import ids as _ids
from shmpipe.bench._report import fmt as _fmt
from shmpipe.bench._report import median as _median
from shmpipe.bench._report import pyplot
from shmpipe.bench._restarts import RestartsResult, restarts_available, restarts_section, restarts_table
from shmpipe.bench._resume_config import ResumeConfig
from shmpipe.bench._resume_loaders import LOADERS, Loader
from shmpipe.errors import ShmpipeValueError, TransportUnavailableError

__all__ = [
    "LOADERS", "JpegFolder", "LoaderResult", "ResumeConfig", "ResumeReport", "fetched",
    "make_jpegs", "plot", "restarts_available", "restarts_section", "restarts_table", "run", "summary", "table",
]


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
    #: In a new process (_resume_fresh): "fresh" and each position, median
    first_batch_s: dict[str, float] = field(default_factory=dict)
    runs_first_batch_s: dict[str, list[float]] = field(default_factory=dict)
    #: Warm: a fresh loader in the bench's own process, its imports done
    #: and shmpipe's fork server running (median, and each round)
    warm_first_batch_s: float = float("nan")
    runs_warm_first_batch_s: list[float] = field(default_factory=list)
    positions: dict[str, int] = field(default_factory=dict)  # label -> batches before the checkpoint
    checks: list[Check] = field(default_factory=list)
    #: Each new process: its pid, what it had before the clock, its times
    processes: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: What the report's first-batch figures are, in its JSON.
CLOCKS = {
    "first_batch_s": "in a new process per measurement, which imported torch, Pillow, NumPy, the dataset's module "
                     "and the peer's own modules before the clock: from the clock (for shmpipe: `import shmpipe` is "
                     "in it, then from_dataset(); for the others: making the loader) to the first batch in hand; "
                     "shmpipe's fork server and producers start inside it",
    "warm_first_batch_s": "warm: a fresh loader in the bench's own process, after its imports and after shmpipe's "
                          "fork server started (one_time_s): from making the loader to its first batch",
}


@dataclass
class ResumeReport:
    config: ResumeConfig
    one_time_s: dict[str, float]  # imports and shmpipe's fork server in the bench's process, before the warm column
    results: list[LoaderResult]
    restarts: RestartsResult
    make_jpegs_s: float = 0.0
    jpeg_bytes: int = 0
    pillow: str | None = None  # the decoder's version

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": {**asdict(self.config), "batches": self.config.batches},
            "clocks": CLOCKS,
            "pillow": self.pillow,
            "make_jpegs_s": self.make_jpegs_s,
            "jpeg_bytes": self.jpeg_bytes,
            "one_time_s": self.one_time_s,
            "results": [r.as_dict() for r in self.results],
            "restarts": self.restarts.as_dict(),
        }


def _one_time(
    loaders: list[Loader], ds: JpegFolder, cfg: ResumeConfig, results: dict[str, LoaderResult]
) -> dict[str, float]:
    """The one-time costs of the bench's own process, paid here so that the
    warm column carries none: importing torch, torchdata and Grain, and
    starting shmpipe's fork server (a pipeline of one producer to its first
    batch). The new processes pay theirs in their first batch. A loader
    whose modules are there but do not import (a package installed without
    its dependencies) is skipped, saying why."""
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
    if any(loader.name == "shmpipe" for loader in loaders):
        t = time.perf_counter()
        with shmpipe.from_dataset(ds, batch_size=1, num_workers=1, timeout=cfg.timeout_s) as pipe:
            next(iter(pipe))
        out["shmpipe: forkserver and a first pipeline"] = time.perf_counter() - t
    return out


class _Rounds:
    """The measurements of one run, round by round: in each, every loader's
    fresh epoch in a new process, then at each position every loader
    resumed in a new process, then every loader warm in this process."""

    def __init__(self, cfg: ResumeConfig, results: dict[str, LoaderResult], tmp: str, images: str,
                 base: JpegFolder, progress: Callable[[str], None] | None) -> None:
        self.cfg, self.results, self.tmp, self.images, self.base = cfg, results, tmp, images, base
        self.progress = progress
        self.job_dir = _resume_fresh.prepare(os.path.join(tmp, "new-processes"))
        self._logs = iter(range(1 << 62))
        #: this round's fresh epochs: loader -> (its batches, its checkpoint files by k)
        self._epochs: dict[str, tuple[list[list[int]], dict[int, str]]] = {}

    def new_log(self) -> str:
        return os.path.join(self.tmp, f"fetched-{next(self._logs)}")

    def round(self, round_no: int, order: list[Loader]) -> None:
        tag = "" if self.cfg.repeat == 1 else f" ({round_no + 1}/{self.cfg.repeat})"
        self._epochs = {}
        for loader in order:
            self._guarded(loader, f"an epoch in a new process{tag}", self._fresh, round_no)
        for label, k in self.cfg.positions():
            for loader in order:
                self._guarded(loader, f"resumed at {label} in a new process{tag}", self._resumed, round_no, label, k)
        for loader in order:
            self._guarded(loader, f"warm, in this process{tag}", self._warm, loader)

    def _guarded(self, loader: Loader, what: str, measure: Callable[..., None], *args: Any) -> None:
        r = self.results[loader.name]
        if r.error:
            return
        if self.progress:
            self.progress(f"{loader.name}: {what}")
        try:
            measure(r, *args)
        except Exception as exc:  # noqa: BLE001 - reported in the table, the others go on
            r.error = f"{type(exc).__name__}: {exc}"

    def _fresh(self, r: LoaderResult, round_no: int) -> None:
        cfg = self.cfg
        run, batches, states = _resume_fresh.measure(
            self.job_dir, r.loader, "fresh", round_no, self.images, cfg.images, self.new_log(), cfg,
            checkpoints=tuple(k for _, k in cfg.positions()))
        r.images = sum(len(b) for b in batches)
        r.runs_images_per_s.append(run.images_per_s)
        r.runs_first_batch_s.setdefault("fresh", []).append(run.first_batch_s)
        r.processes.append(run.record())
        self._epochs[r.loader] = batches, states

    def _resumed(self, r: LoaderResult, round_no: int, label: str, k: int) -> None:
        check = round_no == 0  # every resumed loader of the first round runs to the end
        log = self.new_log()
        batches, states = self._epochs[r.loader]
        run, rest, _ = _resume_fresh.measure(
            self.job_dir, r.loader, label, round_no, self.images, self.cfg.images, log, self.cfg, state=states[k],
            to_the_end=check)
        r.positions[label] = k
        r.runs_first_batch_s.setdefault(label, []).append(run.first_batch_s)
        r.processes.append(run.record())
        if check:
            r.checks.append(_check(label, k, batches, rest, fetched(log)))

    def _warm(self, r: LoaderResult, loader: Loader) -> None:
        """A fresh loader in this process, to its first batch (then closed)."""
        t0 = time.perf_counter()
        opened = loader.fresh(self.base, self.cfg)
        try:
            _ids(next(opened.batches))
            r.runs_warm_first_batch_s.append(time.perf_counter() - t0)
        finally:
            opened.close()


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
        rounds = _Rounds(cfg, results, tmp, images_dir, base, progress)
        for round_no in range(cfg.repeat):
            # Every other round the other way round: on a small, shared
            # machine no loader always goes first, or always follows the
            # same one.
            rounds.round(round_no, running if round_no % 2 == 0 else running[::-1])
        if "shmpipe" in names:
            restarts = restarts_section(base, cfg, progress, rounds.new_log)
        else:
            restarts = RestartsResult(why="not run: shmpipe is not among the loaders", kills=cfg.kills)
    for r in results.values():
        r.images_per_s = _median(r.runs_images_per_s)
        r.first_batch_s = {k: _median(v) for k, v in r.runs_first_batch_s.items()}
        r.warm_first_batch_s = _median(r.runs_warm_first_batch_s)
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
    fastest), the first batch in a new process, fresh and resumed at each
    position, and warm, fresh in the bench's process (medians), and what the
    check of the resumed runs found."""
    labels = _labels(results)
    head = ["loader", "resumes by", "images/s", "first batch, new process: fresh",
            *(f"new process: resumed at {lab}" for lab in labels), "warm process: fresh",
            "resumed = rest of epoch", "fetched before position"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | " + " | ".join(["---:"] * (len(head) - 2)) + " |"]
    for r in results:
        if not _ok(r):
            what = r.skipped if r.skipped else f"failed: {(r.error or '').splitlines()[0]}"
            lines.append(f"| {r.loader} | {r.resumes_by} | {what} |" + " |" * (len(head) - 3))
            continue
        times = [_fmt(r.first_batch_s.get("fresh"), ".3f") + " s"]
        times += [_fmt(r.first_batch_s.get(lab), ".3f") + " s" for lab in labels]
        times.append(_fmt(r.warm_first_batch_s, ".3f") + " s")
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
    collected = _full_collections(results)
    if collected:
        out.append(collected)
    skipped = [f"{r.loader} ({r.skipped})" for r in results if r.skipped]
    if skipped:
        out.append("Not measured: " + "; ".join(skipped) + ".")
    return out


def _full_collections(results: list[LoaderResult]) -> str:
    """A sentence: in how many of each loader's new processes (fresh and
    resumed) CPython's full garbage collection fell inside the first batch,
    its median length there, and the median first batch less it. After
    ``import torch`` it comes within the next few thousand allocations of
    whatever runs, so the loader that allocates more before its first batch
    meets it there; the others meet it later, in the training loop."""
    parts = []
    for r in results:
        runs = [p for p in r.processes if _ok(r) and "full_gcs" in p]
        if not runs:
            continue
        hit = [p for p in runs if p["full_gcs"] > 0]
        parts.append(
            f"{r.loader} {len(hit)} of {len(runs)}"
            + (f" ({_median([p['full_gc_s'] for p in hit]):.3f} s median; the first batch less it "
               f"{_median([p['first_batch_s'] - p['full_gc_s'] for p in hit]):.3f} s median)" if hit else "")
        )
    if not parts:
        return ""
    return ("CPython's full garbage collection (the first after torch's import) fell inside the first batch in a "
            "new process for " + ", ".join(parts) + ".")


def _wins(other: LoaderResult, mine: LoaderResult, results: list[LoaderResult]) -> list[str]:
    """The columns where `other` did better than `mine`, each with both
    medians and, where the rounds overlap, a word of caution."""
    metrics: list[tuple[str, Callable[[LoaderResult], list[float]], bool]] = [
        ("images/s", lambda r: r.runs_images_per_s, True),
        *((f"first batch in a new process, {'fresh' if lab == 'fresh' else 'resumed at ' + lab}",
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
    """Two panels: images/s per loader, and the first batch in a new
    process, fresh and resumed at each position, and warm (hatched; log
    scale)."""
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
    left.set_xlabel("images/s, one epoch (median; whiskers: slowest, fastest)")
    left.set_title("Throughput")
    shades = ["#222222", "#5b5b5b", "#8c8c8c", "#bdbdbd", "#dedede"]
    height = 0.8 / (len(labels) + 1)
    for j, lab in enumerate([*labels, "warm"]):
        ys = [y + 0.4 - height * (j + 0.5) for y in range(len(done))]
        if lab == "warm":  # apart: the bench's own process, its fork server running
            vals = [r.warm_first_batch_s for r in done][::-1]
            right.barh(ys, vals, height=height, color="white", edgecolor="#4C72B0", hatch="//",
                       label="warm process: fresh")
            continue
        vals = [r.first_batch_s.get(lab, float("nan")) for r in done][::-1]
        right.barh(ys, vals, height=height, color=shades[j % len(shades)],
                   label=f"new process: {lab if lab == 'fresh' else 'resumed at ' + lab}")
    right.set_yticks(range(len(done)), names)
    right.set_xscale("log")
    right.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    right.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} s"))
    right.xaxis.set_minor_formatter(NullFormatter())
    right.set_xlabel("to the first batch, median (log scale)")
    right.set_title("First batch: in a new process (as a restarted job), and warm")
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
        f"median of {cfg.repeat} round(s), the loaders' order reversed every other round. First batch, new "
        "process: in a python process of its own per measurement, which imported torch, Pillow, NumPy, the "
        "dataset's module and the peer's modules before its clock; in the clock `import shmpipe` (shmpipe's "
        "loaders), making the loader (and loading the state), its fork server and workers, to the first batch. "
        "Warm: a fresh loader in the bench's process, its imports done and shmpipe's fork server running"
    )
