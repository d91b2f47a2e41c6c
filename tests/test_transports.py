"""The transport registry and what the transports say when something is off."""

from __future__ import annotations

import dataclasses
import fcntl
import os
from typing import Any

import numpy as np
import pytest

import shmpipe
from shmpipe import registry
from shmpipe.errors import BatchTypeError, CorruptChannelError
from shmpipe.testing.sources import Counter, Fixed
from shmpipe.transport import Capabilities, ChannelSpec, ProducerControl, Transport
from shmpipe.transports import arrow
from shmpipe.transports.queue import QueueTransport
from shmpipe_example_pipe import PipeConsumer, PipeTransport


@pytest.fixture
def clean_registry():
    before = dict(registry._registered)
    yield
    registry._registered.clear()
    registry._registered.update(before)


def test_available_transports():
    names = shmpipe.available_transports()
    assert {"shm", "arrow", "ray", "queue", "example-pipe"} <= set(names)
    assert names == sorted(names)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(shmpipe.ShmpipeValueError, match="unknown transport 'nope'; known transports: arrow, ") as info:
        shmpipe.get_transport("nope")
    assert isinstance(info.value, ValueError)


class MyQueue(QueueTransport):
    name = "my-queue"


def test_register_use_and_replace(clean_registry):
    shmpipe.register_transport("my-queue", MyQueue)
    assert "my-queue" in shmpipe.available_transports()
    assert shmpipe.get_transport("my-queue") is MyQueue
    with shmpipe.from_iterators([Counter(4)] * 2, transport="my-queue", timeout=30) as pipe:
        assert len([b for b in pipe]) == 8
        assert pipe.stats().transport == "my-queue"
    with pytest.raises(shmpipe.ShmpipeValueError, match="already exists; pass replace=True"):
        shmpipe.register_transport("my-queue", QueueTransport)
    with pytest.raises(shmpipe.ShmpipeValueError, match="already exists"):
        shmpipe.register_transport("shm", MyQueue)  # built-in names too
    with pytest.raises(shmpipe.ShmpipeValueError, match="already exists"):
        shmpipe.register_transport("example-pipe", MyQueue)  # and entry points
    shmpipe.register_transport("my-queue", QueueTransport, replace=True)
    assert shmpipe.get_transport("my-queue") is QueueTransport


def test_register_rejects_what_is_not_a_transport(clean_registry):
    with pytest.raises(shmpipe.ShmpipeTypeError, match="not a subclass"):
        shmpipe.register_transport("x", object)
    with pytest.raises(shmpipe.ShmpipeTypeError, match="non-empty str"):
        shmpipe.register_transport("", MyQueue)
    with pytest.raises(shmpipe.ShmpipeTypeError, match="transport must be a name"):
        shmpipe.from_iterators([Counter(1)], transport=42)


class NeedsSomethingMissing(QueueTransport):
    name = "needs-missing"
    requires = ("a_module_nobody_installed_xyz",)
    extra = "demo"


def test_a_missing_dependency_says_what_to_install(clean_registry):
    shmpipe.register_transport("needs-missing", NeedsSomethingMissing)
    with pytest.raises(shmpipe.TransportUnavailableError, match=r'pip install "shmpipe\[demo\]"') as info:
        shmpipe.from_iterators([Counter(1)], transport="needs-missing")
    assert isinstance(info.value, ImportError)


class OfAPlugin(NeedsSomethingMissing):
    name = "of-a-plugin"
    install = "shmpipe-gpu-plugin[rdma]"


def test_a_plugins_missing_dependency_names_the_plugins_own_package(clean_registry):
    # shmpipe has no extra of a plugin's: "shmpipe[rdma]" would send its users nowhere.
    shmpipe.register_transport("of-a-plugin", OfAPlugin)
    with pytest.raises(shmpipe.TransportUnavailableError, match=r'pip install "shmpipe-gpu-plugin\[rdma\]"$'):
        shmpipe.from_iterators([Counter(1)], transport="of-a-plugin")
    with pytest.raises(shmpipe.TransportUnavailableError, match=r'needs a_module_nobody_installed_xyz, which is not '
                       r'installed: pip install "shmpipe-gpu-plugin\[rdma\]"$'):
        shmpipe.transport.require("a_module_nobody_installed_xyz", transport="of-a-plugin",
                                  install="shmpipe-gpu-plugin[rdma]")


def test_transport_instances_and_classes_are_accepted():
    with shmpipe.from_iterators([Counter(3)], transport=QueueTransport(), timeout=30) as pipe:
        assert len(list(pipe)) == 3
    with shmpipe.from_iterators([Counter(3)], transport=QueueTransport, timeout=30) as pipe:
        assert len(list(pipe)) == 3


