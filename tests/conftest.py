"""Every test runs under a guard: it fails if it leaves a shmpipe segment in
/dev/shm, a descriptor of a ring's anonymous memory, or a child process
behind."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Hashable
from typing import Any

import pytest

from shmpipe import _process, _segments
from shmpipe.testing.assertions import assert_same  # noqa: F401  (tests import it from here)
from shmpipe.testing.memory import ring_descriptors

#: NumPy asks for transparent huge pages for its large arrays (madvise), and
#: with the kernel's default THP defrag (madvise) such a fault may compact
#: memory first: a producer's 1 GiB batch took 0.16 s or 5.7 s to fill at
#: random, one run of the same script after another. The suite's processes
#: (each inherits this) fill with ordinary pages instead: about 0.5 s, every
#: time. (shmpipe's rings and regions are shared memory, which this leaves as
#: it is.)
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")
#: Most of the suite's CPU is the interpreters it starts (ranks, consumers,
#: fork servers, Ray's workers), on 2 cores, and each that imports NumPy
#: starts OpenBLAS's threads, which spin for a while before they sleep:
#: `import numpy` took 0.24 s of CPU, 0.13 s with this (0.13 s either way on
#: the clock). It sets how soon an idle BLAS thread sleeps, nothing that a
#: test checks; the fork server's own handling of it (it sets it for its
#: preload where the environment does not) has its own test, which sets the
#: variable or removes it for its script.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

#: A suite started in the background without job control (`pytest &` in a
#: script, a CI step's helper) inherits SIGINT ignored, and so does every
#: script it starts (an ignored signal stays ignored across exec; Python
#: then installs no KeyboardInterrupt for it): the tests that press Ctrl-C
#: in a script (os.kill, SIGINT) waited out their timeouts instead, three
#: of them 120 s each in one run here. A handler does not survive exec: the
#: scripts start with SIGINT's default, as under a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _our_segments() -> set[str]:
    """shmpipe segments of this process, of its live descendants (a CLI run
    in a subprocess) or of owners that are gone; not those of other live
    processes (another test run, or a training job, on the same machine)."""
    try:
        entries = os.listdir(_segments.SHM_DIR)
    except FileNotFoundError:
        return set()
    ours = set()
    for entry in entries:
        owner = _segments.parse_name(entry)
        if owner is not None and (not _process.owner_alive(*owner) or _descends_from_us(owner[0])):
            ours.add(entry)
    return ours


#: The scripts of SharedRuns families running in the background now (their
#: pids): what they and their children make is theirs, not the test's that
#: runs meanwhile (a segment they leave behind, its owner dead, is still
#: seen by the guard of whatever test runs then).
_BACKGROUND_PIDS: set[int] = set()


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    for _ in range(64):  # a chain of parents; pid 1 ends it
        if pid == me:
            return True
        if pid <= 1 or pid in _BACKGROUND_PIDS:
            return False
        found = _parent_and_session(pid)
        if found is None:
            return False
        pid = found[0]
    return False


def _parent_and_session(pid: int) -> tuple[int, int] | None:
    """(parent, session) of `pid` (fields 4 and 6 of /proc/PID/stat); None
    where it has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[3])


