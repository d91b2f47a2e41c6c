"""Producers import what their source needs, not the trainer's script
(_startup, _byvalue): real scripts with a heavy import at their top, run in
processes of their own, with forkserver and spawn."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import Command, SharedRuns

import shmpipe
from shmpipe import _byvalue

T = 60  # seconds: no script of these tests may take longer
#: The tests whose scripts run together (SCRIPTS): the first waits for all.
SHARED_TIMEOUT = pytest.mark.timeout(600)

#: A module of the test that is "heavy": it says in a file when it is
#: imported (the producers' pids land there) and takes a while.
HEAVY = textwrap.dedent(
    """
    import os, time
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported_by"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.3)
    """
)

#: A training script: the heavy module (and torch where asked) at its top,
#: sources defined in it that use its globals, its functions and its
#: classes. Each batch reports, from the producer, which of those modules
#: it has loaded and whether it imported the script (__mp_main__).
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    import numpy as np
    import heavy_module
    if "--torch" in sys.argv:
        import torch
    import shmpipe

    OFFSET = 1000 + int(sys.argv[2])  # a global the trainer computes: travels with the source
    LOCK = threading.Lock()           # module-level state no pickle can carry
    SEEN = []                         # written by the source through `global`-free mutation

    def scale(x):
        return x * 2

    class Shape:
        def __init__(self, n):
            self.n = n

        def zeros(self):
            return np.zeros(self.n, dtype=np.int64)

    class Source:
        def __init__(self, per):
            self.per = per

        def __call__(self):
            for i in range(self.per):
                yield report(Shape(3).zeros() + scale(i) + OFFSET)

    def report(data):
        loaded = [m for m in ("heavy_module", "torch") if m in sys.modules]
        if hasattr(sys.modules["__main__"], "SOURCES"):  # this process ran the script's top level
            loaded.append("script")
        return {"data": data, "loaded": np.array([len(m) for m in loaded]), "pid": np.array(os.getpid())}

    def make_batches():
        yield from Source(3)()

    def needs_the_script():
        with LOCK:  # the lock is the script's own: only importing it gives one
            yield from Source(3)()

    SOURCES = {"main": make_batches, "class": Source(3), "script": needs_the_script}

    def run():
        source = SOURCES[sys.argv[3]]
        with shmpipe.from_iterators([source] * 2, start_method=sys.argv[1], timeout=60) as pipe:
            batches = [{k: v.copy() for k, v in b.items()} for b in pipe]
        names = {len(m): m for m in ("heavy_module", "torch", "script")}
        print(json.dumps({
            "values": sorted(int(v) for b in batches for v in b["data"]),
            "loaded": sorted({names[int(n)] for b in batches for n in b["loaded"]}),
            "producers": sorted({int(b["pid"]) for b in batches}),
            "script_pid": os.getpid(),
        }))

    GUARD
    """
)


def _script_command(folder, start_method, source, guarded, torch):
    (folder / "heavy_module.py").write_text(HEAVY)
    script = folder / "train.py"
    body = SCRIPT.replace("GUARD", 'if __name__ == "__main__":\n    run()' if guarded else "run()")
    script.write_text(body)
    args = [sys.executable, str(script), start_method, "7", source] + (["--torch"] if torch else [])
    return Command(args, cwd=folder, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=T)


def run_script(request, start_method, source, guarded=True, torch=False):
    """(what the script did, the pids that imported the heavy module, its folder)."""
    out, folder = SCRIPTS.get(request, ("script", start_method, source, guarded, torch))
    importers = set()
    if (folder / "imported_by").exists():
        importers = {int(line) for line in (folder / "imported_by").read_text().split()}
    return out, importers, folder


def expected_values(offset):
    return sorted(2 * i + 1000 + offset for i in range(3) for _ in range(3) for _ in range(2))


@SHARED_TIMEOUT
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
@pytest.mark.parametrize("source", ["main", "class"])
def test_a_source_of_the_script_runs_without_importing_it(request, start_method, source):
    out, importers, _ = run_script(request, start_method, source)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # every batch arrived, computed from the trainer's globals (OFFSET from argv)
    assert got["values"] == expected_values(7)
    # ... by producers that loaded neither the heavy module nor the script
    assert got["loaded"] == [], got
    assert importers == {got["script_pid"]}, "only the trainer imported the heavy module"
    assert out.stderr == "", out.stderr


