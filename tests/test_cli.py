"""`shmpipe bench ...` and `shmpipe clean`: every option, at a tiny size
(the code paths, never the timings)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import OWN_RAY, Command, SharedRuns

import shmpipe
from shmpipe import registry
from shmpipe.__main__ import main
from shmpipe.bench._report import parse_size
from shmpipe.transports.queue import QueueTransport

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_FEED = ["--workers", "2", "--batches", "2", "--shape", "2,100,3", "--fetch", "0.01", "--compute", "0.002", "--train", "0.002",
             "--transport-bound-workers", "0"]


#: The tests whose CLI runs go together (RUNS, below): the first waits for all.
SHARED_TIMEOUT = pytest.mark.timeout(900)


def png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5000


def test_feed_every_option(tmp_path, capfd):
    out_json, out_png = tmp_path / "feed.json", tmp_path / "feed.png"
    recipes = ["generator", "tf.data", "mp.Queue", "shmpipe:shm", "shmpipe:shm+reserve", "shmpipe:arrow",
               "shmpipe:queue", "shmpipe:example-pipe"]
    rc = main(["bench", "feed", *TINY_FEED[:-2], "--transport-bound-workers", "3", "--transport-bound-batches", "2",
               "--recipes", *recipes, "--out", str(tmp_path / "out"), "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    captured = capfd.readouterr()
    text = captured.out
    assert "2 producers (--workers), 2 batches each" in text
    assert "fetch 0.01 s + compute 0.002 s per batch; train step 0.002 s" in text
    data = json.loads(out_json.read_text())
    assert data["benchmark"] == "feed" and data["config"]["shape"] == [2, 100, 3]
    assert "python" in data["environment"] and "numpy" in data["environment"]
    got = {r["recipe"]: r for r in data["results"]}
    assert list(got) == recipes
    assert len(got["generator"]["waits_s"]) == 2 and len(got["tf.data"]["waits_s"]) == 2
    for name in recipes[2:]:
        assert len(got[name]["waits_s"]) == 4, name  # 2 producers x 2 batches
        assert got[name]["skipped"] is None
        # the floor of 2 producers at 12 ms a batch and a 2 ms step, after their first batches
        assert got[name]["floor_s"] == pytest.approx(0.012 / 2 - 0.002), name
        assert got[name]["cpu_per_batch_s"] > 0 and got[name]["wait_s"] > 0
        # the steady state starts once both producers (2 processes, told apart by pid) have delivered
        assert 2 <= got[name]["warm_up_batches"] <= 4, name
    assert got["generator"]["warm_up_batches"] == got["tf.data"]["warm_up_batches"] == 1
    assert got["generator"]["floor_s"] == pytest.approx(0.012) and got["tf.data"]["floor_s"] == pytest.approx(0.010)
    for name in recipes:
        assert f"| {name} |" in text
    assert "| tf.data | 1 (a thread) |" in text and "| generator | - (the loop) |" in text
    for column in ("wait per batch", "floor", "above floor", "trainer CPU per batch", "speed-up vs tf.data"):
        assert column in text
    # the second run: 3 producers, the recipes that have producer processes
    bound = data["transport_bound"]
    assert bound["config"]["workers"] == 3 and bound["config"]["batches"] == 2
    assert [r["recipe"] for r in bound["results"]] == recipes[2:]
    assert all(len(r["waits_s"]) == 6 and r["warm_up_batches"] >= 3 for r in bound["results"])
    assert "Transport-bound: 3 producers, 2 batches each" in text
    assert "shmpipe waits" in text and "above the floor" in text  # the summary
    assert png(out_png)
    assert f"Results: {out_json}, {out_png}" in text
    assert (tmp_path / "out" / "output.log").exists() and f"{tmp_path / 'out' / 'output.log'}" in text
    # one progress line per recipe and run, none twice
    progress = [line for line in captured.err.splitlines() if line.startswith("  bench feed: ")]
    assert len(progress) == len(set(progress)) == len(recipes) + len(recipes) - 2, captured.err


def test_feed_floor():
    from shmpipe.bench.feed import FeedConfig, transport_bound, wait_floor

    # 2 producers at 0.5 s a batch: one every 0.25 s, of which the loop trains 0.1 s
    assert wait_floor(2, 0.5, 0.1) == pytest.approx(0.15)
    assert wait_floor(0, 0.5, 0.1) == 0.5  # the loop makes its batches itself
    assert wait_floor(1, 0.5, 0.1) == pytest.approx(0.4)  # tf.data's one prefetching thread
    assert wait_floor(8, 0.5, 0.1) == 0.0  # 8 producers outpace the step
    cfg = FeedConfig(workers=2)
    assert cfg.producer_bound and transport_bound(cfg).workers == 8
    assert not transport_bound(cfg).producer_bound and not FeedConfig(workers=8).producer_bound


@SHARED_TIMEOUT
def test_feed_ray_recipes(request):
    # a child process, as a user runs it: Ray's logging holds the stderr of
    # the process it started in
    out, folder = RUNS.get(request, "feed ray")
    assert out.returncode == 0, out.stderr
    got = {r["recipe"]: r for r in json.loads((folder / "feed.json").read_text())["results"]}
    assert len(got["ray.util.iter"]["waits_s"]) == 4 and len(got["shmpipe:ray"]["waits_s"]) == 4
    assert "Started a local Ray instance" not in out.stdout + out.stderr
    assert "Started a local Ray instance" in (folder / "output.log").read_text()
    assert "Ray started once, in " in out.stdout  # for both recipes, not once each


STARTUP_RECIPES = ["shmpipe:shm@torch", "shmpipe:shm+prestart@torch", "torch.DataLoader@torch"]


@SHARED_TIMEOUT
def test_feed_startup_recipes_run_a_script_that_imports_the_framework(request):
    pytest.importorskip("torch")
    recipes = STARTUP_RECIPES
    out, folder = RUNS.get(request, "feed startup")
    assert out.returncode == 0, out.stderr
    got = {r["recipe"]: r for r in json.loads((folder / "feed.json").read_text())["results"]}
    assert list(got) == recipes
    for name in recipes:
        assert len(got[name]["waits_s"]) == 4 and got[name]["first_batch_s"] > 0, name
        assert got[name]["producers_pss_mib"] > 0, name  # both producers' PSS, read from /proc
        # from the script's first line: the import of torch inside, as a user waits for it
        assert got[name]["from_start_s"] > got[name]["first_batch_s"], (name, got[name])
        assert f"| {name} | 2 |" in out.stdout
    assert "| producers' PSS |" in out.stdout
    assert "With `import torch` at the top of the training script, shmpipe's first batch came in " in out.stdout
    assert " with shmpipe.prestart() before the import)" in out.stdout
    assert out.stdout.count(" from the script's start, with ") == 3, out.stdout


class Missing(QueueTransport):
    requires = ("a_module_nobody_installed_xyz",)
    extra = "demo"


def test_feed_skips_what_cannot_run_here_and_refuses_unknown_recipes(tmp_path, capsys):
    registry.register_transport("missing-dep", Missing)
    try:
        rc = main(["bench", "feed", *TINY_FEED, "--recipes", "generator", "shmpipe:missing-dep", "--out", str(tmp_path)])
    finally:
        registry._registered.pop("missing-dep")
    assert rc == 0
    assert 'skipped: the \'missing-dep\' transport needs a_module_nobody_installed_xyz' in capsys.readouterr().out
    assert main(["bench", "feed", *TINY_FEED, "--recipes", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown recipes ['nope']" in capsys.readouterr().err


def test_seed_is_a_deprecated_alias_of_feed(tmp_path, capsys):
    # `bench seed`, the old name: the same benchmark, the same results, and one line on stderr saying so
    rc = main(["bench", "seed", *TINY_FEED, "--recipes", "generator", "--out", str(tmp_path)])
    assert rc == 0
    captured = capsys.readouterr()
    said = [line for line in captured.err.splitlines() if "deprecated" in line]
    assert said == ["shmpipe bench seed is deprecated: use `shmpipe bench feed` (the same benchmark)"], captured.err
    assert "shmpipe bench feed: how long a training loop waits" in captured.out and "| generator |" in captured.out
    data = json.loads((tmp_path / "feed.json").read_text())
    assert data["benchmark"] == "feed" and [r["recipe"] for r in data["results"]] == ["generator"]
    assert len(data["results"][0]["waits_s"]) == 2
    # the new name says nothing of the kind
    assert main(["bench", "feed", *TINY_FEED, "--recipes", "generator", "--out", str(tmp_path / "new")]) == 0
    assert "deprecated" not in capsys.readouterr().err


def test_throughput_every_option(tmp_path, capsys):
    paths = ["memcpy", "mp.Queue", "shm ring", "shm reserve", "shm varying", "transport:arrow", "transport:queue", "transport:example-pipe"]
    rc = main([
        "bench", "throughput", "--sizes", "4KiB", "8KiB", "--seconds", "0.02", "--min-batches", "2", "--workers", "1",
        "--paths", *paths, "--json", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png"),
    ])
    assert rc == 0
    text = capsys.readouterr().out
    assert "1 producers" in text
    assert "MET" not in text.upper().replace("MEMCPY", "")  # no project-internal targets in user output
    assert "targets" not in json.loads((tmp_path / "t.json").read_text())
    data = json.loads((tmp_path / "t.json").read_text())
    assert [(r["path"], r["nbytes"]) for r in data["results"]] == [(p, n) for n in (4096, 8192) for p in paths]
    assert all(r["batches"] >= 2 for r in data["results"])
    assert "| 8 KiB | transport:example-pipe |" in text
    # A first batch whose fork server an earlier run started is warm, and said
    # to be; what is timed (steady state, after untimed batches) is said too.
    by = {(r["path"], r["nbytes"]): r for r in data["results"]}
    assert by["shm reserve", 4096]["warm_start"] is True and by["memcpy", 4096]["warm_start"] is None
    row = next(line for line in text.splitlines() if line.startswith("| 4 KiB | shm reserve |"))
    assert row.endswith(" (warm) |"), row
    assert "Steady state: each run's first batches" in text and "(warm): the fork server" in text
    assert png(tmp_path / "t.png")


def test_throughput_default_paths_cover_every_transport():
    from shmpipe.bench.throughput import default_paths

    paths = default_paths()
    assert paths[:5] == ["memcpy", "mp.Queue", "shm ring", "shm reserve", "shm varying"]
    assert {f"transport:{t}" for t in shmpipe.available_transports() if t != "shm"} <= set(paths)


def test_sizes_are_checked():
    assert parse_size("64KiB") == 65536 and parse_size("48MB") == 48_000_000 and parse_size("4096") == 4096
    with pytest.raises(SystemExit, match="4KiB to 256MB"):
        main(["bench", "throughput", "--sizes", "1KiB"])
    with pytest.raises(SystemExit, match="4KiB to 256MB"):
        main(["bench", "serialize", "--sizes", "1GB"])
    with pytest.raises(shmpipe.ShmpipeValueError, match="not a size"):
        parse_size("lots")


@SHARED_TIMEOUT
def test_serialize_every_option(request):
    # (A process of its own, with the other CLI runs: "ray put/get" starts a
    # local Ray, seconds mostly spent waiting.)
    from shmpipe.bench.serialize import PATHS

    out, folder = RUNS.get(request, "serialize")
    assert out.returncode == 0, out.stderr
    data = json.loads((folder / "s.json").read_text())
    got = {(r["path"], r["nbytes"]): r for r in data["results"]}
    assert set(got) == {(p, n) for p in PATHS for n in (4096, 131072)}
    # which paths copy on decode, as measured: views for these, copies for those
    for p in ("pickle 5 oob", "arrow tensor", "arrow record batch", "ray put/get", "shmpipe"):
        assert got[p, 131072]["decode_copies"] == 0, p
    for p in ("pickle 4", "pickle 5", "numpy save"):
        assert got[p, 131072]["decode_copies"] == 1, p
    # the first round trip of each, timed apart from the steady figures
    for r in got.values():
        assert r["first_us"] > 0 and r["encode_us"] > 0 and r["decode_us"] > 0, r
    assert png(folder / "s.png")
    assert "| 128 KiB | shmpipe |" in out.stdout


@SHARED_TIMEOUT
def test_the_console_script(request):
    out, tmp_path = RUNS.get(request, "console")
    assert out.returncode == 0, out.stderr
    assert "| shmpipe:shm | 2 |" in out.stdout
    # the results land in a folder it names; TensorFlow's start-up lines in its log, not on the screen
    (folder,) = tmp_path.glob("shmpipe-bench-feed-*")
    assert {p.name for p in folder.iterdir()} == {"feed.json", "feed.png", "output.log"}
    assert f"Results: {folder.name}/feed.json, {folder.name}/feed.png" in out.stdout
    log = (folder / "output.log").read_text().splitlines()
    assert log, "TensorFlow says nothing when it starts?"
    for line in log:
        assert line not in out.stdout and line not in out.stderr
    verbose, tmp_path = RUNS.get(request, "console verbose")
    assert verbose.returncode == 0, verbose.stderr
    assert not (tmp_path / "v" / "output.log").exists()
    # With --verbose TensorFlow's start-up lines reach the screen (compared
    # by what they say: they carry timestamps, so they differ run to run).
    tf_said = [line for line in verbose.stderr.splitlines() if any(w in line for w in ("tensorflow", "oneDNN", "absl"))]
    assert tf_said, verbose.stderr


def every_option(parser):
    """(command, option action) for every option of every (sub)command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for command, option in every_option(sub):
                    yield f"{name} {command}".strip(), option
        elif action.option_strings and action.dest != "help":
            yield "", action


