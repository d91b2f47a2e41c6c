"""Pipelines with real producer processes."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import sys
import time

import numpy as np
import pytest
from conftest import assert_same

import shmpipe
from shmpipe import _pipeline, _process, _producer_context, _ring, _segments
from shmpipe.testing.memory import ring_descriptors
from shmpipe.testing.sources import Counter, Fixed, Matrix, Reserver, SeedReporter, payload_for
from shmpipe.transports.shm import ShmTransport

T = 30.0  # no single batch may take longer than this in these tests


def segment_of(pipe):
    return pipe.channel.segment


def check_counter_batch(b, shape=(16,), dtype=np.float32):
    want = payload_for(b["worker"], b["seq"], shape, dtype)
    np.testing.assert_array_equal(b["data"], want)
    assert float(b["data"].astype(np.float64).sum()) == b["checksum"]


@pytest.mark.parametrize("ordered", [False, True])
def test_every_batch_arrives_exactly_once(ordered):
    n, per = 3, 40
    with shmpipe.from_iterators([Counter(per)] * n, ordered=ordered, timeout=T) as pipe:
        seen = []
        for b in pipe:
            check_counter_batch(b)
            seen.append((b["worker"], b["seq"]))
    assert sorted(seen) == [(w, s) for w in range(n) for s in range(per)]
    if ordered:
        assert seen == [(w, s) for s in range(per) for w in range(n)]
    assert pipe.stats().per_worker_batches == (per,) * n


def test_ordered_round_robin_skips_exhausted_workers():
    sources = [Counter(3), Counter(5), Counter(1)]
    with shmpipe.from_iterators(sources, ordered=True, timeout=T) as pipe:
        seen = [(b["worker"], b["seq"]) for b in pipe]
    assert seen == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (1, 4)]


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_start_methods(start_method):
    with shmpipe.from_iterators([Counter(5)] * 2, start_method=start_method, timeout=T) as pipe:
        assert pipe.start_method == start_method
        got = sorted((b["worker"], b["seq"]) for b in pipe)
    assert got == [(w, s) for w in range(2) for s in range(5)]


class CollectorReport:
    """One batch: how many objects this producer's cyclic collector froze
    and how many it still walks."""

    def __call__(self):
        yield {"frozen": gc.get_freeze_count(), "walked": len(gc.get_objects())}


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_a_producer_freezes_what_it_started_with_so_its_collector_never_walks_the_inherited_heap(start_method):
    # Inherited objects walked by a full collection are written to (their
    # header), each shared page copied: with fork, the trainer's whole heap.
    # A list keeps this process's heap well above a booted interpreter's.
    ballast = [[i] for i in range(50_000)]
    # A fork inherits what this process froze itself (conftest freezes the
    # frameworks' objects): counted apart, so that only the producer's own
    # freeze can pass.
    inherited = gc.get_freeze_count() if start_method == "fork" else 0
    with shmpipe.from_iterators([CollectorReport()], start_method=start_method, timeout=T) as pipe:
        (b,) = list(pipe)
    frozen = b["frozen"] - inherited
    assert frozen > 0
    if start_method != "spawn":  # forked: the heap it inherited is most of what it holds
        assert b["walked"] < frozen
    if start_method == "fork":  # the trainer's objects (the ballast too) are among the frozen
        assert frozen > len(ballast)
    del ballast


def test_round_trip_matrix_through_producers():
    # (Imported here: producers of this module's sources import the module,
    # and shmpipe.testing.batches imports ml_dtypes, 0.85 s, where installed.)
    from shmpipe.testing.batches import matrix

    batches = [b for _, b in matrix()]
    with shmpipe.from_iterators([Matrix()], timeout=T, ordered=True) as pipe:
        count = 0
        for got, want in zip(pipe, batches):
            assert_same(got, want)
            count += 1
    assert count == len(batches)


def test_consumer_arrays_are_the_shared_memory():
    with shmpipe.from_iterators([Counter(4, shape=(64, 64))] * 2, timeout=T) as pipe:
        for b in pipe:
            # the ring exists from the first batch on (it is sized from it)
            assert np.shares_memory(b["data"], segment_of(pipe).array())
            assert not b["data"].flags.writeable
            assert b["data"].ctypes.data % 64 == 0


def test_reserve_fills_slots_in_place():
    with shmpipe.from_iterators([Reserver(20, shape=(256,))] * 2, timeout=T) as pipe:
        got = []
        for b in pipe:
            assert np.shares_memory(b["data"], segment_of(pipe).array())
            np.testing.assert_array_equal(b["data"], np.full(256, b["seq"] + 1000 * b["worker"], np.float32))
            got.append((b["worker"], b["seq"]))
    assert sorted(got) == [(w, s) for w in range(2) for s in range(20)]


def test_worker_info_and_seeds():
    assert shmpipe.get_worker_info() is None
    with shmpipe.from_iterators([SeedReporter()] * 3, seed=1234, ordered=True, timeout=T) as pipe:
        first = list(pipe)
        second = list(pipe)
    with shmpipe.from_iterators([SeedReporter()] * 3, seed=1234, ordered=True, timeout=T) as pipe:
        again = list(pipe)
    assert [b["id"] for b in first] == [0, 1, 2]
    assert {b["num_workers"] for b in first} == {3}
    assert [b["epoch"] for b in first] == [0, 0, 0] and [b["epoch"] for b in second] == [1, 1, 1]
    assert len({b["seed"] for b in first + second}) == 6, "seeds differ per worker and per pass"
    assert len({b["np"] for b in first}) == 3 and len({b["py"] for b in first}) == 3
    # NumPy's and random's generators are both MT19937: seeded with the same
    # words they would draw the same numbers (they did, before NumPy's key
    # got a word of its own).
    assert all(b["np"] != b["py"] for b in first + second)
    assert again == first, "the same base seed gives the same seeds and draws"
    assert first[0]["seed"] == _producer_context.seed_for(1234, 0, 0)


def test_a_deterministic_source_gives_a_deterministic_stream():
    def run(seed):
        with shmpipe.from_iterators([RandomBatches(6)] * 3, ordered=True, seed=seed, timeout=T) as pipe:
            return [b.copy() for b in pipe]

    a, b, c = run(7), run(7), run(8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == 18
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


class RandomBatches:
    def __init__(self, n):
        self.n = n

    def __call__(self):
        for _ in range(self.n):
            yield np.random.random(8)


def test_each_iteration_is_a_new_pass():
    with shmpipe.from_iterators([Counter(6)] * 2, timeout=T) as pipe:
        for _ in range(3):
            assert sorted((b["worker"], b["seq"]) for b in pipe) == [(w, s) for w in range(2) for s in range(6)]
        assert pipe.stats().passes == 3


def test_breaking_out_and_iterating_again():
    with shmpipe.from_iterators([Counter(50, delay=0.001)] * 2, timeout=T) as pipe:
        it = iter(pipe)
        for _ in range(5):
            next(it)
        complete = sorted((b["worker"], b["seq"]) for b in pipe)
        assert complete == [(w, s) for w in range(2) for s in range(50)]
        with pytest.raises(shmpipe.PipelineClosedError, match="earlier pass"):
            next(it)


@pytest.mark.parametrize("transport", ["shm", "queue"])
def test_a_new_pass_loses_nothing_to_an_old_iterator_waiting_in_another_thread(transport):
    # What tf.data does when a new iterator starts while an old one's thread
    # still waits for a batch: the old wait must not take, or throw away,
    # batches of the new pass.
    import threading

    # 12 batches at 0.05 s: the old thread cannot finish its pass (0.6 s)
    # before the new one starts (0.02 s after it), even on a loaded machine.
    per = 12
    with shmpipe.from_iterators([Counter(per, delay=0.05)] * 2, transport=transport, timeout=T) as pipe:
        for _ in range(2):
            old = iter(pipe)
            next(old)
            outcome = []

            def drain_old():
                try:
                    for _ in old:
                        pass
                    outcome.append("ended")
                except shmpipe.PipelineClosedError as exc:
                    outcome.append(exc)

            thread = threading.Thread(target=drain_old)
            thread.start()
            time.sleep(0.02)  # it waits inside the pipeline now
            got = sorted((b["worker"], b["seq"]) for b in pipe)
            thread.join(T)
            assert not thread.is_alive()
            assert got == [(w, s) for w in range(2) for s in range(per)]
            assert len(outcome) == 1 and isinstance(outcome[0], shmpipe.PipelineClosedError)


def test_empty_sources_end_at_once():
    with shmpipe.from_iterators([Fixed([])] * 2, timeout=T) as pipe:
        assert list(pipe) == []
        assert list(pipe) == []


def test_backpressure_bounds_batches_in_flight():
    cap = 4
    with shmpipe.from_iterators([Counter(1000)] * 2, capacity=cap, timeout=T) as pipe:
        it = iter(pipe)
        held = [next(it), next(it)]
        import time

        time.sleep(0.5)  # producers run ahead as far as they may
        ring = pipe.channel.ring
        published = sum(ring.worker_published(w) for w in range(2))
        states = ring.slot_states()
        assert published - 2 <= cap - len(held), "more batches in flight than capacity allows"
        assert states.count(_ring.HELD) == 2
        assert states.count(_ring.READY) == cap - 2  # the ring is full ...
        assert pipe.stats().producer_blocked_total_s > 0.2  # ... and the producers wait
        del held


def test_timeout_says_when_the_consumer_holds_every_slot():
    with shmpipe.from_iterators([Counter(100)], capacity=3, timeout=0.5) as pipe:
        it = iter(pipe)
        held = [next(it) for _ in range(3)]
        with pytest.raises(shmpipe.PipelineTimeoutError, match="all 3 slots are held") as info:
            next(it)
        assert isinstance(info.value, TimeoutError)
        del held[0]  # let one go: the pipeline carries on
        b = next(it)
        assert b["seq"] == 3


def test_a_consumer_that_holds_every_slot_is_told_so_without_a_timeout(monkeypatch):
    # Without timeout= such a wait would last forever: after STALL_WARNING_NS
    # (10 s; shortened here) a warning says why, once per pass.
    monkeypatch.setattr(_pipeline, "STALL_WARNING_NS", 200_000_000)
    with shmpipe.from_iterators([Counter(100)] * 2, capacity=3, timeout=1.0) as pipe:
        it = iter(pipe)
        held = [next(it) for _ in range(3)]
        with pytest.warns(shmpipe.ShmpipeWarning, match=r"holds 3 of the 3 slots \(at most 2") as record:
            with pytest.raises(shmpipe.PipelineTimeoutError):
                next(it)
        # Once, and pointing at the caller. Only the warnings that say this
        # are counted: pytest.warns records every warning of its block (CI
        # run 159 recorded 2 here, and printed no second one) and re-emits
        # the others to the filters when it ends, where any but JAX's advice
        # at an os.fork() of this process (ignored: pyproject.toml) fails.
        said = [w for w in record if "slots" in str(w.message)]
        assert len(said) == 1 and said[0].filename == __file__
        with pytest.raises(shmpipe.PipelineTimeoutError):
            next(it)  # the same pass: said once
        del held


def test_slow_producers_are_no_reason_to_warn(monkeypatch):
    monkeypatch.setattr(_pipeline, "STALL_WARNING_NS", 200_000_000)
    with shmpipe.from_iterators([Counter(2, delay=0.5)], capacity=3, timeout=T) as pipe:  # waits 2.5x the 0.2 s
        assert len(list(pipe)) == 2  # a warning would fail the test (filterwarnings = error)


def test_slot_size_from_first_batch_with_headroom():
    first = np.zeros(100_000, np.uint8)
    with shmpipe.from_iterators([Fixed([first, np.zeros(110_000, np.uint8)])], timeout=T) as pipe:
        assert [len(b) for b in pipe] == [100_000, 110_000]
        assert pipe.slot_size >= 1.25 * 100_000 and pipe.slot_size % 4096 == 0


def test_a_batch_larger_than_the_first_arrives_all_the_same():
    batches = [np.zeros(1000, np.uint8), np.arange(1_000_000, dtype=np.int64) % 251]
    with shmpipe.from_iterators([Fixed(batches)], timeout=T) as pipe:
        got = list(pipe)
    assert [b.nbytes for b in got] == [1000, 8_000_000] and pipe.slot_size < 8_000_000
    np.testing.assert_array_equal(got[1], batches[1])


def test_batch_too_large_for_an_explicit_slot_size_is_a_clear_error():
    batches = [np.zeros(1000, np.uint8), np.zeros(1_000_000, np.uint8)]
    with shmpipe.from_iterators([Fixed(batches)], slot_size=8192, timeout=T) as pipe:
        it = iter(pipe)
        next(it)
        with pytest.raises(shmpipe.BatchTooLargeError, match="slot_size=") as info:
            next(it)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value.__cause__, shmpipe.WorkerError)
    assert info.value.__cause__.worker_id == 0


def test_explicit_slot_size():
    with shmpipe.from_iterators([Fixed([np.zeros(200_000, np.uint8)])], slot_size=300_000, timeout=T) as pipe:
        assert pipe.slot_size == 303_104  # rounded up to pages
        assert [b.nbytes for b in pipe] == [200_000]


def test_a_bad_batch_in_a_producer_is_a_type_error_with_its_path():
    bad = [{"ok": np.zeros(2)}, {"ok": np.zeros(2), "x": [1, 2, {"deep": np.array([None])}]}]
    with shmpipe.from_iterators([Fixed(bad)], timeout=T) as pipe:
        with pytest.raises(TypeError, match=r"batch\['x'\]\[2\]\['deep'\]") as info:
            for _ in pipe:
                pass
    assert isinstance(info.value, shmpipe.BatchTypeError)
    assert "worker 0" in str(info.value.__cause__)


def test_stats():
    with shmpipe.from_iterators([Counter(30, shape=(1000,))] * 2, timeout=T) as pipe:
        nbytes = 0
        for b in pipe:
            nbytes += b["data"].nbytes
        s = pipe.stats()
    assert s.batches == 60 and s.per_worker_batches == (30, 30)
    assert s.bytes > nbytes  # payload bytes: arrays plus layout
    assert 0 < s.wait_p50_s <= s.wait_p99_s <= s.wait_max_s
    assert s.wait_total_s >= s.wait_max_s
    assert abs(s.wait_mean_s - s.wait_total_s / 60) < 1e-9
    assert 0 < s.time_to_first_batch_s < T
    assert 0 < s.stall_fraction <= 1.0 and s.wall_s >= s.wait_total_s
    assert len(s.producer_blocked_s) == 2 and s.producer_blocked_total_s >= 0
    assert s.passes == 1 and s.capacity == 6 and s.num_workers == 2
    d = s.as_dict()
    assert d["batches"] == 60 and "producer_blocked_total_s" in d
    text = str(s)
    assert "60 batches" in text and "stall fraction" in text and "p99" in text


def test_stats_are_live_during_an_unfinished_pass():
    # A training loop over endless sources never finishes a pass: its stats
    # must count the pass in progress (they said "0.0% of 0.000 s" before).
    endless = Counter(10**9, delay=0.01)
    with shmpipe.from_iterators([endless] * 2, timeout=T) as pipe:
        it = iter(pipe)
        for _ in range(20):
            next(it)
            time.sleep(0.005)  # the training step
        s = pipe.stats()
        time.sleep(0.05)
        later = pipe.stats()
    assert s.batches == 20 and s.passes == 1
    assert s.wall_s >= 20 * 0.005 and s.wall_s >= s.wait_total_s > 0
    assert 0 < s.stall_fraction < 1
    assert later.wall_s >= s.wall_s + 0.05  # the pass goes on: its wall time grows
    assert later.batches == 20
    assert f"of {s.wall_s:.3f} s iterating" in str(s) and "of 0.000 s" not in str(s)


def test_a_pass_left_unfinished_counts_up_to_the_next_one():
    with shmpipe.from_iterators([Counter(10**9, delay=0.01)], timeout=T) as pipe:
        for i, _ in enumerate(pipe):
            time.sleep(0.01)
            if i == 4:
                break
        first = pipe.stats()
        for i, _ in enumerate(pipe):
            if i == 4:
                break
        s = pipe.stats()
    assert first.batches == 5 and first.wall_s >= 5 * 0.01
    assert s.passes == 2 and s.batches == 10 and s.wall_s >= first.wall_s
    assert s.wall_s >= s.wait_total_s


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path, start_method):
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    # A source that needs the script's top level (its lock cannot be
    # pickled), so its producers import the script, and start it again
    # without the guard (a source that travels by value needs no guard:
    # test_startup).
    script.write_text(
        "import threading\n"
        "import numpy as np\n"
        "import shmpipe\n"
        "LOCK = threading.Lock()\n"
        "def make_batches():\n"
        "    for i in range(3):\n"
        "        with LOCK:\n"
        "            yield {'x': np.arange(10) + i}\n"
        f"with shmpipe.from_iterators([make_batches] * 2, start_method={start_method!r}, timeout=60) as pipe:\n"
        "    for batch in pipe:\n"
        "        pass\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("shmpipe.errors.WorkerDiedError: worker "), out.stderr
    assert f'under `if __name__ == "__main__":` in {script}' in last, last
    # the producers print nothing: not the standard library's RuntimeError, once per producer
    assert "bootstrapping phase" not in out.stderr, out.stderr
    assert out.stderr.count("Traceback") == 1 and len(out.stderr.splitlines()) < 40, out.stderr



@pytest.mark.parametrize("backing", ["memfd", "posix"])
def test_close_while_arrays_are_alive(backing):
    pipe = shmpipe.from_iterators(  # max_restarts: the trainer keeps the ring's descriptor until close()
        [Counter(5, shape=(1000,))], transport=ShmTransport(backing=backing), capacity=8, timeout=T, max_restarts=1
    )
    kept = [b["data"] for b in pipe]
    segment = segment_of(pipe)
    name, fd = segment.name, segment.fd
    assert (name == "") == (backing == "memfd") and (fd >= 0) == (backing == "memfd")
    pipe.close()
    pipe.close()  # idempotent
    assert pipe.closed
    if backing == "posix":
        assert not os.path.exists(_segments.SHM_DIR + name), "close() must destroy the segment's name"
    else:
        assert segment.fd == -1 and fd not in ring_descriptors(), "close() must close the ring's descriptor"
    for seq, arr in enumerate(kept):  # still mapped, still intact
        np.testing.assert_array_equal(arr, payload_for(0, seq, (1000,)))
    del pipe
    gc.collect()
    assert sum(float(a.sum()) for a in kept) == sum(float(payload_for(0, s, (1000,)).sum()) for s in range(5))


def test_a_closed_pipeline_cannot_be_iterated():
    pipe = shmpipe.from_iterators([Counter(3)], timeout=T)
    it = iter(pipe)
    next(it)
    pipe.close()
    with pytest.raises(shmpipe.PipelineClosedError):
        next(it)
    with pytest.raises(shmpipe.PipelineClosedError):
        iter(pipe)


def test_a_forgotten_pipeline_cleans_up_when_collected():
    pipe = shmpipe.from_iterators([Counter(3)], timeout=T)
    next(iter(pipe))
    pids = pipe.pids
    del pipe
    gc.collect()
    for pid in pids:
        assert _process.process_start_time(pid) is None  # stopped and reaped
    # the autouse fixture checks that the segment is gone too


def test_unpicklable_source_is_a_clear_error():
    with pytest.raises(shmpipe.ShmpipeTypeError, match="cannot be pickled") as info:
        shmpipe.from_iterators([lambda: iter([])])
    assert isinstance(info.value, TypeError)
    assert "top level" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(capacity=0), ValueError, "capacity"),
        # a wrong type is a TypeError, a number out of range a ValueError
        (dict(capacity=2.5), TypeError, "capacity"),
        (dict(capacity="8"), TypeError, "capacity must be a positive int"),
        (dict(timeout="5"), TypeError, "timeout"),
        (dict(seed="a"), TypeError, "seed"),
        (dict(max_restarts=1.0), TypeError, "max_restarts"),
        # a batch held in a loop's variable holds its slot: one slot is none for the producers
        (dict(capacity=1), ValueError, "'shm' transport needs capacity >= 2, got 1"),
        (dict(ordered=True, capacity=2), ValueError, "capacity >= 3"),
        (dict(transport="carrier-pigeon"), ValueError, "known transports: arrow, example-pipe, queue, ray, shm"),
        (dict(timeout=-1), ValueError, "timeout"),
        (dict(slot_size=0), ValueError, "slot_size"),
        (dict(ordered="yes"), TypeError, "ordered must be True or False"),
        (dict(capacity=5000), ValueError, "capacity must be at most 4096"),
        (dict(seed=-3), ValueError, "seed"),
        # a state holds its seed as an int64: one past it made states no pipeline could load (helper 75)
        (dict(seed=1 << 63), ValueError, r"seed must be an int in \[0, 2\*\*63\) or None, got 9223372036854775808"),
        (dict(start_method="teleport"), ValueError, "start_method"),
    ],
)
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error, match=words) as info:
        shmpipe.from_iterators([Counter(1)] * 2, **kwargs)
    assert isinstance(info.value, shmpipe.ShmpipeError)
    assert multiprocessing.active_children() == [], "refused only after producers started"


@pytest.mark.parametrize(
    "method, module, words",
    [
        ("to_torch", "torch", "download.pytorch.org/whl/cpu"),
        ("to_jax", "jax", 'pip install "shmpipe[jax]"'),
        ("to_tf_dataset", "tensorflow", 'pip install "shmpipe[tensorflow]"'),
    ],
)
def test_a_framework_that_is_not_installed_is_named_with_what_to_install(monkeypatch, method, module, words):
    # As where it is not installed: Python's own way to make an import fail
    # (None in sys.modules), which importlib.util.find_spec reports too.
    monkeypatch.setitem(sys.modules, module, None)
    with shmpipe.from_iterators([Counter(3)], timeout=T) as pipe:
        with pytest.raises(ModuleNotFoundError, match=rf"{method}\(\) needs {module}, which is not installed") as info:
            getattr(pipe, method)()
        assert info.value.name == module and words in str(info.value)
        assert [b["seq"] for b in pipe] == [0, 1, 2]  # the pipeline is still whole


@pytest.mark.parametrize(
    "sources, words",
    [
        ([], "empty"),
        (Counter(1), "sequence of callables"),
        ([Counter(1)()], "not a callable"),
        (3, "sequence of callables"),
    ],
)
def test_bad_sources(sources, words):
    with pytest.raises(shmpipe.ShmpipeError, match=words):
        shmpipe.from_iterators(sources)


def test_errors_pickle():
    for exc in [
        shmpipe.BatchTypeError("bad", "batch['x']"),
        shmpipe.BatchTooLargeError(10, 5),
        shmpipe.WorkerError(1, 2, "ValueError", "m", "tb"),
        shmpipe.WorkerDiedError(1, 2, -9),
        shmpipe.SharedMemoryFullError(10, 5),
        shmpipe.SegmentExistsError(["/shmpipe-1-2-abc"]),
    ]:
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc)


@pytest.mark.parametrize("transport", ["shm", "queue", "shm-group"])
def test_close_from_another_thread_wakes_the_waiting_consumer(transport):
    import threading
    import time
    import uuid

    from shmpipe.testing.sources import Sleeper

    # shm-group: a group of one rank (from_iterators(group=...)), whose wait is the rank's
    group = {"group": f"t-{uuid.uuid4().hex[:8]}", "rank": 0, "num_ranks": 1} if transport == "shm-group" else {}
    pipe = shmpipe.from_iterators([Sleeper(60.0)], transport=transport.removesuffix("-group"), timeout=T, **group)
    it = iter(pipe)
    next(it)
    errors = []

    def consume():
        try:
            next(it)  # waits: the producer sleeps
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    pipe.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5.0
    assert len(errors) == 1 and isinstance(errors[0], shmpipe.PipelineClosedError), errors


def test_what_a_consumer_does_after_a_close_from_another_thread_is_refused_as_closed():
    # The consumer's thread may be between a look at the pipeline and an
    # act on its producers when close() lands in another: the launcher,
    # down, opens no channel (it would outlive the close, never destroyed)
    # and takes a link that close() shut for no producer's death.
    from shmpipe.testing.processes import wait_until

    pipe = shmpipe.from_iterators([Counter(3, (64,))] * 2, timeout=T)
    launcher = pipe._launcher
    try:
        iter(pipe)  # the pass begins: each producer makes a batch and asks for a channel sized for it

        def asked():
            launcher._read_messages()
            return launcher._need is not None

        assert wait_until(asked, T)
        pipe.close()
        with pytest.raises(shmpipe.PipelineClosedError):
            launcher.open_channel(0.0)
        assert launcher.channel is None  # (before: one opened after the close, never destroyed)
        with pytest.raises(shmpipe.PipelineClosedError):
            launcher._send(0, ("stop",))  # (before: WorkerDiedError, "it ended, and its exit status did not come")
    finally:
        orphan = launcher.channel
        if orphan is not None:
            orphan.close()
            orphan.destroy()


def test_a_source_from_an_interactive_session_runs_unless_it_needs_the_session(tmp_path):
    import subprocess
    import sys

    code = (
        "import threading\n"
        "import numpy as np\n"
        "import shmpipe\n"
        "LOCK = threading.Lock()\n"
        "def gen():\n    yield {'x': np.arange(3)}\n"
        "def locked():\n    with LOCK:\n        yield {'x': np.arange(3)}\n"
        "with shmpipe.from_iterators([gen] * 2, timeout=30) as pipe:\n"
        "    print('batches:', sum(int(b['x'].sum()) for b in pipe))\n"
        "try:\n    shmpipe.from_iterators([locked])\n"
        "except shmpipe.ShmpipeTypeError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    # defined in the session, it travels by value ...
    assert "batches: 6" in out.stdout, out.stdout
    # ... unless it uses what only the session has
    assert "refused:" in out.stdout and "interactive session" in out.stdout
    assert "cannot pickle '_thread.lock' object" in out.stdout


@pytest.mark.parametrize("how", ["close", "collect"])
def test_close_hooks_run_while_the_channel_memory_still_exists(how):
    # to_torch's CUDA registration is undone in such a hook: it must run
    # before the segment is destroyed, on close() and when a forgotten
    # pipeline is collected.
    pipe = shmpipe.from_iterators([Counter(2)], transport=ShmTransport(backing="posix"), timeout=T)
    next(iter(pipe))
    path = "/dev/shm" + pipe.channel.segment.name
    seen = []
    pipe.call_on_close(lambda: seen.append(("first", os.path.exists(path))))
    pipe.call_on_close(lambda: seen.append(("last", os.path.exists(path))))
    if how == "close":
        pipe.close()
    else:
        del pipe
        gc.collect()
    assert seen == [("last", True), ("first", True)]  # last registered, first run
    assert not os.path.exists(path)


class KeepsAView:
    """Reserves batches of {"x": int32[4096]} (after the first, 16x larger
    with `big`: larger than a slot) filled with their number, and keeps a
    NumPy view of each past its yield; after yielding batch `write_at`,
    writes through that view (the batch is the consumer's)."""

    def __init__(self, n: int, write_at: int, big: bool = False) -> None:
        self.n, self.write_at, self.big = n, write_at, big

    def __call__(self):
        kept = None
        for i in range(self.n):
            size = 4096 * (16 if self.big and i else 1)
            batch = shmpipe.reserve({"x": shmpipe.ArraySpec((size,), np.int32)})
            batch["x"][:] = i
            if i == self.write_at + 1:
                kept[:] = -1  # batch write_at was yielded: never lands
            kept = batch["x"][::2]
            yield batch


@pytest.mark.parametrize("big", [False, True], ids=["slot", "region"])
def test_a_write_through_a_view_kept_past_its_yield_is_the_producers_death_not_a_changed_batch(big):
    """A view of a reserved array made before its batch's yield kept its own
    writable flag, and a write through it changed the batch the trainer
    held, silently. Now the producer dies at the write (SIGSEGV, named so
    in the error) and the batch is intact."""
    with shmpipe.from_iterators([KeepsAView(6, write_at=1, big=big)], capacity=4, timeout=T) as pipe:
        it = iter(pipe)
        held = [next(it), next(it)]  # batches 0 and 1, held while the producer goes on
        with pytest.raises(shmpipe.WorkerDiedError, match="SIGSEGV.*kept past") as died:
            for b in it:
                held.append(b)
        assert died.value.signal == 11
    for i, b in enumerate(held):
        assert (b["x"] == i).all(), f"batch {i} changed after it was delivered"
