"""shmpipe's fork server (_forkserver): producers forked from it, a server
killed or stopped while it starts one, and a start that gives up on it.
Each server that a test stops, kills or makes misbehave is a fresh one: a
script's own, in a process of its own, or one that replaces the suite's."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import Command, SharedRuns, group_members

import shmpipe
from shmpipe.testing.processes import gone, wait_until

T = 60  # seconds: no script of these tests may take longer


def parent_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_producers_are_forked_from_shmpipes_own_server_shared_by_pipelines():
    from shmpipe import _forkserver
    from shmpipe.testing.sources import Counter

    parents = set()
    for _ in range(2):
        with shmpipe.from_iterators([Counter(2)] * 2, start_method="forkserver", timeout=T) as pipe:
            it = iter(pipe)
            next(it)
            parents |= {parent_of(pid) for pid in pipe.pids}
            assert len(list(it)) == 3
    server = _forkserver.server_pid()
    assert parents == {server} and server != os.getpid()
    with open(f"/proc/{server}/cmdline", "rb") as f:
        assert b"shmpipe._forkserver_loop import serve" in f.read()  # the standard library's loop, run by ours


@pytest.mark.parametrize("padding", [0, 200_000], ids=["small", "past-a-pipe"])
def test_a_fork_server_killed_while_it_starts_a_producer_is_replaced(padding):
    # Killed (by the OOM killer, say) after the start found it running: the
    # connection closes before it answers. The start waits for it to end,
    # and a new server starts the producer. (Stopped first, so that the
    # start is surely inside its connection when the kill lands.) A
    # producer's data past a pipe's 64 KiB is only partly written then.
    import signal
    import threading

    from shmpipe import _forkserver
    from shmpipe.testing.datasets import Numbered

    with shmpipe.from_dataset(Numbered(20), batch_size=4, num_workers=2, timeout=T) as pipe:
        assert len(list(pipe)) == 5
    old = _forkserver.server_pid()
    assert old is not None
    out: dict[str, object] = {}

    dataset = Numbered(20)
    dataset.padding = b"p" * padding  # travels with the dataset to each producer

    def run() -> None:
        try:
            with shmpipe.from_dataset(dataset, batch_size=4, num_workers=2, timeout=T) as again:
                out["ids"] = [i for b in again for i in b["i"].tolist()]
        except BaseException as exc:  # noqa: BLE001 - the test's to see
            out["error"] = exc

    os.kill(old, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "the start waits for the stopped server's answer"
    finally:
        os.kill(old, signal.SIGKILL)
    thread.join(T)
    assert not thread.is_alive()
    assert out.get("error") is None, repr(out.get("error"))
    assert out["ids"] == list(range(20))
    assert _forkserver.server_pid() not in (None, old)


#: Requests to the fork server that a trainer ended mid-start leaves (cut
#: before its descriptors; its data cut before or inside the pickle), one
#: that is not a trainer's (too few descriptors, none, four of the wrong
#: kinds), and one that never comes: each is dropped or its child ends, and the same server
#: serves the next pipeline. The script prints what it saw as JSON.
BAD_REQUESTS_SCRIPT = """
import json, os, socket, sys, time
from multiprocessing import forkserver, reduction
import shmpipe
from shmpipe import _forkserver
from shmpipe.testing.sources import Counter

def batches():
    with shmpipe.from_iterators([Counter(2)] * 2, start_method="forkserver", timeout=TIMEOUT) as pipe:
        return len(list(pipe))

def connected():
    s = socket.socket(socket.AF_UNIX)
    s.connect(_forkserver._SERVER._forkserver_address)
    return s

def child_exit(data):
    status, child_data = _forkserver._SERVER.connect_to_new_process([])
    forkserver.read_signed(status)  # the child's pid: it was forked
    os.write(child_data, data)
    os.close(child_data)
    code = forkserver.read_signed(status)
    os.close(status)
    return code

out = {"first": batches()}
server = _forkserver.server_pid()
if sys.argv[1] == "idle":
    held = connected()  # and sends nothing
    t0 = time.monotonic()
    out["meanwhile"] = batches()
    out["waited_s"] = time.monotonic() - t0
    held.close()
else:
    connected().close()
    with connected() as s:
        r, w = os.pipe()
        reduction.sendfds(s, [r, w])
        os.close(r), os.close(w)
    with connected() as s:
        s.sendmsg([b"x"])
    with connected() as s:  # four descriptors, of the wrong kinds (the server writes on the second)
        r, w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        reduction.sendfds(s, [r, r, null, null])
        os.close(r), os.close(w), os.close(null)
    out["children"] = [child_exit(b""), child_exit(b"\\x80\\x04\\x95\\xff\\x00")]
