"""from_dataset, and checkpoints: state_dict / load_state_dict on real
pipelines (real producer processes, every transport that runs here)."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

import shmpipe
from shmpipe._sources import collate_into_ring
from shmpipe.testing.datasets import EpochSampler, FailsAtEpoch, FetchLog, Numbered, ShapeByIndex
from shmpipe.testing.sources import Reserver, StatefulCounter

T = 30.0  # no single batch may take longer than this in these tests
N = 23  # samples: batches of 4 leave a short last batch


def take(pipe, epochs: int = 1, stop: int | None = None) -> list[list[int]]:
    """The sample numbers of each batch, over `epochs` passes (or the first
    `stop` batches), each row checked against its sample number."""
    got: list[list[int]] = []
    for _ in range(epochs):
        for b in pipe:
            ids = b["i"].tolist()
            np.testing.assert_array_equal(b["x"][:, 0], b["i"])
            assert b["name"] == [f"s{i}" for i in ids]
            np.testing.assert_array_equal(b["pair"][1], -b["i"])
            got.append(ids)
            if stop is not None and len(got) == stop:
                return got
    return got


def dataset_pipe(num_workers: int, **kwargs):
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("shuffle", True)
    kwargs.setdefault("seed", 11)
    return shmpipe.from_dataset(Numbered(N), num_workers=num_workers, timeout=T, **kwargs)


def per_epoch(batches: list[list[int]]) -> list[list[list[int]]]:
    """Batches split into epochs (6 batches per epoch of 23 samples by 4)."""
    return [batches[i : i + 6] for i in range(0, len(batches), 6)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Three epochs of the dataset as one producer delivers them."""
    with dataset_pipe(1) as pipe:
        return take(pipe, epochs=3)


def test_an_epoch_is_every_sample_once_and_each_epoch_is_shuffled_anew(reference):
    epochs = per_epoch(reference)
    assert len(epochs) == 3
    for epoch in epochs:
        assert sorted(i for b in epoch for i in b) == list(range(N))
        assert [len(b) for b in epoch] == [4, 4, 4, 4, 4, 3]
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize(("transport", "workers"), [("shm", 4), ("arrow", 2), ("queue", 3)])
def test_the_batches_and_their_order_depend_on_neither_workers_nor_transport(reference, transport, workers):
    with dataset_pipe(workers, transport=transport) as pipe:
        assert take(pipe, epochs=3) == reference


def test_unordered_delivers_the_same_batches_of_each_epoch(reference):
    with dataset_pipe(3, ordered=False) as pipe:
        got = take(pipe, epochs=3)
    for mine, theirs in zip(per_epoch(got), per_epoch(reference), strict=True):
        assert sorted(mine) == sorted(theirs)


def test_another_seed_gives_another_order_and_no_shuffle_the_identity(reference):
    with dataset_pipe(2, seed=12) as pipe:
        assert take(pipe) != reference[:6]
    with dataset_pipe(2, shuffle=False) as pipe:
        assert take(pipe, epochs=2) == [list(range(i, min(i + 4, N))) for i in range(0, N, 4)] * 2