@SHARED_TIMEOUT
def test_help_describes_every_option_with_its_default(request):
    from shmpipe.__main__ import build_parser

    options = list(every_option(build_parser()))
    assert len(options) > 25
    for command, action in options:
        assert action.help and len(action.help) > 10, (command, action.option_strings)
    feed_help = build_parser()._subparsers._group_actions[0].choices["bench"]._subparsers._group_actions[0].choices[
        "feed"].format_help()
    feed_help = " ".join(feed_help.split())
    for text in ("--compute COMPUTE", "(default: 0.0)", "(default: 0.5)", "(default: 4,1000000,3)",
                 "(default: 4)", "(default: ./shmpipe-bench-"):
        assert text in feed_help, text
    for kind in ("throughput", "serialize"):
        out, _ = RUNS.get(request, f"help {kind}")
        words = " ".join(out.stdout.split())
        assert out.returncode == 0 and "--json FILE also write the results as JSON to FILE (default: no file)" in words
        assert "(default: 64KiB 1MiB 48MB)" in words


# -- shmpipe doctor ----------------------------------------------------------------


#: Where child processes run: not the repository's root, whose shmpipe/ (no
#: built extension in a clean clone) `python -m` and `-c` would import first.
NEUTRAL = os.path.dirname(os.path.abspath(__file__))


