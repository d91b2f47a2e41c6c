"""Checks this machine for what breaks pipelines in practice, one line each:
OK, or WARN with the fix. Exits 1 when a check warns.

  /dev/shm            its size (Docker gives 64 MB): the named backing
                      (backing="posix") lives there; the default ring does not
  memory for rings    what the default ring (sealed memfd) draws on instead:
                      MemAvailable, or the cgroup's limit when it is smaller
  open files          ulimit -n: each producer holds a few descriptors, Ray many
  locked memory       ulimit -l: pinned (page-locked) memory for a GPU copy
  huge pages          transparent huge pages for shared memory (information)
  start methods       forkserver or spawn, which producers start with
  packages            numpy and the optional ones, with their versions
                      (read from the installed metadata, nothing imported)
  CUDA devices        from the driver (/proc/driver/nvidia), torch not imported
  JAX devices         where JAX is installed: its version, backend and devices,
                      from a child interpreter (this one never imports jax)
  leftover segments   named segments whose processes died (shmpipe clean)
  producer start-up   two producers started as a pipeline starts them: the
                      time to their first batch, their memory (PSS), and
                      whether they load a heavy framework (they should not:
                      shmpipe's fork server never imports the training
                      script; a sitecustomize or .pth file may)
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing
import os
import platform
import re
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Check", "checks", "main"]

GiB, MiB = 1 << 30, 1 << 20

#: Below this /dev/shm is Docker's default size or close to it.
SHM_WARN_BYTES = 1 * GiB
#: Below this the default rings (and a few 48 MB batches) may not fit.
MEMORY_WARN_BYTES = 1 * GiB
#: A pipeline of 8 producers holds about 40 descriptors; Ray and TensorFlow
#: open hundreds more. 1024 is the usual soft default; Docker's or a
#: login's 256 or less runs out.
NOFILE_WARN = 1024
#: pin_memory=True page-locks the ring for a GPU copy.
MEMLOCK_WARN_BYTES = 1 * GiB

#: Starting two producers and getting their first batch takes longer than
#: this only on a machine that is overloaded or imports slowly.
STARTUP_WARN_S = 2.0

#: optional package -> the minimum shmpipe's extras ask for, and the extra
OPTIONAL = {
    "numpy": (None, None),
    "pyarrow": ("14", "arrow"),
    "ray": ("2.9", "ray"),
    "tensorflow": ("2.16", "tensorflow"),
    "torch": ("2.1", "torch"),
    "jax": ("0.4.30", "jax"),
    "rich": ("13", "bench"),
    "matplotlib": ("3.7", "bench"),
}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    value: str
    #: what to do about it (with ok False), or why it does not matter
    fix: str = ""

    @property
    def status(self) -> str:
        return "OK" if self.ok else "WARN"

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = asdict(self)
        d["status"] = self.status
        return d


def _size(nbytes: int) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.1f} GiB"
    return f"{nbytes / MiB:.0f} MiB"


def check_dev_shm() -> Check:
    from shmpipe._segments import SHM_DIR
    from shmpipe.transports._shm_memory import _free_bytes

    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        return Check("/dev/shm", False, f"cannot be read ({exc.strerror})",
                     'only backing="posix" needs it; the default ring does not')
    total, free = st.f_blocks * st.f_frsize, _free_bytes(SHM_DIR)
    value = f"{_size(total)}, {_size(free)} free"
    if total < SHM_WARN_BYTES:
        return Check("/dev/shm", False, value,
                     'the default ring does not use it, but backing="posix" and other libraries (PyTorch\'s '
                     "DataLoader, Ray's object store) do: docker run --shm-size=8g (or mount -o remount,size=8G "
                     "/dev/shm)")
    return Check("/dev/shm", True, value)


def check_memory() -> Check:
    from shmpipe.transports._shm_memory import _cgroup_memory_free, _memory_available

    room, what = _memory_available()
    cgroup = _cgroup_memory_free()
    limit = "no cgroup memory limit" if cgroup is None else f"the cgroup may charge {_size(cgroup)} more"
    if room is None:
        return Check("memory for rings", True, f"unknown (no MemAvailable); {limit}")
    value = f"{_size(room)}: {what}; {limit}"
    if room < MEMORY_WARN_BYTES:
        return Check("memory for rings", False, value,
                     "the default ring (sealed memfd) is charged to this memory: give the container or "
                     "cgroup more (docker run --memory=...), or use a smaller capacity or slot_size")
    return Check("memory for rings", True, value)


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def producers_allowed(soft: int) -> int | None:
    """How many producers one shm pipeline (the fork server's) may start in a
    fresh process under a limit of `soft` open files (None: no limit): what
    the pipeline's own check (_descriptors.check_descriptor_room) allows."""
    from shmpipe._descriptors import FDS_PER_PRODUCER, FDS_TO_START, open_descriptors

    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, (soft - open_descriptors() - FDS_TO_START) // FDS_PER_PRODUCER)


def check_open_files() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    allowed = producers_allowed(soft)
    value = f"{_limit(soft)} (hard limit {_limit(hard)}); " + (
        "no limit on producers" if allowed is None else f"room for {allowed} producers in one pipeline"
    )
    if soft != resource.RLIM_INFINITY and soft < NOFILE_WARN:
        if hard == resource.RLIM_INFINITY or hard >= 4096:
            fix = "ulimit -n 4096 before starting Python"
        else:
            fix = (f"the hard limit is {hard}: raise it (docker run --ulimit nofile=4096:4096, or "
                   "/etc/security/limits.conf), then ulimit -n 4096")
        return Check("open files (ulimit -n)", False, value, fix)
    return Check("open files (ulimit -n)", True, value)


def check_locked_memory(gpus: int) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    value = f"{'unlimited' if soft == resource.RLIM_INFINITY else _size(soft)}"
    small = soft != resource.RLIM_INFINITY and soft < MEMLOCK_WARN_BYTES
    if small and gpus:
        return Check("locked memory (ulimit -l)", False, value,
                     "to_torch(pin_memory=True) page-locks the ring: ulimit -l unlimited "
                     "(docker run --ulimit memlock=-1)")
    return Check("locked memory (ulimit -l)", True, value,
                 "" if not small else "matters only for pinned memory on a GPU machine")


def check_huge_pages() -> Check:
    values = []
    for name in ("enabled", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                text = f.read()
        except OSError:
            continue
        m = re.search(r"\[(\w+)\]", text)
        values.append(f"{name} {m.group(1) if m else text.strip()}")
    return Check("transparent huge pages", True, ", ".join(values) or "not available",
                 "information only: shmpipe works either way")


def check_start_methods() -> Check:
    from shmpipe._startup import default_start_method

    methods = multiprocessing.get_all_start_methods()
    value = f"{', '.join(methods)}; producers start with {default_start_method()}"
    if "forkserver" not in methods and "spawn" not in methods:
        return Check("start methods", False, value, "shmpipe needs forkserver or spawn (Linux has both)")
    return Check("start methods", True, value)


def _startup_source() -> Iterator[dict[str, Any]]:
    """A doctor's producer: one batch that says which heavy frameworks this
    producer process has loaded, by their index in HEAVY_FRAMEWORKS."""
    import numpy as np

    from shmpipe._startup import HEAVY_FRAMEWORKS

    loaded = [i for i, name in enumerate(HEAVY_FRAMEWORKS) if name in sys.modules]
    yield {"pid": np.array(os.getpid()), "loaded": np.array(loaded, dtype=np.int64)}


def check_startup(workers: int = 2) -> Check:
    """Starts `workers` producers as a pipeline does (the default start
    method, shmpipe's fork server started for them where it is not yet)
    and reports what that cost."""
    import shmpipe
    from shmpipe._process import proc_kib
    from shmpipe._startup import HEAVY_FRAMEWORKS, default_start_method

    name = "producer start-up"
    t0 = time.perf_counter()
    try:
        with shmpipe.from_iterators([_startup_source] * workers, timeout=60) as pipe:
            batches: list[dict[str, Any]] = []
            first_s = float("nan")
            for batch in pipe:
                if not batches:
                    first_s = time.perf_counter() - t0
                batches.append({k: v.copy() for k, v in batch.items()})
            # read while they run (they wait for the next pass)
            sizes = [proc_kib(f"/proc/{int(b['pid'])}/smaps_rollup", "Pss") for b in batches]
    except shmpipe.ShmpipeError as exc:
        return Check(name, False, f"could not start producers: {exc}", "see the error; shmpipe doctor's other checks")
    loaded = sorted({HEAVY_FRAMEWORKS[int(i)] for b in batches for i in b["loaded"]})
    memory = "unknown" if any(s is None for s in sizes) else _size(sum(s for s in sizes if s is not None))
    value = (f"{workers} producers ({default_start_method()}): first batch in {first_s:.2f} s, "
             f"their memory {memory} (PSS); "
             + (f"they load {', '.join(loaded)}" if loaded else f"they load none of {', '.join(HEAVY_FRAMEWORKS)}"))
    if loaded:
        return Check(name, False, value,
                     f"something imports {', '.join(loaded)} in every Python process (a sitecustomize.py, a .pth "
                     "file in site-packages, PYTHONSTARTUP): each producer pays for it in time and memory; "
                     "remove that import")
    prestart = ("shmpipe.prestart() at the top of a training script, before it imports a framework, starts the "
                "fork server meanwhile and takes that start out of the first batch")
    if first_s > STARTUP_WARN_S:
        return Check(name, False, value,
                     "starting producers is slow here: the machine is busy, or importing NumPy and shmpipe is "
                     f"(shmpipe's fork server imports them once; a producer is a fork of it); {prestart}")
    return Check(name, True, value,
                 "a source defined in the training script travels by value: producers import neither the script "
                 "nor what it imports, unless the source uses state only the script makes (a lock, an open "
                 f"file), and then shmpipe warns; {prestart}")


def _version(name: str) -> str | None:
    for dist in (name, f"{name}-cpu") if name == "tensorflow" else (name,):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _older(version: str, minimum: str) -> bool:
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", v)[:3])

    return parts(version) < parts(minimum)


def check_packages() -> list[Check]:
    out = []
    for name, (minimum, extra) in OPTIONAL.items():
        version = _version(name)
        label = f"package {name}"
        if version is None:
            if extra is None:
                out.append(Check(label, False, "not installed", "pip install numpy"))
            else:
                how = (
                    "pip install torch (a plain torch from PyPI is a multi-GB CUDA build; for the CPU build: "
                    "pip install torch --index-url https://download.pytorch.org/whl/cpu)"
                    if name == "torch" else f'pip install "shmpipe[{extra}]"'
                )
                out.append(Check(label, True, "not installed (optional)", how))
        elif minimum is not None and _older(version, minimum):
            fix = f'shmpipe needs {name}>={minimum}: pip install -U "{name}>={minimum}"'
            out.append(Check(label, False, version, fix))
        else:
            out.append(Check(label, True, version))
    return out


def cuda_devices() -> int:
    """NVIDIA GPUs the driver lists (0 without a driver)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def check_cuda(gpus: int) -> Check:
    smi = shutil.which("nvidia-smi")
    if gpus:
        return Check("CUDA devices", True, f"{gpus} (driver loaded{', nvidia-smi at ' + smi if smi else ''})")
    return Check("CUDA devices", True, "none: no NVIDIA driver loaded" + (f" (but nvidia-smi at {smi})" if smi else ""),
                 "to_torch(device='cuda') needs one; everything else runs on the CPU")


#: Importing jax and listing its devices takes 1-3 s; longer, a plugin hangs.
JAX_PROBE_TIMEOUT_S = 60.0
_JAX_PROBE = (
    "import json, jax; "
    "print(json.dumps([jax.__version__, jax.default_backend(), [str(d) for d in jax.local_devices()]]))"
)


def check_jax() -> Check:
    """JAX's version, default backend and local devices (what to_jax() puts
    batches on), asked of a child interpreter: importing jax here would
    load it into the doctor's process (and a broken accelerator plugin may
    crash or hang it)."""
    import subprocess
    import tempfile

    name = "JAX devices"
    if _version("jax") is None:
        return Check(name, True, "none: JAX is not installed", 'to_jax() needs it: pip install "shmpipe[jax]"')
    try:
        # Away from the working directory: a folder named jax there would come first.
        proc = subprocess.run([sys.executable, "-c", _JAX_PROBE], capture_output=True, text=True,
                              timeout=JAX_PROBE_TIMEOUT_S, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return Check(name, False, f"importing jax and listing its devices took over {JAX_PROBE_TIMEOUT_S:g} s",
                     "python -c 'import jax; print(jax.devices())' shows where it hangs (a GPU plugin, often)")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(name, False, f"jax fails to start: {error}",
                     "python -c 'import jax; print(jax.devices())' shows the whole error")
    version, backend, devices = json.loads(lines[-1])
    shown = ", ".join(devices[:4]) + (f" and {len(devices) - 4} more" if len(devices) > 4 else "")
    value = f"JAX {version}, {backend} backend: {len(devices)} device{'s' if len(devices) != 1 else ''} ({shown})"
    if backend == "cpu":
        return Check(name, True, value, "to_jax() aliases the ring on the CPU; "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N host devices")
    return Check(name, True, value)


def check_leftovers() -> Check:
    from shmpipe._segments import sweep

    left = sweep(dry_run=True)
    if left:
        names = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        return Check("leftover segments", False, f"{len(left)} whose processes died: {names}",
                     "shmpipe clean (removes only segments whose owner died)")
    return Check("leftover segments", True, "none")


def checks() -> list[Check]:
    """Every check, on this machine, now."""
    gpus = cuda_devices()
    return [
        check_dev_shm(),
        check_memory(),
        check_open_files(),
        check_locked_memory(gpus),
        check_huge_pages(),
        check_start_methods(),
        *check_packages(),
        check_cuda(gpus),
        check_jax(),
        check_leftovers(),
        # last: a pipeline that opens sweeps dead owners' segments, which
        # check_leftovers is to report first
        check_startup(),
    ]


def main(as_json: bool = False) -> int:
    """`shmpipe doctor`: prints the checks; 1 if any warns, else 0."""
    import shmpipe

    found = checks()
    problems = [c for c in found if not c.ok]
    if as_json:
        print(json.dumps({
            "shmpipe": shmpipe.__version__, "python": platform.python_version(), "kernel": platform.release(),
            "ok": not problems, "checks": [c.as_dict() for c in found],
        }, indent=2))
    else:
        print(f"shmpipe doctor: shmpipe {shmpipe.__version__}, Python {platform.python_version()}, "
              f"Linux {platform.release()}, {os.cpu_count()} CPUs")
        width = max(len(c.name) for c in found)
        for c in found:
            line = f"  {c.status:<4}  {c.name:<{width}}  {c.value}"
            if c.fix and not c.ok:
                line += f"\n        fix: {c.fix}"
            elif c.fix:
                line += f"  ({c.fix})"
            print(line)
        print(f"{len(problems)} problem(s)" if problems else "no problems found")
    sys.stdout.flush()
    return 1 if problems else 0
