"""Every test runs under a guard: it fails if it leaves a shmpipe segment in
/dev/shm or a child process behind."""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest

from shmpipe import _segments


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


def assert_same(got, want, path="batch"):
    """Bit-exact equality of two batches: same nesting, container types,
    dtypes, shapes and bytes."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got)} is not an ndarray"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{path}: bytes differ"
        return
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, float) and want != want:
        assert got != got, f"{path}: {got!r} is not NaN"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
