"""The control connections with real processes: what a producer sends is
untrusted (never unpickled, checked field by field), a message cut short
never stops the consumer from honouring timeout=, and a producer gone
between passes is the WorkerDiedError that names it.

Each test runs what could hang (a next() that used to block for good) in a
thread it waits for with a timeout, and kills every process it started in
a finally, whatever happened.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import threading
import time
from typing import Any

import numpy as np
import pytest

import shmpipe
from shmpipe import _control, _producer_context
from shmpipe.errors import CorruptChannelError
from shmpipe.testing.processes import gone, wait_until
from shmpipe.testing.sources import Counter

T = 30.0




def kill(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def next_within(it, seconds: float) -> tuple[bool, dict[str, Any]]:
    """next(it) in a thread, waited for `seconds`: (still blocked, {"value"
    or "error": ..., "took": seconds})."""
    result: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            result["value"] = next(it)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc
        result["took"] = time.monotonic() - t0

    thread = threading.Thread(target=run, name="test-next", daemon=True)
    thread.start()
    thread.join(seconds)
    return thread.is_alive(), result


def _own_connection() -> Any:
    """The producer's end of its control connection (a source runs in the
    producer process, where the producer object is the reserver)."""
    return _producer_context._reserver.conn  # type: ignore[union-attr]


# -- sources that misbehave on the control connection (they run in the producer) --


class _Evil:
    """Unpickled, creates a directory: code a producer chose, run by
    whoever loads the pickle."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


class Forger:
    """Writes a forged message on its own control connection, as the
    producer would frame one (Connection.send_bytes), then waits to be
    stopped."""

    def __init__(self, kind: str, marker: str, large: int) -> None:
        self.kind, self.marker, self.large = kind, marker, large

    def __call__(self):
        conn = _own_connection()
        if self.kind == "pickle":
            # The old framing (<u16 descriptors> <pickle>) of an "error"
            # whose type field runs code when it is loaded.
            forged = ("error", _Evil(self.marker), "forged", "", None)
            conn.send_bytes(struct.pack("<H", 0) + pickle.dumps(forged))
        elif self.kind == "class":
            # JSON naming a class outside shmpipe's own errors.
            conn.send_bytes(b'["error","x","forged","",["os.mkdir",["' + self.marker.encode() + b'"]]]')
        else:  # a frame that says it is larger than any message
            conn.send_bytes(b"[" * self.large)
        time.sleep(T)
        yield np.zeros(1)


class HalfMessage:
    """Writes the first half of a control message, then sleeps ("stops"),
    or forks a child that holds the connection and kills itself ("dies")."""

    def __init__(self, how: str, pid_file: str) -> None:
        self.how, self.pid_file = how, pid_file

    def __call__(self):
        conn = _own_connection()
        if self.how == "dies":
            child = os.fork()
            if child == 0:
                try:
                    time.sleep(T)
                finally:
                    os._exit(0)
            partial = f"{self.pid_file}.{os.getpid()}"
            with open(partial, "w") as f:
                f.write(str(child))
            os.rename(partial, self.pid_file)
        # A frame header for 4000 bytes (Connection's: 4 bytes, big-endian),
        # and 2000 of them: a long error message, cut in the middle.
        os.write(conn.fileno(), struct.pack("!i", 4000) + b"x" * 2000)
        if self.how == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(T)
        yield np.zeros(1)


class LongError:
    """Raises an error whose message and traceback are far longer than a
    control message may be."""

    def __call__(self):
        def deep(n: int) -> None:
            if n == 0:
                raise ValueError("long " + "é" * 500_000 + " end of the message")
            deep(n - 1)

        yield np.zeros(1)
        deep(200)


# -- (2) nothing a producer sends is unpickled ------------------------------------


@pytest.mark.parametrize("kind", ["pickle", "class", "too large"])
def test_a_forged_control_message_runs_no_code_and_is_a_clear_error(tmp_path, kind):
    marker = tmp_path / "code-ran"
    large = _control.MAX_MESSAGE + 1 if kind == "too large" else 0
    pipe = shmpipe.from_iterators([Forger(kind, str(marker), large)], timeout=T)
    pid = pipe.pids[0]
    try:
        t0 = time.monotonic()
        with pytest.raises(shmpipe.ShmpipeError) as info:
            with pipe:
                list(pipe)
        assert not marker.exists(), "the consumer ran code that a producer sent"
        assert isinstance(info.value, CorruptChannelError), repr(info.value)
        text = str(info.value)
        assert f"worker 0 (pid {pid}) sent a malformed control message" in text
        assert {"pickle": "not JSON", "class": "not one of shmpipe's errors", "too large": "a frame of"}[kind] in text
        assert time.monotonic() - t0 < 10.0
        assert pipe.closed and wait_until(lambda: gone(pid), 10.0)
    finally:
        kill(pid)
        pipe.close()


# -- (3) a message cut short never hangs the consumer ----------------------------------


