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
