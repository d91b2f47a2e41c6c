"""Picklable sources for tests and benchmarks.

A source is a zero-argument callable returning an iterable of batches; these
are small classes (not closures) so that spawned producer processes can
unpickle them.
"""

from __future__ import annotations

import os
import random
import signal
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

import shmpipe

__all__ = [
    "Counter",
    "DiesOnce",
    "Fixed",
    "Raiser",
    "Killer",
    "Exiter",
    "Reserver",
    "SeedReporter",
    "Drawing",
    "Stamped",
    "StringsAt",
    "StatefulCounter",
    "Matrix",
    "Progress",
    "NodeReporter",
    "LinearXY",
    "HalfWriter",
    "Sleeper",
    "ForksAChild",
    "ChangedReservation",
    "ReserveThenOther",
    "Shapes",
    "crc_of",
    "fill_pattern",
    "payload_for",
]


def _worker_info() -> shmpipe.WorkerInfo:
    """This producer's WorkerInfo (these sources run inside shmpipe producers)."""
    info = shmpipe.get_worker_info()
    if info is None:
        raise RuntimeError("this source runs in a shmpipe producer: shmpipe.get_worker_info() is None here")
    return info


def payload_for(worker: int, seq: int, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """The deterministic array Counter sends as batch `seq` of `worker`."""
    n = int(np.prod(shape, dtype=np.int64))
    base = np.arange(n, dtype=np.float64) * 1e-3 + worker * 1000 + seq
    return base.astype(dtype).reshape(shape)


class Counter:
    """Yields n batches {"worker", "seq", "data", "checksum"}; data depends
    only on (worker, seq), so the consumer can check every byte. `delay`
    seconds before each batch; `linger` seconds after the last one, before
    the source ends (its end of pass comes late)."""

    def __init__(
        self, n: int, shape: tuple[int, ...] = (16,), dtype: Any = np.float32, delay: float = 0.0, linger: float = 0.0
    ) -> None:
        self.n, self.shape, self.dtype, self.delay, self.linger = n, tuple(shape), np.dtype(dtype), delay, linger

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = _worker_info().id
        for seq in range(self.n):
            if self.delay:
                time.sleep(self.delay)
            data = payload_for(worker, seq, self.shape, self.dtype)
            yield {"worker": worker, "seq": seq, "data": data, "checksum": float(data.astype(np.float64).sum())}
        if self.linger:
            time.sleep(self.linger)


class Fixed:
    """Yields the given batches, in order (worker id ignored)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __call__(self) -> Iterator[Any]:
        yield from self.batches


class _FailsAfter:
    """Worker `only_worker` (every worker if None) yields `after` batches
    {"worker", "seq"} at once, then fails (how: fail()); the other workers
    yield one batch every `delay` seconds, for ever, so the consumer is
    never starved."""

    #: seconds the workers that do not fail sleep before each batch
    delay = 0.01
    #: with a shape, each batch has "data" too: payload_for(worker, seq, shape)
    shape: tuple[int, ...] | None = None

    def __init__(self, after: int, only_worker: int | None) -> None:
        self.after, self.only_worker = after, only_worker

    def fail(self) -> None:
        raise NotImplementedError

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = _worker_info().id
        fails = self.only_worker is None or worker == self.only_worker
        seq = 0
        while True:
            if seq == self.after and fails:
                self.fail()
            if not fails:
                time.sleep(self.delay)
            if self.shape is None:
                yield {"worker": worker, "seq": seq}
            else:
                yield {"worker": worker, "seq": seq, "data": payload_for(worker, seq, self.shape)}
            seq += 1


class Raiser(_FailsAfter):
    """Fails by raising `exc_type(message)`."""

    def __init__(self, after: int, exc_type: type[BaseException] = ValueError, message: str = "boom from the source",
                 only_worker: int | None = None, delay: float = 0.01, shape: tuple[int, ...] | None = None) -> None:
        super().__init__(after, only_worker)
        self.exc_type, self.message, self.delay, self.shape = exc_type, message, delay, shape

    def fail(self) -> None:
        raise self.exc_type(self.message)


class ShardError(Exception):
    """An exception whose __init__ takes other arguments than its args (as
    many of a user's do): pickle cannot rebuild it from them."""

    def __init__(self, shard: int, reason: str) -> None:
        super().__init__(f"shard {shard}: {reason}")


class RaisesShardError(_FailsAfter):
    """Fails by raising a ShardError, which its producer's process can
    pickle and the trainer's cannot unpickle."""

    def __init__(self, after: int, only_worker: int | None = 0) -> None:
        super().__init__(after, only_worker)

    def fail(self) -> None:
        raise ShardError(7, "checksum mismatch")


class NotRebuiltElsewhere(Counter):
    """A Counter that cannot be unpickled in another process than the one
    that made it, as a source whose module is missing on the producer's
    node cannot."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.made_in = os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["made_in"] != os.getpid():
            raise ImportError("No module named 'missing_on_this_node'")
        self.__dict__.update(state)


class Killer(_FailsAfter):
    """Fails by killing its own process with `sig`."""

    def __init__(self, after: int, sig: int = signal.SIGKILL, only_worker: int | None = 0) -> None:
        super().__init__(after, only_worker)
        self.sig = sig

    def fail(self) -> None:
        os.kill(os.getpid(), self.sig)
        time.sleep(10)


class Exiter(_FailsAfter):
    """Fails by leaving with os._exit(code)."""

    def __init__(self, after: int, code: int = 3, only_worker: int | None = 0) -> None:
        super().__init__(after, only_worker)
        self.code = code

    def fail(self) -> None:
        os._exit(self.code)


class DiesOnce:
    """n batches like Reserver's (with "epoch"), every `big_every`-th one
    (0: none) larger than the ring's slots; worker `worker` dies at its
    batch `at` of epoch `epoch` -- after reserving it and writing half of
    it -- the first time only (the file `marker` says it happened, so the
    producer that replaces it goes on). `how`: "kill" (SIGKILL), "segv"
    (SIGSEGV) or "exit" (os._exit(3))."""

    def __init__(
        self, n: int, at: int, marker: str, *, worker: int = 0, epoch: int = 0, how: str = "kill", big_every: int = 0
    ) -> None:
        self.n, self.at, self.marker, self.worker, self.epoch = n, at, marker, worker, epoch
        self.how, self.big_every = how, big_every

    def __call__(self) -> Iterator[dict[str, Any]]:
        info = _worker_info()
        for seq in range(self.n):
            big = self.big_every and seq % self.big_every == self.big_every - 1
            shape = (1 << 17,) if big else (64,)
            batch = shmpipe.reserve(
                {"data": shmpipe.ArraySpec(shape, np.float32), "worker": info.id, "seq": seq, "epoch": info.epoch}
            )
            batch["data"][: shape[0] // 2] = seq
            if (info.id, seq, info.epoch) == (self.worker, self.at, self.epoch) and not os.path.exists(self.marker):
                with open(self.marker, "w"):
                    pass
                if self.how == "exit":
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGSEGV if self.how == "segv" else signal.SIGKILL)
                time.sleep(10)
            batch["data"][shape[0] // 2 :] = seq
            yield batch


class StatefulCounter:
    """A source whose iterator has its own state_dict()/load_state_dict()
    (as torchdata's do): n batches {"worker", "seq", "epoch", "made"} per
    pass, "made" counting the batches this iterator made (so a resume from
    its state, which makes none again, is seen)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self) -> _CountingIterator:
        return _CountingIterator(self.n)


class _CountingIterator:
    def __init__(self, n: int) -> None:
        self.n, self.next_seq, self.made = n, 0, 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.next_seq >= self.n:
            raise StopIteration
        info = _worker_info()
        self.made += 1
        batch = {"worker": info.id, "seq": self.next_seq, "epoch": info.epoch, "made": self.made}
        self.next_seq += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"next_seq": self.next_seq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_seq = int(state["next_seq"])


class Reserver:
    """Fills slots in place with shmpipe.reserve: n batches of
    {"data": float32 array of `shape`, "worker", "seq"} (and "epoch" with
    `with_epoch`); data[...] = seq."""

    def __init__(self, n: int, shape: tuple[int, ...] = (1024,), fill: bool = True, with_epoch: bool = False) -> None:
        self.n, self.shape, self.fill, self.with_epoch = n, tuple(shape), fill, with_epoch

    def __call__(self) -> Iterator[dict[str, Any]]:
        info = _worker_info()
        worker = info.id
        template: dict[str, Any] = {"data": shmpipe.ArraySpec(self.shape, np.float32), "worker": worker, "seq": 0}
        if self.with_epoch:
            template["epoch"] = info.epoch
        for seq in range(self.n):
            batch = shmpipe.reserve(dict(template, seq=seq))
            if self.fill:
                batch["data"][...] = seq + 1000 * worker
            else:
                batch["data"].flat[0] = seq
            yield batch


class SeedReporter:
    """One batch: this worker's WorkerInfo and the first draws of NumPy's and
    random's global generators."""

    def __call__(self) -> Iterator[dict[str, Any]]:
        info = _worker_info()
        yield {
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "epoch": info.epoch,
            "np": float(np.random.random()),
            "py": random.random(),
        }


class Drawing:
    """n batches {"worker", "seq", "epoch", "draw"}: each draw is the next of
    NumPy's global generator, which shmpipe seeds for each pass, so a pass's
    draws are the same whenever it runs. `delay` seconds before each batch
    (a pass given up still has its source in the middle of a batch)."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __call__(self) -> Iterator[dict[str, Any]]:
        info = _worker_info()
        for seq in range(self.n):
            if self.delay:
                time.sleep(self.delay)
            yield {"worker": info.id, "seq": seq, "epoch": info.epoch, "draw": int(np.random.randint(1 << 30))}


class Stamped:
    """n batches whose whole array is filled with a stamp (worker * 1e6 + seq),
    so a consumer can tell if a batch changed after delivery."""

    def __init__(self, n: int, shape: tuple[int, ...] = (4096,), delay: float = 0.0) -> None:
        self.n, self.shape, self.delay = n, tuple(shape), delay

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = _worker_info().id
        data = np.empty(self.shape, np.float64)
        for seq in range(self.n):
            if self.delay:
                time.sleep(self.delay)
            data.fill(worker * 1e6 + seq)
            yield {"stamp": worker * 1e6 + seq, "data": data}


class StampedInPlace:
    """n batches {"stamp", "data"} whose float32 array of `nbytes` is filled
    with its stamp (worker * 1e6 + seq) in the slot itself (shmpipe.reserve):
    a slot reused too early holds another stamp."""

    def __init__(self, n: int, nbytes: int = 1 << 16) -> None:
        self.n, self.nbytes = n, nbytes

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = _worker_info().id
        spec = shmpipe.ArraySpec((self.nbytes // 4,), np.float32)
        for seq in range(self.n):
            a = shmpipe.reserve(spec)
            a.fill(worker * 1e6 + seq)
            yield {"stamp": np.float32(worker * 1e6 + seq), "data": a}


class Matrix:
    """Every batch of shmpipe.testing.batches.matrix(), built in the producer."""

    def __call__(self) -> Iterator[Any]:
        from shmpipe.testing.batches import matrix

        for _, batch in matrix():
            yield batch


class HalfWriter:
    """Publishes `after` batches, then reserves a slot, writes half of it
    and kills its own process: the half-written slot must never be
    delivered."""

    def __init__(self, after: int, shape: tuple[int, ...] = (4096,)) -> None:
        self.after, self.shape = after, tuple(shape)

    def __call__(self) -> Iterator[dict[str, Any]]:
        for seq in range(self.after):
            batch = shmpipe.reserve({"data": shmpipe.ArraySpec(self.shape, np.float64), "seq": seq})
            batch["data"][...] = seq
            yield batch
        batch = shmpipe.reserve({"data": shmpipe.ArraySpec(self.shape, np.float64), "seq": -1})
        batch["data"][: self.shape[0] // 2] = -1.0
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
        yield batch


class Sleeper:
    """One batch, then `seconds` of sleep per batch: a producer stuck in
    user code."""

    def __init__(self, seconds: float, n: int = 1000) -> None:
        self.seconds, self.n = seconds, n

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = _worker_info().id
        for seq in range(self.n):
            yield {"worker": worker, "seq": seq}
            time.sleep(self.seconds)


class ForksAChild:
    """Forks a child that sleeps `child_s` seconds holding every descriptor
    the producer had (its control pipe, multiprocessing's sentinel pipe, the
    channel's), writes the child's pid to `pid_file` (whole, by a rename),
    then yields {"worker", "seq"} every `delay` seconds, for ever. Whoever
    uses it kills the child (its pid is in the file) when done."""

    def __init__(self, pid_file: str, child_s: float = 20.0, delay: float = 0.01) -> None:
        self.pid_file, self.child_s, self.delay = pid_file, child_s, delay

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = _worker_info().id
        pid = os.fork()
        if pid == 0:
            try:
                time.sleep(self.child_s)
            finally:
                os._exit(0)  # never back into the producer's code
        partial = f"{self.pid_file}.{os.getpid()}"
        with open(partial, "w") as f:
            f.write(str(pid))
        os.rename(partial, self.pid_file)
        seq = 0
        while True:
            yield {"worker": worker, "seq": seq}
            seq += 1
            time.sleep(self.delay)


class Progress:
    """n batches {"worker", "seq"}; before yielding each, appends one byte to
    <directory>/<worker>, so the file's size is how far the producer got
    (backpressure tests read it from outside, whatever the transport)."""

    def __init__(self, n: int, directory: str) -> None:
        self.n, self.directory = n, directory

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = _worker_info().id
        fd = os.open(os.path.join(self.directory, str(worker)), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for seq in range(self.n):
                os.write(fd, b".")
                yield {"worker": worker, "seq": seq}
        finally:
            os.close(fd)


def produced(directory: str, num_workers: int) -> int:
    """How many batches Progress sources in `directory` have made."""
    total = 0
    for w in range(num_workers):
        try:
            total += os.path.getsize(os.path.join(directory, str(w)))
        except FileNotFoundError:
            pass
    return total


class NodeReporter:
    """For Ray producers: n batches {"node": the Ray node id it ran on,
    "worker", "seq", "data"} (data as Counter's, of `shape`)."""

    def __init__(self, n: int, shape: tuple[int, ...] = (16,)) -> None:
        self.n, self.shape = n, tuple(shape)

    def __call__(self) -> Iterator[dict[str, Any]]:
        import ray

        node = ray.get_runtime_context().get_node_id()
        worker = _worker_info().id
        for seq in range(self.n):
            yield {"node": node, "worker": worker, "seq": seq, "data": payload_for(worker, seq, self.shape)}


class LinearXY:
    """n (x, y) batches of a linear regression problem, for training loops:
    x is (batch, features) float32, y = x @ [1, 2, ..., features]."""

    def __init__(self, n: int, batch: int = 32, features: int = 8) -> None:
        self.n, self.batch, self.features = n, batch, features

    def __call__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(_worker_info().seed)
        w = np.arange(1, self.features + 1, dtype=np.float32)
        for _ in range(self.n):
            x = rng.standard_normal((self.batch, self.features)).astype(np.float32)
            yield x, (x @ w)[:, None]


def crc_of(arr: np.ndarray) -> int:
    """CRC-32 of an array's bytes (C order), without a copy."""
    return zlib.crc32(arr.reshape(-1).view(np.uint8).data)


def fill_pattern(arr: np.ndarray, worker: int, seq: int) -> None:
    """Fills `arr` (C-contiguous) with bytes that depend on (worker, seq),
    in place and in O(n) without temporaries (a 1 GiB batch stays 1 GiB)."""
    flat = arr.reshape(-1).view(np.uint8)
    n = flat.size
    if n == 0:
        return
    seed = (np.arange(min(n, 4093), dtype=np.uint32) * 31 + worker * 7919 + seq * 104729).astype(np.uint8)
    flat[: seed.size] = seed
    done = seed.size
    while done < n:  # doubling copies: the pattern repeats every 4093 bytes
        step = min(done, n - done)
        flat[done : done + step] = flat[:step]
        done += step


class StringsAt:
    """`n` batches {"x": float32 zeros, "y": two float32s}, but batch `at`
    of each worker has "y" an array of strings: a leaf the shm transport
    carries and torch and JAX refuse (to_torch, to_jax: BatchTypeError)."""

    def __init__(self, at: int, n: int = 20) -> None:
        self.at, self.n = at, n

    def __call__(self) -> Iterator[dict[str, Any]]:
        for seq in range(self.n):
            y = np.array(["a", "b"]) if seq == self.at else np.zeros(2, np.float32)
            yield {"x": np.zeros(16, np.float32), "y": y}


class Shapes:
    """Yields one batch per shape, each {"worker", "seq", "x", "crc"} with
    "x" an array of that shape and dtype filled by fill_pattern and "crc"
    the CRC-32 of its bytes (so the consumer checks any size cheaply).
    With `reserve`, the batches are filled in place (shmpipe.reserve)."""

    def __init__(
        self,
        shapes: list[tuple[int, ...]],
        dtype: Any = np.float32,
        reserve: bool = False,
        pause: tuple[int, int, float] | None = None,
        delay: float = 0.0,
    ) -> None:
        self.shapes, self.dtype, self.reserve = [tuple(s) for s in shapes], np.dtype(dtype), reserve
        self.pause = pause  # (worker, seq, seconds): that worker sleeps before that batch
        self.delay = delay  # seconds every worker sleeps before each batch

    def __call__(self) -> Iterator[dict[str, Any]]:
        worker = _worker_info().id
        for seq, shape in enumerate(self.shapes):
            if self.pause is not None and self.pause[:2] == (worker, seq):
                time.sleep(self.pause[2])
            if self.delay:
                time.sleep(self.delay)
            if self.reserve:
                # The CRC is an array of the reservation too: a reservation is
                # published in place only if its structure comes back as it went.
                template = {
                    "worker": worker,
                    "seq": seq,
                    "x": shmpipe.ArraySpec(shape, self.dtype),
                    "crc": shmpipe.ArraySpec((), np.uint32),
                }
                batch = shmpipe.reserve(template)
                fill_pattern(batch["x"], worker, seq)
                batch["crc"][()] = crc_of(batch["x"])
                yield batch
            else:
                x = np.empty(shape, self.dtype)
                fill_pattern(x, worker, seq)
                yield {"worker": worker, "seq": seq, "x": x, "crc": crc_of(x)}


class ChangedReservation:
    """Reserves 4 MiB (larger than the slots its first small batch sized),
    fills it, then adds a key before yielding: the reservation cannot be
    published in place, so it is copied."""

    def __call__(self) -> Iterator[Any]:
        yield {"x": np.zeros(16, np.uint8), "extra": 0}
        batch = shmpipe.reserve({"x": shmpipe.ArraySpec((4 << 20,), np.uint8)})
        batch["x"][...] = 7
        batch["extra"] = 1
        yield batch


class ReserveThenOther:
    """Worker 0 reserves a slot, then yields another batch instead: one of
    `nbytes` (larger than a slot when big), then a last small one. Other
    workers yield three small batches."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self) -> Iterator[Any]:
        worker = _worker_info().id
        yield {"x": np.zeros(100, np.uint8), "worker": worker}
        if worker == 0:
            shmpipe.reserve({"x": shmpipe.ArraySpec((100,), np.uint8), "worker": worker})
            yield {"x": np.ones(self.nbytes, np.uint8), "worker": worker}
        yield {"x": np.full(100, 2, np.uint8), "worker": worker}
