"""The documentation: every before/after snippet of the migration guides runs
and prints what its page says it prints, and the site builds with
``mkdocs build --strict`` (broken links, missing snippets) with an API
reference entry for every public name."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import OWN_RAY, Command, SharedRuns

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"

#: snippet -> (the page that shows it, the last line it prints)
EXPECTED = {
    "getting_started.py": ("getting-started.md", "batches: 100"),
    "ray_before.py": ("migration/ray.md", "batches: 8, checksum: 144048"),
    "ray_after.py": ("migration/ray.md", "batches: 8, checksum: 144048"),
    "dataloader_before.py": ("migration/dataloader.md", "epochs: 2, batches: 16, images: 128, checksum: 774696"),
    "dataloader_after.py": ("migration/dataloader.md", "epochs: 2, batches: 16, images: 128, checksum: 774696"),
    "tf_data_before.py": ("migration/tf-data.md", "epochs: 2, images per epoch: 256, checksum: 220020"),
    "tf_data_after.py": ("migration/tf-data.md", "epochs: 2, images per epoch: 256, checksum: 220020"),
    "long_runs.py": ("long-runs.md", "batches: 39, resumed after 20: 19 more, same batches: True"),
    "grain_before.py": ("migration/grain.md", "epochs: 2, batches: 16, checksum: 2261504"),
    "grain_after.py": ("migration/grain.md", "epochs: 2, batches: 16, checksum: 2261504"),
}
#: what each snippet needs installed
NEEDS = {"ray_before.py": "ray.util.iter", "dataloader": "torch", "tf_data": "tensorflow", "long_runs": "torch",
         "grain": "jax", "grain_before.py": "grain.python"}

#: the modules whose public names the API reference must document
API_MODULES = ["shmpipe", "shmpipe.transport", "shmpipe.registry", "shmpipe.errors"]


def _env(tmpdir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return env


def _tmpdir_of(name: str, folder: Path) -> Path | None:
    """The temporary directory of snippet `name`'s run: its own folder for
    a "before" snippet (another library's loader, not shmpipe's), /tmp for
    the rest. The DataLoader's workers, daemons terminated at the script's
    exit, leave multiprocessing's pymp-* folders behind (two a run); they
    are torch's to leave, in the run's folder. shmpipe's snippets keep
    /tmp, where a folder they left would show (and Ray's, whose socket
    paths must stay short, too)."""
    return folder if name.endswith("_before.py") and not name.startswith("ray") else None


def test_every_snippet_is_shown_on_its_page_and_run_here():
    on_disk = {p.name for p in SNIPPETS.glob("*.py")}
    assert on_disk == set(EXPECTED)
    for name, (page, line) in EXPECTED.items():
        text = (DOCS / page).read_text()
        assert f'--8<-- "{name}"' in text, (page, name)
        if page.startswith("migration/") or page == "long-runs.md":
            assert f"`{line}`" in text, (page, line)  # the page says what both print


def _missing(name: str) -> str | None:
    """What the snippet needs and is not installed here, if anything."""
    for key, module in NEEDS.items():
        if name.startswith(key):
            try:
                if importlib.util.find_spec(module) is None:
                    return module
            except ImportError:  # its package is missing
                return module
    return None


def _snippet_command(name: str, folder: Path) -> Command:
    env = _env(_tmpdir_of(name, folder))
    text = (SNIPPETS / name).read_text()
    ray = "import ray" in text or 'transport="ray"' in text  # it starts a local Ray
    return Command(
        [sys.executable, str(SNIPPETS / name)], cwd=folder, env={**env, **OWN_RAY} if ray else env, timeout=360,
        exclusive="ray" if ray else None,  # one local Ray at a time, its own
        seconds=10 if ray else 8 if name.startswith("tf_data") else 4,  # Ray's start, TF's import
    )


#: The snippets are independent scripts (most import TensorFlow, torch or
#: Ray, and wait on their producers), run in the background from the
#: session's start (conftest.BackgroundRuns); each test checks its own.
SNIPPET_RUNS = SharedRuns(
    {"test_snippet_runs_and_prints_what_its_page_says"},
    keys=lambda item: [] if _missing(item.callspec.params["name"]) else [item.callspec.params["name"]],
    command=_snippet_command,
    jobs=3,
    background=True,
)

_SITE_TOOLS = ("mkdocs", "mkdocstrings_handlers.python")


def _site_command(key: str, folder: Path) -> Command:
    return Command([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder / "site")],
                   cwd=ROOT, env={**_env(), "NO_MKDOCS_2_WARNING": "1"}, timeout=360, seconds=8)


#: The site's build (a process of its own that keeps a core busy for
#: seconds) runs in the background too; its test reads the pages it made.
SITE_RUN = SharedRuns(
    {"test_site_builds_strict_with_every_public_name"},
    keys=lambda item: ["site"] if all(importlib.util.find_spec(m.split(".")[0]) for m in _SITE_TOOLS) else [],
    command=_site_command,
    background=True,
)


@pytest.mark.timeout(900)  # the first runs them all: 10 scripts of up to 360 s each, three at a time
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_snippet_runs_and_prints_what_its_page_says(name, request):
    for key, module in NEEDS.items():
        if name.startswith(key):
            pytest.importorskip(module)
    proc, _ = SNIPPET_RUNS.get(request, name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    expected = EXPECTED[name][1]
    if name == "getting_started.py":  # then the stats, which vary
        assert lines[0] == expected, proc.stdout
    else:
        assert lines[-1] == expected, proc.stdout


@pytest.mark.timeout(900)  # it may wait for the background to reach its build
def test_site_builds_strict_with_every_public_name(request):
    for module in _SITE_TOOLS:
        pytest.importorskip(module)
    proc, folder = SITE_RUN.get(request, "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = folder / "site"
    api = (site / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="([^"]+)"', api))
    for module in API_MODULES:
        names = importlib.import_module(module).__all__
        missing = [n for n in names if f"{module}.{n}" not in anchors]
        assert not missing, (module, missing)
    assert "shmpipe.testing.conformance.TransportConformance" in anchors
    # A pipeline's methods, defined on its base classes, are on the page
    # (a newcomer looks for to_torch under Pipeline).
    for cls in ("Pipeline", "RankPipeline"):
        for method in ("to_torch", "to_tf_dataset", "to_jax", "stats", "close", "state_dict", "load_state_dict"):
            assert f"shmpipe.{cls}.{method}" in anchors, (cls, method)
    # The snippets are in the pages, not their markers.
    ray_page = (site / "migration" / "ray" / "index.html").read_text()
    assert "gather_async" in ray_page and "--8&lt;--" not in ray_page and "--8<--" not in ray_page
    assert (site / "results" / "index.html").exists()
