"""The consumer's fast path (RingReader.take_ready, called from a pass
iterator's __next__) and the waiters' spin: real rings, real processes."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time

import numpy as np
import pytest

import shmpipe
from shmpipe import _codec, _counters, _external, _ring
from shmpipe._counters import Counters
from shmpipe._pipeline import _declined
from shmpipe.errors import CorruptChannelError, PipelineClosedError
from shmpipe.testing.sources import Counter
from shmpipe.transport import END, FAULT, ChannelSpec
from shmpipe.transports.shm import ShmConsumer, ShmProducer, attach_writer

WAIT = 2.0
FAR = 1 << 62  # a due time that never comes


@pytest.fixture
def ring2():
    c = ShmConsumer(ChannelSpec(num_workers=2, capacity=4, slot_size=8192, ordered=False))
    writers = [attach_writer(c.handle, w) for w in range(2)]
    for w in writers:
        w.start_pass(0)
    yield c, writers
    c.close()
    c.destroy()


def test_take_ready_declines_when_nothing_is_ready(ring2):
    c, _ = ring2
    assert c.take_ready(0, -1, 0, FAR) is None


def test_take_ready_takes_decodes_and_says_what_to_count(ring2):
    c, (w0, w1) = ring2
    a, b = np.arange(10, dtype=np.int32), {"x": np.ones((3, 4), np.float64), "n": 7}
    w0.put(a)
    w1.put(b)
    first, first_bytes, first_worker, first_ns = c.take_ready(0, -1, 0, FAR)
    second, second_bytes, second_worker, second_ns = c.take_ready(0, -1, 0, FAR)
    np.testing.assert_array_equal(first, a)  # in publication order
    assert second["n"] == 7 and np.array_equal(second["x"], b["x"])
    assert not first.flags.writeable and not second["x"].flags.writeable
    assert (first_worker, second_worker) == (0, 1)
    assert (first_bytes, second_bytes) == (_codec.encoded_size(a), _codec.encoded_size(b))
    assert 0 < first_ns < 1e9 and 0 < second_ns < 1e9
    # The slots go back when the batches go.
    del first, second
    assert c.held() == 0


def test_counters_count_a_ready_batch_as_any_other():
    counters = Counters(2)
    counters.delivered(1_000, 3_000, 100, 0)  # a pass's first batch, by the general path
    counters.delivered_ready(500, 40, 1)
    counters.delivered_ready(700, 60, 1)
    assert counters.batches == 3 and counters.bytes == 200 and counters.per_worker == [1, 2]
    w = counters.waits
    assert w.count == 3 and w.total_ns == 2_000 + 500 + 700 and w.max_ns == 2_000
    assert sum(counters.tally[w.first : w.first + _counters.BUCKETS]) == 3  # each wait in one bucket
    assert counters.first_batch_ns == 3_000  # set by the first batch, not by the fast path


def test_the_compiled_count_puts_each_wait_where_python_does():
    import random

    rng = random.Random(7)
    waits = [1, 2, 3, 31, 32, 33, 1000, 65_535, 65_536, 10**9, (1 << 57) - 1]
    waits += [rng.randrange(1, 1 << 50) for _ in range(2000)]
    compiled, python = Counters(3), Counters(3)
    for i, ns in enumerate(waits):
        compiled.delivered_ready(ns, i, i % 3)
        python.waits.add(ns)
        python.tally[_counters.BATCHES] += 1
        python.tally[_counters.BYTES] += i
        python.tally[_counters.TOTALS + i % 3] += 1
    assert compiled.tally == python.tally
    with pytest.raises(ValueError, match="worker 3"):
        compiled.delivered_ready(5, 1, 3)  # the layout's bounds are checked, not trusted


def test_take_ready_in_order_takes_only_the_batch_whose_turn_it_is(ring2):
    c, (w0, w1) = ring2
    w1.put(np.full(4, 10))
    w0.put(np.full(4, 0))
    w0.put(np.full(4, 1))
    assert int(c.take_ready(0, 0, 0, FAR)[0][0]) == 0
    assert c.take_ready(0, 1, 1, FAR) is None  # worker 1's second is not there
    assert int(c.take_ready(0, 1, 0, FAR)[0][0]) == 10
    assert int(c.take_ready(0, 0, 1, FAR)[0][0]) == 1


def test_an_ordered_pass_goes_round_robin_through_the_fast_path():
    with shmpipe.from_iterators([_Numbers(50), _Numbers(80)], capacity=6, ordered=True, timeout=30) as pipe:
        got = [int(b[0]) for b in pipe]
        s = pipe.stats()
    assert got == [i for k in range(50) for i in (k, k)] + list(range(50, 80))
    assert s.per_worker_batches == (50, 80)


def test_take_ready_declines_when_a_look_at_the_producers_is_due(ring2):
    c, (w0, _) = ring2
    w0.put(np.zeros(4))
    assert c.take_ready(0, -1, 0, 0) is None  # due long ago
    assert c.ring.slot_states().count(_ring.READY) == 1  # nothing was taken
    assert c.get(0, -1, 0, WAIT) is not None  # the general path still gets it


def test_take_ready_leaves_ends_and_faults_to_the_general_path(ring2):
    c, (w0, w1) = ring2
    w0.finish_pass()
    w1.finish_pass()
    assert c.take_ready(0, -1, 0, FAR) is None
    assert c.get(0, -1, 0, WAIT) is END
    c.ring.begin_pass()
    for w in (w0, w1):
        w.start_pass(1)
    w0.put(np.zeros(4))
    c.halt()  # a fault: what is READY is still delivered first, fast or not
    got = c.take_ready(1, -1, 0, FAR)
    assert got is not None
    del got
    assert c.take_ready(1, -1, 0, FAR) is None
    assert c.get(1, -1, 0, WAIT) is FAULT


@pytest.mark.parametrize("how", ["take_ready", "get"])
def test_each_workers_batches_come_in_the_order_it_published_them(ring2, how):
    # Tickets (publication order across workers) are shared words: one set
    # out of order, by another process or by a scan that saw a worker's
    # later batch before its earlier one, never reorders a worker's batches.
    c, (w0, w1) = ring2
    for k in range(3):
        w0.put(np.full(4, k))
    w1.put(np.full(4, 10))
    (slot,) = [k for k in range(4) if c.ring.slot_info(k)[1:4] == (0, 0, 0)]  # worker 0's batch 0
    offset = 256 + 64 * 2 + 64 * slot + 24  # its ticket
    ctypes.memmove(c.segment.address + offset, (1 << 60).to_bytes(8, "little"), 8)
    taken = []
    for _ in range(4):
        got = c.take_ready(0, -1, 0, FAR)[0] if how == "take_ready" else c.get(0, -1, 0, WAIT)
        taken.append(int(got[0]))
        del got
    assert [k for k in taken if k < 10] == [0, 1, 2]
    assert sorted(taken) == [0, 1, 2, 10]


def test_take_ready_checks_the_slot_record(ring2):
    c, (w0, _) = ring2
    w0.put(np.zeros(4))
    (slot,) = [k for k, s in enumerate(c.ring.slot_states()) if s == _ring.READY]
    # The slot record's nbytes (shared memory another process may write):
    # after the header (256) and the worker records (64 each), slot k's
    # record is 64 bytes at + 64 k; nbytes at +32.
    offset = 256 + 64 * 2 + 64 * slot + 32
    ctypes.memmove(c.segment.address + offset, (1 << 40).to_bytes(8, "little"), 8)
    with pytest.raises(CorruptChannelError, match="more than a slot holds"):
        c.take_ready(0, -1, 0, FAR)
    assert c.held() == 0  # the lease made before the check gave the slot back


@pytest.mark.parametrize("name", ["shm", "arrow"])
def test_the_fast_path_is_offered_where_the_capability_says(name):
    transport = shmpipe.get_transport(name)()
    with shmpipe.from_iterators([_Numbers(3)], transport=transport, timeout=30) as pipe:
        assert [int(b[0]) for b in pipe] == [0, 1, 2]
        assert (pipe._take_ready is not _declined) is transport.capabilities.takes_ready
    if not transport.capabilities.takes_ready:
        c = transport.open(ChannelSpec(num_workers=1, capacity=2, slot_size=8192, ordered=False))
        try:
            with pytest.raises(NotImplementedError, match="takes_ready"):
                c.take_ready(0, -1, 0, FAR)
        finally:
            c.close()
            c.destroy()


def test_a_pass_whose_first_wait_timed_out_still_counts_its_first_batch(monkeypatch):
    # The first next() times out (the pipeline stays usable); the batch that
    # comes later is the pass's first delivered: the general path takes it,
    # so the time to the first batch is counted, not left None. (No look at
    # the producers falls due meanwhile, which would hide a fast path that
    # took it.)
    from shmpipe import _pipeline

    monkeypatch.setattr(_pipeline, "HEALTH_CHECK_NS", 60_000_000_000)
    with shmpipe.from_iterators([Counter(2, delay=1.0)], slot_size=1 << 16, timeout=0.3) as pipe:
        it = iter(pipe)
        with pytest.raises(shmpipe.PipelineTimeoutError):
            next(it)
        deadline = time.monotonic() + WAIT + 2
        while pipe.channel.ring.slot_states().count(_ring.READY) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert int(next(it)["seq"]) == 0
        s = pipe.stats()
    assert s.batches == 1 and s.time_to_first_batch_s is not None and s.time_to_first_batch_s > 0.9


def test_a_shared_batch_larger_than_a_slot_counts_its_payload_not_its_record():
    c = ShmConsumer(ChannelSpec(num_workers=1, capacity=2, slot_size=8192, ordered=False))
    try:
        writer = attach_writer(c.handle, 0)
        writer.start_pass(0)
        producer = ShmProducer(writer, _external.Outbox(socket.socket(fileno=os.dup(c.handle.outbox.fd))))
        big = np.arange(50_000, dtype=np.int64)
        producer.put(big)
        shared = c.take_shared(0, -1, 0, WAIT)
        # A region is reused: sealed against future writes, not all writes
        # (_external.py), and the rank is told so.
        assert shared.record == ("big", _codec.encoded_size(big), False)
        assert c.last_nbytes == _codec.encoded_size(big) and c.last_worker == 0
        shared.close_fd()
        del shared
        producer.close()
    finally:
        c.close()
        c.destroy()


def test_the_histogram_buckets_are_log_linear():
    # 32 per power of two, exactly (integer arithmetic, as the C side).
    assert _counters.bucket(1) == 32 and _counters.bucket(2) == 64 and _counters.bucket(3) == 64 + 16
    for e in range(6, 60):  # from 32 ns on, each power of two fills its 32 buckets
        lo, hi = 1 << (e - 1), (1 << e) - 1
        assert _counters.bucket(lo) == e * 32 and _counters.bucket(hi) == e * 32 + 31


class _Numbers:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self):
        for i in range(self.n):
            yield np.full(8, i, np.int64)


def test_an_old_pass_iterator_gets_nothing_from_the_fast_path():
    with shmpipe.from_iterators([_Numbers(1000)], capacity=4, timeout=30) as pipe:
        it = iter(pipe)
        next(it)
        deadline = time.monotonic() + WAIT
        while pipe.channel.ring.slot_states().count(_ring.READY) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        it2 = iter(pipe)  # a new pass
        with pytest.raises(PipelineClosedError, match="earlier pass"):
            next(it)
        assert int(next(it2)[0]) == 0


def test_a_pass_delivers_everything_through_the_fast_path_and_counts_it():
    with shmpipe.from_iterators([_Numbers(300), _Numbers(200)], capacity=6, timeout=30) as pipe:
        got = [int(b[0]) for b in pipe]
        s = pipe.stats()
    assert sorted(got) == sorted(list(range(300)) + list(range(200)))
    assert s.batches == 500 and s.per_worker_batches == (300, 200)
    assert s.bytes == 500 * _codec.encoded_size(np.zeros(8, np.int64))
    assert 0 < s.wait_p50_s <= s.wait_max_s


@pytest.mark.parametrize("spin_ns", [0, 1_000_000])
def test_a_blocked_producer_is_woken_with_or_without_spinning(spin_ns):
    old = _ring.set_spin_ns(spin_ns)
    try:
        c = ShmConsumer(ChannelSpec(num_workers=1, capacity=1, slot_size=8192, ordered=False))
        try:
            w = attach_writer(c.handle, 0)
            w.start_pass(0)
            w.put(np.zeros(4))
            held = c.get(0, -1, 0, WAIT)
            done = threading.Event()

            def second() -> None:
                w.put(np.ones(4))  # waits: the only slot is held
                done.set()

            t = threading.Thread(target=second, daemon=True)
            t.start()
            time.sleep(0.05)  # past the spin: it sleeps on the futex (or still spins)
            assert not done.is_set()
            del held  # the release wakes it
            assert done.wait(WAIT)
            t.join(WAIT)
            got = c.get(0, -1, 0, WAIT)
            assert float(got[0]) == 1.0
            del got
        finally:
            c.close()
            c.destroy()
    finally:
        assert _ring.set_spin_ns(old) == spin_ns
