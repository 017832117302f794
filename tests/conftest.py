"""What the test modules share: the local Ray fixture and the ``ray`` marker.

A module that needs a Ray instance says so with
``pytestmark = pytest.mark.usefixtures("local_ray")``: one instance per module,
started with ``address="local"`` (another Ray may run on this machine) and
shut down after the module. Every test that runs Ray — through this fixture,
a fake cluster (``cluster`` marker), or its own (``pytestmark =
pytest.mark.ray``) — carries the ``ray`` marker, so ``make test-core``
(``-m "not ray"``) is the fast, Ray-free suite for the inner loop.
"""
from __future__ import annotations

import pytest
import ray


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance of the using module's own (2 CPUs, no dashboard)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "local_ray" in item.fixturenames or item.get_closest_marker("cluster") is not None:
            item.add_marker(pytest.mark.ray)


def pytest_sessionfinish(session, exitstatus):
    # Modules that start Ray themselves may leave it running. Shut it down
    # here, not in the interpreter's exit handlers: the whole suite's pytest
    # process once died there with a segmentation fault after every test had
    # run (Ray's core worker torn down beside torch's threads).
    if ray.is_initialized():
        ray.shutdown()
