"""Which processes may join a group: only ranks of rank 0's launch.

A process of another launch (another torchrun run, an earlier restart of
this one, a second job given the same group name, a process started by
hand, another ``run_id=``) that connects as a rank that has not joined yet
is refused with GroupLaunchError, and the real rank still joins after it.
A malformed hello closes its connection only, never the group.

Each rank is a real process (tests/launch_rank.py run as a script); every
wait has a timeout and every process a test starts is ended, whatever
fails. The tests whose ranks are processes run those a few groups at a time
(LAUNCHES), each group as its test ran it alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import pytest
from conftest import RegisteredJobs

import shmpipe
from shmpipe._group._wire import WIRE

HERE = os.path.abspath(__file__)
#: One rank: tests/launch_rank.py run as a script.
RANK = os.path.join(os.path.dirname(HERE), "launch_rank.py")
#: Every process a test starts ends within this, or the test fails.
PROC_TIMEOUT_S = 90
#: What a launcher may have set in the test's own environment: each process
#: here gets only the launch variables its case gives it.
_LAUNCH_VARS = ("TORCHELASTIC_", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _group() -> str:
    return f"l-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _torchrun(run_id: str, restart: int = 0, port: int = 29500) -> dict[str, str]:
    """What torchrun's agent sets in a worker (the part a launch is told by)."""
    return {
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _env(launch: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return {**env, **launch}


class _Processes:
    """Processes a test starts (this file as a script, or a command), their
    output in files (what outlives a process does not make the test wait);
    on exit, every one still running is killed, with its process group."""

    def __init__(self) -> None:
        self.started: list[tuple[subprocess.Popen[str], Any, Any]] = []

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, text=True, start_new_session=True)
        self.started.append((proc, out, err))
        return proc

    def rank(self, cfg: dict[str, Any], launch: dict[str, str]) -> subprocess.Popen[str]:
        return self.start([sys.executable, RANK, json.dumps(cfg)], _env(launch))

    def reports(self, proc: subprocess.Popen[str]) -> tuple[list[dict[str, Any]], str]:
        """Waits for `proc`; the JSON lines it printed, and its stderr's end."""
        proc.wait(timeout=PROC_TIMEOUT_S)
        _, out, err = next(entry for entry in self.started if entry[0] is proc)
        out.seek(0)
        err.seek(0)
        lines = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
        return lines, f"exit {proc.returncode}: " + err.read()[-3000:]

    def report(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        lines, stderr = self.reports(proc)
        assert lines, stderr
        return {**lines[-1], "stderr": stderr}

    def __enter__(self) -> _Processes:
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc, out, err in self.started:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its session: torchrun's ranks too
                except ProcessLookupError:
                    pass
                proc.wait(10)
            out.close()
            err.close()


def _rank_cfg(group: str, rank: int, **more: Any) -> dict[str, Any]:
    return {"group": group, "rank": rank, "num_ranks": 2, "per_source": 6, "group_timeout": 30, **more}


#: @runs(a function of the test's parameters that makes what it runs: a
#: function that starts its processes, waits for them and returns what the
#: test checks; the module that needs). Three at a time.
LAUNCHES = RegisteredJobs(jobs=3)
runs = LAUNCHES.runs


def _launched(request: Any) -> Any:
    return LAUNCHES.get_for(request)


# -- a process of another launch cannot take a rank's place --------------------------

CASES = {
    # case: (the group's launch variables, the stray's, the group's run_id=, the stray's)
    "another torchrun run": (_torchrun("run-a"), _torchrun("run-b"), None, None),
    "an earlier restart": (_torchrun("run-a", restart=1), _torchrun("run-a", restart=0), None, None),
    # torchrun's run id is "none" with --master-port (or several nodes) and
    # no --rdzv-id: the rendezvous port tells two jobs apart
    "another job, both with run id none": (_torchrun("none", port=29500), _torchrun("none", port=29611), None, None),
    "a process started by hand": (_torchrun("run-a"), {}, None, None),
    "another run_id=": ({}, {}, "job-1", "job-2"),
    "run_id= against torchrun's": ({}, _torchrun("job-1"), "job-1", None),
}


def _another_launch(case: str) -> Any:
    ours, theirs, our_run_id, their_run_id = CASES[case]
    group = _group()

    def run() -> Any:
        with _Processes() as procs:
            rank0 = procs.rank(_rank_cfg(group, 0, run_id=our_run_id), ours)
            stray = procs.report(procs.rank(_rank_cfg(group, 1, run_id=their_run_id), theirs))
            real1 = procs.rank(_rank_cfg(group, 1, run_id=our_run_id), ours)
            reports = [procs.report(rank0), procs.report(real1)]
        return group, stray, reports

    return run


@runs(_another_launch)
@pytest.mark.parametrize("case", list(CASES))
def test_a_process_of_another_launch_cannot_take_a_ranks_place(case, request):
    """Rank 0 listens; a process of another launch connects as rank 1
    before the real rank 1 starts: it is refused (GroupLaunchError, which
    shows tags, not the group's id), and the real rank 1 then joins and
    the pass completes. Before, the stray was taken for rank 1."""
    ours, _, our_run_id, _ = CASES[case]
    group, stray, reports = _launched(request)
    assert stray["error"] is not None and stray["error"][0] == "GroupLaunchError", stray
    text = stray["error"][1]
    assert "another launch" in text and "the group goes on without it" in text.lower(), text
    if case == "an earlier restart":
        assert "restart 0, the group's is launch" in text and text.endswith(
            "restart 1 (from torchrun's TORCHELASTIC_RUN_ID, MASTER_ADDR, MASTER_PORT). A rank left over from another "
            "run or an earlier restart, or a second job given the same group name? The group goes on without it; "
            "give each job its own group name, or the same run_id= to every rank of one launch."
        ), text
        stray_tag, group_tag = re.findall(r"launch ([0-9a-f]{8})", text)
        assert stray_tag == group_tag  # the same run: only the restart differs
    if case == "a process started by hand":
        assert "it presented no launch id" in text, text
    # Neither the group's id nor its proof reaches the stray.
    secret = our_run_id or ours["TORCHELASTIC_RUN_ID"]
    assert secret == "none" or secret not in text  # ("none": a word a message may hold)
    assert _proof(group, our_run_id, ours) not in text
    for r in reports:
        assert r["error"] is None, r
        assert r["batches"] == 6, r  # 2 sources x 6 batches, dealt to 2 ranks


def _proof(group: str, run_id: str | None, launch_vars: dict[str, str]) -> str:
    from shmpipe._group._options import check_launch
    from shmpipe._group._wire import launch_proof

    saved = {k: os.environ.get(k) for k in launch_vars}
    try:
        os.environ.update(launch_vars)
        proof = launch_proof(group, check_launch(run_id))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert proof is not None
    return proof


def _same_run_id() -> Any:
    group = _group()

    def run() -> Any:
        with _Processes() as procs:
            ranks = [procs.rank(_rank_cfg(group, r, run_id="slurm-4242"), {}) for r in (0, 1)]
            return [procs.report(p) for p in ranks]

    return run


@runs(_same_run_id)
def test_ranks_that_give_the_same_run_id_join(request):
    """run_id= for a launcher other than torchrun: the ranks that give it
    join (here with no launcher's variables at all)."""
    reports = _launched(request)
    for r in reports:
        assert r["error"] is None, r
        assert r["batches"] == 6, r


def _under_torchrun() -> Any:
    group = _group()
    cfg = {"group": group, "per_source": 6, "group_timeout": 60}  # rank and size: LOCAL_RANK, LOCAL_WORLD_SIZE

    def run() -> Any:
        # torchrun's logs in a folder of the test's (without --log-dir it
        # makes /tmp/torchelastic_* and leaves it)
        with tempfile.TemporaryDirectory() as logs, _Processes() as procs:  # the processes end first
            stray = procs.rank(_rank_cfg(group, 1, group_timeout=120), {})
            job = procs.start(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "--log-dir", logs, RANK, json.dumps(cfg)],
                _env({}),
            )
            stray_report = procs.report(stray)
            ranks, stderr = procs.reports(job)
        return stray_report, job, ranks, stderr

    return run


@runs(_under_torchrun, needs="torch", seconds=6)  # torchrun and its ranks import torch: it starts first
def test_under_torchrun_a_process_started_by_hand_cannot_take_a_ranks_place(request):
    """torchrun's own variables, not the test's: a process started by hand
    with the group's name and rank 1 waits for rank 0 and connects as soon
    as it listens, racing torchrun's rank 1. Whichever comes first, the
    stray gets GroupLaunchError and the torchrun job trains its pass.
    Before, it was taken for rank 1 or told the group had started."""
    pytest.importorskip("torch")
    stray_report, job, ranks, stderr = _launched(request)
    assert stray_report["error"] is not None and stray_report["error"][0] == "GroupLaunchError", stray_report
    assert "it presented no launch id" in stray_report["error"][1]
    assert job.returncode == 0, stderr
    assert sorted(r["rank"] for r in ranks) == [0, 1], (ranks, stderr)
    for r in ranks:
        assert r["error"] is None and r["batches"] == 6, r


# -- a malformed hello closes that connection only -----------------------------------


def _fingerprint() -> dict[str, Any]:
    return {"num_ranks": 2, "sources": 1, "transport": "shm", "ordered": False, "capacity": 10, "batches": {}}


def _deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"k": value}
    return value