def test_capabilities_are_what_callers_ask():
    caps = {name: shmpipe.get_transport(name).capabilities for name in ("shm", "arrow", "ray", "queue")}
    assert caps["shm"].zero_copy_reads and caps["shm"].in_place_writes and caps["shm"].alignment == 64
    assert caps["arrow"].zero_copy_reads and not caps["arrow"].in_place_writes and caps["arrow"].alignment == 64
    assert caps["ray"].cross_host and caps["ray"].own_producers and caps["ray"].zero_copy_min_bytes > 0
    # the queue's frames are the ring's encoding, in a buffer of their own: aligned, not shared
    assert caps["queue"] == Capabilities(serializes=caps["queue"].serializes, checks_batches=True, alignment=64)
    assert "pickle" not in caps["queue"].serializes
    # who checks the batch contract: the encoders of the rings and the queue, and Ray's
    # actors; for any transport that does not say so (the example), shmpipe's producer
    assert all(caps[name].checks_batches for name in ("shm", "arrow", "ray", "queue"))
    assert not PipeTransport.capabilities.checks_batches


class TrustingPipe(PipeTransport):
    """The example transport (pickle through a pipe), claiming to refuse
    bad batches itself, which it does not."""

    name = "trusting-pipe"
    capabilities = dataclasses.replace(PipeTransport.capabilities, checks_batches=True)


def test_a_transport_that_checks_batches_itself_is_taken_at_its_word():
    # The opt-out is real (shm, arrow and the queue's batches are walked
    # once, by their encoder): shmpipe's producer does not check again. A
    # transport that claims it and does not check fails the conformance suite.
    bad = [{"s": {1, 2}}]
    with shmpipe.from_iterators([Fixed(bad)], transport=TrustingPipe(), timeout=30) as pipe:
        assert [b["s"] for b in pipe] == [{1, 2}]
    for transport in (PipeTransport(), QueueTransport()):
        with pytest.raises(BatchTypeError, match=r"^batch\['s'\]: unsupported type builtins.set"):
            with shmpipe.from_iterators([Fixed(bad)], transport=transport, timeout=30) as pipe:
                list(pipe)


class _Misreporting(PipeConsumer):
    """The example's consumer, reporting each batch it returns as `report`'s
    (last_worker, last_nbytes)."""

    def __init__(self, spec: Any, report: tuple[Any, Any]) -> None:
        super().__init__(spec)
        self.report = report

    def get(self, pass_no, worker, wseq, wait):
        got = super().get(pass_no, worker, wseq, wait)
        self.last_worker, self.last_nbytes = self.report
        return got


class Misreports(PipeTransport):
    """The example transport, whose consumer misreports what it returns."""

    name = "misreports"

    def __init__(self, report: tuple[Any, Any]) -> None:
        self.report = report

    def open(self, spec):
        return _Misreporting(spec, self.report)


@pytest.mark.parametrize("report", [(2, 8), (-1, 8), ("0", 8), (True, 8), (0, -5), (0, 1 << 70), (0, 8.0)])
def test_what_a_transports_consumer_reports_of_a_batch_is_checked(report):
    # They index and add up the counters: a worker out of range landed in
    # another counter, a huge size was a raw OverflowError (helper 87).
    with pytest.raises(shmpipe.CorruptChannelError, match=r"_Misreporting reported the batch as worker .*: "
                       r"last_worker must be an int in \[0, 2\) and last_nbytes an int in \[0, 2\*\*48\)"):
        with shmpipe.from_iterators([Counter(3)] * 2, transport=Misreports(report), timeout=30) as pipe:
            list(pipe)
    assert pipe.leftovers() == []


def test_a_transports_consumer_may_report_numpy_integers():
    with shmpipe.from_iterators([Counter(3)], transport=Misreports((np.int64(0), np.uint32(8))), timeout=30) as pipe:
        assert len(list(pipe)) == 3
        assert pipe.stats().bytes == 3 * 8


