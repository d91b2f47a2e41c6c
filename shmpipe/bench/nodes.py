"""Several nodes: K simulated nodes x L ranks on this machine, each rank a
fresh process, shmpipe against torch's DataLoader (and Grain).

The JPEG dataset of ``shmpipe bench resume`` (``JpegFolder``: --images
files of --side x --side RGB, decoded with Pillow where a sample is
fetched), one shuffled epoch per job. For each layout KxL (--layouts,
default ``1x2 2x2 2x1 3x2``) every global rank ``g = node_rank * L +
local_rank`` is a ``python`` process of its own, all started at once:

  shmpipe      shmpipe.from_dataset(dataset, batch_size=B, shuffle=True,
               seed=S, num_workers=W, num_nodes=K, node_rank=r, rank=l,
               num_ranks=L, group=<one name per node>); a node of one
               rank has no group. W (--workers) producers per node
  DataLoader   torch's DataLoader(dataset, batch_size=B, num_workers=W // L
               (at least 1), sampler=DistributedSampler(dataset,
               num_replicas=K * L, rank=g, shuffle=True, seed=S,
               drop_last=True)): workers per rank, so a node runs about
               the W workers shmpipe runs as producers
  Grain        grain.python.DataLoader (IndexSampler sharded with
               ShardOptions(g, K * L, drop_remainder=True), Batch(B),
               worker_count=W // L): only where Grain is installed, else
               "not installed" and nothing measured

Per layout and loader, the median of --repeat rounds:

- images/s of the job: the images every rank received, less the job's
  first batch, over the time from the first batch any rank received to the
  last batch any rank received (the clock is CLOCK_MONOTONIC, one for every
  process of the machine);
- first batch: in each rank, from the first statement of its fresh process
  (before anything of shmpipe, torch or Grain is imported, so the import,
  the fork server's start and the producers' are all in it) to its first
  batch in hand; the median over the ranks. Every rank imports torch where
  it is installed, whatever its loader: a training job does, and only the
  DataLoader's paid it before, which made shmpipe's count from the start
  look earlier than a job's would be. Apart: how much of it was the
  imports, and the time from making the loader to its first batch.

Checked in every run, and any failure printed as FAILED in the table: every
sample delivered at most once across all ranks, every sample fetched at
most once (the dataset appends each fetched index to a log file), every
rank the same number of batches, and for shmpipe each rank's batches those
of the global rule: global rank g gets batches g, g + K * L, g + 2 * K * L,
... of the epoch (complete rounds only), the epoch being the one a single
pipeline of one node draws from the same length, batch size and seed.

Then a resume onto another layout (--resume, default 2x2 3x2; shmpipe
only): a job of the first layout stops at --resume-at of the epoch (every
rank's state_dict() at the same step is the job's position), a job of the
second layout loads that state and runs to the end of the epoch, and a
fresh job of the second layout starts beside it; their first batches (from
the process's start, and from from_dataset()) are compared. Checked: the
resumed ranks get the rest of the epoch dealt by the second layout's global
rule, fetch nothing handed out before the position, and nothing twice.

Every process the bench starts is ended, even on error, and a segment left
in /dev/shm or a process left running is a failed check.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import shmpipe
from shmpipe import _segments
from shmpipe._process import owner_alive, process_group_members
from shmpipe.bench._jpegs import fetched, make_jpegs
from shmpipe.bench._report import median as _median
from shmpipe.bench._report import pyplot
from shmpipe.errors import ShmpipeValueError, TransportUnavailableError

__all__ = [
    "LOADERS", "Check", "LayoutResult", "NodesConfig", "NodesReport", "ResumeResult", "check_run", "dealt",
    "describe", "layout_name", "parse_layout", "plot", "resume_table", "run", "table",
]

LOADERS = ("shmpipe", "DataLoader", "Grain")
#: What a rank process runs: the clock is read before anything else is
#: imported, so the first batch carries every import and start-up.
_BOOTSTRAP = ("import time; t0 = time.monotonic()\nimport sys\nfrom shmpipe.bench._nodes_rank import main\n"
              "main(t0, sys.argv[1])")
#: What a launcher sets and a simulated node must not inherit (check_nodes
#: would take the layout from it).
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK", "RANK",
                       "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
_GRACE_S = 5.0  # for a rank's producers to see it gone and clean up after it


Layout = tuple[int, int]  # (nodes, ranks per node)


def parse_layout(text: str) -> Layout:
    """'3x2' -> (3, 2): 3 nodes of 2 ranks."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ShmpipeValueError(f"not a layout: {text!r} (say 2x2: 2 nodes of 2 ranks each)")
    return int(m.group(1)), int(m.group(2))