def doctor(*args, preexec_fn=None, prefix=()):
    return subprocess.run([*prefix, sys.executable, "-m", "shmpipe", "doctor", *args], capture_output=True, text=True,
                          timeout=120, preexec_fn=preexec_fn, cwd=NEUTRAL,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})



# -- the CLI runs of these tests: independent processes, run three at a time by
#    the first test that needs one (36 s one after the other, 23.7 s two at a
#    time, 19.6 s three); each test checks its own ---------------------------------


def _child_env(*first: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*first, *sys.path])}


def _command(key: str, folder) -> Command:
    console = os.path.join(os.path.dirname(sys.executable), "shmpipe")
    if key == "feed ray":
        return Command([sys.executable, "-m", "shmpipe", "bench", "feed", *TINY_FEED, "--recipes", "ray.util.iter",
                        "shmpipe:ray", "--out", str(folder)],
                       cwd=folder,  # not the repository's root: -m would import its unbuilt source tree first
                       env={**_child_env(), **OWN_RAY}, exclusive="ray", seconds=25)
    if key == "feed startup":
        return Command([sys.executable, "-m", "shmpipe", "bench", "feed", *TINY_FEED, "--recipes", *STARTUP_RECIPES,
                        "--out", str(folder)], cwd=folder, env=_child_env(), seconds=10)
    if key == "serialize":
        from shmpipe.bench.serialize import PATHS

        return Command([sys.executable, "-m", "shmpipe", "bench", "serialize", "--sizes", "4KiB", "128KiB", "--paths",
                        *PATHS, "--seconds", "0.01", "--json", str(folder / "s.json"), "--plot", str(folder / "s.png")],
                       cwd=folder, env={**_child_env(), **OWN_RAY}, exclusive="ray", seconds=15)
    # TensorFlow's start-up lines at its own default level: tests/test_tf.py
    # quiets them in this process's environment as it is collected, which a
    # command started after that inherited (the log was then empty).
    tf_says = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if key == "console":  # the recipes of tf.data import TensorFlow
        return Command([console, "bench", "feed", *TINY_FEED, "--recipes", "tf.data", "shmpipe:shm"], cwd=folder,
                       env=tf_says, seconds=8)
    if key == "console verbose":
        return Command([console, "bench", "feed", *TINY_FEED, "--recipes", "tf.data", "--out", "v", "--verbose"],
                       cwd=folder, env=tf_says, seconds=8)
    if key.startswith("help "):
        return Command([sys.executable, "-m", "shmpipe", "bench", key.split()[1], "--help"], cwd=folder,
                       env=_child_env(), timeout=120)
    if key == "doctor's checks":
        code = ("import sys; from shmpipe import _doctor; _doctor.checks(); "
                "print(sorted(m for m in ('torch', 'tensorflow', 'ray', 'pyarrow', 'jax') if m in sys.modules))")
        return Command([sys.executable, "-c", code], cwd=NEUTRAL, env=_child_env(), timeout=120)
    if key == "doctor with torch in sitecustomize":
        (folder / "sitecustomize.py").write_text("import torch\n")
        return Command([sys.executable, "-m", "shmpipe", "doctor", "--json"], cwd=NEUTRAL,
                       env=_child_env(str(folder)))
    doctor_args = {"doctor --json": ["--json"], "doctor": [], "doctor with 256 open files": []}[key]
    return Command([sys.executable, "-m", "shmpipe", "doctor", *doctor_args], cwd=NEUTRAL, env=_child_env(),
                   timeout=120, preexec_fn=_few_files if key == "doctor with 256 open files" else None)