@pytest.mark.parametrize("how", ["stops", "dies"])
def test_half_a_control_message_does_not_hang_the_consumer(tmp_path, how):
    """A producer that stops in the middle of a message (alive), or dies
    there while a child it forked holds the connection: next() raises
    within the timeout (2 s) -- PipelineTimeoutError, or the WorkerDiedError
    seen by the producer's pidfd -- where it used to block for good."""
    pid_file = tmp_path / "child"
    pipe = shmpipe.from_iterators([HalfMessage(how, str(pid_file))], timeout=2.0)
    producer = pipe.pids[0]
    child = None
    blocked = False
    try:
        if how == "dies":
            assert wait_until(pid_file.exists, 10.0), "the producer never forked its child"
            child = int(pid_file.read_text())
        it = iter(pipe)
        blocked, result = next_within(it, 10.0)
        assert not blocked, "next() still blocks 10 s after a half-sent control message (timeout=2)"
        expected = shmpipe.PipelineTimeoutError if how == "stops" else shmpipe.WorkerDiedError
        assert isinstance(result.get("error"), expected), result
        assert result["took"] < 6.0
        if how == "dies":
            assert result["error"].pid == producer and result["error"].signal == signal.SIGKILL
            assert not gone(child), "the child must hold the connection throughout, or the test means nothing"
    finally:
        if child is None and pid_file.exists():
            child = int(pid_file.read_text())
        kill(child)
        kill(producer)  # a next() still blocked (the old code) sees the connection end
        if blocked:
            wait_until(lambda: not any(t.name == "test-next" for t in threading.enumerate()), 10.0)
        pipe.close()


def test_a_long_error_is_clipped_and_still_arrives():
    pipe = shmpipe.from_iterators([LongError()], timeout=T)
    pid = pipe.pids[0]
    try:
        with pytest.raises(shmpipe.WorkerError) as info:
            with pipe:
                list(pipe)
        err = info.value
        assert err.exc_type == "builtins.ValueError" and err.pid == pid
        assert err.message.startswith("long é") and err.message.endswith("end of the message")
        assert "characters clipped" in err.message and len(err.message) < 20_000
        assert "in deep" in err.remote_traceback and "ValueError" in err.remote_traceback
    finally:
        kill(pid)
        pipe.close()


# -- (9) a producer gone between passes ----------------------------------------------


def test_a_producer_killed_between_passes_is_a_worker_died_error():
    pipe = shmpipe.from_iterators([Counter(3)] * 2, timeout=T)
    pids = pipe.pids
    try:
        with pipe:
            assert len(list(pipe)) == 6
            os.kill(pids[1], signal.SIGKILL)
            assert wait_until(lambda: gone(pids[1]), 10.0)
            t0 = time.monotonic()
            with pytest.raises(shmpipe.WorkerDiedError) as info:
                for _ in pipe:
                    pass
            assert time.monotonic() - t0 < 5.0
            err = info.value
            assert err.worker_id == 1 and err.pid == pids[1] and err.signal == signal.SIGKILL
            assert pipe.closed
        assert wait_until(lambda: all(gone(p) for p in pids), 10.0)
    finally:
        for pid in pids:
            kill(pid)
        pipe.close()


# -- the messages themselves (no processes) -----------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        shmpipe.BatchTypeError("unsupported type builtins.set", "batch['s']"),
        shmpipe.BatchTooLargeError(10_000_000, 8192),
        shmpipe.SharedMemoryFullError(1 << 30, 1 << 20, "/dev/shm"),
        shmpipe.CorruptChannelError("bad"),
        shmpipe.ShmpipeValueError("capacity"),
        shmpipe.WorkerDiedError(2, 1234, -9),
        shmpipe.WorkerError(1, None, "builtins.KeyError", "k", "tb"),
        shmpipe.RankDiedError("rank 1 died", 1),
    ],
)
def test_shmpipes_own_errors_travel_as_themselves(exc):
    report = _control.decode(_control.encode(_control.error(exc, "Traceback ...")))
    assert isinstance(report, _control.ErrorReport)
    assert type(report.own) is type(exc) and str(report.own) == str(exc)
    assert report.own.__reduce__()[1] == exc.__reduce__()[1]


def test_other_errors_travel_as_text_only():
    class Mine(shmpipe.BatchTypeError):  # a subclass: not in the closed table
        pass

    for exc in [ValueError("v"), Mine("m", "batch"), shmpipe.BatchTooLargeError(-1, 5)]:
        report = _control.decode(_control.encode(_control.error(exc, "tb")))
        assert isinstance(report, _control.ErrorReport) and report.own is None
        assert report.message == str(exc)


def test_an_iterator_state_is_kept_as_data():
    state = {"position": [1, 2], "file": "a.tfrecord", "deep": [[[{}]]]}
    msg = _control.decode(_control.encode(_control.iterator_state(3, 7, state)))
    assert msg == _control.IteratorState(3, 7, state)


@pytest.mark.parametrize(
    "data, why",
    [
        (b"\x80\x05N.", "not JSON"),
        (b'{"error": 1}', "not an array"),
        (b'["need_channel", -1]', "need_channel"),
        (b'["need_channel", true]', "need_channel"),
        (b'["need_channel", 1.5]', "need_channel"),
        (b'["need_channel", 1099511627777]', "need_channel"),
        (b'["error", "t", "m", "tb"]', "error wants"),
        (b'["error", "t", "m", 3, null]', "error wants"),
        (b'["error", "t", "m", "tb", ["os.system", ["id"]]]', "not one of shmpipe's errors"),
        (b'["error", "t", "m", "tb", ["BatchTooLargeError", [1, "2"]]]', "not of its types"),
        (b'["error", "t", "m", "tb", ["Cancelled", ["x"]]]', "not one of shmpipe's errors"),
        (b'["state", 0, 1]', "state wants"),
        (b'["state", -1, 1, {}]', "state wants"),
        (b'["state", 0, true, {}]', "state wants"),
        (b'["state", 0, 9223372036854775808, null]', "state wants"),
        (b'["attach", 1]', "unknown kind"),
        (b"[" * 100_000, "not JSON"),
    ],
)
def test_malformed_messages_are_corrupt_channel_errors(data, why):
    with pytest.raises(CorruptChannelError, match="malformed control message") as info:
        _control.decode(data)
    assert why in str(info.value)