def _bad_hellos(proof: str | None) -> dict[str, Any]:
    """Hellos with one field wrong each (`proof`: the group's own, so that
    only the field at fault is wrong)."""
    launch = None if proof is None else {"proof": proof, "restart": None}
    fp, pid = _fingerprint(), os.getpid()
    return {
        "an older hello (4 fields)": ["hello", 1, fp, pid],
        "only its name": ["hello"],
        "6 fields": ["hello", 1, fp, pid, launch, "more"],
        "rank a text": ["hello", "1", fp, pid, launch],
        "rank a bool": ["hello", True, fp, pid, launch],
        "rank a float": ["hello", 1.0, fp, pid, launch],
        "rank negative": ["hello", -1, fp, pid, launch],
        "rank huge": ["hello", 10**30, fp, pid, launch],
        "rank a nested list": ["hello", json.loads("[" * 200 + "]" * 200), fp, pid, launch],
        "arguments a list": ["hello", 1, [1, 2], pid, launch],
        "arguments deeply nested": ["hello", 1, _deep(200), pid, launch],
        "arguments nested a level too deep": ["hello", 1, {"batches": {"a": {"b": 1}}}, pid, launch],
        "arguments with a list": ["hello", 1, {**fp, "sources": [1]}, pid, launch],
        "arguments with a long text": ["hello", 1, {**fp, "transport": "x" * 60_000}, pid, launch],
        "arguments with many keys": ["hello", 1, {str(i): i for i in range(1000)}, pid, launch],
        "pid a text": ["hello", 1, fp, "1", launch],
        "pid zero": ["hello", 1, fp, 0, launch],
        "launch a text": ["hello", 1, fp, pid, "run-a"],
        "launch a list": ["hello", 1, fp, pid, [proof, None]],
        "launch without restart": ["hello", 1, fp, pid, {"proof": proof}],
        "launch with more": ["hello", 1, fp, pid, {"proof": proof, "restart": None, "id": "x"}],
        "proof not hex": ["hello", 1, fp, pid, {"proof": "z" * 64, "restart": None}],
        "proof upper case": ["hello", 1, fp, pid, {"proof": "A" * 64, "restart": None}],
        "proof short": ["hello", 1, fp, pid, {"proof": "a" * 63, "restart": None}],
        "proof a number": ["hello", 1, fp, pid, {"proof": 12, "restart": None}],
        "restart negative": ["hello", 1, fp, pid, {"proof": proof or "a" * 64, "restart": -1}],
        "restart a float": ["hello", 1, fp, pid, {"proof": proof or "a" * 64, "restart": 0.5}],
        "restart huge": ["hello", 1, fp, pid, {"proof": proof or "a" * 64, "restart": 1 << 40}],
    }


