"""A program that restored SIGPIPE's default action (``signal.signal(SIGPIPE,
SIG_DFL)``, as tools piped into ``head`` do) is killed by a write to a pipe
or stream socket whose reader is gone. shmpipe writes to its peers (a
producer's control socket, the fork server's data pipe: _interrupts.no_sigpipe),
and a peer may die at any time: each such write is an error shmpipe handles,
never that signal. (A group's sockets are SOCK_SEQPACKET, whose writes never
raise SIGPIPE on Linux.)
Real processes and real signals, in a Python of its own (the test run's own
disposition stays as it is)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, signal, threading, time
import shmpipe
from shmpipe._interrupts import no_sigpipe
from shmpipe.testing.sources import Counter

T = 60
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
out = {}

def gone(pid, within=20.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.01)
    return False

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

# 1. The mechanism, in the main thread and in another one.
out["main"] = write_to_a_closed_pipe()
seen = {}
thread = threading.Thread(target=lambda: seen.update(write_to_a_closed_pipe()))
thread.start()
thread.join(T)
out["thread"] = seen

# 2. A producer killed: close() tells each producer to stop, the dead one's
# control socket included.
with shmpipe.from_iterators([Counter(10_000)] * 2, capacity=4, timeout=T) as pipe:
    it = iter(pipe)
    next(it)
    victim = pipe.pids[0]
    os.kill(victim, signal.SIGKILL)
    out["victim_gone"] = gone(victim)
out["closed_after_a_death"] = True

print(json.dumps(out))
"""


def test_a_program_that_restored_sigpipe_outlives_the_peers_it_writes_to():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    # -13 (SIGPIPE) before: close() told the dead producer to stop.
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    out = json.loads(proc.stdout.splitlines()[-1])
    for where in ("main", "thread"):
        assert out[where] == {"raised": True, "pending": False, "blocked_after": False}, out
    assert out["victim_gone"] and out["closed_after_a_death"], out
