"""tf.data over a pipeline, with real TensorFlow on the CPU."""

from __future__ import annotations

import gc
import os
import sys
import textwrap
import time
import weakref

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf
from conftest import Command, SharedRuns

import shmpipe
from shmpipe import _process, _tf
from shmpipe.testing.sources import Counter, Fixed, LinearXY, Stamped, payload_for

T = 60.0


def in_segment(tensor, pipe) -> bool:
    addr = tensor._numpy().ctypes.data  # the tensor's buffer (numpy() would copy)
    lo = pipe.channel.segment.address
    return lo <= addr < lo + pipe.channel.segment.size


def test_this_tensorflow_aliases_aligned_arrays():
    assert _tf.tensorflow_aliases() is True


def test_the_self_check_warns_when_tensorflow_copies():
    # tf.constant always copies: what a TensorFlow that stopped aliasing does.
    with pytest.warns(shmpipe.ShmpipeWarning, match="copies NumPy arrays"):
        assert _tf.check_aliasing(tf.constant) is False


def test_tensorflow_copies_a_misaligned_array_once_into_its_own_memory():
    # What happens to arrays of transports that promise no 64-byte
    # alignment (small Ray objects, a transport of your own): TensorFlow makes the tensor its
    # own aligned copy, with the same values.
    raw = np.zeros(64 * 5, np.uint8)
    start = (-raw.ctypes.data) % 64 + 8  # 8 bytes past a 64-byte boundary
    arr = raw[start : start + 256].view(np.float32)
    arr[:] = np.arange(64)
    spec = tf.TensorSpec(arr.shape, tf.float32)
    tensor = next(iter(tf.data.Dataset.from_generator(lambda: iter([arr]), output_signature=spec)))
    own = tensor._numpy()
    assert own.ctypes.data != arr.ctypes.data and own.ctypes.data % 64 == 0
    np.testing.assert_array_equal(own, np.arange(64, dtype=np.float32))


