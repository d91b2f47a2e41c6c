"""PyTorch tensors from a pipeline, with the CPU build of torch.

There is no CUDA here. The copy to a device is exercised with the "meta"
device, whose copies are real torch calls but keep no data, and a stand-in
for the CUDA event that the test completes by hand: what is tested is
shmpipe's rule that a slot stays held until the event recorded after its
copy completes. The CUDA calls themselves (cudaHostRegister, events, DMA)
run in benchmarks/gpu_feed.py, on a machine with a GPU."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmpipe  # noqa: E402
from shmpipe import _ring  # noqa: E402
from shmpipe.testing.sources import Counter, Fixed, LinearXY, Raiser, payload_for  # noqa: E402

T = 60.0
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these there)")
no_cuda = pytest.mark.skipif(CUDA, reason="what happens where there is no CUDA")


def in_segment(t, pipe) -> bool:
    lo = pipe.channel.segment.address
    return lo <= t.data_ptr() < lo + pipe.channel.segment.size


def test_host_tensors_are_views_of_the_shared_memory():
    with shmpipe.from_iterators([Counter(6, shape=(32, 32))] * 2, timeout=T) as pipe:
        seen = []
        for b in pipe.to_torch():
            assert isinstance(b["data"], torch.Tensor) and b["data"].dtype == torch.float32
            assert in_segment(b["data"], pipe), "the tensor is a copy"
            np.testing.assert_array_equal(b["data"].numpy(), payload_for(b["worker"], b["seq"], (32, 32)))
            assert isinstance(b["seq"], int)  # scalars stay Python scalars
            seen.append((b["worker"], b["seq"]))
    assert sorted(seen) == [(w, s) for w in range(2) for s in range(6)]


def test_a_slot_is_held_while_a_tensor_lives():
    with shmpipe.from_iterators([Counter(30, shape=(256,))], capacity=8, timeout=T) as pipe:
        it = iter(pipe.to_torch())
        kept = []
        for _ in range(3):
            b = next(it)
            kept.append((b["data"], b["seq"]))
            del b
        ring = pipe.channel.ring
        slots = []
        for t, seq in kept:
            slot = next(i for i in range(ring.nslots) if ring.payload_address(i) <= t.data_ptr() < ring.payload_address(i) + ring.slot_size)
            assert ring.slot_info(slot)[0] == _ring.HELD and ring.slot_info(slot)[3] == seq
            slots.append((slot, seq))
        del kept, t
        gc.collect()
        time.sleep(0.05)
        for slot, seq in slots:
            state, _, _, wseq, _ = ring.slot_info(slot)
            assert not (state == _ring.HELD and wseq == seq)
        del it


def test_nesting_numpy_scalars_and_new_passes():
    batch = {"t": (np.arange(3, dtype=np.int16), [np.float64(2.5), "s"]), "n": np.int64(7)}
    with shmpipe.from_iterators([Fixed([batch, batch])], timeout=T) as pipe:
        batches = pipe.to_torch()
        for _ in range(2):  # each iteration is a pass
            out = list(batches)
            assert len(out) == 2
            b = out[0]
            assert isinstance(b["t"], tuple) and isinstance(b["t"][1], list)
            assert b["t"][0].dtype == torch.int16 and b["t"][0].tolist() == [0, 1, 2]
            assert b["t"][1][0].item() == 2.5 and b["t"][1][1] == "s" and b["n"].item() == 7


def test_a_dtype_torch_lacks_is_a_type_error_with_its_path():
    batch = {"ok": np.zeros(2), "bad": [np.array(["x"], dtype="S1")]}
    with shmpipe.from_iterators([Fixed([batch])], timeout=T) as pipe:
        with pytest.raises(shmpipe.BatchTypeError, match=r"batch\['bad'\]\[0\]"):
            list(pipe.to_torch())


@no_cuda
def test_pin_memory_without_cuda_warns_once_and_works():
    with shmpipe.from_iterators([Counter(4)], timeout=T) as pipe:
        with pytest.warns(shmpipe.ShmpipeWarning, match="no effect") as record:
            batches = pipe.to_torch(pin_memory=True)
        assert len([w for w in record if "no effect" in str(w.message)]) == 1  # (test_pipeline: why only these)
        assert len(list(batches)) == 4


def test_device_cpu():
    with shmpipe.from_iterators([Counter(4)], timeout=T) as pipe:
        assert [b["data"].device.type for b in pipe.to_torch(device="cpu")] == ["cpu"] * 4


def test_a_training_loop():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with shmpipe.from_iterators([LinearXY(10)] * 2, timeout=T) as pipe:
        for _ in range(3):
            total = 0.0
            for x, y in pipe.to_torch():
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item()
            losses.append(total)
    assert losses[-1] < losses[0]


class StandInEvent:
    """What shmpipe needs of a recorded torch.cuda.Event, completed by the
    test. Making one stands for recording it."""

    made: list = []

    def __init__(self) -> None:
        self.done = self.waited = False
        StandInEvent.made.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def held_seqs(pipe) -> set[int]:
    ring = pipe.channel.ring
    return {ring.slot_info(i)[3] for i in range(ring.nslots) if ring.slot_info(i)[0] == _ring.HELD}


def device_batches(pipe):
    StandInEvent.made = []
    batches = pipe.to_torch(device="meta", non_blocking=True)
    assert batches.record_event is None  # "meta" has no events: its copies are done on return
    batches.record_event = StandInEvent  # as a CUDA event would be recorded on a GPU
    return batches


def test_a_slot_stays_held_until_the_event_after_its_copy_completes():
    with shmpipe.from_iterators([Counter(5, shape=(64,))], capacity=4, timeout=T) as pipe:
        it = iter(device_batches(pipe))
        b = next(it)
        assert b["data"].device.type == "meta" and b["seq"] == 0
        e0 = StandInEvent.made[0]
        assert held_seqs(pipe) == {0}, "the copy may still read slot 0"
        assert next(it)["seq"] == 1
        assert held_seqs(pipe) == {0, 1}  # one batch in flight is allowed when taking the next
        e0.done = True
        assert next(it)["seq"] == 2
        assert held_seqs(pipe) == {1, 2}, "the finished copy's slot goes back"
        e1, e2 = StandInEvent.made[1:3]
        assert not e0.waited and not e1.done
        assert next(it)["seq"] == 3
        # two were in flight: shmpipe waited for the older one
        assert e1.waited and not e2.waited and held_seqs(pipe) == {2, 3}
        assert next(it)["seq"] == 4
        with pytest.raises(StopIteration):
            next(it)
        assert all(e.done for e in StandInEvent.made)  # the pass ended: every copy waited for
        assert held_seqs(pipe) == set() and pipe.channel.held() == 0


def test_an_abandoned_pass_waits_for_its_copies_before_letting_slots_go():
    with shmpipe.from_iterators([Counter(8, shape=(64,))], capacity=4, timeout=T) as pipe:
        batches = device_batches(pipe)
        it = iter(batches)
        next(it), next(it)
        assert held_seqs(pipe) == {0, 1}
        del it
        gc.collect()
        assert all(e.waited for e in StandInEvent.made[:2])
        assert held_seqs(pipe) == set()
        # and the next pass is complete
        assert [b["seq"] for b in batches] == list(range(8))


def test_a_failed_pass_waits_for_its_copies_and_holds_no_slot_after():
    # Only the end of a pass waited for the copies in flight: a failure left
    # their host batches with the iterator, which the error's traceback keeps
    # (the ring mapped after close for as long as the error lived; helper 67).
    pipe = shmpipe.from_iterators([Raiser(3, only_worker=0, shape=(64,))], capacity=4, timeout=T)
    it = iter(device_batches(pipe))
    assert [next(it)["seq"] for _ in range(3)] == [0, 1, 2]
    assert held_seqs(pipe) == {1, 2}  # two copies in flight
    with pytest.raises(shmpipe.WorkerError):
        next(it)
    assert all(e.done for e in StandInEvent.made), "the copies in flight were not waited for"
    assert pipe.closed and pipe.held() in (0, None)


def test_copies_in_flight_never_hold_the_ring_hostage():
    # Capacity 2 and copies that never finish on their own: without the
    # wait for the oldest copy the consumer would wait for a slot forever.
    with shmpipe.from_iterators([Counter(12, shape=(64,))], capacity=2, timeout=10) as pipe:
        seqs = [b["seq"] for b in device_batches(pipe)]
    assert seqs == list(range(12))


def test_blocking_copies_need_no_events():
    with shmpipe.from_iterators([Counter(3, shape=(64,))], timeout=T) as pipe:
        batches = pipe.to_torch(device="meta", non_blocking=False)
        batches.record_event = StandInEvent
        StandInEvent.made = []
        assert [b["seq"] for b in batches] == [0, 1, 2]
        assert StandInEvent.made == []


def test_pin_memory_leaves_memory_the_pipeline_does_not_own_alone():
    from shmpipe._torch import _Registration

    with shmpipe.from_iterators([Counter(2)], transport="queue", timeout=T) as pipe:
        next(iter(pipe))
        assert pipe.channel.owns_memory is False
        reg = _Registration.of(pipe)
        assert _Registration.of(pipe) is reg and pipe._close_hooks.count(reg.unregister) == 1
        with pytest.warns(shmpipe.ShmpipeWarning, match="not the pipeline.s own"):
            reg.register(pipe)
        assert reg.ranges == []
        reg.register(pipe)  # tried once: no second warning (pytest errors on one)


def test_pin_memory_without_a_cuda_device_says_it_does_nothing():
    with shmpipe.from_iterators([Counter(2)], timeout=T) as pipe:
        with pytest.warns(shmpipe.ShmpipeWarning, match="no effect"):
            batches = pipe.to_torch(device="cpu", pin_memory=True)
        assert batches.pin_memory is False
        assert len(list(batches)) == 2


@pytest.mark.parametrize(
    "device", [pytest.param("cuda", marks=no_cuda), pytest.param("cuda:0", marks=no_cuda), "bogus", "cuda:99"]
)
def test_a_device_torch_cannot_use_is_refused_before_any_batch_is_taken(device):
    with shmpipe.from_iterators([Counter(3)], timeout=T) as pipe:
        with pytest.raises(shmpipe.ShmpipeValueError, match=r"to_torch\(device=.*torch cannot put tensors there"):
            pipe.to_torch(device=device)
        assert [b["seq"] for b in pipe] == [0, 1, 2]  # nothing was lost


# -- on a GPU (skipped without CUDA) ------------------------------------------


def page_is_pinned(address: int) -> bool:
    import ctypes

    return torch.frombuffer((ctypes.c_uint8 * 4096).from_address(address), dtype=torch.uint8).is_pinned()


@needs_cuda
def test_pin_memory_registers_the_ring_once_and_unregisters_it_at_close():
    with shmpipe.from_iterators([Counter(6, shape=(1 << 16,))], timeout=T) as pipe:
        batches = pipe.to_torch(device="cuda", pin_memory=True)
        it = iter(batches)
        b = next(it)
        assert b["data"].is_cuda
        from shmpipe._torch import _Registration

        reg = _Registration.of(pipe)
        lo, size = pipe.channel.memory_ranges()[0]
        assert reg.ranges == [(lo, size)] and page_is_pinned(lo + size // 2)
        rest = list(it) + list(batches)  # the rest of the pass, and a second pass
        assert len(rest) == 11 and reg.ranges == [(lo, size)]  # registered once
        np.testing.assert_array_equal(rest[-1]["data"].cpu().numpy(), payload_for(0, 5, (1 << 16,)))
    assert reg.ranges == []  # unregistered by close, before the segment could go


@needs_cuda
@pytest.mark.parametrize("pin_memory", [True, False])
def test_on_the_gpu_no_batch_changes_before_its_copy_ran(pin_memory):
    # Each copy waits in the stream behind matrix products, while the
    # producers refill every slot that is given back: a slot given back
    # before its copy ran would reach the GPU with another batch's stamp.
    from shmpipe.testing.sources import StampedInPlace

    a = torch.randn(2048, 2048, device="cuda")
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    n = 0
    with shmpipe.from_iterators([StampedInPlace(30, 4 << 20)] * 2, capacity=3, timeout=T) as pipe:
        for b in pipe.to_torch(device="cuda", pin_memory=pin_memory, non_blocking=True):
            for _ in range(4):
                a = (a @ a) * 1e-4  # the next copy queues behind these
            bad += (b["data"] != b["stamp"]).any().to(torch.int64)
            n += 1
        torch.cuda.synchronize()
    assert n == 60 and int(bad) == 0


# -- in-place ops on a batch's tensors ------------------------------------------


def _bytes_of(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("transport", ["shm", "arrow"])
def test_in_place_ops_on_any_batch_never_crash_and_stay_private(transport):
    """Batches larger than a slot lie in their producer's region, which the
    trainer maps read-only: an in-place op on their tensors (x.mul_(2)) was a
    SIGSEGV. Each such tensor is now a private copy-on-write view: the op
    works, the batch's NumPy arrays never see it, and the next batch in the
    same region is read whole (no page of the write stays behind)."""
    from shmpipe.testing.sources import Shapes, crc_of

    # The first batch (4 KiB) sizes the slot; the others are up to 16x larger,
    # through the same few regions again and again.
    shapes = [(1024 * (1 + (i * 7) % 16),) for i in range(40)]
    with shmpipe.from_iterators([Shapes(shapes)] * 2, transport=transport, capacity=4, timeout=T) as pipe:
        big = 0
        for b in pipe.to_torch():
            x = b["x"]
            assert crc_of(x.numpy()) == b["crc"], "a batch read stale bytes of an earlier write"
            u = x.view(torch.uint8)
            before = u.clone()
            u.add_(1)
            assert torch.equal(u, before + 1)
            big += x.numel() * 4 > pipe.channel.ring.slot_size
        assert big > 20
        # The NumPy arrays of a batch and its tensors: a write through the
        # tensor stays in the tensor (where the batch lies in a slot, the
        # tensor is the batch itself: see the next test).
        for b in pipe:
            host = shmpipe._torch._host_tensors(b, True)
            host["x"].view(torch.uint8).add_(1)
            if b["x"].nbytes > pipe.channel.ring.slot_size:
                assert crc_of(b["x"]) == b["crc"]
                assert _bytes_of(host["x"]) != b["x"].tobytes()


def test_in_place_ops_on_a_batch_in_a_slot_write_that_batch_only():
    """Where the trainer's own ring holds a batch (mapped writable), its
    tensors are the slot itself: an in-place op writes the batch, which is
    the trainer's until it lets it go; the next batches are intact."""
    with shmpipe.from_iterators([Counter(40, shape=(64,))] * 2, capacity=4, timeout=T) as pipe:
        for b in pipe.to_torch():
            assert in_segment(b["data"], pipe)
            np.testing.assert_array_equal(b["data"].numpy(), payload_for(b["worker"], b["seq"], (64,)))
            b["data"].mul_(0)
