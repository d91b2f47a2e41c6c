"""Words of the ring written from outside while a pipeline runs: each is a
CorruptChannelError within a look or two at the producers, never a pass
that quietly lacks batches or a wait that never ends, even without a
timeout (issue 20, point 4).

The words are written through the consumer's own mapping of the ring: the
same bytes another process of the user reaches through the trainer's
descriptor (kept with max_restarts, or with a group) or as a producer."""

from __future__ import annotations

import ctypes
import struct
import time

import pytest

import shmpipe
from shmpipe.testing.sources import Counter, Raiser
from shmpipe.transports.shm import UNEVEN_FOR_NS, UNEVEN_SIGHTINGS

HEADER, WORKER, SLOT = 256, 64, 64  # csrc/shmpipe_ring.h: the three tables
PASS_NO, PUBLISH_TICKET = 64, 136  # header offsets
INFLIGHT, DONE_PASS, PRODUCED = 0, 4, 8  # a worker record's
STATE = 0  # a slot record's
FREE, WRITING, HELD = 0, 1, 3
#: Errors must come within this (a few looks at the producers, 0.25 s apart;
#: an in-flight count's difference once it lasted UNEVEN_FOR_NS).
SOON_S = 5.0


def poke(pipe, offset: int, fmt: str, value: int) -> None:
    """Writes `value` at `offset` of the ring's memory, as another process would."""
    data = struct.pack(fmt, value)
    ctypes.memmove(pipe.channel.segment.address + offset, data, len(data))


def worker_record(worker: int) -> int:
    return HEADER + WORKER * worker


def slot_record(pipe, slot: int) -> int:
    return HEADER + WORKER * pipe.num_workers + SLOT * slot


def endless(**kwargs):
    """Two producers yielding a batch every 10 ms for ever; no timeout."""
    return shmpipe.from_iterators([Raiser(after=1 << 40)] * 2, timeout=None, **kwargs)


def raises_soon(it, before_each=lambda: None) -> shmpipe.CorruptChannelError:
    t0 = time.monotonic()
    with pytest.raises(shmpipe.CorruptChannelError) as info:
        while time.monotonic() - t0 < SOON_S:
            before_each()
            next(it)
    assert time.monotonic() - t0 < SOON_S + 1
    return info.value


def test_an_end_of_pass_marked_from_outside_is_an_error_not_a_short_pass():
    with endless(ordered=True) as pipe:
        it = iter(pipe)
        next(it)
        poke(pipe, worker_record(0) + PRODUCED, "<Q", 1)
        poke(pipe, worker_record(0) + DONE_PASS, "<I", pipe.channel.ring.current_pass + 1)
        error = raises_soon(it)
        assert "worker 0's part of pass" in str(error) and "has not said" in str(error)


def test_a_ready_batch_set_free_from_outside_is_missed_at_the_end_of_the_pass():
    with shmpipe.from_iterators([Counter(200)], capacity=8, timeout=None) as pipe:
        it = iter(pipe)
        next(it)
        ring = pipe.channel.ring
        deadline = time.monotonic() + SOON_S
        while ring.slot_states().count(2) == 0 and time.monotonic() < deadline:  # READY
            time.sleep(0.001)
        ready = ring.slot_states().index(2)
        poke(pipe, slot_record(pipe, ready) + STATE, "<I", FREE)
        error = raises_soon(it)
        assert "says it published 200 batches" in str(error)


def test_the_pass_number_bumped_from_outside_is_an_error_not_a_hang():
    with endless() as pipe:
        it = iter(pipe)
        next(it)
        ring = pipe.channel.ring
        poke(pipe, PASS_NO, "<I", ring.current_pass + 1)
        error = raises_soon(it)
        assert "pass number" in str(error)


def test_slots_marked_held_from_outside_are_an_error_not_a_hang():
    with endless(ordered=True, capacity=3) as pipe:
        it = iter(pipe)
        next(it)
        for slot in range(3):
            poke(pipe, slot_record(pipe, slot) + STATE, "<I", HELD)
        error = raises_soon(it)
        assert "marked as held" in str(error)


def test_an_in_flight_count_at_its_quota_from_outside_is_an_error_not_a_hang():
    with endless(ordered=True, capacity=3) as pipe:  # quota 1 per worker
        it = iter(pipe)
        next(it)
        # its quota: it may claim no slot (written again before each take,
        # as a take of one of its batches puts the word right)
        error = raises_soon(it, lambda: poke(pipe, worker_record(1) + INFLIGHT, "<I", 1))
        assert "in-flight count" in str(error)


def test_an_in_flight_count_off_for_a_moment_is_no_error():
    # A producer between its claim's two steps (the slot's CAS, then the
    # count's increment) shows a slot its count does not hold yet, for as
    # long as it is descheduled there, and the consumer's looks at the
    # producers may come milliseconds apart: two looks in a row seeing it
    # failed healthy pipelines on a loaded machine (9964b77: a group's
    # rank 0, 1 run in 20).
    with shmpipe.from_iterators([Counter(40)] * 2, ordered=True, capacity=4, timeout=30) as pipe:
        it = iter(pipe)
        got = [(int(b["worker"]), int(b["seq"])) for b in [next(it)]]  # (its slot goes back)
        channel, ring = pipe.channel, pipe.channel.ring
        deadline = time.monotonic() + SOON_S
        while ring.slot_states().count(2) < 2 and time.monotonic() < deadline:  # each producer at its quota
            time.sleep(0.001)
        time.sleep(0.1)
        free = ring.slot_states().index(FREE)  # (the producers wait at their quota: none claims it)
        # A slot claimed by worker 0 whose count does not hold it yet ...
        poke(pipe, slot_record(pipe, free) + STATE, "<I", WRITING | 0 << 8)
        for _ in range(20):
            channel.audit(ring.current_pass)
        poke(pipe, slot_record(pipe, free) + STATE, "<I", FREE)  # ... (let go again, to keep the count right)
        channel.audit(ring.current_pass)
        got += [(int(b["worker"]), int(b["seq"])) for b in it]
        assert sorted(got) == [(w, s) for w in range(2) for s in range(40)]
        # The same difference for longer than a producer is ever stopped
        # between two instructions is an error.
        poke(pipe, worker_record(0) + INFLIGHT, "<I", 1)
        channel.audit(ring.current_pass)
        time.sleep(UNEVEN_FOR_NS / 1e9)
        for _ in range(UNEVEN_SIGHTINGS - 2):  # (two looks, however far apart, are not enough)
            channel.audit(ring.current_pass)
        with pytest.raises(shmpipe.CorruptChannelError, match="worker 0's in-flight count is 1 but it has 0 slots"):
            channel.audit(ring.current_pass)


def test_the_publish_ticket_at_its_maximum_loses_nothing():
    with shmpipe.from_iterators([Counter(50)] * 2, capacity=4, timeout=30) as pipe:
        it = iter(pipe)
        b = next(it)
        got = [(int(b["worker"]), int(b["seq"]))]
        del b
        poke(pipe, PUBLISH_TICKET, "<Q", (1 << 64) - 1)
        got += [(int(b["worker"]), int(b["seq"])) for b in it]
    assert sorted(got) == [(w, s) for w in range(2) for s in range(50)]
