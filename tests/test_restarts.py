"""max_restarts: producers that die are replaced, and the run delivers what
a run without the deaths delivers (real processes, real SIGKILLs)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import warnings

import pytest

import shmpipe
from shmpipe.testing.datasets import Numbered
from shmpipe.testing.sources import DiesOnce, Killer, Raiser, Reserver

T = 30.0  # no single batch may take longer than this in these tests


def dataset_pipe(**kwargs):
    return shmpipe.from_dataset(
        Numbered(240), batch_size=4, shuffle=True, seed=3, num_workers=3, capacity=6, timeout=T, **kwargs
    )


def iterator_pipe(**kwargs):
    return shmpipe.from_iterators([Reserver(40, (64,), with_epoch=True)] * 3, seed=3, capacity=6, timeout=T, **kwargs)


def key(kind: str, b) -> tuple:
    if kind == "dataset":
        return tuple(b["i"].tolist())
    return int(b["worker"]), int(b["seq"]), int(b["epoch"])


def run(kind: str, ordered: bool, kills: int = 0, seed: int = 0):
    """Two epochs; with `kills`, that many SIGKILLs of producers at random
    moments (two of one process before it is replaced count as one death)."""
    rng = random.Random(seed)
    make = dataset_pipe if kind == "dataset" else iterator_pipe
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with make(ordered=ordered, max_restarts=kills) as pipe:
            for _ in range(2):
                for b in pipe:
                    got.append(key(kind, b))
                    if kills and rng.random() < 0.1:
                        pids = pipe.pids
                        victim = pids[rng.randrange(len(pids))]
                        # Killed before and not replaced yet: a zombie takes it too, and
                        # one its parent (the fork server) reaped already is gone.
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(victim, signal.SIGKILL)
                        kills -= 1
            restarts = pipe.stats().restarts
    replaced = [w for w in caught if issubclass(w.category, shmpipe.ShmpipeWarning) and "replaced by pid" in str(w.message)]
    return got, restarts, replaced, kills


@pytest.mark.parametrize("kind", ["dataset", "iterators"])
@pytest.mark.parametrize("ordered", [True, False])
def test_random_sigkills_lose_and_repeat_nothing(kind, ordered):
    reference, _, _, _ = run(kind, ordered)
    got, restarts, replaced, left = run(kind, ordered, kills=4, seed=7)
    assert left == 0, "the run ended before every kill happened"
    if ordered:
        assert got == reference  # the same sequence as a run without deaths
    else:
        assert sorted(got) == sorted(reference)  # the same batches, each as often
    assert 1 <= sum(restarts) == len(replaced) <= 4
    assert all("worker" in str(w.message) and "pid" in str(w.message) for w in replaced)
    # at the line of the loop that asked for the batch, not inside shmpipe
    assert all(w.filename == __file__ for w in replaced), {w.filename for w in replaced}


@pytest.mark.parametrize("how", ["kill", "exit"])
@pytest.mark.parametrize("big_every", [0, 3])
def test_a_producer_that_dies_mid_batch_gives_its_slot_back(tmp_path, how, big_every):
    """It dies with a slot reserved and half written (a big batch's own
    memory, with big_every): the replacement writes that batch whole, and
    nothing leaks (conftest checks /dev/shm and processes)."""
    marker = str(tmp_path / "died")
    sources = [DiesOnce(12, at=5, marker=marker, worker=1, how=how, big_every=big_every)] * 2
    with shmpipe.from_iterators(sources, ordered=True, capacity=3, timeout=T, max_restarts=1) as pipe:
        with pytest.warns(shmpipe.ShmpipeWarning, match="worker 1"):
            batches = [(int(b["worker"]), int(b["seq"]), float(b["data"].min()), float(b["data"].max())) for b in pipe]
        assert pipe.stats().restarts == (0, 1)
    assert os.path.exists(marker)
    assert [(w, s) for w, s, _, _ in batches] == [(w, s) for s in range(12) for w in (0, 1)]
    assert all(lo == hi == s for _, s, lo, hi in batches)  # every batch whole


def test_a_producer_dead_between_epochs_is_replaced(tmp_path):
    marker = str(tmp_path / "died")
    with shmpipe.from_iterators(
        [DiesOnce(4, at=0, marker=marker, worker=0, epoch=1)] * 2, ordered=True, timeout=T, max_restarts=1
    ) as pipe:
        first = [(int(b["worker"]), int(b["seq"])) for b in pipe]
        with pytest.warns(shmpipe.ShmpipeWarning, match="replaced"):
            second = [(int(b["worker"]), int(b["seq"]), int(b["epoch"])) for b in pipe]
    assert first == [(w, s) for s in range(4) for w in (0, 1)]
    assert second == [(w, s, 1) for s in range(4) for w in (0, 1)]


def test_past_max_restarts_the_death_is_the_error_with_the_history(tmp_path):
    endless = Raiser(after=1 << 40)  # never gets there: a batch every 10 ms, for ever
    with shmpipe.from_iterators([endless] * 2, timeout=T, max_restarts=1) as pipe:
        it = iter(pipe)
        next(it)
        os.kill(pipe.pids[0], signal.SIGKILL)
        with pytest.warns(shmpipe.ShmpipeWarning, match="replaced"):
            while pipe.stats().restarts != (1, 0):  # batches keep coming while the death is noticed
                next(it)
        os.kill(pipe.pids[1], signal.SIGKILL)
        with pytest.raises(shmpipe.WorkerDiedError, match=r"worker 1 .*SIGKILL.*replaced before: worker 0"):
            for _ in it:
                pass


def test_a_timeout_amid_endless_replacements_says_so():
    # A source that dies at the same batch every time is replaced as long as
    # max_restarts lasts; the wait then shows only producers starting, and
    # the timeout's message said nothing of the deaths (helper 58).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("replaced by pid", each time)
        with pytest.raises(shmpipe.PipelineTimeoutError, match=r"producer death\(s\) replaced so far, the last: .*SIGKILL"):
            with shmpipe.from_iterators([Killer(0)], timeout=3, max_restarts=1 << 20) as pipe:
                for _ in pipe:
                    pass
    assert sum(pipe.stats().restarts) >= 2


def test_a_producer_is_not_replaced_once_its_pipeline_closed():
    # A close() from another thread lands between the consumer's finding a
    # death and its replacing the producer: the launcher, down, refuses the
    # replacement (a replacement already starting is waited for by the
    # shutdown and reaped with the rest), so no producer outlives close().
    pipe = shmpipe.from_iterators([Raiser(after=1 << 40)] * 2, timeout=T, max_restarts=1)
    launcher = pipe._launcher
    try:
        it = iter(pipe)
        next(it)
        os.kill(pipe.pids[0], signal.SIGKILL)
        pipe.close()
        with pytest.raises(shmpipe.PipelineClosedError, match="producer 0 is not replaced"):
            launcher.restart(0)
        assert pipe.leftovers() == []
    finally:
        for p in launcher.processes:  # (before the guard, the replacement ran on: ended here)
            if p.exitcode is None:
                p.kill()
                p.join(T)


def test_a_source_that_raises_is_not_restarted():
    with shmpipe.from_iterators([Raiser(2)] * 2, timeout=T, max_restarts=3) as pipe:
        with pytest.raises(shmpipe.WorkerError, match="ValueError"):
            list(pipe)
        assert pipe.stats().restarts == (0, 0)


def test_max_restarts_needs_a_transport_that_can_replace_a_producer():
    with pytest.raises(shmpipe.ShmpipeValueError, match="'queue' transport cannot replace"):
        shmpipe.from_iterators([Reserver(1)], transport="queue", max_restarts=1)
    with pytest.raises(shmpipe.ShmpipeValueError, match="max_restarts must be"):
        shmpipe.from_iterators([Reserver(1)], max_restarts=-1)


@pytest.mark.parametrize("adapter", ["plain", "torch"])
def test_an_ordered_run_whose_producer_dies_delivers_a_prefix_and_resumes_in_order(adapter):
    # No restarts left: the death ends the run. What it delivered is the
    # ordered sequence up to the batch the dead worker never published, not
    # the later batches the others had published (which would put a gap in
    # the trainer's sequence); the state after the last batch resumes there,
    # and the two runs together are the uninterrupted epoch, in its order.
    import json
    import time

    with dataset_pipe() as pipe:
        want = [key("dataset", b) for b in pipe]
    got, state = [], None
    pipe = dataset_pipe()
    batches = pipe.to_torch() if adapter == "torch" else pipe
    with pytest.raises(shmpipe.WorkerDiedError):
        with pipe:
            for b in batches:
                got.append(key("dataset", b))
                state = json.loads(json.dumps(pipe.state_dict()))
                if len(got) == 2:
                    os.kill(pipe.pids[0], signal.SIGKILL)
                    time.sleep(0.5)  # the others fill their slots meanwhile
    assert 2 <= len(got) < len(want)
    assert got == want[: len(got)], "a prefix of the sequence, no batch after a gap"
    with dataset_pipe() as pipe:
        pipe.load_state_dict(state)
        rest = [key("dataset", b) for b in pipe]
    assert got + rest == want
