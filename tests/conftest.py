"""Every test runs under a guard: it fails if it leaves a shmpipe segment in
/dev/shm or a child process behind."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time

import pytest

from shmpipe import _segments
from shmpipe.testing.assertions import assert_same  # noqa: F401  (tests import it from here)


def _our_segments() -> set[str]:
    try:
        return {e for e in os.listdir(_segments.SHM_DIR) if e.startswith(_segments.PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaks():
    before = _our_segments()
    yield
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