class _RunsCode:
    """A pickle whose loading would run a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_the_example_transport_loads_no_code_written_into_its_sockets(tmp_path):
    # A process of the user that may trace a producer can take a copy of its
    # socket (pidfd_getfd) and write into it: what comes out is data, never code.
    import multiprocessing
    import pickle
    import struct

    consumer = PipeTransport().open(ChannelSpec(num_workers=1, capacity=2, ordered=False, mp_context=multiprocessing))
    try:
        theirs = consumer.handle.socks[0]
        good = pickle.dumps((0, "batch", {"x": np.arange(3, dtype=">i4")}), protocol=5)
        theirs.sendall(struct.pack("!Q", len(good)) + good)
        batch = consumer.get(0, -1, 0, 5.0)
        assert batch["x"].dtype == np.dtype(">i4") and batch["x"].tolist() == [0, 1, 2]
        marker = tmp_path / "ran"
        evil = pickle.dumps((0, "batch", _RunsCode(marker)), protocol=5)
        theirs.sendall(struct.pack("!Q", len(evil)) + evil)
        with pytest.raises(CorruptChannelError, match="names posix.system"):
            consumer.get(0, -1, 0, 5.0)
        assert not marker.exists()
    finally:
        consumer.destroy()


def test_arrow_bad_batches_and_corrupt_payloads():
    with pytest.raises(BatchTypeError) as info:
        arrow.encode({"x": [1, {"y": object()}]})
    assert info.value.path == "batch['x'][1]['y']"
    with pytest.raises(BatchTypeError, match="dtype"):
        arrow.encode({"o": np.array([None])})
    payload = arrow.encode({"x": np.arange(10)})
    bad = payload.copy()
    bad[:4] = 0
    with pytest.raises(CorruptChannelError):
        arrow.decode(bad)
    bad = payload.copy()
    bad[8:12] = np.frombuffer(b"{{{{", np.uint8)
    with pytest.raises(CorruptChannelError):
        arrow.decode(bad)


def test_a_bad_batch_through_the_arrow_transport_is_a_type_error():
    with pytest.raises(TypeError, match=r"batch\['x'\]") as info:
        with shmpipe.from_iterators([Fixed([{"x": object()}])], transport="arrow", timeout=30) as pipe:
            list(pipe)
    assert isinstance(info.value.__cause__, shmpipe.WorkerError)


class Broken(Transport):
    name = "broken"  # forgets to implement open()


def test_an_incomplete_transport_fails_loudly(clean_registry):
    shmpipe.register_transport("broken", Broken)
    with pytest.raises(TypeError, match="abstract"):
        shmpipe.from_iterators([Counter(1)], transport="broken")


def test_how_many_places_the_consumer_may_hold():
    # Unordered, one free place lets any producer deliver; ordered, the
    # worker the consumer waits for needs a place beyond every other
    # worker's quota: capacity - 1 - (workers - 1) * quota.
    from shmpipe.transport import ChannelSpec

    def may_hold(n, capacity, ordered):
        return ChannelSpec(num_workers=n, capacity=capacity, ordered=ordered).consumer_may_hold

    assert may_hold(4, 6, False) == 5
    assert may_hold(1, 6, True) == 5  # one worker: no quota
    assert may_hold(3, 8, True) == 3  # quota 2: 8 - 1 - 2 * 2
    assert may_hold(3, 31, True) == 10  # quota 10: 31 - 1 - 2 * 10
    assert may_hold(2, 3, True) == 1  # quota 1: 3 - 1 - 1


@pytest.mark.parametrize("transport", ["shm", "arrow"])
def test_delivered_arrays_cannot_be_made_writable(transport):
    # A write would change a slot (or a batch's own memory) under the producers.
    from shmpipe.testing.sources import Shapes

    with shmpipe.from_iterators([Shapes([(64,), (1 << 20,)], np.float32)], transport=transport, timeout=60) as pipe:
        for b in pipe:  # the second is larger than a slot: memory of its own
            for arr in (b["x"], b["x"][1:], b["x"].reshape(-1, 2)):
                with pytest.raises(ValueError):
                    arr.flags.writeable = True
            assert not b["x"].flags.writeable


# -- the queue transport's pipes ---------------------------------------------------


def test_queue_capacity_below_the_number_of_workers():
    # Unordered pipelines share one pool of places: one place, three producers.
    with shmpipe.from_iterators([Counter(30)] * 3, transport="queue", capacity=1, timeout=30) as pipe:
        for _ in range(2):
            assert sorted((b["worker"], b["seq"]) for b in pipe) == [(w, s) for w in range(3) for s in range(30)]


def test_queue_a_new_pass_while_producers_are_half_way_through_a_batch():
    # 1 MiB batches through 64 KiB pipes: while the consumer sleeps, each
    # producer holding a place is blocked half way through writing a batch.
    # A new pass then cancels them; a batch begun is finished (the stream
    # has only whole frames) and dropped, and the next pass is whole.
    import time

    from shmpipe.testing.sources import Shapes, crc_of

    shapes = [(1 << 18,)] * 10  # float32
    with shmpipe.from_iterators([Shapes(shapes)] * 2, transport="queue", capacity=3, timeout=30) as pipe:
        for _ in range(3):
            it = iter(pipe)
            next(it)
            time.sleep(0.3)
        seen = []
        for b in pipe:
            assert crc_of(b["x"]) == int(b["crc"])
            seen.append((b["worker"], b["seq"]))
        assert sorted(seen) == [(w, s) for w in range(2) for s in range(10)]


def test_queue_a_producer_stopped_half_way_through_a_batch_is_a_timeout_that_says_so():
    import os
    import signal
    import time

    from shmpipe.testing.sources import Shapes

    shapes = [(1 << 20,)] * 100  # float32: 4 MiB a batch, a pipe holds 64 KiB
    pipe = shmpipe.from_iterators([Shapes(shapes)], transport="queue", capacity=2, timeout=1.0)
    with pytest.raises(shmpipe.PipelineTimeoutError, match=r"worker 0's next batch is arriving \([\d,]+ of [\d,]+ bytes"):
        with pipe:
            it = iter(pipe)
            next(it)
            time.sleep(0.3)  # the producer blocks half way through writing the next one
            os.kill(pipe.pids[0], signal.SIGSTOP)
            t = time.monotonic()
            try:
                for _ in it:
                    t = time.monotonic()
            finally:
                waited = time.monotonic() - t
    assert 1.0 <= waited < 3.0, f"the timeout came after {waited:.1f} s"


def test_queue_a_malformed_frame_is_a_clear_error():
    import collections
    import os

    from shmpipe.transports.queue import HEADER, MAGIC, _Inbound

    r, w = os.pipe2(os.O_NONBLOCK)
    try:
        box = _Inbound(r, 3)
        arrived: collections.deque = collections.deque()
        os.write(w, HEADER.pack(MAGIC, 2, 7, 0))  # a whole END frame
        box.read(arrived)
        assert list(arrived) == [(3, 2, 7, None)] and box.partial() is None
        os.write(w, HEADER.pack(MAGIC, 1, 7, 10) + b"12345")  # half a batch
        box.read(arrived)
        assert len(arrived) == 1 and box.partial() == (HEADER.size + 5, HEADER.size + 10)
        os.write(w, b"67890" + HEADER.pack(b"JUNK", 1, 7, 10))
        with pytest.raises(CorruptChannelError, match="worker 3's pipe holds a malformed frame header"):
            box.read(arrived)
        assert arrived[-1][:3] == (3, 1, 7) and bytes(arrived[-1][3]) == b"1234567890"
        # The rest of the stream cannot be framed: it stays corrupt (it used
        # to ask the pipe for no bytes next, get 0 and take that for the
        # end of the stream).
        os.write(w, b"more")
        with pytest.raises(CorruptChannelError, match="worker 3's pipe holds a malformed frame header b'JUNK"):
            box.read(arrived)
        assert not box.eof
    finally:
        os.close(r)
        os.close(w)


class Unstoppable(ProducerControl):
    """A producer's control for a QueueProducer driven by hand, with no
    pipeline to cancel its puts."""

    def check(self) -> None:
        pass


def queue_channel(num_workers: int = 1, ordered: bool = False):
    """A queue transport's consumer end, made as a pipeline makes it, with
    no producer started: a test writes into its pipes itself."""
    import multiprocessing

    spec = ChannelSpec(num_workers=num_workers, capacity=4, ordered=ordered,
                       mp_context=multiprocessing.get_context("spawn"))
    return QueueTransport().open(spec)


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_queue_a_corrupt_pipe_stays_corrupt_for_every_get(ordered):
    # A malformed header in worker 1's pipe, after a whole batch. The batch
    # is delivered; then every get() says the stream is corrupt, whether
    # the writer goes on writing, or is gone. (get() used to say it once,
    # then read the pipe as closed: the pipeline waited for a producer that
    # had not died, and blamed it, or timed out.)
    import os

    from shmpipe.transports.queue import HEADER

    consumer = queue_channel(2, ordered)
    try:
        QueueTransport().attach(consumer.handle, 1, Unstoppable()).put({"x": np.arange(10)})
        pipe_w = consumer.handle.pipes[1]
        os.write(pipe_w.fd, HEADER.pack(b"JUNK", 1, 0, 10) + b"0123456789")
        worker = 1 if ordered else -1
        assert consumer.get(0, worker, 0, 5.0)["x"].tolist() == list(range(10))
        expected = r"worker 1's pipe holds a malformed frame header b'JUNK"
        for _ in range(3):
            with pytest.raises(CorruptChannelError, match=expected):
                consumer.get(0, worker, 1, 0.1)
        os.write(pipe_w.fd, b"and more bytes")
        with pytest.raises(CorruptChannelError, match=expected):
            consumer.get(0, worker, 1, 0.1)
        pipe_w.close()  # the last writer of that pipe is gone: still corrupt, not closed
        with pytest.raises(CorruptChannelError, match=expected):
            consumer.get(0, worker, 1, 0.1)
        assert "worker 1's pipe is corrupt" in consumer.describe_wait()
        if ordered:  # a get for the other worker says it too, rather than wait on
            with pytest.raises(CorruptChannelError, match=expected):
                consumer.get(0, 0, 0, 0.1)
    finally:
        consumer.destroy()


class OpensAFile:
    """Pickled, a frame body that runs code in whoever unpickles it: it
    opens (so creates) `path` for writing."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _write_ends(pid: int, inode: int) -> list[str]:
    """/proc/<pid>/fd/<n> of each write end of pipe `inode` that process
    `pid` holds: what any process of this user can open and write into."""
    import os

    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != f"pipe:[{inode}]":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration):
            continue  # closed meanwhile
        if flags & os.O_ACCMODE == os.O_WRONLY:
            found.append(f"/proc/{pid}/fd/{fd}")
    return found


