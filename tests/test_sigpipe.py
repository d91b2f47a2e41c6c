"""A program that restored SIGPIPE's default action (``signal.signal(SIGPIPE,
SIG_DFL)``, as tools piped into ``head`` do) is killed by a write to a pipe
or stream socket whose reader is gone. shmpipe writes to its peers (a
producer's control socket, the fork server's socket and data pipe, a
producer's start data, multiprocessing's resource tracker: _interrupts.no_sigpipe),
and a peer may die at any time: each such write is an error shmpipe handles,
never that signal. (A group's sockets are SOCK_SEQPACKET, whose writes never
raise SIGPIPE on Linux; a start that a fork server dropped is in
tests/test_forkserver.py.) Real processes and real signals, in a Python of
its own (the test run's own disposition stays as it is)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, signal, sys, threading, time
import numpy as np
import shmpipe
from shmpipe._interrupts import no_sigpipe
from shmpipe.testing.processes import gone, wait_until
from shmpipe.testing.sources import Counter

T = 60


class Exits:
    # Unpickled in a producer before the rest of its start data: it ends
    # there, and the data past a pipe's 64 KiB is never read.
    def __reduce__(self):
        return (os._exit, (3,))


class ScriptSource:
    # __slots__: not shipped by value, so its producer imports this script
    # (multiprocessing's own start).
    __slots__ = ("exits", "padding")

    def __init__(self):
        self.exits, self.padding = Exits(), b"p" * 1_000_000

    def __call__(self):
        yield {"x": np.zeros(4)}


def ended_within(pid, within=20.0):
    return wait_until(lambda: gone(pid), within)


def write_to_a_closed_pipe():
    r, w = os.pipe()
    os.close(r)
    try:
        with no_sigpipe():
            os.write(w, b"x")
    except BrokenPipeError:
        raised = True
    else:
        raised = False
    finally:
        os.close(w)
    return {"raised": raised, "pending": signal.SIGPIPE in signal.sigpending(),
            "blocked_after": signal.SIGPIPE in signal.pthread_sigmask(signal.SIG_BLOCK, set())}


def raised_by_a_start(method):
    t0 = time.monotonic()
    try:
        with shmpipe.from_iterators([ScriptSource()], start_method=method, timeout=T) as pipe:
            list(pipe)
    except Exception as exc:
        return [type(exc).__name__, str(exc), time.monotonic() - t0]
    return None


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    out = {}
    # 1. The mechanism, in the main thread and in another one.
    out["main"] = write_to_a_closed_pipe()
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(write_to_a_closed_pipe()))
    thread.start()
    thread.join(T)
    out["thread"] = seen

    # 2. A producer killed: close() tells each producer to stop, the dead
    # one's control socket included.
    with shmpipe.from_iterators([Counter(10_000)] * 2, capacity=4, timeout=T) as pipe:
        it = iter(pipe)
        next(it)
        victim = pipe.pids[0]
        os.kill(victim, signal.SIGKILL)
        out["victim_gone"] = ended_within(victim)
    out["closed_after_a_death"] = True

    # 3. multiprocessing's resource tracker killed: the next start asks it
    # whether it runs by writing to its pipe.
    from multiprocessing import resource_tracker
    os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
    time.sleep(0.3)
    with shmpipe.from_iterators([Counter(3)], timeout=T) as pipe:
        out["after_the_tracker"] = len(list(pipe))

    # 4. A producer that ends before it read what it starts with: the write
    # of the rest fails (spawn waited for ever: its read end stayed open in
    # the trainer until the write was done).
    out["spawn"] = raised_by_a_start("spawn")
    out["forkserver"] = raised_by_a_start("forkserver")
    print(json.dumps(out))
"""


def test_a_program_that_restored_sigpipe_outlives_the_peers_it_writes_to(tmp_path):
    job = tmp_path / "sigpipe_job.py"
    job.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    # -13 (SIGPIPE) before, at 2, 3 and 4's forkserver; 4's spawn waited for ever.
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    out = json.loads(proc.stdout.splitlines()[-1])
    for where in ("main", "thread"):
        assert out[where] == {"raised": True, "pending": False, "blocked_after": False}, out
    assert out["victim_gone"] and out["closed_after_a_death"], out
    assert out["after_the_tracker"] == 3, out
    for method in ("spawn", "forkserver"):
        name, message, after_s = out[method]
        assert name == "ShmpipeError" and "ended before it read what it starts with" in message, out[method]
        assert after_s < 30, out[method]
