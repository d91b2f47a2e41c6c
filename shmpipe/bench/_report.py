"""What the benchmarks share: sizes people can type, a progress display,
plots, and the environment a result was measured in."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from shmpipe._startup import default_start_method
from shmpipe.errors import ShmpipeValueError, TransportUnavailableError

KiB, MiB = 1 << 10, 1 << 20
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": KiB, "m": 10**6, "mb": 10**6, "mib": MiB,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30}


def median(values: list[float]) -> float:
    """The median, NaN for no values (a run that measured nothing)."""
    return statistics.median(values) if values else float("nan")


def fmt(v: float | None, spec: str) -> str:
    """A number for a table: "-" for None or NaN."""
    return "-" if v is None or v != v else format(v, spec)


def parse_size(text: str) -> int:
    """'64KiB', '48MB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ShmpipeValueError(f"not a size: {text!r} (say 4KiB, 64KiB, 1MiB, 48MB, 256MB, or bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_size(nbytes: int) -> str:
    for unit, size in (("MiB", MiB), ("MB", 1_000_000), ("KiB", KiB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def process_context() -> Any:
    """The context the benchmarks' own producer processes start with: the
    same start method as a pipeline's producers."""
    return multiprocessing.get_context(default_start_method())


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files, no screen)."""
    try:
        import matplotlib
    except ImportError:
        raise TransportUnavailableError(
            'plots need matplotlib: pip install "shmpipe[bench]"'
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def environment() -> dict[str, Any]:
    """Where and with what a result was measured."""
    import numpy

    import shmpipe

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "shmpipe": shmpipe.__version__,
        "numpy": numpy.__version__,
    }
    for name in ("pyarrow", "ray", "tensorflow"):
        module = sys.modules.get(name)
        if module is not None:
            env[name] = getattr(module, "__version__", "?")
    return env


@contextmanager
def output_captured(log_path: str | None) -> Iterator[IO[str]]:
    """Runs the block with this process's stdout and stderr going to the
    file `log_path`: the file descriptors, so that what C++ libraries
    (TensorFlow's absl and oneDNN lines), Ray and child processes print is
    caught too, and sys.stdout and sys.stderr, for Python code that holds
    other stream objects (under pytest, say). Yields a stream to the
    terminal's stderr, for the progress display. log_path None: nothing is
    captured (--verbose)."""
    if log_path is None:
        yield sys.stderr
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    log = open(log_path, "a", buffering=1)
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        try:
            yield terminal
        finally:
            sys.stdout, sys.stderr = saved_streams
            log.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
    finally:
        os.close(saved_fds[0])
        os.close(saved_fds[1])
        terminal.close()
        log.close()


class Progress:
    """A progress bar (rich) on a terminal; one line per step otherwise."""

    def __init__(self, total: int, what: str, file: IO[str] | None = None) -> None:
        self.total, self.what = total, what
        self.file = file if file is not None else sys.stderr
        self._bar: Any = None
        self._task: Any = None
        self._last: str | None = None
        self.done = 0
        if self.file.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as RichProgress

                self._bar = RichProgress(
                    TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), transient=True, console=Console(file=self.file),
                )
            except ImportError:
                self._bar = None

    @contextmanager
    def running(self) -> Iterator[Progress]:
        if self._bar is not None:
            with self._bar:
                self._task = self._bar.add_task(self.what, total=self.total)
                yield self
        else:
            yield self

    def step(self, label: str, advance: int = 1) -> None:
        """`advance` more units done (0: step `label` starts). Without a
        terminal: one line per step, the first time its label shows."""
        self.done += advance
        if self._bar is not None:
            self._bar.update(self._task, advance=advance, description=f"{self.what}: {label}")
        elif label != self._last:
            self._last = label
            print(f"  {self.what}: {label} ...", file=self.file, flush=True)


def line_plot(
    path: str,
    title: str,
    ylabel: str,
    series: dict[str, list[tuple[int, float]]],
    styles: dict[str, str] | None = None,
) -> None:
    """One line per series ({name: [(batch bytes, value), ...]}), log-log."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, (styles or {}).get(name, "o-"), label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch size, bytes")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
