"""bench resume's measurements in a new process: a first batch as a job
started after preemption meets it.

A restarted job is a fresh interpreter. Whatever shmpipe starts once per
process (importing its modules, its fork server) is in that job's first
batch, and a measurement taken in a process that has paid it already
flatters shmpipe. So each of bench resume's first-batch measurements is a
``python`` process of its own (``measure``), the same for every loader:

- before the clock: torch (where it is installed: the training script's
  framework, for shmpipe's process too), Pillow and NumPy, the dataset's
  module (a copy of shmpipe/bench/_jpegs.py, ``jpeg_dataset``: a module of
  the job's own, as a user's dataset is, importing nothing of shmpipe), the
  peer's own modules (torchdata's, Grain's: a job that uses one imports
  it), the checkpoint read back from its file, and the dataset made;
- then the clock starts, and for shmpipe's loaders the first thing inside
  it is ``import shmpipe``. It is cheap (the package imports its modules
  when they are first used: well under a millisecond after torch) but a
  user pays it, so it is counted: nothing of shmpipe runs in the process
  before the clock, which records that it did not (``shmpipe_modules`` and
  ``children`` before the clock: the test asserts both empty);
- inside the clock: making the loader (``shmpipe.from_dataset(...)``, and
  ``load_state_dict``; ``DataLoader(...)`` and its fast-forward ...) up to
  its first batch in hand. What the library does to get there (importing
  its modules, starting its fork server and producers) is measured without
  this file knowing of it.

A fresh epoch runs to its end in that process (its images/s, and its
checkpoints, pickled to files for the resumed processes); a resumed one
stops after its first batch, or runs to the end where the first round
checks it. The process reports in a JSON file; it is started in a session
of its own, and whatever of that session outlives it is ended.

This file is also the new process's program: it is run with ``python -c``
and its own text, so it imports nothing of shmpipe at its top (and loads
shmpipe/bench/_resume_loaders.py by its path, as a module of its own).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DATASET_MODULE", "NewProcess", "measure", "prepare"]

#: The dataset's module in the job's folder (a copy of _jpegs.py).
DATASET_MODULE = "jpeg_dataset"
#: On top of the loader's timeout per batch: the most a new process may take
#: to import torch (and Grain's JAX) and run its epoch on a loaded machine.
_START_S = 120.0
#: The most a loader's processes get to see their trainer gone and clean up
#: after it before they are killed (and counted as left running): they are
#: usually gone at once, but on a loaded 2-core machine a producer or a
#: spawned worker may take seconds to be scheduled.
_GRACE_S = 30.0


def _here() -> str:
    """This file's folder (in the bench's process: the new one, run with
    -c, has no __file__)."""
    return os.path.dirname(os.path.abspath(__file__))


@dataclass
class NewProcess:
    """One measurement in a new process: what was there before its clock,
    and what it timed (perf_counter seconds in that process)."""

    loader: str
    at: str  # "fresh", or the checkpoint's label
    round: int
    pid: int = 0
    ppid: int = 0  # its parent: the bench's process
    bench_pid: int = 0  # the bench's process, which started it
    before_clock: list[str] = field(default_factory=list)  # what it imported before the clock
    shmpipe_modules_before_clock: list[str] = field(default_factory=list)  # always empty: checked by the tests
    children_before_clock: list[int] = field(default_factory=list)  # always empty: no fork server, no worker
    shmpipe_modules_at_first_batch: int = 0  # for shmpipe's loaders: proof that the clock covered its import
    import_s: float | None = None  # of the first batch: `import shmpipe` (shmpipe's loaders)
    made_s: float = float("nan")  # of the first batch: making the loader (and loading the state)
    first_batch_s: float = float("nan")  # from the clock's start to the first batch in hand
    #: of first_batch_s: CPython's full (generation 2) garbage collections
    #: inside it, timed by gc.callbacks (registered before the clock), and
    #: how many there were
    full_gc_s: float = 0.0
    full_gcs: int = 0
    images_per_s: float = float("nan")  # a fresh epoch's, first batch to last (checkpoints not counted)
    batches: int = 0
    left_running: int = 0  # processes of its session still alive after it ended, killed

    def record(self) -> dict[str, Any]:
        """For the report's JSON."""
        return dict(self.__dict__)


def prepare(folder: str) -> str:
    """The folder the new processes run in, with the dataset's module; and
    shmpipe's modules compiled to bytecode where they are not, as `pip
    install` leaves an installed package (the peers' packages are): a
    checkout run with PYTHONDONTWRITEBYTECODE, as this project's machines
    run, compiled every module of shmpipe from its source in every new
    process, 0.1 s of its first batch on a loaded 2-core machine that no
    user's install pays. Where the package's folder cannot be written, it
    stays as it is."""
    import compileall

    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(os.path.join(_here(), "_jpegs.py"), os.path.join(folder, DATASET_MODULE + ".py"))
    package = os.path.dirname(_here())
    if os.access(package, os.W_OK):
        compileall.compile_dir(package, quiet=2)
    return folder


_ids = iter(range(1 << 62))


