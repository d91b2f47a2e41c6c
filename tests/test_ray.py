"""The Ray transport beyond the conformance suite: a local Ray started and
stopped on demand, and producers placed on another node of a (simulated)
two-node cluster."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import ray
from conftest import OWN_RAY, Command, SharedRuns, ray_friendly_cwd
from ray.cluster_utils import Cluster

import shmpipe
from shmpipe.testing.datasets import Numbered, OnRayNode
from shmpipe.testing.sources import NodeReporter, payload_for
from shmpipe.transports.ray import RayTransport

#: A script that makes a pipeline over Ray, as a user's would: not under Ray
#: (the pipeline starts a local one and stops it on close), and next to a
#: decoy source checkout of shmpipe that cannot be imported (Ray puts the
#: directory ray.init() runs in on its workers' sys.path, so the pipeline must
#: start Ray elsewhere for the actors to find the real one). One process
#: checks both (a local Ray takes seconds to start); each test reads its part.
ON_DEMAND = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    sys.path.remove(sys.path[0])  # like an installed program: ./ is not on the path
    import ray, shmpipe
    from shmpipe.testing.datasets import Numbered
    from shmpipe.testing.sources import Counter
    if __name__ == "__main__":
        # Ray takes seconds to start: the script starts three (two the
        # pipelines', one the program's), each checked for all it can show.
        assert not ray.is_initialized()
        # The Ray a pipeline started is the pipelines': closing the one that
        # started it leaves it to the others, the last stops it (it stopped
        # under the second, whose next call into Ray started a new one and
        # aborted the process, helper 94).
        out = {}
        a = shmpipe.from_iterators([Counter(3)] * 2, transport="ray", slot_size=1 << 20, timeout=120)
        b = shmpipe.from_iterators([Counter(50)], transport="ray", timeout=120)
        taking = iter(b)
        next(taking)
        out["n"] = sum(1 for _ in a)
        out["up"] = ray.is_initialized()
        out["store"] = int(ray.cluster_resources()["object_store_memory"])
        a.close()
        out["up_after_first_close"] = ray.is_initialized()
        out["rest_of_second"] = sum(1 for _ in taking)
        b.close()
        out["up_after_last_close"] = ray.is_initialized()
        # The program stops Ray under a pipeline: its next batch says so, and
        # starts no Ray.
        c = shmpipe.from_iterators([Counter(50)], transport="ray", timeout=120)
        taking = iter(c)
        next(taking)
        ray.shutdown()
        try:
            next(taking)
        except shmpipe.PipelineClosedError as exc:
            out["after_shutdown"] = str(exc)
        out["started_again"] = ray.is_initialized()
        # ... and a Ray the program started again meanwhile is its own: the
        # pipeline's close leaves it up.
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        c.close()
        out["programs_ray_up"] = ray.is_initialized()
        print(json.dumps(out), flush=True)

        # A Ctrl-C while Ray (the program's) cannot place the producers ends
        # the wait (it waited out Ray's 120 s to start them, helper 94).
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t = time.monotonic()
        try:
            shmpipe.from_dataset(Numbered(8), batch_size=4, transport="ray", timeout=120,
                                 ray_remote_args={"resources": {"no_such_node": 1}})
        except KeyboardInterrupt:
            print(json.dumps({"ctrl_c_ended_it_after_s": time.monotonic() - t, "programs_ray_up": ray.is_initialized()}))
        ray.shutdown()
    """
)


def _on_demand(folder):
    (folder / "shmpipe").mkdir()
    (folder / "shmpipe" / "__init__.py").write_text("raise ImportError('the decoy checkout was imported')\n")
    (folder / "run.py").write_text(ON_DEMAND)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **OWN_RAY}
    return Command([sys.executable, str(folder / "run.py")], cwd=folder, env=env, exclusive="ray", seconds=20)


#: In the background from the session's start (conftest.BackgroundRuns), its
#: Ray its own beside the tests' (OWN_RAY).
RUN = SharedRuns(
    {"test_a_local_ray_is_started_for_the_pipeline_and_stopped_on_close", "test_a_pipeline_started_next_to_a_source_checkout",
     "test_the_ray_a_pipeline_started_is_stopped_by_the_last_pipeline_on_it_and_never_the_programs"},
    keys=lambda item: ["on demand"], command=lambda key, folder: _on_demand(folder), background=True,
)


def _on_demand_results(request) -> tuple[dict, dict]:
    out, _ = RUN.get(request, "on demand")
    assert out.returncode == 0, out.stderr[-3000:]
    # (Ray's autoscaler may print a line of its own: the script's are JSON objects)
    got, pressed = (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))
    return got, pressed


