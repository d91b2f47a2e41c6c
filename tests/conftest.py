"""Every test runs under a guard: it fails if it leaves a shmpipe segment in
/dev/shm, a descriptor of a ring's anonymous memory, or a child process
behind."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import time

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
