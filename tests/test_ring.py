"""The ring in one process: real shared memory, both ends attached separately
(as a producer process would), threads where a call must block."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import Command, SharedRuns

from shmpipe import _process, _ring, _segments
from shmpipe.errors import CorruptChannelError, SharedMemoryFullError
from shmpipe.transport import Cancelled, ChannelSpec, Closed
from shmpipe.transports.shm import ShmConsumer, ShmHandle, attach_writer

WAIT = 2.0  # seconds any single wait in these tests may take


@pytest.fixture
def make_ring():
    made = []

    # Named segments by default here, so tests can reach them from outside
    # by name; the anonymous backing has tests of its own below.
    def make(num_workers=1, capacity=4, slot_size=8192, ordered=False, backing="posix"):
        c = ShmConsumer(
            ChannelSpec(num_workers=num_workers, capacity=capacity, slot_size=slot_size, ordered=ordered, first_pass=0),
            backing=backing,
        )
        made.append(c)
        writers = [attach_writer(c.handle, w) for w in range(num_workers)]
        for w in writers:
            w.start_pass(0)
        return c, writers

    yield make
    for c in made:
        c.close()
        c.destroy()


def take(c, worker=-1, wseq=0, pass_no=0, wait=WAIT):
    r = c.get(pass_no, worker, wseq, wait)
    assert r is not _ring.AGAIN, "nothing arrived within the wait"
    return r


def slot_of(batch):
    arr = batch if isinstance(batch, np.ndarray) else batch["x"]
    return arr.base.base.slot  # field -> root -> lease


def in_thread(fn, *args):
    """Runs fn in a thread; returns (thread, result list)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_slot_reuse(make_ring):
    # A slot freed is the first one a producer finds again (warm in cache).
    c, (w,) = make_ring(capacity=3)
    for i in range(100):
        w.put({"x": np.full(10, i, np.int64)})
        b = take(c)
        np.testing.assert_array_equal(b["x"], np.full(10, i))
        assert slot_of(b) == 0
        del b
    assert c.ring.slot_states() == [_ring.FREE] * 3


def test_wraparound(make_ring):
    # The consumer keeps its last two batches: with 3 slots the producers
    # must go round the ring, and worker 1 (which starts its search in the
    # middle) wraps past the end.
    c, ws = make_ring(num_workers=2, capacity=3)
    kept = []
    slots = []
    for i in range(60):
        ws[i % 2].put({"x": np.full(10, i, np.int64)})
        b = take(c)
        np.testing.assert_array_equal(b["x"], np.full(10, i))
        slots.append(slot_of(b))
        kept.append(b)
        if len(kept) > 2:
            del kept[0]
        for j, k in enumerate(kept):  # what is kept never changes
            assert k["x"][0] == i - len(kept) + 1 + j
    assert set(slots) == {0, 1, 2}
    assert all(slots[i] != slots[i + 1] != slots[i + 2] != slots[i] for i in range(len(slots) - 2))


def test_producer_waits_until_the_consumer_lets_go(make_ring):
    c, (w,) = make_ring(capacity=2)
    w.put({"x": np.zeros(4)})
    w.put({"x": np.ones(4)})
    a, b = take(c), take(c)
    assert c.ring.slot_states() == [_ring.HELD, _ring.HELD]
    t, done = in_thread(w.put, {"x": np.full(4, 2.0)})
    t.join(0.3)
    assert t.is_alive(), "put() returned although every slot is held"
    del a  # the only reference to the first batch: its slot goes back
    t.join(WAIT)
    assert not t.is_alive() and done == [None]
    c3 = take(c)
    np.testing.assert_array_equal(c3["x"], np.full(4, 2.0))
    np.testing.assert_array_equal(b["x"], np.ones(4))


def test_out_of_order_release_and_held_views_never_change(make_ring):
    c, (w,) = make_ring(capacity=4)
    held = []
    for i in range(3):
        w.put({"x": np.full(1000, i, np.float64)})
        held.append(take(c))
    freed = slot_of(held[1])
    del held[1]  # release the middle one first
    for i in range(50):  # churn through the remaining slots
        w.put({"x": np.full(1000, 100 + i, np.float64)})
        b = take(c)
        assert slot_of(b) != slot_of(held[0]) and slot_of(b) != slot_of(held[1])
        del b
    np.testing.assert_array_equal(held[0]["x"], np.full(1000, 0.0))
    np.testing.assert_array_equal(held[1]["x"], np.full(1000, 2.0))
    assert c.ring.slot_states()[freed] == _ring.FREE