out["after"] = batches()
out["same_server"] = _forkserver.server_pid() == server and os.path.exists(f"/proc/{server}")
print(json.dumps(out), flush=True)
""".replace("TIMEOUT", str(T))


@pytest.mark.parametrize("case", ["cut-or-malformed", "idle"])
def test_the_fork_server_outlives_requests_cut_short_malformed_or_never_sent(request, case):
    # The standard library's loop ended the server with a traceback on the
    # first four requests (EOFError, ValueError, RuntimeError, OSError), its
    # children printed their unpickling errors, and a client that connected
    # and sent nothing held up every later start for ever.
    import json

    from shmpipe._forkserver_loop import REQUEST_WAIT_S

    proc, _ = SCRIPTS.get(request, ("bad requests", case))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert out["first"] == out["after"] == 4 and out["same_server"], out
    if case == "idle":
        assert out["meanwhile"] == 4 and out["waited_s"] >= REQUEST_WAIT_S - 0.5, out
    else:
        assert out["children"] == [1, 1], out


#: A trainer whose thread is held between its connect to the fork server
#: and its request (a debugger, a stop, another thread keeping the GIL)
#: for longer than the server waits: the server drops the request, and
#: the start asks the same server again.
HELD_START_SCRIPT = """
import json, signal, sys, time
import shmpipe
from shmpipe import _forkserver
from shmpipe._forkserver_loop import REQUEST_WAIT_S
from shmpipe.testing.sources import Counter

def held_at_the_request(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "sendfds":
        sys.setprofile(None)
        time.sleep(REQUEST_WAIT_S + 1)

def batches():
    with shmpipe.from_iterators([Counter(2)], start_method="forkserver", timeout=TIMEOUT) as pipe:
        return len(list(pipe))

# With SIGPIPE's default action (tests/test_sigpipe.py): the request's write
# to a server that dropped the connection killed the trainer (-13).
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
out = {"first": batches()}
server = _forkserver.server_pid()
sys.setprofile(held_at_the_request)
out["held"] = batches()
out["same_server"] = _forkserver.server_pid() == server
print(json.dumps(out), flush=True)
""".replace("TIMEOUT", str(T))


def test_a_start_held_past_the_servers_wait_asks_the_same_server_again(request):
    # Before: the server waited for ever for it (and every later start
    # behind it); with the wait and no retry, a ShmpipeError blaming the
    # server ("did not start ... still running after 2 s").
    import json

    proc, _ = SCRIPTS.get(request, ("held start",))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"first": 2, "held": 2, "same_server": True}, out
    assert "Traceback" not in proc.stderr, proc.stderr


#: The fork server's socket removed while it runs (systemd-tmpfiles removes
#: what is older than 10 days from /tmp: a long job's next start met it),
#: or its whole folder (tmpreaper; systemd-tmpfiles, the folder once old).
SOCKET_REMOVED_SCRIPT = """
import json, os, shutil, sys
import shmpipe
from shmpipe import _forkserver
from shmpipe.testing.sources import Counter

def batches():
    with shmpipe.from_iterators([Counter(2)] * 2, start_method="forkserver", timeout=TIMEOUT) as pipe:
        return len(list(pipe))

out = {"first": batches()}
old = _forkserver.server_pid()
address = _forkserver._SERVER._forkserver_address
os.unlink(address) if sys.argv[1] == "socket" else shutil.rmtree(os.path.dirname(address))
out["after"] = batches()
new = _forkserver.server_pid()
out["new_server"] = new not in (None, old)
out["old_runs_on"] = os.path.exists(f"/proc/{old}")
print(json.dumps(out), flush=True)
print(old, new, os.path.dirname(address), flush=True)
""".replace("TIMEOUT", str(T))


@pytest.mark.parametrize("removed", ["socket", "folder"])
def test_a_fork_server_whose_socket_was_removed_is_replaced(request, removed):
    # Before: "ShmpipeError: shmpipe's fork server (pid N) did not start
    # shmpipe-producer-0 (FileNotFoundError...) and is still running after
    # 2.0 s", for every later start of the process; the folder removed, the
    # new server's bind failed too (a bare FileNotFoundError).
    import json

    proc, _ = SCRIPTS.get(request, ("removed", removed))
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, stderr
    lines = stdout.strip().splitlines()
    assert json.loads(lines[-2]) == {"first": 4, "after": 4, "new_server": True, "old_runs_on": True}, lines
    *servers, folder = lines[-1].split()
    servers = [int(pid) for pid in servers]
    assert not os.path.exists(folder), "the process's exit removes multiprocessing's folder, made again"
    assert wait_until(lambda: all(gone(pid) for pid in servers), 10.0)  # both end with the trainer
    assert "Traceback" not in stderr, stderr


#: A transport whose unpickling in each producer raises an EOFError of its
#: own (a cache file left empty): the user's error, printed by the child,
#: not taken for a start's data cut short.
FAILING_TRANSPORT = """
import pickle
from shmpipe.transports.shm import ShmTransport

class CachedShm(ShmTransport):
    def __init__(self, cache):
        super().__init__()
        self.cache = cache

    def __setstate__(self, state):
        self.__dict__.update(state)
        with open(self.cache, "rb") as f:
            self.table = pickle.load(f)
"""

FAILING_TRANSPORT_SCRIPT = """
import shmpipe
from shmpipe.testing.sources import Counter
from cached_shm import CachedShm

open("empty.pkl", "wb").close()
try:
    with shmpipe.from_iterators([Counter(2)], transport=CachedShm("empty.pkl"), start_method="forkserver",
                                timeout=TIMEOUT) as pipe:
        print("batches", len(list(pipe)))
except shmpipe.ShmpipeError as exc:
    print(type(exc).__name__, exc)
""".replace("TIMEOUT", str(T))


def test_an_error_of_the_users_code_as_a_producer_is_unpickled_is_still_printed(tmp_path):
    (tmp_path / "cached_shm.py").write_text(FAILING_TRANSPORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_TRANSPORT_SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=T,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("WorkerDiedError") and "exited early with exit code 1" in proc.stdout, proc.stdout
    assert "cached_shm.py" in proc.stderr and "EOFError" in proc.stderr, proc.stderr


#: A trainer whose SIGTERM handler ends it (sys.exit) as it starts a
#: replacement: the signal is raised at the first call of `where` in that
#: start (between its connect and its descriptors, or as it writes the
#: child's data).
EXIT_MID_START_SCRIPT = """
import os, signal, sys
import shmpipe
from shmpipe.testing.sources import Counter

def handler(sig, frame):
    sys.exit(3)

def raise_at_first(where):
    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == where:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)
    return hook

