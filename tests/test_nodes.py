"""A job of several nodes: from_dataset(num_nodes=K, node_rank=r) deals one
global order over every rank of every node, each node fetching only its
own ranks' batches, and a checkpoint is the job's position, which any other
layout resumes from.

Nodes are simulated on this machine, as real nodes would run them: each
node is its own group (its own name: nodes never share memory) of real rank
processes (tests/nodes_rank.py run as a script, one per rank), with its own
producers; a node of one rank is a pipeline without a group. The global
rule the tests hold every rank to is written out here, apart from the code
(`dealt`).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import uuid
import warnings
from typing import Any

import numpy as np
import pytest
from conftest import concurrently
from nodes_rank import BATCH, SEED, N, arguments

import shmpipe
from shmpipe._nodes import NodeLayout, check_nodes
from shmpipe._schedule import DatasetSchedule
from shmpipe.testing.datasets import Numbered

#: One rank of a node (or of torchrun): tests/nodes_rank.py run as a script.
RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nodes_rank.py")
LAYOUTS = [(1, 2), (2, 2), (2, 1), (3, 2)]  # (nodes, ranks per node)
FRACTIONS = (0.1, 0.5, 0.9)
RANK_TIMEOUT_S = 120


def dealt(batches: list[Any], nodes: int, ranks: int) -> list[list[Any]]:
    """What each global rank of a layout gets of `batches` (those left of
    an epoch, in order): rank g gets g, g + W, ...; complete rounds only."""
    w = nodes * ranks
    rounds = len(batches) // w
    return [[batches[j * w + g] for j in range(rounds)] for g in range(w)]


def step_at(fraction: float, batches: int, nodes: int, ranks: int) -> int:
    """The step (batches per rank) at `fraction` of an epoch of a layout."""
    rounds = batches // (nodes * ranks)
    return min(rounds - 1, max(1, round(fraction * rounds)))


@pytest.fixture(scope="module")
def epochs() -> list[list[list[int]]]:
    """Two epochs' batches (sample ids) as one pipeline of one node delivers them."""
    with shmpipe.from_dataset(Numbered(N), num_workers=1, **arguments()) as pipe:
        return [[b["i"].tolist() for b in pipe] for _ in range(2)]


# -- the schedule alone: every layout, every resume ---------------------------------------


def _schedule(nodes: int, ranks: int, node: int, default_collate: bool = False, length: int = N) -> DatasetSchedule:
    return DatasetSchedule(
        2, SEED, True, length=length, batch_size=BATCH, shuffle=True, drop_last=False, sampler=None,
        batch_sampler=None, layout=NodeLayout(nodes, node, ranks), default_collate=default_collate,
    )


def _node_batches(schedule: DatasetSchedule, pass_no: int) -> tuple[list[list[int]], int]:
    """A node's batches of its next pass as its ordered pipeline delivers
    them (worker by worker in turn), and the batches the schedule dropped."""
    works = schedule.begin(pass_no)
    per_worker = []
    for work in works:
        per_worker.append([work.plan.samples(k) for k in range(len(work.plan))])
    out = []
    for k in range(max(map(len, per_worker))):
        out.extend(batches[k] for batches in per_worker if k < len(batches))
    return out, schedule.dropped


def _job(nodes: int, ranks: int, state: dict | None, length: int = N) -> tuple[list[list[list[int]]], int]:
    """Each global rank's batches of a job's next pass (the nodes'
    schedules, each node's share split among its ranks in rounds), and the
    batches dropped."""
    per_rank: list[list[list[int]]] = []
    drops = set()
    for node in range(nodes):
        schedule = _schedule(nodes, ranks, node, length=length)
        if state is not None:
            schedule.load(state)
        mine, dropped = _node_batches(schedule, 0)
        drops.add(dropped)
        per_rank.extend(mine[r :: ranks] for r in range(ranks))
    assert len(drops) == 1, "every node counts the same remainder"
    return per_rank, drops.pop()


@pytest.mark.parametrize(("nodes", "ranks"), LAYOUTS + [(1, 1), (4, 3)])
def test_every_rank_gets_the_global_rule_and_every_sample_is_read_once(epochs, nodes, ranks):
    per_rank, dropped = _job(nodes, ranks, None)
    assert per_rank == dealt(epochs[0], nodes, ranks)
    read = sorted(i for batches in per_rank for b in batches for i in b)
    assert len(read) == len(set(read)), "no sample is fetched on two nodes (or by two ranks)"
    assert dropped == len(epochs[0]) % (nodes * ranks)
    assert len(read) + sum(len(b) for b in epochs[0][len(epochs[0]) - dropped :]) == N


