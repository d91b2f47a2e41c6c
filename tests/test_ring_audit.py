"""Words of the ring written from outside while a pipeline runs: each is a
CorruptChannelError within a look or two at the producers, never a pass
that quietly lacks batches or a wait that never ends, even without a
timeout (issue 20, point 4).

The words are written through the consumer's own mapping of the ring: the
same bytes another process of the user reaches through the trainer's
descriptor (kept with max_restarts, or with a group) or as a producer."""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import time

import numpy as np
import pytest

import shmpipe
from shmpipe import _ring
from shmpipe._outcomes import AGAIN
from shmpipe.testing.sources import Counter, Raiser
from shmpipe.transports.shm import UNEVEN_FOR_NS, UNEVEN_SIGHTINGS

HEADER, WORKER, SLOT = 256, 64, 64  # csrc/shmpipe_ring.h: the three tables
PASS_NO, PUBLISH_TICKET = 64, 136  # header offsets
INFLIGHT, DONE_PASS, PRODUCED = 0, 4, 8  # a worker record's
STATE = 0  # a slot record's
FREE, WRITING, READY, HELD = 0, 1, 2, 3
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


@pytest.mark.parametrize("ordered", [False, True])
# READY with owner bits, FREE with owner bits, no state, WRITING by no worker
@pytest.mark.parametrize("word", [0x102, 0x100, 0x7, 0xFFFF01])
def test_a_slot_state_no_ring_writes_is_an_error_not_a_lost_slot(ordered, word):
    # No claim, take, release or reclaim matches such a word: the slot was
    # lost for good, and without a quota (unordered) nothing else saw it:
    # once every slot was, a wait for ever (helper 60).
    with endless(ordered=ordered, capacity=3) as pipe:
        it = iter(pipe)
        next(it)

        def poison():
            for slot in range(3):
                if pipe.channel.ring.slot_info(slot)[0] == READY:  # only this thread (the consumer) moves it on
                    poke(pipe, slot_record(pipe, slot) + STATE, "<I", word)

        error = raises_soon(it, poison)
        assert f"state word is {word:#x}" in str(error)


def test_a_worker_word_rewritten_as_a_batch_is_taken_never_charges_another_worker():
    # The take matched the slot's worker word on one read, then read it
    # again (for the in-flight count, and for whose batch it is): a word
    # flipped between the reads made worker 0's batch worker 1's (helper
    # 60: 3,206 of 453,895 takes in 3 s). Now it is read once.
    nslots, nworkers, slot_size = 4, 2, 4096
    segment = _ring.Segment.create_anonymous("audit", _ring.header_size(nslots, nworkers) + nslots * slot_size)
    ring = _ring.Ring.create(segment, nslots, nworkers, slot_size, 0, True, os.getpid(), 0)
    words = segment.address + HEADER + WORKER * nworkers + 4  # slot 0's worker word; the next ones SLOT apart
    pid = os.fork()
    if pid == 0:  # the other process: the same mapping, inherited, flipping every slot's worker word
        try:
            flipped = [ctypes.c_uint32.from_address(words + SLOT * k) for k in range(nslots)]
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                for word in flipped:
                    word.value ^= 1
        finally:
            os._exit(0)
    try:
        writer, reader = _ring.RingWriter(ring, 0), _ring.RingReader(ring)
        writer.start_pass(0)
        taken = wrong = 0
        end = time.monotonic() + 0.9
        while time.monotonic() < end:
            writer.put({"x": np.array([taken])})
            batch = AGAIN
            while batch is AGAIN and time.monotonic() < end + 5:  # worker 0's batch number `taken`
                batch = reader.take(0, 0, taken, 0.01)
            assert batch is not AGAIN and int(batch["x"][0]) == taken
            wrong += reader.last_worker != 0
            taken += 1
            del batch
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert taken > 1000 and wrong == 0


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
