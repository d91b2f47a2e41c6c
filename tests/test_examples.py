"""The examples run, on the CPU, in seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", ["keras_fit.py", "torch_train.py"])
def test_example_trains_and_reports_the_stall_fraction(script, tmp_path):
    if script == "torch_train.py":
        pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--workers", "2", "--epochs", "3", "--batches", "10"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < first, out.stdout
    assert re.search(r"stall fraction: [\d.]+% of the time", out.stdout), out.stdout
    assert "60 batches" in out.stdout  # 2 workers x 10 batches x 3 epochs


README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readmes_first_example_runs_as_written(tmp_path):
    first = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "first_example.py"
    script.write_text(first)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shmpipe pipeline: 4 workers" in out.stdout and "400 batches" in out.stdout, out.stdout


def test_the_torch_example_says_what_to_install_without_torch(tmp_path):
    # torch made unimportable for this one run (a None entry in sys.modules
    # is how Python itself marks a module that must not be imported)
    code = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.argv = ['torch_train.py']; sys.path.insert(0, {str(EXAMPLES)!r}); "
        f"runpy.run_path({str(EXAMPLES / 'torch_train.py')!r}, run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 1
    assert "needs torch" in out.stderr and "download.pytorch.org/whl/cpu" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
