"""A fresh from_dataset pipeline's first batches, made by the trainer while
its producers start (shmpipe/_first_batches.py): real producers, from a
real fork server that is not running yet, as in a fresh process.

The fixture `fresh_fork_server` gives each test a new fork server, started
by the test's first pipeline (so that pipeline's start runs in the
background, as a user's first one does), and stops it after the test.
A dataset that is slow in the trainer alone (Augmented's `slow_in`) keeps
the trainer making batches while the producers start, so the hand-over
comes in the middle of the epoch."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
from slow_start import SlowStart

import shmpipe
from shmpipe import _forkserver
from shmpipe.testing.datasets import Augmented
from shmpipe.testing.processes import gone, wait_until
from shmpipe.testing.sources import Counter

T = 60.0  # no batch may take longer than this
BATCH = 2


@pytest.fixture
def fresh_fork_server():
    """shmpipe's fork server as a fresh process has it: not started. The
    server of the tests before is set aside and back after; the new one
    is stopped (its clients' end of its pipe closed: it exits) and reaped."""
    with _forkserver._SERVER_LOCK:
        before = _forkserver._SERVER
        fresh = _forkserver._SERVER = _forkserver._ForkServer()
        fresh.set_forkserver_preload(list(_forkserver.SERVER_PRELOAD))
    try:
        yield fresh
    finally:
        with _forkserver._SERVER_LOCK:
            _forkserver._SERVER = before
        pid, alive = fresh._forkserver_pid, fresh._forkserver_alive_fd
        fresh._close_booted()  # (a test that never waited for its boot)
        if alive is not None:
            os.close(alive)
        deadline = time.monotonic() + 10
        while pid is not None and time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.02)
        else:
            if pid is not None:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the fork server did not exit when its clients' pipe closed")


def dataset(n: int, **kwargs) -> Augmented:
    return Augmented(n, slow_in=os.getpid(), **kwargs)


def pipe_of(ds: Augmented, **kwargs) -> shmpipe.Pipeline:
    kwargs.setdefault("num_workers", 2)
    kwargs.setdefault("timeout", T)
    return shmpipe.from_dataset(ds, batch_size=BATCH, shuffle=True, seed=7, **kwargs)


def row(b) -> tuple[list[int], list[list[float]], int]:
    """(sample numbers, their draws, the pid that fetched them) of a batch."""
    pids = set(b["pid"].tolist())
    assert len(pids) == 1
    return b["i"].tolist(), b["draws"].tolist(), pids.pop()


def take(pipe, stop: int | None = None) -> list[tuple[list[int], list[list[float]], int]]:
    """row() of each batch of the next pass, or of its first `stop` batches."""
    out = []
    for b in pipe:
        out.append(row(b))
        if stop is not None and len(out) == stop:
            break
    return out


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Until process `pid` has ended (a zombie, or reaped)."""
    assert wait_until(lambda: gone(pid), timeout), f"process {pid} did not end"


def content(batches):
    return [(ids, draws) for ids, draws, _ in batches]


@pytest.fixture(scope="module")
def reference():
    """Three epochs of 120 samples as the producers alone deliver them (the
    fork server of the module, running)."""
    with pipe_of(Augmented(120), fetch_while_starting=False) as pipe:
        return [content(take(pipe)) for _ in range(3)]


@pytest.fixture
def slow_server(monkeypatch, fresh_fork_server):
    """A fresh fork server that takes 1.5 s to start (tests/slow_start.py):
    the trainer's phase lasts at least that long."""
    monkeypatch.setenv("SHMPIPE_TEST_SERVER_DELAY", "1.5")
    return fresh_fork_server