def _few_files():
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


_TORCH = importlib.util.find_spec("torch") is not None
_KEYS = {
    "test_feed_ray_recipes": ["feed ray"],
    "test_serialize_every_option": ["serialize"],
    "test_feed_startup_recipes_run_a_script_that_imports_the_framework": ["feed startup"] if _TORCH else [],
    "test_the_console_script": ["console", "console verbose"],
    "test_help_describes_every_option_with_its_default": ["help throughput", "help serialize"],
    "test_doctor_checks_this_machine": ["doctor --json", "doctor"],
    "test_doctor_imports_no_heavy_package": ["doctor's checks"],
    "test_doctor_reports_what_starting_producers_costs": ["doctor --json"],
    "test_doctor_warns_when_producers_load_a_heavy_framework": ["doctor with torch in sitecustomize"] if _TORCH else [],
    "test_doctor_warns_about_few_open_files": ["doctor with 256 open files"],
}
# In the background from the session's start (conftest.BackgroundRuns); the
# two that start a local Ray one at a time, each its own (OWN_RAY).
RUNS = SharedRuns(set(_KEYS), keys=lambda item: _KEYS[item.originalname], command=_command, jobs=3, background=True)


@SHARED_TIMEOUT
def test_doctor_checks_this_machine(request):
    out, _ = RUNS.get(request, "doctor --json")
    report = json.loads(out.stdout)
    names = [c["name"] for c in report["checks"]]
    for name in ("/dev/shm", "memory for rings", "open files (ulimit -n)", "locked memory (ulimit -l)",
                 "transparent huge pages", "start methods", "producer start-up", "package numpy", "package pyarrow", "package ray",
                 "package tensorflow", "package torch", "package jax", "CUDA devices", "JAX devices",
                 "leftover segments"):
        assert name in names
    assert all(c["status"] in ("OK", "WARN") and c["value"] for c in report["checks"])
    warned = [c for c in report["checks"] if c["status"] == "WARN"]
    assert all(c["fix"] for c in warned)
    assert out.returncode == (1 if warned else 0) and report["ok"] == (not warned)
    # the versions come from the installed metadata, as the packages say
    import numpy

    assert next(c for c in report["checks"] if c["name"] == "package numpy")["value"] == numpy.__version__
    if importlib.util.find_spec("jax") is not None:  # JAX's devices, asked of a child interpreter
        jax_line = next(c for c in report["checks"] if c["name"] == "JAX devices")["value"]
        assert jax_line.startswith(f"JAX {importlib.metadata.version('jax')}, ") and " device" in jax_line, jax_line
    text, _ = RUNS.get(request, "doctor")
    # (its own measures: the producer start-up is timed again, and may warn
    # in one run and not the other on a busy machine)
    assert text.returncode == (1 if "\n  WARN  " in text.stdout else 0), text.stdout
    assert text.stdout.startswith("shmpipe doctor: ") and "  OK    package numpy" in text.stdout