def test_queue_a_frame_another_process_writes_runs_no_code(tmp_path):
    # Issue 20, 1: a process of the same user opens a write end of a
    # producer's pipe through /proc/<pid>/fd (the trainer's own, or the
    # producer's) and writes one small frame whose body is a pickle. The
    # consumer used to unpickle it: the pickle's code ran in the trainer
    # (here it creates a file), and its result came out as a batch. Frames
    # are decoded now, never unpickled: a CorruptChannelError, nothing run.
    import os
    import pickle
    import subprocess
    import sys

    from shmpipe.testing.sources import Sleeper
    from shmpipe.transports.queue import HEADER, KIND_BATCH, MAGIC

    marker = tmp_path / "ran"
    body = pickle.dumps(OpensAFile(str(marker)), protocol=5)
    with shmpipe.from_iterators([Sleeper(60.0)], transport="queue", timeout=30) as pipe:
        it = iter(pipe)
        next(it)  # its producer sleeps now, between two frames
        inode = os.fstat(pipe.channel._inbound[0].fd).st_ino
        ends = _write_ends(os.getpid(), inode) + _write_ends(pipe.pids[0], inode)
        assert ends, "no process holds a write end of the pipe: nothing was tested"
        frame = HEADER.pack(MAGIC, KIND_BATCH, pipe.channel.pass_no, len(body)) + body
        attacker = "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY); os.write(fd, bytes.fromhex(sys.argv[2]))"
        subprocess.run([sys.executable, "-c", attacker, ends[0], frame.hex()], check=True, timeout=60)
        with pytest.raises(CorruptChannelError, match=r"worker 0's pipe holds a malformed batch: .*payload magic"):
            next(it)
    assert not marker.exists(), "the frame's pickle ran in the consumer"


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_queue_the_consumer_keeps_no_write_end_of_the_producers_pipes(start_method):
    # Once its producers have their pipes, the consumer closes its own
    # write ends: a process that opens the trainer's /proc/<pid>/fd finds
    # nothing there to write into (it found one per producer). Each
    # producer still holds its own, and batches flow as before.
    import os

    with shmpipe.from_iterators([Counter(5)] * 2, transport="queue", start_method=start_method, timeout=30) as pipe:
        it = iter(pipe)
        got = [next(it)]
        inodes = [os.fstat(box.fd).st_ino for box in pipe.channel._inbound]
        assert [_write_ends(os.getpid(), inode) for inode in inodes] == [[], []]
        assert all(_write_ends(pid, inode) for pid, inode in zip(pipe.pids, inodes))
        got += list(it)
        assert sorted((int(b["worker"]), int(b["seq"])) for b in got) == [(w, s) for w in range(2) for s in range(5)]
        assert sorted((int(b["worker"]), int(b["seq"])) for b in pipe) == [(w, s) for w in range(2) for s in range(5)]


