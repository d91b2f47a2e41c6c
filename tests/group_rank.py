"""One rank of a group of tests/test_group.py: run as a script, with its
config (JSON) as argv[1]. It checks every byte of what it receives, reports
what it got as one JSON line, and what it still holds of shared memory after
close(). (A module of its own: a rank imports no more than it needs.)"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import shmpipe


def _add_one_in_place(t: Any) -> Any:
    """Adds one to each byte of tensor `t` in place, checks it did, and
    returns the bytes from before as a NumPy array of `t`'s dtype."""
    import torch

    u = t.view(torch.uint8)
    before = u.clone()
    u.add_(1)
    assert torch.equal(u, before + 1)
    return before.view(t.dtype).numpy()


def _in_a_ring_mapping(address: int) -> bool:
    """Whether `address` lies in a mapping of a shmpipe memfd (shared or
    private) in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:shmpipe" in line:
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                if lo <= address < hi:
                    return True
    return False


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _wait_for(path: str, timeout: float = 60.0) -> None:
    """Until `path` exists; past `timeout`, on (the test finds out what
    did not happen)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def _touch_when_dealt(leader: Any, path: str, timeout: float = 60.0) -> None:
    """Touches `path` once rank 0's leader has dealt pass 0 whole (its
    "end" sent), from a thread (bounded by `timeout`)."""
    import threading

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while not leader.dropped_per_pass and time.monotonic() < deadline:
            time.sleep(0.005)
        _touch(path)

    threading.Thread(target=watch, daemon=True).start()


class _CutBegin(Exception):
    """cut_begin_of_pass's exception."""