@pytest.mark.parametrize(("stop", "workers_before", "workers_after"), [(1, 2, 3), (6, 3, 1), (10, 4, 2)])
def test_a_resumed_run_delivers_exactly_what_the_interrupted_one_had_not(reference, stop, workers_before, workers_after):
    with dataset_pipe(workers_before) as pipe:
        first = take(pipe, epochs=3, stop=stop)
        state = pipe.state_dict()
    state = json.loads(json.dumps(state))  # what a checkpoint file gives back
    assert state["epoch"] == stop // 6
    with dataset_pipe(workers_after) as pipe:
        pipe.load_state_dict(state)
        rest = take(pipe, epochs=3 - stop // 6)
    assert first + rest == reference


def test_resuming_at_90_percent_fetches_nothing_before_the_position(tmp_path):
    log = str(tmp_path / "fetched")
    n, size, k = 200, 5, 36  # 40 batches a epoch: resume after 36
    with shmpipe.from_dataset(Numbered(n, log=log), batch_size=size, shuffle=True, seed=3, num_workers=2, timeout=T) as pipe:
        handed_out = [b["i"].tolist() for _, b in zip(range(k), pipe, strict=False)]
        state = pipe.state_dict()
    before = {i for b in handed_out for i in b}
    open(log, "w").close()
    with shmpipe.from_dataset(Numbered(n, log=log), batch_size=size, shuffle=True, num_workers=3, timeout=T) as pipe:
        pipe.load_state_dict(state)
        rest = [b["i"].tolist() for b in pipe]
    fetched = FetchLog(log).fetched()
    assert len(rest) == 40 - k
    assert sorted(fetched) == sorted(i for b in rest for i in b)  # each of the rest once, nothing else
    assert not before & set(fetched)
    assert sorted(before | set(fetched)) == list(range(n))


def test_an_unordered_run_resumes_with_what_it_had_not_delivered():
    with dataset_pipe(3, ordered=False) as pipe:
        first = take(pipe, stop=4)
        state = pipe.state_dict()
    with dataset_pipe(2, ordered=False) as pipe:
        pipe.load_state_dict(state)
        rest = take(pipe)
    assert sorted(i for b in first + rest for i in b) == list(range(N))
    assert len(first + rest) == 6


def test_the_state_at_an_epochs_end_is_the_next_epochs_start(reference):
    with dataset_pipe(2) as pipe:
        assert pipe.state_dict()["epoch"] == 0
        take(pipe)
        state = pipe.state_dict()
        assert (state["epoch"], state["done_below"], state["done"]) == (1, 0, [])
    with dataset_pipe(2) as pipe:
        pipe.load_state_dict(state)
        assert pipe.state_dict() == state  # loaded, not iterated yet: the same position
        assert take(pipe) == reference[6:12]


def test_a_state_that_does_not_fit_is_refused_naming_the_field():
    with dataset_pipe(2) as pipe:
        first = next(iter(pipe))["i"].tolist()
        good = pipe.state_dict()  # epoch 0's first batch out: the state names its batches (plan, count)
    assert (good["done_below"], good["batches"], type(good["plan"])) == (1, 6, str)
    with dataset_pipe(2) as pipe:
        fresh = pipe.state_dict()

        def refused(change: dict, match: str, error: type = shmpipe.ShmpipeValueError) -> None:
            with pytest.raises(error, match=match):
                pipe.load_state_dict({**good, **change})

        refused({"length": N + 1}, "length")
        refused({"batch_size": 5}, "batch_size")
        refused({"drop_last": True}, "drop_last")
        refused({"sampler": "sequential"}, "sampler")
        refused({"seed": 12}, "seed")  # this pipeline's seed was given
        refused({"kind": "from_iterators"}, "from_iterators")
        refused({"version": 2}, "version")
        refused({"format": "torch"}, "not a shmpipe state")
        refused({"epoch": -1}, "'epoch'")
        refused({"epoch": "1"}, "'epoch'")
        refused({"done_below": 7}, "'done_below'")
        refused({"done": [3, 2]}, "'done'")
        refused({"done": [0]}, "'done'")  # below done_below
        refused({"surprise": 1}, "unknown fields")
        with pytest.raises(shmpipe.ShmpipeValueError, match="malformed state: no 'plan'"):
            pipe.load_state_dict({k: v for k, v in good.items() if k != "plan"})
        with pytest.raises(shmpipe.ShmpipeTypeError, match="a state is a dict"):
            pipe.load_state_dict([good])  # type: ignore[arg-type]
        refused({"plan": "0" * 16}, "other batches")
        refused({"epoch": 5}, "the state's epoch 5 had other batches")  # epoch 0's plan
        # A state of an epoch none of whose batches is done names it alone.
        assert (fresh["plan"], fresh["batches"], fresh["done_below"], fresh["done"]) == (None, None, 0, [])
        for change in ({"batches": 6}, {"done_below": 1}, {"done": [2]}):
            with pytest.raises(shmpipe.ShmpipeValueError, match="malformed state"):
                pipe.load_state_dict({**fresh, **change})
        # Its count is checked against the epoch before anything is sized
        # from it (a mask of 2**62 batches was a MemoryError).
        refused({"batches": 1 << 62, "done_below": 1}, "other batches")
        refused({"batches": 1 << 40, "done_below": 1 << 40}, "other batches")
        # What only a pickled checkpoint can hold: named, never a crash
        # in sorting or showing it.
        refused({1: "x", "junk": 2}, "keys must be strings")
        deep: list = []
        for _ in range(5000):
            deep = [deep]
        refused({"length": deep}, "the state's length is")
        refused({"done": deep}, "'done'")
        refused({"plan": deep}, "'plan'")
        # A value equal to this pipeline's but of another type is another
        # pipeline's (or a hand-made state's).
        refused({"batch_size": 4.0}, "batch_size")
        refused({"drop_last": 0}, "drop_last")
        refused({"version": True}, "version")
        # Every refusal left the pipeline as it was: the epoch from its start.
        assert pipe.state_dict() == fresh
        reference = take(pipe)
        assert reference == take_reference() and reference[0] == first
    # And a new pipeline loads the good state.
    with dataset_pipe(2) as pipe:
        pipe.load_state_dict(good)
        assert take(pipe) == reference[1:]
    # An older shmpipe's state at an epoch's start names its batches (plan, count): loaded as before.
    with dataset_pipe(2) as pipe:
        pipe.load_state_dict({**good, "done_below": 0, "done": []})
        assert take(pipe) == reference


def test_a_state_of_an_epoch_alone_whose_draw_fails_is_refused_and_changes_nothing():
    # Such a state is drawn as its pass begins, within load_state_dict:
    # the sampler's failure there left the state applied (helper 84).
    kw = dict(batch_size=4, num_workers=1, timeout=T, seed=3)
    with shmpipe.from_dataset(Numbered(N), sampler=FailsAtEpoch(N), **kw) as pipe:
        first = take(pipe)
        state = pipe.state_dict()
    assert (state["epoch"], state["plan"]) == (1, None)
    sampler = FailsAtEpoch(N, fail=True)
    with shmpipe.from_dataset(Numbered(N), sampler=sampler, **kw) as pipe:
        before = pipe.state_dict()
        with pytest.raises(RuntimeError, match="failed at epoch 1"):
            pipe.load_state_dict(state)
        assert pipe.state_dict() == before
        assert take(pipe) == first  # epoch 0, its own


def take_reference() -> list[list[int]]:
    """The first epoch of dataset_pipe's seed, from a pipeline of its own."""
    with dataset_pipe(1) as pipe:
        return take(pipe)


def test_a_state_refused_leaves_a_pipeline_without_a_seed_its_own():
    """A refused state changes nothing: not its seed (a pipeline given none
    takes the state's), not its epoch."""
    with dataset_pipe(2) as pipe:
        take(pipe, stop=2)
        other = pipe.state_dict()
    with shmpipe.from_dataset(Numbered(N), batch_size=4, shuffle=True, num_workers=2, timeout=T) as pipe:
        seed, before = pipe.seed, pipe.state_dict()
        with pytest.raises(shmpipe.ShmpipeValueError, match="the state's epoch 3 had other batches"):
            pipe.load_state_dict({**other, "epoch": 3})
        assert (pipe.seed, pipe.state_dict()) == (seed, before)
        assert sorted(i for b in take(pipe) for i in b) == list(range(N)), "epoch 0, whole"


def test_a_state_through_json_fits_a_pipeline_given_an_int_subclass():
    """batch_size=4 as an IntEnum (an int to from_dataset) comes back from
    JSON a plain 4: the same pipeline's state."""
    import enum

    class Size(enum.IntEnum):
        FOUR = 4

    with dataset_pipe(2, batch_size=Size.FOUR) as pipe:
        take(pipe, stop=2)
        state = json.loads(json.dumps(pipe.state_dict()))
    with dataset_pipe(2, batch_size=Size.FOUR) as pipe:
        pipe.load_state_dict(state)
        assert len(take(pipe)) == 4


def test_a_state_is_loaded_before_the_first_pass_only():
    with dataset_pipe(1) as pipe:
        state = pipe.state_dict()
        take(pipe, stop=1)
        with pytest.raises(shmpipe.ShmpipeValueError, match="before the first pass"):
            pipe.load_state_dict(state)


def test_a_pipeline_without_a_seed_takes_the_states(reference):
    with dataset_pipe(2) as pipe:
        take(pipe, stop=3)
        state = pipe.state_dict()
    with shmpipe.from_dataset(Numbered(N), batch_size=4, shuffle=True, num_workers=2, timeout=T) as pipe:
        pipe.load_state_dict(state)
        assert pipe.seed == 11
        assert take(pipe) == reference[3:6]


def test_a_sampler_with_set_epoch_orders_each_epoch():
    sampler = EpochSampler(N, seed=5)
    want = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        want += [order[i : i + 4] for i in range(0, N, 4)]
    with shmpipe.from_dataset(Numbered(N), batch_size=4, sampler=EpochSampler(N, seed=5), num_workers=3, timeout=T) as pipe:
        assert take(pipe, epochs=2) == want


class _GeneratorSampler:
    """A sampler with a generator of its own, as torch's
    RandomSampler(generator=g): each draw goes on from the last, so a draw
    more changes every later epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.draws, self.rng = n, 0, np.random.default_rng(5)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.draws += 1
        return iter(self.rng.permutation(self.n).tolist())


def test_a_state_taken_at_each_epochs_end_draws_no_sampler_twice():
    """A state at an epoch's end names the next epoch alone: it draws
    nothing (it drew the next epoch's batches, and the sampler ran an
    epoch early: helper 83), and the sampler is drawn once an epoch, when
    its pass begins, as without the states."""
    def epochs(take_states: bool) -> tuple[list[list[int]], int]:
        sampler = _GeneratorSampler(N)
        with shmpipe.from_dataset(Numbered(N), batch_size=4, sampler=sampler, num_workers=2, timeout=T) as pipe:
            out = []
            for _ in range(3):
                out.append([i for b in pipe for i in b["i"].tolist()])
                if take_states:
                    pipe.state_dict()
                    pipe.state_dict()
            return out, sampler.draws

    plain, plain_draws = epochs(False)
    with_states, draws = epochs(True)
    assert with_states == plain
    assert (plain_draws, draws) == (3, 3)  # (the states drew epoch 3 before: 4)


def test_a_batch_sampler_gives_the_batches():
    batches = [[5, 1], [0, 2, 3], [22], [7, 8, 9, 10]]
    with shmpipe.from_dataset(Numbered(N), batch_sampler=batches, num_workers=2, timeout=T) as pipe:
        assert take(pipe) == batches
        state = pipe.state_dict()
    assert (state["epoch"], state["batches"], state["plan"]) == (1, None, None)  # epoch 1 alone, not drawn


def test_drop_last_drops_the_short_batch():
    with dataset_pipe(2, drop_last=True, shuffle=False) as pipe:
        assert take(pipe) == [list(range(i, i + 4)) for i in range(0, 20, 4)]


@pytest.mark.parametrize(("length", "says"), [(3, "its 3 samples make no whole batch of 4"), (0, "the dataset is empty")])
def test_an_epoch_without_batches_is_said(length, says):
    # Each epoch's loop ended at once, silently (helper 75); several nodes
    # already said so of an epoch no rank gets.
    with pytest.warns(shmpipe.ShmpipeWarning, match=f"every epoch of this pipeline has no batches: {says}") as seen:
        pipe = shmpipe.from_dataset(Numbered(length), batch_size=4, drop_last=True, num_workers=1, timeout=T)
    assert seen[0].filename == __file__  # the caller's line
    with pipe:
        assert take(pipe) == [] and take(pipe) == []
    # said once the arguments are known good: a bad one's error comes first, under warnings as errors too
    with pytest.raises(shmpipe.ShmpipeValueError, match="known transports"):
        shmpipe.from_dataset(Numbered(length), batch_size=4, drop_last=True, num_workers=1, transport="nope")


@pytest.mark.parametrize(("given", "says"), [
    ({"sampler": [], "batch_size": 4}, "its sampler gave no index"),
    ({"sampler": [1, 2], "batch_size": 4, "drop_last": True}, "its sampler gave fewer indices than a batch of 4, and drop_last=True"),
    ({"batch_sampler": []}, "its batch_sampler gave no batch"),
])
def test_a_sampler_that_gives_no_batches_is_said_once(given, says):
    # Its epochs ended at once, silently (helper 83); the sampler is read per epoch, so it is said of the
    # first epoch with none, and not again (a sampler may give none in some epochs only).
    with shmpipe.from_dataset(Numbered(N), num_workers=1, timeout=T, **given) as pipe:
        with pytest.warns(shmpipe.ShmpipeWarning, match=f"^epoch 0 of this pipeline has no batches: {re.escape(says)}$") as seen:
            assert take(pipe) == []
        assert len(seen) == 1 and seen[0].filename == __file__  # the caller's line
        assert take(pipe) == [] and take(pipe) == []  # under warnings as errors: not said again
    with shmpipe.from_dataset(Numbered(N), sampler=[0, 1, 2], batch_size=4, num_workers=1, timeout=T) as pipe:
        assert take(pipe) == [[0, 1, 2]]  # a short batch is a batch: nothing said


def test_a_collate_fn_makes_the_batch_and_the_default_says_what_it_cannot_stack():
    with shmpipe.from_dataset(ShapeByIndex(), batch_size=3, num_workers=1, timeout=T) as pipe:
        with pytest.raises(shmpipe.ShmpipeTypeError, match=r"shape \(2,\), sample 0 has \(1,\)"):
            next(iter(pipe))
    with shmpipe.from_dataset(ShapeByIndex(), batch_size=3, collate_fn=_padded, num_workers=2, timeout=T) as pipe:
        got = [b for b in pipe]
    assert [b.shape for b in got] == [(3, 3)] * 3
    np.testing.assert_array_equal(got[1][2], [5, 5, 5])


def _padded(samples):
    out = np.zeros((len(samples), 3), np.int32)
    for row, s in zip(out, samples, strict=True):
        row[: len(s)] = s
    return out


def test_the_default_collate_keeps_the_nesting():
    samples = [{"a": (np.full((2,), i, np.float32), [i, "t"]), "b": None, "c": i * 0.5} for i in range(3)]
    batch = collate_into_ring(samples)
    np.testing.assert_array_equal(batch["a"][0], [[0, 0], [1, 1], [2, 2]])
    assert batch["a"][0].dtype == np.float32
    np.testing.assert_array_equal(batch["a"][1][0], [0, 1, 2])
    assert batch["a"][1][1] == ["t", "t", "t"]
    assert batch["b"] == [None, None, None]
    np.testing.assert_array_equal(batch["c"], [0.0, 0.5, 1.0])
    with pytest.raises(shmpipe.ShmpipeTypeError, match="keys"):
        collate_into_ring([{"a": 1}, {"b": 1}])
    with pytest.raises(shmpipe.ShmpipeTypeError, match="dtype"):
        collate_into_ring([np.zeros(2, np.int64), np.zeros(2, np.float64)])
    with pytest.raises(shmpipe.ShmpipeTypeError, match="default collate stacks arrays"):
        collate_into_ring([object(), object()])


def test_torch_tensors_are_stacked_as_arrays():
    torch = pytest.importorskip("torch")
    batch = collate_into_ring([{"t": torch.arange(3) + i} for i in range(2)])
    np.testing.assert_array_equal(batch["t"], [[0, 1, 2], [1, 2, 3]])


def test_from_datasets_arguments_follow_the_dataloaders_rules():
    ds = Numbered(N)
    cases = [
        (dict(batch_sampler=[[0]], batch_size=2), "batch_sampler"),
        (dict(sampler=[0, 1], shuffle=True), "shuffle"),
        (dict(batch_size=0), "batch_size"),
        (dict(num_workers=0), "num_workers"),
        (dict(sampler=iter([0, 1])), "iterator"),
        (dict(shuffle=1), "shuffle"),
    ]
    for kwargs, match in cases:
        with pytest.raises((shmpipe.ShmpipeValueError, shmpipe.ShmpipeTypeError), match=match):
            shmpipe.from_dataset(ds, **kwargs)
    with pytest.raises(shmpipe.ShmpipeTypeError, match="__len__ and __getitem__"):
        shmpipe.from_dataset(iter([1, 2]))
    with pytest.raises(shmpipe.ShmpipeTypeError, match=r"got the class Numbered itself: make one, Numbered\(\.\.\.\)"):
        shmpipe.from_dataset(Numbered)
    for kwargs in (dict(batch_size="4"), dict(num_workers=2.0)):  # a wrong type: a TypeError, as Python's own
        with pytest.raises(shmpipe.ShmpipeTypeError, match="must be a positive int"):
            shmpipe.from_dataset(ds, **kwargs)


def test_numpy_integers_are_taken_as_ints():
    # NumPy's convention (operator.index): np.int64(4) is a batch size, held
    # as Python's int (what a state and its pickle hold); a NumPy bool or
    # float is not an int, a NumPy int out of range is a ValueError.
    kwargs = dict(batch_size=4, num_workers=2, seed=7, capacity=6, max_restarts=1, timeout=T, shuffle=True,
                  drop_last=True, fetch_while_starting=False)
    numpy_kwargs = dict(batch_size=np.int64(4), num_workers=np.int32(2), seed=np.uint32(7), capacity=np.int16(6),
                        max_restarts=np.int8(1), timeout=np.float32(T), shuffle=np.True_, drop_last=np.True_,
                        fetch_while_starting=np.False_)  # (True or False: NumPy's bools too)
    with shmpipe.from_dataset(Numbered(N), **kwargs) as pipe:
        want = [b["i"].tolist() for b in pipe]
        state = pipe.state_dict()
    with shmpipe.from_dataset(Numbered(N), **numpy_kwargs) as pipe:
        assert [b["i"].tolist() for b in pipe] == want
        assert all(type(v) is int for v in (pipe.seed, pipe.capacity, pipe.num_workers))
        assert json.dumps(pipe.state_dict()) == json.dumps(state)  # the same state, of Python's types
    for name, value, error in [("batch_size", np.int64(0), shmpipe.ShmpipeValueError),
                               ("num_workers", np.True_, shmpipe.ShmpipeTypeError),
                               ("capacity", np.float64(6.0), shmpipe.ShmpipeTypeError),
                               ("shuffle", np.int64(1), shmpipe.ShmpipeTypeError),
                               ("seed", np.int64(-1), shmpipe.ShmpipeValueError)]:
        with pytest.raises(error, match=f"{name} must be"):
            shmpipe.from_dataset(Numbered(N), **kwargs | {name: value})


def test_a_sampler_index_outside_the_dataset_is_an_error():
    with shmpipe.from_dataset(Numbered(N), sampler=[0, N], num_workers=1, timeout=T) as pipe:
        with pytest.raises(shmpipe.ShmpipeValueError, match=f"index {N}"):
            next(iter(pipe))
    # An index past int64 was named as it wrapped (-9223372036854775807, helper 83).
    big = np.array([0, 2**63 + 1], np.uint64)
    with shmpipe.from_dataset(Numbered(N), sampler=big, num_workers=1, timeout=T) as pipe:
        with pytest.raises(shmpipe.ShmpipeValueError, match=f"index {2**63 + 1}, outside"):
            next(iter(pipe))
    # Python ints that no one NumPy integer type holds (past uint64; past
    # int64 beside a negative one) were "not a sequence of ints" (object, or
    # float64). A batch sampler's batch is read the same way.
    for args, bad in [(dict(sampler=[0, 2**64]), 2**64), (dict(sampler=[-1, 2**63]), 2**63),
                      (dict(batch_sampler=[[0, 1], [2**64, 2]]), 2**64)]:
        with shmpipe.from_dataset(Numbered(N), num_workers=1, timeout=T, **args) as pipe:
            with pytest.raises(shmpipe.ShmpipeValueError, match=f"index {bad}, outside"):
                next(iter(pipe))
    # Floats are still not indices.
    with shmpipe.from_dataset(Numbered(N), sampler=[0.0, 1.0], num_workers=1, timeout=T) as pipe:
        with pytest.raises(shmpipe.ShmpipeTypeError, match="must be a sequence of ints, got float64"):
            next(iter(pipe))


class _Endless:
    """A sampler that never ends (detectron2's TrainingSampler is one)."""

    def __init__(self, n: int, declared: int | None = None) -> None:
        self.n, self.declared = n, declared

    def __iter__(self):
        return (i % self.n for i in itertools.count())

    def __len__(self) -> int:
        if self.declared is None:
            raise TypeError("endless")
        return self.declared


class _EndlessBatches(_Endless):
    def __iter__(self):
        return ([i % self.n] * 64 for i in itertools.count())


@pytest.mark.parametrize("kind", ["sampler", "sampler with len", "batch_sampler"])
def test_an_endless_sampler_is_a_clear_error_not_a_hang(kind):
    # shmpipe reads an epoch whole: its reading filled memory (1.3 GiB in
    # 10 s, then killed) with no word and no timeout (helper 83).
    # (Counted by indices, a batch sampler's too: its batches of 64 stop it
    # at 2**16 batches. A len() is not trusted to be exact: one of 5 is no
    # bound below an epoch's most.)
    most = f"more than {1 << 22} indices for one epoch of a dataset of {N} samples"
    if kind == "batch_sampler":
        args, match = dict(batch_sampler=_EndlessBatches(N)), f"batch_sampler gave {most}: "
    elif kind == "sampler":
        args, match = dict(sampler=_Endless(N)), f"sampler gave {most}: "
    else:
        args, match = dict(sampler=_Endless(N, declared=5)), rf"sampler gave {most}, where its len\(\) says 5: "
    with shmpipe.from_dataset(Numbered(N), num_workers=1, timeout=T, **args) as pipe:
        with pytest.raises(shmpipe.ShmpipeValueError, match=match):
            next(iter(pipe))


class _NoLength:
    """A sampler whose __len__ says it has none the way some do (torch's
    Sampler base class of old): NotImplementedError, not TypeError."""

    def __iter__(self):
        return iter(range(10))

    def __len__(self) -> int:
        raise NotImplementedError


def test_a_sampler_whose_len_raises_not_implemented_is_read_as_one_without():
    # It was the sampler's raw NotImplementedError from from_dataset().
    with shmpipe.from_dataset(Numbered(N), batch_size=4, sampler=_NoLength(), num_workers=1, timeout=T) as pipe:
        got = [list(b["i"]) for b in pipe]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# -- from_iterators: resume by count -----------------------------------------


def iterator_run(ordered: bool, state=None, stop=None, passes=2):
    """Three sources of 9 reserved batches each (more than the ring's slots:
    a skip that took slots would stall), each batch naming its worker,
    number and epoch."""
    got = []
    with shmpipe.from_iterators([Reserver(9, (64,), with_epoch=True)] * 3, ordered=ordered, seed=5, capacity=4, timeout=T) as pipe:
        if state is not None:
            pipe.load_state_dict(state)
        for _ in range(passes):
            for b in pipe:
                got.append((int(b["worker"]), int(b["seq"]), int(b["epoch"])))
                if stop is not None and len(got) == stop:
                    return got, pipe.state_dict()
        return got, pipe.state_dict()


@pytest.mark.parametrize("ordered", [True, False])
def test_from_iterators_resumes_by_count(ordered):
    full, end = iterator_run(ordered)
    assert end["epoch"] == 2 and end["delivered"] == [0, 0, 0]
    stop = random.Random(ordered).randrange(11, 40)  # beyond the first slots: batches are skipped
    first, state = iterator_run(ordered, stop=stop)
    rest, _ = iterator_run(ordered, state=json.loads(json.dumps(state)), passes=2 - state["epoch"])
    if ordered:
        assert first + rest == full
    else:
        assert sorted(first + rest) == sorted(full) and len(set(first + rest)) == len(full)
    with shmpipe.from_iterators([Reserver(2)] * 2, timeout=T) as pipe:
        with pytest.raises(shmpipe.ShmpipeValueError, match="3 sources, this one has 2"):
            pipe.load_state_dict(state)


@pytest.mark.parametrize("ordered", [True, False])
def test_an_iterator_with_its_own_state_resumes_from_it(ordered):
    def run(state=None, stop=None):
        got = []
        with shmpipe.from_iterators([StatefulCounter(12)] * 2, ordered=ordered, seed=1, timeout=T) as pipe:
            if state is not None:
                pipe.load_state_dict(state)
            for _ in range(2 - (state or {}).get("epoch", 0)):
                for b in pipe:
                    got.append((int(b["worker"]), int(b["seq"]), int(b["epoch"]), int(b["made"])))
                    if len(got) == stop:
                        return got, pipe.state_dict()
        return got, None

    full, _ = run()
    first, state = run(stop=9)
    state = json.loads(json.dumps(state))
    assert state["iterator_states"] == [{"next_seq": d} if d else None for d in state["delivered"]]
    rest, _ = run(state=state)
    key = [(w, s, e) for w, s, e, _ in first + rest]
    if ordered:
        assert key == [(w, s, e) for w, s, e, _ in full]
    else:
        assert sorted(key) == sorted((w, s, e) for w, s, e, _ in full)
    # each worker's first batch after the resume was the first its iterator made: nothing made again
    for worker in (0, 1):
        assert next(m for w, _, e, m in rest if w == worker and e == 0) == 1


_LAZY_TORCH_DATASET = '''
import numpy as np


class LazyTorch:
    """Draws from torch's generator, torch imported where it is used."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import torch

        return {"i": i, "t": np.float64(torch.rand(()).item())}
'''

_LAZY_TORCH_JOB = '''
import json, sys
import shmpipe
from lazy_torch import LazyTorch
with shmpipe.from_dataset(LazyTorch(), batch_size=2, seed=5, num_workers=1, fetch_while_starting=False,
                          timeout=60) as pipe:
    print(json.dumps([b["t"].tolist() for b in pipe]))
'''


@pytest.mark.timeout(180)
def test_a_dataset_importing_torch_while_a_batch_is_made_is_told_its_draws_were_not_seeded(tmp_path):
    # shmpipe seeds torch's generator before each batch only where torch is
    # imported (importing it in every producer would cost a second): a
    # dataset that imports it inside __getitem__ draws the first batch
    # from an unseeded generator (helper 51), which is said, once.
    pytest.importorskip("torch")
    (tmp_path / "lazy_torch.py").write_text(_LAZY_TORCH_DATASET)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", _LAZY_TORCH_JOB], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(json.loads(out.stdout.strip().splitlines()[-1])) == 4
    said = out.stderr.count("ShmpipeWarning: torch was imported while batch 0 of epoch 0 was made")
    assert said == 1, out.stderr[-3000:]
    assert "import torch at the top of the dataset's module" in out.stderr


def test_an_epochs_digest_is_the_one_earlier_versions_saved():
    # A state names its epoch's batches by this digest: hashed from the
    # arrays' own buffers now (no copy), it must stay what states saved by
    # earlier versions hold, whatever the arrays' dtype and layout.
    import hashlib

    from shmpipe._epochs import digest

    rng = np.random.default_rng(3)
    for indices in (np.arange(0), rng.permutation(1000), np.arange(40, dtype=np.int32)[::3], np.arange(7)[::-1]):
        bounds = np.arange(0, len(indices) + 1, 4)
        h = hashlib.blake2b(digest_size=8)
        h.update(np.ascontiguousarray(indices, "<i8").tobytes())
        h.update(np.ascontiguousarray(bounds, "<i8").tobytes())
        assert digest(indices, bounds) == h.hexdigest()
    assert digest(np.arange(8), np.array([0, 4, 8])) == "1cff9510edc26e38"  # what 097d513 computed


_HALF_IMPORTED_TORCH = """
import sys, types
sys.modules["torch"] = types.ModuleType("torch")  # as another thread's import leaves it, half done
from shmpipe._producer_context import generators_kept, seed_generators
with generators_kept():
    seed_generators(7)
print("ok")
"""


def test_a_torch_still_being_imported_is_left_alone_by_the_seeding(tmp_path):
    # Another thread importing torch while the trainer made a batch: the
    # seeding found the half-made module and failed the batch with an
    # AttributeError (helper 52); it is seeded once it is imported whole.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _HALF_IMPORTED_TORCH], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


class _EmptyEpoch1:
    """A set_epoch sampler whose epoch 1 has no indices (the others 4)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 0 if self.epoch == 1 else 4

    def __iter__(self):
        return iter([] if self.epoch == 1 else [0, 1, 2, 3])


def test_a_state_of_an_epoch_without_batches_is_the_one_loaded_until_its_pass_ends():
    # Helper 53: loaded, such a state said the next epoch at once (its
    # batches, none, all done), though a state right after a load is the
    # one loaded; the pass, empty, then ended and the next epoch followed.
    kw = dict(batch_size=2, num_workers=1, timeout=T, seed=1)
    with shmpipe.from_dataset(Numbered(4), sampler=_EmptyEpoch1(), **kw) as pipe:
        list(pipe)
        state = pipe.state_dict()
    assert (state["epoch"], state["batches"]) == (1, None)  # epoch 1 alone, not drawn
    with shmpipe.from_dataset(Numbered(4), sampler=_EmptyEpoch1(), **kw) as pipe:
        # (said where the pass is begun: at the load, which begins it ahead)
        with pytest.warns(shmpipe.ShmpipeWarning, match="^epoch 1 of this pipeline has no batches: its sampler gave no index$"):
            pipe.load_state_dict(state)
        assert pipe.state_dict() == state
        assert list(pipe) == []
        assert pipe.state_dict()["epoch"] == 2
        assert [b["i"].tolist() for b in pipe] == [[0, 1], [2, 3]]
    small = dict(batch_size=3, shuffle=True, drop_last=True, seed=5, num_workers=1, timeout=T)
    with pytest.warns(shmpipe.ShmpipeWarning, match="no batches"), shmpipe.from_dataset(Numbered(2), **small) as pipe:
        state = pipe.state_dict()  # every epoch empty: fewer samples than a batch, drop_last
    with pytest.warns(shmpipe.ShmpipeWarning, match="no batches"), shmpipe.from_dataset(Numbered(2), **small) as pipe:
        pipe.load_state_dict(state)
        assert pipe.state_dict()["epoch"] == 0
