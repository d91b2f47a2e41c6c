"""The fault suite: producers and consumers killed, stopped and failing at
random moments, over many cycles, with every delivered batch checked.

For every transport that runs producers here (shm, arrow; the queue
transport once a producer killed mid-message can no longer hang it, issue
11): each cycle runs a pipeline of varied batch sizes (some larger than a
slot), kills a producer at a random moment, and checks that every batch
delivered is whole (CRC of its bytes), that each worker's batches arrive
without a gap or a duplicate up to the failure, that the failure names the
right worker, and that nothing is left behind (processes, descriptors,
segments). SHMPIPE_SOAK_CYCLES sets the number of cycles (a long soak:
SHMPIPE_SOAK_CYCLES=500).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmpipe
from shmpipe.testing.memory import ring_descriptors
from shmpipe.testing.sources import Exiter, Killer, Raiser, Shapes, crc_of

CYCLES = int(os.environ.get("SHMPIPE_SOAK_CYCLES", "6"))
T = 30.0


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def check_batch(b, seen: dict[int, list[int]]) -> None:
    assert crc_of(b["x"]) == int(b["crc"]), f"a half-written batch: worker {b['worker']} seq {b['seq']}"
    seen.setdefault(int(b["worker"]), []).append(int(b["seq"]))


def check_no_gaps(seen: dict[int, list[int]]) -> None:
    for worker, seqs in seen.items():
        assert seqs == list(range(len(seqs))), f"worker {worker}: {seqs[:20]}... (a gap or a duplicate)"


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
@pytest.mark.parametrize("transport", ["shm", "arrow"])
def test_a_producer_sigkilled_at_a_random_moment(transport, ordered):
    rng = random.Random(f"{transport}-{ordered}")
    fds = ring_descriptors()
    for cycle in range(CYCLES):
        # mostly small batches, some larger than the slots the first one sized
        shapes = [(64,)] + [(rng.choice([64, 256, 4096, 40_000]),) for _ in range(400)]
        source = Shapes(shapes, np.float32, delay=0.0005)
        victim, kill_after = rng.randrange(3), rng.uniform(0.0, 0.25)
        seen: dict[int, list[int]] = {}
        pipe = shmpipe.from_iterators([source] * 3, transport=transport, ordered=ordered, capacity=8, timeout=T)
        pids = list(pipe.pids)
        t0 = time.monotonic()
        killed = False
        with pytest.raises(shmpipe.WorkerDiedError) as info:
            with pipe:
                for b in pipe:
                    check_batch(b, seen)
                    del b
                    if not killed and time.monotonic() - t0 >= kill_after:
                        os.kill(pids[victim], signal.SIGKILL)
                        killed = True
                if not killed:  # the whole pass went by first: kill now, and ask for more
                    os.kill(pids[victim], signal.SIGKILL)
                    for b in pipe:
                        check_batch(b, seen)
        assert info.value.worker_id == victim, f"cycle {cycle}: {info.value}"
        check_no_gaps(seen)
        assert pipe.closed and pipe.leftovers() == []
        deadline = time.monotonic() + 10
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(gone(p) for p in pids), f"cycle {cycle}: producers outlived close()"
        assert ring_descriptors() == fds, f"cycle {cycle}: a descriptor of ring memory stayed open"


@pytest.mark.parametrize("transport", ["shm", "arrow"])
@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: Exiter(5, code=3), shmpipe.WorkerDiedError),
        (lambda: Killer(5, signal.SIGSEGV), shmpipe.WorkerDiedError),
        (lambda: Raiser(5, only_worker=0), shmpipe.WorkerError),
        (lambda: Killer(5, signal.SIGSTOP), shmpipe.PipelineTimeoutError),
    ],
    ids=["os._exit", "SIGSEGV", "exception", "SIGSTOP"],
)
def test_a_producer_ending_in_every_way(transport, make, error):
    # Ordered, so a stopped worker 0 holds everyone up: only the timeout can tell.
    source = make()
    seen: dict[int, list[int]] = {}
    pipe = shmpipe.from_iterators([source] * 2, transport=transport, ordered=True, capacity=5, timeout=2.0)
    pids = list(pipe.pids)
    with pytest.raises(error):
        with pipe:
            for b in pipe:
                seen.setdefault(int(b["worker"]), []).append(int(b["seq"]))
    check_no_gaps(seen)
    assert seen.get(0, []) == list(range(5)), "what worker 0 published before it ended was lost"
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(gone(p) for p in pids), "a producer (a stopped one?) outlived close()"


CONSUMER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import shmpipe
    from shmpipe.testing.sources import Shapes

    if __name__ == "__main__":
        shapes = [(64,)] + [(n,) for n in [64, 4096, 40_000] * 300]
        with shmpipe.from_iterators([Shapes(shapes, np.float32, delay=0.001)] * 2,
                                    transport=sys.argv[1], capacity=6, timeout=30) as pipe:
            for b in pipe:
                pass
    """
)


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


@pytest.mark.parametrize("transport", ["shm", "arrow"])
def test_the_consumer_sigkilled_at_a_random_moment(tmp_path, transport):
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    rng = random.Random(transport)
    shm_before = set(os.listdir("/dev/shm"))
    for cycle in range(CYCLES):
        proc = subprocess.Popen(
            [sys.executable, str(script), transport],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # consumer, forkserver and producers share its process group
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        time.sleep(rng.uniform(0.0, 1.5))  # construction included: Python and shmpipe take ~0.5 s to start
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stderr.close()
        deadline = time.monotonic() + 10
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = group_members(proc.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"cycle {cycle}: processes outlived their consumer: {left}"
    assert set(os.listdir("/dev/shm")) == shm_before
