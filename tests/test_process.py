"""shmpipe._process: who a process is, whether it lives, when it ends (with
real processes)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest

from shmpipe._process import ProcessWatch, process_alive, process_start_time, process_stopped


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def test_a_watch_sees_the_end_of_a_process_whoever_holds_its_pipes(sleeper):
    watch = ProcessWatch(sleeper.pid, process_start_time(sleeper.pid))
    try:
        assert watch.alive() and process_alive(sleeper.pid)
        assert watch.fileno() is not None, "this kernel has no pidfd: the rest of the test means less"
        assert not watch.wait(0.05)
        sleeper.kill()
        t0 = time.monotonic()
        assert watch.wait(10.0) and time.monotonic() - t0 < 5.0
        assert not watch.alive()  # a zombie (not reaped yet) has ended
        assert process_alive(sleeper.pid)  # ... though kill(pid, 0) finds it until it is reaped
        # the pidfd stays readable: something to poll beside other descriptors
        poller = select.poll()
        poller.register(watch.fileno(), select.POLLIN)
        assert poller.poll(0)
    finally:
        watch.close()
    assert watch.fileno() is None
    sleeper.wait(timeout=10)
    assert not process_alive(sleeper.pid)


def test_without_its_pidfd_a_watch_asks_in_turn(sleeper, monkeypatch):
    """What a kernel without pidfds gets (none is opened): the start time,
    given or read as the watch begins."""
    from shmpipe import _process

    monkeypatch.setattr(_process, "open_pidfd", lambda pid: None)
    with ProcessWatch(sleeper.pid, process_start_time(sleeper.pid)) as given, ProcessWatch(sleeper.pid) as read:
        assert given.fileno() is None and read.fileno() is None
        assert read.start == given.start == process_start_time(sleeper.pid)
        assert given.alive() and read.alive()
        assert not given.wait(0.05)
        sleeper.kill()
        assert given.wait(10.0) and read.wait(10.0)  # a zombie has no start time: ended
        assert not read.alive()


def test_a_watch_closed_goes_on_watching_the_same_process_by_its_start_time(sleeper):
    """A teardown cut after it closed its watches, and run again, asks them
    whether its producers still run and signals those that do: without
    its pidfd, a watch that had only the pid answered for whatever process
    had it then (kill(pid, 0)), a stranger once the pid was taken over.
    A watch reads the start time as it begins."""
    import signal

    watch = ProcessWatch(sleeper.pid)
    if watch.fileno() is None:
        pytest.skip("this kernel has no pidfd: nothing to close")
    assert watch.start == process_start_time(sleeper.pid)
    watch.close()
    assert watch.fileno() is None and watch.alive()
    watch.send_signal(signal.SIGKILL)  # the same process, without its pidfd
    assert watch.wait(10.0) and not watch.alive()  # ended: a zombie has no start time


def test_a_watch_of_a_process_that_is_gone_or_someone_else_has_ended(sleeper):
    start = process_start_time(sleeper.pid)
    assert start is not None
    with ProcessWatch(sleeper.pid, start + 1) as other:  # the pid, reused by another process
        assert not other.alive() and other.fileno() is None and other.wait(0)
    sleeper.kill()
    sleeper.wait(timeout=10)
    with ProcessWatch(sleeper.pid, start) as gone:
        assert not gone.alive() and gone.wait(0)


def test_process_alive_counts_other_users_processes():
    assert process_alive(os.getpid())
    assert process_alive(1)  # init: someone else's unless we are root, and alive


def test_a_stopped_process_is_told_from_a_running_one(sleeper):
    import signal

    from shmpipe.testing.processes import wait_until

    assert not process_stopped(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: process_stopped(sleeper.pid), 10)
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)
    assert wait_until(lambda: not process_stopped(sleeper.pid), 10)
    sleeper.kill()
    sleeper.wait(timeout=10)
    assert not process_stopped(sleeper.pid)  # gone


def test_a_watch_signals_its_process_and_nothing_once_it_has_gone(sleeper):
    import signal

    with ProcessWatch(sleeper.pid, process_start_time(sleeper.pid)) as watch:
        watch.send_signal(signal.SIGTERM)
        assert sleeper.wait(timeout=10) == -signal.SIGTERM  # reaped: the pid is free for anyone
        watch.send_signal(signal.SIGKILL)  # to nobody, without an error
        assert not watch.alive()
