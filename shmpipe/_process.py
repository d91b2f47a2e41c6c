"""Who a process is: its pid and start time, whether it still lives, and
when it ends: the one place shmpipe asks.

A pid alone is not an identity: the kernel reuses pids. The pair (pid, start
time) is, where the start time is field 22 of /proc/<pid>/stat (clock ticks
since boot). Producers watch their consumer by it, and segment names carry
their owner's, so a dead owner's memory can be told from a live one's.

A process's end is seen by a *pidfd* (pidfd_open, Linux 5.3): a descriptor
that becomes readable when the process exits, so a thread can wait for it in
poll() beside sockets and pipes, without a timer. Nothing else tells as
well: the end of a socket or pipe the process held comes only once every
holder is gone, and a child it forked holds them all (multiprocessing's
sentinel pipe, a pipeline's control pipe, a group's socket). Where the
kernel has no pidfd (older kernels, some seccomp sandboxes), the process is
looked at in turn: its start time in /proc, or kill(pid, 0).
"""

from __future__ import annotations

import math
import os
import select
import signal
import time

__all__ = [
    "proc_kib",
    "ProcessWatch",
    "open_pidfd",
    "owner_alive",
    "owner_identity",
    "process_alive",
    "process_stopped",
    "process_start_time",
]

#: How often ProcessWatch.wait looks at a process it has no pidfd of.
FALLBACK_POLL_S = 0.25


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3 (the state) onwards of /proc/<pid>/stat; None if `pid` is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or
    # parentheses itself: split after the last ')'.
    return stat[stat.rindex(b")") + 2 :].split()


def process_group_members(pgid: int) -> list[int]:
    """The live processes (not zombies) of process group `pgid`: what is left
    of a session a benchmark or a test started and must end."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                members.append(int(entry))
    return members


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot; None if it is gone
    or a zombie (it has exited; only its exit status remains)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in (b"Z", b"X"):  # state: zombie or dead
        return None
    return int(fields[19])  # field 22 of the whole line


#: The kernel's flag on a task that has begun to exit (PF_EXITING,
#: include/linux/sched.h), in field 9 of /proc/<pid>/stat.
_PF_EXITING = 0x4


def process_ending(pid: int, start: int) -> bool:
    """Whether process (pid, start) has ended or has begun to: gone, a
    zombie, its pid another process's now, or exiting. A process that
    dies closes its descriptors (a peer reads the end of its pipe) before
    it becomes a zombie (its pidfd readable, wait() answered): from the
    start of its exit, the kernel marks it exiting."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in (b"Z", b"X") or int(fields[19]) != start:
        return True
    return bool(int(fields[6]) & _PF_EXITING)  # field 9: the task's flags


def process_stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (SIGSTOP, SIGTSTP): it runs
    nothing, not even a handler of SIGTERM, until it is continued. Not a
    tracer's stop (state "t"): strace or a sampling profiler stops a
    healthy process for moments at a time."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] == b"T"


def proc_kib(path: str, key: str) -> int | None:
    """Bytes of the `key:` line of a /proc file that counts in kB
    (/proc/meminfo's MemAvailable, /proc/self/status's VmSize); None where
    the file or the line cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def owner_identity() -> tuple[int, int]:
    """(pid, start time) of this process."""
    pid = os.getpid()
    start = process_start_time(pid)
    return pid, start if start is not None else 0


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process (pid, start) still runs."""
    return process_start_time(pid) == start


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists: kill(pid, 0), where a process of
    another user (PermissionError) exists too. A zombie exists (it has
    exited; its parent has not yet read its status). For a process whose
    start time is known, owner_alive says more: a pid can be reused."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (close-on-exec; readable once the process has
    exited), or None where the kernel has none (Linux < 5.3, a sandbox
    that forbids it) or `pid` is gone already. The caller closes it."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class ProcessWatch:
    """Watches one process: whether it is alive, and a descriptor that
    becomes readable when it ends (to wait on beside others).

    With `start` (its start time: process_start_time), the watch is of the
    process (pid, start): a pid already reused by another process is seen
    as the watched one having ended. Without, of the process that has the
    pid now, whose start time it reads: a pid taken over later, once that
    one has ended and been reaped, is that one's end (only where the start
    time cannot be read does it ask kill(pid, 0)).

    Thread-safe for alive() and wait() from any thread; close() once, when
    no thread uses the watch any more.
    """

    __slots__ = ("_ended", "_fd", "pid", "start")

    def __init__(self, pid: int, start: int | None = None) -> None:
        self.pid = pid
        self.start = start
        self._ended = False
        self._fd = open_pidfd(pid)
        # The pidfd first, the start time after: if it still matches, the
        # pidfd is of that process (it cannot change process afterwards).
        if start is not None and process_start_time(pid) != start:
            self._ended = True  # gone already, or the pid is someone else's now
            self.close()
        elif start is None:
            # The start time kept for when the pidfd is closed, or where
            # there is none: without it, alive() and send_signal() would
            # answer for whatever process has the pid then (a teardown cut
            # after it closed its watches, and run again, signals the
            # producers it finds alive). Read after the pidfd
            # opened, and kept only if the pidfd still says the process
            # runs: then what was read is its own (its pid is not freed
            # before it has ended).
            read = process_start_time(pid)
            if read is not None and (self._fd is None or self.alive()):
                self.start = read

    def fileno(self) -> int | None:
        """The pidfd: readable once the process has ended (and from then on);
        None where there is none (the kernel has no pidfds, or the process
        had already ended when the watch began): then ask alive() in turn."""
        return self._fd

    def alive(self) -> bool:
        """Whether the process still runs. An exited process whose status
        its parent has not read yet (a zombie) has ended, except where only
        kill(pid, 0) can tell (no pidfd, no start time): until it is reaped."""
        if self._ended:
            return False
        fd = self._fd
        if fd is not None:
            poller = select.poll()  # poll, not select: the descriptor may be >= 1024 (FD_SETSIZE)
            poller.register(fd, select.POLLIN)
            ended = bool(poller.poll(0))
        elif self.start is not None:
            ended = process_start_time(self.pid) != self.start
        else:
            ended = not process_alive(self.pid)
        if ended:
            self._ended = True
        return not ended

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until the process has ended (True) or `timeout` seconds
        have passed (False); None waits as long as it takes."""
        fd = self._fd
        if fd is not None and not self._ended:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))):
                self._ended = True
            return self._ended
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.alive():
            left = FALLBACK_POLL_S if deadline is None else min(FALLBACK_POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)
        return True

    def send_signal(self, sig: int) -> None:
        """Sends `sig` to the process unless it has ended: through the pidfd
        where there is one, so never to a process that reuses the pid (one
        that is not our child, such as a forkserver's, is reaped by
        another process at any moment)."""
        fd = self._fd
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            elif self.alive():
                os.kill(self.pid, sig)  # (no pidfd: the pid may be reused meanwhile)
        except ProcessLookupError:
            self._ended = True

    def close(self) -> None:
        """Closes the pidfd (alive() still answers, without it: by the start
        time, where the watch has one)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> ProcessWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ProcessWatch(pid={self.pid}, start={self.start}, fd={self._fd})"
