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

import os
import sys

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


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    # Modules that start Ray themselves may leave it running: shut it down
    # while the interpreter is whole.
    if ray.is_initialized():
        ray.shutdown()
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # After the last report is written, leave without the interpreter's
    # teardown. Twice, a full run's pytest process died there with SIGSEGV
    # after every test had passed or failed and the summary was printed: the
    # kernel log showed a non-main thread jumping into freed memory (a native
    # callback outliving the Python objects it called, torch's or Ray's), which
    # turned the run's own exit status into make's "Segmentation fault". The
    # status exited with is pytest's own.
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
