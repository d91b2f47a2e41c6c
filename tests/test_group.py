"""Several ranks fed by one pipeline: ``from_iterators(group=...)``.

Each rank is a real process (tests/group_rank.py run as a script, one per
rank, the way torchrun starts them); rank 0 starts the producers. Each rank checks
every byte of what it receives, reports what it got as one JSON line, and
what it still holds of shared memory after close().
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import RegisteredJobs

import shmpipe
from shmpipe._api import check_arguments
from shmpipe._group import group_capacity

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
#: One rank: tests/group_rank.py run as a script.
RANK = os.path.join(os.path.dirname(HERE), "group_rank.py")
#: Every rank (and so the whole test) ends within this, or the test fails.
RANK_TIMEOUT_S = 120


def _group() -> str:
    return f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _run_ranks(configs: list[dict[str, Any]], delays: list[float] | None = None) -> list[dict[str, Any]]:
    """Starts one process per config (after its delay, in the order given),
    waits for all, returns their reports in rank order. Their output goes
    to files, not pipes: what outlives a rank (its fork server, a child of
    fork_child_at) holds them without making the test wait."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    reports: list[dict[str, Any]] = []
    try:
        for i, cfg in enumerate(configs):
            if delays:
                time.sleep(delays[i])
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            procs.append((cfg, out, err, subprocess.Popen([sys.executable, RANK, json.dumps(cfg)],
                                                           stdout=out, stderr=err, env=env, text=True)))
        for cfg, out, err, proc in procs:
            proc.wait(timeout=RANK_TIMEOUT_S)
            out.seek(0)
            err.seek(0)
            lines = [line for line in out.read().splitlines() if line.startswith("{")]
            report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
            report.setdefault("rank", cfg["rank"])
            report["returncode"] = proc.returncode
            report["stderr"] = err.read()[-3000:]
            reports.append(report)
    finally:
        for _, out, err, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            out.close()
            err.close()
        for report in reports:
            _end_child(report.get("child_pid"))
    return sorted(reports, key=lambda r: r["rank"])