@SHARED_TIMEOUT
def test_doctor_imports_no_heavy_package(request):
    out, _ = RUNS.get(request, "doctor's checks")
    assert out.stdout.strip() == "[]", out.stderr


@SHARED_TIMEOUT
def test_doctor_reports_what_starting_producers_costs(request):
    report = json.loads(RUNS.get(request, "doctor --json")[0].stdout)  # the run test_doctor_checks_this_machine checks
    startup = next(c for c in report["checks"] if c["name"] == "producer start-up")
    assert startup["value"].startswith("2 producers (forkserver): first batch in "), startup
    assert "they load none of tensorflow, torch, jax, keras, ray" in startup["value"], startup
    assert "shmpipe.prestart() at the top of a training script" in startup["fix"], startup


@SHARED_TIMEOUT
def test_doctor_warns_when_producers_load_a_heavy_framework(request):
    # A sitecustomize that imports torch: every Python process carries it,
    # shmpipe's fork server and so its producers too.
    pytest.importorskip("torch")
    out, _ = RUNS.get(request, "doctor with torch in sitecustomize")
    report = json.loads(out.stdout)
    startup = next(c for c in report["checks"] if c["name"] == "producer start-up")
    assert startup["status"] == "WARN" and "they load torch" in startup["value"], startup
    assert "sitecustomize.py" in startup["fix"]
    assert out.returncode == 1