def wait_started(pipe, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while pipe._launcher.starting:
        assert time.monotonic() < deadline, "the producers did not start"
        time.sleep(0.01)


def test_the_batches_made_here_and_the_order_are_those_of_the_producers_alone(fresh_fork_server, reference):
    with pipe_of(dataset(120, delay=0.03)) as pipe:
        epochs = [take(pipe), take(pipe)]
        made = pipe.stats().extra["made_by_trainer"]
        per_worker = pipe.stats().per_worker_batches
    assert [content(e) for e in epochs] == reference[:2]
    # The first `made` batches of the first epoch were fetched here, the rest
    # by the producers, and the next epoch by the producers alone.
    assert 1 <= made < len(epochs[0]), made
    assert [pid == os.getpid() for _, _, pid in epochs[0]] == [True] * made + [False] * (len(epochs[0]) - made)
    assert all(pid != os.getpid() for _, _, pid in epochs[1])
    assert sum(per_worker) + made == 2 * len(epochs[0])


def test_an_epoch_made_here_to_its_end_leaves_the_producers_an_empty_part(fresh_fork_server, reference):
    # 8 quick batches: the trainer has made them all before the server is up.
    with pipe_of(Augmented(16, slow_in=os.getpid())) as pipe:
        first = take(pipe)
        made = pipe.stats().extra["made_by_trainer"]
        second = take(pipe)
    with pipe_of(Augmented(16), fetch_while_starting=False) as alone:
        assert [content(first), content(second)] == [content(take(alone)), content(take(alone))]
    assert made >= 1
    assert all(pid != os.getpid() for _, _, pid in second)


def test_the_batches_made_here_are_read_only_aligned_and_shaped_as_the_producers(fresh_fork_server):
    # (Batches made here hold no slot; of the producers' one is kept.)
    with pipe_of(dataset(40, delay=0.03), num_workers=1) as pipe:
        here, there = [], None
        for b in pipe:
            if int(b["pid"][0]) == os.getpid():
                here.append(b)
            elif there is None:
                there = b
    assert here and there is not None
    for b in here:
        for key in ("x", "i", "draws", "pid"):
            a = b[key]
            assert not a.flags.writeable and a.ctypes.data % 64 == 0, key
    first, other = here[0], there
    assert type(first) is type(other) and list(first) == list(other)
    for key in first:
        if isinstance(first[key], np.ndarray):
            assert first[key].dtype == other[key].dtype and first[key].shape[1:] == other[key].shape[1:], key
        else:
            assert type(first[key]) is type(other[key]), key


def test_the_trainers_own_generators_are_left_as_they_were(fresh_fork_server):
    random.seed(1)
    np.random.seed(1)
    expected = (random.random(), np.random.random())
    random.seed(1)
    np.random.seed(1)
    with pipe_of(dataset(40)) as pipe:
        take(pipe, stop=3)
        assert pipe.stats().extra["made_by_trainer"] >= 1
    assert (random.random(), np.random.random()) == expected


@pytest.mark.parametrize("stop", [1, 12])
def test_a_state_taken_while_or_after_the_trainer_makes_batches_resumes_exactly(fresh_fork_server, reference, stop):
    # At 1 the state is taken before the producers have anything (the batch
    # was made here); at 12, after the hand-over.
    with pipe_of(dataset(120, delay=0.03)) as pipe:
        head = take(pipe, stop=stop)
        state = pipe.state_dict()
        made = pipe.stats().extra["made_by_trainer"]
    assert made >= 1 and (stop > 1 or made == 1)
    with pipe_of(Augmented(120), fetch_while_starting=False, num_workers=3) as resumed:
        resumed.load_state_dict(state)
        rest = take(resumed)
    assert content(head) + content(rest) == reference[0]


@pytest.fixture(scope="module")
def state_at_20():
    """The state after 20 batches (taken with the module's fork server,
    before a test's fresh one)."""
    with pipe_of(Augmented(120), fetch_while_starting=False) as pipe:
        take(pipe, stop=20)
        return pipe.state_dict()


def test_a_resumed_pipeline_makes_its_first_batches_here_too(state_at_20, fresh_fork_server, reference):
    state = state_at_20
    with pipe_of(dataset(120, delay=0.03)) as resumed:
        resumed.load_state_dict(state)
        rest = take(resumed)
        made = resumed.stats().extra["made_by_trainer"]
    assert made >= 1
    assert content(rest) == reference[0][20:]


def test_the_datasets_error_here_is_a_worker_error_as_a_producers_and_nothing_is_left(fresh_fork_server, reference):
    first_sample = reference[0][0][0][0]
    pipe = pipe_of(dataset(120, fail_at=first_sample))
    with pytest.raises(shmpipe.WorkerError, match=f"LookupError: sample {first_sample} cannot be read here") as info:
        next(iter(pipe))
    assert info.value.worker_id == -1 and isinstance(info.value.__cause__, LookupError)
    assert info.value.exc_type == "builtins.LookupError"  # as a producer's WorkerError names it
    assert str(info.value).startswith(
        f"the trainer (pid {os.getpid()}), fetching a first batch itself while the producers started, raised "
    ), str(info.value)
    assert pipe.closed
    assert pipe.leftovers() == []


def test_passes_left_before_the_hand_over_still_reach_the_channel(slow_server, reference):
    # A ring sized up front (slot_size): every pass must reach it in order,
    # those the trainer began and left too (a peek at each of two epochs).
    with pipe_of(SlowStart(120, slow_in=os.getpid()), slot_size=1 << 16) as pipe:
        peeks = [content([row(next(iter(pipe)))]) for _ in range(2)]  # each iter() a new pass
        assert pipe._launcher.starting, "the peeks came before the producers were up"
        third = content(take(pipe))
        state = pipe.state_dict()
    assert peeks == [reference[0][:1], reference[1][:1]]
    assert third == reference[2]
    assert (state["epoch"], state["done_below"]) == (3, 0)


def test_a_producer_that_dies_before_the_hand_over_is_replaced(slow_server, reference):
    with pytest.warns(shmpipe.ShmpipeWarning, match="replaced"):
        with pipe_of(SlowStart(120, slow_in=os.getpid()), max_restarts=1) as pipe:
            it = iter(pipe)
            got = [row(next(it))]
            wait_started(pipe)
            victim = pipe.pids[0]
            os.kill(victim, signal.SIGKILL)
            wait_gone(victim)
            got += [row(b) for b in it]
            restarts = pipe.stats().restarts
    assert content(got) == reference[0]
    assert sum(restarts) == 1


def test_a_ctrl_c_inside_the_batch_made_at_the_hand_over_loses_nothing(slow_server, reference):
    # The hand-over deals the producers the pass from the batch after the one
    # the trainer makes then: a KeyboardInterrupt inside that one's fetch
    # leaves it owed, and the next next() makes it.
    second_batch_first_sample = reference[0][1][0][0]
    ds = SlowStart(120, slow_in=os.getpid(), interrupt_at=second_batch_first_sample)
    with pipe_of(ds) as pipe:
        it = iter(pipe)
        got = [row(next(it))]
        wait_started(pipe)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        got += [row(b) for b in it]
        made = pipe.stats().extra["made_by_trainer"]
        state = pipe.state_dict()
    assert content(got) == reference[0]
    assert made == 2 and (state["epoch"], state["done_below"]) == (1, 0)


def test_a_pipeline_iterated_from_another_thread_makes_nothing_here_and_keeps_its_timeout(slow_server, reference):
    # Off the main thread (tf.data's, to_jax's feeder) the trainer makes no
    # batch: the process's generators are not its to seed there. It waits
    # for the producers, within the timeout.
    out: dict = {}

    def consume(pipe):
        try:
            out["batches"] = content(take(pipe))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            out["error"] = exc

    with pipe_of(SlowStart(120, slow_in=os.getpid()), timeout=0.3) as pipe:
        worker = threading.Thread(target=consume, args=(pipe,))
        worker.start()
        worker.join(60)
        assert isinstance(out.get("error"), shmpipe.PipelineTimeoutError), out
        assert "still starting" in str(out["error"])
    out.clear()
    with pipe_of(SlowStart(120, slow_in=os.getpid())) as pipe:
        worker = threading.Thread(target=consume, args=(pipe,))
        worker.start()
        worker.join(60)
        assert out.get("batches") == reference[0], out.get("error")
        assert pipe.stats().extra["made_by_trainer"] == 0


def test_a_pipeline_closed_while_its_producers_start_leaves_nothing(fresh_fork_server):
    pipe = pipe_of(dataset(40))
    pipe.close()
    assert pipe.leftovers() == []


def test_a_start_that_fails_in_the_background_is_raised_by_next(fresh_fork_server):
    # A fork server that cannot start (its interpreter does not exist): the
    # start fails in its thread, and the trainer gets that error, with the
    # pipeline closed, at the hand-over (or at iter(), which begins the pass,
    # where the start has failed already). multiprocessing's resource
    # tracker is started first, with the real interpreter.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    executable = multiprocessing.spawn.get_executable()
    multiprocessing.set_executable("/nonexistent/python3")
    try:
        with pipe_of(dataset(40)) as pipe:
            # (OSError where the exec's failure is reported; where the server
            # was taken for started, the ShmpipeError that a server which
            # ended, and its replacement, could not start the producer.)
            with pytest.raises((OSError, shmpipe.ShmpipeError), match=r"nonexistent|fork server"):
                it = iter(pipe)
                for _ in range(25):  # the epoch's 20 batches, made here, then the hand-over at the latest
                    next(it)
            assert pipe.closed
    finally:
        multiprocessing.set_executable(executable)
    assert pipe.leftovers() == []


@pytest.mark.timeout(60)
def test_a_start_thread_that_cannot_start_is_raised_by_the_constructor(fresh_fork_server, monkeypatch):
    # The thread that starts the producers may fail to start (no thread
    # left: RuntimeError "can't start new thread"): the constructor raises
    # it and stops what it made. (On acca26e it waited for ever for that
    # start to end: helper 57.)
    start = threading.Thread.start

    def no_start_thread(thread):
        if thread.name == "shmpipe-start":
            raise RuntimeError("can't start new thread")
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", no_start_thread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pipe_of(dataset(40))


FRESH_PROCESS_SCRIPT = """
import json, sys
from multiprocessing import resource_tracker
import shmpipe
from shmpipe import _forkserver
from slow_start import SlowStart

pipe = shmpipe.from_dataset(SlowStart(40), batch_size=2, shuffle=True, seed=7, num_workers=2, timeout=TIMEOUT)
out = {"tracker_at_launch": resource_tracker._resource_tracker._pid, "server": _forkserver.server_pid(),
       "booting": _forkserver._SERVER._booted_r is not None}
with pipe:
    batches = iter(pipe)
    ids = next(batches)["i"].tolist()
    # what a fresh first batch leaves unloaded: the group's arguments, the stats records
    out["loaded"] = [m for m in ("shmpipe._group._options", "shmpipe._stats") if m in sys.modules]
    out["ids"] = sorted(ids + [i for b in batches for i in b["i"].tolist()])
    out["made_here"] = pipe.stats().extra["made_by_trainer"]
out["tracker_after"] = resource_tracker._resource_tracker._pid
out["booted_left"] = _forkserver._SERVER._booted_r is not None
print(json.dumps(out), flush=True)
""".replace("TIMEOUT", str(T))


def test_a_fresh_process_starts_the_resource_tracker_once_its_fork_server_has_booted(tmp_path):
    # A fresh process's first pipeline launches the fork server and makes its
    # first batches while the server boots (0.5 s more here: slow_start).
    # multiprocessing's resource tracker, a third interpreter, boots only
    # after it (Python 3.11, whose server is shmpipe's: 3.12's starts it
    # first): on 2 cores the three took the trainer's core at times.
    import json
    import subprocess
    import sys

    script = tmp_path / "fresh.py"
    script.write_text(FRESH_PROCESS_SCRIPT)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path]), "SHMPIPE_TEST_SERVER_DELAY": "0.5"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=2 * T, env=env,
                          cwd=tmp_path, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ids"] == list(range(40)), out  # every sample once, the trainer's and the producers'
    assert out["server"] is not None and out["loaded"] == [], out
    if sys.version_info < (3, 12):  # (3.12's server is the standard library's: no "booted" pipe)
        assert out["tracker_at_launch"] is None and out["booting"], out
    assert out["tracker_after"] is not None and not out["booted_left"], out
    assert out["made_here"] >= 1, out
    assert "Traceback" not in proc.stderr, proc.stderr


def test_from_iterators_starts_its_producers_in_the_constructor_as_before(fresh_fork_server):
    with shmpipe.from_iterators([Counter(3, shape=(4,))] * 2, timeout=T) as pipe:
        assert not pipe._launcher.starting and _forkserver.server_pid() is not None
        assert sorted((b["worker"], b["seq"]) for b in pipe) == [(w, s) for w in range(2) for s in range(3)]
        assert "made_by_trainer" not in pipe.stats().extra


def test_fetch_while_starting_false_reads_the_dataset_in_the_producers_only(fresh_fork_server):
    with pipe_of(dataset(20), fetch_while_starting=False) as pipe:
        assert all(pid != os.getpid() for _, _, pid in take(pipe))
        assert pipe.stats().extra["made_by_trainer"] == 0
    with pytest.raises(shmpipe.ShmpipeTypeError, match="fetch_while_starting"):
        pipe_of(dataset(20), fetch_while_starting=1)
