"""Batches larger than a slot travel in regions reused from batch to batch
(issue 21, point 2; _external.py): big and small batches interleaved at
random on shm and arrow, ordered and unordered, bit-exact, with views kept
across many batches that must never change; the reuse itself (regions
announced, not one per batch), memory given back when sizes shrink, a
producer SIGKILLed mid-run, and a Hypothesis fuzz of what a producer may
put on the outbox and in its records. Real processes, real shared memory;
the conftest checks that nothing is left open or in /dev/shm."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from region_sources import BIG, SMALL, Cycle, GrowThenShrink, RandomSizes, ReserveThenYieldBigger, pattern

import shmpipe
from shmpipe import ArraySpec, _codec, _external, _fdpass, _ring
from shmpipe.errors import CorruptChannelError
from shmpipe.testing.memory import ring_descriptors
from shmpipe.testing.processes import wait_until
from shmpipe.transport import ChannelSpec
from shmpipe.transports.shm import ShmConsumer, ShmProducer, attach_writer

T = 60.0
WAIT = 5.0
KEEP = 2  # views kept at once, rotated (with the one in hand: within what capacity 8 lets an ordered consumer hold)


def check(b: dict[str, Any]) -> None:
    x = b["x"]
    expected = pattern(int(b["worker"]), int(b["seq"]), x.size)
    assert np.array_equal(x, expected), f"batch {b['worker']}/{b['seq']} differs"
    assert not x.flags.writeable
    assert x.__array_interface__["data"][0] % 64 == 0


@pytest.mark.parametrize("transport", ["shm", "arrow"])
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_big_and_small_batches_at_random_with_kept_views(transport, ordered):
    count, workers = 150, 2
    kept: list[tuple[dict[str, Any], np.ndarray]] = []  # (batch, a private copy of its array)
    seen: dict[int, list[int]] = {}
    with shmpipe.from_iterators(
        [RandomSizes(count)] * workers, transport=transport, ordered=ordered, capacity=8, timeout=T
    ) as pipe:
        for i, b in enumerate(pipe):
            check(b)
            seen.setdefault(int(b["worker"]), []).append(int(b["seq"]))
            if i % 7 == 0:
                kept.append((b, np.array(b["x"])))
                if len(kept) > KEEP:
                    old, copy = kept.pop(0)
                    # Kept over at least 20 batches, many of them big: if its
                    # region (or slot) had been written again, this differs.
                    assert np.array_equal(old["x"], copy), f"a kept view changed: {old['worker']}/{old['seq']}"
                    del old  # (else held until the next: one more than KEEP)
            del b
        stats = pipe.channel.external_stats()
    for old, copy in kept:
        assert np.array_equal(old["x"], copy)
    assert {w: sorted(s) for w, s in seen.items()} == {w: list(range(count)) for w in range(workers)}
    for s in seen.values():
        assert s == sorted(s), "a worker's batches out of order"
    big = sum(1 for w in range(workers) for n in _sizes(count, w) if n > SMALL * 1.25)
    # Reused: about 60% of 300 batches are big; a region is announced (a
    # descriptor received, a memfd made) only when a producer's pool grows
    # or a region is replaced by a larger one.
    assert 0 < stats["received"] < big / 4, (stats, big)


def _sizes(count: int, worker: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 1000 + worker)
    return [SMALL if seq == 0 else rng.choice((SMALL, SMALL // 2, BIG, BIG * 2, BIG + 7)) for seq in range(count)]


def test_a_steady_stream_of_big_batches_announces_almost_nothing_after_the_start():
    # The steady state: after a warm-up, 500 more big batches cost at most
    # a few more regions (a pool grows to what is busy at once, at most a
    # region per slot and one, per worker), not one per batch.
    capacity, workers = 6, 2
    with shmpipe.from_iterators([Cycle(1200)] * workers, capacity=capacity, timeout=T) as pipe:
        it = iter(pipe)
        for _ in range(1400):
            check(next(it))
        early = pipe.channel.external_stats()
        for b in it:
            check(b)
            del b
        late = pipe.channel.external_stats()
    more = late["received"] - early["received"]
    assert more <= workers * (capacity + 1) and late["maps"] - early["maps"] <= more + workers * (capacity + 1), (
        early,
        late,
    )
    assert early["received"] <= 3 * workers * (capacity + 1), early


@pytest.mark.parametrize("transport", ["shm", "arrow"])
def test_sizes_shrinking_gives_the_regions_back(transport):
    with shmpipe.from_iterators([GrowThenShrink()] * 2, transport=transport, capacity=6, timeout=T) as pipe:
        it = iter(pipe)
        peak = 0
        for b in it:
            check(b)
            peak = max(peak, pipe.channel.external_stats()["regions"])
            del b
        stats = pipe.channel.external_stats()  # the pass ended: the consumer read the outbox
        assert peak >= 2 and stats["regions"] == 0 and stats["region_bytes"] == 0, (peak, stats)
        assert stats["dropped"] >= peak
        # Nothing of the regions is open in the consumer any more either.
        assert not [fd for fd, what in ring_descriptors().items() if "shmpipe-batch" in what]


@pytest.mark.parametrize("transport", ["shm", "arrow"])
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_a_producer_sigkilled_among_big_batches(transport, ordered):
    # Batches up to the kill are whole and without a gap; then a
    # WorkerDiedError naming the worker; nothing left open (the conftest
    # checks descriptors and /dev/shm too).
    rng = random.Random(21)
    before = set(ring_descriptors())
    seen: dict[int, list[int]] = {}
    victim = rng.randrange(2)
    with pytest.raises(shmpipe.WorkerDiedError) as info:
        with shmpipe.from_iterators(
            [RandomSizes(10_000, seed=1, delay=0.0005)] * 2, transport=transport, ordered=ordered, capacity=8, timeout=T
        ) as pipe:
            kill_at = rng.randrange(20, 120)
            for i, b in enumerate(pipe):
                check(b)
                seen.setdefault(int(b["worker"]), []).append(int(b["seq"]))
                del b
                if i == kill_at:
                    os.kill(pipe.pids[victim], signal.SIGKILL)
    assert info.value.worker_id == victim
    for worker, seqs in seen.items():
        assert seqs == list(range(len(seqs))), f"worker {worker}: a gap or a duplicate"
    assert wait_until(lambda: set(ring_descriptors()) <= before, 5.0), ring_descriptors()


# -- what a producer may send: untrusted, at worst a CorruptChannelError ------

_NEW_OR_DROP = st.sampled_from([_external.NEW, _external.DROP, 0, 3])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tags=st.lists(
        st.tuples(_NEW_OR_DROP, st.integers(0, 3), st.integers(0, 6), st.integers(0, 4), st.booleans()),
        max_size=6,
    ),
    records=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 4), st.sampled_from([0, 64, 400_064, 1 << 50])),
        min_size=1,
        max_size=4,
    ),
)
def test_any_region_ids_offsets_and_lengths_from_a_producer(tags, records):
    """Any datagrams (kind, worker, region, rid, with or without a
    descriptor), then any records (worker, region, rid, nbytes) in slots
    of worker 1: each take gives the batch that region holds, bit-exact,
    or CorruptChannelError; nothing else, and nothing left open."""
    batch = np.arange(50_000, dtype=np.int64)
    payload = _codec.encoded_size(batch)
    c = ShmConsumer(ChannelSpec(num_workers=2, capacity=4, slot_size=8192, ordered=False))
    before = set(ring_descriptors())
    try:
        writer = attach_writer(c.handle, 1)
        writer.start_pass(0)
        with socket.socket(fileno=os.dup(c.handle.outbox.fd)) as sock:
            for kind, worker, index, rid, with_fd in tags:
                fds = [_region_with(batch)] if with_fd else []
                try:
                    _fdpass.send_fds(sock, _external.TAG.pack(kind, worker, index, rid), fds)
                finally:
                    _fdpass.close_all(fds)
            for worker, index, rid, nbytes in records:
                slot, buf = writer.claim()
                struct.pack_into("<4sIQQII", buf.data, 0, b"SPX1", worker, nbytes, rid, index, 0)
                del buf
                writer.publish_claimed(slot, 32)
                try:
                    got = c.get(0, -1, 0, WAIT)
                except CorruptChannelError:
                    continue
                # Delivered: only a record that names a region announced to
                # worker 1 with the whole payload in it.
                assert worker == 1 and nbytes == payload, (worker, nbytes)
                np.testing.assert_array_equal(got, batch)
                assert not got.flags.writeable
                del got
    finally:
        c.close()
        c.destroy()
    assert set(ring_descriptors()) <= before


def _region_with(batch: np.ndarray) -> int:
    """A region as a producer makes one, holding `batch` at its start."""
    payload = _codec.encode(batch).tobytes()
    fd = os.memfd_create("shmpipe-batch", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, _external.region_size_for(len(payload)))
    os.pwrite(fd, payload, 0)
    fcntl.fcntl(
        fd,
        fcntl.F_ADD_SEALS,
        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL | _external.F_SEAL_FUTURE_WRITE,
    )
    return fd


def test_a_producer_writing_its_own_region_ids_into_records_is_caught_before_use():
    """ShmProducer end to end against a forged record: a record in a slot of
    worker 0 naming worker 0's region with another id (the producer's pool
    never made it) is a CorruptChannelError, and the real batches around
    it come through."""
    c = ShmConsumer(ChannelSpec(num_workers=1, capacity=4, slot_size=8192, ordered=False))
    try:
        writer = attach_writer(c.handle, 0)
        writer.start_pass(0)
        producer = ShmProducer(writer, _external.Outbox(socket.socket(fileno=os.dup(c.handle.outbox.fd))))
        producer.put(np.full(50_000, 3, np.int64))
        got = c.get(0, -1, 0, WAIT)
        assert int(got[0]) == 3
        del got
        writer.publish_record(writer.claim_slot(), _codec.encoded_size(np.zeros(50_000, np.int64)), 0, 99)
        with pytest.raises(CorruptChannelError, match=r"names region 0 \(id 99\) of worker 0"):
            c.get(0, -1, 0, WAIT)
        producer.put(np.full(50_000, 4, np.int64))
        got = c.get(0, -1, 0, WAIT)
        assert int(got[0]) == 4 and c.external_stats()["received"] == 1  # the region was reused
        del got
        producer.close()
    finally:
        c.close()
        c.destroy()


def test_a_view_of_a_reservation_in_a_region_kept_past_its_yield_guards_the_region_and_only_then():
    """reserve() of a batch larger than a slot hands out arrays in a region;
    a NumPy view of them kept past the yield could change the batch the
    consumer holds. Seen as for a slot (the reservation's root has more
    references than its arrays): the region is read-only here while it
    carries a batch and the view lives; never otherwise."""
    c = ShmConsumer(ChannelSpec(num_workers=1, capacity=4, slot_size=8192, ordered=False))
    try:
        writer = attach_writer(c.handle, 0)
        writer.start_pass(0)
        producer = ShmProducer(writer, _external.Outbox(socket.socket(fileno=os.dup(c.handle.outbox.fd))))
        pool = producer.regions
        template = {"x": ArraySpec((50_000,), np.int64)}
        for i in range(4):  # filled through a local holding the array itself: no guard
            r = producer.reserve(template)
            x = r["x"]
            x[:] = i
            producer.put(r)
            assert int(c.get(0, -1, i, WAIT)["x"][-1]) == i
        assert pool.guards == 0
        r = producer.reserve(template)
        view = r["x"][100:200]
        r["x"][:] = 4
        producer.put(r)
        region = next(reg for reg in pool.regions if reg.tainted is not None)
        assert pool.guards == 1 and region.protected and view.flags.writeable
        got = c.get(0, -1, 4, WAIT)
        assert int(got["x"][150]) == 4
        del got, view, r, x
        for i in range(5, 9):  # the view is gone: the region is written and published unguarded
            r = producer.reserve(template)
            r["x"][:] = i
            producer.put(r)
            assert int(c.get(0, -1, i, WAIT)["x"][0]) == i
        assert pool.guards == 1 and not region.protected and region.tainted is None
        producer.close()
    finally:
        c.close()
        c.destroy()


# -- the per-batch work, compiled (_ring.RegionPoolCore, _ring.RegionTable) ----


def _counting(reader: Any) -> list[tuple[int, int, int, int]]:
    """Counts the records the reader hands to its Python way
    (_external.Regions.root: a first use, a larger mapping, an error)."""
    calls: list[tuple[int, int, int, int]] = []
    slow = reader.on_external

    def counted(worker: int, index: int, rid: int, nbytes: int, record: np.ndarray) -> np.ndarray:
        calls.append((worker, index, rid, nbytes))
        return slow(worker, index, rid, nbytes, record)

    reader.on_external = counted
    return calls


def test_a_steady_stream_of_big_batches_is_taken_without_the_python_way():
    # After a region's first use, the reader finds it in the table itself:
    # the Python way is taken once per mapping made, never per batch.
    capacity, workers = 6, 2
    with shmpipe.from_iterators([Cycle(400)] * workers, capacity=capacity, timeout=T) as pipe:
        it = iter(pipe)
        check(next(it))  # (the channel exists from the first batch on)
        calls = _counting(pipe.channel.reader)
        maps = pipe.channel.external_stats()["maps"]
        n = 1
        for b in it:
            check(b)
            del b
            n += 1
        stats = pipe.channel.external_stats()
    assert n == 400 * workers
    assert len(calls) == stats["maps"] - maps <= 2 * workers * (capacity + 1), (len(calls), stats)


def test_the_reader_checks_every_value_of_a_record_against_the_region_it_mapped():
    """A region in use (mapped by the consumer): a record that differs from
    it in its id, index, worker or size is a CorruptChannelError, and one
    that needs more of it than is mapped is mapped again (the checked way),
    bit-exact; the real batches around them come through."""
    c = ShmConsumer(ChannelSpec(num_workers=2, capacity=4, slot_size=8192, ordered=False))
    try:
        writer = attach_writer(c.handle, 1)
        writer.start_pass(0)
        producer = ShmProducer(writer, _external.Outbox(socket.socket(fileno=os.dup(c.handle.outbox.fd))))
        calls = _counting(c.reader)
        big, small = np.arange(50_000, dtype=np.int64), np.arange(10_000, dtype=np.int64)
        producer.put(big)  # region A, made for `big`
        held = c.get(0, -1, 0, WAIT)  # A mapped; held: A stays busy
        producer.put(small)  # A busy: region B, made for the peak (`big`)
        got = c.get(0, -1, 0, WAIT)  # B mapped for `small` only (twice its size)
        np.testing.assert_array_equal(got, small)
        del got
        assert len(calls) == 2 and c.regions.maps == 2
        b = next(r for r in producer.regions.regions if r.index != producer.regions.regions[0].index)
        producer.put(big + 1)  # into B (A is held): more than B's mapping
        got = c.get(0, -1, 0, WAIT)
        np.testing.assert_array_equal(got, big + 1)
        del got
        assert len(calls) == 3 and c.regions.maps == 3  # mapped again, larger
        producer.put(big + 2)
        got = c.get(0, -1, 0, WAIT)
        np.testing.assert_array_equal(got, big + 2)
        del got
        assert len(calls) == 3  # the reader itself
        nbytes = _codec.encoded_size(big)
        size = c.regions.table.get(1, b.index).size
        forged = [
            (1, b.index, b.rid + 1, nbytes),  # another id
            (1, b.index, b.rid - 1, nbytes),  # an id that was never B's
            (1, 3, b.rid, nbytes),  # an index never announced
            (1, c.regions.nslots + 1, b.rid, nbytes),  # outside the table
            (0, b.index, b.rid, nbytes),  # another worker's (in a slot of worker 1)
            (1, b.index, b.rid, size + 1),  # more than the region
            (1, b.index, b.rid, 1 << 63),
        ]
        for worker, index, rid, n in forged:
            slot, buf = writer.claim()
            struct.pack_into("<4sIQQII", buf.data, 0, b"SPX1", worker, n, rid, index, 0)
            del buf
            writer.publish_claimed(slot, 32)
            with pytest.raises(CorruptChannelError):
                c.get(0, -1, 0, WAIT)
        producer.put(big + 3)
        got = c.get(0, -1, 0, WAIT)
        np.testing.assert_array_equal(got, big + 3)
        np.testing.assert_array_equal(held, big)  # kept all along: A was never written
        del got, held
        assert c.external_stats()["received"] == 2
        producer.close()
    finally:
        c.close()
        c.destroy()


def test_a_failed_write_into_a_region_gives_its_slot_back_and_leaves_the_region_free():
    c = ShmConsumer(ChannelSpec(num_workers=1, capacity=4, slot_size=8192, ordered=False))
    try:
        writer = attach_writer(c.handle, 0)
        writer.start_pass(0)
        producer = ShmProducer(writer, _external.Outbox(socket.socket(fileno=os.dup(c.handle.outbox.fd))))
        pool = producer.regions
        assert pool is not None
        producer.put(np.zeros(50_000, np.int64))
        got = c.get(0, -1, 0, WAIT)
        del got  # its region is free again

        def fails(buf: np.ndarray) -> None:
            buf[:8] = 7  # a partial write: never published
            raise RuntimeError("the encoder failed")

        with pytest.raises(RuntimeError, match="the encoder failed"):
            pool.put_external(400_000, fails)
        nbytes = writer.put_fitting(np.ones(50_000, np.int64))
        with pytest.raises(ValueError, match="planned"):
            pool.put_planned(nbytes + 8)  # not what was planned
        assert c.ring.slot_states() == [_ring.FREE] * 4  # both slots given back
        assert all(pool.free(r) for r in pool.regions)
        pool.put_planned(nbytes)  # the planned batch, at last
        np.testing.assert_array_equal(c.get(0, -1, 1, WAIT), np.ones(50_000, np.int64))
        producer.close()
    finally:
        c.close()
        c.destroy()


def test_the_region_table_keeps_what_it_was_given_within_the_ring():
    table = _ring.RegionTable(2, 3, _external._Held)
    entry = _ring.RegionEntry(5, 8192, None)
    with pytest.raises(IndexError):
        table.put(2, 0, entry)
    with pytest.raises(IndexError):
        table.put(0, 3, entry)
    assert table.get(2, 0) is None and table.get(0, 1 << 40) is None
    with pytest.raises(KeyError):
        table.pop(1, 1)
    table.put(1, 2, entry)
    table.put(1, 2, entry)
    assert len(table) == 1 and table.items() == [((1, 2), entry)] and table.pop(1, 2) is entry and not table
    # Its mapping: read-only, never larger than the region.
    fd = os.memfd_create("shmpipe-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 16384)
        with pytest.raises(ValueError):
            entry.set_view(_ring.Mapping(fd, 8192, True))
        with pytest.raises(ValueError):
            entry.set_view(_ring.Mapping(fd, 16384, False))
        entry.set_view(_ring.Mapping(fd, 4096, False))
        assert entry.mapped == 4096
    finally:
        os.close(fd)

    class OwnInit(_external._Held):
        __slots__ = ()

        def __init__(self, view: Any, record: Any, desc: Any) -> None:
            super().__init__(view, record, desc)

    with pytest.raises(TypeError):
        _ring.RegionTable(1, 1, OwnInit)


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_a_reservation_yielded_inside_a_batch_larger_than_a_slot(ordered):
    count, workers = 60, 2
    seen: dict[int, list[int]] = {}
    with shmpipe.from_iterators(
        [ReserveThenYieldBigger(count)] * workers, ordered=ordered, capacity=4, timeout=T
    ) as pipe:
        for b in pipe:
            check(b)
            seq = int(b["seq"])
            if seq and seq % 2 == 0:
                big = b["big"]
                assert np.array_equal(big, pattern(int(b["worker"]), seq, BIG)) and not big.flags.writeable
            seen.setdefault(int(b["worker"]), []).append(seq)
            del b
        stats = pipe.channel.external_stats()
    assert {w: sorted(s) for w, s in seen.items()} == {w: list(range(count)) for w in range(workers)}
    assert 0 < stats["received"] <= workers * 5, stats