def test_a_local_ray_is_started_for_the_pipeline_and_stopped_on_close(request):
    got, _ = _on_demand_results(request)
    assert got["n"] == 6 and got["up"] and not got["up_after_last_close"], got
    # sized for the pipeline that started it: max(256 MiB, 3 x capacity x slot_size) = 256 MiB here
    assert abs(got["store"] - (256 << 20)) < (16 << 20), got


def test_a_pipeline_started_next_to_a_source_checkout(request):
    # ./shmpipe there is the decoy: had the actors imported it, no batch
    # would have come.
    got, _ = _on_demand_results(request)
    assert got["n"] == 6 and got["rest_of_second"] == 49, got


def test_the_ray_a_pipeline_started_is_stopped_by_the_last_pipeline_on_it_and_never_the_programs(request):
    got, pressed = _on_demand_results(request)
    assert got["up_after_first_close"] and got["rest_of_second"] == 49 and not got["up_after_last_close"], got
    assert "Ray was shut down under this pipeline" in got["after_shutdown"] and not got["started_again"], got
    assert got["programs_ray_up"], got
    assert pressed["ctrl_c_ended_it_after_s"] < 30 and pressed["programs_ray_up"], pressed


def test_ray_remote_args_are_for_ray_alone():
    up = ray.is_initialized()  # (the cluster of the tests below, where one of them ran first)
    with pytest.raises(shmpipe.ShmpipeValueError, match="ray_remote_args= places the producers of transport='ray'"):
        shmpipe.from_dataset(Numbered(8), ray_remote_args={"num_cpus": 1})
    with pytest.raises(shmpipe.ShmpipeValueError, match="ray_remote_args must be a dict"):
        shmpipe.from_dataset(Numbered(8), transport="ray", ray_remote_args=[("num_cpus", 1)])
    for args, match in [
        ({"max_concurrency": 4}, "may not set max_concurrency: shmpipe sets it"),
        ({"name": "x", "num_cpus": 1}, "may not set name: shmpipe sets it"),
        ({"foo": 1}, "holds an option Ray refuses: Invalid option keyword foo"),
        ({"num_cpus": "two"}, "holds an option Ray refuses: The type of keyword 'num_cpus'"),
        ({"num_cpus": -1}, "holds an option Ray refuses: .*cannot be negative"),
        # (these Ray took, and refused only at the actor's start, after the
        # pipeline started Ray: raw OverflowError, AttributeError,
        # ValueError and AssertionError, helper 94)
        ({"num_cpus": float("inf")}, "holds an option Ray refuses: cannot convert float infinity"),
        ({"resources": {1: 1}}, "holds an option Ray refuses: resources are named by strings"),
        ({"scheduling_strategy": "NOPE"}, "holds an option Ray refuses: scheduling_strategy 'NOPE' is none of"),
        ({"placement_group": "x"}, "holds an option Ray refuses: placement_group is a PlacementGroup"),
    ]:
        with pytest.raises(shmpipe.ShmpipeValueError, match=f"ray_remote_args {match}"):
            shmpipe.from_dataset(Numbered(8), transport="ray", ray_remote_args=args)
    assert ray.is_initialized() == up, "refused before Ray starts"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A (simulated) cluster of two nodes, this process its driver: a head
    of one CPU, and a node whose resource "producers" places producers
    there. One for the tests below (such a cluster takes seconds to start),
    which come last in the module: the last of them changes its nodes.
    (cluster, the first node)."""
    if ray.is_initialized():
        ray.shutdown()
    with ray_friendly_cwd(tmp_path_factory.mktemp("cluster")):
        made = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": 120 << 20, "include_dashboard": False},
        )
        try:
            first = made.add_node(num_cpus=2, resources={"producers": 2}, object_store_memory=120 << 20)
            ray.init(address=made.address)
            made.wait_for_nodes()
            yield made, first
        finally:
            ray.shutdown()
            made.shutdown()


def test_producers_run_on_the_second_node_of_a_cluster(cluster):
    _, first = cluster
    head = ray.get_runtime_context().get_node_id()
    (second,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "producers" in n["Resources"]]
    assert second != head
    transport = RayTransport(actor_options={"num_cpus": 1, "resources": {"producers": 1}})
    shape = (64, 1024)  # 256 KiB: travels through the object store, not inline
    with shmpipe.from_iterators([NodeReporter(5, shape)] * 2, transport=transport, timeout=120) as pipe:
        seen = []
        for b in pipe:
            assert b["node"] == second, "a producer ran on the head node"
            np.testing.assert_array_equal(b["data"], payload_for(b["worker"], b["seq"], shape))
            seen.append((b["worker"], b["seq"]))
        assert ray.is_initialized()  # a cluster shmpipe did not start stays up
    assert sorted(seen) == [(w, s) for w in range(2) for s in range(5)]
    assert pipe.leftovers() == []


def _ids(pipe) -> list[list[int]]:
    return [b["i"].tolist() for b in pipe]


def test_a_producer_node_that_disappears_is_a_restart_and_the_epoch_is_the_same(cluster, monkeypatch):
    """Producers placed by ray_remote_args on a node of a (simulated)
    cluster; mid-epoch a second node joins and the first is removed, with
    the producers' actors on it (their batches of 128 KiB in its object
    store, not inline): max_restarts replaces them on the new node, and
    the epoch is the one a run without the loss delivers, in order."""
    kw = dict(batch_size=4, shuffle=True, seed=9, num_workers=2, timeout=120, num_nodes=1)
    with shmpipe.from_dataset(Numbered(60), **kw) as pipe:
        reference = _ids(pipe)
    cluster, first = cluster
    ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    got, nodes = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with shmpipe.from_dataset(
            OnRayNode(60, delay=0.01, payload=32 << 10), transport="ray", max_restarts=2,
            ray_remote_args={"num_cpus": 1, "resources": {"producers": 1}}, **kw,
        ) as pipe:
            for b in pipe:
                got.append(b["i"].tolist())
                nodes.append(b["node"][0])
                assert (b["pixels"] == (b["i"] % 251)[:, None]).all()
                if len(got) == 3:
                    cluster.add_node(num_cpus=2, resources={"producers": 2}, object_store_memory=100 << 20)
                    cluster.wait_for_nodes()
                    cluster.remove_node(first)
                del b
            restarts = pipe.stats().restarts
        assert pipe.leftovers() == []
    (second,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - ids
    assert got == reference
    assert set(nodes[:3]) == ids - {ray.get_runtime_context().get_node_id()}, "first on the first node"
    assert nodes[-1] == second, "the replacements run on the node that joined"
    assert restarts == (1, 1)
    assert sum("replaced" in str(w.message) for w in caught) == 2
    # A producer whose part of the pass was made whole before its node
    # left: its batches were lost with the node's store (Ray cannot
    # make an actor's streamed objects again), and are made again by
    # the replacement (on 9964b77: Ray's raw ObjectReconstructionFailedError).
    one = dict(kw, num_workers=1)
    with shmpipe.from_dataset(Numbered(12), **one) as pipe:
        small = _ids(pipe)
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with shmpipe.from_dataset(
            OnRayNode(12, payload=32 << 10), transport="ray", max_restarts=1,
            ray_remote_args={"num_cpus": 1, "resources": {"producers": 1}}, **one,
        ) as pipe:
            for b in pipe:
                got.append(b["i"].tolist())
                if len(got) == 1:
                    time.sleep(1)  # its other batches made, in its node's store
                    third = cluster.add_node(num_cpus=2, resources={"producers": 2}, object_store_memory=100 << 20)
                    cluster.wait_for_nodes()
                    cluster.remove_node(next(n for n in cluster.worker_nodes if n is not third))
                del b
            assert pipe.stats().restarts == (1,)
    assert got == small
    assert any("a batch it made was lost" in str(w.message) for w in caught), "not the loss of a batch"
    # Without max_restarts, a dead actor is the WorkerDiedError, after
    # the batches before it, in order.
    got = []
    with pytest.raises(shmpipe.WorkerDiedError, match="its Ray actor died"):
        with shmpipe.from_dataset(
            OnRayNode(60, delay=0.01), transport="ray", ray_remote_args={"resources": {"producers": 1}}, **kw
        ) as pipe:
            for b in pipe:
                got.append(b["i"].tolist())
                if len(got) == 3:
                    os.kill(pipe.pids[1], signal.SIGKILL)
    assert 3 <= len(got) < len(reference) and got == reference[: len(got)]
    # A close() from another thread while the consumer replaces a dead
    # actor (started as the old one is killed, inside restart): the
    # consumer's PipelineClosedError, and the new actor ends with the
    # rest (on 9964b77: an IndexError, and the new actor left running).
    kill, closers = ray.kill, []

    def kill_and_close(actor, **kwargs):
        if not closers:
            closers.append(threading.Thread(target=pipe.close))
            closers[0].start()
        return kill(actor, **kwargs)

    got = []
    with pytest.raises(shmpipe.PipelineClosedError, match="is not replaced|not sent its pass"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a replacement that came first would say so)
        with shmpipe.from_dataset(
            OnRayNode(60, delay=0.01), transport="ray", max_restarts=1,
            ray_remote_args={"resources": {"producers": 1}}, **kw,
        ) as pipe:
            for b in pipe:
                got.append(b["i"].tolist())
                if len(got) == 3:
                    monkeypatch.setattr(ray, "kill", kill_and_close)
                    os.kill(pipe.pids[1], signal.SIGKILL)
    closers[0].join(timeout=60)
    assert got == reference[: len(got)]
    assert pipe.leftovers() == []
