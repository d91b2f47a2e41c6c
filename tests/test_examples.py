"""The examples run, on the CPU, in seconds."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from conftest import Command, SharedRuns

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
README = Path(__file__).resolve().parents[1] / "README.md"


def _command(key: str, folder: Path) -> Command:
    if key == "README":
        first = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
        script = folder / "first_example.py"
        script.write_text(first)
        return Command([sys.executable, str(script)], cwd=folder)
    if key == "torch_train.py without torch":
        # torch made unimportable for this one run (a None entry in sys.modules
        # is how Python itself marks a module that must not be imported)
        code = (
            "import runpy, sys; sys.modules['torch'] = None; "
            f"sys.argv = ['torch_train.py']; sys.path.insert(0, {str(EXAMPLES)!r}); "
            f"runpy.run_path({str(EXAMPLES / 'torch_train.py')!r}, run_name='__main__')"
        )
        return Command([sys.executable, "-c", code], cwd=folder, timeout=120)
    if key == "jax_train.py":
        # 4 forced CPU devices, batches of 32 (8 a device), 6 a pass; about 15 s
        return Command([sys.executable, str(EXAMPLES / key), "--workers", "2", "--epochs", "3", "--images", "192",
                        "--batch-size", "32", "--crop", "32"], cwd=folder, timeout=180, seconds=15)
    return Command([sys.executable, str(EXAMPLES / key), "--workers", "2", "--epochs", "3", "--batches", "10"], cwd=folder,
                   seconds=20 if key == "keras_fit.py" else 8)


def _keys(item: pytest.Item) -> list[str]:
    name = item.originalname
    if name == "test_example_trains_and_reports_the_stall_fraction":
        script = item.callspec.params["script"]
        return [] if script == "torch_train.py" and importlib.util.find_spec("torch") is None else [script]
    if name == "test_the_readmes_first_example_runs_as_written":
        return ["README"]
    if name == "test_the_jax_example_trains_data_parallel_and_every_sample_arrives_once":
        return ["jax_train.py"] if all(importlib.util.find_spec(m) for m in ("jax", "optax")) else []
    return ["torch_train.py without torch"]


#: The examples are independent scripts (Keras, torch, JAX, the README's),
#: run in the background from the session's start (conftest.BackgroundRuns);
#: each test checks its own.
RUNS = SharedRuns(
    {"test_example_trains_and_reports_the_stall_fraction", "test_the_readmes_first_example_runs_as_written",
     "test_the_torch_example_says_what_to_install_without_torch",
     "test_the_jax_example_trains_data_parallel_and_every_sample_arrives_once"},
    keys=_keys, command=_command, background=True,
)


@pytest.mark.timeout(600)  # the first runs them all
@pytest.mark.parametrize("script", ["keras_fit.py", "torch_train.py"])
def test_example_trains_and_reports_the_stall_fraction(script, request):
    if script == "torch_train.py":
        pytest.importorskip("torch")
    out, _ = RUNS.get(request, script)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < first, out.stdout
    assert re.search(r"stall fraction: [\d.]+% of the time", out.stdout), out.stdout
    assert "60 batches" in out.stdout  # 2 workers x 10 batches x 3 epochs


@pytest.mark.timeout(600)
def test_the_readmes_first_example_runs_as_written(request):
    out, _ = RUNS.get(request, "README")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shmpipe pipeline: 4 workers" in out.stdout and "400 batches" in out.stdout, out.stdout


@pytest.mark.timeout(600)
def test_the_torch_example_says_what_to_install_without_torch(request):
    out, _ = RUNS.get(request, "torch_train.py without torch")
    assert out.returncode == 1
    assert "needs torch" in out.stderr and "download.pytorch.org/whl/cpu" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.timeout(600)
def test_the_jax_example_trains_data_parallel_and_every_sample_arrives_once(request):
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    out, _ = RUNS.get(request, "jax_train.py")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    # the step ran on the 4 forced host devices, its batches split over them
    devices, first, last = re.search(r"trained on (\d+) cpu devices, data-parallel: loss ([\d.]+) -> ([\d.]+)",
                                     out.stdout).groups()
    assert int(devices) == 4, out.stdout
    assert float(last) < float(first), out.stdout
    # the script compared each epoch's sample indices with range(192)
    assert "every sample exactly once in each of 3 epochs of 192: yes" in out.stdout, out.stdout
    assert "18 batches" in out.stdout  # 192 / 32 = 6 a pass, 3 passes
    assert "ShmpipeWarning" not in out.stderr, out.stderr  # the producers did not import the script (nor jax)
