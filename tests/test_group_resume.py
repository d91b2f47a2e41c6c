"""A group's checkpoint: from_dataset(group=...) deals one dataset's
batches to the ranks in rounds; any rank's state_dict() at the same step is
the group's position, and a group of another size resumes from it.

Each rank is a real process (this file run as a script, one per rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
import warnings
from typing import Any

import numpy as np
import pytest

import shmpipe
from shmpipe.testing.datasets import FailsAtEpoch, Numbered

HERE = os.path.abspath(__file__)
N, BATCH = 50, 4  # 13 batches an epoch (the last one short)
RANK_TIMEOUT_S = 120


def _arguments() -> dict[str, Any]:
    return dict(batch_size=BATCH, shuffle=True, seed=5, num_workers=2, timeout=60.0)


def _reference(epochs: int) -> list[list[list[int]]]:
    """Each epoch's batches (sample ids) as one pipeline delivers them."""
    with shmpipe.from_dataset(Numbered(N), **_arguments()) as pipe:
        return [[b["i"].tolist() for b in pipe] for _ in range(epochs)]


def _run_group(
    n: int, *, epochs: int, stop: int | None = None, state: dict | None = None, tmp: str, states: list | None = None
) -> list[dict]:
    """n ranks, each iterating `epochs` passes (or `stop` batches), each
    loading `state` (or its own of `states`); their reports in rank order."""
    group = f"r-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    try:
        for rank in range(n):
            cfg = {
                "group": group, "rank": rank, "num_ranks": n, "epochs": epochs, "stop": stop,
                "state": state if states is None else states[rank],
                "barrier": os.path.join(tmp, group),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, HERE, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    env=env, text=True, cwd=tmp,
                )
            )
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=RANK_TIMEOUT_S)
            assert proc.returncode == 0, err[-3000:]
            reports.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return reports


