"""bench resume's restarts section: producers SIGKILLed at random batches of
an epoch of ``from_dataset(..., max_restarts=K)``, shmpipe's alone (no
peer replaces a dead worker), against a fault-free epoch. Checked: the
batches, in order, are those of the fault-free epoch, each sample is
delivered once, a ShmpipeWarning is given per replaced producer; counted:
the producers replaced, the samples fetched twice (what a dead producer had
in hand), and the cost per restart (the difference of the two epochs over
the restarts). Where ``from_dataset`` has no ``max_restarts``, the section
says "not available" and measures nothing."""

from __future__ import annotations

import inspect
import os
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import shmpipe
from shmpipe.bench._jpegs import JpegFolder, fetched, ids
from shmpipe.bench._report import fmt as _fmt
from shmpipe.bench._report import median as _median
from shmpipe.bench._resume_config import ResumeConfig

__all__ = ["RestartsResult", "RestartsRound", "restarts_available", "restarts_section", "restarts_table"]


def restarts_available() -> str | None:
    """None where from_dataset restarts producers (max_restarts); else why not."""
    if "max_restarts" not in inspect.signature(shmpipe.from_dataset).parameters:
        return "not available: max_restarts is not implemented"
    return None


@dataclass
class RestartsRound:
    """One round of the restarts section: a fault-free epoch and one with
    SIGKILLs, each from making the pipeline to its last batch."""

    kills: int = 0  # SIGKILLs sent (one to a process not yet replaced is no new death)
    restarts: int = 0  # producers replaced (pipe.stats().restarts)
    warnings: int = 0  # ShmpipeWarnings saying a producer was replaced
    sequence_equal: bool = False  # the batches, in order, are those of the fault-free epoch
    each_sample_once: bool = False  # every sample of the dataset delivered exactly once
    fetched_again: int = 0  # samples fetched more than once (what dead producers had in hand)
    epoch_s: float = float("nan")  # fault-free
    epoch_with_kills_s: float = float("nan")


@dataclass
class RestartsResult:
    """K random SIGKILLs of shmpipe's producers in an epoch, with
    max_restarts=K: samples delivered once, the ordered
    sequence that of the fault-free run, and what the restarts cost."""

    available: bool = False
    why: str = ""  # when not available, or not run
    kills: int = 0  # per epoch, asked
    rounds: list[RestartsRound] = field(default_factory=list)
    epoch_s: float = float("nan")  # medians of the rounds
    epoch_with_kills_s: float = float("nan")
    cost_per_restart_s: float = float("nan")  # median over rounds of (with kills - fault-free) / restarts
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _kill_points(cfg: ResumeConfig, rng: np.random.Generator) -> list[int]:
    """After which batches to kill: distinct, in the first three quarters of
    the epoch (a death at its very end may be noticed only after it)."""
    span = list(range(1, max(2, cfg.batches * 3 // 4)))
    count = min(cfg.kills, len(span))
    return sorted(int(k) for k in rng.choice(span, size=count, replace=False))


def _restarts_round(base: JpegFolder, cfg: ResumeConfig, round_no: int, logs: Callable[[], str]) -> RestartsRound:

    def make(ds: JpegFolder, max_restarts: int) -> Any:
        return shmpipe.from_dataset(
            ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers, seed=cfg.seed,
            timeout=cfg.timeout_s, max_restarts=max_restarts,
        )

    out = RestartsRound()
    t0 = time.perf_counter()
    with make(base, 0) as pipe:
        reference = [ids(b) for b in pipe]
    out.epoch_s = time.perf_counter() - t0

    rng = np.random.default_rng([cfg.seed, round_no])
    at = set(_kill_points(cfg, rng))
    log = logs()
    got: list[list[int]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        with make(base.logged(log), cfg.kills) as pipe:
            for batch in pipe:
                got.append(ids(batch))
                del batch
                if len(got) in at:
                    pids = [p for p in pipe.pids if p is not None]
                    os.kill(pids[int(rng.integers(len(pids)))], signal.SIGKILL)
                    out.kills += 1
            out.epoch_with_kills_s = time.perf_counter() - t0
            out.restarts = sum(pipe.stats().restarts)
    out.warnings = sum(
        1 for w in caught if issubclass(w.category, shmpipe.ShmpipeWarning) and "replaced" in str(w.message)
    )
    out.sequence_equal = got == reference
    out.each_sample_once = sorted(i for b in got for i in b) == list(range(cfg.images))
    counts = np.bincount(np.asarray(fetched(log), np.int64), minlength=cfg.images)
    out.fetched_again = int(np.sum(counts > 1))
    return out


def restarts_section(base: JpegFolder, cfg: ResumeConfig, progress: Callable[[str], None] | None,
                     logs: Callable[[], str]) -> RestartsResult:
    """The section, run where from_dataset has max_restarts and --kills is
    above 0; else it says why not, never a number."""
    why = restarts_available()
    if why is not None:
        return RestartsResult(why=why, kills=cfg.kills)
    if cfg.kills == 0:
        return RestartsResult(why="not run: --kills 0", kills=0)
    result = RestartsResult(available=True, kills=cfg.kills)
    try:
        for round_no in range(cfg.repeat):
            if progress:
                tag = "" if cfg.repeat == 1 else f" ({round_no + 1}/{cfg.repeat})"
                progress(f"shmpipe: {cfg.kills} SIGKILLs with max_restarts{tag}")
            result.rounds.append(_restarts_round(base, cfg, round_no, logs))
    except Exception as exc:  # noqa: BLE001 - reported, the rest of the report stands
        result.error = f"{type(exc).__name__}: {exc}"
    result.epoch_s = _median([r.epoch_s for r in result.rounds])
    result.epoch_with_kills_s = _median([r.epoch_with_kills_s for r in result.rounds])
    result.cost_per_restart_s = _median(
        [(r.epoch_with_kills_s - r.epoch_s) / r.restarts for r in result.rounds if r.restarts]
    )
    return result


def restarts_table(result: RestartsResult, cfg: ResumeConfig) -> str:
    """Markdown: the restarts section's rounds and medians, or one line
    saying why there is none."""
    if not result.available:
        return f"Producer restarts under SIGKILL (max_restarts): {result.why}."
    lines = [
        f"Producer restarts under SIGKILL: shmpipe.from_dataset(..., max_restarts={result.kills}), "
        f"{result.kills} SIGKILLs of random producers at random batches of an epoch, against a fault-free epoch "
        "(each from making the pipeline to its last batch):",
        "",
        "| round | kills | producers replaced | sequence = fault-free run | each sample once | samples fetched again "
        "| epoch, fault-free | epoch, with kills | cost per restart |",
        "| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for i, r in enumerate(result.rounds, 1):
        cost = (r.epoch_with_kills_s - r.epoch_s) / r.restarts if r.restarts else float("nan")
        lines.append(
            f"| {i} | {r.kills} | {r.restarts} | {'yes' if r.sequence_equal else 'NO'} | "
            f"{'yes' if r.each_sample_once else 'NO'} | {r.fetched_again:,} | {r.epoch_s:.2f} s | "
            f"{r.epoch_with_kills_s:.2f} s | {_fmt(cost, '.2f')} s |"
        )
    if len(result.rounds) > 1:
        lines.append(
            f"| median | | | | | | {result.epoch_s:.2f} s | {result.epoch_with_kills_s:.2f} s | "
            f"{_fmt(result.cost_per_restart_s, '.2f')} s |"
        )
    if result.error:
        lines.append(f"\nThe restarts section failed: {result.error}")
    return "\n".join(lines)