@SHARED_TIMEOUT
def test_doctor_warns_about_few_open_files(request):
    out, _ = RUNS.get(request, "doctor with 256 open files")
    assert out.returncode == 1, out.stdout
    line = next(line for line in out.stdout.splitlines() if "open files" in line)
    assert line.startswith("  WARN") and "256" in line
    # 256, less the process's own and the start's 8, at 3 a producer
    allowed = int(re.search(r"room for (\d+) producers in one pipeline", line).group(1))
    assert 75 <= allowed <= (256 - 8) // 3, line
    assert "fix: ulimit -n 4096" in out.stdout


def test_doctor_warns_about_a_leftover_segment():
    from shmpipe._process import process_start_time
    from shmpipe._segments import SHM_DIR

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start_time(child.pid)
    finally:
        child.kill()
        child.wait(30)
    name = f"shmpipe-{child.pid}-{start}-{'ab' * 12}"  # the name of a segment whose owner died
    path = os.path.join(SHM_DIR, name)
    for _ in range(5):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
        try:
            out = doctor()
        finally:
            # The doctor's own pipeline (its last check) sweeps it, after it
            # was reported; a pipeline opened meanwhile may have swept it too.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if name in out.stdout:  # it was there when the doctor looked (else: again)
            break
    assert out.returncode == 1, out.stdout
    line = next(line for line in out.stdout.splitlines() if "leftover segments" in line)
    assert line.startswith("  WARN") and name in line
    assert "fix: shmpipe clean" in out.stdout


def test_doctor_warns_about_a_64_mb_dev_shm():
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here (unshare -m: {probe.stderr.strip()})")
    mount = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$@\""
    out = doctor(prefix=("unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh"))
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(line for line in out.stdout.splitlines() if "/dev/shm" in line)
    assert line.startswith("  WARN") and "64 MiB" in line
    assert "--shm-size" in out.stdout