def test_a_field_kept_alone_keeps_the_slot(make_ring):
    c, (w,) = make_ring(capacity=2)
    w.put({"x": np.arange(5), "y": np.arange(3)})
    b = take(c)
    y = b["y"]
    s = slot_of(b)
    del b
    assert c.ring.slot_states()[s] == _ring.HELD
    view = y[1:]  # a view of a field still counts
    del y
    assert c.ring.slot_states()[s] == _ring.HELD
    np.testing.assert_array_equal(view, [1, 2])
    del view
    assert c.ring.slot_states()[s] == _ring.FREE


def test_consumer_arrays_cannot_be_made_writeable(make_ring):
    c, (w,) = make_ring()
    w.put({"x": np.arange(5)})
    b = take(c)
    assert not b["x"].flags.writeable
    with pytest.raises(ValueError):
        b["x"].flags.writeable = True
    with pytest.raises(ValueError):
        b["x"][0] = 1
    assert b["x"].ctypes.data % 64 == 0
    assert np.shares_memory(b["x"], c.segment.array())


def test_unordered_takes_in_publication_order(make_ring):
    c, ws = make_ring(num_workers=3, capacity=8)
    order = [(2, 0), (0, 0), (1, 0), (0, 1), (2, 1)]
    for worker, seq in order:
        ws[worker].put({"w": worker, "s": seq})
    got = [take(c) for _ in order]
    assert [(b["w"], b["s"]) for b in got] == order


def test_end_of_pass_needs_every_worker(make_ring):
    c, ws = make_ring(num_workers=2, capacity=4)
    ws[0].put({"x": 1})
    ws[0].finish_pass()
    assert take(c) == {"x": 1}
    assert c.get(0, -1, 0, 0.05) is _ring.AGAIN  # worker 1 has not finished
    ws[1].put({"x": 2})
    ws[1].finish_pass()
    assert take(c) == {"x": 2}
    assert take(c) is _ring.END


def test_ordered_take_and_quota(make_ring):
    # 2 workers, capacity 3: each may have (3 - 1) // 2 = 1 batch in flight.
    c, ws = make_ring(num_workers=2, capacity=3, ordered=True)
    assert c.ring.quota == 1
    ws[1].put({"w": 1, "s": 0})
    t, done = in_thread(ws[1].put, {"w": 1, "s": 1})
    t.join(0.3)
    assert t.is_alive(), "worker 1 went past its quota"
    ws[0].put({"w": 0, "s": 0})  # a slot is left for worker 0
    first = take(c, worker=0, wseq=0)
    assert first == {"w": 0, "s": 0}
    assert take(c, worker=1, wseq=0) == {"w": 1, "s": 0}  # frees worker 1's quota
    t.join(WAIT)
    assert done == [None]
    assert take(c, worker=1, wseq=1) == {"w": 1, "s": 1}
    ws[0].finish_pass()
    assert take(c, worker=0, wseq=1) is _ring.END


def test_new_pass_cancels_producers_and_discards_stale_batches(make_ring):
    c, (w,) = make_ring(capacity=3)
    w.put({"p": 0, "s": 0})
    w.put({"p": 0, "s": 1})
    c.begin_pass(1)
    with pytest.raises(Cancelled):
        w.put({"p": 0, "s": 2})
    w.start_pass(1)
    w.put({"p": 1, "s": 0})
    assert take(c, pass_no=1) == {"p": 1, "s": 0}  # the stale ones were skipped ...
    assert c.ring.slot_states().count(_ring.READY) == 0  # ... and freed
    w.finish_pass()
    assert take(c, pass_no=1) is _ring.END


