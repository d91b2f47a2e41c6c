"""PyTorch tensors from a pipeline (CPU build of torch; CUDA paths need a GPU:
see benchmarks/gpu_feed.py)."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmpipe  # noqa: E402
from shmpipe import _ring  # noqa: E402
from shmpipe.testing.sources import Counter, Fixed, LinearXY, payload_for  # noqa: E402

T = 60.0


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


def test_pin_memory_without_cuda_warns_once_and_works():
    assert not torch.cuda.is_available()
    with shmpipe.from_iterators([Counter(4)], timeout=T) as pipe:
        with pytest.warns(shmpipe.ShmpipeWarning, match="no effect") as record:
            batches = pipe.to_torch(pin_memory=True)
        assert len(record) == 1
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