def _dealt(epoch: list[list[int]], n: int) -> list[list[list[int]]]:
    """What each of n ranks gets of these batches: complete rounds only."""
    rounds = len(epoch) // n
    return [[epoch[k * n + r] for k in range(rounds)] for r in range(n)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_a_group_resumes_with_another_number_of_ranks(tmp_path, before, after):
    reference = _reference(epochs=2)
    stop = 2  # batches per rank before the stop
    first = _run_group(before, epochs=2, stop=stop, tmp=str(tmp_path))
    states = [r["state"] for r in first]
    assert all(s == states[0] for s in states), "every rank's state at the same step is the group's"
    state = states[0]
    assert (state["epoch"], state["done_below"], state["done"]) == (0, stop * before, [])
    for rank, report in enumerate(first):
        assert report["batches"] == _dealt(reference[0], before)[rank][:stop]
    rest = _run_group(after, epochs=2, state=state, tmp=str(tmp_path))
    epoch0_rest = reference[0][stop * before :]
    for rank, report in enumerate(rest):
        want = _dealt(epoch0_rest, after)[rank] + _dealt(reference[1], after)[rank]
        assert report["batches"] == want, rank


class _Flips:
    """A sampler whose order reverses at each drawing: a generator of its
    own, as torch's RandomSampler(generator=g) has."""

    def __init__(self) -> None:
        self.drawn = 0

    def __len__(self) -> int:
        return N

    def __iter__(self):
        self.drawn += 1
        return iter(range(N) if self.drawn % 2 else range(N - 1, -1, -1))


def _one_rank_group(sampler: Any) -> Any:
    """A group of one rank in this process: its position and its leader's
    pipeline both draw the sampler."""
    return shmpipe.from_dataset(
        Numbered(N), batch_size=BATCH, sampler=sampler, num_workers=1, timeout=60.0,
        group=f"r-{os.getpid()}-{uuid.uuid4().hex[:8]}", rank=0, num_ranks=1, group_timeout=30,
    )


@pytest.mark.timeout(120)
def test_a_sampler_is_drawn_once_an_epoch_by_a_ranks_count_and_its_leader():
    # Rank 0's process keeps the rank's count (its position) beside the
    # leader's pipeline: drawn by each, a sampler with a generator of its own
    # gave them two orders, and the states named one the batches were not
    # dealt in (every sample read twice or never on resuming); a load drew
    # again and refused the state the process's own draw had made.
    with _one_rank_group(_Flips()) as pipe:
        it = iter(pipe)
        rest = [next(it)["i"].tolist()]
        state = pipe.state_dict()  # the first batch out, of the order drawn (ascending)
        rest += [b["i"].tolist() for b in it]
    assert rest[0] == list(range(BATCH)), "dealt in the order the state named"
    with _one_rank_group(_Flips()) as pipe:
        assert pipe.state_dict()["plan"] is None  # epoch 0 alone: nothing drawn for it
        pipe.load_state_dict(state)
        got = [b["i"].tolist() for _, b in zip(range(2), pipe)]
        assert got == rest[1:3], "the saved run's order, from its second batch"
        assert pipe.state_dict()["done_below"] == 3


@pytest.mark.timeout(120)
def test_a_pass_whose_sampler_fails_is_not_begun_in_a_rank():
    sampler = FailsAtEpoch(N)
    with _one_rank_group(sampler) as pipe:
        assert len([b["i"].tolist() for b in pipe]) == 13
        sampler.fail = True  # before anything drew epoch 1
        with pytest.raises(RuntimeError, match="failed at epoch 1"):
            next(iter(pipe))
        sampler.fail = False
        assert {k: pipe.state_dict()[k] for k in ("epoch", "done_below", "done")} == {
            "epoch": 1, "done_below": 0, "done": []
        }, "no pass of epoch 1 was begun"
        assert len([b["i"].tolist() for b in pipe]) == 13, "the rank and its leader still in step"


@pytest.mark.timeout(300)
def test_a_rank_that_loaded_another_state_fails_the_group_before_its_first_batch(tmp_path):
    # Rank 0's pipeline deals from the state it loaded; a rank that loaded
    # another, or none, took the right batches but counted from elsewhere:
    # its state_dict() named a position the job was not at.
    state = _run_group(2, epochs=1, stop=2, tmp=str(tmp_path))[0]["state"]
    assert state["done_below"] == 4
    for states in ([state, None], [state, {**state, "done_below": 6}], [None, state]):
        reports = _run_group(2, epochs=1, states=states, tmp=str(tmp_path))
        for report in reports:
            assert report["batches"] == [], "no batch before the error"
            assert ", pass 0: rank 1 begins at 'epoch 0, " in report["error"], report
            assert "every rank must load the same state" in report["error"]


@pytest.mark.timeout(120)
def test_ranks_that_loaded_states_of_two_runs_fail_the_group():
    # Two runs' states at the same step name the same position; with
    # seed=None each rank takes its state's seed, so only the order told
    # them apart, which read as a sampler's (a warning): rank 1's states
    # would have named run Y's order with run X's batches (helper 54).
    def state_of(seed: int) -> dict[str, Any]:
        with shmpipe.from_dataset(Numbered(N), batch_size=BATCH, shuffle=True, seed=seed, num_workers=1,
                                  timeout=60.0) as pipe:
            it = iter(pipe)
            for _ in range(4):
                next(it)
            return pipe.state_dict()

    states = [state_of(1), state_of(2)]

    def body(r: int, group: str, done: threading.Barrier) -> str:
        with shmpipe.from_dataset(
            Numbered(N), batch_size=BATCH, shuffle=True, seed=None, num_workers=1, timeout=60.0,
            group=group, rank=r, num_ranks=2, group_timeout=30,
        ) as pipe:
            pipe.load_state_dict(states[r])
            try:
                next(iter(pipe))
                said = "no error"
            except shmpipe.GroupError as exc:
                said = str(exc)
            done.wait()
            return said

    out = _two_ranks_in_threads(body)
    for said in out.values():
        assert ", pass 0: rank 1 begins at 'epoch 0, seed 2, 4 of 13 batches done" in said, out
        assert "every rank must load the same state" in said


class _OwnGenerator:
    """A sampler with a generator of its own, seeded as it is made: each
    draw advances it (torch's RandomSampler(generator=g))."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return N

    def __iter__(self):
        return iter(self.rng.permutation(N).tolist())


def _two_ranks_in_threads(body: Any) -> dict[int, Any]:
    """Ranks 0 and 1 of a group, each a thread of this process running
    body(rank, group, done); what each returned (or raised)."""
    group = f"r-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    done = threading.Barrier(2, timeout=60)  # no rank closes (rank 0's close ends the group) before both are done
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            out[r] = body(r, group, done)
        except BaseException as exc:  # noqa: BLE001 - the test says which
            out[r] = exc
            done.abort()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads)
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    return out


@pytest.mark.timeout(120)
def test_ranks_whose_samplers_draw_other_orders_are_told_and_dealt_rank_0s():
    # A sampler seeded per rank (torch.manual_seed(base + rank), then
    # RandomSampler): the batches are rank 0's draw, every sample once, but
    # rank 1's states would name its own order: said, not refused (it ran
    # before the start check, and rank 0's state is right).
    def body(r: int, group: str, done: threading.Barrier) -> list[list[int]]:
        with shmpipe.from_dataset(
            Numbered(N), batch_size=BATCH, sampler=_OwnGenerator(100 + r), num_workers=1, timeout=60.0,
            group=group, rank=r, num_ranks=2, group_timeout=30,
        ) as pipe:
            got = [b["i"].tolist() for b in pipe]
            done.wait()
            return got

    with pytest.warns(shmpipe.ShmpipeWarning, match=r"rank 1 drew another order for epoch 0 than rank 0 .*only it can resume"):
        out = _two_ranks_in_threads(body)
    samples = [i for r in (0, 1) for b in out[r] for i in b]
    assert len(out[0]) == len(out[1]) == 6 and len(set(samples)) == len(samples) == 48


@pytest.mark.timeout(120)
def test_an_epoch_that_goes_to_no_rank_is_said_once_a_rank():
    # One batch for two ranks. Rank 0's process runs its count and the
    # leader's pipeline: both said it, once from the dispatch thread
    # (helper 52); each rank's count says it now.
    def body(r: int, group: str, done: threading.Barrier) -> int:
        with shmpipe.from_dataset(
            Numbered(BATCH), batch_size=BATCH, num_workers=1, timeout=60.0, group=group, rank=r, num_ranks=2,
            group_timeout=30,
        ) as pipe:
            got = len(list(pipe))
            done.wait()
            return got

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = _two_ranks_in_threads(body)
    assert out == {0: 0, 1: 0}
    told = [w for w in said if "goes to no rank" in str(w.message)]
    assert len(told) == 2, [str(w.message) for w in told]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ahead", [1, 4])
def test_rank_0_may_begin_epochs_before_its_leader_deals_them(ahead):
    # Rank 0 leaves passes at once and begins a later one (its count draws
    # those epochs) while the leader still waits for rank 1 to begin pass 0:
    # with only the last draw kept (helper 52), or the last 3 (helper 54),
    # the leader drew an epoch again, another order, and the group failed
    # or rank 0's states named an order that was never dealt.
    began = threading.Event()

    def body(r: int, group: str, done: threading.Barrier) -> list[list[int]]:
        with shmpipe.from_dataset(
            Numbered(N), batch_size=BATCH, sampler=_OwnGenerator(7), num_workers=1, timeout=60.0,
            group=group, rank=r, num_ranks=2, group_timeout=30,
        ) as pipe:
            if r == 0:
                for _ in range(ahead):
                    iter(pipe)  # a pass, left at once
                last = iter(pipe)
                began.set()
                got = [b["i"].tolist() for b in last]
            else:
                assert began.wait(30)
                got = [[b["i"].tolist() for b in pipe] for _ in range(ahead + 1)][-1]
            done.wait()
            return got

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = _two_ranks_in_threads(body)
    assert not [str(w.message) for w in said if "drew another order" in str(w.message)], "one draw of each epoch"
    samples = [i for r in (0, 1) for b in out[r] for i in b]
    assert len(out[0]) == len(out[1]) == 6 and len(set(samples)) == len(samples) == 48


def _rank_main(cfg: dict[str, Any]) -> None:
    report: dict[str, Any] = {"rank": cfg["rank"], "batches": []}
    with shmpipe.from_dataset(
        Numbered(N), group=cfg["group"], rank=cfg["rank"], num_ranks=cfg["num_ranks"], **_arguments()
    ) as pipe:
        if cfg["state"] is not None:
            pipe.load_state_dict(cfg["state"])
        epochs = cfg["state"]["epoch"] if cfg["state"] else 0
        try:
            for _ in range(epochs, cfg["epochs"]):
                for b in pipe:
                    report["batches"].append(b["i"].tolist())
                    if len(report["batches"]) == cfg["stop"]:
                        break
                else:
                    continue
                break
            report["state"] = pipe.state_dict()
        except shmpipe.GroupError as exc:
            report["error"] = str(exc)
        # A preemption stops every rank at once: none closes the group (rank
        # 0's close ends it for the others) before all have their state.
        os.makedirs(cfg["barrier"], exist_ok=True)
        open(os.path.join(cfg["barrier"], str(cfg["rank"])), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(cfg["barrier"])) < cfg["num_ranks"] and time.monotonic() < deadline:
            time.sleep(0.01)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))


@pytest.mark.timeout(120)
def test_a_ranks_close_from_another_thread_is_a_close_for_its_own_take(monkeypatch):
    # A rank's close() closes its reader before the stream counted as
    # closed: a take in another thread that then met a batch said the ring
    # was closed in this rank (CorruptChannelError, a fault) rather than
    # PipelineClosedError (helper 62: 3 of 35 group trials; 5 of 5 with the
    # window held open, as here).
    from shmpipe._group import _rank

    closes_reader = _rank.RankPipeline._before_close

    def slowly(self):
        closes_reader(self)
        time.sleep(0.3)  # (a close preempted right there)

    monkeypatch.setattr(_rank.RankPipeline, "_before_close", slowly)
    pipe = shmpipe.from_dataset(
        Numbered(1 << 20), batch_size=BATCH, num_workers=1, timeout=60.0,
        group=f"r-{os.getpid()}-{uuid.uuid4().hex[:8]}", rank=0, num_ranks=1, group_timeout=30,
    )
    ended: list[BaseException] = []

    def consume():
        try:
            for _ in pipe:
                time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001 - what the take ended in is the test's
            ended.append(exc)

    reader = threading.Thread(target=consume)
    reader.start()
    time.sleep(0.5)
    pipe.close()
    reader.join(30)
    assert not reader.is_alive()
    assert len(ended) == 1 and type(ended[0]) is shmpipe.PipelineClosedError, ended
