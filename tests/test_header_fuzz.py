"""Fuzzing the ring's header parser and slot records: bytes in shared memory
are untrusted input.

A real ring's header (docs/design.md, "Byte layout") is copied into fresh
sealed anonymous memory with mutations that know its layout: each geometry
field set to extreme or near-valid values, worker and slot records filled
with garbage, random bytes flipped. Attaching must give a Ring or a
CorruptChannelError; a ring that attaches must then take, publish and
release within its own mapping (a timeout-bounded take returns, or raises
CorruptChannelError): no other exception, no crash, no hang.

SHMPIPE_FUZZ_EXAMPLES=N sets how many examples each test runs (see
test_codec_fuzz.py).
"""

from __future__ import annotations

import os
import struct
import threading

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmpipe import _ring
from shmpipe.errors import CorruptChannelError, ShmpipeValueError
from shmpipe.transport import AGAIN, END, FAULT

EXAMPLES = int(os.environ.get("SHMPIPE_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(
    max_examples=EXAMPLES // 4 or 1,  # each example maps memory: a quarter of the codec's count
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example, HealthCheck.data_too_large],
)

NSLOTS, NWORKERS, SLOT = 4, 2, 8192
HEADER = _ring.header_size(NSLOTS, NWORKERS)
TOTAL = HEADER + NSLOTS * SLOT
WORKERS_AT = 256
SLOTS_AT = WORKERS_AT + 64 * NWORKERS

#: (offset, width) of every field a process reads from the header
GEOMETRY = {
    "magic": (0, 8), "layout_version": (8, 4), "flags": (12, 4), "header_size": (16, 8), "slot_size": (24, 8),
    "total_size": (32, 8), "nslots": (40, 4), "nworkers": (44, 4), "quota": (48, 4), "owner_pid": (52, 4),
    "owner_start": (56, 8), "pass_no": (64, 4), "closed": (68, 4), "faults": (144, 4),
}
WORKER_FIELDS = {"inflight": (0, 4), "done_pass": (4, 4), "produced": (8, 8)}
SLOT_FIELDS = {"state": (0, 4), "worker": (4, 4), "pass": (8, 4), "wseq": (16, 8), "ticket": (24, 8), "nbytes": (32, 8)}


def _template() -> bytes:
    """A real ring (header and slots) with one batch READY."""
    seg = _ring.Segment.create_anonymous("fuzz-template", TOTAL)
    ring = _ring.Ring.create(seg, NSLOTS, NWORKERS, SLOT, 0, False, os.getpid(), 1, 0)
    writer = _ring.RingWriter(ring, 1)
    writer.start_pass(0)
    writer.put({"x": np.arange(100, dtype=np.int32)})
    return bytes(seg.array())


TEMPLATE = _template()


def _values(width: int) -> st.SearchStrategy[int]:
    top = (1 << (8 * width)) - 1
    return st.one_of(
        st.sampled_from(
            [v for v in (0, 1, 2, 3, 4, 5, 7, 8, 4095, 4096, 8192, HEADER, TOTAL, top >> 1, 1 << 30, 1 << 40) if v < top]
            + [top]
        ),
        st.integers(0, top),
    )


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    header = bytearray(TEMPLATE)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["geometry", "worker", "slot", "bytes"]))
        if kind == "geometry":
            offset, width = GEOMETRY[draw(st.sampled_from(sorted(GEOMETRY)))]
        elif kind == "worker":
            field = WORKER_FIELDS[draw(st.sampled_from(sorted(WORKER_FIELDS)))]
            offset, width = WORKERS_AT + 64 * draw(st.integers(0, NWORKERS - 1)) + field[0], field[1]
        elif kind == "slot":
            field = SLOT_FIELDS[draw(st.sampled_from(sorted(SLOT_FIELDS)))]
            offset, width = SLOTS_AT + 64 * draw(st.integers(0, NSLOTS - 1)) + field[0], field[1]
        else:  # any byte of the header and the tables (the payloads are the codec's fuzz)
            offset, width = draw(st.integers(0, HEADER - 1)), 1
        header[offset : offset + width] = draw(_values(width)).to_bytes(width, "little")
    return bytes(header)


def _exercise(header: bytes) -> None:
    seg = _ring.Segment.create_anonymous("fuzz", TOTAL)
    os.pwrite(seg.fd, header, 0)
    try:
        ring = _ring.Ring.attach(seg)
    except CorruptChannelError:
        return
    # It attached: every geometry value it keeps is consistent and inside the mapping.
    assert HEADER <= TOTAL and ring.nslots * ring.slot_size <= seg.size
    reader = _ring.RingReader(ring)
    for pass_no, worker in ((0, -1), (0, 0), (0, 1), (1, -1)):
        try:
            got = reader.take(pass_no, worker, 0, 0.0)
        except (CorruptChannelError, ShmpipeValueError):
            continue
        if got not in (AGAIN, END, FAULT):
            assert isinstance(got, dict) and np.asarray(got["x"]).nbytes <= ring.slot_size
            del got
    # A producer's put waits for a slot as long as none is free (the ring's
    # words may say every slot is taken, or the worker at its quota): it runs
    # in a thread, and closing the ring ends the wait, as a consumer's close
    # does.
    outcome: list[BaseException | None] = []

    def put() -> None:
        try:
            writer = _ring.RingWriter(ring, 0)
            writer.start_pass(ring.current_pass)
            writer.put({"x": np.zeros(10)})
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    thread = threading.Thread(target=put, daemon=True)
    thread.start()
    thread.join(1.0)
    if thread.is_alive():
        ring.close()
        thread.join(10.0)
    assert not thread.is_alive(), "a closed ring must end a producer's wait for a slot"
    exc = outcome[0]
    if exc is not None and not isinstance(exc, (CorruptChannelError, ShmpipeValueError, ValueError)):
        # Cancelled/Closed from the protocol words: fine, they are the ring's answers
        assert type(exc).__name__ in ("Cancelled", "Closed"), repr(exc)


@FUZZ
@given(mutated_headers())
def test_a_mutated_header_attaches_consistently_or_is_refused(header):
    _exercise(header)


@FUZZ
@given(st.binary(min_size=HEADER, max_size=HEADER))
def test_random_bytes_as_a_header(header):
    _exercise(header + TEMPLATE[HEADER:])


def test_the_template_itself_attaches_and_delivers():
    seg = _ring.Segment.create_anonymous("fuzz", TOTAL)
    os.pwrite(seg.fd, TEMPLATE, 0)
    ring = _ring.Ring.attach(seg)
    batch = _ring.RingReader(ring).take(0, -1, 0, 0.0)
    assert ring.slot_size == SLOT and batch["x"].tolist() == list(range(100))
    assert struct.unpack_from("<Q", TEMPLATE, 24)[0] == SLOT  # the layout this file mutates