def _frame(body: bytes, pass_no: int = 0) -> bytes:
    from shmpipe.transports.queue import HEADER, KIND_BATCH, MAGIC

    return HEADER.pack(MAGIC, KIND_BATCH, pass_no, len(body)) + body


@pytest.mark.parametrize("bad", ["a pickle", "garbage", "sizes that disagree", "cut short", "a string past its end"])
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_queue_a_malformed_payload_is_corrupt_for_every_get(tmp_path, bad, ordered):
    # A whole batch, a frame whose payload is not a batch, another whole
    # batch, in worker 1's pipe. The first is delivered; then every get()
    # raises CorruptChannelError, and nothing after the bad frame is
    # delivered. (The body was unpickled: a pickle's code ran and its result
    # came out as a batch, and garbage was an UnpicklingError once, then
    # the stream went on.)
    import os
    import pickle

    from shmpipe import _codec

    marker = tmp_path / "ran"
    payload = bytes(_codec.encode({"x": np.arange(10), "s": "text"}))
    if bad == "a pickle":  # what frames used to hold: unpickled, this one creates a file
        body = pickle.dumps(OpensAFile(str(marker)), protocol=5)
    elif bad == "garbage":
        body = bytes(range(256)) * 4
    elif bad == "sizes that disagree":  # the payload's own length (bytes 8-16) says more than the frame's
        body = payload[:8] + (len(payload) + 64).to_bytes(8, "little") + payload[16:]
    elif bad == "cut short":
        body = payload[:-64]
    else:  # the string's length (u32 after its 's' tag) runs past the structure
        at = payload.index(b"s\x04\x00\x00\x00text")
        body = payload[: at + 1] + (1 << 20).to_bytes(4, "little") + payload[at + 5 :]
    consumer = queue_channel(2, ordered)
    try:
        os.write(consumer.handle.pipes[1].fd, _frame(payload) + _frame(body) + _frame(payload))
        worker = 1 if ordered else -1
        first = consumer.get(0, worker, 0, 5.0)
        assert first["x"].tolist() == list(range(10)) and first["s"] == "text"
        expected = r"worker 1's pipe holds a malformed batch: "
        for _ in range(3):
            with pytest.raises(CorruptChannelError, match=expected):
                consumer.get(0, worker, 1, 0.1)
        os.write(consumer.handle.pipes[1].fd, _frame(payload))  # the pipe is read no more
        with pytest.raises(CorruptChannelError, match=expected):
            consumer.get(0, worker, 1, 0.1)
        if ordered:  # a get for the other worker says it too, rather than wait on
            with pytest.raises(CorruptChannelError, match=expected):
                consumer.get(0, 0, 0, 0.1)
        assert "worker 1's pipe is corrupt" in consumer.describe_wait()
        assert not marker.exists()
    finally:
        consumer.destroy()


