"""Several ranks fed by one pipeline: ``from_iterators(group=...)``.

Each rank is a real process (this file run as a script, one per rank, the
way torchrun starts them); rank 0 starts the producers. Each rank checks
every byte of what it receives, reports what it got as one JSON line, and
what it still holds of shared memory after close().
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest

import shmpipe
from shmpipe._options import check_options, group_capacity

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
#: Every rank (and so the whole test) ends within this, or the test fails.
RANK_TIMEOUT_S = 120


def _group() -> str:
    return f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _run_ranks(configs: list[dict[str, Any]], delays: list[float] | None = None) -> list[dict[str, Any]]:
    """Starts one process per config (after its delay, in the order given),
    waits for all, returns their reports in rank order."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    try:
        for i, cfg in enumerate(configs):
            if delays:
                time.sleep(delays[i])
            procs.append(
                (
                    cfg,
                    subprocess.Popen(
                        [sys.executable, HERE, json.dumps(cfg)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        env=env,
                        text=True,
                    ),
                )
            )
        reports = []
        for cfg, proc in procs:
            out, err = proc.communicate(timeout=RANK_TIMEOUT_S)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
            report.setdefault("rank", cfg["rank"])
            report["returncode"] = proc.returncode
            report["stderr"] = err[-3000:]
            reports.append(report)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return sorted(reports, key=lambda r: r["rank"])


def _configs(n: int, **common: Any) -> list[dict[str, Any]]:
    group = _group()
    return [{"group": group, "rank": r, "num_ranks": n, **common} for r in range(n)]


def _expected_order(sources: int, per_source: int) -> list[list[int]]:
    """An ordered pipeline's stream: worker 0's batch 0, worker 1's, ..."""
    return [[w, s] for s in range(per_source) for w in range(sources)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _assert_clean(report: dict[str, Any]) -> None:
    """The rank let go of everything shared (after close and its batches)."""
    assert report["ring_fds"] == [], report
    assert report["mapped"] == 0, report


# -- delivery ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_batch_goes_to_exactly_one_rank_and_every_rank_gets_the_same_number(n):
    sources, per_source, passes = 3, 7, 2
    reports = _run_ranks(_configs(n, sources=sources, per_source=per_source, passes=passes, ordered=True))
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        _assert_clean(r)
    total = sources * per_source
    stream = _expected_order(sources, per_source)
    for p in range(passes):
        got = [r["passes"][p] for r in reports]
        assert all(len(g) == total // n for g in got)  # equal counts
        seen = [tuple(b) for g in got for b in g]
        assert len(seen) == len(set(seen))  # disjoint
        assert len(seen) == total - total % n  # complete but for the remainder
        # ordered: batch k of the pass went to rank k % n, every pass
        for rank, g in enumerate(got):
            assert g == stream[rank : total - total % n : n]
    group = reports[0]["group_stats"]
    assert group["dropped_per_pass"] == [total % n] * passes
    assert group["batches_per_rank"] == [passes * (total // n)] * n
    for r in reports:
        assert r["stats"]["extra"]["dropped_remainder"] == passes * (total % n)
        assert r["stats"]["batches"] == passes * (total // n)
        assert r["stats"]["passes"] == passes


def test_unordered_delivery_is_disjoint_and_equal_with_arrow_and_big_batches():
    """Unordered, over the arrow transport, with batches larger than a slot
    (each in memory of its own, its descriptor sent to its rank)."""
    n = 2
    reports = _run_ranks(_configs(n, sources=2, per_source=9, passes=1, transport="arrow", grow=True))
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        _assert_clean(r)
    got = [tuple(b) for r in reports for b in r["passes"][0]]
    assert len(got) == len(set(got)) == 18
    assert len(reports[0]["passes"][0]) == len(reports[1]["passes"][0]) == 9
    assert sum(r["big"] for r in reports) > 0  # some did travel outside the ring


def test_a_slot_is_not_reused_while_a_rank_holds_its_batch_and_posix_backing_works():
    """Each rank keeps its first batch while 60 more pass through a ring of
    10 slots; it is intact at the end of the pass. The ring is a named
    segment here (backing="posix"), which ranks open by name."""
    configs = _configs(2, sources=2, per_source=60, passes=2, transport="shm-posix", keep_first=True)
    reports = _run_ranks(configs)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert [len(p) for p in r["passes"]] == [60, 60]
        assert r["kept_intact"] is True
        _assert_clean(r)


def test_ranks_may_start_in_any_order_and_late():
    configs = _configs(3, sources=2, per_source=6, passes=1, group_timeout=60)
    reports = _run_ranks(list(reversed(configs)), delays=[0.0, 2.0, 3.0])  # rank 2, then 1, then rank 0 3 s later
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert len(r["passes"][0]) == 4
        _assert_clean(r)


def test_a_rank_that_never_comes_is_named():
    configs = _configs(3, sources=1, per_source=4, passes=1, group_timeout=3)
    reports = _run_ranks(configs[:2])  # rank 2 never starts
    for r in reports:
        assert r["error"][0] == "GroupStartError", r
        assert "rank(s) 2 of 3 did not join" in r["error"][1]
        _assert_clean(r)
    assert _wait_gone(reports[0]["pids"]) == []


def test_a_rank_whose_rank_0_never_comes_says_so():
    configs = _configs(2, sources=1, per_source=4, passes=1, group_timeout=2)
    (report,) = _run_ranks(configs[1:])
    assert report["error"][0] == "GroupStartError", report
    assert "rank 0 did not start listening" in report["error"][1]


def test_ranks_that_disagree_on_the_arguments_do_not_start():
    configs = _configs(2, sources=2, per_source=4, passes=1, group_timeout=20)
    configs[1]["sources"] = 3
    reports = _run_ranks(configs)
    for r in reports:
        assert r["error"][0] == "GroupStartError", r
        assert "other arguments than rank 0" in r["error"][1]


def test_several_passes_stay_in_step_when_ranks_run_at_different_speeds():
    configs = _configs(2, sources=2, per_source=10, passes=3, ordered=True)
    configs[1]["step_s"] = 0.01  # rank 1 trains slower
    reports = _run_ranks(configs)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert [len(p) for p in r["passes"]] == [10, 10, 10]
        assert r["passes"][0] == r["passes"][1] == r["passes"][2]  # deterministic, every pass
        _assert_clean(r)


# -- faults ------------------------------------------------------------------------


def test_a_rank_killed_mid_pass_fails_the_others_quickly_and_its_slots_come_back():
    configs = _configs(3, sources=2, per_source=1000, passes=1, step_s=0.002)
    configs[1]["kill_at"] = [0, 5]
    reports = _run_ranks(configs)
    victim = reports[1]
    assert victim["returncode"] == -signal.SIGKILL
    for r in (reports[0], reports[2]):
        assert r["error"][0] == "RankDiedError", r
        assert "rank 1" in r["error"][1]
        assert r["error_at"] - victim["killed_at"] < 5.0, (r["error_at"] - victim["killed_at"])
        _assert_clean(r)
    # Rank 0 released what rank 1 held as soon as its connection ended.
    assert reports[0]["held_by_rank"]["1"] == 0
    assert _wait_gone(reports[0]["pids"]) == []


def test_rank_0_killed_fails_the_others_and_its_producers_exit():
    configs = _configs(3, sources=2, per_source=1000, passes=1, step_s=0.002)
    configs[0]["kill_at"] = [0, 5]
    reports = _run_ranks(configs)
    assert reports[0]["returncode"] == -signal.SIGKILL
    for r in reports[1:]:
        assert r["error"][0] == "RankDiedError", r
        assert "rank 0" in r["error"][1]
        assert r["error_at"] - reports[0]["killed_at"] < 5.0
        _assert_clean(r)  # the memory is gone from every rank
    assert _wait_gone(reports[0]["pids"]) == []  # the producers noticed their consumer died


def test_a_producer_failure_reaches_every_rank():
    reports = _run_ranks(_configs(3, sources=2, per_source=0, passes=1, raiser=True))
    for r in reports:
        assert r["error"][0] == "WorkerError", r
        assert "boom from the source" in r["error"][1]
        _assert_clean(r)
    assert _wait_gone(reports[0]["pids"]) == []


def test_a_rank_closing_mid_pass_fails_the_others():
    configs = _configs(2, sources=2, per_source=1000, passes=1, step_s=0.002)
    configs[1]["close_at"] = [0, 3]
    reports = _run_ranks(configs)
    assert reports[1]["error"] is None
    assert reports[0]["error"][0] == "RankDiedError"
    assert "closed its pipeline in the middle of pass 0" in reports[0]["error"][1]


# -- frameworks --------------------------------------------------------------------


def test_to_torch_in_each_rank():
    pytest.importorskip("torch")
    reports = _run_ranks(_configs(2, sources=2, per_source=6, passes=1, adapter="torch"))
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert len(r["passes"][0]) == 6
        assert r["zero_copy"] is True
        _assert_clean(r)


def test_to_tf_dataset_in_a_rank():
    pytest.importorskip("tensorflow")
    configs = _configs(2, sources=2, per_source=6, passes=2)
    configs[1]["adapter"] = "tf"
    reports = _run_ranks(configs)
    for r in reports:
        assert r["returncode"] == 0 and r["error"] is None, r
        assert [len(p) for p in r["passes"]] == [6, 6]
    assert {tuple(b) for r in reports for b in r["passes"][0]} == {(w, s) for w in range(2) for s in range(6)}


def test_the_ddp_example_trains_under_torchrun(tmp_path):
    """examples/ddp_train.py: DistributedDataParallel (gloo, CPU) on 2 ranks
    under torchrun, fed by one pipeline of 3 producers: 15 batches an epoch,
    7 to each rank, 1 dropped; the ranks' weights stay identical."""
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(ROOT, "examples", "ddp_train.py"), "--workers", "3", "--epochs", "3", "--batches", "5"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = dict(re.findall(r"rank (\d): 21 batches in 3 epochs, .* weights checksum (\S+)", out.stdout))
    assert set(ranks) == {"0", "1"}, out.stdout
    assert ranks["0"] == ranks["1"]  # DDP kept the replicas in step
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < first, out.stdout
    assert "batches per rank [21, 21], remainder dropped 3, producer processes 3" in out.stdout


def test_bench_ranks_runs_and_writes_json(tmp_path):
    out_json = tmp_path / "ranks.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-m", "shmpipe", "bench", "ranks", "--ranks", "2", "--batches", "12", "--size", "64KiB",
         "--work-ms", "0", "--setups", "shared pool", "pipeline per rank", "--json", str(out_json)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = {r["setup"]: r for r in json.loads(out_json.read_text())["results"]}
    shared, own = results["shared pool"], results["pipeline per rank"]
    assert shared["batches_per_rank"] == own["batches_per_rank"] == [12, 12]
    assert (shared["producer_processes"], own["producer_processes"]) == (2, 4)
    assert (shared["processes_started"], own["processes_started"]) == (4, 6)
    assert shared["cpu_s"] > 0 and shared["pss_bytes"] > 0
    assert "| shared pool | 2 | 4 | 12 |" in out.stdout


# -- arguments (no process starts) -------------------------------------------------


def _check(**kw: Any) -> Any:
    from shmpipe.testing.sources import Counter

    args = dict(transport="shm", capacity=None, ordered=False, start_method=None, timeout=None, slot_size=None, seed=1)
    args.update(kw)
    return check_options([Counter(1)] * 2, **args)


def test_arguments_are_checked_before_anything_starts(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(shmpipe.ShmpipeValueError, match="LOCAL_RANK"):
        _check(group="g")
    with pytest.raises(shmpipe.ShmpipeValueError, match="need group="):
        _check(rank=0, num_ranks=2)
    with pytest.raises(shmpipe.ShmpipeValueError, match="rank must be"):
        _check(group="g", rank=2, num_ranks=2)
    with pytest.raises(shmpipe.ShmpipeValueError, match="group must be"):
        _check(group="a b", rank=0, num_ranks=2)
    with pytest.raises(shmpipe.ShmpipeValueError, match="capacity >= "):
        _check(group="g", rank=0, num_ranks=4, capacity=5)
    with pytest.raises(shmpipe.ShmpipeValueError, match="cannot feed several ranks"):
        _check(group="g", rank=0, num_ranks=2, transport="queue")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    options = _check(group="g")
    assert (options.rank, options.num_ranks) == (1, 3)
    assert options.capacity >= group_capacity(2, 3, False)


def test_capabilities_say_which_transports_serve_ranks():
    assert shmpipe.get_transport("shm").capabilities.serves_ranks
    assert shmpipe.get_transport("arrow").capabilities.serves_ranks
    assert not shmpipe.get_transport("queue").capabilities.serves_ranks


# -- one rank (this file run as a script) ------------------------------------------------


def _rank_main(cfg: dict[str, Any]) -> None:
    import gc

    import numpy as np

    from shmpipe.testing.memory import ring_descriptors
    from shmpipe.testing.sources import Counter, Raiser, Shapes, crc_of, fill_pattern, payload_for

    result: dict[str, Any] = {"rank": cfg["rank"], "passes": [], "error": None, "big": 0, "pids": []}
    n = cfg["sources"]
    if cfg.get("raiser"):
        sources: list[Any] = [Raiser(after=3, only_worker=1)] * n
    elif cfg.get("grow"):
        # The first batch sizes the slot; later ones are up to 4x larger.
        sources = [Shapes([(1024 * (1 + (i % 4)),) for i in range(cfg["per_source"])])] * n
    else:
        sources = [Counter(cfg["per_source"], (64,))] * n

    def check(b: Any) -> tuple[int, int]:
        """Checks one batch; returns (worker, seq). A function, so that no
        array of the batch outlives the check in a local."""
        if adapter == "tf":
            b = {k: v.numpy() for k, v in b.items()}
        w, s = int(b["worker"]), int(b["seq"])
        if "x" in b:
            x = b["x"]
            expected = np.empty(x.shape, x.dtype)
            fill_pattern(expected, w, s)
            assert crc_of(x) == int(b["crc"]) and x.tobytes() == expected.tobytes()
            # The first batch (4 KiB) sized the slot (12 KiB): these did not fit.
            result["big"] += x.nbytes >= 12288
        elif "data" in b:
            data = b["data"]
            if adapter == "torch":
                assert isinstance(data, torch.Tensor)
                owner = pipe.channel
                lo, size = owner.memory_ranges()[0]
                result["zero_copy"] = lo <= data.data_ptr() < lo + size
                data = data.numpy()
            elif adapter is None:
                assert not data.flags.writeable
                try:
                    data.flags.writeable = True
                    raise AssertionError("a rank's batch could be made writeable")
                except ValueError:
                    pass
            assert np.array_equal(data, payload_for(w, s, (64,)))
        return w, s

    pipe = batches = ds = kept = None
    try:
        transport: Any = cfg.get("transport", "shm")
        if transport == "shm-posix":
            from shmpipe.transports.shm import ShmTransport

            transport = ShmTransport(backing="posix")
        pipe = shmpipe.from_iterators(
            sources,
            transport=transport,
            ordered=cfg.get("ordered", False),
            timeout=60,
            group=cfg["group"],
            rank=cfg["rank"],
            num_ranks=cfg["num_ranks"],
            group_timeout=cfg.get("group_timeout", 30),
        )
        result["pids"] = pipe.pids
        adapter = cfg.get("adapter")
        for p in range(cfg["passes"]):
            got: list[list[int]] = []
            if adapter == "torch":
                import torch

                batches = pipe.to_torch()
            elif adapter == "tf" and p == 0:
                ds = pipe.to_tf_dataset()
            for b in batches if adapter == "torch" else ds if adapter == "tf" else pipe:
                w, s = check(b)
                got.append([w, s])
                if cfg.get("keep_first") and kept is None:
                    kept = (w, s, b["data"])  # its slot must not be reused while this lives
                del b
                if cfg.get("kill_at") == [p, len(got)]:
                    result["killed_at"] = time.time()
                    print(json.dumps(result), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if cfg.get("close_at") == [p, len(got)]:
                    pipe.close()
                    break
                if cfg.get("step_s"):
                    time.sleep(cfg["step_s"])
            result["passes"].append(got)
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
        if pipe is not None and pipe._leader is not None:
            result["held_by_rank"] = {str(r): len(link.held) for r, link in pipe._leader.links.items()}
    finally:
        if pipe is not None:
            pipe.close()
    pipe = batches = ds = kept = None
    gc.collect()
    result["ring_fds"] = sorted(ring_descriptors().values())
    with open("/proc/self/maps") as f:
        result["mapped"] = sum("memfd:shmpipe" in line for line in f)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