signal.signal(signal.SIGTERM, handler)
pipe = shmpipe.from_iterators([Counter(50)] * 2, start_method="forkserver", timeout=TIMEOUT, max_restarts=1)
it = iter(pipe)
next(it)
os.kill(pipe.pids[0], signal.SIGKILL)
sys.setprofile(raise_at_first(sys.argv[1]))
for batch in it:
    pass
""".replace("TIMEOUT", str(T))


@pytest.mark.parametrize("where", ["sendfds", "until_ready"])
def test_a_trainer_that_exits_in_the_middle_of_a_start_leaves_no_traceback_and_nothing_running(tmp_path, where):
    # Before: the server died of the request cut short and printed its
    # EOFError (sendfds), or the child printed its unpickling error.
    proc, _, err = _run_in_a_session(tmp_path, EXIT_MID_START_SCRIPT, where)
    assert proc.returncode == 3, err
    assert wait_until(lambda: not group_members(proc.pid), 10.0)  # (its session: its process group too)
    assert "Traceback" not in err, err


def _run_in_a_session(tmp_path, script, *args):
    """Runs `script` with `args` in a new Python process, in a session of
    its own (killed whole if it outlasts T): the process, its stdout and
    stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=T)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc, stdout, stderr


#: A source whose module, preloaded by the fork server, makes the server die
#: the first time it is about to answer with a child's pid: after the fork,
#: the child reading its data meanwhile (the window an OOM kill could hit).
DYING_SERVER = """
import os, signal, sys, time

if sys.argv and sys.argv[0] == "-c" and os.environ.get("KILL_MARKER"):  # in the fork server
    import multiprocessing.forkserver as forkserver
    answer = forkserver.write_signed

    def dies_first(fd, n):
        if not os.path.exists(os.environ["KILL_MARKER"]):
            open(os.environ["KILL_MARKER"], "w").close()
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        return answer(fd, n)

    forkserver.write_signed = dies_first


class Source:
    def __init__(self, log):
        self.log = log

    def __call__(self):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        for seq in range(6):
            time.sleep(0.05)
            yield {"seq": seq}
"""

DYING_SERVER_SCRIPT = """
import sys
import shmpipe
from dying_server import Source

if __name__ == "__main__":
    try:
        with shmpipe.from_iterators([Source(sys.argv[1])] * 2, ordered=True, timeout=20) as pipe:
            print("batches", len(list(pipe)))
    except shmpipe.ShmpipeError as exc:
        print(type(exc).__name__, exc)
"""


def test_a_fork_server_killed_after_it_forked_a_producer_does_not_start_it_twice(tmp_path):
    # The child may run (it read its data): starting it again from a new
    # server would make two producers of one, sharing its control pipe (the
    # pass stalled). A clear error instead, and the orphan ends with its
    # consumer.
    (tmp_path / "dying_server.py").write_text(DYING_SERVER)
    (tmp_path / "run.py").write_text(DYING_SERVER_SCRIPT)
    log = tmp_path / "producers"
    env = {**os.environ, "KILL_MARKER": str(tmp_path / "killed"), "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "run.py", str(log)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "killed").exists(), "the server did not reach its answer"
    assert out.stdout.startswith("ShmpipeError"), out.stdout + out.stderr
    assert "ended while it started shmpipe-producer-0" in out.stdout and "not started again" in out.stdout
    pids = [int(p) for p in log.read_text().split()] if log.exists() else []
    assert len(pids) <= 1, f"producer 0 started twice: {pids}"
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids), "the orphaned producer outlived its consumer"


