"""The test suite every transport must pass.

shmpipe runs it against each of its transports, and a plugin author runs it
against theirs: subclass :class:`TransportConformance` in a pytest module and
give it a ``transport`` fixture (a name, a Transport class or an instance)::

    import pytest
    from shmpipe.testing.conformance import TransportConformance

    class TestMyTransport(TransportConformance):
        @pytest.fixture
        def transport(self):
            return "mytransport"

Every test runs real producer processes (or whatever the transport runs)
through ``shmpipe.from_iterators``. A transport skips a test only where its
capabilities say the test does not apply (no zero-copy claim, no zero-copy
test); there is no other way to opt out.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmpipe
from shmpipe import _process
from shmpipe._options import Source
from shmpipe._tree import leaves
from shmpipe.registry import resolve_transport
from shmpipe.testing.assertions import assert_same
from shmpipe.testing.memory import channel_descriptors, named_segments, ring_descriptors
from shmpipe.testing.sources import (
    Counter,
    Drawing,
    Fixed,
    Killer,
    Matrix,
    NotRebuiltElsewhere,
    Progress,
    Raiser,
    RaisesShardError,
    Reserver,
    Shapes,
    Sleeper,
    Stamped,
    payload_for,
    produced,
)
from shmpipe.transport import Capabilities, ConsumerEnd, Transport, check_batch

__all__ = ["TransportConformance"]

#: What a ``transport`` fixture may give: a name, a Transport class or an instance.
TransportArg = str | type[Transport] | Transport


def _our_memory(prefixes: tuple[str, ...] = ()) -> set[str]:
    """shmpipe's named segments in /dev/shm, the entries there whose names
    begin with one of `prefixes` (a transport's own), and this process's
    descriptors of anonymous ring memory."""
    descriptors = {f"fd {fd} -> {target}" for fd, target in ring_descriptors().items()}
    return named_segments() | named_segments(prefixes) | descriptors


def _bounded_by_pytest_timeout(request: pytest.FixtureRequest) -> bool:
    """Whether pytest-timeout ends this test if it runs too long: its
    marker, else the command line, PYTEST_TIMEOUT, the ini file (the order
    pytest-timeout reads them in)."""
    config = request.config
    if not config.pluginmanager.hasplugin("timeout"):
        return False
    marker = request.node.get_closest_marker("timeout")
    reads: list[Callable[[], Any]] = [lambda: config.getoption("timeout"), lambda: os.environ.get("PYTEST_TIMEOUT"),
                                      lambda: config.getini("timeout")]
    if marker is not None:
        reads.insert(0, lambda: marker.kwargs.get("timeout", marker.args[0] if marker.args else None))
    for read in reads:
        try:
            value = read()
        except ValueError:  # (an option or ini value the plugin did not declare)
            continue
        if value not in (None, ""):
            try:
                return float(value) > 0
            except (TypeError, ValueError):
                return False
    return False


def _kinds(descriptors: dict[int, str]) -> collections.Counter[str]:
    """How many descriptors of each kind (socket, pipe, memfd, /dev/shm file,
    each kind of anonymous inode)."""
    def kind(target: str) -> str:
        if target.startswith(("socket:", "pipe:")):
            return target.partition(":")[0]
        if target.startswith("/memfd:"):
            return "memfd"
        return "/dev/shm file" if target.startswith("/dev/shm/") else target  # anon_inode:[eventfd], ...

    return collections.Counter(kind(t) for t in descriptors.values())


def _more_than(before: dict[int, str], settle: float = 10.0) -> dict[str, int]:
    """How many more descriptors of each kind a transport opens this process
    holds now than in `before`, once that stays so: one another thread holds
    for a moment (a test harness starting a process), or that another
    process's end lets go of in its time (Ray's connections to an actor it
    killed), is gone within `settle` seconds; one left open is not."""
    deadline = time.monotonic() + settle
    while True:
        more = dict(_kinds(channel_descriptors()) - _kinds(before))
        if not more or time.monotonic() > deadline:
            return more
        time.sleep(0.1)


def _in_ranges(arr: np.ndarray, ranges: list[tuple[int, int]]) -> bool:
    lo = arr.__array_interface__["data"][0]
    return any(start <= lo and lo + arr.nbytes <= start + size for start, size in ranges)


def _channel(pipe: shmpipe.Pipeline) -> ConsumerEnd:
    channel = pipe.channel
    assert channel is not None, "the pipeline has delivered a batch, so its channel is open"
    return channel


def _arrays(batch: Any) -> list[np.ndarray]:
    return [leaf for leaf in leaves(batch) if isinstance(leaf, np.ndarray)]


class NotALeaf:
    """A user's own object: no transport may carry it (at module level, so
    a source holding one pickles to any producer)."""


#: What a batch may not hold, put at ``batch['x'][2]``: (id, value, the path
#: the error names, words of its message).
BAD_LEAVES = [
    ("set", {1, 2}, "batch['x'][2]", "unsupported type builtins.set"),
    ("object", object(), "batch['x'][2]", "unsupported type builtins.object"),
    ("object-array", np.array([1, None], dtype=object), "batch['x'][2]", "cannot be carried"),
    ("int-key", {"ok": np.zeros(2), 7: np.zeros(2)}, "batch['x'][2][7]", "dict keys must be str, not int"),
    ("custom-object", NotALeaf(), "batch['x'][2]", f"unsupported type {__name__}.NotALeaf"),
]


class TransportConformance:
    """Subclass and provide a ``transport`` fixture (see the module doc)."""

    #: seconds the consumer waits for any one batch before the test fails
    timeout = 60.0
    #: How the names of the /dev/shm entries your transport makes begin (its
    #: own segments, beside shmpipe's): the clean-up test fails where close()
    #: leaves one. Without it, only shmpipe's own names are looked for there
    #: (an entry of another process cannot be told from a leak by name).
    shm_prefixes: tuple[str, ...] = ()

    #: Seconds a test may run in all where pytest-timeout does not bound it
    #: (it is not installed, or set to 0): a transport whose wait ignores its
    #: `wait` fails a test then, where it would hang the run.
    test_deadline = 300.0

    @pytest.fixture
    def transport(self) -> TransportArg:
        raise NotImplementedError("give the subclass a `transport` fixture")

    @pytest.fixture(autouse=True)
    def _a_hang_is_a_failure(self, request: pytest.FixtureRequest) -> Iterator[None]:
        """Ends a test at `test_deadline` with a failure that says so (a
        SIGALRM, which interrupts the wait of the main thread), unless
        pytest-timeout bounds it already (it may use the same signal)."""
        if (_bounded_by_pytest_timeout(request) or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, signal.SIG_IGN, None)):
            yield
            return
        deadline = self.test_deadline

        def expired(signum: int, frame: Any) -> None:
            pytest.fail(f"the test ran past TransportConformance.test_deadline ({deadline:g} s): does the "
                        "transport's ConsumerEnd.get wait past its `wait`?")

        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, deadline)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def pipe(self, transport: TransportArg, sources: Sequence[Source], **options: Any) -> shmpipe.Pipeline:
        options.setdefault("timeout", self.timeout)
        return shmpipe.from_iterators(sources, transport=transport, **options)

    @staticmethod
    def caps(transport: TransportArg) -> Capabilities:
        return resolve_transport(transport).capabilities

    # -- what arrives --------------------------------------------------------

    def test_round_trip_matrix_bit_exact(self, transport: TransportArg) -> None:
        from shmpipe.testing.batches import matrix  # (see test_alignment)

        want = [b for _, b in matrix()]
        with self.pipe(transport, [Matrix()], ordered=True) as pipe:
            got = 0
            for batch, expected in zip(pipe, want, strict=False):  # a count below says if one ran short
                assert_same(batch, expected)
                got += 1
        assert got == len(want)

    @pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
    def test_every_batch_exactly_once(self, transport: TransportArg, ordered: bool) -> None:
        n, per = 3, 25
        with self.pipe(transport, [Counter(per, shape=(64,))] * n, ordered=ordered) as pipe:
            seen = []
            for b in pipe:
                np.testing.assert_array_equal(b["data"], payload_for(b["worker"], b["seq"], (64,)))
                assert float(b["data"].astype(np.float64).sum()) == b["checksum"]
                seen.append((b["worker"], b["seq"]))
            stats = pipe.stats()
        assert sorted(seen) == [(w, s) for w in range(n) for s in range(per)]
        if ordered:
            assert seen == [(w, s) for s in range(per) for w in range(n)]
        else:  # each worker's batches still come in the order it made them
            for w in range(n):
                assert [s for ww, s in seen if ww == w] == list(range(per))
        assert stats.batches == n * per and stats.per_worker_batches == (per,) * n

    def test_batches_at_the_edge_of_the_contract(self, transport: TransportArg) -> None:
        # Whole batches that are a bare None, empty, a zero or arrays with a
        # 0-length axis: each is a batch (a transport whose "nothing came"
        # is None must not take a None batch for it).
        edge = [None, {}, [], (), 0, "", b"", np.zeros((0, 5), np.float32), np.float64(-0.0), None]
        edge += [{"x": None, "y": [np.zeros((3, 0, 2), np.int8), ()]}]
        with self.pipe(transport, [Fixed(edge)]) as pipe:
            got = list(pipe)
        assert len(got) == len(edge), f"{len(got)} of {len(edge)} batches came: {got!r}"
        for batch, want in zip(got, edge, strict=True):
            assert_same(batch, want)

    def test_ordered_skips_exhausted_workers(self, transport: TransportArg) -> None:
        with self.pipe(transport, [Counter(3), Counter(5), Counter(1)], ordered=True) as pipe:
            seen = [(b["worker"], b["seq"]) for b in pipe]
        assert seen == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (1, 4)]

    def test_end_of_stream_and_new_passes(self, transport: TransportArg) -> None:
        with self.pipe(transport, [Counter(6)] * 2) as pipe:
            for _ in range(2):
                assert sorted((b["worker"], b["seq"]) for b in pipe) == [(w, s) for w in range(2) for s in range(6)]
            it = iter(pipe)
            next(it)  # abandon this pass after one batch
            assert sorted((b["worker"], b["seq"]) for b in pipe) == [(w, s) for w in range(2) for s in range(6)]
        with self.pipe(transport, [Fixed([])] * 2) as pipe:
            assert list(pipe) == [] and list(pipe) == []

    def test_a_pass_given_up_or_resumed_changes_nothing_of_the_next(self, transport: TransportArg) -> None:
        """A source's pass is entered afresh (its work, get_worker_info(), the
        seeded generators) whatever the pass before it still does: a pass left
        after a few batches, or one begun and replaced by a resumed one
        (load_state_dict), leaves the next pass's batches and draws those of
        an uninterrupted run."""

        def key(b: Any) -> tuple[int, ...]:
            return int(b["worker"]), int(b["seq"]), int(b["epoch"]), int(b["draw"])

        sources = [Drawing(8, delay=0.02)] * 2
        with self.pipe(transport, sources, ordered=True, seed=3) as pipe:
            whole = [[key(b) for b in pipe] for _ in range(2)]
        with self.pipe(transport, sources, ordered=True, seed=3) as pipe:
            it = iter(pipe)
            taken = [key(next(it)) for _ in range(5)]
            state = pipe.state_dict()
            del it  # left in the middle of its sources' batches
            assert taken == whole[0][:5]
            got = [key(b) for b in pipe]
            assert got == whole[1], f"the pass after one left early differs: {got} != {whole[1]}"
        with self.pipe(transport, sources, ordered=True, seed=3) as pipe:
            pipe.load_state_dict(state)
            rest = [key(b) for b in pipe]
            assert taken + rest == whole[0], f"resumed after 5 batches: {taken} + {rest} != {whole[0]}"
            assert [key(b) for b in pipe] == whole[1]

    def test_reserve_gives_correct_batches(self, transport: TransportArg) -> None:
        with self.pipe(transport, [Reserver(10, shape=(128,))] * 2) as pipe:
            seen = []
            for b in pipe:
                np.testing.assert_array_equal(b["data"], np.full(128, b["seq"] + 1000 * b["worker"], np.float32))
                seen.append((b["worker"], b["seq"]))
        assert sorted(seen) == [(w, s) for w in range(2) for s in range(10)]

    # -- bounds --------------------------------------------------------------

    def test_backpressure_bounds_batches_in_flight(self, transport: TransportArg, tmp_path: Path) -> None:
        n, capacity = 2, 4
        with self.pipe(transport, [Progress(500, str(tmp_path))] * n, capacity=capacity) as pipe:
            it = iter(pipe)
            delivered = 0
            for _ in range(3):
                next(it)
                delivered += 1
                # Producers run ahead as far as the channel lets them: until
                # as many are in flight as the bound allows (within 10 ms on
                # every built-in transport) or for 0.5 s, then 0.1 s more, in
                # which producers that ignored the bound would go past it.
                deadline = time.monotonic() + 0.5
                while produced(str(tmp_path), n) - delivered < capacity + n and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.1)
                made = produced(str(tmp_path), n)
                # in flight (made, not yet delivered) is at most capacity, plus
                # the one batch each producer holds while it waits for room
                assert made - delivered <= capacity + n, (
                    f"{made} batches made, {delivered} delivered, capacity {capacity}"
                )
            assert made >= delivered + 1, "producers did not run ahead at all"

    def test_held_batches_never_change(self, transport: TransportArg) -> None:
        kept = []
        with self.pipe(transport, [Stamped(60, shape=(2048,))] * 2, capacity=6) as pipe:
            for b in pipe:
                kept.append(b)
                if len(kept) > 2:  # keep a window while the producers write on
                    del kept[0]
                for k in kept:
                    assert np.all(k["data"] == k["stamp"])
            for k in kept:
                assert np.all(k["data"] == k["stamp"])

    # -- failures ------------------------------------------------------------

    @pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
    def test_producer_exception(self, transport: TransportArg, ordered: bool) -> None:
        # The healthy worker is slow, so in ordered mode the failing worker's
        # batches queue up behind its turns. Unordered, they must all be
        # delivered; ordered, the pass ends at the first batch missing (the
        # slow worker's, stopped by the failure): what came is a prefix of
        # the ordered sequence, with nothing after a gap.
        pipe = self.pipe(transport, [Raiser(3, only_worker=1, delay=0.3)] * 2, ordered=ordered)
        seen = []
        with pytest.raises(shmpipe.WorkerError) as info:
            with pipe:
                for b in pipe:
                    seen.append((int(b["worker"]), int(b["seq"])))
        err = info.value
        assert err.worker_id == 1
        assert err.exc_type == "builtins.ValueError" and "boom from the source" in str(err)
        assert "raise self.exc_type(self.message)" in err.remote_traceback
        if ordered:
            assert seen == [(k % 2, k // 2) for k in range(len(seen))], f"not a prefix of the order: {seen}"
            assert len(seen) <= 7, "worker 1 published three batches, no more"
        else:
            assert [s for w, s in seen if w == 1] == [0, 1, 2], "batches yielded before the error were lost"
        assert pipe.closed

    def test_an_exception_the_trainer_cannot_unpickle_is_still_the_producers_error(
        self, transport: TransportArg
    ) -> None:
        # A ShardError's __init__ takes other arguments than its args: the
        # trainer cannot rebuild it. Still a WorkerError naming the worker
        # (Ray's UnserializableException came through as itself, helper 94).
        pipe = self.pipe(transport, [RaisesShardError(2, only_worker=0)])
        seen = 0
        with pytest.raises(shmpipe.WorkerError) as info:
            with pipe:
                for _ in pipe:
                    seen += 1
        assert info.value.worker_id == 0 and seen == 2, (info.value, seen)
        assert pipe.closed

    def test_a_source_its_producer_cannot_rebuild_is_the_producers_error(self, transport: TransportArg) -> None:
        # Its module missing where the producer runs (another node): the
        # unpickling fails there. A WorkerError (a WorkerDiedError where the
        # producer's process ended with it) naming the worker and the cause,
        # from the constructor or the first batch (Ray's ActorDiedError came
        # through as itself, helper 94).
        try:
            with self.pipe(transport, [NotRebuiltElsewhere(3)]) as pipe:
                list(pipe)
        except shmpipe.WorkerError as exc:
            assert exc.worker_id == 0 and "missing_on_this_node" in str(exc), exc
        else:  # (a transport whose producers get the source without unpickling it: forked, or in this process)
            pytest.skip("the transport's producers had the source without unpickling it")

    @pytest.mark.parametrize("bad", BAD_LEAVES, ids=[b[0] for b in BAD_LEAVES])
    def test_a_bad_batch_is_refused_with_its_path(self, transport: TransportArg, bad: tuple[Any, ...]) -> None:
        # The batch contract is every transport's: the same error, the same
        # path, the same words, after the good batches put before it.
        _, leaf, path, words = bad
        good = {"x": [np.arange(6, dtype=np.int32), "two", np.ones(3, np.float32)], "y": 1.5}
        batch = {"x": [np.arange(6, dtype=np.int32), "two", leaf], "y": 1.5}
        with pytest.raises(shmpipe.BatchTypeError) as expected:
            check_batch(batch)
        pipe = self.pipe(transport, [Fixed([good, good, batch, good])], ordered=True)
        delivered = 0
        with pytest.raises(shmpipe.BatchTypeError) as info:
            with pipe:
                for b in pipe:
                    assert_same(b, good)
                    delivered += 1
        err = info.value
        assert delivered == 2, "the batches put before the bad one were not all delivered"
        assert err.path == path and words in err.message
        assert str(err) == str(expected.value), "not the error the batch contract gives"
        cause = err.__cause__  # says which worker, as for any producer's error
        assert isinstance(cause, shmpipe.WorkerError) and cause.worker_id == 0
        assert cause.exc_type == "shmpipe.errors.BatchTypeError" and path in cause.message
        assert pipe.closed

    def test_a_bad_first_batch_is_refused_with_its_path(self, transport: TransportArg) -> None:
        # Before any batch has gone through (a channel sized by its first
        # batch does not exist yet).
        with pytest.raises(shmpipe.BatchTypeError) as info:
            with self.pipe(transport, [Fixed([(np.zeros(2), {1, 2})])]) as pipe:
                for _ in pipe:
                    pass
        assert info.value.path == "batch[1]" and "builtins.set" in info.value.message
        assert isinstance(info.value.__cause__, shmpipe.WorkerError)

    def test_producer_death(self, transport: TransportArg) -> None:
        with pytest.raises(shmpipe.WorkerDiedError) as info:
            with self.pipe(transport, [Killer(2, signal.SIGKILL, only_worker=0)] * 2) as pipe:
                for _ in pipe:
                    pass
        assert info.value.worker_id == 0
        assert pipe.closed

    def test_producer_death_half_way_through_a_batch(self, transport: TransportArg) -> None:
        # The producer is killed while it puts a 16 MiB batch the consumer
        # is not reading yet (more than any pipe or socket buffers): what it
        # wrote of it must not hold the consumer, past the timeout or at all.
        caps = self.caps(transport)
        if caps.cross_host:
            pytest.skip("the producers may run on other machines: no pid to kill")
        shapes: list[tuple[int, ...]] = [(1 << 22,)] * 1000  # float32: 16 MiB a batch
        with pytest.raises((shmpipe.WorkerDiedError, shmpipe.PipelineTimeoutError)) as info:
            with self.pipe(transport, [Shapes(shapes, np.float32)], capacity=2, timeout=10) as pipe:
                for i, _ in enumerate(pipe):
                    if i == 1:
                        time.sleep(0.5)  # the producer is in put(), blocked
                        pid = pipe.pids[0]
                        assert pid is not None
                        os.kill(pid, signal.SIGKILL)
                        killed = time.monotonic()
        waited = time.monotonic() - killed
        assert isinstance(info.value, shmpipe.WorkerDiedError), f"the death was not seen: {info.value}"
        assert waited < 5.0, f"the death was seen {waited:.1f} s after the kill"

    def test_close_from_another_thread_ends_a_wait(self, transport: TransportArg) -> None:
        # close() while the consumer's thread waits in get(): the wait ends
        # in PipelineClosedError, never in what the transport's destroy()
        # would make a read under it raise (a closed descriptor's OSError).
        pipe = self.pipe(transport, [Sleeper(60.0)] * 2, timeout=30)
        outcome: list[BaseException | None] = []
        taken = threading.Semaphore(0)

        def consume() -> None:
            try:
                for _ in pipe:
                    taken.release()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - what the wait ended in is the test's
                outcome.append(exc)

        with pipe:
            reader = threading.Thread(target=consume)
            reader.start()
            # Each producer's one batch taken, then nothing for a minute:
            # the reader waits in get() (a moment after its last take).
            assert taken.acquire(timeout=30) and taken.acquire(timeout=30), "no first batches within 30 s"
            time.sleep(0.1)
            t0 = time.monotonic()
            pipe.close()
            reader.join(10)
        assert not reader.is_alive(), "the wait went on after close()"
        assert len(outcome) == 1 and isinstance(outcome[0], shmpipe.PipelineClosedError), outcome
        assert time.monotonic() - t0 < 10
        assert pipe.leftovers() == []

    # -- clean-up --------------------------------------------------------------

    def test_close_leaves_nothing_behind_and_keeps_delivered_batches(self, transport: TransportArg) -> None:
        before = _our_memory(self.shm_prefixes)
        pipe = self.pipe(transport, [Counter(100, shape=(1000,))] * 2, capacity=6)
        it = iter(pipe)
        kept = [next(it) for _ in range(3)]
        pids = [p for p in pipe.pids if p is not None]
        pipe.close()
        assert pipe.leftovers() == []
        if not self.caps(transport).cross_host:
            deadline = time.monotonic() + 10
            while any(_process.process_start_time(p) is not None for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(_process.process_start_time(p) is None for p in pids), "producers outlived close()"
        left = _our_memory(self.shm_prefixes) - before
        assert left == set(), f"close() left shared memory behind: {sorted(left)[:8]}"
        for b in kept:  # batches delivered before close stay valid
            np.testing.assert_array_equal(b["data"], payload_for(b["worker"], b["seq"], (1000,)))

    def test_passes_and_pipelines_give_back_their_descriptors(self, transport: TransportArg) -> None:
        """What a transport opens for a pass or for a pipeline, it closes:
        after five more passes this process holds no more descriptors of any
        kind a transport opens (sockets, pipes, memory, anonymous inodes:
        shmpipe.testing.memory.channel_descriptors) than after one, and after
        close() no more than before the pipeline was made (after a first
        pipeline, for what a process opens once and keeps: the connection to
        shmpipe's fork server, say)."""
        with self.pipe(transport, [Counter(3)] * 2) as pipe:
            assert len(list(pipe)) == 6
        before = channel_descriptors()
        with self.pipe(transport, [Counter(3)] * 2) as pipe:
            assert len(list(pipe)) == 6
            after_one = channel_descriptors()
            for _ in range(5):
                assert len(list(pipe)) == 6
            more = _more_than(after_one)
            assert not more, f"5 more passes left more descriptors open, of each kind: {more}"
        assert pipe.leftovers() == []  # (which waits for what runs elsewhere to end)
        more = _more_than(before)
        assert not more, f"a pipeline closed left more descriptors open than before it, of each kind: {more}"

    # -- what the capabilities claim -----------------------------------------

    def test_zero_copy_reads(self, transport: TransportArg) -> None:
        caps = self.caps(transport)
        if not caps.zero_copy_reads:
            pytest.skip("the transport does not claim zero-copy reads")
        n = max(256, caps.zero_copy_min_bytes // 4 + 1)  # float32 elements
        with self.pipe(transport, [Counter(5, shape=(n,))] * 2) as pipe:
            for b in pipe:
                ranges = _channel(pipe).memory_ranges()
                assert ranges, "zero_copy_reads but memory_ranges() is empty"
                for arr in _arrays(b):
                    assert _in_ranges(arr, ranges), "a delivered array is not in the transport's memory"
                    assert not arr.flags.writeable

    def test_owned_memory_stays_the_same_for_the_pipelines_life(self, transport: TransportArg) -> None:
        # owns_memory lets to_torch(pin_memory=True) page-lock memory_ranges()
        # once, at the first batch, and unlock them at close: they must hold
        # every batch, and must not move, for as long as the pipeline lives.
        with self.pipe(transport, [Counter(6, shape=(512,))] * 2) as pipe:
            it = iter(pipe)
            first = next(it)
            if not pipe.owns_memory():
                pytest.skip("the transport's memory is not its own (owns_memory is False)")
            assert self.caps(transport).zero_copy_reads, "owns_memory needs zero_copy_reads"
            ranges = _channel(pipe).memory_ranges()
            assert ranges, "owns_memory but memory_ranges() is empty"
            assert all(_in_ranges(arr, ranges) for arr in _arrays(first))
            del first
            for batches in (it, pipe):  # the rest of this pass, and the next
                for b in batches:
                    for arr in _arrays(b):
                        assert _in_ranges(arr, ranges), "a batch lies outside the ranges of the first"
            assert _channel(pipe).memory_ranges() == ranges

    def test_takes_ready(self, transport: TransportArg) -> None:
        # The fast path's contract: never waits; None having taken nothing
        # when nothing is there or a look is due; else the batch get() would
        # give that worker's turn, with its size, worker and time.
        if not self.caps(transport).takes_ready:
            pytest.skip("the transport does not claim takes_ready")
        with self.pipe(transport, [Counter(4, shape=(64,))] * 2, ordered=True, capacity=6) as pipe:
            it = iter(pipe)
            first = next(it)  # the general path: opens the channel
            assert (first["worker"], first["seq"]) == (0, 0)
            channel = _channel(pipe)
            t0 = time.perf_counter()
            assert channel.take_ready(0, 1, 1, 0) is None  # a look is due: nothing taken
            deadline = time.monotonic() + self.timeout
            got = None
            while got is None and time.monotonic() < deadline:  # worker 1's first batch, once it is there
                got = channel.take_ready(0, 1, 0, 1 << 62)
                if got is None:
                    time.sleep(0.005)
            assert got is not None, "worker 1's first batch never came by the fast path"
            batch, nbytes, worker, ns = got
            assert (batch["worker"], batch["seq"], worker) == (1, 0, 1)
            assert nbytes > 0 and ns > 0
            assert channel.take_ready(0, 0, 99, 1 << 62) is None  # not there: never waits
            assert time.perf_counter() - t0 < self.timeout
            del batch, got

    def test_serves_ranks_claims_the_protocol(self, transport: TransportArg) -> None:
        from shmpipe.transport import ServesRanks, SharingConsumerEnd

        resolved = resolve_transport(transport)
        if not resolved.capabilities.serves_ranks:
            pytest.skip("the transport does not claim serves_ranks")
        assert isinstance(resolved, ServesRanks), "serves_ranks without ServesRanks.rank_reader"
        with self.pipe(transport, [Counter(2)]) as pipe:
            assert len(list(pipe)) == 2
            assert isinstance(_channel(pipe), SharingConsumerEnd), "serves_ranks without a SharingConsumerEnd"

    def test_alignment(self, transport: TransportArg) -> None:
        caps = self.caps(transport)
        align = caps.alignment
        if not align:
            pytest.skip("the transport promises no alignment")
        source: Source
        if caps.zero_copy_min_bytes:
            # Imported here, not with this module: a producer that unpickles
            # NotALeaf imports this module, and shmpipe.testing.batches
            # imports ml_dtypes (1.1 s of CPU for its 0.7.0; see the
            # troubleshooting page), where installed.
            from shmpipe.testing.batches import matrix

            # every batch of the matrix, with enough bytes beside it
            filler = np.zeros(caps.zero_copy_min_bytes + 1, np.uint8)
            source = Fixed([{"batch": b, "filler": filler} for _, b in matrix()])
        else:
            source = Matrix()
        with self.pipe(transport, [source]) as pipe:
            for b in pipe:
                for arr in _arrays(b):
                    if arr.nbytes:
                        assert arr.__array_interface__["data"][0] % align == 0

    def test_in_place_writes(self, transport: TransportArg) -> None:
        if not self.caps(transport).in_place_writes:
            pytest.skip("the transport does not claim in-place writes")
        with self.pipe(transport, [Reserver(6, shape=(512,))] * 2) as pipe:
            for b in pipe:
                assert _in_ranges(b["data"], _channel(pipe).memory_ranges())
                assert np.all(b["data"] == b["seq"] + 1000 * b["worker"])
