"""The benchmarks' code paths at a tiny size (never their timings)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import Command, SharedRuns

from shmpipe.bench import throughput, train

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_every_path_runs():
    results = throughput.run([4096, 65536], seconds=0.05, min_batches=3, paths=throughput.PATHS)
    assert [(r.path, r.nbytes) for r in results] == [
        (p, n) for n in (4096, 65536) for p in throughput.PATHS
    ]
    for r in results:
        assert r.batches >= 3 and r.seconds > 0 and r.gb_per_s > 0
    text = throughput.table(results)
    assert text.count("\n") == 2 + len(results) - 1
    assert "| 64 KiB | shm reserve |" in text


def test_throughput_runs_paths_in_rounds_and_keeps_the_median_run():
    seen = []
    results = throughput.run(
        [65536], seconds=0.05, min_batches=3, paths=["memcpy", "shm varying", throughput.MIXED_IN_SLOTS],
        repeat=3, progress=lambda path, nbytes: seen.append(path),
    )
    # every path once, then every path again: a slow spell hits one run of each
    assert seen == ["memcpy", "shm varying", throughput.MIXED_IN_SLOTS] * 3
    for r in results:
        assert len(r.runs_per_s) == 3
        assert sorted(r.runs_per_s)[1] == r.batches_per_s  # the median run is the one reported
    assert "| 64 KiB | shm mixed in slots |" in throughput.table(results)


def test_varying_is_checked_against_the_ring_and_the_same_batches_in_slots():
    R = throughput.Result
    results = [
        R("shm ring", 8 * 2**20, 3000, 1.0, 0.03),
        R("shm varying", 8 * 2**20, 2000, 1.0, 0.03),  # 0.67x the ring: not met
        R(throughput.MIXED_IN_SLOTS, 8 * 2**20, 1800, 1.0, 0.03),  # but faster than the same batches in slots
    ]
    got = {name: met for name, met, _ in throughput.targets(results)}
    assert got == {
        "8 MiB: shm varying >= 0.8 x shm ring": False,
        "8 MiB: shm varying trainer CPU per batch <= 2 x shm ring's": True,
        "8 MiB: shm varying >= 0.8 x shm mixed in slots (the same batches)": True,
    }


def test_targets_are_checked_from_results():
    R = throughput.Result
    results = [
        R("memcpy", 48_000_000, 10, 1.0, 0.1),
        R("shm ring", 48_000_000, 4, 1.0, 0.1),  # 0.4x memcpy: not met
        R("shm ring", 65536, 200_000, 1.0, 0.1),
        R("mp.Queue", 65536, 10_000, 1.0, 0.1),
        R("shm reserve", 65536, 100_000, 1.0, 0.1),
        R("shm reserve", 48_000_000, 90_000, 1.0, 0.1),
    ]
    checks = [met for _, met, _ in throughput.targets(results)]
    # ring 48 MB, ring 64 KiB >= 150k, vs mp.Queue, reserve flat, ring 64 KiB >= 300k, reserve <= 5 us
    assert checks == [False, True, True, True, False, False]
    results[2] = R("shm ring", 65536, 300_000, 1.0, 0.1)
    results[4] = R("shm reserve", 65536, 200_000, 1.0, 0.1)
    results[5] = R("shm reserve", 48_000_000, 250_000, 1.0, 0.1)
    assert [met for _, met, _ in throughput.targets(results)] == [False, True, True, True, True, True]


# -- the scripts and CLI runs of these tests: independent processes (most
#    import torch or TensorFlow), run in the background from the session's
#    start (SharedRuns, conftest.BackgroundRuns); each test checks its own. --------

#: bench train's recipes in three runs, one per trainer, side by side.
TRAIN_GROUPS = {trainer: [name for name in train.RECIPES if name.startswith(trainer + ":")]
                for trainer in ("keras", "torch", "jax")}


def _command(key, folder):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if key == "throughput script":
        return Command(
            [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--sizes", "8192", "--seconds", "0.05",
             "--min-batches", "2", "--paths", *throughput.PATHS, "--json", str(folder / "t.json")],
            cwd=folder, timeout=120,
        )
    if key == "gpu_feed":
        return Command([sys.executable, str(ROOT / "benchmarks" / "gpu_feed.py"), "--mib", "1", "--batches", "2"],
                       cwd=folder, timeout=120)
    if key == "rank death":
        return Command([sys.executable, str(ROOT / "benchmarks" / "rank_death.py"), "--trials", "2", "--victim", "0",
                        "--json", str(folder / "death.json")], cwd=folder, env=env, timeout=120, seconds=3)
    if key == "resume":
        return Command(
            [sys.executable, "-m", "shmpipe", "bench", "resume", "--images", "40", "--side", "16", "--batch-size", "8",
             "--workers", "1", "--repeat", "1", "--at", "0.5", "--timeout", "60",
             "--json", str(folder / "resume.json"), "--plot", str(folder / "resume.png")],
            cwd=folder, env=env, timeout=300, seconds=40,
        )
    if key == "nodes":
        return Command(
            [sys.executable, "-m", "shmpipe", "bench", "nodes", *TINY_NODES, "--json", str(folder / "nodes.json"),
             "--plot", str(folder / "nodes.png")],
            cwd=folder, env=env, timeout=180, seconds=25,
        )
    _, trainer = key
    env = None
    if trainer == "jax":
        # Each JAX recipe (a new process) compiles the same model: its
        # initialisation (jax.random.normal, a compile per shape) and its
        # step, 9 of its 12 s of CPU. JAX's persistent compilation cache,
        # in this run's folder, gives the second and third recipes the
        # first's executables (the recipes run one at a time: no two write
        # it at once). What the test checks, every recipe's figures, is the
        # same either way; `bench train` itself leaves JAX's cache as the
        # user set it.
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(folder / "jax-cache"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return Command(
        [sys.executable, "-m", "shmpipe", "bench", "train", "--images", "48", "--batch-size", "16",
         "--distinct", "4", "--crop", "24", "--sides", "32,48", "--reference-steps", "2", "--timeout", "300",
         "--recipes", *TRAIN_GROUPS[trainer], "--json", str(folder / "train.json"), "--plot", str(folder / "train.png")],
        cwd=folder, env=env, timeout=840, seconds=8 * len(TRAIN_GROUPS[trainer]),  # a new process per recipe
    )


#: bench nodes at a tiny size: 48 JPEGs of 16x16 in 12 batches, one layout of
#: two nodes, and its state resumed by a job of one node of two ranks (whose
#: fresh job the resume section times too): each rank of each loader is a new
#: process that imports torch, so every layout more is four more of them.
TINY_NODES = ["--layouts", "2x1", "--images", "48", "--side", "16", "--batch-size", "4", "--workers", "2",
              "--repeat", "1", "--resume", "2x1", "1x2", "--timeout", "60"]

RUNS = SharedRuns(
    {"test_throughput_script_writes_json", "test_gpu_feed_says_what_it_did_not_measure",
     "test_rank_death_script_times_each_survivors_error_and_leaves_nothing",
     "test_bench_train_runs_every_recipe_and_its_figures_are_sane",
     "test_bench_resume_measures_every_loader_and_checks_the_resumed_epochs",
     "test_bench_nodes_runs_every_layout_and_its_checks_pass"},
    keys=lambda item: {
        "test_throughput_script_writes_json": ["throughput script"],
        "test_gpu_feed_says_what_it_did_not_measure": ["gpu_feed"],
        "test_rank_death_script_times_each_survivors_error_and_leaves_nothing": ["rank death"],
        "test_bench_train_runs_every_recipe_and_its_figures_are_sane": [("train", t) for t in TRAIN_GROUPS],
        "test_bench_resume_measures_every_loader_and_checks_the_resumed_epochs": ["resume"],
        "test_bench_nodes_runs_every_layout_and_its_checks_pass": ["nodes"],
    }[item.originalname],
    command=_command,
    background=True,  # from the session's start, beside the other tests (conftest.BackgroundRuns)
)
#: A test of RUNS may wait for the background's scripts (bench train's take
#: the longest: up to 840 s).
SHARED_TIMEOUT = pytest.mark.timeout(900)


@SHARED_TIMEOUT
def test_throughput_script_writes_json(request):
    proc, folder = RUNS.get(request, "throughput script")
    assert proc.returncode == 0, proc.stderr
    assert "| 8 KiB | shm ring |" in proc.stdout
    data = json.loads((folder / "t.json").read_text())
    assert {r["path"] for r in data["results"]} == set(throughput.PATHS)


@SHARED_TIMEOUT
def test_gpu_feed_says_what_it_did_not_measure(request):
    # No GPU in CI: the script must say so and succeed, measuring nothing.
    proc, _ = RUNS.get(request, "gpu_feed")
    assert proc.returncode == 0, proc.stderr
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        assert "not measured" in proc.stdout
    else:
        assert "host-to-device GB/s" in proc.stdout


@SHARED_TIMEOUT
def test_rank_death_script_times_each_survivors_error_and_leaves_nothing(request):
    proc, folder = RUNS.get(request, "rank death")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((folder / "death.json").read_text())
    assert data["summary"] == {**data["summary"], "samples": 2, "failed_or_left": 0}, data["summary"]
    for trial in data["trials"]:
        assert trial["errors"]["1"][0] == "RankDiedError" and "rank 0" in trial["errors"]["1"][1], trial
        assert trial["latencies_ms"]["1"] > 0 and trial["left"] == [] and trial["failed"] is None, trial
    assert "2 of 2 trials clean" in proc.stdout


def test_gpu_feed_slot_safety_check_runs_on_the_host():
    # The GPU check's own code, with host tensors instead of copies (no
    # CUDA here): every stamp must survive, as it must on the GPU.
    torch = pytest.importorskip("torch")
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_feed", ROOT / "benchmarks" / "gpu_feed.py")
    gpu_feed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_feed)
    out = gpu_feed.check_slot_safety(torch, argparse.Namespace(batches=6), gated=True, device="cpu")
    assert out == {"batches": 12, "changed": 0, "waits_for_copy_events": True}


def test_bench_train_feeds_every_recipe_the_same_images():
    # Every recipe's loader draws image k's crop and flip from k, so the
    # batches a producer makes (copied or reserved) are the samples a
    # DataLoader or tf.data would stack.
    from shmpipe.bench import train

    cfg = train.TrainConfig(images=20, batch_size=8, distinct=3, crop=16, min_side=20, max_side=40)
    images = train.Images(train.make_jpegs(cfg), cfg)
    assert len(images.jpegs) == 3 and all(j[:2] == b"\xff\xd8" for j in images.jpegs)
    batch, labels = images.batch(2)  # the last, short batch
    assert batch.shape == (4, 16, 16, 3) and batch.dtype == np.float32
    for i, k in enumerate(range(16, 20)):
        sample, label = images[k]
        np.testing.assert_array_equal(batch[i], sample)
        assert labels[i] == label == k % 10
    assert abs(float(batch.mean())) < 3 and float(batch.std()) > 0.1  # normalised, not blank
    with pytest.raises(IndexError):
        images[20]


@SHARED_TIMEOUT
def test_bench_train_runs_every_recipe_and_its_figures_are_sane(request):
    # Every recipe, in three runs, two at a time: the Keras recipes (and
    # their baseline) in one, the torch recipes in another, the JAX recipes
    # (Grain, tf.data and shmpipe's to_jax into one jitted step) in the third.
    from shmpipe.bench import train

    results = {}
    for trainer in TRAIN_GROUPS:
        proc, folder = RUNS.get(request, ("train", trainer))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        data = json.loads((folder / "train.json").read_text())
        assert data["benchmark"] == "train" and data["config"]["images"] == 48
        got = {r["recipe"]: r for r in data["results"]}
        assert list(got) == TRAIN_GROUPS[trainer]
        results.update(got)
        for name in got:
            assert f"| {name.split(':')[0]} | {name.split(':')[1]} |" in proc.stdout
        assert (folder / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(results) == list(train.RECIPES)
    for name, r in results.items():
        assert r["skipped"] is None and r["error"] is None, (name, r)
        # Every image requested, counted by the trainer. (Grain batches within
        # each of its 2 workers: 24 images each, in batches of 16 and 8.)
        assert r["images"] == 48 and r["steps"] == (4 if name == "jax:Grain" else 3), (name, r)
        assert 0 <= r["idle_fraction"] <= 1 and 0 <= r["idle_estimated"] <= 1, (name, r)
        # a torch or JAX loop times its next(); model.fit does not say
        assert r["idle_method"] == ("estimated" if name.startswith("keras:") else "measured")
        assert r["images_per_s"] > 0 and r["window_s"] > 0 and r["first_step_s"] > 0 and r["reference_step_s"] > 0
        # The first step from the trainer's start has the framework's import and the model in it too.
        assert r["from_start_s"] > r["first_step_s"], (name, r)
        # CPU of every process of the recipe, from building the input pipeline on.
        assert 0 < r["cpu_s"] < 300 and r["cpu_s_per_image"] == pytest.approx(r["cpu_s"] / 48)
        assert r["peak_pss_bytes"] > 20 << 20 and r["trainer_peak_rss_bytes"] > 20 << 20
        # The trainer was seen. (Its producers or workers too, in a run of
        # any length; in this tiny one the DataLoader's workers can come and
        # go between two 0.2 s samples.)
        assert r["processes"] >= (3 if ":shmpipe" in name else 1), (name, r)
        if name == "jax:shmpipe":  # the wait split: the batches its trainer made at start, the producers' after
            assert 0 <= r["made_by_trainer"] <= 3 and 0 <= r["idle_producers"] <= r["idle_fraction"], r
        # Every run's figures (one run here), the median run's among them.
        assert r["runs_images_per_s"] == [r["images_per_s"]] and r["runs_idle_fraction"] == [r["idle_fraction"]], r
        assert r["runs_made_by_trainer"] == [r["made_by_trainer"]], r


def test_bench_train_help_gives_every_default_and_bad_sizes_are_refused(capsys):
    from shmpipe.__main__ import main
    from shmpipe.bench import train

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "train", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    cfg = train.TrainConfig()
    for option, default in [
        ("--images", cfg.images), ("--batch-size", cfg.batch_size), ("--workers", cfg.workers), ("--crop", cfg.crop),
        ("--sides", f"{cfg.min_side},{cfg.max_side}"), ("--distinct", cfg.distinct),
        ("--reference-steps", cfg.reference_steps), ("--trainer-threads", 0), ("--timeout", f"{cfg.timeout_s:g}"),
        ("--repeat", 1),
    ]:
        assert re.search(rf"{option} \S+ [^-]*\(default {default}\b", text), option
    for name in train.RECIPES:
        assert name in text
    # Refused before anything starts, with what to change.
    assert main(["bench", "train", "--images", "10", "--batch-size", "8"]) == 2
    assert "must be at least two batches" in capsys.readouterr().err
    assert main(["bench", "train", "--crop", "128", "--sides", "96,224"]) == 2
    assert "crop (128) <= min_side (96)" in capsys.readouterr().err


@SHARED_TIMEOUT
def test_bench_resume_measures_every_loader_and_checks_the_resumed_epochs(request):
    # A tiny run (40 JPEGs of 16x16, 5 batches, 1 worker, resumed at 50%): the JSON's
    # structure, and the checks it records, never a timing.
    from shmpipe.bench import resume

    proc, folder = RUNS.get(request, "resume")
    out, png = folder / "resume.json", folder / "resume.png"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "resume"
    assert data["config"]["images"] == 40 and data["config"]["batches"] == 5
    restarts = data["restarts"]
    if resume.restarts_available() is None:
        # SIGKILLs in the first three quarters of the epoch (after batch 1
        # or 2): the run delivered what the fault-free one did, each sample
        # once; a kill sent to a producer not yet replaced is no new death.
        assert restarts["available"] and restarts["error"] is None, restarts
        (r,) = restarts["rounds"]
        assert r["kills"] == 2 and r["sequence_equal"] and r["each_sample_once"], r
        assert r["restarts"] == r["warnings"] <= r["kills"], r
        assert r["epoch_s"] > 0 and r["epoch_with_kills_s"] > 0
        assert "| 1 | 2 |" in proc.stdout
    else:
        assert restarts["available"] is False and restarts["why"] == "not available: max_restarts is not implemented"
        assert "Producer restarts under SIGKILL (max_restarts): not available: max_restarts is not implemented" in proc.stdout
    results = {r["loader"]: r for r in data["results"]}
    assert list(results) == list(resume.LOADERS)
    # One position (each is a new process per loader: the suite's time), of
    # 5 batches: some before it, some after.
    positions = {"50%": 2}
    for name, r in results.items():
        if r["skipped"] is not None:  # an optional peer, said so and not measured
            assert name in ("StatefulDataLoader", "Grain") and r["skipped"].startswith("not installed"), (name, r)
            assert r["runs_images_per_s"] == [] and r["checks"] == []
            assert f"| {name} | {r['resumes_by']} | not installed" in proc.stdout
            continue
        assert r["error"] is None, (name, r)
        assert r["images"] == 40 and r["images_per_s"] > 0, (name, r)
        assert set(r["first_batch_s"]) == {"fresh", *positions} and all(v > 0 for v in r["first_batch_s"].values())
        assert r["warm_first_batch_s"] > 0 and len(r["runs_warm_first_batch_s"]) == 1, (name, r)
        assert r["positions"] == positions
        # Each first batch of the new-process columns was a process of its
        # own, started by the bench, with nothing of shmpipe's before its
        # clock (see test_a_new_process_has_nothing_of_shmpipe_before_its_clock).
        procs = r["processes"]
        assert [p["at"] for p in procs] == ["fresh", *positions], name
        assert len({p["pid"] for p in procs} | {procs[0]["bench_pid"]}) == len(procs) + 1, procs
        for p in procs:
            assert p["ppid"] == p["bench_pid"] != p["pid"], p
            assert p["shmpipe_modules_before_clock"] == [] and p["children_before_clock"] == [], p
            assert p["first_batch_s"] == r["first_batch_s"][p["at"]] and p["left_running"] == 0, p
            assert (p["full_gcs"] > 0) == (p["full_gc_s"] > 0) and 0 <= p["full_gc_s"] < p["first_batch_s"], p
            assert "jpeg_dataset" in p["before_clock"], p
            if name.startswith("shmpipe"):  # its import, and what from_dataset imported, inside the clock
                assert p["import_s"] is not None and p["shmpipe_modules_at_first_batch"] > 0, p
        assert [(c["at"], c["batch"], c["resumed_batches"]) for c in r["checks"]] == [
            (at, k, 5 - k) for at, k in positions.items()
        ], name
        for c in r["checks"]:
            after = 40 - 8 * c["batch"]  # samples after the position
            if name.startswith("shmpipe"):
                # The resumed epoch is the rest of the uninterrupted one, and
                # it fetched each sample after the position once, none before.
                assert c["resumed_equals_rest"] and c["fetched_exactly_rest"], (name, c)
                assert c["fetched"] == after and c["fetched_before_position"] == 0, (name, c)
            elif name == "DataLoader":
                # No resume: the fast-forward fetches what it skips, and the
                # counter sees it.
                assert c["resumed_equals_rest"], c
                assert c["fetched"] == 40 and c["fetched_before_position"] == 8 * c["batch"], c
            else:
                assert isinstance(c["resumed_equals_rest"], bool) and c["fetched"] >= after, (name, c)
        assert f"| {name} | {r['resumes_by']} |" in proc.stdout
    assert "shmpipe: resumed batches equal the rest of the uninterrupted epoch; 0 samples" in proc.stdout
    assert "CPython's full garbage collection (the first after torch's import) fell inside the first batch" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_new_process_has_nothing_of_shmpipe_before_its_clock(tmp_path):
    # bench resume's new-process columns: one measurement, taken while this
    # process has shmpipe imported and its fork server running (as the
    # bench's warm column has them). The new process reports none of it
    # before its clock: shmpipe's import, the fork server's start and the
    # producers' are all in its first batch. The same report read in this
    # process, warm, is not empty: the test would see a warm measurement.
    import shmpipe
    from shmpipe.bench import _resume_fresh
    from shmpipe.bench._jpegs import JpegFolder, fetched, make_jpegs
    from shmpipe.bench._resume_config import ResumeConfig

    cfg = ResumeConfig(images=16, side=16, batch_size=4, workers=1, at=(0.5,), repeat=1, timeout_s=60)
    images = tmp_path / "images"
    images.mkdir()
    make_jpegs(str(images), cfg.images, cfg.side)
    job = _resume_fresh.prepare(str(tmp_path / "job"))
    with shmpipe.from_dataset(JpegFolder(str(images), cfg.images), batch_size=4, num_workers=1, timeout=60) as pipe:
        assert len([b for b in pipe]) == 4
        warm = _resume_fresh._shmpipe_modules(), _resume_fresh._children()
        assert warm[0] and warm[1], warm  # here: shmpipe imported, its fork server a child of this process
        run, batches, states = _resume_fresh.measure(
            str(job), "shmpipe", "fresh", 0, str(images), cfg.images, str(tmp_path / "log"), cfg, checkpoints=(2,))
    assert run.pid != os.getpid() and run.ppid == run.bench_pid == os.getpid(), run
    assert run.shmpipe_modules_before_clock == [] and run.children_before_clock == [], run
    assert run.shmpipe_modules_at_first_batch > 0 and run.import_s is not None, run
    assert 0 < run.made_s <= run.first_batch_s and run.left_running == 0, run
    assert sorted(i for b in batches for i in b) == list(range(16)) and set(states) == {2}, (batches, states)
    assert sorted(fetched(str(tmp_path / "log"))) == list(range(16))
    # Resumed from the checkpoint the first process wrote: a third process.
    again, rest, _ = _resume_fresh.measure(str(job), "shmpipe", "50%", 0, str(images), cfg.images,
                                           str(tmp_path / "log2"), cfg, state=states[2], to_the_end=True)
    assert again.pid not in (run.pid, os.getpid()) and again.children_before_clock == [], again
    assert rest == batches[2:]


def test_a_new_process_times_the_full_collections_inside_its_clock():
    # What bench resume's new processes register before their clock: it
    # times generation-2 collections only (the ones that take torch's
    # import's 0.1 s), each from its start to its end.
    import gc

    from shmpipe.bench._resume_fresh import _FullCollections

    full = _FullCollections()
    gc.callbacks.append(full)
    try:
        gc.collect(0)
        gc.collect(1)
        assert (full.count, full.seconds) == (0, 0.0)
        gc.collect()
        gc.collect(2)
    finally:
        gc.callbacks.remove(full)
    assert full.count == 2 and full.seconds > 0, (full.count, full.seconds)


def test_bench_feed_says_which_first_batch_was_warm():
    # bench feed's first batch. A start-up recipe is a script of its own
    # whose clock starts before shmpipe's fork server does (the script has
    # the package and two modules of the bench, nothing else of shmpipe): not
    # warm. In the bench's own process a shmpipe recipe after another finds
    # the server running: warm, and the table says so.
    from shmpipe.bench import feed

    cfg = feed.FeedConfig(workers=2, batches=2, shape=(8,), target_shape=(1,), fetch_s=0.0, train_s=0.0)
    results = feed.run(cfg, ["shmpipe:shm@numpy", "shmpipe:queue", "shmpipe:shm"])
    script, _, second = results
    assert all(len(r.waits_s) == 4 and r.first_batch_s > 0 for r in results), results
    assert script.warm_start is False and second.warm_start is True, results
    # the script's first batch from its first line too; a recipe of this process has no such clock
    assert script.from_start_s > script.first_batch_s and second.from_start_s is None, results
    assert f"| {feed._fmt_s(second.first_batch_s)} (warm) |" in feed.table(results)
    # (shmpipe:queue too where an earlier test of this process started the server)
    assert any(line.startswith("First batches marked (warm): ") and "shmpipe:shm ran on shmpipe's fork server" in line
               for line in feed.summary(results, None)), feed.summary(results, None)


def test_bench_feed_marks_warm_what_started_before_the_clock_for_its_peers_too():
    # mp.Queue's producers start from multiprocessing's fork server, which
    # the recipe run first in the process started: the second's first batch
    # is warm, and said to be (only shmpipe's recipes were marked before).
    from shmpipe.bench import feed
    from shmpipe.bench._report import process_context

    if process_context().get_start_method() != "forkserver":
        pytest.skip("mp.Queue's producers start from a fork server only where that is the start method")
    cfg = feed.FeedConfig(workers=2, batches=2, shape=(8,), target_shape=(1,), fetch_s=0.0, train_s=0.0)
    feed.run(cfg, ["mp.Queue"])
    (again,) = feed.run(cfg, ["mp.Queue"])
    assert again.warm_start is True and len(again.waits_s) == 4, again
    assert f"| {feed._fmt_s(again.first_batch_s)} (warm) |" in feed.table([again])
    assert any(line.startswith("First batches marked (warm): mp.Queue ran on multiprocessing's fork server")
               for line in feed.summary([again], None))


def test_bench_resume_check_sees_a_wrong_resume():
    # The check of a resumed run, on runs made up here: one that repeats a
    # batch and fetches a sample before the position is told apart.
    from shmpipe.bench.resume import _check

    epoch = [[3, 1], [0, 5], [4, 2]]
    good = _check("50%", 1, epoch, [[0, 5], [4, 2]], [5, 0, 2, 4])
    assert (good.resumed_equals_rest, good.fetched_exactly_rest, good.fetched_before_position) == (True, True, 0)
    bad = _check("50%", 1, epoch, [[3, 1], [0, 5], [4, 2]], [3, 1, 0, 5, 4, 2])
    assert (bad.resumed_equals_rest, bad.fetched_exactly_rest, bad.fetched_before_position) == (False, False, 2)
    assert (bad.resumed_batches, bad.fetched) == (3, 6)


def test_bench_resume_help_gives_every_default_and_bad_settings_are_refused(capsys):
    from shmpipe.__main__ import main
    from shmpipe.bench import resume

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "resume", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    cfg = resume.ResumeConfig()
    for option, default in [
        ("--images", cfg.images), ("--side", cfg.side), ("--batch-size", cfg.batch_size), ("--workers", cfg.workers),
        ("--at", "0.1 0.5 0.9"), ("--repeat", cfg.repeat), ("--seed", cfg.seed), ("--timeout", f"{cfg.timeout_s:g}"),
        ("--kills", cfg.kills),
    ]:
        assert re.search(rf"{option} \S+ [^-]*\(default {default}\b", text), option
    for name in resume.LOADERS:
        assert name in text
    assert "max_restarts" in text
    # Refused before any JPEG is made, with what to change.
    assert main(["bench", "resume", "--images", "10", "--batch-size", "8"]) == 2
    assert "must be at least two batches" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "resume", "--at", "1.5"])
    assert exit_.value.code == 2
    assert "strictly between 0 and 1" in capsys.readouterr().err


@SHARED_TIMEOUT
def test_bench_nodes_runs_every_layout_and_its_checks_pass(request):
    # A tiny run (TINY_NODES): the JSON's structure and the checks it
    # records, never a timing beyond its being there.
    import importlib.util

    from shmpipe.bench import nodes

    proc, folder = RUNS.get(request, "nodes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((folder / "nodes.json").read_text())
    assert data["benchmark"] == "nodes" and data["checks_passed"] is True
    assert data["config"]["layouts"] == ["2x1"] and data["config"]["batches"] == 12
    results = {(r["layout"], r["loader"]): r for r in data["results"]}
    assert list(results) == [("2x1", name) for name in nodes.LOADERS]
    for (layout, name), r in results.items():
        if nodes.why_not(name) is not None:  # Grain here: said so, nothing measured
            assert r["skipped"].startswith("not installed") and r["runs"] == [], r
            assert f"| all | {name} | not installed" in proc.stdout
            continue
        assert r["error"] is None and r["checks_passed"], (layout, name, r)
        (run,) = r["runs"]
        assert run["images"] == 48 and run["images_per_s"] > 0 and run["window_s"] > 0, (layout, name)
        assert len(run["first_batch_s"]) == 2, "a report from every rank"
        # The first batch counts the rank's imports and the loader's start,
        # both of them measured.
        for first, imports, made in zip(run["first_batch_s"], run["imports_s"], run["made_to_first_s"], strict=True):
            assert first > 0 and imports > 0 and made > 0 and first == pytest.approx(imports + made)
        # Every rank imported torch in its clock, whatever its loader (a
        # training job does; only the DataLoader's ranks did before).
        assert run["torch_imported"] == [importlib.util.find_spec("torch") is not None] * 2, run
        c = run["check"]
        assert c["delivered"] == 48 and c["delivered_once"] and c["fetched_once"] and c["same_count"], c
        assert c["fetched"] == 48 and c["leftover"] is None, c
        assert c["global_rule"] is (True if name == "shmpipe" else None), c
        assert r["workers_per_node"] == 2
        assert f"| {layout} | {name} |" in proc.stdout
    assert importlib.util.find_spec("torch") is None or results["2x1", "DataLoader"]["workers_per_rank"] == 2
    resume = data["resume"]
    assert resume["before"] == "2x1" and resume["after"] == "1x2" and resume["checks_passed"], resume
    assert resume["step"] == 3 and resume["position"] == 6  # 6 rounds of 2 ranks: half of them out
    assert resume["fresh_first_batch_s"] > 0 and resume["resumed_first_batch_s"] > 0
    assert resume["fresh_made_to_first_s"] > 0 and resume["resumed_made_to_first_s"] > 0
    (resumed,) = resume["resumed"]
    assert resumed["images"] == 24 and resumed["check"]["global_rule"], resumed  # the rest of the epoch
    assert resumed["check"]["fetched_before_position"] == 0 and resumed["check"]["fetched"] == 24, resumed
    assert resume["states_agree"] == [True]
    assert "| 1x2 resumed at 50% of 2x1 |" in proc.stdout and "| 1x2 fresh |" in proc.stdout
    assert "FAILED" not in proc.stdout + proc.stderr
    assert (folder / "nodes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_nodes_check_sees_a_wrong_run():
    # The global rule and the check, on runs made up here: a rank given
    # another's batch, a sample read twice, one read before the position.
    from shmpipe.bench.nodes import check_run, dealt, parse_layout, step_at

    epoch = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13]]
    rule = dealt(epoch, parse_layout("1x2"))
    assert rule == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]  # the last, incomplete round dropped
    assert dealt(epoch, parse_layout("3X1")) == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert step_at(0.5, len(epoch), (1, 2)) == 2 and step_at(0.01, len(epoch), (1, 2)) == 1
    good = check_run(rule, list(range(12)), rule)
    assert good.failures() == [] and (good.delivered, good.fetched, good.global_rule) == (12, 12, True)
    swapped = check_run([rule[1], rule[0]], list(range(12)), rule)
    assert swapped.failures() == ["batches differ from the global rule"]
    twice = check_run([rule[0], rule[0][:2]], [0, 1, 0, 1], None)
    assert set(twice.failures()) == {"a sample delivered twice", "a sample read twice",
                                     "ranks got different numbers of batches"}
    resumed = check_run([[[4, 5]], [[6, 7]]], [2, 4, 5, 6, 7], before={0, 1, 2, 3})
    assert resumed.failures() == ["1 samples before the position read again"]
    with pytest.raises(ValueError, match="not a layout"):
        parse_layout("2by2")


def test_bench_nodes_help_gives_every_default_and_bad_settings_are_refused(capsys):
    from shmpipe.__main__ import main
    from shmpipe.bench import nodes

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "nodes", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    cfg = nodes.NodesConfig()
    for option, default in [
        ("--layouts", "1x2 2x2 2x1 3x2"), ("--images", cfg.images), ("--side", cfg.side),
        ("--batch-size", cfg.batch_size), ("--workers", cfg.workers), ("--repeat", cfg.repeat), ("--seed", cfg.seed),
        ("--timeout", f"{cfg.timeout_s:g}"), ("--resume", "2x2 3x2"), ("--resume-at", "0.5"),
    ]:
        assert re.search(rf"{option} \S+ [^-]*\(default {default}\b", text), option
    assert "DistributedSampler" in text and "Grain" in text
    # The peers' workers per rank: the node's split over its ranks, at least one.
    assert [nodes.NodesConfig(workers=2).workers_per_rank(ranks) for ranks in (1, 2, 3)] == [2, 1, 1]
    # Refused before any JPEG is made or any process starts, with what to change.
    assert main(["bench", "nodes", "--layouts", "3x2", "--images", "64", "--batch-size", "8"]) == 2
    assert "fewer than two rounds of its 6 ranks" in capsys.readouterr().err
    assert main(["bench", "nodes", "--layouts", "1x2", "--images", "400", "--resume-at", "0.9"]) == 2
    assert "leaves 5 batches, not a round of 3x2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "nodes", "--layouts", "2by2"])
    assert exit_.value.code == 2
    assert "not a layout" in capsys.readouterr().err