#: The sources of the stopped-server tests. Their module, preloaded by each
#: fork server (a `python -c` process), logs each child the server forks.
#: It stops the server (as SIGSTOP, or Ctrl-Z of its process group, would
#: stop it at any moment) as it imports it, with STOP_SERVER set (a start
#: in the background then waits for an answer that does not come), or at
#: its next fork once the file STOP_AT_FORK names exists (the start has
#: connected, and waits in its write or its read). With SLOW_SERVER it
#: makes the server's boot take that long (a preload that imports a heavy
#: framework).
STOPPING_SERVER = """
import os, signal, sys, time
import numpy as np

if sys.argv[:1] == ["-c"]:  # in the fork server, which preloads this module
    fork = os.fork

    def logged_fork():
        marker = os.environ.get("STOP_AT_FORK", "")
        if os.path.exists(marker):
            os.remove(marker)
            os.kill(os.getpid(), signal.SIGSTOP)
        pid = fork()
        if pid:
            with open(os.environ["FORK_LOG"], "a") as f:
                f.write(f"{pid}\\n")
        return pid

    os.fork = logged_fork
    if os.environ.get("STOP_SERVER"):
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(float(os.environ.get("SLOW_SERVER", "0")))


class Data:
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"i": np.array(i)}


class Source:
    def __init__(self, padding=0, batches=3, pause=0.0):
        self.padding = b"p" * padding  # travels with it: past a pipe's 64 KiB, the start's write waits for the child
        self.batches, self.pause = batches, pause

    def __call__(self):
        for i in range(self.batches):
            time.sleep(self.pause)
            yield {"x": np.arange(4) + i}
"""

#: Each case prints one JSON line: what the pipeline raised, after how
#: long, and what the server forked once it was continued, and whether
#: those children ended.
STOPPING_SERVER_SCRIPT = """
import json, os, signal, sys, threading, time
import shmpipe
from shmpipe import _forkserver
from stopping_server import Data, Source

def forked():
    try:
        with open(os.environ["FORK_LOG"]) as f:
            return f.read().split()
    except FileNotFoundError:
        return []

def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (reaped since the open: ESRCH)
        return False

def stop(pid):
    # SIGSTOP takes effect once the kernel next runs the process, a moment
    # after kill() returns on a busy machine: until then /proc says it runs,
    # and a start connects and writes (seen: 1 of 10 runs, a child forked).
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)

def warm_up():  # the server runs
    with shmpipe.from_iterators([Source()], timeout=TIMEOUT) as pipe:
        out["before"] = sum(1 for _ in pipe)

def stop_at_next_fork():
    open(os.environ["STOP_AT_FORK"], "w").close()

def restart_case():
    # a producer dies; the server stops as it forks its replacement
    pipe = shmpipe.from_iterators([Source(batches=200, pause=0.02)] * 2, timeout=2, max_restarts=1)
    it = iter(pipe)
    next(it)
    stop_at_next_fork()
    os.kill(pipe.pids[0], signal.SIGKILL)
    try:
        for _ in it:
            pass
    finally:
        out["restarts"] = list(pipe.stats().restarts)
        t_close = time.monotonic()
        pipe.close()
        out["close_s"] = time.monotonic() - t_close

if __name__ == "__main__":
    # No collection closes what a start that gave up left open (its
    # traceback's frames keep them): the start must close them itself.
    import gc
    gc.disable()
    case = sys.argv[1]
    out = {}
    if case not in ("dataset", "slow"):
        warm_up()
    t = time.monotonic()
    try:
        if case == "dataset":  # stopped as it boots: the start in the background waits
            os.environ["STOP_SERVER"] = "1"
            pipe = shmpipe.from_dataset(Data(), batch_size=4, num_workers=2, timeout=2)
            try:
                out["batches"] = sum(1 for _ in pipe)
            finally:
                t_close = time.monotonic()
                pipe.close()
                out["close_s"] = time.monotonic() - t_close
        elif case == "restart":
            restart_case()
        else:
            padding = 200_000 if case == "at-fork-past-a-pipe" else 0
            if case.startswith("at-fork"):
                stop_at_next_fork()  # the start connects, writes, then waits
            elif case != "slow":
                stop(_forkserver.server_pid())  # the start waits before it connects
            if case in ("ctrl-c", "own-handler"):
                if case == "own-handler":  # the program's own: it decides, after the start, as before
                    signal.signal(signal.SIGINT, lambda *a: out.setdefault("handled", time.monotonic() - t))
                    threading.Timer(2.0, os.kill, (_forkserver.server_pid(), signal.SIGCONT)).start()
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
            timeout = None if case in ("ctrl-c", "own-handler") else 1 if case == "slow" else 2
            with shmpipe.from_iterators([Source(padding)] * 2, timeout=timeout) as pipe:
                out["batches"] = sum(1 for _ in pipe)
    except BaseException as exc:
        out["raised"] = [type(exc).__name__, str(exc)]
    out["after_s"] = time.monotonic() - t
    server = _forkserver.server_pid()
    before = len(forked())
    try:
        out["stopped"] = open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[0] == "T"
    finally:
        os.kill(server, signal.SIGCONT)  # (stopped, it would hold this script's output open)
    # It answers a start that gave up after it connected now: the child it
    # forks reads a cut pickle, or finds its control pipe closed, and ends.
    # (The starts of "stopped" and "ctrl-c" never connected; none gave up in
    # "slow" and "own-handler": nothing to wait for.)
    new, left = [], []
    deadline = time.monotonic() + {"stopped": 3, "ctrl-c": 3, "slow": 0, "own-handler": 0}.get(case, 10)
    while time.monotonic() < deadline:
        time.sleep(0.02)
        new = forked()[before:]
        left = [pid for pid in new if running(int(pid))]
        if new and not left:
            break
    out["children_forked"], out["children_left"] = len(new), left
    with shmpipe.from_iterators([Source()] * 2, timeout=TIMEOUT) as pipe:
        out["after_continue"] = sum(1 for _ in pipe)
    print(json.dumps(out))
""".replace("TIMEOUT", str(T))