def test_queue_a_malformed_payload_in_one_pipe_leaves_the_others_batches():
    # Unordered: worker 0's whole batches are all delivered, before or
    # after the error that worker 1's pipe is corrupt (whichever pipe was
    # read first); worker 1's batch after its bad frame never is.
    import os

    from shmpipe import _codec
    from shmpipe.transport import AGAIN

    def payload(worker, seq):
        return bytes(_codec.encode({"worker": worker, "seq": seq}))

    consumer = queue_channel(2)
    try:
        os.write(consumer.handle.pipes[0].fd, _frame(payload(0, 0)) + _frame(payload(0, 1)))
        os.write(consumer.handle.pipes[1].fd, _frame(b"not a payload at all") + _frame(payload(1, 1)))
        delivered, errors = [], 0
        for _ in range(5):
            try:
                got = consumer.get(0, -1, 0, 0.5)
            except CorruptChannelError as exc:
                assert "worker 1's pipe holds a malformed batch" in str(exc)
                errors += 1
                continue
            assert got is not AGAIN
            delivered.append((got["worker"], got["seq"]))
        assert delivered == [(0, 0), (0, 1)] and errors == 3
    finally:
        consumer.destroy()


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_queue_producers_waiting_for_room_are_counted(ordered):
    import time

    # A consumer slower than its producers: they spend most of the pass
    # waiting for a place (for a token, or for room in their pipe).
    with shmpipe.from_iterators([Counter(200, shape=(1 << 16,))] * 2, transport="queue", capacity=3,
                                ordered=ordered, timeout=30) as pipe:
        it = iter(pipe)
        for _ in range(12):
            next(it)
            time.sleep(0.1)
        blocked = pipe.stats().producer_blocked_s
    assert all(b is not None and b > 0.1 for b in blocked), blocked
    assert sum(blocked) > 0.6, blocked


def test_queue_a_header_no_producer_can_have_written_is_corrupt_at_once():
    # A length beyond MAX_FRAME, an END with a body, an empty batch: an
    # error at once, before any memory is taken for the body. (A header
    # claiming 32 TiB used to be taken at its word: a bytearray of 32 TiB,
    # a MemoryError.)
    import os

    from shmpipe.transports.queue import HEADER, MAGIC, MAX_FRAME

    for header, why in [
        (HEADER.pack(MAGIC, 1, 0, 1 << 45), "a batch of 35,184,372,088,832 bytes: more than any producer can send"),
        (HEADER.pack(MAGIC, 1, 0, MAX_FRAME + 1), f"a batch of {MAX_FRAME + 1:,} bytes: more than any producer can send"),
        (HEADER.pack(MAGIC, 2, 0, 10), "an end of a pass with 10 bytes after it"),
        (HEADER.pack(MAGIC, 1, 0, 0), "an empty batch"),
        (HEADER.pack(MAGIC, 3, 0, 10), "kind 3"),
    ]:
        consumer = queue_channel()
        try:
            os.write(consumer.handle.pipes[0].fd, header)
            with pytest.raises(CorruptChannelError, match=rf"worker 0's pipe holds a malformed frame header .*\({why}\)"):
                consumer.get(0, -1, 0, 5.0)
        finally:
            consumer.destroy()