def _connect_raw(group: str) -> socket.socket:
    from shmpipe._group import socket_address

    deadline = time.monotonic() + 20
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(socket_address(group))
            sock.settimeout(10)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)


def _say(group: str, message: Any) -> list[Any]:
    """Sends one datagram on a connection of its own; what rank 0 answers
    (the connection must end after it)."""
    sock = _connect_raw(group)
    try:
        sock.send(message if isinstance(message, bytes) else json.dumps(message).encode())
        answer = sock.recv(1 << 16)
        assert answer, f"rank 0 closed the connection without saying why: {message!r:.80}"
        assert sock.recv(1 << 16) == b"", "rank 0 kept the connection"
    finally:
        sock.close()
    return json.loads(answer)


def _rank_in_thread(group: str, rank: int, run_id: str | None, results: dict[int, Any]) -> threading.Thread:
    """A rank that joins and takes one pass (results[rank]: its batches or
    its error)."""
    from shmpipe.testing.sources import Counter

    launch = {"run_id": run_id} if run_id is not None else {}

    def run() -> None:
        try:
            with shmpipe.from_iterators(
                [Counter(4)], group=group, rank=rank, num_ranks=2, timeout=20, group_timeout=30, **launch
            ) as pipe:
                results[rank] = sum(1 for _ in pipe)
        except BaseException as exc:  # reported by the test
            results[rank] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("launch", ["no launch id", "run_id="])