def measure(
    job_dir: str, loader: str, at: str, round_no: int, images: str, count: int, log: str, cfg: Any, *,
    state: str | None = None, checkpoints: tuple[int, ...] = (), to_the_end: bool = False,
) -> tuple[NewProcess, list[list[int]], dict[int, str]]:
    """Runs `loader` in a new process in `job_dir` (see prepare()): a fresh
    epoch to its end, its checkpoints after each k in `checkpoints` pickled
    to files; or, with `state` (such a file), a resumed loader to its first
    batch (to the end with `to_the_end`). Returns the measurement, the
    batches' sample indices, and the checkpoint files by k. Raises if the
    process fails or runs past the loader's timeout and _START_S."""
    n = next(_ids)
    out_path = os.path.join(job_dir, f"out-{n}.json")
    spec = {
        "loader": loader, "images": images, "count": count, "log": log, "state": state,
        "checkpoints": list(checkpoints), "to_the_end": to_the_end or state is None,
        "cfg": {"batch_size": cfg.batch_size, "workers": cfg.workers, "seed": cfg.seed, "timeout_s": cfg.timeout_s},
        "loaders_file": os.path.join(_here(), "_resume_loaders.py"),
        "out": out_path, "states": os.path.join(job_dir, f"state-{n}"),
    }
    path = os.path.join(job_dir, f"job-{n}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    # The process finds the dataset's module in its folder (and producers,
    # whatever their start method, through PYTHONPATH) and this very shmpipe.
    package_parent = os.path.dirname(os.path.dirname(_here()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (job_dir, package_parent, os.environ.get("PYTHONPATH", "")) if p)}
    with open(os.path.join(job_dir, f"log-{n}.txt"), "w+") as output:
        proc = subprocess.Popen(
            [sys.executable, "-c", _source(), path], stdout=output, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=job_dir, env=env, start_new_session=True,
        )
        try:
            proc.wait(timeout=cfg.timeout_s + _START_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            left = _end(proc)
        if proc.returncode != 0:
            output.seek(0)
            tail = output.read().strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"{loader} ({at}) in a new process: exit status {proc.returncode}: {tail[0]}")
    with open(out_path) as f:
        got = json.load(f)
    run = NewProcess(loader, at, round_no, bench_pid=os.getpid(), left_running=left,
                     **{k: v for k, v in got.items() if k not in ("batches", "states")})
    run.batches = len(got["batches"])
    return run, got["batches"], {int(k): v for k, v in got["states"].items()}


def _source() -> str:
    with open(os.path.abspath(__file__)) as f:
        return f.read()


def _end(proc: subprocess.Popen) -> int:
    """Ends the new process (SIGKILL if it still runs) and, after _GRACE_S
    for them to clean up, whatever of its session is left (its loader's
    processes). Returns how many had to be killed."""
    from shmpipe._process import process_group_members

    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + _GRACE_S
    while process_group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = process_group_members(proc.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(left)


# -- the new process ------------------------------------------------------------------------------


def _children() -> list[int]:
    """This process's live children, from /proc (nothing of shmpipe's)."""
    me, out = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":  # ppid; a zombie is no process at work
            out.append(int(entry))
    return sorted(out)


def _shmpipe_modules() -> list[str]:
    return sorted(m for m in sys.modules if m == "shmpipe" or m.startswith("shmpipe."))


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _FullCollections:
    """CPython's full (generation 2) garbage collections in this process,
    timed: a callback of gc.callbacks, added before the clock. After
    ``import torch`` the collector's counters stand close to its first full
    collection (about 0.1 s over torch's objects), which the next few
    thousand allocations of anything trigger; the report says whose first
    batch it fell in."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began
            self.count += 1


def _main(spec_path: str) -> None:
    with open(spec_path) as f:
        job = json.load(f)
    before: list[str] = []
    for name in ("torch", "PIL.Image", "numpy", DATASET_MODULE):
        if name != "torch" or importlib.util.find_spec("torch") is not None:
            importlib.import_module(name)
            before.append(name)
    dataset = sys.modules[DATASET_MODULE]
    loader = _load("_bench_resume_loaders", job["loaders_file"]).LOADERS[job["loader"]]
    for name in loader.imports:
        importlib.import_module(name)
        before += [] if name in before else [name]
    state = None
    if job["state"] is not None:
        with open(job["state"], "rb") as f:
            state = pickle.load(f)
    cfg = types.SimpleNamespace(**job["cfg"])
    ds = dataset.JpegFolder(job["images"], job["count"], job["log"])
    out: dict[str, Any] = {"pid": os.getpid(), "ppid": os.getppid(), "before_clock": before,
                           "shmpipe_modules_before_clock": _shmpipe_modules(), "children_before_clock": _children()}
    at = set(job["checkpoints"])
    batches: list[list[int]] = []
    states: dict[int, str] = {}
    paused, t_first = 0.0, float("nan")
    full = _FullCollections()
    gc.callbacks.append(full)

    t0 = time.perf_counter()  # the clock: nothing of shmpipe's has run in this process
    if job["loader"].startswith("shmpipe"):
        import shmpipe  # noqa: F401 - a user's job pays it: counted

        out["import_s"] = time.perf_counter() - t0
    opened = loader.fresh(ds, cfg) if state is None else loader.resume(ds, cfg, state)
    out["made_s"] = time.perf_counter() - t0
    try:
        for batch in opened.batches:
            batches.append(dataset.ids(batch))
            del batch  # shmpipe: the slot goes back before the next batch is taken
            t = time.perf_counter()
            if len(batches) == 1:
                t_first = t
                out["first_batch_s"] = t - t0
                out["full_gc_s"], out["full_gcs"] = full.seconds, full.count
                out["shmpipe_modules_at_first_batch"] = len(_shmpipe_modules())
                if not job["to_the_end"]:
                    break
            if len(batches) in at:
                states[len(batches)] = f"{job['states']}-{len(batches)}.pkl"
                with open(states[len(batches)], "wb") as f:
                    pickle.dump(loader.checkpoint(opened, len(batches)), f)
            paused += time.perf_counter() - t
        t_end = time.perf_counter()
    finally:
        opened.close()
    window = t_end - t_first - paused
    if len(batches) > 1 and window > 0:
        out["images_per_s"] = sum(len(b) for b in batches[1:]) / window
    with open(job["out"], "w") as f:
        json.dump({**out, "batches": batches, "states": states}, f)


if __name__ == "__main__":
    _main(sys.argv[1])