def test_queue_the_memory_of_a_frame_grows_with_the_bytes_that_arrive():
    # A header claims 512 GiB (within MAX_FRAME: a real producer could
    # send it, on a machine big enough), and a producer process sends
    # 40 MiB of it. get() waits for the rest, holding at most twice what
    # came. (The body used to be allocated whole from the header, before a
    # byte of it came: a MemoryError here, the whole of it committed on a
    # machine with the memory.)
    import subprocess
    import sys
    import time
    import tracemalloc

    from shmpipe.transport import AGAIN
    from shmpipe.transports.queue import HEADER, MAGIC

    sent = 40 << 20
    consumer = queue_channel()
    fd = consumer.handle.pipes[0].fd
    writer = (f"import os; os.set_blocking({fd}, True); "
              f"os.write({fd}, {HEADER.pack(MAGIC, 1, 0, 1 << 39)!r}); os.write({fd}, bytes({sent}))")
    tracemalloc.start()
    child = subprocess.Popen([sys.executable, "-c", writer], pass_fds=[fd])
    try:
        deadline = time.monotonic() + 60
        while f"({HEADER.size + sent:,} of {HEADER.size + (1 << 39):,} bytes so far)" not in consumer.describe_wait():
            assert time.monotonic() < deadline, consumer.describe_wait()
            assert consumer.get(0, -1, 0, 0.1) is AGAIN
        assert child.wait(timeout=30) == 0
        assert consumer.get(0, -1, 0, 0.1) is AGAIN  # and it waits on
        held, peak = tracemalloc.get_traced_memory()
        assert peak < 2 * sent + (4 << 20), f"{peak:,} bytes for {sent:,} arrived"
    finally:
        tracemalloc.stop()
        child.kill()  # on a failure, blocked writing into a pipe no one reads
        child.wait(timeout=30)
        consumer.destroy()


def test_queue_frames_of_several_pieces_arrive_whole():
    # Bodies of one piece and of several, around the first piece's size,
    # sent by a producer process through a real pipe: each arrives byte for
    # byte, in pieces that grow (1, 1, 2 MiB...) with what arrived, and is
    # handed to the decoder in one 64-byte aligned buffer.
    import collections
    import random
    import subprocess
    import sys
    import time

    from shmpipe.transports.queue import FIRST_PIECE, HEADER, MAGIC, _Inbound, _Pieces

    sizes = [1, FIRST_PIECE - 1, FIRST_PIECE, FIRST_PIECE + 1, 5 * FIRST_PIECE + 12345]
    consumer = queue_channel()  # for its pipe
    fd = consumer.handle.pipes[0].fd
    writer = (f"import os, random; os.set_blocking({fd}, True)\n"
              f"for n in {sizes!r}:\n"
              f"    os.write({fd}, {HEADER.pack(MAGIC, 1, 0, 0)[:-8]!r} + n.to_bytes(8, 'little'))\n"
              f"    os.write({fd}, random.Random(n).randbytes(n))\n")
    box = _Inbound(consumer._inbound[0].fd, 0)
    arrived: collections.deque = collections.deque()
    child = subprocess.Popen([sys.executable, "-c", writer], pass_fds=[fd])
    try:
        deadline = time.monotonic() + 60
        while len(arrived) < len(sizes):
            assert time.monotonic() < deadline, box.partial()
            box.read(arrived)
            time.sleep(0.001)
        assert child.wait(timeout=30) == 0
        for n, (worker, kind, pass_no, body) in zip(sizes, arrived):
            assert (worker, kind, pass_no) == (0, 1, 0)
            assert isinstance(body, np.ndarray if n <= FIRST_PIECE else _Pieces)
            if n == sizes[-1]:
                assert [len(p) for p in body.pieces] == [FIRST_PIECE, FIRST_PIECE, 2 * FIRST_PIECE, FIRST_PIECE + 12345]
            data = body if isinstance(body, np.ndarray) else body.whole()
            assert data.ctypes.data % 64 == 0 and data.dtype == np.uint8
            assert bytes(data) == random.Random(n).randbytes(n), n
            if isinstance(body, _Pieces):
                assert not body.pieces  # each let go of once copied
    finally:
        child.kill()  # on a failure, perhaps blocked writing into a pipe no one reads
        child.wait(timeout=30)
        consumer.destroy()


