"""What `import shmpipe` does and does not do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shmpipe


def in_a_fresh_python(code: str, cwd) -> str:
    """What `code` prints, run by a new interpreter (so nothing this test
    process imported counts); it must exit with 0."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_import_pulls_in_no_heavy_optional_dependency(tmp_path):
    code = (
        "import sys, shmpipe; "
        "heavy = [m for m in ('ray', 'pyarrow', 'tensorflow', 'torch', 'jax', 'cloudpickle') if m in sys.modules]; "
        "compiled = [m for m in ('shmpipe._ring', 'shmpipe._codec', 'shmpipe._spans', 'shmpipe._tally') if m in sys.modules]; "
        "print(heavy + compiled)"
    )
    assert in_a_fresh_python(code, tmp_path).strip() == "[]"


def test_the_producer_side_loads_none_of_the_trainers_side(tmp_path):
    """shmpipe's fork server (and a spawned producer) imports what a producer
    runs on: it must not load the pipeline, groups, options or the registry
    (the package's names load their modules at their first use)."""
    code = (
        "import sys; from shmpipe._forkserver import SERVER_PRELOAD; "
        "[__import__(m) for m in SERVER_PRELOAD]; import shmpipe; shmpipe.reserve; shmpipe.get_worker_info; "
        "print([m for m in ('shmpipe._api', 'shmpipe._pipeline', 'shmpipe._group', 'shmpipe._options', "
        "'shmpipe.registry', 'importlib.metadata') if m in sys.modules])"
    )
    assert in_a_fresh_python(code, tmp_path).strip() == "[]"


def test_each_public_name_is_where_the_package_says_and_typed_there():
    import ast
    import importlib

    where = shmpipe._WHERE
    assert set(shmpipe.__all__) == set(where) | {"clean", "prestart", "signature_of"}
    for name, module in where.items():
        assert getattr(shmpipe, name) is getattr(importlib.import_module(module), name), name
    # the TYPE_CHECKING imports (what type checkers see) name the same modules
    with open(shmpipe.__file__) as f:
        tree = ast.parse(f.read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert typed == where
    assert set(shmpipe.__all__) <= set(dir(shmpipe))


def test_public_api():
    for name in shmpipe.__all__:
        assert hasattr(shmpipe, name), name
    for name in [n for n in shmpipe.__all__ if n.endswith("Error")]:
        assert issubclass(getattr(shmpipe, name), shmpipe.ShmpipeError)
    assert issubclass(shmpipe.PipelineTimeoutError, TimeoutError)
    assert issubclass(shmpipe.BatchTypeError, TypeError)
    assert issubclass(shmpipe.SharedMemoryFullError, OSError)


def test_deprecated_names_still_work_and_say_what_replaces_them():
    import pytest

    from shmpipe import errors

    for module in (shmpipe, errors):
        with pytest.warns(DeprecationWarning, match="use shmpipe.CorruptChannelError") as caught:
            old = module.CorruptSegmentError
        assert old is shmpipe.CorruptChannelError
        assert caught[0].filename == __file__  # the user's line, where the old name is
    with pytest.warns(DeprecationWarning) as caught:
        from shmpipe import CorruptSegmentError  # noqa: F401
    assert caught[0].filename == __file__
    for module in (shmpipe, errors):
        with pytest.raises(AttributeError):
            module.NoSuchName  # noqa: B018


def test_a_ctrl_c_while_a_name_loads_its_module_comes_after_the_import(tmp_path):
    # The first use of shmpipe.from_iterators imports the pipeline's side; a
    # Ctrl-C pressed in the middle (here: when shmpipe._pipeline is looked
    # up) is a KeyboardInterrupt once that import is whole, not an import cut
    # in half (which can surface as another exception: a RuntimeError where
    # it lands in a class body, as a CI run of test_faults saw).
    code = (
        "import os, signal, sys\n"
        "import shmpipe\n"
        "class Press:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'shmpipe._pipeline':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Press())\n"
        "try:\n"
        "    shmpipe.from_iterators\n"
        "except KeyboardInterrupt:\n"
        "    print('KeyboardInterrupt', 'shmpipe._api' in sys.modules, callable(shmpipe.from_iterators))\n"
    )
    printed = in_a_fresh_python(code, tmp_path)
    assert printed.split() == ["KeyboardInterrupt", "True", "True"], printed


def test_a_name_loads_its_module_without_a_garbage_collection_and_leaves_the_collector_as_it_was(tmp_path):
    # The import of from_dataset's side makes 7,000 long-lived objects: in a
    # process that had just imported torch they set off a full collection of
    # 60-90 ms inside a fresh process's first batch. With a threshold of 100,
    # a collection is due every 100 allocations from a collection just run:
    # the import must run none, and leave the collector as the program had
    # it, on or off.
    code = (
        "import gc, sys\n"
        "import shmpipe\n"
        "runs = []\n"
        "gc.callbacks.append(lambda phase, info: runs.append(phase) if phase == 'start' else None)\n"
        "gc.set_threshold(100)\n"
        "gc.collect(); before = len(runs)\n"
        "shmpipe.from_dataset\n"
        "print(len(runs) - before, gc.isenabled(), 'shmpipe._api' in sys.modules)\n"
        "gc.disable(); before = len(runs); unloaded = 'shmpipe._stats' not in sys.modules\n"
        "shmpipe.GroupStats\n"
        "print(len(runs) - before, gc.isenabled(), unloaded)\n"
        "gc.enable(); before = len(runs)\n"
        "[[] for _ in range(300)]\n"
        "print(len(runs) > before)\n"
    )
    lines = in_a_fresh_python(code, tmp_path).splitlines()
    assert lines == ["0 True True", "0 False True", "True"], lines


def test_every_python_module_stays_under_800_lines():
    # One job per module: a module past this has taken on a second one
    # (split it by job, as _turns.py was split from _pipeline.py). The
    # compiled cores (_ring.pyx, _codec.pyx) are one job each, and longer.
    from pathlib import Path

    root = Path(shmpipe.__file__).parent
    modules = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    assert len(modules) > 40
    long = {str(p.relative_to(root)): n for p in modules if (n := len(p.read_text().splitlines())) > 800}
    assert not long, long


@pytest.mark.parametrize("tree", ["a clone's source tree", "an install without its extension"])
def test_a_package_without_its_compiled_core_says_why(tmp_path, tree):
    # A script run from a clone's root imports the clone's shmpipe/ (its
    # folder comes first on sys.path), which has no built extension: the
    # error says so and what to do, not only "cannot import name '_ring'".
    # -S: no site-packages' .pth files, so an editable install's finder does
    # not answer for the tree either (the tree is what Python finds).
    source = Path(__file__).resolve().parent.parent / "shmpipe"
    skip = ["*.so", "*.c", "__pycache__"] + (["*.pyx", "*.pxd"] if tree.startswith("an install") else [])
    shutil.copytree(source, tmp_path / "shmpipe", ignore=shutil.ignore_patterns(*skip))
    site = [p for p in sys.path if p.endswith("site-packages")]  # NumPy's, for the package's own imports
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import shmpipe; print(shmpipe.__file__, flush=True); from shmpipe import _ring"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(site)},
    )
    assert out.stdout.strip() == str(tmp_path / "shmpipe" / "__init__.py"), out.stdout + out.stderr  # the tree, indeed
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: shmpipe's compiled core, shmpipe._ring, is not built: "), out.stderr
    if tree.startswith("a clone"):
        assert f"this shmpipe is a source tree ({tmp_path / 'shmpipe'})" in last and "pip install -e ." in last
    else:
        assert "reinstall shmpipe" in last