@SHARED_TIMEOUT
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_producers_of_a_script_that_imports_torch_do_not_load_torch(request, start_method):
    pytest.importorskip("torch")
    out, _, _ = run_script(request, start_method, "main", torch=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["values"] == expected_values(7)
    assert "torch" not in got["loaded"] and got["loaded"] == [], got


@SHARED_TIMEOUT
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_source_that_needs_the_script_still_works_by_importing_it(request, start_method):
    out, importers, _ = run_script(request, start_method, "script", torch=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["values"] == expected_values(7)
    # the old way: each producer imported the script, and so the heavy module
    assert got["loaded"] == ["heavy_module", "script", "torch"], got
    assert importers == {got["script_pid"], *got["producers"]}
    # and the trainer was told why, and what it costs
    # (at the script's line that made the pipeline)
    assert "train.py:48: ShmpipeWarning: 2 producer(s) import the training script, and with it torch" in out.stderr
    assert "cannot pickle '_thread.lock' object" in out.stderr


@SHARED_TIMEOUT
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_script_without_a_main_guard_runs_when_its_sources_travel_by_value(request, start_method):
    out, importers, _ = run_script(request, start_method, "main", guarded=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["values"] == expected_values(7) and got["loaded"] == []
    assert importers == {got["script_pid"]}


@SHARED_TIMEOUT
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_script_without_a_main_guard_whose_source_needs_it_is_told_to_add_one(request, start_method):
    out, _, folder = run_script(request, start_method, "script", guarded=False)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("shmpipe.errors.WorkerDiedError: worker "), out.stderr
    assert f'under `if __name__ == "__main__":` in {folder / "train.py"}' in last, last
    assert "bootstrapping phase" not in out.stderr, out.stderr


ARGS_SCRIPT = """
import sys
import numpy as np
import shmpipe

def make_batches():
    yield {"x": np.array(ARGS["scale"])}

if __name__ == "__main__":
    ARGS = {"scale": int(sys.argv[1])}
    with shmpipe.from_iterators([make_batches] * 2, timeout=60) as pipe:
        print(sorted(int(b["x"]) for b in pipe))
"""


@SHARED_TIMEOUT
def test_a_global_set_under_the_main_guard_travels_with_the_source(request):
    # Parsed arguments, say: a producer that imported the script would not
    # have them (the guard is skipped there); by value they come along.
    out, _ = SCRIPTS.get(request, ("args",))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[21, 21]"


GUARDED_SOURCE_SCRIPT = """
import threading
import numpy as np
import shmpipe

if __name__ == "__main__":
    lock = threading.Lock()

    def make_batches():
        with lock:  # a lock: it cannot travel by value, so the producer would import the script
            yield {"x": np.arange(3)}

    try:
        shmpipe.from_iterators([make_batches], timeout=60)
    except shmpipe.ShmpipeTypeError as exc:
        print("refused:", exc)
"""


def test_a_source_that_needs_the_script_but_is_defined_under_its_guard_is_refused(tmp_path):
    # The producer imports the script without running the guard's body, so
    # it did not find the source: multiprocessing's AttributeError traceback
    # in the producer, then 'worker 0 exited early with exit code 1' naming
    # neither the source nor the fix. Now refused before any process starts.
    (tmp_path / "train.py").write_text(GUARDED_SOURCE_SCRIPT)
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=T)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: source 0 (<function make_batches"), out.stdout
    assert "defines make_batches only under `if __name__ == \"__main__\":`" in out.stdout, out.stdout
    assert "cannot pickle '_thread.lock' object" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr, out.stderr  # no producer started, so none printed one


def test_which_names_a_script_binds_only_under_its_guard(tmp_path):
    from shmpipe._startup import bound_only_under_the_guard

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os.path as osp, json
        from functools import partial as P
        try:
            import missing
        except ImportError:
            FALLBACK = 1
        for i in range(2):
            LOOPED = i
        def top(): pass
        class Top: pass
        if "__main__" == __name__:
            def guarded(): pass
            class Guarded: pass
            top = 2
        else:
            def imported_only(): pass
        if __name__ == "__main__":
            def also_guarded(): pass
    """))

    def named(name, qualname=None):
        return type(name, (), {"__qualname__": qualname or name})  # a class of that name: its own qualname

    for bound in ("top", "Top", "osp", "json", "P", "missing", "FALLBACK", "LOOPED", "imported_only"):
        assert bound_only_under_the_guard(named(bound), str(script)) is None, bound
    for guarded in ("guarded", "Guarded", "also_guarded"):
        assert bound_only_under_the_guard(named(guarded), str(script)) == guarded
    assert bound_only_under_the_guard(named("Guarded")(), str(script)) == "Guarded"  # an instance: its class
    # Not seen bound anywhere (exec, a global statement in a function,
    # type(), a lambda): not refused, pickling says what it says.
    for unseen in ("made_by_exec", "<lambda>"):
        assert bound_only_under_the_guard(named(unseen), str(script)) is None, unseen
    # A method of the script's top level, bound to an instance of a class
    # of the guard's: the instance's class is what the producer lacks.
    top_method = type("Top", (), {"__qualname__": "Top", "__module__": "__main__", "run": lambda self: None})
    guarded_sub = type("Guarded", (top_method,), {"__qualname__": "Guarded", "__module__": "__main__"})
    assert bound_only_under_the_guard(guarded_sub().run, str(script)) == "Guarded"
    assert bound_only_under_the_guard(top_method().run, str(script)) is None
    # The globals the code reads: one bound only under the guard (the lock
    # the source takes, say) is missing in the producer as well.
    scope = {"__name__": "__main__"}
    exec("def uses_guarded():\n    return guarded, top, len\ndef uses_top():\n    return top, osp, len\n", scope)
    assert bound_only_under_the_guard(scope["uses_guarded"], str(script)) == "guarded"
    assert bound_only_under_the_guard(scope["uses_top"], str(script)) is None
    assert bound_only_under_the_guard(named("Top", "Top.method"), str(script)) is None
    assert bound_only_under_the_guard(named("guarded"), str(tmp_path / "gone.py")) is None  # unreadable: not refused
    (tmp_path / "bad.py").write_text("def (:\n")
    assert bound_only_under_the_guard(named("guarded"), str(tmp_path / "bad.py")) is None



#: Modules of the preload tests: each says in a file who imported it.
PRELOAD_MODULES = {
    "recorded.py": """
        import os

        def record(name):
            with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported_by"), "a") as f:
                f.write(f"{name} {os.getpid()}\\n")
    """,
    "decoder.py": "import recorded\nrecorded.record('decoder')\nSCALE = 3\n",
    "helper.py": "import recorded\nrecorded.record('helper')\nOFFSET = 100\n",
    "images.py": """
        import sys
        import numpy as np

        class Images:
            def __init__(self, n):
                self.n = n

            def __len__(self):
                return self.n

            def __getitem__(self, i):
                import decoder  # where it is used, as a dataset of images imports its decoder

                # (The trainer's own copy, which fetches a fresh pipeline's
                # first batches itself, was never unpickled: it says True.)
                return {"x": np.array(i * decoder.SCALE), "random": np.array(getattr(self, "random_loaded", True))}

            def __setstate__(self, state):
                self.__dict__.update(state)
                # in the producer, as its source is loaded: before the pass seeds NumPy's generator
                self.random_loaded = "numpy.random" in sys.modules
    """,
}

#: Sources of modules that the trainer imports after shmpipe.prestart():
#: one light, two with a heavy framework at their top (LATE_SCRIPT). Each
#: records the process that imported it, once its imports are done.
LATE_MODULES = {
    f"{name}.py": f"""
        import numpy as np
        {heavy}
        import recorded
        recorded.record({name!r})

        class Numbers:
            def __init__(self, n):
                self.n = n

            def __call__(self):
                for i in range(self.n):
                    yield np.array(i)
    """
    for name, heavy in (("light_ds", ""), ("heavy_ds", "import torch"), ("heavy2_ds", "from torch import zeros"))
}

LATE_SCRIPT = """
    import json, os, sys
    import shmpipe
    from shmpipe import _forkserver

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    if __name__ == "__main__":
        shmpipe.prestart()  # at the top of the script, before the datasets' modules
        first = _forkserver.server_pid()
        import light_ds, heavy_ds, heavy2_ds
        out = {"trainer": os.getpid(), "first": first}
        runs = (("light", light_ds), ("heavy", heavy_ds), ("heavy again", heavy_ds), ("heavy2", heavy2_ds))
        for name, module in runs:
            with shmpipe.from_iterators([module.Numbers(3)] * 2, timeout=60) as pipe:
                got = sorted(int(b) for b in pipe)
                out[name] = {"got": got, "server": _forkserver.server_pid(), "pids": pipe.pids,
                             "parents": sorted({parent(p) for p in pipe.pids})}
        print(json.dumps(out))
"""


def _late_command(folder):
    for name, text in {"recorded.py": PRELOAD_MODULES["recorded.py"], **LATE_MODULES}.items():
        (folder / name).write_text(textwrap.dedent(text))
    (folder / "train.py").write_text(textwrap.dedent(LATE_SCRIPT))
    return Command([sys.executable, str(folder / "train.py")], cwd=folder, timeout=T,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])})


#: The trainer: it has the modules loaded; its pipeline is made (after
#: shmpipe.prestart(...) with "--prestart") the way argv[1] says.
PRELOAD_SCRIPT = """
    import json, os, sys
    import numpy as np
    import shmpipe
    import decoder, helper
    from images import Images

    def make_batches():
        yield {"y": np.array(helper.OFFSET)}  # a function of the script: travels by value, `helper` by name

    if __name__ == "__main__":
        kind = sys.argv[1]
        if "--prestart" in sys.argv:
            shmpipe.prestart(Images(8) if kind == "dataset" else make_batches)
        if kind == "dataset":
            pipe = shmpipe.from_dataset(Images(8), batch_size=2, num_workers=2, timeout=60)
        else:
            pipe = shmpipe.from_iterators([make_batches] * 2, timeout=60)
        with pipe:
            got = sorted(tuple(int(v) for b in pipe for v in b["x" if kind == "dataset" else "y"].ravel()))
            random = [bool(b["random"].all()) for b in pipe] if kind == "dataset" else []
        from shmpipe import _forkserver
        print(json.dumps({"got": got, "random": random, "trainer": os.getpid(), "server": _forkserver.server_pid(),
                          "producers": pipe.pids}))
"""


def _preload_command(folder, kind, flags):
    for name, text in PRELOAD_MODULES.items():
        (folder / name).write_text(textwrap.dedent(text))
    (folder / "train.py").write_text(textwrap.dedent(PRELOAD_SCRIPT))
    return Command([sys.executable, str(folder / "train.py"), kind, *flags], cwd=folder, timeout=T,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])})


def run_preload_script(request, kind, *flags):
    out, folder = SCRIPTS.get(request, ("preload", kind, flags))
    assert out.returncode == 0, out.stderr
    importers: dict[str, set[int]] = {}
    for line in (folder / "imported_by").read_text().split("\n"):
        if line:
            name, pid = line.split()
            importers.setdefault(name, set()).add(int(pid))
    return json.loads(out.stdout), importers


@SHARED_TIMEOUT
@pytest.mark.parametrize("flags", [(), ("--prestart",)])
def test_the_fork_server_preloads_what_a_dataset_imports_where_it_is_used(request, flags):
    # Images.__getitem__ imports decoder: the fork server imports it once (the
    # trainer has it loaded), and numpy.random, which every producer seeds;
    # the producers inherit both instead of importing them before their first
    # batch. The same where shmpipe.prestart(dataset) started the server.
    got, importers = run_preload_script(request, "dataset", *flags)
    assert got["got"] == [3 * i for i in range(8)]
    assert importers["decoder"] == {got["trainer"], got["server"]}, (importers, got)
    assert not set(got["producers"]) & importers["decoder"]
    assert got["random"] == [True] * 4  # numpy.random was there as each producer loaded its source


@SHARED_TIMEOUT
def test_a_later_pipeline_whose_module_brings_a_heavy_framework_gets_a_server_that_has_it(request):
    # prestart() started the server before the datasets' modules were
    # imported, so it has none. The light one: each producer imports it
    # (a new server would cost more than that). The one with `import torch`
    # at its top: a new server imports it once, and the producers of this
    # pipeline and the next fork from it instead of each importing torch.
    # Another module of torch: that server has torch, nothing new starts.
    pytest.importorskip("torch")
    out, folder = SCRIPTS.get(request, ("late",))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    importers: dict[str, set[int]] = {}
    for line in (folder / "imported_by").read_text().split("\n"):
        if line:
            name, pid = line.split()
            importers.setdefault(name, set()).add(int(pid))
    light, heavy, again = got["light"], got["heavy"], got["heavy again"]
    for run in (light, heavy, again):
        assert run["got"] == [0, 0, 1, 1, 2, 2]
    assert light["server"] == got["first"] and light["parents"] == [got["first"]]
    assert importers["light_ds"] == {got["trainer"], *light["pids"]}
    assert heavy["server"] != got["first"] and heavy["parents"] == [heavy["server"]]
    assert importers["heavy_ds"] == {got["trainer"], heavy["server"]}, (importers, got)
    assert again["server"] == heavy["server"] and again["parents"] == [heavy["server"]]
    heavy2 = got["heavy2"]
    assert heavy2["got"] == [0, 0, 1, 1, 2, 2]
    assert heavy2["server"] == heavy["server"] and heavy2["parents"] == [heavy["server"]]
    assert importers["heavy2_ds"] == {got["trainer"], *heavy2["pids"]}


def test_what_brings_a_heavy_framework_is_told_from_what_does_not():
    import types

    torch = pytest.importorskip("torch")
    from shmpipe import _startup

    made = {
        "m_imports_it": {"torch": torch},
        "m_a_builtin_of_it": {"zeros": torch.zeros},
        "m_an_object_of_it": {"DEVICE": torch.device("cpu")},
        "m_a_class_of_it": {"Dataset": torch.utils.data.Dataset},
        "m_light": {"typing": __import__("typing"), "np": np, "n": 3},
    }
    made["m_through_a_module"] = {"inner": "m_imports_it"}  # as `import torchvision` brings torch
    try:
        for name, values in made.items():
            module = types.ModuleType(name)
            for key, value in values.items():
                setattr(module, key, sys.modules[value] if key == "inner" else value)
            sys.modules[name] = module
        got = {name: _startup._heavy_frameworks_of(name) for name in made}
    finally:
        for name in made:
            sys.modules.pop(name, None)
    assert got == {name: (set() if name == "m_light" else {"torch"}) for name in made}
    assert _startup._heavy_frameworks_of("torch.nn") == {"torch"}


@SHARED_TIMEOUT
@pytest.mark.parametrize("flags", [(), ("--prestart",)])
def test_the_fork_server_preloads_the_modules_a_function_of_the_script_uses(request, flags):
    # make_batches travels by value; `helper`, a global it uses, by name:
    # the server imports it, not each producer.
    got, importers = run_preload_script(request, "function", *flags)
    assert got["got"] == [100, 100]
    assert importers["helper"] == {got["trainer"], got["server"]}, (importers, got)


PRESTART_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import shmpipe
    from shmpipe import _forkserver

    def make_batches():
        yield np.arange(3)

    if __name__ == "__main__":
        before = _forkserver.server_pid()
        shmpipe.prestart()
        # what a first pipeline imports in this process is here already
        ready = all(m in sys.modules for m in ("numpy.random", "shmpipe.transports.shm", "shmpipe._ring"))
        server = _forkserver.server_pid()
        shmpipe.prestart()  # once only
        again = _forkserver.server_pid()
        parents = set()
        for _ in range(2):
            with shmpipe.from_iterators([make_batches] * 2, timeout=60) as pipe:
                got = [b.tolist() for b in pipe]
                for pid in pipe.pids:
                    with open(f"/proc/{pid}/stat") as f:
                        parents.add(int(f.read().rsplit(")", 1)[1].split()[1]))
        print(json.dumps({"before": before, "server": server, "again": again, "parents": sorted(parents),
                          "got": got, "ready": ready}))
    """
)


@SHARED_TIMEOUT
def test_prestart_starts_the_server_before_any_pipeline_and_pipelines_use_it(request):
    out, _ = SCRIPTS.get(request, ("prestart",))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["before"] is None and got["server"] is not None and got["again"] == got["server"]
    assert got["parents"] == [got["server"]]  # every producer of both pipelines forked from it
    assert got["got"] == [[0, 1, 2], [0, 1, 2]] and got["ready"]
    assert out.stderr == ""


ENVIRONMENT_SCRIPT = """
import os, sys
import shmpipe

def report():
    yield {"value": os.environ.get("OPENBLAS_THREAD_TIMEOUT", "unset")}

if __name__ == "__main__":
    with shmpipe.from_iterators([report] * 2, timeout=60) as pipe:
        print(sorted(b["value"] for b in pipe))
"""


@SHARED_TIMEOUT
@pytest.mark.parametrize("value", [None, "12"])
def test_the_producers_environment_is_the_trainers(request, value):
    # The fork server imports its preload with OPENBLAS_THREAD_TIMEOUT=4 (its
    # OpenBLAS threads would spin a core for 0.1 s), unless the trainer's
    # environment sets it, and removes it before it forks any producer.
    out, _ = SCRIPTS.get(request, ("environment", value))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([value or "unset"] * 2)


def _environment_command(folder, value):
    script = folder / "environment.py"
    script.write_text(ENVIRONMENT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = value
    return Command([sys.executable, str(script)], cwd=folder, timeout=T,
                   env={**env, "PYTHONPATH": os.pathsep.join(sys.path)})


def _command(key, folder):
    kind, *args = key
    if kind == "script":
        return _script_command(folder, *args)
    if kind == "preload":
        return _preload_command(folder, *args)
    if kind == "environment":
        return _environment_command(folder, *args)
    if kind == "late":
        return _late_command(folder)
    script = folder / f"{kind}.py"
    script.write_text(PRESTART_SCRIPT if kind == "prestart" else ARGS_SCRIPT)
    return Command([sys.executable, str(script), *(["21"] if kind == "args" else [])], cwd=folder, timeout=T,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


#: The script each test of the family runs (see their calls of SCRIPTS.get).
_KEYS = {
    "test_a_source_of_the_script_runs_without_importing_it": lambda p: ("script", p["start_method"], p["source"], True, False),
    "test_producers_of_a_script_that_imports_torch_do_not_load_torch": lambda p: ("script", p["start_method"], "main", True, True),
    "test_a_source_that_needs_the_script_still_works_by_importing_it": lambda p: ("script", p["start_method"], "script", True, True),
    "test_a_script_without_a_main_guard_runs_when_its_sources_travel_by_value": lambda p: ("script", p["start_method"], "main", False, False),
    "test_a_script_without_a_main_guard_whose_source_needs_it_is_told_to_add_one": lambda p: ("script", p["start_method"], "script", False, False),
    "test_a_global_set_under_the_main_guard_travels_with_the_source": lambda p: ("args",),
    "test_the_fork_server_preloads_what_a_dataset_imports_where_it_is_used": lambda p: ("preload", "dataset", p["flags"]),
    "test_the_fork_server_preloads_the_modules_a_function_of_the_script_uses": lambda p: ("preload", "function", p["flags"]),
    "test_prestart_starts_the_server_before_any_pipeline_and_pipelines_use_it": lambda p: ("prestart",),
    "test_a_later_pipeline_whose_module_brings_a_heavy_framework_gets_a_server_that_has_it": lambda p: ("late",),
    "test_the_producers_environment_is_the_trainers": lambda p: ("environment", p["value"]),
}


def _keys(item):
    key = _KEYS[item.originalname](getattr(item, "callspec", None) and item.callspec.params)
    if key[0] == "script" and key[4] and importlib.util.find_spec("torch") is None:
        return []  # the test is skipped
    return [key]


#: The training scripts of these tests are independent processes, run in the
#: background from the session's start (conftest.BackgroundRuns); each test
#: checks its own.
SCRIPTS = SharedRuns(set(_KEYS), keys=_keys, command=_command, jobs=3, background=True)


class CountsItsPickles:
    """A dataset that counts, in a file, how often the trainer pickles it."""

    def __init__(self, path, n):
        self.path, self.n = path, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.array(i)

    def __call__(self):  # a source of from_iterators too
        for i in range(self.n):
            yield np.array([i])

    def __reduce__(self):
        if os.getpid() == self.owner:
            with open(self.path, "a") as f:
                f.write("pickled\n")
        return CountsItsPickles._rebuild, (self.path, self.n, self.owner)

    @staticmethod
    def _rebuild(path, n, owner):
        made = CountsItsPickles(path, n)
        made.owner = owner
        return made


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
@pytest.mark.parametrize("kind", ["dataset", "iterators"])
def test_a_source_is_pickled_once_for_all_its_producers(tmp_path, start_method, kind):
    # The options' check pickles each source to know whether it can travel
    # without the script; the launcher ships that pickle: a dataset held in
    # memory is not pickled again, nor once per producer.
    log = tmp_path / "pickles"
    source = CountsItsPickles(str(log), 12)
    source.owner = os.getpid()
    if kind == "dataset":
        pipe = shmpipe.from_dataset(source, batch_size=3, num_workers=3, start_method=start_method, timeout=T)
    else:
        pipe = shmpipe.from_iterators([source] * 3, start_method=start_method, timeout=T)
    with pipe:
        got = sorted(int(v) for b in pipe for v in b)
    assert got == sorted(list(range(12)) * (1 if kind == "dataset" else 3))
    assert log.read_text().split() == ["pickled"]


# -- _byvalue, in this process: functions and classes "of the script" are made
#    with exec under __name__ == "__main__" (their __module__) ----------------------


def script_namespace(code):
    namespace = {"__name__": "__main__"}
    exec(textwrap.dedent(code), namespace)
    return namespace


def roundtrip(obj):
    return _byvalue.loads(_byvalue.dumps(obj))


def test_functions_travel_with_their_globals_closures_and_defaults():
    ns = script_namespace(
        """
        import math
        BASE = 10
        UNUSED = list(range(1000))
        def helper(x):
            return x + BASE
        def outer(k):
            def inner(x, y=2, *, z=3):
                return helper(x) * k + y + z + math.floor(0.5)
            return inner
        def fact(n):
            return 1 if n <= 1 else n * fact(n - 1)
        square = lambda x: x * x
        """
    )
    inner = roundtrip(ns["outer"](5))
    assert inner(1) == (1 + 10) * 5 + 2 + 3
    assert inner.__module__ == "__main__" and inner.__qualname__ == "outer.<locals>.inner"
    assert inner.__globals__ is not ns  # a copy, with only what the code names (helper's too)
    assert set(inner.__globals__) - {"__builtins__", "__name__"} == {"helper", "math", "BASE"}
    assert roundtrip(ns["fact"])(5) == 120  # names itself
    assert roundtrip(ns["square"])(7) == 49
    bound = roundtrip(functools.partial(ns["helper"], 5))
    assert bound() == 15


def test_the_functions_of_one_pickle_share_their_globals():
    ns = script_namespace(
        """
        COUNT = 0
        def bump():
            global COUNT
            COUNT += 1
        def read():
            return COUNT
        """
    )
    bump, read = roundtrip((ns["bump"], ns["read"]))
    bump()
    bump()
    assert read() == 2 and ns["COUNT"] == 0  # the trainer's own is untouched


def test_classes_travel_with_their_methods():
    ns = script_namespace(
        """
        import abc
        class Base(abc.ABC):
            @abc.abstractmethod
            def make(self): ...
            def twice(self):
                return [self.make(), self.make()]
        class Source(Base):
            unit = 3
            def __init__(self, n):
                self.n = n
            def make(self):
                return self.n * self.unit
            @staticmethod
            def name():
                return "source"
            @classmethod
            def create(cls):
                return cls(2)
            @property
            def double(self):
                return self.n * 2
            def __repr__(self):
                return f"Source({self.n}) " + super().__repr__()[:1]
        """
    )
    source = roundtrip(ns["Source"](4))
    assert type(source) is not ns["Source"] and type(source).__module__ == "__main__"
    assert source.twice() == [12, 12] and source.double == 8
    assert type(source).name() == "source" and type(source).create().n == 2
    assert repr(source) == "Source(4) <"  # super() finds the rebuilt class
    with pytest.raises(TypeError, match="abstract"):
        type(source).__mro__[1]()  # Base is still abstract


@pytest.mark.parametrize(
    "code, name, why",
    [
        ("import threading\nLOCK = threading.Lock()\ndef f():\n    return LOCK", "f", "_thread.lock"),
        ("import enum\nclass Color(enum.Enum):\n    RED = 1\ndef f():\n    return Color.RED", "f", "metaclass"),
        ("class P:\n    __slots__ = ('x',)\ndef f():\n    return P", "f", "__slots__"),
    ],
)
def test_what_cannot_travel_by_value_says_why(code, name, why):
    ns = script_namespace(code)
    with pytest.raises(_byvalue.NotByValue, match=why):
        _byvalue.dumps(ns[name])


@pytest.fixture
def token_of_the_script():
    """A script whose TOKEN pickles as its name in __main__ (a singleton with
    a __reduce__ returning its name), installed as __main__ for the test."""
    import types

    ns = script_namespace(
        """
        class Token:
            def __reduce__(self):
                return "TOKEN"
        TOKEN = Token()
        """
    )
    main = types.ModuleType("__main__")
    main.__dict__.update(ns)
    real = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        yield ns["TOKEN"]
    finally:
        sys.modules["__main__"] = real


def test_a_value_named_by_the_script_is_not_shipped_by_value(token_of_the_script):
    # an object whose pickle names a global of __main__ would need the script in the producer
    with pytest.raises(_byvalue.NotByValue, match="__main__.TOKEN"):
        _byvalue.dumps([token_of_the_script])


def test_cached_functions_travel_by_value_each_with_an_empty_cache():
    # functools.cache is how a script opens a connection once per producer
    # (DataLoader's worker_init_fn's job): by name, it needed the script.
    ns = script_namespace(
        """
        import functools
        CALLS = []
        @functools.cache
        def connection(worker):
            CALLS.append(worker)
            return f"connection {worker}"
        @functools.lru_cache(maxsize=8, typed=True)
        def fib(n):
            return n if n < 2 else fib(n - 1) + fib(n - 2)
        fib.calls_made = "counted elsewhere"  # set by the script on the wrapper: travels
        def fetch(k):
            return connection(k % 2), fib(k)
        """
    )
    ns["connection"](0)  # the trainer's cache holds an entry; a producer's starts empty
    fetch = roundtrip(ns["fetch"])
    connection = fetch.__globals__["connection"]
    assert connection is not ns["connection"] and connection.cache_info().currsize == 0
    assert connection.__wrapped__.__module__ == "__main__"
    assert [fetch(k) for k in (3, 5, 10)] == [("connection 1", 2), ("connection 1", 5), ("connection 0", 55)]
    # CALLS travelled with the trainer's value ([0]), as a fork copies it;
    # the copy's empty cache called the function once per argument since.
    assert connection.__wrapped__.__globals__["CALLS"] == [0, 1, 0]
    fib = fetch.__globals__["fib"]
    assert fib.cache_parameters() == {"maxsize": 8, "typed": True} and fib.calls_made == "counted elsewhere"
    assert fib.__wrapped__.__globals__["fib"] is fib  # one wrapper: the one the function calls itself through
    assert ns["CALLS"] == [0]  # the trainer's own is untouched


def test_what_needs_the_script_is_named_even_after_the_string_main_was_pickled_once(token_of_the_script):
    # "__main__" pickled once as a value is fetched from the pickle's memo
    # when a name of the script is looked up after it: the message names
    # that lookup, not the next string of the pickle.
    with pytest.raises(_byvalue.NotByValue, match=r"refers to __main__\.TOKEN in"):
        _byvalue.dumps(["__main__", {"np": 1}, token_of_the_script])
    # The string alone is refused too (a false alarm costs only the slower start), and says so.
    with pytest.raises(_byvalue.NotByValue, match=r"names the script's module \(__main__\)"):
        _byvalue.dumps(["__main__", "np"])


def test_objects_of_other_modules_travel_by_reference():
    from shmpipe.testing.sources import Counter

    data = _byvalue.dumps(Counter(3))
    assert b"shmpipe.testing.sources" in data and b"__main__" not in data
    assert isinstance(_byvalue.loads(data), Counter)


def test_a_trainer_run_from_a_source_checkout_starts_its_producers(tmp_path):
    """The fork server imports shmpipe with the trainer's sys.path, not from
    the directory the trainer runs in: here one holding shmpipe's sources
    without their compiled modules (a clean clone, where CI runs the tests).
    Python 3.11's fork server used to import that copy, and every producer
    failed to start."""
    import shutil

    package = os.path.dirname(shmpipe.__file__)
    shutil.copytree(package, tmp_path / "shmpipe", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    script = tmp_path / "elsewhere" / "train.py"
    script.parent.mkdir()
    script.write_text(
        textwrap.dedent(
            """
            import shmpipe
            from shmpipe.testing.sources import Counter
            if __name__ == "__main__":
                with shmpipe.from_iterators([Counter(3)] * 2, timeout=60) as pipe:
                    print(sorted(int(b["seq"]) for b in pipe))
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[0] == "[0, 0, 1, 1, 2, 2]"


_TRANSPORT_PRELOAD_JOB = """
import json, sys
import shmpipe
from shmpipe import _forkserver
from shmpipe.testing.sources import Counter
with shmpipe.from_iterators([Counter(2)] * 2, transport=sys.argv[1], timeout=60) as pipe:
    assert len(list(pipe)) == 4
    print(json.dumps(_forkserver._SERVER._preload_modules))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("transport", "module", "preloaded"), [
    ("arrow", "shmpipe.transports.arrow", True),
    # a transport of another package: its module may keep state per process
    # (a client, a pid), which producers forked from the server would share
    ("example-pipe", "shmpipe_example_pipe", False),
])
def test_the_fork_server_preloads_the_module_of_shmpipes_transport_only(tmp_path, transport, module, preloaded):
    # Each producer unpickles its transport from the transport's module: the
    # arrow transport's imports pyarrow (27 ms of CPU a producer, measured),
    # which the producers now inherit from the server (helpers 50 and 54).
    pytest.importorskip("pyarrow" if transport == "arrow" else module)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _TRANSPORT_PRELOAD_JOB, transport], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (module in json.loads(out.stdout.strip().splitlines()[-1])) is preloaded


_README_PATTERN_JOB = """
import json, sys
import numpy as np
import shmpipe
from shmpipe import _forkserver

def make_batches():  # of the script, as the README's: it calls shmpipe.get_worker_info()
    info = shmpipe.get_worker_info()
    yield {"id": np.array(info.id), "pipeline_side": np.array([m in sys.modules for m in SIDE])}

SIDE = ("shmpipe._api", "shmpipe._pipeline", "shmpipe._launch", "shmpipe._group", "shmpipe._options",
        "shmpipe.registry")

if __name__ == "__main__":
    with shmpipe.from_iterators([make_batches] * 2, timeout=60) as pipe:
        got = [(int(b["id"]), b["pipeline_side"].tolist()) for b in pipe]
    print(json.dumps({"got": sorted(got), "preload": [m for m in _forkserver._SERVER._preload_modules if m in SIDE]}))
"""


@pytest.mark.timeout(120)
def test_a_generator_of_the_script_that_uses_shmpipe_brings_no_pipeline_module_to_the_producers(tmp_path):
    # The server imported every module of shmpipe the trainer had loaded
    # (the pipeline's side too, which no producer runs) when a function of
    # the script used the global `shmpipe`, as the README's first example does.
    script = tmp_path / "readme_pattern.py"
    script.write_text(_README_PATTERN_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["preload"] == []
    assert got["got"] == [[0, [False] * 6], [1, [False] * 6]]


def test_the_imports_of_a_function_with_hundreds_of_names_are_read_as_written():
    # Past 255 names an import's name takes an EXTENDED_ARG, which cut the
    # constants that say the import's level: `from .x import y` was read as
    # the top-level module x (helper 100).
    from shmpipe._startup import _imports_of

    names = " + ".join(f"g{i}" for i in range(300))
    namespace: dict = {}
    exec(compile(f"def f():\n    x = {names}\n    from .x import y\n    import os.path\n", "<made>", "exec"), namespace)
    assert _imports_of(namespace["f"].__code__, "pkg") == {"pkg.x", "pkg.x.y", "os.path"}
    exec(compile("def f():\n    from .x import y\n", "<made>", "exec"), namespace)  # as short functions are
    assert _imports_of(namespace["f"].__code__, "pkg") == {"pkg.x", "pkg.x.y"}