def layout_name(layout: Layout) -> str:
    return f"{layout[0]}x{layout[1]}"


@dataclass(frozen=True)
class NodesConfig:
    layouts: tuple[Layout, ...] = ((1, 2), (2, 2), (2, 1), (3, 2))
    images: int = 4000  # JPEG files, the epoch (twice bench resume's: each rank's start-up is long beside it)
    side: int = 224  # each is side x side RGB
    batch_size: int = 32
    workers: int = 2  # per node: shmpipe's producers; the DataLoader's and Grain's are split over its ranks
    repeat: int = 3  # rounds; the table shows the median
    seed: int = 0  # the JPEGs' pixels and every loader's shuffle
    quality: int = 90
    timeout_s: float = 300.0  # the most one job (all its ranks) may take
    resume: tuple[Layout, Layout] | None = ((2, 2), (3, 2))  # from, to; None: no resume section
    resume_at: float = 0.5  # the share of the epoch before the state

    @property
    def batches(self) -> int:
        return -(-self.images // self.batch_size)

    def workers_per_rank(self, ranks: int) -> int:
        """The DataLoader's (and Grain's) workers per rank: the node's
        --workers split over its ranks, rounded down, at least one."""
        return max(1, self.workers // ranks)

    def resume_step(self) -> int:
        """Batches per rank of the first layout before the state (at least
        one, and at least one round left)."""
        assert self.resume is not None
        return step_at(self.resume_at, self.batches, self.resume[0])

    def check(self) -> None:
        if self.batch_size < 1 or self.workers < 1 or self.repeat < 1 or self.images < 1:
            raise ShmpipeValueError("images, batch_size, workers and repeat must be at least 1")
        if not 8 <= self.side <= 4096:
            raise ShmpipeValueError(f"side must be 8 to 4096 pixels, not {self.side}")
        if not self.layouts:
            raise ShmpipeValueError("give at least one layout")
        for layout in self.layouts + (self.resume or ()):
            world = layout[0] * layout[1]
            if self.batches // world < 2 or self.images // world < self.batch_size:
                raise ShmpipeValueError(
                    f"layout {layout_name(layout)}: {self.images} images make {self.batches} batches of "
                    f"{self.batch_size}, fewer than two rounds of its {world} ranks: give more --images"
                )
        if self.resume is not None:
            if not 0 < self.resume_at < 1:
                raise ShmpipeValueError(f"resume-at is a share of the epoch, between 0 and 1: {self.resume_at}")
            before, after = self.resume
            left = self.batches - self.resume_step() * before[0] * before[1]
            if left < after[0] * after[1]:
                raise ShmpipeValueError(
                    f"resuming {layout_name(before)} at {self.resume_at:g} leaves {left} batches, not a round of "
                    f"{layout_name(after)}: give more --images or an earlier --resume-at"
                )


# -- the global rule, written out here apart from shmpipe's code ---------------------------


def dealt(batches: list[Any], layout: Layout) -> list[list[Any]]:
    """What each global rank of a layout gets of `batches` (an epoch's,
    those left of it, in order): rank g gets g, g + W, ...; complete rounds
    of W = nodes * ranks only."""
    w = layout[0] * layout[1]
    rounds = len(batches) // w
    return [[batches[j * w + g] for j in range(rounds)] for g in range(w)]


def step_at(fraction: float, batches: int, layout: Layout) -> int:
    """The step (batches per rank) at `fraction` of an epoch of a layout."""
    rounds = batches // (layout[0] * layout[1])
    return min(rounds - 1, max(1, round(fraction * rounds)))


# -- a job: the rank processes of one layout -----------------------------------------------


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _end(procs: list[subprocess.Popen]) -> int:
    """Ends every rank process and what it started (each rank leads a
    session of its own). A rank still running is SIGKILLed; its producers
    get _GRACE_S to notice and clean up, then whatever is left of any
    session is SIGKILLed. Returns how many processes had to be."""
    _signal_all([p.pid for p in procs if p.poll() is None], signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=30)
    deadline = time.monotonic() + _GRACE_S
    while any(process_group_members(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [pid for p in procs for pid in process_group_members(p.pid)]
    _signal_all(left, signal.SIGKILL)
    return len(left)


def _our_segments() -> set[str]:
    try:
        return {e for e in os.listdir(_segments.SHM_DIR) if _segments.parse_name(e) is not None}
    except FileNotFoundError:
        return set()


def _leftover_segments(before: set[str]) -> list[str]:
    """shmpipe segments made since `before` whose owner is dead: a job's
    leak (each removed, so one leak does not fail the jobs after it)."""
    deadline = time.monotonic() + _GRACE_S  # a producer may be removing one now
    while True:
        left = []
        for name in sorted(_our_segments() - before):
            owner = _segments.parse_name(name)
            if owner is not None and not owner_alive(*owner):
                left.append(name)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for name in left:
        try:
            os.unlink(os.path.join(_segments.SHM_DIR, name))
        except FileNotFoundError:
            pass
    return left


def _rank_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    # The ranks import the shmpipe this process runs, wherever they start.
    here = os.path.dirname(os.path.dirname(os.path.abspath(shmpipe.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class _Job:
    reports: list[dict[str, Any]]  # in global rank order
    log: str  # the fetch log
    leftover: str | None  # processes or segments left behind, said in words


_job_ids = iter(range(1 << 62))


def _run_job(cfg: NodesConfig, tmp: str, folder: str, loader: str, layout: Layout, *,
             state: dict[str, Any] | None = None, stop: int | None = None) -> _Job:
    """Starts every rank of `layout` at once and waits for all (cfg.timeout_s
    in all); raises if one fails. Whatever happens, every process it
    started is ended before it returns."""
    nodes, ranks = layout
    job_id = next(_job_ids)
    barrier, log = os.path.join(tmp, f"barrier-{job_id}"), os.path.join(tmp, f"fetched-{job_id}")
    os.makedirs(barrier)
    env, before = _rank_env(), _our_segments()
    procs: list[subprocess.Popen] = []
    files: list[tuple[Any, Any]] = []
    try:
        for node in range(nodes):
            for rank in range(ranks):
                spec = {
                    "loader": loader, "folder": folder, "count": cfg.images, "log": log, "nodes": nodes,
                    "ranks": ranks, "node": node, "rank": rank, "batch_size": cfg.batch_size,
                    "workers": cfg.workers, "seed": cfg.seed, "timeout": cfg.timeout_s, "state": state,
                    "stop": stop, "barrier": barrier, "group": f"bench-nodes-{os.getpid()}-{job_id}-n{node}",
                }
                path = os.path.join(tmp, f"job-{job_id}-{node}-{rank}.json")
                with open(path, "w") as f:
                    json.dump(spec, f)
                files.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, path], stdout=files[-1][0], stderr=files[-1][1],
                    stdin=subprocess.DEVNULL, cwd=tmp, env=env, start_new_session=True,
                ))
        # A rank that fails leaves the others of its group (or all, at the
        # barrier) waiting for it: the job ends at the first failure, not
        # at the timeout.
        deadline = time.monotonic() + cfg.timeout_s
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{loader} {layout_name(layout)}: the ranks did not end in {cfg.timeout_s:g} s")
            time.sleep(0.02)
        reports = []
        for g, (proc, (out, err)) in enumerate(zip(procs, files, strict=True)):
            out.seek(0)
            err.seek(0)
            lines = [line for line in out.read().splitlines() if line.startswith("{")]
            if proc.returncode is None:  # ended by the rank that failed, below
                continue
            if proc.returncode != 0 or not lines:
                tail = err.read().strip().splitlines()[-1:] or ["(nothing on stderr)"]
                raise RuntimeError(f"rank {g} of {loader} {layout_name(layout)} exited {proc.returncode}: {tail[0]}")
            reports.append(json.loads(lines[-1]))
    finally:
        killed = _end(procs)
        segments = _leftover_segments(before)
        for out, err in files:
            out.close()
            err.close()
    leftover = []
    if killed:
        leftover.append(f"{killed} process(es) left running")
    if segments:
        leftover.append(f"{len(segments)} segment(s) left in /dev/shm")
    return _Job(reports, log, "; ".join(leftover) or None)


# -- checks ----------------------------------------------------------------------------------


@dataclass
class Check:
    """What one job delivered and fetched, against what it must."""

    delivered: int = 0  # samples, all ranks
    delivered_once: bool = False  # no sample delivered to two ranks, or twice
    fetched: int = 0  # samples the dataset read (its log), all ranks' loaders
    fetched_once: bool = False  # no sample read twice
    same_count: bool = False  # every rank got the same number of batches
    global_rule: bool | None = None  # shmpipe: each rank got what the global rule deals it
    fetched_before_position: int | None = None  # a resumed job: samples out before the state, read again
    leftover: str | None = None  # processes or segments the job left behind

    def failures(self) -> list[str]:
        out = []
        if not self.delivered_once:
            out.append("a sample delivered twice")
        if not self.fetched_once:
            out.append("a sample read twice")
        if not self.same_count:
            out.append("ranks got different numbers of batches")
        if self.global_rule is False:
            out.append("batches differ from the global rule")
        if self.fetched_before_position:
            out.append(f"{self.fetched_before_position} samples before the position read again")
        if self.leftover:
            out.append(self.leftover)
        return out


def check_run(per_rank: list[list[list[int]]], fetched_ids: list[int],
              expected: list[list[list[int]]] | None = None, before: set[int] | None = None) -> Check:
    """The check of a job: `per_rank` each global rank's batches (sample
    indices), `fetched_ids` what the dataset read, `expected` each rank's
    batches by the global rule (None: not checked), `before` the samples
    handed out before a resumed job's state."""
    ids = [i for batches in per_rank for b in batches for i in b]
    return Check(
        delivered=len(ids),
        delivered_once=len(ids) == len(set(ids)) and not (before and set(ids) & before),
        fetched=len(fetched_ids),
        fetched_once=len(fetched_ids) == len(set(fetched_ids)),
        same_count=len({len(batches) for batches in per_rank}) <= 1,
        global_rule=None if expected is None else per_rank == expected,
        fetched_before_position=None if before is None else sum(1 for i in fetched_ids if i in before),
    )


# -- results ---------------------------------------------------------------------------------


@dataclass
class Run:
    """One job of one layout and loader."""

    images: int  # every rank's
    window_s: float  # the first batch of any rank to the last of any
    images_per_s: float
    first_batch_s: list[float]  # per rank, from its process's first statement
    imports_s: list[float]  # per rank, of that: the imports before the loader is made
    made_to_first_s: list[float]  # per rank, from making the loader (and loading a state) to its first batch
    check: Check
    torch_imported: list[bool] = field(default_factory=list)  # per rank: torch was in it before the loader


def _run_of(job: _Job, expected: list[list[list[int]]] | None, before: set[int] | None = None) -> Run:
    reps = job.reports
    empty = [r["global_rank"] for r in reps if not r["batches"]]
    if empty:
        raise RuntimeError(f"ranks {empty} got no batch")
    got = [r["batches"] for r in reps]
    check = check_run(got, fetched(job.log), expected, before)
    check.leftover = job.leftover
    start, end = min(r["t_first"] for r in reps), max(r["t_last"] for r in reps)
    first_size = len(next(r["batches"][0] for r in reps if r.get("t_first") == start))
    images = sum(len(b) for r in reps for b in r["batches"])
    window = end - start
    return Run(
        images=images,
        window_s=window,
        images_per_s=(images - first_size) / window if window > 0 else float("nan"),
        first_batch_s=[r["t_first"] - r["t_start"] for r in reps],
        imports_s=[r["t_construct"] - r["t_start"] for r in reps],
        made_to_first_s=[r["t_first"] - r["t_construct"] for r in reps],
        check=check,
        torch_imported=[r["torch_imported"] for r in reps],
    )


@dataclass
class LayoutResult:
    layout: str
    loader: str
    workers_per_node: int = 0  # processes fetching samples, per node
    workers_per_rank: int | None = None  # the DataLoader's and Grain's
    runs: list[Run] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None

    @property
    def images_per_s(self) -> float:
        return _median([r.images_per_s for r in self.runs])

    def first_batch_s(self, what: str = "first_batch_s") -> float:
        """The median over the rounds of each round's median over the ranks."""
        return _median([_median(getattr(r, what)) for r in self.runs])

    def failures(self) -> list[str]:
        return sorted({f for r in self.runs for f in r.check.failures()})

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "images_per_s": self.images_per_s, "first_batch_s": self.first_batch_s(),
                "imports_s": self.first_batch_s("imports_s"),
                "made_to_first_s": self.first_batch_s("made_to_first_s"),
                "checks_passed": not self.failures() and not self.skipped and not self.error}


@dataclass
class ResumeResult:
    before: str
    after: str
    at: float
    step: int = 0  # batches per rank of `before` before the state
    position: int = 0  # batches of the epoch out before the state
    fresh: list[Run] = field(default_factory=list)  # the second layout from the start: its first batch
    resumed: list[Run] = field(default_factory=list)  # the second layout from the state, to the end of the epoch
    stopped: list[Run] = field(default_factory=list)  # the first layout, to the state
    states_agree: list[bool] = field(default_factory=list)  # every rank's state at the step was the same
    skipped: str | None = None
    error: str | None = None

    def median(self, runs: str, what: str) -> float:
        return _median([_median(getattr(r, what)) for r in getattr(self, runs)])

    def failures(self) -> list[str]:
        out = {f for r in self.stopped + self.resumed + self.fresh for f in r.check.failures()}
        if not all(self.states_agree):
            out.add("the ranks' states at the same step differ")
        return sorted(out)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "checks_passed": not self.failures() and not self.error, **{
            f"{runs}_{what}": self.median(runs, what)
            for runs in ("fresh", "resumed") for what in ("first_batch_s", "made_to_first_s")}}


@dataclass
class NodesReport:
    config: NodesConfig
    results: list[LayoutResult]
    resume: ResumeResult | None
    make_jpegs_s: float = 0.0
    jpeg_bytes: int = 0
    versions: dict[str, str | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        done = [r for r in self.results if not r.skipped]
        ok = all(not r.error and not r.failures() for r in done)
        return ok and (self.resume is None or (not self.resume.error and not self.resume.failures()))

    def as_dict(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "config": {**asdict(cfg), "layouts": [layout_name(x) for x in cfg.layouts], "batches": cfg.batches,
                       "resume": [layout_name(x) for x in cfg.resume] if cfg.resume else None},
            "versions": self.versions, "make_jpegs_s": self.make_jpegs_s, "jpeg_bytes": self.jpeg_bytes,
            "checks_passed": self.passed,
            "results": [r.as_dict() for r in self.results],
            "resume": self.resume.as_dict() if self.resume else None,
        }


# -- measuring -------------------------------------------------------------------------------


def why_not(loader: str) -> str | None:
    """None where `loader` can run here; else what is missing."""
    needs = {"shmpipe": [], "DataLoader": [("torch", 'pip install "shmpipe[torch]"')],
             "Grain": [("grain", "pip install grain")]}[loader]
    for module, how in (("PIL", "pip install pillow"), *needs):
        if importlib.util.find_spec(module) is None:
            return f"not installed: {module} ({how})"
    return None


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - a version is only informative
        return None


def reference_epoch(cfg: NodesConfig) -> list[list[int]]:
    """The epoch's batches as one pipeline of one node delivers them: the
    order depends on the dataset's length, the batch size and the seed only,
    so a dataset of numbers stands in for the JPEGs."""
    from shmpipe.testing.datasets import Numbered

    with shmpipe.from_dataset(Numbered(cfg.images), batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed,
                              num_workers=1, timeout=cfg.timeout_s) as pipe:
        return [[int(i) for i in np.asarray(b["i"]).tolist()] for b in pipe]


def _resume_round(cfg: NodesConfig, tmp: str, folder: str, epoch: list[list[int]], result: ResumeResult) -> None:
    assert cfg.resume is not None
    before, after = cfg.resume
    step = result.step

    def fresh() -> None:
        job = _run_job(cfg, tmp, folder, "shmpipe", after, stop=1)
        result.fresh.append(_run_of(job, [b[:1] for b in dealt(epoch, after)]))

    # The fresh job goes first in every other round, so that neither start
    # always follows the same job (the order's own effect cancels out).
    fresh_first = len(result.fresh) % 2 == 1
    if fresh_first:
        fresh()
    first = _run_job(cfg, tmp, folder, "shmpipe", before, stop=step)
    result.stopped.append(_run_of(first, [b[:step] for b in dealt(epoch, before)]))
    states = [r["state"] for r in first.reports]
    result.states_agree.append(all(s == states[0] for s in states))
    out = {i for b in epoch[: result.position] for i in b}
    resumed = _run_job(cfg, tmp, folder, "shmpipe", after, state=states[0])
    result.resumed.append(_run_of(resumed, dealt(epoch[result.position :], after), before=out))
    if not fresh_first:
        fresh()


def run(cfg: NodesConfig, loaders: list[str] | None = None, progress: Callable[[str], None] | None = None,
        folder: str | None = None) -> NodesReport:
    """Makes the JPEGs (in `folder`, or a temporary folder removed after),
    then runs every layout with every loader in rounds (a change of load
    hits all alike), then the resume section. A loader that cannot run here
    comes back with `skipped`, a job that failed with `error`."""
    cfg.check()
    if importlib.util.find_spec("PIL") is None:
        raise TransportUnavailableError("bench nodes decodes JPEGs with Pillow: pip install pillow")
    names = list(LOADERS) if loaders is None else loaders
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        raise ShmpipeValueError(f"unknown loaders {unknown}; known: {', '.join(LOADERS)}")
    results = {
        (layout, name): LayoutResult(
            layout_name(layout), name, workers_per_node=cfg.workers if name == "shmpipe"
            else cfg.workers_per_rank(layout[1]) * layout[1],
            workers_per_rank=None if name == "shmpipe" else cfg.workers_per_rank(layout[1]), skipped=why_not(name),
        )
        for layout in cfg.layouts for name in names
    }
    resume = None
    if cfg.resume is not None and "shmpipe" in names:
        before, after = cfg.resume
        step = cfg.resume_step()
        resume = ResumeResult(layout_name(before), layout_name(after), cfg.resume_at, step,
                              step * before[0] * before[1])
    with tempfile.TemporaryDirectory(prefix="shmpipe-bench-nodes-") as tmp:
        images = folder or os.path.join(tmp, "images")
        os.makedirs(images, exist_ok=True)
        if progress:
            progress("making the JPEGs")
        t = time.perf_counter()
        make_jpegs(images, cfg.images, cfg.side, cfg.seed, cfg.quality)
        made_s = time.perf_counter() - t
        jpeg_bytes = sum(os.path.getsize(os.path.join(images, f)) for f in os.listdir(images))
        epoch = reference_epoch(cfg)
        for round_no in range(cfg.repeat):
            tag = "" if cfg.repeat == 1 else f" ({round_no + 1}/{cfg.repeat})"
            for (layout, name), r in results.items():
                if r.skipped or r.error:
                    continue
                if progress:
                    progress(f"{name} {r.layout}{tag}")
                try:
                    job = _run_job(cfg, tmp, images, name, layout)
                    r.runs.append(_run_of(job, dealt(epoch, layout) if name == "shmpipe" else None))
                except Exception as exc:  # noqa: BLE001 - reported in the table, the others go on
                    r.error = f"{type(exc).__name__}: {exc}"
            if resume is not None and not resume.error:
                if progress:
                    progress(f"shmpipe {resume.before} -> {resume.after}{tag}")
                try:
                    _resume_round(cfg, tmp, images, epoch, resume)
                except Exception as exc:  # noqa: BLE001 - reported, the rest of the report stands
                    resume.error = f"{type(exc).__name__}: {exc}"
    versions = {"shmpipe": shmpipe.__version__, **{d: _version(d) for d in ("torch", "grain", "pillow")}}
    return NodesReport(cfg, list(results.values()), resume, made_s, jpeg_bytes, versions)


# -- the report -------------------------------------------------------------------------------


def _s(v: float) -> str:
    return "-" if v != v else f"{v:.2f} s"


def _checks(failures: list[str]) -> str:
    return "ok" if not failures else "**FAILED**: " + "; ".join(failures)


def _workers(r: LayoutResult) -> str:
    if r.workers_per_rank is None:
        return f"{r.workers_per_node} per node"
    return f"{r.workers_per_rank} per rank ({r.workers_per_node} per node)"


def table(results: list[LayoutResult]) -> str:
    """Markdown: per layout and loader, the job's images/s (median round,
    slowest and fastest), the first batch (median of the rounds' medians
    over the ranks), and the checks."""
    head = ["layout", "loader", "workers", "images", "images/s (job)", "first batch", "of it: imports",
            "making the loader to first batch", "checks"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | --- | " + " | ".join(["---:"] * 5) + " | --- |"]
    said = set()
    for r in results:
        if r.skipped:
            if r.loader not in said:  # once, for every layout
                said.add(r.loader)
                lines.append(f"| all | {r.loader} | {r.skipped} |" + " |" * (len(head) - 3))
            continue
        if r.error or not r.runs:
            lines.append(f"| {r.layout} | {r.loader} | {_workers(r)} | **FAILED**: {r.error} |" + " |" * 5)
            continue
        rates = [x.images_per_s for x in r.runs]
        rate = f"{r.images_per_s:,.0f}" + (f" ({min(rates):,.0f}-{max(rates):,.0f})" if len(rates) > 1 else "")
        images = statistics.median_low([x.images for x in r.runs])
        lines.append(
            f"| {r.layout} | {r.loader} | {_workers(r)} | {images:,} | {rate} | {_s(r.first_batch_s())} | "
            f"{_s(r.first_batch_s('imports_s'))} | {_s(r.first_batch_s('made_to_first_s'))} | "
            f"{_checks(r.failures())} |"
        )
    return "\n".join(lines)


def resume_table(result: ResumeResult | None) -> str:
    """Markdown: the second layout's first batch resumed from the first
    layout's state and fresh (medians), and the checks; or why none."""
    if result is None:
        return "Resume onto another layout: not run (--resume none, or shmpipe is not among the loaders)."
    lines = [
        f"Resume onto another layout (shmpipe): {result.before} stopped after {result.step} batches per rank "
        f"({result.position} of the epoch's batches out, {result.at:.0%}); {result.after} resumed from its state, "
        f"against {result.after} fresh (median of the rounds' medians over the ranks):",
        "",
        "| layout | first batch, from the process's start | from from_dataset() | checks |",
        "| --- | ---: | ---: | --- |",
    ]
    if result.error:
        lines.append(f"| {result.after} | **FAILED**: {result.error} | | |")
        return "\n".join(lines)
    rows = [(f"{result.after} resumed at {result.at:.0%} of {result.before}", "resumed", result.resumed
             + result.stopped), (f"{result.after} fresh", "fresh", result.fresh)]
    for label, runs, checked in rows:
        failures = sorted({f for r in checked for f in r.check.failures()})
        if runs == "resumed" and not all(result.states_agree):
            failures.append("the ranks' states at the same step differ")
        lines.append(f"| {label} | {_s(result.median(runs, 'first_batch_s'))} | "
                     f"{_s(result.median(runs, 'made_to_first_s'))} | {_checks(failures)} |")
    return "\n".join(lines)


def plot(report: NodesReport, path: str, title: str) -> None:
    """Three panels: the job's images/s and the first batch per layout and
    loader, and the resumed against the fresh first batch."""
    plt = pyplot()
    done = [r for r in report.results if r.runs]
    layouts = list(dict.fromkeys(r.layout for r in done))
    names = list(dict.fromkeys(r.loader for r in done))
    colors = {"shmpipe": "#4C72B0", "DataLoader": "#999999", "Grain": "#DD8452"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        by = {r.layout: r for r in done if r.loader == name}
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(layouts))]
        rates = [by[lay].images_per_s if lay in by else float("nan") for lay in layouts]
        firsts = [by[lay].first_batch_s() if lay in by else float("nan") for lay in layouts]
        imports = [by[lay].first_batch_s("imports_s") if lay in by else float("nan") for lay in layouts]
        axes[0].bar(xs, rates, width, label=name, color=colors.get(name))
        axes[1].bar(xs, firsts, width, label=name, color=colors.get(name))
        # The imports' share: a training script that imports torch anyway
        # pays the DataLoader's part of it whatever loads its data.
        axes[1].bar(xs, imports, width, color="none", edgecolor="#333333", linewidth=0, hatch="//",
                    label="of it: imports" if k == len(names) - 1 else None)
    for ax, label in ((axes[0], "images/s of the job (median round)"),
                      (axes[1], "first batch from the process's start, s")):
        ax.set_xticks(range(len(layouts)), [f"{lay}\n(nodes x ranks)" for lay in layouts], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    res = report.resume
    if res is not None and res.fresh and res.resumed:
        labels = ["from the process's start", "from from_dataset()"]
        for k, (runs, color) in enumerate((("fresh", "#9DB4D8"), ("resumed", "#4C72B0"))):
            vals = [res.median(runs, "first_batch_s"), res.median(runs, "made_to_first_s")]
            axes[2].bar([i + (k - 0.5) * 0.4 for i in range(2)], vals, 0.4, color=color,
                        label=f"{res.after} {runs}" + (f" (from {res.before} at {res.at:.0%})" if k else ""))
        axes[2].set_xticks(range(2), labels, fontsize=8)
        axes[2].legend(fontsize=8)
    axes[2].set_title("first batch: resumed onto another layout vs fresh, s", fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(report: NodesReport) -> str:
    cfg = report.config
    return (
        f"shmpipe bench nodes: {cfg.images} JPEGs of {cfg.side}x{cfg.side} RGB ({report.jpeg_bytes / 1e6:.1f} MB, "
        f"made in {report.make_jpegs_s:.1f} s), decoded with Pillow where fetched; a shuffled epoch of "
        f"{cfg.batches} batches of {cfg.batch_size}; layouts (nodes x ranks) "
        f"{', '.join(layout_name(x) for x in cfg.layouts)}, each rank a fresh process; {cfg.workers} workers per "
        f"node (shmpipe's producers; the DataLoader's split over a node's ranks); median of {cfg.repeat} round(s). "
        "images/s (job): every rank's images but the job's first batch, from the first batch of any rank to the "
        "last of any; first batch: from the rank process's first statement (imports and start-ups in it), the "
        "median over the ranks"
    )

