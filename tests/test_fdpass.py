"""shmpipe._fdpass: descriptor passing over real Unix sockets."""

from __future__ import annotations

import fcntl
import os
import socket
import threading

import pytest

from shmpipe import _fdpass


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.settimeout(10.0)  # every blocking call here has a limit
    b.settimeout(10.0)
    yield a, b
    a.close()
    b.close()


def _same_file(fd1: int, fd2: int) -> bool:
    s1, s2 = os.fstat(fd1), os.fstat(fd2)
    return (s1.st_dev, s1.st_ino) == (s2.st_dev, s2.st_ino)


def test_descriptors_travel_close_on_exec_with_their_message(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        os.set_inheritable(r, True)  # the sender's flag does not travel
        _fdpass.send_fds(a, b"hello", [r, w])
        got = _fdpass.recv_fds(b, 64, 4)
        try:
            assert got.data == b"hello" and len(got.fds) == 2
            assert not got.truncated and not got.fds_cut
            assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in got.fds)
            assert _same_file(got.fds[0], r) and _same_file(got.fds[1], w)
        finally:
            _fdpass.close_all(got.fds)
    finally:
        os.close(r)
        os.close(w)


def test_a_message_without_descriptors_has_none(pair):
    a, b = pair
    _fdpass.send_fds(a, memoryview(b"just bytes"), [])
    got = _fdpass.recv_fds(b, 64, 4)
    assert got == _fdpass.Received(b"just bytes", [], False, False)


def test_flags_are_honoured(pair):
    """MSG_DONTWAIT on a blocking socket (no timeout: with one, Python
    waits for the socket to be readable before it asks): socket.recv_fds
    dropped the flags, and waited. Should it wait, a message sent 5 s later
    ends the wait, and the test fails instead of hanging."""
    a, b = pair
    b.settimeout(None)
    late = threading.Timer(5.0, a.send, (b"late",))
    late.start()
    try:
        with pytest.raises(BlockingIOError):
            _fdpass.recv_fds(b, 64, 4, socket.MSG_DONTWAIT)
    finally:
        late.cancel()
        late.join(10.0)


def test_never_more_descriptors_than_asked_for(pair):
    """maxfds=1: CMSG_SPACE's padding would have room for a second one."""
    a, b = pair
    r, w = os.pipe()
    try:
        _fdpass.send_fds(a, b"x", [r, w, r])
        got = _fdpass.recv_fds(b, 64, 1)
        _fdpass.close_all(got.fds)
        assert len(got.fds) == 1 and got.fds_cut and not got.truncated
    finally:
        os.close(r)
        os.close(w)


def test_a_message_longer_than_the_buffer_is_reported_truncated(pair):
    a, b = pair
    _fdpass.send_fds(a, b"0123456789", [])
    got = _fdpass.recv_fds(b, 4, 1)
    assert got.data == b"0123" and got.truncated and not got.fds_cut


def test_the_end_of_the_connection_is_an_empty_message(pair):
    a, b = pair
    a.close()
    assert _fdpass.recv_fds(b, 64, 4) == _fdpass.Received(b"", [], False, False)


def test_an_empty_message_is_refused(pair):
    a, _ = pair
    with pytest.raises(ValueError):
        _fdpass.send_fds(a, b"", [0])


def test_close_all_closes_every_one_and_raises_the_first_failure():
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(OSError):
        _fdpass.close_all([w, r])  # w is already closed: r is closed all the same
    with pytest.raises(OSError):
        os.fstat(r)
