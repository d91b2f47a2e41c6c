"""Waiting on processes in tests, with a bound: every wait here ends."""

from __future__ import annotations

import time
from collections.abc import Callable

from shmpipe import _process

__all__ = ["gone", "wait_until"]


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts as exited)."""
    return _process.process_start_time(pid) is None


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether `predicate()` became true within `timeout` seconds (asked
    every 20 ms, and once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
