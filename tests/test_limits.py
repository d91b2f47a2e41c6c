"""A pipeline and the limit of open files (ulimit -n): each producer costs
the trainer 3 descriptors (its control link, multiprocessing's sentinel,
its pidfd), and a pipeline that would not fit is refused before any
producer starts with a DescriptorLimitError that says how to raise the
limit, never a raw OSError from the middle of a start.

Each case is a fresh interpreter whose limit (soft and hard, as ``ulimit
-n`` sets both) is lowered before it runs."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import shmpipe
    from shmpipe.testing.sources import Counter

    def parent_of(pid):
        try:  # (any process of the machine may end between the listing and the read)
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            return None

    if __name__ == "__main__":
        n, transport = int(sys.argv[1]), sys.argv[2]
        try:
            with shmpipe.from_iterators([Counter(3, (64,))] * n, transport=transport, timeout=60) as pipe:
                print("batches", sum(1 for _ in pipe), "descriptors", len(os.listdir("/proc/self/fd")))
        except shmpipe.DescriptorLimitError as exc:
            children = [p for p in os.listdir("/proc") if p.isdigit() and parent_of(p) == str(os.getpid())]
            print("refused", exc.limit, exc.needed, len(children), exc, sep="|")
    """
)


def _run(limit: int, producers: int, cwd: str, transport: str = "shm") -> subprocess.CompletedProcess:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    # Run away from the checkout: with -c, ./ comes first on sys.path, and
    # ./shmpipe there is the source, not the installed package.
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(producers), transport], capture_output=True, text=True, timeout=120,
        preexec_fn=lower, cwd=cwd,
    )


def test_sixteen_producers_run_under_ulimit_64(tmp_path):
    out = _run(64, 16, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    assert words[:2] == ["batches", "48"], out.stdout
    assert int(words[3]) <= 64


@pytest.mark.parametrize(("limit", "producers", "transport"), [(40, 16, "shm"), (64, 16, "queue"), (64, 20, "arrow")])
def test_a_pipeline_that_cannot_fit_is_refused_before_any_producer_starts(tmp_path, limit, producers, transport):
    out = _run(limit, producers, str(tmp_path), transport)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("refused|"), out.stdout + out.stderr[-2000:]
    _, said_limit, needed, children, message = out.stdout.strip().split("|", 4)
    assert int(said_limit) == limit and int(needed) > limit
    assert children == "0", "no producer was started"
    assert f"this pipeline of {producers} producers needs about {needed} file descriptors" in message
    assert f"its limit (ulimit -n) is {limit}" in message and "ulimit -n 1024" in message
    assert f"the hard limit is {limit}" in message and "or start fewer producers" in message


KEPT = textwrap.dedent(
    """
    import json, multiprocessing.process, os, sys
    import shmpipe
    from shmpipe.testing.sources import Counter

    def descriptors():
        found = set()
        for name in os.listdir("/proc/self/fd"):
            try:
                found.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
            except OSError:  # the listing's own, closed by now
                pass
        return found

    def one_pipeline():
        with shmpipe.from_iterators([Counter(3, (64,))] * 2, start_method=sys.argv[1], timeout=60) as pipe:
            assert sum(1 for _ in pipe) == 6
        return pipe

    if __name__ == "__main__":
        kept = [one_pipeline()]  # starts what serves the process's life (fork server, resource tracker)
        before = descriptors()
        kept += [one_pipeline() for _ in range(3)]
        ours = {id(p) for pipe in kept for p in pipe._launcher.children()}
        print(json.dumps({
            "new": sorted(descriptors() - before),
            "children_kept": sum(id(p) in ours for p in multiprocessing.process._children),
        }))
    """
)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_a_closed_pipeline_holds_no_descriptor_while_it_is_kept(tmp_path, start_method):
    # multiprocessing keeps a sentinel per process (with fork, a pipe more)
    # until the process object goes: a job that keeps its closed pipelines
    # (a list of the epochs' loaders) would run out of descriptors. (In a
    # fresh interpreter: the suite's own process opens files meanwhile.)
    import json

    out = subprocess.run(
        [sys.executable, "-c", KEPT, start_method], capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"new": [], "children_kept": 0}, got