def test_queue_batches_larger_than_a_piece_round_trip():
    # Joined from their pieces into one aligned buffer, decoded in place:
    # bit-exact, aligned, and writable (each batch's buffer is its own).
    from shmpipe.testing.sources import Shapes, crc_of
    from shmpipe.transports.queue import FIRST_PIECE

    shapes = [(FIRST_PIECE * 10 + 3,), (16,), (FIRST_PIECE // 4 + 1,)]  # float32: 40 MiB in 7 pieces, 1, 2
    with shmpipe.from_iterators([Shapes(shapes)] * 2, transport="queue", timeout=60) as pipe:
        got = sorted(
            (int(b["worker"]), int(b["seq"]), b["x"].shape, crc_of(b["x"]) == int(b["crc"]),
             b["x"].ctypes.data % 64, b["x"].flags.writeable)
            for b in pipe
        )
    assert got == [(w, s, shape, True, 0, True) for w in range(2) for s, shape in enumerate(shapes)]


@pytest.mark.parametrize("stream", ["small frames", "one huge frame"])
def test_queue_a_get_keeps_its_deadline_while_a_fast_writer_keeps_the_pipe_full(stream):
    # A producer process writes for 4 s, as fast as the consumer reads or
    # faster: ends of passes no one reads (two readv calls a frame for the
    # consumer: the writer is far ahead), or one frame of 256 GiB through
    # the largest pipe allowed (a writer that never sleeps). get(wait=0.1)
    # returns on time all the same. (A read took everything the pipe had
    # until it found it empty: with small frames, until the writer stopped,
    # 4 s; with the huge frame, whenever the writer fell behind once.)
    import fcntl
    import select
    import subprocess
    import sys
    import time

    from shmpipe.transport import AGAIN
    from shmpipe.transports.queue import HEADER, MAGIC

    consumer = queue_channel()
    fd = consumer.handle.pipes[0].fd
    if stream == "small frames":
        writer = (f"import os, time; os.set_blocking({fd}, True); frames = {HEADER.pack(MAGIC, 2, 9, 0)!r} * 4096\n"
                  f"end = time.monotonic() + 4\n"
                  f"while time.monotonic() < end: os.write({fd}, frames)\n")
    else:
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)  # the most an unprivileged process may ask for
        except OSError:
            pass
        writer = (f"import os, time; os.set_blocking({fd}, True); os.write({fd}, {HEADER.pack(MAGIC, 1, 0, 1 << 38)!r})\n"
                  f"os.set_blocking({fd}, False); body = bytes(1 << 20); end = time.monotonic() + 4\n"
                  f"while time.monotonic() < end:\n"
                  f"    try: os.write({fd}, body)\n"
                  f"    except BlockingIOError: pass\n")
    child = subprocess.Popen([sys.executable, "-c", writer], pass_fds=[fd])
    try:
        assert select.select([consumer._inbound[0].fd], [], [], 30)[0], "the writer never began"
        took = []
        for _ in range(5):
            t = time.monotonic()
            assert consumer.get(0, -1, 0, 0.1) is AGAIN
            took.append(time.monotonic() - t)
        assert max(took) < 0.1 + 0.3, took
        assert child.poll() is None, "the writer stopped before the gets were done: nothing was tested"
    finally:
        child.kill()
        child.wait(timeout=30)
        consumer.destroy()


def test_a_queue_channel_closed_after_its_destroy_writes_to_no_descriptor():
    """A shutdown cut by a signal handler's exception runs again (the
    stream's finalizer is owed again), and may close a channel it had
    destroyed: the queue's close() wrote its wake byte to the descriptor
    number destroy() had closed, by then perhaps another file's (helper 72,
    on 6f1cab7). Here that number is given to a pipe of the test's."""
    pipe = shmpipe.from_iterators([Counter(2, (8,))], transport="queue", timeout=30, start_method="fork")
    assert len(list(pipe)) == 2
    channel = pipe._launcher.channel
    assert channel is not None
    pipe.close()  # destroys it
    r, w = os.pipe()
    try:
        os.dup2(w, channel._wake_w)  # the closed number, now this pipe's
        fcntl.fcntl(r, fcntl.F_SETFL, os.O_NONBLOCK)
        channel.close()
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
    finally:
        os.close(channel._wake_w)
        os.close(r)
        os.close(w)


def test_a_queue_channel_destroy_cut_as_its_lock_is_taken_leaves_the_lock_free():
    """destroy() took the channel's I/O lock with a timeout and then entered
    the try that releases it: a signal handler's exception raised as
    acquire() returned (Python checks there) left the lock held, and every
    get() of another thread waited on it for good. A profile hook raises at
    that very check; another thread takes the lock within a second."""
    import sys
    import threading

    pipe = shmpipe.from_iterators([Counter(2, (8,))], transport="queue", timeout=30, start_method="fork")
    try:
        assert len(list(pipe)) == 2
        channel = pipe._launcher.channel
        io = channel._io
        cut: list[bool] = []

        def hook(frame, event, arg):
            if event == "c_return" and getattr(arg, "__self__", None) is io and arg.__name__ == "acquire" and not cut:
                cut.append(True)
                raise KeyboardInterrupt

        sys.setprofile(hook)
        try:
            channel.destroy()
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        got: list[bool] = []

        def take() -> None:
            got.append(io.acquire(timeout=1.0))
            if got[-1]:
                io.release()

        other = threading.Thread(target=take)
        other.start()
        other.join(10)
        assert got == [True], f"the channel's I/O lock was left held ({cut})"
    finally:
        pipe.close()