def _stopping_server_command(folder, case):
    (folder / "stopping_server.py").write_text(STOPPING_SERVER)
    (folder / "run.py").write_text(STOPPING_SERVER_SCRIPT)
    env = {
        **os.environ, "FORK_LOG": str(folder / "forked"), "STOP_AT_FORK": str(folder / "stop-at-fork"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
        **({"SLOW_SERVER": "3"} if case == "slow" else {}),
    }
    return Command([sys.executable, "run.py", case], cwd=folder, env=env, timeout=T)


def _stopping_server(request, case):
    """What the stopped-server script printed for `case`, and its stderr."""
    import json

    proc, _ = SCRIPTS.get(request, ("stopping server", case))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("case", ["stopped", "at-fork", "at-fork-past-a-pipe", "dataset", "ctrl-c", "restart"])
def test_a_start_gives_up_on_a_stopped_fork_server(request, case):
    # The server's socket and pipes are buffered: a stopped server fails
    # nothing, and the start waited for its answer forever (and the close()
    # that waits for a start, and a Ctrl-C). Now: stopped for the pipeline's
    # timeout, a start from the caller's thread fails, whether it waits to
    # connect, to write (past a pipe's 64 KiB) or to read the answer
    # (from_iterators: the constructor; a producer's replacement: the death
    # stands, no restart counted); a start in the background is abandoned
    # by close() at once (from_dataset: the trainer makes batches, then its
    # next() times out); a Ctrl-C ends it where there is no timeout. What
    # the server forks once it goes on ends by itself (a start that had
    # connected: one child), and it starts the next pipeline.
    out, stderr = _stopping_server(request, case)
    assert out["stopped"], f"the server was not stopped at the end: {out}"
    name, message = out["raised"]
    if case in ("stopped", "at-fork", "at-fork-past-a-pipe"):
        assert name == "PipelineTimeoutError", out
        assert "has been stopped (SIGSTOP, or Ctrl-Z of its process group) for the pipeline's timeout of 2" in message
        assert "kill -CONT" in message
        assert 2.0 <= out["after_s"] < 2.0 + 10, out
    elif case == "dataset":
        assert name == "PipelineTimeoutError" and "still starting" in message, out
        assert "fork server (pid" in message and "is stopped" in message and "kill -CONT" in message, out
        assert out["close_s"] < 5, f"close() waited for the stopped server: {out}"
    elif case == "ctrl-c":
        assert name == "KeyboardInterrupt", out
        assert 1.0 <= out["after_s"] < 1.0 + 10, out
    else:
        assert name == "WorkerDiedError", out
        assert "its replacement did not start" in message and "has been stopped" in message, out
        assert out["restarts"] == [0, 0], out  # none counted: none replaced
        assert out["after_s"] < 2.0 + 10, out
    if case in ("stopped", "ctrl-c"):
        assert out["children_forked"] == 0, out  # the start never connected
    elif case != "dataset":  # (there, stopped before or after the start connected)
        assert out["children_forked"] == 1, out
    assert out["children_left"] == [], f"a child of the server outlived the start that gave up: {out}"
    assert out["after_continue"] == 6, out


def test_a_start_waits_for_a_slow_fork_server_and_for_the_programs_own_ctrl_c_handler(request):
    # Not given up: a server whose boot outlasts the timeout (a preload that
    # imports torch), and a Ctrl-C that goes to the program's own handler
    # (it decides what a press does, after the start, as before; the server
    # continued after 2 s): the pipeline is made and runs.
    out, _ = _stopping_server(request, "slow")
    assert "raised" not in out and out["batches"] == 6, out
    assert out["after_s"] >= 3, out
    out, _ = _stopping_server(request, "own-handler")
    assert "raised" not in out and out["batches"] == 6, out
    assert 1.0 <= out["handled"] < out["after_s"], out


#: A producer killed while the fork server is stopped, before the pipeline's
#: first batch: its exit status waits in the server, so its death is found
#: as the ring opens (the attach it no longer reads).
DIED_BEFORE_ATTACH_SCRIPT = """
import json, os, signal, sys, threading, time, warnings
import multiprocessing.context
import numpy as np
import shmpipe
from shmpipe import _forkserver

def source():
    for i in range(20):
        time.sleep(0.01)
        yield {"x": np.full(4, i)}

if __name__ == "__main__":
    continue_after, timeout = float(sys.argv[1]), float(sys.argv[2])
    producers, killed = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 3 else (3, 1)
    with shmpipe.from_iterators([source], timeout=TIMEOUT) as pipe:
        sum(1 for _ in pipe)  # the server runs
    server = _forkserver.server_pid()
    if "keep-ends" in sys.argv[5:]:  # as a server stopped before closing its copies as it forked them would
        real_pipe = multiprocessing.context.ForkServerContext.Pipe
        kept = []

        def keeping_a_copy(self, duplex=True):
            parent_end, child_end = real_pipe(self, duplex)
            kept.append(os.dup(child_end.fileno()))
            return parent_end, child_end

        multiprocessing.context.ForkServerContext.Pipe = keeping_a_copy
    pipe = shmpipe.from_iterators([source] * producers, timeout=timeout, max_restarts=1)
    os.kill(server, signal.SIGSTOP)
    for pid in pipe.pids[:killed]:
        os.kill(pid, signal.SIGKILL)
    goes_on = threading.Timer(continue_after, os.kill, (server, signal.SIGCONT))
    goes_on.daemon = True
    goes_on.start()
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        try:
            out["got"] = sorted(int(b["x"][0]) for b in pipe)
        except Exception as exc:
            out["raised"] = [type(exc).__name__, str(exc)]
        out["raised_after_s"] = time.monotonic() - t0
    out["warnings"] = [str(w.message) for w in caught]
    out["restarts"] = list(pipe.stats().restarts)
    pipe.close()
    if "leave-stopped" not in sys.argv[5:]:
        os.kill(server, signal.SIGCONT)
    print(json.dumps(out), flush=True)
""".replace("TIMEOUT", str(T))


@pytest.mark.parametrize("continued", [True, False], ids=["continued", "still-stopped"])
def test_a_producer_dead_before_the_ring_opens_is_replaced_and_a_late_exit_status_is_named(request, continued):
    # Found dead as the ring opened, it was the pipeline's failure at once,
    # whatever max_restarts said ("its control connection closed while it
    # was still running"): now it is replaced there too, as at a pass's
    # start. While the server stays stopped, the death says its exit status
    # is late and why, and that its replacement did not start.
    import json

    proc, _ = SCRIPTS.get(request, ("died before attach", *(("0.5", "10", 3, 1) if continued else ("30", "2", 3, 1))))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if continued:
        assert out.get("got") == sorted(list(range(20)) * 3), out
        assert out["restarts"] == [1, 0, 0], out
        # It died before its first batch: its replacement starts there
        # (the warning once said "after its batch -1").
        assert any("replaced by pid" in w and "goes on from its first batch" in w for w in out["warnings"]), out
    else:
        name, message = out["raised"]
        assert name == "WorkerDiedError", out
        assert "its exit status has not come: shmpipe's fork server" in message, out
        assert "is stopped" in message and "its replacement did not start" in message, out
        assert out["restarts"] == [0, 0, 0], out


def test_producers_found_dead_while_the_server_is_stopped_are_told_within_the_timeout(request):
    # With the fork server stopped, a producer's exit status (which the
    # server sends) cannot come: each death found as the ring opened waited
    # GRACE_S (1 s) for it, one after the other; the restart waited for it
    # again, and the shutdown a third time. One death was told 5.1 s after
    # the first next() with timeout=2, four 8.2 s. Now none is waited for:
    # the replacement's start, given up after the timeout, is the wait.
    import json

    took = {}
    for producers, killed in ((3, 1), (5, 4)):
        proc, _ = SCRIPTS.get(request, ("died before attach", "30", "2", producers, killed))
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["raised"][0] == "WorkerDiedError" and "exit status has not come" in out["raised"][1], out
        took[killed] = out["raised_after_s"]
    assert took[1] < 2 + 1.5 and took[4] < 2 + 1.5, took


def test_a_producer_that_ended_while_the_server_is_stopped_is_found_by_its_pidfd(request):
    # Where another copy of its end of the control pipe lives (a server
    # stopped before it closed its own as it forked the producer: 1 in 6
    # runs of the case above beside two busy loops), the pipe cannot say
    # so: the death was a PipelineTimeoutError after the timeout, the dead
    # producer named only in its words. The health check asks the pidfd.
    import json

    proc, _ = SCRIPTS.get(request, ("died before attach", "30", "2", 3, 1, "keep-ends"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    name, message = out["raised"]
    assert name == "WorkerDiedError", out
    assert "its exit status has not come: shmpipe's fork server" in message, out
    assert "its replacement did not start" in message, out


#: A trainer forked from a process that had made multiprocessing's folder
#: (as a Manager or a Listener makes it) inherits it by name, and its fork
#: server's socket goes there: once the trainer and its server have ended,
#: the folder is still its maker's.
INHERITED_FOLDER_SCRIPT = """
import json, os, sys, time
from multiprocessing import util

folder = util.get_temp_dir()
pid = os.fork()
if pid == 0:
    import shmpipe
    from shmpipe import _forkserver
    from shmpipe.testing.sources import Counter

    with shmpipe.from_iterators([Counter(2)], start_method="forkserver", timeout=TIMEOUT) as pipe:
        count = len(list(pipe))
    with open(sys.argv[1], "w") as f:
        json.dump({"count": count, "server": _forkserver.server_pid(),
                   "address": _forkserver._SERVER._forkserver_address}, f)
    sys.exit(0)
os.waitpid(pid, 0)
with open(sys.argv[1]) as f:
    child = json.load(f)
deadline = time.monotonic() + TIMEOUT
while os.path.exists(f"/proc/{child['server']}") and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({**child, "folder": folder, "server_ended": not os.path.exists(f"/proc/{child['server']}"),
                  "folder_kept": os.path.isdir(folder), "socket_left": os.path.exists(child["address"])}))
""".replace("TIMEOUT", str(T))


#: A process forked from a trainer with a fork server makes pipelines of
#: its own; then the trainer's server is killed and the trainer's next
#: pipeline starts a new one.
FORKED_AND_REPLACED_SCRIPT = """
import json, os, signal, sys, time
import shmpipe
from shmpipe import _forkserver
from shmpipe.testing.sources import Counter

def batches():
    with shmpipe.from_iterators([Counter(2)], start_method="forkserver", timeout=TIMEOUT) as pipe:
        return len(list(pipe))

out = {"first": batches()}
server, address = _forkserver.server_pid(), _forkserver._SERVER._forkserver_address
pid = os.fork()
if pid == 0:
    code = 0
    try:
        got = batches()
        with open(sys.argv[1], "w") as f:
            json.dump({"child": got, "child_server": _forkserver.server_pid()}, f)
    except BaseException as exc:
        with open(sys.argv[1], "w") as f:
            json.dump({"child_error": repr(exc)}, f)
        code = 1
    os._exit(code)
_, status = os.waitpid(pid, 0)
with open(sys.argv[1]) as f:
    out.update(json.load(f))
out["server_kept"] = _forkserver.server_pid() == server and os.path.exists(address)
os.kill(server, signal.SIGKILL)
deadline = time.monotonic() + TIMEOUT
while time.monotonic() < deadline:
    with open(f"/proc/{server}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended; the next start reaps it
            break
    time.sleep(0.02)
out["after"] = batches()
out["replaced"] = _forkserver.server_pid() not in (None, server)
out["old_socket_left"] = os.path.exists(address)
print(json.dumps(out), flush=True)
""".replace("TIMEOUT", str(T))


def test_a_forked_process_starts_its_own_server_and_a_dead_servers_socket_goes(tmp_path):
    # A process forked from a trainer with a fork server failed every
    # forkserver pipeline (ChildProcessError: it asked the kernel about its
    # parent's server); and a server killed left its socket in the trainer's
    # folder, which outlived the trainer (helper 101).
    import json

    script = tmp_path / "forked.py"
    script.write_text(FORKED_AND_REPLACED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "child.json")], capture_output=True,
                          text=True, timeout=3 * T, env=env, cwd=tmp_path, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == out["child"] == out["after"] == 2, out
    assert out["server_kept"] and out["replaced"] and not out["old_socket_left"], out
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12 and later run the standard library's loop")
def test_a_server_of_a_forked_trainer_leaves_the_folder_it_inherited(tmp_path):
    import json

    script = tmp_path / "inherited.py"
    script.write_text(INHERITED_FOLDER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "child.json")], capture_output=True,
                          text=True, timeout=2 * T, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["count"] == 2 and out["server_ended"], out
    assert os.path.dirname(out["address"]) == out["folder"], out  # the server's socket went in the inherited folder
    assert out["folder_kept"] and not out["socket_left"], out  # its own socket removed, the folder left to its maker
    assert "Traceback" not in proc.stderr, proc.stderr  # the maker's exit removed the folder as ever


def test_a_program_whose_fork_server_stays_stopped_still_exits(tmp_path):
    # The interpreter's exit joins each of multiprocessing's children without
    # a limit (multiprocessing.util._exit_function): a producer whose exit
    # status waited in the stopped fork server held the program's end until
    # the server was continued, for ever if it never was (faulthandler: the
    # exit blocked in popen_forkserver's poll). Producers in that state are
    # now let go (the server, their parent, reaps them once continued).
    import signal

    from conftest import end_group

    (tmp_path / "run.py").write_text(DIED_BEFORE_ATTACH_SCRIPT)
    # Into a file: the stopped server holds the program's stdout as well.
    with open(tmp_path / "out.txt", "w+") as output:
        proc = subprocess.Popen(
            [sys.executable, "run.py", "600", "2", "3", "1", "leave-stopped"],
            cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # The stopped server, continued, ends by itself (its program is
            # gone): else the grace below is waited out to the end.
            try:
                os.killpg(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            end_group(proc, grace=2)  # whatever is left
        output.seek(0)
        out = output.read()
    assert rc == 0, f"the program did not end within 30 s (exit status {rc}); it printed {out!r}"
    assert '"raised": ["WorkerDiedError"' in out, out


@pytest.mark.parametrize("max_restarts", [0, 2])
def test_producers_that_outlive_their_fork_server_are_not_taken_for_dead(max_restarts):
    # The server sends each child's exit status. Killed (the OOM killer's
    # pick, say), it left multiprocessing's poll saying 255 at once for
    # producers that ran on: the next pass failed with a WorkerDiedError
    # ('exit code 255') or, with max_restarts, replaced live producers that
    # still wrote (48 batches where 24 were due, then CorruptChannelError).
    # Now each one's own end is waited for; one that then dies is told as
    # such, its status gone with the server, and is replaced by a new one.
    import signal
    import warnings

    from shmpipe import _forkserver
    from shmpipe._process import ProcessWatch
    from shmpipe.testing.sources import Counter

    def seen(pipe):
        return sorted((int(b["worker"]), int(b["seq"])) for b in pipe)

    with shmpipe.from_iterators([Counter(12, delay=0.005)] * 2, timeout=T, max_restarts=max_restarts) as pipe:
        every = seen(pipe)
        assert len(every) == 24
        server = _forkserver.server_pid()
        with ProcessWatch(server) as watch:
            os.kill(server, signal.SIGKILL)
            assert watch.wait(10)
        assert seen(pipe) == every  # the producers ran on
        assert list(pipe.stats().restarts) == [0, 0]
        os.kill(pipe.pids[0], signal.SIGKILL)
        if max_restarts == 0:
            with pytest.raises(shmpipe.WorkerDiedError, match="its exit status went with the server"):
                seen(pipe)
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert seen(pipe) == every  # from a new server
            assert any("its exit status went with the server" in str(w.message) for w in caught)
            assert list(pipe.stats().restarts) == [1, 0]


def test_a_child_of_a_killed_server_polled_from_two_threads_is_not_taken_for_dead():
    # multiprocessing polls every child from whichever thread starts a
    # process (_cleanup). With the server killed, one poll swapped the
    # child's pidfd in while another, woken by the pipe's end, set 255 for
    # a child that ran on (helper 26: 9 of 10 trials); with the server
    # alive, the second read could overwrite a real status with 255.
    import signal
    import threading

    from shmpipe import _forkserver
    from shmpipe._process import ProcessWatch

    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # threads trade places often: the window opens
    try:
        for _ in range(5):
            p = _forkserver.ServerProcess(target=time.sleep, args=(60,), daemon=True)
            p.start()
            server = p._popen.server_pid
            stop = threading.Event()
            seen: list[int] = []

            def poll(p=p, stop=stop, seen=seen):
                while not stop.is_set() and p.exitcode is None:
                    pass
                if p.exitcode is not None:
                    seen.append(p.exitcode)

            threads = [threading.Thread(target=poll) for _ in range(3)]
            for t in threads:
                t.start()
            with ProcessWatch(server) as watch:
                os.kill(server, signal.SIGKILL)
                assert watch.wait(10)
            time.sleep(0.2)  # every poller has seen the server's end
            stop.set()
            for t in threads:
                t.join(10)
            assert seen == [] and p.exitcode is None and p.is_alive(), seen
            os.kill(p.pid, signal.SIGKILL)  # its own end is seen now, its status lost with the server
            p.join(10)
            assert p.exitcode == 255 and _forkserver.status_lost(p) is not None
    finally:
        sys.setswitchinterval(switch)


# -- the scripts of these tests, run together -----------------------------------------

def _command(key, folder):
    kind, *args = key
    if kind == "stopping server":
        command = _stopping_server_command(folder, *args)
    elif kind == "died before attach":
        (folder / "run.py").write_text(DIED_BEFORE_ATTACH_SCRIPT)
        command = Command([sys.executable, "run.py", *map(str, args)], cwd=folder, timeout=T)
    else:
        script = {"bad requests": BAD_REQUESTS_SCRIPT, "held start": HELD_START_SCRIPT}.get(kind, SOCKET_REMOVED_SCRIPT)
        command = Command([sys.executable, "-c", script, *args], cwd=folder, timeout=T,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    command.seconds = SECONDS.get(key, 2.0)
    return command


#: About how long the longer scripts take alone (seconds): the longest start first.
SECONDS = {
    ("held start",): 8.0, ("stopping server", "slow"): 6.0, ("stopping server", "stopped"): 5.5,
    ("bad requests", "idle"): 5.0, ("stopping server", "ctrl-c"): 4.5, ("stopping server", "own-handler"): 3.0,
}

#: The script(s) each test of the family runs (see their calls of SCRIPTS.get).
_KEYS = {
    "test_the_fork_server_outlives_requests_cut_short_malformed_or_never_sent": lambda p: [("bad requests", p["case"])],
    "test_a_start_held_past_the_servers_wait_asks_the_same_server_again": lambda p: [("held start",)],
    "test_a_fork_server_whose_socket_was_removed_is_replaced": lambda p: [("removed", p["removed"])],
    "test_a_start_gives_up_on_a_stopped_fork_server": lambda p: [("stopping server", p["case"])],
    "test_a_start_waits_for_a_slow_fork_server_and_for_the_programs_own_ctrl_c_handler":
        lambda p: [("stopping server", "slow"), ("stopping server", "own-handler")],
    "test_a_producer_dead_before_the_ring_opens_is_replaced_and_a_late_exit_status_is_named":
        lambda p: [("died before attach", *(("0.5", "10", 3, 1) if p["continued"] else ("30", "2", 3, 1)))],
    "test_a_producer_that_ended_while_the_server_is_stopped_is_found_by_its_pidfd":
        lambda p: [("died before attach", "30", "2", 3, 1, "keep-ends")],
    "test_producers_found_dead_while_the_server_is_stopped_are_told_within_the_timeout":
        lambda p: [("died before attach", "30", "2", 3, 1), ("died before attach", "30", "2", 5, 4)],
}

#: These scripts mostly wait (for a stopped server, a server's own wait, a
#: timeout), each with a fork server of its own: the first test to ask runs
#: them all, four at a time, and the others find theirs done. (Not in the
#: background: there they held its two places while the scripts that need
#: a core waited, and those then ran beside the busiest tests.)
SCRIPTS = SharedRuns(
    set(_KEYS), keys=lambda item: _KEYS[item.originalname](getattr(item, "callspec", None) and item.callspec.params),
    command=_command, jobs=4,
)
