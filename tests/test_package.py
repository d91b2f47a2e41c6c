"""What `import shmpipe` does and does not do."""

from __future__ import annotations

import subprocess
import sys

import shmpipe


def test_import_pulls_in_no_heavy_optional_dependency(tmp_path):
    code = (
        "import sys, shmpipe; "
        "heavy = [m for m in ('ray', 'pyarrow', 'tensorflow', 'torch', 'cloudpickle') if m in sys.modules]; "
        "compiled = [m for m in ('shmpipe._ring', 'shmpipe._codec', 'shmpipe._tally') if m in sys.modules]; "
        "print(heavy + compiled)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


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