def test_close_stops_a_waiting_producer(make_ring):
    c, (w,) = make_ring(capacity=1)
    w.put({"x": 0})
    errors = []

    def blocked_put():
        try:
            w.put({"x": 1})
        except Closed as exc:
            errors.append(exc)

    t = threading.Thread(target=blocked_put, daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive()
    c.close()
    t.join(WAIT)
    assert len(errors) == 1


def test_reserve_publishes_in_place(make_ring):
    c, (w,) = make_ring(capacity=2, slot_size=1 << 16)
    r = w.reserve({"x": _ring_spec((100,), np.float32), "tag": "t"})
    assert r["x"].flags.writeable
    r["x"][:] = np.arange(100)
    offset = r["x"].ctypes.data - w.ring.segment.address
    w.put(r)
    assert not r["x"].flags.writeable, "the producer's arrays must be sealed once published"
    b = take(c)
    # The consumer reads the very bytes written (each end has its own
    # mapping, so compare offsets in the segment).
    assert b["x"].ctypes.data - c.segment.address == offset
    np.testing.assert_array_equal(b["x"], np.arange(100))
    assert b["tag"] == "t"


def test_reserve_then_yield_something_else_copies_and_frees(make_ring):
    c, (w,) = make_ring(capacity=2, slot_size=1 << 16)
    r = w.reserve({"x": _ring_spec((10,), np.int32)})
    r["x"][:] = 7
    w.put((r["x"], "other structure"))  # not what reserve returned: copied
    assert c.ring.slot_states().count(_ring.WRITING) == 0
    b = take(c)
    np.testing.assert_array_equal(b[0], np.full(10, 7))


def test_reserve_twice_without_yielding_is_an_error(make_ring):
    c, (w,) = make_ring(capacity=3, slot_size=1 << 16)
    w.reserve({"x": _ring_spec((4,), np.int8)})
    with pytest.raises(ValueError, match="reserve"):
        w.reserve({"x": _ring_spec((4,), np.int8)})


def test_batch_too_large_names_the_option(make_ring):
    c, (w,) = make_ring(slot_size=8192)
    with pytest.raises(ValueError, match=r"slot_size=1 << 20") as info:
        w.put(np.zeros(10_000, np.float64))
    assert info.value.nbytes > 80_000 and info.value.slot_size == 8192
    assert c.ring.slot_states() == [_ring.FREE] * 4  # nothing claimed


def _ring_spec(shape, dtype):
    from shmpipe import ArraySpec

    return ArraySpec(shape, dtype)


# -- the segment -------------------------------------------------------------


def test_segment_name_mode_and_exclusive_creation(make_ring):
    c, _ = make_ring()
    name = c.handle.name
    assert _segments.parse_name(name) == _process.owner_identity()
    assert len(name.rsplit("-", 1)[1]) == 24  # 96 random bits
    st = os.stat(_segments.SHM_DIR + name)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == c.segment.size
    with pytest.raises(FileExistsError):
        _ring.Segment.create(name, 4096)


@pytest.fixture
def a_taken_name(monkeypatch):
    """A name in shmpipe's format, taken in /dev/shm by a segment with a
    mark in it, which the name generator then gives out every time (a test
    seam: the segment, shm_open and the ring are all real)."""
    name = _segments.new_segment_name()
    path = _segments.SHM_DIR + name
    _ring.Segment.create(name, 4096)
    with open(path, "r+b") as f:
        f.write(b"not ours")
    monkeypatch.setattr(_segments, "new_segment_name", lambda: name)
    try:
        yield name
    finally:
        with open(path, "rb") as f:
            there = f.read()
        _ring.unlink_segment(name)
        # It failed closed: what was there is as it was.
        assert there == b"not ours" + bytes(4096 - 8), "the segment under the taken name was touched"


def test_a_taken_segment_name_is_a_clear_error(a_taken_name):
    # The name generator gives out a name that is taken: creating the
    # ring fails closed (O_EXCL), after a few fresh names, as a ShmpipeError
    # that names the segment. (It was a raw FileExistsError from shm_open.)
    import shmpipe
    from shmpipe.transports import shm

    with pytest.raises(shmpipe.SegmentExistsError) as info:
        ShmConsumer(ChannelSpec(num_workers=1, capacity=2, slot_size=4096, ordered=False, first_pass=0), backing="posix")
    err = info.value
    assert isinstance(err, shmpipe.ShmpipeError) and isinstance(err, FileExistsError) and err.errno == errno.EEXIST
    assert err.names == [a_taken_name] * shm.NAME_TRIES
    assert f"/dev/shm{a_taken_name} already exists" in str(err)
    assert f"{shm.NAME_TRIES} fresh random names tried" in str(err)


@pytest.mark.parametrize("sized", ["at once", "by the first batch"])
def test_a_taken_segment_name_fails_the_pipeline_cleanly(a_taken_name, sized):
    # The same through the API, with the ring made before the producers
    # start (a slot size given) or once the first batch sizes it: the
    # error, and nothing left running (the guard in conftest checks).
    import shmpipe
    from shmpipe.testing.sources import Counter
    from shmpipe.transports.shm import ShmTransport

    slot = {"slot_size": 1 << 16} if sized == "at once" else {}
    with pytest.raises(shmpipe.SegmentExistsError, match="already exists"):
        with shmpipe.from_iterators([Counter(3)] * 2, transport=ShmTransport(backing="posix"), timeout=30, **slot) as pipe:
            list(pipe)


@pytest.mark.parametrize("backing", ["posix", "memfd"])
def test_pages_are_reserved_at_creation_and_touched_where_first_written(backing):
    # Reserved: posix_fallocate gave the memory every block it needs, so a
    # first write never needs room (test_memory fills /dev/shm under a live
    # ring: no SIGBUS). Not touched: the ring is made while the first batch
    # waits, and mapping every page then was most of that wait.
    import ctypes
    import resource

    size = 64 << 20
    if backing == "posix":
        name = _segments.new_segment_name()
        seg = _ring.Segment.create(name, size)
    else:
        seg = _ring.Segment.create_anonymous("test", size)
    try:
        blocks = os.stat(_segments.SHM_DIR + name).st_blocks if backing == "posix" else os.fstat(seg.fd).st_blocks
        assert blocks * 512 >= size, "the memory is reserved whole at creation"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ctypes.memset(seg.address, 1, size)  # the first write to every page
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults >= (size // 4096) // 2, f"only {faults} page faults: the mapping was populated at creation"
    finally:
        seg.unlink()


def test_space_is_reserved_up_front():
    name = _segments.new_segment_name()
    free = os.statvfs(_segments.SHM_DIR).f_bavail * os.statvfs(_segments.SHM_DIR).f_frsize
    with pytest.raises(OSError) as info:
        _ring.Segment.create(name, free + (1 << 30))
    assert info.value.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
    assert not os.path.exists(_segments.SHM_DIR + name), "a failed create must not leave the name"


def test_too_small_dev_shm_is_a_clear_error():
    free = os.statvfs(_segments.SHM_DIR).f_bavail * os.statvfs(_segments.SHM_DIR).f_frsize
    with pytest.raises(SharedMemoryFullError) as info:
        ShmConsumer(ChannelSpec(num_workers=1, capacity=2, slot_size=free, ordered=False, first_pass=0), backing="posix")
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert err.needed > err.available
    assert f"{err.needed:,}" in str(err) and "--shm-size" in str(err)


def _corrupt(name, offset, data):
    fd = os.open(_segments.SHM_DIR + name, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "offset, data, words",
    [
        (0, b"NOTMAGIC", "bad magic"),
        (8, (99).to_bytes(4, "little"), "layout version"),
        (40, (0).to_bytes(4, "little"), "inconsistent"),  # nslots
        (24, (12345).to_bytes(8, "little"), "inconsistent"),  # slot_size
        (32, (1 << 50).to_bytes(8, "little"), "inconsistent"),  # total size
    ],
)
def test_corrupted_header_is_an_error(make_ring, offset, data, words):
    c, _ = make_ring()
    _corrupt(c.handle.name, offset, data)
    with pytest.raises(CorruptChannelError, match=words):
        attach_writer(c.handle, 0)


def test_a_segment_of_someone_else_is_refused(make_ring):
    c, _ = make_ring()
    with pytest.raises(CorruptChannelError, match="belongs to pid"):
        attach_writer(ShmHandle(c.handle.name, c.handle.fd, 1, 1), 0)


def test_a_forked_child_does_not_release_the_parents_slots(tmp_path):
    script = textwrap.dedent(
        """
        import os, numpy as np
        from shmpipe import _ring
        from shmpipe.transport import ChannelSpec
        from shmpipe.transports.shm import ShmConsumer, attach_writer
        c = ShmConsumer(ChannelSpec(num_workers=1, capacity=2, slot_size=8192, ordered=False, first_pass=0))
        w = attach_writer(c.handle, 0); w.start_pass(0)
        w.put({"x": np.arange(3)})
        b = c.get(0, -1, 0, 2.0)
        pid = os.fork()
        if pid == 0:
            del b          # the child's copy of the lease is freed here ...
            os._exit(0)
        os.waitpid(pid, 0)
        print(c.ring.slot_states()[0] == _ring.HELD)   # ... but the slot stays held
        del b
        print(c.ring.slot_states()[0] == _ring.FREE)
        c.close(); c.destroy()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


# -- another process rewrites the live ring ----------------------------------
#
# The segment is writable by every process of the user, so its bytes are
# untrusted input. The geometry is read once at attach and kept private; the
# live words that could index or size memory are checked before use. Each
# scenario runs in its own Python process so that a crash (SIGSEGV, SIGBUS)
# is a failed test, not a dead test runner, and every blocking call in it is
# bounded (`bounded` below; a watchdog alarm kills anything else that hangs).

# Byte offsets (csrc/shmpipe_ring.c: shmp_header, shmp_worker, shmp_slot).
HEADER_FIELDS = {  # name: (offset, width)
    "flags": (12, 4),
    "header_size": (16, 8),
    "slot_size": (24, 8),
    "total_size": (32, 8),
    "nslots": (40, 4),
    "nworkers": (44, 4),
    "quota": (48, 4),
}
#: What another process writes into each: values no valid ring has.
HOSTILE_HEADER = {
    "header_size": 1 << 40,  # the old code: SIGSEGV
    "slot_size": 1 << 30,  # the old code: SIGSEGV
    "total_size": 1 << 50,
    "nslots": 0xFFFFFFFF,
    "nworkers": 0xFFFFFFFF,
    "quota": 0xFFFFFFFF,
    "flags": 0xFFFFFFFF,
}
WORKER_TABLE, WORKER_BYTES, SLOT_BYTES = 256, 64, 64
SLOT_FIELDS = {"worker": (4, 4), "pass": (8, 4), "wseq": (16, 8), "ticket": (24, 8), "nbytes": (32, 8)}

_HOSTILE_PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, threading
    import numpy as np
    signal.alarm(60)  # a hang nothing else catches kills the process (SIGALRM)
    from shmpipe import _ring, _segments
    from shmpipe.errors import CorruptChannelError
    from shmpipe.transport import ChannelSpec
    from shmpipe.transports.shm import ShmConsumer, attach_writer

    WAIT = 2.0

    def bounded(fn, *args, timeout=5.0):
        # fn(*args) in a thread: its result, its exception, or HANG and exit 3.
        out = []
        def run():
            try:
                out.append((True, fn(*args)))
            except BaseException as exc:
                out.append((False, exc))
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            print("HANG", getattr(fn, "__name__", fn), flush=True)
            os._exit(3)
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def poke(name, offset, width, value):
        fd = os.open(_segments.SHM_DIR + name, os.O_RDWR)
        try:
            os.pwrite(fd, (value % (1 << (8 * width))).to_bytes(width, "little"), offset)
        finally:
            os.close(fd)

    def ring(num_workers=2, capacity=4, ordered=False):
        # the named backing: the one any process of the user can open and edit
        c = ShmConsumer(ChannelSpec(num_workers=num_workers, capacity=capacity,
                                    slot_size=8192, ordered=ordered, first_pass=0), backing="posix")
        ws = [attach_writer(c.handle, w) for w in range(num_workers)]
        for w in ws:
            w.start_pass(0)
        return c, ws

    def batch(i):
        return {"i": i, "x": np.full(500, i, np.int64)}

    def check(b, i):
        assert b["i"] == i and b["x"].shape == (500,) and (b["x"] == i).all(), (i, b)

    def run(c, ws, first, count, ordered=False, keep=2):
        # Produce and consume `count` batches, each checked byte for byte,
        # keeping the last `keep` alive so producers go round the ring.
        kept = []
        nw = len(ws)
        for i in range(first, first + count):
            bounded(ws[i % nw].put, batch(i))
            if ordered:
                b = c.get(0, i % nw, i // nw, WAIT)
            else:
                b = c.get(0, -1, 0, WAIT)
            assert b is not _ring.AGAIN, f"batch {i} did not come within {WAIT}s"
            check(b, i)
            kept.append(b)
            del kept[:-keep]
            del b
    """
)


#: test name -> (its scenario's body, from the test's parameters; its timeout)
_SCENARIOS: dict = {}


def scenario(body, timeout=90):
    """Registers the scenario the test runs (`body(**params)`: the code after
    the prelude); the first test of these runs every scenario this session
    runs, in fresh interpreters, three at a time (HOSTILE)."""

    def register(test):
        _SCENARIOS[test.__name__] = (body, timeout)
        return pytest.mark.timeout(600)(test)  # the first waits for all

    return register


def _keys(item):
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return [(item.originalname, tuple(sorted(params.items())))]


def _command(key, folder):
    name, params = key
    body, timeout = _SCENARIOS[name]
    script = _HOSTILE_PRELUDE + textwrap.dedent(body(**dict(params))) + "\nprint('EXIT OK')\n"
    return Command([sys.executable, "-c", script], cwd=folder, timeout=timeout)


HOSTILE = SharedRuns(_SCENARIOS.keys(), keys=_keys, command=_command, jobs=3)


def _run_hostile(request):
    """Runs the test's scenario (see scenario()); its stdout lines, after
    checking it exited normally (a signal is a crash, 3 a hang)."""
    try:
        out, _ = HOSTILE.get(request, _keys(request.node)[0])
    finally:
        _segments.sweep()  # a scenario that died cannot remove its segment
    lines = out.stdout.split("\n")
    if out.returncode < 0:
        import signal

        how = signal.Signals(-out.returncode).name
        pytest.fail(f"the scenario died of {how}; stdout {lines}, stderr {out.stderr[-2000:]}")
    assert out.returncode == 0, f"exit {out.returncode}; stdout {lines}; stderr {out.stderr[-3000:]}"
    assert "EXIT OK" in lines
    return lines


def _geometry_rewrite(field, value, ordered):
    offset, width = HEADER_FIELDS[field]
    return f"""
        ordered = {ordered}
        c, ws = ring(num_workers=2, capacity=4 if not ordered else 3, ordered=ordered)
        run(c, ws, 0, 40, ordered)
        poke(c.handle.name, {offset}, {width}, {value})
        run(c, ws, 40, 200, ordered)
        print("delivered", 240)
        assert (c.ring.nslots, c.ring.nworkers, c.ring.slot_size) == (c.capacity, 2, 8192)
        assert ws[0].ring.slot_size == 8192 and ws[1].ring.nslots == c.capacity
        try:
            attach_writer(c.handle, 0)
        except CorruptChannelError as exc:
            print("attach refused:", exc)
        c.close(); c.destroy()
        """


@scenario(_geometry_rewrite)
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
@pytest.mark.parametrize(
    "field, value",
    list(HOSTILE_HEADER.items()),
)
def test_live_geometry_rewrite_changes_nothing(request, field, value, ordered):
    # A ring in use keeps working from its private geometry, both ends,
    # while the header says something else; a process attaching afterwards
    # refuses the header.
    lines = _run_hostile(request)
    assert "delivered 240" in lines
    assert any(line.startswith("attach refused:") and "inconsistent" in line for line in lines), lines


def _quota_rewrite():
    return """
        c, ws = ring(num_workers=2, capacity=3, ordered=True)
        poke(c.handle.name, 48, 4, 0)
        ws[1].put(batch(1))
        t = threading.Thread(target=ws[1].put, args=(batch(3),), daemon=True)
        t.start()
        t.join(0.5)
        print("second put blocked:", t.is_alive())
        bounded(ws[0].put, batch(0))
        check(c.get(0, 0, 0, WAIT), 0)
        check(c.get(0, 1, 0, WAIT), 1)  # frees worker 1's quota
        t.join(WAIT)
        check(c.get(0, 1, 1, WAIT), 3)
        print("done")
        c.close(); c.destroy()
        """


@scenario(_quota_rewrite)
def test_live_quota_rewrite_keeps_the_private_quota(request):
    # Ordered, 2 workers, 3 slots: quota 1 per worker. Writing quota = 0 (no
    # limit) into the live header must not let worker 1 fill the ring.
    lines = _run_hostile(request)
    assert "second put blocked: True" in lines and "done" in lines


def _slot_record(nworkers, slot, field):
    off, width = SLOT_FIELDS[field]
    return WORKER_TABLE + WORKER_BYTES * nworkers + SLOT_BYTES * slot + off, width


def _garbage_in_a_ready_slot(field, value, ordered, outcome):  # (the outcome is the test's to check)
    return f"""
        import re
        c, ws = ring(num_workers=2, capacity=4, ordered={ordered})
        run(c, ws, 0, 10, {ordered})
        ws[0].put(batch(10))
        slot = c.ring.slot_states().index(_ring.READY)
        base = 256 + 64 * 2 + 64 * slot
        poke(c.handle.name, base + {SLOT_FIELDS[field][0]}, {SLOT_FIELDS[field][1]}, {value})
        try:
            b = c.get(0, 0 if {ordered} else -1, 5, 0.5)
        except CorruptChannelError as exc:
            print("error:", exc)
        else:
            if b is _ring.AGAIN:
                print("nothing")
            else:
                check(b, 10)
                print("delivered")
            del b
        if not {ordered}:
            # The ring goes on: every slot can still be claimed and read.
            run(c, ws, 11, 60)
            print("went on")
        c.close(); c.destroy()
        """


@scenario(_garbage_in_a_ready_slot)
@pytest.mark.parametrize(
    "field, value, ordered, outcome",
    [
        ("worker", 0xFFFFFFFF, False, "error: slot .* names worker 4294967295"),
        ("worker", 7, False, "error: slot .* names worker 7"),
        ("nbytes", 1 << 40, False, "error: slot .* claims 1099511627776 bytes"),
        ("nbytes", 8, False, "error: a slot payload of 8 bytes is too short"),
        ("wseq", 1 << 63, False, "delivered$"),
        ("wseq", 1 << 63, True, "nothing$"),  # the batch it waits for never comes: a timeout
        ("pass", 12345, False, "nothing$"),  # a batch of another pass: dropped
        ("ticket", 1 << 63, False, "delivered$"),
    ],
)
def test_garbage_in_a_ready_slots_record(request, field, value, ordered, outcome):
    # A READY slot's record is rewritten before the consumer takes it; the
    # ring then goes on carrying batches.
    import re

    lines = _run_hostile(request)
    assert any(re.match(outcome, line) for line in lines), lines
    assert ordered or "went on" in lines


def _inflight_count():
    return """
        c, ws = ring(num_workers=2, capacity=3, ordered=True)
        name = c.handle.name
        for i in range(6):  # w0: 0, w1: 0, w0: 1, ...
            bounded(ws[i % 2].put, batch(i))
            if i % 2 == 0:
                poke(name, 256 + 0, 4, 0)  # worker 0's inflight: 1 -> 0
            check(c.get(0, i % 2, i // 2, WAIT), i)
        print("no underflow")
        poke(name, 256 + 64, 4, 0xFFFFFFFF)  # worker 1's inflight
        try:
            bounded(ws[1].put, batch(7))
        except CorruptChannelError as exc:
            print("error:", exc)
        poke(name, 256 + 64, 4, 0)
        bounded(ws[1].put, batch(7))
        check(c.get(0, 1, 3, WAIT), 7)
        print("recovered")
        c.close(); c.destroy()
        """


@scenario(_inflight_count)
def test_garbage_in_a_workers_inflight_count(request):
    # Ordered: 2 workers, 3 slots, quota 1. (a) A count set to 0 while a
    # batch is in flight must not wrap below 0 when the consumer takes it
    # (that would hold the worker at its quota for good); (b) an impossible
    # count is a CorruptChannelError for the producer, not a wait forever.
    lines = _run_hostile(request)
    assert "no underflow" in lines and "recovered" in lines
    assert any(line.startswith("error:") and "impossible value" in line for line in lines), lines


def _live_pipeline():
    fields = ", ".join(repr(HEADER_FIELDS[f] + (v,)) for f, v in HOSTILE_HEADER.items())
    return f"""
        import shmpipe
        from shmpipe.testing.sources import Counter, payload_for
        n, per = 2, 300
        seen = set()
        pokes = [{fields}]
        from shmpipe.transports.shm import ShmTransport
        posix = ShmTransport(backing="posix")
        with shmpipe.from_iterators([Counter(per, shape=(256,))] * n, transport=posix, timeout=20) as pipe:
            for b in pipe:
                want = payload_for(b["worker"], b["seq"], (256,), np.float32)
                assert (b["data"] == want).all()
                seen.add((b["worker"], b["seq"]))
                # Once every producer has attached (a batch from each came),
                # one field per batch; a producer attaching after this would
                # refuse the segment (CorruptChannelError), tested above.
                if pokes and len({{w for w, _ in seen}}) == n:
                    poke(pipe.channel.segment.name, *pokes.pop())
        assert not pokes
        assert len(seen) == n * per, len(seen)
        print("delivered", len(seen))
        """


@scenario(_live_pipeline, timeout=120)
def test_live_pipeline_survives_its_header_being_rewritten(request):
    # A whole pipeline (producer processes) whose ring header is rewritten
    # field by field while batches flow delivers every batch, bit-exact.
    lines = _run_hostile(request)
    assert f"delivered {2 * 300}" in lines


# -- views of reserved arrays kept past their yield ------------------------------


def test_a_view_kept_past_its_yield_guards_the_slot_and_only_then(make_ring):
    """A NumPy view of a reserved array, made before the yield, kept its own
    writable flag: writes through it changed the published batch. Such a
    view is seen (the reservation's root has more references than its
    arrays) and the slot's pages become read-only here until the slot is
    claimed again; with no view, no system call (guards stays 0)."""
    c, (w,) = make_ring(capacity=3, slot_size=1 << 16)
    # The usual ways of filling: through the structure, and through locals
    # holding the arrays themselves (not views): never guarded.
    for i in range(6):
        r = w.reserve({"x": _ring_spec((100,), np.float32)})
        x = r["x"]
        x[:] = i
        w.put(r)
        assert take(c, wseq=i)["x"][0] == i
    assert w.guards == 0
    # A view kept past the yield: guarded at once, and each time the slot
    # holds a batch of ours again while the view lives.
    r = w.reserve({"x": _ring_spec((100,), np.float32)})
    view = r["x"][10:20]
    w.put(r)
    assert w.guards == 1 and not r["x"].flags.writeable and view.flags.writeable
    assert take(c, wseq=6)["x"].shape == (100,)
    del view, r
    # The view is gone: the next batches in that slot are not guarded.
    for i in range(7, 13):
        r = w.reserve({"x": _ring_spec((100,), np.float32)})
        r["x"][:] = i
        w.put(r)
        take(c, wseq=i)
    assert w.guards == 1


WRITES_THROUGH_A_KEPT_VIEW = textwrap.dedent(
    """
    import sys
    import numpy as np
    from shmpipe import ArraySpec
    from shmpipe.transport import ChannelSpec
    from shmpipe.transports.shm import ShmConsumer, attach_writer

    c = ShmConsumer(ChannelSpec(num_workers=1, capacity=3, slot_size=1 << 16, ordered=False, first_pass=0))
    w = attach_writer(c.handle, 0)
    w.start_pass(0)
    r = w.reserve({"x": ArraySpec((1000,), np.int32)})
    r["x"][:] = 7
    view = r["x"][::2]
    w.put(r)
    batch = c.get(0, -1, 0, 2.0)
    print("published", w.guards, int(batch["x"].sum()), flush=True)
    view[0] = -1  # the batch is the consumer's: this must never land
    print("written", int(batch["x"].sum()), flush=True)
    """
)


def test_a_write_through_a_view_kept_past_its_yield_never_reaches_the_batch(tmp_path):
    """The write is a SIGSEGV of the producer (reported as its death by a
    pipeline) instead of a change to a batch the consumer holds."""
    script = tmp_path / "writes.py"
    script.write_text(WRITES_THROUGH_A_KEPT_VIEW)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["published 1 7000"], out.stdout + out.stderr
    assert out.returncode == -11  # SIGSEGV, at the write