def _end_child(pid: int | None) -> None:
    """Ends a child a rank forked to hold its sockets (fork_child_at),
    once its part in the test is over."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _configs(n: int, **common: Any) -> list[dict[str, Any]]:
    group = _group()
    return [{"group": group, "rank": r, "num_ranks": n, **common} for r in range(n)]


def _expected_order(sources: int, per_source: int) -> list[list[int]]:
    """An ordered pipeline's stream: worker 0's batch 0, worker 1's, ..."""
    return [[w, s] for s in range(per_source) for w in range(sources)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _assert_clean(report: dict[str, Any]) -> None:
    """The rank let go of everything shared (after close and its batches)."""
    assert report["ring_fds"] == [], report
    assert report["mapped"] == 0, report


# -- the groups of the tests, run a few at a time ------------------------------------

def _ranks_of(made: Any) -> Callable[[], Any]:
    """The job of a test that runs (see `runs` below): the ranks' configs, or
    (configs, the delays before each starts), or a function that runs
    something else and returns what the test checks."""
    if callable(made):
        return made
    configs, delays = made if isinstance(made, tuple) else (made, None)
    return lambda: _run_ranks(configs, delays)


#: Each group is a few processes that mostly start Python and shmpipe, or
#: wait (for a rank that never comes, a late one, a timeout): three groups at
#: a time keep the two cores busy.
GROUPS = RegisteredJobs(wrap=_ranks_of, jobs=4)
#: @runs(what the test's group runs, from its parameters; the module that needs)
runs = GROUPS.runs


def _reports(request: Any) -> Any:
    """What the test's group did (its ranks' reports, in rank order)."""
    return GROUPS.get_for(request)


# -- delivery ----------------------------------------------------------------------


@runs(lambda n: _configs(n, sources=3, per_source=7, passes=2, ordered=True))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_batch_goes_to_exactly_one_rank_and_every_rank_gets_the_same_number(n, request):
    sources, per_source, passes = 3, 7, 2
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        _assert_clean(r)
    total = sources * per_source
    stream = _expected_order(sources, per_source)
    for p in range(passes):
        got = [r["passes"][p] for r in reports]
        assert all(len(g) == total // n for g in got)  # equal counts
        seen = [tuple(b) for g in got for b in g]
        assert len(seen) == len(set(seen))  # disjoint
        assert len(seen) == total - total % n  # complete but for the remainder
        # ordered: batch k of the pass went to rank k % n, every pass
        for rank, g in enumerate(got):
            assert g == stream[rank : total - total % n : n]
    group = reports[0]["group_stats"]
    assert group["dropped_per_pass"] == [total % n] * passes
    assert group["batches_per_rank"] == [passes * (total // n)] * n
    for r in reports:
        assert r["stats"]["extra"]["dropped_remainder"] == passes * (total % n)
        assert r["stats"]["batches"] == passes * (total // n)
        assert r["stats"]["passes"] == passes


@runs(lambda: _configs(2, sources=2, per_source=9, passes=1, transport="arrow", grow=True))
def test_unordered_delivery_is_disjoint_and_equal_with_arrow_and_big_batches(request):
    """Unordered, over the arrow transport, with batches larger than a slot
    (each in memory of its own, its descriptor sent to its rank)."""
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        _assert_clean(r)
    got = [tuple(b) for r in reports for b in r["passes"][0]]
    assert len(got) == len(set(got)) == 18
    assert len(reports[0]["passes"][0]) == len(reports[1]["passes"][0]) == 9
    assert sum(r["big"] for r in reports) > 0  # some did travel outside the ring


@runs(lambda: _configs(2, sources=2, per_source=9, passes=1, grow=True, adapter="torch"), needs="torch", seconds=12)
def test_in_place_torch_ops_in_every_rank_on_batches_of_any_size(request):
    """A rank's batches lie in memory it maps read-only: an in-place op on
    their tensors (x.add_(1)) killed the rank with SIGSEGV. Now each
    tensor is a private view: the op works and the batch is intact (the
    check compares the bytes from before the op with what was sent)."""
    pytest.importorskip("torch")
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        _assert_clean(r)
    assert sorted(tuple(b) for r in reports for b in r["passes"][0]) == [(w, s) for w in range(2) for s in range(9)]
    assert all(r["big"] > 0 for r in reports)  # each rank had batches outside the ring


@runs(lambda: _configs(2, sources=2, per_source=60, passes=2, transport="shm-posix", keep_first=True))
def test_a_slot_is_not_reused_while_a_rank_holds_its_batch_and_posix_backing_works(request):
    """Each rank keeps its first batch while 60 more pass through a ring of
    10 slots; it is intact at the end of the pass. The ring is a named
    segment here (backing="posix"), which ranks open by name."""
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert [len(p) for p in r["passes"]] == [60, 60]
        assert r["kept_intact"] is True
        _assert_clean(r)


def _any_order_and_late() -> Any:
    configs = _configs(3, sources=2, per_source=6, passes=1, group_timeout=60)
    return list(reversed(configs)), [0.0, 2.0, 3.0]  # rank 2, then 1, then rank 0 3 s later


@runs(_any_order_and_late)
def test_ranks_may_start_in_any_order_and_late(request):
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert len(r["passes"][0]) == 4
        _assert_clean(r)


@runs(lambda: _configs(3, sources=1, per_source=4, passes=1, group_timeout=3)[:2])  # rank 2 never starts
def test_a_rank_that_never_comes_is_named(request):
    reports = _reports(request)
    for r in reports:
        assert r["error"][0] == "GroupStartError", r
        assert "rank(s) 2 of 3 did not join" in r["error"][1]
        _assert_clean(r)
    assert _wait_gone(reports[0]["pids"]) == []


@runs(lambda: _configs(2, sources=1, per_source=4, passes=1, group_timeout=2)[1:])  # rank 0 never starts
def test_a_rank_whose_rank_0_never_comes_says_so(request):
    (report,) = _reports(request)
    assert report["error"][0] == "GroupStartError", report
    assert "rank 0 did not start listening" in report["error"][1]


def _disagreeing() -> Any:
    configs = _configs(2, sources=2, per_source=4, passes=1, group_timeout=20)
    configs[1]["sources"] = 3
    return configs


@runs(_disagreeing)
def test_ranks_that_disagree_on_the_arguments_do_not_start(request):
    reports = _reports(request)
    for r in reports:
        assert r["error"][0] == "GroupStartError", r
        assert "other arguments than rank 0" in r["error"][1]


def _different_speeds() -> Any:
    configs = _configs(2, sources=2, per_source=10, passes=3, ordered=True)
    configs[1]["step_s"] = 0.01  # rank 1 trains slower
    return configs


@runs(_different_speeds)
def test_several_passes_stay_in_step_when_ranks_run_at_different_speeds(request):
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert [len(p) for p in r["passes"]] == [10, 10, 10]
        assert r["passes"][0] == r["passes"][1] == r["passes"][2]  # deterministic, every pass
        _assert_clean(r)


# -- faults ------------------------------------------------------------------------


def _one_killed(child: bool, victim: int) -> Any:
    configs = _configs(3, sources=2, per_source=1000, passes=1, step_s=0.002)
    if child:
        configs[victim]["fork_child_at"] = [0, 3]
    configs[victim]["kill_at"] = [0, 5]
    return configs


@runs(lambda child: _one_killed(child, 1))
@pytest.mark.parametrize("child", [False, True], ids=["alone", "with-a-child-holding-its-socket"])
def test_a_rank_killed_mid_pass_fails_the_others_quickly_and_nothing_is_left(child, request):
    """With a child it forked keeping its end of the socket open for 20 s
    after it dies, its death is seen by its pidfd, not by the socket's end.
    The survivors let go of the ring, and the producers exit."""
    reports = _reports(request)
    victim = reports[1]
    assert victim["returncode"] == -signal.SIGKILL
    for r in (reports[0], reports[2]):
        assert r["error"][0] == "RankDiedError", r
        assert "rank 1" in r["error"][1]
        assert r["error_at"] - victim["killed_at"] < 5.0, (r["error_at"] - victim["killed_at"])
        _assert_clean(r)
    assert _wait_gone(reports[0]["pids"]) == []


def _after_the_deal(n: int, then: str, at: int = 2, passes: int = 1, **extra: Any) -> Callable[[], Any]:
    """2 sources of 6 batches: 12 a pass, 12 / n per rank. Rank 1 waits at
    its first batch of pass 0 until rank 0 has dealt the pass whole (a file
    rank 0 touches then), and does `then` at its batch `at`."""

    def run() -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory() as tmp:
            dealt = os.path.join(tmp, "dealt")
            configs = _configs(n, sources=2, per_source=6, passes=passes, **extra)
            configs[0] |= {"dealt_file": dealt}
            configs[1] |= {"wait_at": [0, 1], "wait_file": dealt, then: [0, at]}
            return _run_ranks(configs)

    return run


@runs(lambda: _after_the_deal(3, "kill_at"))
def test_a_rank_killed_in_the_last_pass_after_its_deal_fails_the_others(request):
    """The others had every batch of theirs, and the pass's end, before the
    death: a pass ends only when every rank is past it, so they hear of the
    batches lost with it (they ended as if nothing had happened)."""
    reports = _reports(request)
    victim = reports[1]
    assert victim["returncode"] == -signal.SIGKILL
    for r in (reports[0], reports[2]):
        assert r["error"] is not None and r["error"][0] == "RankDiedError", r
        assert "rank 1" in r["error"][1]
        assert len(r["pass_so_far"]) == 4, r  # all of theirs: the deal was over before the death
        assert r["error_at"] - victim["killed_at"] < 5.0, (r["error_at"] - victim["killed_at"])
        _assert_clean(r)
    assert _wait_gone(reports[0]["pids"]) == []


@runs(lambda: _after_the_deal(2, "kill_at", at=6, adapter="jax-ahead", step_s=0.2), needs="jax", seconds=10)
def test_a_rank_killed_in_its_last_step_while_to_jax_read_ahead_fails_the_others(request):
    """to_jax's thread (as on an accelerator) read rank 1's share and the
    pass's end one step (0.2 s) ahead of its trainer, which dies in the step
    of its last batch, before it asks for more: as in a loop over the
    pipeline itself, that batch was not trained on, and rank 0 hears of the
    death (it heard nothing: the thread had said the pass was taken)."""
    pytest.importorskip("jax")
    reports = _reports(request)
    assert reports[1]["returncode"] == -signal.SIGKILL, reports[1]
    assert reports[0]["error"] is not None and reports[0]["error"][0] == "RankDiedError", reports[0]
    assert len(reports[0]["pass_so_far"]) == 6
    _assert_clean(reports[0])


@pytest.mark.parametrize(
    "how", ["close_at", "raise_at"], ids=["close", "an-exception-out-of-the-loop"]
)
@runs(lambda how: _after_the_deal(2, how))
def test_a_rank_leaving_the_last_pass_with_batches_untaken_fails_the_others(how, request):
    """Rank 1 closes (or its trainer raises out of the loop, and its
    pipeline closes) after its 2nd of 6 batches: a close in the middle of
    the pass, though rank 0 had dealt it whole; rank 0 hears which batches."""
    reports = _reports(request)
    assert reports[1]["error"] == (["RuntimeError", "the trainer's own error"] if how == "raise_at" else None)
    assert reports[0]["error"] is not None and reports[0]["error"][0] == "RankDiedError", reports[0]
    assert "in the middle of pass 0, 4 of the 6 batches dealt to it not taken" in reports[0]["error"][1]
    for r in reports:
        _assert_clean(r)


@runs(lambda: _after_the_deal(2, "close_at", at=6))
def test_a_rank_closing_at_its_share_without_asking_for_the_end_lets_the_others_end_the_pass(request):
    """Rank 1 stops at exactly its share (islice, steps_per_epoch) and
    closes without reading the pass's end: it took the whole pass, so
    rank 0's pass ends normally."""
    reports = _reports(request)
    assert reports[1]["error"] is None and [len(p) for p in reports[1]["passes"]] == [6], reports[1]
    assert reports[0]["error"] is None and [len(p) for p in reports[0]["passes"]] == [6], reports[0]
    for r in reports:
        _assert_clean(r)


@pytest.mark.parametrize("who", [0, 1])
@runs(lambda who: [
    {**cfg, **({"close_at": [0, 6]} if cfg["rank"] == who else {})}
    for cfg in _configs(2, sources=2, per_source=6, passes=1, linger=0.4)
], seconds=4)
def test_a_rank_closing_at_its_share_before_the_deal_ends_fails_nobody(who, request):
    """The sources end their pass 0.4 s after their last batch: a rank that
    closes at its share (6) meanwhile had every batch it was dealt, and no
    more come (it was taken for one closing in the middle of the pass).
    Rank 0's close waits for the deal's end (up to 1 s) and the others'."""
    reports = _reports(request)
    for r in reports:
        assert r["error"] is None and [len(p) for p in r["passes"]] == [6], r
        _assert_clean(r)


def _rank_0_closing_first() -> list[dict[str, Any]]:
    """Rank 0 stops at its share (6) and closes once it has dealt the pass
    whole; rank 1 takes its six slowly."""
    with tempfile.TemporaryDirectory() as tmp:
        dealt = os.path.join(tmp, "dealt")
        configs = _configs(2, sources=2, per_source=6, passes=1)
        configs[1] |= {"step_s": 0.2}
        configs[0] |= {"dealt_file": dealt, "wait_at": [0, 6], "wait_file": dealt, "close_at": [0, 6]}
        return _run_ranks(configs)


@runs(lambda: _rank_0_closing_first)
def test_rank_0_closing_first_at_its_share_waits_for_the_others_to_end_the_pass(request):
    """Only rank 0 can tell the others their pass is complete: its close
    waits for them (up to group_timeout) instead of failing them."""
    reports = _reports(request)
    for r in reports:
        assert r["error"] is None and [len(p) for p in r["passes"]] == [6], r
        _assert_clean(r)


def _rank_1_sending(message: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Rank 1 sends rank 0 `message` at its first batch of a long pass."""
    configs = _configs(2, sources=2, per_source=50, passes=1, step_s=0.01)
    configs[1] |= {"send_at": [0, 1], **({"raw": message[1]} if message[0] == "raw" else {"message": list(message)})}
    return configs


@pytest.mark.parametrize(
    "message",
    [("taken", 10**30), ("taken", 0), ("taken", "0"), ("bye", 0), ("bye", "0", 1), ("begin", 0, None),
     ("bye", 0, 10**6), ("raw", "\xff\x00 not JSON")],
    ids=["taken-a-later-pass", "taken-while-dealt", "taken-not-an-int", "bye-short", "bye-not-ints",
         "begin-the-same-pass-again", "bye-having-had-more-than-dealt", "not-json"],
)
@runs(lambda message: _rank_1_sending(message))
def test_rank_0_refuses_a_malformed_taken_or_bye(message, request):
    """A "taken" of a pass not dealt whole would end passes whose batches
    the rank never had; a rank's passes only go forward; a "bye" having
    had more than it was dealt would hide a rank that left with batches
    not taken: each is a malformed message, which fails the group (never a
    TypeError in rank 0's threads, never a pass ended early), as is a
    datagram that is no message (not "died": the rank lives)."""
    reports = _reports(request)
    assert reports[0]["error"] is not None and reports[0]["error"][0] == "RankDiedError", reports[0]
    assert "sent a malformed message" in reports[0]["error"][1], reports[0]["error"]
    assert len(reports[0]["pass_so_far"]) < 50
    for r in reports:
        _assert_clean(r)


@runs(lambda: [cfg | ({"cut_begin_of_pass": 1} if cfg["rank"] == 1 else {})
               for cfg in _configs(2, sources=2, per_source=8, passes=3, ordered=True)])
def test_a_rank_whose_begin_was_cut_leaves_that_pass_and_the_group_goes_on(request):
    """Rank 1's program catches an exception that its signal handler raised
    as its pipeline began pass 1, before the pass's "begin" was sent, and
    iterates again: it begins pass 2, leaving pass 1 as a break would (its
    share of pass 1 is not had), and the group goes on (a begin of a later
    pass than the next was refused as malformed for a moment, helper 77)."""
    reports = _reports(request)
    assert reports[0]["error"] is None and [len(p) for p in reports[0]["passes"]] == [8, 8, 8], reports[0]
    assert reports[1]["error"] is None, reports[1]
    assert [p if p == "interrupted" else len(p) for p in reports[1]["passes"]] == [8, "interrupted", 8]
    for r in reports:
        _assert_clean(r)


@runs(lambda: [
    {**cfg, **({"adapter": "jax-ahead", "break_at": [0, 6], "state_after_pass": True} if cfg["rank"] == 1
               else {"step_s": 0.1})}
    for cfg in _configs(2, sources=2, samples=24, passes=2)
], needs="jax", seconds=8)
def test_a_state_made_while_to_jax_read_the_end_ahead_of_the_trainer_does_not_deadlock(request):
    """Rank 1's trainer stops at its share (6, as islice would) while
    to_jax's thread has read the pass's end and waits for the trainer to
    ask past it (rank 0, a little slower, has not ended the pass either);
    a state_dict() then (a checkpoint at the epoch's end) took the two
    locks in the other order and hung both ranks for ever."""
    pytest.importorskip("jax")
    reports = _reports(request)
    for r in reports:
        assert r["error"] is None and [len(p) for p in r["passes"]] == [6, 6], r
        _assert_clean(r)
    # made as the trainer had its share of pass 0: the group's epoch 0 is out
    assert [(s["epoch"], s["done_below"]) for s in reports[1]["states"]] == [(1, 0), (2, 0)]
    for p in range(2):
        assert sorted(b for r in reports for b in r["passes"][p]) == [[2 * k, 2 * k + 1] for k in range(12)]


@runs(lambda: _configs(2, sources=2, samples=4, passes=1, adapter="tf"), needs="tensorflow", seconds=12)
def test_to_tf_dataset_in_ranks_whose_share_is_smaller_than_its_peek(request):
    """One batch per rank, and to_tf_dataset() peeks two to infer the
    signature: it read the pass's end in the peek, and waited there for
    ever (no tf.data trainer asks while it is being made)."""
    pytest.importorskip("tensorflow")
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None and [len(p) for p in r["passes"]] == [1], r
    assert sorted(b for r in reports for b in r["passes"][0]) == [[0, 1], [2, 3]]


@runs(lambda: _configs(2, sources=2, samples=12, passes=1, adapter="jax-ahead", timeout=4.0, step_s=2.5),
      needs="jax", seconds=14)
def test_to_jax_ahead_of_slow_steps_is_no_timeout_at_the_pass_end(request):
    """to_jax's thread reads the end two steps (5 s) before its trainer
    asks past its last batch: the wait for the other ranks begins only
    then, so timeout=4.0 is not hit in a group whose ranks are in step.
    (With timeout=1.0, and once with 2.0, a rank's first batch came after
    it on a busy machine, its ranks having begun the pass that far apart.)"""
    pytest.importorskip("jax")
    reports = _reports(request)
    for r in reports:
        assert r["error"] is None and [len(p) for p in r["passes"]] == [3], reports
        _assert_clean(r)


def _rank_0_waited_for_by_rank_1() -> list[dict[str, Any]]:
    """Rank 1 stops at its share and waits for rank 0 to close before it
    does (as a collective after the loop would); rank 0 closes first."""
    with tempfile.TemporaryDirectory() as tmp:
        dealt, closed = os.path.join(tmp, "dealt"), os.path.join(tmp, "closed")
        configs = _configs(2, sources=2, per_source=6, passes=1, group_timeout=5)
        configs[0] |= {"dealt_file": dealt, "wait_at": [0, 6], "wait_file": dealt, "close_at": [0, 6],
                       "touch_when_done": closed}
        configs[1] |= {"break_at": [0, 6], "wait_file_after_pass": closed}
        return _run_ranks(configs)


@runs(lambda: _rank_0_waited_for_by_rank_1, seconds=8)
def test_rank_0_closing_while_a_rank_waits_for_it_gives_up_and_warns(request):
    """Rank 0's close waits for rank 1 to end the pass, which waits for
    rank 0: after group_timeout (5 s) rank 0 closes anyway, and says why."""
    reports = _reports(request)
    assert reports[0]["error"] is None and reports[1]["error"] is None, reports
    assert reports[0]["close_s"] >= 4.5, reports[0]
    assert any("closed after waiting 5 s for rank(s) 1 to end pass 0" in w for w in reports[0]["warnings"]), reports[0]
    for r in reports:
        _assert_clean(r)


@runs(lambda: _after_the_deal(2, "break_at", passes=2))
def test_a_rank_leaving_a_pass_early_for_the_next_lets_the_others_end_it(request):
    """A rank that began pass 1 is past pass 0 (its unread batches of pass
    0 go back to the ring): rank 0 ends pass 0, and pass 1 is whole."""
    reports = _reports(request)
    for r in reports:
        assert r["error"] is None, r
        _assert_clean(r)
    assert [len(p) for p in reports[0]["passes"]] == [6, 6]
    assert [len(p) for p in reports[1]["passes"]] == [2, 6]


def test_a_pass_every_rank_left_for_the_next_is_not_made_to_its_end(tmp_path):
    """Rank 0 dealt a pass to its end, whoever had left it: a break, then
    the next pass's first batch came only once the producers had made the
    rest of the epoch (0.27 s for 1,000 batches, 2.7 s for 10,000; one
    pipeline: 0.001 and 0.007 s). Now the rest is no one's once every
    rank began a later pass, and such a pass counts none dropped (it has
    no last round; helper 82 saw the round cut off counted, 0 or 1 by
    timing). Two ranks, each in a thread of this process."""
    import threading

    from shmpipe.testing.datasets import FetchLog, Numbered

    log, group = str(tmp_path / "fetched"), _group()
    got: dict[int, Any] = {}

    def rank(r: int) -> None:
        with shmpipe.from_dataset(Numbered(4002, log=log), batch_size=4, num_workers=2, timeout=60,
                                  group=group, rank=r, num_ranks=2, group_timeout=30) as pipe:
            firsts = []
            for _ in range(3):
                for b in pipe:
                    firsts.append(b["i"].tolist())
                    break
            whole = sum(1 for _ in pipe)
            got[r] = (firsts, whole, pipe.stats().extra["dropped_per_pass"],
                      pipe.group_stats().dropped_per_pass if r == 0 else None)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads) and sorted(got) == [0, 1], got
    for r in range(2):  # 1,001 batches a pass: 500 each, the last round (1) dropped
        assert got[r][:3] == ([[4 * r + k for k in range(4)]] * 3, 500, [1]), got[r]
    assert got[0][3] == (0, 0, 0, 1)
    fetched = FetchLog(log).fetched()
    assert 4002 + 24 <= len(fetched) < 4002 + 2000, f"{len(fetched)} samples fetched for three first batches and a pass"


@runs(lambda child: _one_killed(child, 0))
@pytest.mark.parametrize("child", [False, True], ids=["alone", "with-a-child-holding-its-sockets"])
def test_rank_0_killed_fails_the_others_and_its_producers_exit(child, request):
    reports = _reports(request)
    assert reports[0]["returncode"] == -signal.SIGKILL
    for r in reports[1:]:
        assert r["error"][0] == "RankDiedError", r
        assert "rank 0" in r["error"][1]
        assert r["error_at"] - reports[0]["killed_at"] < 5.0
        _assert_clean(r)  # the memory is gone from every rank
    assert _wait_gone(reports[0]["pids"]) == []  # the producers noticed their consumer died


@runs(lambda: _configs(3, sources=2, per_source=0, passes=1, raiser=True))
def test_a_producer_failure_reaches_every_rank(request):
    reports = _reports(request)
    for r in reports:
        assert r["error"][0] == "WorkerError", r
        assert "boom from the source" in r["error"][1]
        _assert_clean(r)
    assert _wait_gone(reports[0]["pids"]) == []


def _one_closing(**extra: Any) -> Any:
    configs = _configs(2, sources=2, per_source=1000, passes=1, step_s=0.002, **extra)
    configs[1]["close_at"] = [0, 3]
    return configs


@runs(_one_closing)
def test_a_rank_closing_mid_pass_fails_the_others(request):
    reports = _reports(request)
    assert reports[1]["error"] is None
    assert reports[0]["error"][0] == "RankDiedError"
    assert "closed its pipeline in the middle of pass 0" in reports[0]["error"][1]


@runs(lambda: _configs(3, sources=2, per_source=0, passes=1, raiser=True, emoji=30_000))
def test_a_long_non_ascii_producer_error_reaches_every_rank(request):
    """A message JSON writes 12 bytes per character of: clipped by its
    encoded size, it still fits one group message (it was clipped by
    characters, did not fit, and the ranks waited for ever)."""
    # 30,000 emoji (12 bytes each in JSON), made in each rank (too long for a command line)
    reports = _reports(request)
    for r in reports:
        assert r["error"][0] == "WorkerError", r
        assert "\U0001f600" * 100 in r["error"][1] and "[...]" in r["error"][1]
        _assert_clean(r)
    assert _wait_gone(reports[0]["pids"]) == []


def test_error_messages_fit_whatever_their_texts():
    from shmpipe._group._wire import MAX_ERROR_BYTES as _MAX_ERROR_BYTES
    from shmpipe._group._wire import encode as _encode
    from shmpipe._group._wire import error_from as _error_from
    from shmpipe._group._wire import error_message as _error_message

    huge = "\U0001f600\x00\u2028" * 50_000
    for exc in (
        shmpipe.WorkerError(1, 2, "ValueError", huge, huge),
        shmpipe.WorkerDiedError(0, 1, None, huge),
        shmpipe.RankDiedError(huge, 3),
        RuntimeError(huge),
    ):
        message = _error_message(exc)
        assert len(_encode(message)) <= _MAX_ERROR_BYTES
        back = _error_from(json.loads(_encode(message)))
        assert isinstance(back, shmpipe.ShmpipeError) and "[...]" in str(back)


def test_what_the_pipeline_adds_to_a_producers_death_reaches_the_ranks_and_survives_pickling():
    # The replacements before it, or why its replacement did not start: rank
    # 0 knew, the other ranks got the bare death (the wire sent the
    # constructor's arguments, the note was only in the message).
    import pickle

    from shmpipe._group._wire import encode, error_from, error_message

    death = shmpipe.WorkerDiedError(1, 42, -9)
    death.add_pipeline_note("1 producer(s) died and were replaced before: worker 0 (pid 41) was killed")
    death.add_pipeline_note("its replacement did not start: the fork server is stopped")
    for back in (error_from(json.loads(encode(error_message(death)))), pickle.loads(pickle.dumps(death))):
        assert type(back) is shmpipe.WorkerDiedError and str(back) == str(death) == back.message, str(back)
        assert (back.worker_id, back.pid, back.signal, back.note) == (1, 42, 9, death.note)
    assert str(death).startswith("worker 1 (pid 42) was killed by signal SIGKILL; 1 producer(s) died")


@runs(lambda: _configs(2, sources=2, per_source=5, passes=2, high_fds=True, ordered=True))
def test_descriptors_above_1024_work_in_every_rank(request):
    """Each rank first fills its descriptors up to 1100, so the group's
    sockets and pidfds are above FD_SETSIZE (select() raised ValueError)."""
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert [len(p) for p in r["passes"]] == [5, 5]
        _assert_clean(r)


@runs(lambda: _configs(3, sources=2, per_source=0, passes=1, big_then_raise=True, ordered=True))
def test_batches_not_yet_dealt_when_the_pipeline_fails_leave_no_descriptor(request):
    """The error comes with an incomplete round that holds a batch larger
    than a slot (a descriptor of its own): rank 0 closes it."""
    reports = _reports(request)
    for r in reports:
        assert r["error"][0] == "WorkerError", r
        _assert_clean(r)  # ring_fds: rank 0 kept no batch's descriptor
    assert _wait_gone(reports[0]["pids"]) == []


@runs(lambda: _one_closing(keep_first=True))
def test_a_rank_closing_mid_pass_keeps_its_batches_intact(request):
    """Rank 1 keeps its first batch, closes mid-pass and reads it 1 s later:
    rank 0 stops the producers before it frees anything that rank held, and
    keeps its slots until the batch is gone."""
    reports = _reports(request)
    assert reports[1]["error"] is None, reports[1]
    assert reports[1]["kept_intact"] is True
    assert reports[0]["error"][0] == "RankDiedError"
    for r in reports:
        _assert_clean(r)


def _with_a_stray() -> Any:
    """The group's ranks, and a stray that starts with them but joins once
    rank 0 has its first batch; the ranks hold after it until the stray
    was answered (each wait is bounded: the checks see what did not
    happen), whatever the machine's load."""

    def run() -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory() as tmp:
            started, answered = os.path.join(tmp, "started"), os.path.join(tmp, "answered")
            configs = _configs(2, sources=2, per_source=100, passes=1, step_s=0.01, ordered=True,
                               hold_until_file=answered)
            configs[0]["started_file"] = started
            stray = {**configs[1], "wait_for_file": started, "touch_when_done": answered}
            del stray["hold_until_file"]
            return _run_ranks([*configs, stray])

    return run


@runs(_with_a_stray)
def test_a_stray_process_joining_a_running_group_is_turned_away(request):
    """A third process says it is rank 1 after the group started: it gets
    GroupStartError; the group goes on (it failed before)."""
    reports = _reports(request)
    stray_report = [r for r in reports if r["rank"] == 1 and r["error"] is not None]
    good = [r for r in reports if r["error"] is None]
    assert len(stray_report) == 1 and stray_report[0]["error"][0] == "GroupStartError", reports
    assert "already started" in stray_report[0]["error"][1] or "two processes" in stray_report[0]["error"][1]
    assert sorted(r["rank"] for r in good) == [0, 1], reports
    for r in good:
        assert len(r["passes"][0]) == 100
        _assert_clean(r)


# -- a rank and a forged rank 0 (untrusted messages) ---------------------------------


class _ForgedRank0:
    """Listens as rank 0 of `group` in this process and sends a rank the
    given datagrams (JSON-encoded lists, or raw bytes) after "ready"."""

    def __init__(self, group: str, script: list[tuple[Any, list[int]]]) -> None:
        import socket
        import threading

        from shmpipe._group import socket_address

        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(socket_address(group))
        self.listener.listen(1)
        self.listener.settimeout(20)
        self.script = script
        self.heard: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import socket

        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(20)
            self.heard.append(conn.recv(1 << 16))  # hello
            conn.send(b'["ready", 1]')
            for message, fds in self.script:
                data = message if isinstance(message, bytes) else json.dumps(message).encode()
                try:
                    socket.send_fds(conn, [data], fds) if fds else conn.send(data)
                except OSError:  # the rank left already: what it said is still queued here
                    break
            while True:  # what the rank says until it leaves
                try:
                    data = conn.recv(1 << 16)
                except ConnectionResetError:
                    # It left with messages of ours unread: the kernel says
                    # so once, before what it sent that is still queued.
                    continue
                if not data:
                    return
                self.heard.append(data)

    def close(self) -> None:
        self.thread.join(20)
        self.listener.close()
        assert not self.thread.is_alive()


def _rank_1_against(script: list[tuple[Any, list[int]]]) -> tuple[BaseException, list[bytes]]:
    from shmpipe.testing.memory import ring_descriptors
    from shmpipe.testing.sources import Counter

    group = _group()
    before = ring_descriptors()
    forged = _ForgedRank0(group, script)
    try:
        pipe = shmpipe.from_iterators(
            [Counter(1)], group=group, rank=1, num_ranks=2, timeout=10, group_timeout=10
        )
        with pytest.raises(Exception) as caught:
            for _ in pipe:
                pass
        assert pipe.closed
        pipe.close()
    finally:
        forged.close()
    assert ring_descriptors() == before
    return caught.value, forged.heard


def _unsealed_ring() -> tuple[dict[str, Any], int]:
    from shmpipe import _ring

    page = _ring.PAGE_SIZE
    fd = os.memfd_create("shmpipe-forged", os.MFD_CLOEXEC)  # no sealing allowed
    os.ftruncate(fd, 3 * page)
    return {"backing": "posix", "total": 3 * page, "header": page, "slot_size": page, "nslots": 2}, fd


@pytest.mark.parametrize(
    "what",
    [
        "not json", "nested", "batch fields", "batch before ring", "ring not a dict", "ring bad geometry",
        "end fields", "end nested", "complete fields", "complete nested", "error worker fields", "error died fields", "error args not list",
        "unknown kind", "unsealed ring called posix",
    ],
)
def test_a_rank_turns_any_malformed_message_from_rank_0_into_a_shmpipe_error(what):
    fds: list[int] = []
    message: Any
    if what == "not json":
        message = b"\xff{not json"
    elif what == "nested":
        message = b"[" * 100_000 + b"]" * 100_000
    elif what == "batch fields":
        message = ["batch", 0, "token", {"a": 1}, None, -1]
    elif what == "batch before ring":
        message = ["batch", 0, 1, ["slot", 4096, 10], 0, 10]
    elif what == "ring not a dict":
        message = ["ring", [1, 2]]
        fds = [os.open(os.devnull, os.O_RDONLY)]
    elif what == "ring bad geometry":
        message = ["ring", {"backing": "memfd", "total": 5, "header": -1, "slot_size": "x", "nslots": 2}]
        fds = [os.open(os.devnull, os.O_RDONLY)]
    elif what == "end fields":
        message = ["end", 0, "x"]
    elif what == "end nested":
        message = ["end", 0, [1]]
    elif what == "complete fields":
        message = ["complete", "0"]
    elif what == "complete nested":
        message = ["complete", [[0]]]
    elif what == "error worker fields":
        message = ["error", "worker", [1, 2, 3, 4, 5]]
    elif what == "error died fields":
        message = ["error", "worker_died", ["a", {}, [], 4]]
    elif what == "error args not list":
        message = ["error", "rank_died", "text"]
    elif what == "unknown kind":
        message = ["launch", "rm -rf /"]
    else:
        share, fd = _unsealed_ring()
        message = ["ring", share]
        fds = [fd]
    try:
        error, heard = _rank_1_against([(message, fds), (["end", 0, 0], [])])
    finally:
        for fd in fds:
            os.close(fd)
    assert isinstance(error, shmpipe.ShmpipeError), repr(error)
    if what.startswith("error worker") or what.startswith("error died") or what == "error args not list":
        assert "malformed" in str(error)
    if what == "unsealed ring called posix":
        assert isinstance(error, shmpipe.CorruptChannelError) and "backing" in str(error)
    assert json.loads(heard[-1])[0] == "bye"  # it left the group


# -- frameworks --------------------------------------------------------------------


@runs(lambda: _configs(2, sources=2, per_source=6, passes=1, adapter="torch"), needs="torch", seconds=7)
def test_to_torch_in_each_rank(request):
    pytest.importorskip("torch")
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert len(r["passes"][0]) == 6
        assert r["zero_copy"] is True
        _assert_clean(r)


def _one_tf_rank() -> Any:
    configs = _configs(2, sources=2, per_source=6, passes=2)
    configs[1]["adapter"] = "tf"
    return configs


@runs(_one_tf_rank, needs="tensorflow", seconds=12)  # a rank imports TensorFlow
def test_to_tf_dataset_in_a_rank(request):
    pytest.importorskip("tensorflow")
    reports = _reports(request)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert [len(p) for p in r["passes"]] == [6, 6]
    assert {tuple(b) for r in reports for b in r["passes"][0]} == {(w, s) for w in range(2) for s in range(6)}


def _script(*args: str) -> Callable[[], subprocess.CompletedProcess]:
    """A function that runs `args` with this process's sys.path, in a folder
    of its own, as subprocess.run(capture_output=True, text=True) does; the
    JSON files it wrote there come back as the result's .json."""

    def run() -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with tempfile.TemporaryDirectory() as cwd:
            out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
            out.json = {p.name: p.read_text() for p in Path(cwd).glob("*.json")}  # type: ignore[attr-defined]
        return out

    return run


# (--log-dir in the run's folder: without it, torchrun makes /tmp/torchelastic_* and leaves it)
@runs(lambda: _script(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      "--log-dir", "torchrun-logs", os.path.join(ROOT, "examples", "ddp_train.py"), "--workers", "3", "--epochs", "3", "--batches", "5"),
      needs="torch", seconds=23)
def test_the_ddp_example_trains_under_torchrun(request):
    """examples/ddp_train.py: DistributedDataParallel (gloo, CPU) on 2 ranks
    under torchrun, fed by one pipeline of 3 producers: 15 batches an epoch,
    7 to each rank, 1 dropped; the ranks' weights stay identical."""
    pytest.importorskip("torch")
    out = _reports(request)
    # (the ranks' stdout too: how far each got, where one aborts in torch)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-2000:]}\nstderr:\n{out.stderr[-3000:]}"
    ranks = dict(re.findall(r"rank (\d): 21 batches in 3 epochs, .* weights checksum (\S+)", out.stdout))
    assert set(ranks) == {"0", "1"}, out.stdout
    assert ranks["0"] == ranks["1"]  # DDP kept the replicas in step
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < first, out.stdout
    assert "batches per rank [21, 21], remainder dropped 3, producer processes 3" in out.stdout


@runs(lambda: _script(sys.executable, "-m", "shmpipe", "bench", "ranks", "--ranks", "2", "--batches", "12", "--size",
                      "64KiB", "--work-ms", "0", "--setups", "shared pool", "pipeline per rank", "--json", "ranks.json"))
def test_bench_ranks_runs_and_writes_json(request):
    out = _reports(request)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {r["setup"]: r for r in json.loads(out.json["ranks.json"])["results"]}
    shared, own = results["shared pool"], results["pipeline per rank"]
    assert shared["batches_per_rank"] == own["batches_per_rank"] == [12, 12]
    assert (shared["producer_processes"], own["producer_processes"]) == (2, 4)
    assert (shared["processes_started"], own["processes_started"]) == (4, 6)
    assert shared["cpu_s"] > 0 and shared["pss_bytes"] > 0
    assert "| shared pool | 2 | 4 | 12 |" in out.stdout


# -- arguments (no process starts) -------------------------------------------------


def _check(**kw: Any) -> Any:
    from shmpipe.testing.sources import Counter

    args = dict(transport="shm", capacity=None, ordered=False, start_method=None, timeout=None, slot_size=None, seed=1)
    args.update(kw)
    return check_arguments([Counter(1)] * 2, **args)


def test_arguments_are_checked_before_anything_starts(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(shmpipe.ShmpipeValueError, match="LOCAL_RANK"):
        _check(group="g")
    with pytest.raises(shmpipe.ShmpipeValueError, match="need group="):
        _check(rank=0, num_ranks=2)
    with pytest.raises(shmpipe.ShmpipeValueError, match="rank must be"):
        _check(group="g", rank=2, num_ranks=2)
    with pytest.raises(shmpipe.ShmpipeValueError, match="group must be"):
        _check(group="a b", rank=0, num_ranks=2)
    with pytest.raises(shmpipe.ShmpipeValueError, match="capacity >= "):
        _check(group="g", rank=0, num_ranks=4, capacity=5)
    with pytest.raises(shmpipe.ShmpipeValueError, match="cannot feed several ranks"):
        _check(group="g", rank=0, num_ranks=2, transport="queue")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    options, group = _check(group="g")
    assert (group.rank, group.num_ranks) == (1, 3)
    assert options.capacity >= group_capacity(2, 3, False)
    # NumPy integers are ints (held as Python's); a NumPy bool is not one
    _, group = _check(group="g", rank=np.int64(1), num_ranks=np.uint8(2))
    assert (type(group.rank), type(group.num_ranks)) == (int, int) and (group.rank, group.num_ranks) == (1, 2)
    with pytest.raises(shmpipe.ShmpipeTypeError, match="num_ranks must be"):
        _check(group="g", rank=0, num_ranks=np.True_)


def test_capabilities_say_which_transports_serve_ranks():
    assert shmpipe.get_transport("shm").capabilities.serves_ranks
    assert shmpipe.get_transport("arrow").capabilities.serves_ranks
    assert not shmpipe.get_transport("queue").capabilities.serves_ranks


# -- what a stray connection to rank 0 can do ------------------------------------


def _rank_in_thread(group: str, rank: int, made: dict[int, Any]) -> Any:
    import threading

    from shmpipe.testing.sources import Counter

    def run() -> None:
        try:
            made[rank] = shmpipe.from_iterators(
                [Counter(1)], group=group, rank=rank, num_ranks=2, timeout=10, group_timeout=20
            )
        except BaseException as exc:  # reported by the test
            made[rank] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _connect_raw(group: str) -> Any:
    import socket

    from shmpipe._group import socket_address

    deadline = time.monotonic() + 15
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(socket_address(group))
            sock.settimeout(5)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)


def _finish_group(group: str, made: dict[int, Any], threads: list[Any]) -> None:
    threads.append(_rank_in_thread(group, 1, made))
    try:
        for thread in threads:
            thread.join(30)
        assert all(not t.is_alive() for t in threads)
        assert all(isinstance(made.get(r), shmpipe.RankPipeline) for r in (0, 1)), made
    finally:
        for r in (1, 0):
            if isinstance(made.get(r), shmpipe.RankPipeline):
                made[r].close()


@pytest.mark.parametrize("how", ["silent", "crowd"])
def test_connections_that_never_say_hello_are_closed(monkeypatch, how):
    from shmpipe._group import _door

    monkeypatch.setattr(_door, "HELLO_TIMEOUT_S", 0.5 if how == "silent" else 60.0)
    monkeypatch.setattr(_door, "MAX_PENDING", 2)
    group = _group()
    made: dict[int, Any] = {}
    threads = [_rank_in_thread(group, 0, made)]
    socks = [_connect_raw(group)]
    try:
        if how == "crowd":  # more silent connections than rank 0 keeps: the oldest goes
            socks += [_connect_raw(group), _connect_raw(group)]
        start = time.monotonic()
        assert socks[0].recv(64) == b"", "rank 0 should have closed the connection"
        assert time.monotonic() - start < 3
        if how == "crowd":
            socks[-1].setblocking(False)
            with pytest.raises(BlockingIOError):
                socks[-1].recv(64)  # the newest is still kept
    finally:  # whatever failed, the group completes and closes: nothing left running
        for sock in socks:
            sock.close()
        _finish_group(group, made, threads)


OUT_OF_DESCRIPTORS = """
import os, resource, sys, threading, time
import shmpipe
from shmpipe.testing.sources import Counter

if __name__ == "__main__":
    group = sys.argv[1]
    made = {}

    def rank0():
        try:
            made[0] = shmpipe.from_iterators([Counter(1)], group=group, rank=0, num_ranks=2, timeout=10, group_timeout=6)
        except shmpipe.GroupStartError as exc:
            made[0] = exc

    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    time.sleep(1.0)  # rank 0 listens now
    # No descriptor left: the listener's next accept() fails (EMFILE).
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print("limited", flush=True)
    thread.join(20)
    print("done", type(made.get(0)).__name__, flush=True)
"""


def test_rank_0_out_of_descriptors_does_not_spin(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(OUT_OF_DESCRIPTORS)
    group = _group()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(script), group], stdout=subprocess.PIPE, text=True, env=env)
    socks = []
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "limited"
        for _ in range(3):  # connections the kernel queues and rank 0 cannot accept
            socks.append(_connect_raw(group))

        def cpu_s() -> float:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        before = cpu_s()
        time.sleep(2.0)
        spent = cpu_s() - before
        assert spent < 0.5, f"rank 0 spent {spent:.2f} s of CPU in 2 s, waiting for descriptors"
        out, _ = proc.communicate(timeout=30)
        assert "done GroupStartError" in out  # rank 1 never joined: the group times out, as it should
    finally:
        for sock in socks:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

