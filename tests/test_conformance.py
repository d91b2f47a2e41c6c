"""Every built-in transport, and the example plugin (found through its real
entry point), against shmpipe.testing.conformance."""

from __future__ import annotations

import importlib.metadata

import pytest
from conftest import ray_friendly_cwd

from shmpipe import registry
from shmpipe.testing.conformance import TransportConformance


class TestShm(TransportConformance):
    @pytest.fixture
    def transport(self):
        return "shm"


class TestArrow(TransportConformance):
    @pytest.fixture
    def transport(self):
        return "arrow"


class TestQueue(TransportConformance):
    @pytest.fixture
    def transport(self):
        return "queue"


class TestRay(TransportConformance):
    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def ray_running(cls, tmp_path_factory):
        # One local Ray for the class: the transport uses a running Ray as
        # it finds it (starting and stopping one is tested on its own).
        import ray

        with ray_friendly_cwd(tmp_path_factory.mktemp("ray")):
            ray.init(num_cpus=4, object_store_memory=400 << 20, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()

    @pytest.fixture
    def transport(self):
        from shmpipe.transports.ray import RayTransport

        return RayTransport()


class TestExamplePlugin(TransportConformance):
    """examples/pipe-transport, installed as a package (the README's test
    command installs it): found through the entry point, never registered
    by hand."""

    @pytest.fixture
    def transport(self):
        return "example-pipe"

    def test_it_comes_from_its_entry_point(self):
        eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)}
        assert "example-pipe" in eps, "install examples/pipe-transport (see README)"
        assert "example-pipe" not in registry._registered
        assert "example-pipe" in registry.available_transports()
        cls = registry.get_transport("example-pipe")
        assert cls.__module__ == "shmpipe_example_pipe" and cls.name == "example-pipe"


STUCK = '''
import pytest

from shmpipe.testing.conformance import TransportConformance
from shmpipe.testing.sources import Counter


class TestStuck(TransportConformance):
    test_deadline = 2.0

    @pytest.fixture
    def transport(self):
        return "shm"

    def test_a_wait_without_end(self, transport):
        with self.pipe(transport, [Counter(1, delay=600)], timeout=None) as pipe:
            next(iter(pipe))
'''


def test_a_suite_run_without_pytest_timeout_still_ends_a_hung_test(tmp_path):
    # A plugin author's run may have no pytest-timeout (helper 87: a transport
    # whose get ignored its wait hung the whole run): the suite's own deadline
    # fails the test, says why, and the pipeline's close ends its producer.
    import subprocess
    import sys
    import time

    (tmp_path / "test_stuck.py").write_text(STUCK)
    t = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:timeout", "-p", "no:cacheprovider", "-q",
                          "-k", "wait_without_end", "test_stuck.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed" in run.stdout and "ran past TransportConformance.test_deadline (2 s)" in run.stdout, run.stdout
    assert took < 60, f"the run took {took:.0f} s"
