"""shmpipe's fork server, and how a producer's process is started from it
without the trainer's script.

What each producer needs, and whether it can start without the script, is
_startup's to decide (plan); this module is the mechanism: the server
process (an instance of the standard library's ForkServer of our own), the
one that new producers fork from and the ones retired, and the Popen whose
_launch is CPython 3.11's with the preparation data changed (the two
entries that name the script dropped: _starts.pickled_for_child) and our
server. The other ways a producer starts (spawned, or importing the
script) are _starts'.

A start talks to the server over its socket and two pipes (the data it
sends the child, the pid it gets back): it waits for the server only within
a StartWait, and where the server ended before it answered, a new server
starts the child when no child can have its data (_server_gone). The
server reads what comes on its socket as input from another process: a
request cut short (its trainer ended mid-start), malformed or never sent
is dropped, and the server goes on (_forkserver_loop.py, what runs inside
the server's process).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import io
import multiprocessing.connection
import multiprocessing.process
import os
import select
import signal
import socket
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import forkserver, popen_forkserver, spawn, util
from multiprocessing.process import BaseProcess
from typing import NoReturn

from shmpipe._forkserver_loop import REQUEST_WAIT_S
from shmpipe._interrupts import born_with_ctrl_c_blocked, no_sigpipe
from shmpipe._process import ProcessWatch, process_start_time, process_stopped
from shmpipe._starts import pickled_for_child
from shmpipe.errors import PipelineTimeoutError, ShmpipeError

__all__ = [
    "SERVER_END_WAIT_S",
    "SERVER_PRELOAD",
    "ServerProcess",
    "StartWait",
    "launch_server",
    "preload",
    "server_pid",
    "stopped_note",
    "wait_until_booted",
    "waiting",
]

#: What the fork server imports before it forks producers: what every
#: producer needs to unpickle its arguments and run (the default transport
#: included, and numpy.random, which every producer seeds before each pass:
#: 20-40 ms of each producer's first batch where it imported it itself; and
#: the wrappers of a source, _sources, which a producer unpickles), so that a
#: producer inherits it instead of importing it. The pipeline's side
#: (_api, _pipeline, _group, _options, the registry) is not here: a producer
#: never runs it (tests/test_package.py checks that this list loads none of it).
SERVER_PRELOAD = ["shmpipe._worker", "shmpipe._startup", "shmpipe._sources", "shmpipe.transports.shm", "numpy.random"]

#: How long a start that found the fork server gone (a connection refused,
#: or closed before it answered) waits for its process to end before it
#: starts a new one; one that is still running then is an error.
SERVER_END_WAIT_S = 2.0

#: The fork server's command line (Python 3.11, _ForkServer): the trainer's
#: sys.path first, then _forkserver_loop.serve: the preload, the "booted"
#: pipe told, then the standard library's server loop.
_SERVER_COMMAND = """\
import sys
sys.path[:] = %r
from shmpipe._forkserver_loop import serve
serve(%d, %d, %r, %r, preload=%r, booted_fd=%d)
"""


class _ForkServer(forkserver.ForkServer):
    """The standard library's fork server, whose process imports its preload
    with the trainer's sys.path.

    CPython 3.11's forkserver.main is given the trainer's sys.path but does
    not apply it before the preload: the server, started as ``python -c``,
    has the trainer's *current directory* first on its path, and a trainer
    run from a source checkout of shmpipe (its compiled modules not built
    there: CI runs the tests from one) made the server import that shmpipe,
    which cannot load; every producer then failed to start. Later versions
    apply it (and 3.13 adds an authentication key this copy would lack), so
    the override is for versions before 3.12 only: ensure_running as in
    3.11, with the command line setting sys.path first (_SERVER_COMMAND).
    """

    #: The "booted" pipe's read end, until the server is seen booted (seen_booted); None on Python 3.12+.
    _booted_r: int | None = None

    def ensure_running(self) -> None:
        _temp_dir_back()
        if sys.version_info >= (3, 12):
            super().ensure_running()
            return
        from multiprocessing import connection

        # No resource tracker started, unlike the standard library's: a producer's
        # start needs it and starts it first (born_with_ctrl_c_blocked in _launch).
        with self._lock:  # type: ignore[attr-defined]
            if self._forkserver_pid is not None:  # type: ignore[has-type]
                pid, _ = os.waitpid(self._forkserver_pid, os.WNOHANG)  # type: ignore[has-type]
                if not pid:
                    return  # still alive
                self._forget()
            data = {k: v for k, v in spawn.get_preparation_data("ignore").items() if k in ("main_path", "sys_path")}
            with socket.socket(socket.AF_UNIX) as listener:
                folder_is_ours = _temp_dir_made_here()
                address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
                listener.bind(address)
                if not util.is_abstract_socket_namespace(address):
                    os.chmod(address, 0o600)
                listener.listen()
                # Every client holds the write end of the "alive" pipe: the
                # server ends when the read end says they all have.
                alive_r, alive_w = os.pipe()
                booted_r = booted_w = -1
                try:
                    booted_r, booted_w = os.pipe()
                    fds_to_pass = [listener.fileno(), alive_r, booted_w]
                    line = _SERVER_COMMAND % (
                        data.get("sys_path", sys.path),
                        listener.fileno(),
                        alive_r,
                        data,
                        folder_is_ours,
                        self._preload_modules,  # type: ignore[attr-defined]
                        booted_w,
                    )
                    exe = spawn.get_executable()
                    args = [exe, *util._args_from_interpreter_flags(), "-c", line]  # type: ignore[attr-defined]
                    pid = util.spawnv_passfds(exe, args, fds_to_pass)  # type: ignore[arg-type]
                except BaseException:
                    for fd in (alive_w, booted_r):
                        if fd >= 0:
                            os.close(fd)
                    raise
                finally:
                    for fd in (alive_r, booted_w):
                        if fd >= 0:
                            os.close(fd)
                self._forkserver_address = address
                self._forkserver_alive_fd = alive_w
                self._forkserver_pid = pid
                self._booted_r = booted_r

    def wait_until_booted(self, wait: StartWait) -> None:
        """Waits, within `wait`, until the server launched last has imported
        its preload (its byte on the "booted" pipe) or ended (the pipe's
        end); at once where it was seen booted, or is not ours (3.12+)."""
        with self._lock:  # type: ignore[attr-defined]
            if self._booted_r is None:
                return
            # A copy: another thread may see the pipe closed first and close
            # the original, whose number could then be reused under this poll.
            try:
                fd, pid = os.dup(self._booted_r), self._forkserver_pid
            except OSError:  # out of descriptors: no wait (it only orders two boots)
                return
        try:
            wait.until_ready(fd, select.POLLIN, pid, "up")
        finally:
            os.close(fd)
        self.seen_booted(pid)

    def seen_booted(self, pid: int | None) -> None:
        """Server `pid` has booted (said so, or answered a start): its "booted" pipe goes."""
        with self._lock:  # type: ignore[attr-defined]
            if self._forkserver_pid == pid:
                self._close_booted()

    def _close_booted(self) -> None:
        booted, self._booted_r = self._booted_r, None
        if booted is not None:
            with contextlib.suppress(OSError):
                os.close(booted)

    def forget_if_ended(self, pid: int | None, wait_s: float) -> bool:
        """Whether the server's process `pid` has ended, waited for up to
        `wait_s` (a process killed a moment ago may still be exiting: not
        yet a zombie, so ensure_running took it for running); an ended one
        is forgotten, as ensure_running forgets one it finds dead, and the
        next start starts a new server."""
        deadline = time.monotonic() + wait_s
        with self._lock:  # type: ignore[attr-defined]
            if pid is None or self._forkserver_pid != pid:
                return True  # forgotten already (another thread's start may have started its successor)
            while True:
                try:
                    ended, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: gone all the same
                    ended = pid
                if ended:
                    break
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.005)
            self._forget()
            return True

    def _forget(self) -> None:
        """Lets go of a server whose process ended (under self._lock): the
        next ensure_running starts a new one. Its socket goes too: nothing
        listens there, and a server killed left it in the trainer's folder,
        which then outlived a trainer killed later (helper 101)."""
        self._close_booted()
        alive = self._forkserver_alive_fd
        if alive is not None:
            os.close(alive)
        address = self._forkserver_address
        if isinstance(address, str) and address.startswith("/"):
            with contextlib.suppress(OSError):
                os.unlink(address)
        self._forkserver_address = None
        self._forkserver_alive_fd = None  # type: ignore[assignment]
        self._forkserver_pid = None  # type: ignore[assignment]


#: (this process's pid, the name of multiprocessing's temporary folder that
#: _temp_dir_made_here saw this process make), or None
_TEMP_DIR_MADE: tuple[int, str] | None = None


def _temp_dir_made_here() -> bool:
    """Makes multiprocessing's temporary folder (pymp-*) where this process
    has none yet, and says whether this process made the one it has: a
    server whose trainer was killed removes it (_forkserver_loop), which
    only its maker may. A forked process inherits its parent's by name
    (multiprocessing's config), and one made before shmpipe looked (by a
    Manager, a Listener) is not known to be this process's: those are left
    to their makers."""
    global _TEMP_DIR_MADE
    had = multiprocessing.process.current_process()._config.get("tempdir")  # type: ignore[attr-defined]
    folder = util.get_temp_dir()
    if had is None:
        _TEMP_DIR_MADE = (os.getpid(), folder)
    return _TEMP_DIR_MADE == (os.getpid(), folder)


def _temp_dir_back() -> None:
    """multiprocessing makes its temporary folder (pymp-*, where a fork
    server's socket goes) once per process and keeps its name; a cleaner of
    the temporary directory may remove it in a long job (tmpreaper, or
    systemd-tmpfiles once it is old), and every later bind there would
    fail. A folder gone is made again under its name, ours again (mkdir
    fails on any name that exists, a link included), so that the process's
    exit still removes it; where that fails, its name is forgotten and the
    next socket's folder is a new one."""
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    tempdir = config.get("tempdir")
    if tempdir is None or os.path.isdir(tempdir):
        return
    try:
        os.mkdir(tempdir, 0o700)
    except OSError:
        config["tempdir"] = None  # multiprocessing.util.get_temp_dir makes a new one


#: The fork server that new producers fork from. A later pipeline whose
#: sources need a heavy framework that it lacks replaces it by a server that
#: has it (preload); the one replaced keeps running, in _RETIRED, for the
#: producers it forked: their exit codes come through it. Each ends with
#: this process (its end of a pipe closes): at most one per framework of
#: _startup.HEAVY_FRAMEWORKS, since each new one has all the old had, and
#: one per server whose socket could no longer be reached (_retire).
_SERVER = _ForkServer()
_SERVER.set_forkserver_preload(SERVER_PRELOAD)
_RETIRED: list[_ForkServer] = []
#: Guards the choice and the swap of _SERVER: pipelines may be made from
#: several threads at once.
_SERVER_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A process forked (os.fork) from one with fork servers does not own
    them: its first start asked the kernel about a server that is not its
    child (ChildProcessError), and every pipeline with the forkserver start
    method failed to start there. The child starts its own server at its
    first start, with the same preload; the "alive" ends of its parent's
    servers that it inherited are closed (holding them, it kept those
    servers from ending with the parent). The lock is new: another thread
    of the parent may have held it as it forked."""
    global _SERVER, _SERVER_LOCK
    for server in (_SERVER, *_RETIRED):
        server._close_booted()
        alive = server._forkserver_alive_fd
        if alive is not None:
            with contextlib.suppress(OSError):
                os.close(alive)
    preload = _SERVER._preload_modules  # type: ignore[attr-defined]
    _SERVER = _ForkServer()
    _SERVER.set_forkserver_preload(preload)
    _RETIRED.clear()
    _SERVER_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def launch_server() -> None:
    """Starts the fork server's process now, with the preload plan() set,
    where it is not running: the caller then does other work while it boots
    (0.2-0.3 s); the first producer's start connects to it, waiting for
    the rest of its boot. (ensure_running does nothing where it runs.)
    Born with SIGINT blocked, and so the producers it forks. Without the
    resource tracker where the server is ours (Python 3.11; 3.12's starts
    it first, so must born_with_ctrl_c_blocked): a third interpreter booting
    here put 28 ms into a fresh process's first batch of 0.12 s on 2 cores
    (JPEGs, 2 workers, measured); the first producer's start starts it."""
    with born_with_ctrl_c_blocked("forkserver", tracker=sys.version_info >= (3, 12)):
        _SERVER.ensure_running()


def wait_until_booted(wait: StartWait) -> None:
    """Waits, within `wait`, until the server launched last has imported its
    preload: a start in the background (_launch) starts the resource tracker
    only then, and the producers' starts, which wait for that boot anyway."""
    _SERVER.wait_until_booted(wait)


def server_pid() -> int | None:
    """The fork server's pid, once started (for tests and the doctor)."""
    return _SERVER._forkserver_pid



def stopped_note() -> str:
    """Where a fork server of this process (the current one, or a retired
    one whose producers still run) is stopped: a sentence that says so and
    how to continue it, for an error's message. Otherwise ""."""
    for server in (_SERVER, *_RETIRED):
        pid = server._forkserver_pid
        if pid is not None and process_stopped(pid):
            return (
                f"shmpipe's fork server (pid {pid}) is stopped (SIGSTOP, or Ctrl-Z of its process group), and with "
                f"it the producers' starts and exit statuses: `kill -CONT {pid}` continues it"
            )
    return ""


def status_held_back(p: object) -> bool:
    """Whether producer `p`'s exit status cannot come now: `p` is a child of
    a fork server (the current one or a retired one) that is stopped. The
    server reaps its children and sends each status; it does neither until
    it is continued, so a wait for it would only be time lost."""
    server_pid = getattr(getattr(p, "_popen", None), "server_pid", None)
    return server_pid is not None and process_stopped(server_pid)


def status_lost(p: object) -> str | None:
    """Where producer `p`'s fork server ended before it sent p's exit
    status (_ServerPopen.wait), and p's exit code (255) is not its own:
    what p's death says of it. Otherwise None."""
    popen = getattr(p, "_popen", None)
    if not getattr(popen, "status_lost", False):
        return None
    if getattr(popen, "taken_for_ended", False):
        return (
            "shmpipe's fork server, its parent, had ended (killed?), and this kernel has no pidfds (Linux < 5.3) "
            "to see its own end by: it was ended (SIGKILL) with it"
        )
    return (
        "it ended after shmpipe's fork server, its parent, had ended (killed?): its exit status went with the "
        "server; a signal or the OOM killer may have ended both (dmesg tells)"
    )


def let_go(p: object) -> None:
    """Producer `p` has ended and its exit status waits in its stopped fork
    server (status_held_back): `p` is taken off multiprocessing's children,
    each of which the interpreter's exit joins without a limit
    (multiprocessing.util._exit_function): the program would not end until
    the server is continued. The server, its parent, reaps it; `p.exitcode`
    still reads its status once sent, and its sentinel closes with `p`."""
    children: set[object] = getattr(multiprocessing.process, "_children", set())
    children.discard(p)


def preload(modules: set[str], heavy_frameworks_of: Callable[[str], set[str]]) -> None:
    """The fork server imports `modules` too (a pipeline's sources' modules:
    _startup._preload_with_the_server says why). One not started yet (the
    first pipeline's, or one swapped in that no producer used yet) adds them
    to its preload. One running cannot import more: its producers import
    what it lacks themselves, unless that brings a heavy framework
    (`heavy_frameworks_of(module)`) it lacks; then a new server, with all the
    old one had and these, replaces it for this pipeline and the next ones,
    and the old one goes to _RETIRED."""
    global _SERVER
    with _SERVER_LOCK:
        preloaded: list[str] = _SERVER._preload_modules  # type: ignore[attr-defined]
        missing = sorted(modules - set(preloaded))
        if server_pid() is None:
            _SERVER.set_forkserver_preload([*preloaded, *missing])
            return
        needed = set().union(*map(heavy_frameworks_of, missing))
        if not needed or needed <= set().union(*map(heavy_frameworks_of, preloaded)):
            return  # nothing heavy, or nothing its producers would not inherit
        server = _ForkServer()
        server.set_forkserver_preload([*preloaded, *missing])
        _RETIRED.append(_SERVER)
        _SERVER = server  # started by the first producer forked from it


def _retire(server: _ForkServer) -> None:
    """Puts `server`, which runs but cannot be reached at its socket, in
    _RETIRED (its producers' exit statuses still come through it; it ends
    with this process) and a new server with the same preload in its
    place, started by the next producer's start."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is server:  # (not replaced by another thread meanwhile)
            new = _ForkServer()
            new.set_forkserver_preload(server._preload_modules)  # type: ignore[attr-defined]
            _RETIRED.append(server)
            _SERVER = new


class StartWait:
    """How a producer's start waits for the fork server: not once
    `abandoned(what)` gives the error to end the wait with (the pipeline is
    closing, a Ctrl-C is pending; `what` says which start it ended), nor
    once the server has been stopped for `timeout` seconds (None: no
    limit). One per start.

    A server answers in milliseconds once it has booted, and a start waits
    longer only while it boots: 0.2 s, or seconds where its preload brings
    a heavy framework (that wait is not limited: a start with a per-batch
    timeout of a second must not fail for a server importing torch). Or
    where it does not run at all: stopped (SIGSTOP, Ctrl-Z of its process
    group). A start's socket and pipes are buffered, so nothing fails
    there: unchecked, that start waited forever, and so did the pipeline's
    close(), which waits for it, and a Ctrl-C (blocked in the starting
    thread: _launch says why). A server that runs but never answers (stuck
    in its preload), or one a tracer holds (a debugger, strace: state "t",
    which process_stopped leaves out), is still waited for, as long as the
    start is not abandoned.

    Python 3.12 and later use the standard library's ensure_running and
    connect_to_new_process; 3.14's adds a blocking handshake with the
    server before the descriptors go, which no slice bounds (not tried:
    the project runs on 3.11)."""

    #: How often a wait looks at the server and at `abandoned` (a ready
    #: descriptor ends it at once): also how long a close() waits, at most,
    #: for a start in the background to give up (0.1 s: 90 ms a close of a
    #: fresh pipeline, measured). A look is a call, or a read of /proc.
    SLICE_S = 0.02

    def __init__(self, timeout: float | None, abandoned: Callable[[str], BaseException | None]) -> None:
        self.timeout = timeout
        self.abandoned = abandoned
        #: (server pid, when it was first seen stopped since it last ran)
        self._stopped: tuple[int, float] | None = None

    def _check(self, pid: int | None, name: str) -> None:
        """Between two slices: the error `abandoned` gives once it gives one,
        a PipelineTimeoutError once server `pid` has been stopped for the
        timeout."""
        error = self.abandoned(f"while shmpipe's fork server (pid {pid}) started {name}")
        if error is not None:
            raise error
        if self.timeout is None or pid is None:
            return
        if not process_stopped(pid):
            self._stopped = None
            return
        now = time.monotonic()
        if self._stopped is None or self._stopped[0] != pid:  # (a retry's new server: a clock of its own)
            self._stopped = (pid, now)
        elif now - self._stopped[1] >= self.timeout:
            raise PipelineTimeoutError(
                f"shmpipe's fork server (pid {pid}) has been stopped (SIGSTOP, or Ctrl-Z of its process group) for "
                f"the pipeline's timeout of {self.timeout} s while it started {name}: `kill -CONT {pid}` continues it"
            )

    def while_stopped(self, pid: int | None, name: str) -> None:
        """Waits while server `pid` is stopped, before a start connects to
        it: a connection to a stopped server waits in its listen backlog,
        and once that is full (128 starts that gave up) connect() blocks."""
        while pid is not None and process_stopped(pid):
            self._check(pid, name)
            time.sleep(self.SLICE_S)

    def until_ready(self, fd: int, events: int, pid: int | None, name: str) -> None:
        """Waits until `fd` has one of `events`, or an error (the caller's
        read or write then says which), while server `pid` starts `name`."""
        poller = select.poll()
        poller.register(fd, events)
        while not poller.poll(int(self.SLICE_S * 1000)):
            self._check(pid, name)


_WAITS = threading.local()


@contextlib.contextmanager
def waiting(wait: StartWait) -> Iterator[None]:
    """Producers started in the block, from this thread, by the fork server
    wait for it as `wait` says. (A thread-local, not an argument: a start
    runs through multiprocessing's Process.start, which takes none.)"""
    before = getattr(_WAITS, "wait", None)
    _WAITS.wait = wait
    try:
        yield
    finally:
        _WAITS.wait = before


class _ServerPopen(popen_forkserver.Popen):
    """A child of shmpipe's fork server (popen_forkserver.Popen._launch with
    the preparation data and the server changed), whose exit status is
    never made up (poll, wait)."""

    #: The server ended before it sent this child's exit status (killed, by
    #: the OOM killer say): its status, once it has ended, is 255 for
    #: multiprocessing's sake, and not its own.
    status_lost = False
    #: And this kernel has no pidfds (Linux < 5.3): the child's end could
    #: not be seen later, and it was ended (SIGKILL) with the server.
    taken_for_ended = False
    started: int | None = None  # the child's start time (process_start_time), to know it again

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        return self.wait(0 if flag == os.WNOHANG else None)

    def wait(self, timeout: float | None = None) -> int | None:
        """The child's exit status, or None if it still runs after `timeout`
        seconds (None: as long as it takes). multiprocessing's poll says
        255 at once where the server has ended without sending the status,
        though the child, reparented, runs on: a pass of live producers was
        failed as dead, or with max_restarts, replaced while they still
        wrote (duplicated batches, CorruptChannelError). Here the child's
        own end is waited for then.

        Any thread may poll (multiprocessing's _cleanup polls every child
        at each start): the sentinel is read under a lock, once; a thread
        woken by what another has read already finds the status set, or
        the sentinel changed, and waits again.

        A signal handler that runs in a thread while it reads (one that
        closes a pipeline, whose shutdown asks every producer's status)
        is answered None, not known yet: it would wait for its own
        thread's lock for ever, and the read it interrupted gets the status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not multiprocessing.connection.wait([self.sentinel], left):
                return None
            if getattr(self._reader, "reading", False):
                return None
            self._reader.reading = True  # (from before the lock is asked for, to after it is let go)
            try:
                with self._status_lock:
                    if self.returncode is None:
                        self._sentinel_ready()
            finally:
                self._reader.reading = False
        return self.returncode

    def _sentinel_ready(self) -> None:
        """The sentinel reads (under _status_lock, no status yet): the status
        the server sent, or the child's end (its pidfd, past the server's),
        or the server's end without the status; then, where the child still
        runs, its pidfd takes the sentinel's number: every wait on the
        sentinel (multiprocessing's, the launcher's) wakes at the child's
        end, and the finalizer closes it."""
        if self.status_lost:
            # The child's pidfd, which another thread's wait may have
            # answered for the pipe it replaced: ended only if it says so.
            if multiprocessing.connection.wait([self.sentinel], 0):
                self.returncode = 255
            return
        try:
            self.returncode = forkserver.read_signed(self.sentinel)
            return
        except (OSError, EOFError):
            self.status_lost = True
        if self.started is None:  # ended before its start time was read: gone
            self.returncode = 255
            return
        with ProcessWatch(self.pid, self.started) as child:
            fd = child.fileno()
            if fd is not None and child.alive():
                os.dup2(fd, self.sentinel, inheritable=False)
                return
            if fd is None and child.alive():
                # No pidfd to see its end by (Linux < 5.3): its status is
                # made true instead. It ran a moment ago (its start time
                # says so, and a live process keeps its pid), and it is
                # ended now, so that no producer runs on beside one started
                # in its place.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.taken_for_ended = True
            self.returncode = 255

    def _launch(self, process_obj: BaseProcess) -> None:
        self._status_lock = threading.Lock()
        self._reader = threading.local()  # whether this thread is reading the status (wait)
        buf = pickled_for_child(self, process_obj)
        tried: list[_ServerGone] = []
        while True:
            # The server ended after it was last seen running (killed: the
            # OOM killer's pick, say, while it was starting this child), or
            # runs and dropped the request, or cannot be reached (see
            # _server_gone), and no child of it has this start's data: a new
            # server, or the same one, starts it; each way once.
            try:
                self._fork_from(_SERVER, buf, process_obj.name)  # (one retired is replaced: the current one)
                return
            except _ServerGone as gone:
                if any(t.why == gone.why for t in tried):
                    raise ShmpipeError(gone.again(process_obj.name, tried)) from gone.__cause__
                tried.append(gone)

    def _fork_from(self, server: _ForkServer, buf: io.BytesIO, name: str) -> None:
        """Has `server` fork child `name` and sends it `buf`; _ServerGone
        where the server ended, dropped the request or cannot be reached,
        and no child of it can have the data, so that a new server, or the
        same one, may start it (see _server_gone)."""
        # (A start without a StartWait of its caller's, prestart's or a
        # test's: no limit, never abandoned.)
        wait: StartWait = getattr(_WAITS, "wait", None) or StartWait(None, lambda what: None)
        # The server this start talks to. (connect_to_new_process runs
        # ensure_running again, a no-op, and reads the address unlocked: a
        # successor started by another thread in between would be blamed
        # instead, a wrong message after a 2 s wait, never a second child.)
        try:
            server.ensure_running()
        except OSError as exc:  # its socket cannot be made (a temporary directory not writable, full)
            raise ShmpipeError(
                f"shmpipe's fork server could not be started to start {name}: {exc!r}; its socket goes in a "
                f"folder of the temporary directory ({tempfile.gettempdir()})"
            ) from exc
        used = server._forkserver_pid
        wait.while_stopped(used, name)
        try:
            # The request's sendmsg, to a server that may have dropped this
            # connection (a client silent for REQUEST_WAIT_S) or died, is a
            # BrokenPipeError here, never a SIGPIPE. (Its ensure_running is
            # ours, just run: it starts a server only where that one died
            # since, which then unblocks SIGPIPE itself: serve.)
            with no_sigpipe():
                sentinel, w = server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        except (ConnectionError, FileNotFoundError) as exc:  # the request reached no server
            _server_gone(server, used, name, exc)
        finalizer = util.Finalize(self, util.close_fds, (sentinel,))  # type: ignore[attr-defined]
        try:
            # The data pipe's write end stays open until the server answers:
            # where it ends without answering, the pipe tells whether a child
            # may have read the data. (multiprocessing keeps a duplicate for
            # the child's parent_process(); a producer watches its consumer
            # itself, the owner's pidfd in _worker.py, so it is closed then:
            # one descriptor less per producer against `ulimit -n`.)
            written = 0  # what reached the pipe (past its 64 KiB, the rest waits for the child to read)
            try:
                # Both waits within `wait`; where it gives up, the descriptors
                # close below: a child the server forks later reads a cut
                # pickle and ends (printing the unpickling error), or a
                # whole one and finds its control pipe closed and ends (an
                # orphan of a moment, never a second producer: this start
                # is not retried).
                # The pipe's reader, the child, may be gone (the server died
                # with the request): a BrokenPipeError, never a SIGPIPE.
                os.set_blocking(w, False)
                with buf.getbuffer() as data, no_sigpipe():
                    while written < data.nbytes:
                        wait.until_ready(w, select.POLLOUT, used, name)
                        with contextlib.suppress(BlockingIOError):  # a reader took less than POLLOUT promised
                            written += os.write(w, data[written:])
                wait.until_ready(sentinel, select.POLLIN, used, name)
                pid = forkserver.read_signed(sentinel)
                server.seen_booted(used)  # (it answered)
            except (BrokenPipeError, EOFError) as exc:
                _server_gone(server, used, name, exc, data_pipe=w, nbytes=written)
            finally:
                os.close(w)
        except BaseException:
            finalizer()  # the sentinel is closed now, not at a collection (its number may be reused by then)
            raise
        self.sentinel, self.finalizer, self.pid = sentinel, finalizer, pid
        self.started = process_start_time(pid)
        self.server_pid = used  # its parent, which sends its exit status (status_held_back)


class _ServerGone(Exception):
    """The fork server `pid` did not start a child, and no child of it can
    have that start's data, `why`: it "ended" (a new server may start it),
    "dropped" the request and runs on (the same one may), or is
    "unreachable" at its socket and was retired (a new one may)."""

    def __init__(self, pid: int | None, why: str) -> None:
        super().__init__(pid, why)
        self.pid, self.why = pid, why

    def again(self, name: str, tried: list[_ServerGone]) -> str:
        """The error's message where a start of `name` met this a second time."""
        first = next(t for t in tried if t.why == self.why)
        if self.why == "dropped":
            return (
                f"shmpipe's fork server (pid {self.pid}) runs but did not start {name}, twice: either the request "
                f"came over {REQUEST_WAIT_S:g} s after its connect (was this process stopped, in a debugger, or held "
                f"by a thread that kept the GIL?) or the child ended before it read its data: {self.__cause__!r}"
            )
        if self.why == "unreachable":
            return (
                f"shmpipe's fork server (pid {first.pid}) could not be reached at its socket, nor the one started in "
                f"its place (pid {self.pid}), to start {name}: {self.__cause__!r}"
            )
        return (
            f"shmpipe's fork server (pid {first.pid}) ended, and the one started in its place (pid {self.pid}, "
            f"interpreter {spawn.get_executable()}) did not start {name} either: {self.__cause__!r}"
        )


def _server_gone(
    server: _ForkServer, pid: int | None, name: str, cause: BaseException, data_pipe: int | None = None,
    nbytes: int = 0,
) -> NoReturn:
    """A start of child `name` through `server`'s process `pid` failed with
    `cause`, a sign that it ended: _ServerGone("ended") once it has ended,
    where no child can have the start's data. Where the process runs on:
    before the request reached it (`data_pipe` None), a connection refused
    or a socket gone (a /tmp cleaner removes files older than some days:
    systemd-tmpfiles' 10) is _ServerGone("unreachable"), the server
    retired; one closed is _ServerGone("dropped") (its descriptors came
    later than REQUEST_WAIT_S after the connect: this process was held, by
    a debugger, a stop, or a thread that kept the GIL), as is a data pipe no
    child can have read. A ShmpipeError otherwise: where a child may have
    been forked and read the data (the server died between its fork and its
    answer), starting it again could make two producers of one."""
    if not server.forget_if_ended(pid, SERVER_END_WAIT_S):
        if data_pipe is None and isinstance(cause, (FileNotFoundError, ConnectionRefusedError)):
            _retire(server)
            raise _ServerGone(pid, "unreachable") from cause
        if data_pipe is None or _unread_without_reader(data_pipe, nbytes):
            raise _ServerGone(pid, "dropped") from cause
        raise ShmpipeError(
            f"shmpipe's fork server (pid {pid}) did not start {name} ({cause!r}) and is still running after "
            f"{SERVER_END_WAIT_S} s"
        ) from cause
    if data_pipe is not None and not _unread_without_reader(data_pipe, nbytes):
        raise ShmpipeError(
            f"shmpipe's fork server (pid {pid}) ended while it started {name}, after it may have forked it "
            f"({cause!r}); not started again, which could make two of it"
        ) from cause
    raise _ServerGone(pid, "ended") from cause


def _unread_without_reader(fd: int, nbytes: int) -> bool:
    """Whether the pipe whose write end is `fd` has no reader left (POLLERR)
    and still holds all `nbytes` written to it: no process read any of the
    data, and none can."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)  # POLLERR is always reported
    events = poller.poll(200)  # the ended server's descriptors close as it exits: a moment
    if not any(ev & select.POLLERR for _, ev in events):
        return False
    left = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, left)
    return left[0] == nbytes


class ServerProcess(BaseProcess):
    """A producer forked from shmpipe's fork server."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _ServerPopen:  # noqa: N802 (multiprocessing's name)
        return _ServerPopen(process_obj)