def test_a_malformed_hello_closes_its_connection_only(launch):
    """Each hello of _bad_hellos on a connection of its own: rank 0 says
    why and closes it; then a hello of another launch with other arguments
    (refused as such, the group not failed for its arguments); then the
    real rank 1 joins and the pass completes. Before, a hello with a field
    of the wrong type failed the group."""
    group = _group()
    run_id = "job-9" if launch == "run_id=" else None
    proof = _proof(group, run_id, {}) if run_id else None
    results: dict[int, Any] = {}
    threads = [_rank_in_thread(group, 0, run_id, results)]
    try:
        for what, hello in _bad_hellos(proof).items():
            answer = _say(group, hello)
            assert answer[:2] == ["error", "start"], (what, answer)
            assert f"group {group!r} refused a process (pid {os.getpid()}): a hello" in answer[2][0], (what, answer)
        stranger = {"proof": "0" * 64, "restart": 3}
        answer = _say(group, ["hello", 1, {"other": "arguments"}, os.getpid(), stranger])
        assert answer[:2] == ["error", "launch"], answer
        assert "restart 3" in answer[2][0] and (proof or "0" * 64) not in answer[2][0]
    finally:  # whatever failed, rank 1 comes, so both threads end
        threads.append(_rank_in_thread(group, 1, run_id, results))
        for thread in threads:
            thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert results == {0: 2, 1: 2}, results


# -- what a launch is (no process starts) --------------------------------------------


def _group_options(monkeypatch: Any, env: dict[str, str], **kw: Any) -> Any:
    from shmpipe._api import check_arguments
    from shmpipe.testing.sources import Counter

    for name in list(os.environ):
        if name.startswith(_LAUNCH_VARS):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = {"group": "g", "rank": 0, "num_ranks": 2, **kw}
    return check_arguments([Counter(1)] * 2, **args)[1]


def test_a_launch_is_run_id_else_torchruns_and_torchruns_restart_count(monkeypatch):
    assert _group_options(monkeypatch, {}).launch is None  # as before: any process of the user may join
    torchrun = _group_options(monkeypatch, _torchrun("run-a", restart=2)).launch
    assert torchrun.restart == 2 and "TORCHELASTIC_RUN_ID" in torchrun.source
    # each of torchrun's variables counts
    for changed in (
        _torchrun("run-b", 2),
        _torchrun("run-a", 2, port=29501),
        {**_torchrun("run-a", 2), "MASTER_ADDR": "h"},
    ):
        assert _group_options(monkeypatch, changed).launch.run_id != torchrun.run_id
    given = _group_options(monkeypatch, _torchrun("run-a", restart=2), run_id="job-1").launch
    assert (given.run_id, given.restart, given.source) == ("job-1", 2, "run_id=")  # the argument first
    assert _group_options(monkeypatch, {}, run_id="job-1").launch.restart is None
    # a secret given as run_id stays out of the options' repr
    assert "job-1" not in repr(_group_options(monkeypatch, {}, run_id="job-1"))


@pytest.mark.parametrize("run_id", ["", 42, b"job", "x" * 1025])
def test_a_run_id_must_be_a_short_text(monkeypatch, run_id):
    with pytest.raises(shmpipe.ShmpipeValueError, match="run_id must be a non-empty str"):
        _group_options(monkeypatch, {}, run_id=run_id)


def test_launch_arguments_are_checked(monkeypatch):
    with pytest.raises(shmpipe.ShmpipeValueError, match="TORCHELASTIC_RESTART_COUNT"):
        _group_options(monkeypatch, {**_torchrun("run-a"), "TORCHELASTIC_RESTART_COUNT": "x"})
    # read only with a launch id: a stray variable breaks no setup that has none
    assert _group_options(monkeypatch, {"TORCHELASTIC_RESTART_COUNT": "x"}).launch is None
    with pytest.raises(shmpipe.ShmpipeValueError, match="need group="):
        _group_options(monkeypatch, {}, group=None, rank=None, num_ranks=None, run_id="job-1")
    assert issubclass(shmpipe.GroupLaunchError, shmpipe.GroupStartError)


def test_a_rank_of_another_shmpipe_is_told_so_at_its_hello():
    # Its hello parses (the fields are the same); its arguments name no
    # wire version, and a "begin" of it would have read as malformed
    # (helper 52): the difference names the wire.
    group = _group()
    results: dict[int, Any] = {}
    thread = _rank_in_thread(group, 0, None, results)
    try:
        answer = _say(group, ["hello", 1, _fingerprint(), os.getpid(), None])
        assert answer[:2] == ["error", "start"], answer
        said = answer[2][0]
        assert f"it runs another shmpipe (wire None vs {WIRE}): run the same shmpipe on every rank" in said, answer
        assert "capacity" not in said and "sources" not in said, "another shmpipe, not other arguments"
    finally:
        thread.join(40)
    assert not thread.is_alive()
    assert isinstance(results[0], shmpipe.GroupStartError), results