@pytest.mark.parametrize("before", LAYOUTS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_state_resumes_on_every_other_layout_with_nothing_lost_or_repeated(epochs, before, fraction):
    nodes, ranks = before
    step = step_at(fraction, len(epochs[0]), nodes, ranks)
    # Every rank of every node counts its own way to the same state.
    states = []
    for node in range(nodes):
        position = _schedule(nodes, ranks, node).one_reader(share_draws=False)
        position.begin(0)
        states.append(position.state_after_rounds(step))
    assert all(s == states[0] for s in states)
    state = states[0]
    out = epochs[0][: step * nodes * ranks]
    for after in LAYOUTS:
        if after == before:
            continue
        per_rank, dropped = _job(*after, state)
        rest = epochs[0][len(out) :]
        assert per_rank == dealt(rest, *after), (after, "the rest, dealt in rounds of the new layout")
        delivered = out + [b for batches in per_rank for b in batches]
        ids = [i for b in delivered for i in b]
        assert len(ids) == len(set(ids)), "nothing repeated"
        assert len(delivered) == len(epochs[0]) - dropped, "nothing lost but the new layout's remainder"


def _states_at_each_fraction(epochs) -> list[dict | None]:
    states: list[dict | None] = [None]
    for nodes, ranks in LAYOUTS:
        for fraction in FRACTIONS:
            position = _schedule(nodes, ranks, 0).one_reader(share_draws=False)
            position.begin(0)
            states.append(position.state_after_rounds(step_at(fraction, len(epochs[0]), nodes, ranks)))
    for step in range(1, 13):  # one rank, each step: every count of batches left, modulo any W here
        position = _schedule(1, 1, 0).one_reader(share_draws=False)
        position.begin(0)
        states.append(position.state_after_rounds(step))
    return states


@pytest.mark.parametrize(("nodes", "ranks"), LAYOUTS + [(1, 1), (4, 3)])
def test_only_a_rank_that_may_get_the_short_batch_says_the_sizes_vary(epochs, nodes, ranks):
    # The short batch is an epoch's last: in rounds of W it can only reach
    # the last rank of the last node (to_tf_dataset leaves the batch axis
    # unknown there, and fixed everywhere else), fresh or resumed from any
    # layout's state.
    says = [_schedule(nodes, ranks, g // ranks).batch_sizes_vary(g % ranks) for g in range(nodes * ranks)]
    assert says == [g == nodes * ranks - 1 for g in range(nodes * ranks)]
    assert [_schedule(nodes, ranks, node).batch_sizes_vary() for node in range(nodes)] == [
        node == nodes - 1 for node in range(nodes)
    ]
    # Its rows where the default collate makes the batches (to_jax refuses a
    # sharding that cannot split them at the first batch): only where every
    # fresh epoch gives that rank the short batch, an epoch of whole rounds
    # (helper 93: 61 batches on 2 ranks never deal it, and to_jax refused).
    w = nodes * ranks
    for length in (N, 2 * BATCH * w - 1):  # 61 batches; 2W batches, the last one short
        whole = -(-length // BATCH) % w == 0
        assert [
            _schedule(nodes, ranks, g // ranks, default_collate=True, length=length).short_batch(g % ranks)
            for g in range(w)
        ] == [length % BATCH if g == w - 1 and whole else None for g in range(w)], length
        assert {_schedule(nodes, ranks, g // ranks, length=length).short_batch(g % ranks) for g in range(w)} == {None}
        if whole:  # and that rank does get it, every epoch
            per_rank, _ = _job(nodes, ranks, None, length=length)
            assert [len(b) for b in per_rank[-1]][-1] == length % BATCH, length
    got_short = set()
    for state in _states_at_each_fraction(epochs):
        per_rank, _ = _job(nodes, ranks, state)
        got_short |= {g for g, batches in enumerate(per_rank) if any(len(b) < BATCH for b in batches)}
        for g, batches in enumerate(per_rank):
            if not says[g]:
                assert all(len(b) == BATCH for b in batches), (g, state)
    assert got_short == {nodes * ranks - 1}, "some state gives the last rank the short batch"


def test_the_state_at_the_last_complete_round_is_the_next_epochs_start(epochs):
    nodes, ranks = 3, 2
    position = _schedule(nodes, ranks, 1).one_reader(share_draws=False)
    position.begin(0)
    state = position.state_after_rounds(len(epochs[0]) // 6)
    assert (state["epoch"], state["done_below"], state["done"]) == (1, 0, [])


def test_a_nodes_workers_draw_seeds_of_their_own():
    seeds = [[w.seed for w in _schedule(2, 1, node).begin(0)] for node in range(2)]
    assert len({*seeds[0], *seeds[1]}) == 4
    single = DatasetSchedule(
        2, SEED, True, length=N, batch_size=BATCH, shuffle=True, drop_last=False, sampler=None, batch_sampler=None
    )
    assert [w.seed for w in single.begin(0)] == seeds[0], "node 0's seeds are a single node's"


# -- real pipelines of one rank per node, in this process ------------------------------------


def _simulate(nodes: int, steps: int | None = None, state: dict | None = None, **kw: Any) -> tuple[list, list]:
    """K nodes of one rank, each its own pipeline (real producers), taken
    in lockstep as DDP's ranks are: (each rank's batches, each one's state)."""
    pipes = [
        shmpipe.from_dataset(Numbered(N), num_nodes=nodes, node_rank=r, **arguments(num_workers=1) | kw)
        for r in range(nodes)
    ]
    try:
        if state is not None:
            for pipe in pipes:
                pipe.load_state_dict(state)
        its = [iter(pipe) for pipe in pipes]
        got: list[list[list[int]]] = [[] for _ in pipes]
        while steps is None or len(got[0]) < steps:
            batches = [next(it, None) for it in its]
            if all(b is None for b in batches):
                break
            assert None not in batches, "every rank gets the same number of batches"
            for mine, b in zip(got, batches):
                mine.append(b["i"].tolist())
            del batches
        return got, [pipe.state_dict() for pipe in pipes]
    finally:
        for pipe in pipes:
            pipe.close()


@pytest.mark.parametrize(
    "kw", [dict(), dict(transport="arrow"), dict(num_workers=3)], ids=["shm", "arrow", "3-workers"]
)
def test_nodes_of_one_rank_deliver_the_global_rule_on_any_transport_and_workers(epochs, kw):
    got, states = _simulate(2, **kw)
    assert got == dealt(epochs[0], 2, 1)
    assert all(s["epoch"] == 1 and s["done_below"] == 0 for s in states)


def test_nodes_of_one_rank_resume_on_three_nodes_with_a_nodes_stats(epochs):
    got, states = _simulate(2, steps=10)
    assert got == [b[:10] for b in dealt(epochs[0], 2, 1)]
    assert all(s == states[0] for s in states)
    rest, _ = _simulate(3, state=states[0])
    assert rest == dealt(epochs[0][20:], 3, 1)
    with shmpipe.from_dataset(Numbered(N), num_nodes=3, node_rank=2, **arguments(num_workers=1)) as pipe:
        assert sum(1 for _ in pipe) == len(epochs[0]) // 3
        extra = pipe.stats().extra
    assert extra.pop("made_by_trainer") in range(len(epochs[0]) // 3 + 1)
    assert extra == {"num_nodes": 3, "node_rank": 2, "dropped_remainder": 1, "dropped_per_pass": [1]}


def test_an_unordered_node_cannot_tell_the_jobs_position():
    with shmpipe.from_dataset(Numbered(N), num_nodes=2, node_rank=0, ordered=False, **arguments()) as pipe:
        next(iter(pipe))
        with pytest.raises(shmpipe.ShmpipeValueError, match="ordered=True"):
            pipe.state_dict()


# -- bad input ---------------------------------------------------------------------------------


ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


def _launched_with(monkeypatch, env: dict[str, str]) -> None:
    """The launcher's variables (ENV) are `env`'s, and none other of them."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_an_epoch_of_fewer_batches_than_ranks_is_said_to_go_to_no_rank():
    # Complete rounds only: 2 batches on 3 nodes give every rank nothing,
    # every epoch (helper 51: a job that silently trained on nothing).
    for node in range(3):
        with shmpipe.from_dataset(Numbered(3), num_workers=1, num_nodes=3, node_rank=node,
                                  **arguments(batch_size=2)) as pipe:
            with pytest.warns(shmpipe.ShmpipeWarning, match=r"an epoch of 2 batches goes to no rank: .*\(3 nodes of 1 rank\)"):
                assert list(pipe) == []
    with shmpipe.from_dataset(Numbered(6), num_workers=1, num_nodes=3, node_rank=2, **arguments(batch_size=2)) as pipe:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a round each: nothing said
            assert len(list(pipe)) == 1
    # However many: 2**63 nodes was numpy's "Maximum allowed dimension
    # exceeded" at the first iter() (helper 90), and 2**62 "array is too big".
    for nodes in (2**62, 2**63):
        with shmpipe.from_dataset(Numbered(3), num_workers=1, num_nodes=nodes, node_rank=nodes - 1,
                                  **arguments(batch_size=2)) as pipe:
            with pytest.warns(shmpipe.ShmpipeWarning, match=rf"an epoch of 2 batches goes to no rank: .*\({nodes} nodes"):
                assert list(pipe) == []


def test_numpy_integers_are_a_layout_as_ints_are(monkeypatch):
    _launched_with(monkeypatch, {})
    layout = check_nodes(np.int64(2), np.uint8(1), 1, False)
    assert layout == NodeLayout(2, 1, 1) and (type(layout.num_nodes), type(layout.node_rank)) == (int, int)
    assert check_nodes(np.int64(1), np.int64(0), 1, False, sharded=True) == NodeLayout(1, 0, 1)


@pytest.mark.parametrize(
    ("env", "kw", "match"),
    [
        ({}, dict(num_nodes=2, node_rank=2), r"node_rank must be an int in \[0, 2\)"),
        ({}, dict(num_nodes=2, node_rank=-1), r"node_rank must be an int in \[0, 2\)"),
        ({}, dict(num_nodes=0), "num_nodes must be a positive int"),
        ({}, dict(num_nodes=2, node_rank="1"), "node_rank must be an int"),
        ({}, dict(num_nodes=1, node_rank=1), "node_rank must be 0 with num_nodes=1"),
        ({}, dict(num_nodes=2), r"num_nodes=2 needs node_rank= .*GROUP_RANK or NODE_RANK"),
        # num_nodes not given: the message says where 2 nodes came from
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, dict(),
         r"^2 nodes \(WORLD_SIZE=2, LOCAL_WORLD_SIZE=1 in the environment\) need node_rank="),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}, dict(num_nodes=2), r"num_nodes=2 disagrees .*4 nodes.*num_nodes=1"),
        ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, dict(), "not a multiple of LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "0", "LOCAL_WORLD_SIZE": "0"}, dict(), "must both be positive"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "3"}, dict(node_rank=1), r"node_rank=1 .*GROUP_RANK=3"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "7"}, dict(), r"GROUP_RANK=7 is not a node of 4"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, dict(), r"LOCAL_WORLD_SIZE=2.*group="),
        ({"NODE_RANK": "x"}, dict(num_nodes=2), "NODE_RANK='x' is not an int"),
        # One node by default, yet the launcher numbers this node above 0:
        # dealt its own epoch, every node would read every sample.
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "3"}, dict(),
         r"GROUP_RANK=3 says this is node 3 .*LOCAL_WORLD_SIZE=4: 1 node: .*num_nodes=1"),
        ({"WORLD_SIZE": "8", "NODE_RANK": "1"}, dict(), r"NODE_RANK=1 says .*nothing says how many nodes"),
        ({"GROUP_RANK": "-2"}, dict(), r"GROUP_RANK=-2 is not a node's number"),
        ({"GROUP_RANK": "3"}, dict(node_rank=0), r"GROUP_RANK=3 says this is node 3"),
        ({}, dict(num_nodes=1, node_rank=False), "node_rank must be 0 with num_nodes=1"),
        ({}, dict(node_rank=0.0), "node_rank must be 0 with one node"),
        ({}, dict(num_nodes=2, node_rank=0, seed=None), "needs seed=.*read some samples twice"),
        # without shuffle too: each node's state would hold a seed of its own (helper 41)
        ({}, dict(num_nodes=2, node_rank=0, seed=None, shuffle=False), "needs seed=.*every rank's state_dict"),
    ],
)
def test_bad_node_arguments_are_refused(monkeypatch, env, kw, match):
    _launched_with(monkeypatch, env)
    # A node argument that is no int at all (a str, a bool, a float) is a
    # TypeError; an int out of range, or a layout that does not hold, a ValueError.
    wrong_type = any(k in ("num_nodes", "node_rank") and type(v) is not int for k, v in kw.items())
    with pytest.raises(shmpipe.ShmpipeTypeError if wrong_type else shmpipe.ShmpipeValueError, match=match):
        shmpipe.from_dataset(Numbered(N), num_workers=1, **arguments() | kw)


def test_the_environment_gives_the_defaults(monkeypatch):
    for name in ("GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("NODE_RANK", "2")
    assert check_nodes(None, None, 2, True) == NodeLayout(3, 2, 2)
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's name comes first
    assert check_nodes(None, None, 2, True) == NodeLayout(3, 1, 2)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # (2 ranks on the node without a group: a warning, below)
    for name in ("GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(name)
    assert check_nodes(None, None, 1, False) == NodeLayout(1, 0, 1), "one node where the launcher says nothing"
    monkeypatch.setenv("GROUP_RANK", "0")
    assert check_nodes(None, None, 1, False) == NodeLayout(1, 0, 1), "or numbers its one node 0"


@pytest.mark.parametrize(
    ("env", "num_ranks", "match"),
    [
        # a group per rank on a node of 2 (helper 51: every sample read twice)
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, 1,
         r"LOCAL_WORLD_SIZE=2\), and the group has 1: .*num_ranks=2.*pass num_nodes= and node_rank="),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}, 2, r"the group has 2: .*num_ranks=4"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, 4, r"the group has 4"),
    ],
)
def test_a_group_that_is_not_the_launchers_node_is_refused_unless_the_layout_is_given(
    monkeypatch, env, num_ranks, match
):
    _launched_with(monkeypatch, env)
    with pytest.raises(shmpipe.ShmpipeValueError, match=match):
        check_nodes(None, None, num_ranks, True)
    with pytest.raises(shmpipe.ShmpipeValueError, match=match):
        check_nodes(2, None, num_ranks, True)  # the node's rank still the environment's
    # Both given: taken as the layout (tensor parallel peers: helper 52),
    # said (a script passing the launcher's numbers: helper 54).
    with pytest.warns(shmpipe.ShmpipeWarning, match=r"taken as the layout num_nodes= and node_rank= say"):
        assert check_nodes(2, 1, num_ranks, True) == NodeLayout(2, 1, num_ranks)
    with pytest.warns(shmpipe.ShmpipeWarning, match=r"each calling from_dataset: taken as the layout"):
        assert check_nodes(2, 1, 1, False) == NodeLayout(2, 1, 1)  # one data-parallel rank a node, no group
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(num_ranks))
    monkeypatch.setenv("WORLD_SIZE", str(2 * num_ranks))
    assert check_nodes(None, None, num_ranks, True) == NodeLayout(2, 1, num_ranks), "the launcher's node"


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"},
                                 {"LOCAL_WORLD_SIZE": "2"}], ids=["torchrun", "local-only"])
def test_ranks_of_one_node_that_may_each_read_the_whole_epoch_are_told(monkeypatch, env):
    # One node of 2 ranks, each calling from_dataset without a group: as
    # data-parallel ranks each read the whole epoch, silently (helper 75).
    # Said, not refused: ranks that shard the dataset themselves, rank 0's
    # pipeline alone, tensor parallel peers do the same (helper 78). A group
    # of the node's ranks, a sampler that shards, num_nodes=1 say nothing.
    _launched_with(monkeypatch, env)
    with pytest.warns(shmpipe.ShmpipeWarning, match=r"this node runs 2 ranks \(LOCAL_WORLD_SIZE=2\) and this pipeline "
                      r"deals the whole epoch: .*group=\.\.\., num_ranks=2.*pass num_nodes=1") as seen:
        pipe = shmpipe.from_dataset(Numbered(N), num_workers=1, seed=0, timeout=60.0)
    assert seen[0].filename == __file__  # the caller's line
    with pipe:
        assert sum(len(b["i"]) for b in pipe) == N
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_nodes(None, None, 1, False, sharded=True) == NodeLayout(1, 0, 1)
        assert check_nodes(None, None, 2, True) == NodeLayout(1, 0, 2)
        assert check_nodes(1, None, 1, False) == NodeLayout(1, 0, 1)
        assert check_nodes(1, None, 1, True) == NodeLayout(1, 0, 1)


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"},
                                 {"LOCAL_WORLD_SIZE": "4"}], ids=["torchrun", "local-only"])
def test_a_group_that_is_not_every_rank_of_one_node_is_told(monkeypatch, env):
    # A group per rank, or two groups on a node: each group read the whole
    # epoch, silently, where the same on several nodes is refused and ranks
    # without a group are told (helper 80).
    _launched_with(monkeypatch, env)
    local = int(env["LOCAL_WORLD_SIZE"])
    told = rf"this node runs {local} ranks \(LOCAL_WORLD_SIZE={local}\) and this pipeline's group has 1 of them, .*num_ranks={local}"
    with pytest.warns(shmpipe.ShmpipeWarning, match=told + r".*pass num_nodes=1") as seen:
        pipe = shmpipe.from_dataset(Numbered(N), num_workers=1, seed=0, timeout=60.0,
                                    group=f"nodes-{os.getpid()}-{uuid.uuid4().hex[:8]}", rank=0, num_ranks=1)
    assert seen[0].filename == __file__  # the caller's line
    with pipe:
        assert sum(len(b["i"]) for b in pipe) == N
    if local == 4:  # two groups of 2 on a node of 4
        with pytest.warns(shmpipe.ShmpipeWarning, match=r"group has 2 of them"):
            assert check_nodes(None, None, 2, True) == NodeLayout(1, 0, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_nodes(None, None, local, True) == NodeLayout(1, 0, local)  # every rank of the node
        assert check_nodes(None, None, 8, True) == NodeLayout(1, 0, 8)  # more: its start says so


def test_a_launcher_of_one_task_a_node_is_no_node_of_ranks(monkeypatch):
    # Slurm with a task per node that runs a group of 8 itself: WORLD_SIZE
    # counts the tasks, and nothing says ranks per node (helper 52).
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    assert check_nodes(2, None, 8, True) == NodeLayout(2, 1, 8)


def test_num_nodes_1_always_holds_and_reads_no_environment(monkeypatch):
    """A job that shards the data itself keeps doing so under a launcher of
    several nodes; one node's user is not held to other tools' variables."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("NODE_RANK", "garbage")
    assert check_nodes(1, None, 1, False) == NodeLayout(1, 0, 1)
    assert check_nodes(1, 0, 2, True) == NodeLayout(1, 0, 2)


def test_a_sampler_that_shards_the_job_already_is_refused_on_several_nodes(epochs):
    torch_data = pytest.importorskip("torch.utils.data")
    sharded = torch_data.distributed.DistributedSampler(Numbered(N), num_replicas=2, rank=0, shuffle=False)
    for kw in (dict(sampler=sharded, batch_size=BATCH), dict(batch_sampler=torch_data.BatchSampler(sharded, BATCH, False))):
        with pytest.raises(shmpipe.ShmpipeValueError, match=r"shard of the job already \(DistributedSampler with "
                           r"num_replicas=2\).*num_nodes=1 to keep your own sharding"):
            shmpipe.from_dataset(Numbered(N), num_nodes=2, node_rank=1, num_workers=1, seed=SEED, **kw)
    sharded.num_replicas = np.int64(2)  # (a sampler of a user's may count its replicas in NumPy)
    with pytest.raises(shmpipe.ShmpipeValueError, match=r"shard of the job already"):
        shmpipe.from_dataset(Numbered(N), num_nodes=2, node_rank=1, num_workers=1, seed=SEED, sampler=sharded,
                             batch_size=BATCH)
    sharded.num_replicas = 2
    # One node: the sampler's own shard, as a DataLoader would read it.
    with shmpipe.from_dataset(Numbered(N), num_nodes=1, sampler=sharded, batch_size=BATCH, num_workers=1) as pipe:
        assert sorted(i for b in pipe for i in b["i"].tolist()) == list(range(0, N + 1, 2))[: (N + 1) // 2]


def test_an_unordered_node_has_a_state_before_it_delivers(epochs):
    with shmpipe.from_dataset(Numbered(N), num_nodes=2, node_rank=1, **arguments(num_workers=1)) as ordered:
        it = iter(ordered)
        for _ in range(3):
            next(it)
        state = ordered.state_dict()
        del it
    with shmpipe.from_dataset(Numbered(N), num_nodes=2, node_rank=1, ordered=False, **arguments()) as pipe:
        pipe.load_state_dict(state)
        assert pipe.state_dict() == state


def test_a_state_of_another_job_is_refused_on_any_layout(epochs):
    with shmpipe.from_dataset(Numbered(N + 1), num_nodes=2, node_rank=1, **arguments(num_workers=1)) as pipe:
        state = pipe.state_dict()
    with shmpipe.from_dataset(Numbered(N), num_nodes=3, node_rank=1, **arguments(num_workers=1)) as pipe:
        with pytest.raises(shmpipe.ShmpipeValueError, match="the state's length is 122"):
            pipe.load_state_dict(state)


# -- real processes: every layout, resumed on every other, a producer killed on each node --


def run_job(nodes: int, ranks: int, *, tmp: str, state: dict | None = None, epochs: int = 1,
            states_at: tuple[int, ...] = (), kill: int | None = None, transport: str = "shm",
            overrides: dict[tuple[int, int], dict[str, Any]] | None = None) -> list[dict]:
    """A job of `nodes` simulated nodes of `ranks` rank processes each (a
    group per node, none for one rank); each rank iterates `epochs` passes,
    saving its state_dict() after each step of `states_at`. `kill`: the node
    whose rank 0 SIGKILLs one of its producers after its first batch
    (max_restarts=1). `overrides`: (node, rank) -> config keys that rank
    gets instead. The ranks' reports in global rank order."""
    job = uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK"):
        env.pop(name, None)
    procs = []
    try:
        for node in range(nodes):
            for rank in range(ranks):
                cfg = {
                    "group": f"n{node}-{os.getpid()}-{job}" if ranks > 1 else None, "rank": rank,
                    "num_ranks": ranks, "num_nodes": nodes, "node_rank": node, "epochs": epochs,
                    "states_at": list(states_at), "state": state, "barrier": os.path.join(tmp, job),
                    "world": nodes * ranks, "kill": kill == node and rank == 0, "transport": transport,
                } | (overrides or {}).get((node, rank), {})
                procs.append(
                    subprocess.Popen(
                        [sys.executable, RANK, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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


def _steps(layout: tuple[int, int], batches: int) -> list[int]:
    return [step_at(f, batches, *layout) for f in FRACTIONS]


#: Each layout's state at each fraction resumes on another layout, every
#: other layout once; half of them on arrow; in each, node (i + j) % K
#: SIGKILLs one of its producers (max_restarts=1).
RESUMES = [
    (before, j, [a for a in LAYOUTS if a != before][(i + j) % 3], "arrow" if (i + j) % 2 else "shm", (i + j))
    for i, before in enumerate(LAYOUTS)
    for j in range(len(FRACTIONS))
]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, epochs) -> dict[tuple[int, int], list[dict]]:
    """Each layout's job over one epoch, its ranks saving their states at
    10, 50 and 90% of it: two jobs at a time."""
    tmp = str(tmp_path_factory.mktemp("nodes"))
    calls = [
        functools.partial(run_job, *layout, tmp=tmp, states_at=tuple(_steps(layout, len(epochs[0]))))
        for layout in LAYOUTS
    ]
    return dict(zip(LAYOUTS, concurrently(calls, timeout=400)))


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory, first_runs) -> list[list[dict]]:
    tmp = str(tmp_path_factory.mktemp("resumed"))
    calls = [
        functools.partial(
            run_job, *after, tmp=tmp, state=first_runs[before][0]["states"][j], epochs=2, transport=transport,
            kill=kill % after[0],
        )
        for before, j, after, transport, kill in RESUMES
    ]
    return concurrently(calls, timeout=600)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{k}x{n}" for k, n in LAYOUTS])
def test_every_layout_delivers_the_global_rule_and_every_sample_once(first_runs, epochs, layout):
    reports = first_runs[layout]
    w = layout[0] * layout[1]
    assert [r["batches"] for r in reports] == dealt(epochs[0], *layout)
    ids = [i for r in reports for b in r["batches"] for i in b]
    assert len(ids) == len(set(ids)), "every sample at most once across all ranks of all nodes"
    remainder = epochs[0][len(epochs[0]) - len(epochs[0]) % w :] if len(epochs[0]) % w else []
    assert sorted(ids + [i for b in remainder for i in b]) == list(range(N)), "and once, the remainder aside"
    assert all(r["dropped"] == [len(epochs[0]) % w] for r in reports)
    for j, step in enumerate(_steps(layout, len(epochs[0]))):
        states = [r["states"][j] for r in reports]
        assert all(s == states[0] for s in states), "every rank's state at the same step is the job's"
        assert (states[0]["epoch"], states[0]["done_below"], states[0]["done"]) == (0, step * w, [])


@pytest.mark.timeout(650)
@pytest.mark.parametrize(
    "case", range(len(RESUMES)),
    ids=[f"{b[0]}x{b[1]}@{FRACTIONS[j]:.0%}->{a[0]}x{a[1]}-{t}-kill{k % a[0]}" for b, j, a, t, k in RESUMES],
)
def test_a_state_resumes_on_another_layout_and_a_killed_producer_changes_nothing(resumed_runs, epochs, case):
    before, j, after, _, kill = RESUMES[case]
    reports = resumed_runs[case]
    done = _steps(before, len(epochs[0]))[j] * before[0] * before[1]
    left = epochs[0][done:]
    w = after[0] * after[1]
    for g, report in enumerate(reports):
        assert report["batches"] == dealt(left, *after)[g] + dealt(epochs[1], *after)[g], g
        assert report["dropped"] == [len(left) % w, len(epochs[1]) % w]
    ids = [i for b in epochs[0][:done] for i in b]
    ids += [i for r in reports for b in r["batches"][: len(left) // w] for i in b]
    assert len(ids) == len(set(ids)), "nothing of the epoch read twice"
    assert [r["restarts"] for r in reports] == [int(g == (kill % after[0]) * after[1]) for g in range(w)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("field", ["num_nodes", "length"])
def test_ranks_of_a_node_that_disagree_on_the_job_do_not_start(tmp_path, field):
    """Rank 1 of node 0 was given 3 nodes, or a dataset of another length:
    the hello where the node's ranks meet refuses it, naming the field."""
    other = {"num_nodes": 3} if field == "num_nodes" else {"length": N + 1}
    alone = {"world": 2}  # node 1's ranks wait for each other only: node 0's never get a pipeline
    reports = run_job(2, 2, tmp=str(tmp_path), overrides={(0, 1): other, (1, 0): alone, (1, 1): alone})
    want = "num_nodes: 3 vs 2" if field == "num_nodes" else f"length: {N + 1} vs {N}"
    for report in reports[:2]:
        assert report["error"].startswith("GroupStartError"), report
        assert f"calls from_dataset with other arguments than rank 0: {want}" in report["error"], report
    assert all("error" not in r for r in reports[2:]), "node 1 is another node: nothing of node 0 reaches it"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(300)
def test_torchrun_of_two_nodes_gives_the_layout_from_its_environment(tmp_path, epochs):
    """Two torchrun agents, --nnodes 2 with a local rendezvous (static: the
    node rank is --node-rank), 2 ranks each: the ranks pass no node or rank
    argument, only group= (per node: simulated nodes share this machine)."""
    pytest.importorskip("torch")
    port, job = _free_port(), uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    agents = []
    try:
        for node in range(2):
            cfg = {"torchrun": f"{os.getpid()}-{job}", "barrier": str(tmp_path / job)}
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                 "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "--log-dir", str(tmp_path / f"logs{node}"), "--redirects", "1", RANK, json.dumps(cfg)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, cwd=str(tmp_path),
                start_new_session=True,
            ))
        for agent in agents:
            _, err = agent.communicate(timeout=RANK_TIMEOUT_S)
            assert agent.returncode == 0, err[-3000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(10)
    reports = {}
    for path in (tmp_path / job).glob("report-*"):
        report = json.loads(path.read_text())
        reports[report["global_rank"]] = report
    assert sorted(reports) == [0, 1, 2, 3]
    assert [reports[g]["layout"] for g in range(4)] == [[2, 0, 2]] * 2 + [[2, 1, 2]] * 2
    assert [reports[g]["batches"] for g in range(4)] == dealt(epochs[0], 2, 2)


def test_a_state_right_after_its_load_is_the_loaded_one_even_with_less_than_a_round_left():
    # One batch of epoch 0 left, 2 nodes: no complete round for this layout.
    # A node's pipeline said "epoch 1" before any of the pass was out, a
    # group's rank said what was loaded (helper 41): a checkpoint saved
    # there and resumed on one node lost the batch in one case only. Both
    # say what was loaded now, and "epoch 1" once the (empty) pass is over.
    kw = dict(batch_size=3, seed=SEED, num_workers=1, timeout=60.0)  # 11 samples: 4 batches
    with shmpipe.from_dataset(Numbered(11), **kw) as pipe:
        it = iter(pipe)
        for _ in range(3):
            next(it)
        state = pipe.state_dict()
    for extra in ({}, dict(group=f"after-load-{os.getpid()}", rank=0, num_ranks=1)):
        with shmpipe.from_dataset(Numbered(11), num_nodes=2, node_rank=0, **kw, **extra) as pipe:
            pipe.load_state_dict(state)
            assert pipe.state_dict() == state, extra
            assert list(pipe) == [], extra  # the remainder of epoch 0 is dropped on 2 nodes
            after = pipe.state_dict()
            assert (after["epoch"], after["done_below"]) == (1, 0), (extra, after)
    # ... and one node resuming the state saved right after the load has the batch
    with shmpipe.from_dataset(Numbered(11), **kw) as pipe:
        pipe.load_state_dict(state)
        assert [[int(i) for i in b["i"]] for b in pipe] == [[9, 10]]