def _rank_main(cfg: dict[str, Any]) -> None:
    import gc
    import warnings

    import numpy as np

    from shmpipe.testing.memory import ring_descriptors
    from shmpipe.testing.sources import Counter, Raiser, Shapes, crc_of, fill_pattern, payload_for

    result: dict[str, Any] = {"rank": cfg["rank"], "passes": [], "error": None, "big": 0, "pids": [], "warnings": []}
    warnings.showwarning = lambda message, category, *_, **__: result["warnings"].append(f"{category.__name__}: {message}")
    n = cfg["sources"]
    if cfg.get("high_fds"):
        # Every descriptor the group opens from here on is >= 1024, where
        # select() cannot go (FD_SETSIZE).
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        filler = os.open(os.devnull, os.O_RDONLY)
        result["fillers"] = [os.dup2(filler, fd) for fd in range(filler + 1, 1100)]
    if cfg.get("raiser"):
        sources: list[Any] = [Raiser(after=3, only_worker=1, message="\U0001f600" * cfg.get("emoji", 0) or "boom from the source")] * n
    elif cfg.get("big_then_raise"):
        # Ordered: w0 b0, w1 b0, w0 b1, w1 b1, w0 b2 (larger than a slot), then
        # worker 1 raises: with 3 ranks the second round is incomplete when
        # the error comes, and holds a batch that owns a descriptor.
        sources = [Shapes([(1024,), (1024,), (4096,), (4096,)]), Raiser(after=2, only_worker=1)]
    elif cfg.get("grow"):
        # The first batch sizes the slot; later ones are up to 4x larger.
        sources = [Shapes([(1024 * (1 + (i % 4)),) for i in range(cfg["per_source"])])] * n
    else:
        sources = [Counter(cfg.get("per_source", 0), (64,), linger=cfg.get("linger", 0.0))] * n

    def check(b: Any) -> tuple[int, int]:
        """Checks one batch; returns (worker, seq). A function, so that no
        array of the batch outlives the check in a local."""
        if adapter == "tf":
            b = {k: v.numpy() for k, v in b.items()}
        elif adapter == "jax-ahead":
            b = {k: np.asarray(v) for k, v in b.items()}
        if "i" in b:  # a dataset's batch (cfg "samples"): its first and last sample
            assert np.array_equal(b["x"], np.repeat(b["i"][:, None].astype(np.float32), 8, axis=1))
            return int(b["i"][0]), int(b["i"][-1])
        w, s = int(b["worker"]), int(b["seq"])
        if "x" in b:
            x = b["x"]
            if adapter == "torch":
                # In place, on a batch larger than a slot too: a private view.
                x = _add_one_in_place(x)
            expected = np.empty(x.shape, x.dtype)
            fill_pattern(expected, w, s)
            assert crc_of(x) == int(b["crc"]) and x.tobytes() == expected.tobytes()
            # The first batch (4 KiB) sized the slot (12 KiB): these did not fit.
            result["big"] += x.nbytes >= 12288
        elif "data" in b:
            data = b["data"]
            if adapter == "torch":
                assert isinstance(data, torch.Tensor)
                # No copy: the tensor's pages are the group's ring (in rank 0)
                # or a private mapping of it (elsewhere: read-only there).
                result["zero_copy"] = _in_a_ring_mapping(data.data_ptr())
                # In place: a SIGSEGV on a rank's read-only mapping, once.
                data = _add_one_in_place(data)
            elif adapter is None:
                assert not data.flags.writeable
                try:
                    data.flags.writeable = True
                    raise AssertionError("a rank's batch could be made writeable")
                except ValueError:
                    pass
            assert np.array_equal(data, payload_for(w, s, (64,)))
        return w, s

    if cfg.get("cut_begin_of_pass") is not None:
        # A signal handler's exception (a timeout of the program's own) right
        # after the rank began that pass, before its "begin" was sent.
        from shmpipe._group import _rank

        began, cut = _rank._Progress.began, cfg["cut_begin_of_pass"]

        def cut_began(self: Any, pass_no: int) -> None:
            began(self, pass_no)
            if pass_no == cut:
                raise _CutBegin(f"cut after pass {pass_no} began")

        _rank._Progress.began = cut_began
    pipe = batches = ds = kept = None
    if cfg.get("adapter") == "jax-ahead":
        # JAX imported before the group forms, not once its pass has begun:
        # a rank that imported it there (seconds on a busy machine) began
        # the pass that much after the other, whose wait is under timeout=.
        from shmpipe._jax import JaxBatches
    try:
        if cfg.get("wait_for_file"):  # a stray: it joins once the group delivers
            _wait_for(cfg["wait_for_file"])
        transport: Any = cfg.get("transport", "shm")
        if transport == "shm-posix":
            from shmpipe.transports.shm import ShmTransport

            transport = ShmTransport(backing="posix")
        if cfg.get("samples"):  # a dataset's batches (of 2), in order: a group that can save its state
            samples = [{"x": np.full((8,), i, np.float32), "i": i} for i in range(cfg["samples"])]
            pipe = shmpipe.from_dataset(
                samples, batch_size=2, num_workers=n, ordered=True, timeout=cfg.get("timeout", 60),
                group=cfg["group"], rank=cfg["rank"], num_ranks=cfg["num_ranks"], group_timeout=30,
            )
        else:
            pipe = shmpipe.from_iterators(
                sources,
                transport=transport,
                ordered=cfg.get("ordered", False),
                timeout=cfg.get("timeout", 60),
                group=cfg["group"],
                rank=cfg["rank"],
                num_ranks=cfg["num_ranks"],
                group_timeout=cfg.get("group_timeout", 30),
            )
        result["pids"] = pipe.pids
        if cfg.get("dealt_file") and pipe._leader is not None:
            _touch_when_dealt(pipe._leader, cfg["dealt_file"])
        adapter = cfg.get("adapter")
        for p in range(cfg["passes"]):
            got: list[list[int]] = []
            result["pass_so_far"] = got  # what the pass delivered, also when it ends in an error
            if adapter == "torch":
                import torch

                batches = pipe.to_torch()
            elif adapter == "tf" and p == 0:
                ds = pipe.to_tf_dataset()
            elif adapter == "jax-ahead":
                # Batches put ahead of the trainer from to_jax's thread (as
                # on an accelerator), here on the CPU.
                batches = JaxBatches(pipe, prefetch=2, ahead=True)
            try:
                taking = iter(batches if adapter in ("torch", "jax-ahead") else ds if adapter == "tf" else pipe)
            except _CutBegin:  # caught, as a program catches its own timeout, and it goes on
                result["passes"].append("interrupted")
                continue
            for b in taking:
                w, s = check(b)
                got.append([w, s])
                if cfg.get("keep_first") and kept is None:
                    kept = (w, s, b["data"])  # its slot must not be reused while this lives
                del b
                if p == 0 and len(got) == 1:
                    if cfg.get("started_file"):
                        _touch(cfg["started_file"])
                    if cfg.get("hold_until_file"):  # the group goes on once the stray was answered
                        _wait_for(cfg["hold_until_file"])
                if cfg.get("fork_child_at") == [p, len(got)]:
                    # A child that keeps this rank's end of the group's socket
                    # open (as a DataLoader worker would) for 20 s, but not
                    # the report's pipe (the test would wait for it); the
                    # test ends it (child_pid).
                    child = os.fork()
                    if child == 0:
                        null = os.open(os.devnull, os.O_WRONLY)
                        os.dup2(null, 1)
                        os.dup2(null, 2)
                        time.sleep(20)
                        os._exit(0)
                    result["child_pid"] = child
                if cfg.get("wait_at") == [p, len(got)]:
                    _wait_for(cfg["wait_file"])  # dealt_file: rank 0 dealt the pass whole
                for _ in range(cfg.get("states_each_step", 0)):
                    pipe.state_dict()  # as a checkpoint each step would (from to_jax's thread's side too)
                if cfg.get("send_at") == [p, len(got)]:
                    # A message rank 0 must refuse (a broken rank's)
                    if "raw" in cfg:  # a datagram that is no message at all
                        pipe._conn.sock.send(cfg["raw"].encode("latin-1"))
                    else:
                        pipe._conn.send(cfg["message"])
                if cfg.get("raise_at") == [p, len(got)]:
                    raise RuntimeError("the trainer's own error")
                if cfg.get("kill_at") == [p, len(got)]:
                    result["killed_at"] = time.time()
                    print(json.dumps(result), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if cfg.get("close_at") == [p, len(got)]:
                    t0 = time.monotonic()
                    pipe.close()
                    result["close_s"] = time.monotonic() - t0
                    if kept is not None:
                        # Rank 0 fails the group, its producers write on for a
                        # moment: none of it may land in the slot kept here.
                        time.sleep(1.0)
                    break
                if cfg.get("break_at") == [p, len(got)]:
                    break  # leaves the pass early; the next one begins
                if cfg.get("step_s"):
                    time.sleep(cfg["step_s"])
            result["passes"].append(got)
            if cfg.get("state_after_pass"):
                time.sleep(0.5)  # to_jax's thread reads the pass's end meanwhile
                result.setdefault("states", []).append(pipe.state_dict())
            if cfg.get("wait_file_after_pass"):  # as a collective after the loop would
                _wait_for(cfg["wait_file_after_pass"], timeout=cfg.get("wait_s", 60.0))
            if kept is not None:
                result["kept_intact"] = bool(np.array_equal(kept[2], payload_for(kept[0], kept[1], (64,))))
                kept = None
            if pipe.closed:
                break
        result["stats"] = pipe.stats().as_dict()
        if cfg["rank"] == 0:
            result["group_stats"] = pipe.group_stats().as_dict()
    except shmpipe.ShmpipeError as exc:
        result["error_at"] = time.time()
        result["error"] = [type(exc).__name__, str(exc)]
    except RuntimeError as exc:  # raise_at: the trainer's own error, out of its loop
        result["error"] = [type(exc).__name__, str(exc)]
    finally:
        if pipe is not None and not pipe.closed:
            t0 = time.monotonic()
            pipe.close()
            result["close_s"] = time.monotonic() - t0
        if cfg.get("touch_when_done"):
            _touch(cfg["touch_when_done"])
    pipe = batches = ds = kept = None
    gc.collect()
    result["ring_fds"] = sorted(ring_descriptors().values())
    with open("/proc/self/maps") as f:
        result["mapped"] = sum("memfd:shmpipe" in line for line in f)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