def assert_round_robin_prefix(order: list[tuple[int, int]], num_workers: int) -> None:
    """An ordered pass's deliveries, (worker, its batch number) each, of
    workers whose parts are equally long: the workers in turn, each at its
    next batch, with no gap: a prefix of the uninterrupted sequence, also
    where the pass failed."""
    want = [(k % num_workers, k // num_workers) for k in range(len(order))]
    assert order == want, f"not the ordered sequence's prefix: {order[:40]}"


#: The frameworks whose objects _freeze_the_frameworks froze last.
_FROZEN_WITH: set[str] = set()


def _freeze_the_frameworks() -> None:
    """This process imports torch, TensorFlow, JAX, pyarrow and Ray as the
    tests need them, millions of objects that live to its end, and each full
    collection walked them all: about 0.3 s each, the tests' own
    gc.collect() calls and the collector's, 11 s of one run's 682 s
    (measured with gc.callbacks). Once a framework is loaded, what lives is
    moved out of the collector's sight (gc.freeze; collected first, so that
    no garbage is kept), at the next test's start. Objects made later are
    collected as before: what the tests about collection look at."""
    loaded = {name for name in ("torch", "tensorflow", "jax", "pyarrow", "ray") if name in sys.modules}
    if loaded - _FROZEN_WITH:
        gc.collect()
        gc.freeze()
        _FROZEN_WITH.update(loaded)


@pytest.fixture(autouse=True)
def no_leaks():
    _freeze_the_frameworks()
    before = _our_segments()
    before_fds = set(ring_descriptors())
    yield
    left_fds = set(ring_descriptors()) - before_fds
    if left_fds:  # a pipeline a test forgot is closed when it is collected (gc is slow: only then)
        gc.collect()
        left_fds = set(ring_descriptors()) - before_fds
    # Clean-up that happens in other processes (a producer removing the
    # segment of a consumer that died) may take a moment.
    deadline = time.monotonic() + 5.0
    while True:
        left = _our_segments() - before
        children = multiprocessing.active_children()
        if (not left and not children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for name in left:  # so one leak does not fail the tests after it
        try:
            os.unlink(os.path.join(_segments.SHM_DIR, name))
        except FileNotFoundError:
            pass
    for child in children:
        child.kill()
        child.join(5)
    assert not left, f"the test left shared-memory segments behind: {sorted(left)}"
    assert not left_fds, f"the test left descriptors of ring memory open: {sorted(left_fds)}"
    assert not children, f"the test left child processes behind: {children}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "after_background: the test runs after every other test; with the fixture background_ended it also "
        "waits until every background family's scripts have ended: a test that what those scripts do would disturb",
    )


#: What the suite's processes make in the temporary directory and must not
#: leave there: multiprocessing's folders (pymp-*, a fork server's socket),
#: torchrun's (torchelastic_*), tempfile's (tmp*) and shmpipe's (shmpipe-*,
#: the benches'). Ray's /tmp/ray is Ray's to keep; pytest's tmp_path
#: folders are pytest's (pytest-of-*).
_TMP_PREFIXES = ("pymp-", "torchelastic_", "tmp", "shmpipe-")
#: What was there before the session.
_TMP_BEFORE: set[str] = set()
#: How long the session's end waits for a folder being removed (a fork
#: server removes its killed trainer's folder on its way out).
_TMP_GRACE_S = 10.0


def _tmp_entries() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(_TMP_PREFIXES)}


def pytest_sessionstart(session: pytest.Session) -> None:
    _TMP_BEFORE.update(_tmp_entries())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run if its processes left anything in the temporary
    directory (after the folders being removed had a moment). It removes
    nothing: another session running beside this one (two subsets at once)
    would have its live folders taken for leaks, and lose them."""
    own = multiprocessing.process.current_process()._config.get("tempdir")  # removed at this process's exit
    deadline = time.monotonic() + _TMP_GRACE_S
    while True:
        left = sorted(n for n in _tmp_entries() - _TMP_BEFORE if os.path.join(tempfile.gettempdir(), n) != own)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left:
        session.config.get_terminal_writer().line(
            f"\nthe tests left these in {tempfile.gettempdir()}: {', '.join(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of modules with a background family run last (in their
    order), so that their scripts have run beside everything before them;
    after them, the tests marked after_background."""
    late = {id(module) for _, module in background_families(items)}

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("after_background") is not None:
            return 2
        return 1 if id(getattr(item, "module", None)) in late else 0

    items.sort(key=rank)  # stable: each group keeps its order


@pytest.fixture
def background_ended(shared_runs_in_background: BackgroundRuns) -> None:
    """Waits until the scripts of every background family have ended: each
    of them starts pipelines, and each pipeline that opens a ring sweeps
    the dead owners' segments of this user (a test that makes such segments
    to see what `shmpipe clean` does with them would find them gone)."""
    for family in shared_runs_in_background.families:
        if not family.background_done.wait(BACKGROUND_WAIT_S):
            raise TimeoutError(f"the background runs did not end within {BACKGROUND_WAIT_S:g} s")


@pytest.fixture(scope="session", autouse=True)
def shared_runs_in_background(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts the scripts of the background families (SharedRuns) with the
    session, and ends whatever of them still runs when it ends."""
    runs = BackgroundRuns(request.session.items, tmp_path_factory)
    runs.start()
    yield runs
    runs.stop()


@contextlib.contextmanager
def ray_friendly_cwd(directory):
    """Ray puts the driver's working directory on its workers' sys.path. Run
    from the repository's root, that would make them import the shmpipe
    source tree (no compiled extensions) instead of the installed package,
    so Ray is started from another directory."""
    old = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(old)


# -- scripts run in a process group of their own ----------------------------------


def ignoring_sigint() -> None:
    """A ``preexec_fn``: the script starts with SIGINT ignored, as whatever
    ran the tests may have left it (``nohup ... &``, a CI runner), and as
    every child inherits it. A script that is to be Ctrl-C'd says what a
    press does itself: ``signal.signal(signal.SIGINT, signal.default_int_handler)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


#: The live processes of a process group (shmpipe._process has the one reading of /proc).
group_members = _process.process_group_members


def end_group(proc: subprocess.Popen, grace: float = 10.0, remove_segments: bool = True) -> tuple[Any, Any]:
    """Ends `proc`, a script started with ``start_new_session=True``, and
    every process of its group (its producers, forkserver, resource
    tracker), whatever state the test left them in; removes the segments
    named after it (unless `remove_segments` is false: a check that comes
    later is to see them); reads and closes its pipes. For a test's
    ``finally``: a failing test still leaves nothing running. Returns what
    was left to read of its stdout and stderr, as ``communicate`` does.

    The script is SIGKILLed first, and its group gets `grace` seconds to
    end by itself: producers see their consumer gone and remove what it
    can no longer remove (SIGKILLing the whole group at once would take
    the resource tracker and the producers' clean-up with it)."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    deadline = time.monotonic() + grace
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in group_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        entries = os.listdir(_segments.SHM_DIR) if remove_segments else []
    except FileNotFoundError:
        entries = []
    for entry in entries:
        owner = _segments.parse_name(entry)
        if owner is not None and owner[0] == proc.pid and not _process.owner_alive(*owner):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_segments.SHM_DIR, entry))
    try:
        return proc.communicate(timeout=10)  # every writer is gone: it reads to the end
    except subprocess.TimeoutExpired:  # a process outside the group holds its pipes
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        return None, None


# -- independent scripts of several tests, run a few at a time --------------------


@dataclasses.dataclass
class Command:
    """A script a test runs and waits for: `args` in `cwd`, killed (and its
    process group) if it is not done within `timeout` seconds. Commands of
    the same `exclusive` tag never run at the same time (two local Rays).
    `seconds`: about how long it takes alone, an order only (run_together
    starts the longest first)."""

    args: list[str]
    cwd: Any
    env: dict[str, str] | None = None
    timeout: float = 300.0
    exclusive: str | None = None
    preexec_fn: Callable[[], None] | None = None
    seconds: float = 0.0


class Stopped(Exception):
    """run_together was told to stop (the session ends)."""


def run_together(
    commands: dict[Hashable, Command], jobs: int = 2, *, stop: threading.Event | None = None,
    on_start: Callable[[Hashable, int], None] | None = None,
    on_done: Callable[[Hashable, subprocess.CompletedProcess], None] | None = None,
) -> dict[Hashable, subprocess.CompletedProcess]:
    """Runs `commands`, `jobs` at a time (this machine, and CI's, has two
    cores; most of these scripts keep one busy while they import a
    framework, then wait on their producers), and returns for each what
    ``subprocess.run(..., capture_output=True, text=True)`` would. Output goes to files, not pipes, so a process that
    outlives its script cannot hold the wait up. A command past its timeout
    is SIGKILLed with its process group and comes back with its output so
    far and returncode -9 (the test's assertion on it says so). Whatever
    ends the wait early (a KeyboardInterrupt, pytest-timeout's signal), the
    commands still running are killed with their process groups.

    The longest start first (Command.seconds; ties in the given order): the
    family's wait ends when its last command does, and a long one started
    last would run alone on a core the others left idle.

    `on_start(key, pid)` and `on_done(key, result)` are called as each
    starts and ends; `stop`, once set, ends the wait with Stopped (what is
    still running killed)."""
    pending = dict(sorted(commands.items(), key=lambda kv: -kv[1].seconds))
    running: dict[Hashable, tuple[subprocess.Popen, Any, Any, float]] = {}
    done: dict[Hashable, subprocess.CompletedProcess] = {}
    try:
        while pending or running:
            busy = {commands[k].exclusive for k in running}
            for key, cmd in list(pending.items()):
                if len(running) >= jobs:
                    break
                if cmd.exclusive is not None and cmd.exclusive in busy:
                    continue
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                proc = subprocess.Popen(cmd.args, cwd=cmd.cwd, env=cmd.env, stdout=out, stderr=err, text=True,
                                        stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=cmd.preexec_fn)
                running[key] = (proc, out, err, time.monotonic() + cmd.timeout)
                busy.add(cmd.exclusive)
                del pending[key]
                if on_start is not None:
                    on_start(key, proc.pid)
            for key, (proc, out, err, deadline) in list(running.items()):
                if proc.poll() is None and time.monotonic() < deadline:
                    continue
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)
                out.seek(0)
                err.seek(0)
                done[key] = subprocess.CompletedProcess(commands[key].args, proc.returncode, out.read(), err.read())
                out.close()
                err.close()
                del running[key]
                if on_done is not None:
                    on_done(key, done[key])
            if stop is not None and stop.is_set():
                raise Stopped
            if running:
                _wait_any([proc for proc, *_ in running.values()], 0.5)
    finally:
        for proc, out, err, _ in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            out.close()
            err.close()
    return {key: done[key] for key in commands}


def _wait_any(procs: list[subprocess.Popen], timeout: float) -> None:
    """Until one of `procs` ends, or `timeout` seconds (on their pidfds)."""
    import select

    fds = []
    try:
        for proc in procs:
            with contextlib.suppress(OSError):
                fds.append(os.pidfd_open(proc.pid))
        if fds:
            select.select(fds, [], [], timeout)
        else:
            time.sleep(min(timeout, 0.05))
    finally:
        for fd in fds:
            os.close(fd)


def concurrently(calls: list[Callable[[], Any]], jobs: int = 2, timeout: float = 600.0) -> list[Any]:
    """Runs `calls` (independent cycles of a test, each starting, waiting
    for and checking its own processes), `jobs` at a time in threads, and
    returns their results in order once all have ended. The first of them
    (in order) that raised is raised again. Each call bounds its own waits;
    `timeout` bounds the wait for all."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(call) for call in calls]
        done, _ = concurrent.futures.wait(futures, timeout=timeout)
        if len(done) < len(futures):
            raise TimeoutError(f"{len(futures) - len(done)} of {len(futures)} runs did not end within {timeout:g} s")
    return [future.result() for future in futures]


class _Shared:
    """What SharedRuns and SharedJobs have in common: the results of a family
    of tests, made together by the first test that asks."""

    def __init__(self, tests: Collection[str], keys: Callable[[pytest.Item], list[Hashable]], jobs: int) -> None:
        self.tests, self.keys, self.jobs = tests, keys, jobs
        self.results: dict[Hashable, Any] = {}

    def wanted_by(self, items: list[pytest.Item], module: Any) -> list[Hashable]:
        """The keys of every test of the family among `items` (of `module`)."""
        keys: list[Hashable] = []
        for item in items:
            if item.module is module and getattr(item, "originalname", None) in self.tests:
                keys += [k for k in self.keys(item) if k not in keys]
        return keys

    def _wanted(self, request: pytest.FixtureRequest, key: Hashable) -> list[Hashable]:
        """`key`, then those of every test of the family this session runs,
        that are not made yet."""
        return [key] + [k for k in self.wanted_by(request.session.items, request.module)
                        if k != key and k not in self.results]


class SharedRuns(_Shared):
    """The scripts of a family of tests -- `tests`, test functions of one
    module, each running scripts and checking what they printed -- run
    together by the first of them that asks (run_together), for every test
    of the family this session runs; the others find their results ready.

    `keys(item)` says which scripts a test item runs (none where it will be
    skipped); `command(key, folder)` makes one, in an empty folder of its
    own, writing there whatever it needs. The first test's guard (no_leaks)
    sees every script of the family end and checks that nothing of theirs
    is left behind.

    With `background`, the family's scripts start when the session does
    (BackgroundRuns), beside the other tests, which mostly wait on their
    processes (the suite used half a core outside these scripts), and below
    them in priority (BACKGROUND_NICE); the family's tests run last. The
    background's scripts of the same Command.exclusive tag (a local Ray:
    OWN_RAY) still run one at a time."""

    def __init__(self, tests: Collection[str], keys: Callable[[pytest.Item], list[Hashable]],
                 command: Callable[[Hashable, Any], Command], jobs: int = 2, background: bool = False) -> None:
        super().__init__(tests, keys, jobs)
        self.command = command
        self.background = background
        #: key -> its folder, for the scripts the background runs; set once they have all ended
        self.in_background: dict[Hashable, Any] = {}
        self.background_done = threading.Event()
        self.background_error: BaseException | None = None

    def get(self, request: pytest.FixtureRequest, key: Hashable) -> tuple[subprocess.CompletedProcess, Any]:
        """(what the script of `key` did, its folder)."""
        if key in self.in_background:
            # The test's own timeout (pytest-timeout) bounds this wait too.
            if not self.background_done.wait(BACKGROUND_WAIT_S):
                raise TimeoutError(f"the background run of {key!r} did not end within {BACKGROUND_WAIT_S:g} s")
            if key not in self.results:
                raise RuntimeError(f"the background run of {key!r} did not run: {self.background_error!r}")
        if key not in self.results:
            keys = [k for k in self._wanted(request, key) if k not in self.in_background]
            factory = request.getfixturevalue("tmp_path_factory")
            folders = {k: _folder(factory, k) for k in keys}
            commands = {k: self.command(k, folders[k]) for k in keys}
            for k, out in run_together(commands, self.jobs).items():
                self.results[k] = (out, folders[k])
        return self.results[key]


def _folder(factory: pytest.TempPathFactory, key: Hashable) -> Any:
    return factory.mktemp(re.sub(r"\W+", "_", str(key))[:30] or "run")


#: The environment of a script that starts a local Ray beside the tests (a
#: background family's): a Ray of its own, never the cluster a test of this
#: process made meanwhile (cluster_utils.Cluster writes its address where
#: ray.init() looks for one, and would be joined). What shmpipe does is the
#: same: it calls ray.init() as a user's program would. Such scripts are
#: Command.exclusive="ray": one of them at a time (each Ray's start keeps a
#: core busy for seconds).
OWN_RAY = {"RAY_ADDRESS": "local"}


#: The niceness of the background's scripts (and what they start): 10 leaves
#: them about a tenth of a core the foreground wants, and every idle one.
BACKGROUND_NICE = 10

#: A script still running after this part of its timeout gets back the
#: foreground's priority: below it, with the foreground busy, a script ran
#: up to 6 times as long as alone (14 s to 35 s of a 60 s timeout), and its
#: timeout (or its own inner ones) must not be what ends it.
BACKGROUND_NICE_FOR = 1 / 3

#: One change of an autogroup's nice at a time: the kernel takes one per
#: 0.1 s machine-wide from a process without CAP_SYS_ADMIN (EAGAIN), and
#: the two threads that make them would otherwise retry in step.
_AUTOGROUP_LOCK = threading.Lock()


def _set_priority(pid: int, nice: int) -> bool:
    """Makes `pid` and its session `nice`. Where the kernel groups the
    scheduling by session (autogroup, the default on most distributions:
    /proc/PID/autogroup), a process's nice ranks it only within its session,
    and sessions share the cores equally whatever their processes' nice: the
    session's group is set too, or nothing changes. (Without privilege a
    process's nice only goes up; a session's goes back to 0 too.) False where
    the process has ended (or this kernel has no autogroup); True once done."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    deadline = time.monotonic() + 2.0
    with _AUTOGROUP_LOCK:
        while True:
            try:
                fd = os.open(f"/proc/{pid}/autogroup", os.O_WRONLY)
            except OSError:  # no autogroup here, or the process has ended
                return False
            try:
                os.write(fd, str(nice).encode())
                return True
            except BlockingIOError:  # EAGAIN: the machine-wide pace above
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.03)
            except OSError:
                return False
            finally:
                os.close(fd)


def _descendants(roots: Collection[int]) -> dict[int, tuple[int, int]]:
    """The live descendants of `roots`: {pid: (its root, its session)}. (A
    bench's script starts each process it measures in a session of its own,
    which a session's group priority does not reach.)"""
    parent: dict[int, int] = {}
    session: dict[int, int] = {}
    for name in os.listdir("/proc"):
        found = _parent_and_session(int(name)) if name.isdigit() else None
        if found is not None:  # (None: not a process, or ended since the listing)
            parent[int(name)], session[int(name)] = found
    found: dict[int, tuple[int, int]] = {}
    for pid in parent:
        ancestor = parent[pid]
        for _ in range(64):
            if ancestor in roots:
                found[pid] = (ancestor, session[pid])
                break
            if ancestor <= 1 or ancestor not in parent:
                break
            ancestor = parent[ancestor]
    return found


#: The most a test waits for the background runs (each script has its own
#: timeout, and run_together kills it there).
BACKGROUND_WAIT_S = 1200.0


def background_families(items: list[pytest.Item]) -> list[tuple[SharedRuns, Any]]:
    """The SharedRuns families made with background=True among the modules
    of `items`, with their modules, in the items' order."""
    found: list[tuple[SharedRuns, Any]] = []
    for module in dict.fromkeys(item.module for item in items if getattr(item, "module", None) is not None):
        for value in vars(module).values():
            if isinstance(value, SharedRuns) and value.background and all(f is not value for f, _ in found):
                found.append((value, module))
    return found


class BackgroundRuns:
    """The scripts of every background family this session runs, started at
    the session's start in a thread of this process (run_together, `jobs`
    at a time, the longest first), each family's results handed to it as
    its scripts end. stop() kills what is still running."""

    def __init__(self, items: list[pytest.Item], factory: pytest.TempPathFactory, jobs: int = 2) -> None:
        self.jobs = jobs
        self.commands: dict[Hashable, Command] = {}
        self.owner: dict[Hashable, tuple[SharedRuns, Hashable]] = {}
        found = background_families(items)
        self.families = [family for family, _ in found]
        for family, module in found:
            for key in family.wanted_by(items, module):
                folder = _folder(factory, key)
                command = family.command(key, folder)
                family.in_background[key] = folder
                self.commands[(id(family), key)] = command
                self.owner[(id(family), key)] = (family, key)
        #: each family's scripts not ended yet: its tests wait for its own only
        self.left = {id(family): len(family.in_background) for family in self.families}
        self.pids: dict[Hashable, int] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shared runs", daemon=True)
        self.started_at: dict[Hashable, float] = {}
        self.priorities = threading.Thread(target=self._keep_priorities, name="shared runs' priority", daemon=True)

    def start(self) -> None:
        for family in self.families:
            if not self.left[id(family)]:
                family.background_done.set()
        if self.commands:
            self.thread.start()
            self.priorities.start()

    def _keep_priorities(self) -> None:
        """Each second while scripts run: the sessions that their processes
        start go below the foreground too; a script past BACKGROUND_NICE_FOR
        of its timeout gets the foreground's priority back, with every
        process and session of its."""
        lowered: set[int] = set()  # sessions
        restored: set[int] = set()  # scripts' pids
        while self.thread.is_alive() and not self.stop_event.wait(1.0):
            now = time.monotonic()
            running = {pid: key for key, pid in list(self.pids.items())}
            late = {pid for pid, key in running.items()
                    if pid not in restored and now - self.started_at[key] > self.commands[key].timeout * BACKGROUND_NICE_FOR}
            back: dict[int, int] = {pid: pid for pid in late}  # the sessions to set back: {session: a process in it}
            for pid, (root, sid) in _descendants(running.keys()).items():
                if root in late:
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, pid, 0)
                    back.setdefault(sid, pid)
                elif root not in restored and sid not in lowered and sid not in running:
                    if _set_priority(pid, BACKGROUND_NICE):
                        lowered.add(sid)
            for pid in back.values():
                _set_priority(pid, 0)
            restored |= late

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            run_together(self.commands, self.jobs, stop=self.stop_event, on_start=self._started, on_done=self._done)
        except BaseException as exc:  # handed to the tests that wait, which raise it
            error = exc
        finally:
            self._finish(error)

    def _started(self, key: Hashable, pid: int) -> None:
        self.started_at[key] = time.monotonic()
        self.pids[key] = pid
        _BACKGROUND_PIDS.add(pid)
        # Below the tests in the foreground, which are what the session waits
        # for: these use a core when the foreground leaves it idle (it mostly
        # waits on its processes, or keeps one core of two busy) instead of
        # slowing it down (test_conformance alone beside two busy loops: 104 s
        # at the same priority, 64 s below it, 62 s with nothing beside it).
        # Set at once, before the script (which has just exec'd its
        # interpreter) starts processes of its own, which inherit it.
        _set_priority(pid, BACKGROUND_NICE)

    def _done(self, key: Hashable, result: subprocess.CompletedProcess) -> None:
        family, k = self.owner[key]
        family.results[k] = (result, family.in_background[k])
        _BACKGROUND_PIDS.discard(self.pids.pop(key, -1))
        self.left[id(family)] -= 1
        if not self.left[id(family)]:
            family.background_done.set()

    def _finish(self, error: BaseException | None) -> None:
        """Every family's wait ends (with `error`, where the run failed or
        was stopped, for the scripts that did not end)."""
        for family in self.families:
            family.background_error = error
            family.background_done.set()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(60)
        if self.priorities.is_alive():
            self.priorities.join(10)


class SharedJobs(_Shared):
    """As SharedRuns, for jobs that start and wait for processes themselves
    (a group's ranks): `job(key)` makes a function that does one, and up to
    `jobs` of them run at a time in threads of this process. get() returns
    what the job returned, or raises what it raised. Each job bounds its own
    waits; `timeout` bounds the wait for all."""

    def __init__(self, tests: Collection[str], keys: Callable[[pytest.Item], list[Hashable]],
                 job: Callable[[Hashable], Callable[[], Any]], jobs: int = 2, timeout: float = 600.0) -> None:
        super().__init__(tests, keys, jobs)
        self.job, self.timeout = job, timeout

    def seconds(self, key: Hashable) -> float:
        """About how long `key`'s job takes alone, where that is known: the
        longest start first, so that one of them starting last does not
        hold the family up after the others ended."""
        return 0.0

    def get(self, request: pytest.FixtureRequest, key: Hashable) -> Any:
        if key not in self.results:
            import concurrent.futures

            keys = sorted(self._wanted(request, key), key=self.seconds, reverse=True)  # stable: else in order
            calls = {k: self.job(k) for k in keys}
            with concurrent.futures.ThreadPoolExecutor(max_workers=self.jobs) as pool:
                futures = {k: pool.submit(call) for k, call in calls.items()}
                concurrent.futures.wait(futures.values(), timeout=self.timeout)
                for k, future in futures.items():
                    if not future.done():
                        self.results[k] = (None, TimeoutError(f"{k} did not end within {self.timeout:g} s"))
                    elif future.exception() is not None:
                        self.results[k] = (None, future.exception())
                    else:
                        self.results[k] = (future.result(), None)
        value, error = self.results[key]
        if error is not None:
            raise error
        return value


class RegisteredJobs(SharedJobs):
    """SharedJobs whose tests say what they run with a decorator:
    ``@FAMILY.runs(make, needs)``. The test's job is ``wrap(make(**its
    parameters))`` (by default what make returns: a function that starts
    its processes, waits for them and returns what the test checks); a test
    whose `needs` module is not installed has none (it is skipped).
    ``get_for(request)`` is what the asking test's own job returned."""

    def __init__(self, wrap: Callable[[Any], Callable[[], Any]] | None = None, jobs: int = 2,
                 timeout: float = 600.0) -> None:
        #: test name -> (make, the module it needs, about how long its job takes alone)
        self.made: dict[str, tuple[Callable[..., Any], str | None, float]] = {}
        self.wrap = wrap if wrap is not None else (lambda made: made)
        super().__init__(self.made.keys(), keys=self._keys_of, job=self._job, jobs=jobs, timeout=timeout)

    def runs(self, make: Callable[..., Any], needs: str | None = None, seconds: float = 0.0) -> Callable[[Any], Any]:
        """Registers what the decorated test runs: the first test of the
        family to ask runs those of every one this session runs, `jobs` at a
        time (the longest by `seconds` first), and waits for all (its
        timeout is the family's)."""

        def register(test: Any) -> Any:
            self.made[test.__name__] = (make, needs, seconds)
            return pytest.mark.timeout(self.timeout)(test)

        return register

    def _keys_of(self, item: pytest.Item) -> list[Hashable]:
        import importlib.util

        _, needs, _ = self.made[item.originalname]  # type: ignore[attr-defined]
        if needs is not None and importlib.util.find_spec(needs) is None:
            return []  # the test is skipped
        params = item.callspec.params if hasattr(item, "callspec") else {}
        return [(item.originalname, tuple(sorted(params.items())))]  # type: ignore[attr-defined]

    def _job(self, key: Hashable) -> Callable[[], Any]:
        name, params = key  # type: ignore[misc]
        return self.wrap(self.made[name][0](**dict(params)))

    def seconds(self, key: Hashable) -> float:
        return self.made[key[0]][2]  # type: ignore[index]

    def get_for(self, request: pytest.FixtureRequest) -> Any:
        return self.get(request, self._keys_of(request.node)[0])
