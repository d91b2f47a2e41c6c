"""Every test runs under a guard: it fails if it leaves a shmpipe segment in
/dev/shm, a descriptor of a ring's anonymous memory, or a child process
behind."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from shmpipe import _process, _segments
from shmpipe.testing.assertions import assert_same  # noqa: F401  (tests import it from here)
from shmpipe.testing.memory import ring_descriptors


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


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    for _ in range(64):  # a chain of parents; pid 1 ends it
        if pid == me:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        pid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # field 4: the parent
    return False


@pytest.fixture(autouse=True)
def no_leaks():
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


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies are not)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def end_group(proc: subprocess.Popen, grace: float = 10.0) -> tuple[Any, Any]:
    """Ends `proc`, a script started with ``start_new_session=True``, and
    every process of its group (its producers, forkserver, resource
    tracker), whatever state the test left them in; removes the segments
    named after it; reads and closes its pipes. For a test's ``finally``: a
    failing test still leaves nothing running. Returns what was left to
    read of its stdout and stderr, as ``communicate`` does.

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
        entries = os.listdir(_segments.SHM_DIR)
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