def test_tensors_alias_the_shared_memory():
    with shmpipe.from_iterators([Counter(8, shape=(1024,))] * 2, timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        assert ds.element_spec["data"] == tf.TensorSpec((1024,), tf.float32)
        assert ds.element_spec["seq"] == tf.TensorSpec((), tf.int64)
        seen = []
        for e in ds:
            assert in_segment(e["data"], pipe), "the tensor is a copy"
            w, s = int(e["worker"]), int(e["seq"])
            np.testing.assert_array_equal(e["data"].numpy(), payload_for(w, s, (1024,)))
            seen.append((w, s))
    assert sorted(seen) == [(w, s) for w in range(2) for s in range(8)]


@pytest.mark.parametrize("transport", ["shm", "arrow", "ray"])
def test_tensors_alias_the_memory_of_every_aligned_transport(transport, tmp_path):
    # Every transport whose arrays are 64-byte aligned: the tensors tf.data
    # yields lie in its memory. The rings promise it for every array; Ray
    # for arrays of 2 KiB or more in objects it keeps in its store (100 KiB
    # or more: smaller ones travel inline), which is what this batch is.
    import contextlib

    from conftest import ray_friendly_cwd

    caps = shmpipe.get_transport(transport).capabilities
    assert caps.zero_copy_reads and (caps.alignment >= 64 or transport == "ray")
    n = max(4096, caps.zero_copy_min_bytes // 4 + 1)  # float32 elements
    place = ray_friendly_cwd(tmp_path) if transport == "ray" else contextlib.nullcontext()
    with place, shmpipe.from_iterators([Counter(4, shape=(n,))] * 2, transport=transport, timeout=120) as pipe:
        seen = []
        for e in pipe.to_tf_dataset():
            addr = e["data"]._numpy().ctypes.data
            assert any(lo <= addr < lo + size for lo, size in pipe.channel.memory_ranges()), "a copy"
            w, s = int(e["worker"]), int(e["seq"])
            np.testing.assert_array_equal(e["data"].numpy(), payload_for(w, s, (n,)))
            seen.append((w, s))
            del e
    assert sorted(seen) == [(w, s) for w in range(2) for s in range(4)]


def slot_of(tensor, pipe) -> int:
    ring = pipe.channel.ring
    addr = tensor._numpy().ctypes.data
    return next(i for i in range(ring.nslots) if ring.payload_address(i) <= addr < ring.payload_address(i) + ring.slot_size)


def test_a_slot_is_released_only_when_tensorflow_drops_the_tensor():
    from shmpipe import _ring

    with shmpipe.from_iterators([Counter(50, shape=(256,))], capacity=8, timeout=T) as pipe:
        it = iter(pipe.to_tf_dataset())
        kept = []
        for _ in range(3):
            e = next(it)
            kept.append((e["data"], int(e["seq"])))
            del e
        slots = [(slot_of(t, pipe), seq) for t, seq in kept]
        time.sleep(0.3)
        for slot, seq in slots:  # held, by exactly that batch, while the tensor lives
            state, _, _, wseq, _ = pipe.channel.ring.slot_info(slot)
            assert (state, wseq) == (_ring.HELD, seq)
        del kept
        gc.collect()
        time.sleep(0.1)
        for slot, seq in slots:  # given back (maybe already reused by a later batch)
            state, _, _, wseq, _ = pipe.channel.ring.slot_info(slot)
            assert not (state == _ring.HELD and wseq == seq), "the slot was not released"
        del it


@pytest.mark.parametrize("transform", ["prefetch", "batch", "map+batch+prefetch", "shuffle+batch", "unbatched slow"])
def test_no_element_changes_while_producers_keep_writing(transform):
    with shmpipe.from_iterators([Stamped(80, shape=(4096,))] * 2, capacity=16, timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        if transform == "prefetch":
            ds = ds.prefetch(4)
        elif transform == "batch":
            ds = ds.batch(4)
        elif transform == "shuffle+batch":
            ds = ds.shuffle(8, seed=1).batch(2)
        elif transform == "map+batch+prefetch":
            ds = ds.map(lambda e: {"stamp": e["stamp"], "data": e["data"] * 1}).batch(3).prefetch(2)
        else:
            ds = ds.prefetch(6)
        count = 0
        kept = []
        for e in ds:
            stamp = e["stamp"].numpy()
            data = e["data"].numpy()
            expect = np.broadcast_to(np.reshape(stamp, np.shape(stamp) + (1,)), data.shape)
            np.testing.assert_array_equal(data, expect)
            count += int(np.size(stamp))
            if transform == "unbatched slow":
                kept.append(e)  # hold a few tensors while the producers write on
                if len(kept) > 3:
                    old = kept.pop(0)
                    np.testing.assert_array_equal(old["data"].numpy(), np.full(4096, old["stamp"].numpy()))
                time.sleep(0.002)
        assert count == 160


def test_a_dataset_that_holds_more_than_the_ring_copies_instead_of_deadlocking():
    # batch(8) holds 8 elements at once; the ring has 4 slots.
    with shmpipe.from_iterators([Counter(40, shape=(64,))] * 2, capacity=4, timeout=T) as pipe:
        ds = pipe.to_tf_dataset().batch(8)
        with pytest.warns(shmpipe.ShmpipeWarning, match="one of the 4 free"):
            batches = list(ds)
        seen = sorted(
            (int(w), int(s)) for b in batches for w, s in zip(b["worker"].numpy(), b["seq"].numpy())
        )
        assert seen == [(w, s) for w in range(2) for s in range(40)]
        for b in batches:
            for w, s, d in zip(b["worker"].numpy(), b["seq"].numpy(), b["data"].numpy()):
                np.testing.assert_array_equal(d, payload_for(int(w), int(s), (64,)))


def test_a_dataset_that_holds_more_than_the_ring_waits_for_it_once_a_pass(monkeypatch):
    # batch(8) over 4 slots lets go of its elements and holds them again for
    # each of its 5 batches a pass. Only the first time in a pass is worth a
    # wait: after TensorFlow kept its slots through one, later batches that
    # would not fit are copied at once; the next pass (epoch) waits again
    # once. (A wait each time: 5 x 1.5 s a pass.)
    monkeypatch.setattr(_tf, "RELEASE_WAIT_S", 1.5)
    with shmpipe.from_iterators([Counter(20, shape=(64,))] * 2, capacity=4, timeout=T) as pipe:
        ds = pipe.to_tf_dataset().batch(8)
        with pytest.warns(shmpipe.ShmpipeWarning, match="one of the 4 free"):
            for epoch in range(2):
                t0 = time.monotonic()
                batches = list(ds)
                took = time.monotonic() - t0
                assert sum(len(b["seq"]) for b in batches) == 40
                assert 1.5 <= took < 2 * 1.5, f"pass {epoch} took {took:.1f} s: it waited {'not' if took < 1.5 else 'more than'} once"


@pytest.mark.parametrize("hold", ["list", "batch", "break-and-again"])
def test_an_ordered_pipeline_never_lends_tensorflow_the_slots_its_producers_need(hold):
    # Ordered, the consumer waits for one worker while the others may fill
    # their quota of slots with batches whose turn has not come: tf.data may
    # hold only what is left (here 8 - 1 - 2 * 2 = 3 of 8 slots), or the
    # worker whose turn it is could never write.
    n, per = 3, 12
    expected = [(w, s) for s in range(per) for w in range(n)]
    with shmpipe.from_iterators([Counter(per, shape=(256,))] * n, ordered=True, timeout=T) as pipe:
        assert pipe.capacity == 8 and pipe._spec.consumer_may_hold == 3
        ds = pipe.to_tf_dataset()
        with pytest.warns(shmpipe.ShmpipeWarning, match="ordered pipeline of 3 workers may lend it at most 3 of 8"):
            if hold == "list":
                elements = list(ds)  # every element kept: far more than 8 slots
                got = [(int(e["worker"]), int(e["seq"])) for e in elements]
                for e in elements:
                    w, s = int(e["worker"]), int(e["seq"])
                    np.testing.assert_array_equal(e["data"].numpy(), payload_for(w, s, (256,)))
                del elements
            elif hold == "batch":
                got = [(int(w), int(s)) for b in ds.batch(5) for w, s in zip(b["worker"], b["seq"])]
            else:
                for i, _element in enumerate(ds):
                    if i == 2:
                        break
                del _element  # the pass is abandoned while an element is still held, then let go
                got = [(int(e["worker"]), int(e["seq"])) for e in list(ds)]
    assert got == expected


@pytest.mark.parametrize("shape", [(3,), (64, 1024), (0, 5), ()])
def test_the_copy_made_when_the_ring_is_full_is_the_only_one(shape):
    # The fallback above copies a batch once, into 64-byte aligned memory,
    # which TensorFlow then aliases (a plain ndarray.copy() of 4 KiB or more
    # starts 16 bytes into a page: TensorFlow would copy it again).
    src = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    batch = {"x": src, "n": [np.int64(3), 2.5]}
    out = _tf.copy_for_tensorflow(batch)
    x = out["x"]
    assert not np.shares_memory(x, src)
    assert x.size == 0 or x.ctypes.data % 64 == 0
    np.testing.assert_array_equal(x, src)
    assert out["n"] == (np.int64(3), 2.5)
    spec = tf.TensorSpec(shape, tf.float32)
    tensor = next(iter(tf.data.Dataset.from_generator(lambda: iter([x]), output_signature=spec)))
    if x.ndim and x.size:  # (_numpy() of a 0-d tensor is a NumPy scalar: no address to compare)
        assert tensor._numpy().ctypes.data == x.ctypes.data, "TensorFlow copied the copy"
    np.testing.assert_array_equal(tensor._numpy(), src)


def test_each_iteration_of_the_dataset_is_a_new_pass():
    with shmpipe.from_iterators([Counter(5)] * 2, timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        for _ in range(3):
            got = sorted((int(e["worker"]), int(e["seq"])) for e in ds)
            assert got == [(w, s) for w in range(2) for s in range(5)]
        assert pipe.stats().passes == 3


def test_datasets_made_and_never_iterated_give_their_peeked_slots_back_when_a_pass_begins():
    # The pipeline keeps each dataset's owner, and the owner the batches
    # peeked for the signature: a dataset made and never iterated (made to
    # look at its element_spec, say) held them for the pipeline's life, and
    # a few such datasets held every slot (helper 81's probe: "no batch
    # within 30 s: of 16 slots 10 are held by batches the consumer still
    # references").
    with shmpipe.from_iterators([Counter(40, shape=(8,))] * 2, capacity=8, timeout=10.0) as pipe:
        for _ in range(6):  # each peeks 2 batches (one per worker) of a pass of its own
            pipe.to_tf_dataset()
        assert sum(1 for _ in pipe) == 80  # a pass of the pipeline itself, every slot free to it
        ds = pipe.to_tf_dataset()
        early = pipe.to_tf_dataset()  # peeked, then its pass superseded by the iteration below
        assert sum(1 for _ in ds) == 80
        assert sum(1 for _ in early) == 80  # its first iteration runs a pass of its own, whole


def test_a_forgotten_dataset_takes_its_pipeline_with_it():
    # TensorFlow keeps from_generator's function for the life of the
    # process (eager mode files it with the global default graph): when the
    # function held the pipeline, no pipeline made into a dataset was ever
    # collected, its ring stayed mapped, a forgotten one's producers ran on
    # (helper 58: 5 datasets forgotten, 10 producers running).
    pipe = shmpipe.from_iterators([Counter(5)] * 2, capacity=16, timeout=T)
    pids = [p for p in pipe.pids if p is not None]
    ds = pipe.to_tf_dataset()
    assert len(list(ds)) == 10
    collected = weakref.ref(pipe)
    del pipe
    # The dataset alone keeps it, and what is made from the dataset does.
    gc.collect()
    ds = ds.map(lambda e: e["seq"]).batch(4)
    gc.collect()
    assert sorted(int(x) for b in ds for x in b) == sorted(list(range(5)) * 2)
    del ds
    gc.collect()
    assert collected() is None, "the pipeline outlived its dataset"
    deadline = time.monotonic() + 30
    while any(_process.process_start_time(p) is not None for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_process.process_start_time(p) is None for p in pids), "its producers ran on"
    # A dataset made inside a function TensorFlow traces keeps no Python
    # object of it: the pipeline, held here, keeps what it needs.
    with shmpipe.from_iterators([Counter(5)] * 2, capacity=16, timeout=T) as held:
        assert len(list(tf.data.Dataset.range(1).flat_map(lambda _: held.to_tf_dataset()))) == 10


#: A process of its own, which has made no dataset before (this one has,
#: eagerly): its first is made inside a traced function.
TRACED_FIRST = textwrap.dedent(
    """
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    import shmpipe
    from shmpipe.testing.sources import Counter
    with shmpipe.from_iterators([Counter(5)] * 2, capacity=16, timeout=60) as pipe:
        print(len(list(tf.data.Dataset.range(1).flat_map(lambda _: pipe.to_tf_dataset()))))
    """
)

#: The scripts of this module's tests that import TensorFlow in a new
#: process (seconds of a core each): run in the background from the
#: session's start (conftest.BackgroundRuns), below the foreground's tests.
SCRIPTS = SharedRuns(
    {"test_the_first_dataset_of_a_process_may_be_made_inside_a_traced_function"}, keys=lambda item: ["traced first"],
    command=lambda key, folder: Command([sys.executable, "-c", TRACED_FIRST], cwd=folder, timeout=180,
                                        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}),
    background=True,
)


@pytest.mark.timeout(600)  # it may wait for the background to reach its script
def test_the_first_dataset_of_a_process_may_be_made_inside_a_traced_function(request):
    # The once-per-process check that TensorFlow aliases NumPy arrays ran
    # where it was first asked for: inside a traced function its tensor was
    # symbolic (AttributeError: no _numpy; helper 62, 3 of 3).
    done, _ = SCRIPTS.get(request, "traced first")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "10"


def test_dimensions_that_vary_become_none_and_surprises_are_clear():
    # worker 0 sends rows of 3, worker 1 rows of 5: the first dimension varies
    sources = [Fixed([np.zeros((3, 2), np.float32)] * 3), Fixed([np.zeros((5, 2), np.float32)] * 3)]
    with shmpipe.from_iterators(sources, ordered=True, timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        assert ds.element_spec == tf.TensorSpec((None, 2), tf.float32)
        assert [tuple(e.shape) for e in ds] == [(3, 2), (5, 2)] * 3
    sources = [Fixed([np.zeros((3, 2), np.float32), np.zeros((3, 7), np.float32)])]
    with shmpipe.from_iterators(sources, ordered=True, timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        with pytest.raises(Exception, match=r"batch has shape \(3, 7\).*output_signature"):
            list(ds)


@pytest.mark.parametrize(("first", "later", "says"), [
    (np.zeros(2, np.int32), np.full(2, 2**40 + 3), r"batch\['x'\] is int64, but the dataset's element_spec says int32"),
    (np.zeros(2, np.int32), np.full(2, 4.7, np.float32), r"batch\['x'\] is float32, .* says int32"),
    (np.zeros(2, bool), np.array([5, 0]), r"batch\['x'\] is int64, .* says bool"),
    (3, 3.9, r"batch\['x'\] is float64, .* says int64"),
    (np.zeros(2, np.float32), None, r"batch\['x'\]: tf.data cannot hold NoneType"),
    (np.array(["a", "b"]), np.zeros(2), r"batch\['x'\] is float64, .* says string"),
    (np.zeros(2), "gone", r"the batch has no batch\['y'\], which the dataset's element_spec holds"),
])
def test_a_later_batch_that_the_inferred_spec_does_not_fit_is_an_error_naming_it(first, later, says):
    # TensorFlow converted a later dtype in silence: 2**40 + 3 into the first
    # batches' int32 came out 3, 4.7 came out 4 (helper 89); a later None or
    # a missing key was TensorFlow's error, without the path.
    batches = [{"x": first, "y": 1}] * 2 + [{"x": first} if isinstance(later, str) and later == "gone" else {"x": later, "y": 1}]
    with shmpipe.from_iterators([Fixed(batches)], timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        with pytest.raises(Exception, match=says):
            list(ds)


def test_an_explicit_signature():
    sig = (tf.TensorSpec((None,), tf.float32), tf.TensorSpec((), tf.int64))
    batches = [(np.ones(n, np.float32), n) for n in (2, 3, 4)]
    with shmpipe.from_iterators([Fixed(batches)], timeout=T) as pipe:
        ds = pipe.to_tf_dataset(output_signature=sig)
        assert ds.element_spec == sig
        assert [int(n) for _, n in ds] == [2, 3, 4]
    # a dtype the user gave is TensorFlow's to convert to (float64 into float32 here)
    with shmpipe.from_iterators([Fixed([(np.ones(2), 2)])], timeout=T) as pipe:
        assert [x.dtype for x, _ in pipe.to_tf_dataset(output_signature=sig)] == [tf.float32]


def test_lists_become_tuples_and_none_is_refused():
    with shmpipe.from_iterators([Fixed([[np.zeros(2), 1]])], timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        assert isinstance(ds.element_spec, tuple)
    with shmpipe.from_iterators([Fixed([{"x": np.zeros(2), "y": None}])], timeout=T) as pipe:
        with pytest.raises(shmpipe.BatchTypeError, match=r"batch\['y'\].*None"):
            pipe.to_tf_dataset()


def test_a_list_of_strings_is_one_string_tensor_of_the_batch():
    batches = [{"x": np.zeros(3), "name": ["a", "bb", "c"]}, {"x": np.zeros(3), "name": [b"d", b"e", b"f"]}]
    with shmpipe.from_iterators([Fixed(batches)], timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        assert ds.element_spec["name"] == tf.TensorSpec((3,), tf.string)
        assert [e["name"].numpy().tolist() for e in ds] == [[b"a", b"bb", b"c"], [b"d", b"e", b"f"]]


def test_a_list_of_bytes_keeps_every_byte_of_each_value():
    # NumPy's fixed-width bytes and str dtypes drop trailing NULs, and pad
    # each value to the longest: the values go to TensorFlow as they are.
    values = [b"\x01", b"\x02\x00", b"\x03\x00\x00", b"x" * 100_000]
    texts = ["\u00e9\x00", "a", "b\x00\x00", "\u4e2d"]
    batches = [{"raw": values, "text": texts}]
    with shmpipe.from_iterators([Fixed(batches)], timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        assert ds.element_spec["raw"] == tf.TensorSpec((4,), tf.string)
        (element,) = list(ds)
        assert element["raw"].numpy().tolist() == values
        assert element["text"].numpy().tolist() == [t.encode() for t in texts]


@pytest.mark.parametrize("taken", [0, 8], ids=["none", "the-whole-pass"])
def test_the_batches_peeked_for_the_signature_are_not_counted_before_tensorflow_takes_them(taken):
    # Without output_signature, to_tf_dataset takes the first batches of a
    # pass to infer it: a state made before tf.data took them counted them
    # as handed out, and a run resumed from it never delivered them
    # (helper 27: 6 of 8 batches, from the third). (Mid-pass, tf.data's own
    # buffers count as handed out, as docs/long-runs.md says.)
    import json

    from shmpipe.testing.datasets import Numbered

    def make():
        return shmpipe.from_dataset(Numbered(96), batch_size=12, num_workers=2, seed=0, timeout=T)

    with make() as pipe:
        reference = [b["i"].tolist() for b in pipe]
    with make() as pipe:
        ds = pipe.to_tf_dataset()
        got = [e["i"].numpy().tolist() for e in ds.take(taken)]
        state = json.loads(json.dumps(pipe.state_dict()))
    assert got == reference[:taken]
    with make() as pipe:
        pipe.load_state_dict(state)
        rest = [b["i"].tolist() for b in pipe]
    if taken == len(reference):
        assert state["epoch"] == 1 and rest == reference, state  # the next epoch: unshuffled, the same batches
    else:
        assert state["epoch"] == 0 and rest == reference, (state, rest)


# from_dataset: the schedule knows whether an epoch ends with a partial batch
# (a length the batch size does not divide, drop_last=False), so the batch
# axis is unknown there even though the first batches peeked are all full.


@pytest.mark.parametrize(("n", "drop_last", "first_axis"), [(10, False, None), (12, False, 4), (10, True, 4)])
def test_a_datasets_partial_last_batch_fits_the_element_spec(n, drop_last, first_axis):
    from shmpipe.testing.datasets import Numbered

    with shmpipe.from_dataset(Numbered(n), batch_size=4, drop_last=drop_last, num_workers=2, timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        assert ds.element_spec["x"] == tf.TensorSpec((first_axis, 3), tf.int64)
        # the collate gathers each sample's name into a list: one string tensor
        assert ds.element_spec["name"] == tf.TensorSpec((first_axis,), tf.string)
        for _ in range(2):  # two epochs: the partial batch ends each
            rows = [e["i"].numpy().tolist() for e in ds]
            names = [e["name"].numpy().tolist() for e in ds.take(1)]
            want = list(range(n - n % 4 if drop_last else n))
            assert [i for r in rows for i in r] == want
            assert [len(r) for r in rows][-1] == (n % 4 or 4 if not drop_last else 4)
            assert names == [[b"s0", b"s1", b"s2", b"s3"]]


@pytest.mark.parametrize(("node", "first_axis", "sizes"), [(0, 4, [4, 4]), (1, None, [4, 2])])
def test_only_the_node_that_gets_the_short_batch_leaves_the_batch_axis_unknown(node, first_axis, sizes):
    from shmpipe.testing.datasets import Numbered

    # 14 samples: batches of 4, 4, 4, 2 dealt to 2 nodes in turn; node 0
    # never gets the short one, whatever state a run resumes from.
    with shmpipe.from_dataset(Numbered(14), batch_size=4, num_workers=1, num_nodes=2, node_rank=node, seed=1,
                              timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        assert ds.element_spec["x"] == tf.TensorSpec((first_axis, 3), tf.int64)
        assert [len(e["i"]) for e in ds] == sizes


def test_a_batch_samplers_batches_leave_the_batch_axis_unknown():
    from shmpipe.testing.datasets import Numbered

    sizes = [[0, 1, 2], [3, 4, 5], [6]]
    with shmpipe.from_dataset(Numbered(7), batch_sampler=sizes, num_workers=2, timeout=T) as pipe:
        ds = pipe.to_tf_dataset()
        assert ds.element_spec["x"] == tf.TensorSpec((None, 3), tf.int64)
        assert [e["i"].numpy().tolist() for e in ds] == sizes


class _Unsized:
    """A sampler without a length: how many batches it makes is unknown."""

    def __iter__(self):
        return iter(range(8))


def test_a_samplers_length_tells_whether_the_last_batch_may_be_partial():
    from shmpipe.testing.datasets import EpochSampler, Numbered

    for sampler, first_axis in ((EpochSampler(12, seed=1), 4), (EpochSampler(10, seed=1), None), (_Unsized(), None)):
        with shmpipe.from_dataset(Numbered(12), batch_size=4, sampler=sampler, num_workers=1, timeout=T) as pipe:
            ds = pipe.to_tf_dataset()
            assert ds.element_spec["x"].shape.as_list() == [first_axis, 3], sampler
            assert sum(len(e["i"]) for e in ds) == len(list(sampler))


def test_keras_fits_a_dataset_whose_epochs_end_with_a_partial_batch():
    import keras

    from shmpipe.testing.datasets import Numbered

    # 10 samples in batches of 4: each epoch's third batch has 2
    with shmpipe.from_dataset(Numbered(10, shape=(8,)), batch_size=4, num_workers=2, timeout=T) as pipe:
        ds = pipe.to_tf_dataset(batches_per_pass=3).map(lambda b: (tf.cast(b["x"], tf.float32) / 10, tf.cast(b["i"], tf.float32) / 10))
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(ds, epochs=3, verbose=0, shuffle=False)
        assert len(history.history["loss"]) == 3
        assert pipe.stats().batches == 9


def test_prefetch_to_device_is_the_last_hop():
    with shmpipe.from_iterators([Counter(6)] * 2, timeout=T) as pipe:
        ds = pipe.to_tf_dataset(device="/cpu:0")
        assert sorted((int(e["worker"]), int(e["seq"])) for e in ds) == [(w, s) for w in range(2) for s in range(6)]


def test_a_device_tensorflow_lacks_is_said_and_a_bad_one_refused():
    with shmpipe.from_iterators([Counter(3)], timeout=T) as pipe:
        with pytest.raises(shmpipe.ShmpipeValueError, match=r"device='bogus'"):
            pipe.to_tf_dataset(device="bogus")
        assert [b["seq"] for b in pipe] == [0, 1, 2]  # refused before any batch was taken
        if tf.config.list_logical_devices("GPU"):
            return
        with pytest.warns(shmpipe.ShmpipeWarning, match="sees no GPU here, so the elements stay on the CPU"):
            ds = pipe.to_tf_dataset(device="/gpu:0")
        assert [int(e["seq"]) for e in ds] == [0, 1, 2]


def test_a_producer_failure_comes_through_tensorflow():
    from shmpipe.testing.sources import Raiser

    with shmpipe.from_iterators([Raiser(3)], timeout=T) as pipe:
        ds = pipe.to_tf_dataset(output_signature={"worker": tf.TensorSpec((), tf.int64), "seq": tf.TensorSpec((), tf.int64)})
        seen = []
        with pytest.raises(tf.errors.UnknownError, match=r"(?s)WorkerError.*boom from the source"):
            for e in ds:
                seen.append(int(e["seq"]))
        assert seen == [0, 1, 2]  # everything published before the failure


def test_model_fit_on_a_shmpipe_dataset():
    import keras

    # LinearXY lives in a module without TensorFlow, so producers stay light
    with shmpipe.from_iterators([LinearXY(10)] * 2, timeout=T) as pipe:
        ds = pipe.to_tf_dataset(batches_per_pass=np.int64(20)).prefetch(2)  # (a NumPy int is one)
        assert ds.cardinality().numpy() == 20
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(ds, epochs=3, verbose=0, shuffle=False)
        assert len(history.history["loss"]) == 3
        assert history.history["loss"][-1] < history.history["loss"][0]
        stats = pipe.stats()
    assert stats.passes == 3 and stats.batches == 60


@pytest.mark.parametrize(("kwargs", "error"), [
    (dict(batches_per_pass=0), shmpipe.ShmpipeValueError),
    (dict(batches_per_pass=2.0), shmpipe.ShmpipeTypeError),
])
def test_a_bad_argument_is_refused_before_a_batch_is_peeked_at(kwargs, error):
    # (batches_per_pass was checked after the first batches were taken to
    # infer the signature: the error came with the stream's position moved)
    with shmpipe.from_iterators([Counter(3)], timeout=T) as pipe:
        with pytest.raises(error, match=f"{next(iter(kwargs))} must be a positive int"):
            pipe.to_tf_dataset(**kwargs)
        assert pipe.stats().passes == 0  # no pass begun, no batch taken to peek at
        assert [b["seq"] for b in pipe] == [0, 1, 2]
